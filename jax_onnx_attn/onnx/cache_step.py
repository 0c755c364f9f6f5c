"""Fixed-capacity KV-cache stepping of a lowered decoder: one jittable step for prefill and decode.

    step = lowered.fixed_cache_step(batch=B, capacity=C)
    cache = step.init_cache(params)                        # {past input name: [B, Hkv, C, D] zeros}
    logits, cache = step(params, input_ids, cache_len, num_new, cache)
    logits, cache, status = step.with_status(params, input_ids, cache_len, num_new, cache)

input_ids int32 [B, S] is right-padded; cache_len int32 [B] counts the tokens already in the cache of
each row; num_new int32 [B] (<= S) counts the valid new tokens. Row b's tokens sit at positions
cache_len[b] .. cache_len[b] + S - 1; logits [B, S, V] are valid at s < num_new[b]. The caller sets
cache_len += num_new for the next step. Every row needs cache_len[b] + S <= C: the padded tail of a
row is written too (beyond the row's valid length, where the next step overwrites it).

Device status: `step.with_status` also returns status int32 [B], the bitwise OR of the status of
every op of the step that writes the cache (`jax_onnx_attn.ops.status`: GroupQueryAttention,
kv_append, attention_with_cache) and of the step's own check of the same rule (cache_len[b] >= 0
and cache_len[b] + S <= C). A flagged row's cache write was skipped, so its buffers keep what they
held; its logits are not meaningful. Nothing synchronises: the caller reads the status when it
reads anything else (DecoderSession folds it into the summary it reads between decode calls).
Calling the step itself returns (logits, cache) as before.

How the graph is driven, by the kind of KV cache it has: one cache policy class each
(`BuilderSharedBuffer`, `TorchConcat`, `AttentionWithPast`), with one method per decision (which
nodes hold the cache, what feeds the past inputs, how the node's head count and size are probed,
how the step intercepts the graph):
  * GroupQueryAttention (onnxruntime-genai builder): past_key_values.* are fed the capacity-C buffers
    and GQA runs in its shared-buffer mode (present is past, written in place at past_b). The
    attention_mask fed is [B, C] with ones at j < cache_len + S, so the graph's own mask subgraph
    gives seqlens_k = cache_len + S - 1 and total_sequence_length = C (GQA's static-cache
    form: past_b = seqlens_k + 1 - S = cache_len). A sliding-window layer (local_window_size W, with
    sliding_window_cache=1 when the producer sized its cache to the window, as the builder does for
    Gemma-2 on CPU/CUDA) keeps a capacity-C buffer too and runs with sliding_window_cache=0: no row
    is ever evicted (cache_len + S <= C), so onnxruntime's window-sized layout would hold the same
    positions at the same rows and the window mask alone gives the same output, while the windowed
    path would move (copy) the buffer every step. The cost is C rows of memory instead of W + slack;
    only the window's keys are unmasked. An If whose condition reads the mask's width (the
    LongRoPE cos/sin choice) is decided on the logical length max(cache_len + num_new), on the
    device, as onnxruntime-genai's growing mask would decide it.
  * Concat(past, new) outside the attention op (torch.onnx.export): the Concat becomes
    `ops.kv_append(cache, new, cache_len)`, so every "present" is the capacity-C buffer updated in
    place. past_key_values.* are shape-only placeholders of length C - S, so the graph's own mask
    arithmetic sees C keys; the attention it builds is then restricted to keys
    j <= cache_len[b] + s (our causal mask, ANDed into ai.onnx Attention's mask or applied before
    every Softmax over the keys of a decomposed attention).
  * ai.onnx Attention with past_key/past_value inputs: the node runs as
    `ops.attention_with_cache` over the buffers.

Donate `cache` (argument 4) to the jit: the buffers are updated in place (`jit()` does it).
"""

from __future__ import annotations

from collections import ChainMap
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
import onnx

from jax_onnx_attn import ops
from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.fusion import JOA_DOMAIN
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.onnx.handlers.attention import (ATTENTION_ATTRS, known_attrs, run_attention,
                                                   run_gqa)
from jax_onnx_attn.onnx.handlers.control import select_branches
from jax_onnx_attn.onnx.interpreter import NodeContext
from jax_onnx_attn.onnx.values import ShapeOnly, is_static, to_jax

#: Graph inputs the step computes itself; every other input must be a KV cache input.
DRIVEN_INPUTS = ("input_ids", "attention_mask", "position_ids")


