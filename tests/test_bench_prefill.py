"""The prefill benchmark harness on CPU: ours needs an sm_90 GPU (skipped, with the reason), the xla
peer is timed, the JSON has the schema the figures read, and the figures read it as prefill."""

import json

from jax_onnx_attn.bench import __main__ as bench_main
from jax_onnx_attn.bench import plots


def test_prefill_suite_times_the_xla_peer_and_writes_json(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rc = bench_main.main(["prefill", "--seqlens", "32", "64", "--tokens", "64", "--heads", "4/2",
                          "--dims", "64", "--causal", "causal", "noncausal", "--impls", "ours",
                          "ours-pingpong", "jax-xla", "--calls", "2", "--target-ms", "2", "--reps", "2",
                          "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "prefill" and len(doc["results"]) == 4
    for res in doc["results"]:
        assert res["batch"] * res["q_len"] == 64 and res["ctx"] == res["q_len"]
        xla = res["impls"]["jax-xla"]
        assert xla["us"] > 0 and xla["tflops"] > 0, res
        assert set(res["impls"]) == {"jax-xla"}
    assert "ours ours-pingpong skipped" in capsys.readouterr().err
    recs = plots.load_results(tmp_path)
    assert {r["phase"] for r in recs} == {"prefill"} and {r["causal"] for r in recs} == {True, False}


def test_prefill_suite_stops_starting_cases_past_its_budget(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rc = bench_main.main(["prefill", "--seqlens", "32", "--tokens", "32", "--heads", "4/2", "--dims", "256",
                          "96", "--causal", "causal", "--impls", "jax-xla", "--calls", "2", "--target-ms", "2",
                          "--reps", "2", "--max-seconds", "0", "--out", str(out)])
    assert rc == 0 and not out.exists()
    assert "time budget reached: stopping before B1 S32 4/2 d256 bf16 causal" in capsys.readouterr().out
