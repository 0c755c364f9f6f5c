"""The error catalogue (docs/errors.md): loader, apply, device statuses and DecoderSession rows, one
test per row, plus the check that the docs table and the tests list the same rows.

The operators' rows are the cases of tests/test_attention_errors.py and tests/test_gqa_errors.py;
`python tools/error_catalogue.py` regenerates docs/errors.md from the three case lists (running each
case to record the message it raises).
"""

from __future__ import annotations

import functools
import re
from pathlib import Path

import jax
import ml_dtypes
import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

import jax_onnx_attn
from jax_onnx_attn.onnx import Static, UnsupportedOpsError
from jax_onnx_attn.ops import status
from ort_gqa import _model_bytes

DOCS = Path(__file__).resolve().parents[1] / "docs" / "errors.md"


def _model(nodes, inputs, outputs, opset=21, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, initializer=list(initializers))
    m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 10
    return m


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


def add_model():
    """y = x + x, x float32 [batch, 4]."""
    return _model([helper.make_node("Add", ["x", "x"], ["y"])], [_vi("x", TensorProto.FLOAT, ["b", 4])],
                  [_vi("y", TensorProto.FLOAT, ["b", 4])])


def two_input_model():
    """y = a + b, both float32 [batch, 4] (one symbolic dim, shared)."""
    return _model([helper.make_node("Add", ["a", "b"], ["y"])],
                  [_vi("a", TensorProto.FLOAT, ["batch", 4]), _vi("b", TensorProto.FLOAT, ["batch", 4])],
                  [_vi("y", TensorProto.FLOAT, ["batch", 4])])


def reshape_model():
    """y = Reshape(x, shape): `shape` is a graph input that sets a shape."""
    return _model([helper.make_node("Reshape", ["x", "shape"], ["y"])],
                  [_vi("x", TensorProto.FLOAT, [2, 3]), _vi("shape", TensorProto.INT64, [2])],
                  [_vi("y", TensorProto.FLOAT, None)])


def embedding_model(vocab=10):
    """logits = Gather(table, input_ids): the token embedding alone."""
    table = helper.make_tensor("table", TensorProto.FLOAT, [vocab, 4],
                               np.arange(vocab * 4, dtype=np.float32).tolist())
    return _model([helper.make_node("Gather", ["table", "input_ids"], ["logits"])],
                  [_vi("input_ids", TensorProto.INT64, ["b", "s"])],
                  [_vi("logits", TensorProto.FLOAT, ["b", "s", 4])], initializers=[table])


def gqa_model(total_len=9):
    """A single GroupQueryAttention node (decode on a past of 8 rows, non-shared present)."""
    sig = (("query", "float32", (2, 1, 64)), ("key", "float32", (2, 1, 32)),
           ("value", "float32", (2, 1, 32)), ("past_key", "float32", (2, 2, 8, 16)),
           ("past_value", "float32", (2, 2, 8, 16)), ("seqlens_k", "int32", (2,)),
           ("total_sequence_length", "int32", ()))
    return onnx.load_from_string(_model_bytes(sig, (("kv_num_heads", 2), ("num_heads", 4))))


def gqa_feeds(seqlens=(8, 3), total=9):
    rng = np.random.default_rng(0)
    f = lambda *s: rng.standard_normal(s).astype(np.float32)
    return dict(query=f(2, 1, 64), key=f(2, 1, 32), value=f(2, 1, 32), past_key=f(2, 2, 8, 16),
                past_value=f(2, 2, 8, 16), seqlens_k=np.array(seqlens, np.int32),
                total_sequence_length=np.array(total, np.int32))


def _load_file(tmp_path, content: bytes):
    path = tmp_path / "model.onnx"
    path.write_bytes(content)
    return jax_onnx_attn.load(path)


def _apply(model, feeds):
    lw = jax_onnx_attn.load(model)
    return lw.apply(lw.params, feeds)


def _checked(model, feeds):
    lw = jax_onnx_attn.load(model)
    return lw.checked_apply(lw.params, feeds)


@functools.lru_cache(maxsize=1)
def _session():
    """A session of the embedded tiny decoder (every row's check runs before any compile)."""
    from jax_onnx_attn.models.tiny import build_tiny_decoder
    from jax_onnx_attn.runtime import DecoderSession
    return DecoderSession(build_tiny_decoder(), max_length=16)


def _cli(*argv):
    """Run the CLI; raise SystemExit with its stderr when it exits with an error status."""
    import contextlib
    import io

    from jax_onnx_attn import cli
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        rc = cli.main(list(argv), out=io.StringIO())
    if rc:
        raise SystemExit(err.getvalue().strip())


