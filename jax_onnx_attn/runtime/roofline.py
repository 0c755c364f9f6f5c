"""The speed limits of a lowered decoder: the one definition of the decode bound and prefill FLOPs.

Decode (one new token per row, `batch` rows, `ctx` tokens already cached) is memory bound; its bound
is the bytes a step must read from HBM over the HBM bandwidth:

    bytes(batch, ctx) = weight bytes read in full          every projection incl. the LM head, norms,
                                                           biases; MatMulNBits' packed codes + scales
                                                           + zero points
                      + batch x gathered-row bytes         tables a step reads one row of per token: the
                                                           embedding (Gather), rotary cos/sin caches
                      + batch x ctx x KV bytes per token   every layer's K and V cache:
                                                           2 x layers x kv_heads x head_size x itemsize
    bound_s = bytes / hbm_bytes_per_s                      (4.8e12 B/s for the H200)

Prefill of `tokens` prompt tokens per row (no cache before) is compute bound:

    flops(batch, tokens) = 2 x matmul params x batch x tokens      (every MatMul / Gemm / MatMulNBits
                                                                   weight but the LM head)
                         + 2 x LM head params x batch              (the head at each row's last token
                                                                   only: all a prompt's first token
                                                                   needs, all DecoderSession computes,
                                                                   `FixedCacheStep.logits_head`)
                         + per attention layer 4 x batch x q_heads x head_size x tokens^2 / 2
                                                                   (QKᵀ and PV, causal: half the square)

Everything is read off the lowered model (`jax_onnx_attn.load(...)`): its graph says how each
initializer is used and its params give their sizes in the dtype they were loaded as, so the
definition holds for any export (builder, torch.onnx), not only the package's own models. The KV
cache's shape comes from the lowering's `fixed_cache_step(...).cache_shapes`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import numpy as np
import onnx

#: The H200's HBM3e bandwidth (bytes/s, datasheet): the issues' targets are fractions of it.
H200_HBM_BYTES_PER_S = 4.8e12
#: HBM bandwidth (bytes/s, datasheets) of the GPUs a bound can be computed for, by a fragment of
#: jax's `device_kind` ("NVIDIA H100 80GB HBM3" is the SXM part); the first fragment found wins.
HBM_BYTES_PER_S = {"H200": H200_HBM_BYTES_PER_S, "H100 PCIe": 2.0e12, "H100 NVL": 3.9e12,
                   "H100": 3.35e12}


def hbm_bytes_per_s(device_kind: str | None) -> float | None:
    """The HBM bandwidth of a GPU named `device_kind` (jax's), or None when the table lacks it."""
    for fragment, bandwidth in HBM_BYTES_PER_S.items():
        if device_kind and fragment.lower() in device_kind.lower():
            return bandwidth
    return None

#: The H200's dense tensor-core peak (FLOP/s, datasheet) per compute dtype.
H200_PEAK_FLOPS = {"float16": 989e12, "bfloat16": 989e12, "float32": 67e12}

_MATMULS = {("", "MatMul"): 1, ("", "Gemm"): 1, ("com.microsoft", "MatMulNBits"): 1,
            ("jax_onnx_attn", "Linear"): 1}  # the loader's fused projections (onnx/fusion.py)
_GATHERED_ROPE = {("com.microsoft", "GroupQueryAttention"): (7, 8), ("", "RotaryEmbedding"): (1, 2),
                  ("com.microsoft", "RotaryEmbedding"): (2, 3)}


@dataclass(frozen=True)
class StepCost:
    """What one step of a lowered decoder reads and computes, independent of batch and context.

    Attributes:
      weight_bytes: bytes of every param a step reads in full.
      row_bytes: bytes per token of the row-gathered tables (embedding row, cos/sin rows).
      kv_bytes_per_token: bytes of K and V of all layers for one cached token of one row.
      matmul_params: K x N summed over every matrix product with a weight param.
      head_params: K x N of the one that makes the logits (`FixedCacheStep.logits_head`; 0 when the
        step does not find it, and a prefill then counts it at every position, as it runs).
      attention_qd: per attention layer, q_heads x head_size (for attention FLOPs).
      breakdown: weight bytes by kind ("matmul", "matmul_nbits", "other") and the gathered tables'
        full sizes ("gathered_tables") for reports.
    """

    weight_bytes: int
    row_bytes: int
    kv_bytes_per_token: int
    matmul_params: int
    attention_qd: tuple[int, ...]
    breakdown: dict = field(default_factory=dict)
    head_params: int = 0

    def decode_bytes(self, batch: int, ctx: int) -> int:
        """Bytes one decode step of `batch` rows at context `ctx` must read (see the module doc)."""
        _check(batch, ctx)
        return self.weight_bytes + batch * self.row_bytes + batch * ctx * self.kv_bytes_per_token

    def decode_seconds(self, batch: int, ctx: int, hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
        """The bandwidth bound of one decode step: decode_bytes / hbm_bytes_per_s."""
        return self.decode_bytes(batch, ctx) / hbm_bytes_per_s

    def fraction_of_bound(self, seconds_per_step: float, batch: int, ctx: int,
                          hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
        """decode_seconds / a measured step time (1.0: at the bound)."""
        return self.decode_seconds(batch, ctx, hbm_bytes_per_s) / seconds_per_step

    def decode_flops(self, batch: int, ctx: int) -> float:
        """FLOPs of one decode step: 2 x matmul params x batch + 4 x batch x q_heads x head_size x ctx
        per attention layer."""
        _check(batch, ctx)
        return 2.0 * self.matmul_params * batch + sum(4.0 * batch * qd * ctx for qd in self.attention_qd)

    def prefill_flops(self, batch: int, tokens: int, causal: bool = True) -> float:
        """FLOPs of the prefill of `tokens` tokens per row (see the module doc; causal counts half)."""
        _check(batch, tokens)
        attn = sum(4.0 * batch * qd * tokens * tokens for qd in self.attention_qd)
        body = self.matmul_params - self.head_params
        return 2.0 * body * batch * tokens + 2.0 * self.head_params * batch + (attn / 2 if causal else attn)

    def prefill_seconds(self, batch: int, tokens: int, peak_flops: float) -> float:
        """The compute bound of a prefill: prefill_flops / peak_flops."""
        return self.prefill_flops(batch, tokens) / peak_flops

    def as_dict(self) -> dict:
        """The fields as a JSON-ready dict."""
        return dataclasses.asdict(self)


def _check(batch: int, ctx: int) -> None:
    if batch < 1 or ctx < 0:
        raise ValueError(f"need batch >= 1 and ctx/tokens >= 0, got batch={batch}, ctx={ctx}")


def _attrs(node: onnx.NodeProto) -> dict:
    return {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}


def step_cost(lowered) -> StepCost:
    """The StepCost of a lowered decoder (an object with `model`, `params` and `fixed_cache_step`,
    e.g. `jax_onnx_attn.load(path)`). Raises ValueError when the model has no KV cache the lowering
    recognises (it is not a decoder with a cache)."""
    from jax_onnx_attn.onnx import registry

    params = lowered.params
    nbytes = {name: int(np.prod(a.shape)) * np.dtype(a.dtype).itemsize for name, a in params.items()}
    full: set[str] = set()
    gathered: dict[str, int] = {}  # name -> bytes of one row
    matmul_params = 0
    kinds: dict[str, str] = {}
    node_params: dict[str, int] = {}  # projection's output name -> its K x N
    for node in registry.iter_nodes(lowered.model.graph):
        key = (registry.normalize_domain(node.domain), node.op_type)
        ins = list(node.input)
        row_inputs: set[int] = set()
        if key == ("", "Gather") and ins and ins[0] in params and _attrs(node).get("axis", 0) == 0:
            row_inputs = {0}
        elif key in _GATHERED_ROPE:
            row_inputs = {i for i in _GATHERED_ROPE[key] if i < len(ins)}
        if key in _MATMULS and len(ins) > 1 and ins[1] in params:
            a = _attrs(node)
            before = matmul_params
            if key[1] == "MatMulNBits" or (key[1] == "Linear" and a.get("bits")):
                matmul_params += int(a["K"]) * int(a["N"])
                # packed codes, scales, zero points (not a fused Linear's bias / residual / norm)
                for name in ins[1:4 if key[1] == "Linear" else None]:
                    if name:
                        kinds.setdefault(name, "matmul_nbits")
            else:
                w = params[ins[1]]
                matmul_params += int(np.prod(w.shape[-2:])) * int(np.prod(w.shape[:-2]) or 1)
                kinds.setdefault(ins[1], "matmul")
            node_params[node.output[0]] = matmul_params - before
        for i, name in enumerate(ins):
            if name not in params:
                continue
            if i in row_inputs:
                shape = params[name].shape
                gathered[name] = nbytes[name] // max(int(shape[0]), 1) if len(shape) else nbytes[name]
            else:
                full.add(name)
    gathered = {k: v for k, v in gathered.items() if k not in full}
    breakdown = {"matmul": 0, "matmul_nbits": 0, "other": 0}
    for name in full:
        breakdown[kinds.get(name, "other")] += nbytes[name]
    breakdown["gathered_tables"] = sum(nbytes[n] for n in gathered)

    step = lowered.fixed_cache_step(1, 1)
    head = step.logits_head
    head_params = node_params.get(head.output[0], 0) if head is not None else 0
    kv = 0
    for _, ((_, hkv, _, d), dtype) in step.cache_shapes.items():
        kv += int(hkv) * int(d) * np.dtype(dtype).itemsize
    attention_attrs = next((_attrs(n) for n in registry.iter_nodes(lowered.model.graph)
                            if n.op_type == "Attention" and registry.normalize_domain(n.domain) == ""), {})
    qd = []
    seen_nodes = set()
    for slot in step.slots:
        # One entry per attention layer: GroupQueryAttention / Attention nodes hold both buffers; a
        # Concat(past, new) export has one node per buffer, its key buffers named "...key".
        if step.mode == "concat":
            if "value" in slot.past.replace("key_values", ""):
                continue
        elif id(slot.node) in seen_nodes:
            continue
        seen_nodes.add(id(slot.node))
        (_, hkv, _, d), _ = step.cache_shapes[slot.past]
        # q heads from the attention node (for a Concat cache, the graph's first ai.onnx Attention);
        # a fully decomposed export does not say: kv heads.
        a = _attrs(slot.node) if step.mode != "concat" else attention_attrs
        heads = a.get("num_heads") or a.get("q_num_heads") or hkv
        qd.append(int(heads) * int(d))
    return StepCost(weight_bytes=sum(nbytes[n] for n in full), row_bytes=sum(gathered.values()),
                    kv_bytes_per_token=kv, matmul_params=matmul_params, attention_qd=tuple(qd),
                    breakdown=breakdown, head_params=head_params)


def decode_bound_seconds(lowered, batch: int, ctx: int,
                         hbm_bytes_per_s: float = H200_HBM_BYTES_PER_S) -> float:
    """The bandwidth bound (seconds) of one decode step of `lowered` (see `step_cost`)."""
    return step_cost(lowered).decode_seconds(batch, ctx, hbm_bytes_per_s)


__all__ = ["StepCost", "step_cost", "decode_bound_seconds", "hbm_bytes_per_s", "HBM_BYTES_PER_S",
           "H200_HBM_BYTES_PER_S", "H200_PEAK_FLOPS"]
