"""Shape and data-movement ops: Shape, Reshape, Expand, (Un)Squeeze, Concat, Slice, Gather*, Pad, ...

Shape always returns NumPy (shapes are static at trace time), so the arithmetic built on it folds and
the shape inputs of Reshape / Expand / Slice / Pad / Range / ConstantOfShape are concrete. Those
inputs must be static: a shape that depends on data cannot be traced by XLA, and the handler says so.

Handlers: `(ctx, *inputs) -> outputs`, per their @register op's ONNX schema (see `onnx.handlers`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from jax_onnx_attn.onnx.registry import register
from jax_onnx_attn.onnx.values import is_static, np_dtype, to_jax

_V_SHAPE = (13, 15, 19, 21, 23, 24, 25)


def _ints(v) -> list[int]:
    return [int(i) for i in np.asarray(v).reshape(-1)]


def _norm_axes(axes, rank: int) -> list[int]:
    return [a + rank if a < 0 else a for a in axes]


@register("Shape", *_V_SHAPE)
def shape(ctx, x):
    """Shape: x's dims [start:end] as static int64 [n] (x may be a ShapeOnly)."""
    dims = list(x.shape)
    rank = len(dims)
    start, end = ctx.attr("start", 0), ctx.attr("end", rank)
    # Shape-15: start/end are clamped into [0, rank] after adding rank to negatives.
    start = min(max(start + rank if start < 0 else start, 0), rank)
    end = min(max(end + rank if end < 0 else end, 0), rank)
    return np.asarray(dims[start:end], dtype=np.int64)


@register("Size", 13, 19, 21, 23, 24, 25)
def size(ctx, x):
    """Size: x's element count as a static int64 scalar."""
    return np.asarray(int(np.prod(x.shape, dtype=np.int64)), dtype=np.int64)


@register("Reshape", 5, 13, 14, 19, 21, 23, 24, 25, static_inputs=(1,))
def reshape(ctx, x, new_shape):
    """Reshape to a static int64 shape (0 copies a dim unless allowzero; -1 inferred)."""
    dims = _ints(ctx.static_value(new_shape, "Reshape's shape"))
    if not ctx.attr("allowzero", 0):
        # 0 copies the input's dimension at that index (unless allowzero=1).
        dims = [x.shape[i] if d == 0 else d for i, d in enumerate(dims)]
    if is_static(x):
        return np.reshape(x, dims)
    return jnp.reshape(to_jax(x), dims)


@register("Flatten", 9, 11, 13, 21, 23, 24, 25)
def flatten(ctx, x):
    """Flatten: 2-D [prod(dims[:axis]), prod(dims[axis:])]."""
    axis = ctx.attr("axis", 1)
    axis = axis + x.ndim if axis < 0 else axis
    outer = int(np.prod(x.shape[:axis], dtype=np.int64))
    return ctx.xp.reshape(ctx.operands(x), (outer, -1))


@register("Expand", 8, 13, static_inputs=(1,))
def expand(ctx, x, new_shape):
    """Expand: x broadcast bidirectionally with a static int64 shape."""
    dims = tuple(_ints(ctx.static_value(new_shape, "Expand's shape")))
    # Bidirectional broadcast: a 1 in `shape` keeps the input's dimension.
    out = np.broadcast_shapes(tuple(x.shape), dims)
    if is_static(x):
        return np.broadcast_to(x, out)
    return jnp.broadcast_to(to_jax(x), out)


@register("Unsqueeze", 11, 13, 21, 23, 24, 25, static_inputs=(1,))
def unsqueeze(ctx, x, axes=None):
    """Unsqueeze: size-1 axes inserted (static int64 axes; an attribute before opset 13)."""
    axes = ctx.attr("axes") if ctx.version < 13 else _ints(ctx.static_value(axes, "Unsqueeze's axes"))
    axes = tuple(sorted(_norm_axes(list(axes), x.ndim + len(axes))))
    if is_static(x):
        return np.expand_dims(x, axes)
    return jnp.expand_dims(to_jax(x), axes)


@register("Squeeze", 11, 13, 21, 23, 24, 25, static_inputs=(1,))
def squeeze(ctx, x, axes=None):
    """Squeeze: the given (static) size-1 axes removed, or every size-1 axis."""
    if ctx.version < 13:
        axes = ctx.attr("axes")
    elif axes is not None:
        axes = _ints(ctx.static_value(axes, "Squeeze's axes"))
    if axes is None:
        axes = [i for i, d in enumerate(x.shape) if d == 1]
    axes = tuple(_norm_axes(list(axes), x.ndim))
    if is_static(x):
        return np.squeeze(x, axes)
    return jnp.squeeze(to_jax(x), axes)


