"""The in-place KV-cache append used by both attention operators."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import cuda, partitioning
from jax_onnx_attn.ops.backend import dispatch
from jax_onnx_attn.ops.dtypes import check_float_dtype, lengths_int32
from jax_onnx_attn.ops.reference import kv_cache as reference


def kv_append(cache, new, start, *, backend: str = "auto"):
    """Write S new rows per batch into a fixed-capacity cache, in place when the cache is donated.

    Args:
      cache: [B, H, C, D] float32 / float16 / bfloat16 (float64 on the reference backend); C is the
        capacity.
      new: [B, H, S, D], same dtype as `cache`, S <= C.
      start: int32 [B], the row at which batch b's new rows start (read on the device).
      backend: "auto", "reference" or "cuda".

    Returns:
      (cache, status): the updated cache, and int32 [B] status (see `jax_onnx_attn.ops.status`): a
      batch row whose rows would fall outside [0, C) is not written and gets KV_WRITE_OUT_OF_RANGE.
    """
    cache, new = jnp.asarray(cache), jnp.asarray(new)
    start = start if hasattr(start, "dtype") else np.asarray(start)
    if cache.ndim != 4:
        raise ValueError(f"kv_append: cache must be [B, H, C, D], got shape {cache.shape}")
    if new.ndim != 4:
        raise ValueError(f"kv_append: new must be [B, H, S, D], got shape {new.shape}")
    check_float_dtype("kv_append", "cache", cache.dtype)
    if new.dtype != cache.dtype:
        raise TypeError(f"kv_append: new has dtype {new.dtype} but cache has {cache.dtype}")
    b, h, c, d = cache.shape
    if (new.shape[0], new.shape[1], new.shape[3]) != (b, h, d):
        raise ValueError(f"kv_append: new {new.shape} does not match cache {cache.shape} in B, H or D")
    if new.shape[2] > c:
        raise ValueError(f"kv_append: new has {new.shape[2]} rows, more than the cache capacity {c}")
    if tuple(start.shape) != (b,) or not jnp.issubdtype(start.dtype, jnp.integer):
        raise ValueError(f"kv_append: start must be integer [B]=[{b}], got {start.dtype}{list(start.shape)}")
    start = lengths_int32(start)  # any integer width: saturated, never wrapped
    cuda_fn = cuda.kv_append if cache.dtype != jnp.float64 else None
    return dispatch("kv_append", backend, reference.kv_append, cuda_fn, cache, new, start,
                    unsupported="float64 runs on the reference backend only",
                    rule=partitioning.KV_APPEND)
