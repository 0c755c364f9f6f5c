"""Issue 12's targets (`python -m jax_onnx_attn.bench targets`) on hand-made bench e2e documents and
on a committed grid result: which cases each target covers, the figure it reads from the record
(fraction of the bound, speed over the JAX peer, kernels a layer, fraction of the GEMM peak), the
comparison (at least, or at most for kernels) and the exit status."""

import json

import pytest

from jax_onnx_attn.bench import targets
from jax_onnx_attn.bench.__main__ import main as bench_main


def _decode(model, weights, batch, ctx, ms, peer_ms, frac, kernels=None):
    ours = {"ms": ms, "frac_of_bound": frac, **({"kernels_per_step": kernels} if kernels else {})}
    return {"model": model, "model_alias": model, "weights": weights, "batch": batch, "ctx": ctx,
            "phase": "decode", "impls": {"ours": ours, "jax-peer": {"ms": peer_ms}}}


def _prefill(model, tokens, ms, peer_ms, frac):
    return {"model": model, "model_alias": model, "weights": "fp16", "batch": 1, "ctx": tokens, "tokens": tokens,
            "phase": "prefill", "impls": {"ours": {"ms": ms, "frac_of_gemm_peak": frac}, "jax-peer": {"ms": peer_ms}}}


def _doc(*results):
    config = {"layers": 16}
    return {"suite": "e2e", "commit": "abc1234", "gpu": "NVIDIA H200",
            "models": {f"{m}/{w}": {"config": config} for m in ("1b", "8b") for w in ("fp16", "int4")},
            "results": list(results)}


def _by(rows, target_prefix):
    return [r for r in rows if r["target"].startswith(target_prefix)]


def test_b1_decode_needs_the_fraction_and_the_lead_over_the_peer():
    doc = _doc(_decode("1b", "fp16", 1, 1024, 1.0, 1.4, 0.81, kernels=160),
               _decode("1b", "fp16", 1, 16384, 1.0, 1.1, 0.5))  # ctx 16k: outside 1k-8k
    rows = targets.check(doc)
    frac = _by(rows, "decode fp16 B=1 1k-8k: fraction")
    peer = _by(rows, "decode fp16 B=1 1k-8k: speed")
    assert [(r["ctx"], r["value"], r["met"]) for r in frac] == [(1024, 0.81, True)]
    assert peer[0]["value"] == pytest.approx(1.4) and peer[0]["met"]
    kernels = _by(rows, "decode: kernels")
    assert [(r["value"], r["met"]) for r in kernels] == [(10.0, True)]  # 160 over 16 layers: at most 10 holds


def test_misses_and_the_batch_rules():
    doc = _doc(_decode("1b", "fp16", 1, 2048, 1.0, 1.2, 0.79, kernels=176),
               _decode("1b", "int4", 1, 2048, 1.0, 3.0, 0.61),
               _decode("1b", "fp16", 8, 2048, 1.0, 1.0, 0.74),
               _decode("1b", "fp16", 32, 2048, 1.0, 1.0, 0.70),
               _decode("1b", "int4", 32, 2048, 1.0, 1.0, 0.10))  # no target names int4 at B=32
    rows = targets.check(doc)
    assert not _by(rows, "decode fp16 B=1 1k-8k: fraction")[0]["met"]
    assert not _by(rows, "decode fp16 B=1 1k-8k: speed")[0]["met"]  # 1.2x < 1.3x
    assert _by(rows, "decode int4 B=1")[0]["met"]
    assert [r["met"] for r in _by(rows, "decode fp16 B=8")] == [False]
    assert [r["met"] for r in _by(rows, "decode fp16 B=32")] == [True]
    assert not _by(rows, "decode: kernels")[0]["met"]  # 11 a layer
    assert len(rows) == 6  # the int4 B=32 case and the unprofiled kernel counts are not listed


