"""ONNX -> JAX lowering: `load(model)` gives params and a pure, jittable `apply(params, inputs)`.

  load(path_or_proto, dtype=None) -> LoweredModel
  LoweredModel.params / .apply / .input_names / .output_names / .model / .fixed_cache_step(B, C)
  Static(value): a shape-setting input passed by value through jax.jit (LoweredModel.static_inputs).
  UnsupportedOpsError: raised by load with every (domain, op_type, since_version) it lacks.
  register(op_type, *since_versions, domain=...): add an op handler (see registry).
"""

from jax_onnx_attn.onnx.loader import LoweredModel, load
from jax_onnx_attn.onnx.registry import OpKey, UnsupportedOpsError, register, registered
from jax_onnx_attn.onnx.values import Static

__all__ = ["load", "LoweredModel", "UnsupportedOpsError", "OpKey", "register", "registered",
           "Static"]
