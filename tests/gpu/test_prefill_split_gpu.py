"""Split-KV on the Hopper prefill engine (ffi/kernels/prefill/plan.h, engine.cuh SplitEpilogue,
combine.cuh) against its spec, `jax_onnx_attn.ops.reference.prefill.prefill_attention`.

Forced splits 2 / 3 / 8 (and more splits than key tiles: empty splits) over causal / non-causal,
few queries on a long cache (chunked prefill, decode / verify steps: the calls split-KV is for) and
whole prompts (several M blocks, rows crossing heads), ragged lengths with kv_len 0 and q_len 0 rows
and K / V past kv_len poisoned with NaN, windows, sinks (added once, in the combine), softcap,
f16 / bf16, head sizes 64 / 128 (and 80 / 96 / 256 once each), the D 128 default's tuned split
kernel and its plain fallback (scale <= 0); bitwise repeatability and batch invariance at a fixed
split count; splits=1 equal to the default where the plan gives 1, and a named schedule running
unsplit; the plan's own choice (splits=None) and a vmapped call keeping the per-example plan; a
loop of split calls inside an XLA command buffer. Split-KV runs each head size's default schedule
(the split kernels are compiled for it only). Tolerances: jax_onnx_attn.testing.

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

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float16, BF16]

_reference = jax.jit(prefill_reference.prefill_attention,
                     static_argnames=("scale", "causal", "softcap", "left", "right"))
_engine = jax.jit(cuda.prefill_attention,
                  static_argnames=("scale", "causal", "softcap", "left", "right", "schedule", "splits"))


def _check(q, k, v, q_len, kv_len, sink=None, *, splits, causal, scale=None, **variant):
    """The engine at `splits` (its default schedule) against the spec. Returns its output."""
    scale = float(q.shape[-1] ** -0.5 if scale is None else scale)
    want = _reference(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, **variant)
    got = np.asarray(_engine(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, splits=splits,
                             **variant))
    assert got.shape == q.shape and got.dtype == q.dtype
    assert_close(got, want, q.dtype, err_msg=f"splits={splits}")
    return got


# Few queries on a long cache: rows 0 and 1 full / shorter, row 2 kv_len 0 (no key: 0), row 3
# q_len 0 (nothing live: 0), row 4 q_len > kv_len (causal: the first rows see no key).
def _few_query_lengths(s, t):
    return [s, max(s - 5, 1), s, 0, s], [t, t - 700, 0, t, max(s - 3, 1)]


@needs_sm90
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("dtype", DTYPES, ids=["f16", "bf16"])
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_few_queries_on_a_long_cache(causal, d, dtype, splits):
    """Chunked prefill / verify steps: S 16 of G 4 (64 packed rows, one M block) on 3000 keys (24
    tiles of 128, the last partial), ragged lengths incl. kv_len 0 and q_len 0."""
    s, t = 16, 3000
    args = _inputs(splits * 7 + d, 5, 8, 2, s, t, d, dtype, *_few_query_lengths(s, t))
    got = _check(*args, splits=splits, causal=causal)
    assert not got[2].astype(np.float32).any() and not got[3].astype(np.float32).any()


@needs_sm90
@pytest.mark.parametrize("splits", [2, 3, 8])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_whole_prompts(causal, splits):
    """Several M blocks, rows of several query heads in one CTA (S 45), causal m-blocks seeing
    different tile counts (each split a share of its own range), T ending mid-tile."""
    for s, t, group, dtype, d in ((300, 700, 4, np.float16, 128), (45, 1037, 8, BF16, 64),
                                  (1000, 1000, 1, BF16, 128)):
        q_len, kv_len = [s, s - 17, max(s // 2, 1)], [t, t - 5, s // 2 + 100]
        args = _inputs(s + t + splits, 3, 2 * group, 2, s, t, d, dtype, q_len, kv_len)
        _check(*args, splits=splits, causal=causal)


@needs_sm90
def test_more_splits_than_tiles():
    """Splits past the visible tiles get none (lse -inf, weight 0): 8 and 64 splits of 2 tiles."""
    args = _inputs(3, 3, 8, 2, 16, 200, 128, BF16, [16, 9, 16], [200, 130, 16])
    for splits in (8, cuda.PREFILL_MAX_SPLITS):
        _check(*args, splits=splits, causal=True)


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, 0, -1), (True, 100, -1), (True, 700, -1),
                                               (False, 40, 0), (False, 200, 300), (False, -1, 5),
                                               (False, 5000, 5000)], ids=lambda x: str(x))
def test_local_windows(causal, left, right):
    """Windows narrower than a tile to wider than T, few queries and a prompt, 3 and 8 splits (a
    narrow window leaves most splits empty)."""
    for s, t in ((16, 2500), (400, 1500)):
        args = _inputs(s + left + right, 3, 8, 2, s, t, 128, np.float16, [s, s - 3, s // 2],
                       [t, t - 300, s // 2 + 50])
        for splits in (3, 8):
            _check(*args, splits=splits, causal=causal, left=left, right=right)


def _sinks(hq, seed):
    """Sinks from very negative (no effect) through 0 and typical values to very large (all the
    weight on the sink: the row's output ~0)."""
    fixed = np.array([-1e4, 0.0, 1e4, -30.0], np.float32)
    rng = np.random.default_rng(seed)
    return np.concatenate([fixed, rng.uniform(-4, 8, hq - 4).astype(np.float32)])[:hq]


@needs_sm90
@pytest.mark.parametrize("splits", [2, 8])
@pytest.mark.parametrize("causal,left", [(True, -1), (False, -1), (True, 300)], ids=lambda x: str(x))
def test_sinks_added_once(causal, left, splits):
    """The sink enters the combine once (not once a split): with 8 splits a per-split sink would
    weigh 8 times. Rows without keys (kv_len 0, causal q_len > kv_len) and rows past q_len give 0
    whatever the sink."""
    s, t = 16, 2000
    for dtype, d in ((np.float16, 128), (BF16, 64)):
        args = _inputs(d + splits, 5, 8, 2, s, t, d, dtype, *_few_query_lengths(s, t))
        sink = _sinks(8, d)
        got = _check(*args, sink, splits=splits, causal=causal, left=left).astype(np.float32)
        assert np.isfinite(got).all()
        assert np.abs(got[:, 2]).max() < 1e-3  # head 2's sink 1e4 takes all the weight
        assert not got[2].any() and not got[3].any()


@needs_sm90
@pytest.mark.parametrize("causal,softcap,left,sinks", [(True, 30.0, -1, False), (False, 5.0, 150, True)],
                         ids=lambda x: str(x))
def test_softcap(causal, softcap, left, sinks):
    s, t = 32, 1800
    args = _inputs(int(softcap) + left, 3, 8, 2, s, t, 128, BF16, [32, 20, 32], [1800, 1000, 40])
    sink = _sinks(8, 3) if sinks else None
    for splits in (3, 8):
        _check(*args, sink, splits=splits, causal=causal, softcap=softcap, left=left)


@needs_sm90
@pytest.mark.parametrize("d,dtype", [(80, np.float16), (96, BF16), (256, np.float16)],
                         ids=["d80-f16", "d96-bf16", "d256-f16"])
def test_head_dims_80_96_256(d, dtype):
    """The padded tiles (the partials hold D columns, not the padded width) and 80-key tiles."""
    s, t = 16, 1500
    args = _inputs(d, 5, 8, 2, s, t, d, dtype, *_few_query_lengths(s, t))
    for splits in (2, 3):
        _check(*args, splits=splits, causal=True)
        _check(*args, _sinks(8, d), splits=splits, causal=False, left=100, right=50)


@needs_sm90
def test_default_schedules_split_kernels():
    """D 128's default is pingpong-fold-lazy: its split kernel keeps the raw max (kTuneFold), the
    lse scales it; scale <= 0 takes the plain pingpong split kernel (the fold needs scale > 0)."""
    args = _inputs(11, 3, 8, 2, 16, 3000, 128, BF16, [16, 7, 16], [3000, 2100, 300])
    for splits in (2, 8):
        _check(*args, splits=splits, causal=True)
        _check(*args, splits=splits, causal=True, scale=-0.05)


@needs_sm90
def test_a_named_schedule_runs_unsplit():
    """splits=None with a named schedule is the engine without split-KV (splits=1) on a shape the
    plan would split."""
    b, hq, hkv, s, t, d = 2, 32, 8, 16, 8192, 128
    assert cuda.prefill_plan(b, hq, hkv, s, t, d, True)["splits"] > 1
    args = _inputs(14, b, hq, hkv, s, t, d, BF16, [16, 11], [8192, 5000])
    for name in ("serial", "pingpong", cuda.PREFILL_TILING[d]["schedule"]):
        named = np.asarray(_engine(*args, scale=0.1, causal=True, schedule=name))
        one = np.asarray(_engine(*args, scale=0.1, causal=True, schedule=name, splits=1))
        assert np.array_equal(named, one, equal_nan=True), name


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_bitwise_repeatable_and_batch_invariant(causal):
    """A fixed split count gives the same bits run to run, and a batch row alone the bits it has in
    the batch (its partition depends on its own lengths only)."""
    q, k, v, q_len, kv_len = _inputs(5, 4, 16, 4, 16, 4096, 128, BF16, [16, 9, 16, 1],
                                     [4096, 3000, 555, 4096])
    f = functools.partial(_engine, scale=0.1, causal=causal, splits=5)
    first = np.asarray(f(q, k, v, q_len, kv_len))
    for _ in range(3):
        assert np.array_equal(first, np.asarray(f(q, k, v, q_len, kv_len)), equal_nan=True)
    for bi in range(4):
        alone = np.asarray(f(q[bi:bi + 1], k[bi:bi + 1], v[bi:bi + 1], q_len[bi:bi + 1], kv_len[bi:bi + 1]))
        assert np.array_equal(first[bi:bi + 1], alone, equal_nan=True), bi


@needs_sm90
def test_splits_one_is_the_default_where_the_plan_gives_one():
    """Where the plan gives 1 (enough CTAs: B 2 x Hkv 8 x 8 M blocks), splits=1 and the default are
    one kernel without split-KV: the same bits."""
    b, hq, hkv, s, t, d = 2, 32, 8, 256, 2048, 128
    assert cuda.prefill_plan(b, hq, hkv, s, t, d, True)["splits"] == 1
    args = _inputs(9, b, hq, hkv, s, t, d, BF16, [256, 200], [2048, 1500])
    default = np.asarray(_engine(*args, scale=0.1, causal=True))
    one = np.asarray(_engine(*args, scale=0.1, causal=True, splits=1))
    assert np.array_equal(default, one, equal_nan=True)


@needs_sm90
def test_the_plans_choice():
    """splits=None on a few-query shape takes the plan's splits (> 1 here) and its bits."""
    b, hq, hkv, s, t, d = 2, 32, 8, 16, 8192, 128
    plan = cuda.prefill_plan(b, hq, hkv, s, t, d, True)
    assert plan["splits"] > 1, plan
    args = _inputs(10, b, hq, hkv, s, t, d, BF16, [16, 11], [8192, 5000])
    default = _check(*args, splits=None, causal=True)
    forced = np.asarray(_engine(*args, scale=float(d ** -0.5), causal=True, splits=plan["splits"]))
    assert np.array_equal(default, forced, equal_nan=True)


@needs_sm90
def test_vmap_keeps_the_per_example_plan():
    """A vmapped call folds the mapped axis into B (more CTAs: another plan) but keeps each
    example's splits: the bits of the per-example loop."""
    q, k, v, q_len, kv_len = _inputs(12, 2 * 2, 32, 8, 16, 4096, 128, BF16, [16, 5, 16, 16],
                                     [4096, 3000, 17, 4096])
    q, k, v = (x.reshape(2, 2, *x.shape[1:]) for x in (q, k, v))
    q_len, kv_len = q_len.reshape(2, 2), kv_len.reshape(2, 2)
    attn = functools.partial(cuda.prefill_attention, scale=0.1, causal=True)
    # Per example (B 2) and folded (B 4): other splits, so the pin is what keeps the bits.
    assert (cuda.prefill_plan(2, 32, 8, 16, 4096, 128, True)["splits"]
            != cuda.prefill_plan(4, 32, 8, 16, 4096, 128, True)["splits"])
    got = np.asarray(jax.jit(jax.vmap(attn))(q, k, v, q_len, kv_len))
    for n in range(2):
        one = np.asarray(jax.jit(attn)(q[n], k[n], v[n], q_len[n], kv_len[n]))
        assert np.array_equal(got[n], one, equal_nan=True), n


# A loop of split-KV calls (each query the previous output) under jit: XLA captures the custom call
# (split kernel + PDL combine) into a command buffer and replays it. A fresh process, so XLA_FLAGS
# apply.
_LOOP = command_buffer.prefill_loop("scale=0.1, causal=True, splits=4", 16, 3000, (16, 9), (3000, 2100))



@needs_sm90
def test_split_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "prefill_attention", tmp_path)
