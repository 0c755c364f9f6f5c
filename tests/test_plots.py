"""jax_onnx_attn.bench.plots and tools/plot_bench.py on a small synthetic results folder.

The synthetic JSON follows the benchmark harness's schema (`python -m jax_onnx_attn.bench decode
--out`). Its peer numbers are the project's H200 baseline (bf16, 32 query / 8 KV heads, head size
128), entered as per-call times, so the derived metrics are checked against the published figures.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from jax_onnx_attn.bench import plots

ROOT = Path(__file__).resolve().parent.parent
SHAPE = dict(q_heads=32, kv_heads=8, head_dim=128, dtype="bf16")
ENV = {"gpu": "name, driver_version, clocks.sm [MHz]\nNVIDIA H200, 580.159.04, 1980 MHz",
       "commit": "0c4ee63"}
#: (B, context) -> effective GB/s of one-token decode.
DECODE = {(1, 4096): {"jax-xla": 238.0, "jax-cudnn": 148.0, "torch-flash": 547.0},
          (8, 8192): {"jax-xla": 1161.0, "jax-cudnn": 3299.0, "torch-flash": 3637.0},
          (8, 16384): {"jax-xla": 1286.0, "jax-cudnn": 4349.0, "torch-flash": 2728.0}}
#: (B, S) -> TFLOP/s of causal prefill.
PREFILL = {(1, 2048): {"jax-cudnn": 342.6, "torch-flash": 208.8},
           (4, 4096): {"jax-cudnn": 574.5, "torch-flash": 326.1}}


def _flat(b, ctx, q_len, causal=True):
    return dict(batch=b, q_len=q_len, kv_len=ctx, causal=causal, q_heads=32, kv_heads=8,
                head_dim=128, dtype="bfloat16")


def _decode_case(b, ctx, gbps):
    """A harness result: times from GB/s; ours at half the best peer; one skipped peer."""
    us = {impl: plots.kv_bytes(_flat(b, ctx, 1)) / (v * 1e9) * 1e6 for impl, v in gbps.items()}
    us[plots.OURS] = min(us.values()) * 2
    impls = {impl: {"us": t} for impl, t in us.items()}
    impls["torch-cudnn"] = {"skip": "error: RuntimeError: no kernel"}
    return dict(batch=b, ctx=ctx, q_len=1, label=f"B={b} ctx={ctx}", impls=impls, **SHAPE)


def _prefill_case(b, s, tflops):
    us = {impl: plots.flops(_flat(b, s, s)) / (v * 1e12) * 1e6 for impl, v in tflops.items()}
    us[plots.OURS] = us["jax-cudnn"] / 1.1
    return dict(batch=b, ctx=s, q_len=s, causal=True, impls={i: {"us": t} for i, t in us.items()},
                **SHAPE)


def _write(path, suite, results):
    path.write_text(json.dumps({"suite": suite, "env": ENV, "results": results}))


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "results"
    d.mkdir()
    _write(d / "decode-h200.json", "decode", [_decode_case(b, c, v) for (b, c), v in DECODE.items()])
    _write(d / "prefill-h200.json", "prefill", [_prefill_case(b, s, v) for (b, s), v in PREFILL.items()])
    return d


N_RECORDS = 4 * len(DECODE) + 3 * len(PREFILL)  # skipped impls are left out


def test_records_and_derived_metrics(results_dir):
    recs = plots.load_results(results_dir)
    assert len(recs) == N_RECORDS
    assert {r["gpu"] for r in recs} == {"NVIDIA H200"}
    assert not plots.select(recs, impl="torch-cudnn")
    for (b, ctx), peers in DECODE.items():
        for impl, gbps in peers.items():
            r, = plots.select(recs, impl=impl, phase="decode", batch=b, kv_len=ctx)
            assert r["gbps"] == pytest.approx(gbps)
            assert r["dtype"] == "bfloat16" and r["q_len"] == 1
            # decode attention sits far left of the H200 ridge point (~206 FLOP/B): memory bound
            assert r["intensity"] < 10
    for (b, s), peers in PREFILL.items():
        for impl, tflops in peers.items():
            r, = plots.select(recs, impl=impl, phase="prefill", batch=b, kv_len=s)
            assert r["tflops"] == pytest.approx(tflops)
            assert r["intensity"] > 206


def test_harness_gbs_is_used_when_given(tmp_path):
    case = _decode_case(1, 4096, {"jax-xla": 238.0})
    case["impls"]["jax-xla"]["gbs"] = 123.0
    _write(tmp_path / "a.json", "decode", [case])
    r, = plots.select(plots.load_results(tmp_path), impl="jax-xla")
    assert r["gbps"] == 123.0


def test_metric_definitions():
    r = _flat(1, 2048, 2048)
    assert plots.flops(r) == plots.flops({**r, "causal": False}) / 2  # causal counts half
    assert plots.flops({**r, "causal": False}) == 4 * 32 * 2048 * 2048 * 128
    # the baseline's decode figure: B=1, T=4096 in 70 us is about 238 GB/s
    assert plots.kv_bytes(_flat(1, 4096, 1)) / 70e-6 / 1e9 == pytest.approx(240, rel=0.01)


def test_gpu_name():
    assert plots.gpu_name(ENV) == "NVIDIA H200"
    assert plots.gpu_name({"gpu": "NVIDIA H200"}) == "NVIDIA H200"
    assert plots.gpu_name({}) is None
    assert plots.hardware_for("NVIDIA H200") is plots.H200
    assert plots.hardware_for("NVIDIA H100 80GB HBM3") is None
    assert plots.H200.hbm_gbps == 4800 and plots.H200.peak("bfloat16") == 989


def test_a_later_run_of_a_case_replaces_all_its_measurements(results_dir):
    # The rerun measures ours and jax-xla only: the older run's other peers at that case are not set
    # against the new ours (numbers count only side by side); other cases keep the older run.
    _write(results_dir / "zz-decode-rerun.json", "decode", [_decode_case(1, 4096, {"jax-xla": 400.0})])
    recs = plots.load_results(results_dir)
    r, = plots.select(recs, impl="jax-xla", batch=1, kv_len=4096)
    assert r["gbps"] == pytest.approx(400.0) and r["source"] == "zz-decode-rerun.json"
    ours, = plots.select(recs, impl=plots.OURS, batch=1, kv_len=4096)
    assert ours["source"] == "zz-decode-rerun.json"
    assert not plots.select(recs, impl="jax-cudnn", batch=1, kv_len=4096)
    assert len(plots.select(recs, impl="jax-cudnn", phase="decode")) == len(DECODE) - 1
    assert len(recs) == N_RECORDS - 2


def test_kernel_runs_of_one_day_are_ordered_by_when_they_ran_not_by_their_hash(results_dir):
    # <date>-<commit>-... names of one day sort by the hashes' spelling; the run that ended later
    # (its `measured` time) replaces the case, as in the e2e figures (plots._run_order).
    for name, measured, gbps in [("2026-12-03-78b319e-decode.json", "2026-12-03T23:30:00Z", 900.0),
                                 ("2026-12-03-8130647-decode.json", "2026-12-03T22:40:00Z", 300.0)]:
        doc = {"suite": "decode", "measured": measured, "env": ENV,
               "results": [_decode_case(1, 4096, {"jax-xla": gbps})]}
        (results_dir / name).write_text(json.dumps(doc))
    r, = plots.select(plots.load_results(results_dir), impl="jax-xla", batch=1, kv_len=4096)
    assert (r["gbps"], r["source"]) == (pytest.approx(900.0), "2026-12-03-78b319e-decode.json")


def test_a_later_peers_only_run_does_not_displace_a_run_with_ours(results_dir):
    case = _decode_case(8, 8192, {"jax-xla": 10.0})
    del case["impls"][plots.OURS]
    _write(results_dir / "zz-peers-only.json", "decode", [case])
    recs = plots.load_results(results_dir)
    assert {r["source"] for r in plots.select(recs, batch=8, kv_len=8192)} == {"decode-h200.json"}
    assert len(recs) == N_RECORDS


def test_ratio_table(results_dir):
    rows = plots.ratio_table(plots.load_results(results_dir))
    assert len(rows) == 3 * len(DECODE) + 2 * len(PREFILL)
    for row in rows:
        peers = (DECODE if row["phase"] == "decode" else PREFILL)[(row["batch"], row["kv_len"])]
        if row["phase"] == "decode":
            assert row["ratio"] == pytest.approx(max(peers.values()) / 2 / peers[row["peer"]])
        elif row["peer"] == "jax-cudnn":
            assert row["ratio"] == pytest.approx(1.1)


def test_missing_results_say_what_to_do(tmp_path):
    with pytest.raises(plots.NoResults, match=r"has no \*.json.*jax_onnx_attn.bench decode"):
        plots.load_results(tmp_path / "nowhere")
    _write(tmp_path / "empty.json", "decode", [])
    with pytest.raises(plots.NoResults, match="hold no measurements"):
        plots.load_results(tmp_path)


def test_bad_result_names_its_file(tmp_path):
    bad = _decode_case(1, 4096, {"jax-xla": 238.0})
    del bad["head_dim"]
    _write(tmp_path / "bad.json", "decode", [bad])
    with pytest.raises(ValueError, match=r"bad.json: a result lacks \['head_dim'\]"):
        plots.load_results(tmp_path)


def test_regenerate_writes_every_figure(results_dir, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    written = plots.regenerate(results_dir, tmp_path / "images")
    assert sorted(p.name for p in written) == ["decode_gbps.png", "prefill_tflops.png", "roofline.png"]
    for p in written:
        assert p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and p.stat().st_size > 10_000


def test_tool_script(results_dir, tmp_path):
    pytest.importorskip("matplotlib")
    tool = [sys.executable, str(ROOT / "tools" / "plot_bench.py")]
    ok = subprocess.run(tool + ["--results", str(results_dir), "--out", str(tmp_path / "img")],
                        capture_output=True, text=True, timeout=300)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.count("wrote ") == 3
    empty = subprocess.run(tool + ["--results", str(tmp_path / "none"), "--out", str(tmp_path / "x")],
                           capture_output=True, text=True, timeout=300)
    assert empty.returncode == 1
    assert "no benchmark results to plot" in empty.stderr
    assert not (tmp_path / "x").exists()


def _gqa_case(b, ctx, kv_bits, cuda_us, reference_us):
    """A `bench gqa` result: one whole GroupQueryAttention step, our kernels vs the XLA reference."""
    return dict(batch=b, ctx=ctx, q_len=1, kv_bits=kv_bits, label=f"B={b} ctx={ctx}",
                impls={"cuda": {"us": cuda_us}, "reference": {"us": reference_us}}, **SHAPE)


def test_gqa_steps_are_read_apart_and_drawn(results_dir, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    steps = [_gqa_case(1, 4096, 0, 18.0, 19.0), _gqa_case(8, 32768, 8, 312.4, 739.9)]
    _write(results_dir / "gqa-h200.json", "gqa", steps)
    # The kernel figures do not see whole-step results ...
    assert len(plots.load_results(results_dir)) == N_RECORDS
    # ... which load on their own, "cuda" playing ours.
    recs = plots.load_results(results_dir, ("gqa",), plots.STEP_OURS)
    rows = sorted(plots.ratio_table(recs, plots.STEP_OURS), key=lambda r: r["batch"])
    assert [(r["peer"], r["kv_bits"]) for r in rows] == [("reference", 0), ("reference", 8)]
    assert [r["ratio"] for r in rows] == pytest.approx([19.0 / 18.0, 739.9 / 312.4])
    written = plots.regenerate(results_dir, tmp_path / "images")
    assert "gqa_step.png" in [p.name for p in written]
    with pytest.raises(plots.NoResults, match="bench gqa"):
        plots.load_results(tmp_path / "nowhere", ("gqa",), plots.STEP_OURS)


def test_longer_query_rows_get_their_own_decode_figure(results_dir, tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib

    matplotlib.use("Agg")
    case = _decode_case(8, 8192, {"jax-cudnn": 1200.0})
    case.update(q_len=16, label="B=8 ctx=8192 S=16")
    _write(results_dir / "zz-verify.json", "decode", [case])
    names = sorted(p.name for p in plots.regenerate(results_dir, tmp_path / "images"))
    assert names == ["decode_gbps.png", "decode_gbps_s16.png", "prefill_tflops.png", "roofline.png"]
