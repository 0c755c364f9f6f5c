"""Public JAX ops. Each validates its inputs at trace time and runs on the reference or CUDA backend."""

from jax_onnx_attn.ops import status
from jax_onnx_attn.ops.kv_cache import kv_append

__all__ = ["kv_append", "status"]
