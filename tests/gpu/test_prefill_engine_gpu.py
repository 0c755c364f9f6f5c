"""The Hopper prefill engine (prefill_attention target, ffi/kernels/prefill/) against its spec,
`jax_onnx_attn.ops.reference.prefill.prefill_attention`.

Sweeps causal / non-causal x GQA groups 1 / 4 / 8 x S in {1, 63, 128, 1000, 2048} (T >= S) x
float16 / bfloat16 at head size 128, with ragged q and kv lengths per batch row and K / V rows past
kv_len poisoned with NaN (they must never reach the output); head size 64; head sizes 80 / 96 (the
128-wide tiles, zero-filled past D) and 256 (80-key tiles) with every feature (their test names
carry d80 / d96 / d256: `-k "d80 or d96 or d256"` selects them); the length edge cases
(0, q_len > kv_len, beyond the buffers, negative); local windows (left / right, 0 to wider than T);
sinks (-1e4 to 1e4, per query head); softcap (with windows and sinks);
bitwise repeatability run to run and batch
invariance; a loop of calls inside an XLA command buffer. Every value check runs the three
consumer schedules (serial, overlap, pingpong) and holds them to the same bits. Tolerances:
jax_onnx_attn.testing.

Needs an sm_90 GPU (H100 / H200): elsewhere the engine refuses to launch and these tests skip.
"""

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close

import command_buffer
from prefill_cases import engine_inputs as _inputs, needs_sm90

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]


_reference = jax.jit(prefill_reference.prefill_attention,
                     static_argnames=("scale", "causal", "softcap", "left", "right"))
_engine = jax.jit(cuda.prefill_attention,
                  static_argnames=("scale", "causal", "softcap", "left", "right", "schedule"))
SCHEDULES = ("serial", "overlap", "pingpong")


def _check(q, k, v, q_len, kv_len, sink=None, *, causal, scale=None, **variant):
    """Every schedule of the engine against the spec, and against each other: they add in the same
    order, so their bits agree. variant: the spec's other keywords (left, right, ...)."""
    scale = float(scale if scale is not None else q.shape[-1] ** -0.5)
    want = _reference(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, **variant)
    got = {name: _engine(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, schedule=name,
                         **variant)
           for name in SCHEDULES}
    for name, y in got.items():
        assert y.shape == q.shape and y.dtype == q.dtype
        assert_close(y, want, q.dtype, err_msg=name)
    for name in SCHEDULES[1:]:
        assert np.array_equal(np.asarray(got["serial"]), np.asarray(got[name]), equal_nan=True), name
    return got["serial"]


