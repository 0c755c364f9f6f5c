"""Decode attention over a fixed-capacity KV cache: the op both attention operators' decode paths use.

A few query rows (decode, speculative verify: S = 1..16) attend to the first kv_len[b] rows of a
cache [B, Hkv, C, D] with GQA head sharing, bottom-right causal offset, local window, softcap, an
additive or boolean bias and per-head sinks. The cache may be int8 / int4 quantised (`reference.quant`);
the CUDA engine then streams the packed bytes. Semantics: `reference.decode.decode_attention`.
"""

from __future__ import annotations

import functools
import math

import jax.numpy as jnp

from jax_onnx_attn import _extension
from jax_onnx_attn.ops import cuda, partitioning
from jax_onnx_attn.ops.backend import dispatch
from jax_onnx_attn.ops.dtypes import CUDA_FLOAT_DTYPES, HALF_DTYPES, check_float_dtype
from jax_onnx_attn.ops.reference import decode as reference
from jax_onnx_attn.ops.reference import quant

OP = "decode_attention"
#: Bias dtypes the engine takes: bool (True keeps a key) or an additive float.
BIAS_DTYPES = (jnp.dtype(jnp.bool_),) + CUDA_FLOAT_DTYPES


def cuda_unsupported(q_dtype, head_dim: int) -> str | None:
    """Why the CUDA decode engine cannot take a call, or None when it can."""
    if jnp.dtype(q_dtype) not in HALF_DTYPES:
        return f"the CUDA decode kernels take float16 and bfloat16, not {jnp.dtype(q_dtype)}"
    if _extension.limits() is None:
        return _extension.build_info()["reason"]
    if head_dim not in cuda.DECODE_HEAD_DIMS:
        return f"head dim {head_dim} is not one of {cuda.DECODE_HEAD_DIMS}"
    return None