FIXTURE = Path(__file__).resolve().parent / "fixtures" / "builder_llama_fp32" / "model.onnx"


def _dup_output():
    m = add_model()
    m.graph.output.append(m.graph.output[0])
    return m


def _produced_twice():
    m = add_model()
    m.graph.node.append(helper.make_node("Mul", ["x", "x"], ["y"]))
    return m


def _unsorted():
    m = _model([helper.make_node("Relu", ["t"], ["y"]), helper.make_node("Neg", ["x"], ["t"])],
               [_vi("x", TensorProto.FLOAT, [4])], [_vi("y", TensorProto.FLOAT, [4])])
    return m


# (row id, callable(tmp_path) raising, exception type, message regex)
CASES = [
    # ---- load: the file and the graph ----
    ("load-missing-file", lambda t: jax_onnx_attn.load(t / "nope.onnx"), FileNotFoundError,
     "no model at .*nope.onnx: expected an .onnx file or a folder holding one"),
    ("load-empty-file", lambda t: _load_file(t, b""), ValueError, r"is empty \(0 bytes\)"),
    ("load-truncated-file", lambda t: _load_file(t, add_model().SerializeToString()[:-7]),
     ValueError, "model.onnx' is not a readable ONNX model"),
    ("load-corrupt-file", lambda t: _load_file(t, b"\xff\x00garbage" * 9), ValueError,
     "is not a readable ONNX model"),
    ("load-not-a-model", lambda t: jax_onnx_attn.load(42), TypeError,
     "expected a path or an onnx.ModelProto"),
    ("load-no-outputs", lambda t: jax_onnx_attn.load(onnx.ModelProto()), ValueError,
     "has no outputs"),
    ("load-duplicate-output", lambda t: jax_onnx_attn.load(_dup_output()), ValueError,
     r"graph output name\(s\) \['y'\] appear more than once"),
    ("load-value-produced-twice", lambda t: jax_onnx_attn.load(_produced_twice()), ValueError,
     "outputs 'y', which node .* already defines"),
    ("load-too-many-inputs", lambda t: jax_onnx_attn.load(_model(
        [helper.make_node("Relu", ["x", "x"], ["y"])], [_vi("x", TensorProto.FLOAT, [4])],
        [_vi("y", TensorProto.FLOAT, [4])])), ValueError, "has 2 inputs; Relu-14 takes 1 to 1"),
    ("load-too-few-inputs", lambda t: jax_onnx_attn.load(_model(
        [helper.make_node("Add", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [4])],
        [_vi("y", TensorProto.FLOAT, [4])])), ValueError, "has 1 inputs; Add-14 takes 2 to 2"),
    ("load-unsupported-op", lambda t: jax_onnx_attn.load(_model(
        [helper.make_node("Hardmax", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [4])],
        [_vi("y", TensorProto.FLOAT, [4])])), UnsupportedOpsError, "Hardmax"),
    ("apply-unsorted-graph", lambda t: _apply(_unsorted(), {"x": np.zeros(4, np.float32)}),
     ValueError, "reads 't', which is not computed before it"),
    # ---- apply: the feeds ----
    ("apply-missing-input", lambda t: _apply(add_model(), {}), ValueError,
     r"inputs missing \['x'\]"),
    ("apply-unknown-input", lambda t: _apply(add_model(), {"x": np.zeros((1, 4), np.float32),
                                                           "z": 1}), ValueError, r"unknown \['z'\]"),
    ("apply-float64-for-float32", lambda t: _apply(add_model(), {"x": np.zeros((1, 4))}),
     TypeError, "input 'x' has dtype float64, but the model declares float32"),
    ("apply-float-token-ids", lambda t: _apply(embedding_model(), {"input_ids": np.ones((1, 2))}),
     TypeError, "input 'input_ids' has dtype float64, but the model declares int64"),
    ("apply-rank", lambda t: _apply(add_model(), {"x": np.zeros(4, np.float32)}), ValueError,
     r"input 'x' has shape \[4\] \(rank 1\), but the model declares rank 2"),
    ("apply-fixed-dim", lambda t: _apply(add_model(), {"x": np.zeros((1, 5), np.float32)}),
     ValueError, "declares dim 1 = 4"),
    ("apply-symbolic-dim", lambda t: _apply(two_input_model(), {
        "a": np.zeros((1, 4), np.float32), "b": np.zeros((2, 4), np.float32)}), ValueError,
     "input 'b' dim 0 \\('batch'\\) is 2, but input 'a' has 'batch' = 1"),
    ("apply-shape-input-traced", lambda t: jax.jit(jax_onnx_attn.load(reshape_model()).apply)(
        {}, {"x": np.zeros((2, 3), np.float32), "shape": np.array([3, 2])}), TypeError,
     r"input 'shape' sets a shape .*pass it as\s+jax_onnx_attn.onnx.Static"),
    ("apply-dtype-jax-lacks", lambda t: _apply(_model(
        [helper.make_node("Identity", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT6E2M3, [2])],
        [_vi("y", TensorProto.FLOAT6E2M3, [2])]) if hasattr(TensorProto, "FLOAT6E2M3") else None,
        {"x": np.zeros(2, ml_dtypes.float6_e2m3fn)}), TypeError,
     "input 'x' has dtype float6_e2m3fn, which jax cannot hold"),
    ("apply-static-gather-index", lambda t: _apply(_model(
        [helper.make_node("Constant", [], ["i"], value=helper.make_tensor("i", TensorProto.INT64, [1], [7])),
         helper.make_node("Gather", ["c", "i"], ["y"])], [], [_vi("y", TensorProto.FLOAT, [1])],
        initializers=[helper.make_tensor("c", TensorProto.INT64, [3], [1, 2, 3])]), {}),
     IndexError, r"indices \[7\] are outside \[-3, 3\)"),
    # ---- device statuses through apply (checked_apply raises; apply_with_status flags) ----
    ("status-token-id-out-of-vocab", lambda t: _checked(embedding_model(), {
        "input_ids": np.array([[1, 10]], np.int64)}), RuntimeError,
     "Gather 'logits': index out of range"),
    ("status-negative-token-id-out-of-vocab", lambda t: _checked(embedding_model(), {
        "input_ids": np.array([[-11, 1]], np.int64)}), RuntimeError, "index out of range"),
    ("status-gqa-seqlens-beyond-cache", lambda t: _checked(gqa_model(), gqa_feeds((8, 30))),
     RuntimeError, "GroupQueryAttention 'output': batch 1: KV write out of range"),
    ("apply-int64-for-int32", lambda t: _checked(gqa_model(), dict(
        gqa_feeds(), seqlens_k=np.array([3, 2 ** 33 + 4], np.int64))), TypeError,
     "input 'seqlens_k' has dtype int64, but the model declares int32"),
    ("status-gqa-seqlens-int64-out-of-range", lambda t: status.check(
        jax_onnx_attn.ops.group_query_attention(
            **dict(gqa_feeds(), seqlens_k=np.array([3, 2 ** 33 + 4], np.int64)),
            num_heads=4, kv_num_heads=2).status), RuntimeError,
     "batch 1: KV write out of range"),
    ("status-gqa-traced-total-invalid", lambda t: _checked(gqa_model(), gqa_feeds(total=10)),
     RuntimeError, "total_sequence_length out of range"),
    # ---- DecoderSession ----
    ("session-float-token", lambda t: _session().generate([[1, 2.5]], 1), TypeError,
     "prompt 0: token 1 is 2.5 .*token ids are integers"),
    ("session-token-beyond-vocab", lambda t: (lambda s: s.generate([[1, s.vocab_size]], 1))(
        _session()), ValueError, "prompt 0: token 1 is .*outside the model's vocabulary"),
    ("session-negative-token", lambda t: _session().generate([[-1]], 1), ValueError,
     "prompt 0: token 0 is -1, outside the model's vocabulary"),
    ("session-empty-prompt", lambda t: _session().generate([[]], 1), ValueError,
     "prompt 0 is empty"),
    ("session-prompt-too-long", lambda t: _session().generate([list(range(16))], 1), ValueError,
     "leaves no room in max_length"),
    ("session-no-prompts", lambda t: _session().generate([], 1), ValueError,
     "needs at least one prompt"),
    ("session-negative-max-new", lambda t: _session().generate([[1]], -1), ValueError,
     "max_new_tokens must be >= 0"),
    ("session-max-length", lambda t: __import__("jax_onnx_attn.runtime").runtime.DecoderSession(
        add_model(), max_length=1), ValueError, "max_length must be >= 2"),
    ("session-max-length-beyond-positions", lambda t: __import__("jax_onnx_attn.runtime").runtime
     .DecoderSession(__import__("jax_onnx_attn.models").models.build_tiny_decoder(max_positions=32),
                     max_length=40), ValueError,
     "max_length 40 exceeds the 32 positions the model supports"),
    ("session-logits-float-token", lambda t: _session().logits([1, 2.0], 1), TypeError,
     "sequence: token 1 is 2.0"),
    ("cli-token-beyond-vocab", lambda t: _cli("generate", str(FIXTURE), "--ids", "1,320",
                                              "--max-new-tokens", "1", "--no-progress"),
     SystemExit, "token id 320 is outside the model's vocabulary of 320"),
    ("cli-float-token", lambda t: _cli("generate", str(FIXTURE), "--ids", "1,2.5",
                                       "--max-new-tokens", "1", "--no-progress"),
     SystemExit, "argument --ids: expected comma-separated token ids"),
    # ---- backends ----
    ("backend-cuda-without-kernels-or-gpu", lambda t: jax_onnx_attn.ops.attention(
        *[np.zeros((1, 1, 1, 64), np.float16)] * 3, backend="cuda")
        if jax_onnx_attn.ops.backend.no_cuda_device() else pytest.skip("a GPU is here"),
     NotImplementedError, "backend='cuda' is not available for this call"),
]