class KVSlot(NamedTuple):
    """One cache buffer: the graph input it feeds, the output that returns it, its node."""
    past: str
    present: str | None
    node: onnx.NodeProto


class StepOutput(NamedTuple):
    """What `FixedCacheStep.with_status` returns.

    logits: [B, S, V], valid at s < num_new[b].
    cache: the updated buffers, {past input name: [B, Hkv, C, D]}.
    status: int32 [B], 0 or the flags of `jax_onnx_attn.ops.status` (a refused cache write).
    """
    logits: jax.Array
    cache: dict
    status: jax.Array


class _StepRun(NamedTuple):
    """The values of one call of the step that a policy's hook reads or fills."""
    cache: dict          # {past name: buffer} as given
    new_cache: dict      # {past name: updated buffer}, filled by the hooks that update one
    cache_len: jax.Array  # int32 [B]
    num_new: jax.Array    # int32 [B]
    s: int                # new tokens per row this step
    fits: jax.Array       # bool [B]: the row's S tokens fit the buffer
    width: int            # keys the graph sees: C, or the S new rows (TorchConcat's first prompt)
    causal: jax.Array     # bool [B, 1, S, width]: query s of row b may read key j
    statuses: list        # int32 [B] statuses of the step's cache writes
    empty_cache: bool     # a first prompt (every cache_len is 0)


class CachePolicy:
    """How the step drives one kind of KV cache. Subclasses say, each in one place: which nodes hold
    the cache and which of their inputs / outputs are the buffers (`pairs`), what checks the nodes
    need (`check`), what feeds a past input (`feed`), how a node's (Hkv, D) is probed when the graph
    does not declare it (`probe`), and how the step intercepts the graph (`hook`)."""

    #: The kind's name (FixedCacheStep.mode).
    mode = ""

    def __init__(self, step: "FixedCacheStep"):
        self.step = step

    @staticmethod
    def pairs(node: onnx.NodeProto, graph_inputs: set) -> list | None:
        """[(past input index, present output index)] when `node` holds this kind of cache."""
        raise NotImplementedError

    def check(self, slots: list) -> None:
        """Raise ValueError for cache nodes this kind cannot drive."""

    def key_width(self, s: int, empty_cache: bool) -> int:
        """How many keys the graph sees in a step of S new tokens: the whole buffer by default."""
        return self.step.capacity

    def feed(self, slot: KVSlot, run: _StepRun):
        """The value fed to the slot's past input."""
        return run.cache[slot.past]

    def probe(self, ctx, inputs, slots: list, found: dict):
        """Record {past: (Hkv, D)} of the node's slots in `found`; return the node's outputs."""
        raise NotImplementedError

    def hook(self, ctx, inputs, slots: list | None, run: _StepRun):
        """The node's outputs under the step, or None to run its handler (`slots`: the node's cache
        slots, None for any other node)."""
        raise NotImplementedError


