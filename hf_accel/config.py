"""AccelConfig: every knob of accelerate_model() in one validated object, plus device-dependent defaults."""

from __future__ import annotations

import enum
import logging
from dataclasses import dataclass, field, fields, replace

import torch

logger = logging.getLogger("hf_accel")


class CUDAGraphMode(str, enum.Enum):
    NONE = "none"
    PIECEWISE = "piecewise"
    FULL = "full"
    FULL_DECODE_ONLY = "full_decode_only"
    FULL_AND_PIECEWISE = "full_and_piecewise"

    @property
    def has_full(self) -> bool:
        return self in (CUDAGraphMode.FULL, CUDAGraphMode.FULL_DECODE_ONLY, CUDAGraphMode.FULL_AND_PIECEWISE)

    @property
    def has_piecewise(self) -> bool:
        return self in (CUDAGraphMode.PIECEWISE, CUDAGraphMode.FULL_AND_PIECEWISE)


ATTENTION_BACKENDS = ("auto", "torch", "triton", "flashinfer", "flash_attn")


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """vLLM-like: 1, 2, 4, then multiples of 8 up to 2 * max_num_seqs, capped at 512."""
    top = min(2 * max_num_seqs, 512)
    sizes = [s for s in (1, 2, 4) if s <= top] + list(range(8, top + 1, 8))
    return sizes


# relative spacing of the default piecewise sizes above 16 tokens: a mixed step pads at most this share of tokens
MIXED_STEP_PAD = 0.125


def thinned_capture_sizes(sizes: list[int], pad: float = MIXED_STEP_PAD) -> list[int]:
    """The default piecewise capture sizes beside full decode graphs: `sizes` up to 16, then each next size at least
    `1 + pad` times the last one kept, and always the largest (it bounds which steps run as graphs).

    Why: with full graphs for uniform decode batches (the hot path, every size kept), piecewise graphs serve only
    steps that hold a prefill chunk, of which there are far fewer. Every captured size costs 33 piecewise graphs for
    a 32-layer model at every start (2 ms each), so the default list of 67 sizes up to 512 cost about 4.7 s of an
    8B start on an H200; the thinned list (26 sizes) pads a mixed step by at most 12.5 % of its tokens instead of
    8 tokens. Sizes given explicitly (`cudagraph_capture_sizes` or `piecewise_capture_sizes`) are not thinned."""
    kept: list[int] = []
    for size in sorted(set(sizes)):
        if size <= 16 or not kept or size >= kept[-1] * (1.0 + pad):
            kept.append(size)
    if sizes and kept[-1] != max(sizes):
        kept.append(max(sizes))
    return kept


# compute of a step (2 x its tokens x the matmul parameters, in FLOPs) up to which a step with a prefill chunk is
# worth a piecewise graph above the default sizes: about 10-15 ms of a Hopper GPU's dense bf16 matmuls, where the
# ~400 Python launches of an uncaptured step of a 28-32-layer model take ~35 ms of host time on the H200 machine
LARGE_STEP_GRAPH_FLOPS = 8e12


def large_piecewise_sizes(above: int, max_tokens: int, flops_per_token: float,
                          limit: float = LARGE_STEP_GRAPH_FLOPS) -> list[int]:
    """Piecewise capture sizes above the derived ones (`above`, their largest: 512 with the default max_num_seqs, 2 x
    max_num_seqs below that): doubling up to `max_tokens` (the step token budget, always the last size so that a
    full chunked-prefill step pads nothing; a doubling within 12.5 % below it is replaced by it), each kept only
    while a step of that size computes at most `limit` FLOPs.

    Why: a step larger than every captured size runs uncaptured, and for a small model that step is host-bound
    (W2 on qwen3-0.6b: its 8,192-token prefill step took 35 ms of host launches for 17 ms of kernels); as a graph
    it takes its GPU time. For a large model the same step is GPU-bound (llama-3.1-8b: ~150 ms of matmuls), so a
    graph would only hold memory (the pool grows with the largest size: 218 -> 702 MiB for qwen3-0.6b at 8,192).
    Doubling keeps the count small (4 more sizes from 512 to 8,192) and pads a step at most 2x, which, below the
    limit, costs less GPU time than the launches it saves."""
    if max_tokens <= above or flops_per_token <= 0:
        return []
    sizes = []
    size = above * 2
    while size < max_tokens and size * flops_per_token <= limit:
        sizes.append(size)
        size *= 2
    if size >= max_tokens and max_tokens * flops_per_token <= limit:
        if sizes and max_tokens <= sizes[-1] * (1.0 + MIXED_STEP_PAD):
            sizes.pop()  # e.g. 1024 and a budget of 1025: one size, the budget, instead of two captures
        sizes.append(max_tokens)
    return sizes


