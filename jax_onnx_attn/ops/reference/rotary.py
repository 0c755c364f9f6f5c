"""Rotary position embedding (RoPE), the math shared by GroupQueryAttention (do_rotary=1), ai.onnx
RotaryEmbedding and com.microsoft RotaryEmbedding.

Only the first `rotary_dim` features of each head rotate; the rest pass through. A feature pair
(x1, x2) at position p becomes (x1·cos − x2·sin, x2·cos + x1·sin) with cos = cos_table[p, i]:
  half-split   (interleaved=False): x1 = x[:R/2],  x2 = x[R/2:R]   (GPT-NeoX / Llama layout)
  interleaved  (interleaved=True):  x1 = x[0:R:2], x2 = x[1:R:2]   (GPT-J layout)
"""

from __future__ import annotations

import jax.numpy as jnp

from jax_onnx_attn.ops.reference.core import accumulation_dtype


def rotary_embedding(x, cos, sin, positions=None, *, interleaved: bool = False,
                     rotary_dim: int | None = None):
    """Rotate the first `rotary_dim` features of every head of x.

    Args:
      x: [B, H, S, D] float (BHSD, the layout of `core`; transpose a BSHD tensor first).
      cos, sin: either tables [max_position, >= R/2] read at `positions`, or, when `positions` is
        None, per-token values [B, S, R/2] (or broadcastable to it, e.g. [S, R/2]).
      positions: integer [B, S] (or broadcastable, e.g. [S]) absolute positions into the tables.
        A position outside the table reads the nearest row (gathers never go out of bounds; the
        operators validate what is known at trace time).
      interleaved: pair (x[2i], x[2i+1]) instead of (x[i], x[i + R/2]).
      rotary_dim: R, even and <= D; default 2 * cos.shape[-1].

    Returns:
      x's shape and dtype. Computed in float32 (float64 for f64) and rounded once.
    """
    r = 2 * cos.shape[-1] if rotary_dim is None else int(rotary_dim)
    d = x.shape[-1]
    if r % 2 or not 0 < r <= d:
        raise ValueError(f"rotary_embedding: rotary_dim must be even and in (0, {d}], got {r}")
    half = r // 2
    if cos.shape[-1] < half or sin.shape[-1] < half:
        raise ValueError(f"rotary_embedding: cos/sin need {half} columns, "
                         f"got {cos.shape[-1]} and {sin.shape[-1]}")
    acc = accumulation_dtype(x.dtype)
    cos, sin = cos[..., :half].astype(acc), sin[..., :half].astype(acc)
    if positions is not None:
        positions = jnp.asarray(positions).astype(jnp.int32)
        cos = jnp.take(cos, positions, axis=0, mode="clip")
        sin = jnp.take(sin, positions, axis=0, mode="clip")
    # [.., S, R/2] -> [.., 1, S, R/2]: one angle per (batch, token), shared by every head.
    if cos.ndim >= 3:
        cos, sin = cos[..., None, :, :], sin[..., None, :, :]
    xr = x[..., :r].astype(acc)
    if interleaved:
        x1, x2 = xr[..., 0::2], xr[..., 1::2]
    else:
        x1, x2 = xr[..., :half], xr[..., half:]
    o1 = x1 * cos - x2 * sin
    o2 = x2 * cos + x1 * sin
    if interleaved:
        rotated = jnp.stack([o1, o2], axis=-1).reshape(xr.shape)
    else:
        rotated = jnp.concatenate([o1, o2], axis=-1)
    return jnp.concatenate([rotated.astype(x.dtype), x[..., r:]], axis=-1)
