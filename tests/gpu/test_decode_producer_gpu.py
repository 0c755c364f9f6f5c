"""The decode engine's producer warp (LaunchOptions::producer, DenseProducerKv; JOA_DECODE_PRODUCER)
against the engine without it: the same bits.

The producer warp issues the same 16-byte copies (zero fill outside the visible rows) into the same
shared-memory tiles, through an mbarrier ring instead of the compute warps' cp.async groups, so every
output must equal the default engine's bit for bit: over head dims, dtypes, packed-row layouts, q_len
1 and 4, B 1 and 8, kv_len ragged (0, fewer keys than queries, not a multiple of the 64-row tile, past
the capacity), windows cutting the first tile, one split / 64-row splits / the planner's (cluster or
combine kernel), softcap / bias / sinks / pos_shift, NaN in rows past kv_len (never read) and inside
it (the same NaNs as the default), and a decode loop captured in a command buffer. On a GPU other than
sm_90 the handler ignores the option, and these tests hold trivially.
"""

import textwrap

import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.testing import assert_close

import command_buffer
import decode_cases

pytestmark = pytest.mark.gpu

DTYPES = [np.float16, ml_dtypes.bfloat16]


def _same_bits(q, k, v, lens, bias=None, sink=None, **static):
    """The producer's output, asserted bitwise equal to the engine's without it (its default copies:
    the cursor loads at d128, the strided ones otherwise; both fill the same tiles,
    test_decode_attention_gpu.py checks)."""
    got = decode_cases.engine(q, k, v, lens, bias, sink, producer=True, **static)
    np.testing.assert_array_equal(got, decode_cases.engine(q, k, v, lens, bias, sink, producer=False, **static))
    return got


# (Hq, Hkv, S): packed rows 4 and 16 (16-row blocks: the decode layout), 15, 64 (a 64-row block).
HEADS = [(32, 8, 1), (32, 8, 4), (6, 2, 5), (32, 8, 16)]
# fp16 at every head dim, bf16 at 64 / 128: 7 x 4 = 28 cases.
DIMS = [(np.float16, d) for d in (64, 80, 96, 128, 256)] + [(ml_dtypes.bfloat16, d) for d in (64, 128)]


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("dtype,d", DIMS,
                         ids=lambda x: f"d{x}" if isinstance(x, int) else np.dtype(x).name)
