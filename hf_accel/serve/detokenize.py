"""Token ids to text while they arrive: incremental detokenization and stop strings.

Decoding the whole sequence again at every step costs O(n^2) over a generation; decoding each new token alone is
wrong for tokenizers whose text for a token depends on its neighbours (SentencePiece drops the leading space of the
first token it decodes; byte-level BPE splits one character's bytes over several tokens). So each step decodes a
short window that starts at the tokens handed out one step earlier: the window's text up to what was already
handed out is decoded as well, and only what follows it is new.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"  # what a decoder makes of bytes that are not (yet) a whole UTF-8 character
_MAX_PENDING = 16  # tokens held back for an incomplete character before the text is handed out anyway


class IncrementalDetokenizer:
    """Text of a growing sequence of token ids, handed out piece by piece with bounded work per token.

    `context_ids` (the end of the prompt) only give the first generated tokens their neighbours; their text is
    never handed out. Text that ends in U+FFFD is held back: the next token may complete the character. After
    `_MAX_PENDING` tokens it is not an incomplete character but bytes that never will be one, and it goes out.
    """

    def __init__(self, tokenizer: Any, *, context_ids: Sequence[int] = (), skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids: list[int] = list(context_ids)
        self._start = 0  # first id of the window decoded at each step
        self._out = len(self._ids)  # ids before this index have had their text handed out (or are context)
        if self._ids and self._decode(self._ids).endswith(_REPLACEMENT):
            self._ids, self._out = [], 0  # context that ends mid-character would garble the first token

    def _decode(self, ids: Sequence[int]) -> str:
        if not ids:
            return ""
        return self._tokenizer.decode(ids, skip_special_tokens=self._skip_special,
                                      clean_up_tokenization_spaces=False)

    def add(self, token_ids: Sequence[int]) -> str:
        """Take new ids; return the text that is now settled (possibly empty)."""
        self._ids.extend(token_ids)
        return self._advance(final=False)

    def flush(self) -> str:
        """The text still held back (at the end of the sequence)."""
        return self._advance(final=True)

    def _advance(self, *, final: bool) -> str:
        if self._out == len(self._ids):
            return ""
        window = self._ids[self._start:]
        full = self._decode(window)
        if not final and full.endswith(_REPLACEMENT) and len(self._ids) - self._out < _MAX_PENDING:
            return ""
        settled = self._decode(self._ids[self._start:self._out])
        new = full[len(settled):] if full.startswith(settled) else full[_common_prefix(settled, full):]
        self._start, self._out = self._out, len(self._ids)
        return new


def _common_prefix(a: str, b: str) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class ChoiceText:
    """The text of one choice: detokenized as tokens come, cut at the first stop string, handed out without any
    text that could still turn out to be the start of a stop string.

    Only the text not handed out yet is kept. A stop string can only begin there: any tail of the text that could
    begin one is held back, so searching the unsent text (not all of it) is enough.
    """

    def __init__(self, tokenizer: Any, *, stop: Sequence[str] = (), context_ids: Sequence[int] = ()) -> None:
        self._detok = IncrementalDetokenizer(tokenizer, context_ids=context_ids)
        self._stop = [s for s in stop if s]
        self._longest_stop = max((len(s) for s in self._stop), default=0)
        self._unsent = ""  # decoded, not handed out yet (cut at a stop string once one is seen)
        self.num_tokens = 0  # tokens that made the text (tokens after a stop string do not count)
        self.stopped = False  # a stop string was seen

    def add(self, token_ids: Sequence[int]) -> bool:
        """Take new token ids; True when a stop string has now been seen (the tokens after it are dropped)."""
        if self.stopped:
            return True
        if not self._stop:
            self.num_tokens += len(token_ids)
            self._unsent += self._detok.add(token_ids)
            return False
        for tid in token_ids:  # one at a time, so that the token count stops where the stop string was seen
            self.num_tokens += 1
            if self._append(self._detok.add([tid])):
                return True
        return False

    def finish(self) -> None:
        """The sequence ended: whatever is held back for incomplete characters is text now."""
        if not self.stopped:
            self._append(self._detok.flush())

    def _append(self, piece: str) -> bool:
        if not piece:
            return False
        searched = max(0, len(self._unsent) - self._longest_stop + 1)  # no stop string ends before this
        self._unsent += piece
        hits = [i for i in (self._unsent.find(s, searched) for s in self._stop) if i >= 0]
        if hits:
            self._unsent = self._unsent[:min(hits)]
            self.stopped = True
        return self.stopped

    def take(self, *, final: bool) -> str:
        """The text not handed out yet, less (unless `final`) a tail that may begin a stop string."""
        keep = 0 if final or self.stopped else self._held_back()
        piece, self._unsent = self._unsent[:len(self._unsent) - keep], self._unsent[len(self._unsent) - keep:]
        return piece

    def _held_back(self) -> int:
        """Length of the longest tail of the unsent text that is a proper prefix of a stop string."""
        best = 0
        for s in self._stop:
            for k in range(min(len(s) - 1, len(self._unsent)), best, -1):
                if self._unsent.endswith(s[:k]):
                    best = k
                    break
        return best
