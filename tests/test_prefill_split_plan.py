"""The prefill engine's split-KV plan (ffi/kernels/prefill/plan.h, `_ffi.prefill_plan` through
`cuda.prefill_plan`) and `cuda.prefill_attention`'s `splits` argument on the CPU: the plan's table at
the few-query shapes it is for, its invariants against an independent statement of the rule, the
workspace size, and the wrapper's trace-time checks and vmap pin (the kernel swapped for its spec,
tests/kernel_specs.py). The kernels: tests/gpu/test_prefill_split_gpu.py."""

import itertools

import jax
import numpy as np
import pytest

from jax_onnx_attn import _extension
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close

from kernel_specs import use_specs

needs_plan = pytest.mark.skipif(_extension._ffi is None or not hasattr(_extension._ffi, "prefill_plan"),
                                reason="extension not built, or built before the prefill split plan")

K, M = 1024, 128  # keys; the engine's kBlockM


def _mirror(b, hq, hkv, s, t, d, causal=True, left=-1, right=-1):
    """The rule of plan.h MakeSplitPlan written out again from its comment, with the constants the
    extension exports: catches a change of one side that the other does not follow."""
    lim = _extension.limits()["prefill"]
    sms, most_splits, min_tiles = lim["plan_sms"], lim["max_splits"], lim["split_min_tiles"]
    block_n = lim["tiling"][d]["block_n"]
    rows = hq // hkv * s
    ctas = b * hkv * -(-rows // M)
    tiles = -(-t // block_n)
    right_keys = 0 if causal else right
    if left >= 0 and right_keys >= 0:
        tiles = min(tiles, -(-(left + right_keys + s) // block_n) + 1)
    tiles = max(tiles, 1)
    if ctas == 0 or ctas * 100 >= lim["split_full_percent"] * sms:
        return 1
    cost = {n: -(-ctas * n // sms) * -(-tiles // n) for n in range(1, max(1, min(most_splits, tiles // min_tiles)) + 1)}
    least = min(cost.values())
    return min(n for n, c in cost.items() if c * 100 <= least * (100 + lim["split_slack_percent"]))


@needs_plan
@pytest.mark.parametrize("b,t,s,want", [
    # GQA 32 / 8, d128, causal: few queries (S 16: 64 packed rows, one M block a KV head) split
    # until about 128 of the 132 SMs hold a CTA; S 2048 (64 M blocks a head) and B 32 never split.
    (1, 4 * K, 16, 8),      # 8 CTAs; 32 tiles: at most 32 / 4 = 8 splits
    (1, 32 * K, 16, 16),    # 8 CTAs x 16 = 128
    (8, 4 * K, 16, 2),      # 64 CTAs x 2 = 128
    (8, 32 * K, 16, 2),     # the case: 64 CTAs on 132 SMs
    (32, 4 * K, 16, 1),     # 256 CTAs
    (32, 32 * K, 16, 1),
    (1, 4 * K, 2048, 1),    # 512 CTAs
    (1, 32 * K, 2048, 1),
    (8, 4 * K, 2048, 1),
    (8, 32 * K, 2048, 1),
    (32, 4 * K, 2048, 1),
    (32, 32 * K, 2048, 1),
    (1, 32 * K, 64, 8),     # 16 CTAs x 8 = 128
    (8, 32 * K, 64, 1),     # 128 CTAs: 97% of the SMs already
])
def test_plan_table(b, t, s, want):
    plan = cuda.prefill_plan(b, 32, 8, s, t, 128, True)
    assert plan["splits"] == want, plan
    assert plan["ctas"] == b * 8 * -(-4 * s // M)


@needs_plan
def test_plan_follows_its_rule():
    """Over shapes around the thresholds: the mirror's splits, at most max_splits, 1 with enough
    CTAs or too few tiles, and the workspace [B, Hkv, splits, M, D + 1] f32 (1 element unsplit)."""
    lim = _extension.limits()["prefill"]
    for b, (hq, hkv), s, t, d, causal, (left, right) in itertools.product(
            [1, 2, 3, 8, 13], [(32, 8), (8, 1), (64, 4), (16, 16)], [1, 16, 64, 200],
            [1, 100, 1000, 4 * K, 32 * K + 7], [64, 128, 256], [True, False],
            [(-1, -1), (100, -1), (100, 0), (0, 300)]):
        plan = cuda.prefill_plan(b, hq, hkv, s, t, d, causal, left, right)
        n = plan["splits"]
        assert n == _mirror(b, hq, hkv, s, t, d, causal, left, right), (b, hq, hkv, s, t, d, causal, left, right)
        assert 1 <= n <= lim["max_splits"]
        if plan["ctas"] * 100 >= lim["split_full_percent"] * lim["plan_sms"] or plan["tiles"] < 2 * lim["split_min_tiles"]:
            assert n == 1
        rows = hq // hkv * s
        assert plan["workspace_elems"] == (b * hkv * n * rows * (d + 1) if n > 1 else 1)


@needs_plan
def test_plan_windows_bound_the_tiles():
    """A window bounds the key tiles a CTA's rows see, so a narrow one on a long cache does not
    split into mostly empty ranges."""
    wide = cuda.prefill_plan(1, 32, 8, 16, 32 * K, 128, True)
    narrow = cuda.prefill_plan(1, 32, 8, 16, 32 * K, 128, True, left=255)
    assert wide["tiles"] == 256 and narrow["tiles"] == 4 and narrow["splits"] == 1
    # Non-causal needs a right bound too.
    assert cuda.prefill_plan(1, 32, 8, 16, 32 * K, 128, False, left=255)["tiles"] == 256


@needs_plan
def test_plan_override_and_errors():
    for n in (1, 2, 3, 64):
        plan = cuda.prefill_plan(8, 32, 8, 16, 32 * K, 128, True, splits=n)
        assert plan["splits"] == n
        assert plan["workspace_elems"] == (8 * 8 * n * 64 * 129 if n > 1 else 1)
    with pytest.raises(ValueError, match="prefill_plan: splits"):
        cuda.prefill_plan(8, 32, 8, 16, 32 * K, 128, True, splits=65)
    with pytest.raises(ValueError, match="prefill_plan: shapes"):
        cuda.prefill_plan(8, 32, 8, 16, 32 * K, 112, True)


def _args(b=2, hq=8, hkv=2, s=16, t=40, d=64):
    rng = np.random.default_rng(0)
    return dict(q=rng.standard_normal((b, hq, s, d)).astype(np.float16),
                k=rng.standard_normal((b, hkv, t, d)).astype(np.float16),
                v=rng.standard_normal((b, hkv, t, d)).astype(np.float16),
                q_len=np.full((b,), s, np.int32), kv_len=np.full((b,), t, np.int32))


@needs_plan
@pytest.mark.parametrize("splits", [0, -1, 65, True, 2.0, "2"])
def test_bad_splits_name_the_input(splits):
    with pytest.raises(ValueError, match="prefill_attention: splits: must be None"):
        jax.eval_shape(lambda **a: cuda.prefill_attention(**a, scale=0.1, causal=True, splits=splits),
                       **_args())


@needs_plan
@pytest.mark.parametrize("schedule", ["serial", "pingpong-n176"])
def test_split_kv_takes_the_default_schedule_only(monkeypatch, schedule):
    """The split kernels are compiled for each head size's default schedule: splits > 1 with
    another is refused at trace time (splits=1 is not: the unsplit engine runs every schedule)."""
    use_specs(monkeypatch)
    a = _args(d=128)
    with pytest.raises(ValueError, match="prefill_attention: splits: split-KV runs the head size's default"):
        jax.eval_shape(lambda **x: cuda.prefill_attention(**x, scale=0.1, causal=True, splits=2,
                                                          schedule=schedule), **a)
    jax.eval_shape(lambda **x: cuda.prefill_attention(**x, scale=0.1, causal=True, splits=1,
                                                      schedule=schedule), **a)


@needs_plan
def test_splits_reach_the_call(monkeypatch):
    """splits=None lowers with the plan's splits left to the implementation, a named schedule with
    1 (the engine as it runs unsplit); a given count is kept."""
    calls = use_specs(monkeypatch)
    jax.eval_shape(lambda **a: cuda.prefill_attention(**a, scale=0.1, causal=True), **_args())
    assert calls[-1][2]["splits"] is None
    for name in ("serial", cuda.PREFILL_TILING[64]["schedule"]):
        jax.eval_shape(lambda **a: cuda.prefill_attention(**a, scale=0.1, causal=True, schedule=name),
                       **_args())
        assert calls[-1][2]["splits"] == 1
    jax.eval_shape(lambda **a: cuda.prefill_attention(**a, scale=0.1, causal=True, splits=np.int32(3)),
                   **_args())
    assert calls[-1][2]["splits"] == 3


@needs_plan
def test_vmap_pins_the_per_example_plan(monkeypatch):
    """Folding the mapped axis into B gives more CTAs (another plan): the folded call is told each
    example's splits, so its bits are the per-example loop's."""
    calls = use_specs(monkeypatch)
    a = _args(b=2 * 2, hq=32, hkv=8, s=16, t=4 * K, d=128)
    per_example = cuda.prefill_plan(2, 32, 8, 16, 4 * K, 128, True)["splits"]
    assert per_example != cuda.prefill_plan(4, 32, 8, 16, 4 * K, 128, True)["splits"]
    x = {n: v.reshape(2, 2, *v.shape[1:]) for n, v in a.items()}
    f = jax.jit(jax.vmap(lambda q, k, v, ql, kl: cuda.prefill_attention(q, k, v, ql, kl, scale=0.1,
                                                                       causal=True)))
    got = f(x["q"], x["k"], x["v"], x["q_len"], x["kv_len"])
    folded = [c for c in calls if c[0] == "prefill" and c[1][0] == 4]
    assert folded and folded[-1][2]["splits"] == per_example
    for n in range(2):
        want = prefill_reference.prefill_attention(x["q"][n], x["k"][n], x["v"][n], x["q_len"][n],
                                                   x["kv_len"][n], scale=0.1, causal=True)
        assert_close(got[n], want)
