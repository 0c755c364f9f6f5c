"""The embedded tiny decoder: builder-shaped graph, runs in onnxruntime CPU, and our lowering of it
gives onnxruntime's logits."""

from __future__ import annotations

import numpy as np
import pytest

from jax_onnx_attn.models import tiny
from jax_onnx_attn.runtime import OrtDecoder
from jax_onnx_attn.testing import assert_close

try:
    from jax_onnx_attn.onnx import load
except ImportError:  # the lowering is not in this tree yet
    load = None


def _feeds(config: tiny.TinyConfig, rows: list[list[int]]) -> dict[str, np.ndarray]:
    """A right-padded first-prompt feed (empty past) in the builder's I/O names."""
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


ROWS = [tiny.encode("Hello, JAX!"), tiny.encode("abc")]


def _run_ort(model, feed):
    ort = pytest.importorskip("onnxruntime")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    names = [o.name for o in session.get_outputs()]
    return dict(zip(names, session.run(names, feed)))


def test_graph_is_builder_shaped():
    config = tiny.TinyConfig(layers=3)
    model = tiny.build_tiny_decoder(config)
    opsets = {o.domain: o.version for o in model.opset_import}
    assert opsets == {"": 22, "com.microsoft": 1}
    ops = {(n.domain, n.op_type) for n in model.graph.node}
    assert {("", "Gather"), ("", "SimplifiedLayerNormalization"), ("", "MatMul"),
            ("com.microsoft", "GroupQueryAttention"), ("com.microsoft", "SkipSimplifiedLayerNormalization"),
            ("", "Sigmoid"), ("", "Mul"), ("", "ReduceSum"), ("", "Shape"), ("", "Cast")} <= ops
    inputs = [i.name for i in model.graph.input]
    outputs = [o.name for o in model.graph.output]
    assert inputs[:2] == ["input_ids", "attention_mask"]
    # The builder's order: every layer's key, then every layer's value.
    assert inputs[2:] == [f"past_key_values.{i}.{kv}" for kv in ("key", "value") for i in range(3)]
    assert outputs == ["logits"] + [f"present.{i}.{kv}" for kv in ("key", "value") for i in range(3)]
    gqa = [n for n in model.graph.node if n.op_type == "GroupQueryAttention"]
    assert len(gqa) == 3
    attrs = {a.name: a for a in gqa[0].attribute}
    assert (attrs["num_heads"].i, attrs["kv_num_heads"].i, attrs["do_rotary"].i) == (4, 2, 1)
    # packed QKV: key and value inputs empty; cos/sin caches [max_positions, head_size / 2]
    assert list(gqa[0].input[1:3]) == ["", ""] and list(gqa[0].input[7:9]) == ["cos_cache", "sin_cache"]
    inits = {t.name: t for t in model.graph.initializer}
    assert list(inits["cos_cache"].dims) == [config.max_positions, config.head_size // 2]


def test_weights_come_from_the_seed():
    a, b = tiny.tiny_weights(tiny.TinyConfig(seed=3)), tiny.tiny_weights(tiny.TinyConfig(seed=3))
    c = tiny.tiny_weights(tiny.TinyConfig(seed=4))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert not np.array_equal(a["lm_head.MatMul.weight"], c["lm_head.MatMul.weight"])
    assert a["model.embed_tokens.weight"].dtype == np.float32
    assert tiny.tiny_weights(tiny.TinyConfig(dtype="f16"))["cos_cache"].dtype == np.float16


@pytest.mark.parametrize("bad", [dict(hidden=48, heads=4), dict(heads=4, kv_heads=3), dict(dtype="int8"),
                                 dict(vocab=300)])
def test_config_validation(bad):
    with pytest.raises(ValueError):
        tiny.TinyConfig(**bad)


def test_byte_tokenizer():
    text = "Grüße, JAX!\n"
    assert tiny.decode(tiny.encode(text)) == text
    assert tiny.encode("A") == [65]
    assert tiny.decode([0xFF]) == "\ufffd"


@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_runs_in_onnxruntime(dtype):
    """Right-padded batch of 2 in onnxruntime CPU: shapes, dtypes, finite, printable predictions."""
    config = tiny.TinyConfig(dtype=dtype)
    out = _run_ort(tiny.build_tiny_decoder(config), _feeds(config, ROWS))
    logits = out["logits"]
    assert logits.shape == (2, len(ROWS[0]), 256) and logits.dtype == config.np_dtype
    assert out["present.1.value"].shape == (2, config.kv_heads, len(ROWS[0]), config.head_size)
    assert np.isfinite(logits).all()
    # The LM head's columns outside printable ASCII are zero, so those logits are exactly 0.
    assert np.all(logits[..., ~tiny.printable_ids()] == 0)
    assert tiny.printable_ids()[logits.argmax(-1)].all()


def test_onnxruntime_decode_agrees_with_prefill():
    """The cos/sin, seqlens_k and total_sequence_length wiring holds across cached decode steps:
    onnxruntime's logits from one prefill equal those from prefill + one-token steps."""
    ort = OrtDecoder(tiny.build_tiny_decoder())
    sequence = ROWS[0] + tiny.encode(" more tokens")
    assert_close(ort.logits(sequence, len(ROWS[0])), ort.logits(sequence, len(sequence)), np.float32)


@pytest.mark.skipif(load is None, reason="the ONNX lowering (jax_onnx_attn.onnx.load) is not in this tree yet")
@pytest.mark.parametrize("dtype", ["float32", "float16"])
def test_lowering_matches_onnxruntime(dtype):
    """jax_onnx_attn.load(model).apply gives onnxruntime's logits and presents on a right-padded
    first prompt (padded positions excluded: their values are unspecified)."""
    config = tiny.TinyConfig(dtype=dtype)
    model = tiny.build_tiny_decoder(config)
    feed = _feeds(config, ROWS)
    expected = _run_ort(model, feed)
    lowered = load(model)
    got = lowered.apply(lowered.params, feed)
    for r, p in enumerate(ROWS):
        n = len(p)
        want, have = expected["logits"][r, :n], np.asarray(got["logits"][r, :n])
        if config.dtype == "float16":
            # Two layers of f16 rounding, placed differently by onnxruntime and XLA, leave logits of
            # |x| ~ 10 apart by a few f16 ulps of that size: compare relative to the logits' range.
            scale = np.abs(want.astype(np.float32)).max()
            want, have = want / scale, have / scale
            assert np.array_equal(have.argmax(-1), want.argmax(-1))
        assert_close(have, want, config.np_dtype)
        for name in ("present.0.key", "present.1.value"):
            assert_close(np.asarray(got[name])[r, :, :n], expected[name][r, :, :n], config.np_dtype)
