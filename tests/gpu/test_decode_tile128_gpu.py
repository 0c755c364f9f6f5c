"""The decode engine's wide KV tile (LaunchOptions::tile128, WideTileKv; JOA_DECODE_TILE128) against the
reference, and bit-for-bit against itself.

The wide tile streams a 16-row block's K / V in 128-row tiles (each of the 4 warps takes 32 columns
in one softmax chunk) at head dims 64 and 128, and plans its splits in whole 128-row tiles. Its online
softmax updates once a 128 rows instead of a 64, so it does not give the default tile's bits: outputs
are checked against the reference at the dtype's tolerance (`jax_onnx_attn.testing.TOLERANCES`) and
bitwise against a second run. Over f16 / bf16, d64 / d128, B 1 / 8 / 32, q_len 1 and 4, ragged kv_len
(0, fewer keys than queries, not a multiple of 128, NaN past it), windows that cut a 128-row tile,
one split / 128-row splits / the planner's (clusters and the combine kernel), softcap / bias / sinks /
pos_shift, NaN / Inf semantics (docs/attention.md) and a decode loop in a command buffer; where it
does not apply (a 64-row block, another head dim, a quantised cache, splits not whole 128-row tiles)
the option changes no bit.
"""

import functools
import textwrap

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.testing import assert_close

import command_buffer
import decode_cases

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _wide(q, k, v, lens, bias=None, sink=None, **static):
    """The wide tile's output, asserted bitwise equal to a second run."""
    got = decode_cases.engine(q, k, v, lens, bias, sink, tile128=True, **static)
    np.testing.assert_array_equal(decode_cases.engine(q, k, v, lens, bias, sink, tile128=True, **static), got)
    return got


def _tile_rows(q, k, **kw):
    b, hq, s, d = q.shape
    return cuda.decode_plan(b, hq, k.shape[1], s, k.shape[2], d, tile128=True, **kw)["tile_rows"]


