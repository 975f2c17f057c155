"""LLMEngine: requests in, tokens out. Owns the KV cache, block manager, scheduler, runner and sampler.

Not thread-safe by itself, on purpose: one engine thread per model (`engine/loop.py`, whose docstring says what runs
on which thread) is the only one that steps it, adds and aborts requests; callers on any thread reach it through
that loop. `check_request` alone may be called from anywhere (it reads nothing that changes).
"""

from __future__ import annotations

import gc
import itertools
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from hf_accel.attention.backend import AttentionBackend, AttentionSpec, KVLayout
from hf_accel.config import AccelConfig, CUDAGraphMode, large_piecewise_sizes
from hf_accel.engine.block_manager import BlockManager
from hf_accel.engine.kv_cache import allocate_kv_cache, bytes_per_block
from hf_accel.engine.model_state import prefix_key, take_snapshot
from hf_accel.engine.request import Request, RequestStatus
from hf_accel.engine.runner import ModelRunner, engine_forward
from hf_accel.engine.sampler import Sampler
from hf_accel.engine.scheduler import Scheduler
from hf_accel.engine.tensor_parallel import TensorParallel, local_heads, tensor_parallel_of
from hf_accel.ops import pdl
from hf_accel.patches import family_patch

if TYPE_CHECKING:
    from hf_accel.engine.tp_driver import LeaderDriver

logger = logging.getLogger(__name__)

CPU_KV_CACHE_BYTES = 1 << 30  # default KV budget on CPU when num_kv_blocks is not given
GPU_GRAPH_RESERVE_BYTES = 1 << 30  # kept free for the CUDA graph pool and compile workspace before sizing the cache


@dataclass
class ModelShape:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_model_len: int
    vocab_size: int
    # what limits max_model_len, for error messages (a family's `context_limit` may lower it below the config's)
    context_limit_reason: str = "the model's max_position_embeddings"
    max_step_tokens: int | None = None  # a family's cap on one step's packed tokens (`step_token_limit`)

    @classmethod
    def from_config(cls, config, tp: TensorParallel | None = None) -> ModelShape:
        """The attention shape one rank runs: with tensor parallel `tp`, its own share of the heads."""
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        heads = text.num_attention_heads
        patch = family_patch(getattr(text, "model_type", ""))
        head_dim = patch.attention_head_dim(text)
        num_heads, num_kv_heads = local_heads(heads, getattr(text, "num_key_value_heads", None) or heads, tp)
        max_len = getattr(text, "max_position_embeddings", None) or 2048
        reason = "the model's max_position_embeddings"
        limit = patch.context_limit(text)
        if limit is not None and limit[0] < max_len:
            max_len, reason = limit[0], f"the context hf_accel serves for this model: {limit[1]}"
        step = patch.step_token_limit(text)
        return cls(
            num_layers=text.num_hidden_layers, num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
            max_model_len=max_len, vocab_size=text.vocab_size, context_limit_reason=reason,
            max_step_tokens=step[0] if step is not None else None,
        )


@dataclass
class _InFlight:
    """A launched step: the requests that sample, their tokens on the device and, when asynchronous, the pinned
    host copy and the event that says it has arrived."""

    sampled: list[Request]
    inputs_ready: torch.cuda.Event | None = None
    tokens: torch.Tensor | None = None
    packed: torch.Tensor | None = None  # tokens, then the sampler's invalid-row flags where any row sampled
    rows: dict[int, int] = field(default_factory=dict)  # id(request) -> its row in tokens
    host_tokens: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    scores: torch.Tensor | None = None
    logits: torch.Tensor | None = None


@dataclass
class EngineStats:
    steps: int = 0
    preemptions: int = 0
    async_steps: int = 0  # steps launched before the previous step's tokens were read back
    timings: dict[str, float] = field(default_factory=dict)


