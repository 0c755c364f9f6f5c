"""The `jax-onnx-attn` command: demo, generate and parity on the embedded tiny decoder and on the
producers' fixtures (text through their tokenizer.json and chat template), every usage error named,
exit codes, --json, --version and `python -m jax_onnx_attn`.

onnxruntime is the oracle of the generated tokens; the `tokenizers` library, run directly, is the
oracle of the prompt's token ids.
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
from jax_onnx_attn.runtime import DecoderSession, OrtDecoder, describe_backend

PROMPT = "Hello, JAX!"
FIXTURES = Path(__file__).parent / "fixtures"
LLAMA = FIXTURES / "builder_llama_fp32"


@pytest.fixture(scope="module")
def expected():
    """onnxruntime's 12 greedy tokens after PROMPT on the tiny decoder."""
    return OrtDecoder(tiny.build_tiny_decoder()).greedy(tiny.encode(PROMPT), 12)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny")
    onnx.save(tiny.build_tiny_decoder(), str(path / "model.onnx"))
    return path


@pytest.fixture(scope="module")
def llama_tokenizer():
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(LLAMA / "tokenizer.json"))


def run(*argv) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    old, sys.stderr = sys.stderr, err
    try:
        rc = cli.main([str(a) for a in argv], out=out)
    finally:
        sys.stderr = old
    return rc, out.getvalue(), err.getvalue()


def run_json(*argv) -> tuple[int, dict, str]:
    rc, out, err = run(*argv, "--json")
    return rc, json.loads(out), err


def _save(path, producer=None):
    model = tiny.build_tiny_decoder()
    if producer is not None:
        model.producer_name = producer
    onnx.save(model, str(path / "model.onnx"))


def _ids(tokens) -> str:
    return ",".join(map(str, tokens))


# --------------------------------------------------------------------------------------------------
# demo

def test_demo(expected, tmp_path):
    rc, out, err = run("demo", "--max-new-tokens", 12, "--no-progress", "--save", tmp_path)
    assert rc == 0, out + err
    assert f"prompt: {PROMPT!r} (11 tokens)" in out
    assert f"generated ids (12, finish: length): {_ids(expected)}" in out
    assert f"text: {tiny.decode(expected)!r}" in out
    assert f"backend: {describe_backend()}" in out
    # warm-up reported apart, then steady-state time to first token and decode rate
    assert "warm-up: " in out and "not counted below" in out
    assert "time to first token: " in out and "decode: 11 tokens in " in out
    assert "tokens/s" in out and "steady state" in out and "not steady state" not in out
    assert (tmp_path / "model.onnx").exists() and f"generate {tmp_path} --prompt" in out


def test_demo_json_is_one_object_with_steady_state_timings(expected):
    rc, record, err = run_json("demo", "--max-new-tokens", 12)
    assert rc == 0, err
    assert record["ok"] is True and record["exit_code"] == 0 and record["command"] == "demo"
    (row,) = record["rows"]
    assert row["tokens"] == expected and row["finish_reason"] == "length"
    assert row["prompt_ids"] == tiny.encode(PROMPT) and row["text"] == tiny.decode(expected)
    t = record["timings"]
    assert t["warm"] is True and t["compile_s"] == 0.0  # the warm-up compiled everything
    assert t["new_tokens"] == 12 and t["decode_tokens"] == 11 and t["decode_steps"] == 11
    assert t["ttft_s"] == t["prefill_s"] > 0 and t["decode_tokens_per_s"] > 0
    assert record["warmup"]["warm"] is False and record["warmup"]["compile_s"] > 0
    assert record["bandwidth_bound"] is None  # no GPU here (test_bandwidth_bound_uses_the_gpus_bandwidth)
    assert record["backend"]["cuda_usable"] == jax_onnx_attn.build_info()["cuda_usable"]


