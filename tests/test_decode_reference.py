"""The reference decode attention (the CUDA engine's spec) against a float64 NumPy oracle, on CPU;
and the public op's validation and backend choice."""

import itertools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import decode_oracle
from kernel_specs import use_specs
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import cuda_unsupported, decode_attention
from jax_onnx_attn.ops.reference import decode as reference
from jax_onnx_attn.testing import assert_close

FEATURES = list(itertools.product(
    [True, False],                      # causal
    [(-1, -1), (3, -1), (0, -1), (-1, 2), (4, 1)],  # (left, right)
    [0.0, 2.5],                         # softcap
    [None, "f32", "bool"],              # bias
    [False, True],                      # sink
))


def _case(seed, b=3, hq=4, hkv=2, s=3, d=8, c=11):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(np.float32)
    k = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    v = rng.standard_normal((b, hkv, c, d)).astype(np.float32)
    lens = np.array([c, 0, 7][:b], np.int32)
    for bi, n in enumerate(lens):  # rows past the valid length must never be read
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    return rng, q, k, v, lens


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES)
def test_reference_matches_oracle(causal, window, softcap, bias_kind, sink):
    rng, q, k, v, lens = _case(len(FEATURES))
    b, hq, s, _ = q.shape
    c = k.shape[2]
    bias = None
    if bias_kind == "f32":
        bias = rng.standard_normal((b, 1, s, c + 2)).astype(np.float32)
        bias[0, 0, 1, :] = -np.inf  # one fully masked row
    elif bias_kind == "bool":
        bias = rng.random((1, hq, 1, c - 3)) < 0.7
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    kw = dict(scale=0.4, softcap=softcap, causal=causal, left=window[0], right=window[1])
    got = reference.decode_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), jnp.asarray(lens),
                                     None if bias is None else jnp.asarray(bias),
                                     None if sink_v is None else jnp.asarray(sink_v), **kw)
    want = decode_oracle.decode_attention(q, k, v, lens, bias, sink_v, **kw)
    assert not np.isnan(np.asarray(got)).any()
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("pos_shift", [-4, -1, 2, 9])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1)])
def test_pos_shift_moves_every_query_position(pos_shift, window):
    _, q, k, v, lens = _case(5)
    kw = dict(scale=0.4, causal=True, left=window[0], right=window[1], pos_shift=pos_shift)
    got = reference.decode_attention(*map(jnp.asarray, (q, k, v, lens)), **kw)
    want = decode_oracle.decode_attention(q, k, v, lens, **kw)
    assert_close(got, want, np.float32)


def test_kv_len_is_clamped_to_capacity():
    _, q, k, v, _ = _case(1)
    k, v = np.nan_to_num(k), np.nan_to_num(v)
    lens = np.array([99, -5, 11], np.int32)
    got = reference.decode_attention(q, k, v, jnp.asarray(lens), scale=0.3)
    want = decode_oracle.decode_attention(q, k, v, np.clip(lens, 0, 11), scale=0.3)
    assert_close(got, want, np.float32)


def test_auto_backend_on_cpu_is_the_reference():
    _, q, k, v, lens = _case(2)
    auto = jax.jit(lambda *a: decode_attention(*a, scale=0.5))(q, k, v, lens)
    ref = decode_attention(q, k, v, lens, scale=0.5, backend="reference")
    np.testing.assert_array_equal(np.asarray(auto), np.asarray(ref))


def test_cuda_coverage_and_validation():
    assert cuda_unsupported(jnp.float32, 128) is not None
    assert cuda_unsupported(jnp.bfloat16, 72) is not None
    assert cuda_unsupported(jnp.float16, 80) is None
    q = jnp.zeros((1, 6, 1, 8))
    with pytest.raises(ValueError, match="multiple of KV heads"):
        decode_attention(q, jnp.zeros((1, 4, 5, 8)), jnp.zeros((1, 4, 5, 8)), jnp.array([3]))
    with pytest.raises(ValueError, match="bias"):
        decode_attention(q, jnp.zeros((1, 2, 5, 8)), jnp.zeros((1, 2, 5, 8)), jnp.array([3]),
                         bias=jnp.zeros((1, 2, 1, 5)))
    with pytest.raises(ValueError, match="split_rows"):
        decode_attention(q, jnp.zeros((1, 2, 5, 8)), jnp.zeros((1, 2, 5, 8)), jnp.array([3]),
                         split_rows=100)


