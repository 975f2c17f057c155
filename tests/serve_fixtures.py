"""A tiny checkpoint on disk for the server tests: a random Llama and a byte-level BPE tokenizer trained here.

Byte-level BPE so that generated text has characters split over several tokens and bytes that are no character
(the incremental detokenizer must get both right); saved with `save_pretrained` so that the server loads it the way
`hf-accel serve` does.
"""

from __future__ import annotations

import asyncio
import socket
import threading
from pathlib import Path
from types import SimpleNamespace

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A café in Zürich serves crème brûlée and naïve jalapeño dishes.",
    "Привет, мир! こんにちは世界 你好，世界 🙂🚀",
    "hello world, hello there, the end of the story is near.",
    "Once upon a time there was a small model that wrote text one token at a time.",
]
SPECIALS = ["<pad>", "<s>", "</s>"]
CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{{ eos_token }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")


def make_tokenizer() -> PreTrainedTokenizerFast:
    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=SPECIALS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator(CORPUS * 4, trainer=trainer)
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
                                  clean_up_tokenization_spaces=False)
    tok.chat_template = CHAT_TEMPLATE
    return tok


def save_checkpoint(path: Path, *, seed: int = 0) -> Path:
    """Write a tiny float32 Llama and its tokenizer to `path` (as from_pretrained reads them)."""
    tok = make_tokenizer()
    torch.manual_seed(seed)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=len(tok), max_position_embeddings=256,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    model = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # EOS wins wherever token 293 would: some greedy outputs end on EOS, others run on
        model.lm_head.weight[tok.eos_token_id] = model.lm_head.weight[293] * 1.05
    model.save_pretrained(path)
    tok.save_pretrained(path)
    return path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ScriptedStream:
    """A stand-in for `GenerationStream` whose deltas a test scripts (see `ScriptedModel`)."""

    def __init__(self, model: ScriptedModel, n: int) -> None:
        self.model, self.n = model, n
        self.aborted: set[int] = set()
        self.closed = False
        self._pending: list | None = None

    def abort(self, sequence: int | None = None) -> None:
        self.aborted.update(range(self.n) if sequence is None else [sequence])

    def __aiter__(self) -> ScriptedStream:
        return self

    async def __anext__(self):
        from hf_accel import GenerationDelta

        if self._pending is None:
            if self.model.mode == "hold":  # until the test releases it, or it is aborted
                while not self.model.release.is_set() and len(self.aborted) < self.n:
                    await asyncio.sleep(0.005)
            elif self.model.mode == "fail":
                raise RuntimeError("the engine broke down")
            self._pending = []
            for i in range(self.n):  # every delta at once: the server must send one chunk per choice
                if i in self.aborted:
                    self._pending.append(GenerationDelta(i, [], "abort"))
                    continue
                self._pending += [GenerationDelta(i, [t]) for t in self.model.token_ids]
                self._pending.append(GenerationDelta(i, [], "length"))
        if not self._pending:
            raise StopAsyncIteration
        return self._pending.pop(0)

    async def aclose(self) -> None:
        self.closed = True
        self.abort()


class ScriptedModel(torch.nn.Module):
    """An "accelerated model" whose `agenerate_stream` follows a script: for the server's paths that a real engine
    does not reach on demand (requests that stay in flight, engine errors, many deltas waiting at once)."""

    def __init__(self, tokenizer: PreTrainedTokenizerFast, text: str = "hello world") -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.config = SimpleNamespace(vocab_size=len(tokenizer), max_position_embeddings=256)
        self.generation_config = SimpleNamespace(eos_token_id=tokenizer.eos_token_id,
                                                 pad_token_id=tokenizer.pad_token_id)
        self.token_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        self.mode = "burst"  # "burst": all deltas at once; "hold": wait for `release`; "fail"; "raise"
        self.release = threading.Event()
        self.streams: list[ScriptedStream] = []

    def agenerate_stream(self, input_ids: torch.Tensor, *, seed: int | None = None, **kwargs) -> ScriptedStream:
        if self.mode == "raise":
            raise RuntimeError("unexpected failure at submission")
        stream = ScriptedStream(self, kwargs.get("num_return_sequences", 1))
        self.streams.append(stream)
        return stream