@dataclass
class AccelConfig:
    attention_backend: str = "auto"
    cudagraph_mode: str | CUDAGraphMode | None = None
    cudagraph_capture_sizes: list[int] | None = None
    # token counts captured as piecewise graphs where full graphs serve decode (steps with a prefill chunk); None:
    # `cudagraph_capture_sizes` when given, else the default sizes thinned to 12.5 % spacing (thinned_capture_sizes)
    # and, for a model small enough that such steps are host-bound, doubling sizes up to max_num_batched_tokens
    # (large_piecewise_sizes; the engine adds them, knowing the model). Where no full graphs run
    # (cudagraph_mode="piecewise", or a backend without them) every capture size is used
    piecewise_capture_sizes: list[int] | None = None
    compile: bool | None = None
    enforce_eager: bool = False
    block_size: int | None = None
    num_kv_blocks: int | None = None
    gpu_memory_utilization: float = 0.9
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    enable_prefix_caching: bool = True
    compile_cache_dir: str | None = None  # None: ~/.cache/hf_accel; "" disables the on-disk compile cache
    # attention_backend="auto" on CUDA: time the valid backends on this model's shapes at warm-up (about a second
    # each, plus any first-use JIT of a library) and keep the fastest; False takes the static preference order
    autotune_attention: bool = True
    # launch each step before the host has read the previous step's tokens (they feed it from device memory), so
    # scheduling and input packing overlap the GPU; requests whose sampling needs the tokens on the host
    # (repetition penalty, logits processors, output_scores/logits) run synchronously whatever this says
    async_scheduling: bool = True
    # what a cached prefix's key covers besides the structure and adapters (engine/model_state.py): "content" reads
    # every weight's bits at the start of each call on an idle engine (catches edits through `.data` and PEFT merges);
    # "version" trusts in-place version counters only (free; blind to `.data` writes)
    prefix_cache_weight_check: str = "content"
    # decode-speed switches (each one flag, for A/B): programmatic dependent launch for our Triton kernels and
    # Inductor's (None: on where supported, i.e. CUDA sm90+ with a triton that exposes it; False: off); the small-M
    # GEMM for decode linears, used per weight shape and row count only where it beat cuBLAS at warm-up
    pdl: bool | None = None
    small_m_gemm: bool = True
    # split-KV decode attention and split-K small-M GEMMs sum their partial results in the launch that made them
    # (the last program to finish a group does it) instead of in a second kernel: one launch less per layer each.
    # The small-M GEMM's tuning times the fused form either way, so False keeps the tile choices (an A/B of the
    # reduction alone)
    fused_split_reductions: bool = True
    # the Triton backend runs every uniform decode step (one query token per sequence) through its decode kernel:
    # one program per (sequence, KV head) found by index, not by searching the batch, writing the new K/V and the
    # output itself; split over more programs where the batch alone would leave SMs idle. False: decode batches too
    # wide to split run the unified kernel, as before this option (the A/B)
    decode_attention_kernel: bool = True
    # the decode kernel's unsplit launches (wide decode batches) take their sequences longest context first: the
    # GPU runs such a launch in several waves of programs, and in batch order a long context could start in the last
    # wave and run alone while the other SMs idle (W3: 256 contexts of 356-1,536 tokens). The host sorts the step's
    # lengths (it knows them) and copies the order with the step. False: batch order, as before (the A/B)
    decode_longest_first: bool = True
    # a mixed step's attention (prefill chunks beside decodes, attention outside any full CUDA graph) in two launches:
    # its leading decode rows, where the scheduler puts running decodes, through the decode kernel and the rest
    # through the unified kernel, whose prefill tile gives each decode row a 64-token program. Triton backend only;
    # at least 16 leading decode rows; never when cudagraph_mode="full" captures mixed steps whole. None (default):
    # on where it applies; True: the same, and an info log where it has no effect; False: one launch, as before (the
    # A/B). On an H100 (session 28, examples/results) it took W3's 18 prefill-chunk steps from 530 to 498 ms
    split_mixed_attention: bool | None = None
    # every full decode CUDA graph ends with the greedy argmax of its logits (one Triton launch, ops/greedy.py); the
    # sampler takes those tokens when every request of the step is plain greedy, and computes its own otherwise.
    # False: the sampler's torch.argmax after the graph, as before this option (the A/B)
    graph_greedy_argmax: bool = True
    # with small_m_gemm: a Llama-style RMSNorm (and the residual add before it) whose result feeds one linear is one op
    # with that linear (compilation/norm_folding.py); at one row, where the linear's tuned kernel is the one-row
    # GEMM, the norm runs inside it and its own kernel is gone (two per layer at batch 1); other steps run the add and
    # the norm as one kernel of ours. Both round as the eager module does (Inductor's kernel keeps the normalized row
    # in float32 before the weight). False: the norm and the add stay in Inductor's kernels, as before (the A/B)
    fold_norms: bool = True
    # with small_m_gemm: a gated SiLU MLP's packed gate/up linear and the `silu(gate) * up` after it are one op
    # (compilation/gated_activation.py); for row counts where warm-up timed it faster, the small-M GEMM applies the
    # gate in its epilogue and the activation's kernel is gone (one per layer); elsewhere the op runs the linear and
    # one SiLU-and-mul kernel of ours, rounding as the stock MLP does. On by default: every workload measured gained
    # or held within noise with it (same H100 lease, fixed reduction configurations, against False): qwen3-0.6b W1 1,044
    # against 1,009 tok/s, W2 31,841 against 31,976, W3 25,125 against 24,799; llama-3.2-1b W1 841 against 826;
    # llama-3.1-8b W1 178 against 178, W2 8,180 against 8,137 (examples/results, session 31). Its earlier W3 loss on
    # the H200 (29,296 against 30,613) was Inductor's q-norm + RoPE kernel keeping a slow launch configuration from
    # its first-launch timing, not the gated op (compilation/piecewise.fixed_reduction_settings). False: the linear
    # and Inductor's fused activation, as before (the A/B)
    gated_gemm: bool = True
    # Inductor's combo kernels (horizontal fusion) in the compiled pieces, on the GPU (Inductor combines no CPU
    # kernels): kernels of a piece that do not depend on each other go out as one launch, up to eight at a time,
    # e.g. Qwen3's q-norm + RoPE and k-norm + RoPE (one kernel fewer per layer). The kernels of one launch share
    # its launch configuration, so a reduction may round its last bits otherwise than on its own.
    # On by default since session 35, when the compile-path GPU suite (test_gpu_ab, test_compilation,
    # test_trace_cache, test_gpu_training) ran with it. On one H100 lease (session 32, examples/results): qwen3-0.6b
    # W2 31,668 against 30,998 tok/s (ranges apart), W1 1,024 against 998 (noisy runs), W3 24,336 against 24,412
    # (within noise). False: Inductor's separate launches (the A/B)
    combo_kernels: bool = True
    # with fold_norms: the linear whose output a folded norm's residual add takes (o_proj, down_proj) joins that op
    # (ops/residual_chain.py). At 2-64 rows, where both linears' tuned decisions are tensor-core tiles of the small-M
    # GEMM (or, where cuBLAS won narrowly, their chain tiles: ops/linear.py CHAIN_SLACK), the first GEMM's epilogue
    # adds the residual and stores each column tile's sums of squares, and the second normalizes its input from them:
    # the add + norm kernel between them is gone (two per layer). With it on, norms of rows wider than 2,048 columns
    # fold too (norm_folding.MAX_FOLD_K), so 8B-class models can chain. Rounds as the stock modules do, up to the order
    # of the float32 sum of squares. Off by default until its GPU tests and A/B have run (sessions 36-37: no GPU
    # came); True turns it on, False keeps the add and norm kernel, as before
    chain_residual_norms: bool = False
    # attention_backend="auto": a library that would JIT-compile its kernels on first use here (FlashInfer on a
    # fresh machine, ~90 s) is not timed or chosen at startup; with this on, one detached low-priority process
    # builds them meanwhile, and a later start times it (attention/prebuild.py). Also: HF_ACCEL_BACKGROUND_BUILDS=0
    background_builds: bool = True
    # store Dynamo's traced forward in the compile cache and read it back at the next start of the same model,
    # skipping the trace (about 9 s of a warm start for an 8B model; compilation/trace_cache.py); False traces
    # every time. Needs the compile cache (compile_cache_dir not "")
    reuse_traced_graph: bool = True
    extra: dict = field(default_factory=dict)
    # set by resolve_for when it derived piecewise_capture_sizes from the default capture sizes: a later
    # updated(cudagraph_capture_sizes=...) then derives them again instead of keeping a list of other sizes
    _piecewise_sizes_derived: bool = field(default=False, repr=False, compare=False)

    def updated(self, **overrides) -> AccelConfig:
        known = {f.name for f in fields(self)}
        unknown = set(overrides) - known
        if unknown:
            raise TypeError(f"unknown accelerate_model option(s): {sorted(unknown)}")
        if (self._piecewise_sizes_derived and "cudagraph_capture_sizes" in overrides
                and "piecewise_capture_sizes" not in overrides):
            overrides = {**overrides, "piecewise_capture_sizes": None, "_piecewise_sizes_derived": False}
        elif "piecewise_capture_sizes" in overrides and "_piecewise_sizes_derived" not in overrides:
            # sizes given now are the caller's (None derives them again at resolve_for): captured as given
            overrides = {**overrides, "_piecewise_sizes_derived": False}
        return replace(self, **overrides)

    def validate(self) -> None:
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(
                f"unknown attention_backend {self.attention_backend!r}; choose one of {ATTENTION_BACKENDS}")
        if self.cudagraph_mode is not None:
            try:
                self.cudagraph_mode = CUDAGraphMode(self.cudagraph_mode)
            except ValueError:
                raise ValueError(
                    f"unknown cudagraph_mode {self.cudagraph_mode!r}; choose one of {[m.value for m in CUDAGraphMode]}"
                ) from None
        if self.prefix_cache_weight_check not in ("content", "version"):
            raise ValueError(f"prefix_cache_weight_check must be 'content' or 'version', "
                             f"got {self.prefix_cache_weight_check!r}")
        if self.block_size is not None and (self.block_size <= 0 or self.block_size & (self.block_size - 1)):
            raise ValueError(f"block_size must be a positive power of two, got {self.block_size}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2 (block 0 is reserved), got {self.num_kv_blocks}")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        for name in ("cudagraph_capture_sizes", "piecewise_capture_sizes"):
            sizes = getattr(self, name)
            if sizes is not None:
                if not sizes or any(int(s) < 1 for s in sizes):
                    raise ValueError(f"{name} must be positive integers, got {sizes}")
                setattr(self, name, sorted({int(s) for s in sizes}))

    def resolve_for(self, device: torch.device) -> AccelConfig:
        """Fill device-dependent defaults (compile and graphs on for CUDA, off for CPU; enforce_eager wins)."""
        cfg = replace(self)
        cfg.validate()
        on_cuda = device.type == "cuda"
        if cfg.enforce_eager:
            cfg.compile = False
            cfg.cudagraph_mode = CUDAGraphMode.NONE
        else:
            if cfg.compile is None:
                cfg.compile = on_cuda
            if cfg.cudagraph_mode is None:
                cfg.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE if on_cuda else CUDAGraphMode.NONE
            if not on_cuda and cfg.cudagraph_mode != CUDAGraphMode.NONE:
                logger.warning("hf_accel: cudagraph_mode=%r needs a CUDA device; the model is on %s, so it runs "
                               "without CUDA graphs ('none')", CUDAGraphMode(cfg.cudagraph_mode).value, device.type)
                cfg.cudagraph_mode = CUDAGraphMode.NONE
        if cfg.cudagraph_capture_sizes is None:
            cfg.cudagraph_capture_sizes = default_capture_sizes(cfg.max_num_seqs)
            if cfg.piecewise_capture_sizes is None:
                cfg.piecewise_capture_sizes = thinned_capture_sizes(cfg.cudagraph_capture_sizes)
                cfg._piecewise_sizes_derived = True
        return cfg