def matmul_parameters(model: torch.nn.Module) -> int:
    """About the parameters a token's forward multiplies by: all but the input embedding and the LM head (which
    computes logits only for the sampled positions), each tensor counted once (tied weights). An estimate: a
    mixture-of-experts model counts every expert (fewer large graphs than its active share would give), a quantized
    checkpoint's packed weights their stored elements (more). Either way only which steps get graphs changes."""
    skip = set()
    for get in ("get_input_embeddings", "get_output_embeddings"):
        try:
            module = getattr(model, get)()
        except (AttributeError, NotImplementedError):  # an unusual layout: count those weights too (fewer graphs)
            module = None
        if isinstance(module, torch.nn.Module):
            skip.update(id(p) for p in module.parameters())
    seen, total = set(), 0
    for p in model.parameters():
        if id(p) not in skip and id(p) not in seen:
            seen.add(id(p))
            total += p.numel()
    return total


class LLMEngine:
    def __init__(self, model: torch.nn.Module, cfg: AccelConfig, backend_cls: type[AttentionBackend],
                 spec: AttentionSpec, progress=None) -> None:
        """`progress`: a `hf_accel.progress.StartupProgress` told when each startup phase begins (optional)."""
        self.model = model
        self.cfg = cfg
        self.device = next(model.parameters()).device
        self.tp = tensor_parallel_of(model)  # None unless transformers sharded the model (tp_plan under torchrun)
        # rank 0 of a tensor-parallel model being served: hands its schedule to the other ranks (engine/tp_driver.py)
        self.driver: LeaderDriver | None = None
        self.shape = ModelShape.from_config(model.config, self.tp)
        if backend_cls.kv_layout != KVLayout.NHD:
            layout = getattr(backend_cls.kv_layout, "value", backend_cls.kv_layout)
            raise NotImplementedError(f"the {backend_cls.name} backend reads a {layout} KV cache; "
                                      "the engine allocates NHD caches only (kv_cache.allocate_kv_cache)")
        self.block_size = cfg.block_size or backend_cls.supported_block_sizes[0]
        if self.block_size not in backend_cls.supported_block_sizes:
            raise ValueError(f"block_size {self.block_size} is not supported by the {backend_cls.name} backend "
                             f"(supports {backend_cls.supported_block_sizes})")
        self.max_blocks_per_seq = -(-self.shape.max_model_len // self.block_size)
        self.max_num_batched_tokens = cfg.max_num_batched_tokens
        if self.shape.max_step_tokens is not None and self.shape.max_step_tokens < cfg.max_num_batched_tokens:
            logger.info("hf_accel: at most %d tokens per step for this model (%s)", self.shape.max_step_tokens,
                        type(model).__name__)
            self.max_num_batched_tokens = self.shape.max_step_tokens
        self.max_num_tokens = max(self.max_num_batched_tokens, max(cfg.cudagraph_capture_sizes or [1]))
        self.stats = EngineStats()
        t0 = time.perf_counter()
        if progress is not None:
            progress.phase("allocate the KV cache", backend_cls.name)
        self.backend = backend_cls(spec, self.device, self.block_size, cfg.max_num_seqs, self.max_num_tokens,
                                   self.max_blocks_per_seq)
        num_blocks = cfg.num_kv_blocks or self._auto_num_blocks(spec.dtype)
        if self.tp is not None:  # every rank's block manager must make the same decisions
            num_blocks = self.tp.min_int(num_blocks)
        self.kv_caches = allocate_kv_cache(self.shape.num_layers, num_blocks, self.block_size,
                                           self.shape.num_kv_heads, self.shape.head_dim, spec.dtype, self.device)
        self.num_kv_blocks = num_blocks
        self.kv_cache_bytes = num_blocks * bytes_per_block(self.shape.num_layers, self.block_size,
                                                           self.shape.num_kv_heads, self.shape.head_dim, spec.dtype)
        self.block_manager = BlockManager(num_blocks, self.block_size, cfg.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, cfg.max_num_seqs, self.max_num_batched_tokens)
        self.runner = ModelRunner(model, self.backend, self.kv_caches, self.block_size, cfg.max_num_seqs,
                                  self.max_num_tokens, self.max_blocks_per_seq, self.shape.max_model_len,
                                  fused_split_reductions=cfg.fused_split_reductions,
                                  graph_greedy_argmax=cfg.graph_greedy_argmax)
        self.sampler = Sampler()
        self.stats.timings["kv_cache_s"] = time.perf_counter() - t0
        self.compile_info: dict = {}
        self.use_pdl = cfg.pdl is not False and pdl.supported(self.device)
        if cfg.pdl and not self.use_pdl:
            logger.info("hf_accel: pdl=True but programmatic dependent launch needs CUDA sm90+ and a triton that "
                        "exposes it; running without")
        self.backend.use_pdl = self.use_pdl
        self.backend.fused_split_reductions = cfg.fused_split_reductions
        self.backend.decode_kernel = cfg.decode_attention_kernel
        self.backend.longest_first = cfg.decode_longest_first
        # a split plan follows the step's query lengths: never for steps captured whole (mode "full" captures mixed
        # steps; piecewise graphs are cut at attention, so their attention may split)
        self.backend.split_mixed = (cfg.split_mixed_attention is not False and self.backend.splits_mixed_steps
                                    and cfg.cudagraph_mode != CUDAGraphMode.FULL)
        if cfg.split_mixed_attention and not self.backend.splits_mixed_steps:
            logger.info("hf_accel: split_mixed_attention=True has no effect here (the %s backend has no split path)",
                        backend_cls.name)
        elif cfg.split_mixed_attention and not self.backend.split_mixed:
            logger.info('hf_accel: split_mixed_attention=True has no effect here (cudagraph_mode="full" captures '
                        "mixed steps whole)")
        mixed_sizes = cfg.piecewise_capture_sizes
        if (cfg._piecewise_sizes_derived and mixed_sizes and cfg.compile
                and cfg.cudagraph_mode == CUDAGraphMode.FULL_AND_PIECEWISE):  # resolved: an enum member
            # derived, not given, and used (beside full decode graphs): add the large steps worth a graph
            mixed_sizes = mixed_sizes + large_piecewise_sizes(max(mixed_sizes), self.max_num_batched_tokens,
                                                              2.0 * matmul_parameters(model))
        if cfg.compile or cfg.cudagraph_mode.value != "none":
            try:
                self.compile_info = self.runner.enable_compilation(
                    cfg.cudagraph_mode, list(cfg.cudagraph_capture_sizes or []), bool(cfg.compile),
                    cfg.compile_cache_dir, model.config, spec.dtype, pdl=self.use_pdl,
                    small_m_gemm=cfg.small_m_gemm, fold_norms=cfg.fold_norms, gated_gemm=cfg.gated_gemm,
                    combo_kernels=cfg.combo_kernels, chain_residual_norms=cfg.chain_residual_norms,
                    progress=progress, tp=self.tp,
                    reuse_traced_graph=cfg.reuse_traced_graph, mixed_capture_sizes=mixed_sizes)
            except BaseException:
                self.kv_caches.clear()  # give the cache's memory back even while the traceback lives on
                if self.device.type == "cuda":
                    torch.cuda.empty_cache()
                raise
            logger.info("hf_accel: compile %.1f s, graph capture %.1f s, graph pool %.2f GiB (mode %s)",
                        self.compile_info["compile_s"], self.compile_info["capture_s"],
                        self.compile_info["graph_pool_bytes"] / 2**30, self.compile_info.get("cudagraph_mode"))
        logger.info("hf_accel: %s attention, %d KV blocks of %d tokens (%.2f GiB)", backend_cls.name, num_blocks,
                    self.block_size, self.kv_cache_bytes / 2**30)
        self._request_ids = itertools.count(1)
        snapshot = take_snapshot(model)
        self._structure = snapshot.structure
        self._engine_key = snapshot.engine
        self._prefix_key: tuple | None = None  # set by sync_with_model() at the first call
        # set by the engine loop before each step: the step may be launched one ahead of the host
        self.allow_async = False
        self._inflight: _InFlight | None = None
        self._hook_errors: list[tuple[Request, BaseException]] = []  # stop checks that raised (see take_hook_errors)

    @property
    def has_frozen_code(self) -> bool:
        """Compiled pieces or CUDA graphs froze the module tree and the parameters' addresses at warm-up."""
        return self.runner.dispatcher is not None

    def sync_with_model(self) -> bool:
        """At the start of a call, engine idle: compare the model with what the engine was built for.

        Returns True when the engine must be rebuilt: the attention implementation was switched or the parameters'
        dtype or device changed, or the structure changed (parameters replaced or added, modules swapped, PEFT
        adapters switched, disabled or merged, forward hooks added) under compiled code. Otherwise drops
        the cached prefixes whenever their key (structure, versions and, by default, weight contents) changed, so
        a prefix is never served with KV computed under other weights or adapters (engine/model_state.py).
        """
        if self.is_busy:
            raise RuntimeError("internal error: sync_with_model() on a busy engine")
        snapshot = take_snapshot(self.model)
        rebuild = snapshot.engine != self._engine_key or (snapshot.structure != self._structure
                                                          and self.has_frozen_code)
        if self.tp is not None:  # what one rank sees (its own shard changed) every rank acts on
            rebuild = self.tp.any(rebuild)
        if rebuild:
            return True
        if snapshot.structure != self._structure:
            self._structure = snapshot.structure
        if self.cfg.enable_prefix_caching:
            key = prefix_key(snapshot, self.cfg.prefix_cache_weight_check)
            changed = key != self._prefix_key
            if self.tp is not None:
                changed = self.tp.any(changed)
            if changed:
                if self._prefix_key is not None and self.block_manager.cached:
                    logger.info("hf_accel: the model's weights or adapters changed; the prefix cache was cleared")
                self.block_manager.forget_prefixes()
                self._prefix_key = key
        return False

    def _auto_num_blocks(self, dtype: torch.dtype) -> int:
        per_block = bytes_per_block(self.shape.num_layers, self.block_size, self.shape.num_kv_heads,
                                    self.shape.head_dim, dtype)
        one_seq = self.max_blocks_per_seq + 1
        if self.device.type != "cuda":
            want = self.max_blocks_per_seq * min(self.cfg.max_num_seqs, 64) + 1
            return max(one_seq, min(want, CPU_KV_CACHE_BYTES // per_block))
        torch.cuda.synchronize(self.device)
        # memory the caching allocator holds but no tensor uses (a model quantized in place on the GPU leaves its
        # bf16 weights' blocks there) is free for the KV pool, not "used": hand it back before reading the driver
        gc.collect()
        torch.cuda.empty_cache()
        free, total = torch.cuda.mem_get_info(self.device)
        peak_activation = self._profile_activation_bytes()
        used = total - free
        budget = total * self.cfg.gpu_memory_utilization - used - peak_activation - GPU_GRAPH_RESERVE_BYTES
        blocks = int(budget // per_block)
        if blocks < one_seq:
            raise RuntimeError(f"not enough GPU memory for the KV cache: {blocks} blocks fit, one sequence of "
                               f"max_position_embeddings needs {one_seq} (GPU memory in use {used / 2**30:.1f} GiB, "
                               f"of which this process's tensors {torch.cuda.memory_allocated(self.device) / 2**30:.1f}"
                               f" GiB; peak activations {peak_activation / 2**30:.1f} GiB); lower "
                               f"max_num_batched_tokens or raise gpu_memory_utilization")
        return blocks

    def _profile_activation_bytes(self) -> int:
        """Peak activation memory of one forward at the full token budget (dummy single sequence)."""
        from hf_accel.attention.context import ForwardContext, forward_context
        from hf_accel.attention.metadata import StepMetadata

        t = min(self.max_num_batched_tokens, self.shape.max_model_len)
        nblk = -(-t // self.block_size) + 1
        caches = allocate_kv_cache(self.shape.num_layers, nblk, self.block_size, self.shape.num_kv_heads,
                                   self.shape.head_dim, next(self.model.parameters()).dtype, self.device)
        dev = self.device
        meta = StepMetadata(
            num_tokens=t, num_seqs=1, max_query_len=t, max_seq_len=t, block_size=self.block_size,
            query_start_loc=torch.tensor([0, t], dtype=torch.int32, device=dev),
            seq_lens=torch.tensor([t], dtype=torch.int32, device=dev),
            context_lens=torch.zeros(1, dtype=torch.int32, device=dev),
            block_tables=torch.arange(1, nblk, dtype=torch.int32, device=dev)[None],
            slot_mapping=torch.arange(self.block_size, self.block_size + t, dtype=torch.int64, device=dev),
            query_lens_cpu=[t], seq_lens_cpu=[t],
        )
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        self.backend.prepare(meta)
        ids = torch.randint(10, 1000, (t,), device=dev) % self.shape.vocab_size
        with torch.inference_mode(), forward_context(ForwardContext(meta, self.backend, caches)):
            engine_forward(self.model, ids[None], torch.arange(t, device=dev)[None], torch.tensor([t - 1], device=dev))
        torch.cuda.synchronize(dev)
        peak = torch.cuda.max_memory_allocated(dev) - before
        del caches
        torch.cuda.empty_cache()
        return int(peak)

    # -- requests ----------------------------------------------------------------------------------------------
    def new_request_id(self) -> int:
        """Unique across caller threads (`next` on an itertools counter is atomic)."""
        return next(self._request_ids)

    def check_request(self, req: Request) -> None:
        """Raise if the request can never run here (an empty prompt, more KV blocks than the cache has). Reads no
        mutable state, so any thread may call it."""
        if req.num_prompt_tokens == 0:
            raise ValueError("empty prompt: every request needs at least one token")
        self.scheduler.check(req)

    def add_request(self, req: Request) -> None:
        self.check_request(req)
        if self.driver is not None:  # rank 0 of a driven tensor-parallel engine: the other ranks add it too
            self.driver.record_add(req)
        self.scheduler.add(req)

    def abort_request(self, req: Request) -> None:
        """Drop a request that has not finished: out of the queues, its blocks freed. A token of it still in flight
        is dropped when read back."""
        if not req.is_finished:
            if self.driver is not None:
                self.driver.record_abort(req)
            self.scheduler.abort(req)

    @property
    def is_busy(self) -> bool:
        """Requests queued or running, or a step still in flight."""
        return self.scheduler.has_work or self._inflight is not None

    def take_hook_errors(self) -> list[tuple[Request, BaseException]]:
        """The (request, exception) pairs of the request callbacks (logits processors, stop checks) that raised in the
        last step; the engine loop fails their calls."""
        if not self._hook_errors and not self.sampler.hook_errors:  # every step asks: no lists made for nothing
            return []
        errors = self._hook_errors + self.sampler.hook_errors
        self._hook_errors, self.sampler.hook_errors = [], []
        return errors

    def recover(self) -> None:
        """After an exception anywhere in a step: drop every request and what is in flight, and rebuild the block
        state from what is left alive (nothing), so the engine serves the next call with its whole cache."""
        self._inflight = None
        self._hook_errors, self.sampler.hook_errors = [], []
        live = self.scheduler.live_requests()
        try:
            self.scheduler.abort_all()
            for req in live:  # dead now, also one caught between leaving the scheduler and its release
                req.num_pending_tokens = 0
                req.block_ids, req.block_hashes = [], []
        finally:
            # the exception may have landed anywhere in the scheduler or block manager (a block taken off the free
            # list and not yet recorded, a release cut short): rebuild the block state from the requests still alive
            leaked = self.block_manager.reconcile(self.scheduler.live_requests())
            if leaked:
                logger.debug("hf_accel: %d KV blocks recovered after an exception", leaked)

    def step(self) -> list[tuple[Request, int]]:
        """Run one engine step; returns (request, token) for every token the host read back in it.

        Synchronous mode reads the step's own tokens. Asynchronous mode launches the step, then reads the previous
        step's tokens while the GPU computes this one (the previous tokens fed this step from device memory), so
        tokens come back one step late and a request that finished is computed once more and that token dropped.
        """
        caught_up: list[tuple[Request, int]] = []
        if not self.allow_async and self._inflight is not None:
            # a request that needs every token on the host joined: read the step in flight before planning the next
            flight, self._inflight = self._inflight, None
            caught_up = self._read_back(flight)
        sched = self.scheduler.schedule()
        self.stats.preemptions += len(sched.preempted)
        previous, self._inflight = self._inflight, None
        if not sched.requests:
            if previous is None:
                if self.scheduler.has_work and not caught_up:
                    raise RuntimeError("scheduler made no progress (KV cache too small for any waiting request)")
                return caught_up
            return caught_up + self._read_back(previous)
        if previous is not None and previous.inputs_ready is not None:
            previous.inputs_ready.synchronize()  # its host staging buffers are free again (long since, in practice)
        launched = self._launch(sched, previous)
        if not self.allow_async:
            return caught_up + self._read_back(launched)
        self._inflight = launched
        self.stats.async_steps += previous is not None
        return self._read_back(previous) if previous is not None else []

    def _launch(self, sched, previous: _InFlight | None) -> _InFlight:
        """Run the forward and the sampler of one scheduled step; the sampled tokens stay on the device."""
        prev_tokens = previous.tokens if previous is not None else None
        prev_rows = previous.rows if previous is not None else None
        logits, sampled, greedy = self.runner.execute(sched, prev_tokens, prev_rows)
        for req, n in zip(sched.requests, sched.num_tokens):
            req.num_computed_tokens += n
            if not req.num_pending_tokens:  # else its last computed token is still on the device: _read_back commits
                self.block_manager.commit(req)
        self.stats.steps += 1
        flight = _InFlight(sampled=sampled, inputs_ready=self.runner.inputs_ready)
        if not sampled:
            return flight
        tokens, scores = self.sampler(logits, sampled, greedy)
        flight.rows = {id(r): i for i, r in enumerate(sampled)}
        if self.sampler.invalid is not None:  # sampling rows: their validity comes back in the same copy
            packed = torch.cat([tokens, self.sampler.invalid.to(tokens.dtype)])
            tokens = packed[: len(sampled)]
        else:
            packed = tokens
        # tokens may be a full graph's output (its greedy argmax), which the next replay overwrites: they are read
        # only by the copy to the host queued below and by the next step's input copy, queued before its replay
        flight.tokens, flight.packed = tokens, packed
        if self.allow_async and tokens.device.type == "cuda":
            flight.host_tokens = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            flight.host_tokens.copy_(packed, non_blocking=True)
            flight.ready = torch.cuda.Event()
            flight.ready.record()
        if any(r.want_scores or r.want_logits for r in sampled):
            flight.scores, flight.logits = scores, logits.float()
        for req in sampled:
            req.num_pending_tokens += 1
        return flight

    def _read_back(self, flight: _InFlight) -> list[tuple[Request, int]]:
        """Bring a launched step's tokens to the host (its one device-to-host wait), append them, finish requests."""
        if not flight.sampled:
            return []
        if flight.ready is not None:
            flight.ready.synchronize()
            token_list = flight.host_tokens.tolist()
        else:
            token_list = flight.packed.tolist()
        n = len(flight.sampled)
        invalid = token_list[n:]  # the sampler's flags, where any row sampled (else empty)
        out = []
        for i, (req, tok) in enumerate(zip(flight.sampled, token_list[:n])):
            req.num_pending_tokens -= 1
            if req.status == RequestStatus.FINISHED:
                continue  # finished by the token before, while this one was already being computed: dropped
            if invalid and invalid[i]:  # stock's torch.multinomial raises here: the request's call fails with its error
                self._hook_errors.append((req, RuntimeError(
                    "probability tensor contains either `inf`, `nan` or element < 0 (the logits of a sampled "
                    "step, after the logits processors, were NaN, +inf, or all -inf)")))
                self.scheduler.finish(req, "abort")
                continue
            req.output_token_ids.append(tok)
            if req.want_scores:
                req.scores.append(flight.scores[i].detach().clone())
            if req.want_logits:
                req.raw_logits.append(flight.logits[i].detach().clone())
            if req.num_computed_tokens >= req.num_known_tokens:  # it fed a step while pending: commit skipped then
                self.block_manager.commit(req)
            out.append((req, tok))
            reason = None
            if tok in req.eos_token_ids:
                reason = "stop"
            elif len(req.output_token_ids) >= req.max_new_tokens:
                reason = "length"
            elif req.stop_check is not None and self._stop_check(req):
                reason = "stop"
            if reason is not None:
                self.scheduler.finish(req, reason)
        return out

    def _stop_check(self, req: Request) -> bool:
        """The request's stop check; one that raises stops the request and is reported by take_hook_errors()."""
        try:
            return bool(req.stop_check(req))
        except BaseException as exc:  # noqa: BLE001 - the call's own error (even KeyboardInterrupt): its call fails
            self._hook_errors.append((req, exc))
            return True