@register("Concat", 4, 11, 13)
def concat(ctx, *xs):
    """Concat along attribute `axis` (omitted inputs skipped)."""
    axis = ctx.attr("axis")
    xs = [x for x in xs if x is not None]
    if ctx.static:
        return np.concatenate(xs, axis=axis)
    return jnp.concatenate([to_jax(x) for x in xs], axis=axis)


@register("Transpose", 13, 21, 23, 24, 25)
def transpose(ctx, x):
    """Transpose by attribute `perm` (default: reversed axes)."""
    perm = ctx.attr("perm")
    perm = tuple(perm) if perm is not None else tuple(reversed(range(x.ndim)))
    return ctx.xp.transpose(ctx.operands(x), perm)


@register("Slice", 10, 11, 13, static_inputs=(1, 2, 3, 4))
def slice_(ctx, x, starts, ends, axes=None, steps=None):
    """Slice with static int starts / ends / axes / steps, clamped as Python slices."""
    starts = _ints(ctx.static_value(starts, "Slice's starts"))
    ends = _ints(ctx.static_value(ends, "Slice's ends"))
    axes = _ints(ctx.static_value(axes, "Slice's axes")) if axes is not None else list(range(len(starts)))
    steps = _ints(ctx.static_value(steps, "Slice's steps")) if steps is not None else [1] * len(starts)
    index = [slice(None)] * x.ndim
    for a, s, e, st in zip(_norm_axes(axes, x.ndim), starts, ends, steps):
        if st == 0:
            ctx.fail("a step of 0 is invalid")
        # Python slices clamp out-of-range starts/ends exactly as ONNX Slice does.
        index[a] = slice(s, e, st)
    return ctx.operands(x)[tuple(index)]


def _norm_index(xp, idx, dim: int):
    idx = idx.astype(np.int64) if xp is np else idx
    return xp.where(idx < 0, idx + dim, idx)


def _index_status(idx, dim: int):
    """int32 [] status: INDEX_OUT_OF_RANGE when any (negative-wrapped) index is outside [0, dim)."""
    from jax_onnx_attn.ops import status as st
    ok = jnp.all((idx >= 0) & (idx < dim)) if idx.size else jnp.bool_(True)
    return st.flag_unless(ok, st.INDEX_OUT_OF_RANGE)


def _gather_operands(ctx, data, indices):
    """(axis, data, indices with negatives wrapped) for the Gather family."""
    axis = ctx.attr("axis", 0)
    axis = axis + data.ndim if axis < 0 else axis
    data, indices = ctx.operands(data, indices)
    return axis, data, _norm_index(ctx.xp, indices, data.shape[axis])


@register("Gather", 11, 13)
def gather(ctx, data, indices):
    """Gather: data indexed by integer indices (negatives wrapped) along `axis`."""
    axis, data, idx = _gather_operands(ctx, data, indices)
    if ctx.static:
        dim = data.shape[axis]
        bad = (idx < 0) | (idx >= dim)
        if np.any(bad):
            ctx.fail(f"indices {sorted(set(np.asarray(indices)[bad].tolist()))[:8]} are outside "
                     f"[-{dim}, {dim})", IndexError)
        return np.take(data, idx, axis=axis)
    if ctx.collecting_status:
        # Only the device sees traced indices: the status flags any outside [-dim, dim).
        ctx.report_status(_index_status(idx, data.shape[axis]))
    # Out-of-range indices are clamped ("clip" keeps XLA's gather free of a fill branch);
    # apply_with_status flags them.
    return jnp.take(data, idx, axis=axis, mode="clip")


@register("GatherElements", 11, 13)
def gather_elements(ctx, data, indices):
    """GatherElements: take_along_axis on `axis` (indices of data's rank)."""
    axis, data, idx = _gather_operands(ctx, data, indices)
    return ctx.xp.take_along_axis(data, idx, axis=axis)


@register("GatherND", 11, 12, 13)
def gather_nd(ctx, data, indices):
    """GatherND: data at integer index tuples indices[..., :k], after batch_dims leading dims."""
    b = ctx.attr("batch_dims", 0)
    data, indices = ctx.operands(data, indices)
    xp = ctx.xp
    k = indices.shape[-1]
    batch = data.shape[:b]
    nb = int(np.prod(batch, dtype=np.int64))
    d = data.reshape((nb,) + tuple(data.shape[b:]))
    ind = indices.reshape((nb,) + tuple(indices.shape[b:]))
    dims = np.asarray(d.shape[1:1 + k])
    ind = xp.where(ind < 0, ind + dims, ind)

    def one(dd, ii):
        return dd[tuple(ii[..., j] for j in range(k))]

    if ctx.static:
        out = np.stack([one(d[i], ind[i]) for i in range(nb)]) if nb else np.zeros((0,), data.dtype)
    else:
        out = jax.vmap(one)(d, ind)
    return out.reshape(tuple(batch) + tuple(indices.shape[b:-1]) + tuple(data.shape[b + k:]))


