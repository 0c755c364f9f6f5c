"""Block-wise weight quantisation as onnxruntime's `MatMulNBitsQuantizer` (MLAS) writes it.

onnxruntime-genai's model builder quantises every projection and the LM head with
`onnxruntime.quantization.matmul_nbits_quantizer` (QOperator format), whose kernel is MLAS's
`MlasQuantizeBlockwise`. For a MatMul weight W [K, N] and block size `bs`, each column n is cut into
kb = ceil(K / bs) blocks along K (the last one zero-padded) and every block gets one scale:

  * symmetric (the builder's default; no zero-points input): m = the block's value of largest
    magnitude, with its sign; scale = -m / 2^(bits-1); the implicit zero point is 2^(bits-1), so m
    itself lands on code 0.
  * asymmetric (zero points): lo = min(min, 0), hi = max(max, 0); scale = (hi - lo) / (2^bits - 1);
    zp = clamp(roundf(-lo / scale), 0, 2^bits - 1) (zp = 0 for an all-zero block).

  code = clamp(roundf(v * (1 / scale) + zp), 0, 2^bits - 1)   (roundf: half away from zero; the
  scale is first rounded to the scales' dtype, then its float32 reciprocal taken)

Layouts (MatMulNBits' inputs): B uint8 [N, kb, bs * bits / 8], element j of a block in bits
(j % per_byte) * bits of byte j // per_byte (low nibble first for int4); codes of the padding past K are 0; scales [N, kb] in the
weight's dtype (bf16 weights are quantised in float32, scales cast to bf16); zero points uint8
[N, ceil(kb * bits / 8)], packed the same way along the blocks. Dequantised:
W[k, n] = (code - zp) * scale[n, k // bs].

`tests/test_models_quant.py` holds this to onnxruntime's own quantiser (byte for byte) and to the
builder's int4 / int8 fixtures.
"""

from __future__ import annotations

from typing import NamedTuple

import ml_dtypes
import numpy as np

#: Bit widths MatMulNBits models use here.
BITS = (4, 8)


class Quantized(NamedTuple):
    """One MatMulNBits weight: packed codes, scales and (asymmetric only) packed zero points."""

    packed: np.ndarray          # uint8 [N, kb, bs * bits / 8]
    scales: np.ndarray          # [N, kb], the weight's dtype (float32 / float16 / bfloat16)
    zero_points: np.ndarray | None  # uint8 [N, ceil(kb * bits / 8)] or None (symmetric)


def _check(bits: int, block_size: int) -> None:
    if bits not in BITS:
        raise ValueError(f"bits must be one of {BITS}, got {bits}")
    if block_size < 16 or block_size & (block_size - 1):
        raise ValueError(f"block_size must be a power of two >= 16 (MatMulNBits), got {block_size}")


def _roundf(x: np.ndarray) -> np.ndarray:
    """C's roundf on float32 values: half away from zero (exact, through float64)."""
    x64 = x.astype(np.float64)
    return (np.sign(x64) * np.floor(np.abs(x64) + 0.5)).astype(np.float32)


