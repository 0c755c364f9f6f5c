"""The prefill engine's spec and wrapper on the CPU: `reference.prefill.prefill_attention` against
a plain NumPy loop and against the decode spec (uniform lengths), and `cuda.prefill_attention`'s
trace-time checks and batching with the kernel swapped for its spec (tests/kernel_specs.py). The
kernel itself: tests/gpu/test_prefill_engine_gpu.py."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import _extension
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import decode as decode_reference
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close

from kernel_specs import use_specs


def _numpy_prefill(q, k, v, q_len, kv_len, scale, causal, left=-1, right=-1, sink=None, softcap=0.0):
    b, hq, s, d = q.shape
    hkv, t = k.shape[1], k.shape[2]
    g = hq // hkv
    y = np.zeros((b, hq, s, d), np.float64)
    for bi in range(b):
        ql, kl = int(np.clip(q_len[bi], 0, s)), int(np.clip(kv_len[bi], 0, t))
        for h in range(hq):
            for i in range(ql):
                pos = kl - ql + i
                keys = [j for j in range(kl) if (not causal or j <= pos)
                        and (left < 0 or pos - j <= left) and (right < 0 or j - pos <= right)]
                if not keys:
                    continue
                x = np.array([scale * q[bi, h, i].astype(np.float64) @ k[bi, h // g, j].astype(np.float64)
                              for j in keys])
                if softcap > 0:
                    x = softcap * np.tanh(x / softcap)
                m = x.max() if sink is None else max(x.max(), float(sink[h]))
                p = np.exp(x - m)
                denom = p.sum() + (0.0 if sink is None else np.exp(float(sink[h]) - m))
                y[bi, h, i] = (p / denom) @ v[bi, h // g, keys].astype(np.float64)
    return y


def _inputs(rng, b, hq, hkv, s, t, d, dtype=np.float32):
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    return q, k, v


@pytest.mark.parametrize("causal", [True, False])
def test_spec_matches_a_numpy_loop_with_ragged_lengths(causal):
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, 5, 4, 2, 6, 9, 8)
    q_len = np.array([6, 3, 0, 6, 9], np.int32)   # full, short, none, more than kv, beyond S
    kv_len = np.array([9, 5, 9, 2, -1], np.int32)
    for bi, n in enumerate(kv_len):  # keys past kv_len are never read
        k[bi, :, max(n, 0):] = np.nan
        v[bi, :, max(n, 0):] = np.nan
    got = prefill_reference.prefill_attention(q, k, v, q_len, kv_len, scale=0.4, causal=causal)
    want = _numpy_prefill(q, k, v, q_len, kv_len, 0.4, causal)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_spec_with_full_query_rows_is_the_decode_spec(causal):
    rng = np.random.default_rng(1)
    q, k, v = _inputs(rng, 3, 8, 2, 5, 11, 16, ml_dtypes.bfloat16)
    kv_len = np.array([11, 7, 5], np.int32)
    got = prefill_reference.prefill_attention(q, k, v, np.full((3,), 5, np.int32), kv_len, scale=0.25,
                                              causal=causal)
    want = decode_reference.decode_attention(q, k, v, kv_len, scale=0.25, causal=causal)
    assert_close(got, want)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("left,right", [(0, -1), (2, -1), (-1, 0), (-1, 3), (0, 0), (1, 2),
                                        (20, 20), (-1, -1)])
def test_spec_windows_match_a_numpy_loop(causal, left, right):
    """Local windows: key j hidden from the row at position p when p - j > left or j - p > right
    (0: the row's own position only; > T: no limit)."""
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, 4, 4, 2, 6, 9, 8)
    q_len = np.array([6, 3, 6, 0], np.int32)
    kv_len = np.array([9, 5, 2, 9], np.int32)
    for bi, n in enumerate(kv_len):
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    got = prefill_reference.prefill_attention(q, k, v, q_len, kv_len, scale=0.4, causal=causal,
                                              left=left, right=right)
    want = _numpy_prefill(q, k, v, q_len, kv_len, 0.4, causal, left, right)
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("left,right", [(3, -1), (-1, 2), (0, 4)])
def test_spec_windows_with_full_query_rows_are_the_decode_spec(causal, left, right):
    rng = np.random.default_rng(4)
    q, k, v = _inputs(rng, 3, 8, 2, 5, 11, 16, ml_dtypes.bfloat16)
    kv_len = np.array([11, 7, 5], np.int32)
    got = prefill_reference.prefill_attention(q, k, v, np.full((3,), 5, np.int32), kv_len, scale=0.25,
                                              causal=causal, left=left, right=right)
    want = decode_reference.decode_attention(q, k, v, kv_len, scale=0.25, causal=causal, left=left,
                                             right=right)
    assert_close(got, want)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("window", [(-1, -1), (2, 1)])