def _ragged(s, t, b=3):
    """Lengths of b batch rows: full, then shorter q and kv (T >= S on every row)."""
    q_len = [s, max(s - 17, 1), max(s // 2, 1)]
    kv_len = [t, t - 5 if t - 5 >= q_len[1] else t, max(q_len[2] + 3, min(t, q_len[2] + 100))]
    q_len, kv_len = q_len[:b], kv_len[:b]
    return q_len, kv_len


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("s", [1, 63, 128, 1000, 2048])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_values(causal, group, s, dtype):
    hkv, t = 2, s + 37
    q_len, kv_len = _ragged(s, t)
    args = _inputs(s * 31 + group, 3, hkv * group, hkv, s, t, 128, dtype, q_len, kv_len)
    _check(*args, causal=causal)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("s,t,group", [(1, 1, 8), (100, 300, 4), (257, 257, 1), (512, 1500, 8)])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_head_dim_64(causal, s, t, group, dtype):
    q_len, kv_len = _ragged(s, t)
    args = _inputs(s + t + group, 3, 2 * group, 2, s, t, 64, dtype, q_len, kv_len)
    _check(*args, causal=causal)


# --- local windows: tiles outside every row's window skipped, inside it unmasked --------------------

@needs_sm90
@pytest.mark.parametrize("causal,left,right", [
    (True, 0, -1), (True, 127, -1), (True, 300, -1), (True, 5000, -1), (False, 0, 0),
    (False, -1, 0), (False, 200, 70), (False, -1, 129), (False, 5000, 5000)], ids=lambda x: str(x))
def test_local_windows(causal, left, right):
    """Windows of 0 (the row's own key), around the 128-key tile size, wider than T; GQA group 4,
    ragged lengths, poisoned keys past kv_len; f16 and bf16."""
    s, t = 700, 900
    for dtype, d in ((np.float16, 128), (ml_dtypes.bfloat16, 64)):
        args = _inputs(7 * (left + 1) + right + 1, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        _check(*args, causal=causal, left=left, right=right)


@needs_sm90
def test_local_window_tiles_crossing_heads():
    """A CTA's rows span several query heads (S = 45): the block's bounds cover all their positions."""
    args = _inputs(12, 2, 16, 2, 45, 300, 128, np.float16, [45, 30], [300, 200])
    _check(*args, causal=True, left=20)
    _check(*args, causal=False, left=10, right=3)


# --- sinks: one extra logit per query head, added once in the epilogue ------------------------------

def _sinks(hq, seed):
    """Sinks from very negative (no effect) through 0 and typical values to very large (all the
    weight on the sink: the row's output ~0)."""
    fixed = np.array([-1e4, 0.0, 1e4, -30.0], np.float32)
    rng = np.random.default_rng(seed)
    return np.concatenate([fixed, rng.uniform(-4, 8, hq - 4).astype(np.float32)])[:hq]


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, -1, -1), (False, -1, -1), (True, 100, -1),
                                               (False, 40, 0)], ids=lambda x: str(x))
