"""A request: one prompt's journey through the engine, and the sampling parameters it carries."""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass, field

PENDING_TOKEN = -1  # placeholder id of a token sampled on the device and not read back yet


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling knobs; the sampler batches requests with different values in one step."""

    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    min_new_tokens: int = 0
    seed: int = 0  # counter-based RNG seed: same seed, same tokens, whatever the batch around the request

    @property
    def is_greedy(self) -> bool:
        return not self.do_sample


@dataclass
class Request:
    request_id: int
    prompt_token_ids: list[int]
    max_new_tokens: int
    sampling: SamplingParams = field(default_factory=SamplingParams)
    eos_token_ids: frozenset[int] = frozenset()
    # extra stop check on the full token list (prompt + output); True stops after the token just appended
    stop_check: Callable[[Request], bool] | None = None
    # slow path: HF-style logits processing for this request (row token ids, float32 logits [V]) -> scores [V]
    logits_hook: Callable[[Request, object], object] | None = None
    want_scores: bool = False
    want_logits: bool = False
    # tokens that count for the repetition penalty besides the request's own (the row's left padding, as stock
    # transformers penalizes every id in the padded row)
    extra_penalty_tokens: tuple[int, ...] = ()

    output_token_ids: list[int] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # of those, how many came from the prefix cache at the last admission
    # KV blocks, in order. Only ever appended to, or replaced by a new list (release, reset): the runner's host
    # block table (runner.HostBlockTable) copies only what was appended to a list it has seen
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # prefix-cache hash chain of its full blocks
    # the same chain over the full blocks its tokens filled at its last admission: admission hashes them to look up
    # cached prefixes, and registering the blocks once computed (BlockManager.commit) reuses them
    admitted_block_hashes: list[bytes] = field(default_factory=list, repr=False)
    num_preemptions: int = 0
    # tokens sampled on the device whose values the host has not read yet (asynchronous scheduling): they count in
    # num_tokens, so the scheduler can plan the step that consumes them; the runner feeds them from the device
    num_pending_tokens: int = 0
    finish_reason: str | None = None
    scores: list = field(default_factory=list)  # per generated token, when want_scores
    raw_logits: list = field(default_factory=list)  # per generated token, when want_logits

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        """Prompt plus generated tokens, the pending ones (sampled, not yet read by the host) included."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending_tokens

    @property
    def num_known_tokens(self) -> int:
        """Tokens whose values the host has: the prompt and the generated tokens already read back."""
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_generated(self) -> int:
        """Tokens generated so far, the pending ones included (the sampler's step index, min_new_tokens)."""
        return len(self.output_token_ids) + self.num_pending_tokens

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_at(self, i: int) -> int:
        """Token id at position i; PENDING_TOKEN for a token still on the device."""
        n = len(self.prompt_token_ids)
        if i < n:
            return self.prompt_token_ids[i]
        i -= n
        return self.output_token_ids[i] if i < len(self.output_token_ids) else PENDING_TOKEN

    def known_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids at positions [start, end), all of them known to the host (none pending)."""
        n = len(self.prompt_token_ids)
        if end <= n:
            return self.prompt_token_ids[start:end]
        if start >= n:
            return self.output_token_ids[start - n : end - n]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n]

    @property
    def is_async_safe(self) -> bool:
        """True when sampling this request needs no token values on the host (so steps may run one ahead):
        no repetition penalty, no transformers logits processors, no per-step scores or logits kept."""
        return (self.sampling.repetition_penalty == 1.0 and self.logits_hook is None and not self.want_scores
                and not self.want_logits)

    @property
    def is_finished(self) -> bool:
        return self.status == RequestStatus.FINISHED
