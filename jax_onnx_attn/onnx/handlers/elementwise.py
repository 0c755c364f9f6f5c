"""Element-wise ops: arithmetic, comparisons, logic, unary math, activations, Where, Cast, Clip.

All broadcast with NumPy rules (ONNX multidirectional broadcasting). Each works in NumPy when its
inputs are static and in jax.numpy otherwise.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_onnx_attn.onnx.registry import MS_DOMAIN, register
from jax_onnx_attn.onnx.values import is_static, to_jax


def _eager(fn, *args):
    """jax.numpy `fn` on static inputs, evaluated now and returned as NumPy (for functions NumPy
    lacks, e.g. erf): the result stays foldable."""
    with jax.ensure_compile_time_eval():
        return np.asarray(fn(*[jnp.asarray(a) for a in args]))


def _unary(np_fn, jnp_fn=None):
    jnp_fn = jnp_fn or getattr(jnp, np_fn.__name__)

    def handler(ctx, x):
        if ctx.static:
            return np.asarray(np_fn(x) if np_fn is not None else _eager(jnp_fn, x)).astype(x.dtype)
        return jnp_fn(to_jax(x))
    return handler


def _int_div(xp, a, b):
    """C-style integer division (truncates toward zero), which is what ONNX Div does on integers."""
    q = xp.floor_divide(a, b)
    fix = (xp.remainder(a, b) != 0) & ((a < 0) != (b < 0))
    return xp.where(fix, q + 1, q)


def _div(xp, a, b):
    if np.issubdtype(np.dtype(a.dtype), np.integer):
        return _int_div(xp, a, b)
    return xp.divide(a, b)


def _pow(xp, a, b):
    # ONNX Pow keeps the base's type (an integer exponent does not promote a float base).
    if np.issubdtype(np.dtype(a.dtype), np.floating) and b.dtype != a.dtype:
        b = b.astype(a.dtype)
    return xp.power(a, b).astype(a.dtype)


_BINARY = {
    "Add": ((7, 13, 14), lambda xp, a, b: xp.add(a, b)),
    "Sub": ((7, 13, 14), lambda xp, a, b: xp.subtract(a, b)),
    "Mul": ((7, 13, 14), lambda xp, a, b: xp.multiply(a, b)),
    "Div": ((7, 13, 14), _div),
    "Pow": ((7, 12, 13, 15), _pow),
    "Equal": ((7, 11, 13, 19), lambda xp, a, b: xp.equal(a, b)),
    "Less": ((7, 9, 13), lambda xp, a, b: xp.less(a, b)),
    "LessOrEqual": ((12, 16), lambda xp, a, b: xp.less_equal(a, b)),
    "Greater": ((7, 9, 13), lambda xp, a, b: xp.greater(a, b)),
    "GreaterOrEqual": ((12, 16), lambda xp, a, b: xp.greater_equal(a, b)),
    "And": ((7,), lambda xp, a, b: xp.logical_and(a, b)),
    "Or": ((7,), lambda xp, a, b: xp.logical_or(a, b)),
    "Xor": ((7,), lambda xp, a, b: xp.logical_xor(a, b)),
    "BitwiseAnd": ((18,), lambda xp, a, b: xp.bitwise_and(a, b)),
    "BitwiseOr": ((18,), lambda xp, a, b: xp.bitwise_or(a, b)),
}


def _binary_handler(fn):
    def handler(ctx, a, b):
        a, b = ctx.operands(a, b)
        out = fn(ctx.xp, a, b)
        return np.asarray(out) if ctx.static else out
    return handler


for _name, (_versions, _fn) in _BINARY.items():
    register(_name, *_versions)(_binary_handler(_fn))


@register("Mod", 10, 13, 28)
def mod(ctx, a, b):
    """Mod: remainder with the divisor's sign, or the dividend's (C fmod) with fmod=1."""
    a, b = ctx.operands(a, b)
    xp = ctx.xp
    # fmod=1: the result has the dividend's sign (C fmod); fmod=0: the divisor's (Python %).
    out = xp.fmod(a, b) if ctx.attr("fmod", 0) else xp.remainder(a, b)
    return np.asarray(out) if ctx.static else out


def _variadic(fn):
    def handler(ctx, *xs):
        xs = ctx.operands(*xs)
        xs = xs if isinstance(xs, tuple) else (xs,)
        out = xs[0]
        for x in xs[1:]:
            out = fn(ctx.xp, out, x)
        return np.asarray(out) if ctx.static else out
    return handler


register("Max", 8, 12, 13)(_variadic(lambda xp, a, b: xp.maximum(a, b)))
register("Min", 8, 12, 13)(_variadic(lambda xp, a, b: xp.minimum(a, b)))
register("Sum", 8, 13)(_variadic(lambda xp, a, b: xp.add(a, b)))


@register("Mean", 8, 13)
def mean(ctx, *xs):
    """Mean: the element-wise mean of the inputs, in the first input's dtype."""
    total = _variadic(lambda xp, a, b: xp.add(a, b))(ctx, *xs)
    return (total / len(xs)).astype(total.dtype)


