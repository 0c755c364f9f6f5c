"""Reference in-place KV-cache append: the executable spec of the `kv_append` CUDA kernel."""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_onnx_attn.ops import status as st


def kv_append(cache, new, start):
    """Write new [B, H, S, D] into cache [B, H, C, D] at rows start[b] .. start[b]+S-1.

    A batch row whose rows do not all fit in [0, C) is left untouched and flagged in the status.
    Written as a clamped dynamic_update_slice so that XLA updates a donated cache in place.
    """
    capacity, s = cache.shape[2], new.shape[2]
    start = start.astype(jnp.int32)
    ok = (start >= 0) & (start <= capacity - s)

    zero = jnp.int32(0)  # index dtypes must agree (int64 under x64 otherwise)

    def one(c, n, pos, fits):
        pos = jnp.clip(pos, 0, capacity - s)
        current = lax.dynamic_slice(c, (zero, pos, zero), n.shape)
        return lax.dynamic_update_slice(c, jnp.where(fits, n, current), (zero, pos, zero))

    out = jax.vmap(one)(cache, new, start, ok)
    status = st.kv_write_status(ok)
    return out, status
