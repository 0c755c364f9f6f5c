"""The lowering machinery: op coverage reporting, trace-time folding, loading, MatMulNBits vs
onnxruntime, and the fixed-capacity cache step's compile/donation contract."""

from __future__ import annotations

import re
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

import jax_onnx_attn
from jax_onnx_attn.onnx import UnsupportedOpsError
from jax_onnx_attn.testing import assert_close

FIXTURES = Path(__file__).parent / "fixtures"


def _model(nodes, inputs, outputs, initializers=(), opset=21, extra_opsets=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    ops = [helper.make_opsetid("", opset)] + [helper.make_opsetid(d, v) for d, v in extra_opsets]
    return helper.make_model(graph, opset_imports=ops, ir_version=10)


def _ort(model, feeds):
    return ort.InferenceSession(model.SerializeToString(),
                                providers=["CPUExecutionProvider"]).run(None, feeds)


def test_unsupported_ops_are_all_listed_at_load():
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])
    y = helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])
    branch = helper.make_graph([helper.make_node("Hardmax", ["x"], ["h"])], "b", [],
                               [helper.make_tensor_value_info("h", TensorProto.FLOAT, [2])])
    nodes = [
        helper.make_node("Relu", ["x"], ["a"]),                               # supported
        helper.make_node("FancyNorm", ["a"], ["b"], domain="com.example"),    # unknown domain op
        helper.make_node("DequantizeLinear", ["b", "s"], ["c"]),              # ai.onnx, no handler
        helper.make_node("Constant", [], ["cond"], value=numpy_helper.from_array(np.array(True))),
        helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=branch),  # Hardmax inside
    ]
    s = numpy_helper.from_array(np.array(1.0, np.float32), "s")
    model = _model(nodes, [x], [y], [s], extra_opsets=[("com.example", 3)])
    with pytest.raises(UnsupportedOpsError) as info:
        jax_onnx_attn.load(model)
    missing = {(k.domain, k.op_type, k.since_version) for k in info.value.missing}
    assert missing == {("com.example", "FancyNorm", 3), ("", "DequantizeLinear", 21),
                       ("", "Hardmax", 13)}
    assert "FancyNorm" in str(info.value) and "Hardmax" in str(info.value)


def test_a_newer_schema_version_is_reported_not_run_with_old_semantics(monkeypatch):
    # Mod has a since_version 28; a handler that declares only 10 and 13 must not run it.
    from jax_onnx_attn.onnx import registry
    monkeypatch.delitem(registry._REGISTRY, registry.OpKey("", "Mod", 28))
    x = helper.make_tensor_value_info("x", TensorProto.INT64, [3])
    model = _model([helper.make_node("Mod", ["x", "x"], ["y"])], [x],
                   [helper.make_tensor_value_info("y", TensorProto.INT64, [3])], opset=28)
    with pytest.raises(UnsupportedOpsError, match="Mod"):
        jax_onnx_attn.load(model)


def test_every_registered_op_has_its_newest_schema():
    """A handler covers the newest since_version onnx defines for its op (onnx.defs), so a model at
    the newest opset runs every op the lowering has."""
    import onnx.defs
    from jax_onnx_attn.onnx import registry
    have = {}
    for k in registry.registered():
        have.setdefault((k.domain, k.op_type), set()).add(k.since_version)
    stale = {}
    for (domain, op), versions in have.items():
        try:
            newest = onnx.defs.get_schema(op, domain=domain).since_version
        except onnx.defs.SchemaError:
            continue  # onnxruntime contrib ops: not in onnx.defs
        if newest not in versions:
            stale[op] = (newest, sorted(versions))
    assert not stale, stale


