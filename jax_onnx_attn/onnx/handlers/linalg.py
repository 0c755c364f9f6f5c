"""Matrix products: MatMul, Gemm, Einsum and onnxruntime's weight-only quantised MatMulNBits.

float32 products run at HIGHEST precision (no TF32 on GPUs: parity with onnxruntime's fp32). Half
types are plain half-precision dots: XLA's GPU GEMMs (cuBLAS, Triton) accumulate them in float32
and round once, and XLA:CPU upcasts them to float32, so asking for a float32 result
(preferred_element_type) changes no value but makes XLA:GPU run a float32 GEMM on converted
weights (measured on the H200: 2x slower at decode, issue 12).

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax

from jax_onnx_attn.onnx.fusion import JOA_DOMAIN
from jax_onnx_attn.onnx.handlers.attention import GroupedKV, grouped_kv
from jax_onnx_attn.onnx.registry import MS_DOMAIN, register
from jax_onnx_attn.onnx.values import to_jax
from jax_onnx_attn.ops.reference.linear import unpack_nbits
from jax_onnx_attn.ops.dtypes import HALF_DTYPES


def _dot_kwargs(dtype) -> dict:
    if np.dtype(dtype) in HALF_DTYPES:
        return {}
    return dict(precision=lax.Precision.HIGHEST)


def matmul_jax(a, b):
    """a @ b (NumPy matmul broadcasting) in a's dtype with the module's precision rule."""
    a, b = to_jax(a), to_jax(b)
    if not jnp.issubdtype(a.dtype, jnp.floating):
        return jnp.matmul(a, b)
    return jnp.matmul(a, b, **_dot_kwargs(a.dtype)).astype(a.dtype)


@register("MatMul", 9, 13)
def matmul(ctx, a, b):
    """MatMul: NumPy broadcasting matmul; a 4-D product with torch's repeat_kv(K/V) skips the repeat."""
    if ctx.static:
        return np.matmul(a, b)
    if getattr(a, "ndim", 0) == 4 and getattr(b, "ndim", 0) == 4:
        grouped = grouped_kv(ctx, 1)
        if grouped is not None and a.shape[:2] == b.shape[:2]:
            return grouped_matmul(a, grouped)
    return matmul_jax(a, b)


def grouped_matmul(a, kv: GroupedKV):
    """a [B, Hkv*G, S, X] @ repeat_kv(kv) without materialising the expansion: the query heads of
    one KV head are batched against it, [B, Hkv, G, S, X] @ [B, Hkv, 1, X, Y]."""
    a = to_jax(a)
    rhs = kv.operand()
    b, hkv = rhs.shape[:2]
    y = matmul_jax(a.reshape(b, hkv, kv.groups, *a.shape[2:]), rhs[:, :, None])
    return y.reshape(b, hkv * kv.groups, *y.shape[3:])


@register("Gemm", 9, 11, 13)
def gemm(ctx, a, b, c=None):
    """Gemm: alpha * op(A) @ op(B) + beta * C, op = transpose per transA / transB."""
    a, b, c = ctx.operands(a, b, c)
    if ctx.attr("transA", 0):
        a = a.T
    if ctx.attr("transB", 0):
        b = b.T
    y = np.matmul(a, b) if ctx.static else matmul_jax(a, b)
    alpha, beta = ctx.attr("alpha", 1.0), ctx.attr("beta", 1.0)
    if alpha != 1.0:
        y = y * np.asarray(alpha, y.dtype)
    if c is not None:
        y = y + (c * np.asarray(beta, y.dtype) if beta != 1.0 else c)
    return y


@register("Einsum", 12, 28)
def einsum(ctx, *xs):
    """Einsum: the `equation` attribute over the inputs, in the first input's dtype."""
    eq = ctx.attr("equation")
    xs = ctx.operands(*xs)
    xs = xs if isinstance(xs, tuple) else (xs,)
    if ctx.static:
        return np.einsum(eq, *xs)
    kw = _dot_kwargs(xs[0].dtype) if jnp.issubdtype(xs[0].dtype, jnp.floating) else {}
    return jnp.einsum(eq, *xs, **kw).astype(xs[0].dtype)