def test_prefill_targets_are_the_8b_models():
    doc = _doc(_prefill("8b", 2048, 50.0, 47.0, 0.80), _prefill("8b", 8192, 200.0, 210.0, 0.55),
               _prefill("1b", 2048, 5.0, 6.0, 0.5))
    rows = targets.check(doc)
    peak = _by(rows, "prefill ~8B 2k-8k: fraction")
    ttft = _by(rows, "prefill ~8B 2k-8k: TTFT")
    assert [(r["ctx"], r["met"]) for r in peak] == [(2048, True), (8192, False)]
    assert [(r["ctx"], round(r["value"], 3), r["met"]) for r in ttft] == [(2048, 0.94, False), (8192, 1.05, True)]


def test_a_missing_peer_is_a_miss_not_an_error():
    rec = _decode("8b", "fp16", 1, 2048, 4.3, None, 0.74)
    del rec["impls"]["jax-peer"]
    rows = _by(targets.check(_doc(rec)), "decode fp16 B=1 1k-8k: speed")
    assert rows[0]["value"] is None and not rows[0]["met"]
    assert "n/a" in targets.format_rows(rows)


def test_a_committed_grid(capsys):
    """The session-20 grid (b873a50, H200): each listed figure is the record's own."""
    path = "bench/results/2026-12-02-b873a50-e2e-grid-8b.json"
    doc = json.load(open(path))
    rows = targets.check(doc)
    b1 = next(r for r in doc["results"] if r["phase"] == "decode" and r["weights"] == "fp16" and r["batch"] == 1)
    row = _by(rows, "decode fp16 B=1 1k-8k: fraction")[0]
    assert row["value"] == b1["impls"]["ours"]["frac_of_bound"] and not row["met"]
    assert bench_main(["targets", path, "--markdown"]) == 1
    out = capsys.readouterr().out
    assert "| decode fp16 B=1 1k-8k: fraction of the bound | llama-3.1-8b |" in out and " of 9 met" in out


def test_no_covered_case_is_status_2(tmp_path, capsys):
    path = tmp_path / "e.json"
    path.write_text(json.dumps(_doc(_prefill("1b", 2048, 5.0, 6.0, 0.5))))
    assert bench_main(["targets", str(path)]) == 2
    assert "covered by a target" in capsys.readouterr().err


def test_latest_takes_each_cases_latest_h200_run(tmp_path, capsys):
    """--latest: a case measured twice counts once, from the later run; another GPU's run is not
    the targets' (the H200's) and is left out."""
    older = _doc(_decode("1b", "fp16", 1, 1024, 1.0, 1.2, 0.50), _decode("1b", "int4", 1, 1024, 1.0, 3.0, 0.20))
    newer = _doc(_decode("1b", "fp16", 1, 1024, 1.0, 1.4, 0.55))
    h100 = {**_doc(_decode("1b", "fp16", 1, 1024, 1.0, 1.0, 0.90)), "gpu": "NVIDIA H100 80GB HBM3"}
    for name, doc in (("2026-12-01-aaaaaaa-e2e.json", older), ("2026-12-02-bbbbbbb-e2e.json", newer),
                      ("2026-12-03-ccccccc-e2e.json", h100)):
        (tmp_path / name).write_text(json.dumps(doc))
    runs = targets.latest_runs(tmp_path)
    assert [(p.name, [(r["weights"], r["impls"]["ours"]["frac_of_bound"]) for r in recs]) for p, _, recs in runs] == [
        ("2026-12-01-aaaaaaa-e2e.json", [("int4", 0.20)]), ("2026-12-02-bbbbbbb-e2e.json", [("fp16", 0.55)])]
    assert [p.name for p, _, _ in targets.latest_runs(tmp_path, gpu="H100")] == ["2026-12-03-ccccccc-e2e.json"]
    assert bench_main(["targets", "--latest", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "1 of 3 met" in out and "0.90" not in out  # 1.4x the peer is the one met
    with pytest.raises(SystemExit):
        bench_main(["targets", "--latest", str(tmp_path), str(tmp_path / "2026-12-01-aaaaaaa-e2e.json")])