def test_spec_sinks_match_a_numpy_loop(causal, window):
    """sink [Hq]: an extra logit per query head in the max and the denominator, no value row; from
    very negative (no effect) to very large (all weight on the sink: 0)."""
    rng = np.random.default_rng(5)
    q, k, v = _inputs(rng, 4, 4, 2, 6, 9, 8)
    q_len = np.array([6, 3, 6, 0], np.int32)
    kv_len = np.array([9, 5, 2, 9], np.int32)
    sink = np.array([0.0, 1.5, -1e4, 1e4], np.float32)
    for bi, n in enumerate(kv_len):
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    got = prefill_reference.prefill_attention(q, k, v, q_len, kv_len, sink, scale=0.4, causal=causal,
                                              left=window[0], right=window[1])
    want = _numpy_prefill(q, k, v, q_len, kv_len, 0.4, causal, *window, sink=sink)
    assert_close(got, want, np.float32)
    assert np.isfinite(np.asarray(got)).all() and not np.asarray(got)[:, 3].any()


@pytest.mark.parametrize("causal", [True, False])
def test_spec_sinks_with_full_query_rows_are_the_decode_spec(causal):
    rng = np.random.default_rng(6)
    q, k, v = _inputs(rng, 3, 8, 2, 5, 11, 16, ml_dtypes.bfloat16)
    kv_len = np.array([11, 7, 5], np.int32)
    sink = rng.standard_normal(8).astype(np.float32) * 3
    got = prefill_reference.prefill_attention(q, k, v, np.full((3,), 5, np.int32), kv_len, sink,
                                              scale=0.25, causal=causal, left=3)
    want = decode_reference.decode_attention(q, k, v, kv_len, sink=sink, scale=0.25, causal=causal,
                                             left=3)
    assert_close(got, want)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("softcap", [0.5, 3.0, 50.0])
def test_spec_softcap_matches_a_numpy_loop(causal, softcap):
    """softcap > 0: x -> softcap * tanh(x / softcap) before the mask; with windows and sinks."""
    rng = np.random.default_rng(8)
    q, k, v = _inputs(rng, 4, 4, 2, 6, 9, 8)
    q *= 3
    q_len = np.array([6, 3, 6, 0], np.int32)
    kv_len = np.array([9, 5, 2, 9], np.int32)
    sink = np.array([0.0, 1.5, -2.0, 0.3], np.float32)
    for bi, n in enumerate(kv_len):
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    for kw in (dict(), dict(left=2, right=1, sink=sink)):
        got = prefill_reference.prefill_attention(q, k, v, q_len, kv_len, kw.get("sink"), scale=0.4,
                                                  causal=causal, softcap=softcap,
                                                  left=kw.get("left", -1), right=kw.get("right", -1))
        want = _numpy_prefill(q, k, v, q_len, kv_len, 0.4, causal, kw.get("left", -1),
                              kw.get("right", -1), sink=kw.get("sink"), softcap=softcap)
        assert_close(got, want, np.float32)


@pytest.mark.parametrize("causal", [True, False])
def test_spec_softcap_with_full_query_rows_is_the_decode_spec(causal):
    rng = np.random.default_rng(9)
    q, k, v = _inputs(rng, 3, 8, 2, 5, 11, 16, ml_dtypes.bfloat16)
    kv_len = np.array([11, 7, 5], np.int32)
    got = prefill_reference.prefill_attention(q, k, v, np.full((3,), 5, np.int32), kv_len,
                                              scale=0.5, causal=causal, softcap=2.0)
    want = decode_reference.decode_attention(q, k, v, kv_len, scale=0.5, causal=causal, softcap=2.0)
    assert_close(got, want)


needs_limits = pytest.mark.skipif(_extension._ffi is None, reason="extension not built")


@needs_limits
def test_head_dims_and_schedules_come_from_the_extension():
    limits = _extension.limits()["prefill"]
    assert cuda.PREFILL_HEAD_DIMS == tuple(limits["head_dims"]) == (64, 80, 96, 128, 256)
    assert cuda.PREFILL_SCHEDULES == tuple(limits["schedules"]) == (
        "serial", "overlap", "pingpong", "pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy", "pingpong-n176",
        "pingpong-fold-lazy-n176", "pingpong-fold-lazy-s4", "pingpong-n192", "pingpong-fold-lazy-n192",
        "pingpong-fold-lazy-n192-s4", "pingpong-fold-lazy-m192", "pingpong-fold-lazy-m192-s4")


