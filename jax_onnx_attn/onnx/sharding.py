"""Tensor parallelism of a lowered decoder: which weights split over the model axis, and how.

Megatron's layout, found from the graph's structure (after `onnx.fusion`, whose `Linear` nodes are
the projections):

* column-parallel (the weight's N rows split, each device computes some output features, no
  collective): the projections that feed an attention (Q, K, V, or the packed QKV) and the gated
  gate / up projection of the MLP;
* row-parallel (the weight's K columns split: each device a partial sum, one all-reduce): the
  projection that reads an attention's output (o) and the one that reads the gated MLP's (down);
* the LM head (the projection that makes the logits) split by vocabulary rows.

The attention between them splits by heads (`ops.partitioning`): its query heads and KV heads
follow the Q / K / V features, and the KV cache splits by KV heads with them. A packed QKV weight
([Q heads | K heads | V heads] rows) would not split at one place, so its rows are regrouped shard
by shard ([Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...], `regroup_packed_rows`); the cache step then unpacks
each shard's part into separate Q, K, V (`FixedCacheStep(packed_qkv_groups=...)`).

Everything else (embedding, norms, rotary tables, projections the walk does not place) stays whole
on every device. A projection placed wrongly would still compute the right values (XLA moves what
the split needs); only the collectives would cost more.
"""

from __future__ import annotations

import dataclasses
from collections import defaultdict

import jax.numpy as jnp
import numpy as np
import onnx

from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.fusion import JOA_DOMAIN, LINEAR_INPUTS
from jax_onnx_attn.ops.cuda_matmul import meta_tile_rows
from jax_onnx_attn.ops.linear import tile_nbits_meta, untile_nbits_meta

COLUMN, ROW, VOCAB = "column", "row", "vocab"
#: Normalisations: the walks from an attention stop there (the residual stream is beyond), except
#: at a per-head norm (its weight narrower than the model's hidden size: Qwen3's q / k norm).
NORMS = ("SimplifiedLayerNormalization", "SkipSimplifiedLayerNormalization", "LayerNormalization",
         "SkipLayerNormalization", "RMSNormalization")
#: Nodes a walk crosses at most between an attention and its projections.
_MAX_STEPS = 24


@dataclasses.dataclass(frozen=True)
class ParamSplit:
    """How one weight splits over the model axis.

    axis: the axis split into equal contiguous pieces.
    packed_heads: (num_heads, kv_num_heads, head_size) for a packed QKV projection's rows (axis 0
      of the weight, its scales / zero points, its bias): regrouped shard-major before the split.
    tiled_rows: N for MatMulNBits scales / zero points in the kernels' tiled layout [ceil(N / 16),
      k_blocks, 16] (`ops.tile_nbits_meta`): axis 0 holds tiles of 16 rows, so a row split cuts
      between tiles and a regroup un-tiles, regroups the rows and tiles again.
    """

    axis: int
    packed_heads: tuple[int, int, int] | None = None
    tiled_rows: int | None = None


@dataclasses.dataclass
class TensorParallelPlan:
    """Where a lowered decoder's projections split (module doc); `plan_tensor_parallel` makes it.

    Attributes:
      pieces: the model axis' size.
      splits: {param name: ParamSplit}; params not named stay whole.
      roles: {Linear node name: COLUMN | ROW | VOCAB} of the projections that split.
      whole: {Linear node name: why it stays whole} for projections the walk found but cannot split.
      regrouped_queries: {packed query value name: G} for each GroupQueryAttention whose packed QKV
        rows are regrouped into G shard-major groups (the cache step unpacks them).
    """

    pieces: int
    splits: dict[str, ParamSplit] = dataclasses.field(default_factory=dict)
    roles: dict[str, str] = dataclasses.field(default_factory=dict)
    whole: dict[str, str] = dataclasses.field(default_factory=dict)
    regrouped_queries: dict[str, int] = dataclasses.field(default_factory=dict)

    def prepare(self, params: dict) -> dict:
        """params with every packed QKV weight's rows regrouped shard-major (new arrays; the
        others as they are)."""
        out = dict(params)
        for name, split in self.splits.items():
            if split.packed_heads is None:
                continue
            if split.tiled_rows is None:
                out[name] = regroup_packed_rows(params[name], *split.packed_heads, self.pieces)
            else:
                rows = untile_nbits_meta(params[name], split.tiled_rows)
                out[name] = tile_nbits_meta(regroup_packed_rows(rows, *split.packed_heads,
                                                                self.pieces))
        return out

    def counts(self) -> dict[str, int]:
        """Projections per role (for reports)."""
        found = defaultdict(int)
        for role in self.roles.values():
            found[role] += 1
        return dict(found)