# AccelConfig's on/off optimisations that the command lines (`hf-accel bench`, `hf-accel serve`) offer as `--name` /
# `--no-name` (unset: AccelConfig's default), each with its help text: one flag turns one optimisation off for an
# A/B, or works around it where it misbehaves
CLI_SWITCHES: dict[str, str] = {
    "pdl": "programmatic dependent launch (default: on where supported); --no-pdl for the A/B",
    "small_m_gemm": "the tuned small-M GEMM for decode linears (default: on); --no-small-m-gemm for the A/B",
    "fused_split_reductions": "split-KV attention and split-K GEMMs reduce in the same launch (default: on); "
                              "--no-fused-split-reductions for the A/B",
    "decode_attention_kernel": "the triton backend's decode kernel for every decode batch (default: on); "
                               "--no-decode-attention-kernel runs wide decode batches through the unified kernel",
    "decode_longest_first": "a wide decode batch's attention programs start with the longest contexts (default: "
                            "on); --no-decode-longest-first launches them in batch order",
    "split_mixed_attention": "a mixed step's leading decode rows run the decode kernel, the rest the unified kernel "
                             "(default: on; triton backend); --no-split-mixed-attention: one launch",
    "graph_greedy_argmax": "full decode graphs end with the greedy argmax (default: on); --no-graph-greedy-argmax "
                           "leaves it to the sampler after the graph",
    "fold_norms": "RMSNorms (and the residual add before them) run inside the one-row GEMM after them at batch 1 "
                  "(default: on); --no-fold-norms keeps Inductor's norm kernels",
    "gated_gemm": "a gated MLP's SiLU-and-mul runs in its gate/up GEMM's epilogue where warm-up timed it faster "
                  "(default: on); --no-gated-gemm keeps the linear and Inductor's activation kernel",
    "chain_residual_norms": "at 2-64 rows, the linear before a residual add and RMSNorm adds the residual and sums "
                            "the squares in its epilogue, and the linear after normalizes its input: no norm kernel "
                            "(default: off until measured on a GPU); --no-chain-residual-norms for the A/B",
    "combo_kernels": "Inductor launches each compiled piece's independent GPU kernels together, up to eight per "
                     "launch (default: on); --no-combo-kernels for the A/B",
    "reuse_traced_graph": "read the traced forward back from the compile cache (default: on); "
                          "--no-reuse-traced-graph traces every start",
}


def add_switch_arguments(group) -> None:
    """Add `CLI_SWITCHES` to an argparse parser or argument group, each defaulting to None (unset)."""
    import argparse

    assert set(CLI_SWITCHES) <= {f.name for f in fields(AccelConfig)}, "a switch that AccelConfig does not have"
    for name, text in CLI_SWITCHES.items():
        group.add_argument("--" + name.replace("_", "-"), action=argparse.BooleanOptionalAction, default=None,
                           help=text)


def switch_values(args) -> dict[str, bool]:
    """The `CLI_SWITCHES` the command line set (name -> value), for AccelConfig(**...)."""
    return {name: getattr(args, name) for name in CLI_SWITCHES if getattr(args, name, None) is not None}