@needs_limits
def test_tiling_per_head_dim_comes_from_the_extension():
    """params.h TilingFor: 80 / 96 run in the 128-wide tiles; 256 takes 80-key tiles (FA3's)."""
    tiling = cuda.PREFILL_TILING
    assert set(tiling) == set(cuda.PREFILL_HEAD_DIMS)
    for d, t in tiling.items():
        assert t["padded"] >= d and t["padded"] % 64 == 0 and t["block_n"] % 16 == 0 and t["stages"] >= 2
    assert tiling[80]["padded"] == tiling[96]["padded"] == 128
    assert tiling[128] == {"padded": 128, "block_n": 128, "stages": 2, "schedule": "pingpong-fold-lazy"}
    assert tiling[256] == {"padded": 256, "block_n": 80, "stages": 2, "schedule": "overlap"}
    assert {t["schedule"] for t in tiling.values()} <= set(cuda.PREFILL_SCHEDULES)


@needs_limits
@pytest.mark.parametrize("d", [64, 96, 256])
def test_default_schedule_is_the_head_dims(monkeypatch, d):
    """schedule=None lowers the head size's default (PREFILL_TILING); a named one is kept."""
    calls = use_specs(monkeypatch)
    q = np.zeros((1, 2, 8, d), np.float16)
    k = np.zeros((1, 1, 8, d), np.float16)
    lens = np.full((1,), 8, np.int32)
    jax.eval_shape(lambda q, k: cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True), q, k)
    assert calls[-1][2]["schedule"] == cuda.PREFILL_TILING[d]["schedule"]
    jax.eval_shape(lambda q, k: cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True,
                                                       schedule="serial"), q, k)
    assert calls[-1][2]["schedule"] == "serial"


@needs_limits
@pytest.mark.parametrize("change,exc,match", [
    (dict(q=np.zeros((2, 4, 8), np.float16)), ValueError, "q: must be rank 4"),
    (dict(q=np.zeros((2, 4, 8, 128), np.float32)), TypeError, "q: must be float16 or bfloat16"),
    (dict(k=np.zeros((2, 2, 16, 128), ml_dtypes.bfloat16)), TypeError, "k: must have q's dtype"),
    (dict(q=np.zeros((2, 4, 8, 112), np.float16), k=np.zeros((2, 2, 16, 112), np.float16),
          v=np.zeros((2, 2, 16, 112), np.float16)), ValueError, "q: head size 112"),
    (dict(k=np.zeros((3, 2, 16, 128), np.float16)), ValueError, r"k: must be \[B=2"),
    (dict(k=np.zeros((2, 3, 16, 128), np.float16), v=np.zeros((2, 3, 16, 128), np.float16)),
     ValueError, "k: KV heads 3"),
    (dict(v=np.zeros((2, 2, 17, 128), np.float16)), ValueError, "v: must have k's shape"),
    (dict(q_len=np.zeros((3,), np.int32)), ValueError, r"q_len: must be an integer \[B=2\]"),
    (dict(kv_len=np.zeros((2,), np.float32)), TypeError, "kv_len: must be an integer"),
    (dict(sink=np.zeros((2,), np.float32)), ValueError, r"sink: must be \[Hq=4\]"),
])
def test_wrapper_names_the_bad_input(change, exc, match):
    """Each rule of the engine's inputs, broken once, names the input."""
    args = dict(q=np.zeros((2, 4, 8, 128), np.float16), k=np.zeros((2, 2, 16, 128), np.float16),
                v=np.zeros((2, 2, 16, 128), np.float16), q_len=np.full((2,), 8, np.int32),
                kv_len=np.full((2,), 16, np.int32))
    args.update(change)
    with pytest.raises(exc, match=f"prefill_attention: {match}"):
        jax.eval_shape(lambda **a: cuda.prefill_attention(**a, scale=0.1, causal=True), **args)


