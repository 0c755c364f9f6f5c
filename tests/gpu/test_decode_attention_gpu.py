"""The CUDA decode engine (decode_attention target) against the reference decode attention.

Sweeps head dims x dtypes x GQA shapes x q_len (packed M from 1 to 256 rows), the variant features
(causal, windows, softcap, biases, sinks), split sizes (1 to 32 splits + combine), ragged lengths
including 0, < S and > capacity, and cache rows past kv_len poisoned with NaN (they must never be
read). Plus bitwise determinism, batch invariance at a fixed split size, PDL on/off equality, and a
decode loop captured in a command buffer.
"""

import functools
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.testing import assert_close

import command_buffer
import decode_cases
from decode_cases import FEATURES

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]
HEAD_DIMS = [64, 80, 96, 128, 256]
# (Hq, Hkv, S): packed rows G * S = 4, 8, 1, 4, 16, 32, 64, 128, 256 (two M blocks), 9.
HEADS = [(32, 8, 1), (64, 8, 1), (8, 8, 1), (4, 1, 1), (32, 8, 4), (64, 8, 4), (32, 8, 16),
         (64, 8, 16), (16, 1, 16), (6, 2, 3)]


def _inputs(seed, b, hq, hkv, s, d, c, dtype, lens=None):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    if lens is None:
        lens = rng.integers(0, c + 1, size=b)
        lens[0] = c
        if b > 2:
            lens[1] = min(s - 1, c)  # fewer keys than queries: early rows see nothing
    lens = np.asarray(lens, np.int32)
    for bi, n in enumerate(lens):  # rows past the valid length hold garbage the kernel must skip
        k[bi, :, max(n, 0):] = np.nan
        v[bi, :, max(n, 0):] = np.nan
    return rng, q, k, v, lens


@functools.cache
def _jitted(backend, **static):
    return jax.jit(functools.partial(decode_attention, backend=backend, **static))


def _run(backend, q, k, v, lens, bias=None, sink=None, **static):
    return np.asarray(_jitted(backend, **static)(q, k, v, lens, bias, sink))


def _check(q, k, v, lens, bias=None, sink=None, **static):
    got = _run("cuda", q, k, v, lens, bias, sink, **static)
    ref_static = {key: val for key, val in static.items() if key not in ("split_rows",)}
    want = _run("reference", q, k, v, lens, bias, sink, **ref_static)
    assert not np.isnan(got.astype(np.float32)).any(), "NaN in the kernel output"
    assert_close(got, want, q.dtype)
    return got