class BuilderSharedBuffer(CachePolicy):
    """onnxruntime-genai's builder: GroupQueryAttention over past_key_values.*, run in its
    shared-buffer mode on the capacity-C buffers (module doc)."""
    mode = "gqa"

    @staticmethod
    def pairs(node, graph_inputs):
        """GroupQueryAttention: past_key / past_value (inputs 3, 4) -> present (outputs 1, 2)."""
        if registry.normalize_domain(node.domain) == registry.MS_DOMAIN and \
                node.op_type == "GroupQueryAttention":
            return [(3, 1), (4, 2)]
        return None

    def probe(self, ctx, inputs, slots, found):
        """(Hkv, D) from the query (packed) or the key; the output as zeros."""
        a = ctx.attrs
        q = inputs[0]
        hkv, n = int(a["kv_num_heads"]), int(a["num_heads"])
        packed = len(inputs) < 2 or inputs[1] is None
        d = q.shape[-1] // (n + 2 * hkv) if packed else inputs[1].shape[-1] // hkv
        for s in slots:
            found[s.past] = (hkv, d)
        b, sq = q.shape[:2]
        return (jnp.zeros((b, sq, n * d), q.dtype), None, None, None)

    def hook(self, ctx, inputs, slots, run):
        """GQA in its shared-buffer mode; an If that reads the mask's width decided on the
        logical width."""
        node = ctx.node
        if slots:
            # A sliding-window layer keeps the full capacity-C buffer: no row is ever evicted
            # (cache_len + S <= C), so the window-sized layout would hold the same rows at the same
            # places, and local_window_size alone gives the same output. The windowed path would
            # restage (copy) the buffer every step.
            inputs = list(inputs)
            groups = self.step.regrouped_queries.get(node.input[0], 1)
            if groups > 1 and (len(inputs) < 2 or inputs[1] is None):
                inputs[:3] = unpack_regrouped_qkv(to_jax(inputs[0]), int(ctx.attrs["num_heads"]),
                                                  int(ctx.attrs["kv_num_heads"]), groups)
            if len(inputs) > 5 and inputs[5] is not None:
                # The graph derives seqlens_k from the C-wide mask, which clamps a row that does not
                # fit into range (GQA would write rows C - S .. C - 1): such a row gets its true
                # seqlens_k, beyond the buffer, so the op refuses its write and flags it.
                seqlens = to_jax(inputs[5])
                inputs[5] = jnp.where(run.fits, seqlens,
                                      (run.cache_len + run.s - 1).astype(seqlens.dtype))
            return run_gqa(ctx, inputs, shared_buffer=True, overrides={"sliding_window_cache": 0},
                           statuses=run.statuses, past_empty=run.empty_cache)
        if node.op_type == "If" and is_static(inputs[0]):
            cond = self.step._logical_if_condition(ctx, run.cache_len + run.num_new)
            if cond is not None:
                return select_branches(ctx, cond, pad_rows=True)
        return None


