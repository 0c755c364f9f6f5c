"""Batching and partitioning of the ops: one mechanism, one rule per op.

An op's rule says, for one call, what each axis of its operands and results is, in an einsum-like
notation (`Layout`): "b" the batch axis, "h" the KV heads (query heads are "(h g)": the G query
heads of one KV head stay together, so query and KV heads split at the same place), "k" an axis
the op contracts (a projection's K), any other name an axis the op needs whole. From the rule the
mechanism (`Rule.apply`) gives the op's implementation, CUDA or reference alike:

* Batching (`jax.vmap`). An FFI target folds the mapped axis into its batch axis and makes one
  call over V·B rows (exact: rows are independent); `pin` keeps what the kernel plans from its
  batch size at the per-example plan, so the bits are those of the per-example loop. A call whose
  rule has no batch axis for a mapped operand runs as a loop (`jax.lax.map`). A public op
  (`bind`, "inner" batching) lets vmap trace into its implementation instead, where the FFI
  targets fold.
* Partitioning (`jax.jit` with sharded operands): `jax.experimental.custom_partitioning`, with the
  layout as its Shardy sharding rule (every axis but b, h and k "need replication") and as its
  GSPMD callback. When the partitioner asks, the op is split over the mesh axes that shard its
  batch axis (data parallel) and its head axis (tensor parallel), or its contracted axis (then
  each shard's partial result is summed with one `psum`, the `per_shard` hook of the rule adding
  what comes after the sum); every other axis is whole. The implementation runs per shard on its
  local shapes, with static attributes that count heads made local (`local`). No operand is
  gathered: an operand sharded otherwise than the rule says is resharded by XLA to the rule's
  sharding before the call, so results are right for any input sharding.

Without a mesh of more than one device the op lowers to its implementation as is (no custom call,
nothing changes). jax 0.10 and 0.11 both take this (Shardy is their default partitioner; the GSPMD
callback serves `jax_use_shardy_partitioner=False`).

The rules of every FFI target and public op are at the end of this module.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Callable, Sequence
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import Mesh, NamedSharding, PartitionSpec

#: The axis roles a layout may name; every other factor name is an axis the op needs whole.
BATCH, HEADS, CONTRACTED = "b", "h", "k"
_ROLES = (BATCH, HEADS, CONTRACTED)


# --------------------------------------------------------------------------------------------------
# Layouts


@dataclasses.dataclass(frozen=True)
class Layout:
    """What each axis of one call's operands and results is.

    Attributes:
      operands: one entry per operand, in the op's order: None for an absent operand, else a
        string of space-separated axes ("b (h g) s d"): a factor name, or a parenthesised group of
        factors whose first (major) factor is b or h. Names b, h and k are the roles (module doc);
        any other name is an axis kept whole, named for the reader only.
      results: likewise, one entry per array the implementation returns (its pytree's leaves,
        None leaves skipped).
      sizes: {role: size} for a role that no axis names alone (only in groups, e.g. h of "(h g)").
    """

    operands: tuple[str | None, ...]
    results: tuple[str, ...]
    sizes: dict[str, int] = dataclasses.field(default_factory=dict)


def _parse(spec: str) -> list[tuple[str, ...]]:
    """'b (h g) s d' -> [('b',), ('h', 'g'), ('s',), ('d',)]."""
    dims, group = [], None
    for token in spec.replace("(", " ( ").replace(")", " ) ").split():
        if token == "(":
            group = []
        elif token == ")":
            if not group:
                raise ValueError(f"layout {spec!r}: an empty group")
            dims.append(tuple(group))
            group = None
        elif group is not None:
            group.append(token)
        else:
            dims.append((token,))
    if group is not None:
        raise ValueError(f"layout {spec!r}: an unclosed group")
    for dim in dims:
        if any(f in _ROLES for f in dim[1:]):
            raise ValueError(f"layout {spec!r}: a role (b, h, k) must be the major factor of a group")
    return dims


class _Axes(NamedTuple):
    """A layout checked against shapes: per value, per axis, its factors; the roles' sizes."""
    values: list[list[tuple[str, ...]] | None]   # operands then results
    sizes: dict[str, int]                        # b, h, k: their sizes where present


