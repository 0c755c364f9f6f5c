"""Export folders are accepted wherever a model path is (load, DecoderSession,
compare_with_onnxruntime, the CLI), by the rules of `onnx.files.model_file`; and `apply` keeps the
model's declared output order under jax.jit."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from onnx import TensorProto, helper

import jax_onnx_attn
from jax_onnx_attn.onnx.files import model_file
from jax_onnx_attn.runtime import DecoderSession, OrtDecoder, compare_with_onnxruntime

LLAMA = Path(__file__).parent / "fixtures" / "builder_llama_fp32"
PROMPT = [5, 17, 33, 2, 9]


def test_model_file_rules(tmp_path):
    assert model_file(LLAMA) == LLAMA / "model.onnx"
    assert model_file(LLAMA / "model.onnx") == LLAMA / "model.onnx"
    assert model_file(str(LLAMA)) == LLAMA / "model.onnx"
    # the only .onnx of a folder
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "decoder.onnx").write_bytes(b"")
    assert model_file(tmp_path / "a") == tmp_path / "a" / "decoder.onnx"
    # several: genai_config.json's decoder filename picks one, else model.onnx, else an error
    (tmp_path / "a" / "other.onnx").write_bytes(b"")
    with pytest.raises(ValueError, match="holds 2 .onnx files"):
        model_file(tmp_path / "a")
    (tmp_path / "a" / "genai_config.json").write_text(
        json.dumps({"model": {"decoder": {"filename": "other.onnx"}}}))
    assert model_file(tmp_path / "a") == tmp_path / "a" / "other.onnx"
    (tmp_path / "a" / "genai_config.json").write_text("{not json")
    (tmp_path / "a" / "model.onnx").write_bytes(b"")
    assert model_file(tmp_path / "a") == tmp_path / "a" / "model.onnx"
    # nothing there
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="without an .onnx file"):
        model_file(tmp_path / "empty")
    with pytest.raises(FileNotFoundError, match="no model at"):
        model_file(tmp_path / "missing")


def test_load_and_session_take_a_folder():
    """A folder lowers to the same params as its model file, and a session made from the folder
    generates onnxruntime's greedy tokens."""
    from_folder = jax_onnx_attn.load(LLAMA)
    from_file = jax_onnx_attn.load(LLAMA / "model.onnx")
    assert sorted(from_folder.params) == sorted(from_file.params)
    for name in from_file.params:
        np.testing.assert_array_equal(np.asarray(from_folder.params[name]),
                                      np.asarray(from_file.params[name]))
    session = DecoderSession(LLAMA, max_length=32)
    want = OrtDecoder(str(LLAMA / "model.onnx")).greedy(PROMPT, 8)
    assert session.generate([PROMPT], 8, progress=False).tokens == [want]


def test_compare_with_onnxruntime_takes_a_folder(tmp_path):
    # a copy under another file name, found through genai_config.json's decoder filename, with its
    # external data beside it
    for f in LLAMA.iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "model.onnx").rename(tmp_path / "decoder.onnx")
    config = json.loads((tmp_path / "genai_config.json").read_text())
    config["model"]["decoder"]["filename"] = "decoder.onnx"
    (tmp_path / "genai_config.json").write_text(json.dumps(config))
    report = compare_with_onnxruntime(tmp_path, PROMPT, 6)
    assert report.ok and report.first_divergence is None
    assert report.ort_tokens == OrtDecoder(str(LLAMA / "model.onnx")).greedy(PROMPT, 6)


def test_apply_keeps_the_declared_output_order_under_jit():
    """Outputs declared z, a, m come back as z, a, m from apply, jit(apply) and vmap(apply), not
    key-sorted (a plain dict comes out of jit sorted)."""
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, [3])
    outs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, [3]) for n in ("z", "a", "m")]
    graph = helper.make_graph([helper.make_node("Neg", ["x"], ["z"]),
                               helper.make_node("Abs", ["x"], ["a"]),
                               helper.make_node("Add", ["x", "x"], ["m"])], "g", [x], outs)
    lowered = jax_onnx_attn.load(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]))
    assert lowered.output_names == ["z", "a", "m"]
    xv = np.array([-1.0, 2.0, -3.0], np.float32)
    for fn in (lowered.apply, jax.jit(lowered.apply)):
        got = fn(lowered.params, {"x": xv})
        assert list(got) == ["z", "a", "m"]
        np.testing.assert_array_equal(np.asarray(got["z"]), -xv)
        np.testing.assert_array_equal(np.asarray(got["a"]), np.abs(xv))
        np.testing.assert_array_equal(np.asarray(got["m"]), 2 * xv)
    batched = jax.vmap(lowered.apply, in_axes=(None, 0))(lowered.params, {"x": np.stack([xv, xv])})
    assert list(batched) == ["z", "a", "m"]