def _split_modes(c):
    return {"auto": None, "single": -(-c // 64) * 64, "tile": 64}


@pytest.mark.parametrize("split", ["auto", "single", "tile"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_shapes(dtype, d, heads, split):
    if split != "auto" and d in (80, 96) and heads[2] not in (1, 16):
        pytest.skip("split modes are swept on the other head dims")
    hq, hkv, s = heads
    c = 200 if d != 256 else 131  # not a multiple of the 64-row tile
    _, q, k, v, lens = _inputs(d + hq + s, 3, hq, hkv, s, d, c, dtype)
    _check(q, k, v, lens, split_rows=_split_modes(c)[split], scale=1.0 / np.sqrt(d))


def _feature_case(dtype, hq, hkv, s, d, c, causal, window, softcap, bias_kind, sink, seed):
    rng, q, k, v, lens = _inputs(seed, 3, hq, hkv, s, d, c, dtype)
    bias = decode_cases.bias(bias_kind, rng, 3, hq, s, c)
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    _check(q, k, v, lens, bias, sink_v, scale=float(1 / np.sqrt(d)), softcap=softcap,
           causal=causal, left=window[0], right=window[1])


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES)
def test_features_bf16_gqa4_s4(causal, window, softcap, bias_kind, sink):
    _feature_case(ml_dtypes.bfloat16, 32, 8, 4, 128, 300, causal, window, softcap, bias_kind, sink, 7)


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES[::3])
def test_features_f16_gqa8_s1_d64(causal, window, softcap, bias_kind, sink):
    _feature_case(np.float16, 64, 8, 1, 64, 257, causal, window, softcap, bias_kind, sink, 8)


@pytest.mark.parametrize("d", [80, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_all_features_at_once(dtype, d):
    _feature_case(dtype, 16, 2, 5, d, 190, True, (50, -1), 20.0, "f32_full", True, d)


@pytest.mark.parametrize("split_rows", [64, 128, 192, 640, 2048, None])
def test_splits_long_context(split_rows):
    _, q, k, v, lens = _inputs(3, 2, 32, 8, 4, 128, 2048, ml_dtypes.bfloat16, lens=[2048, 1500])
    _check(q, k, v, lens, split_rows=split_rows, scale=0.09)


@pytest.mark.parametrize("c", [16384, 32768])
def test_very_long_context(c):
    _, q, k, v, lens = _inputs(c, 2, 32, 8, 1, 128, c, ml_dtypes.bfloat16, lens=[c, c // 2 + 5])
    _check(q, k, v, lens, scale=0.09)


@pytest.mark.parametrize("pos_shift", [-70, -3, 5, 130])
@pytest.mark.parametrize("window", [(-1, -1), (40, 2)])
def test_pos_shift(pos_shift, window):
    """ai.onnx offsets that are not bottom-right (past with L != S, no past with L != S)."""
    _, q, k, v, lens = _inputs(11, 3, 32, 8, 6, 128, 300, ml_dtypes.bfloat16)
    _check(q, k, v, lens, scale=0.09, causal=True, left=window[0], right=window[1], pos_shift=pos_shift)


CLUSTER_CASES = [  # (Hq, Hkv, S, D, C, split_rows): 2 to 8 splits of 16-row blocks
    (32, 8, 1, 128, 1024, 128), (64, 8, 2, 64, 777, 128), (8, 8, 1, 256, 300, 64),
    (16, 2, 2, 80, 4096, 512), (6, 2, 5, 96, 200, 64)]


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("case", CLUSTER_CASES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_cluster_combine(dtype, case, sink):
    """Splits combined inside a thread-block cluster (no combine kernel, no workspace) against the
    reference, with ragged lengths (empty splits, rows with no key) and an optional sink; and
    bitwise equal run to run."""
    hq, hkv, s, d, c, split_rows = case
    rng, q, k, v, lens = _inputs(d + c, 4, hq, hkv, s, d, c, dtype)
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    f = jax.jit(functools.partial(cuda.decode_attention, scale=float(1 / np.sqrt(d)),
                                  split_rows=split_rows, cluster=True))
    got = np.asarray(f(q, k, v, lens, None, sink_v))
    want = _run("reference", q, k, v, lens, None, sink_v, scale=float(1 / np.sqrt(d)))
    assert not np.isnan(got.astype(np.float32)).any()
    assert_close(got, want, dtype)
    np.testing.assert_array_equal(np.asarray(f(q, k, v, lens, None, sink_v)), got)


def test_planner_picks_the_cluster_at_batch_1():
    """The auto plan of a B=1 decode step at head dim 64 is one clustered launch: no combine kernel
    in the HLO's custom calls' workspace (size 1) and the same values as the combine-kernel path.
    (Head dim 128 takes 4-tile splits and the combine kernel there: test_batch_1_head_dim_128_plans.)"""
    _, q, k, v, lens = _inputs(5, 1, 32, 8, 1, 64, 4096, ml_dtypes.bfloat16, lens=[4000])
    assert cuda.decode_cluster_split_rows(1, 8, 4, 4096, 64) == 256  # 16 splits: a non-portable cluster
    auto = jax.jit(functools.partial(cuda.decode_attention, scale=0.09))
    hlo = auto.lower(q, k, v, lens).as_text()
    assert "cluster = true" in hlo
    plain = jax.jit(functools.partial(cuda.decode_attention, scale=0.09, cluster=False))
    assert_close(np.asarray(auto(q, k, v, lens)), np.asarray(plain(q, k, v, lens)), ml_dtypes.bfloat16)


def test_kv_len_beyond_capacity_is_clamped_and_empty_rows_are_zero():
    _, q, k, v, _ = _inputs(4, 4, 8, 2, 4, 64, 100, np.float16, lens=[100, 100, 100, 100])
    lens = np.array([500, -3, 0, 2], np.int32)
    got = _check(q, k, v, lens, scale=0.125)
    assert not got[1:3].astype(np.float32).any()                 # no key at all
    assert not got[3, :, :2].astype(np.float32).any()           # rows before position 0


def test_bitwise_deterministic_and_pdl_invariant():
    _, q, k, v, lens = _inputs(5, 2, 64, 8, 16, 128, 4096, ml_dtypes.bfloat16, lens=[4096, 3000])
    f = jax.jit(functools.partial(decode_attention, scale=0.09, backend="cuda", split_rows=256))
    first = np.asarray(f(q, k, v, lens))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, lens)), first)
    no_pdl = jax.jit(lambda *a: cuda.decode_attention(*a, scale=0.09, split_rows=256, pdl=False))
    np.testing.assert_array_equal(np.asarray(no_pdl(q, k, v, lens)), first)


def test_batch_invariant_at_a_fixed_split_size():
    _, q, k, v, lens = _inputs(6, 4, 32, 8, 2, 128, 1024, np.float16, lens=[1024, 700, 3, 1000])
    f = jax.jit(functools.partial(decode_attention, scale=0.09, backend="cuda", split_rows=128))
    batched = np.asarray(f(q, k, v, lens))
    for bi in range(4):
        alone = np.asarray(f(q[bi:bi + 1], k[bi:bi + 1], v[bi:bi + 1], lens[bi:bi + 1]))
        np.testing.assert_array_equal(alone[0], batched[bi])


# A decode loop (16 dependent attention calls over one cache, kv_len advancing on the device) run in a
# fresh process so XLA_FLAGS apply; it prints the custom-call names to find them in XLA's dump.
_LOOP = textwrap.dedent("""
    import functools, jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops.decode import decode_attention

    attn = functools.partial(decode_attention, scale=0.1, backend="cuda")
    def steps(q, k, v, lens):
        def body(i, carry):
            q, lens = carry
            return attn(q, k, v, lens).astype(q.dtype), lens + 1
        return jax.lax.fori_loop(0, 16, body, (q, lens))

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 32, 1, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((2, 8, 2048, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((2, 8, 2048, 128)), jnp.bfloat16)
    lens = jnp.array([1000, 1500], jnp.int32)
    f = jax.jit(steps)
    hlo = f.lower(q, k, v, lens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_decode_attention"' in l]
    print("CUSTOM_CALL_NAMES", *names)
    got, _ = f(q, k, v, lens)
    got2, _ = f(q, k, v, lens)  # replay
    want, l2 = q, lens
    for i in range(16):
        want = attn(want, k, v, l2); l2 = l2 + 1
    assert np.array_equal(np.asarray(got), np.asarray(got2))
    assert np.array_equal(np.asarray(got), np.asarray(want)), float(jnp.abs(got - want).max())
    print("LOOP_OK")
""")


def test_decode_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "decode_attention", tmp_path)


# --- issue 15's options: cursor loads (LaunchOptions::cursor_loads) and the "fit" plan policy -----

def _cuda_call(q, k, v, lens, bias=None, sink=None, **static):
    return np.asarray(jax.jit(functools.partial(cuda.decode_attention, **static))(q, k, v, lens, bias, sink))


# (Hq, Hkv, S): packed rows 4 (16-row blocks), 8, 16, 64 (64-row), 256 (two 128-row blocks), 15.
CURSOR_HEADS = [(32, 8, 1), (64, 8, 1), (16, 1, 1), (32, 8, 16), (64, 8, 32), (6, 2, 5)]


@pytest.mark.parametrize("heads", CURSOR_HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("d", HEAD_DIMS, ids=lambda d: f"d{d}")
@pytest.mark.parametrize("dtype", DTYPES, ids=["fp16", "bf16"])
def test_cursor_loads_give_the_same_bits(dtype, d, heads):
    """The cursor loads copy the same shared-memory tiles as the strided ones: the same bits for
    every layout, with tiles cut by kv_len (NaN past it), by a window's start and by the capacity
    (not a multiple of the tile), over one split, 64-row splits and the planner's; and the
    reference's values."""
    hq, hkv, s = heads
    c = 200 if d != 256 else 131
    _, q, k, v, lens = _inputs(d + hq + s + 15, 3, hq, hkv, s, d, c, dtype)
    for split_rows in (None, 64, -(-c // 64) * 64):
        for left in (-1, 37):
            static = dict(scale=float(1 / np.sqrt(d)), causal=True, left=left, split_rows=split_rows)
            strided = _cuda_call(q, k, v, lens, cursor_loads=False, **static)
            cursor = _cuda_call(q, k, v, lens, cursor_loads=True, **static)
            assert not np.isnan(cursor.astype(np.float32)).any()
            np.testing.assert_array_equal(cursor, strided)
    want = _run("reference", q, k, v, lens, scale=float(1 / np.sqrt(d)), causal=True, left=37)
    assert_close(cursor, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_cursor_loads_with_every_feature_and_a_cluster(dtype):
    """The logit variant (softcap, bias), sinks, a window and pos_shift through the cursor loads, in
    a cluster and with the combine kernel: the strided loads' bits."""
    hq, hkv, s, d, c = 8, 2, 3, 128, 700  # 12 packed rows: a 16-row block, as a cluster takes
    rng, q, k, v, lens = _inputs(21, 3, hq, hkv, s, d, c, dtype)
    bias = decode_cases.bias("f32_full", rng, 3, hq, s, c)
    sink = rng.standard_normal(hq).astype(np.float32)
    for cluster in (True, False):
        static = dict(scale=0.09, softcap=20.0, causal=True, left=90, right=-1, pos_shift=-2,
                      split_rows=128, cluster=cluster)
        strided = _cuda_call(q, k, v, lens, bias, sink, cursor_loads=False, **static)
        np.testing.assert_array_equal(_cuda_call(q, k, v, lens, bias, sink, cursor_loads=True, **static),
                                      strided)


# B=2-16 decode shapes of issue 15 (32/8, q_len 1) where the "fit" plan or the default "wave" plan
# (11-, 6- or 3-CTA clusters) differs from the ladder.
FIT_CASES = [(8, 64, 2048), (8, 64, 2304), (8, 128, 4096), (2, 128, 2048), (16, 64, 2048), (4, 80, 1000),
             (4, 128, 1024), (4, 64, 2304), (2, 64, 4096)]


@pytest.mark.parametrize("case", FIT_CASES, ids=lambda x: f"b{x[0]}_d{x[1]}_c{x[2]}")
@pytest.mark.parametrize("cursor", [False, True], ids=["strided", "cursor"])
@pytest.mark.parametrize("policy", ["fit", "wave"])
def test_capped_plan_policies(case, cursor, policy):
    """The "fit" plan (one clustered launch at these shapes) and the "wave" plan (the default)
    against the reference, with ragged lengths (0, fewer keys than a split, NaN past kv_len) and
    bitwise repeatable; their cursor and strided loads give the same bits."""
    b, d, c = case
    plan = cuda.decode_plan(b, 32, 8, 1, c, d, policy=policy)
    assert plan["cluster"] or policy == "wave", plan
    lens = [min(n, c) for n in [c, 0, 70, c - 1, 500, 1, 1500, c] * 2][:b]
    _, q, k, v, lens = _inputs(b + d + c, b, 32, 8, 1, d, c, np.float16, lens=lens)
    f = functools.partial(_cuda_call, scale=float(1 / np.sqrt(d)), plan_policy=policy)
    got = f(q, k, v, lens, cursor_loads=cursor)
    want = _run("reference", q, k, v, lens, scale=float(1 / np.sqrt(d)))
    assert not np.isnan(got.astype(np.float32)).any()
    assert_close(got, want, np.float16)
    np.testing.assert_array_equal(f(q, k, v, lens, cursor_loads=cursor), got)
    np.testing.assert_array_equal(f(q, k, v, lens, cursor_loads=not cursor), got)
    hlo = jax.jit(functools.partial(cuda.decode_attention, scale=0.1, plan_policy="fit")).lower(
        q, k, v, lens).as_text()
    assert "cluster = true" in hlo


@pytest.mark.parametrize("c,kv_len", [(1280, 1280), (2304, 2049), (4096, 70), (8192, 8191), (2048, 0),
                                      (16384, 12345)])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_batch_1_head_dim_128_plans(c, kv_len, dtype):
    """The default B=1 d128 plans (splits of >= 4 tiles and the combine kernel, 8-16 tiles at 8k-16k,
    or 8-CTA clusters of <= 2 tiles) against the reference and the ladder's 12- / 16-CTA clusters,
    bitwise repeatable."""
    plan = cuda.decode_plan(1, 32, 8, 1, c, 128)
    assert plan["split_rows"] >= 4 * cuda.DECODE_BLOCK_N or plan["cluster"], plan
    _, q, k, v, lens = _inputs(c + kv_len, 1, 32, 8, 1, 128, c, dtype, lens=[kv_len])
    f = functools.partial(_cuda_call, scale=0.09)
    got = f(q, k, v, lens)
    want = _run("reference", q, k, v, lens, scale=0.09)
    assert not np.isnan(got.astype(np.float32)).any()
    assert_close(got, want, dtype)
    assert_close(got, _cuda_call(q, k, v, lens, scale=0.09, plan_policy="ladder"), dtype)
    np.testing.assert_array_equal(f(q, k, v, lens), got)


def test_decode_loop_in_a_command_buffer_with_the_options(tmp_path, monkeypatch):
    """The decode loop of test_decode_loop_in_a_command_buffer with JOA_DECODE_PLAN=fit (B=2: an
    11-CTA cluster) and JOA_DECODE_CURSOR_LOADS=1: captured, replayed with the same bits."""
    monkeypatch.setenv(cuda.PLAN_POLICY_ENV, "fit")
    monkeypatch.setenv(cuda.CURSOR_LOADS_ENV, "1")
    command_buffer.assert_captured(_LOOP, "decode_attention", tmp_path)