@register("Range", 11, 27, static_inputs=(0, 1, 2))
def range_(ctx, start, limit, delta):
    """Range from static scalars: [start, limit) by delta, in start's dtype.

    Range-27 float16 / bfloat16 makes the values in float32 (stash_type 1, the default) or float64
    (stash_type 11) and rounds them once to the input type.
    """
    start, limit, delta = (ctx.static_value(v, "Range's " + n).reshape(()) for v, n in
                           ((start, "start"), (limit, "limit"), (delta, "delta")))
    dtype = start.dtype
    if dtype in (np.dtype(np.float16), np.dtype(ml_dtypes.bfloat16)) and ctx.version >= 27:
        # stash_type: FLOAT (1, the default) or DOUBLE (11) is the type the values are made in.
        stash = {1: np.float32, 11: np.float64}.get(int(ctx.attr("stash_type", 1)))
        if stash is None:
            ctx.fail(f"stash_type must be 1 (FLOAT) or 11 (DOUBLE), got {ctx.attr('stash_type')}")
        return np.arange(stash(start), float(limit), float(delta), dtype=stash).astype(dtype)
    return np.arange(start.item(), limit.item(), delta.item()).astype(dtype)


@register("ConstantOfShape", 9, 20, 21, 23, 24, 25, static_inputs=(0,))
def constant_of_shape(ctx, dims):
    """ConstantOfShape: a static tensor of shape dims filled with `value` (default 0.0 f32)."""
    dims = _ints(ctx.static_value(dims, "ConstantOfShape's shape"))
    value = ctx.attr("value")
    if value is None:
        value = np.zeros((1,), np.float32)
    value = np.asarray(value).reshape(-1)[:1]
    dtype = ctx.interp.map_dtype(value.dtype)
    return np.full(dims, value[0], dtype=dtype)


@register("Constant", 9, 11, 12, 13, 19, 21, 23, 24, 25)
def constant(ctx):
    """Constant: the value / value_float(s) / value_int(s) attribute as NumPy."""
    a = ctx.attrs
    if "value" in a:
        v = np.asarray(a["value"])
    elif "value_float" in a:
        v = np.asarray(a["value_float"], np.float32)
    elif "value_floats" in a:
        v = np.asarray(a["value_floats"], np.float32)
    elif "value_int" in a:
        v = np.asarray(a["value_int"], np.int64)
    elif "value_ints" in a:
        v = np.asarray(a["value_ints"], np.int64)
    else:
        ctx.fail(f"unsupported Constant attribute(s) {sorted(a)}", NotImplementedError)
    return v.astype(ctx.interp.map_dtype(v.dtype))


@register("Pad", 11, 13, 18, 19, 21, 23, 24, 25, static_inputs=(1, 3))
def pad(ctx, x, pads, constant_value=None, axes=None):
    """Pad with static int64 pads (negative pads crop); constant, reflect, edge or wrap mode."""
    mode = ctx.attr("mode", "constant")
    pads = _ints(ctx.static_value(pads, "Pad's pads"))
    axes = (_norm_axes(_ints(ctx.static_value(axes, "Pad's axes")), x.ndim) if axes is not None
            else list(range(x.ndim)))
    n = len(axes)
    widths = [[0, 0] for _ in range(x.ndim)]
    for i, a in enumerate(axes):
        widths[a] = [pads[i], pads[i + n]]
    xp = ctx.xp
    x = ctx.operands(x)
    # Negative pads crop: slice those first, then pad with the positive parts.
    crop = tuple(slice(-lo if lo < 0 else 0, (x.shape[i] + hi) if hi < 0 else None)
                 for i, (lo, hi) in enumerate(widths))
    x = x[crop]
    pos = [(max(lo, 0), max(hi, 0)) for lo, hi in widths]
    if mode == "constant":
        # The fill value sets no shape: it may be traced (lax.pad takes it as an operand).
        if constant_value is None or np.size(constant_value) == 0:
            cv = np.zeros((), x.dtype)
        elif is_static(constant_value):
            cv = np.asarray(constant_value).reshape(-1)[0].astype(x.dtype)
        else:
            cv = to_jax(constant_value).reshape(-1)[0].astype(x.dtype)
            x = to_jax(x)
            xp = jnp
        return xp.pad(x, pos, mode="constant", constant_values=cv)
    if mode not in ("reflect", "edge", "wrap"):
        ctx.fail(f"mode {mode!r} is not supported", NotImplementedError)
    return xp.pad(x, pos, mode=mode)


