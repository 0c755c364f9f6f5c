"""Reductions and normalising ops along an axis: Reduce*, Softmax, LogSoftmax, ArgMax/Min, CumSum, TopK.

Half-precision (float16 / bfloat16) traced inputs accumulate in float32 and are cast back, the
project's rule for every reduction (onnxruntime's CPU kernels do the same).

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.onnx.registry import register
from jax_onnx_attn.ops.dtypes import HALF_DTYPES


def _acc(x):
    return jnp.float32 if np.dtype(x.dtype) in HALF_DTYPES else None


def _identity(dtype, fn_name: str):
    """The identity of max / min over `dtype`: its lowest / highest value (-inf / inf for floats)."""
    dtype = np.dtype(dtype)
    if dtype == np.bool_:
        return fn_name == "min"
    if dtype.kind == "f" or dtype.kind == "V":
        return -np.inf if fn_name == "max" else np.inf
    info = np.iinfo(dtype)
    return info.min if fn_name == "max" else info.max


def _axes(ctx, x, axes_input, axes_from_input: bool):
    if axes_from_input:
        axes = None if axes_input is None else [
            int(a) for a in ctx.static_value(axes_input, "the reduction axes").reshape(-1)]
    else:
        axes = ctx.attr("axes")
    if not axes:
        # noop_with_empty_axes=1 makes empty axes the identity; otherwise all axes are reduced.
        return None if ctx.attr("noop_with_empty_axes", 0) else tuple(range(x.ndim))
    return tuple(a + x.ndim if a < 0 else a for a in axes)


def _reduce(fn_name: str, first_input_version: int, post=None, pre=None):
    def handler(ctx, x, axes=None):
        ax = _axes(ctx, x, axes, ctx.version >= first_input_version)
        if ax is None:
            return x
        keep = bool(ctx.attr("keepdims", 1))
        xp = ctx.xp
        x = ctx.operands(x)
        if pre is not None:
            x = pre(xp, x)
        kwargs = {}
        if not ctx.static and fn_name in ("sum", "mean", "prod") and _acc(x) is not None:
            kwargs["dtype"] = _acc(x)
        if fn_name in ("max", "min") and any(x.shape[a] == 0 for a in ax):
            # An empty reduction gives the identity: -inf / +inf (the type's lowest / highest).
            kwargs["initial"] = _identity(x.dtype, fn_name)
        out = getattr(xp, fn_name)(x, axis=ax, keepdims=keep, **kwargs)
        if post is not None:
            out = post(xp, out)
        out = out.astype(x.dtype)
        return np.asarray(out) if ctx.static else out
    return handler


register("ReduceSum", 11, 13, static_inputs=(1,))(_reduce("sum", 13))
register("ReduceMean", 11, 13, 18, static_inputs=(1,))(_reduce("mean", 18))
register("ReduceMax", 11, 12, 13, 18, 20, static_inputs=(1,))(_reduce("max", 18))
register("ReduceMin", 11, 12, 13, 18, 20, static_inputs=(1,))(_reduce("min", 18))
register("ReduceProd", 11, 13, 18, static_inputs=(1,))(_reduce("prod", 18))
register("ReduceSumSquare", 11, 13, 18, static_inputs=(1,))(_reduce("sum", 18, pre=lambda xp, x: x * x))
register("ReduceL2", 11, 13, 18, static_inputs=(1,))(_reduce("sum", 18, pre=lambda xp, x: x * x,
                                         post=lambda xp, y: xp.sqrt(y)))


def _softmax_axis(ctx, x):
    axis = ctx.attr("axis", -1 if ctx.version >= 13 else 1)
    return axis + x.ndim if axis < 0 else axis


def _softmax_like(log: bool):
    def handler(ctx, x):
        axis = _softmax_axis(ctx, x)
        x = ctx.operands(x)
        shape = x.shape
        if ctx.version < 13:
            # Softmax-1/11 flattens to 2-D at `axis` and normalises the trailing block as one row.
            x = x.reshape(int(np.prod(shape[:axis], dtype=np.int64)), -1)
            axis = 1
        if ctx.static:
            m = np.max(x, axis=axis, keepdims=True)
            e = np.exp(x - m)
            s = np.sum(e, axis=axis, keepdims=True)
            out = (x - m - np.log(s)) if log else e / s
        else:
            acc = x.astype(_acc(x) or x.dtype)
            out = (jax.nn.log_softmax if log else jax.nn.softmax)(acc, axis=axis)
        return out.astype(x.dtype).reshape(shape)
    return handler


register("Softmax", 11, 13)(_softmax_like(False))
register("LogSoftmax", 11, 13)(_softmax_like(True))


def _arg(fn_name):
    def handler(ctx, x):
        axis = ctx.attr("axis", 0)
        axis = axis + x.ndim if axis < 0 else axis
        keep = bool(ctx.attr("keepdims", 1))
        x = ctx.operands(x)
        xp = ctx.xp
        if ctx.attr("select_last_index", 0):
            flipped = xp.flip(x, axis)
            idx = x.shape[axis] - 1 - getattr(xp, fn_name)(flipped, axis=axis)
        else:
            idx = getattr(xp, fn_name)(x, axis=axis)
        if keep:
            idx = xp.expand_dims(idx, axis)
        return idx.astype(np.int64) if ctx.static else idx.astype(jnp.int32)
    return handler


register("ArgMax", 11, 12, 13)(_arg("argmax"))
register("ArgMin", 11, 12, 13)(_arg("argmin"))


@register("CumSum", 11, 14, static_inputs=(1,))
def cumsum(ctx, x, axis):
    """CumSum along a static axis (exclusive / reverse attributes), in x's dtype."""
    ax = int(ctx.static_value(axis, "CumSum's axis").reshape(()))
    ax = ax + x.ndim if ax < 0 else ax
    x = ctx.operands(x)
    xp = ctx.xp
    if ctx.attr("reverse", 0):
        x = xp.flip(x, ax)
    out = xp.cumsum(x, axis=ax, dtype=x.dtype)
    if ctx.attr("exclusive", 0):
        out = out - x
    if ctx.attr("reverse", 0):
        out = xp.flip(out, ax)
    return out


@register("TopK", 11, 24, static_inputs=(1,))
def topk(ctx, x, k):
    """TopK with static k: (values, indices int64 static / int32 traced); ties: lower index."""
    k = int(ctx.static_value(k, "TopK's k").reshape(-1)[0])
    axis = ctx.attr("axis", -1)
    axis = axis + x.ndim if axis < 0 else axis
    largest = ctx.attr("largest", 1)
    x = ctx.operands(x)
    xp = ctx.xp
    moved = xp.moveaxis(x, axis, -1)
    key = moved if largest else -moved
    if ctx.static:
        # Stable sort on the negated key keeps the lower index first among equal values.
        idx = np.argsort(-key, axis=-1, kind="stable")[..., :k]
        vals = np.take_along_axis(moved, idx, -1)
    else:
        _, idx = jax.lax.top_k(key, k)
        vals = jnp.take_along_axis(moved, idx, -1)
    idx = idx.astype(np.int64) if ctx.static else idx.astype(jnp.int32)
    return xp.moveaxis(vals, -1, axis), xp.moveaxis(idx, -1, axis)
