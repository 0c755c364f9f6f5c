"""The dtype table for every op: one place that says which float types each backend takes."""

from __future__ import annotations

import jax.numpy as jnp

#: Floating types the ops accept (the reference runs all of them).
FLOAT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16),
                jnp.dtype(jnp.float64))
#: Floating types the CUDA kernels take (float64 stays on the reference backend).
CUDA_FLOAT_DTYPES = FLOAT_DTYPES[:3]
#: Half-precision types: they accumulate in float32 (products, reductions) and round once.
HALF_DTYPES = (jnp.dtype(jnp.float16), jnp.dtype(jnp.bfloat16))


def check_float_dtype(op: str, name: str, dtype) -> None:
    """Raise TypeError, naming `op` and input `name`, unless `dtype` is in FLOAT_DTYPES.

    Args:
      op: the op's name, for the message.
      name: the input's name, for the message.
      dtype: anything `jnp.dtype` accepts (a dtype, a type, a string).
    """
    if jnp.dtype(dtype) not in FLOAT_DTYPES:
        raise TypeError(f"{op}: {name} must be one of "
                        f"{[str(d) for d in FLOAT_DTYPES]}, got {jnp.dtype(dtype)}")
