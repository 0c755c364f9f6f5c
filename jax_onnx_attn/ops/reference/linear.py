"""Projections (y = x W^T with fusions) and onnxruntime's MatMulNBits: the executable spec of the
GEMV kernels (ffi/kernels/gemv/), and the path for every shape the kernels do not take.

The roundings are those of the unfused graph: optional RMS norm (rounded to x's dtype), the product
(a plain half-precision dot: f32 accumulation inside XLA's GEMM, one rounding), + bias (rounded),
gated SiLU (silu(gate) * up in f32 from the rounded halves, rounded), + residual (rounded).
float32 products run at HIGHEST precision (no TF32), as the ONNX lowering does.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from jax_onnx_attn.ops.dtypes import HALF_DTYPES
from jax_onnx_attn.ops.reference.norm import rms_norm


def _product(x, w, kn: bool = False):
    """x [..., K] @ w[N, K]^T (w [K, N] with kn: x @ w) in x's dtype."""
    wt = w if kn else w.T
    if jnp.dtype(x.dtype) in HALF_DTYPES:
        return x @ wt  # XLA's half GEMM: f32 accumulation, one rounding (no f32 GEMM on converted W)
    return jnp.matmul(x, wt, precision=lax.Precision.HIGHEST).astype(x.dtype)


def linear(x, w, bias=None, residual=None, norm_weight=None, norm_epsilon: float = 1e-6,
           gated: bool = False, kn: bool = False):
    """y = x W^T with the fusions of `jax_onnx_attn.ops.linear` (same arguments, no validation).

    Args:
      x: [..., K] float.
      w: [N, K] of x's dtype; with gated, gate and up rows interleaved in blocks of 8
        (`jax_onnx_attn.ops.linear.interleave_gate_up`), N = 2 I.
      bias: None or [N] (interleaved like w's rows when gated).
      residual: None or [..., N_out].
      norm_weight: None or [K]: x is first RMS-normalised (`rms_norm`) with it and norm_epsilon.
      gated: y = silu(x Wg^T + bg) * (x Wu^T + bu), N_out = N / 2.
      kn: w is stored [K, N] (its transpose; gated: gate / up columns interleaved in blocks of 8).

    Returns:
      [..., N_out] of x's dtype.
    """
    if norm_weight is not None:
        x = rms_norm(x, norm_weight, norm_epsilon)
    y = _product(x, w, kn)
    if bias is not None:
        y = y + bias.astype(y.dtype)
    if gated:
        from jax_onnx_attn.ops.linear import split_gate_up  # the one definition of the layout
        gate, up = split_gate_up(y)
        acc = jnp.float32 if y.dtype != jnp.float64 else jnp.float64
        y = (jax.nn.silu(gate.astype(acc)) * up.astype(acc)).astype(y.dtype)
    if residual is not None:
        y = y + residual.astype(y.dtype)
    return y


def unpack_nbits(packed, bits: int):
    """uint8 [..., n_bytes] -> uint8 [..., n_bytes * 8 / bits]: element j of a byte run sits in
    bits (j % (8 / bits)) * bits of byte j // (8 / bits), lowest first (onnxruntime's packing)."""
    if bits == 8:
        return packed
    per_byte = 8 // bits
    shifts = jnp.arange(per_byte, dtype=jnp.uint8) * bits
    vals = (packed[..., None] >> shifts) & jnp.uint8((1 << bits) - 1)
    return vals.reshape(packed.shape[:-1] + (packed.shape[-1] * per_byte,))


def dequantize_nbits(b_quant, scales, zero_points, *, bits: int, block_size: int, dtype):
    """The dense [N, K] weight of MatMulNBits operands in the kernels' form (see
    `jax_onnx_attn.ops.linear.prepare_nbits`): W[n, k] = (q - zp) * scale, computed in f32 and
    rounded once to `dtype` (the values of the ONNX lowering's dequantisation).

    Args:
      b_quant: uint8 [N, k_blocks, block_size * bits / 8].
      scales: [N, k_blocks].
      zero_points: None (2^(bits - 1)) or uint8 [N, k_blocks], one value each.
      bits: 4 or 8.
      block_size: K elements per block.
      dtype: the result's dtype.
    """
    n, k_blocks = b_quant.shape[0], b_quant.shape[1]
    q = unpack_nbits(b_quant, bits)[..., :block_size].astype(jnp.float32)  # [N, kb, bs]
    zp = (jnp.float32(1 << (bits - 1)) if zero_points is None
          else zero_points.reshape(n, k_blocks, 1).astype(jnp.float32))
    s = scales.reshape(n, k_blocks, 1).astype(jnp.float32)
    return ((q - zp) * s).reshape(n, k_blocks * block_size).astype(dtype)


def matmul_nbits(x, b_quant, scales, zero_points=None, bias=None, residual=None, norm_weight=None,
                 norm_epsilon: float = 1e-6, gated: bool = False, *, bits: int, block_size: int):
    """`linear` with the weight `dequantize_nbits(b_quant, scales, zero_points)` in x's dtype."""
    w = dequantize_nbits(b_quant, scales, zero_points, bits=bits, block_size=block_size,
                         dtype=x.dtype)
    return linear(x, w, bias, residual, norm_weight, norm_epsilon, gated)
