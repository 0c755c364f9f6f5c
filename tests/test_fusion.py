"""Load-time fusion (jax_onnx_attn/onnx/fusion.py): the rewritten graph computes what the graph
computes (fused vs unfused lowering, and onnxruntime through the model tests), with the fused
node structure a decoder layer should have."""

import collections

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import jax_onnx_attn
from jax_onnx_attn.models import build_tiny_decoder
from jax_onnx_attn.onnx.fusion import JOA_DOMAIN
from jax_onnx_attn.testing import assert_close, tolerance

import session_switch

FIXTURES = "tests/fixtures"


def _feeds(lowered, b=2, s=5, past=3, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    kv_shapes = lowered.fixed_cache_step(b, past + s).cache_shapes  # (Hkv, D) of each past input
    for name, (dims, dtype) in lowered.input_info().items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, 200, (b, s)).astype(np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((b, past + s), np.int64)
        elif name == "position_ids":
            feeds[name] = np.broadcast_to(np.arange(past, past + s), (b, s)).astype(np.int64)
        else:  # past key / value [B, Hkv, P, D]
            (_, hkv, _, d), _ = kv_shapes[name]
            feeds[name] = rng.standard_normal((b, hkv, past, d)).astype(dtype)
    return feeds


def _assert_same_bits(fused, plain, b=1):
    """Both lowerings of one model give the same bits on one step of b rows with a past."""
    feeds = _feeds(plain, b=b)
    got, want = fused.apply(fused.params, feeds), plain.apply(plain.params, feeds)
    assert list(got) == list(want)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_builder_decoder_fuses_to_four_linears_a_layer_and_keeps_its_outputs(dtype):
    model = build_tiny_decoder(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype=dtype)
    fused = jax_onnx_attn.load(model)
    plain = jax_onnx_attn.load(model, fuse=False)
    ops = collections.Counter(n.op_type for n in fused.model.graph.node)
    # Per layer: Linear (norm + QKV), GQA, Linear (o + residual), Linear (norm + SwiGLU),
    # Linear (down + residual); plus the LM head (norm prologue).
    assert ops["Linear"] == 4 * 3 + 1 and ops["GroupQueryAttention"] == 3
    for op in ("MatMul", "Sigmoid", "SkipSimplifiedLayerNormalization", "SimplifiedLayerNormalization"):
        assert ops[op] == 0, op
    assert fused.fusions.gated == 3 and fused.fusions.residual == 6 and fused.fusions.norm == 7
    assert plain.fusions is None
    feeds = _feeds(plain, b=1 if dtype == "f16" else 2)  # onnxruntime: one row with a past
    got = fused.apply(fused.params, feeds)
    if dtype == "f32":
        want = plain.apply(plain.params, feeds)
    else:
        # In half precision the fused SwiGLU rounds once where the graph rounds three times, so
        # the oracle is onnxruntime, not the unfused lowering.
        import onnxruntime as ort
        sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        want = dict(zip([o.name for o in sess.get_outputs()], sess.run(None, feeds)))
    assert list(got) == list(want)
    tol = tolerance(np.float16 if dtype == "f16" else np.float32)[1]
    for name in want:
        # Relative to each output's scale, as the model tests hold logits (tests/test_onnx_models.py).
        ref = np.asarray(want[name], np.float32)
        err = float(np.abs(np.asarray(got[name], np.float32) - ref).max())
        assert err <= tol * max(1.0, float(np.abs(ref).max())), (name, err)


@pytest.mark.parametrize("fixture", ["builder_llama_int4", "builder_qwen2_fp32", "torch_qwen2_op23"])
def test_exports_fuse_and_match_the_unfused_lowering(fixture):
    path = f"{FIXTURES}/{fixture}/model.onnx"
    fused, plain = jax_onnx_attn.load(path), jax_onnx_attn.load(path, fuse=False)
    assert fused.fusions.linear + fused.fusions.nbits >= 7
    feeds = _feeds(plain, past=4)
    got, want = fused.apply(fused.params, feeds), plain.apply(plain.params, feeds)
    dtype = np.float32  # float32 exports: the fused math must agree to float32 rounding
    for name in want:
        assert_close(np.asarray(got[name], np.float32), np.asarray(want[name], np.float32), dtype,
                     err_msg=name)
    # The fused graph's weights are the op layouts: [N, K] for dense projections.
    for node in fused.model.graph.node:
        if node.op_type == "Linear" and not any(a.name == "bits" for a in node.attribute):
            assert node.input[1].endswith((".nk", ".gate_up"))


def _mlp_model(output_intermediate: bool):
    """x -> MatMul(W1) -> Sigmoid-gated product with MatMul(W2): the SwiGLU pattern, optionally with
    the gate also a graph output (then it must not be fused away)."""
    rng = np.random.default_rng(1)
    w1, w2 = (rng.standard_normal((16, 24)).astype(np.float32) for _ in range(2))
    nodes = [helper.make_node("MatMul", ["x", "W1"], ["g"]),
             helper.make_node("Sigmoid", ["g"], ["sg"]),
             helper.make_node("Mul", ["g", "sg"], ["act"]),
             helper.make_node("MatMul", ["x", "W2"], ["u"]),
             helper.make_node("Mul", ["act", "u"], ["y"])]
    outputs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 24])]
    if output_intermediate:
        outputs.append(helper.make_tensor_value_info("g", TensorProto.FLOAT, [2, 24]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 16])],
                              outputs, [onnx.numpy_helper.from_array(w1, "W1"),
                                        onnx.numpy_helper.from_array(w2, "W2")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("output_intermediate", [False, True])
def test_swiglu_fuses_unless_an_intermediate_is_a_graph_output(output_intermediate):
    model = _mlp_model(output_intermediate)
    fused = jax_onnx_attn.load(model)
    assert fused.fusions.gated == (0 if output_intermediate else 1)
    assert fused.fusions.linear == 2
    x = np.random.default_rng(2).standard_normal((2, 16)).astype(np.float32)
    got = fused.apply(fused.params, {"x": x})
    ref = jax_onnx_attn.load(model, fuse=False)
    want = ref.apply(ref.params, {"x": x})
    for name in want:
        assert_close(np.asarray(got[name]), np.asarray(want[name]), np.float32)
    assert any(o.domain == JOA_DOMAIN for o in fused.model.opset_import)


def test_rows_layout_fuses_4bit_weights_and_keeps_the_results(monkeypatch):
    # nbits_layout="rows": the 4-bit projections the rows kernel takes hold their weights in the rows
    # layout (attribute layout="rows"); the reference through it computes the same bits. A session
    # of batch >= 2 loads it that way where the kernels run (JOA_GEMV_ROWS=1 here), and generates
    # the same tokens.
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime import DecoderSession

    path = f"{FIXTURES}/builder_llama_int4/model.onnx"
    onnx_layout, rows = jax_onnx_attn.load(path), jax_onnx_attn.load(path, nbits_layout="rows")
    linears = [n for n in rows.model.graph.node if n.op_type == "Linear"]
    moved = [n for n in linears if any(a.name == "layout" and a.s == b"rows" for a in n.attribute)]
    if cuda_matmul.rows_unsupported(2, 64, 64, 32, False) is not None:
        pytest.skip("the rows kernel's plan (the compiled extension) is missing")
    assert len(moved) == len(linears) == 9
    for n in moved:
        assert rows.params[n.input[1]].shape[-1] == 512
    feeds = _feeds(onnx_layout, past=4)
    got, want = rows.apply(rows.params, feeds), onnx_layout.apply(onnx_layout.params, feeds)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    with pytest.raises(ValueError, match="nbits_layout"):
        jax_onnx_attn.load(path, nbits_layout="tiles")
    # Tensor parallelism leaves rows-layout weights whole (no split of the layout yet).
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel
    plan = plan_tensor_parallel(rows, 2)
    assert not plan.splits and all("rows layout" in why for why in plan.whole.values())
    # Rows of x the kernel does not take (> 32): the weights keep the ring kernel's layout.
    wide = jax_onnx_attn.load(path, nbits_layout="rows", decode_rows=33)
    assert not any(a.name == "layout" for n in wide.model.graph.node for a in n.attribute)

    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    monkeypatch.setenv(cuda_matmul.ROWS_ENV, "0")
    plain = DecoderSession(path, max_length=16, batch=2)
    assert not any(a.name == "layout" for n in plain.lowered.model.graph.node for a in n.attribute)
    plain = plain.generate(prompts, max_new_tokens=6)
    monkeypatch.setenv(cuda_matmul.ROWS_ENV, "1")
    session = DecoderSession(path, max_length=16, batch=2)
    assert any(a.name == "layout" for n in session.lowered.model.graph.node for a in n.attribute)
    assert session.generate(prompts, max_new_tokens=6).tokens == plain.tokens
    one_row = DecoderSession(path, max_length=16, batch=1)  # one row keeps the slots kernel's layout
    assert not any(a.name == "layout" for n in one_row.lowered.model.graph.node for a in n.attribute)


def test_rows_layout_is_on_by_default_where_the_kernels_run(monkeypatch):
    from jax_onnx_attn._extension import cuda_usable
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime.session import nbits_layout_for

    monkeypatch.delenv(cuda_matmul.ROWS_ENV, raising=False)
    assert cuda_matmul.rows_layout_enabled() == cuda_usable()
    assert nbits_layout_for(8) == ("rows" if cuda_usable() else "onnx") and nbits_layout_for(1) == "onnx"
    monkeypatch.setenv(cuda_matmul.ROWS_ENV, "1")
    assert nbits_layout_for(8) == "rows" and nbits_layout_for(8, mesh=object()) == "onnx"
    monkeypatch.setenv(cuda_matmul.ROWS_ENV, "2")
    with pytest.raises(ValueError, match="JOA_GEMV_ROWS"):
        cuda_matmul.rows_layout_enabled()


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_dense_kn_layout_stores_weights_as_onnx_does_and_keeps_the_results(dtype):
    # dense_layout="kn": every dense Linear reads its weight [K, N] (attribute layout="kn"): a
    # MatMul's own initializer, not a copy, where no pass changed it; the interleaved gate / up
    # transposed once. The outputs are those of the [N, K] layout within the dtype's rounding
    # (another GEMM layout may sum in another order).
    model = build_tiny_decoder(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype=dtype)
    nk, kn = jax_onnx_attn.load(model), jax_onnx_attn.load(model, dense_layout="kn")
    inits = {t.name for t in model.graph.initializer}
    linears = {n.name: n for n in kn.model.graph.node if n.op_type == "Linear"}
    assert len(linears) == 4 * 2 + 1
    gated = 0
    for n in nk.model.graph.node:
        if n.op_type != "Linear":
            continue
        twin = linears[n.name]
        assert any(a.name == "layout" and a.s == b"kn" for a in twin.attribute), n.name
        assert not any(a.name == "layout" for a in n.attribute), n.name
        np.testing.assert_array_equal(np.asarray(kn.params[twin.input[1]]), np.asarray(nk.params[n.input[1]]).T)
        if any(a.name == "gated" and a.i for a in n.attribute):
            gated += 1
            assert twin.input[1].endswith(".kn"), twin.input[1]
        else:
            assert twin.input[1] in inits, twin.input[1]  # the graph's own [K, N] initializer
    assert gated == 2 and not any(name.endswith(".nk") for name in kn.params)
    feeds = _feeds(nk, b=2)
    got, want = kn.apply(kn.params, feeds), nk.apply(nk.params, feeds)
    tol = tolerance(np.float16 if dtype == "f16" else np.float32)[1]
    for name in want:
        ref = np.asarray(want[name], np.float32)
        err = float(np.abs(np.asarray(got[name], np.float32) - ref).max())
        assert err <= tol * max(1.0, float(np.abs(ref).max())), (name, err)
    with pytest.raises(ValueError, match="dense_layout"):
        jax_onnx_attn.load(model, dense_layout="tn")
    # A mesh's splits read [N, K]: the plan refuses the layout, naming it.
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel
    with pytest.raises(ValueError, match="dense_layout='nk'"):
        plan_tensor_parallel(kn, 2)


def test_sessions_of_two_rows_load_dense_weights_kn_and_generate_the_same_tokens(monkeypatch):
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime import DecoderSession
    from jax_onnx_attn.runtime.session import dense_layout_for

    monkeypatch.delenv(cuda_matmul.DENSE_KN_ENV, raising=False)
    assert cuda_matmul.dense_kn_enabled()
    assert dense_layout_for(8) == "kn" and dense_layout_for(1) == "nk" and dense_layout_for(8, mesh=object()) == "nk"
    model = build_tiny_decoder(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype="f32")
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    session = DecoderSession(model, max_length=16, batch=2)
    layouts = {a.s for n in session.lowered.model.graph.node for a in n.attribute if a.name == "layout"}
    assert layouts == {b"kn"}
    monkeypatch.setenv(cuda_matmul.DENSE_KN_ENV, "0")
    assert dense_layout_for(8) == "nk"
    plain = DecoderSession(model, max_length=16, batch=2)
    assert not any(a.name == "layout" for n in plain.lowered.model.graph.node for a in n.attribute)
    assert (session.generate(prompts, max_new_tokens=6).tokens == plain.generate(prompts, max_new_tokens=6).tokens)
    monkeypatch.setenv(cuda_matmul.DENSE_KN_ENV, "yes")
    with pytest.raises(ValueError, match=cuda_matmul.DENSE_KN_ENV):
        dense_layout_for(8)


def test_rotary_pair_order_puts_each_rotary_pair_in_one_16_row_group():
    from jax_onnx_attn.ops import rotary_pair_order

    n, hkv, d, half = 3, 2, 64, 16  # partial rotary: dims 32..63 of each head are not rotated
    order = rotary_pair_order(n, hkv, d, half)
    assert sorted(order.tolist()) == list(range((n + 2 * hkv) * d))
    groups = order.reshape(-1, 16)
    for g, rows in enumerate(groups):
        head, within = divmod(int(rows[0]), d)
        assert all(r // d == head for r in rows), "a group stays in one head"
        dims = rows % d
        if head < n + hkv and within < 2 * half:  # Q or K, rotated: dims 8j.. then R/2 + 8j..
            j = (g * 16 - head * d) // 16
            assert dims.tolist() == list(range(8 * j, 8 * j + 8)) + list(range(half + 8 * j, half + 8 * j + 8))
        else:  # the rest of a head, and V heads: in order
            assert dims.tolist() == list(range(dims[0], dims[0] + 16))
    y = np.arange(len(order))[order]  # a projection's output in the order ...
    np.testing.assert_array_equal(jax_onnx_attn.ops.from_rotary_pair_order(y, order), np.arange(len(order)))
    for bad in ((3, 2, 56, 16), (3, 2, 64, 12), (3, 2, 64, 40)):
        with pytest.raises(ValueError, match="rotary_pair_order"):
            rotary_pair_order(*bad)


@pytest.mark.parametrize("dtype,bits", [("float32", 0), ("float16", 0), ("float16", 4)])
def test_qkv_prepare_reorders_the_packed_projection_and_keeps_the_results(dtype, bits):
    # hidden 128 over 2 heads: D = 64, R/2 = 32, so the order moves rows (with D = 16 it would not).
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig

    model = build_decoder(DecoderConfig(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=96,
                                        dtype=dtype, weight_bits=bits))
    fused = jax_onnx_attn.load(model, qkv_prepare=True)
    plain = jax_onnx_attn.load(model)
    assert fused.fusions.qkv_pairs == 2 and plain.fusions.qkv_pairs == 0
    gqa_queries = {n.input[0] for n in fused.model.graph.node if n.op_type == "GroupQueryAttention"}
    qkv = [n for n in fused.model.graph.node if n.op_type == "Linear" and n.output[0] in gqa_queries]
    assert len(qkv) == 2
    for node in qkv:
        pairs = next(helper.get_attribute_value(a) for a in node.attribute if a.name == "qkv_pairs")
        assert list(pairs) == [2, 1, 64, 32]
        if not bits:  # the weight's rows are the plain load's in the order
            name = node.input[1]
            original = plain.params[name.replace(".qkv_pairs", "")]
            order = jax_onnx_attn.ops.rotary_pair_order(*pairs)
            np.testing.assert_array_equal(np.asarray(fused.params[name]), np.asarray(original)[order])
    _assert_same_bits(fused, plain)  # the Linear puts its output back


def test_qkv_prepare_leaves_what_the_fused_route_cannot_take():
    model = build_tiny_decoder(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=96, dtype="f16")
    for node in model.graph.node:  # interleaved rotary: pairs are neighbours, no reordering needed
        if node.op_type == "GroupQueryAttention":
            kept = [a for a in node.attribute if a.name != "rotary_interleaved"]
            del node.attribute[:]
            node.attribute.extend(kept + [helper.make_attribute("rotary_interleaved", 1)])
    assert jax_onnx_attn.load(model, qkv_prepare=True).fusions.qkv_pairs == 0
    model = build_tiny_decoder(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=96, dtype="f16")
    assert jax_onnx_attn.load(model, qkv_prepare=True, dense_layout="kn").fusions.qkv_pairs == 0


def test_tensor_parallel_plan_refuses_packed_qkv_in_the_rotary_pair_order():
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel

    model = build_tiny_decoder(layers=1, hidden=128, heads=2, kv_heads=2, intermediate=96, dtype="f32")
    assert plan_tensor_parallel(jax_onnx_attn.load(model), 2).pieces == 2
    with pytest.raises(ValueError, match="rotary-pair order"):
        plan_tensor_parallel(jax_onnx_attn.load(model, qkv_prepare=True), 2)


def test_sessions_of_one_row_reorder_qkv_under_the_switch_and_generate_the_same_tokens(monkeypatch):
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime.session import qkv_prepare_for

    session_switch.check_load_switch(monkeypatch, cuda_matmul.QKV_PREPARE_ENV, qkv_prepare_for, "qkv_pairs", "on")


def test_a_query_given_with_its_projection_gives_the_same_results():
    # ops.QkvProjection (onnx.fusion's qkv_prepare): the op may compute the packed query from the
    # projection on the CUDA decode route of one row; every other route (here the CPU's reference)
    # reads `query`, which is the projection's output put back in order. A decode step of one row on
    # a shared buffer, with and without the projection: the same outputs, the same cache.
    import jax.numpy as jnp

    from jax_onnx_attn import ops

    n, hkv, d, half, k, cap = 4, 2, 64, 32, 128, 16
    rng = np.random.default_rng(0)
    order = ops.rotary_pair_order(n, hkv, d, half)
    x = rng.standard_normal((1, 1, k)).astype(np.float32)
    w = ops.to_rotary_pair_order((rng.standard_normal(((n + 2 * hkv) * d, k)) / 16).astype(np.float32), order)
    query = ops.from_rotary_pair_order(jnp.asarray(x) @ jnp.asarray(w).T, order)
    ang = rng.uniform(0, 6.28, (cap, half))
    common = dict(past_key=jnp.asarray(rng.standard_normal((1, hkv, cap, d)), jnp.float32),
                  past_value=jnp.asarray(rng.standard_normal((1, hkv, cap, d)), jnp.float32),
                  seqlens_k=jnp.asarray([6], jnp.int32), total_sequence_length=cap,
                  cos_cache=jnp.asarray(np.cos(ang), jnp.float32), sin_cache=jnp.asarray(np.sin(ang), jnp.float32),
                  num_heads=n, kv_num_heads=hkv, do_rotary=1, shared_buffer=True)
    projection = ops.QkvProjection(jnp.asarray(x), jnp.asarray(w), None, None, 1e-6, 16, 0, half)
    plain = ops.group_query_attention(query, **common)
    given = ops.group_query_attention(query, **common, query_projection=projection)
    for name, a, b in zip(plain._fields, plain, given):
        if a is not None:
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=name)


@pytest.mark.parametrize("bits", [0, 4])
def test_a_batch_one_step_takes_the_fused_call_where_the_kernels_run(monkeypatch, bits):
    # The step a batch-1 session runs, on the CUDA routes with every kernel swapped for its spec
    # (tests/kernel_specs.py): loaded with qkv_prepare, each layer calls linear_gqa_prepare instead
    # of gqa_prepare (the projection's own call is then unread: XLA drops it on the GPU), and the
    # step's logits and cache are those of the plain load.
    import jax
    import jax.numpy as jnp
    from collections import Counter

    from kernel_specs import use_specs

    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig
    from jax_onnx_attn.ops import backend

    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)  # the specs run on the CPU
    calls = use_specs(monkeypatch)
    model = build_decoder(DecoderConfig(layers=2, hidden=512, heads=8, kv_heads=2, intermediate=1024,
                                        vocab=512, dtype="float16", weight_bits=bits, block_size=32))
    layout = {"nbits_layout": "record"} if bits else {}
    results = {}
    for qkv in (False, True):
        lowered = jax_onnx_attn.load(model, qkv_prepare=qkv, **layout)
        step = lowered.fixed_cache_step(1, 32)
        cache = step.init_cache(lowered.params)
        feeds = (jnp.asarray([[7]], jnp.int32), jnp.asarray([5], jnp.int32), jnp.asarray([1], jnp.int32))
        del calls[:]
        results[qkv] = jax.jit(step)(lowered.params, *feeds, cache)
        results[qkv, "calls"] = Counter(c[0] for c in calls)
    plain, fused = results[False, "calls"], results[True, "calls"]
    assert plain["gqa_prepare"] == 2 and "linear_gqa_prepare" not in plain, plain
    assert fused["linear_gqa_prepare"] == 2 and "gqa_prepare" not in fused, fused
    for got, want in zip(jax.tree.leaves(results[True]), jax.tree.leaves(results[False])):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_gated_mlp_fuses_gate_up_and_down_into_one_node_and_keeps_the_results(dtype):
    # Pass 4b: each layer's norm + SwiGLU Linear and its down projection (with the residual) become
    # one GatedMlp. Off the kernel (here: CPU) it computes the two Linears' calls: the same bits.
    model = build_tiny_decoder(layers=3, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype=dtype)
    fused = jax_onnx_attn.load(model, gated_mlp=True)
    plain = jax_onnx_attn.load(model)
    assert fused.fusions.gated_mlp == 3 and plain.fusions.gated_mlp == 0
    ops = collections.Counter(n.op_type for n in fused.model.graph.node)
    assert ops["GatedMlp"] == 3 and ops["Linear"] == 2 * 3 + 1
    for node in (n for n in fused.model.graph.node if n.op_type == "GatedMlp"):
        x, w_gu, w_down, residual, norm = node.input
        assert fused.params[w_gu].shape == (2 * 96, 64) and fused.params[w_down].shape == (64, 96)
        assert residual and norm and node.domain == JOA_DOMAIN
    _assert_same_bits(fused, plain)