def test_producer_gives_the_same_bits(dtype, d, heads):
    """Every head dim, B=3 with lengths c, 0, < S and random, capacity not a multiple of the tile;
    over the planner's splits, 64-row splits and one split; with a window whose start cuts a tile;
    NaN past kv_len never reaches the output. And the reference's values. The producer takes 16-row
    blocks (4, 16, 15 packed rows here); the 64-row case checks the others keep their copies."""
    hq, hkv, s = heads
    c = 200 if d != 256 else 131
    _, q, k, v, lens = decode_cases.dense_inputs(d + hq + s, 3, hq, hkv, s, d, c, dtype)
    scale = float(1 / np.sqrt(d))
    for split_rows, left in ((None, -1), (64, 37), (-(-c // 64) * 64, 37)):
        got = _same_bits(q, k, v, lens, scale=scale, causal=True, left=left, split_rows=split_rows)
        assert not np.isnan(got.astype(np.float32)).any(), "NaN past kv_len leaked"
    assert_close(got, decode_cases.reference(q, k, v, lens, scale=scale, causal=True, left=37), dtype)


# Issue 15's shapes: 32/8, q_len 1 and 4, B 1 and 8, the planner's plan (clusters at B=1, the combine
# kernel or clusters at B=8) at capacities 2048 / 2304 (the ~1B decoder's) / 4096.
ISSUE_CASES = [(b, d, c, s) for b in (1, 8) for d in (64, 128) for c in (2048, 2304, 4096) for s in (1,)]
ISSUE_CASES += [(8, 128, 2304, 4), (1, 64, 4096, 4)]


@pytest.mark.parametrize("case", ISSUE_CASES, ids=lambda x: f"b{x[0]}_d{x[1]}_c{x[2]}_s{x[3]}")
def test_producer_at_decode_shapes(case):
    """The decode steps the producer is for, with ragged lengths (full, 0, a few keys, mid-tile),
    NaN past kv_len: the default engine's bits and the reference's values."""
    b, d, c, s = case
    lens = [c, 0, 70, c - 1, 500, 1, 1500, c - 37][:b] if b > 1 else [c - 37]
    _, q, k, v, lens = decode_cases.dense_inputs(b + d + c + s, b, 32, 8, s, d, c, np.float16, lens=lens)
    scale = float(1 / np.sqrt(d))
    got = _same_bits(q, k, v, lens, scale=scale)
    assert not np.isnan(got.astype(np.float32)).any()
    assert_close(got, decode_cases.reference(q, k, v, lens, scale=scale), np.float16)
    np.testing.assert_array_equal(decode_cases.engine(q, k, v, lens, scale=scale, producer=True), got)  # repeatable


@pytest.mark.parametrize("cluster", [True, False], ids=["cluster", "combine"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
def test_producer_with_every_feature(dtype, cluster):
    """The logit variant (softcap, an f32 bias), sinks, a window and pos_shift through the producer,
    its splits combined in a cluster or by the combine kernel: the default engine's bits."""
    hq, hkv, s, d, c = 8, 2, 3, 128, 700  # 12 packed rows: a 16-row block, as a cluster takes
    rng, q, k, v, lens = decode_cases.dense_inputs(21, 3, hq, hkv, s, d, c, dtype)
    bias = decode_cases.bias("f32_full", rng, 3, hq, s, c)
    sink = rng.standard_normal(hq).astype(np.float32)
    _same_bits(q, k, v, lens, bias, sink, scale=0.09, softcap=20.0, causal=True, left=90, right=-1,
               pos_shift=-2, split_rows=128, cluster=cluster)


@pytest.mark.parametrize("d", [64, 128])
def test_producer_keeps_nan_and_inf_semantics(d):
    """NaN / +inf inside the visible rows poison their rows the same way with and without the
    producer (docs/attention.md "NaN and Inf"); NaN past kv_len does not (never read), nor NaN keys
    before a window's start, in and before the tile the window cuts (hidden: -inf by a select)."""
    q, k, v, lens = decode_cases.nan_inf_inputs(d)
    for left in (-1, 200):
        got = _same_bits(q, k, v, lens, scale=0.1, causal=True, left=left, split_rows=128)
        decode_cases.check_nan_inf(got, left)


# A decode loop (16 dependent attention calls, kv_len advancing on the device) run in a fresh process
# so XLA_FLAGS apply: B=8, 32/8, d64, capacity 2304 (the ~1B decoder's), the producer on through
# JOA_DECODE_PRODUCER; captured, replayed with the same bits, and the bits of the loop without it.
_LOOP = textwrap.dedent("""
    import functools, os
    os.environ["JOA_DECODE_PRODUCER"] = "1"
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops import cuda

    def steps(q, k, v, lens, producer):
        attn = functools.partial(cuda.decode_attention, scale=0.125, producer=producer)
        def body(i, carry):
            q, lens = carry
            return attn(q, k, v, lens).astype(q.dtype), lens + 1
        return jax.lax.fori_loop(0, 16, body, (q, lens))

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 32, 1, 64)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((8, 8, 2304, 64)), jnp.float16)
    v = jnp.asarray(rng.standard_normal((8, 8, 2304, 64)), jnp.float16)
    lens = jnp.array([2000, 1500, 0, 63, 64, 65, 1000, 2280], jnp.int32)
    f = jax.jit(functools.partial(steps, producer=None))  # None: JOA_DECODE_PRODUCER, read at trace time
    hlo = f.lower(q, k, v, lens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_decode_attention"' in l]
    assert "producer = true" in f.lower(q, k, v, lens).as_text()
    print("CUSTOM_CALL_NAMES", *names)
    got, _ = f(q, k, v, lens)
    got2, _ = f(q, k, v, lens)  # replay
    want, _ = jax.jit(functools.partial(steps, producer=False))(q, k, v, lens)
    assert np.array_equal(np.asarray(got), np.asarray(got2)), "replay changed the bits"
    assert np.array_equal(np.asarray(got), np.asarray(want)), "the producer changed the bits"
    print("LOOP_OK")
""")


def test_producer_decode_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "decode_attention", tmp_path)
