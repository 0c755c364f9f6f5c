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

How the graph is driven, by the kind of KV cache it has:
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
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.onnx.handlers.attention import (ATTENTION_ATTRS, known_attrs, run_attention,
                                              run_gqa)
from jax_onnx_attn.onnx.handlers.control import select_branches
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


class FixedCacheStep:
    """A jittable prefill/decode step of `lowered` over [batch, Hkv, capacity, D] KV buffers.

    Attributes:
      batch, capacity: B and C.
      mode: "gqa", "concat" or "attention_past" (see the module doc).
      slots: the KV buffers (KVSlot per past input).
      cache_shapes: {past input name: ((B, Hkv, C, D), dtype)}.
      logits_name: the graph output returned as logits.
    """

    def __init__(self, lowered, batch: int, capacity: int):
        self.lowered = lowered
        self.batch, self.capacity = int(batch), int(capacity)
        if self.batch < 1 or self.capacity < 1:
            raise ValueError(f"fixed_cache_step: batch and capacity must be >= 1, got {batch}, {capacity}")
        graph = lowered.model.graph
        self._inputs = set(lowered.input_names)
        outputs = {o.name for o in graph.output}
        self._producers = {o: n for n in graph.node for o in n.output if o}
        self.slots, self.mode = self._find_slots(graph, outputs)
        others = [n for n in lowered.input_names
                  if n not in DRIVEN_INPUTS and n not in {s.past for s in self.slots}]
        if others:
            raise ValueError(f"fixed_cache_step: the model has inputs {others} that are neither KV "
                             f"cache inputs nor one of {DRIVEN_INPUTS}; the step cannot drive them")
        if "input_ids" not in self._inputs:
            raise ValueError("fixed_cache_step: the model has no input_ids input")
        self.logits_name = "logits" if "logits" in lowered.output_names else lowered.output_names[0]
        self.cache_shapes = self._cache_shapes()
        if self.mode == "concat":
            self._kv_reach = self._reachable({s.node.output[0] for s in self.slots})

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
        slots, modes = [], set()
        for node in graph.node:
            dom = registry.normalize_domain(node.domain)
            ins = list(node.input)
            if dom == registry.MS_DOMAIN and node.op_type == "GroupQueryAttention":
                pairs = [(3, 1), (4, 2)]
                mode = "gqa"
            elif dom == "" and node.op_type == "Attention" and len(ins) > 5 and ins[4]:
                pairs = [(4, 1), (5, 2)]
                mode = "attention_past"
            elif dom == "" and node.op_type == "Concat" and len(ins) == 2 and ins[0] in self._inputs:
                pairs = [(0, 0)]
                mode = "concat"
            else:
                continue
            for i, o in pairs:
                if len(ins) > i and ins[i] in self._inputs:
                    present = node.output[o] if len(node.output) > o and node.output[o] else None
                    slots.append(KVSlot(ins[i], present and self._through_identity(present, outputs),
                                        node))
                    modes.add(mode)
        if not slots:
            raise ValueError(
                "fixed_cache_step: no recognisable KV cache in the model: expected past inputs "
                "consumed by com.microsoft GroupQueryAttention, by ai.onnx Attention's past_key/"
                "past_value, or by Concat(past, new) along the sequence axis; the model's inputs "
                f"are {self.lowered.input_names}")
        if len(modes) > 1:
            raise ValueError(f"fixed_cache_step: the model mixes KV cache kinds {sorted(modes)}")
        seen = [s.past for s in slots]
        dup = sorted({p for p in seen if seen.count(p) > 1})
        if dup:
            raise ValueError(f"fixed_cache_step: past inputs {dup} feed more than one cache node")
        mode = modes.pop()
        if mode == "concat":
            for s in slots:
                axis = next((a.i for a in s.node.attribute if a.name == "axis"), None)
                if axis not in (2, -2):
                    raise ValueError(f"fixed_cache_step: Concat {s.node.name!r} appends along axis "
                                     f"{axis}, not the sequence axis of [B, H, T, D]")
        return slots, mode

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
        """(Hkv, D) of each buffer, from the new K/V its node receives (abstract evaluation)."""
        found = {}
        by_node = {}
        for s in self.slots:
            by_node.setdefault(id(s.node), []).append(s)

        def hook(ctx, inputs):
            slots = by_node.get(id(ctx.node))
            if not slots:
                return None
            a = ctx.attrs
            if self.mode == "gqa":
                q = inputs[0]
                hkv, n = int(a["kv_num_heads"]), int(a["num_heads"])
                packed = len(inputs) < 2 or inputs[1] is None
                d = q.shape[-1] // (n + 2 * hkv) if packed else inputs[1].shape[-1] // hkv
                for s in slots:
                    found[s.past] = (hkv, d)
                b, sq = q.shape[:2]
                return (jnp.zeros((b, sq, n * d), q.dtype), None, None, None)
            k = inputs[1]
            if self.mode == "attention_past" and k.ndim == 3:
                hkv = int(a["kv_num_heads"])
                found[slots[0].past] = (hkv, k.shape[-1] // hkv)
                found[slots[1].past] = (hkv, inputs[2].shape[-1] // hkv)
            elif self.mode == "attention_past":
                found[slots[0].past] = (k.shape[1], k.shape[3])
                found[slots[1].past] = (inputs[2].shape[1], inputs[2].shape[3])
            else:
                found[slots[0].past] = (k.shape[1], k.shape[3])
            raise _ProbeDone()

        info = self.lowered.input_info()
        b = self.batch

        def run(params):
            feeds = self._driven_inputs(jnp.zeros((b, 1), jnp.int32), jnp.zeros((b,), jnp.int32),
                                        jnp.ones((b,), jnp.int32), probe=True)
            for s in self.slots:
                dims, dtype = info[s.past]
                feeds[s.past] = ShapeOnly((b, dims[1] if isinstance(dims[1], int) else 0, 0, 0), dtype,
                                          "probing the KV head size")
            try:
                self.lowered.run(params, feeds, hook)
            except _ProbeDone:
                pass
            return 0

        try:
            jax.eval_shape(run, self.lowered.params)
        except _ProbeDone:
            pass
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

    def __call__(self, params, input_ids, cache_len, num_new, cache, *, empty_cache: bool = False):
        """One step. Shapes: input_ids [B, S], cache_len / num_new [B], cache as `init_cache`.

        Returns (logits [B, S, V], cache): the updated buffers, same structure and shapes. The
        device status is dropped: `with_status` returns it too.
        """
        out = self.with_status(params, input_ids, cache_len, num_new, cache,
                               empty_cache=empty_cache)
        return out.logits, out.cache

    def with_status(self, params, input_ids, cache_len, num_new, cache, *,
                    empty_cache: bool = False) -> StepOutput:
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
            plain prompt while the buffer is written in place. (An Attention-with-past graph
            still reads the whole buffer.)

        Returns:
          StepOutput(logits [B, S, V], cache, status int32 [B]): status is the OR of every cache
          write's status and of the step's range check (module doc); nonzero rows were not written.
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
        # The keys the graph sees: the whole buffer, or on a first prompt of a Concat-cache graph
        # only the S new rows (its past is fed as empty, so the graph runs as a plain prompt and
        # its attention is S x S instead of S x C; the buffer is still written in place).
        width = s if empty_cache and self.mode == "concat" else c
        feeds = self._driven_inputs(input_ids, cache_len, num_new, width=width)
        # causal[b, 0, s, j]: query s of row b (at position cache_len[b] + s) may read key j.
        causal = (jnp.arange(width, dtype=jnp.int32)[None, None, None, :]
                  <= (cache_len[:, None, None, None] + jnp.arange(s, dtype=jnp.int32)[None, None, :, None]))
        new_cache: dict = {}
        # Rows whose S new tokens fit the buffer; the cache ops flag (and skip) the others, and
        # every status they return is collected here.
        fits = (cache_len >= 0) & (cache_len + s <= c)
        statuses = [st.kv_write_status(fits)]
        slot_of = {}
        for sl in self.slots:
            slot_of.setdefault(id(sl.node), []).append(sl)
            if self.mode == "concat":
                shape, dtype = self.cache_shapes[sl.past]
                feeds[sl.past] = ShapeOnly((b, shape[1], width - s, shape[3]), dtype,
                                           "the KV cache lives in the step's fixed-capacity buffer")
            else:
                feeds[sl.past] = cache[sl.past]

        def hook(ctx, inputs):
            node = ctx.node
            slots = slot_of.get(id(node))
            if self.mode == "gqa":
                if slots:
                    # A sliding-window layer keeps the full capacity-C buffer: no row is ever
                    # evicted (cache_len + S <= C), so the window-sized layout would hold the same
                    # rows at the same places, and local_window_size alone gives the same output.
                    # The windowed path would restage (copy) the buffer every step.
                    inputs = list(inputs)
                    if len(inputs) > 5 and inputs[5] is not None:
                        # The graph derives seqlens_k from the C-wide mask, which clamps a row
                        # that does not fit into range (GQA would write rows C - S .. C - 1):
                        # such a row gets its true seqlens_k, beyond the buffer, so the op
                        # refuses its write and flags it.
                        seqlens = to_jax(inputs[5])
                        inputs[5] = jnp.where(fits, seqlens, (cache_len + s - 1).astype(seqlens.dtype))
                    return run_gqa(ctx, inputs, shared_buffer=True,
                                   overrides={"sliding_window_cache": 0}, statuses=statuses,
                                   past_empty=empty_cache)
                if node.op_type == "If" and is_static(inputs[0]):
                    cond = self._logical_if_condition(ctx, cache_len + num_new)
                    if cond is not None:
                        return select_branches(ctx, cond, pad_rows=True)
                return None
            if self.mode == "attention_past":
                if slots:
                    return self._attention_past(ctx, inputs, cache, cache_len, new_cache, slots,
                                                statuses)
                return None
            # concat mode
            if slots:
                sl = slots[0]
                buf, status = ops.kv_append(cache[sl.past],
                                            to_jax(inputs[1]).astype(cache[sl.past].dtype), cache_len)
                statuses.append(status)
                new_cache[sl.past] = buf
                return (buf if width == c else buf[:, :, :width],)
            if node.op_type == "Attention" and node.input[1] in self._kv_reach:
                return self._masked_attention(ctx, inputs, causal, width)
            if node.op_type == "Softmax" and node.input[0] in self._kv_reach:
                x = inputs[0]
                if getattr(x, "ndim", 0) == 4 and x.shape[-1] == width and x.shape[-2] == s:
                    x = to_jax(x)
                    x = jnp.where(causal, x, jnp.asarray(-jnp.inf, x.dtype))
                    return registry.lookup(ctx.key)(ctx, x)
            return None

        outs = self.lowered.run(params, feeds, hook)
        for sl in self.slots:
            if sl.past not in new_cache:
                if sl.present is None:
                    raise ValueError(f"step: the cache fed by {sl.past} is not returned by any output")
                new_cache[sl.past] = outs[sl.present]
        status = statuses[0]
        for flags in statuses[1:]:
            status = status | flags.astype(jnp.int32).reshape(b)
        return StepOutput(outs[self.logits_name], new_cache, status)

    def jit(self, *, with_status: bool = False, **kwargs):
        """jax.jit of the step (or of `with_status` when with_status=True) with the cache
        (argument 4) donated; kwargs go to jax.jit."""
        fn = self.with_status if with_status else self.__call__
        return jax.jit(fn, donate_argnums=(4,), **kwargs)

    # -- pieces of the hook ------------------------------------------------------------------
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

    def _attention_past(self, ctx, inputs, cache, cache_len, new_cache, slots, statuses):
        inputs = list(inputs) + [None] * (7 - len(inputs))
        if inputs[6] is not None:
            ctx.fail("nonpad_kv_seqlen together with past_key is invalid")
        # The node's attributes checked as run_attention checks them, and its model's opset (the
        # window attributes need 25).
        attrs = known_attrs(ctx, ATTENTION_ATTRS)
        res = ops.attention_with_cache(
            to_jax(inputs[0]), to_jax(inputs[1]), to_jax(inputs[2]), cache[slots[0].past],
            cache[slots[1].past], cache_len, to_jax(inputs[3]), **attrs,
            opset=ctx.interp.opsets[""], return_qk=ctx.wants(3))
        new_cache[slots[0].past], new_cache[slots[1].past] = res.key_cache, res.value_cache
        statuses.append(res.status)
        return res.y, res.key_cache, res.value_cache, res.qk

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


class _ProbeDone(Exception):
    """Stops the abstract probe run once the shapes are known."""
