"""CUDA backend: one thin `jax.ffi.ffi_call` wrapper per FFI target of `jax_onnx_attn._ffi`.

Inputs reach these wrappers already validated and in the kernels' layout (the public ops in
`jax_onnx_attn.ops` do that). Caches are aliased to their outputs (`input_output_aliases`) so a
donated cache is updated in place. Every handler is command-buffer compatible.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn._extension import target


def kv_append(cache, new, start):
    """cache [B, H, C, D] (aliased), new [B, H, S, D], start int32 [B] -> (cache, status int32 [B])."""
    b = cache.shape[0]
    call = jax.ffi.ffi_call(
        target("kv_append"),
        (jax.ShapeDtypeStruct(cache.shape, cache.dtype), jax.ShapeDtypeStruct((b,), jnp.int32)),
        input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(cache, new, start.astype(jnp.int32))


# --- decode attention (ffi/attention/decode.cu, engine in ffi/kernels/decode/) ---------------------

#: KV rows per engine tile; split sizes are multiples of it (kBlockN in ffi/kernels/decode/params.h).
DECODE_BLOCK_N = 64
#: Most splits the combine takes (kMaxSplits in ffi/kernels/decode/combine.cuh).
DECODE_MAX_SPLITS = 256
#: Head dims the decode engine is compiled for.
DECODE_HEAD_DIMS = (64, 80, 96, 128, 256)
# CTA slots the split planner aims to fill: an H200's 132 SMs. A constant, not a device query, so a
# given call shape always gets the same splits, hence the same bits, on any GPU.
_PLAN_SMS = 132


def _decode_block_rows(rows: int) -> int:
    """Packed query rows per CTA (BlockRows in ffi/kernels/decode/launch.cuh)."""
    return 16 if rows <= 16 else 32 if rows <= 32 else 64 if rows <= 64 else 128


def decode_ctas_per_sm(rows: int, head_dim: int) -> int:
    """CTAs per SM of the engine's layout for `rows` packed rows (EngineConfig::kCtasPerSm in
    ffi/kernels/decode/engine.cuh: stages sized to fit two CTAs of ~113 KB, or one of 227 KB when
    that keeps half again as many KV tiles in flight; 16-bit elements)."""
    block = _decode_block_rows(rows)
    warps_m = block // 16
    warps_n = 4 // warps_m if warps_m < 4 else 1
    tile_n = 64 if warps_n > 1 else 32
    stride = head_dim + 8
    q_bytes = block * stride * 2
    stage = 2 * tile_n * stride * 2
    merge = warps_m * warps_n * 16 * (stride + 2) * 4
    two, one = min(8, (115712 - q_bytes) // stage), min(8, (232448 - q_bytes) // stage)
    fits_two = (32 * warps_m * warps_n <= 128 and two >= 2 and 3 * (two - 1) >= one - 1
                and q_bytes + merge <= 115712)
    return 2 if fits_two else 1


def decode_split_rows(batch: int, kv_heads: int, rows: int, capacity: int, head_dim: int) -> int:
    """KV rows per split for a decode call: a pure function of static shapes.

    With enough (batch, KV head, M block) CTAs to fill the GPU there is one split (no combine).
    Otherwise it takes the fewest splits whose wave efficiency is within 85% of the best (the FA3
    heuristic), each split a whole number of tiles. rows = (Hq / Hkv) * S.
    """
    block = _decode_block_rows(rows)
    ctas = batch * kv_heads * -(-rows // block)
    tiles = max(1, -(-capacity // DECODE_BLOCK_N))
    slots = _PLAN_SMS * decode_ctas_per_sm(rows, head_dim)
    if ctas >= 0.8 * slots:
        return tiles * DECODE_BLOCK_N
    options = []
    for per_split in range(1, tiles + 1):
        n = -(-tiles // per_split)
        if n > DECODE_MAX_SPLITS:
            continue
        work = ctas * n
        options.append((n, per_split, work / (math.ceil(work / slots) * slots)))
    best = max(eff for _, _, eff in options)
    n, per_split, _ = min((o for o in options if o[2] >= 0.85 * best), key=lambda o: o[0])
    return per_split * DECODE_BLOCK_N


def decode_workspace_elems(batch: int, kv_heads: int, rows: int, capacity: int, head_dim: int,
                           split_rows: int) -> int:
    """f32 elements of the split partials (WorkspaceElems in ffi/kernels/decode/host.h), >= 1."""
    splits = -(-capacity // split_rows)
    return batch * kv_heads * splits * rows * (head_dim + 1) if splits > 1 else 1


def decode_attention(q, k_cache, v_cache, kv_len, bias=None, sink=None, *, scale: float,
                     softcap: float = 0.0, causal: bool = True, left: int = -1, right: int = -1,
                     pos_shift: int = 0, split_rows: int | None = None, pdl: bool = True):
    """q [B, Hq, S, D] f16/bf16, k_cache / v_cache [B, Hkv, C, D], kv_len int32 [B] -> [B, Hq, S, D].

    Semantics of `jax_onnx_attn.ops.reference.decode.decode_attention`. bias: None or
    [B|1, Hq|1, S|1, T] f32/f16/bf16/bool; sink: None or [Hq]. split_rows overrides the planner (a
    multiple of DECODE_BLOCK_N); pdl launches the combine as a programmatic dependent launch.
    """
    b, hq, s, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    rows = (hq // hkv) * s
    if split_rows is None:
        split_rows = decode_split_rows(b, hkv, rows, c, d)
    ws = decode_workspace_elems(b, hkv, rows, c, d, split_rows)
    placeholder = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(
        target("decode_attention"),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
        vmap_method="sequential",
    )
    out, _ = call(q, k_cache, v_cache, kv_len.astype(jnp.int32),
                  placeholder if bias is None else bias,
                  placeholder if sink is None else sink.astype(jnp.float32),
                  scale=np.float32(scale), softcap=np.float32(softcap if softcap > 0 else 0.0),
                  causal=bool(causal), left=int(left), right=int(right), pos_shift=int(pos_shift),
                  has_bias=bias is not None, has_sink=sink is not None,
                  split_rows=int(split_rows), pdl=bool(pdl))
    return out