def pack_codes(codes: np.ndarray, bits: int) -> np.ndarray:
    """uint8 codes [..., n] (n a multiple of 8 / bits) packed along the last axis, lowest bits first."""
    if bits == 8:
        return codes.astype(np.uint8)
    per = 8 // bits
    c = codes.astype(np.uint8).reshape(codes.shape[:-1] + (codes.shape[-1] // per, per))
    out = np.zeros(c.shape[:-1], np.uint8)
    for j in range(per):
        out |= c[..., j] << np.uint8(j * bits)
    return out


def unpack_codes(packed: np.ndarray, bits: int) -> np.ndarray:
    """The inverse of `pack_codes`: uint8 [..., m] -> codes [..., m * 8 / bits]."""
    if bits == 8:
        return packed.astype(np.uint8)
    per = 8 // bits
    mask = np.uint8((1 << bits) - 1)
    parts = [(packed >> np.uint8(j * bits)) & mask for j in range(per)]
    return np.stack(parts, axis=-1).reshape(packed.shape[:-1] + (packed.shape[-1] * per,))


def quantize_blocks(wt: np.ndarray, bits: int, block_size: int, symmetric: bool = True,
                    scale_dtype=None) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Quantise the rows of a transposed weight Wᵀ [N, K] block by block (see the module doc).

    Returns (codes uint8 [N, kb, block_size] unpacked, scales [N, kb] of `scale_dtype` (default
    wt's dtype; float32 for bfloat16), zero points uint8 [N, kb] or None when symmetric).
    """
    _check(bits, block_size)
    wt = np.asarray(wt)
    if wt.ndim != 2:
        raise ValueError(f"quantize_blocks expects a 2-D Wᵀ [N, K], got shape {wt.shape}")
    if scale_dtype is None:
        scale_dtype = np.float32 if wt.dtype == ml_dtypes.bfloat16 else wt.dtype
    scale_dtype = np.dtype(scale_dtype)
    n, k = wt.shape
    kb = -(-k // block_size)
    x = wt.astype(np.float32)
    if kb * block_size != k:
        x = np.pad(x, ((0, 0), (0, kb * block_size - k)))
    x = x.reshape(n, kb, block_size)
    qmax = np.float32((1 << bits) - 1)
    if symmetric:
        lo, hi = x.min(axis=-1), x.max(axis=-1)
        m = np.where(np.abs(hi) > np.abs(lo), hi, lo)
        scale = (-m / np.float32(1 << (bits - 1))).astype(scale_dtype)
        zp = np.full(scale.shape, np.float32(1 << (bits - 1)), np.float32)
    else:
        lo = np.minimum(x.min(axis=-1), np.float32(0))
        hi = np.maximum(x.max(axis=-1), np.float32(0))
        scale_f = (hi - lo) / qmax
        safe = np.where(scale_f != 0, scale_f, np.float32(1))
        zp_f = np.where(scale_f != 0, np.float32(0) - lo / safe, lo)
        zp = np.clip(_roundf(zp_f), 0, qmax).astype(np.float32)
        zp = np.where(zp_f < 0, np.float32(0), zp)
        scale = scale_f.astype(scale_dtype)
    s = scale.astype(np.float32)
    recip = np.where(s != 0, np.float32(1) / np.where(s != 0, s, np.float32(1)), np.float32(0))
    codes = np.clip(_roundf(x * recip[..., None] + zp[..., None]), 0, qmax).astype(np.uint8)
    if kb * block_size != k:  # MLAS leaves the padding's codes at 0
        codes.reshape(n, kb * block_size)[:, k:] = 0
    return codes, scale, None if symmetric else zp.astype(np.uint8)


def quantize_nbits(w: np.ndarray, bits: int = 4, block_size: int = 32, symmetric: bool = True
                   ) -> Quantized:
    """A MatMul weight W [K, N] as MatMulNBits' packed inputs, exactly as onnxruntime's quantiser
    writes them (scales in W's dtype; bfloat16 scales from a float32 quantisation)."""
    w = np.asarray(w)
    if w.ndim != 2:
        raise ValueError(f"quantize_nbits expects a 2-D weight [K, N], got shape {w.shape}")
    codes, scales, zp = quantize_blocks(w.T, bits, block_size, symmetric)
    if w.dtype == ml_dtypes.bfloat16:
        scales = scales.astype(ml_dtypes.bfloat16)
    return Quantized(pack_codes(codes, bits), scales, None if zp is None else pack_zero_points(zp, bits))


def pack_zero_points(zp: np.ndarray, bits: int) -> np.ndarray:
    """uint8 zero points [N, kb] -> [N, ceil(kb * bits / 8)] (int4: two blocks a byte, low first; an
    odd kb's last nibble holds the midpoint 2^(bits-1), as MLAS leaves it)."""
    per = 8 // bits
    kb = zp.shape[-1]
    pad = -kb % per
    if pad:
        zp = np.pad(zp, ((0, 0), (0, pad)), constant_values=1 << (bits - 1))
    return pack_codes(zp, bits)


def dequantize_nbits(q: Quantized, k: int, bits: int, block_size: int) -> np.ndarray:
    """float32 W [K, N] from MatMulNBits' inputs: (code - zp) * scale (see the module doc)."""
    n, kb, _ = q.packed.shape
    codes = unpack_codes(q.packed, bits)[..., :block_size].astype(np.float32)
    if q.zero_points is None:
        zp = np.float32(1 << (bits - 1))
    else:
        zp = unpack_codes(q.zero_points, bits)[:, :kb].astype(np.float32)[..., None]
    w = (codes - zp) * q.scales.astype(np.float32)[..., None]
    return w.reshape(n, kb * block_size)[:, :k].T


def nbits_bytes(k: int, n: int, bits: int, block_size: int, symmetric: bool, scale_itemsize: int) -> int:
    """Bytes of MatMulNBits' B + scales (+ zero points) for a [K, N] weight."""
    kb = -(-k // block_size)
    size = n * kb * block_size * bits // 8 + n * kb * scale_itemsize
    if not symmetric:
        size += n * -(-kb * bits // 8)
    return size


__all__ = ["Quantized", "BITS", "quantize_nbits", "quantize_blocks", "dequantize_nbits", "pack_codes",
           "unpack_codes", "pack_zero_points", "nbits_bytes"]
