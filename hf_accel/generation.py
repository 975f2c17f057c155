"""The transformers `generate()` / `generate_batch()` contract, served by the engine.

Stock transformers is the reference for every behaviour here: configuration resolution (kwargs > passed
GenerationConfig > model.generation_config > defaults), `max_length` counting the padded prompt, EOS lists, pad
filling after EOS, min lengths, stop strings, user stopping criteria and logits processors, streamers,
`num_return_sequences` and `return_dict_in_generate`. Left padding is stripped: each row becomes one request
(times `num_return_sequences`). Generation modes the engine does not run take the stock path with one warning.

Decisions where stock behaviour cannot be reproduced row by row (written down in the README too):
- after a row finishes, stock keeps computing it; we do not, so its `scores`/`logits` entries for later steps are
  -inf everywhere except 0 at `pad_token_id` (the token the row is filled with);
- stop strings or stopping criteria on a batch with no EOS token take the stock path (stock keeps generating a
  stopped row, unpadded, until every row has stopped);
- user `logits_processor` and `stopping_criteria` are called per row with that row's token ids as stock would hold
  them (left padding included), shape `[1, L]`; stopping criteria get `scores=None`.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from transformers import GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinLengthLogitsProcessor,
    MinNewTokensLengthLogitsProcessor,
    MinPLogitsWarper,
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)
from transformers.generation.stopping_criteria import (
    EosTokenCriteria,
    MaxLengthCriteria,
    MaxTimeCriteria,
    StopStringCriteria,
)
from transformers.generation.utils import GenerateDecoderOnlyOutput

from hf_accel.engine.loop import CallEvent
from hf_accel.engine.request import Request, SamplingParams

if TYPE_CHECKING:
    from hf_accel.engine.engine import LLMEngine

logger = logging.getLogger(__name__)

# logits processors the batched sampler reproduces exactly; any other one switches that call to the per-row path
_FAST_PROCESSORS = (RepetitionPenaltyLogitsProcessor, MinLengthLogitsProcessor, MinNewTokensLengthLogitsProcessor,
                    TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper, MinPLogitsWarper)
# generate() keyword arguments that the engine understands (besides GenerationConfig fields)
_ENGINE_MODEL_KWARGS = {"attention_mask", "use_cache", "cache_implementation", "position_ids", "token_type_ids"}


def stock_reason(generation_config: GenerationConfig, model_kwargs: dict[str, Any],
                 extra: dict[str, Any]) -> str | None:
    """Why this call must take the stock path, or None if the engine can serve it."""
    gc = generation_config
    if extra.get("assistant_model") is not None or gc.prompt_lookup_num_tokens is not None:
        return "assisted / prompt-lookup decoding"
    if getattr(gc, "assistant_early_exit", None) is not None:
        return "assisted decoding (early exit)"
    if (gc.num_beams or 1) > 1:
        return "beam search"
    if getattr(gc, "penalty_alpha", None) is not None and gc.penalty_alpha > 0:
        return "contrastive search"
    if gc.output_attentions or gc.output_hidden_states:
        return "output_attentions / output_hidden_states"
    if extra.get("prefix_allowed_tokens_fn") is not None:
        return "prefix_allowed_tokens_fn"
    if extra.get("negative_prompt_ids") is not None or (gc.guidance_scale is not None and gc.guidance_scale != 1):
        return "classifier-free guidance"
    if extra.get("synced_gpus"):
        return "synced_gpus"
    if getattr(gc, "dola_layers", None) is not None:
        return "DoLa decoding"
    if getattr(gc, "force_words_ids", None) is not None or getattr(gc, "constraints", None):
        return "constrained generation (force_words_ids / constraints)"
    if getattr(gc, "token_healing", False):
        return "token healing"
    if gc.cache_implementation == "paged":
        return "cache_implementation='paged' (transformers' own continuous batching)"
    replaced = _replaced_criteria(gc, extra.get("stopping_criteria"))
    if replaced:
        return (f"a stopping criterion of a type generate() builds itself ({', '.join(replaced)}): stock uses it "
                "instead of its own, the engine would apply both (pass max_new_tokens, eos_token_id, max_time or "
                "stop_strings instead)")
    rows = extra.get("num_rows", 1) * max(1, gc.num_return_sequences or 1)
    if rows > 1 and not eos_ids(gc) and (gc.stop_strings is not None or extra.get("stopping_criteria")):
        # without an EOS token stock generate() does not pad a row that met its stop criterion: the row keeps
        # generating real tokens until every row has stopped
        return "stop strings / stopping criteria with no EOS token in a batch"
    try:  # any mode transformers itself would not run as plain greedy search or sampling
        mode = gc.get_generation_mode()
    except Exception:  # let stock generate() raise its own error for an invalid combination
        return "a generation mode stock transformers must validate"
    if getattr(mode, "name", str(mode)).upper() not in ("GREEDY_SEARCH", "SAMPLE"):
        return f"generation mode {getattr(mode, 'name', mode)}"
    for key in model_kwargs:
        if key not in _ENGINE_MODEL_KWARGS and model_kwargs[key] is not None:
            return f"model input {key!r}"
    if model_kwargs.get("token_type_ids") is not None:
        return "model input 'token_type_ids'"
    return None


def eos_ids(gc: GenerationConfig) -> list[int]:
    """The config's EOS ids as Python ints: one id or a list, each an int, a numpy integer or a tensor of them (stock
    accepts all of these)."""
    eos = gc.eos_token_id
    if eos is None:
        return []
    if isinstance(eos, torch.Tensor | np.ndarray | np.generic):
        eos = eos.tolist()
    return [int(e) for e in eos] if isinstance(eos, list | tuple | set | frozenset) else [int(eos)]


def pad_and_attention_mask(input_ids: torch.Tensor, gc: GenerationConfig,
                           model_kwargs: dict[str, Any]) -> tuple[int | None, Any]:
    """The pad id (the config's, else its first EOS id) and the attention mask of a generate() call: the one given,
    else the one stock infers (`input_ids != pad` where the pad id occurs in the prompt and is not an EOS id, else
    all ones)."""
    eos = eos_ids(gc)
    pad = gc.pad_token_id if gc.pad_token_id is not None else (eos[0] if eos else None)
    if isinstance(pad, torch.Tensor):
        pad = int(pad.item())
    attention_mask = model_kwargs.get("attention_mask")
    if attention_mask is None:
        if pad is not None and (input_ids == pad).any() and pad not in eos:
            attention_mask = input_ids.ne(pad).long()
        else:
            attention_mask = torch.ones_like(input_ids)
    return pad, attention_mask


def padding_reason(input_ids: torch.Tensor, attention_mask: Any) -> str | None:
    """Why a generate() call's padding sends it stock: a row whose attention mask (`pad_and_attention_mask`'s) has
    a 0 after a 1 (right padding, or masked tokens inside a prompt). The engine runs each row's unmasked tokens as
    one prompt and continues from its last real token; stock also computes the masked positions and continues from
    the row's last position, whatever the mask says there, so its tokens differ (it warns about right padding
    itself). Left padding is the layout both compute alike. Malformed input is left to `prepare_generate`'s
    errors."""
    if (input_ids.ndim != 2 or input_ids.shape[1] < 2 or not isinstance(attention_mask, torch.Tensor)
            or attention_mask.shape != input_ids.shape):
        return None
    kept = attention_mask.bool()
    if bool((kept[:, :-1] & ~kept[:, 1:]).any()):
        return ("right padding, or masked tokens inside a prompt (an attention_mask with a 0 after a 1; "
                "stock continues from each row's last position, pad or not: use left padding)")
    return None


def _replaced_criteria(gc: GenerationConfig, criteria) -> list[str]:
    """The classes of the user's stopping criteria that replace one stock generate() builds for this call: stock
    (`_merge_criteria_processor_list`) keeps a user criterion of the same class as one of its own in place of its
    own (a MaxLengthCriteria of 20 tokens lifts max_new_tokens=4), while the engine enforces the config's limits
    itself and checks the user's criteria on top. Stock builds a MaxLengthCriteria for every call (max_length is
    always resolved), an EosTokenCriteria when an EOS id is set, a MaxTimeCriteria with max_time, a
    StopStringCriteria with stop_strings."""
    if not criteria:
        return []
    built = [MaxLengthCriteria]
    if eos_ids(gc):
        built.append(EosTokenCriteria)
    if gc.max_time is not None:
        built.append(MaxTimeCriteria)
    if gc.stop_strings is not None:
        built.append(StopStringCriteria)
    return sorted({type(c).__name__ for c in criteria if type(c) in built})


class _StreamFeeder:
    """Feeds a streamer exactly as stock generate() does: one `[B]` tensor per step, pad for finished rows.

    It runs on the caller's thread, from the events the engine loop hands the call (tokens and finishes), and keeps
    its own copy of each row so far: it never reads requests the engine thread is still writing.
    """

    def __init__(self, streamer, num_rows: int, pad_token_id: int) -> None:
        self.streamer = streamer
        self.pad = pad_token_id
        self.tokens: list[list[int]] = [[] for _ in range(num_rows)]
        self.finished = [False] * num_rows
        self.emitted = 0

    def __call__(self, events: list[CallEvent]) -> None:
        for i, tok, reason in events:
            if tok is not None:
                self.tokens[i].append(tok)
            if reason is not None:
                self.finished[i] = True
        while True:
            k = self.emitted
            row = []
            for toks, done in zip(self.tokens, self.finished):
                if len(toks) > k:
                    row.append(toks[k])
                elif done:
                    row.append(self.pad)
                else:
                    return
            if all(len(toks) <= k for toks in self.tokens):
                return
            self.streamer.put(torch.tensor(row, dtype=torch.long))
            self.emitted += 1


@dataclass
class PreparedCall:
    """A generate()/generate_batch() call turned into engine requests, and what the caller does around the run:
    `on_events` (on the caller's thread, as tokens arrive; None when nothing needs them) and `finish` (after the run:
    build the return value exactly as stock does)."""

    requests: list[Request]
    finish: Callable[[], Any]
    on_events: Callable[[list[CallEvent]], None] | None = None
    before: Callable[[], None] | None = None  # just before the requests are submitted (the streamer's prompt)


def call_seed(seed: int | None, do_sample: bool) -> int:
    """The base seed of a call's counter-based sampling noise: from torch's global RNG as stock generate() draws (so
    torch.manual_seed reproduces a call), or from an explicit seed (the async entry points, the server). Greedy calls
    draw nothing, as stock's do not."""
    if seed is not None:
        digest = hashlib.blake2b(int(seed).to_bytes(16, "little", signed=True), digest_size=8).digest()
        return int.from_bytes(digest, "little") >> 2
    return int(torch.randint(0, 2**62, (1,)).item()) if do_sample else 0


