"""The `jax-onnx-attn` command: demo, generate and parity on the embedded tiny decoder, and parity
on an onnxruntime-genai builder fixture.

The commands load through the ONNX lowering, or through the stand-in of test_runtime (the same
contract) while the lowering is not in the tree; onnxruntime is the oracle of the outputs.
"""

from __future__ import annotations

import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import onnx
import pytest

import jax_onnx_attn
from jax_onnx_attn import cli
from jax_onnx_attn.models import tiny
from jax_onnx_attn.runtime import OrtDecoder, describe_backend

from test_runtime import StandIn, real_load
PROMPT = "Hello, JAX!"


def _loader(seed: int = 0):
    """The ONNX lowering, or the stand-in for the tiny decoder; `seed` swaps in other weights."""
    real = real_load()

    def load(model, dtype=None):
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(str(model))
        assert proto.producer_name == cli.TINY_PRODUCER and dtype is None
        if real is None:
            return StandIn(tiny.TinyConfig(seed=seed))
        return real(tiny.build_tiny_decoder(seed=seed) if seed else proto, dtype=dtype)

    return load


@pytest.fixture
def load(monkeypatch):
    monkeypatch.setattr(jax_onnx_attn, "load", _loader(), raising=False)


@pytest.fixture(scope="module")
def expected():
    """onnxruntime's 12 greedy tokens after PROMPT."""
    return OrtDecoder(tiny.build_tiny_decoder()).greedy(tiny.encode(PROMPT), 12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    onnx.save(tiny.build_tiny_decoder(), str(path / "model.onnx"))
    return path


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        rc = cli.main([str(a) for a in argv], out=out)
    finally:
        sys.stderr = old
    return rc, out.getvalue(), err.getvalue()


def _save(path, producer=None):
    model = tiny.build_tiny_decoder()
    if producer is not None:
        model.producer_name = producer
    onnx.save(model, str(path / "model.onnx"))


def _ids(tokens) -> str:
    return ",".join(map(str, tokens))


def test_demo(load, expected, tmp_path):
    rc, out, _ = run("demo", "--max-new-tokens", 12, "--no-progress", "--save", tmp_path)
    assert rc == 0, out
    assert f"prompt: {PROMPT!r} (11 tokens)" in out
    assert f"generated ids (12, finish: length): {_ids(expected)}" in out
    assert f"text: {tiny.decode(expected)!r}" in out
    assert "tokens/s" in out and f"backend: {describe_backend()}" in out
    assert (tmp_path / "model.onnx").exists()


def test_generate_ids(load, expected, model_dir):
    prompt_ids = _ids(tiny.encode(PROMPT))
    rc, out, _ = run("generate", model_dir, "--ids", prompt_ids, "--ids", "97,98", "--max-new-tokens", 12)
    assert rc == 0, out
    assert f"[0] generated ids (12, finish: length): {_ids(expected)}" in out
    assert "[1] generated ids (12" in out


def test_generate_prompt_stops_at_genai_config_eos(load, expected, tmp_path):
    """--prompt through the tiny model's byte-level tokenizer; eos_token_id from genai_config.json
    is the default stop token."""
    _save(tmp_path)
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": [expected[3]]}}))
    rc, out, _ = run("generate", tmp_path / "model.onnx", "--prompt", PROMPT, "--max-new-tokens", 12)
    n = expected.index(expected[3]) + 1
    assert rc == 0 and f"generated ids ({n}, finish: stop): {_ids(expected[:n])}" in out
    assert f"stop tokens: {expected[3]}" in out and f"text: {tiny.decode(expected[:n])!r}" in out


def test_parity_ok(load, model_dir):
    rc, out, _ = run("parity", model_dir, "--prompt", PROMPT, "--max-new-tokens", 8)
    assert rc == 0, out
    assert "greedy tokens: identical" in out and "parity: OK" in out and "within float32" in out


def test_parity_reports_a_mismatch(monkeypatch, model_dir):
    """Lowering other weights than onnxruntime runs: exit 1, logits outside tolerance, divergence."""
    monkeypatch.setattr(jax_onnx_attn, "load", _loader(seed=1), raising=False)
    rc, out, _ = run("parity", model_dir, "--ids", _ids(tiny.encode(PROMPT)), "--max-new-tokens", 8)
    assert rc == 1
    assert "OUTSIDE float32 tolerance" in out and "first divergence at new token" in out
    assert "parity: MISMATCH" in out


@pytest.mark.parametrize("argv, message", [
    (["generate", "{dir}", "--ids", "1,x"], "comma-separated integers"),
    (["generate", "{dir}"], "--ids 1,2,3 or as --prompt"),
    (["generate", "{dir}/missing.onnx", "--ids", "1"], "no model at"),
    (["generate", "{dir}", "--ids", "1,2,3", "--max-length", "3"], "leaves no room"),
    (["demo", "--hidden", "40"], "multiple of 16"),
    (["parity", "{dir}", "--ids", "1", "--ids", "2"], "one prompt at a time"),
])
def test_usage_errors(load, model_dir, argv, message):
    rc, _, err = run(*[a.format(dir=model_dir) for a in argv])
    assert rc == 2 and message in err, err


def test_prompt_needs_a_tokenizer(load, tmp_path):
    """A model that is not the tiny one needs tokenizer.json (and the tokenizers package)."""
    _save(tmp_path, producer="someone-else")
    rc, _, err = run("generate", tmp_path, "--prompt", "hi")
    assert rc == 2 and "tokenizer.json" in err and "--ids" in err


def test_module_entry_point_help():
    proc = subprocess.run([sys.executable, "-m", "jax_onnx_attn.cli", "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout and "parity" in proc.stdout


@pytest.mark.skipif(real_load() is None or shutil.which("jax-onnx-attn") is None,
                    reason="needs the installed `jax-onnx-attn` script and the ONNX lowering")
def test_installed_demo_command():
    proc = subprocess.run(["jax-onnx-attn", "demo", "--max-new-tokens", "4"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CI": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout


@pytest.mark.skipif(real_load() is None, reason="needs the ONNX lowering")
def test_parity_on_a_builder_fixture():
    """`parity` on an onnxruntime-genai builder model (past head size declared as the symbol
    kv_cache_dim): onnxruntime opens it and the lowering agrees with it, tokens and logits."""
    path = Path(__file__).parent / "fixtures" / "builder_llama_fp32" / "model.onnx"
    rc, out, err = run("parity", path, "--ids", "5,17,33,2,9,40,77", "--max-new-tokens", 12)
    assert rc == 0, out + err
    assert "greedy: 12 tokens from onnxruntime, 12 from jax_onnx_attn" in out
    assert "greedy tokens: identical" in out and "within float32 tolerance" in out
    assert "parity: OK" in out
