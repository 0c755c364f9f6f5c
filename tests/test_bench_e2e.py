"""The e2e benchmark harness on CPU: a tiny preset end to end (ours on the reference backend, the JAX
peer with XLA attention, torch eagerly where it is installed), valid JSON in the suite's schema, the
peers' greedy tokens equal to ours, and the harness's own rules (case order, budget, memory, trace
parsing). Speeds are not asserted."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from jax_onnx_attn.bench import __main__ as bench_main
from jax_onnx_attn.bench import e2e
from jax_onnx_attn.models import preset

STEPS = 2
ARGS = ["--models", "tiny", "--batch", "1", "--ctx", "32", "--steps", str(STEPS), "--max-calls", "2",
        "--reps", "2", "--prefill-reps", "1", "--target-ms", "1"]


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One run over fp16 and int4 tiny models; returns the JSON document."""
    d = tmp_path_factory.mktemp("e2e")
    out = d / "e2e.json"
    rc = bench_main.main(["e2e", *ARGS, "--weights", "fp16", "int4", "--models-dir", str(d / "models"),
                          "--out", str(out)])
    assert rc == 0
    return json.loads(out.read_text())


def test_json_schema(run):
    assert run["suite"] == "e2e"
    assert {"gpu", "versions", "commit", "env", "results", "verify", "models", "skipped"} <= set(run)
    assert run["versions"]["jax"] and run["env"]["gemm_peak_tflops"] > 0
    phases = sorted((r["weights"], r["phase"]) for r in run["results"])
    assert phases == [("fp16", "decode"), ("fp16", "prefill"), ("int4", "decode"), ("int4", "prefill")]
    for r in run["results"]:
        assert (r["model"], r["batch"], r["ctx"]) == ("tiny", 1, 32)
        assert r["weight_bits"] == (16 if r["weights"] == "fp16" else 4)
        assert r["capacity"] % 256 == 0 and r["capacity"] >= 32 + (2 + 1) * STEPS
        assert set(r["impls"]) == {"ours", "jax-peer", "torch-peer"}
        for impl in ("ours", "jax-peer"):
            m = r["impls"][impl]
            assert m["ms"] > 0 and "kernels_per_step" in m, (impl, m)
            if r["phase"] == "decode":
                assert m["tokens_per_s"] == pytest.approx(r["batch"] / (m["ms"] / 1e3))
                # the fraction is the roofline bound over the measured step
                assert m["frac_of_bound"] == pytest.approx(r["bound_ms"] / m["ms"])
                assert m["calls_per_sample"] >= 1 and len(m["samples_ms"]) == 2
            else:
                assert m["tokens_per_s"] == pytest.approx(r["tokens"] / (m["ms"] / 1e3))
                assert m["frac_of_gemm_peak"] == pytest.approx(
                    r["flops"] / (m["ms"] / 1e3) / 1e12 / r["gemm_peak_tflops"])
    decode = [r for r in run["results"] if r["phase"] == "decode"]
    # on a CPU the trace has no device events: kernels per step is null, with the reason
    ours = decode[0]["impls"]["ours"]
    assert ours["kernels_per_step"] is None and "no device events" in ours["profile"]["note"]
    # the profiled case's prefills are traced too (ours through generate, the peer's jitted prefill)
    prefill = next(r for r in run["results"] if r["phase"] == "prefill" and r["weights"] == decode[0]["weights"])
    for impl in ("ours", "jax-peer"):
        assert "no device events" in prefill["impls"][impl]["profile"]["note"], impl
    int4 = next(r for r in decode if r["weights"] == "int4")
    skip = int4["impls"]["torch-peer"]["skip"]
    assert "MatMulNBits" in skip or "torch not installed" in skip
    model = run["models"]["tiny/fp16"]
    assert model["params"] == preset("tiny").param_count() and model["step_cost"]["kv_bytes_per_token"] > 0


