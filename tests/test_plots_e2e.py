"""The e2e figure: plots.load_e2e / plot_e2e and its place in regenerate / tools/plot_bench.py, on
synthetic JSON in the e2e harness's schema (`python -m jax_onnx_attn.bench e2e --out`)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jax_onnx_attn.bench import plots

ROOT = Path(__file__).resolve().parent.parent
ENV = {"gpu": "name, driver_version\nNVIDIA H200, 580.159.04", "commit": "abc1234"}
#: (model, weights, B, T) -> bound ms and each impl's fraction of it.
CASES = {("llama-3.2-1b", "fp16", 1, 2048): (0.62, {"ours": 0.25, "jax-peer": 0.35, "torch-peer": 0.46}),
         ("llama-3.2-1b", "int4", 8, 2048): (0.30, {"ours": 0.20, "jax-peer": 0.30}),
         ("llama-3.1-8b", "fp16", 1, 8192): (3.6, {"ours": 0.30, "jax-peer": 0.55, "torch-peer": 0.60})}


def _result(model, weights, b, t, bound_ms, fracs, phase="decode"):
    impls = {i: {"ms": bound_ms / f, "tokens_per_s": b / (bound_ms / f / 1e3), "frac_of_bound": f,
                 "kernels_per_step": 200.0 if i == "ours" else None} for i, f in fracs.items()}
    if "torch-peer" not in impls:
        impls["torch-peer"] = {"skip": "MatMulNBits weights: ..."}
    return {"model": model, "model_alias": model, "weights": weights, "weight_bits": 4 if weights == "int4" else 16,
            "batch": b, "ctx": t, "phase": phase, "bound_ms": bound_ms, "impls": impls}


def _write(path, results, suite="e2e"):
    path.write_text(json.dumps({"suite": suite, "gpu": ENV["gpu"], "env": ENV, "results": results}))


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    _write(d / "e2e-h200.json", [_result(*k, *v) for k, v in CASES.items()])
    return d


def test_load_e2e_records(results_dir):
    recs = plots.load_e2e(results_dir)
    assert len(recs) == sum(len(v[1]) for v in CASES.values())  # skipped impls left out
    for (model, weights, b, t), (bound, fracs) in CASES.items():
        for impl, f in fracs.items():
            r, = plots.select(recs, model=model, weights=weights, batch=b, ctx=t, impl=impl)
            assert r["frac"] == f and r["gpu"] == "NVIDIA H200" and r["phase"] == "decode"
            assert r["tokens_per_s"] == pytest.approx(b / (bound / f / 1e3))
    # the kernel figures do not read whole-model results
    with pytest.raises(plots.NoResults):
        plots.load_results(results_dir)


def test_a_later_run_replaces_a_case(results_dir):
    key = ("llama-3.2-1b", "fp16", 1, 2048)
    _write(results_dir / "zz-rerun.json", [_result(*key, 0.62, {"ours": 0.5, "jax-peer": 0.4})])
    recs = plots.select(plots.load_e2e(results_dir), model=key[0], weights=key[1], batch=1, ctx=2048)
    assert sorted((r["impl"], r["frac"]) for r in recs) == [("jax-peer", 0.4), ("ours", 0.5)]


def test_runs_of_one_day_are_ordered_by_when_they_ran_not_by_their_hash(results_dir):
    # Names are <date>-<commit>-...: the same day's files would sort by the hashes' spelling. The
    # run that ended later (its `measured` time) replaces the case, whatever its name.
    key = ("llama-3.2-1b", "fp16", 1, 2048)
    for name, measured, frac in [("2026-12-03-b00d575-e2e.json", "2026-12-03T20:40:00Z", 0.61),
                                 ("2026-12-03-c5a0183-e2e.json", "2026-12-03T09:00:00Z", 0.33)]:
        doc = {"suite": "e2e", "gpu": ENV["gpu"], "env": ENV, "measured": measured,
               "results": [_result(*key, 0.62, {"ours": frac, "jax-peer": 0.4})]}
        (results_dir / name).write_text(json.dumps(doc))
    recs = plots.select(plots.load_e2e(results_dir), model=key[0], weights=key[1], batch=1, ctx=2048, impl="ours")
    assert [(r["frac"], r["source"]) for r in recs] == [(0.61, "2026-12-03-b00d575-e2e.json")]


def test_missing_e2e_results_say_how_to_measure(tmp_path):
    with pytest.raises(plots.NoResults, match="bench e2e"):
        plots.load_e2e(tmp_path / "nowhere")


def test_plot_e2e_draws_every_case(results_dir):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    fig = plots.plot_e2e(plots.load_e2e(results_dir))
    # One panel per (model, weights), two a row: tokens/s above the fraction of the bound.
    assert [sub.get_suptitle() for sub in fig.subfigs[:3]] == [
        "~8B fp16 (llama-3.1-8b)", "~1B fp16 (llama-3.2-1b)", "~1B int4 (llama-3.2-1b)"]
    axes = fig.axes
    assert len(axes) == 6
    tops, bottoms = axes[0::2], axes[1::2]
    assert [len(top.patches) for top in tops] == [3, 3, 2]  # a bar per impl measured at each case
    assert [[t.get_text() for t in ax.get_xticklabels()] for ax in bottoms] == [["B=1 T=8k"], ["B=1 T=2k"],
                                                                              ["B=8 T=2k"]]
    assert [t.get_text() for t in axes[0].get_legend().get_texts()] == ["ours", "jax-peer", "torch-peer"]
    # An A/B form of ours joins the figure only when asked.
    variant = [dict(r, impl="ours[ab]") for r in plots.select(plots.load_e2e(results_dir), impl="ours")]
    assert len(plots.plot_e2e(plots.load_e2e(results_dir) + variant).axes[0].patches) == 3
    assert len(plots.plot_e2e(plots.load_e2e(results_dir) + variant, variants=True).axes[0].patches) == 4
    empty = plots.plot_e2e([], "prefill")
    assert "no e2e prefill results" in empty.axes[0].texts[0].get_text()


def test_regenerate_and_tool_write_the_e2e_figure(results_dir, tmp_path):
    pytest.importorskip("matplotlib")
    # regenerate needs the kernel results too: one decode case in the decode harness's schema
    (results_dir / "decode.json").write_text(json.dumps({"suite": "decode", "env": ENV, "results": [
        {"batch": 1, "ctx": 4096, "q_len": 1, "q_heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16",
         "impls": {"ours": {"us": 20.0}, "jax-cudnn": {"us": 30.0}}}]}))
    tool = [sys.executable, str(ROOT / "tools" / "plot_bench.py")]
    ok = subprocess.run(tool + ["--results", str(results_dir), "--out", str(tmp_path / "img")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    png = tmp_path / "img" / "e2e_decode.png"
    assert f"wrote {png}" in ok.stdout
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
