"""Projections as JAX ops: `linear` (y = x W^T, W in torch Linear's [N, K] layout) and
`matmul_nbits` (onnxruntime's com.microsoft::MatMulNBits, 4- / 8-bit weights dequantised in
registers), with the fusions a decoder layer needs: an RMS-norm prologue, bias, residual add and a
gated SiLU (gate / up rows interleaved by `interleave_gate_up`).

Both validate at trace time, then run on the weight-streaming GEMV kernels (backend "cuda", for
f16 / bf16 x with at most 32 rows; ffi/kernels/gemv/) or on the reference (`ops.reference.linear`:
XLA's plain half GEMM; every other shape, float32, and the CPU). `prepare_nbits` turns
onnxruntime's MatMulNBits initialisers into the kernels' form, once, at load.
"""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.backend import dispatch
from jax_onnx_attn.ops.dtypes import HALF_DTYPES, check_float_dtype
from jax_onnx_attn.ops.reference import linear as reference

#: Rows per gate / up block of a gated weight: rows 16b .. 16b+7 of `interleave_gate_up(g, u)` are
#: g[8b .. 8b+7], rows 16b+8 .. 16b+15 are u[8b .. 8b+7] (one 16-row MMA tile of the kernels holds
#: a gate block and its up block, so the gating needs no data exchange).
GATE_UP_BLOCK = 8
#: Bits per element the MatMulNBits kernels take.
NBITS = (4, 8)
#: W rows per row group of the rows layout (`to_rows_layout`): a warp's four m16 MMA tiles in the
#: rows kernel (ffi/kernels/gemv/plan.h's kRowsGroup; tests check that they agree).
ROWS_GROUP = 64
#: The record layout (`to_record_layout`): one record of RECORD_BYTES per (RECORD_ROWS-row tile,
#: RECORD_K-element chunk of K): RECORD_W_BYTES of W, then 3 metadata words a lane (ffi/kernels/gemv/
#: plan.h's kRecord*; tests check that they agree).
RECORD_ROWS, RECORD_K, RECORD_W_BYTES = 16, 256, 2048
RECORD_BYTES = RECORD_W_BYTES + 3 * 4 * 32
#: The weight layouts `matmul_nbits` takes: "onnx" (`prepare_nbits`' form, scales / zero points
#: row-major or tiled), "rows" (`to_rows_layout`: 4-bit weights for the rows kernel, M >= 2) and
#: "record" (`to_record_layout`: 4-bit weights for the slots kernel's record reader, M = 1).
LAYOUTS = ("onnx", "rows", "record")


def _xp(a):
    return np if isinstance(a, np.ndarray) else jnp