def test_peers_compute_the_same_model(run):
    """The JAX peer (and torch, where installed) give our greedy tokens step for step."""
    assert [v["weights"] for v in run["verify"]] == ["fp16", "int4"]
    for v in run["verify"]:
        ours = v["tokens"]["ours"]
        assert isinstance(ours, list) and len(ours) == 1 + STEPS
        assert v["tokens"]["jax-peer"] == ours and v["equal"]["jax-peer"]
        torch_tokens = v["tokens"]["torch-peer"]
        if isinstance(torch_tokens, list):
            assert torch_tokens == ours
        else:
            assert "torch not installed" in torch_tokens["skip"] or "MatMulNBits" in torch_tokens["skip"]


def test_every_batch_size_is_verified(tmp_path):
    """Each batch size's first case checks the greedy tokens (a batch size picks its own kernels):
    at B = 1 and 2 ours and the JAX peer agree on every step."""
    out = tmp_path / "e2e.json"
    assert e2e.main([*ARGS[:2], "--batch", "1", "2", *ARGS[4:], "--weights", "fp16", "--impls", "ours", "jax-peer",
                     "--phases", "decode", "--profile", "none", "--models-dir", str(tmp_path), "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert [v["batch"] for v in doc["verify"]] == [1, 2]
    for v in doc["verify"]:
        assert v["equal"] == {"jax-peer": True} and len(v["tokens"]["ours"]) == 1 + STEPS, v


def test_budget_skips_with_a_reason(tmp_path):
    out = tmp_path / "e2e.json"
    assert e2e.main([*ARGS, "--weights", "fp16", "--max-seconds", "0", "--models-dir", str(tmp_path),
                     "--out", str(out)]) == 0
    doc = json.loads(out.read_text())
    assert doc["results"] == [] and [s["why"] for s in doc["skipped"]] == ["time budget"]


def test_memory_rule():
    args = SimpleNamespace(max_calls=8, steps=16)
    config = e2e.model_config(e2e.Case("8b", "fp16", 32, 32768))
    cap = e2e.capacity_for(32768, args)
    assert cap == 33024
    why = e2e.memory_skip(e2e.Case("8b", "fp16", 32, 32768), config, cap, 140 * 2**30)
    assert why and why.startswith("beyond memory")
    assert e2e.memory_skip(e2e.Case("8b", "fp16", 8, 32768), config, cap, 140 * 2**30) is None
    assert e2e.memory_skip(e2e.Case("8b", "fp16", 32, 32768), config, cap, None) is None


def test_case_order_and_quick_subset():
    args = SimpleNamespace(quick=False, models=["1b", "8b"], weights=["fp16", "int4"], batch=[1, 8, 32],
                           ctx=[1024, 2048, 8192, 32768])
    cases = e2e.default_cases(args)
    assert len(cases) == 48
    groups = list(dict.fromkeys((c.model, c.weights) for c in cases))
    assert groups == [("1b", "fp16"), ("1b", "int4"), ("8b", "fp16"), ("8b", "int4")]
    first = [(c.batch, c.ctx) for c in cases[:4]]
    assert first == [(1, 2048), (8, 2048), (32, 2048), (1, 8192)]
    quick = e2e.default_cases(SimpleNamespace(**{**vars(args), "quick": True}))
    assert [c.label() for c in quick] == [f"{m} {w} B={b} ctx={t}" for m, w, b, t in e2e.QUICK]


def _trace(lines):
    """A Chrome trace with one GPU process: (thread name, [event names]) per line."""
    events = [{"ph": "M", "pid": 1, "name": "process_name", "args": {"name": "/host:CPU"}},
              {"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}}]
    for tid, (thread, names) in enumerate(lines):
        events.append({"ph": "M", "pid": 2, "tid": tid, "name": "thread_name", "args": {"name": thread}})
        events += [{"ph": "X", "pid": 2, "tid": tid, "ts": i, "dur": 1, "name": n} for i, n in enumerate(names)]
    events.append({"ph": "X", "pid": 1, "tid": 0, "ts": 0, "dur": 5, "name": "PjitFunction(run)"})
    return events


def test_kernel_count_reads_the_stream_lines():
    events = _trace([("XLA Modules", ["jit_run"]), ("XLA Ops", ["fusion", "gemm", "fusion.1"]),
                     ("Stream #13(Compute)", ["fusion", "gemm_kernel", "fusion_1", "fusion"]),
                     ("Stream #14(MemcpyD2H)", ["MemcpyD2H"])])
    n, info = e2e.count_device_kernels(events)
    assert n == 4 and dict(info["top"])["fusion"] == 2
    assert info["copies_us"] == {"MemcpyD2H": 1.0}  # copies: device time beside the kernels
    # without "Stream" lines, every device line but the derived ones
    n, _ = e2e.count_device_kernels(_trace([("XLA Ops", ["a"]), ("cuda stream 7", ["k1", "k2"])]))
    assert n == 2
    n, info = e2e.count_device_kernels(_trace([])[:1])
    assert n is None and "no device events" in info["note"]


def test_kernel_timeline_finds_the_device_idle_gaps():
    # a [0, 10), b [5, 12) overlaps a; c [20, 25) after an 8 µs gap; d [26, 30) after 1 µs.
    kernels = [{"ts": 0, "dur": 10, "name": "a"}, {"ts": 5, "dur": 7, "name": "b"},
               {"ts": 20, "dur": 5, "name": "c"}, {"ts": 26, "dur": 4, "name": "d"}]
    t = e2e.kernel_timeline(kernels)
    assert t["span_us"] == 30 and t["busy_us"] == 21 and t["idle_us"] == 9
    assert t["largest_gaps"] == [(8.0, "b", "c"), (1.0, "c", "d")]
    assert t["short_gaps_us"] == 9 and t["short_gaps"] == 2  # both up to SHORT_GAP_US
    long = e2e.kernel_timeline(kernels + [{"ts": 60, "dur": 1, "name": "e"}])
    assert long["short_gaps_us"] == 9 and long["idle_us"] == 9 + 30
    assert e2e.kernel_timeline([]) == {}
    # count_device_kernels reports it
    _, info = e2e.count_device_kernels(_trace([("Stream #13(Compute)", ["k1", "k2"])]))
    assert info["span_us"] == 2 and info["idle_us"] == 0


def test_kernel_wall_times_count_an_overlap_once():
    # split [0, 10), combine [2, 12) launched early (waits on split), gemm [12, 20), then gemm again
    # [25, 30) after a gap: the combine adds 2, the rest their durations; the sum is busy_us.
    kernels = [{"ts": 0, "dur": 10, "name": "split"}, {"ts": 2, "dur": 10, "name": "combine"},
               {"ts": 12, "dur": 8, "name": "gemm"}, {"ts": 25, "dur": 5, "name": "gemm"}]
    wall = e2e.kernel_wall_times(kernels)
    assert wall == {"split": 10, "combine": 2, "gemm": 13}
    assert sum(wall.values()) == e2e.kernel_timeline(kernels)["busy_us"]
    events = [{"ph": "M", "pid": 2, "name": "process_name", "args": {"name": "/device:GPU:0"}},
              {"ph": "M", "pid": 2, "tid": 0, "name": "thread_name", "args": {"name": "Stream #13(Compute)"}}]
    events += [{"ph": "X", "pid": 2, "tid": 0, **k} for k in kernels]
    _, info = e2e.count_device_kernels(events)
    assert dict(info["top_wall"]) == {"split": 10, "combine": 2, "gemm": 13}
    assert dict((n, t) for n, _, t in info["top_time"])["combine"] == 10  # the summed duration


def test_command_buffers_during_profiling_flag_only_where_xla_knows_it(tmp_path):
    knows, old = tmp_path / "xla_cuda_plugin.so", tmp_path / "libjax_common.so"
    knows.write_bytes(b"\0xla_gpu_enable_command_buffer\0" + e2e.COMMAND_BUFFERS_DURING_PROFILING.encode() + b"\0")
    old.write_bytes(b"\0xla_gpu_enable_command_buffer\0")
    env = {"XLA_FLAGS": "--xla_gpu_autotune_level=0"}
    assert e2e.keep_command_buffers_when_profiling(env, [str(knows)]) is None
    want = "--xla_gpu_autotune_level=0 --xla_enable_command_buffers_during_profiling=true"
    assert env["XLA_FLAGS"] == want
    assert e2e.keep_command_buffers_when_profiling(env, [str(knows)]) is None  # not twice
    assert env["XLA_FLAGS"] == want
    # XLA aborts on a flag it does not know: then XLA_FLAGS is left alone, and the reason given.
    env = {}
    why = e2e.keep_command_buffers_when_profiling(env, [str(knows), str(old)])
    assert "libjax_common.so has no xla_enable_command_buffers_during_profiling" in why and env == {}
    assert "no XLA library" in e2e.keep_command_buffers_when_profiling(env, [])
    # this machine's jax: its libraries are found and checked (a real answer either way)
    libraries = e2e._xla_libraries()
    assert libraries and all(lib.endswith(".so") for lib in libraries)


def test_ours_env_variants_are_parsed_and_scoped():
    import os

    from jax_onnx_attn.bench import e2e as E

    assert E.parse_ours_env(["pf:JOA_A=1,JOA_B=x", "rec:JOA_C=1"]) == [
        ("pf", {"JOA_A": "1", "JOA_B": "x"}), ("rec", {"JOA_C": "1"})]
    for bad in ("noname", ":JOA_A=1", "x:", "x:JOA_A", "x:=1"):
        with pytest.raises(ValueError, match="--ours-env"):
            E.parse_ours_env([bad])
    names = [name for name, _ in E.measured_impls(["ours", "jax-peer"], [1], E.parse_ours_env(["pf:JOA_T=1"]))]
    assert names == ["ours", "ours[pf]", "jax-peer"]
    os.environ.pop("JOA_TEST_SCOPED", None)
    with E._environment({"JOA_TEST_SCOPED": "1"}):
        assert os.environ["JOA_TEST_SCOPED"] == "1"
    assert "JOA_TEST_SCOPED" not in os.environ


def test_ours_env_variant_loads_the_model_it_asks_for(tmp_path, monkeypatch):
    # --ours-env qkv:JOA_QKV_PREPARE=1: the variant's batch-1 session runs a model loaded with the
    # QKV projection's step preparation (the harness loads models itself, so it must ask for it as
    # DecoderSession would), the plain "ours" does not, and both generate the same tokens.
    monkeypatch.delenv("JOA_QKV_PREPARE", raising=False)
    out = tmp_path / "e2e.json"
    rc = bench_main.main(["e2e", *ARGS, "--weights", "fp16", "--phases", "decode", "--impls", "ours",
                          "--ours-env", "qkv:JOA_QKV_PREPARE=1", "--models-dir", str(tmp_path / "models"),
                          "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    (rec,) = doc["results"]
    assert rec["impls"]["ours"]["qkv_prepare"] is False
    assert rec["impls"]["ours[qkv]"]["qkv_prepare"] is True
    tokens = doc["verify"][0]["tokens"]
    assert tokens["ours[qkv]"] == tokens["ours"], tokens


def test_median_round_keeps_the_median_and_the_first_profile():
    recs = [{"ms": 3.0, "kernels_per_step": 90, "trace": "t0"}, {"ms": 1.0, "kernels_per_step": None},
            {"skip": "oom"}, {"ms": 2.0, "kernels_per_step": None}]
    got = e2e.median_round(recs)
    assert got["ms"] == 2.0 and got["kernels_per_step"] == 90 and got["trace"] == "t0"
    assert got["rounds_ms"] == [3.0, 1.0, None, 2.0]
    assert e2e.median_round([{"ms": 1.0}, {"ms": 5.0}])["ms"] == 1.0  # even: the lower middle
    assert e2e.median_round([{"skip": "x"}]) == {"skip": "x"}


def test_rounds_measure_every_impl_in_turn(tmp_path):
    out = tmp_path / "e2e.json"
    rc = bench_main.main(["e2e", *ARGS, "--weights", "fp16", "--phases", "decode", "--impls", "ours", "jax-peer",
                          "--rounds", "3", "--models-dir", str(tmp_path / "models"), "--out", str(out)])
    assert rc == 0
    (rec,) = json.loads(out.read_text())["results"]
    for impl in ("ours", "jax-peer"):
        got = rec["impls"][impl]
        assert len(got["rounds_ms"]) == 3 and got["ms"] == sorted(got["rounds_ms"])[1], got
        assert "kernels_per_step" in got
    with pytest.raises(SystemExit):
        bench_main.main(["e2e", *ARGS, "--rounds", "0", "--models-dir", str(tmp_path / "models")])


def test_median_round_lists_each_profiled_rounds_device_time():
    prof = [{"busy_us": 900.0, "idle_us": v, "largest_gaps": [[v, "a", "b"]], "top": []} for v in (66.0, 105.0)]
    recs = [{"ms": 1.0, "kernels_per_step": 92, "profile": prof[0]}, {"ms": 0.96, "kernels_per_step": 92,
                                                                          "profile": prof[1]}]
    got = e2e.median_round(recs)
    assert got["ms"] == 0.96 and got["profile"] is prof[1]
    assert got["rounds_profile"] == [{"ms": 1.0, "busy_us": 900.0, "idle_us": 66.0, "largest_gaps": [[66.0, "a", "b"]]},
                                     {"ms": 0.96, "busy_us": 900.0, "idle_us": 105.0,
                                      "largest_gaps": [[105.0, "a", "b"]]}]
    assert "rounds_profile" not in e2e.median_round([recs[0], {"ms": 2.0, "kernels_per_step": None}])


def test_lowerings_that_do_not_fit_beside_the_held_ones_evict_the_least_recently_used(tmp_path, monkeypatch):
    # An ~8B A/B of ours' variants holds a lowering (its weights on the device) per set of load
    # options; on an 80 GB card three did not fit (session 39). With room for two, each load drops
    # the others first, least recently used first, and a held one is reused as it is.
    from jax_onnx_attn.models import ensure_model

    config = e2e.model_config(e2e.Case("tiny", "fp16", 1, 32), 0)
    path, _ = ensure_model(config, tmp_path / "models")
    g = e2e.Group("tiny", "fp16", config, info={"path": str(path)})
    plain, qkv, mlp = {}, {"qkv_prepare": True}, {"gated_mlp": True}
    keys = lambda: [dict(k) for k in g.loaded]
    monkeypatch.setattr(e2e, "_fits", lambda nbytes: len(g.loaded) < 2)  # room for two
    for options in (plain, qkv):
        e2e.lowered_for(g, options, 1)
    assert keys() == [plain, qkv]
    first = g.loaded[e2e.load_key(plain)]
    assert e2e.lowered_for(g, plain, 1) is first  # reused, now the most recent
    assert keys() == [qkv, plain]
    got = e2e.lowered_for(g, mlp, 1)  # no room: qkv (least recent) goes, then there is
    assert keys() == [plain, mlp] and g.loaded[e2e.load_key(mlp)] is got
    assert got.fusions.qkv_pairs == 0 and got.fusions.gated_mlp == config.layers
    monkeypatch.setattr(e2e, "_fits", lambda nbytes: False)  # never room: all others go first
    e2e.lowered_for(g, qkv, 1)
    assert keys() == [qkv] and g.loaded[e2e.load_key(qkv)].fusions.qkv_pairs == config.layers