def test_sinks(causal, left, right):
    """GQA group 4 (the sink is indexed by the query head of each packed row), ragged lengths,
    windows, f16 / D 128 and bf16 / D 64."""
    s, t = 600, 700
    for dtype, d in ((np.float16, 128), (ml_dtypes.bfloat16, 64)):
        args = _inputs(d + left, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        sink = _sinks(8, d)
        got = np.asarray(_check(*args[:5], sink, causal=causal, left=left, right=right)).astype(np.float32)
        assert np.isfinite(got).all()
        assert np.abs(got[:, 2]).max() < 1e-3  # head 2's sink 1e4 takes all the weight


@needs_sm90
def test_sinks_on_rows_without_keys_and_crossing_heads():
    """Rows that see no key (q_len > kv_len, causal) give 0 whatever the sink; S = 45 puts several
    query heads in one CTA (each row its own head's sink)."""
    args = _inputs(13, 3, 16, 2, 45, 60, 128, np.float16, [45, 45, 30], [60, 20, 0])
    sink = _sinks(16, 1)
    got = np.asarray(_check(*args, sink, causal=True)).astype(np.float32)
    assert not got[1, :, :25].any() and not got[2].any()
    _check(*args, sink, causal=False, left=5, right=5)


# --- softcap: its own kernels (CapVariant, tanhf per logit) -----------------------------------------

@needs_sm90
@pytest.mark.parametrize("causal,softcap,left,sinks", [
    (True, 30.0, -1, False), (False, 5.0, -1, True), (True, 1.0, 150, True), (False, 50.0, -1, False)],
    ids=lambda x: str(x))
def test_softcap(causal, softcap, left, sinks):
    """Logits past the cap (q scaled by 4), with and without windows and sinks (the WithSink<CapVariant>
    kernels); f16 / D 128 and bf16 / D 64, ragged lengths, GQA group 4."""
    s, t = 500, 640
    for dtype, d in ((np.float16, 128), (ml_dtypes.bfloat16, 64)):
        q, k, v, q_len, kv_len = _inputs(int(softcap) + d, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        q = (q.astype(np.float32) * 4).astype(dtype)
        sink = _sinks(8, 3) if sinks else None
        _check(q, k, v, q_len, kv_len, sink, causal=causal, softcap=softcap, left=left)


# --- diagnostics: each isolates one half of the engine, so a failure says where to look ------------

@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zero_queries_average_the_visible_values(schedule):
    """q = 0: every visible key scores the same, so y is the mean of the visible V rows. Exercises
    P V (the MN-major V descriptor, the V ring, the tail zeroing), the mask and the row sums without
    depending on Q K^T."""
    _zero_queries(schedule, 128)


def _zero_queries(schedule, d):
    b, hq, hkv, s, t = 2, 8, 2, 200, 300
    rng = np.random.default_rng(5)
    q = np.zeros((b, hq, s, d), np.float16)
    k = rng.standard_normal((b, hkv, t, d)).astype(np.float16)
    v = rng.standard_normal((b, hkv, t, d)).astype(np.float16)
    kv_len = np.array([300, 250], np.int32)
    v[1, :, 250:] = np.nan
    got = np.asarray(_engine(q, k, v, np.full((b,), s, np.int32), kv_len, scale=0.1, causal=True,
                             schedule=schedule), np.float64)
    v64 = v.astype(np.float64)
    for bi in range(b):
        for i in (0, 1, 99, 199):
            keys = kv_len[bi] - s + i + 1  # causal: keys 0 .. pos
            want = v64[bi, :, :keys].mean(axis=1)  # [Hkv, D]
            want = np.broadcast_to(want[:, None, :], (hkv, hq // hkv, d))
            assert_close(got[bi, :, i].reshape(hkv, hq // hkv, d), want, np.float16,
                         err_msg=f"batch row {bi}, query row {i}")


@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_hot_keys_pick_one_value_row(schedule):
    """Key j = 30·e_(j mod D) and query i = e_(i mod D) (no causal mask): query i's softmax is all
    on the keys with j = i mod D, so y is the mean of those V rows. Exercises Q K^T (the K-major
    descriptors, the swizzle, the 32-byte k-steps across both 64-column blocks of D)."""
    _one_hot_keys(schedule, 128, 128, 256)


def _one_hot_keys(schedule, d, s, t):
    b, h = 1, 1
    q = np.zeros((b, h, s, d), np.float32)
    k = np.zeros((b, h, t, d), np.float32)
    q[0, 0, np.arange(s), np.arange(s) % d] = 1.0
    k[0, 0, np.arange(t), np.arange(t) % d] = 30.0
    rng = np.random.default_rng(6)
    v = rng.standard_normal((b, h, t, d)).astype(np.float16)
    lens = np.array([s], np.int32), np.array([t], np.int32)
    got = np.asarray(_engine(q.astype(np.float16), k.astype(np.float16), v, *lens, scale=1.0,
                             causal=False, schedule=schedule), np.float64)
    v64 = v.astype(np.float64)
    want = np.stack([v64[0, 0, [j for j in range(t) if j % d == i % d]].mean(axis=0) for i in range(s)])
    assert_close(got[0, 0], want, np.float16)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_length_edge_cases(causal):
    """q_len 0 (all rows 0), kv_len 0 (no keys: 0), q_len > kv_len (early rows see nothing when
    causal), lengths beyond the buffers (clamped) and negative (0)."""
    _length_edge_cases(causal, 128)


def _length_edge_cases(causal, d):
    s, t = 200, 300
    q_len = [0, 150, 200, 999, -4, 200]
    kv_len = [300, 0, 90, 5000, 300, -1]
    args = _inputs(7, 6, 8, 2, s, t, d, ml_dtypes.bfloat16, q_len, kv_len)
    got = np.asarray(_check(*args, causal=causal)).astype(np.float32)
    assert not got[0].any() and not got[1].any() and not got[4].any() and not got[5].any()
    if causal:  # row 2: query i sits at 90 - 200 + i, so rows i < 110 see no key
        assert not got[2, :, :110].any() and got[2, :, 110:].any()


@needs_sm90
def test_tiles_crossing_heads():
    """Packed rows of one CTA span two query heads (S not a multiple of the 128-row tile) and the
    last key tile reads past T into the next KV head's rows (masked, V zeroed)."""
    args = _inputs(11, 2, 16, 2, 45, 45, 128, np.float16, [45, 30], [45, 40])
    _check(*args, causal=True)
    _check(*args, causal=False)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bitwise_repeatable_and_batch_invariant(causal, schedule):
    _bitwise_repeatable(causal, schedule, 128)


def _bitwise_repeatable(causal, schedule, d):
    s, t = 1000, 1200
    q, k, v, q_len, kv_len = _inputs(3, 3, 16, 2, s, t, d, ml_dtypes.bfloat16, [1000, 700, 999],
                                     [1200, 800, 1000])
    f = functools.partial(_engine, scale=0.1, causal=causal, schedule=schedule)
    first = np.asarray(f(q, k, v, q_len, kv_len))
    for _ in range(3):
        assert np.array_equal(first, np.asarray(f(q, k, v, q_len, kv_len)), equal_nan=True)
    # One batch row alone gives the same bits as inside the batch (same tiles, same order).
    alone = np.asarray(f(q[1:2], k[1:2], v[1:2], q_len[1:2], kv_len[1:2]))
    assert np.array_equal(first[1:2], alone, equal_nan=True)


# --- head sizes 80 / 96 (the 128-wide tiles, zero-filled past D) and 256 (80-key tiles) -------------
# Every test name here carries the head sizes it runs (d80 / d96 / d256), for -k.

BF16 = ml_dtypes.bfloat16


@needs_sm90
@pytest.mark.parametrize("s,t,group", [(1, 1, 8), (100, 300, 4), (257, 257, 1), (1000, 1037, 8)],
                         ids=lambda x: str(x))
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("d,dtype", [(80, np.float16), (96, BF16), (256, np.float16), (256, BF16)],
                         ids=["d80-f16", "d96-bf16", "d256-f16", "d256-bf16"])
def test_head_dims_80_96_256(d, dtype, causal, s, t, group):
    """Ragged lengths, poisoned keys past kv_len, GQA groups 1 / 4 / 8; T = 257 / 300 / 1037 end
    mid-tile for both 128- and 80-key tiles."""
    q_len, kv_len = _ragged(s, t)
    args = _inputs(s + t + group + d, 3, 2 * group, 2, s, t, d, dtype, q_len, kv_len)
    _check(*args, causal=causal)


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, 79, -1), (True, 300, -1), (False, 80, 81),
                                               (False, -1, 0)], ids=lambda x: str(x))
def test_local_windows_d256_d96(causal, left, right):
    """Windows at the 80-key tile size of D 256 (tiles skipped, unmasked inside every row's window),
    GQA group 4, ragged lengths; bf16 / D 256 and f16 / D 96."""
    s, t = 700, 900
    for dtype, d in ((BF16, 256), (np.float16, 96)):
        args = _inputs(7 * (left + 1) + right + d, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        _check(*args, causal=causal, left=left, right=right)


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, -1, -1), (False, 40, 0)], ids=lambda x: str(x))
def test_sinks_d256_d80(causal, left, right):
    s, t = 600, 700
    for dtype, d in ((np.float16, 256), (BF16, 80)):
        args = _inputs(d + left, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        got = np.asarray(_check(*args[:5], _sinks(8, d), causal=causal, left=left, right=right))
        got = got.astype(np.float32)
        assert np.isfinite(got).all()
        assert np.abs(got[:, 2]).max() < 1e-3  # head 2's sink 1e4 takes all the weight


@needs_sm90
@pytest.mark.parametrize("causal,softcap,left,sinks", [(True, 30.0, -1, False), (False, 5.0, 150, True)],
                         ids=lambda x: str(x))
def test_softcap_d256_d96(causal, softcap, left, sinks):
    s, t = 500, 640
    for dtype, d in ((BF16, 256), (np.float16, 96)):
        q, k, v, q_len, kv_len = _inputs(int(softcap) + d, 3, 8, 2, s, t, d, dtype, *_ragged(s, t))
        q = (q.astype(np.float32) * 4).astype(dtype)
        sink = _sinks(8, 3) if sinks else None
        _check(q, k, v, q_len, kv_len, sink, causal=causal, softcap=softcap, left=left)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_length_edge_cases_d256(causal):
    _length_edge_cases(causal, 256)


@needs_sm90
def test_tiles_crossing_heads_d256_d80():
    for d in (256, 80):
        args = _inputs(11 + d, 2, 16, 2, 45, 45, d, np.float16, [45, 30], [45, 40])
        _check(*args, causal=True)
        _check(*args, causal=False, left=10, right=3)


@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_zero_queries_d256(schedule):
    """P V at D 256: one m64n256k16 per 16 keys over V's four 64-column blocks (10 KB apart)."""
    _zero_queries(schedule, 256)


@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_one_hot_keys_d256_d80(schedule):
    """Q K^T at D 256 (16 k-steps over four column blocks, N = 80) and D 80 (5 k-steps: the second
    column block's zero fill past D never read)."""
    _one_hot_keys(schedule, 256, 256, 512)
    _one_hot_keys(schedule, 80, 80, 160)


@needs_sm90
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_bitwise_repeatable_and_batch_invariant_d256(schedule):
    for causal in (True, False):
        _bitwise_repeatable(causal, schedule, 256)


# A loop of prefill calls (each query the previous output) under jit: XLA captures the custom call
# into a command buffer and replays it. Runs in a fresh process so XLA_FLAGS apply.
_LOOP = command_buffer.prefill_loop('scale=0.1, causal=True, schedule="pingpong"', 512, 640, (512, 300), (640, 500))



@needs_sm90
def test_prefill_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "prefill_attention", tmp_path)


