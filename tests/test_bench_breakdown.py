"""The decode-step breakdown (`python -m jax_onnx_attn.bench.breakdown`) on a hand-made bench e2e
document: kernels grouped by name, each group's bytes from the model's shapes (2 bytes a f16
weight, the KV cache's bytes a token x ctx x batch), µs a step over the calls' steps, the bound at
the HBM peak, and the kernels outside the profile's top list counted in "other"."""

import json

import pytest

from jax_onnx_attn.bench import breakdown

CONFIG = {"name": "tiny", "hidden": 64, "layers": 2, "heads": 4, "kv_heads": 2, "head_size": 16,
          "intermediate": 128, "weight_bits": 0}
QKV, O, GATE_UP, DOWN, HEAD = 64 * 8 * 16, 64 * 64, 64 * 256, 128 * 64, 64 * 100
PARAMS = 2 * (QKV + O + GATE_UP + DOWN) + HEAD
STEPS = 4


def _doc(with_profile=True):
    gemv = "void joa::gemv::GemvDenseRowKernel<__half, joa::gemv::{}, joa::gemv::{}, 3>"
    top = [[gemv.format("RmsNormInput", "GatedSiluEpilogue"), 8, 80.0],
           [gemv.format("RmsNormInput", "StoreEpilogue"), 12, 60.0],
           [gemv.format("PlainInput", "StoreEpilogue"), 16, 40.0],
           ["void joa::decode::DecodeSplitKernel<__half, 16, 1, 4, joa::MaskVariant>", 8, 24.0],
           ["void joa::gqa::(anonymous namespace)::GqaPrepareKernel<__half, 0, 8>", 8, 8.0],
           ["loop_add_fusion", 8, 4.0]]
    prof = {"top_time": top, "total_us": 220.0, "span_us": 260.0, "busy_us": 220.0}
    ours = {"ms": 0.07, "frac_of_bound": 0.5, **({"profile": prof} if with_profile else {})}
    rec = {"model": "tiny", "model_alias": "tiny", "weights": "fp16", "weight_bits": 16, "batch": 2, "ctx": 10,
           "steps_per_call": STEPS, "phase": "decode", "bytes_per_step": 2 * PARAMS + 5000, "bound_ms": 0.03,
           "impls": {"ours": ours}}
    cost = {"head_params": HEAD, "matmul_params": PARAMS, "kv_bytes_per_token": 256,
            "breakdown": {"matmul": 2 * PARAMS, "matmul_nbits": 0}}
    return {"suite": "e2e", "commit": "abc1234", "args": {"hbm": 2e12}, "models": {"tiny/fp16": {"config": CONFIG, "step_cost": cost}},
            "results": [rec]}


def test_groups_their_bytes_and_their_bound():
    doc = _doc()
    rows = {r["group"]: r for r in breakdown.step_breakdown(doc, doc["results"][0], hbm=1e12)}
    assert rows["gate-up"]["us"] == pytest.approx(80.0 / STEPS) and rows["gate-up"]["calls"] == 2
    assert rows["gate-up"]["mb"] == pytest.approx(2 * GATE_UP * 2 / 1e6)
    assert rows["qkv + LM head"]["mb"] == pytest.approx((2 * QKV + HEAD) * 2 / 1e6)
    assert rows["o + down"]["mb"] == pytest.approx(2 * (O + DOWN) * 2 / 1e6)
    assert rows["attention"]["mb"] == pytest.approx(256 * 10 * 2 / 1e6)
    # at 1000 GB/s a byte takes 1e-3 ns: bound µs = bytes / 1e6
    assert rows["o + down"]["bound_us"] == pytest.approx(2 * (O + DOWN) * 2 / 1e6)
    assert rows["o + down"]["over_us"] == pytest.approx(10.0 - rows["o + down"]["bound_us"])
    assert rows["gqa_prepare"]["us"] == pytest.approx(2.0) and rows["gqa_prepare"]["bound_us"] == 0
    # the XLA fusion plus the 4 µs the top list left out
    assert rows["other"]["us"] == pytest.approx((4.0 + 4.0) / STEPS)
    assert rows["kernels"]["us"] == pytest.approx(220.0 / STEPS)
    assert rows["idle, profiled"]["us"] == pytest.approx(10.0)
    assert breakdown.IDLE_BOUNDARIES not in rows  # a profile from before the split
    assert rows["step (timed)"]["us"] == pytest.approx(70.0)
    assert rows[breakdown.TIMED_NOT_KERNELS]["us"] == pytest.approx(70.0 - 220.0 / STEPS)
    # without hbm, the run's own --hbm (2e12 B/s): half the bound
    own = {r["group"]: r for r in breakdown.step_breakdown(doc, doc["results"][0])}
    assert own["o + down"]["bound_us"] == pytest.approx(rows["o + down"]["bound_us"] / 2)


def test_cli_prints_a_table_and_fails_without_a_profile(tmp_path, capsys):
    path = tmp_path / "e2e.json"
    path.write_text(json.dumps(_doc()))
    assert breakdown.main([str(path)]) == 0
    out = capsys.readouterr().out
    assert "tiny fp16 B=2 ctx=10 ours (commit abc1234; 0.50 of the bound)" in out
    assert out.count("\n") >= 10 and "gate-up" in out and "step (timed)" in out
    path.write_text(json.dumps(_doc(with_profile=False)))
    assert breakdown.main([str(path)]) == 1
    assert "no profiled decode case" in capsys.readouterr().err


