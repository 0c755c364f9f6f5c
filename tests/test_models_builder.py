"""jax_onnx_attn.models: builder-shaped decoders of any size, dtype and weight format.

Oracles: the real onnxruntime-genai builder exports in tests/fixtures/builder_llama_* (graph structure,
and their int4 / int8 weights byte for byte from the fp32 fixture's weights), onnxruntime's own
MatMulNBits quantiser (packing byte for byte), onnxruntime CPU running each variant (logits of our
lowering within testing.py's tolerances; bf16 against onnxruntime's float32 run of the same weights).
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import jax_onnx_attn
from jax_onnx_attn.models import (DecoderConfig, build_decoder, ensure_model, preset, quantize_nbits,
                                  save_decoder)
from jax_onnx_attn.models import builder as builder_mod
from jax_onnx_attn.models.quant import dequantize_nbits, quantize_blocks
from jax_onnx_attn.models.weights import WeightMaker, make_weights
from jax_onnx_attn.testing import assert_close

ort = pytest.importorskip("onnxruntime")
FIXTURES = Path(__file__).parent / "fixtures"
#: The fixtures' model (tools/make_fixtures.py COMMON) as a DecoderConfig.
FIXTURE_SHAPE = dict(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=320,
                     max_positions=256, rms_eps=1e-5)


def _signature(model: onnx.ModelProto):
    nodes = [(n.op_type, n.domain, n.name, tuple(n.input), tuple(n.output),
              tuple(sorted((a.name, str(helper.get_attribute_value(a))) for a in n.attribute)))
             for n in model.graph.node]
    inits = sorted((t.name, tuple(t.dims), t.data_type) for t in model.graph.initializer)
    io = [(v.name, str(v.type)) for v in list(model.graph.input) + list(model.graph.output)]
    return nodes, inits, io, [(o.domain, o.version) for o in model.opset_import], model.ir_version


@pytest.mark.parametrize("fixture, overrides", [
    ("builder_llama_fp32", dict(dtype="float32")), ("builder_llama_fp16", dict(dtype="float16")),
    ("builder_llama_int4", dict(dtype="float32", weight_bits=4)),
    ("builder_llama_int8", dict(dtype="float32", weight_bits=8))])
def test_graph_is_the_builders_node_for_node(fixture, overrides):
    """Nodes (op, domain, name, inputs, outputs, attributes), initializer names / shapes / types,
    graph inputs and outputs, opsets and IR version all equal the real builder export's."""
    ref = onnx.load(str(FIXTURES / fixture / "model.onnx"), load_external_data=False)
    ours = build_decoder(DecoderConfig(**FIXTURE_SHAPE, **overrides))
    for got, want in zip(_signature(ours), _signature(ref)):
        assert got == want


def _fixture_inits(name):
    m = onnx.load(str(FIXTURES / name / "model.onnx"))
    return {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}


@pytest.mark.parametrize("bits", [4, 8])
def test_quantiser_reproduces_the_builders_weights(bits):
    """The fp32 fixture's weights, quantised here, are the int4 / int8 fixture's bytes (same
    checkpoint through the builder)."""
    dense, quant = _fixture_inits("builder_llama_fp32"), _fixture_inits(f"builder_llama_int{bits}")
    names = [n for n in dense if n.endswith("MatMul.weight")]
    assert len(names) == 11
    for name in names:
        q = quantize_nbits(dense[name], bits, 32)
        assert np.array_equal(q.packed, quant[f"{name}_Q{bits}"]), name
        assert np.array_equal(q.scales, quant[f"{name}_scales"]), name
        assert q.zero_points is None