@needs_limits
def test_wrapper_under_jit_and_vmap_folds_into_one_call(monkeypatch):
    calls = use_specs(monkeypatch)
    rng = np.random.default_rng(2)
    q, k, v = _inputs(rng, 2 * 3, 4, 2, 8, 12, 64, np.float16)
    q, k, v = (x.reshape(2, 3, *x.shape[1:]) for x in (q, k, v))
    q_len = np.array([[8, 5, 1], [8, 8, 0]], np.int32)
    kv_len = np.array([[12, 9, 3], [10, 12, 12]], np.int32)
    f = jax.jit(jax.vmap(lambda *a: cuda.prefill_attention(*a, scale=0.125, causal=True,
                                                           schedule="pingpong")))
    got = f(q, k, v, q_len, kv_len)
    assert calls[-1][:2] == ("prefill", (6, 4, 8, 64))  # the lowered call: the mapped axis folded into B
    for n in range(2):
        want = prefill_reference.prefill_attention(q[n], k[n], v[n], q_len[n], kv_len[n], scale=0.125,
                                                   causal=True)
        assert_close(got[n], want)
    assert jnp.asarray(got).dtype == jnp.float16


@needs_limits
@pytest.mark.parametrize("name", ["left", "right"])
def test_negative_window_below_minus_one_is_refused(name):
    q = np.zeros((1, 2, 4, 64), np.float16)
    k = np.zeros((1, 1, 4, 64), np.float16)
    lens = np.full((1,), 4, np.int32)
    with pytest.raises(ValueError, match=f"prefill_attention: {name}: must be -1"):
        cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True, **{name: -2})


@needs_limits
def test_wrapper_sink_under_jit_and_vmap(monkeypatch):
    """The sink [Hq] is shared by the folded batch (not mapped) and reaches the spec as float32."""
    calls = use_specs(monkeypatch)
    rng = np.random.default_rng(7)
    q, k, v = _inputs(rng, 2 * 2, 4, 2, 8, 12, 64, np.float16)
    q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v))
    lens = np.array([[8, 5], [3, 8]], np.int32), np.array([[12, 9], [10, 12]], np.int32)
    sink = np.array([0.5, -2.0, 0.0, 3.0], np.float16)
    f = jax.jit(jax.vmap(lambda q, k, v, a, b: cuda.prefill_attention(q, k, v, a, b, sink, scale=0.125,
                                                                     causal=True, left=4)))
    got = f(q, k, v, *lens)
    assert calls[-1][:2] == ("prefill", (4, 4, 8, 64))
    for n in range(2):
        want = prefill_reference.prefill_attention(q[n], k[n], v[n], lens[0][n], lens[1][n],
                                                   sink.astype(np.float32), scale=0.125,
                                                   causal=True, left=4)
        assert_close(got[n], want)


@needs_limits
def test_unknown_schedule_is_refused():
    q = np.zeros((1, 2, 4, 64), np.float16)
    k = np.zeros((1, 1, 4, 64), np.float16)
    lens = np.full((1,), 4, np.int32)
    with pytest.raises(ValueError, match="prefill_attention: schedule: must be one of"):
        cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True, schedule="fast")


@needs_limits
def test_wrapper_takes_the_persistent_switch_at_trace_time(monkeypatch):
    """cuda.prefill_attention resolves JOA_PREFILL_PERSISTENT when it is traced (unset: persistent
    over at most PREFILL_PERSISTENT_MAX_KEYS key rows; "0" off, "1" on) and hands it to the kernel
    call as a bool; an explicit argument wins."""
    calls = use_specs(monkeypatch)
    q = np.zeros((1, 2, 8, 64), np.float16)
    k = np.zeros((1, 1, 8, 64), np.float16)
    lens = np.full((1,), 8, np.int32)

    def persistent(**kw):
        jax.eval_shape(lambda q, k: cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True, **kw),
                       q, k)
        return calls[-1][2]["persistent"]

    monkeypatch.delenv(cuda.PREFILL_PERSISTENT_ENV, raising=False)
    most = cuda.PREFILL_PERSISTENT_MAX_KEYS
    assert cuda.prefill_persistent(most) is True and cuda.prefill_persistent(most + 1) is False
    assert persistent() is True  # 8 key rows
    long_k = np.zeros((1, 1, most + 128, 64), np.float16)
    jax.eval_shape(lambda q, k: cuda.prefill_attention(q, k, k, lens, lens, scale=0.1, causal=True), q, long_k)
    assert calls[-1][2]["persistent"] is False
    monkeypatch.setenv(cuda.PREFILL_PERSISTENT_ENV, "1")
    assert cuda.prefill_persistent(most + 1) is True and persistent() is True
    assert persistent(persistent=False) is False
    monkeypatch.setenv(cuda.PREFILL_PERSISTENT_ENV, "0")
    assert persistent() is False and persistent(persistent=True) is True
    # A named schedule or splits leave the switch as it is (the launch applies it where it can).
    assert persistent(schedule="serial", persistent=True) is True
