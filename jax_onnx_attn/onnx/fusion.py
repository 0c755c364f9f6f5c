"""Load-time rewrites of a decoder graph into the lowering's own fused nodes.

A decode step streams every weight once; what costs time besides that is the number of launches
and every extra pass over an activation. `load` therefore rewrites the graph once, before any trace,
into nodes of our own domain (`JOA_DOMAIN`) whose handlers call `jax_onnx_attn.ops.linear` /
`ops.matmul_nbits`, and stores the weights in those ops' layouts:

1. A MatMul whose B is a float initializer [K, N] that only MatMuls read becomes
   `Linear(x, W_nk)` with the weight stored transposed, [N, K] (the kernels' weight-major layout;
   XLA's GEMM takes it as transposed for free). A following Add of a [N] initializer becomes its
   bias. com.microsoft MatMulNBits becomes `Linear` over the packed weight (`ops.prepare_nbits`).
2. Gate and up projections of one input feeding `Mul(Mul(gate, Sigmoid(gate)), up)` (SwiGLU, as
   onnxruntime-genai's builder writes it) become one gated `Linear` over their rows interleaved
   (`ops.interleave_gate_up`): one pass over the input, the activation in the epilogue.
3. SkipSimplifiedLayerNormalization(a, b, gamma) where b (or a) is a `Linear` read by nothing else:
   the sum becomes that Linear's residual epilogue, the node a plain SimplifiedLayerNormalization
   of the sum; likewise a plain Add of such a Linear and an activation (torch's residual add).
4. A SimplifiedLayerNormalization whose only readers are `Linear` nodes (as their input) becomes
   their RMSNorm prologue.
4b. With gated_mlp, a dense gated Linear (no bias or residual) whose output only a dense Linear
   reads as its input (the down projection: no norm, bias or rotary order) becomes one
   `GatedMlp(x, w_gate_up, w_down, residual, norm_weight)`: one kernel for one row of x
   (`ops.gated_mlp`), the two Linears' calls otherwise.
4c. With out_mlp, a GatedMlp whose input and residual are both the output of a dense Linear with a
   residual (the attention's output projection: not gated, no bias, norm or rotary order) that
   nothing else reads becomes one `OutMlp(a, w_o, x, w_gate_up, w_down, norm_weight)`: one kernel
   for one row (`ops.out_mlp`), the Linear's and the GatedMlp's calls otherwise.
5. With qkv_prepare, a Linear (dense, or 4-bit) that is the packed Q | K | V query of exactly one
   GroupQueryAttention (rotary not interleaved, cos / sin initializers, no q / k norm, a float
   cache) stores its rows in the rotary-pair order (`ops.rotary_pair_order`; attribute
   qkv_pairs = [N, Hkv, D, R/2]): the GQA's CUDA decode route of one row then computes the
   projection and its step preparation in one launch (`cuda_matmul.linear_gqa_prepare`), and the
   Linear, whose output is put back in the original order, is left unread (XLA drops it).
6. Last, MatMulNBits weights take the kernels' layout: scales / zero points tiled
   (`ops.tile_nbits_meta`), or with nbits_layout="rows" 4-bit weights the rows kernel takes go
   whole into the rows layout (`ops.to_rows_layout`; the node's attribute layout="rows"), with
   nbits_layout="record" those the slots kernel's record reader takes into the record layout
   (`ops.to_record_layout`; layout="record").

A builder decoder layer is then: Linear (norm + QKV), GroupQueryAttention, Linear (o + residual),
Linear (norm + gate/up + SiLU·up), Linear (down + residual). Each rewrite keeps the math of the
nodes it replaces (values rounded to the model's type where the graph rounds them), so parity with
onnxruntime holds; `load(..., fuse=False)` keeps the graph as it is. Outputs of the graph and
values read by subgraphs are never fused away.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections import defaultdict

import numpy as np
import onnx
from onnx import helper

from jax_onnx_attn.onnx import registry

#: The domain of the lowering's own fused nodes.
JOA_DOMAIN = "jax_onnx_attn"
JOA_OPSET = 1


@dataclasses.dataclass
class FusionReport:
    """What `fuse_decoder` rewrote (counts), for tests and `LoweredModel.fusions`."""

    linear: int = 0
    nbits: int = 0
    bias: int = 0
    gated: int = 0
    residual: int = 0
    norm: int = 0
    qkv_pairs: int = 0
    gated_mlp: int = 0
    out_mlp: int = 0

    def __str__(self) -> str:
        return ", ".join(f"{k} {v}" for k, v in dataclasses.asdict(self).items() if v) or "none"


class _Graph:
    """The main graph as a mutable node list with producer / reader maps."""

    def __init__(self, model: onnx.ModelProto):
        self.model = model
        self.nodes: list[onnx.NodeProto | None] = list(model.graph.node)
        self.outputs = {o.name for o in model.graph.output}
        # Names read inside subgraphs (If / Loop bodies) stay as they are.
        self.subgraph_reads: set[str] = set()
        for node in self.nodes:
            for attr in node.attribute:
                for g in ([attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)):
                    for sub in registry.iter_nodes(g):
                        self.subgraph_reads.update(i for i in sub.input if i)

    def readers(self) -> dict[str, list[int]]:
        out = defaultdict(list)
        for i, node in enumerate(self.nodes):
            if node is None:
                continue
            for name in node.input:
                if name:
                    out[name].append(i)
        return out

    def producers(self) -> dict[str, int]:
        return {o: i for i, n in enumerate(self.nodes) if n is not None for o in n.output if o}

    def private(self, name: str, readers, count: int = 1) -> bool:
        """True when `name` is read by exactly `count` nodes of the main graph and nothing else."""
        return (name not in self.outputs and name not in self.subgraph_reads
                and len(readers.get(name, ())) == count)


def _attr(node, name, default=None):
    for a in node.attribute:
        if a.name == name:
            return helper.get_attribute_value(a)
    return default


def _linear(inputs, output, name, **attrs) -> onnx.NodeProto:
    return helper.make_node("Linear", inputs, [output], name=name, domain=JOA_DOMAIN, **attrs)


# Linear's inputs, in order (absent optional inputs are "").
LINEAR_INPUTS = ("x", "w", "scales", "zero_points", "bias", "residual", "norm_weight")


def _set_input(node, what: str, value: str) -> None:
    idx = LINEAR_INPUTS.index(what)
    while len(node.input) <= idx:
        node.input.append("")
    node.input[idx] = value


def _get_input(node, what: str) -> str:
    idx = LINEAR_INPUTS.index(what)
    return node.input[idx] if len(node.input) > idx else ""


def fuse_decoder(model: onnx.ModelProto, arrays: dict[str, np.ndarray], *,
                 nbits: bool = True, nbits_layout: str = "onnx",
                 decode_rows: int = 2, float_map: dict | None = None, dense_layout: str = "nk",
                 qkv_prepare: bool = False, gated_mlp: bool = False,
                 out_mlp: bool = False) -> tuple[onnx.ModelProto, dict, FusionReport]:
    """The rewrites of the module doc on `model` (local functions already inlined).

    Args:
      model: the ModelProto; not modified (a rewritten copy is returned).
      arrays: {initializer name: NumPy array} of every initializer (the loader's); new and
        re-laid-out weights are added under new names, the replaced ones dropped when unused.
      nbits: rewrite com.microsoft MatMulNBits too (False keeps them, e.g. to reproduce
        onnxruntime's int8 activations).
      nbits_layout: "onnx" (scales / zero points tiled for the ring and slots kernels) or "rows":
        4-bit weights whose shape the rows kernel takes at decode_rows rows of x (its plan) in the
        rows layout, for decode steps of 2..32 rows (`runtime.DecoderSession` of batch >= 2
        where the kernels run: `ops.cuda_matmul.rows_layout_enabled`); the others as "onnx".
        "record": 4-bit weights whose shape the slots kernel's record reader takes (one row of x:
        N % 16 == 0, K % 256 == 0, block_size >= 32, its plan) in the record layout, for decode
        steps of one row (`runtime.DecoderSession` of batch 1 under
        `ops.cuda_matmul.record_layout_enabled`); the others as "onnx".
      decode_rows: the rows of x a decode step has (the session's batch; "rows" only).
      float_map: {dtype: dtype} the loader casts float initializers by after the fusion
        (`load(dtype=...)`): the record layout holds the scales' bits, so it takes them cast.
      dense_layout: "nk" (dense weights [N, K], the kernels' layout) or "kn": stored [K, N], ONNX's
        own (attribute layout="kn"; only XLA's GEMM reads them, 2-4% faster than [N, K] at decode's
        8-32 rows on the H200), for sessions whose dense projections never take our kernels
        (`runtime.session.dense_layout_for`). The passes below work on [N, K] views; the last one
        stores each weight [K, N] (a MatMul's own initializer where it is unchanged).
      qkv_prepare: the packed QKV projections of GroupQueryAttention in the rotary-pair order (pass
        5), for decode steps of one row (`runtime.DecoderSession` of batch 1 under
        `ops.cuda_matmul.qkv_prepare_enabled`); ignored with dense_layout "kn".
      gated_mlp: dense gated MLPs as one GatedMlp node (pass 4b), for decode steps of one row
        (`runtime.DecoderSession` of batch 1 under `ops.cuda_matmul.gated_mlp_enabled`); ignored
        with dense_layout "kn".
      out_mlp: with gated_mlp, each GatedMlp and the attention output projection that alone feeds it
        as one OutMlp node (pass 4c), for decode steps of one row (`runtime.DecoderSession` of batch
        1 under `ops.cuda_matmul.out_mlp_enabled`).

    Returns:
      (model, arrays, FusionReport).
    """
    # The module (ops.linear the attribute is the op function of the same name).
    linear_ops = importlib.import_module("jax_onnx_attn.ops.linear")
    if nbits_layout not in linear_ops.LAYOUTS:
        raise ValueError(f"fuse_decoder: nbits_layout must be one of {linear_ops.LAYOUTS}, got {nbits_layout!r}")
    if dense_layout not in linear_ops.DENSE_LAYOUTS:
        raise ValueError(f"fuse_decoder: dense_layout must be one of {linear_ops.DENSE_LAYOUTS}, "
                         f"got {dense_layout!r}")

    out = onnx.ModelProto()
    out.CopyFrom(model)
    del out.graph.node[:]
    g = _Graph(model)
    arrays = dict(arrays)
    report = FusionReport()
    graph_inputs = {i.name for i in model.graph.input}

    def is_weight(name):
        a = arrays.get(name)
        return a is not None and name not in graph_inputs and a.ndim == 2 and \
            np.issubdtype(a.dtype, np.floating)

    # 1. MatMul with an initializer weight -> Linear(x, W [N, K]); MatMulNBits -> Linear(bits).
    readers = g.readers()
    transposed: dict[str, str] = {}
    for i, node in enumerate(g.nodes):
        dom = registry.normalize_domain(node.domain)
        if dom == "" and node.op_type == "MatMul" and is_weight(node.input[1]):
            w = node.input[1]
            if any(d % 8 for d in arrays[w].shape):
                continue  # ops.linear takes K and N in multiples of 8 (16-byte rows)
            if w in g.subgraph_reads or w in g.outputs or any(
                    g.nodes[r].op_type != "MatMul" or g.nodes[r].input[1] != w
                    or g.nodes[r].input[0] == w for r in readers[w]):
                continue
            if w not in transposed:
                transposed[w] = f"{w}.nk"
                # With dense_layout "kn" a view: the last pass puts it back as it was, no copy.
                arrays[transposed[w]] = arrays[w].T if dense_layout == "kn" else np.ascontiguousarray(arrays[w].T)
            g.nodes[i] = _linear([node.input[0], transposed[w]], node.output[0], node.name)
            report.linear += 1
        elif nbits and dom == registry.MS_DOMAIN and node.op_type == "MatMulNBits":
            ins = list(node.input) + [""] * (6 - len(node.input))
            bq, scales, zp, g_idx, bias = ins[1], ins[2], ins[3], ins[4], ins[5]
            k, n = int(_attr(node, "K")), int(_attr(node, "N"))
            bits, block = int(_attr(node, "bits", 4)), int(_attr(node, "block_size"))
            if g_idx or n % 8 or any(x and x not in arrays for x in (bq, scales, zp)):
                continue
            try:
                pq, ps, pz = linear_ops.prepare_nbits(arrays[bq], arrays[scales],
                                                      arrays[zp] if zp else None, k=k, n=n,
                                                      bits=bits, block_size=block)
            except (ValueError, NotImplementedError):
                continue  # a form the kernels do not take: the MatMulNBits handler runs it
            names = []
            for src, arr, tag in ((bq, pq, "q"), (scales, ps, "scales"), (zp, pz, "zp")):
                if arr is None:
                    names.append("")
                elif _same(arr, arrays[src]):
                    names.append(src)  # the layout the op takes already: keep its name
                else:
                    names.append(f"{src}.{tag}")
                    arrays[names[-1]] = arr
            g.nodes[i] = _linear([node.input[0], *names, bias], node.output[0], node.name,
                                 bits=bits, K=k, N=n, block_size=block)
            report.nbits += 1

    # 1b. Linear -> Add(y, other): a [N] initializer becomes the bias epilogue (only before a
    # residual: the epilogue adds bias, then residual), an activation the residual epilogue (torch's
    # residual add; the handler adds one whose shape differs from the output's the broadcasting way).
    readers, producers = g.readers(), g.producers()
    for i, node in enumerate(g.nodes):
        if node is None or node.op_type != "Add" or registry.normalize_domain(node.domain):
            continue
        for lin_in, other in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            p = producers.get(lin_in)
            if (p is None or g.nodes[p].op_type != "Linear" or other == lin_in
                    or _get_input(g.nodes[p], "residual") or not g.private(lin_in, readers)):
                continue
            lin = g.nodes[p]
            if other in arrays:
                n_out = _attr(lin, "N") if _attr(lin, "bits") else arrays[_get_input(lin, "w")].shape[0]
                if (_get_input(lin, "bias") or other in graph_inputs
                        or arrays[other].shape != (n_out,)):
                    continue
                _set_input(lin, "bias", other)
                report.bias += 1
            else:
                _set_input(lin, "residual", other)
                report.residual += 1
            lin.output[0] = node.output[0]
            g.nodes[i], g.nodes[p] = lin, None  # the fused node takes the Add's place
            readers, producers = g.readers(), g.producers()
            break

    # 2. SwiGLU: Mul(Mul(gate, Sigmoid(gate)), up) over two Linears of one input.
    readers, producers = g.readers(), g.producers()
    for i, node in enumerate(g.nodes):
        if node is None or node.op_type != "Mul" or registry.normalize_domain(node.domain):
            continue
        for act_name, up_name in ((node.input[0], node.input[1]), (node.input[1], node.input[0])):
            act = g.nodes[producers[act_name]] if act_name in producers else None
            up = g.nodes[producers[up_name]] if up_name in producers else None
            if act is None or up is None or act.op_type != "Mul" or up.op_type != "Linear":
                continue
            gate_name = sig_name = None
            for a, b in ((act.input[0], act.input[1]), (act.input[1], act.input[0])):
                s = g.nodes[producers[b]] if b in producers else None
                if s is not None and s.op_type == "Sigmoid" and s.input[0] == a:
                    gate_name, sig_name = a, b
            gate = g.nodes[producers[gate_name]] if gate_name in producers else None
            if gate is None or gate.op_type != "Linear":
                continue
            same = all(_get_input(gate, f) == "" and _get_input(up, f) == ""
                       for f in ("bias", "residual", "norm_weight"))
            if (not same or gate.input[0] != up.input[0] or _attr(gate, "bits") != _attr(up, "bits")
                    or _attr(gate, "block_size") != _attr(up, "block_size")
                    or not g.private(gate_name, readers, 2) or not g.private(sig_name, readers)
                    or not g.private(act_name, readers) or not g.private(up_name, readers)):
                continue
            bits = _attr(gate, "bits") or 0
            if bits:
                parts = [[_get_input(x, f) for x in (gate, up)] for f in ("w", "scales", "zero_points")]
                if bool(parts[2][0]) != bool(parts[2][1]):
                    continue
                merged = linear_ops.interleave_gate_up_nbits(
                    *([arrays[p[j]] if p[j] else None for p in parts] for j in (0, 1)))
                names = []
                for (pg, _), arr in zip(parts, merged):
                    names.append("" if arr is None else f"{pg}.gate_up")
                    if arr is not None:
                        arrays[names[-1]] = arr
                fused = _linear([gate.input[0], *names], node.output[0], node.name, gated=1,
                                bits=bits, K=_attr(gate, "K"), N=2 * _attr(gate, "N"),
                                block_size=_attr(gate, "block_size"))
            else:
                wg, wu = _get_input(gate, "w"), _get_input(up, "w")
                if arrays[wg].shape != arrays[wu].shape:
                    continue
                name = f"{wg}.gate_up"
                arrays[name] = linear_ops.interleave_gate_up(arrays[wg], arrays[wu])
                fused = _linear([gate.input[0], name], node.output[0], node.name, gated=1)
            for j in (producers[gate_name], producers[sig_name], producers[act_name],
                      producers[up_name]):
                g.nodes[j] = None
            g.nodes[i] = fused
            report.gated += 1
            readers, producers = g.readers(), g.producers()
            break

    # 3. SkipSimplifiedLayerNormalization over a Linear: the sum is the Linear's residual epilogue.
    # Each rewrite touches only its own two nodes, so the maps stay valid; the node list is rebuilt
    # after the pass (the Linear moves to the norm's place, the norm right after it).
    readers, producers = g.readers(), g.producers()
    moved: dict[int, list] = {}
    for i, node in enumerate(g.nodes):
        if (node is None or node.op_type != "SkipSimplifiedLayerNormalization"
                or registry.normalize_domain(node.domain) != registry.MS_DOMAIN
                or len(node.input) > 3 and node.input[3]):
            continue
        # Outputs nobody reads count as absent (the tiny builder names all four).
        outs = [o if o and (o in g.outputs or o in g.subgraph_reads or readers.get(o)) else ""
                for o in list(node.output) + [""] * (4 - len(node.output))]
        outs[0] = node.output[0]
        if outs[1]:
            continue  # the mean output (unused by every producer we know) has no fused form
        for lin_in, res in ((node.input[1], node.input[0]), (node.input[0], node.input[1])):
            p = producers.get(lin_in)
            if (p is None or p in moved or g.nodes[p] is None or g.nodes[p].op_type != "Linear"
                    or _get_input(g.nodes[p], "residual") or not g.private(lin_in, readers)):
                continue
            lin = g.nodes[p]
            total = outs[3] or f"{node.name or node.output[0]}/sum"
            _set_input(lin, "residual", res)
            lin.output[0] = total
            norm_outs = [outs[0], outs[2]] if outs[2] else [outs[0]]  # (Y, inv_std_var)
            norm = helper.make_node("SimplifiedLayerNormalization", [total, node.input[2]],
                                    norm_outs, name=node.name, axis=-1,
                                    epsilon=float(_attr(node, "epsilon", 1e-5)), stash_type=1)
            g.nodes[p] = None
            moved[i] = [lin, norm]
            report.residual += 1
            break
    if moved:
        g.nodes = [x for i, n in enumerate(g.nodes) for x in (moved[i] if i in moved else [n])]

    # 4. SimplifiedLayerNormalization read only by Linears (as their input): their prologue.
    readers, producers = g.readers(), g.producers()
    for i, node in enumerate(g.nodes):
        if (node is None or node.op_type not in ("SimplifiedLayerNormalization", "RMSNormalization")
                or len([o for o in node.output if o]) != 1 or _attr(node, "axis", -1) != -1
                or _attr(node, "stash_type", 1) != 1):
            continue
        h, scale = node.output[0], node.input[1]
        rs = readers.get(h, [])
        if (not rs or h in g.outputs or h in g.subgraph_reads or scale not in arrays
                or arrays[scale].ndim != 1
                or any(g.nodes[r].op_type != "Linear" or g.nodes[r].input[0] != h
                       or _get_input(g.nodes[r], "norm_weight") for r in rs)):
            continue
        eps = float(_attr(node, "epsilon", 1e-5))
        for r in rs:
            lin = g.nodes[r]
            lin.input[0] = node.input[0]
            _set_input(lin, "norm_weight", scale)
            lin.attribute.append(helper.make_attribute("norm_epsilon", eps))
        g.nodes[i] = None
        report.norm += 1
        readers, producers = g.readers(), g.producers()

    # 4b. A dense gated Linear read only by the down projection: one GatedMlp at the down's place.
    if gated_mlp and dense_layout == "nk":
        readers = g.readers()
        for i, gu in enumerate(g.nodes):
            if (gu is None or gu.op_type != "Linear" or not _attr(gu, "gated", 0) or _attr(gu, "bits")
                    or _get_input(gu, "bias") or _get_input(gu, "residual")
                    or not g.private(gu.output[0], readers)):
                continue
            j = readers[gu.output[0]][0]
            down = g.nodes[j]
            if (down.op_type != "Linear" or _attr(down, "gated", 0) or _attr(down, "bits")
                    or down.input[0] != gu.output[0] or _get_input(down, "bias")
                    or _get_input(down, "norm_weight") or _attr(down, "qkv_pairs") is not None):
                continue
            w_gu, w_down = _get_input(gu, "w"), _get_input(down, "w")
            if arrays[w_down].shape != (arrays[w_gu].shape[1], arrays[w_gu].shape[0] // 2):
                continue
            mlp = helper.make_node("GatedMlp", [gu.input[0], w_gu, w_down, _get_input(down, "residual"),
                                                _get_input(gu, "norm_weight")],
                                   [down.output[0]], name=down.name, domain=JOA_DOMAIN)
            if _get_input(gu, "norm_weight"):
                mlp.attribute.append(helper.make_attribute("norm_epsilon", float(_attr(gu, "norm_epsilon"))))
            g.nodes[i], g.nodes[j] = None, mlp
            report.gated_mlp += 1
            readers = g.readers()

    # 4c. The attention's output projection and the GatedMlp it alone feeds (input and residual).
    if out_mlp and gated_mlp and dense_layout == "nk":
        readers, producers = g.readers(), g.producers()
        for j, mlp in enumerate(g.nodes):
            if mlp is None or mlp.op_type != "GatedMlp" or len(mlp.input) < 4:
                continue
            x1 = mlp.input[0]
            i = producers.get(x1)
            o = g.nodes[i] if i is not None else None
            if (mlp.input[3] != x1 or not g.private(x1, readers, 2) or o is None or o.op_type != "Linear"
                    or _attr(o, "gated", 0) or _attr(o, "bits") or _get_input(o, "bias")
                    or _get_input(o, "norm_weight") or not _get_input(o, "residual")
                    or _attr(o, "qkv_pairs") is not None):
                continue
            w_o = _get_input(o, "w")
            if arrays[w_o].shape[0] != arrays[mlp.input[2]].shape[0]:
                continue
            node = helper.make_node("OutMlp", [o.input[0], w_o, _get_input(o, "residual"), mlp.input[1],
                                               mlp.input[2], mlp.input[4] if len(mlp.input) > 4 else ""],
                                    [mlp.output[0]], name=mlp.name, domain=JOA_DOMAIN)
            node.attribute.extend(a for a in mlp.attribute if a.name == "norm_epsilon")
            g.nodes[i], g.nodes[j] = None, node
            report.out_mlp += 1
            readers, producers = g.readers(), g.producers()

    # 5. The packed QKV projection of a GroupQueryAttention in the rotary-pair order.
    if qkv_prepare and dense_layout == "nk":
        readers, producers = g.readers(), g.producers()
        for node in g.nodes:
            if node is None or node.op_type != "GroupQueryAttention" or \
                    registry.normalize_domain(node.domain) != registry.MS_DOMAIN:
                continue
            pairs = _qkv_pairs(node, g, readers, producers, arrays)
            if pairs is None:
                continue
            lin = g.nodes[producers[node.input[0]]]
            order = linear_ops.rotary_pair_order(*pairs)
            for what in ("w", "scales", "zero_points", "bias"):
                name = _get_input(lin, what)
                if name:
                    arrays[f"{name}.qkv_pairs"] = linear_ops.to_rotary_pair_order(arrays[name], order)
                    _set_input(lin, what, f"{name}.qkv_pairs")
            lin.attribute.append(helper.make_attribute("qkv_pairs", list(pairs)))
            report.qkv_pairs += 1

    # MatMulNBits scales / zero points in the kernels' tiled layout (ops.tile_nbits_meta), or the
    # whole weight in the rows layout, last, so that the passes above see them row-major.
    tiled: dict[str, str] = {}
    rows: dict[tuple, tuple] = {}
    records: dict[tuple, str] = {}
    for node in g.nodes:
        if node is None or node.op_type != "Linear" or not _attr(node, "bits"):
            continue
        if nbits_layout == "rows" and _rows_layout(node, arrays, rows, linear_ops, decode_rows):
            continue
        if nbits_layout == "record" and _record_layout(node, arrays, records, linear_ops, float_map or {}):
            continue
        for what in ("scales", "zero_points"):
            name = _get_input(node, what)
            if name and arrays[name].ndim == 2:
                if name not in tiled:
                    tiled[name] = f"{name}.tiles"
                    arrays[tiled[name]] = linear_ops.tile_nbits_meta(arrays[name])
                _set_input(node, what, tiled[name])
    if dense_layout == "kn":
        original = {nk: w for w, nk in transposed.items()}
        kn: dict[str, str] = {}
        for node in g.nodes:
            if node is None or node.op_type != "Linear" or _attr(node, "bits"):
                continue
            name = _get_input(node, "w")
            if name not in kn:
                if name in original:  # a MatMul's weight as the graph had it
                    kn[name] = original[name]
                else:  # made by a pass (the interleaved gate / up)
                    kn[name] = f"{name}.kn"
                    arrays[kn[name]] = np.ascontiguousarray(arrays[name].T)
            _set_input(node, "w", kn[name])
            node.attribute.append(helper.make_attribute("layout", "kn"))
    out.graph.node.extend(n for n in g.nodes if n is not None)
    # Initializers: the new layouts; the replaced ones go when nothing reads them any more.
    used = {i for n in registry.iter_nodes(out.graph) for i in n.input if i}
    used |= {o.name for o in out.graph.output}
    del out.graph.initializer[:]
    for name in list(arrays):
        if name not in used:
            del arrays[name]
    main_inits = {t.name for t in model.graph.initializer}
    any_inits = {t.name for sub in registry.iter_graphs(model.graph) for t in sub.initializer}
    for name, arr in arrays.items():
        if name in main_inits or name not in any_inits:
            # Names, shapes and types only: the loader keeps the values (its params).
            t = out.graph.initializer.add()
            t.name, t.data_type = name, _elem_type(arr)
            t.dims.extend(arr.shape)
    if not any(o.domain == JOA_DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(JOA_DOMAIN, JOA_OPSET))
    return out, arrays, report


def _qkv_pairs(gqa, g: _Graph, readers, producers, arrays) -> tuple[int, int, int, int] | None:
    """(N, Hkv, D, R/2) when the packed query of GroupQueryAttention node `gqa` is a Linear that
    pass 5 may reorder (module doc), else None."""
    from jax_onnx_attn.onnx.handlers.attention import GQA_INPUTS  # the op's input order, one table

    ins = dict(zip(GQA_INPUTS, list(gqa.input) + [""] * len(GQA_INPUTS)))
    query = ins["query"]
    p = producers.get(query)
    lin = g.nodes[p] if p is not None else None
    if (lin is None or lin.op_type != "Linear" or ins["key"] or ins["value"] or not g.private(query, readers)
            or _attr(lin, "gated", 0) or _get_input(lin, "residual") or _attr(lin, "qkv_pairs")
            or int(_attr(gqa, "do_rotary", 0)) != 1 or int(_attr(gqa, "rotary_interleaved", 0))
            or int(_attr(gqa, "kv_cache_bit_width", 0)) or ins["q_norm_weight"] or ins["k_norm_weight"]
            or any(_text(_attr(gqa, a, "NONE")) != "NONE" for a in ("k_quant_type", "v_quant_type"))):
        return None
    bits = int(_attr(lin, "bits", 0))
    if bits not in (0, 4):
        return None
    cos, sin = arrays.get(ins["cos_cache"]), arrays.get(ins["sin_cache"])
    if cos is None or sin is None or cos.ndim != 2 or cos.shape != sin.shape:
        return None
    n, hkv = int(_attr(gqa, "num_heads")), int(_attr(gqa, "kv_num_heads"))
    rows = int(_attr(lin, "N")) if bits else arrays[_get_input(lin, "w")].shape[0]
    d, rem = divmod(rows, n + 2 * hkv)
    half = int(cos.shape[1])
    if rem or d % 16 or half % 8 or not 0 < 2 * half <= d:
        return None
    if bits and any(_get_input(lin, w) and arrays[_get_input(lin, w)].shape[0] != rows
                    for w in ("w", "scales", "zero_points")):
        return None  # rows not on axis 0 (a layout we do not reorder)
    return n, hkv, d, half


def _rows_layout(node, arrays, done: dict, linear_ops, decode_rows: int) -> bool:
    """Puts a fused 4-bit Linear's weight in the rows layout when the rows kernel takes its shape at
    decode_rows rows of x (asked of its plan: without the compiled extension nothing moves; a shape
    it refuses, e.g. x's K slice too large at 32 rows, keeps the ring kernel's layout rather than
    fall back to the reference every step). done: the weights already moved ({(b_quant, scales,
    zero_points): new names})."""
    from jax_onnx_attn.ops import cuda_matmul

    k, n, block = (int(_attr(node, a)) for a in ("K", "N", "block_size"))
    if int(_attr(node, "bits")) != 4 or cuda_matmul.rows_unsupported(
            decode_rows, n, k, block, bool(_attr(node, "gated", 0)), bool(_get_input(node, "norm_weight"))):
        return False
    key = tuple(_get_input(node, w) for w in ("w", "scales", "zero_points"))
    if key not in done:
        packed = linear_ops.to_rows_layout(arrays[key[0]], arrays[key[1]],
                                           arrays[key[2]] if key[2] else None)
        done[key] = tuple(f"{name}.rows" if name else "" for name in key)
        for name, arr in zip(done[key], packed):
            if name:
                arrays[name] = arr
    for what, name in zip(("w", "scales", "zero_points"), done[key]):
        if name:
            _set_input(node, what, name)
    node.attribute.append(helper.make_attribute("layout", "rows"))
    return True


def _record_layout(node, arrays, done: dict, linear_ops, float_map: dict) -> bool:
    """Puts a fused 4-bit Linear's weight (W, scales and zero points) in the record layout when the
    slots kernel's record reader takes its shape at one row of x (asked of its plan: without a
    compiled extension that knows the layout nothing moves; a shape it refuses keeps the "onnx"
    layout, decided here, never a wrong result). Scales are cast by float_map first (the loader casts
    floats after the fusion; the records hold the scales' bits) and must then be 16-bit floats.
    done: the weights already moved ({(b_quant, scales, zero_points): new names})."""
    from jax_onnx_attn.ops import cuda_matmul

    k, n, block = (int(_attr(node, a)) for a in ("K", "N", "block_size"))
    key = tuple(_get_input(node, w) for w in ("w", "scales", "zero_points"))
    scales = arrays[key[1]]
    scales = scales.astype(float_map.get(scales.dtype, scales.dtype))
    if (int(_attr(node, "bits")) != 4 or scales.ndim != 2 or scales.dtype.itemsize != 2
            or cuda_matmul.record_unsupported(1, n, k, block, bool(_attr(node, "gated", 0)),
                                              bool(_get_input(node, "norm_weight")))):
        return False
    if key not in done:
        name = f"{key[0]}.record"
        arrays[name] = linear_ops.to_record_layout(arrays[key[0]], scales,
                                                   arrays[key[2]] if key[2] else None)
        done[key] = name
    _set_input(node, "w", done[key])
    for what in ("scales", "zero_points"):
        _set_input(node, what, "")
    node.attribute.append(helper.make_attribute("layout", "record"))
    return True


def _text(value) -> str:
    """A string attribute's value (onnx gives bytes) as str."""
    return value.decode() if isinstance(value, bytes) else str(value)


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """Whether a prepared array is the original unchanged: the same shape and dtype over the same
    memory (prepare_nbits returns views of what it leaves as is; comparing the bytes of a multi-GB
    weight would read it twice at load)."""
    a, b = np.asarray(a), np.asarray(b)
    return (a.shape == b.shape and a.dtype == b.dtype and a.strides == b.strides
            and a.__array_interface__["data"][0] == b.__array_interface__["data"][0])


def _elem_type(arr: np.ndarray) -> int:
    if arr.dtype.name == "bfloat16":
        return onnx.TensorProto.BFLOAT16
    return helper.np_dtype_to_tensor_dtype(arr.dtype)


__all__ = ["fuse_decoder", "FusionReport", "JOA_DOMAIN", "LINEAR_INPUTS"]