# (Hq, Hkv, S): packed rows 4, 16 and 15: 16-row blocks, the wide tile's layout.
HEADS = [(32, 8, 1), (32, 8, 4), (6, 2, 5)]
DIMS = [(t, d) for t in DTYPES for d in (64, 128)]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("dtype,d", DIMS, ids=lambda x: f"d{x}" if isinstance(x, int) else np.dtype(x).name)
def test_tile128_matches_the_reference(dtype, d, heads):
    """B=3 with lengths c, 0, < S and random, capacity 200 / 333 (not whole 128-row tiles); over the
    planner's splits, 128-row splits (combine kernel), 256-row splits in a cluster and one split, with
    and without a window whose start cuts a 128-row tile; NaN past kv_len never reaches the output;
    the plan runs the wide tile."""
    hq, hkv, s = heads
    c = 200 if s == 1 else 333
    _, q, k, v, lens = decode_cases.dense_inputs(d + hq + s, 3, hq, hkv, s, d, c, dtype)
    assert _tile_rows(q, k) == 128
    scale = float(1 / np.sqrt(d))
    for split_rows, cluster, left in ((None, None, -1), (128, False, 37), (256, True, -1),
                                      (-(-c // 128) * 128, None, 150)):
        got = _wide(q, k, v, lens, scale=scale, causal=True, left=left, split_rows=split_rows,
                    cluster=cluster)
        assert not np.isnan(got.astype(np.float32)).any(), "NaN past kv_len leaked"
        assert_close(got, decode_cases.reference(q, k, v, lens, scale=scale, causal=True, left=left), dtype,
                     err_msg=f"split_rows={split_rows} cluster={cluster} left={left}")


# The decode steps the wide tile is for: 32/8 at B 1 / 8 / 32 over the planner's plans (clusters at
# B=1, the combine kernel or clusters at B=8, one split at B=32), q_len 1 and 4.
ISSUE_CASES = [(8, d, c, 1) for d in (64, 128) for c in (2048, 2304, 4096)]
ISSUE_CASES += [(1, d, c, 1) for d in (64, 128) for c in (2048, 8192)]
ISSUE_CASES += [(32, d, 4096, 1) for d in (64, 128)]
ISSUE_CASES += [(8, 128, 2304, 4), (1, 64, 4096, 4), (32, 64, 2304, 4)]


@pytest.mark.parametrize("case", ISSUE_CASES, ids=lambda x: f"b{x[0]}_d{x[1]}_c{x[2]}_s{x[3]}")
def test_tile128_at_decode_shapes(case):
    """Ragged lengths (full, 0, a few keys, mid-tile, either side of a 128-row tile), NaN past
    kv_len: the reference's values, repeatable bits."""
    b, d, c, s = case
    base = [c, 0, 70, c - 1, 500, 1, 1500, c - 37, 127, 129, 128, 255]
    lens = (base * 3)[:b] if b > 1 else [c - 37]
    _, q, k, v, lens = decode_cases.dense_inputs(b + d + c + s, b, 32, 8, s, d, c, np.float16, lens=lens)
    assert _tile_rows(q, k) == 128
    scale = float(1 / np.sqrt(d))
    got = _wide(q, k, v, lens, scale=scale)
    assert not np.isnan(got.astype(np.float32)).any()
    assert_close(got, decode_cases.reference(q, k, v, lens, scale=scale), np.float16)


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "combine"])
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_tile128_with_every_feature(dtype, d, cluster):
    """The logit variant (softcap, an f32 bias with -inf holes and a fully masked row), sinks, a
    window and pos_shift through the wide tile, its 128-row splits combined in a cluster or by the
    combine kernel: the reference's values, repeatable bits."""
    hq, hkv, s, c = 8, 2, 3, 700  # 12 packed rows: a 16-row block, as a cluster takes
    rng, q, k, v, lens = decode_cases.dense_inputs(21 + d, 3, hq, hkv, s, d, c, dtype)
    bias = decode_cases.bias("f32_full", rng, 3, hq, s, c)
    sink = rng.standard_normal(hq).astype(np.float32)
    static = dict(scale=0.09, softcap=20.0, causal=True, left=190, right=-1, pos_shift=-2)
    got = _wide(q, k, v, lens, bias, sink, split_rows=128, cluster=cluster, **static)
    assert_close(got, decode_cases.reference(q, k, v, lens, bias, sink, **static), dtype)


@pytest.mark.parametrize("d", [64, 128])
def test_tile128_keeps_nan_and_inf_semantics(d):
    """NaN / +inf inside the visible rows poison their rows (docs/attention.md "NaN and Inf"); NaN
    past kv_len does not (never read), nor NaN keys before a window's start, in and before the
    128-row tile the window cuts (hidden: -inf by a select)."""
    q, k, v, lens = decode_cases.nan_inf_inputs(d)
    for left in (-1, 200):
        got = _wide(q, k, v, lens, scale=0.1, causal=True, left=left, split_rows=256)
        decode_cases.check_nan_inf(got, left)
        want = decode_cases.reference(q, k, v, lens, scale=0.1, causal=True, left=left)
        assert_close(got[3], want[3], np.float16)


@pytest.mark.parametrize("case", [("rows64", 64), ("d80", 80), ("split192", 64), ("int8", 128)])
def test_tile128_where_it_does_not_apply(case):
    """A 64-row block (32/8, q_len 16), head dim 80, 192-row splits (not whole 128-row tiles) and an
    int8 cache keep the default tile: tile128 changes no bit."""
    kind, d = case
    s = 16 if kind == "rows64" else 1
    _, q, k, v, lens = decode_cases.dense_inputs(7 + d, 3, 32, 8, s, d, 500, np.float16)
    static = dict(scale=0.1, split_rows=192 if kind == "split192" else None)
    if kind == "int8":
        rng = np.random.default_rng(1)
        k = rng.integers(-127, 128, k.shape).astype(np.int8)
        v = rng.integers(-127, 128, v.shape).astype(np.int8)
        ks, vs = np.float32([0.02]), np.float32([0.03])
        f = lambda wide: np.asarray(jax.jit(functools.partial(  # noqa: E731
            cuda.decode_attention, kv_bits=8, tile128=wide, **static))(q, k, v, lens, None, None, ks, vs))
        np.testing.assert_array_equal(f(True), f(False))
        return
    if kind != "split192":
        assert _tile_rows(q, k) != 128
    np.testing.assert_array_equal(decode_cases.engine(q, k, v, lens, tile128=True, **static),
                                  decode_cases.engine(q, k, v, lens, tile128=False, **static))


# A decode loop (16 dependent attention calls, kv_len advancing on the device) run in a fresh process
# so XLA_FLAGS apply: B=8, 32/8, d64, capacity 2304 (the ~1B decoder's), the wide tile on through
# JOA_DECODE_TILE128; captured, replayed with the same bits, and close to the default tile's loop.
_LOOP = textwrap.dedent("""
    import functools, os
    os.environ["JOA_DECODE_TILE128"] = "1"
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops import cuda

    def steps(q, k, v, lens, tile128):
        attn = functools.partial(cuda.decode_attention, scale=0.125, tile128=tile128)
        # The outputs summed in f32, not stacked: a scan's stacked output would put the call inside a
        # dynamic-slice fusion, whose thunk hides its name from the capture check.
        def body(i, carry):
            lens, acc = carry
            out = attn(q * (1.0 + 0.01 * i).astype(q.dtype), k, v, lens)
            return lens + 1, acc + out.astype(jnp.float32)
        return jax.lax.fori_loop(0, 16, body, (lens, jnp.zeros(q.shape, jnp.float32)))[1]

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 32, 1, 64)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((8, 8, 2304, 64)), jnp.float16)
    v = jnp.asarray(rng.standard_normal((8, 8, 2304, 64)), jnp.float16)
    lens = jnp.array([2000, 1500, 0, 63, 127, 128, 1000, 2280], jnp.int32)
    f = jax.jit(functools.partial(steps, tile128=None))  # None: JOA_DECODE_TILE128, read at trace time
    hlo = f.lower(q, k, v, lens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_decode_attention"' in l]
    assert "tile128 = true" in f.lower(q, k, v, lens).as_text()
    print("CUSTOM_CALL_NAMES", *names)
    got = f(q, k, v, lens)
    got2 = f(q, k, v, lens)  # replay
    want = jax.jit(functools.partial(steps, tile128=False))(q, k, v, lens)
    assert np.array_equal(np.asarray(got), np.asarray(got2)), "replay changed the bits"
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 0.01, err  # one fp16 rounding of P apart (the softmax's max moves per 128 rows)
    print("LOOP_OK")
""")


def test_tile128_decode_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "decode_attention", tmp_path)
