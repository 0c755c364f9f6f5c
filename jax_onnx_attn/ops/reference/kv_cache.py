"""Reference in-place KV-cache append: the executable spec of the `kv_append` CUDA kernel."""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops import status as st


def append_fits(start, s: int, capacity: int):
    """bool [B]: rows start[b] .. start[b] + S - 1 all lie in [0, C), in int32 arithmetic: the rule
    the kv_append and gqa_prepare kernels apply before they write a batch row."""
    start = start.astype(jnp.int32)
    return (start >= 0) & (start <= capacity - s)


def kv_append(cache, new, start):
    """Write new [B, H, S, D] into cache [B, H, C, D] at rows start[b] .. start[b]+S-1.

    A batch row whose rows do not all fit in [0, C) is left untouched and flagged in the status.
    Written as a scatter whose refused rows aim past the cache (mode="drop" discards them), so
    that XLA updates a donated cache in place without reading it first (a read of the old rows
    made XLA copy the cache at batch 1).
    """
    b, h, capacity, _ = cache.shape
    s = new.shape[2]
    start = start.astype(jnp.int32)
    ok = append_fits(start, s, capacity)
    rows = jnp.where(ok, start, capacity)[:, None] + jnp.arange(s, dtype=jnp.int32)  # [B, S]
    batch = jnp.arange(b, dtype=jnp.int32)[:, None, None]
    heads = jnp.arange(h, dtype=jnp.int32)[None, :, None]
    out = cache.at[batch, heads, rows[:, None, :]].set(new, mode="drop", unique_indices=True,
                                                     indices_are_sorted=True)
    status = st.kv_write_status(ok)
    return out, status