def unpack_regrouped_qkv(query, num_heads: int, kv_num_heads: int, groups: int):
    """A packed query whose rows were regrouped shard-major (`onnx.sharding.regroup_packed_rows`:
    [Q_0 K_0 V_0 | Q_1 K_1 V_1 | ...] along the last axis) -> (q [B, S, N·D], k, v [B, S, Hkv·D])
    in the heads' own order. The slices are within each group, so a query split into the groups
    (tensor parallelism) is unpacked on each device without moving data between them."""
    b, s, hidden = query.shape
    d = hidden // (num_heads + 2 * kv_num_heads)
    q_width, kv_width = num_heads // groups * d, kv_num_heads // groups * d
    x = query.reshape(b, s, groups, hidden // groups)
    q = x[..., :q_width].reshape(b, s, num_heads * d)
    k = x[..., q_width:q_width + kv_width].reshape(b, s, kv_num_heads * d)
    v = x[..., q_width + kv_width:].reshape(b, s, kv_num_heads * d)
    return q, k, v


class TorchConcat(CachePolicy):
    """torch.onnx.export: Concat(past, new) along the sequence axis, outside the attention op; the
    Concat becomes an in-place kv_append and the attention reading the cache gets the step's causal
    mask (module doc)."""
    mode = "concat"

    @staticmethod
    def pairs(node, graph_inputs):
        """Concat(past graph input, new): the past (input 0) -> the concatenation (output 0)."""
        ins = list(node.input)
        if registry.normalize_domain(node.domain) == "" and node.op_type == "Concat" and len(ins) == 2 and \
                ins[0] in graph_inputs:
            return [(0, 0)]
        return None

    def check(self, slots):
        """Concats along the sequence axis only; remembers what the cache reaches."""
        for s in slots:
            axis = next((a.i for a in s.node.attribute if a.name == "axis"), None)
            if axis not in (2, -2):
                raise ValueError(f"fixed_cache_step: Concat {s.node.name!r} appends along axis "
                                 f"{axis}, not the sequence axis of [B, H, T, D]")
        # Every value computed from a Concat's output: the attention over the cache.
        self.kv_reach = self.step._reachable({s.node.output[0] for s in slots})

    def key_width(self, s, empty_cache):
        """S on a first prompt (an empty past), else the capacity."""
        # A first prompt sees only its S new rows: its past is fed as empty, so the graph runs as a
        # plain prompt and its attention is S x S instead of S x C (the buffer is still written in
        # place).
        return s if empty_cache else self.step.capacity

    def feed(self, slot, run):
        """A shape-only placeholder: the graph's mask arithmetic sees `width` keys."""
        # A shape-only placeholder of length width - S: the graph's mask arithmetic sees the keys.
        shape, dtype = self.step.cache_shapes[slot.past]
        return ShapeOnly((shape[0], shape[1], run.width - run.s, shape[3]), dtype,
                         "the KV cache lives in the step's fixed-capacity buffer")

    def probe(self, ctx, inputs, slots, found):
        """(Hkv, D) from the new rows, which stand in for the concatenation."""
        k = to_jax(inputs[1])
        found[slots[0].past] = (k.shape[1], k.shape[3])
        return (k,)  # the concatenation with an empty past

    def hook(self, ctx, inputs, slots, run):
        """The Concat as an in-place kv_append; the attention and the softmax over the cache
        under the step's causal mask."""
        node = ctx.node
        if slots:
            past = slots[0].past
            buf, status = ops.kv_append(run.cache[past], to_jax(inputs[1]).astype(run.cache[past].dtype),
                                        run.cache_len)
            run.statuses.append(status)
            run.new_cache[past] = buf
            return (buf if run.width == self.step.capacity else buf[:, :, :run.width],)
        if node.op_type == "Attention" and node.input[1] in self.kv_reach:
            return self._masked_attention(ctx, inputs, run.causal, run.width)
        if node.op_type == "Softmax" and node.input[0] in self.kv_reach:
            x = inputs[0]
            if getattr(x, "ndim", 0) == 4 and x.shape[-1] == run.width and x.shape[-2] == run.s:
                x = to_jax(x)
                x = jnp.where(run.causal, x, jnp.asarray(-jnp.inf, x.dtype))
                return registry.lookup(ctx.key)(ctx, x)
        return None

    def _masked_attention(self, ctx, inputs, causal, width):
        """ai.onnx Attention over the cache (its first `width` rows): the graph's mask AND keys
        j <= cache_len + s."""
        inputs = list(inputs) + [None] * (7 - len(inputs))
        mask = inputs[3]
        if mask is None:
            mask = causal
        else:
            mask = to_jax(mask)
            if mask.shape[-1] != width:
                ctx.fail(f"the attention mask covers {mask.shape[-1]} keys, not the {width} the "
                         f"step feeds")
            if mask.dtype == jnp.bool_:
                mask = mask & causal
            else:
                mask = mask + jnp.where(causal, 0, -jnp.inf).astype(mask.dtype)
        return run_attention(ctx, inputs[0], inputs[1], inputs[2], mask, *inputs[4:7],
                             overrides={"is_causal": 0})


class AttentionWithPast(CachePolicy):
    """ai.onnx Attention with past_key / past_value inputs: the node runs as
    `ops.attention_with_cache` over the buffers (module doc)."""
    mode = "attention_past"

    @staticmethod
    def pairs(node, graph_inputs):
        """Attention with past inputs: past_key / past_value (4, 5) -> present (1, 2)."""
        ins = list(node.input)
        if registry.normalize_domain(node.domain) == "" and node.op_type == "Attention" and \
                len(ins) > 5 and ins[4]:
            return [(4, 1), (5, 2)]
        return None

    def probe(self, ctx, inputs, slots, found):
        """(Hkv, D) from the new K / V; the node itself over an empty past."""
        k, v = inputs[1], inputs[2]
        if k.ndim == 3:
            hkv = int(ctx.attrs["kv_num_heads"])
            found[slots[0].past] = (hkv, k.shape[-1] // hkv)
            found[slots[1].past] = (hkv, v.shape[-1] // hkv)
        else:
            found[slots[0].past] = (k.shape[1], k.shape[3])
            found[slots[1].past] = (v.shape[1], v.shape[3])
        # The node itself over an empty past of the probed shape.
        inputs = list(inputs)
        b = k.shape[0]
        for i, slot in ((4, slots[0]), (5, slots[1])):
            hkv, d = found[slot.past]
            inputs[i] = jnp.zeros((b, hkv, 0, d), to_jax(k).dtype)
        return registry.lookup(ctx.key)(ctx, *inputs)

    def hook(self, ctx, inputs, slots, run):
        """The node as `ops.attention_with_cache` over the buffers."""
        if not slots:
            return None
        inputs = list(inputs) + [None] * (7 - len(inputs))
        if inputs[6] is not None:
            ctx.fail("nonpad_kv_seqlen together with past_key is invalid")
        # The node's attributes checked as run_attention checks them, and its model's opset (the
        # window attributes need 25).
        attrs = known_attrs(ctx, ATTENTION_ATTRS)
        res = ops.attention_with_cache(
            to_jax(inputs[0]), to_jax(inputs[1]), to_jax(inputs[2]), run.cache[slots[0].past],
            run.cache[slots[1].past], run.cache_len, to_jax(inputs[3]), **attrs,
            opset=ctx.interp.opsets[""], return_qk=ctx.wants(3))
        run.new_cache[slots[0].past], run.new_cache[slots[1].past] = res.key_cache, res.value_cache
        run.statuses.append(res.status)
        return res.y, res.key_cache, res.value_cache, res.qk


#: The cache kinds the step recognises.
POLICIES = (BuilderSharedBuffer, TorchConcat, AttentionWithPast)

#: (domain, op) of the projections the logits may come from (their inputs past x: params or empty).
_HEADS = {("", "MatMul"), (registry.MS_DOMAIN, "MatMulNBits"), (JOA_DOMAIN, "Linear")}
#: Nodes that act on each (row, position) alone; a binary one only with a constant of <= 1 dims.
_POSITIONWISE_UNARY = {"Cast", "Identity", "Tanh", "Neg"}
_POSITIONWISE_BINARY = {"Mul", "Div", "Add", "Sub"}


def last_new_rows(x, num_new):
    """x [B, S, ...] -> [B, 1, ...]: each row's last new token (s = num_new[b] - 1; s = 0 for a row
    without new tokens), the only position whose logits a prompt's first token needs."""
    last = jnp.clip(jnp.asarray(num_new) - 1, 0, x.shape[1] - 1)
    return jnp.take_along_axis(x, last.reshape((-1,) + (1,) * (x.ndim - 1)), axis=1)


def logits_head(producers: dict, params: dict, logits_name: str):
    """The projection node that makes `logits_name`, reached through position-wise nodes only
    (Cast, a softcap's Div / Tanh / Mul by constants, a bias Add), or None. Gathering its input's
    rows then gives the same logits as gathering the logits' rows."""

    def constant(name) -> bool:
        if name in params:
            return np.ndim(params[name]) <= 1
        node = producers.get(name)
        if node is None or node.op_type != "Constant":
            return False
        value = next((a.t for a in node.attribute if a.name == "value"), None)
        return value is not None and len(value.dims) <= 1

    name = logits_name
    for _ in range(16):
        node = producers.get(name)
        if node is None:
            return None
        key = (registry.normalize_domain(node.domain), node.op_type)
        if key in _HEADS:
            weights = [i for i in node.input[1:] if i]
            return node if weights and all(i in params for i in weights) else None
        if key[0] == "" and node.op_type in _POSITIONWISE_UNARY:
            name = node.input[0]
        elif key[0] == "" and node.op_type in _POSITIONWISE_BINARY and len(node.input) == 2:
            a, b = node.input
            if constant(b):
                name = a
            elif constant(a):
                name = b
            else:
                return None
        else:
            return None
    return None


class FixedCacheStep:
    """A jittable prefill/decode step of `lowered` over [batch, Hkv, capacity, D] KV buffers.

    Args:
      lowered, batch, capacity: the model, B and C.
      regrouped_queries: {packed query value name: G} when the params hold those GroupQueryAttention
        nodes' packed QKV rows regrouped shard-major (tensor parallelism: `onnx.sharding`); the step
        unpacks each into separate Q, K, V (`unpack_regrouped_qkv`). None: the graph's layout.

    Attributes:
      batch, capacity: B and C.
      policy: the model's cache policy (`BuilderSharedBuffer`, `TorchConcat`, `AttentionWithPast`).
      mode: its name: "gqa", "concat" or "attention_past" (see the module doc).
      slots: the KV buffers (KVSlot per past input).
      cache_shapes: {past input name: ((B, Hkv, C, D), dtype)}.
      logits_name: the graph output returned as logits.
      logits_head: the projection that makes the logits (a MatMul / MatMulNBits / fused Linear whose
        other inputs are params), reached from the logits through position-wise nodes only, or
        None. `with_status(..., last_logits=True)` runs it on each row's last token alone.
    """

    def __init__(self, lowered, batch: int, capacity: int, *,
                 regrouped_queries: dict[str, int] | None = None):
        self.lowered = lowered
        self.batch, self.capacity = int(batch), int(capacity)
        #: {packed query value: G}: GroupQueryAttention queries whose packed QKV rows the params hold
        #: regrouped into G shard-major groups (`onnx.sharding`); the step unpacks them.
        self.regrouped_queries = dict(regrouped_queries or {})
        if self.batch < 1 or self.capacity < 1:
            raise ValueError(f"fixed_cache_step: batch and capacity must be >= 1, got {batch}, {capacity}")
        graph = lowered.model.graph
        self._inputs = set(lowered.input_names)
        outputs = {o.name for o in graph.output}
        self._producers = {o: n for n in graph.node for o in n.output if o}
        self.slots, policy = self._find_slots(graph, outputs)
        self._slots_of = {}
        for sl in self.slots:
            self._slots_of.setdefault(id(sl.node), []).append(sl)
        self.policy = policy(self)
        self.mode = self.policy.mode
        self.policy.check(self.slots)
        others = [n for n in lowered.input_names
                  if n not in DRIVEN_INPUTS and n not in {s.past for s in self.slots}]
        if others:
            raise ValueError(f"fixed_cache_step: the model has inputs {others} that are neither KV "
                             f"cache inputs nor one of {DRIVEN_INPUTS}; the step cannot drive them")
        if "input_ids" not in self._inputs:
            raise ValueError("fixed_cache_step: the model has no input_ids input")
        self.logits_name = "logits" if "logits" in lowered.output_names else lowered.output_names[0]
        self.logits_head = logits_head(self._producers, lowered.params, self.logits_name)
        self.cache_shapes = self._cache_shapes()

    # -- graph analysis --------------------------------------------------------------------------
    def _through_identity(self, name: str, outputs: set) -> str | None:
        """The graph output that `name` reaches through Identity nodes only (or `name` itself)."""
        if name in outputs:
            return name
        for node in self.lowered.model.graph.node:
            if node.op_type == "Identity" and node.input and node.input[0] == name:
                found = self._through_identity(node.output[0], outputs)
                if found:
                    return found
        return None

    def _find_slots(self, graph, outputs):
        """The cache slots and the one policy whose nodes hold them."""
        slots, kinds = [], set()
        for node in graph.node:
            ins = list(node.input)
            for policy in POLICIES:
                pairs = policy.pairs(node, self._inputs)
                if pairs is None:
                    continue
                for i, o in pairs:
                    if len(ins) > i and ins[i] in self._inputs:
                        present = node.output[o] if len(node.output) > o and node.output[o] else None
                        slots.append(KVSlot(ins[i], present and self._through_identity(present, outputs),
                                            node))
                        kinds.add(policy)
                break
        if not slots:
            raise ValueError(
                "fixed_cache_step: no recognisable KV cache in the model: expected past inputs "
                "consumed by com.microsoft GroupQueryAttention, by ai.onnx Attention's past_key/"
                "past_value, or by Concat(past, new) along the sequence axis; the model's inputs "
                f"are {self.lowered.input_names}")
        if len(kinds) > 1:
            raise ValueError(f"fixed_cache_step: the model mixes KV cache kinds "
                             f"{sorted(k.mode for k in kinds)}")
        seen = [s.past for s in slots]
        dup = sorted({p for p in seen if seen.count(p) > 1})
        if dup:
            raise ValueError(f"fixed_cache_step: past inputs {dup} feed more than one cache node")
        return slots, kinds.pop()

    def _reachable(self, names: set) -> set:
        """Every value name computed (transitively) from `names`."""
        reach = set(names)
        for node in registry.iter_nodes(self.lowered.model.graph):
            if any(i in reach for i in node.input):
                reach.update(o for o in node.output if o)
        return reach

    def _cache_shapes(self) -> dict:
        info = self.lowered.input_info()
        unknown = [s.past for s in self.slots
                   if not all(isinstance(d, int) and d > 0 for d in (info[s.past][0][1], info[s.past][0][3]))]
        probed = self._probe_dims() if unknown else {}
        shapes = {}
        for s in self.slots:
            dims, dtype = info[s.past]
            if len(dims) != 4:
                raise ValueError(f"fixed_cache_step: {s.past} must be [B, H, T, D], declared {dims}")
            hkv, d = probed.get(s.past, (dims[1], dims[3]))
            shapes[s.past] = ((self.batch, int(hkv), self.capacity, int(d)), np.dtype(dtype))
        return shapes

    def _probe_dims(self) -> dict:
        """(Hkv, D) of each buffer, from the new K/V its node receives: an abstract run of the graph
        (jax.eval_shape) in which each cache node reports its dims and stands in for itself."""
        found = {}
        info = self.lowered.input_info()
        b = self.batch

        def hook(ctx, inputs):
            slots = self._slots_of.get(id(ctx.node))
            return self.policy.probe(ctx, inputs, slots, found) if slots else None

        def run(params):
            feeds = self._driven_inputs(jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32),
                                        jnp.ones((b,), jnp.int32), probe=True)
            for s in self.slots:
                dims, dtype = info[s.past]
                feeds[s.past] = ShapeOnly((b, dims[1] if isinstance(dims[1], int) else 0, 0, 0), dtype,
                                          "probing the KV head size")
            self.lowered.run(params, feeds, hook)
            return 0

        jax.eval_shape(run, self.lowered.params)
        missing = [s.past for s in self.slots if s.past not in found]
        if missing:
            raise ValueError(f"fixed_cache_step: could not infer the head count/size of {missing}")
        return found

    # -- the step ----------------------------------------------------------------------------
    def init_cache(self, params=None) -> dict:
        """{past input name: zeros [B, Hkv, C, D]} in the cache dtype, allocated once."""
        return {name: jnp.zeros(shape, dtype) for name, (shape, dtype) in self.cache_shapes.items()}

    def _driven_inputs(self, input_ids, cache_len, num_new, probe=False, width=None) -> dict:
        b, s = input_ids.shape
        feeds = {"input_ids": input_ids}
        if "attention_mask" in self._inputs:
            # Ones for every row position the graph may treat as a key: the cache plus this step's
            # S tokens (padding included; our causal mask hides what a valid query must not see).
            width = 1 if probe else (width or self.capacity)
            feeds["attention_mask"] = (jnp.arange(width, dtype=jnp.int32)[None, :]
                                       < (cache_len + s)[:, None]).astype(jnp.int32)
        if "position_ids" in self._inputs:
            feeds["position_ids"] = cache_len[:, None] + jnp.arange(s, dtype=jnp.int32)[None, :]
        return feeds

    def __call__(self, params, input_ids, cache_len, num_new, cache, *, empty_cache: bool = False,
                 last_logits: bool = False):
        """One step. Shapes: input_ids [B, S], cache_len / num_new [B], cache as `init_cache`.

        Returns (logits [B, S, V] ([B, 1, V] with last_logits), cache): the updated buffers, same
        structure and shapes. The device status is dropped: `with_status` returns it too.
        """
        out = self.with_status(params, input_ids, cache_len, num_new, cache,
                               empty_cache=empty_cache, last_logits=last_logits)
        return out.logits, out.cache

    def with_status(self, params, input_ids, cache_len, num_new, cache, *,
                    empty_cache: bool = False, last_logits: bool = False) -> StepOutput:
        """One step, as `__call__`, with the device status of its cache writes.

        Args:
          params: the lowered model's params.
          input_ids: int [B, S], right-padded.
          cache_len, num_new: int32 [B].
          cache: as `init_cache` (donate it).
          empty_cache: static; True for a first prompt, when every row's cache_len is 0 (cache_len
            is then taken as zeros). The attention reads only the S new rows instead of the whole
            capacity: a GroupQueryAttention graph's long prompt runs on cuDNN's flash attention on a
            GPU; a Concat-cache graph is fed an empty past (and a [B, S] mask) so it runs as a
            plain prompt while the buffer is written in place (`CachePolicy.key_width`). (An
            Attention-with-past graph still reads the whole buffer.)
          last_logits: static; True: the logits of each row's last new token only (s =
            num_new[b] - 1, s = 0 for a row without new tokens), [B, 1, V]. What a prompt needs
            for its first token: the LM head (`logits_head`) then runs on B rows instead of B x S
            (a 2k-token prompt of a 128k-vocabulary model: 1 TFLOP and 0.5 GB of logits less a
            row). Without a head the graph's logits are computed whole and gathered.

        Returns:
          StepOutput(logits [B, S, V] or [B, 1, V], cache, status int32 [B]): status is the OR of
          every cache write's status and of the step's range check (module doc); nonzero rows were
          not written.
        """
        input_ids = jnp.asarray(input_ids).astype(jnp.int32)
        b, s = input_ids.shape
        if b != self.batch:
            raise ValueError(f"step: input_ids has batch {b}, the step was built for {self.batch}")
        if s > self.capacity:
            raise ValueError(f"step: {s} new tokens exceed the cache capacity {self.capacity}")
        if set(cache) != set(self.cache_shapes):
            raise ValueError(f"step: cache keys {sorted(cache)} != {sorted(self.cache_shapes)}")
        cache_len = jnp.asarray(cache_len).astype(jnp.int32).reshape(b)
        if empty_cache:
            cache_len = jnp.zeros_like(cache_len)
        num_new = jnp.asarray(num_new).astype(jnp.int32).reshape(b)
        c = self.capacity
        # The keys the graph sees: the whole buffer, or what the policy says a step sees.
        width = self.policy.key_width(s, empty_cache)
        feeds = self._driven_inputs(input_ids, cache_len, num_new, width=width)
        # causal[b, 0, s, j]: query s of row b (at position cache_len[b] + s) may read key j.
        causal = (jnp.arange(width, dtype=jnp.int32)[None, None, None, :]
                  <= (cache_len[:, None, None, None] + jnp.arange(s, dtype=jnp.int32)[None, None, :, None]))
        # Rows whose S new tokens fit the buffer; the cache ops flag (and skip) the others, and
        # every status they return is collected here.
        fits = (cache_len >= 0) & (cache_len + s <= c)
        run = _StepRun(cache=cache, new_cache={}, cache_len=cache_len, num_new=num_new, s=s, fits=fits,
                       width=width, causal=causal, statuses=[st.kv_write_status(fits)],
                       empty_cache=empty_cache)
        for sl in self.slots:
            feeds[sl.past] = self.policy.feed(sl, run)

        head = self.logits_head if last_logits else None
        gathered = []

        def hook(ctx, inputs):
            if head is not None and ctx.node is head:
                x = to_jax(inputs[0])
                if x.ndim == 3 and x.shape[:2] == (b, s):
                    gathered.append(True)
                    x = last_new_rows(x, num_new)
                    sub = NodeContext(ctx.node, ctx.key, [x, *inputs[1:]], ctx.interp, ctx.env)
                    return registry.lookup(ctx.key)(sub, x, *inputs[1:])
            return self.policy.hook(ctx, inputs, self._slots_of.get(id(ctx.node)), run)

        outs = self.lowered.run(params, feeds, hook)
        new_cache = run.new_cache
        for sl in self.slots:
            if sl.past not in new_cache:
                if sl.present is None:
                    raise ValueError(f"step: the cache fed by {sl.past} is not returned by any output")
                new_cache[sl.past] = outs[sl.present]
        status = run.statuses[0]
        for flags in run.statuses[1:]:
            status = status | flags.astype(jnp.int32).reshape(b)
        logits = outs[self.logits_name]
        if last_logits and not gathered:
            logits = last_new_rows(logits, num_new)
        return StepOutput(logits, new_cache, status)

    def jit(self, *, with_status: bool = False, **kwargs):
        """jax.jit of the step (or of `with_status` when with_status=True) with the cache
        (argument 4) donated; kwargs go to jax.jit."""
        fn = self.with_status if with_status else self.__call__
        return jax.jit(fn, donate_argnums=(4,), **kwargs)

    # -- pieces of the policies' hooks ------------------------------------------------------------
    def _logical_if_condition(self, ctx, lengths):
        """An If condition that reads the attention mask's width, recomputed with the logical width
        max(lengths) on the device (the fed mask is C wide); None when it does not read it."""
        cond_name = ctx.node.input[0]
        cone, stack = [], [cond_name]
        seen = set()
        while stack:
            name = stack.pop()
            node = self._producers.get(name)
            if node is None or id(node) in seen:
                continue
            seen.add(id(node))
            cone.append(node)
            stack.extend(i for i in node.input if i)
        shape_nodes = [n for n in cone if n.op_type == "Shape" and n.input[0] == "attention_mask"]
        if not shape_nodes:
            return None
        order = {id(n): i for i, n in enumerate(self.lowered.model.graph.node)}
        cone.sort(key=lambda n: order.get(id(n), -1))
        env = ChainMap({}, ctx.env)
        b = self.batch
        logical = jnp.stack([jnp.asarray(b, jnp.int32), jnp.max(lengths).astype(jnp.int32)])
        interp = ctx.interp
        for node in cone:
            if node in shape_nodes:
                start = next((a.i for a in node.attribute if a.name == "start"), 0)
                end = next((a.i for a in node.attribute if a.name == "end"), 2)
                env[node.output[0]] = logical[start:end]
            else:
                interp.run_node(node, env)
        return env[cond_name]