@pytest.mark.parametrize("batch,rows,capacity,d", [(1, 4, 1024, 128), (1, 4, 131072, 128),
                                                  (8, 64, 16384, 128), (128, 4, 4096, 256),
                                                  (3, 200, 333, 80)])
def test_split_plan_is_valid(batch, rows, capacity, d):
    sr = cuda.decode_split_rows(batch, 8, rows, capacity, d)
    assert sr % cuda.DECODE_BLOCK_N == 0 and sr > 0
    splits = -(-capacity // sr)
    assert splits <= cuda.DECODE_MAX_SPLITS
    assert cuda.decode_split_rows(batch, 8, rows, capacity, d) == sr  # pure function
    if batch * 8 >= 264:
        assert splits == 1


@pytest.mark.parametrize("batch,rows,capacity", [(1, 4, 1024), (1, 8, 8192), (4, 4, 4096), (1, 1, 64),
                                                 (1, 4, 2048), (1, 4, 4096), (2, 8, 4096),
                                                 (1, 4, 16384), (1, 16, 4096), (1, 32, 4096),
                                                 (64, 4, 4096)])
def test_cluster_plan_is_valid(batch, rows, capacity):
    sr = cuda.decode_cluster_split_rows(batch, 8, rows, capacity, 64)  # d128 B=1: its own rule
    tiles = -(-capacity // cuda.DECODE_BLOCK_N)
    if sr is None:  # not a 16-row block, or no cluster of >= 2 splits fits a wave with short splits
        n = min(cuda.DECODE_MAX_CLUSTER_SPLITS, tiles, 264 // (batch * 8))
        while n >= 2 and batch * 8 * n > _wave_ctas(n, 2):
            n -= 1
        assert rows > 16 or n < 2 or -(-tiles // n) > max(t for _, t in cuda._CLUSTER_PLANS)
        return
    splits = -(-capacity // sr)
    assert sr % cuda.DECODE_BLOCK_N == 0
    assert 2 <= splits <= cuda.DECODE_MAX_CLUSTER_SPLITS
    assert batch * 8 * splits <= _wave_ctas(splits, 2)  # one wave of clusters (the default policy)


# --- plan policies (plan.h PlanPolicy: "wave", the default, "fit" and "ladder") -------------------

def _plan(batch, capacity, d, policy, rows=4, **kw):
    """The plan of a q_len-1 call with `rows` query heads per KV head over 8 KV heads."""
    return cuda.decode_plan(batch, 8 * rows, 8, 1, capacity, d, cluster_capable=True, policy=policy, **kw)


def _wave_ctas(splits, ctas_per_sm):
    """plan.h ClusterWaveCtas: the CTAs of `splits`-CTA clusters one wave of the H200 holds."""
    return cuda._limits()["decode"]["wave_clusters"][ctas_per_sm - 1][splits - 1] * splits


def test_wave_clusters_are_the_measured_h200_table():
    """The wave cap is cudaOccupancyMaxActiveClusters on the H200 (tools/probes/cluster_occupancy),
    not a formula: GPCs of unequal sizes hold 237 CTAs of 3-CTA clusters but 248 of 4-CTA ones."""
    table = cuda._limits()["decode"]["wave_clusters"]
    assert [len(row) for row in table] == [cuda.DECODE_MAX_CLUSTER_SPLITS] * 3
    for ctas_per_sm, row in enumerate(table, 1):
        assert row[0] == 132 * ctas_per_sm  # one-CTA "clusters": every slot
        assert all(c * size <= 132 * ctas_per_sm for size, c in enumerate(row, 1))
        assert all(a >= b for a, b in zip(row, row[1:]))
    assert [_wave_ctas(n, 2) for n in (3, 4, 7, 8, 12, 16)] == [237, 248, 224, 240, 192, 224]


@pytest.mark.parametrize("batch,capacity,splits", [(4, 1280, 7), (2, 2304, 12)])
def test_wave_policy_keeps_cluster_grids_the_table_says_fit(batch, capacity, splits):
    """d128 B=4 capacity 1280 (7-CTA clusters, 224 CTAs) and B=2 2304 (12-CTA clusters, 192): one
    wave holds them, so "wave" plans the ladder's clusters (the worst-case GPC formula of session 27
    cut them to 5 / 9 splits: 13.1 -> 15.1 and 12.2 -> 12.7 µs)."""
    wave, ladder = _plan(batch, capacity, 128, "wave"), _plan(batch, capacity, 128, "ladder")
    assert wave["cluster"] and wave["splits"] == splits
    assert wave == ladder


@pytest.mark.parametrize("capacity", [64, 200, 1024, 2048, 2304, 4096, 8192, 16384, 131072])
@pytest.mark.parametrize("d", [64, 80, 128])
@pytest.mark.parametrize("rows", [1, 4, 8, 16, 32])
def test_fit_policy_keeps_the_batch_1_plans(capacity, d, rows):
    """At B=1 the ladder's clusters already fit one wave of clusters: "fit" plans the same."""
    assert _plan(1, capacity, d, "fit", rows) == _plan(1, capacity, d, "ladder", rows)


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
@pytest.mark.parametrize("capacity", [64, 1024, 2048, 2304, 4096, 8192, 32768])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_fit_policy_cluster_grids_fit_one_wave(batch, capacity, d):
    """A "fit" cluster plan: 2-16 splits of at most fit_max_tiles tiles whose CTAs one wave of
    clusters holds (the H200's measured max active clusters), no workspace; otherwise the split plan."""
    plan = _plan(batch, capacity, d, "fit")
    assert plan == _plan(batch, capacity, d, "fit")  # pure
    if not plan["cluster"]:
        assert plan == _plan(batch, capacity, d, "fit", cluster=False)
        return
    n = plan["splits"]
    assert 2 <= n <= cuda.DECODE_MAX_CLUSTER_SPLITS and n == -(-capacity // plan["split_rows"])
    assert batch * 8 * n <= _wave_ctas(n, plan["ctas_per_sm"])
    assert plan["split_rows"] <= cuda._limits()["decode"]["fit_max_tiles"] * cuda.DECODE_BLOCK_N
    assert plan["workspace_elems"] == 1


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 64])
@pytest.mark.parametrize("capacity", [64, 1024, 2048, 2304, 4096, 8192, 32768])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_wave_policy_is_the_ladder_capped_by_one_wave_of_clusters(batch, capacity, d):
    """"wave": the ladder where its cluster grid fits one wave of clusters; otherwise a cluster plan
    that does (its splits no longer than the ladder's rungs allow) or the split plan (B=1 at head
    dim 128 has a rule of its own)."""
    ladder, wave = _plan(batch, capacity, d, "ladder"), _plan(batch, capacity, d, "wave")
    if batch * 8 <= 8 and d == 128:
        return  # B=1's own rule: test_wave_policy_splits_batch_1_at_head_dim_128_longer
    if ladder["cluster"] and batch * 8 * ladder["splits"] <= _wave_ctas(ladder["splits"], ladder["ctas_per_sm"]):
        assert wave == ladder
    elif wave["cluster"]:
        n = wave["splits"]
        assert 2 <= n <= cuda.DECODE_MAX_CLUSTER_SPLITS and n == -(-capacity // wave["split_rows"])
        assert batch * 8 * n <= _wave_ctas(n, wave["ctas_per_sm"])
        assert wave["split_rows"] <= max(t for _, t in cuda._CLUSTER_PLANS) * cuda.DECODE_BLOCK_N
    else:
        assert wave == _plan(batch, capacity, d, "wave", cluster=False)


@pytest.mark.parametrize("batch,kv_heads", [(1, 8), (1, 4), (2, 4), (2, 8), (8, 8), (1, 32)])
@pytest.mark.parametrize("capacity", [64, 1024, 1280, 2048, 2304, 4096, 8192, 8448, 131072])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_wave_policy_splits_batch_1_at_head_dim_128_longer(batch, kv_heads, capacity, d):
    """"wave" at <= 8 CTAs a split, head dim 128 and >= 2048 rows: the first cluster rung (8 splits of
    <= 2 tiles) or else splits of >= 4 tiles and the combine kernel, no more than 16 of them while
    that keeps them within 16 tiles; elsewhere the rule is not used."""
    plan = cuda.decode_plan(batch, 4 * kv_heads, kv_heads, 1, capacity, d, cluster_capable=True, policy="wave")
    if d != 128 or batch * kv_heads > 8 or capacity < 2048:
        if plan["cluster"] and batch * kv_heads <= 8:  # B=1's own clusters: longer rungs allowed
            assert plan["splits"] <= cuda.DECODE_MAX_CLUSTER_SPLITS
        return
    if plan["cluster"]:
        assert plan["splits"] <= 8 and plan["split_rows"] <= 2 * cuda.DECODE_BLOCK_N
    else:
        lim, tiles = cuda._limits()["decode"], -(-capacity // cuda.DECODE_BLOCK_N)
        assert plan["split_rows"] >= min(lim["long_split_tiles"], tiles) * cuda.DECODE_BLOCK_N
        assert (plan["splits"] <= lim["long_split_max_splits"]
                or plan["split_rows"] >= lim["long_split_max_tiles"] * cuda.DECODE_BLOCK_N)
    assert plan == cuda.decode_plan(batch, 4 * kv_heads, kv_heads, 1, capacity, d, cluster_capable=True)


@pytest.mark.parametrize("capacity,split_rows", [(2048, 256), (2304, 256), (4096, 256), (8192, 512),
                                                 (8448, 576), (16384, 1024), (32768, 1152),
                                                 (131072, 4544)])
def test_batch_1_head_dim_128_splits_spread_over_16_ctas_a_head_up_to_16_tiles(capacity, split_rows):
    """B=1 32/8 d128: 4-tile splits up to 4k, 16 splits of 8-16 tiles at 8k-16k (one CTA an SM:
    8k 13.7 µs against 14.1 for 32 splits of 4 tiles), the split plan's own beyond."""
    plan = _plan(1, capacity, 128, "wave")
    assert not plan["cluster"] and plan["split_rows"] == split_rows
    lim = cuda._limits()["decode"]
    assert (lim["long_split_tiles"], lim["long_split_max_splits"], lim["long_split_max_tiles"]) == (4, 16, 16)


@pytest.mark.parametrize("batch,capacity,d,wave,fit,ladder", [
    # B=8 ctx 2k: the ladder's 4-CTA clusters take 256 of 264 slots (27.7 µs at d128 on the H200,
    # the split plan 23.1): "wave" takes the split plan, "fit" 3-CTA clusters of 11 tiles.
    (8, 2048, 64, (4, 512, False), (3, 704, True), (4, 512, True)),
    # The ~1B decoder's cache (2304 rows): split + combine kernel; "fit": one launch.
    (8, 2304, 64, (4, 576, False), (3, 768, True), (4, 576, False)),
    (8, 4096, 128, (4, 1024, False), (3, 1408, True), (4, 1024, False)),
    (8, 8192, 128, (4, 2048, False), (4, 2048, False), (4, 2048, False)),  # 43 tiles: > fit_max_tiles
    (16, 2048, 64, (2, 1024, False), (2, 1024, True), (2, 1024, False)),
    # B=2 ctx 2k: 16-CTA clusters over 256 slots (18.3 µs at d128) -> 11-CTA clusters (11.3).
    (2, 2048, 128, (11, 192, True), (11, 192, True), (16, 128, True)),
    (4, 1024, 128, (6, 192, True), (6, 192, True), (8, 128, True)),
    # B=1 d128: 4-tile splits + the combine kernel (10.2 µs) instead of 16-CTA clusters (11.4).
    (1, 4096, 128, (16, 256, False), (16, 256, True), (16, 256, True)),
    (1, 4096, 64, (16, 256, True), (16, 256, True), (16, 256, True)),
])
def test_plan_policies_at_issue_15_shapes(batch, capacity, d, wave, fit, ladder):
    for policy, want in (("wave", wave), ("fit", fit), ("ladder", ladder)):
        plan = _plan(batch, capacity, d, policy)
        assert (plan["splits"], plan["split_rows"], plan["cluster"]) == want, policy


def test_plan_policy_comes_from_the_environment(monkeypatch):
    """JOA_DECODE_PLAN picks the policy of calls that name none; the default is the first name;
    an unknown name is a ValueError naming the switch."""
    assert cuda.DECODE_PLAN_POLICIES[0] == "wave" and {"fit", "ladder"} <= set(cuda.DECODE_PLAN_POLICIES)
    monkeypatch.delenv(cuda.PLAN_POLICY_ENV, raising=False)
    assert cuda.decode_plan_policy() is None
    assert _plan(8, 2048, 64, None) == _plan(8, 2048, 64, "wave") != _plan(8, 2048, 64, "ladder")
    monkeypatch.setenv(cuda.PLAN_POLICY_ENV, "fit")
    assert cuda.decode_plan_policy() == "fit"
    assert _plan(8, 2048, 64, None) == _plan(8, 2048, 64, "fit")
    monkeypatch.setenv(cuda.PLAN_POLICY_ENV, "widest")
    with pytest.raises(ValueError, match="JOA_DECODE_PLAN"):
        _plan(8, 2048, 64, None)


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_decode_attention_takes_the_switches_at_trace_time(monkeypatch, kv_bits):
    """cuda.decode_attention resolves JOA_DECODE_PLAN and JOA_DECODE_CURSOR_LOADS when it is traced
    and hands the plan policy and the cursor loads (float caches only) to the kernel call."""
    calls = use_specs(monkeypatch)
    b, hq, hkv, s, d, c = 8, 32, 8, 1, 64, 2048
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((b, hq, s, d)), jnp.float16)
    dt = jnp.int8 if kv_bits else jnp.float16
    cache = jnp.zeros((b, hkv, c, d), dt)
    scales = (jnp.ones((1,), jnp.float32),) * 2 if kv_bits else (None, None)
    lens = jnp.full((b,), c, jnp.int32)
    monkeypatch.setenv(cuda.PLAN_POLICY_ENV, "fit")
    monkeypatch.setenv(cuda.CURSOR_LOADS_ENV, "1")
    cuda.decode_attention(q, cache, cache, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits)
    static = calls[-1][2]
    assert static["plan_policy"] == "fit" and static["cursor_loads"] is (not kv_bits)
    monkeypatch.delenv(cuda.PLAN_POLICY_ENV)
    monkeypatch.delenv(cuda.CURSOR_LOADS_ENV)
    cuda.decode_attention(q, cache, cache, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits,
                          plan_policy="fit")
    static = calls[-1][2]
    assert static["plan_policy"] == "fit" and static["cursor_loads"] is False
    # Head dim 128 takes the cursor loads unless the switch says "0" (cuda.CURSOR_LOADS_HEAD_DIMS).
    q128 = jnp.zeros((b, hq, s, 128), jnp.float16)
    cache128 = jnp.zeros((b, hkv, c, 128), dt)
    cuda.decode_attention(q128, cache128, cache128, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits)
    assert calls[-1][2]["cursor_loads"] is (not kv_bits)
    monkeypatch.setenv(cuda.CURSOR_LOADS_ENV, "0")
    cuda.decode_attention(q128, cache128, cache128, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits)
    assert calls[-1][2]["cursor_loads"] is False


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_decode_attention_takes_the_producer_switch_at_trace_time(monkeypatch, kv_bits):
    """cuda.decode_attention resolves JOA_DECODE_PRODUCER when it is traced (off unless "1") and
    hands the producer warp to the kernel call for float caches only; an explicit argument wins."""
    calls = use_specs(monkeypatch)
    b, hq, hkv, s, d, c = 8, 32, 8, 1, 128, 2304
    q = jnp.zeros((b, hq, s, d), jnp.float16)
    cache = jnp.zeros((b, hkv, c, d), jnp.int8 if kv_bits else jnp.float16)
    scales = (jnp.ones((1,), jnp.float32),) * 2 if kv_bits else (None, None)
    lens = jnp.full((b,), c, jnp.int32)

    def producer(**kw):
        cuda.decode_attention(q, cache, cache, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits, **kw)
        return calls[-1][2]["producer"]

    monkeypatch.delenv(cuda.PRODUCER_ENV, raising=False)
    assert cuda.decode_producer() is False and producer() is False
    monkeypatch.setenv(cuda.PRODUCER_ENV, "1")
    assert cuda.decode_producer() is True and producer() is (not kv_bits)
    assert producer(producer=False) is False
    monkeypatch.setenv(cuda.PRODUCER_ENV, "0")
    assert producer() is False and producer(producer=True) is (not kv_bits)
    # The switch leaves the cursor loads' own rule alone (the handler prefers the producer).
    assert calls[-1][2]["cursor_loads"] is (not kv_bits)


@pytest.mark.parametrize("kv_bits", [0, 8])
def test_decode_attention_takes_the_tile128_switch_at_trace_time(monkeypatch, kv_bits):
    """cuda.decode_attention resolves JOA_DECODE_TILE128 when it is traced (off unless "1") and hands
    the wide KV tile to the kernel call for float caches only; an explicit argument wins; the cursor
    loads keep their own rule."""
    calls = use_specs(monkeypatch)
    b, hq, hkv, s, d, c = 8, 32, 8, 1, 64, 2304
    q = jnp.zeros((b, hq, s, d), jnp.float16)
    cache = jnp.zeros((b, hkv, c, d), jnp.int8 if kv_bits else jnp.float16)
    scales = (jnp.ones((1,), jnp.float32),) * 2 if kv_bits else (None, None)
    lens = jnp.full((b,), c, jnp.int32)

    def tile128(**kw):
        cuda.decode_attention(q, cache, cache, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits, **kw)
        return calls[-1][2]["tile128"]

    monkeypatch.delenv(cuda.TILE128_ENV, raising=False)
    assert cuda.decode_tile128() is False and tile128() is False
    monkeypatch.setenv(cuda.TILE128_ENV, "1")
    assert cuda.decode_tile128() is True and tile128() is (not kv_bits)
    assert tile128(tile128=False) is False
    assert calls[-1][2]["cursor_loads"] is False  # d64: the cursor loads' rule, untouched
    monkeypatch.setenv(cuda.TILE128_ENV, "0")
    assert tile128() is False and tile128(tile128=True) is (not kv_bits)


@pytest.mark.parametrize("kv_bits", [0, 8, 4])
def test_decode_attention_takes_the_key_rows_switch_at_trace_time(monkeypatch, kv_bits):
    """cuda.decode_attention resolves JOA_DECODE_KEY_ROWS when it is traced (on unless "0") and hands
    the key-rows register kernel to the kernel call for quantised caches only (the handler takes it
    where the register kernel runs on a block of at most KEY_ROWS_MAX_ROWS rows); an explicit
    argument wins; the register path's own switch is untouched."""
    calls = use_specs(monkeypatch)
    b, hq, hkv, s, d, c = 8, 32, 8, 1, 128, 2304
    q = jnp.zeros((b, hq, s, d), jnp.float16)
    dt = {0: jnp.float16, 8: jnp.int8, 4: jnp.uint8}[kv_bits]
    cache = jnp.zeros((b, hkv, c, d // 2 if kv_bits == 4 else d), dt)
    scales = (jnp.ones((1,), jnp.float32),) * 2 if kv_bits else (None, None)
    lens = jnp.full((b,), c, jnp.int32)

    def key_rows(**kw):
        cuda.decode_attention(q, cache, cache, lens, None, None, *scales, scale=0.1, kv_bits=kv_bits, **kw)
        return calls[-1][2]["key_rows"]

    monkeypatch.delenv(cuda.KEY_ROWS_ENV, raising=False)
    assert cuda.decode_key_rows() is True and key_rows() is bool(kv_bits)
    assert key_rows(key_rows=False) is False
    monkeypatch.setenv(cuda.KEY_ROWS_ENV, "0")
    assert cuda.decode_key_rows() is False and key_rows() is False
    assert key_rows(key_rows=True) is bool(kv_bits)
    monkeypatch.setenv(cuda.QUANT_REGS_ENV, "0")
    assert key_rows(key_rows=True) is bool(kv_bits) and calls[-1][2]["quant_regs"] is False