@register("Not", 1)
def not_(ctx, x):
    """Not: logical not of a bool tensor."""
    return np.logical_not(x) if ctx.static else jnp.logical_not(to_jax(x))


def _sigmoid(x):
    return 1.0 / (1.0 + np.exp(-x))


_UNARY = {
    "Neg": ((6, 13), np.negative, jnp.negative),
    "Abs": ((6, 13), np.abs, jnp.abs),
    "Sqrt": ((6, 13), np.sqrt, jnp.sqrt),
    "Exp": ((6, 13), np.exp, jnp.exp),
    "Log": ((6, 13), np.log, jnp.log),
    "Sin": ((7, 22), np.sin, jnp.sin),
    "Cos": ((7, 22), np.cos, jnp.cos),
    "Tanh": ((6, 13), np.tanh, jnp.tanh),
    "Floor": ((6, 13), np.floor, jnp.floor),
    "Ceil": ((6, 13), np.ceil, jnp.ceil),
    "Round": ((11, 22), np.round, jnp.round),  # both round half to even, as ONNX does
    "Sign": ((9, 13), np.sign, jnp.sign),
    "Reciprocal": ((6, 13), np.reciprocal, jnp.reciprocal),
    "Sigmoid": ((6, 13), _sigmoid, jax.nn.sigmoid),
    "Erf": ((9, 13), None, jax.scipy.special.erf),
    "Relu": ((6, 13, 14), lambda x: np.maximum(x, 0), jax.nn.relu),
    "Softsign": ((1, 22), lambda x: x / (1 + np.abs(x)), jax.nn.soft_sign),
    "Softplus": ((1, 22), None, jax.nn.softplus),
}

for _name, (_versions, _np, _jnp) in _UNARY.items():
    register(_name, *_versions)(_unary(_np, _jnp))


@register("IsNaN", 9, 13, 20)
def isnan(ctx, x):
    """IsNaN: bool tensor, True where x is NaN."""
    return np.isnan(x) if ctx.static else jnp.isnan(to_jax(x))


@register("IsInf", 10, 20)
def isinf(ctx, x):
    """IsInf: bool tensor, True at +inf / -inf as detect_positive / detect_negative ask."""
    xp = ctx.xp
    x = ctx.operands(x)
    pos = (x == np.inf) if ctx.attr("detect_positive", 1) else xp.zeros(x.shape, bool)
    neg = (x == -np.inf) if ctx.attr("detect_negative", 1) else xp.zeros(x.shape, bool)
    return pos | neg


def _activation(fn):
    def handler(ctx, x):
        if ctx.static:
            return _eager(lambda v: fn(ctx, v), x).astype(x.dtype)
        return fn(ctx, to_jax(x))
    return handler


register("LeakyRelu", 6, 16)(_activation(
    lambda ctx, x: jnp.where(x >= 0, x, x * jnp.asarray(ctx.attr("alpha", 0.01), x.dtype))))
register("Elu", 6, 22)(_activation(
    lambda ctx, x: jnp.where(x > 0, x, jnp.asarray(ctx.attr("alpha", 1.0), x.dtype) * jnp.expm1(x))))
register("Selu", 6, 22)(_activation(
    lambda ctx, x: jnp.asarray(ctx.attr("gamma", 1.0507009873554805), x.dtype) * jnp.where(
        x > 0, x, jnp.asarray(ctx.attr("alpha", 1.6732632423543772), x.dtype) * jnp.expm1(x))))
register("HardSigmoid", 6, 22)(_activation(
    lambda ctx, x: jnp.clip(x * ctx.attr("alpha", 0.2) + ctx.attr("beta", 0.5), 0, 1).astype(x.dtype)))
register("HardSwish", 14, 22)(_activation(
    lambda ctx, x: (x * jnp.clip(x / 6 + 0.5, 0, 1)).astype(x.dtype)))