# --- tuned pingpong kernels (params.h Tune; opt-in schedules for A/B runs) ---------------------------
# Every test name here carries "tuned" (-k tuned; the D 64 ones also "d64": -k "tuned and d64").
# "-lazy" keeps its base's bits (it only skips multiplies by exactly 1), "-s4" its 2-stage twin's
# (the ring's depth orders no arithmetic) and "-m192" its 128-row twin's (a row visits the same
# 128-key tiles in the same order; the tiles a wider CTA adds are all hidden from it: P = 0, alpha 1);
# "-fold" (one FFMA per element), "-n176" / "-n192" (wider key tiles: other row-sum order) change
# bits, so they are held to the spec's tolerance and to their own bits run to run.

#: The tuned schedules compiled at D 128 and at D 64 (params.h TuneCompiled); elsewhere, and for the
#: other head size's tilings, a tuned name runs plain pingpong.
TUNED = ("pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy", "pingpong-n176", "pingpong-fold-lazy-n176")
TUNED_D64 = ("pingpong-fold", "pingpong-lazy", "pingpong-fold-lazy", "pingpong-fold-lazy-s4", "pingpong-n192",
             "pingpong-fold-lazy-n192", "pingpong-fold-lazy-n192-s4", "pingpong-fold-lazy-m192",
             "pingpong-fold-lazy-m192-s4")