def _ort_quantise(w, bits, block, symmetric):
    from onnxruntime.capi._pybind_state import quantize_matmul_4bits, quantize_matmul_8bits
    k, n = w.shape
    kb = -(-k // block)
    packed = np.zeros((n, kb, block * bits // 8), np.uint8)
    scales = np.zeros((n, kb), w.dtype)
    zp = np.zeros((n, -(-kb * bits // 8)), np.uint8)
    fn = quantize_matmul_4bits if bits == 4 else quantize_matmul_8bits
    fn(packed, np.ascontiguousarray(w), scales, zp, block, n, k, symmetric)
    return packed, scales, zp


@pytest.mark.parametrize("dtype, bits, block, symmetric", list(itertools.product(
    [np.float32, np.float16], [4, 8], [32, 128], [True, False])))
def test_quantiser_matches_onnxruntime(dtype, bits, block, symmetric):
    """Byte for byte with onnxruntime's MLAS quantiser, K a multiple of the block or not, with zero
    columns, constant runs and a wide range of magnitudes."""
    rng = np.random.default_rng(bits * block)
    for k in (256, 96, 300):
        w = (rng.standard_normal((k, 24)) * rng.uniform(0.01, 3.0, 24)).astype(dtype)
        w[:, 0] = 0
        w[5:40, 1] = 0.5
        packed, scales, zp = _ort_quantise(w, bits, block, symmetric)
        q = quantize_nbits(w, bits, block, symmetric)
        assert np.array_equal(q.packed, packed), (k, "packed")
        assert np.array_equal(q.scales, scales), (k, "scales")
        if not symmetric:
            assert np.array_equal(q.zero_points, zp), (k, "zero points")
        # and the dequantised weight is within a quantisation step of the original
        w_hat = dequantize_nbits(q, k, bits, block)
        step = np.abs(q.scales.astype(np.float32)).max()
        assert np.abs(w_hat - w.astype(np.float32)).max() <= step * (1.0 if symmetric else 0.51) + 1e-3


def test_quantiser_bfloat16_scales_come_from_a_float32_quantisation():
    w = np.random.default_rng(0).standard_normal((64, 8)).astype(ml_dtypes.bfloat16)
    q = quantize_nbits(w, 4, 32)
    q32 = quantize_nbits(w.astype(np.float32), 4, 32)
    assert q.scales.dtype == ml_dtypes.bfloat16
    assert np.array_equal(q.packed, q32.packed)
    assert np.array_equal(q.scales, q32.scales.astype(ml_dtypes.bfloat16))


def test_pooled_quantised_weights_are_the_quantisation_of_their_source():
    """The fast path (a quantised pool laid out block-window by block-window) gives exactly what the
    quantiser makes of the float source those windows describe."""
    for bits, block, zp in ((4, 32, False), (8, 128, True)):
        config = preset("tiny", weight_bits=bits, block_size=block, zero_points=zp, vocab=512)
        maker = WeightMaker(config)
        for name, (k, n) in list(config.linear_shapes().items())[:3] + [("lm_head.MatMul.weight",
                                                                         config.linear_shapes()["lm_head.MatMul.weight"])]:
            std = maker.linear_std(name, k)
            got = maker.quantized(name, k, n, std)
            want = quantize_nbits(maker.quantized_source(name, k, n, std).T, bits, block, not zp)
            assert np.array_equal(got.packed, want.packed) and np.array_equal(got.scales, want.scales)
            if zp:
                assert np.array_equal(got.zero_points, want.zero_points)


def test_weights_are_seeded_real_data():
    config = preset("tiny", dtype="float32")
    a, b = make_weights(config), make_weights(config)
    c = make_weights(config.replace(seed=1))
    assert list(a) == list(b) and all(np.array_equal(a[k], b[k]) for k in a)
    assert all(not np.array_equal(a[k], c[k]) for k in a if k not in ("cos_cache", "sin_cache"))
    for name, w in a.items():
        assert np.count_nonzero(w) > 0.9 * w.size, name  # never zeros
    # statistics of the pools: projections N(0, 1/K), norms around 1
    qkv = a["model.layers.0.attn.qkv_proj.MatMul.weight"]
    assert abs(qkv.std() * np.sqrt(config.hidden) - 1) < 0.05
    assert abs(a["model.layers.0.input_layernorm.weight"].mean() - 1) < 0.05
    # different tensors are not copies of each other
    assert not np.array_equal(a["model.layers.0.mlp.gate_proj.MatMul.weight"],
                              a["model.layers.0.mlp.up_proj.MatMul.weight"])


def test_presets_sizes_without_making_them():
    one, eight = preset("llama-3.2-1b"), preset("8b")
    assert one.param_count() == 1_498_482_688  # Llama-3.2-1B (1.236 B) + its untied LM head
    assert eight.param_count() == 8_030_261_248  # Llama-3.1-8B
    assert (one.head_size, one.layers, one.vocab, one.rope_theta) == (64, 16, 128256, 500000.0)
    assert (eight.head_size, eight.intermediate, eight.max_positions) == (128, 14336, 131072)
    rotary = 2 * eight.max_positions * eight.head_size // 2 * 2
    assert eight.file_bytes() == 2 * eight.param_count() + rotary
    int4 = preset("8b", weight_bits=4)
    linear = sum(k * n for k, n in int4.linear_shapes().values())
    # packed nibbles + one fp16 scale per 32 weights; the embedding and norms stay fp16
    assert int4.file_bytes() == linear // 2 + linear // 32 * 2 + 2 * (eight.param_count() - linear) + rotary
    issue = preset("issue")
    assert round(issue.param_count() / 1e9, 2) == 0.73 and issue.byte_level


def test_in_memory_build_refuses_what_needs_external_data():
    with pytest.raises(ValueError, match="save_decoder"):
        build_decoder(preset("1b"))


@pytest.mark.parametrize("bad, match", [
    (dict(hidden=48, heads=4), "head_size 12"), (dict(heads=4, kv_heads=3), "kv_heads 3"),
    (dict(dtype="int8"), "int8"), (dict(weight_bits=3), "weight_bits"),
    (dict(weight_bits=4, block_size=48), "block_size"),
    (dict(weight_bits=4, block_size=128, hidden=64), "multiple of block_size 128"),
    (dict(vocab=300, printable=True), "printable")])
def test_config_errors_name_the_bad_input(bad, match):
    with pytest.raises(ValueError, match=match):
        DecoderConfig(**bad)
    with pytest.raises(ValueError, match="unknown preset 'llama-9'"):
        preset("llama-9")


# --------------------------------------------------------------------------------------------------
# Running the variants

def _feeds(config: DecoderConfig, rows):
    s = max(map(len, rows))
    ids = np.zeros((len(rows), s), np.int64)
    mask = np.zeros((len(rows), s), np.int64)
    for r, p in enumerate(rows):
        ids[r, :len(p)], mask[r, :len(p)] = p, 1
    feed = {"input_ids": ids, "attention_mask": mask}
    for i in range(config.layers):
        for kv in ("key", "value"):
            feed[f"past_key_values.{i}.{kv}"] = np.zeros((len(rows), config.kv_heads, 0, config.head_size),
                                                         config.np_dtype)
    return feed


def _as_level0(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every MatMulNBits at accuracy_level 0 (onnxruntime's exact dequantised product;
    level 4 quantises activations on CPU, a speed choice)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for node in model.graph.node:
        for a in list(node.attribute):
            if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                node.attribute.remove(a)
    return model


def _run_ort(model: onnx.ModelProto, feed):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, {k: v for k, v in feed.items()})))


def _float32_copy(model: onnx.ModelProto) -> onnx.ModelProto:
    """The model with every bfloat16 initializer and value converted to float32 (exactly)."""
    model = onnx.ModelProto.FromString(model.SerializeToString())
    for t in model.graph.initializer:
        if t.data_type == TensorProto.BFLOAT16:
            arr = np.frombuffer(t.raw_data, ml_dtypes.bfloat16).reshape(tuple(t.dims)).astype(np.float32)
            t.CopyFrom(numpy_helper.from_array(arr, t.name))
    for v in list(model.graph.input) + list(model.graph.output):
        if v.type.tensor_type.elem_type == TensorProto.BFLOAT16:
            v.type.tensor_type.elem_type = TensorProto.FLOAT
    return model


ROWS = [[5, 300, 17, 499, 42, 7, 256, 1], [3, 511, 88]]  # ids beyond the byte range


def _compare(config, got, want, rows):
    for r, p in enumerate(rows):
        n = len(p)
        have, exp = np.asarray(got["logits"][r, :n], np.float32), np.asarray(want["logits"][r, :n], np.float32)
        if config.dtype != "float32":
            # half-precision rounding, placed differently by onnxruntime and XLA: relative to the
            # logits' range; against an fp16 oracle also the same greedy choices (a bf16 model against
            # the float32 oracle can differ at near ties: bf16 keeps 8 bits)
            scale = np.abs(exp).max()
            have, exp = have / scale, exp / scale
            if want["logits"].dtype == config.np_dtype:
                assert np.array_equal(have.argmax(-1), exp.argmax(-1))
        assert_close(have, exp, config.np_dtype)
        for name in ("present.0.key", "present.1.value"):
            assert_close(np.asarray(got[name], np.float32)[r, :, :n],
                         np.asarray(want[name], np.float32)[r, :, :n], config.np_dtype)


VARIANTS = {
    "fp32": dict(dtype="float32"), "fp16": dict(dtype="float16"),
    "int4": dict(dtype="float32", weight_bits=4), "int4-fp16": dict(dtype="float16", weight_bits=4),
    "int8-b128": dict(dtype="float32", weight_bits=8, block_size=128),
    "int4-b128-zp": dict(dtype="float32", weight_bits=4, block_size=128, zero_points=True),
    "int8-zp-fp16": dict(dtype="float16", weight_bits=8, zero_points=True),
}


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_variant_runs_in_onnxruntime_and_our_lowering_matches(variant):
    config = preset("tiny", vocab=512, **VARIANTS[variant])
    model = build_decoder(config)
    if config.weight_bits:
        levels = {a.i for n in model.graph.node if n.op_type == "MatMulNBits"
                  for a in n.attribute if a.name == "accuracy_level"}
        assert levels == ({4} if config.dtype == "float32" else set())  # the builder's defaults
    feed = _feeds(config, ROWS)
    want = _run_ort(_as_level0(model), feed)
    assert want["logits"].shape == (2, len(ROWS[0]), 512)
    lowered = jax_onnx_attn.load(model)
    _compare(config, lowered.apply(lowered.params, feed), want, ROWS)


@pytest.mark.parametrize("weight_bits", [0, 4])
def test_bfloat16_matches_onnxruntime_float32_on_the_same_weights(weight_bits):
    """onnxruntime's CPU provider has no bfloat16 GroupQueryAttention: the oracle is its float32 run
    of the same (exactly converted) weights; ours computes in bfloat16."""
    config = preset("tiny", vocab=512, dtype="bfloat16", weight_bits=weight_bits)
    model = build_decoder(config)
    assert {t.data_type for t in model.graph.initializer} >= {TensorProto.BFLOAT16}
    feed = _feeds(config, ROWS)
    want = _run_ort(_as_level0(_float32_copy(model)),
                    {k: v.astype(np.float32) if v.dtype == ml_dtypes.bfloat16 else v for k, v in feed.items()})
    lowered = jax_onnx_attn.load(model)
    _compare(config, lowered.apply(lowered.params, feed), want, ROWS)


def test_external_data_round_trips(tmp_path):
    """save_decoder writes the builder's layout; onnx and onnxruntime read it back to the same
    tensors and logits as the in-memory model; large tensors start 64 KB-aligned."""
    config = preset("tiny", dtype="float32", vocab=4096)  # 2 MB embedding and LM head
    path = save_decoder(config, tmp_path / "m", progress=False)
    assert sorted(p.name for p in path.parent.iterdir()) == ["genai_config.json", "model.onnx",
                                                             "model.onnx.data"]
    assert path.stat().st_size < 100_000  # the graph only
    proto = onnx.load(str(path), load_external_data=False)
    offsets = {t.name: int({e.key: e.value for e in t.external_data}["offset"]) for t in proto.graph.initializer}
    assert offsets["lm_head.MatMul.weight"] % 65536 == 0
    loaded = onnx.load(str(path))
    expected = make_weights(config)
    for t in loaded.graph.initializer:
        assert np.array_equal(numpy_helper.to_array(t), expected[t.name]), t.name
    assert len(loaded.graph.initializer) == len(expected)
    genai = json.loads((path.parent / "genai_config.json").read_text())
    assert genai["model"]["decoder"]["head_size"] == config.head_size
    assert genai["model"]["vocab_size"] == 4096
    feed = _feeds(config, ROWS)
    session = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    got = dict(zip([o.name for o in session.get_outputs()], session.run(None, feed)))
    want = _run_ort(build_decoder(config), feed)
    assert np.array_equal(got["logits"], want["logits"])
    lowered = jax_onnx_attn.load(path)
    _compare(config, lowered.apply(lowered.params, feed), want, ROWS)


def test_ensure_model_reuses_a_matching_copy(tmp_path):
    config = preset("tiny", vocab=300)
    path, made = ensure_model(config, tmp_path)
    assert made > 0 and path.parent.name == builder_mod.model_dirname(config)
    again, made = ensure_model(config, tmp_path)
    assert again == path and made == 0.0
    # a field outside the folder's name: the stamp differs, so the model is made again
    changed, made = ensure_model(config.replace(rope_theta=5e5), tmp_path)
    assert changed == path and made > 0
    assert not list(tmp_path.glob("*.tmp*"))


def test_byte_level_models_keep_the_tiny_producer():
    assert build_decoder(preset("tiny", vocab=256)).producer_name == builder_mod.BYTE_PRODUCER
    assert build_decoder(preset("tiny")).producer_name == builder_mod.PRODUCER


def test_quantize_blocks_rejects_bad_input():
    with pytest.raises(ValueError, match="bits"):
        quantize_blocks(np.zeros((2, 32), np.float32), 3, 32)
    with pytest.raises(ValueError, match="2-D"):
        quantize_nbits(np.zeros(32, np.float32))
