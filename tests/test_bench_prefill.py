"""The prefill benchmark harness on CPU: ours needs an sm_90 GPU (skipped, with the reason), the xla
peer is timed, the JSON has the schema the figures read, and the figures read it as prefill. Issue 14's
cases: chunked prefill and ragged rows (their FLOPs, lengths, command line), the peers' skip reasons
and notes, and an oracle: the jax-xla peer as the bench calls it (bottom-right mask, per-row lengths)
against the engine's reference `ops.reference.prefill.prefill_attention`."""

import argparse
import json
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn.bench import __main__ as bench_main
from jax_onnx_attn.bench import plots, prefill
from jax_onnx_attn.ops.reference.prefill import prefill_attention as reference


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


# --------------------------------------------------------------------------------------------------
# Ragged rows, chunked prefill, the peers (issue 14)


def _case(**kw):
    base = dict(batch=2, seq=2048, q_heads=32, kv_heads=8, head_dim=128, dtype="bf16", causal=True)
    return prefill.Case(**{**base, **kw})


def test_prefill_suite_stops_starting_cases_past_its_budget(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rc = bench_main.main(["prefill", "--seqlens", "32", "--tokens", "32", "--heads", "4/2", "--dims", "256",
                          "96", "--causal", "causal", "--impls", "jax-xla", "--calls", "2", "--target-ms", "2",
                          "--reps", "2", "--max-seconds", "0", "--out", str(out)])
    assert rc == 0 and not out.exists()
    assert "time budget reached: stopping before B1 S32 4/2 d256 bf16 causal" in capsys.readouterr().out


def test_flops_count_the_visible_pairs():
    per_pair = 4 * 32 * 128  # 4·Hq·D
    self_causal = _case()
    assert self_causal.kind == "self" and self_causal.keys == 2048
    assert self_causal.flops == per_pair * 2 * 2048 * 2048 / 2  # the former count
    assert _case(causal=False).flops == per_pair * 2 * 2048 * 2048
    chunk = _case(ctx=30720)
    assert chunk.kind == "chunked" and chunk.q_lens == (2048, 2048) and chunk.kv_lens == (30720, 30720)
    # causal: the whole cache of T - S keys, then a triangle of the chunk
    assert chunk.flops == per_pair * 2 * (2048 * (30720 - 2048) + 2048 ** 2 / 2)
    assert _case(ctx=30720, causal=False).flops == per_pair * 2 * 2048 * 30720
    ragged = _case(lengths=(1500, 2048))
    assert ragged.kind == "ragged" and ragged.q_lens == ragged.kv_lens == (1500, 2048)
    assert ragged.flops == per_pair * (1500 ** 2 + 2048 ** 2) / 2
    assert _case(lengths=(1500, 2048), causal=False).flops == per_pair * (1500 ** 2 + 2048 ** 2)
    assert [c.label() for c in (self_causal, chunk, ragged)] == [
        "B2 S2048 32/8 d128 bf16 causal", "B2 S2048 T30720 32/8 d128 bf16 causal",
        "B2 S2048 ragged 32/8 d128 bf16 causal"]
    with pytest.raises(ValueError, match="T >= S"):
        _case(ctx=1024)
    with pytest.raises(ValueError, match="ragged rows"):
        _case(lengths=(10,))


def test_ragged_lengths_are_deterministic_and_in_range():
    for b, s in ((1, 4096), (4, 4096), (16, 1024), (3, 7)):
        lens = prefill.ragged_lengths(b, s)
        assert lens == prefill.ragged_lengths(b, s) and len(lens) == b
        assert all(s // 2 <= n <= s for n in lens)
    assert len(set(prefill.ragged_lengths(16, 1024))) > 8  # rows really differ


def test_command_line_cases():
    args = prefill.parse_args(["--seqlens", "1024", "4096", "--tokens", "8192", "--causal", "causal",
                               "--ragged", "--chunked", "2048:30720", "512:8192", "--impls", "jax-xla"])
    assert args.chunked == [(2048, 30720), (512, 8192)] and args.ragged == []
    cases = prefill.default_cases(args)
    assert [(c.kind, c.batch, c.seq, c.keys) for c in cases] == [
        ("self", 8, 1024, 1024), ("ragged", 8, 1024, 1024), ("self", 2, 4096, 4096),
        ("ragged", 2, 4096, 4096), ("chunked", 4, 2048, 30720), ("chunked", 16, 512, 8192)]
    assert cases[1].lengths == prefill.ragged_lengths(8, 1024)
    # ragged at chosen S only, no self-attention cases, chunked B given
    args = prefill.parse_args(["--seqlens", "--ragged", "4096", "--chunked", "2048:8192",
                               "--chunk-batch", "1", "--causal", "noncausal"])
    assert [(c.kind, c.batch, c.seq, c.causal) for c in prefill.default_cases(args)] == [
        ("ragged", 4, 4096, False), ("chunked", 1, 2048, False)]
    assert prefill.parse_args([]).ragged is None and not prefill.parse_args([]).chunked
    # the default grid is unchanged: causal and not x S = 1k .. 16k with B·S = 16k
    assert [(c.batch, c.seq, c.causal) for c in prefill.default_cases(prefill.parse_args([]))] == [
        (16384 // s, s, causal) for causal in (True, False) for s in (1024, 2048, 4096, 8192, 16384)]
    for bad in (["--chunked", "3:2"], ["--chunked", "2048"], ["--part", "0/4"], ["--part", "x"]):
        with pytest.raises(SystemExit):
            prefill.parse_args(bad)


def test_issue14_preset_and_parts():
    args = prefill.parse_args(["--issue14", "--part", "2/8"])
    assert args.seqlens[0] == 512 and args.seqlens[-1] == 32768 and args.tokens == 32768
    assert args.chunked == [(2048, 8192), (2048, 30720)] and args.part == (2, 8)
    assert (args.target_ms, args.reps) == (30.0, 3) and args.impls == ["ours", *prefill.PEERS]
    # options given beside the preset win over its values
    mine = prefill.parse_args(["--issue14", "--dtypes", "fp16", "--reps", "5", "--impls", "jax-xla"])
    assert (mine.dtypes, mine.reps, mine.impls, mine.tokens) == (["fp16"], 5, ["jax-xla"], 32768)
    assert prefill.parse_args(["--dtypes", "fp16"]).dtypes == ["fp16"]  # and nothing is lost without it
    cases = prefill.default_cases(args)
    assert len(cases) == 2 * 2 * 3 * 2 * (7 + 2 + 2) == 264
    kinds = {c.kind for c in cases}
    assert kinds == {"self", "ragged", "chunked"}
    parts = [prefill.select_part(cases, (k, 8)) for k in range(1, 9)]
    assert sorted(map(id, sum(parts, []))) == sorted(map(id, cases))  # each case in one part
    assert parts[1][0] is cases[1] and max(map(len, parts)) - min(map(len, parts)) <= 1


def test_ours_and_its_pinned_schedules():
    assert prefill.parse_args([]).impls == ["ours", "ours-serial", "ours-overlap", *prefill.PEERS]
    assert set(prefill.IMPLS) >= {"ours-pingpong", "jax-mosaic", "torch-flash", "torch-cudnn"}


def test_tuned_schedules_are_opt_in_impls():
    """The tuned pingpong kernels (params.h kScheduleSpecs) are impls "ours-<schedule>" the bench
    accepts but does not run by default; their schedule names are the extension's."""
    assert prefill.TUNED_IMPLS == ("ours-pingpong-fold", "ours-pingpong-lazy", "ours-pingpong-fold-lazy",
                                   "ours-pingpong-n176", "ours-pingpong-fold-lazy-n176", "ours-pingpong-fold-lazy-s4",
                                   "ours-pingpong-n192", "ours-pingpong-fold-lazy-n192",
                                   "ours-pingpong-fold-lazy-n192-s4", "ours-pingpong-fold-lazy-m192",
                                   "ours-pingpong-fold-lazy-m192-s4")
    assert not set(prefill.TUNED_IMPLS) & set(prefill.DEFAULT_IMPLS)
    assert prefill.parse_args(["--impls", "ours", *prefill.TUNED_IMPLS]).impls == ["ours", *prefill.TUNED_IMPLS]
    from jax_onnx_attn import _extension
    if _extension._ffi is not None:
        from jax_onnx_attn.ops import cuda
        assert {i.partition("-")[2] for i in prefill.TUNED_IMPLS} <= set(cuda.PREFILL_SCHEDULES)


def test_nosplit_is_an_opt_in_impl(monkeypatch):
    """"ours-nosplit" (split-KV off, splits=1) runs only when named and passes splits=1 and no
    schedule; "ours" leaves the splits to the plan."""
    assert prefill.SPLIT_IMPLS == ("ours-nosplit",) and "ours-nosplit" not in prefill.DEFAULT_IMPLS
    assert prefill.parse_args(["--impls", "ours", "ours-nosplit"]).impls == ["ours", "ours-nosplit"]
    from jax_onnx_attn.ops import cuda
    seen = []
    monkeypatch.setattr(cuda, "prefill_attention", lambda *a, **kw: seen.append(kw))
    case = prefill.Case(batch=1, seq=16, q_heads=4, kv_heads=1, head_dim=64, dtype="bf16", causal=True,
                        ctx=256)
    for impl in ("ours", "ours-nosplit"):
        fn, layout = prefill.jax_attention(case, impl)
        fn(None, None, None)
    assert "splits" not in seen[0] and "schedule" not in seen[0]
    assert seen[1]["splits"] == 1 and "schedule" not in seen[1]


def test_persistent_is_an_opt_in_impl(monkeypatch):
    """"ours-persistent" / "ours-nopersistent" run only when named and pass persistent=True / False
    and no schedule or splits; "ours" leaves it to the switch."""
    assert prefill.PERSISTENT_IMPLS == ("ours-persistent", "ours-nopersistent")
    assert not set(prefill.PERSISTENT_IMPLS) & set(prefill.DEFAULT_IMPLS)
    impls = ["ours", *prefill.PERSISTENT_IMPLS]
    assert prefill.parse_args(["--impls", *impls]).impls == impls
    from jax_onnx_attn.ops import cuda
    seen = []
    monkeypatch.setattr(cuda, "prefill_attention", lambda *a, **kw: seen.append(kw))
    case = prefill.Case(batch=1, seq=16, q_heads=4, kv_heads=1, head_dim=64, dtype="bf16", causal=True,
                        ctx=256)
    for impl in impls:
        fn, layout = prefill.jax_attention(case, impl)
        fn(None, None, None)
    assert "persistent" not in seen[0]
    assert seen[1] == {"scale": seen[0]["scale"], "causal": True, "persistent": True}
    assert seen[2] == {"scale": seen[0]["scale"], "causal": True, "persistent": False}


def test_skip_reasons_and_notes():
    skip, note = prefill._impl_skip, prefill._impl_note
    fp16 = dict(dtype="fp16")
    assert "fp16 only" in skip(_case(), "jax-mosaic")
    assert "per-row lengths" in skip(_case(lengths=(9, 2048), **fp16), "jax-mosaic")
    assert "top-left" in skip(_case(ctx=8192, **fp16), "jax-mosaic")
    assert "needs D % 64" in skip(_case(seq=1000, **fp16), "jax-mosaic")
    # fp16, non-causal chunk, S % 128 and T % 128: only the platform (no GPU here) stops it
    assert skip(_case(ctx=8192, causal=False, **fp16), "jax-mosaic") == prefill._mosaic_status()
    assert "per-row lengths" in skip(_case(lengths=(9, 2048)), "torch-flash")
    assert skip(_case(), "torch-cudnn") == prefill._torch_status()
    assert "xla logits" in skip(_case(batch=8, ctx=30720), "jax-xla")
    assert skip(_case(batch=1, seq=64, ctx=256), "jax-xla") is None
    assert "explicit bool mask" in note(_case(ctx=8192), "jax-cudnn")
    assert "query_seq_lengths" in note(_case(lengths=(9, 2048)), "jax-xla")
    assert note(_case(), "jax-cudnn") is None and note(_case(ctx=8192, causal=False), "jax-xla") is None
    assert "causal_lower_right" in note(_case(ctx=8192), "torch-flash")
    assert "materialised" in note(_case(ctx=8192), "torch-cudnn")
    assert "GQA native" in note(_case(**fp16), "jax-mosaic")
    assert note(_case(), "ours") is None


def test_bottom_right_mask():
    mask = np.asarray(prefill.bottom_right_mask(3, 4))
    assert mask.shape == (1, 1, 3, 4)
    assert mask[0, 0].astype(int).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    assert np.array_equal(np.asarray(prefill.bottom_right_mask(5, 5))[0, 0], np.tril(np.ones((5, 5), bool)))


def _peer_vs_reference(case, impl="jax-xla"):
    """The peer's rows (BTNH, as the bench calls it) and the reference's, both as BHSD float32."""
    attn, layout = prefill.jax_attention(case, impl)
    assert layout == "BTNH"
    ks = jax.random.split(jax.random.PRNGKey(0), 3)
    q_shape, kv_shape = prefill.shapes(case, "BHSD")
    q, k, v = (jax.random.normal(key, shape, jnp.float16)
               for key, shape in zip(ks, (q_shape, kv_shape, kv_shape)))
    got = attn(*(x.transpose(0, 2, 1, 3) for x in (q, k, v))).transpose(0, 2, 1, 3)
    want = reference(q, k, v, jnp.asarray(case.q_lens), jnp.asarray(case.kv_lens),
                     scale=case.head_dim ** -0.5, causal=case.causal)
    return np.asarray(got, np.float32), np.asarray(want, np.float32)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_chunked_peer_computes_the_engines_rows(causal):
    # A 5-query chunk at the bottom right of 12 keys: the peer with bottom_right_mask (causal) is
    # the reference of our engine (q_len = S, kv_len = T).
    case = prefill.Case(2, 5, 4, 2, 16, "fp16", causal, ctx=12)
    got, want = _peer_vs_reference(case)
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=2e-3)
    if causal:  # and not what jax's own (top-left) causal flag gives
        top_left = prefill.jax_attention(prefill.Case(2, 5, 4, 2, 16, "fp16", True, ctx=12), "jax-xla")
        assert top_left[1] == "BTNH"
        ks = jax.random.split(jax.random.PRNGKey(0), 3)
        q = jax.random.normal(ks[0], (2, 5, 4, 16), jnp.float16)
        k = jax.random.normal(ks[1], (2, 12, 2, 16), jnp.float16)
        plain = jax.nn.dot_product_attention(q, k, k, is_causal=True, implementation="xla")
        masked = top_left[0](q, k, k)
        assert not np.allclose(np.asarray(plain, np.float32), np.asarray(masked, np.float32), atol=1e-2)


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_ragged_peer_computes_the_engines_rows(causal):
    case = prefill.Case(3, 8, 4, 2, 16, "fp16", causal, lengths=(4, 8, 6))
    got, want = _peer_vs_reference(case)
    for b, n in enumerate(case.lengths):  # the real rows (the padding's output is not compared)
        np.testing.assert_allclose(got[b, :, :n], want[b, :, :n], atol=2e-3, rtol=2e-3)


def test_new_cases_run_on_cpu_and_plot(tmp_path, capsys):
    out = tmp_path / "prefill.json"
    rc = bench_main.main(["prefill", "--seqlens", "64", "--tokens", "128", "--heads", "4/2", "--dims", "64",
                          "--ragged", "--chunked", "32:96", "--impls", "jax-xla", "jax-mosaic",
                          "torch-flash", "--calls", "2", "--target-ms", "2", "--reps", "2",
                          "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    kinds = [r["kind"] for r in doc["results"]]
    assert kinds == ["self", "ragged", "chunked"] * 2
    for res in doc["results"]:
        assert res["impls"]["jax-xla"]["tflops"] > 0
        assert "skip" in res["impls"]["jax-mosaic"] and "skip" in res["impls"]["torch-flash"]
        if res["kind"] == "ragged":
            assert len(res["lengths"]) == res["batch"] == 2
        if res["kind"] == "chunked":
            assert (res["q_len"], res["ctx"], res["batch"]) == (32, 96, 4)
            assert ("note" in res["impls"]["jax-xla"]) == res["causal"]
    recs = plots.load_files([out], ("prefill",))
    assert sum(r["ragged"] for r in recs) == 2 and len(recs) == 6  # ragged twins are their own cases
    pytest.importorskip("matplotlib")
    png = tmp_path / "prefill.png"
    assert plots.main(["prefill", str(out), "--out", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    other = tmp_path / "decode.json"
    other.write_text(json.dumps({"suite": "decode", "results": []}))
    assert plots.main(["prefill", str(other), "--out", str(tmp_path / "x.png")]) == 1
    assert "no prefill measurements" in capsys.readouterr().err


def test_chunk_spec_parser():
    assert prefill.parse_chunk("2048:30720") == (2048, 30720)
    with pytest.raises(argparse.ArgumentTypeError):
        prefill.parse_chunk("0:5")


def test_the_committed_run_reads_with_todays_names():
    # 2026-12-01-4fae144-prefill.json named the serial schedule "ours"; the default (pingpong) is
    # "ours" when read (plots.IMPL_ALIASES), so the figure's ours is what the model path runs.
    path = plots.RESULTS_DIR / "2026-12-01-4fae144-prefill.json"
    root = Path(__file__).resolve().parent.parent
    recs = plots.load_files([root / path], ("prefill",))
    ours, = plots.select(recs, impl="ours", batch=4, q_len=4096, causal=True)
    serial, = plots.select(recs, impl="ours-serial", batch=4, q_len=4096, causal=True)
    assert round(ours["tflops"]) == 488 and round(serial["tflops"]) == 458
    assert not plots.select(recs, impl="ours-pingpong")
    # the figures read bench/results/ and take the newest run of each case: the last file (in name
    # order: date, then commit) that measured "ours" on it, whichever that is as runs are committed
    latest = plots.load_results(root / plots.RESULTS_DIR)
    assert path.name not in {r["source"] for r in plots.select(latest, phase="prefill")}
    case = dict(impl="ours", batch=1, q_len=16384, causal=True, head_dim=128, dtype="bfloat16")
    tuned = plots.select(latest, **case)
    files = sorted((root / plots.RESULTS_DIR).glob("*.json"))
    runs = [f.name for f in files if plots.select(plots.load_files([f], ("prefill",)), **case)]
    assert len(runs) >= 2 and [r["source"] for r in tuned] == [runs[-1]]
    assert tuned[0]["tflops"] > 0