ALL_TUNED = tuple(dict.fromkeys(TUNED + TUNED_D64))
#: The tuned schedule whose bits each must equal (lazy: its base without the skip; -s4: 2 stages;
#: -m192: 128-row CTAs).
SAME_BITS_AS = {"pingpong-lazy": "pingpong", "pingpong-fold-lazy": "pingpong-fold",
                "pingpong-fold-lazy-s4": "pingpong-fold-lazy", "pingpong-fold-lazy-n192-s4": "pingpong-fold-lazy-n192",
                "pingpong-fold-lazy-m192": "pingpong-fold-lazy",
                "pingpong-fold-lazy-m192-s4": "pingpong-fold-lazy-m192"}


def _check_tuned(q, k, v, q_len, kv_len, sink=None, *, causal, scale=None, schedules=TUNED, **variant):
    """Every tuned schedule of `schedules` against the spec; those that keep a twin's bits bit for bit
    against it."""
    scale = float(scale if scale is not None else q.shape[-1] ** -0.5)
    want = _reference(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, **variant)
    got = {name: np.asarray(_engine(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, schedule=name,
                                    **variant))
           for name in ("pingpong", *schedules)}
    for name, y in got.items():
        assert y.shape == q.shape and y.dtype == q.dtype
        assert_close(y, want, q.dtype, err_msg=name)
    for name, base in SAME_BITS_AS.items():
        if name in got and base in got:
            assert np.array_equal(got[name], got[base], equal_nan=True), (name, base)
    return got