register("Swish", 24)(_activation(
    lambda ctx, x: x * jax.nn.sigmoid(x * jnp.asarray(ctx.attr("alpha", 1.0), x.dtype))))
register("Mish", 18, 22)(_activation(lambda ctx, x: x * jnp.tanh(jax.nn.softplus(x))))


def _gelu(x, approximate: str):
    """Gelu in float32 for half inputs (as onnxruntime's kernels do), back to the input's dtype."""
    acc = x.astype(jnp.promote_types(x.dtype, jnp.float32))
    if approximate == "tanh":
        c = math.sqrt(2.0 / math.pi)
        y = 0.5 * acc * (1.0 + jnp.tanh(c * (acc + 0.044715 * acc ** 3)))
    else:
        y = 0.5 * acc * (1.0 + jax.scipy.special.erf(acc / math.sqrt(2.0)))
    return y.astype(x.dtype)


register("Gelu", 20)(_activation(lambda ctx, x: _gelu(x, ctx.attr("approximate", "none"))))
# onnxruntime contrib activations (the builder's Gemma/GPT-style MLPs).
register("Gelu", 1, domain=MS_DOMAIN)(_activation(lambda ctx, x: _gelu(x, "none")))
register("QuickGelu", 1, domain=MS_DOMAIN)(_activation(
    lambda ctx, x: x * jax.nn.sigmoid(x * jnp.asarray(ctx.attr("alpha", 1.702), x.dtype))))


@register("FastGelu", 1, domain=MS_DOMAIN)
def fast_gelu(ctx, x, bias=None):
    """com.microsoft FastGelu: tanh-approximated Gelu of x (+ bias)."""
    if bias is not None:
        x = ctx.operands(x) + ctx.operands(bias)
    return _activation(lambda c, v: _gelu(v, "tanh"))(ctx, x)


@register("BiasGelu", 1, domain=MS_DOMAIN)
def bias_gelu(ctx, x, bias):
    """com.microsoft BiasGelu: exact (erf) Gelu of x + bias."""
    return _activation(lambda c, v: _gelu(v, "none"))(ctx, ctx.operands(x) + ctx.operands(bias))


@register("Where", 9, 16)
def where(ctx, cond, a, b):
    """Where: a where cond (bool) else b, broadcast."""
    cond, a, b = ctx.operands(cond, a, b)
    return ctx.xp.where(cond, a, b)


#: float8 types that Cast saturates (attribute saturate=1, the default): out-of-range -> +-max.
_SATURATING_FLOAT8 = tuple(np.dtype(t) for t in (
    ml_dtypes.float8_e4m3fn, ml_dtypes.float8_e4m3fnuz, ml_dtypes.float8_e5m2,
    ml_dtypes.float8_e5m2fnuz))
#: Sub-byte integer types (bits, signed): a float goes through int32 (truncation), then any value
#: wraps modulo 2^bits, as the ONNX reference does. The wrap is spelled out rather than left to the
#: dtype conversion (ml_dtypes 0.7 turns an out-of-range float into 0 for these types).
SUB_BYTE_INTS = {np.dtype(ml_dtypes.int4): (4, True), np.dtype(ml_dtypes.uint4): (4, False),
                np.dtype(ml_dtypes.int2): (2, True), np.dtype(ml_dtypes.uint2): (2, False)}
_E8M0 = np.dtype(ml_dtypes.float8_e8m0fnu)


def _to_e8m0(xp, x, saturate: bool, round_mode: str):
    """float8e8m0 (a power of two) from float32 bits, as onnx.numpy_helper.to_float8e8m0."""
    bits = x.astype(np.float32).view(np.uint32) if xp is np else \
        jax.lax.bitcast_convert_type(x.astype(jnp.float32), jnp.uint32)
    exponent = ((bits >> 23) & 0xFF).astype(np.int32)
    special = exponent == 0xFF
    if round_mode == "nearest":
        g = (bits & 0x400000) > 0
        r = (bits & 0x200000) > 0
        sticky = (bits & 0x1FFFFF) > 0
        up = g & (r | sticky | (exponent > 0))
    elif round_mode == "up":
        up = (bits & 0x7FFFFF) > 0
    elif round_mode == "down":
        up = xp.zeros(bits.shape, bool)
    else:
        raise ValueError(f"Cast: round_mode must be 'up', 'down' or 'nearest', got {round_mode!r}")
    up = up & ~special
    if saturate:
        up = up & (exponent != 0xFE)
    out = xp.where(special, 0xFF, (exponent + up.astype(np.int32)) & 0xFF).astype(np.uint8)
    if xp is np:
        return out.view(ml_dtypes.float8_e8m0fnu)
    return jax.lax.bitcast_convert_type(out, _E8M0)