@pytest.mark.parametrize("kind, bandwidth", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                             ("NVIDIA A100-SXM4-80GB", None)])
def test_bandwidth_bound_uses_the_gpus_bandwidth(kind, bandwidth, monkeypatch):
    """generate's fraction of the bound divides by the bandwidth of the GPU that ran (an H100 run
    was once measured against the H200's 4.8 TB/s); a GPU the table lacks gets no bound."""
    import jax

    from jax_onnx_attn.runtime import roofline
    from jax_onnx_attn.runtime.session import Timings

    session = DecoderSession(tiny.build_tiny_decoder(), max_length=64)
    timings = Timings(prompt_tokens=10, rows=1, decode_s=0.02, decode_steps=20)
    fake = type("Gpu", (), {"platform": "gpu", "device_kind": kind})()
    monkeypatch.setattr(jax, "devices", lambda *a: [fake])
    bound = cli.bandwidth_bound(session, timings)
    if bandwidth is None:
        assert bound is None
        return
    step_bytes = roofline.step_cost(session.lowered).decode_bytes(1, 10 + 20 // 2)
    assert bound["peak_gb_s"] == bandwidth / 1e9 and bound["bytes_per_step"] == step_bytes
    assert bound["fraction"] == pytest.approx(step_bytes / bandwidth / timings.step_s)


def test_no_warmup_says_its_timings_are_not_steady_state():
    rc, out, _ = run("demo", "--max-new-tokens", 4, "--no-warmup")
    assert rc == 0
    assert "warm-up: skipped" in out and "not steady state" in out and "compile: " in out
    rc, record, _ = run_json("demo", "--max-new-tokens", 4, "--no-warmup")
    assert record["warmup"] is None and record["timings"]["warm"] is False
    assert record["timings"]["compile_s"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--heads", "0"], "argument --heads: expected an integer >= 1, got 0"),
    (["--kv-heads", "0"], "argument --kv-heads: expected an integer >= 1, got 0"),
    (["--layers", "-1"], "argument --layers: expected an integer >= 1, got -1"),
    (["--hidden", "x"], "argument --hidden: expected an integer >= 1, got 'x'"),
    (["--hidden", "40"], "multiple of 16"),
    (["--heads", "4", "--kv-heads", "3"], "heads 4 is not a multiple of kv_heads 3"),
    (["--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got 0"),
    (["--prompt", ""], "--prompt is empty"),
    (["--top-p", "0"], "argument --top-p: expected a number in (0, 1], got 0"),
    (["--temperature", "-1"], "argument --temperature: expected a number in [0, inf], got -1"),
    (["--top-k", "-2"], "argument --top-k: expected an integer >= 0, got -2"),
])
def test_demo_usage_errors(argv, message):
    rc, out, err = run("demo", *argv)
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and out == ""


# --------------------------------------------------------------------------------------------------
# generate

def test_generate_ids(expected, model_dir):
    prompt_ids = _ids(tiny.encode(PROMPT))
    rc, out, _ = run("generate", model_dir, "--ids", prompt_ids, "--ids", "97,98", "--max-new-tokens", 12)
    assert rc == 0, out
    assert f"[0] generated ids (12, finish: length): {_ids(expected)}" in out
    want = OrtDecoder(tiny.build_tiny_decoder()).greedy([97, 98], 12)
    assert f"[1] generated ids (12, finish: length): {_ids(want)}" in out


def test_generate_batch_smaller_than_prompts(expected, model_dir):
    """--batch 1 with two prompts runs two groups; every row's tokens are onnxruntime's."""
    rc, record, err = run_json("generate", model_dir, "--ids", _ids(tiny.encode(PROMPT)),
                               "--ids", "97,98", "--max-new-tokens", 12, "--batch", 1)
    assert rc == 0, err
    assert record["batch"] == 1 and record["rows"][0]["tokens"] == expected
    assert record["rows"][1]["tokens"] == OrtDecoder(tiny.build_tiny_decoder()).greedy([97, 98], 12)
    assert record["timings"]["warm"] is True and record["timings"]["rows"] == 2


def test_generate_prompt_stops_at_genai_config_eos(expected, tmp_path):
    """--prompt through the tiny model's byte-level tokenizer; eos_token_id from genai_config.json
    is the default stop token."""
    _save(tmp_path)
    (tmp_path / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": [expected[3]]}}))
    rc, out, _ = run("generate", tmp_path / "model.onnx", "--prompt", PROMPT, "--max-new-tokens", 12)
    n = expected.index(expected[3]) + 1
    assert rc == 0 and f"generated ids ({n}, finish: stop): {_ids(expected[:n])}" in out
    assert f"stop tokens: {expected[3]} (from genai_config.json)" in out
    assert f"text: {tiny.decode(expected[:n])!r}" in out
    rc, out, _ = run("generate", tmp_path, "--prompt", PROMPT, "--max-new-tokens", 12, "--stop", "")
    assert rc == 0 and f"generated ids (12, finish: length): {_ids(expected)}" in out


def test_generate_text_on_a_builder_fixture_through_its_chat_template(llama_tokenizer):
    """The README's route: an export folder with tokenizer.json and a chat template; --prompt is
    wrapped in the template, encoded by the tokenizer, and the tokens are onnxruntime's greedy ones."""
    rc, record, err = run_json("generate", LLAMA, "--prompt", "the model reads", "--max-new-tokens", 10,
                               "--stop", "")
    assert rc == 0, err
    rendered = "<s>user\nthe model reads</s>\n<s>assistant\n"
    want_ids = llama_tokenizer.encode(rendered, add_special_tokens=False).ids
    (row,) = record["rows"]
    assert row["prompt_ids"] == want_ids and row["prompt_text"] == rendered
    assert row["tokens"] == OrtDecoder(str(LLAMA / "model.onnx")).greedy(want_ids, 10)
    assert row["text"] == llama_tokenizer.decode(row["tokens"], skip_special_tokens=True)
    assert record["tokenizer"] == str(LLAMA / "tokenizer.json")
    assert record["chat_template"] == str(LLAMA / "tokenizer_config.json")
    assert record["timings"]["warm"] is True


def test_generate_raw_prompt_and_system_message(llama_tokenizer):
    rc, record, err = run_json("generate", LLAMA, "--prompt", "keys and values", "--raw",
                               "--max-new-tokens", 2)
    assert rc == 0, err
    assert record["rows"][0]["prompt_ids"] == llama_tokenizer.encode("keys and values").ids
    assert record["chat_template"] is None
    rc, record, err = run_json("generate", LLAMA, "--prompt", "hi", "--system", "be brief",
                               "--max-new-tokens", 2)
    assert rc == 0, err
    rendered = "<s>system\nbe brief</s>\n<s>user\nhi</s>\n<s>assistant\n"
    assert record["rows"][0]["prompt_ids"] == llama_tokenizer.encode(rendered,
                                                                     add_special_tokens=False).ids
    rc, _, err = run("generate", LLAMA, "--prompt", "hi", "--system", "x", "--raw")
    assert rc == 2 and "--system needs a chat template" in err


def test_generate_default_stop_is_the_exports_eos(llama_tokenizer):
    rc, out, err = run("generate", LLAMA, "--ids", "5,17,33", "--max-new-tokens", 2)
    assert rc == 0, err
    assert "stop tokens: 2 (from genai_config.json)" in out  # </s>, id 2 in tokenizer.json too
    assert llama_tokenizer.token_to_id("</s>") == 2


@pytest.mark.parametrize("argv, message", [
    (["generate", "{dir}", "--ids", "1,x"], "argument --ids: expected comma-separated token ids"),
    (["generate", "{dir}", "--ids", "1,-3"], "argument --ids: token ids are >= 0"),
    (["generate", "{dir}", "--ids", "1,256"], "token id 256 is outside the model's vocabulary of 256"),
    (["generate", "{dir}"], "--ids 1,2,3 or as --prompt"),
    (["generate", "{dir}", "--ids", "1", "--prompt", "a"], "not both"),
    (["generate", "{dir}/missing.onnx", "--ids", "1"], "no model at"),
    (["generate", "{dir}", "--ids", "1,2,3", "--max-length", "3"], "leaves no room"),
    (["generate", "{dir}", "--ids", "1", "--max-length", "1"],
     "argument --max-length: expected an integer >= 2, got 1"),
    (["generate", "{dir}", "--ids", "1", "--batch", "0"],
     "argument --batch: expected an integer >= 1, got 0"),
    (["generate", "{dir}", "--ids", "1", "--stop", "x"],
     "argument --stop: expected comma-separated token ids (integers >= 0), got 'x'"),
    (["generate", "{dir}", "--ids", "1", "--dtype", "int8"], "argument --dtype: invalid choice"),
    (["parity", "{dir}", "--ids", "1", "--ids", "2"], "one prompt at a time"),
    (["generate", str(LLAMA), "--ids", "1", "--max-length", "300"],
     "--max-length 300 exceeds the model's context length 256 (genai_config.json)"),
    (["generate", str(LLAMA), "--ids", "1,2", "--max-new-tokens", "300"],
     "prompt + --max-new-tokens + 1 = 303 exceeds the model's context length 256"),
    (["parity", str(LLAMA), "--ids", "1,2", "--max-new-tokens", "300"],
     "prompt + --max-new-tokens + 1 = 303 exceeds the model's context length 256"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
])
def test_usage_errors(model_dir, argv, message):
    rc, out, err = run(*[a.format(dir=model_dir) for a in argv])
    assert rc == 2 and message in err, err
    assert "Traceback" not in err and out == ""


def test_usage_error_as_json(model_dir):
    rc, record, err = run_json("generate", model_dir, "--ids", "1", "--stop", "x")
    assert rc == 2 and record == {"command": "generate", "ok": False, "exit_code": 2,
                                  "error_kind": "usage", "error": err.split("error: ", 1)[1].strip()}
    assert "--stop" in record["error"]


def test_prompt_needs_a_tokenizer(tmp_path):
    """A model that is not the tiny one needs its export's tokenizer.json for --prompt."""
    _save(tmp_path, producer="someone-else")
    rc, _, err = run("generate", tmp_path, "--prompt", "hi")
    assert rc == 2 and "tokenizer.json" in err and "--ids" in err


def test_a_folder_with_several_models_must_be_named(tmp_path):
    _save(tmp_path)
    shutil.copy(tmp_path / "model.onnx", tmp_path / "other.onnx")
    (tmp_path / "model.onnx").rename(tmp_path / "first.onnx")
    rc, _, err = run("generate", tmp_path, "--ids", "1")
    assert rc == 2 and "holds 2 .onnx files (first.onnx, other.onnx)" in err


# --------------------------------------------------------------------------------------------------
# parity and exit codes

def test_parity_ok(model_dir):
    rc, out, _ = run("parity", model_dir, "--prompt", PROMPT, "--max-new-tokens", 8)
    assert rc == 0, out
    assert "greedy tokens: identical" in out and "parity: OK" in out and "within float32" in out


def test_parity_bfloat16_on_a_builder_fixture():
    """--dtype bfloat16 used to fail on np.finfo(bfloat16); the report now takes bf16's tolerance,
    within which the jax side in bf16 agrees with onnxruntime in f32 (greedy tokens the same up to a
    near-tie)."""
    rc, record, err = run_json("parity", LLAMA, "--ids", "5,17,33,2,9,40,77", "--max-new-tokens", 8,
                               "--dtype", "bfloat16")
    assert rc == 0, err
    assert record["logits_dtype"] == "bfloat16" and record["tolerance"] == [3e-2, 3e-2]
    assert record["logits_within_tolerance"]
    assert record["first_divergence"] is None or record["divergence_is_tie"]
    # bf16 rounding shows in the logits (far above f32's), yet within bf16's bound
    assert 1e-4 < record["prefill_max_abs"] <= record["logits_bound"]


def _load_other_weights(model, dtype=None):
    """jax_onnx_attn.load, but the tiny decoder with other weights than the file's."""
    from jax_onnx_attn.onnx import load

    return load(tiny.build_tiny_decoder(seed=1), dtype=dtype)


def test_parity_reports_a_mismatch_with_exit_1(monkeypatch, model_dir):
    """Lowering other weights than onnxruntime runs: exit 1, logits outside tolerance, divergence."""
    monkeypatch.setattr(jax_onnx_attn, "load", _load_other_weights)
    rc, out, _ = run("parity", model_dir, "--ids", _ids(tiny.encode(PROMPT)), "--max-new-tokens", 8)
    assert rc == 1
    assert "OUTSIDE float32 tolerance" in out and "first divergence at new token" in out
    assert "parity: MISMATCH" in out
    rc, record, _ = run_json("parity", model_dir, "--ids", "72,105", "--max-new-tokens", 8)
    assert rc == 1 and record["ok"] is False and record["exit_code"] == 1


def test_a_file_that_is_not_onnx_exits_3(tmp_path):
    (tmp_path / "model.onnx").write_bytes(b"\x00 definitely not a protobuf \xff" * 10)
    for command in ("generate", "parity"):
        rc, _, err = run(command, tmp_path, "--ids", "1,2")
        assert rc == 3, err
        assert "cannot be read as an ONNX model" in err and "Traceback" not in err


def test_an_unsupported_model_exits_3(tmp_path):
    """A graph with an op the lowering has no handler for: exit 3, the op named, no traceback."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Gather", ["emb", "input_ids"], ["h"]),
         helper.make_node("DynamicQuantizeLinear", ["h"], ["q", "s", "z"]),
         helper.make_node("Cast", ["q"], ["logits"], to=TensorProto.FLOAT)],
        "g", [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["b", "s"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["b", "s", 4])],
        [helper.make_tensor("emb", TensorProto.FLOAT, [4, 4], [0.0] * 16)])
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 20)]),
              str(tmp_path / "model.onnx"))
    rc, _, err = run("generate", tmp_path, "--ids", "1,2")
    assert rc == 3 and "could not load" in err and "DynamicQuantizeLinear" in err, err
    assert "Traceback" not in err


def test_a_run_the_model_cannot_do_exits_3(model_dir):
    """Beyond the tiny model's 512 rotary positions (no config file says so): the session refuses
    the capacity when it is made, naming the model's limit; exit 3 with its message, no traceback."""
    rc, _, err = run("generate", model_dir, "--ids", "1,2", "--max-length", 600, "--max-new-tokens", 2)
    assert rc == 3 and "512 positions the model supports" in err, err
    assert "Traceback" not in err


def test_an_internal_error_exits_4_with_one_line(monkeypatch, model_dir):
    def broken(self, *a, **k):
        raise KeyError("a bug")

    monkeypatch.setattr(DecoderSession, "generate", broken)
    rc, out, err = run("generate", model_dir, "--ids", "1,2")
    assert rc == 4 and "internal error: KeyError: 'a bug'" in err and "--traceback" in err
    assert "Traceback" not in err
    rc, out, err = run("generate", model_dir, "--ids", "1,2", "--traceback")
    assert rc == 4 and "Traceback (most recent call last)" in err
    rc, record, _ = run_json("generate", model_dir, "--ids", "1,2")
    assert rc == 4 and record["error_kind"] == "internal"


# --------------------------------------------------------------------------------------------------
# entry points

def test_version():
    rc, out, _ = run("--version")
    assert rc == 0
    info = jax_onnx_attn.build_info()
    import jax

    assert f"jax {jax.__version__}" in out
    assert ("CUDA kernels: not compiled" in out) == (not info["cuda_compiled"])


def test_no_command_prints_help_and_exits_2():
    rc, out, _ = run()
    assert rc == 2 and "demo" in out and "parity" in out


@pytest.mark.parametrize("module", ["jax_onnx_attn", "jax_onnx_attn.cli"])
def test_module_entry_points(module):
    proc = subprocess.run([sys.executable, "-m", module, "--help"], capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0 and "demo" in proc.stdout and "parity" in proc.stdout
    assert "exit status" in proc.stdout


def test_python_m_reports_usage_errors_with_exit_2():
    proc = subprocess.run([sys.executable, "-m", "jax_onnx_attn", "demo", "--heads", "0"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "argument --heads" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.skipif(shutil.which("jax-onnx-attn") is None, reason="needs the installed `jax-onnx-attn` script")
def test_installed_command():
    proc = subprocess.run(["jax-onnx-attn", "demo", "--max-new-tokens", "4"], capture_output=True,
                          text=True, timeout=300, env={**os.environ, "CI": "1"})
    assert proc.returncode == 0, proc.stderr
    assert "tokens/s" in proc.stdout and proc.stderr == ""  # no progress drawn off a terminal
    proc = subprocess.run(["jax-onnx-attn", "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout.startswith("jax-onnx-attn ")