def interleave_gate_up(gate, up):
    """Interleave the rows (axis 0) of a gate and an up projection in blocks of GATE_UP_BLOCK.

    Args:
      gate, up: [I, ...] each (a weight [I, K], a bias [I], MatMulNBits' b_quant [I, k_blocks,
        blob], scales or zero points [I, k_blocks]); I a multiple of 8. NumPy in, NumPy out.

    Returns:
      [2 I, ...]: rows 16b .. 16b+7 = gate[8b .. 8b+7], rows 16b+8 .. 16b+15 = up[8b .. 8b+7], the
      layout `linear(..., gated=True)` and `matmul_nbits(..., gated=True)` expect.
    """
    if gate.shape != up.shape:
        raise ValueError(f"interleave_gate_up: gate {tuple(gate.shape)} and up {tuple(up.shape)} differ")
    if gate.ndim < 1 or gate.shape[0] % GATE_UP_BLOCK:
        raise ValueError(f"interleave_gate_up: gate must have a multiple of {GATE_UP_BLOCK} rows, "
                         f"got shape {tuple(gate.shape)}")
    xp = _xp(gate)
    i, rest = gate.shape[0], tuple(gate.shape[1:])
    blocks = (i // GATE_UP_BLOCK, 1, GATE_UP_BLOCK) + rest
    both = xp.concatenate([gate.reshape(blocks), up.reshape(blocks)], axis=1)
    return both.reshape((2 * i,) + rest)


def deinterleave_gate_up(rows):
    """The inverse of `interleave_gate_up` along axis 0: [2 I, ...] -> (gate [I, ...], up [I, ...])."""
    if rows.ndim < 1 or rows.shape[0] % (2 * GATE_UP_BLOCK):
        raise ValueError(f"deinterleave_gate_up: needs a multiple of {2 * GATE_UP_BLOCK} rows, got "
                         f"shape {tuple(rows.shape)}")
    rest = tuple(rows.shape[1:])
    both = rows.reshape((rows.shape[0] // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK) + rest)
    half = (rows.shape[0] // 2,) + rest
    return both[:, 0].reshape(half), both[:, 1].reshape(half)


def split_gate_up(y):
    """The same layout along the last axis: y [..., 2 I] (products with interleaved rows) ->
    (gate [..., I], up [..., I])."""
    lead, n = y.shape[:-1], y.shape[-1]
    both = y.reshape(lead + (n // (2 * GATE_UP_BLOCK), 2, GATE_UP_BLOCK))
    return both[..., 0, :].reshape(lead + (n // 2,)), both[..., 1, :].reshape(lead + (n // 2,))


def interleave_gate_up_nbits(gate, up):
    """`interleave_gate_up` for MatMulNBits operands in the kernels' form (`prepare_nbits`).

    Args:
      gate, up: (b_quant [I, k_blocks, blob], scales [I, k_blocks], zero_points [I, k_blocks] or
        None) each, with the same bits, block size and K.

    Returns:
      (b_quant [2 I, ...], scales [2 I, ...], zero_points [2 I, ...] or None) for
      `matmul_nbits(..., n=2 * I, gated=True)`.
    """
    (gb, gs, gz), (ub, us, uz) = gate, up
    if (gz is None) != (uz is None):
        raise ValueError("interleave_gate_up_nbits: zero_points must be given for both or neither")
    zp = None if gz is None else interleave_gate_up(gz, uz)
    return interleave_gate_up(gb, ub), interleave_gate_up(gs, us), zp


def rotary_pair_order(num_heads: int, kv_num_heads: int, head_dim: int, rotary_half: int) -> np.ndarray:
    """The rotary-pair order of a packed Q | K | V projection's rows (`linear_gqa_prepare`'s weight).

    GroupQueryAttention rotates dims (d, d + R/2) of each Q and K head together (R/2 = rotary_half,
    not interleaved). In this order each 16-row group of a Q or K head's first R rows holds dims
    8j .. 8j+7 then their partners R/2 + 8j .. R/2 + 8j+7, so that one thread of the GEMV's epilogue
    has both halves of its pairs; the rest of each head and the V heads keep their order.

    Returns:
      int64 [(num_heads + 2 kv_num_heads) head_dim]: row r of the reordered weight is row order[r]
      of the original (`w[order]`); a projection's output y in this order is y_orig[..., order], and
      `np.argsort(order)` undoes it.
    """
    d, half = int(head_dim), int(rotary_half)
    if d % 16 or half % GATE_UP_BLOCK or not 0 < 2 * half <= d:
        raise ValueError(f"rotary_pair_order: needs head_dim % 16 == 0 and rotary_half a positive multiple "
                         f"of 8 with 2 * rotary_half <= head_dim, got head_dim {d}, rotary_half {half}")
    blocks = np.arange(2 * half).reshape(2, half // GATE_UP_BLOCK, GATE_UP_BLOCK)
    rotated = np.concatenate([blocks.transpose(1, 0, 2).reshape(-1), np.arange(2 * half, d)])
    heads = num_heads + kv_num_heads
    order = [h * d + rotated for h in range(heads)]
    order += [np.arange(heads * d, (heads + kv_num_heads) * d)]
    return np.concatenate(order).astype(np.int64)


def to_rotary_pair_order(rows, order):
    """rows [N, ...] (a weight, a bias, MatMulNBits' b_quant / scales / zero points by W row)
    reordered along axis 0 by `rotary_pair_order`'s `order`. NumPy in, NumPy out."""
    if rows.ndim < 1 or rows.shape[0] != len(order):
        raise ValueError(f"to_rotary_pair_order: needs {len(order)} rows, got shape {tuple(rows.shape)}")
    return rows[order]


def from_rotary_pair_order(y, order):
    """The inverse along the last axis: y [..., N] in the rotary-pair order -> the original order."""
    return y[..., np.argsort(order)]


def tile_nbits_meta(meta):
    """Per-block scales or zero points [N, k_blocks] -> the kernels' layout [ceil(N / 16), k_blocks,
    16]: tile T holds rows 16 T .. 16 T + 15 block-major, so the 16 values of one block that a warp's
    row tile needs are 32 (scales) or 16 (zero points) contiguous bytes, one or two 16-byte copies
    for a whole chunk (a 4-byte load per lane and row made the int4 kernels L1-bound). Rows past N
    are zeros. Done once at load (`onnx.fusion`); NumPy in, NumPy out (jax arrays work too).
    """
    xp = _xp(meta)
    if meta.ndim != 2:
        raise ValueError(f"tile_nbits_meta: expected [N, k_blocks], got shape {tuple(meta.shape)}")
    n, kb = meta.shape
    rows = cuda_matmul.meta_tile_rows()
    tiles = -(-n // rows)
    if tiles * rows != n:
        meta = xp.concatenate([meta, xp.zeros((tiles * rows - n, kb), meta.dtype)])
    out = meta.reshape(tiles, rows, kb).transpose(0, 2, 1)
    return np.ascontiguousarray(out) if xp is np else out


def untile_nbits_meta(tiles, n: int):
    """The inverse of `tile_nbits_meta`: [ceil(N / 16), k_blocks, 16] -> [N, k_blocks]."""
    t, kb, rows = tiles.shape
    return tiles.transpose(0, 2, 1).reshape(t * rows, kb)[:n]


def prepare_nbits(b_quant, scales, zero_points, *, k: int, n: int, bits: int, block_size: int):
    """MatMulNBits initialisers as onnxruntime stores them -> the kernels' form (NumPy, once at load).

    Args:
      b_quant: uint8 [N, k_blocks, block_size * bits / 8] (or any shape of that size).
      scales: [N * k_blocks] or [N, k_blocks], float.
      zero_points: None; uint8 packed [N * ceil(k_blocks * bits / 8)] (element j of a row's run in
        bits (j % (8 / bits)) * bits of byte j // (8 / bits)); or float [N * k_blocks].
      k, n, bits, block_size: the node's attributes K, N, bits, block_size.

    Returns:
      (b_quant uint8 [N, k_blocks, blob], scales [N, k_blocks], zero_points uint8 [N, k_blocks], one
      value per block, or None) — what `matmul_nbits` takes.

    Raises:
      NotImplementedError: forms the kernels do not take (bits other than 4 / 8, K not a multiple
        of block_size, float zero points): keep the XLA dequantisation for those.
      ValueError: operands inconsistent with the attributes.
    """
    op = "prepare_nbits"
    if bits not in NBITS:
        raise NotImplementedError(f"{op}: bits={bits}: the kernels take {NBITS}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{op}: block_size must be a power of two >= 16, got {block_size}")
    if k <= 0 or n <= 0:
        raise ValueError(f"{op}: K and N must be positive, got K={k}, N={n}")
    if k % block_size:
        raise NotImplementedError(f"{op}: K={k} is not a multiple of block_size={block_size}")
    k_blocks = k // block_size
    blob = block_size * bits // 8
    b_quant = np.asarray(b_quant)
    if b_quant.dtype != np.uint8 or b_quant.size != n * k_blocks * blob:
        raise ValueError(f"{op}: b_quant must be uint8 with N * k_blocks * blob = {n * k_blocks * blob} "
                         f"elements, got {b_quant.dtype}{list(b_quant.shape)}")
    scales = np.asarray(scales)
    if not np.issubdtype(scales.dtype, np.floating) and scales.dtype.name != "bfloat16":
        raise ValueError(f"{op}: scales must be float, got {scales.dtype}")
    if scales.size != n * k_blocks:
        raise ValueError(f"{op}: scales must have N * k_blocks = {n * k_blocks} elements, got "
                         f"{list(scales.shape)}")
    zp = None
    if zero_points is not None:
        zero_points = np.asarray(zero_points)
        if zero_points.dtype != np.uint8:
            raise NotImplementedError(f"{op}: zero_points of dtype {zero_points.dtype}: the kernels "
                                      "take uint8 zero points only")
        per_row = -(-k_blocks * bits // 8)
        if zero_points.size != n * per_row:
            raise ValueError(f"{op}: zero_points must be uint8 [N * ceil(k_blocks * bits / 8)] = "
                             f"[{n * per_row}], got {list(zero_points.shape)}")
        packed = zero_points.reshape(n, per_row)
        if bits == 8:
            zp = packed.copy()
        else:
            per_byte = 8 // bits
            shifts = (np.arange(per_byte, dtype=np.uint8) * bits)
            vals = (packed[..., None] >> shifts) & np.uint8((1 << bits) - 1)
            zp = vals.reshape(n, per_row * per_byte)[:, :k_blocks].copy()
    return (b_quant.reshape(n, k_blocks, blob), scales.reshape(n, k_blocks), zp)


def _in_slabs(one_slab, count: int, slab: int) -> None:
    """one_slab(i0) for i0 = 0, slab, 2 slab, ... < count, in threads: NumPy's copies release the GIL
    (an ~8B model's weights take seconds, not a minute, on a 16-core host)."""
    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        list(pool.map(one_slab, range(0, count, slab)))


def _rows_bytes(b):
    """The ONNX-order bytes of 64 G W rows, uint8 [G * 64, K / 2] (element k in bits 4 (k % 2) of
    byte k // 2) -> the rows layout's bytes [G, K / 16, 512]. Works on bytes, not nibbles: each
    output byte pairs rows h = 0 / 1 of a tile at one k, so it is one nibble of each of two input
    bytes."""
    g, half = b.shape[0] // ROWS_GROUP, b.shape[1]
    # row = 64 rg + 16 i + 8 h + g8, byte m = 8 j + 4 c + t holds k = 16 j + 8 c + 2 t + e (e = 0
    # low) -> lane (g8, t) of step j, word i, byte 2 e + c, nibble h (rows.cuh's layout).
    b = b.reshape(g, 4, 2, 8, half // 8, 2, 4)                   # rg i h g8 j c t
    r0, r1 = b[:, :, 0], b[:, :, 1]                               # rg i g8 j c t, rows h = 0 / 1
    out = np.stack([(r0 & 15) | (r1 << 4), (r0 >> 4) | (r1 & 0xF0)], axis=-1)  # ... e
    return out.transpose(0, 3, 2, 5, 1, 6, 4).reshape(g, half // 8, 512)  # rg j g8 t i e c


def _rows_meta(meta, groups, xp):
    """Per-block values [N, k_blocks] -> [G, k_blocks, 64]: value 8 g8 + 2 i + h = row 16 i + 8 h + g8
    of the group (rows past N zeros)."""
    n, kb = meta.shape
    if groups * ROWS_GROUP != n:
        meta = xp.concatenate([meta, xp.zeros((groups * ROWS_GROUP - n, kb), meta.dtype)])
    return meta.reshape(groups, 4, 2, 8, kb).transpose(0, 4, 3, 1, 2).reshape(groups, kb, ROWS_GROUP)


def to_rows_layout(b_quant, scales, zero_points):
    """4-bit MatMulNBits weights in `prepare_nbits`' form -> the rows layout of the rows kernel
    (ffi/kernels/gemv/rows.cuh: 2..32 rows of x), once at load. NumPy in, NumPy out.

    Args:
      b_quant: uint8 [N, k_blocks, block_size / 2] (element j of a block in bits 4 (j % 2) of byte
        j // 2); K = k_blocks * block_size a multiple of 16.
      scales: [N, k_blocks] (row-major, not tiled).
      zero_points: None (8) or uint8 [N, k_blocks], one value 0..15 a block.

    Returns:
      (w uint8 [G, K / 16, 512], scales [G, k_blocks, 64], zero_points uint8 [G, k_blocks, 64] or
      None), G = ceil(N / 64): a warp's row group of 64 W rows, per k16 step 32 lanes x 16 bytes of
      MMA A fragments (rows.cuh's header); rows past N are zeros. `from_rows_layout` inverts it.
    """
    op = "to_rows_layout"
    b_quant, scales = np.asarray(b_quant), np.asarray(scales)
    if b_quant.dtype != np.uint8 or b_quant.ndim != 3:
        raise ValueError(f"{op}: b_quant must be uint8 [N, k_blocks, block_size / 2], got "
                         f"{b_quant.dtype}{list(b_quant.shape)}")
    n, kb, blob = b_quant.shape
    k = kb * blob * 2
    if k % 16:
        raise NotImplementedError(f"{op}: b_quant: K={k} must be a multiple of 16")
    if scales.shape != (n, kb):
        raise ValueError(f"{op}: scales must be [{n}, {kb}] (row-major), got {list(scales.shape)}")
    if zero_points is not None:
        zero_points = np.asarray(zero_points)
        if zero_points.dtype != np.uint8 or zero_points.shape != (n, kb) or (zero_points > 15).any():
            raise ValueError(f"{op}: zero_points must be uint8 [{n}, {kb}] in 0..15, got "
                             f"{zero_points.dtype}{list(zero_points.shape)}")
    groups = -(-n // ROWS_GROUP)
    w = np.empty((groups, k // 16, 512), np.uint8)
    slab = 32  # row groups a pass (bounds the temporaries: a 128k-row LM head is 2004 groups)

    def one_slab(g0):
        rows = b_quant[g0 * ROWS_GROUP:(g0 + slab) * ROWS_GROUP].reshape(-1, k // 2)
        pad = min(slab, groups - g0) * ROWS_GROUP - rows.shape[0]
        if pad:
            rows = np.concatenate([rows, np.zeros((pad, k // 2), np.uint8)])
        w[g0:g0 + slab] = _rows_bytes(rows)

    _in_slabs(one_slab, groups, slab)
    zp = None if zero_points is None else np.ascontiguousarray(_rows_meta(zero_points, groups, np))
    return w, np.ascontiguousarray(_rows_meta(scales, groups, np)), zp


def from_rows_layout(w, scales, zero_points, *, n: int, block_size: int):
    """The inverse of `to_rows_layout`: (b_quant uint8 [N, k_blocks, block_size / 2], scales
    [N, k_blocks], zero_points [N, k_blocks] or None). NumPy or jax arrays (traceable: the
    reference computes from it)."""
    xp = _xp(w)
    groups, steps = w.shape[0], w.shape[1]
    k = 16 * steps
    b = w.reshape(groups, steps, 32, 4, 4)                              # rg j lane word byte
    q = xp.stack([b & 15, b >> 4], axis=-1)                             # ... nibble (low first)
    q = q.reshape(groups, steps, 8, 4, 4, 2, 2, 2)                      # rg j g8 t i e c h
    q = q.transpose(0, 4, 7, 2, 1, 6, 3, 5).reshape(groups * ROWS_GROUP, k)[:n]  # rows x k
    pairs = q.reshape(n, k // 2, 2)
    b_quant = (pairs[..., 0] | (pairs[..., 1] << 4)).reshape(n, k // block_size, block_size // 2)

    def meta(a):
        kb = a.shape[1]
        return a.reshape(groups, kb, 8, 4, 2).transpose(0, 3, 4, 2, 1).reshape(groups * ROWS_GROUP, kb)[:n]

    return b_quant, meta(scales), None if zero_points is None else meta(zero_points)


def pack_nbits_rows(b_quant, scales, zero_points, *, k: int, n: int, bits: int, block_size: int):
    """MatMulNBits initialisers as onnxruntime stores them (`prepare_nbits`' arguments) -> the rows
    layout (`to_rows_layout`), for `matmul_nbits(..., layout="rows")`. 4-bit weights only."""
    if bits != 4:
        raise NotImplementedError(f"pack_nbits_rows: bits={bits}: the rows layout holds 4-bit weights")
    return to_rows_layout(*prepare_nbits(b_quant, scales, zero_points, k=k, n=n, bits=bits,
                                         block_size=block_size))


def _record_slots(k: int, block_size: int):
    """Per quantisation block b of a row: (its record's chunk, the slot s of the chunk whose scale
    and zero point the record holds for it), as int arrays [K / block_size]. Slot s = 4 piece + t
    spans chunk K offsets 128 piece + 32 t .. + 31 (slots.cuh's SlotK); a block (>= 32, a power of
    two) holds at least one whole slot: its first one."""
    k0 = np.arange(k // block_size) * block_size
    off = k0 % RECORD_K
    return k0 // RECORD_K, 4 * (off // 128) + (off % 128) // 32


def _record_operands(op, b_quant, scales, zero_points):
    """The checks of the 4-bit record layout (`to_record_layout`) on `prepare_nbits`' form: (b_quant,
    scales, zero_points as NumPy arrays, (N, k_blocks, block_size, K)); NotImplementedError for forms
    the layout does not hold, ValueError for bad operands."""
    b_quant, scales = np.asarray(b_quant), np.asarray(scales)
    if b_quant.dtype != np.uint8 or b_quant.ndim != 3:
        raise ValueError(f"{op}: b_quant must be uint8 [N, k_blocks, block_size / 2], got "
                         f"{b_quant.dtype}{list(b_quant.shape)}")
    n, kb, blob = b_quant.shape
    block, k = 2 * blob, kb * blob * 2
    if block < 32 or block & (block - 1):
        raise NotImplementedError(f"{op}: b_quant: block_size={block} must be a power of two >= 32")
    if k % RECORD_K or n % RECORD_ROWS:
        raise NotImplementedError(f"{op}: b_quant: K={k} must be a multiple of {RECORD_K} and N={n} "
                                  f"of {RECORD_ROWS}")
    if scales.shape != (n, kb) or scales.dtype.itemsize != 2 or scales.dtype.kind not in "fV":
        raise ValueError(f"{op}: scales must be float16 / bfloat16 [{n}, {kb}] (row-major), got "
                         f"{scales.dtype}{list(scales.shape)}")
    if zero_points is not None:
        zero_points = np.asarray(zero_points)
        if zero_points.dtype != np.uint8 or zero_points.shape != (n, kb) or (zero_points > 15).any():
            raise ValueError(f"{op}: zero_points must be uint8 [{n}, {kb}] in 0..15, got "
                             f"{zero_points.dtype}{list(zero_points.shape)}")
    return b_quant, scales, zero_points, (n, kb, block, k)


def to_record_layout(b_quant, scales, zero_points):
    """4-bit MatMulNBits weights in `prepare_nbits`' form -> the record layout of the slots kernel's
    record reader (ffi/kernels/gemv/slots.cuh's RecordFormat: one row of x), once at load. NumPy in,
    NumPy out.

    Per (16-row tile T, 256-element chunk c of K) one record of RECORD_BYTES (2432) bytes: exactly
    the bytes lane L = 4 g + t of the warp streaming that tile loads for that chunk, in lane order,
    so that every warp load is contiguous (512 bytes of W, 128 of metadata) and a lane's address is
    one pointer advanced a record a chunk:
      - W word j (h = j // 2, piece p = j % 2) of lane L at 512 j + 16 L: the 16 bytes of row
        16 T + g + 8 h at K offsets 256 c + 32 t + 128 p .. + 31 (the wide format's piece, ONNX's
        nibble order: element k in bits 4 (k % 2) of byte k // 2);
      - metadata word m of lane L at 2048 + 128 m + 4 L: m = 0 / 1 the scales of row g + 8 m for the
        lane's slots 2 t + e (e = 0 low 16 bits; scale bits of the scales' dtype), m = 2 the zero
        points of rows g + 8 h, slots 2 t + e in byte 2 h + e (8 when absent: the same values).
    Slot s covers K offsets 128 (s // 4) + 32 (s % 4) .. + 31 of the chunk; its scale is its block's.

    Args:
      b_quant: uint8 [N, k_blocks, block_size / 2]; N a multiple of 16, K = k_blocks * block_size a
        multiple of 256, block_size a power of two >= 32 (raises NotImplementedError otherwise:
        keep such weights in the "onnx" layout).
      scales: [N, k_blocks] float16 or bfloat16 (row-major, not tiled).
      zero_points: None (8) or uint8 [N, k_blocks], one value 0..15 a block.

    Returns:
      uint8 [N / 16, K / 256, 2432]. `from_record_layout` inverts it.
    """
    op = "to_record_layout"
    b_quant, scales, zero_points, (n, kb, block, k) = _record_operands(op, b_quant, scales, zero_points)
    tiles, chunks = n // RECORD_ROWS, k // RECORD_K
    # Per (chunk, lane t, e): the block of slot 2 t + e.
    slot_k = 32 * (np.arange(8) % 4) + 128 * (np.arange(8) // 4)
    blk = ((np.arange(chunks)[:, None] * RECORD_K + slot_k[None, :]) // block).reshape(chunks, 4, 2)
    rec = np.empty((tiles, chunks, RECORD_BYTES), np.uint8)
    scale_bits = scales.view(np.uint16)
    slab = 256  # tiles a pass

    def one_slab(t0):
        t1 = min(tiles, t0 + slab)
        r0, r1 = RECORD_ROWS * t0, RECORD_ROWS * t1
        w = b_quant[r0:r1].reshape(t1 - t0, 2, 8, chunks, 2, 4, 16)    # T h g c p t byte
        rec[t0:t1, :, :RECORD_W_BYTES] = w.transpose(0, 3, 1, 4, 2, 5, 6).reshape(t1 - t0, chunks, -1)
        sc = scale_bits[r0:r1].reshape(t1 - t0, 2, 8, kb)[..., blk]    # T h g c t e
        rec[t0:t1, :, RECORD_W_BYTES:RECORD_W_BYTES + 256] = (
            np.ascontiguousarray(sc.transpose(0, 3, 1, 2, 4, 5)).astype("<u2").view(np.uint8)
            .reshape(t1 - t0, chunks, 256))
        if zero_points is None:
            rec[t0:t1, :, RECORD_W_BYTES + 256:] = 8
        else:
            zp = zero_points[r0:r1].reshape(t1 - t0, 2, 8, kb)[..., blk]  # T h g c t e
            rec[t0:t1, :, RECORD_W_BYTES + 256:] = zp.transpose(0, 3, 2, 4, 1, 5).reshape(t1 - t0, chunks, 128)

    _in_slabs(one_slab, tiles, slab)
    return rec


def from_record_layout(rec, *, n: int, block_size: int, dtype):
    """The inverse of `to_record_layout`: (b_quant uint8 [N, k_blocks, block_size / 2], scales
    [N, k_blocks] of `dtype` (the scales' bits reinterpreted), zero_points uint8 [N, k_blocks]: 8
    where the weight had none, the same values). NumPy or jax arrays (traceable: the reference
    computes from it)."""
    xp = _xp(rec)
    tiles, chunks = rec.shape[0], rec.shape[1]
    k = chunks * RECORD_K
    w = rec[..., :RECORD_W_BYTES].reshape(tiles, chunks, 2, 2, 8, 4, 16)   # T c h p g t byte
    b_quant = w.transpose(0, 2, 4, 1, 3, 5, 6).reshape(n, k // block_size, block_size // 2)
    c, slot = _record_slots(k, block_size)
    lo_hi = rec[..., RECORD_W_BYTES:RECORD_W_BYTES + 256].reshape(tiles, chunks, 2, 8, 4, 2, 2)
    lo_hi = lo_hi.astype(xp.uint16)
    bits = (lo_hi[..., 0] | (lo_hi[..., 1] << 8))[:, c, :, :, slot // 2, slot % 2]  # kb T h g
    bits = bits.transpose(1, 2, 3, 0).reshape(n, -1)
    scales = bits.view(dtype) if xp is np else jax.lax.bitcast_convert_type(bits, dtype)
    zp = rec[..., RECORD_W_BYTES + 256:].reshape(tiles, chunks, 8, 4, 2, 2)  # T c g t h e
    zp = zp[:, c, :, slot // 2, :, slot % 2].transpose(1, 3, 2, 0).reshape(n, -1)  # kb T g h
    return b_quant, scales, zp


def record_shape(n: int, k: int) -> tuple[int, int, int]:
    """The uint8 shape of [N, K] 4-bit weights in the record layout (`to_record_layout`)."""
    return (n // RECORD_ROWS, k // RECORD_K, RECORD_BYTES)


def _matmul_nbits_record(x, rec, scales, zero_points, bias, residual, norm_weight, *, k, n, bits,
                         block_size, eps, gated, backend, pdl):
    """`matmul_nbits` with layout="record" (x, bits, block_size and k already checked)."""
    op = "matmul_nbits"
    if bits != 4:
        raise NotImplementedError(f"{op}: layout='record' holds 4-bit weights, got bits={bits}")
    if block_size < 32:
        raise ValueError(f"{op}: layout='record' needs block_size >= 32, got {block_size}")
    if k % RECORD_K or n % RECORD_ROWS:
        raise ValueError(f"{op}: layout='record' needs K a multiple of {RECORD_K} and N of "
                         f"{RECORD_ROWS}, got k={k}, n={n}")
    want = record_shape(n, k)
    if rec.dtype != jnp.uint8 or tuple(rec.shape) != want:
        raise ValueError(f"{op}: b_quant in the record layout must be uint8 {list(want)} "
                         f"(to_record_layout), got {rec.dtype}{list(rec.shape)}")
    if scales is not None or zero_points is not None:
        raise ValueError(f"{op}: layout='record' holds the scales and zero points in b_quant: pass "
                         "scales=None and zero_points=None")
    n_out = _check_operands(op, x, n, "b_quant", gated, bias, residual, norm_weight)

    def ref_fn(x2, rec, bias, norm_weight, r2):
        b_quant, s, z = from_record_layout(rec, n=n, block_size=block_size, dtype=x2.dtype)
        return reference.matmul_nbits(x2, b_quant, s, z, bias, r2, norm_weight, eps, gated, bits=bits,
                                      block_size=block_size)

    why = _kernel_unsupported(x, n, bits, gated, norm_weight is not None, block_size,
                              backend=backend, record_layout=True)
    cuda_fn = None
    if why is None:
        def cuda_fn(x2, rec, bias, norm_weight, r2):
            return cuda_matmul.matmul_nbits_record(x2, rec, bias, r2, norm_weight, n=n,
                                                   block_size=block_size, eps=eps, gated=gated,
                                                   pdl=pdl)
    return _run(op, backend, ref_fn, cuda_fn, why, x, (rec, bias, norm_weight), residual, n_out)


def _matmul_nbits_rows(x, w, scales, zero_points, bias, residual, norm_weight, *, k, n, bits,
                       block_size, eps, gated, backend, pdl):
    """`matmul_nbits` with layout="rows" (x, bits, block_size and k already checked)."""
    op = "matmul_nbits"
    if bits != 4:
        raise NotImplementedError(f"{op}: layout='rows' holds 4-bit weights, got bits={bits}")
    if k % 16:
        raise ValueError(f"{op}: layout='rows' needs K a multiple of 16, got k={k}")
    groups, kb = -(-n // ROWS_GROUP), k // block_size
    want = (groups, k // 16, 512)
    if w.dtype != jnp.uint8 or tuple(w.shape) != want:
        raise ValueError(f"{op}: b_quant in the rows layout must be uint8 {list(want)} (to_rows_layout), "
                         f"got {w.dtype}{list(w.shape)}")
    meta_shape = (groups, kb, ROWS_GROUP)
    if tuple(scales.shape) != meta_shape:
        raise ValueError(f"{op}: scales in the rows layout must be {list(meta_shape)} (to_rows_layout), "
                         f"got {list(scales.shape)}")
    if scales.dtype != x.dtype:
        raise TypeError(f"{op}: scales must have x's dtype {x.dtype}, got {scales.dtype}")
    if zero_points is not None and (zero_points.dtype != jnp.uint8
                                    or tuple(zero_points.shape) != meta_shape):
        raise ValueError(f"{op}: zero_points in the rows layout must be uint8 {list(meta_shape)} "
                         f"(to_rows_layout), got {zero_points.dtype}{list(zero_points.shape)}")
    n_out = _check_operands(op, x, n, "b_quant", gated, bias, residual, norm_weight)

    def ref_fn(x2, w, scales, zero_points, bias, norm_weight, r2):
        b_quant, s, z = from_rows_layout(w, scales, zero_points, n=n, block_size=block_size)
        return reference.matmul_nbits(x2, b_quant, s, z, bias, r2, norm_weight, eps, gated, bits=bits,
                                      block_size=block_size)

    why = _kernel_unsupported(x, n, bits, gated, norm_weight is not None, block_size,
                              backend=backend, rows_layout=True)
    cuda_fn = None
    if why is None:
        def cuda_fn(x2, w, scales, zero_points, bias, norm_weight, r2):
            return cuda_matmul.matmul_nbits_rows(x2, w, scales, zero_points, bias, r2, norm_weight,
                                                 n=n, block_size=block_size, eps=eps, gated=gated,
                                                 pdl=pdl)
    return _run(op, backend, ref_fn, cuda_fn, why, x, (w, scales, zero_points, bias, norm_weight),
                residual, n_out)


def _array(x):
    return None if x is None else (x if isinstance(x, jax.Array) else jnp.asarray(x))


def _check_operands(op, x, n_rows, w_name, gated, bias, residual, norm_weight):
    """Trace-time checks shared by both ops (x's dtype and K are checked by the caller); returns
    N_out."""
    if n_rows % (2 * GATE_UP_BLOCK if gated else 8):
        raise ValueError(f"{op}: {w_name}: N={n_rows} must be a multiple of "
                         f"{'16 (gate / up blocks of 8)' if gated else 8}")
    n_out = n_rows // 2 if gated else n_rows
    k = x.shape[-1]
    for name, a, shape in (("bias", bias, (n_rows,)), ("residual", residual, x.shape[:-1] + (n_out,)),
                           ("norm_weight", norm_weight, (k,))):
        if a is None:
            continue
        if tuple(a.shape) != tuple(shape):
            raise ValueError(f"{op}: {name} must have shape {list(shape)}, got {list(a.shape)}")
        if a.dtype != x.dtype:
            raise TypeError(f"{op}: {name} must have x's dtype {x.dtype}, got {a.dtype}")
    return n_out


def _check_x(op, x, name="x"):
    check_float_dtype(op, name, x.dtype)
    if x.ndim < 1:
        raise ValueError(f"{op}: {name} must be [..., K], got a scalar")
    if x.shape[-1] % 8 or x.shape[-1] == 0:
        raise ValueError(f"{op}: {name}: K={x.shape[-1]} must be a positive multiple of 8")


def _run(op, backend, ref_fn, cuda_fn, why, x, operands, residual, n_out):
    """Flatten x's leading axes into M, dispatch, restore them."""
    lead, k = x.shape[:-1], x.shape[-1]
    m = math.prod(lead)
    x2 = x.reshape(m, k)
    r2 = None if residual is None else residual.reshape(m, n_out)
    if m == 0:
        return jnp.zeros(lead + (n_out,), x.dtype)
    y = dispatch(op, backend, ref_fn, cuda_fn, x2, *operands, r2, unsupported=why)
    return y.reshape(lead + (n_out,))


def kernel_formats() -> str:
    """Which weight formats `backend="auto"` runs on our kernels: "nbits" (the default: MatMulNBits
    weights on ours; dense half weights on ours for one row of x where the dense row kernel takes
    the shape, on XLA's GEMM otherwise), "all" or "none"; set with the environment variable
    JOA_LINEAR_KERNELS (read at trace time).

    Why: for n-bit weights ours (dequantised in registers) is the only path that does not
    materialise a dequantised matrix: 2-3x faster than XLA's in the whole step. For dense weights
    XLA's plain half GEMV streams 3.3-4.0 TB/s on the H200; our ring kernel reaches 0.80-0.93x of
    it at M = 1 and less at M = 8 / 32 (bench/results/2026-12-01-*-linear*.json), so more rows stay
    on XLA's. One row runs on the dense row kernel (`cuda_matmul.dense_row_enabled`: 3.9-4.5 TB/s on
    the ~8B shapes with the decoder's norm / residual / gating fused in,
    bench/results/2026-12-02-gemv-dense-row.json). Each of its FFI calls sits outside XLA's
    programmatic-dependent-launch chain (~0.5-0.8 µs more a kernel boundary), but the fusions cut
    the step's kernels by more than half: ~8B fp16 B=1 4.50 ms, 6.4 kernels a layer, against 4.70
    with XLA's dots (14.4 a layer); ~1B 1.059 against 1.053, within run-to-run noise
    (bench/results/2026-12-02-d314b44-e2e-dense-row.json, the JAX peer 4.48 / 1.34 in both runs).
    """
    value = os.environ.get("JOA_LINEAR_KERNELS", "nbits")
    if value not in ("all", "nbits", "none"):
        raise ValueError(f"JOA_LINEAR_KERNELS must be all, nbits or none, got {value!r}")
    return value


def _kernel_unsupported(x, n_rows, bits, gated, norm, block_size=0, backend="auto",
                        wide=None, rows_layout=False, record_layout=False) -> str | None:
    if jnp.dtype(x.dtype) not in HALF_DTYPES:
        return f"x is {x.dtype}: the kernels take float16 and bfloat16"
    formats = kernel_formats()
    # A preference of "auto" only: backend="cuda" always runs the kernels where they can.
    if backend == "auto" and formats == "none":
        return f"JOA_LINEAR_KERNELS={formats}: XLA's GEMM runs these weights"
    if backend == "auto" and formats == "nbits" and bits == cuda_matmul.DENSE_BITS:
        m = math.prod(x.shape[:-1])
        if m != 1 or not cuda_matmul.dense_row_enabled() or not _dense_row(n_rows, x.shape[-1], gated, norm):
            return (f"JOA_LINEAR_KERNELS={formats}: XLA's GEMM runs dense weights but for one row on "
                    "the dense row kernel")
    if record_layout:
        return cuda_matmul.record_unsupported(math.prod(x.shape[:-1]), n_rows, x.shape[-1], block_size,
                                              gated, norm)
    if rows_layout:
        return cuda_matmul.rows_unsupported(math.prod(x.shape[:-1]), n_rows, x.shape[-1], block_size,
                                            gated, norm)
    return cuda_matmul.unsupported(math.prod(x.shape[:-1]), n_rows, x.shape[-1], bits, gated,
                                   norm, block_size, wide=wide)


def _dense_row(n_rows, k, gated, norm) -> bool:
    """Whether one row of x against these dense weights takes the dense row kernel."""
    try:
        return bool(cuda_matmul.gemv_plan(1, n_rows, k, cuda_matmul.DENSE_BITS, gated, norm,
                                          slots=True)["dense_row"])
    except RuntimeError:  # no extension: the kernels do not run here
        return False


#: Layouts of a dense weight: [N, K] (torch Linear's, the kernels' weight-major one) or [K, N]
#: (ONNX MatMul's, which XLA's GEMM reads 2-4% faster at decode's 8-32 rows; reference only).
DENSE_LAYOUTS = ("nk", "kn")


def linear(x, w, bias=None, *, residual=None, norm_weight=None, norm_epsilon: float = 1e-6,
           gated: bool = False, backend: str = "auto", pdl: bool = False, w_layout: str = "nk"):
    """y = x W^T (+ bias) (gated) (+ residual), optionally on RMS-normalised x.

    Args:
      x: [..., K] float16 / bfloat16 (float32 / float64 on the reference); K a multiple of 8.
      w: [N, K] of x's dtype (torch Linear's layout; N a multiple of 8). With gated:
        `interleave_gate_up(w_gate, w_up)`, N = 2 I.
      bias: None or [N] of x's dtype (interleaved like w when gated).
      residual: None or [..., N_out] of x's dtype, added last.
      norm_weight: None or [K]: x is first replaced by round(x * rsqrt(mean(x²) + norm_epsilon) *
        norm_weight) (statistics in f32; onnxruntime's SimplifiedLayerNormalization).
      norm_epsilon: the norm's epsilon.
      gated: y = silu(x W_gate^T + b_gate) * (x W_up^T + b_up), computed in f32 from the rounded
        products and rounded once; N_out = N / 2.
      backend: "auto", "reference" or "cuda". The kernels take f16 / bf16 with M = prod(x.shape[:-1])
        <= 32 (and what fits their plan); "auto" runs the rest on the reference.
      pdl: launch the kernel as a programmatic dependent of the previous one, so that it starts
        streaming W before that kernel has finished. Only for weights no kernel of the program
        writes (parameters); off by default.
      w_layout: "nk" (w as above) or "kn": w stored [K, N] (gated: gate / up columns interleaved
        in blocks of 8), which only XLA's GEMM reads (the reference; backend="cuda" refuses it).

    Returns:
      [..., N_out] of x's dtype, N_out = N (N / 2 when gated). Each step is rounded to x's dtype as
      the unfused graph rounds it (`jax_onnx_attn.ops.reference.linear.linear`).
    """
    op = "linear"
    x, w = _array(x), _array(w)
    bias, residual, norm_weight = _array(bias), _array(residual), _array(norm_weight)
    _check_x(op, x)
    if w_layout not in DENSE_LAYOUTS:
        raise ValueError(f"{op}: w_layout must be one of {DENSE_LAYOUTS}, got {w_layout!r}")
    kn = w_layout == "kn"
    if w.ndim != 2 or w.shape[1 - kn] != x.shape[-1]:
        want = "[K, N]" if kn else "[N, K]"
        raise ValueError(f"{op}: w must be {want} with x's K={x.shape[-1]} (w_layout={w_layout!r}), "
                         f"got shape {list(w.shape)}")
    if w.dtype != x.dtype:
        raise TypeError(f"{op}: w must have x's dtype {x.dtype}, got {w.dtype}")
    n_rows = w.shape[kn]
    n_out = _check_operands(op, x, n_rows, "w", gated, bias, residual, norm_weight)
    eps = float(norm_epsilon)

    def ref_fn(x2, w, bias, norm_weight, r2):
        return reference.linear(x2, w, bias, r2, norm_weight, eps, gated, kn)

    why = ("w is [K, N] (w_layout='kn'): the kernels read [N, K], so XLA's GEMM runs it" if kn else
           _kernel_unsupported(x, n_rows, cuda_matmul.DENSE_BITS, gated, norm_weight is not None,
                               backend=backend))
    cuda_fn = None
    if why is None:
        def cuda_fn(x2, w, bias, norm_weight, r2):
            return cuda_matmul.linear(x2, w, bias, r2, norm_weight, eps=eps, gated=gated, pdl=pdl)
    return _run(op, backend, ref_fn, cuda_fn, why, x, (w, bias, norm_weight), residual, n_out)


def gated_mlp(x, w_gate_up, w_down, *, residual=None, norm_weight=None, norm_epsilon: float = 1e-6,
              backend: str = "auto", pdl: bool = False, split: str | None = None):
    """A gated MLP, `linear(linear(x, w_gate_up, norm_weight=, gated=True), w_down, residual=)`:
    one kernel (`cuda_matmul.gated_mlp`) for one row of x where it takes the shape, else the two
    `linear` calls (each on its own route).

    Args:
      x: [..., H] float16 / bfloat16 (float32 / float64 on the reference).
      w_gate_up: [2 I, H] of x's dtype, `interleave_gate_up(w_gate, w_up)`.
      w_down: [H, I] of x's dtype.
      residual: None or [..., H] of x's dtype, added last. norm_weight: None or [H] (RMS norm of x
        first, norm_epsilon).
      backend: "auto", "reference" or "cuda" ("cuda": the fused kernel, or NotImplementedError
        saying why it does not take the call).
      pdl: as `linear`'s, for the two calls when they run.
      split: the fused kernel's split, "k" or "n" (None: the JOA_GATED_MLP_SPLIT switch, "k" by
        default; `cuda_matmul.gated_mlp_split`).

    Returns:
      [..., H] of x's dtype: every product and the activation rounded as the two calls round them;
      the fused kernel's K split adds the down projection's f32 sums in another order (within the
      dtype's tolerance of the two calls, not the same bits), its N split in the same order (the
      two calls' bits).
    """
    op = "gated_mlp"
    x, w_gate_up, w_down = _array(x), _array(w_gate_up), _array(w_down)
    residual, norm_weight = _array(residual), _array(norm_weight)
    _check_x(op, x)
    h = x.shape[-1]
    inter = _check_mlp_weights(op, x, w_gate_up, w_down, norm_weight)
    _check_mlp_residual(op, x, residual)
    eps = float(norm_epsilon)
    split = cuda_matmul.gated_mlp_split(split)
    why = _gated_mlp_unsupported(x, h, inter, norm_weight is not None, backend, split)
    if why is not None:
        if backend == "cuda":
            raise NotImplementedError(f"{op}: backend='cuda' is not available for this call: {why}")
        hidden = linear(x, w_gate_up, norm_weight=norm_weight, norm_epsilon=eps, gated=True,
                        backend=backend, pdl=pdl)
        return linear(hidden, w_down, residual=residual, backend=backend, pdl=pdl)

    def ref_fn(x2, wgu, wdn, nw, r2):
        hidden = reference.linear(x2, wgu, None, None, nw, eps, True)
        return reference.linear(hidden, wdn, None, r2)

    def cuda_fn(x2, wgu, wdn, nw, r2):
        return cuda_matmul.gated_mlp(x2, wgu, wdn, nw, r2, eps=eps, split=split)

    return _run(op, backend, ref_fn, cuda_fn, None, x, (w_gate_up, w_down, norm_weight), residual, h)


def _check_mlp_residual(op, x, residual) -> None:
    """A gated MLP's residual: None or x's shape and dtype (it is added to the MLP's output)."""
    if residual is not None and (tuple(residual.shape) != tuple(x.shape) or residual.dtype != x.dtype):
        raise ValueError(f"{op}: residual must be {x.dtype}{list(x.shape)} (x's shape and dtype), got "
                         f"{residual.dtype}{list(residual.shape)}")


def _check_mlp_weights(op, x, w_gate_up, w_down, norm_weight) -> int:
    """Trace-time checks of a gated MLP's weights against its input x [..., H]; returns I."""
    h = x.shape[-1]
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        if w.ndim != 2 or w.dtype != x.dtype:
            raise ValueError(f"{op}: {name} must be a matrix of x's dtype {x.dtype}, got "
                             f"{w.dtype}{list(w.shape)}")
    if w_gate_up.shape[1] != h:
        raise ValueError(f"{op}: w_gate_up must be [2 I, H={h}], got {list(w_gate_up.shape)}")
    inter = _check_operands(op, x, w_gate_up.shape[0], "w_gate_up", True, None, None, norm_weight)
    if tuple(w_down.shape) != (h, inter):
        raise ValueError(f"{op}: w_down must be [H={h}, I={inter}] (w_gate_up has 2 I rows), got "
                         f"{list(w_down.shape)}")
    return inter


def _fused_row_unsupported(name, x, backend, enabled, env) -> str | None:
    """The rules every fused one-row kernel shares (None when they hold): not the reference, one row
    of `x` (operand `name`), and for "auto" its switch on (`enabled()`, the variable `env`)."""
    if backend == "reference":
        return "backend='reference'"
    if math.prod(x.shape[:-1]) != 1:
        return f"{name} has {math.prod(x.shape[:-1])} rows: the kernel takes one (a decode step of batch 1)"
    if backend == "auto" and not enabled():
        return f"{env}=0"
    return None


def _gated_mlp_unsupported(x, h, inter, norm, backend, split: str) -> str | None:
    """Why the fused MLP kernel does not take this call (None when it does): one row, the switch, the
    gate-up projection's own kernel rules (dtype, JOA_LINEAR_KERNELS, the dense row kernel; it is
    built on it) and a grid for the shape."""
    why = _fused_row_unsupported("x", x, backend, cuda_matmul.gated_mlp_enabled, cuda_matmul.GATED_MLP_ENV)
    if why is not None:
        return why
    why = _kernel_unsupported(x, 2 * inter, cuda_matmul.DENSE_BITS, True, norm, backend=backend)
    if why is not None:
        return why
    if cuda_matmul.gated_mlp_grid(h, inter, split) == 0:
        return f"H={h}, I={inter}: not a geometry the kernel takes ({split} split; ffi/kernels/gemv/mlp_row.h)"
    return None


def out_mlp(a, w_o, x, w_gate_up, w_down, *, norm_weight=None, norm_epsilon: float = 1e-6,
            backend: str = "auto", pdl: bool = False):
    """A decoder layer's attention output projection and gated MLP, the residual stream through both:
    x1 = `linear(a, w_o, residual=x)`, then `gated_mlp(x1, w_gate_up, w_down, residual=x1,
    norm_weight=)`. One kernel (`cuda_matmul.out_mlp`: three phases of one persistent launch) for one
    row where it takes the shapes, else those two calls (each on its own route).

    Args:
      a: [..., Ho] float16 / bfloat16 (float32 / float64 on the reference): the attention's output,
        heads flattened.
      w_o: [H, Ho] of a's dtype.
      x: [..., H] of a's dtype (a's leading shape): the residual stream o's output is added to.
      w_gate_up: [2 I, H] of a's dtype, `interleave_gate_up(w_gate, w_up)`. w_down: [H, I].
      norm_weight: None or [H]: the MLP's RMS norm of x1 (norm_epsilon).
      backend: "auto" (the kernel under JOA_OUT_MLP=1, `cuda_matmul.out_mlp_enabled`, read at trace
        time), "reference" or "cuda" (the kernel, or NotImplementedError saying why not).
      pdl: as `linear`'s, for the calls when they run.

    Returns:
      [..., H] of a's dtype. The kernel adds every sum in the separate one-row kernels' order (the
      MLP's as its two GEMVs, not the fused MLP's default K split): their bits.
    """
    op = "out_mlp"
    a, w_o, x, w_gate_up, w_down = (_array(v) for v in (a, w_o, x, w_gate_up, w_down))
    norm_weight = _array(norm_weight)
    _check_x(op, a, "a")
    _check_x(op, x)
    for name, w in (("w_o", w_o), ("x", x)):
        if w.dtype != a.dtype:
            raise TypeError(f"{op}: {name} must have a's dtype {a.dtype}, got {w.dtype}")
    if x.shape[:-1] != a.shape[:-1]:
        raise ValueError(f"{op}: x must be [..., H] with a's leading shape {list(a.shape[:-1])}, got "
                         f"{list(x.shape)}")
    h, ho = x.shape[-1], a.shape[-1]
    if w_o.ndim != 2 or tuple(w_o.shape) != (h, ho):
        raise ValueError(f"{op}: w_o must be [H={h}, Ho={ho}], got {list(w_o.shape)}")
    inter = _check_mlp_weights(op, x, w_gate_up, w_down, norm_weight)
    eps = float(norm_epsilon)
    why = _out_mlp_unsupported(a, x, inter, norm_weight is not None, backend)
    if why is not None:
        if backend == "cuda":
            raise NotImplementedError(f"{op}: backend='cuda' is not available for this call: {why}")
        x1 = linear(a, w_o, residual=x, backend=backend, pdl=pdl)
        return gated_mlp(x1, w_gate_up, w_down, residual=x1, norm_weight=norm_weight, norm_epsilon=eps,
                         backend=backend, pdl=pdl)

    def ref_fn(a2, wo, x2, wgu, wdn, nw):
        x1 = reference.linear(a2, wo, None, x2)
        return reference.linear(reference.linear(x1, wgu, None, None, nw, eps, True), wdn, None, x1)

    def cuda_fn(a2, wo, x2, wgu, wdn, nw):
        return cuda_matmul.out_mlp(a2, wo, x2, wgu, wdn, nw, eps=eps)

    y = dispatch(op, backend, ref_fn, cuda_fn, a.reshape(1, ho), w_o, x.reshape(1, h), w_gate_up, w_down,
                 norm_weight)
    return y.reshape(x.shape)


def _out_mlp_unsupported(a, x, inter, norm, backend) -> str | None:
    """Why the out_mlp kernel does not take this call (None when it does): one row, the switch, the
    dense row kernel's rules for both projections it is built on (dtype, JOA_LINEAR_KERNELS) and a
    grid for the chain."""
    why = _fused_row_unsupported("a", a, backend, cuda_matmul.out_mlp_enabled, cuda_matmul.OUT_MLP_ENV)
    if why is not None:
        return why
    h, ho = x.shape[-1], a.shape[-1]
    why = (_kernel_unsupported(a, h, cuda_matmul.DENSE_BITS, False, False, backend=backend) or
           _kernel_unsupported(x, 2 * inter, cuda_matmul.DENSE_BITS, True, norm, backend=backend))
    if why is not None:
        return why
    if cuda_matmul.out_mlp_grid(h, ho, inter) == 0:
        return f"H={h}, Ho={ho}, I={inter}: not a geometry the kernel takes (ffi/kernels/gemv/row_chain.h)"
    return None


def matmul_nbits(x, b_quant, scales, zero_points=None, bias=None, *, k: int, n: int, bits: int,
                 block_size: int, residual=None, norm_weight=None, norm_epsilon: float = 1e-6,
                 gated: bool = False, backend: str = "auto", pdl: bool = False,
                 wide: bool | None = None, layout: str = "onnx"):
    """onnxruntime's MatMulNBits, y = x dequant(B)^T (+ bias), with `linear`'s fusions.

    Args:
      x: [..., K] float16 / bfloat16 (float32 / float64 on the reference); K a multiple of 8.
      b_quant, scales, zero_points: the kernels' form (`prepare_nbits`): uint8 [N, K / block_size,
        block_size * bits / 8], [N, K / block_size] of x's dtype, None (2^(bits-1)) or uint8
        [N, K / block_size], one zero point per block. scales and zero_points may also come tiled
        (`tile_nbits_meta`: [ceil(N / 16), K / block_size, 16]), the layout the kernels read;
        row-major ones are tiled on every call of the kernels. W[n, k] = (q - zp) * scale, exactly the
        ONNX lowering's dequantisation. With gated: rows interleaved (`interleave_gate_up_nbits`).
      bias: None or [N] of x's dtype.
      k, n, bits, block_size: the node's attributes (bits 4 or 8; block_size a power of two >= 16
        dividing K).
      residual, norm_weight, norm_epsilon, gated, backend, pdl: as `linear`. The kernels also need
        block_size >= the K of a lane's 16-byte piece (32 for 4 bits, 16 for 8); "auto" sends the
        rest to the reference.
      wide: the kernels' n-bit format (`cuda_matmul.nbits_wide`): each lane streams two 16-byte
        pieces of a row per chunk instead of one; the same results. None: the environment variable
        JOA_GEMV_NBITS_WIDE (default on). The reference ignores it.
      layout: "onnx" (the above) or "rows": 4-bit weights in the rows layout (`to_rows_layout`):
        b_quant uint8 [ceil(N / 64), K / 16, 512], scales [ceil(N / 64), K / block_size, 64] of x's
        dtype, zero_points uint8 of that shape or None; run by the rows kernel (for 2..32 rows of x
        at decode; block sizes 32 and 128) and elsewhere (M > 32: prefill; other block sizes; CPU)
        by the reference on the weights `from_rows_layout` gives back (XLA gathers them each call).
        Or "record": 4-bit weights in the record layout (`to_record_layout`): b_quant uint8
        [N / 16, K / 256, 2432] holding W, scales (x's dtype) and zero points; scales and
        zero_points None; block_size >= 32. One row of x runs on the slots kernel reading records
        (the same bits as the "onnx" layout's slots kernel); every other call (M > 1: prefill;
        CPU) on the reference over `from_record_layout`'s weights.

    Returns:
      [..., N_out] of x's dtype (N_out = N, or N / 2 when gated).
    """
    op = "matmul_nbits"
    x = _array(x)
    b_quant, scales, zero_points = _array(b_quant), _array(scales), _array(zero_points)
    bias, residual, norm_weight = _array(bias), _array(residual), _array(norm_weight)
    _check_x(op, x)
    if bits not in NBITS:
        raise NotImplementedError(f"{op}: bits={bits}: the kernels and their reference take {NBITS}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"{op}: block_size must be a power of two >= 16, got {block_size}")
    if k != x.shape[-1]:
        raise ValueError(f"{op}: x: K={x.shape[-1]} differs from the attribute k={k}")
    if k % block_size:
        raise ValueError(f"{op}: k={k} is not a multiple of block_size={block_size} (prepare_nbits "
                         "rejects such weights: keep the XLA path)")
    kb = k // block_size
    if layout not in LAYOUTS:
        raise ValueError(f"{op}: layout must be one of {LAYOUTS}, got {layout!r}")
    if layout == "record":
        return _matmul_nbits_record(x, b_quant, scales, zero_points, bias, residual, norm_weight, k=k,
                                    n=n, bits=bits, block_size=block_size, eps=float(norm_epsilon),
                                    gated=gated, backend=backend, pdl=pdl)
    if layout == "rows":
        return _matmul_nbits_rows(x, b_quant, scales, zero_points, bias, residual, norm_weight, k=k,
                                  n=n, bits=bits, block_size=block_size, eps=float(norm_epsilon),
                                  gated=gated, backend=backend, pdl=pdl)
    want = (n, kb, block_size * bits // 8)
    if b_quant.dtype != jnp.uint8 or tuple(b_quant.shape) != want:
        raise ValueError(f"{op}: b_quant must be uint8 {list(want)} (see prepare_nbits), got "
                         f"{b_quant.dtype}{list(b_quant.shape)}")
    tiled_shape = cuda_matmul.tiled_meta_shape(n, kb)
    if tuple(scales.shape) not in ((n, kb), tiled_shape):
        raise ValueError(f"{op}: scales must be [{n}, {kb}] (see prepare_nbits) or tiled "
                         f"{list(tiled_shape)} (tile_nbits_meta), got {list(scales.shape)}")
    tiled = scales.ndim == 3
    if scales.dtype != x.dtype:
        raise TypeError(f"{op}: scales must have x's dtype {x.dtype}, got {scales.dtype}")
    if zero_points is not None and (zero_points.dtype != jnp.uint8
                                    or tuple(zero_points.shape) != tuple(scales.shape)):
        raise ValueError(f"{op}: zero_points must be uint8 in scales' layout {list(scales.shape)}, "
                         f"one per block (see prepare_nbits), got {zero_points.dtype}"
                         f"{list(zero_points.shape)}")
    n_out = _check_operands(op, x, n, "b_quant", gated, bias, residual, norm_weight)
    eps = float(norm_epsilon)

    def ref_fn(x2, b_quant, scales, zero_points, bias, norm_weight, r2):
        if tiled:
            scales = untile_nbits_meta(scales, n)
            zero_points = None if zero_points is None else untile_nbits_meta(zero_points, n)
        return reference.matmul_nbits(x2, b_quant, scales, zero_points, bias, r2, norm_weight, eps,
                                      gated, bits=bits, block_size=block_size)

    why = _kernel_unsupported(x, n, bits, gated, norm_weight is not None, block_size, backend=backend,
                              wide=wide)
    cuda_fn = None
    if why is None:
        def cuda_fn(x2, b_quant, scales, zero_points, bias, norm_weight, r2):
            if not tiled:  # a transpose per call: tile at load (onnx.fusion does) to avoid it
                scales = tile_nbits_meta(scales)
                zero_points = None if zero_points is None else tile_nbits_meta(zero_points)
            return cuda_matmul.matmul_nbits(x2, b_quant, scales, zero_points, bias, r2, norm_weight,
                                            bits=bits, block_size=block_size, eps=eps, gated=gated,
                                            pdl=pdl, wide=wide)
    return _run(op, backend, ref_fn, cuda_fn, why, x, (b_quant, scales, zero_points, bias, norm_weight),
                residual, n_out)