def _resolve(layout: Layout, shapes: Sequence[tuple[int, ...] | None], op: str) -> _Axes:
    """The layout's axes for the values of `shapes` (operands then results), sizes checked."""
    specs = list(layout.operands) + list(layout.results)
    if len(specs) != len(shapes):
        raise AssertionError(f"{op}: the layout has {len(specs)} values, the call {len(shapes)}")
    values, sizes = [], {role: int(n) for role, n in layout.sizes.items()}
    for spec, shape in zip(specs, shapes):
        if (spec is None) != (shape is None):
            raise AssertionError(f"{op}: layout {spec!r} for a value of shape {shape}")
        if spec is None:
            values.append(None)
            continue
        dims = _parse(spec)
        if len(dims) != len(shape):
            raise AssertionError(f"{op}: layout {spec!r} has {len(dims)} axes, the value {shape}")
        for dim, size in zip(dims, shape):
            if len(dim) == 1 and dim[0] in _ROLES:
                if sizes.setdefault(dim[0], size) != size:
                    raise AssertionError(f"{op}: {dim[0]} is {sizes[dim[0]]} and {size} in {spec!r}")
        values.append(dims)
    for dims, shape in zip(values, shapes):
        for dim, size in zip(dims or (), shape or ()):
            if len(dim) > 1 and dim[0] in _ROLES:
                major = sizes.get(dim[0])
                if major is None or major == 0 or size % major:
                    raise AssertionError(f"{op}: axis {dim} of size {size} is not a multiple of "
                                         f"{dim[0]} = {major}")
    return _Axes(values, sizes)


def _sdy_rule(values, shapes, sizes: dict) -> tuple[list[str], dict]:
    """Per value its Shardy mapping, and the rule's keyword arguments: every whole axis becomes a
    factor of its own that needs replication (the whole axes of a group one factor); sizes are
    given for the factors seen only inside groups."""
    names, whole, grouped, plain = [], [], {}, set()
    for dims, shape in zip(values, shapes):
        parts = []
        for dim, size in zip(dims, shape):
            if len(dim) == 1:
                factor = dim[0] if dim[0] in _ROLES else f"w{len(whole)}"
                if factor not in _ROLES:
                    whole.append(factor)
                parts.append(factor)
                plain.add(factor)
                continue
            role, rest = dim[0], f"w{len(whole)}"
            whole.append(rest)
            grouped[rest] = size // sizes[role]
            grouped.setdefault(role, sizes[role])
            parts.append(f"({role} {rest})")
        names.append(" ".join(parts))
    kw = dict(need_replication_factors=tuple(whole),
              **{f: s for f, s in grouped.items() if f not in plain})
    if CONTRACTED in sizes:
        kw["reduction_factors"] = (CONTRACTED,)
    return names, kw


# --------------------------------------------------------------------------------------------------
# Shardings


def _mesh_coords(mesh: Mesh) -> dict[int, tuple[int, ...]]:
    return {d.id: c for c, d in np.ndenumerate(mesh.devices)}


def _axes_per_dim(sharding, mesh: Mesh, shape) -> list[tuple[str, ...]] | None:
    """The mesh axes that split each axis of an array of `shape` under `sharding`, major first, or
    None when the sharding is not a plain tiling over whole mesh axes (the op then takes the
    operand as if unsharded: XLA reshards it to the rule's sharding)."""
    if isinstance(sharding, NamedSharding) and sharding.mesh.shape == mesh.shape:
        out = []
        for entry in tuple(sharding.spec) + (None,) * (len(shape) - len(sharding.spec)):
            out.append(() if entry is None else (entry,) if isinstance(entry, str) else tuple(entry))
        return out
    try:
        index = sharding.devices_indices_map(tuple(shape))
    except Exception:  # noqa: BLE001 - a sharding jax cannot index against this shape
        return None
    coords = _mesh_coords(mesh)
    if set(d.id for d in index) != set(coords):
        return None
    grid = mesh.devices.shape
    out = []
    for axis, size in enumerate(shape):
        starts = np.zeros(grid, np.int64)
        for device, idx in index.items():
            start = idx[axis].start if axis < len(idx) else 0
            starts[coords[device.id]] = start or 0
        varying = [a for a in range(len(grid)) if grid[a] > 1 and np.any(np.diff(starts, axis=a))]
        origin = starts[(0,) * len(grid)]
        step = {a: abs(int(starts[tuple(1 if i == a else 0 for i in range(len(grid)))] - origin))
                for a in varying}
        order = sorted(varying, key=lambda a: -step[a])
        pieces = math.prod(grid[a] for a in order)
        if pieces and (size % pieces or len(np.unique(starts)) != pieces):
            return None
        # Each axis must step by the tile size times the pieces of the axes minor to it.
        tile, minor = size // max(pieces, 1), 1
        for a in reversed(order):
            if step[a] != tile * minor:
                return None
            minor *= grid[a]
        out.append(tuple(mesh.axis_names[a] for a in order))
    return out


