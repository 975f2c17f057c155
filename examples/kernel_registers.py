"""Registers and spills of the small-M GEMM kernel's tiles on Hopper, without a GPU: each 16- and 64-row candidate
tile of `hf_accel.ops.linear` compiled ahead of time for sm_90a (Triton's compiler, then `ptxas -v`) as a plain
linear, as a residual chain's first linear (residual epilogue and partial sums of squares), as its second
(normalizing prologue over 64, 128 or 256 partial sums; plain and gated).

Why: a chain runs a tile with more work in its prologue or epilogue than the plain linear; where that variant
spills and the plain one does not, the chained launch is slower than the plain timing says. Session 38's output of
this tool (examples/results/) found such tiles, and the tuner has since timed chain tiles as chained launches
(`ops.linear._time_chain_tiles`). Register allocation depends on the Triton version: this machine's may differ from
the GPU machine's, so read the figures as a guide.

    python examples/kernel_registers.py [--k 4096] [--buckets 16 64]
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from hf_accel.ops import skinny_gemm
from hf_accel.ops.linear import _candidates_for

POINTERS = {"x_ptr": "*bf16", "w_ptr": "*bf16", "b_ptr": "*bf16", "s_ptr": "*bf16", "y_ptr": "*bf16",
            "part_ptr": "*fp32", "counters_ptr": "*i32", "r_ptr": "*bf16", "ss_out_ptr": "*fp32", "g_ptr": "*bf16",
            "ss_in_ptr": "*fp32"}
INTS = {"M", "N", "K", "K_PER_SPLIT", "stride_xm", "stride_wn", "stride_ym", "n_ss_tiles"}
FLOATS = {"inv_k", "eps"}


def _ptxas() -> str:
    """The newest ptxas Triton ships (the plain one may be older than the PTX version Triton writes)."""
    folder = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
    for name in ("ptxas-blackwell", "ptxas"):
        if os.path.exists(os.path.join(folder, name)):
            return os.path.join(folder, name)
    raise SystemExit("no ptxas in this Triton installation")


def registers(cfg: skinny_gemm.SkinnyConfig, split: int, residual: bool = False, norm: bool = False,
              ss_tiles: int = 1, gated: bool = False) -> str:
    """`registers/spill-store bytes` of one variant of the GEMM kernel compiled for sm_90a with PDL on."""
    kernel = skinny_gemm._skinny_gemm_kernel
    constants = dict(BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k, EVEN_K=True, IS_SPLIT=split > 1,
                     HAS_BIAS=False, HAS_SCALE=False, USE_PDL=True, FUSED_SPLITS=split if split > 1 else 0,
                     EARLY_TRIGGER=False, GATED=gated, RESIDUAL=residual, NORM=norm, SS_TILES=ss_tiles)
    signature = {a: POINTERS.get(a) or ("i32" if a in INTS else "fp32" if a in FLOATS else "constexpr")
                 for a in kernel.arg_names}
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                              options=dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    with tempfile.TemporaryDirectory() as tmp:
        ptx = os.path.join(tmp, "k.ptx")
        with open(ptx, "w") as f:
            f.write(compiled.asm["ptx"])
        text = subprocess.run([_ptxas(), "-v", "--gpu-name=sm_90a", ptx, "-o", os.devnull], capture_output=True,
                              text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", text).group(1)
    spill = re.search(r"(\d+) bytes spill stores", text).group(1)
    return f"{regs}r/{spill}s"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--k", type=int, default=4096, help="K of the candidate sets (split-K needs whole tiles)")
    ap.add_argument("--buckets", type=int, nargs="+", default=[16, 64])
    args = ap.parse_args()
    print(f"triton {triton.__version__}, sm_90a, PDL on; registers r / spill-store bytes s")
    seen = set()
    for bucket in args.buckets:
        for cfg in _candidates_for(bucket, args.k, False):
            key = (cfg.block_m, cfg.block_n, cfg.block_k, cfg.num_warps, cfg.num_stages, min(cfg.split_k, 2))
            if cfg.gemv or key in seen:
                continue
            seen.add(key)
            row = [f"m{bucket} bn{cfg.block_n} bk{cfg.block_k} w{cfg.num_warps} s{cfg.num_stages} "
                   f"split{'1' if cfg.split_k == 1 else '>1'}:", "plain", registers(cfg, cfg.split_k),
                   "first", registers(cfg, cfg.split_k, residual=True)]
            if cfg.split_k == 1:
                row += [item for t in (64, 128, 256) for item in (f"second@{t}", registers(cfg, 1, norm=True,
                                                                                           ss_tiles=t))]
                row += ["gated", registers(cfg, 1, gated=True), "gated-second@64",
                        registers(cfg, 1, norm=True, ss_tiles=64, gated=True)]
            print(" ".join(row), flush=True)


if __name__ == "__main__":
    main()
