"""The dtype table for every op: one place that says which float types each backend takes."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

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


#: Lengths, offsets and positions are saturated into [-LENGTH_LIMIT, LENGTH_LIMIT] when they become
#: int32: far beyond any cache capacity (an out-of-range value stays out of range, whatever its
#: integer width), and small enough that adding a sequence length to it cannot overflow int32.
LENGTH_LIMIT = 1 << 30


def lengths_int32(x):
    """An integer length / position tensor (any integer width, signed or not; NumPy, jax or traced)
    as int32, saturated into [-LENGTH_LIMIT, LENGTH_LIMIT].

    A 64-bit value never wraps: `2**33 + 2` becomes LENGTH_LIMIT, not 2. NumPy input is saturated on
    the host (before jax would truncate it to 32 bits without jax_enable_x64).

    Args:
      x: integer array of any shape (the caller has checked the dtype).

    Returns:
      int32 jax array of x's shape.
    """
    if not isinstance(x, jax.Array):
        arr = np.asarray(x)
        if arr.dtype.kind == "u":
            arr = np.minimum(arr, LENGTH_LIMIT)
        else:
            arr = np.clip(arr, -LENGTH_LIMIT, LENGTH_LIMIT)
        return jnp.asarray(arr.astype(np.int32))
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger):
        return jnp.minimum(x, jnp.asarray(LENGTH_LIMIT, x.dtype)).astype(jnp.int32)
    lim = jnp.asarray(LENGTH_LIMIT, x.dtype) if jnp.iinfo(x.dtype).max >= LENGTH_LIMIT else None
    if lim is None:  # int8 / int16: every value is already in range
        return x.astype(jnp.int32)
    return jnp.clip(x, -lim, lim).astype(jnp.int32)


def host_integers_fit(x):
    """x unchanged, or, for a NumPy 64-bit / uint32 integer array, the same values as int32 saturated
    by `lengths_int32`: the form in which integer inputs enter jax without wrapping (jax would
    truncate them to 32 bits without jax_enable_x64)."""
    if isinstance(x, (np.ndarray, np.generic)) and np.asarray(x).dtype.kind in "iu" and \
            np.asarray(x).dtype.itemsize >= 4 and np.asarray(x).dtype != np.int32:
        return lengths_int32(x)
    return x