def test_tuned_schedules_are_the_extensions():
    assert set(ALL_TUNED) <= set(cuda.PREFILL_SCHEDULES)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("s", [1, 63, 1000, 2048])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tuned_values(causal, s, dtype):
    """D 128, GQA group 4, ragged lengths, NaN keys past kv_len; T = S + 37 ends mid-tile for both
    128- and 176-key tiles."""
    hkv, group, t = 2, 4, s + 37
    args = _inputs(s * 29 + 5, 3, hkv * group, hkv, s, t, 128, dtype, *_ragged(s, t))
    _check_tuned(*args, causal=causal)


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, 0, -1), (True, 300, -1), (False, 200, 70),
                                               (False, -1, 129)], ids=lambda x: str(x))
def test_tuned_local_windows(causal, left, right):
    s, t = 700, 900
    args = _inputs(11 * (left + 1) + right, 3, 8, 2, s, t, 128, BF16, *_ragged(s, t))
    _check_tuned(*args, causal=causal, left=left, right=right)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tuned_length_edge_cases_and_tiles_crossing_heads(causal):
    """q_len 0, kv_len 0, q_len > kv_len, clamped and negative lengths; S = 45 (a CTA spans heads)."""
    s, t = 200, 300
    args = _inputs(7, 6, 8, 2, s, t, 128, BF16, [0, 150, 200, 999, -4, 200], [300, 0, 90, 5000, 300, -1])
    for name, y in _check_tuned(*args, causal=causal).items():
        y = y.astype(np.float32)
        assert not y[0].any() and not y[1].any() and not y[4].any() and not y[5].any(), name
    _check_tuned(*_inputs(11, 2, 16, 2, 45, 45, 128, np.float16, [45, 30], [45, 40]), causal=causal)


@needs_sm90
def test_tuned_fall_back_to_pingpong_elsewhere():
    """Where no tuned kernel is compiled (sinks, softcap, D 256, scale <= 0, the other head size's
    tilings: n176 at D 64, s4 / n192 at D 128) a tuned schedule runs plain pingpong: the same bits."""
    s, t = 300, 400
    f16 = _inputs(21, 2, 8, 2, s, t, 128, np.float16, *_ragged(s, t, 2))
    d64 = _inputs(22, 2, 8, 2, s, t, 64, BF16, *_ragged(s, t, 2))
    d64_only = tuple(n for n in TUNED_D64 if n not in TUNED)
    cases = [(f16, dict(causal=True), _sinks(8, 2), ALL_TUNED), (f16, dict(causal=False, softcap=5.0), None, ALL_TUNED),
             (f16, dict(causal=True, scale=-0.05), None, ALL_TUNED), (f16, dict(causal=True), None, d64_only),
             (d64, dict(causal=True), None, tuple(n for n in TUNED if n not in TUNED_D64)),
             (d64, dict(causal=False), _sinks(8, 4), ALL_TUNED), (d64, dict(causal=True, scale=-0.1), None, ALL_TUNED),
             (_inputs(23, 2, 8, 2, s, t, 256, BF16, *_ragged(s, t, 2)), dict(causal=False), None, ALL_TUNED)]
    for args, kw, sink, names in cases:
        kw.setdefault("scale", args[0].shape[-1] ** -0.5)
        base = np.asarray(_engine(*args, sink, schedule="pingpong", **kw))
        for name in names:
            assert np.array_equal(base, np.asarray(_engine(*args, sink, schedule=name, **kw)), equal_nan=True), \
                (name, args[0].shape, kw, sink is not None)


@needs_sm90
@pytest.mark.parametrize("schedule", TUNED)
def test_tuned_zero_queries_and_one_hot_keys(schedule):
    """P V alone (q = 0: the mean of the visible V rows), then Q K^T alone (one-hot keys), for the
    176-key tiles' descriptors (K's column blocks 22 KB apart, V's leading byte offset 22 KB)."""
    _zero_queries(schedule, 128)
    _one_hot_keys(schedule, 128, 128, 256)
    _one_hot_keys(schedule, 128, 200, 600)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("schedule", TUNED)