def test_kernel_names_fall_in_their_groups():
    assert breakdown.group_of("void joa::gemv::GemvRecordKernel<__half, joa::gemv::RmsNormInput, "
                              "joa::gemv::GatedSiluEpilogue>") == "gate-up"
    assert breakdown.group_of("void joa::decode::DecodeCombineKernel<__half, 128>") == "attention"
    assert breakdown.group_of("void joa::gemv::GemvDenseRowKernel<__half, joa::gemv::PlainInput, "
                              "joa::gemv::QkvRotaryEpilogue, 3>") == "qkv + LM head"  # + the prepare
    assert breakdown.group_of("nvjet_sm90_hsh_128x128") == "other"
    for kernel in ("MlpRowKernel<__half, 16, 2, true>", "MlpRowNKernel<__half, 8, 3, true>"):  # both splits
        assert breakdown.group_of(f"void joa::gemv::{kernel}(joa::gemv::MlpRowParams)") == "mlp (fused)"
    # The N split, and o + the MLP (out_mlp): the row chain.
    assert breakdown.group_of("void joa::gemv::RowChainKernel<__half, 8, 3>(joa::gemv::RowChainParams)") == \
        "mlp (fused)"


@pytest.mark.parametrize("out_mlp", [False, True])
def test_the_row_chain_takes_the_mlp_bytes_and_os_under_out_mlp(out_mlp):
    doc = _doc()
    ours = doc["results"][0]["impls"]["ours"]
    ours["out_mlp"] = out_mlp
    top = ours["profile"]["top_time"]
    # The chain in place of the gate-up (8 calls) and down kernels (and o's under out_mlp): 8 calls, 120 µs.
    gone = ("GatedSilu", "PlainInput") if out_mlp else ("GatedSilu",)
    top[:] = [["void joa::gemv::RowChainKernel<__half, 8, 3>(joa::gemv::RowChainParams)", 8, 120.0]] + \
        [t for t in top if not any(g in t[0] for g in gone)]
    rows = {r["group"]: r for r in breakdown.step_breakdown(doc, doc["results"][0], hbm=1e12)}
    o = O if out_mlp else 0
    assert rows["mlp (fused)"]["mb"] == pytest.approx(2 * (o + GATE_UP + DOWN) * 2 / 1e6)
    assert rows["mlp (fused)"]["us"] == pytest.approx(120.0 / STEPS) and rows["mlp (fused)"]["calls"] == 2
    assert rows["o + down"]["mb"] == pytest.approx(2 * (O - o) * 2 / 1e6) and rows["gate-up"]["mb"] == 0


def test_profiled_idle_splits_into_kernel_boundaries_and_host_waits():
    doc = _doc()
    prof = doc["results"][0]["impls"]["ours"]["profile"]
    prof.update(short_gaps_us=6.0, short_gaps=20)  # of the 40 µs idle: 6 between kernels, 34 host waits
    rows = {r["group"]: r for r in breakdown.step_breakdown(doc, doc["results"][0], hbm=1e12)}
    assert rows[breakdown.IDLE_BOUNDARIES]["us"] == pytest.approx(6.0 / STEPS)
    assert rows[breakdown.IDLE_BOUNDARIES]["calls"] == pytest.approx(20 / STEPS)
    assert rows[breakdown.IDLE_HOST]["us"] == pytest.approx(34.0 / STEPS)


def test_wall_times_count_overlapping_kernels_once():
    # The split kernel's successor (a programmatic dependent launch) overlapped it: the attention's
    # 24 µs of durations add 16 to the busy time; the rest add what they last.
    doc = _doc()
    prof = doc["results"][0]["impls"]["ours"]["profile"]
    walls = {name: total for name, _, total in prof["top_time"]}
    split = next(n for n in walls if "DecodeSplit" in n)
    walls[split] = 16.0
    prof["top_wall"] = [[n, walls[n]] for n, _, _ in prof["top_time"]]
    prof["busy_us"] = 212.0  # 220 of durations less the 8 counted twice
    rows = {r["group"]: r for r in breakdown.step_breakdown(doc, doc["results"][0], hbm=1e12)}
    att = rows["attention"]
    assert att["us"] == pytest.approx(24.0 / STEPS) and att["wall_us"] == pytest.approx(16.0 / STEPS)
    assert att["over_us"] == pytest.approx(16.0 / STEPS - att["bound_us"])  # of the wall time
    assert rows["gate-up"]["wall_us"] == pytest.approx(rows["gate-up"]["us"])
    assert rows["other"]["wall_us"] == pytest.approx((4.0 + 4.0) / STEPS)  # busy less the listed walls
    assert rows["kernels"]["wall_us"] == pytest.approx(212.0 / STEPS)
    assert rows[breakdown.TIMED_NOT_KERNELS]["us"] == pytest.approx(70.0 - 212.0 / STEPS)
    table = breakdown.format_breakdown(list(rows.values()))
    assert "µs wall" in table.splitlines()[0]
    # A profile without wall times: no such column, over of the summed durations
    del prof["top_wall"]
    plain = breakdown.step_breakdown(doc, doc["results"][0], hbm=1e12)
    assert all(r["wall_us"] is None for r in plain)
    assert "µs wall" not in breakdown.format_breakdown(plain)