@pytest.mark.parametrize("make,exc,match", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_catalogue_row(tmp_path, make, exc, match):
    with pytest.raises(exc, match=match):
        make(tmp_path)


def test_statuses_are_zero_for_valid_inputs_and_flag_bad_ones():
    """apply_with_status (jittable) returns the statuses the checked rows raise on."""
    from jax_onnx_attn.ops import status as st
    lw = jax_onnx_attn.load(embedding_model())
    out, stat = jax.jit(lw.apply_with_status)(lw.params, {"input_ids": np.array([[1, 9]], np.int64)})
    assert st.describe(stat) == []
    out, stat = jax.jit(lw.apply_with_status)(lw.params, {"input_ids": np.array([[1, 10]], np.int64)})
    assert st.describe(stat) == ["Gather 'logits': index out of range (clamped by the gather)"]
    lw = jax_onnx_attn.load(gqa_model())
    _, stat = jax.jit(lw.apply_with_status)(lw.params, gqa_feeds())
    assert st.describe(stat) == []
    # total_sequence_length traced under jit: derived, checked on the device.
    _, stat = jax.jit(lw.apply_with_status)(lw.params, gqa_feeds(total=10))
    assert "total_sequence_length out of range" in "; ".join(st.describe(stat))


def test_static_shape_input_under_jit_with_static():
    lw = jax_onnx_attn.load(reshape_model())
    assert list(lw.static_inputs) == ["shape"]
    x = np.arange(6, dtype=np.float32).reshape(2, 3)
    want = x.reshape(3, 2)
    got = jax.jit(lw.apply)(lw.params, {"x": x, "shape": Static(np.array([3, 2]))})["y"]
    np.testing.assert_array_equal(np.asarray(got), want)
    got = lw.jit()(lw.params, {"x": x, "shape": np.array([6, 1])})["y"]
    np.testing.assert_array_equal(np.asarray(got), x.reshape(6, 1))


# ---- the docs table ----

def _doc_rows() -> dict[str, list[str]]:
    """{section: [row ids]} from docs/errors.md (rows are `| \\`id\\` | ...` lines)."""
    rows: dict[str, list[str]] = {}
    section = None
    for line in DOCS.read_text().splitlines():
        if line.startswith("## "):
            section = line[3:].strip()
        m = re.match(r"^\| `([^`]+)` \|", line)
        if m:
            rows.setdefault(section, []).append(m.group(1))
    return rows


def catalogue_cases() -> dict[str, list[str]]:
    """{section of docs/errors.md: [test case ids]}: the rows each section must list."""
    import test_attention_errors
    import test_gqa_errors
    return {"ai.onnx Attention": [c[0] for c in test_attention_errors.CASES],
            "com.microsoft GroupQueryAttention": [c[0] for c in test_gqa_errors.CASES],
            "Loader, apply, statuses, session, backends": [c[0] for c in CASES]}


def test_docs_table_lists_exactly_the_tested_rows():
    docs = _doc_rows()
    for section, ids in catalogue_cases().items():
        assert len(ids) == len(set(ids)), f"{section}: duplicate case ids"
        listed = docs.get(section, [])
        missing = sorted(set(ids) - set(listed))
        untested = sorted(set(listed) - set(ids))
        assert not missing and not untested, (
            f"docs/errors.md section {section!r}: rows without a doc line {missing}, doc lines "
            f"without a test {untested} (regenerate: python tools/error_catalogue.py)")