class EngineGenerator:
    """Turns generate()/generate_batch() calls into engine requests and back."""

    def __init__(self, model: torch.nn.Module, engine: LLMEngine) -> None:
        self.model = model
        self.engine = engine

    def _agreed(self, base_seed: int, do_sample: bool) -> int:
        """A sampling call's seed: rank 0's on every rank of a tensor-parallel model (engine/tensor_parallel.py)."""
        tp = getattr(self.engine, "tp", None)
        if tp is None or not do_sample or getattr(self.engine, "driver", None) is not None:
            return base_seed  # (a driven engine's requests carry rank 0's seeds to the other ranks)
        return tp.broadcast_int(base_seed)

    # -- generate() --------------------------------------------------------------------------------------------
    def prepare_generate(self, input_ids: torch.Tensor, generation_config: GenerationConfig,
                         model_kwargs: dict[str, Any], logits_processor: LogitsProcessorList | None, stopping_criteria,
                         streamer, tokenizer=None, has_default_max_length: bool = False,
                         seed: int | None = None) -> PreparedCall:
        """generate(): validate and build the requests (raising for bad input, before anything runs); the returned
        call's `finish()` gives what stock generate() returns."""
        gc = generation_config
        model = self.model
        if input_ids.ndim != 2:
            raise ValueError(f"input_ids must be 2-D [batch, length], got shape {tuple(input_ids.shape)}")
        batch, padded_len = input_ids.shape
        if batch == 0 or padded_len == 0:
            raise ValueError("empty prompt: input_ids has no tokens (generate needs at least one prompt token)")
        device = input_ids.device
        eos = eos_ids(gc)
        pad, attention_mask = pad_and_attention_mask(input_ids, gc, model_kwargs)
        if attention_mask.shape != input_ids.shape:
            raise ValueError(f"attention_mask shape {tuple(attention_mask.shape)} does not match input_ids "
                             f"{tuple(input_ids.shape)}")

        # lengths, as stock generate() counts them (max_length includes the padded prompt)
        if gc.max_new_tokens is not None:
            max_length = gc.max_new_tokens + padded_len
        elif has_default_max_length:  # stock: by default, 20 new tokens, capped at the context
            max_length = gc.max_length + padded_len
            warnings.warn(f"Using the model-agnostic default `max_length` (={gc.max_length}) to control the "
                          "generation length. We recommend setting `max_new_tokens` to control the maximum "
                          "length of the generation.", UserWarning, stacklevel=3)
            max_pos_cfg = getattr(model.config, "max_position_embeddings", None)
            if max_pos_cfg is not None:
                max_length = min(max_length, max_pos_cfg)
        else:
            max_length = gc.max_length
        if padded_len >= max_length:
            raise ValueError(
                f"Input length of input_ids is {padded_len}, but `max_length` is set to {max_length}. This can "
                "lead to unexpected behavior. You should consider increasing `max_length` or, better yet, "
                "setting `max_new_tokens`.")
        max_new = max_length - padded_len
        # as stock _prepare_generated_length: the resolved lengths go into the (per-call copy of the) config, where
        # logits processors read them (ForcedEOS needs max_length), and min_new_tokens replaces min_length
        gc.max_length = max_length
        if gc.min_new_tokens is not None:
            gc.min_length = gc.min_new_tokens + padded_len
        min_new = max((gc.min_length or 0) - padded_len, 0)
        if pad is None and batch > 1:
            pad = 0

        # logits processing: batched fast path unless a processor we do not reproduce is present
        model._prepare_special_tokens(generation_config=gc, kwargs_has_attention_mask=True, device=device)
        user_processors = logits_processor if logits_processor is not None else LogitsProcessorList()

        def build_processors(rows: torch.Tensor, rows_mask: torch.Tensor) -> LogitsProcessorList:
            return model._get_logits_processor(
                generation_config=gc, input_ids_seq_length=padded_len, encoder_input_ids=rows,
                logits_processor=user_processors, device=device,
                model_kwargs={**model_kwargs, "attention_mask": rows_mask})

        processors = build_processors(input_ids, attention_mask)
        slow = any(not isinstance(p, _FAST_PROCESSORS) for p in processors) or bool(logits_processor)
        # transformers >= 5.2x skips each row's left padding in the repetition penalty; older ones penalize it
        rep = next((p for p in processors if isinstance(p, RepetitionPenaltyLogitsProcessor)), None)
        penalize_padding = rep is not None and not isinstance(getattr(rep, "prompt_ignore_length", None),
                                                              torch.Tensor)
        criteria = list(stopping_criteria or [])
        if gc.stop_strings is not None:
            if tokenizer is None:
                raise ValueError("There are one or more stop strings, either in the arguments to `generate` or in "
                                 "the model's generation config, but we could not locate a tokenizer. When "
                                 "generating with stop strings, you must pass the model's tokenizer to the "
                                 "`tokenizer` argument of `generate`.")
            criteria.append(StopStringCriteria(stop_strings=gc.stop_strings, tokenizer=tokenizer))
        if getattr(self.engine, "tp", None) is not None and (
                gc.max_time is not None or any(isinstance(c, MaxTimeCriteria) for c in criteria)):
            raise NotImplementedError("max_time / MaxTimeCriteria is not supported on a tensor-parallel model: each "
                                      "rank's clock would stop the call at a different step, and the ranks' "
                                      "collectives would no longer pair up (stopping criteria must decide from the "
                                      "tokens alone there)")
        deadline = time.monotonic() + gc.max_time if gc.max_time is not None else None

        n_ret = max(1, gc.num_return_sequences or 1)
        base_seed = self._agreed(call_seed(seed, bool(gc.do_sample)), bool(gc.do_sample))
        rows_cpu = input_ids.cpu()
        mask_cpu = attention_mask.cpu().bool()
        requests: list[Request] = []
        max_pos = self.engine.shape.max_model_len
        for b in range(batch):
            prompt = rows_cpu[b][mask_cpu[b]].tolist()
            if not prompt:
                raise ValueError(f"row {b} of the batch is all padding (attention_mask is all zeros): nothing to "
                                 "generate from")
            if len(prompt) + max_new > max_pos:
                raise ValueError(f"row {b}: prompt of {len(prompt)} tokens + {max_new} new tokens exceeds {max_pos} "
                                 f"tokens, {self.engine.shape.context_limit_reason}")
            padded_row = rows_cpu[b].tolist()
            for copy_index in range(n_ret):
                rid = self.engine.new_request_id()
                req = Request(
                    request_id=rid, prompt_token_ids=prompt, max_new_tokens=max_new,
                    sampling=SamplingParams(
                        do_sample=bool(gc.do_sample), temperature=float(gc.temperature or 1.0),
                        top_k=int(gc.top_k or 0), top_p=float(gc.top_p if gc.top_p is not None else 1.0),
                        min_p=float(gc.min_p or 0.0), repetition_penalty=float(gc.repetition_penalty or 1.0),
                        min_new_tokens=min_new, seed=base_seed + 7919 * len(requests)),
                    eos_token_ids=frozenset(eos),
                    want_scores=bool(gc.output_scores and gc.return_dict_in_generate),
                    want_logits=bool(gc.output_logits and gc.return_dict_in_generate),
                    extra_penalty_tokens=tuple(set(padded_row) - set(prompt)) if penalize_padding else (),
                )
                row_of = _row_view(padded_row)
                if slow:  # processors built for each returned sequence alone: some keep per-row state (padding
                    # lengths, a watermark's history), so no two sequences share one (`processors`, built for the
                    # whole batch, serves the only sequence of a one-row call)
                    alone = batch == 1 and copy_index == 0
                    row_processors = processors if alone else build_processors(input_ids[b : b + 1],
                                                                               attention_mask[b : b + 1])
                    req.logits_hook = _processor_hook(row_processors, row_of, device)
                if criteria or deadline is not None:
                    req.stop_check = _stop_hook(criteria, row_of, deadline)
                requests.append(req)

        feeder = before = None
        if streamer is not None:
            feeder = _StreamFeeder(streamer, len(requests), pad if pad is not None else 0)
            # as stock: the prompt first, one row per sequence
            before = lambda: streamer.put(input_ids.repeat_interleave(n_ret, dim=0).cpu())  # noqa: E731

        def finish() -> torch.Tensor | GenerateDecoderOnlyOutput:
            if streamer is not None:
                streamer.end()
            # assemble: the padded prompt row + new tokens, pad after EOS. The new tokens go through one numpy array
            # (a row assignment per request) and one concatenation: a torch slice assignment per row took 4 ms of
            # host time at batch 64 x 256 new tokens (the H200 host), on the call's critical path
            gen_len = max(len(r.output_token_ids) for r in requests)
            generated = np.full((len(requests), gen_len), pad if pad is not None else 0, dtype=np.int64)
            for i, r in enumerate(requests):
                generated[i, : len(r.output_token_ids)] = r.output_token_ids
            out = torch.cat([rows_cpu.repeat_interleave(n_ret, dim=0).long(), torch.from_numpy(generated)], dim=1)
            sequences = out.to(device)
            if not gc.return_dict_in_generate:
                return sequences
            scores = _stack_steps(requests, "scores", gen_len, pad) if gc.output_scores else None
            logits = _stack_steps(requests, "raw_logits", gen_len, pad) if gc.output_logits else None
            return GenerateDecoderOnlyOutput(sequences=sequences, scores=scores, logits=logits)

        return PreparedCall(requests=requests, finish=finish, on_events=feeder, before=before)

    # -- generate_batch() ---------------------------------------------------------------------------------------
    def prepare_generate_batch(self, inputs: list[list[int]], generation_config: GenerationConfig | None,
                               progress_bar: bool, max_new_tokens: int | None) -> PreparedCall:
        """generate_batch(): the requests, a progress bar fed on the caller's thread, and stock's result dict."""
        from tqdm.auto import tqdm
        from transformers.generation.continuous_batching.requests import GenerationOutput, RequestStatus

        # a copy: the special-token tensors prepared below go into it, not into the caller's (or the model's) config
        gc = copy.deepcopy(generation_config if generation_config is not None else self.model.generation_config)
        n_ret = max(1, gc.num_return_sequences or 1)
        max_new = max_new_tokens if max_new_tokens is not None else gc.max_new_tokens
        if max_new is None:
            max_new = gc.max_length or 20
        if max_new <= 0:
            raise ValueError(f"`max_new_tokens` must be greater than 0, but is {max_new}.")
        eos = frozenset(eos_ids(gc))
        base_seed = self._agreed(call_seed(None, bool(gc.do_sample)), bool(gc.do_sample))
        max_pos = self.engine.shape.max_model_len
        device = self.engine.device
        model = self.model
        # the config's other processors (suppress_tokens, bad_words_ids, no_repeat_ngram_size, ...) run per row as
        # in generate(): the batched sampler reproduces only the penalty / min-length / warper family
        model._prepare_special_tokens(generation_config=gc, kwargs_has_attention_mask=True, device=device)

        def row_processors(prompt: list[int]) -> LogitsProcessorList:
            rows = torch.tensor([prompt], dtype=torch.long, device=device)
            row_gc = copy.copy(gc)  # the lengths resolved for this prompt, as generate() resolves them for its batch
            row_gc.max_length = len(prompt) + max_new  # (ForcedEOS reads max_length)
            if gc.min_new_tokens is not None:
                row_gc.min_length = gc.min_new_tokens + len(prompt)
            return model._get_logits_processor(
                generation_config=row_gc, input_ids_seq_length=len(prompt), encoder_input_ids=rows,
                logits_processor=LogitsProcessorList(), device=device,
                model_kwargs={"attention_mask": torch.ones_like(rows)})

        # which processors the config asks for does not depend on the prompt: decided once, built per prompt only
        # when a hook is needed at all
        first = [int(t) for t in inputs[0]] or [0]
        hooked = any(not isinstance(p, _FAST_PROCESSORS) for p in row_processors(first))

        requests, ids = [], []
        for i, prompt in enumerate(inputs):
            prompt = list(map(int, prompt))  # as [int(t) for t in prompt], in half the time (W3: 144k tokens, ~14 ms)
            if not prompt:
                raise ValueError(f"input {i} is an empty prompt")
            if len(prompt) + max_new > max_pos:
                raise ValueError(f"input {i}: prompt of {len(prompt)} tokens + {max_new} new tokens exceeds {max_pos} "
                                 f"tokens, {self.engine.shape.context_limit_reason}")
            # stock naming: input i is "req_i"; its extra copies (num_return_sequences) "req_i__child#k", listed first
            for k in range(n_ret):
                ids.append(f"req_{i}__child#{k}" if k < n_ret - 1 else f"req_{i}")
                requests.append(Request(
                    request_id=self.engine.new_request_id(), prompt_token_ids=prompt, max_new_tokens=max_new,
                    sampling=SamplingParams(
                        do_sample=bool(gc.do_sample), temperature=float(gc.temperature or 1.0),
                        top_k=int(gc.top_k or 0), top_p=float(gc.top_p if gc.top_p is not None else 1.0),
                        min_p=float(gc.min_p or 0.0), repetition_penalty=float(gc.repetition_penalty or 1.0),
                        min_new_tokens=int(gc.min_new_tokens or 0), seed=base_seed + 7919 * len(requests)),
                    eos_token_ids=eos))
                if hooked:
                    requests[-1].logits_hook = _processor_hook(row_processors(prompt), _row_view(prompt), device)
        created = time.perf_counter()
        pbar = tqdm(total=len(requests), disable=not progress_bar, desc=f"Solving {len(requests)} requests",
                    unit="request") if progress_bar else None

        def on_events(events: list[CallEvent]) -> None:
            pbar.update(sum(1 for _, _, reason in events if reason is not None))

        def finish() -> dict:
            done = time.perf_counter()
            if pbar is not None:
                pbar.close()
            return {
                rid: GenerationOutput(request_id=rid, prompt_ids=list(r.prompt_token_ids),
                                      generated_tokens=list(r.output_token_ids), status=RequestStatus.FINISHED,
                                      created_time=created, lifespan=(created, done))
                for rid, r in zip(ids, requests)
            }

        return PreparedCall(requests=requests, finish=finish, on_events=on_events if pbar is not None else None)