@register("Split", 11, 13, 18, static_inputs=(1,))
def split(ctx, x, split_sizes=None):
    """Split along `axis` by static sizes, or into equal chunks (the last smaller)."""
    axis = ctx.attr("axis", 0)
    axis = axis + x.ndim if axis < 0 else axis
    n_out = len(ctx.node.output)
    if ctx.version < 13:
        sizes = ctx.attr("split")
    elif split_sizes is not None:
        sizes = _ints(ctx.static_value(split_sizes, "Split's split"))
    else:
        sizes = None
    dim = x.shape[axis]
    if sizes is None:
        n = ctx.attr("num_outputs", n_out)
        chunk = -(-dim // n)  # ceil: the last chunk is smaller when dim % n != 0 (Split-18)
        sizes = [min(chunk, dim - i * chunk) for i in range(n)]
    bounds = np.cumsum(sizes)[:-1].tolist()
    return tuple(ctx.xp.split(ctx.operands(x), bounds, axis=axis))


@register("Tile", 6, 13, static_inputs=(1,))
def tile(ctx, x, repeats):
    """Tile: x repeated by static int64 repeats per axis."""
    reps = _ints(ctx.static_value(repeats, "Tile's repeats"))
    return ctx.xp.tile(ctx.operands(x), reps)


@register("Trilu", 14)
def trilu(ctx, x, k=None):
    """Trilu: upper (triu) or lower (tril) triangle of the last two axes, diagonal k (k may be
    traced: it selects elements, it does not set a shape)."""
    x = ctx.operands(x)
    upper = ctx.attr("upper", 1)
    if k is None or (ctx.static and np.ndim(k) <= 1):
        kk = 0 if k is None else int(np.asarray(k).reshape(()))
        return ctx.xp.triu(x, kk) if upper else ctx.xp.tril(x, kk)
    kk = to_jax(k).reshape(()).astype(jnp.int32)
    rows, cols = x.shape[-2], x.shape[-1]
    diff = jnp.arange(cols, dtype=jnp.int32)[None, :] - jnp.arange(rows, dtype=jnp.int32)[:, None]
    keep = diff >= kk if upper else diff <= kk
    x = to_jax(x)
    return jnp.where(keep, x, jnp.zeros((), x.dtype))


@register("ScatterND", 11, 13, 16, 18)
def scatter_nd(ctx, data, indices, updates):
    """ScatterND: updates written (or reduced) into data at integer index tuples."""
    reduction = ctx.attr("reduction", "none")
    data, indices, updates = ctx.operands(data, indices, updates)
    k = indices.shape[-1]
    idx = tuple(indices[..., j] for j in range(k))
    if ctx.static:
        out = np.array(data, copy=True)
        flat_idx = indices.reshape(-1, k)
        flat_upd = updates.reshape((flat_idx.shape[0],) + tuple(data.shape[k:]))
        for i, u in zip(flat_idx, flat_upd):
            t = tuple(i)
            out[t] = {"none": u, "add": out[t] + u, "mul": out[t] * u,
                      "max": np.maximum(out[t], u), "min": np.minimum(out[t], u)}[reduction]
        return out
    at = data.at[idx]
    return {"none": at.set, "add": at.add, "mul": at.multiply, "max": at.max,
            "min": at.min}[reduction](updates)


@register("EyeLike", 9, 22)
def eye_like(ctx, x):
    """EyeLike: a static 2-D identity of x's shape, diagonal k, dtype attribute or x's."""
    dt = ctx.attr("dtype")
    dtype = ctx.interp.map_dtype(np_dtype(dt)) if dt is not None else x.dtype
    return np.eye(x.shape[0], x.shape[1], k=ctx.attr("k", 0), dtype=dtype)


@register("NonZero", 9, 13, static_inputs=(0,))
def non_zero(ctx, x):
    """NonZero of a static x: int64 [rank, nnz] indices of its nonzero elements."""
    # The output's length is the number of nonzeros: only foldable when x is static.
    return np.stack(np.nonzero(ctx.static_value(x, "NonZero's input"))).astype(np.int64)