class Shards(NamedTuple):
    """How one call is split: the mesh axes of its batch, head and contracted axes (empty: whole)
    and how many pieces each is split into."""
    mesh: Mesh
    batch: tuple[str, ...]
    heads: tuple[str, ...]
    contracted: tuple[str, ...]

    def count(self, axes: tuple[str, ...]) -> int:
        """How many pieces these mesh axes split a value into."""
        return math.prod(self.mesh.shape[a] for a in axes)

    @property
    def head_pieces(self) -> int:
        """How many pieces the heads (h) are split into."""
        return self.count(self.heads)

    def spec(self, dims: list[tuple[str, ...]]) -> PartitionSpec:
        """The PartitionSpec of a value with these axes."""
        roles = {BATCH: self.batch, HEADS: self.heads, CONTRACTED: self.contracted}
        entries = []
        for dim in dims:
            axes = roles.get(dim[0], ())
            entries.append(None if not axes else axes[0] if len(axes) == 1 else axes)
        return PartitionSpec(*entries)


def _choose(axes: _Axes, operand_shardings, operand_shapes, mesh: Mesh, priority) -> Shards:
    """The mesh axes of b, h and k for a call: for each role, those of the first operand (in
    `priority` order) that has the role's axis split, if the role's size divides into them."""
    found: dict[str, tuple[str, ...]] = {}
    for i in priority:
        dims, sharding = axes.values[i], operand_shardings[i]
        if dims is None or sharding is None:
            continue
        per_dim = _axes_per_dim(sharding, mesh, operand_shapes[i])
        if per_dim is None:
            continue
        for dim, mesh_axes in zip(dims, per_dim):
            role = dim[0]
            if role in _ROLES and mesh_axes and role not in found:
                taken = {a for r in found.values() for a in r}
                if taken.isdisjoint(mesh_axes):
                    pieces = math.prod(mesh.shape[a] for a in mesh_axes)
                    if axes.sizes.get(role, 0) % pieces == 0:
                        found[role] = tuple(mesh_axes)
    if HEADS in found and CONTRACTED in found:
        found.pop(CONTRACTED)  # an output split by heads is not also a partial sum
    return Shards(mesh, found.get(BATCH, ()), found.get(HEADS, ()), found.get(CONTRACTED, ()))


def _replicated_mesh(shardings) -> Mesh:
    """A one-axis mesh over the devices of the call, for a call that has no mesh of its own."""
    devices = sorted((d for s in shardings if s is not None for d in s.device_set),
                     key=lambda d: d.id)
    unique = list(dict.fromkeys(devices))
    return Mesh(np.array(unique), ("_devices",))


# --------------------------------------------------------------------------------------------------
# The mechanism


def _default_per_shard(impl, static, shards: Shards):
    """What a shard runs by default: the implementation with its static attributes."""
    return functools.partial(impl, **static)