def test_gated_mlp_leaves_what_it_cannot_fuse():
    model = build_tiny_decoder(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype="f16")
    # dense_layout "kn" (sessions of 2+ rows): XLA's GEMM reads the weights, nothing to fuse for.
    assert jax_onnx_attn.load(model, gated_mlp=True, dense_layout="kn").fusions.gated_mlp == 0
    # 4-bit weights: the fused kernel streams dense ones only.
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig

    quant = build_decoder(DecoderConfig(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=128,
                                        dtype="float16", weight_bits=4, block_size=32))
    assert jax_onnx_attn.load(quant, gated_mlp=True).fusions.gated_mlp == 0
    # The gated output a graph output, not read by a down projection alone: no fusion.
    model = _mlp_model(output_intermediate=False)
    assert jax_onnx_attn.load(model, gated_mlp=True).fusions.gated_mlp == 0


def test_tensor_parallel_plan_refuses_fused_gated_mlps():
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel

    model = build_tiny_decoder(layers=1, hidden=128, heads=2, kv_heads=2, intermediate=96, dtype="f32")
    with pytest.raises(ValueError, match="gated_mlp"):
        plan_tensor_parallel(jax_onnx_attn.load(model, gated_mlp=True), 2)


def test_sessions_of_one_row_fuse_the_mlp_under_the_switch_and_generate_the_same_tokens(monkeypatch):
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime.session import gated_mlp_for

    session_switch.check_load_switch(monkeypatch, cuda_matmul.GATED_MLP_ENV, gated_mlp_for, "gated_mlp")



@pytest.mark.parametrize("dtype", ["f32", "f16"])
def test_out_mlp_is_one_node_a_layer_with_the_same_bits(dtype):
    # Pass 4c: each layer's o projection (its residual fused) and the GatedMlp it alone feeds (as
    # input and residual) become one OutMlp; off the kernel its route is those two calls, so the
    # step is the GatedMlp load's bit for bit.
    model = build_tiny_decoder(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=96, dtype=dtype)
    mlp = jax_onnx_attn.load(model, gated_mlp=True)
    both = jax_onnx_attn.load(model, gated_mlp=True, out_mlp=True)
    assert mlp.fusions.out_mlp == 0 and both.fusions.gated_mlp == 2 and both.fusions.out_mlp == 2
    ops = collections.Counter(n.op_type for n in both.model.graph.node)
    assert ops["OutMlp"] == 2 and ops["GatedMlp"] == 0
    assert ops["Linear"] == collections.Counter(n.op_type for n in mlp.model.graph.node)["Linear"] - 2
    assert jax_onnx_attn.load(model, out_mlp=True).fusions.out_mlp == 0  # it takes GatedMlp nodes
    _assert_same_bits(both, mlp)