def test_tuned_bitwise_repeatable_and_batch_invariant(causal, schedule):
    _bitwise_repeatable(causal, schedule, 128)


# --- the D 64 tunings: fold / lazy on the plain tiling, 4 stages, 192-key tiles, 192-row CTAs --------

@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("s", [1, 63, 1000, 2048])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tuned_values_d64(causal, s, dtype):
    """GQA group 4, ragged lengths, NaN keys past kv_len; T = S + 37 ends mid-tile for both 128- and
    192-key tiles (2085 = 10 x 192 + 165); S 2048 runs 11+ tiles per CTA, past every ring's depth;
    M = 4 S packed rows end mid-CTA for 192-row CTAs (S 1000: 4000 = 20 x 192 + 160) and 192-row
    CTAs span two query heads."""
    hkv, group, t = 2, 4, s + 37
    args = _inputs(s * 23 + 9, 3, hkv * group, hkv, s, t, 64, dtype, *_ragged(s, t))
    _check_tuned(*args, causal=causal, schedules=TUNED_D64)


@needs_sm90
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tuned_chunked_d64(causal, dtype):
    """Chunked prefill: q_len < kv_len (the queries at the bottom right of a long cache), ragged:
    rows of 256 / 200 / 130 queries on 2000 / 1531 / 700 keys (none a multiple of 128 or 192), GQA
    group 8."""
    s, t = 256, 2000
    args = _inputs(31 + causal, 3, 16, 2, s, t, 64, dtype, [256, 200, 130], [2000, 1531, 700])
    _check_tuned(*args, causal=causal, schedules=TUNED_D64)


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, 0, -1), (True, 191, -1), (True, 300, -1), (False, 192, 70),
                                               (False, -1, 129)], ids=lambda x: str(x))
def test_tuned_local_windows_d64(causal, left, right):
    """Windows at the 192-key tile size (tiles skipped, unmasked inside every row's window)."""
    s, t = 700, 900
    args = _inputs(13 * (left + 1) + right, 3, 8, 2, s, t, 64, BF16, *_ragged(s, t))
    _check_tuned(*args, causal=causal, left=left, right=right, schedules=TUNED_D64)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tuned_length_edge_cases_and_tiles_crossing_heads_d64(causal):
    """q_len 0, kv_len 0, q_len > kv_len, clamped and negative lengths; S = 45 (a CTA spans heads: 8
    of them in a 192-row CTA; the last 192-key tile reads past T into the next KV head's rows)."""
    s, t = 200, 300
    args = _inputs(8, 6, 8, 2, s, t, 64, BF16, [0, 150, 200, 999, -4, 200], [300, 0, 90, 5000, 300, -1])
    for name, y in _check_tuned(*args, causal=causal, schedules=TUNED_D64).items():
        y = y.astype(np.float32)
        assert not y[0].any() and not y[1].any() and not y[4].any() and not y[5].any(), name
    _check_tuned(*_inputs(12, 2, 16, 2, 45, 45, 64, np.float16, [45, 30], [45, 40]), causal=causal,
                 schedules=TUNED_D64)


@needs_sm90
@pytest.mark.parametrize("schedule", TUNED_D64)
def test_tuned_zero_queries_and_one_hot_keys_d64(schedule):
    """P V alone (q = 0), then Q K^T alone (one-hot keys; T = 600 = 3 x 192 + 24 ends mid-tile), for
    the 192-key descriptors (K 24 KB a tile, P V 12 k-steps of m64n64k16), the 4-stage ring and the
    third consumer's Q rows (16 KB into the 24 KB Q tile)."""
    _zero_queries(schedule, 64)
    _one_hot_keys(schedule, 64, 64, 256)
    _one_hot_keys(schedule, 64, 200, 600)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("schedule", TUNED_D64)
def test_tuned_bitwise_repeatable_and_batch_invariant_d64(causal, schedule):
    _bitwise_repeatable(causal, schedule, 64)
