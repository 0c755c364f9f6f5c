"""Op handlers, one module per op family. Importing this package registers every handler."""

from jax_onnx_attn.onnx.ops import attention, control, elementwise, linalg, norm, reduce, shape

__all__ = ["attention", "control", "elementwise", "linalg", "norm", "reduce", "shape"]