@dataclasses.dataclass(frozen=True)
class Rule:
    """An op's batching and partitioning rule.

    Attributes:
      name: the op's name (errors).
      layout: (*operands, **static) -> Layout of the call; operands are arrays / ShapeDtypeStructs
        (None where absent), in the implementation's positional order.
      local: (static, shards) -> the static attributes of one shard's call (e.g. head counts
        divided by shards.head_pieces); None keeps them.
      per_shard: (impl, static, shards) -> the function one shard runs on its operands (default:
        impl with the local static attributes); a rule with a contracted axis sums the partial
        results there (`psum` over shards.contracted) and adds what follows the sum.
      priority: the order in which operands decide the split (default: their order).
    """

    name: str
    layout: Callable[..., Layout]
    local: Callable[[dict, Shards], dict] | None = None
    per_shard: Callable[[Callable, dict, Shards], Callable] = _default_per_shard
    priority: Callable[[int], Sequence[int]] | None = None

    def apply(self, impl: Callable, operands: Sequence, static: dict | None = None, *,
              batching: str = "fold", pin: Callable[..., dict] | None = None):
        """impl(*operands, **static) with this rule's batching and partitioning.

        Args:
          impl: the implementation (an FFI wrapper, or a reference function of the same signature);
            returns a pytree of arrays (None leaves allowed).
          operands: its positional arguments: arrays or None.
          static: its keyword arguments (Python values).
          batching: "fold" (the mapped axis joins the batch axis: FFI targets) or "inner" (vmap
            traces into impl: public ops whose implementations are made of such targets).
          pin: for "fold": (static, axis size, *per-example operands) -> static attributes to add
            to the folded call so that it computes what each example's call would (e.g. the
            kernel's plan), or None when the folded call cannot (then one call per example).
        """
        static = dict(static or {})
        operands = list(operands)
        present = [i for i, x in enumerate(operands) if x is not None]
        arrays = [jnp.asarray(operands[i]) for i in present]

        def fill(xs):
            full = [None] * len(operands)
            for i, x in zip(present, xs):
                full[i] = x
            return full

        def call(*xs):
            return self._partitioned(impl, fill, xs, static)

        batched_fn = jax.custom_batching.custom_vmap(call)

        @batched_fn.def_vmap
        def rule(axis_size, in_batched, *xs):
            if batching == "inner":
                in_axes = [0 if b else None for b in in_batched]
                out = jax.vmap(lambda *ys: impl(*fill(ys), **static), in_axes=in_axes)(*xs)
            else:
                out = self._fold(impl, fill, xs, in_batched, axis_size, static, pin)
            return out, jax.tree.map(lambda _: True, out)

        return batched_fn(*arrays)

    def bind(self, fn: Callable) -> Callable:
        """fn(*operands) with this rule ("inner" batching), for a public op's dispatch: fn a
        functools.partial whose keywords are its static attributes (localised per shard), or any
        callable without shard-dependent statics."""
        if isinstance(fn, functools.partial) and not fn.args:
            impl, static = fn.func, dict(fn.keywords)
        else:
            impl, static = fn, {}

        def bound(*operands):
            return self.apply(impl, operands, static, batching="inner")
        return bound

    def _axes(self, full: list, static: dict, results: list) -> _Axes:
        """The layout of a call with operands `full` (trailing absent ones may be left out) and
        result leaves `results`, checked against their shapes; axes of operands then results."""
        layout = self.layout(*full, **static)
        extra = layout.operands[len(full):]
        if any(spec is not None for spec in extra):
            raise AssertionError(f"{self.name}: the layout names operands the call lacks: {extra}")
        layout = dataclasses.replace(layout, operands=layout.operands[:len(full)])
        shapes = [None if x is None else tuple(x.shape) for x in full] + [tuple(x.shape) for x in results]
        return _resolve(layout, shapes, self.name)

    # -- batching ----------------------------------------------------------------------------------
    def _fold(self, impl, fill, xs, in_batched, axis_size, static, pin):
        """One call over the mapped axis folded into the batch axis (see the module doc)."""
        per_example = [jax.ShapeDtypeStruct(x.shape[1:] if b else x.shape, x.dtype)
                       for x, b in zip(xs, in_batched)]
        full = fill(per_example)
        out_shapes = jax.eval_shape(lambda *ys: impl(*fill(ys), **static), *per_example)
        leaves, out_tree = jax.tree.flatten(out_shapes)
        axes = self._axes(full, static, leaves)
        n = len(full)

        def batch_axis(dims):
            return next((i for i, d in enumerate(dims) if d == (BATCH,)), None)

        op_axes = [batch_axis(axes.values[i]) for i in range(n) if axes.values[i] is not None]
        out_axes = [batch_axis(d) for d in axes.values[n:]]
        extra = pin(static, axis_size, *full) if pin is not None else {}
        if (any(b and a is None for b, a in zip(in_batched, op_axes)) or None in out_axes
                or extra is None):
            # Some mapped operand or result has no batch axis, or the implementation cannot take
            # the folded call as each example's: one call per example.
            def one(mapped):
                it = iter(mapped)
                ys = [next(it) if b else x for x, b in zip(xs, in_batched)]
                return self.apply(impl, fill(ys), static)
            return jax.lax.map(one, [x for x, b in zip(xs, in_batched) if b])
        folded = []
        for x, b, a in zip(xs, in_batched, op_axes):
            if a is not None:
                if not b:  # the same operand for every example: repeated along the new rows
                    x = jnp.broadcast_to(x[None], (axis_size,) + x.shape)
                x = jnp.moveaxis(x, 0, a)
                x = x.reshape(x.shape[:a] + (x.shape[a] * x.shape[a + 1],) + x.shape[a + 2:])
            folded.append(x)
        out = self.apply(impl, fill(folded), {**static, **extra})
        got = jax.tree.leaves(out)
        restored = []
        for y, a in zip(got, out_axes):
            y = y.reshape(y.shape[:a] + (axis_size, y.shape[a] // axis_size) + y.shape[a + 1:])
            restored.append(jnp.moveaxis(y, a, 0))
        return jax.tree.unflatten(out_tree, restored)

    # -- partitioning ------------------------------------------------------------------------------
    def _partitioned(self, impl, fill, xs, static):
        """impl over xs as one custom_partitioning call whose rule is the layout."""
        full = fill(xs)
        closed, out_shapes = jax.make_jaxpr(lambda *ys: impl(*fill(ys), **static),
                                            return_shape=True)(*xs)
        consts = list(closed.consts)
        if any(isinstance(c, jax.core.Tracer) for c in consts):
            # impl closes over a traced value (e.g. a length only the device knows): it cannot be
            # re-traced per shard, so it runs as it is (XLA partitions its operations).
            return impl(*full, **static)
        leaves, out_tree = jax.tree.flatten(out_shapes)
        axes = self._axes(full, static, leaves)
        n = len(full)
        operand_values = [v for v in axes.values[:n] if v is not None]
        # Hoisted constants are extra operands the op needs whole.
        const_dims = [[(f"c{i}_{j}",) for j in range(np.ndim(c))] for i, c in enumerate(consts)]
        all_values = operand_values + const_dims + list(axes.values[n:])
        all_shapes = ([tuple(x.shape) for x in xs] + [tuple(np.shape(c)) for c in consts]
                      + [tuple(x.shape) for x in leaves])
        names, kw = _sdy_rule(all_values, all_shapes, axes.sizes)
        n_in = len(xs) + len(consts)
        sdy = ", ".join(names[:n_in]) + " -> " + ", ".join(names[n_in:])
        in_axes = _Axes(all_values[:n_in], axes.sizes)
        out_values = all_values[n_in:]
        order = list(self.priority(len(full)) if self.priority else range(len(full)))
        present = [i for i, x in enumerate(full) if x is not None]
        priority = [present.index(i) for i in order if i in present]

        def decide(mesh, arg_shapes):
            if mesh is None or mesh.empty:
                return None
            shardings = [getattr(a, "sharding", None) for a in arg_shapes]
            return _choose(in_axes, shardings, [a.shape for a in arg_shapes], mesh, priority)

        def result_shardings(shards: Shards):
            return [NamedSharding(shards.mesh, shards.spec(d)) for d in out_values]

        def infer(mesh, arg_shapes, result_shape):
            shards = decide(mesh, arg_shapes)
            if shards is None:
                mesh = _replicated_mesh([getattr(a, "sharding", None) for a in arg_shapes])
                shards = Shards(mesh, (), (), ())
            return result_shardings(shards)

        def partition(mesh, arg_shapes, result_shape):
            shards = decide(mesh, arg_shapes)
            if shards is None:
                mesh = _replicated_mesh([getattr(a, "sharding", None) for a in arg_shapes])
                shards = Shards(mesh, (), (), ())
            local = self.local(static, shards) if self.local else static
            run = self.per_shard(impl, local, shards)

            def lower(*local_xs):
                # The hoisted constants come along whole; impl captures its own again.
                return jax.tree.leaves(run(*fill(local_xs[:len(xs)])))
            arg_shardings = tuple(NamedSharding(shards.mesh, shards.spec(d)) for d in in_axes.values)
            return shards.mesh, lower, result_shardings(shards), arg_shardings

        def body(*args):
            return jax.core.eval_jaxpr(closed.jaxpr, list(args[len(xs):]), *args[:len(xs)])

        op = custom_partitioning(body)
        op.def_partition(partition=partition, infer_sharding_from_operands=infer,
                         decode_shardings=False, sharding_rule=sdy, **kw)
        flat = op(*xs, *consts)
        return jax.tree.unflatten(out_tree, flat)


# --------------------------------------------------------------------------------------------------
# The rules. A rule's layout function takes the implementation's positional operands (arrays or
# ShapeDtypeStructs, None where absent) and its static keywords.


def _broadcast(x, full: Sequence[str], sizes: Sequence[int | None]) -> str:
    """A broadcastable operand's axes: an axis of the full size (or of size None: any) is that
    axis; one of size 1 standing for a larger one is a whole axis of its own."""
    return " ".join(f if m is None or n == m else f"one{i}" for i, (f, n, m) in
                    enumerate(zip(full, x.shape, sizes)))


def _channel_scale(x, hkv: int) -> str | None:
    """k_scale / v_scale: one element (per tensor: whole), [1, Hkv, 1, D] or [Hkv·D] (per channel)."""
    if x is None:
        return None
    if x.size == 1:
        return " ".join(f"one{i}" for i in range(x.ndim))
    if x.ndim == 4:
        return "one0 h one2 d"
    return "(h d)"


def _kv_append_layout(cache, new, start, **static):
    return Layout(("b h c d", "b h s d", "b"), ("b h c d", "b"))


#: ops.kv_append and the kv_append target: cache [B, H, C, D], new [B, H, S, D], start [B].
KV_APPEND = Rule("kv_append", _kv_append_layout)


def _query_heads_layout(q, bias) -> tuple[str, str | None]:
    """A BHSD query [B, Hq, S, D] and its bias [B|1, Hq|1, S|1, T] (or None)."""
    b, hq, s, _ = q.shape
    bias_axes = None if bias is None else _broadcast(bias, ("b", "(h g)", "s", "t"), (b, hq, s, None))
    return "b (h g) s d", bias_axes


def _decode_layout(q, k_cache, v_cache, kv_len, bias=None, sink=None, k_scale=None, v_scale=None,
                   **static):
    hkv = k_cache.shape[1]
    q_axes, bias_axes = _query_heads_layout(q, bias)
    return Layout((q_axes, "b h c e", "b h c e", "b", bias_axes,
                   None if sink is None else "(h g)",
                   _channel_scale(k_scale, hkv), _channel_scale(v_scale, hkv)),
                  (q_axes,), sizes={HEADS: hkv})


#: ops.decode_attention and the decode_attention target: q [B, Hq, S, D], caches [B, Hkv, C, D]
#: (or D/2), kv_len [B], bias [B|1, Hq|1, S|1, T], sink [Hq], scales -> [B, Hq, S, D].
DECODE_ATTENTION = Rule("decode_attention", _decode_layout)


def _general_layout(q, k, v, kv_len, bias=None, *, qk_mode=None, **static):
    hkv = k.shape[1]
    q_axes, bias_axes = _query_heads_layout(q, bias)
    results = ("b (h g) s dv",) + (("b (h g) s c",) if qk_mode is not None else ())
    return Layout((q_axes, "b h c d", "b h c dv", "b", bias_axes), results, sizes={HEADS: hkv})


#: The general_attention target: q [B, Hq, S, D], k [B, Hkv, C, D], v [B, Hkv, C, Dv], kv_len [B],
#: bias -> (y [B, Hq, S, Dv], qk [B, Hq, S, C] or None).
GENERAL_ATTENTION = Rule("general_attention", _general_layout)


def _prefill_layout(q, k, v, q_len, kv_len, sink=None, **static):
    return Layout(("b (h g) s d", "b h t d", "b h t d", "b", "b", None if sink is None else "(h g)"),
                  ("b (h g) s d",),
                  sizes={HEADS: k.shape[1]})


#: The prefill_attention target: q [B, Hq, S, D], k / v [B, Hkv, T, D], q_len / kv_len [B],
#: sink [Hq] or None -> [B, Hq, S, D].
PREFILL_ATTENTION = Rule("prefill_attention", _prefill_layout)


def _local_heads(static: dict, shards: Shards) -> dict:
    """num_heads / kv_num_heads of one shard."""
    t = shards.head_pieces
    return {**static, "num_heads": static["num_heads"] // t,
            "kv_num_heads": static["kv_num_heads"] // t}


def _gqa_inputs_layout(key):
    """(query, key, value, cache axes, q heads axis) of GroupQueryAttention's inputs: separate
    Q / K / V split by heads; a packed [Q | K | V] query (key None) keeps its heads whole (its
    thirds do not split at one place)."""
    if key is None:
        return "b s qkv", None, None, "b hw c e", "hq"
    return "b s (h qd)", "b kvs (h kd)", "b kvs (h vd)", "b h c e", "(h g)"


def _gqa_prepare_layout(query, key, value, k_cache, v_cache, seqlens_k, cos_cache=None,
                        sin_cache=None, position_ids=None, q_norm_weight=None, k_norm_weight=None,
                        k_scale=None, v_scale=None, *, num_heads, kv_num_heads, **static):
    hkv = kv_num_heads
    q_axes, k_axes, v_axes, cache_axes, heads = _gqa_inputs_layout(key)
    packed = key is None
    scale = (lambda x: None if x is None else " ".join(f"one{i}" for i in range(x.ndim))) if packed \
        else (lambda x: _channel_scale(x, hkv))
    operands = (q_axes, k_axes, v_axes, cache_axes, cache_axes, "b",
                None if cos_cache is None else "pos r", None if sin_cache is None else "pos r",
                None if position_ids is None else "b s",
                None if q_norm_weight is None else "d", None if k_norm_weight is None else "d",
                scale(k_scale), scale(v_scale))
    return Layout(operands, (f"b {heads} s d", cache_axes, cache_axes, "b"),
                  sizes={} if packed else {HEADS: hkv})


def _local_gqa_prepare(static: dict, shards: Shards) -> dict:
    return _local_heads(static, shards)


#: The gqa_prepare target (and its spec reference.gqa.prepare_step): separate Q/K/V split by KV
#: heads with the caches; a packed query keeps the heads whole.
GQA_PREPARE = Rule("gqa_prepare", _gqa_prepare_layout, local=_local_gqa_prepare)


def _gqa_layout(query, key, value, past_key, past_value, seqlens_k, cos_cache, sin_cache,
                position_ids, attention_bias, head_sink, k_scale, v_scale, q_norm_weight,
                k_norm_weight, query_seqlens, *, config, total=None):
    hkv, n = config.kv_num_heads, config.num_heads
    q_axes, k_axes, v_axes, cache_axes, heads = _gqa_inputs_layout(key)
    packed = key is None
    b, s = query.shape[:2]
    if attention_bias is None:
        bias_axes = None
    elif packed:
        bias_axes = _broadcast(attention_bias, ("b", "hq", "s", "t"), (b, n, s, None))
    else:
        bias_axes = _broadcast(attention_bias, ("b", "(h g)", "s", "t"), (b, n, s, None))

    def scale(x):
        if x is None:
            return None
        return " ".join(f"one{i}" for i in range(x.ndim)) if packed or x.size == 1 \
            else _channel_scale(x, hkv)
    operands = (q_axes, k_axes, v_axes,
                None if past_key is None else cache_axes, None if past_value is None else cache_axes,
                "b", None if cos_cache is None else "pos r", None if sin_cache is None else "pos r",
                None if position_ids is None else "b s", bias_axes,
                None if head_sink is None else heads, scale(k_scale), scale(v_scale),
                None if q_norm_weight is None else "d", None if k_norm_weight is None else "d",
                None if query_seqlens is None else "b")
    out_axes = "b s qkv" if packed else "b s (h od)"
    present = "b hw p e" if packed else "b h p e"
    results = (out_axes, present, present) + ((f"b {heads} s t",) if config.qk_output else ()) + ("b",)
    return Layout(operands, results, sizes={} if packed else {HEADS: hkv})


def _local_gqa(static: dict, shards: Shards) -> dict:
    c = static["config"]
    t = shards.head_pieces
    return {**static, "config": dataclasses.replace(c, num_heads=c.num_heads // t,
                                                    kv_num_heads=c.kv_num_heads // t)}


#: ops.group_query_attention (reference.group_query_attention and its CUDA paths).
GROUP_QUERY_ATTENTION = Rule("group_query_attention", _gqa_layout, local=_local_gqa)


def _attention_layout(q, k, v, attn_mask=None, past_key=None, past_value=None,
                      nonpad_kv_seqlen=None, **static):
    # The reference says return_qk, the CUDA step qk_mode (None: no qk).
    return_qk = static.get("return_qk", False) or static.get("qk_mode") is not None
    hkv = k.shape[1]
    q_axes, mask_axes = _query_heads_layout(q, attn_mask)
    operands = (q_axes, "b h l d", "b h l dv", mask_axes,
                None if past_key is None else "b h p d", None if past_value is None else "b h p dv",
                None if nonpad_kv_seqlen is None else "b")
    results = ("b (h g) s dv", "b h t d", "b h t dv") + (("b (h g) s t",) if return_qk else ())
    return Layout(operands, results, sizes={HEADS: hkv})


#: ops.attention / attention_with_cache (reference.attention and its CUDA paths), on BHSD q, k, v.
ATTENTION = Rule("attention", _attention_layout)


# Projections: y [M, N_out] = x [M, K] W^T. Column-parallel: W's N rows split (h), each device
# computes its output features, no collective; gate / up pairs stay together (pieces of 16 rows).
# Row-parallel: K split (k), in pieces of whole blocks: each device a partial product, summed by one
# psum, the bias and the residual added after the sum. The batch axis is M. K stays whole with an
# RMS-norm prologue (the norm reads all of K) and when gated (the gate is not linear).

def _linear_layout(x, w, bias=None, residual=None, norm_weight=None, *, gated=False, **static):
    rows, k = w.shape
    unit = 16 if gated else 8
    whole_k = gated or norm_weight is not None or k % 8
    k_axis = "kw" if whole_k else "(k e)"
    sizes = {HEADS: rows // unit} if whole_k else {HEADS: rows // unit, CONTRACTED: k // 8}
    return Layout((f"b {k_axis}", f"(h r) {k_axis}", None if bias is None else "(h r)",
                   None if residual is None else "b (h o)", None if norm_weight is None else "kw"),
                  ("b (h o)",), sizes=sizes)


def _nbits_layout(x, b_quant, scales, zero_points=None, bias=None, residual=None, norm_weight=None,
                  *, gated=False, **static):
    rows = b_quant.shape[0]
    tiled = scales.ndim == 3  # [ceil(N / 16), k_blocks, 16] (ops.tile_nbits_meta): split by tiles
    unit = max(16 if gated else 8, scales.shape[2] if tiled else 1)
    whole_k = gated or norm_weight is not None
    blocks = "kb" if whole_k else "k"  # K splits in whole quantisation blocks
    if tiled and rows % unit:  # a partial last tile: the rows stay whole
        n, meta, sizes = "n", f"tiles {blocks} t", {}
    else:
        # (A tile is one h: Shardy takes no group with a factor of size 1.)
        meta = f"h {blocks} t" if tiled else f"(h r) {blocks}"
        n, sizes = "(h r)", {HEADS: rows // unit}
    out = "b (h o)" if sizes else "b o"
    return Layout(("b kw" if whole_k else "b (k e)", f"{n} {blocks} blob", meta,
                   None if zero_points is None else meta,
                   None if bias is None else n, None if residual is None else out,
                   None if norm_weight is None else "kw"),
                  (out,), sizes=sizes)


def _partial_sums(bias_at: int, residual_at: int):
    """per_shard of a projection: with K split, the partial products summed over the devices
    (one psum), then the bias and the residual (each rounded to y's dtype, as the epilogue does)."""
    def per_shard(impl, static, shards: Shards):
        if not shards.contracted:
            return functools.partial(impl, **static)

        def run(*operands):
            operands = list(operands)
            bias, residual = operands[bias_at], operands[residual_at]
            operands[bias_at] = operands[residual_at] = None
            y = jax.lax.psum(impl(*operands, **static), shards.contracted)
            if bias is not None:
                y = y + bias.astype(y.dtype)
            if residual is not None:
                y = y + residual.astype(y.dtype)
            return y
        return run
    return per_shard


def _weight_first(n: int) -> list[int]:
    """The weight decides a projection's split (rows: column-parallel, K: row-parallel), then x."""
    return [1, 0] + list(range(2, n))


def _nbits_rows_layout(x, w, scales, zero_points=None, bias=None, residual=None, norm_weight=None,
                       **static):
    # The rows layout (ops.linear.to_rows_layout) interleaves 64 W rows a group: rows and K stay
    # whole (batch only) until a split by row groups is written.
    meta = "groups kb t"
    return Layout(("b kw", "groups steps blob", meta, None if zero_points is None else meta,
                   None if bias is None else "nr", None if residual is None else "b o",
                   None if norm_weight is None else "kw"), ("b o",))


def _nbits_record_layout(x, rec, bias=None, residual=None, norm_weight=None, **static):
    # The record layout (ops.linear.to_record_layout) holds W, scales and zero points per (16-row
    # tile, 256-k chunk): rows and K stay whole (batch only) until a split by tiles is written.
    return Layout(("b kw", "tiles chunks rec", None if bias is None else "nr",
                   None if residual is None else "b o", None if norm_weight is None else "kw"), ("b o",))


#: The linear target (and its spec reference.linear.linear): x [M, K], w [N, K], bias [N],
#: residual [M, N_out], norm_weight [K] -> [M, N_out].
LINEAR = Rule("linear", _linear_layout, per_shard=_partial_sums(2, 3), priority=_weight_first)
#: The matmul_nbits target (and reference.linear.matmul_nbits): x [M, K], b_quant [N, K / block,
#: blob], scales / zero_points [N, K / block] or tiled [ceil(N / 16), K / block, 16], bias, residual,
#: norm_weight as LINEAR.
MATMUL_NBITS = Rule("matmul_nbits", _nbits_layout, per_shard=_partial_sums(4, 5),
                    priority=_weight_first)
#: The matmul_nbits target with 4-bit weights in the rows layout: w [ceil(N / 64), K / 16, 512],
#: scales / zero_points [ceil(N / 64), K / block, 64], the rest as MATMUL_NBITS; batch only.
MATMUL_NBITS_ROWS = Rule("matmul_nbits (rows layout)", _nbits_rows_layout)
#: The matmul_nbits target with 4-bit weights in the record layout: x [1, K], rec [N / 16, K / 256,
#: 2432], bias, residual, norm_weight as MATMUL_NBITS; batch only.
MATMUL_NBITS_RECORD = Rule("matmul_nbits (record layout)", _nbits_record_layout)


def _linear_gqa_prepare_layout(x, w, bias=None, norm_weight=None, k_cache=None, v_cache=None,
                               seqlens_k=None, cos_cache=None, sin_cache=None, position_ids=None,
                               **static):
    # One decode row against the whole packed QKV weight (rotary-pair order): batch only.
    weight = "n kw" if w.ndim == 2 else "tiles chunks rec"
    return Layout(("b kw", weight, None if bias is None else "n", None if norm_weight is None else "kw",
                   "b hw c e", "b hw c e", "b", "pos r", "pos r", None if position_ids is None else "b s"),
                  ("b hq s d", "b hw c e", "b hw c e", "b"))


#: The linear_gqa_prepare target (linear / matmul_nbits (record layout) then gqa_prepare, one
#: launch): x [1, K], w, bias, norm_weight, caches, seqlens_k, cos / sin, position_ids ->
#: (q, caches, status); batch only.
LINEAR_GQA_PREPARE = Rule("linear_gqa_prepare", _linear_gqa_prepare_layout)
