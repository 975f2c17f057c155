"""hf_accel: a drop-in accelerator for Hugging Face transformers causal LMs.

    model = accelerate_model(model)   # patched in place: paged attention, continuous batching, CUDA graphs
    model.generate(...)               # same outputs as stock transformers, faster; any number of threads at once
    await model.agenerate(...)        # the same from asyncio; model.agenerate_stream(...) streams tokens
    restore(model)                    # undo
"""

from hf_accel.api import accelerate_model, available_backends, engine_info, restore
from hf_accel.config import AccelConfig, CUDAGraphMode
from hf_accel.streams import GenerationDelta, GenerationStream

__all__ = ["AccelConfig", "CUDAGraphMode", "GenerationDelta", "GenerationStream", "accelerate_model",
           "available_backends", "engine_info", "restore"]
__version__ = "0.1.0"