def test_shape_arithmetic_folds_at_trace_time():
    """Reshape/Slice/Expand fed by Shape -> Gather -> Concat arithmetic see static shapes: the traced
    program holds no shape computation, and the result equals onnxruntime's."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["b", "s", 8])
    c = lambda name, v: helper.make_node("Constant", [], [name], value=numpy_helper.from_array(np.array(v, np.int64)))
    nodes = [
        helper.make_node("Shape", ["x"], ["sh"]),
        c("i0", [0]), c("i1", [1]), c("m1", [-1]), c("two", [2]), c("ax", [1]), c("st", [1]),
        helper.make_node("Gather", ["sh", "i0"], ["b"]),
        helper.make_node("Gather", ["sh", "i1"], ["s"]),
        helper.make_node("Mul", ["s", "two"], ["s2"]),
        helper.make_node("Concat", ["b", "s2", "m1"], ["new_shape"], axis=0),
        helper.make_node("Reshape", ["x", "new_shape"], ["r"]),                 # [b, 2s, 4]
        helper.make_node("Slice", ["r", "st", "s2", "ax"], ["sl"]),             # [b, 2s-1, 4]
        helper.make_node("Concat", ["b", "two", "i1", "i1"], ["es"], axis=0),
        helper.make_node("Unsqueeze", ["sl", "ax"], ["u"]),
        helper.make_node("Expand", ["u", "es"], ["y"]),
    ]
    model = _model(nodes, [x], [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])
    lowered = jax_onnx_attn.load(model)
    xv = np.random.default_rng(0).standard_normal((2, 3, 8)).astype(np.float32)
    jaxpr = str(jax.make_jaxpr(lowered.apply)(lowered.params, {"x": xv}))
    for prim in ("concatenate", "gather", "mul", "iota"):
        assert prim not in jaxpr, f"{prim} was traced:\n{jaxpr}"
    got = jax.jit(lowered.apply)(lowered.params, {"x": xv})["y"]
    assert_close(got, _ort(model, {"x": xv})[0])


@pytest.mark.parametrize("bits,k,block,zero_points,bias", [
    (4, 40, 16, True, True), (4, 64, 32, False, False), (8, 48, 16, True, False), (8, 64, 64, False, True)])
def test_matmul_nbits_matches_onnxruntime(bits, k, block, zero_points, bias):
    """Packed 4/8-bit weights with and without (packed) zero points, a K that is not a multiple of
    the block, and a bias; onnxruntime at accuracy_level 0 (exact dequantised product)."""
    rng = np.random.default_rng(bits + k)
    n, kb = 24, -(-k // block)
    blob = block * bits // 8
    b_q = rng.integers(0, 256, (n, kb, blob), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, n * kb).astype(np.float32)
    names = ["A", "B", "scales"]
    inits = [numpy_helper.from_array(b_q, "B"), numpy_helper.from_array(scales, "scales")]
    if zero_points:
        zp = rng.integers(0, 256, n * -(-kb * bits // 8), dtype=np.uint8)
        inits.append(numpy_helper.from_array(zp, "zp"))
        names.append("zp")
    if bias:
        names += ["", "bias"] if zero_points else ["", "", "bias"]
        inits.append(numpy_helper.from_array(rng.standard_normal(n).astype(np.float32), "bias"))
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=0)
    model = _model([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, [2, 3, k])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [2, 3, n])], inits,
                   extra_opsets=[("com.microsoft", 1)])
    a = rng.standard_normal((2, 3, k)).astype(np.float32)
    lowered = jax_onnx_attn.load(model)
    assert "B" in lowered.params and lowered.params["B"].dtype == jnp.uint8  # packed bytes are params
    assert_close(jax.jit(lowered.apply)(lowered.params, {"A": a})["Y"], _ort(model, {"A": a})[0])


@pytest.mark.parametrize("bits,k,block,zero_points", [(4, 64, 32, False), (4, 100, 32, True),
                                                      (8, 48, 16, False), (4, 128, 64, True)])
def test_matmul_nbits_int8_activations_match_onnxruntime_level_4(bits, k, block, zero_points):
    """accuracy_level=4: onnxruntime's CPU kernel quantises A to int8 per block along K. With
    load(int8_activations=True) the product matches it to f32 precision; the exact product (the
    default) is off by the quantisation (about 1% of the output scale)."""
    rng = np.random.default_rng(bits * k + block)
    n, kb = 40, -(-k // block)
    names = ["A", "B", "scales"]
    packed = rng.integers(0, 256, (n, kb, block * bits // 8), dtype=np.uint8)
    inits = [numpy_helper.from_array(packed, "B"),
             numpy_helper.from_array(rng.uniform(0.01, 0.1, n * kb).astype(np.float32), "scales")]
    if zero_points:
        inits.append(numpy_helper.from_array(
            rng.integers(0, 256, n * -(-kb * bits // 8), dtype=np.uint8), "zp"))
        names.append("zp")
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block, accuracy_level=4)
    model = _model([node], [helper.make_tensor_value_info("A", TensorProto.FLOAT, [3, 5, k])],
                   [helper.make_tensor_value_info("Y", TensorProto.FLOAT, [3, 5, n])], inits,
                   extra_opsets=[("com.microsoft", 1)])
    a = (rng.standard_normal((3, 5, k)) * 2).astype(np.float32)
    a[0, 0] = 0.0  # an all-zero block (scale 0)
    want = _ort(model, {"A": a})[0]
    scale = float(np.abs(want).max())
    int8 = jax_onnx_attn.load(model, int8_activations=True)
    got = np.asarray(jax.jit(int8.apply)(int8.params, {"A": a})["Y"])
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * scale)
    exact = jax_onnx_attn.load(model)
    err = np.abs(np.asarray(jax.jit(exact.apply)(exact.params, {"A": a})["Y"]) - want).max()
    assert err > 1e-3 * scale


@pytest.mark.parametrize("variant", ["k_transposed", "scale_first", "v", "heads_permuted"])
def test_decomposed_repeat_kv_matmul_matches_onnxruntime(monkeypatch, variant):
    """torch's repeat_kv (Unsqueeze, Expand, Reshape to 4 heads) of a 2-head K or V feeding a MatMul,
    through Reshape/Transpose/Reshape and a scalar Mul: the lowering computes with the 2 heads
    (grouped_matmul) and equals onnxruntime. A chain that permutes heads is not grouped."""
    from jax_onnx_attn.onnx.handlers import linalg
    b, hkv, g, t, d, s = 2, 2, 2, 5, 8, 3
    hq = hkv * g
    c = lambda name, v: numpy_helper.from_array(np.asarray(v), name)
    inits = [c("ax2", np.array([2], np.int64)), c("ex", np.array([b, hkv, g, t, d], np.int64)),
             c("hq", np.array([b, hq, t, d], np.int64)), c("flat", np.array([b * hq, t, d], np.int64)),
             c("kt", np.array([b, hq, d, t], np.int64)), c("sc", np.array(0.5, np.float32))]
    nodes = [helper.make_node("Unsqueeze", ["kv", "ax2"], ["u"]),
             helper.make_node("Expand", ["u", "ex"], ["e"]),
             helper.make_node("Reshape", ["e", "hq"], ["r"])]
    if variant == "v":
        q_shape, last = [b, hq, s, t], "r"
    elif variant == "heads_permuted":  # [B, Hq, T, D] -> [Hq, B, D, T]: head h is not KV head h // G
        q_shape, last = [hq, b, s, d], "p"
        nodes += [helper.make_node("Transpose", ["r"], ["p0"], perm=[1, 0, 3, 2]),
                  helper.make_node("Mul", ["p0", "sc"], ["p"])]
    else:
        q_shape, last = [b, hq, s, d], "m"
        mul_in = ["sc", "r3"] if variant == "scale_first" else ["r3", "sc"]
        nodes += [helper.make_node("Reshape", ["r", "flat"], ["r1"]),
                  helper.make_node("Transpose", ["r1"], ["r2"], perm=[0, 2, 1]),
                  helper.make_node("Reshape", ["r2", "kt"], ["r3"]),
                  helper.make_node("Mul", mul_in, ["m"])]
    nodes.append(helper.make_node("MatMul", ["q", last], ["y"]))
    model = _model(nodes, [helper.make_tensor_value_info("q", TensorProto.FLOAT, q_shape),
                           helper.make_tensor_value_info("kv", TensorProto.FLOAT, [b, hkv, t, d])],
                   [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)], inits)
    rng = np.random.default_rng(0)
    feeds = {"q": rng.standard_normal(q_shape).astype(np.float32),
             "kv": rng.standard_normal((b, hkv, t, d)).astype(np.float32)}
    grouped = []
    real = linalg.grouped_matmul
    monkeypatch.setattr(linalg, "grouped_matmul", lambda a, kv: grouped.append(kv) or real(a, kv))
    lowered = jax_onnx_attn.load(model)
    assert_close(jax.jit(lowered.apply)(lowered.params, feeds)["y"], _ort(model, feeds)[0])
    assert len(grouped) == (0 if variant == "heads_permuted" else 1)


def test_external_data_from_proto_with_base_dir():
    path = FIXTURES / "builder_llama_fp32" / "model.onnx"
    assert (path.parent / "model.onnx.data").exists()
    from_path = jax_onnx_attn.load(path)
    proto = onnx.load(str(path), load_external_data=False)
    from_proto = jax_onnx_attn.load(proto, base_dir=path.parent)
    assert from_path.params.keys() == from_proto.params.keys()
    for k, v in from_path.params.items():
        np.testing.assert_array_equal(np.asarray(v), np.asarray(from_proto.params[k]))


def test_fixed_cache_step_needs_a_kv_cache():
    x = helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])
    model = _model([helper.make_node("Identity", ["input_ids"], ["logits"])], [x],
                   [helper.make_tensor_value_info("logits", TensorProto.INT64, ["b", "s"])])
    with pytest.raises(ValueError, match="no recognisable KV cache"):
        jax_onnx_attn.load(model).fixed_cache_step(1, 8)


@pytest.mark.parametrize("name", ["builder_llama_fp32", "builder_gemma2_fp32", "torch_llama_op23",
                                  "torch_llama_op20"])
def test_decode_reuses_one_executable_and_updates_the_cache_in_place(name):
    """GQA shared buffer (builder; gemma2's sliding-window layer included) and Concat -> kv_append
    (torch): decode steps with changing lengths never retrace, and the donated cache is aliased to
    the output with no copy of it in the HLO."""
    lowered = jax_onnx_attn.load(FIXTURES / name / "model.onnx")
    b, cap = 3, 48
    step = lowered.fixed_cache_step(b, cap)
    traces = []

    def counted(*args):
        traces.append(1)
        return step(*args)

    run = jax.jit(counted, donate_argnums=(4,))
    cache = step.init_cache(lowered.params)
    args = (lowered.params, np.zeros((b, 1), np.int32), np.array([0, 3, 7], np.int32),
            np.ones(b, np.int32))
    hlo = run.lower(*args, cache).compile().as_text()
    shape = "[{},{},{},{}]".format(*next(iter(step.cache_shapes.values()))[0])
    # An instruction whose result has the cache's shape and that is a copy (or an async copy).
    copy_of_cache = re.compile(r"=\s*\w+" + re.escape(shape) + r"(\{[^}]*\})?\s+copy(-start)?\(")
    copies = [ln for ln in hlo.splitlines() if copy_of_cache.search(ln)]
    assert not copies, "the cache is copied:\n" + "\n".join(copies)
    alias = next(ln for ln in hlo.splitlines() if ln.startswith("HloModule"))
    assert alias.count("may-alias") + alias.count("must-alias") >= len(cache), alias
    for t in range(6):
        ids = np.full((b, 1), 5 + t, np.int32)
        old = next(iter(cache.values()))
        _, cache = run(lowered.params, ids, np.array([t, 3 + t, 7 + t], np.int32), np.ones(b, np.int32),
                       cache)
        assert old.is_deleted(), "the donated cache buffer was not consumed"
    assert len(traces) == 1, f"{len(traces)} traces for 6 decode steps"


def _attention_past_model(vocab=32, hidden=32, heads=4, kv_heads=2, head=8, opset=23, **attrs):
    """One ai.onnx Attention-23 layer with past_key/past_value inputs (the step's attention_past
    mode): Gather -> Q/K/V MatMuls -> Attention(is_causal) -> MatMul to logits."""
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal(shape) * 0.3).astype(np.float32), name)
             for name, shape in (("emb", (vocab, hidden)), ("wq", (hidden, heads * head)),
                                 ("wk", (hidden, kv_heads * head)), ("wv", (hidden, kv_heads * head)),
                                 ("wo", (heads * head, vocab)))]
    past = ["past_key_values.0.key", "past_key_values.0.value"]
    nodes = [helper.make_node("Gather", ["emb", "input_ids"], ["x"]),
             *(helper.make_node("MatMul", ["x", w], [o]) for w, o in (("wq", "q"), ("wk", "k"), ("wv", "v"))),
             helper.make_node("Attention", ["q", "k", "v", ""] + past, ["y", "present.0.key", "present.0.value"],
                              q_num_heads=heads, kv_num_heads=kv_heads, is_causal=1, **attrs),
             helper.make_node("MatMul", ["y", "wo"], ["logits"])]
    kv = lambda name, t: helper.make_tensor_value_info(name, TensorProto.FLOAT, ["b", kv_heads, t, head])
    return _model(nodes, [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"]),
                          kv(past[0], "p"), kv(past[1], "p")],
                  [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", vocab]),
                   kv("present.0.key", "t"), kv("present.0.value", "t")], inits, opset=opset)


#: One model per kind of KV cache the step drives: GQA shared buffer (plain and with a
#: sliding-window layer), Concat -> kv_append before ai.onnx Attention and before a decomposed
#: attention, and ai.onnx Attention's own past_key/past_value.
STATUS_MODELS = {"builder_llama_fp32": "gqa", "builder_gemma2_fp32": "gqa", "torch_llama_op23": "concat",
                 "torch_llama_op20": "concat", "attention_past": "attention_past"}


def _load_status_model(name):
    if name == "attention_past":
        return jax_onnx_attn.load(_attention_past_model())
    return jax_onnx_attn.load(FIXTURES / name / "model.onnx")


def _prefilled(step, lowered):
    """(run, host cache) after a prefill of 4 and 3 tokens; run = the jitted with_status step."""
    run = step.jit(with_status=True)
    out = run(lowered.params, np.array([[5, 6, 7, 8], [9, 10, 11, 0]], np.int32), np.zeros(2, np.int32),
              np.array([4, 3], np.int32), step.init_cache(lowered.params))
    np.testing.assert_array_equal(np.asarray(out.status), [0, 0])
    return run, jax.tree.map(np.asarray, out.cache)


@pytest.mark.parametrize("name", list(STATUS_MODELS))
def test_step_status_flags_a_row_that_does_not_fit_and_keeps_its_cache(name):
    """A decode step whose row 1 starts at cache_len C (one past the buffer) or -1: with_status
    flags row 1 (KV_WRITE_OUT_OF_RANGE) and only row 1; row 1's buffers are bitwise what they were
    (the write was skipped: GQA's graph would otherwise clamp the row to the buffer's last row), row
    0's logits and buffers are bitwise those of the same step with row 1 in range; calling the step
    returns the same (logits, cache) without the status."""
    from jax_onnx_attn.ops import status

    lowered = _load_status_model(name)
    b, cap = 2, 16
    step = lowered.fixed_cache_step(b, cap)
    assert step.mode == STATUS_MODELS[name]
    run, base = _prefilled(step, lowered)
    ids, ones = np.array([[12], [13]], np.int32), np.ones(b, np.int32)
    fresh = lambda: jax.tree.map(jnp.asarray, base)  # noqa: E731 - the run donates its cache
    clean = jax.tree.map(np.asarray, run(lowered.params, ids, np.array([4, 3], np.int32), ones, fresh()))
    np.testing.assert_array_equal(clean.status, [0, 0])
    assert any(not np.array_equal(clean.cache[k][1], base[k][1]) for k in base)  # row 1 is written
    for bad in (cap, -1):
        got = jax.tree.map(np.asarray, run(lowered.params, ids, np.array([4, bad], np.int32), ones, fresh()))
        np.testing.assert_array_equal(got.status, [status.OK, status.KV_WRITE_OUT_OF_RANGE])
        for k in base:
            np.testing.assert_array_equal(got.cache[k][1], base[k][1], err_msg=f"{k} row 1, cache_len {bad}")
            np.testing.assert_array_equal(got.cache[k][0], clean.cache[k][0], err_msg=f"{k} row 0")
        np.testing.assert_array_equal(got.logits[0], clean.logits[0])
    logits, cache = jax.jit(step)(lowered.params, ids, np.array([4, -1], np.int32), ones, fresh())
    np.testing.assert_array_equal(np.asarray(logits), got.logits)
    assert all(np.array_equal(np.asarray(cache[k]), got.cache[k]) for k in base)


@pytest.mark.parametrize("name, op", [("builder_llama_fp32", "group_query_attention"),
                                      ("torch_llama_op23", "kv_append"),
                                      ("attention_past", "attention_with_cache")])
def test_step_status_carries_the_cache_ops_flags(monkeypatch, name, op):
    """Every status the step's cache op returns comes out of the step: the op, wrapped to OR a
    marker bit (one the step never sets itself) into row 1, marks row 1 of an in-range step."""
    mark = 1 << 8
    real = getattr(jax_onnx_attn.ops, op)

    def marked(*args, **kwargs):
        res = real(*args, **kwargs)
        extra = jnp.array([0, mark], jnp.int32)
        if op == "kv_append":
            return res[0], res[1] | extra
        return res._replace(status=res.status | extra)

    lowered = _load_status_model(name)
    step = lowered.fixed_cache_step(2, 16)
    monkeypatch.setattr(jax_onnx_attn.ops, op, marked)
    out = jax.jit(step.with_status)(lowered.params, np.array([[5, 6, 7, 8], [9, 10, 11, 0]], np.int32),
                                    np.zeros(2, np.int32), np.array([4, 3], np.int32),
                                    step.init_cache(lowered.params))
    np.testing.assert_array_equal(np.asarray(out.status), [0, mark])


def test_attention_past_model_step_matches_onnxruntime():
    """The attention_past model of the status tests is a real one: its cache step gives
    onnxruntime's logits for a prefill of 4 tokens and a decode step (onnxruntime grows the past)."""
    model = _attention_past_model()
    lowered = jax_onnx_attn.load(model)
    step = lowered.fixed_cache_step(1, 16)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    empty = np.zeros((1, 2, 0, 8), np.float32)
    ref = sess.run(None, {"input_ids": np.array([[3, 4, 5, 6]]), "past_key_values.0.key": empty,
                          "past_key_values.0.value": empty})
    ref2 = sess.run(None, {"input_ids": np.array([[7]]), "past_key_values.0.key": ref[1],
                           "past_key_values.0.value": ref[2]})
    run = jax.jit(step.with_status)
    out = run(lowered.params, np.array([[3, 4, 5, 6]], np.int32), np.zeros(1, np.int32),
              np.array([4], np.int32), step.init_cache())
    out2 = run(lowered.params, np.array([[7]], np.int32), np.array([4], np.int32),
               np.array([1], np.int32), out.cache)
    assert_close(np.asarray(out.logits), ref[0], np.float32)
    assert_close(np.asarray(out2.logits), ref2[0], np.float32)
    assert int(out.status[0]) == int(out2.status[0]) == 0


def test_attention_past_step_keeps_the_models_opset():
    """The attention_past step runs the node under its model's opset: an opset-25 sliding window
    (left_window_size) is accepted and gives the logits of the graph run without a cache."""
    lowered = jax_onnx_attn.load(_attention_past_model(opset=25, left_window_size=1))
    step = lowered.fixed_cache_step(1, 8)
    ids = np.array([[3, 4, 5, 6]], np.int32)
    out = jax.jit(step.with_status)(lowered.params, ids, np.zeros(1, np.int32),
                                     np.array([4], np.int32), step.init_cache())
    empty = np.zeros((1, 2, 0, 8), np.float32)
    want = jax.jit(lowered.apply)(lowered.params, {"input_ids": ids, "past_key_values.0.key": empty,
                                                   "past_key_values.0.value": empty})["logits"]
    assert_close(np.asarray(out.logits), np.asarray(want), np.float32)
    full = jax_onnx_attn.load(_attention_past_model(opset=25))
    unwindowed = jax.jit(full.apply)(full.params, {"input_ids": ids, "past_key_values.0.key": empty,
                                                   "past_key_values.0.value": empty})["logits"]
    assert np.abs(np.asarray(unwindowed) - np.asarray(want)).max() > 1e-3  # the window matters


@pytest.mark.parametrize("to,bits,signed", [(TensorProto.INT4, 4, True), (TensorProto.UINT4, 4, False),
                                            (TensorProto.INT2, 2, True), (TensorProto.UINT2, 2, False)])
@pytest.mark.parametrize("jit", [False, True])
def test_cast_float_to_sub_byte_ints_truncates_then_wraps(to, bits, signed, jit):
    """Cast float -> int4 / uint4 / int2 / uint2: truncate to an integer, then wrap modulo 2^bits
    (ONNX's stored test data for test_cast_FLOAT_to_INT4 etc.). The oracle goes through int32,
    whose conversion to the narrow type wraps in every ml_dtypes (their float one does not in 0.7,
    which is why the node suite leaves those generated cases out: node_suite.ORACLE_UNUSABLE)."""
    narrow = helper.tensor_dtype_to_np_dtype(to)
    x = np.arange(-9.5, 16.0, 0.75, dtype=np.float32)
    model = _model([helper.make_node("Cast", ["x"], ["y"], to=to)],
                   [helper.make_tensor_value_info("x", TensorProto.FLOAT, [x.size])],
                   [helper.make_tensor_value_info("y", to, [x.size])], opset=25)
    lowered = jax_onnx_attn.load(model)
    apply = jax.jit(lowered.apply) if jit else lowered.apply
    got = np.asarray(apply(lowered.params, {"x": x})["y"])
    want = np.trunc(x).astype(np.int32).astype(narrow)
    assert got.dtype == np.dtype(narrow)
    np.testing.assert_array_equal(got.astype(np.int32), want.astype(np.int32))
    lo = -(1 << (bits - 1)) if signed else 0
    assert got.astype(np.int32).min() == lo and got.astype(np.int32).max() == lo + (1 << bits) - 1


@pytest.mark.parametrize("name", ["builder_llama_fp32", "builder_gemma2_fp32", "torch_llama_op23",
                                  "torch_llama_op20"])
def test_last_logits_runs_the_head_on_each_rows_last_token(name):
    """A prompt step with last_logits=True: the head found through the graph's position-wise tail
    (gemma2: its logit softcap), logits [B, 1, V] equal to the whole step's logits at each row's
    last new token (ragged rows; a row without new tokens reads position 0), and no [B, S, V]
    value anywhere in the computation."""
    lowered = jax_onnx_attn.load(FIXTURES / name / "model.onnx")
    b, s, cap = 3, 6, 16
    step = lowered.fixed_cache_step(b, cap)
    assert step.logits_head is not None, "the LM head was not found"
    ids = (np.arange(b * s, dtype=np.int32).reshape(b, s) * 7) % 50 + 1
    zero, num_new = np.zeros(b, np.int32), np.array([6, 3, 0], np.int32)
    full, _ = step(lowered.params, ids, zero, num_new, step.init_cache(lowered.params))
    last, _ = step(lowered.params, ids, zero, num_new, step.init_cache(lowered.params), last_logits=True)
    v = full.shape[-1]
    assert last.shape == (b, 1, v)
    want = np.asarray(full)[np.arange(b), [5, 2, 0]][:, None]
    assert_close(last, want)
    jaxpr = jax.make_jaxpr(lambda p, c: step(p, ids, zero, num_new, c, last_logits=True))(
        lowered.params, step.init_cache(lowered.params))
    shapes = {tuple(var.aval.shape) for eqn in jaxpr.jaxpr.eqns for var in eqn.outvars
              if hasattr(var.aval, "shape")}
    assert (b, s, v) not in shapes, "the logits of every position were computed"


def test_logits_head_crosses_only_position_wise_nodes():
    """`logits_head` walks back from the logits through position-wise nodes only: not through a
    Transpose, nor past a binary op whose other operand is more than a vector, nor to a projection
    whose weight is not a param (a step then computes the whole logits and gathers them)."""
    from jax_onnx_attn.onnx.cache_step import logits_head

    producers = {"logits": helper.make_node("Transpose", ["t"], ["logits"], perm=[1, 0, 2]),
                 "t": helper.make_node("MatMul", ["x", "w"], ["t"])}
    assert logits_head(producers, {"w": np.zeros((4, 4))}, "logits") is None
    producers["logits"] = helper.make_node("Mul", ["t", "c"], ["logits"])
    assert logits_head(producers, {"w": np.zeros((4, 4)), "c": np.zeros(4)}, "logits") is producers["t"]
    # A [V, V] "constant" is not position-wise safe to skip past: not found.
    assert logits_head(producers, {"w": np.zeros((4, 4)), "c": np.zeros((4, 4))}, "logits") is None
    # A projection with a non-param weight (a residual, an activation) is not a head.
    assert logits_head({"logits": producers["t"]}, {}, "logits") is None