def _row_view(padded_row: list[int]) -> Callable[[Request], torch.Tensor]:
    """The row as stock generate() holds it: padded prompt + generated tokens, shape [1, L]."""

    def row(req: Request) -> torch.Tensor:
        return torch.tensor([padded_row + req.output_token_ids], dtype=torch.long)

    return row


def _processor_hook(processors: LogitsProcessorList, row_of, device: torch.device):
    def hook(req: Request, logits: torch.Tensor) -> torch.Tensor:
        return processors(row_of(req).to(device), logits.float().clone())

    return hook


def _stop_hook(criteria: list, row_of, deadline: float | None):
    def check(req: Request) -> bool:
        if deadline is not None and time.monotonic() > deadline:
            return True
        if not criteria:
            return False
        ids = row_of(req)
        return any(bool(torch.as_tensor(c(ids, None)).any()) for c in criteria)

    return check


def _stack_steps(requests: list[Request], attr: str, steps: int, pad: int | None) -> tuple[torch.Tensor, ...]:
    """Per-step `[B, V]` tensors; rows that already finished hold -inf with 0 at the pad token."""
    first = next(getattr(r, attr)[0] for r in requests if getattr(r, attr))
    vocab, dev = first.shape[-1], first.device
    filler = torch.full((vocab,), float("-inf"), device=dev)
    if pad is not None:
        filler[pad] = 0.0
    out = []
    for k in range(steps):
        out.append(torch.stack([getattr(r, attr)[k] if k < len(getattr(r, attr)) else filler for r in requests]))
    return tuple(out)