def decode_attention(q, k_cache, v_cache, kv_len, bias=None, sink=None, k_scale=None, v_scale=None,
                     *, scale: float | None = None, softcap: float = 0.0, causal: bool = True,
                     left: int = -1, right: int = -1, pos_shift: int = 0, kv_bits: int = 0,
                     backend: str = "auto", split_rows: int | None = None):
    """Attention of q [B, Hq, S, D] over caches [B, Hkv, C, D] whose first kv_len[b] rows are valid.

    Args:
      q: [B, Hq, S, D]; query row i sits at position kv_len[b] - S + i + pos_shift.
      k_cache, v_cache: [B, Hkv, C, D], q's dtype; Hq % Hkv == 0 (head h reads KV head h // (Hq/Hkv)).
        With kv_bits 8: int8 [B, Hkv, C, D]; with kv_bits 4: uint8 [B, Hkv, C, D/2] (two values a
        byte, low nibble first, stored + 8).
      kv_len: integer [B], read on the device; rows at or past it are never read.
      bias: None or [B|1, Hq|1, S|1, T]: float (added after softcap) or bool (True keeps a key);
        keys j >= T are hidden.
      sink: None or [Hq]: an extra logit per query head in the softmax (no value row).
      k_scale, v_scale: with kv_bits only: float32 of 1 element (per tensor) or [1, Hkv, 1, D]
        (per channel). A cache value reads as q.dtype(float32(x) * scale), a scale of 0 as 1
        (`reference.quant.dequantize`).
      scale: multiplies q.k; None means 1 / sqrt(D).
      softcap: > 0 applies softcap * tanh(x / softcap) before the bias.
      causal, left, right: key j is hidden when j > pos_i (causal), pos_i - j > left (left >= 0) or
        j - pos_i > right (right >= 0).
      pos_shift: static shift of every query position (0: the last query row sits at kv_len - 1).
      kv_bits: 0 (float caches), 8 or 4 (quantised caches).
      backend: "auto", "reference" or "cuda".
      split_rows: CUDA only: KV rows per split (a multiple of 64) instead of the planner's choice.

    Returns:
      [B, Hq, S, D] in q's dtype; a row that sees no key is 0.
    """
    q, k_cache, v_cache, kv_len = map(jnp.asarray, (q, k_cache, v_cache, kv_len))
    if kv_bits not in (0, 4, 8):
        raise ValueError(f"{OP}: kv_bits must be 0 (float caches), 8 or 4, got {kv_bits}")
    for name, x in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache)):
        if x.ndim != 4:
            raise ValueError(f"{OP}: {name} must be rank 4, got shape {x.shape}")
        if name == "q" or not kv_bits:
            check_float_dtype(OP, name, x.dtype)
    b, hq, s, d = q.shape
    if kv_bits == 4 and d % 2:
        raise ValueError(f"{OP}: q's head dim {d} must be even with kv_bits=4 (two values a byte)")
    cache_d = d // 2 if kv_bits == 4 else d
    if k_cache.shape != v_cache.shape or k_cache.shape[0] != b or k_cache.shape[3] != cache_d:
        last = "D/2" if kv_bits == 4 else "D"
        raise ValueError(f"{OP}: caches {k_cache.shape} / {v_cache.shape} must both be "
                         f"[B={b}, Hkv, C, {last}={cache_d}]")
    cache_dtype = quant.storage_dtype(kv_bits) if kv_bits else q.dtype
    for name, x in (("k_cache", k_cache), ("v_cache", v_cache)):
        if x.dtype != cache_dtype:
            why = f"kv_bits={kv_bits}" if kv_bits else "q's dtype"
            raise TypeError(f"{OP}: {name} must be {cache_dtype} ({why}), got {x.dtype}")
    hkv = k_cache.shape[1]
    if hkv == 0 or hq % hkv:
        raise ValueError(f"{OP}: query heads {hq} are not a multiple of KV heads {hkv}")
    if kv_len.shape != (b,) or not jnp.issubdtype(kv_len.dtype, jnp.integer):
        raise ValueError(f"{OP}: kv_len must be integer [B]=[{b}], got {kv_len.dtype}{list(kv_len.shape)}")
    if bias is not None:
        bias = jnp.asarray(bias)
        bs = bias.shape
        if bias.ndim != 4 or bs[0] not in (1, b) or bs[1] not in (1, hq) or bs[2] not in (1, s):
            raise ValueError(f"{OP}: bias must be [B|1, Hq|1, S|1, T], got {bs}")
        if bias.dtype not in BIAS_DTYPES:
            raise TypeError(f"{OP}: bias must be bool, float32, float16 or bfloat16, got {bias.dtype}")
    if sink is not None:
        sink = jnp.asarray(sink)
        if sink.shape != (hq,):
            raise ValueError(f"{OP}: sink must be [Hq]=[{hq}], got {sink.shape}")
    k_scale, v_scale = (_check_kv_scale(name, x, kv_bits, hkv, d)
                        for name, x in (("k_scale", k_scale), ("v_scale", v_scale)))
    if scale is None:
        scale = 1.0 / math.sqrt(d)
    if split_rows is not None and _extension.limits() is not None and (
            split_rows <= 0 or split_rows % cuda.DECODE_BLOCK_N):
        raise ValueError(f"{OP}: split_rows must be a positive multiple of {cuda.DECODE_BLOCK_N}")
    static = dict(scale=float(scale), softcap=float(softcap), causal=bool(causal), left=int(left),
                  right=int(right), pos_shift=int(pos_shift), kv_bits=int(kv_bits))
    ref_fn = functools.partial(reference.decode_attention, **static)
    why = cuda_unsupported(q.dtype, d)
    cuda_fn = None if why else functools.partial(cuda.decode_attention, split_rows=split_rows, **static)
    return dispatch(OP, backend, ref_fn, cuda_fn, q, k_cache, v_cache, kv_len, bias, sink, k_scale,
                    v_scale, unsupported=why, rule=partitioning.DECODE_ATTENTION)


def _check_kv_scale(name: str, x, kv_bits: int, hkv: int, d: int):
    """k_scale / v_scale: None without kv_bits, else float32 of 1 element or [1, Hkv, 1, D]."""
    if not kv_bits:
        if x is not None:
            raise ValueError(f"{OP}: {name} is for quantised caches (kv_bits 8 or 4); kv_bits is 0")
        return None
    if x is None:
        raise ValueError(f"{OP}: {name} is required with kv_bits={kv_bits}")
    x = jnp.asarray(x)
    if x.dtype != jnp.float32:
        raise TypeError(f"{OP}: {name} must be float32, got {x.dtype}")
    if x.size != 1 and x.shape != (1, hkv, 1, d):
        raise ValueError(f"{OP}: {name} must have 1 element (per tensor) or shape [1, Hkv, 1, D] = "
                         f"[1, {hkv}, 1, {d}] (per channel), got {list(x.shape)}")
    return x
