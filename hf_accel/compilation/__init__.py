"""Compilation layer: piecewise torch.compile backend (cut at the attention op), CUDA graph capture/replay,
the FULL / PIECEWISE / NONE dispatcher, and the on-disk compile cache."""

from hf_accel.compilation.cache import CompileCacheInfo, compile_cache_key, setup_compile_cache
from hf_accel.compilation.cuda_graph import FullCUDAGraphRunner, pad_to_capture_size
from hf_accel.compilation.dispatcher import BatchKey, CUDAGraphDispatcher, Dispatch, RuntimeMode
from hf_accel.compilation.piecewise import CompileStats, PiecewiseForward, compile_piecewise

__all__ = [
    "BatchKey",
    "CUDAGraphDispatcher",
    "CompileCacheInfo",
    "CompileStats",
    "Dispatch",
    "FullCUDAGraphRunner",
    "PiecewiseForward",
    "RuntimeMode",
    "compile_cache_key",
    "compile_piecewise",
    "pad_to_capture_size",
    "setup_compile_cache",
]
