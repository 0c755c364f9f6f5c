"""Element-wise ops: arithmetic, comparisons, logic, unary math, activations, Where, Cast, Clip.

All broadcast with NumPy rules (ONNX multidirectional broadcasting). Each works in NumPy when its
inputs are static and in jax.numpy otherwise.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
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


@register("Mod", 10, 13)
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


@register("Cast", 6, 9, 13, 19, 21, 23, 24, 25)
def cast(ctx, x):
    """Cast: x in the dtype of attribute `to` (mapped by load(dtype=...), JAX's when traced)."""
    dtype = ctx.dtype(ctx.attr("to"))
    if is_static(x):
        return np.asarray(x).astype(dtype)
    return to_jax(x).astype(dtype)


@register("CastLike", 15, 19, 21, 23, 24, 25)
def cast_like(ctx, x, like):
    """CastLike: x in like's dtype (a static x stays NumPy)."""
    dtype = like.dtype
    if is_static(x):
        # A static value cast like a traced one stays static (shape arithmetic stays foldable).
        return np.asarray(x).astype(dtype)
    return to_jax(x).astype(dtype)


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


@register("Dropout", 12, 13, 22)
def dropout(ctx, x, ratio=None, training_mode=None):
    """Dropout (inference): (x, all-True bool mask of x's shape)."""
    # Inference: Dropout is the identity and its mask is all True.
    if training_mode is not None and is_static(training_mode) and bool(np.asarray(training_mode)):
        ctx.fail("training_mode=True is not supported (inference only)")
    mask = np.ones(x.shape, bool) if is_static(x) else jnp.ones(x.shape, bool)
    return x, mask