def dequantize_nbits(b_quant, scales, zero_points, *, k: int, n: int, bits: int, block_size: int,
                     dtype):
    """MatMulNBits' B as a dense [K, N] matrix of `dtype`.

    b_quant: uint8 [N, k_blocks, block_size * bits / 8]; scales: [N * k_blocks] (or [N, k_blocks]);
    zero_points: None (midpoint 2^(bits-1)), uint8 packed [N * ceil(k_blocks * bits / 8)], or
    `dtype`-typed [N * k_blocks]. Element j of a block sits in bits (j % per_byte) * bits of byte
    j // per_byte, lowest first. W[k, n] = (q - zp) * scale[n, k // block_size].
    """
    k_blocks = -(-k // block_size)
    q = unpack_nbits(to_jax(b_quant).reshape(n, k_blocks, -1), bits)       # [N, kb, block]
    q = q[..., :block_size].astype(jnp.float32)
    s = to_jax(scales).reshape(n, k_blocks, 1).astype(jnp.float32)
    if zero_points is None:
        zp = jnp.float32(1 << (bits - 1))
    else:
        zp = to_jax(zero_points)
        if zp.dtype == jnp.uint8:
            zp = unpack_nbits(zp.reshape(n, -1), bits)[:, :k_blocks]
        zp = zp.reshape(n, k_blocks, 1).astype(jnp.float32)
    w = ((q - zp) * s).reshape(n, k_blocks * block_size)[:, :k]            # [N, K]
    return w.T.astype(dtype)


def quantize_blocks_int8(a, block_size: int):
    """A [..., K] rounded to int8 levels per block of `block_size` along K, back in a's dtype:
    onnxruntime's CPU MatMulNBits at accuracy_level=4 (MLAS CompInt8) multiplies these values.

    scale = max|block| / 127 (a zero block stays zero); q = round_half_even(a * (1 / scale)),
    clipped to [-127, 127]; returns q * scale.
    """
    a = to_jax(a)
    k = a.shape[-1]
    blocks = -(-k // block_size)
    x = a.astype(jnp.float32)
    x = jnp.pad(x, [(0, 0)] * (x.ndim - 1) + [(0, blocks * block_size - k)])
    x = x.reshape(x.shape[:-1] + (blocks, block_size))
    scale = jnp.max(jnp.abs(x), axis=-1, keepdims=True) / jnp.float32(127)
    inv = jnp.where(scale != 0, jnp.float32(1) / jnp.where(scale != 0, scale, 1), 0)
    q = jnp.clip(jnp.round(x * inv), -127, 127)                  # jnp.round: half to even
    return (q * scale).reshape(x.shape[:-2] + (blocks * block_size,))[..., :k].astype(a.dtype)


@register("MatMulNBits", 1, domain=MS_DOMAIN)
def matmul_nbits(ctx, a, b_quant, scales, zero_points=None, g_idx=None, bias=None):
    """A [..., K] @ dequant(B) [K, N] (+ bias [N]); 2- to 8-bit weights in blocks along K.

    The weight is dequantised inside the traced program (XLA fuses it into the product), so params
    keep the packed bytes. accuracy_level is a speed hint for onnxruntime: at level 4 its CPU kernel
    quantises A to int8 per block; the result here is the exact product with the dequantised weight,
    unless the model was loaded with int8_activations=True (then A is quantised as onnxruntime's
    CPU kernel does, see quantize_blocks_int8).
    """
    if g_idx is not None:
        ctx.fail("g_idx (act-order) weights are not supported", NotImplementedError)
    k, n, bits, block = (int(ctx.attr(x)) for x in ("K", "N", "bits", "block_size"))
    if bits not in (2, 4, 8):
        ctx.fail(f"bits={bits} is not supported (2, 4 or 8)", NotImplementedError)
    a = to_jax(a)
    if ctx.attr("accuracy_level", 0) == 4 and ctx.interp.options.get("int8_activations"):
        a = quantize_blocks_int8(a, block)
    w = dequantize_nbits(b_quant, scales, zero_points, k=k, n=n, bits=bits, block_size=block,
                         dtype=a.dtype)
    y = matmul_jax(a, w)
    if bias is not None:
        y = y + to_jax(bias).astype(y.dtype)
    return y


@register("Linear", 1, domain=JOA_DOMAIN)
def fused_linear(ctx, x, w, scales=None, zero_points=None, bias=None, residual=None,
                 norm_weight=None):
    """jax_onnx_attn::Linear, the load-time fusion of MatMul / MatMulNBits with their neighbours
    (see `onnx.fusion`): y = rms_norm(x)·W (+ bias) (+ residual), or silu(gate)·up when gated.

    Args:
      x: [..., K] float. w: [N, K] of x's dtype (weight-major; [K, N] with attribute layout="kn",
        `onnx.fusion`'s dense_layout), or MatMulNBits' packed uint8
        [N, k_blocks, block_size·bits/8] when attribute bits > 0 (then scales and zero_points
        (None or uint8) [N, k_blocks] as `ops.prepare_nbits` returns them, or tiled
        [ceil(N/16), k_blocks, 16] as `ops.tile_nbits_meta` makes them at load); with attribute
        layout="rows", all three in the rows layout (`ops.to_rows_layout`); with layout="record",
        w the record layout (`ops.to_record_layout`, W with its scales and zero points), scales
        and zero_points absent. With attribute qkv_pairs = [N, Hkv, D, R/2] the rows (and bias,
        scales, zero points) are in `ops.rotary_pair_order` (`onnx.fusion` pass 5) and y is put
        back in the original order.
      bias: [N] or None. residual: [..., N_out] or None. norm_weight: [K] or None (attribute
        norm_epsilon). Attribute gated=1: W's rows interleave gate and up (`ops.interleave_gate_up`)
        and y is [..., N/2].

    Returns:
      y [..., N] (or [..., N/2] gated) in x's dtype.
    """
    from jax_onnx_attn import ops

    x, w, scales, zero_points, bias, residual, norm_weight = (
        to_jax(v) for v in (x, w, scales, zero_points, bias, residual, norm_weight))
    # pdl: the kernel may start streaming W before the previous kernel ends: W is a param, which
    # nothing in the program writes (x and the residual are read only after the wait).
    common = dict(residual=residual, norm_weight=norm_weight,
                  norm_epsilon=float(ctx.attr("norm_epsilon", 1e-6)),
                  gated=bool(ctx.attr("gated", 0)), pdl=True)
    bits = int(ctx.attr("bits", 0))
    w_layout = "nk" if bits else ctx.attr("layout", "nk")
    n_out = int(ctx.attr("N")) if bits else w.shape[w_layout == "kn"]
    out_shape = x.shape[:-1] + (n_out // 2 if common["gated"] else n_out,)
    late = None
    if residual is not None and (residual.shape != out_shape or residual.dtype != x.dtype):
        late, common["residual"] = residual, None  # a broadcasting add: after the product
    if bits:
        y = ops.matmul_nbits(x, w, scales, zero_points, bias, k=int(ctx.attr("K")), n=n_out,
                             bits=bits, block_size=int(ctx.attr("block_size")),
                             layout=ctx.attr("layout", "onnx"), **common)
    else:
        y = ops.linear(x, w, bias, w_layout=w_layout, **common)
    pairs = ctx.attr("qkv_pairs")
    if pairs is not None:
        # Read only where GroupQueryAttention's fused route does not take the projection itself.
        y = ops.from_rotary_pair_order(y, ops.rotary_pair_order(*(int(v) for v in pairs)))
    return y if late is None else y + late


def _fusable_residual(x, residual):
    """(residual for the fused op's epilogue, residual to add after it): a residual of x's shape and
    dtype goes into the op; another (a broadcast, another dtype) is added after, the graph's way."""
    if residual is not None and (residual.shape != x.shape or residual.dtype != x.dtype):
        return None, residual
    return residual, None


@register("GatedMlp", 1, domain=JOA_DOMAIN)
def fused_gated_mlp(ctx, x, w_gate_up, w_down, residual=None, norm_weight=None):
    """jax_onnx_attn::GatedMlp (`onnx.fusion` pass 4b): a gated Linear and the down projection that
    alone reads it, `ops.gated_mlp`: y = down(silu(gate)·up of rms_norm(x)) (+ residual).

    Args:
      x: [..., H]. w_gate_up: [2 I, H] (`ops.interleave_gate_up`). w_down: [H, I].
      residual: [..., H] or None (another shape: added after, the broadcasting way).
      norm_weight: [H] or None (attribute norm_epsilon).

    Returns:
      y [..., H] in x's dtype.
    """
    from jax_onnx_attn import ops

    x, w_gate_up, w_down, residual, norm_weight = (
        to_jax(v) for v in (x, w_gate_up, w_down, residual, norm_weight))
    residual, late = _fusable_residual(x, residual)
    y = ops.gated_mlp(x, w_gate_up, w_down, residual=residual, norm_weight=norm_weight,
                      norm_epsilon=float(ctx.attr("norm_epsilon", 1e-6)), pdl=True)
    return y if late is None else y + late


@register("OutMlp", 1, domain=JOA_DOMAIN)
def fused_out_mlp(ctx, a, w_o, x, w_gate_up, w_down, norm_weight=None):
    """jax_onnx_attn::OutMlp (`onnx.fusion` pass 4c): the attention's output projection with its
    residual and the GatedMlp that alone reads it, `ops.out_mlp`: x1 = a W_o^T + x, then
    y = x1 + down(silu(gate)·up of rms_norm(x1)).

    Args:
      a: [..., Ho]. w_o: [H, Ho]. x: [..., H] (another shape: added after o, the broadcasting way,
        and the two calls run). w_gate_up: [2 I, H] (`ops.interleave_gate_up`). w_down: [H, I].
      norm_weight: [H] or None (attribute norm_epsilon).

    Returns:
      y [..., H] in a's dtype.
    """
    from jax_onnx_attn import ops

    a, w_o, x, w_gate_up, w_down, norm_weight = (to_jax(v) for v in (a, w_o, x, w_gate_up, w_down, norm_weight))
    eps = float(ctx.attr("norm_epsilon", 1e-6))
    if x.shape != a.shape[:-1] + (w_o.shape[0],) or x.dtype != a.dtype:
        x1 = ops.linear(a, w_o, pdl=True) + x
        return ops.gated_mlp(x1, w_gate_up, w_down, residual=x1, norm_weight=norm_weight, norm_epsilon=eps,
                             pdl=True)
    return ops.out_mlp(a, w_o, x, w_gate_up, w_down, norm_weight=norm_weight, norm_epsilon=eps, pdl=True)
