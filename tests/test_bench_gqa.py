"""The GQA step benchmark harness on CPU: it times the reference step (the cuda backend needs a GPU),
writes its JSON, and the kernel figures leave its suite out."""

import json

from jax_onnx_attn.bench import __main__ as bench_main
from jax_onnx_attn.bench import gqa, plots


def test_gqa_suite_times_the_reference_step_and_writes_json(tmp_path, capsys):
    out = tmp_path / "gqa.json"
    rc = bench_main.main(["gqa", "--batch", "2", "--ctx", "64", "--heads", "4/2", "--dims", "64",
                          "--dtypes", "fp16", "--kv-bits", "0", "8", "--calls", "2",
                          "--target-ms", "2", "--reps", "2", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "gqa" and len(doc["results"]) == 2
    for res, bits in zip(doc["results"], (0, 8)):
        assert res["kv_bits"] == bits
        assert res["kv_bytes"] == gqa.Case(2, 64, 1, 4, 2, 64, "fp16", bits).kv_bytes
        assert res["impls"]["reference"]["us"] > 0, res
    assert "cuda skipped" in capsys.readouterr().err


def test_kernel_figures_leave_other_suites_out(tmp_path):
    (tmp_path / "a.json").write_text(json.dumps({"suite": "gqa", "env": {}, "results": [
        {"batch": 1, "ctx": 64, "q_len": 1, "q_heads": 4, "kv_heads": 2, "head_dim": 64,
         "dtype": "fp16", "impls": {"cuda": {"us": 5.0}}}]}))
    try:
        plots.load_results(tmp_path)
    except plots.NoResults:
        return
    raise AssertionError("a gqa-suite file was read as kernel measurements")


def test_unknown_suite_prints_usage(capsys):
    assert bench_main.main(["nope"]) == 2
    assert "decode,prefill,gqa" in capsys.readouterr().err
