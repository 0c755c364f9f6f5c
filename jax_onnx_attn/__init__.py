"""jax-onnx-attn: ONNX decoder models as jitted JAX functions, with attention on our own CUDA kernels.

Public API:
  ops.attention, ops.group_query_attention, ops.kv_append  -- the JAX ops (reference and CUDA backends)
  build_info()                                               -- what the compiled extension contains
"""

from jax_onnx_attn._extension import build_info, cuda_usable, has_cuda, register_targets
from jax_onnx_attn import ops
from jax_onnx_attn.onnx import load  # ONNX -> JAX: load(model) -> LoweredModel

__version__ = "0.1.0"

# Registering at import makes the CUDA targets available to every jit in the process.
register_targets()

__all__ = ["build_info", "cuda_usable", "has_cuda", "load", "ops", "__version__"]
