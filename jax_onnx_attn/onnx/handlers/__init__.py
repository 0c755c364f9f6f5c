"""Op handlers, one module per op family. Importing this package registers every handler.

Handler contract (every module of onnx/handlers): a function registered with `@register(op_type,
*since_versions, domain=...)` is called as `handler(ctx, *inputs) -> outputs`: `ctx` is the node's
`NodeContext` (attributes, ctx.xp, ctx.fail), the inputs and outputs follow the ONNX schema of the
registered op in order (None for an omitted optional input), and the outputs are one value or a
tuple. Values are NumPy when known at trace time, jax arrays otherwise (see `onnx.values`).
"""

from jax_onnx_attn.onnx.handlers import attention, control, elementwise, linalg, norm, reduce, shape

__all__ = ["attention", "control", "elementwise", "linalg", "norm", "reduce", "shape"]