def regroup_packed_rows(rows, num_heads: int, kv_num_heads: int, head_size: int, groups: int):
    """Rows [Q heads | K heads | V heads] (axis 0, head_size rows a head; any trailing axes) ->
    [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...]: group g holds query heads g·N/G .. and KV heads g·Hkv/G ..,
    so that a contiguous split into G pieces gives each piece a packed QKV of its own heads."""
    n, hkv, d, g = num_heads, kv_num_heads, head_size, groups
    if n % g or hkv % g or rows.shape[0] != (n + 2 * hkv) * d:
        raise ValueError(f"regroup_packed_rows: {rows.shape[0]} rows of ({n} + 2 x {hkv}) heads of "
                         f"{d} do not regroup into {g} groups")
    xp = np if isinstance(rows, np.ndarray) else jnp
    rest = rows.shape[1:]
    q = rows[:n * d].reshape((g, n // g * d) + rest)
    k = rows[n * d:(n + hkv) * d].reshape((g, hkv // g * d) + rest)
    v = rows[(n + hkv) * d:].reshape((g, hkv // g * d) + rest)
    return xp.concatenate([q, k, v], axis=1).reshape(rows.shape)


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return onnx.helper.get_attribute_value(a)
    return default


def _input(node, what: str) -> str:
    i = LINEAR_INPUTS.index(what)
    return node.input[i] if len(node.input) > i else ""


def _is_linear(node) -> bool:
    return node.op_type == "Linear" and node.domain == JOA_DOMAIN


class _Walk:
    """Producers and readers of the main graph's values."""

    def __init__(self, graph: onnx.GraphProto, hidden: int | None, params: dict):
        self.nodes = list(graph.node)
        self.producer = {o: n for n in self.nodes for o in n.output if o}
        self.readers = defaultdict(list)
        for n in self.nodes:
            for i in n.input:
                if i:
                    self.readers[i].append(n)
        self.hidden, self.params = hidden, params

    def crosses(self, node) -> bool:
        """Whether a walk may pass `node`: not a projection, not a norm of the residual stream."""
        if _is_linear(node):
            return False
        if node.op_type in NORMS:
            scale = node.input[2] if node.op_type.startswith("Skip") else node.input[1]
            weight = self.params.get(scale)
            return (weight is not None and self.hidden is not None
                    and int(np.prod(weight.shape)) < self.hidden)
        return True

    def back(self, names, stop=()) -> set[str]:
        """Linear nodes (by name) whose output reaches `names` through crossable nodes only (and
        none of the nodes `stop`)."""
        found, seen, stack = set(), {id(n) for n in stop}, [(n, 0) for n in names if n]
        while stack:
            name, depth = stack.pop()
            node = self.producer.get(name)
            if node is None or id(node) in seen or depth > _MAX_STEPS:
                continue
            seen.add(id(node))
            if _is_linear(node):
                found.add(node.name)
            elif self.crosses(node):
                stack.extend((i, depth + 1) for i in node.input if i)
        return found

    def forward(self, names) -> tuple[set[str], list]:
        """(Linear nodes (by name) that read `names` as their x through crossable nodes only, the
        crossed nodes: a decomposed attention's, whose other inputs come from the Q projection)."""
        found, seen, crossed, stack = set(), set(), [], [(n, 0) for n in names if n]
        while stack:
            name, depth = stack.pop()
            for node in self.readers.get(name, ()):
                if id(node) in seen or depth > _MAX_STEPS:
                    continue
                seen.add(id(node))
                if _is_linear(node):
                    if node.input[0] == name:
                        found.add(node.name)
                elif self.crosses(node):
                    crossed.append(node)
                    stack.extend((o, depth + 1) for o in node.output if o)
        return found, crossed


def _attention_nodes(graph, graph_inputs: set):
    """[(node, data inputs, output)] of every attention: GroupQueryAttention and ai.onnx Attention
    (Q, K, V in, output 0 out), and a cache Concat(past, new) of a torch export (the new rows in,
    the concatenation out: the decomposed attention reads it)."""
    found = []
    for node in graph.node:
        dom = registry.normalize_domain(node.domain)
        if (dom, node.op_type) in ((registry.MS_DOMAIN, "GroupQueryAttention"), ("", "Attention")):
            found.append((node, list(node.input[:3]), node.output[0]))
        elif dom == "" and node.op_type == "Concat" and len(node.input) == 2 \
                and node.input[0] in graph_inputs:
            found.append((node, [node.input[1]], node.output[0]))
    return found


def plan_tensor_parallel(lowered, pieces: int, logits_name: str | None = None) -> TensorParallelPlan:
    """The tensor-parallel split of `lowered` (a LoweredModel, fused) over `pieces` devices.

    Args:
      lowered: the model; its `model` graph and `params` are read, not changed.
      pieces: devices along the model axis (1: nothing splits).
      logits_name: the graph output holding the logits (its projection is the LM head); None:
        "logits", else the first output.

    Returns:
      TensorParallelPlan. Raises ValueError when an attention's heads do not divide into `pieces`
      (query heads and KV heads must split at one place).
    """
    plan = TensorParallelPlan(pieces=int(pieces))
    if plan.pieces <= 1:
        return plan
    graph, params = lowered.model.graph, lowered.params
    graph_inputs = set(lowered.input_names)
    linears = {n.name: n for n in graph.node if _is_linear(n)}
    kn = sorted(name for name, n in linears.items() if _attr(n, "layout") == b"kn")
    if kn:  # the splits below read a dense weight as [N, K]
        raise ValueError(f"plan_tensor_parallel: dense weights stored [K, N] (load(dense_layout='kn')) do "
                         f"not split; load the model with dense_layout='nk' for a mesh (e.g. {kn[0]})")
    pairs = sorted(name for name, n in linears.items() if _attr(n, "qkv_pairs") is not None)
    if pairs:  # the regrouping below reads a packed QKV weight's rows in the heads' own order
        raise ValueError(f"plan_tensor_parallel: packed QKV weights in the rotary-pair order "
                         f"(load(qkv_prepare=True)) do not split; load the model without it for a mesh "
                         f"(e.g. {pairs[0]})")
    mlps = sorted(n.name for n in graph.node if n.op_type in ("GatedMlp", "OutMlp"))
    if mlps:  # the splits below see Linear nodes only
        raise ValueError(f"plan_tensor_parallel: fused gated MLPs (load(gated_mlp=True), out_mlp=True) do not "
                         f"split; load the model without them for a mesh (e.g. {mlps[0]})")
    embedding = next((params[n.input[0]] for n in graph.node
                      if n.op_type == "Gather" and n.input[0] in params and n.input[1] == "input_ids"),
                     None)
    hidden = int(embedding.shape[-1]) if embedding is not None else None
    walk = _Walk(graph, hidden, params)

    roles: dict[str, str] = {}
    packed: dict[str, tuple[int, int, int]] = {}   # Linear name -> its packed heads
    packed_query: dict[str, str] = {}              # Linear name -> the packed query it makes
    for node, inputs, output in _attention_nodes(graph, graph_inputs):
        _check_heads(node, pieces)
        for name in walk.back(inputs):
            roles[name] = COLUMN
        if node.op_type == "GroupQueryAttention" and (len(node.input) < 2 or not node.input[1]):
            producer = walk.producer.get(node.input[0])
            if producer is not None and _is_linear(producer):
                n, hkv = int(_attr(node, "num_heads")), int(_attr(node, "kv_num_heads"))
                rows = _rows(producer, params)
                packed[producer.name] = (n, hkv, rows // (n + 2 * hkv))
                packed_query[producer.name] = node.input[0]
        rows, crossed = walk.forward([output])
        for name in rows:
            roles.setdefault(name, ROW)
        for name in walk.back([i for n in crossed for i in n.input]):
            roles.setdefault(name, COLUMN)
    for name, node in linears.items():
        if _attr(node, "gated", 0):
            roles[name] = COLUMN
            for down in walk.forward([node.output[0]])[0]:
                roles.setdefault(down, ROW)
    # An MLP the fusion left apart (gate and up of one input, e.g. GELU-gated): the projections that
    # feed a projection, all reading one x, without an attention between.
    attentions = [n for n, _, _ in _attention_nodes(graph, graph_inputs)]
    attentions += [n for n in graph.node if n.op_type == "Softmax"]
    for name, node in linears.items():
        if name in roles:
            continue
        feeding = walk.back([node.input[0]], stop=attentions)
        if len(feeding) >= 2 and not feeding & set(roles) and \
                len({linears[f].input[0] for f in feeding}) == 1:
            roles.update({f: COLUMN for f in feeding})
            roles[name] = ROW
    outputs = [o.name for o in graph.output]
    logits = logits_name or ("logits" if "logits" in outputs else outputs[0])
    heads = walk.back([logits])  # through a softcap, if any
    if len(heads) == 1 and not heads & set(roles):
        roles[heads.pop()] = VOCAB

    for name, role in roles.items():
        why = _place(plan, linears[name], role, packed.get(name), params)
        if why:
            plan.whole[name] = why
        else:
            plan.roles[name] = role
            if name in packed_query:
                plan.regrouped_queries[packed_query[name]] = plan.pieces
    return plan


def _check_heads(node, pieces: int) -> None:
    """Query and KV heads of an attention node (where its attributes say) divide into `pieces`."""
    heads = [(a, _attr(node, a)) for a in ("num_heads", "kv_num_heads", "q_num_heads")]
    for name, value in heads:
        if value is not None and int(value) % pieces:
            raise ValueError(f"tensor parallelism over {pieces} devices: {node.op_type} "
                             f"{node.name!r} has {name}={value}, not a multiple of {pieces} (query "
                             f"and KV heads split over the devices)")


def _rows(node, params) -> int:
    """N: the output rows of a Linear's weight (before gating)."""
    bits = _attr(node, "bits", 0)
    return int(_attr(node, "N")) if bits else int(params[_input(node, "w")].shape[0])


def _place(plan: TensorParallelPlan, node, role: str, packed_heads, params) -> str | None:
    """Add the splits of one projection's weights to the plan, or say why it stays whole."""
    t = plan.pieces
    bits = _attr(node, "bits", 0)
    gated = bool(_attr(node, "gated", 0))
    rows = _rows(node, params)
    w = _input(node, "w")
    k = int(_attr(node, "K")) if bits else int(params[w].shape[1])
    if _attr(node, "layout") in ("rows", b"rows"):
        return "4-bit weights in the rows layout (ops.to_rows_layout) have no split yet"
    if _attr(node, "layout") in ("record", b"record"):
        return "4-bit weights in the record layout (ops.to_record_layout) have no split yet"
    # Piece sizes the kernels take: rows in multiples of 8 (16 when gated: a gate / up block pair),
    # K in whole quantisation blocks (and multiples of 8).
    if role == ROW:
        if _input(node, "norm_weight"):
            return "a row-parallel projection with an RMS-norm prologue (the norm needs all of K)"
        if gated:
            return "a gated projection cannot sum partial products (the gate is not linear)"
        block = int(_attr(node, "block_size")) if bits else 8
        if k % (t * block):
            return f"K={k} does not split into {t} pieces of whole {block}-element blocks"
        axis = 1
    else:
        # Tiled scales / zero points split between their 16-row tiles.
        tiled = bool(bits) and np.ndim(params[_input(node, "scales")]) == 3
        unit = max(16 if gated else 8, meta_tile_rows() if tiled else 1)
        if rows % (t * unit):
            return f"N={rows} does not split into {t} pieces of multiples of {unit} rows"
        if packed_heads is not None:
            n, hkv, d = packed_heads
            if (n % t or hkv % t or (n + 2 * hkv) * d != rows
                    or (n // t * d) % 8 or (hkv // t * d) % 8):
                return f"packed QKV of {n} + 2 x {hkv} heads does not regroup into {t} pieces"
        axis = 0
    split = ParamSplit(axis, packed_heads if role == COLUMN else None)
    new = {_input(node, "w"): split}
    for what in ("scales", "zero_points"):
        name = _input(node, what)
        if name:
            tiled = np.ndim(params[name]) == 3  # else row-major [N, k_blocks]: as the weight
            new[name] = dataclasses.replace(split, tiled_rows=rows) if tiled else split
    bias = _input(node, "bias")
    if bias and role != ROW:
        new[bias] = ParamSplit(0, split.packed_heads)
    shared = [name for name, s in new.items() if plan.splits.get(name, s) != s]
    if shared:
        return f"weights {shared} are read by another projection that splits them otherwise"
    plan.splits.update(new)
    return None


__all__ = ["TensorParallelPlan", "ParamSplit", "plan_tensor_parallel", "regroup_packed_rows",
           "COLUMN", "ROW", "VOCAB"]