def cast_value(ctx, x, dtype, *, saturate: bool = True, round_mode: str = "up"):
    """x as `dtype` by ONNX Cast's rules (NumPy for a static x, jax otherwise).

    float8 e4m3fn / e4m3fnuz / e5m2 / e5m2fnuz saturate (out-of-range and +-inf become +-max) when
    `saturate`; float8e8m0 rounds by `round_mode`; a float or integer cast to a sub-byte integer
    (int4 / uint4 / int2 / uint2) truncates to int32 and wraps modulo 2^bits, as the reference does.
    """
    static = is_static(x)
    xp = np if static else jnp
    x = np.asarray(x) if static else to_jax(x)
    dtype = np.dtype(dtype)
    src = np.dtype(x.dtype)
    if dtype == _E8M0 and src != _E8M0:
        return _to_e8m0(xp, x, bool(saturate), round_mode)
    if dtype in _SATURATING_FLOAT8 and saturate and src.kind == "f" and src not in _SATURATING_FLOAT8:
        info = ml_dtypes.finfo(dtype)
        x = xp.clip(x, np.asarray(float(info.min), src), np.asarray(float(info.max), src))
    if dtype in SUB_BYTE_INTS and src.kind in "fiu":
        bits, signed = SUB_BYTE_INTS[dtype]
        half = (1 << (bits - 1)) if signed else 0
        x = ((x.astype(np.int32) + half) & ((1 << bits) - 1)) - half
    return x.astype(dtype)


@register("Cast", 6, 9, 13, 19, 21, 23, 24, 25, 28)
def cast(ctx, x):
    """Cast: x in the dtype of attribute `to` (mapped by load(dtype=...), JAX's when traced), with
    Cast's saturate / round_mode rules for float8 (`cast_value`)."""
    return cast_value(ctx, x, ctx.dtype(ctx.attr("to")), saturate=bool(ctx.attr("saturate", 1)),
                      round_mode=ctx.attr("round_mode", "up"))


@register("CastLike", 15, 19, 21, 23, 24, 25)
def cast_like(ctx, x, like):
    """CastLike: x in like's dtype (a static x stays NumPy), with Cast's rules (`cast_value`)."""
    # A static value cast like a traced one stays static (shape arithmetic stays foldable).
    return cast_value(ctx, x, like.dtype, saturate=bool(ctx.attr("saturate", 1)),
                      round_mode=ctx.attr("round_mode", "up"))


@register("Clip", 6, 11, 12, 13)
def clip(ctx, x, lo=None, hi=None):
    """Clip: x limited to [min, max] (inputs from opset 11, attributes before)."""
    if ctx.version < 11:
        lo, hi = ctx.attr("min", -np.inf), ctx.attr("max", np.inf)
        lo, hi = np.asarray(lo, x.dtype), np.asarray(hi, x.dtype)
    x, lo, hi = ctx.operands(x, lo, hi)
    xp = ctx.xp
    if lo is not None:
        x = xp.maximum(x, lo)
    if hi is not None:
        x = xp.minimum(x, hi)
    return x


@register("Identity", 13, 14, 16, 19, 21, 23, 24, 25)
def identity(ctx, x):
    """Identity: x unchanged."""
    return x


@register("Dropout", 10, 12, 13, 22, static_inputs=(1, 2))
def dropout(ctx, x, ratio=None, training_mode=None):
    """Dropout (inference): (x, all-True bool mask of x's shape). training_mode must be known at
    trace time (it decides which computation runs); True is supported only with ratio 0 (which
    drops nothing): random dropping is not."""
    # Inference (or ratio 0): Dropout is the identity and its mask is all True.
    if training_mode is not None and bool(np.asarray(
            ctx.static_value(training_mode, "Dropout's training_mode")).reshape(-1)[0]):
        r = 0.5 if ratio is None else float(
            np.asarray(ctx.static_value(ratio, "Dropout's ratio")).reshape(-1)[0])
        if r != 0.0:
            ctx.fail(f"training_mode=True with ratio {r} (random dropping) is not supported "
                     f"(inference only)", NotImplementedError)
    mask = np.ones(x.shape, bool) if is_static(x) else jnp.ones(x.shape, bool)
    return x, mask
