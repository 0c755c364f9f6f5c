"""The decode engine's speculated first tiles (DecodeParams::speculate; JOA_DECODE_SPECULATE) on a GPU.

With it a split's first KV tiles are copied before kv_len is read, as if every row of the split were
visible: rows past kv_len are read from the cache (which holds NaN there in these cases) and must
never reach the output, the tile that crosses kv_len gets its values zeroed, and a window that hides
a split's first rows drops the speculated tiles and loads the right ones. The bits are the engine's
without it, so every case is held bitwise to the same call with `speculate=False` (itself held to
the reference by test_decode_attention_gpu.py) and to the reference within the dtype's tolerance:
f16 / bf16, head dims 64 (strided copies) / 128 (cursor copies) / 80 / 256, q_len 1 and 4, lengths
0, < S, mid-tile, on a tile boundary, at a split's start and end and at capacity, capacities not a
multiple of the tile, one split / the planner's splits (clusters, the combine kernel) / forced
64-row splits, windows that cut a split's first tile, softcap / bias / sinks, the wide tile, a
decode loop in a command buffer; a quantised cache and the producer warp ignore the switch.
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


def _both(q, k, v, lens, bias=None, sink=None, **static):
    """(speculated output, the output without): asserted bit for bit equal, and repeatable."""
    spec = decode_cases.engine(q, k, v, lens, bias, sink, speculate=True, engine="decode", **static)
    plain = decode_cases.engine(q, k, v, lens, bias, sink, speculate=False, engine="decode", **static)
    np.testing.assert_array_equal(spec, plain, err_msg=f"speculated tiles changed bits ({static})")
    np.testing.assert_array_equal(
        decode_cases.engine(q, k, v, lens, bias, sink, speculate=True, engine="decode", **static), spec)
    return spec


def _lens(c, s, split):
    """Lengths that put kv_len everywhere a speculated tile can meet it: 0, fewer than S, one row,
    mid-tile, a tile boundary (64), a split's start and end, one short of capacity, capacity."""
    out = {0, min(s - 1, c), 1, 37, 64, 65, split, split + 1, split - 1, c - 1, c, (c * 2) // 3 + 5}
    return sorted(x for x in out if 0 <= x <= c)


CASES = [(dt, d, hq, hkv, s) for dt in DTYPES for d in (64, 128) for hq, hkv, s in ((32, 8, 1), (32, 8, 4))]
CASES += [(np.float16, 80, 8, 2, 1), (ml_dtypes.bfloat16, 256, 16, 4, 1)]


@pytest.mark.parametrize("dtype,d,hq,hkv,s", CASES,
                         ids=lambda x: np.dtype(x).name if isinstance(x, type) else str(x))
def test_speculated_tiles_are_the_engines_bits(dtype, d, hq, hkv, s):
    c = 1000  # not a multiple of 64: the last tile crosses capacity
    scale = float(1 / np.sqrt(d))
    for split_rows, cluster in ((None, None), (64, False), (256, True), (192, False), (1024, None)):
        lens = _lens(c, s, split_rows or 256)
        _, q, k, v, lens = decode_cases.dense_inputs(d + s, len(lens), hq, hkv, s, d, c, dtype, lens=lens)
        for left in (-1, 100):
            got = _both(q, k, v, lens, scale=scale, causal=True, left=left, split_rows=split_rows,
                        cluster=cluster)
            assert not np.isnan(got.astype(np.float32)).any(), "NaN past kv_len leaked"
            assert_close(got, decode_cases.reference(q, k, v, lens, scale=scale, causal=True, left=left),
                         dtype, err_msg=f"split_rows={split_rows} cluster={cluster} left={left}")
        # NaN in the rows a window hides (before its start): read by neither form (docs/attention.md,
        # "NaN and Inf": the kernels do not read hidden rows), so the same bits and no NaN.
        k2, v2 = k.copy(), v.copy()
        for bi, n in enumerate(lens):
            k2[bi, :, :max(n - s - 100, 0)] = np.nan
            v2[bi, :, :max(n - s - 100, 0)] = np.nan
        got = _both(q, k2, v2, lens, scale=scale, causal=True, left=100, split_rows=split_rows, cluster=cluster)
        assert not np.isnan(got.astype(np.float32)).any(), "NaN before the window leaked"


# The decode steps the switch is for: 32/8, B 1 and 8, the planner's plan, lengths just under the
# capacity (a decoder's cache) and far under it (most splits see nothing).
@pytest.mark.parametrize("b,d,c", [(1, 128, 2304), (1, 128, 8192), (8, 128, 2304), (1, 64, 1280), (8, 64, 4096)])
def test_decoder_steps(b, d, c):
    dtype = np.float16
    for lens in ([c - 7] * b, [c // 5 + 3] * b):
        _, q, k, v, lens = decode_cases.dense_inputs(b * d + c, b, 32, 8, 1, d, c, dtype, lens=lens)
        got = _both(q, k, v, lens, scale=0.088, causal=True)
        assert_close(got, decode_cases.reference(q, k, v, lens, scale=0.088, causal=True), dtype,
                     err_msg=f"lens {lens[0]}")


@pytest.mark.parametrize("variant", ["softcap", "bias", "sink"])
def test_variants(variant):
    dtype, d, c, b = ml_dtypes.bfloat16, 128, 777, 5
    rng, q, k, v, lens = decode_cases.dense_inputs(3, b, 32, 8, 1, d, c, dtype, lens=[777, 0, 500, 64, 130])
    bias = decode_cases.bias("f32_full", rng, b, 32, 1, c) if variant == "bias" else None
    sink = rng.standard_normal(32).astype(np.float32) if variant == "sink" else None
    static = dict(scale=0.1, causal=True, softcap=30.0 if variant == "softcap" else 0.0, split_rows=128)
    got = _both(q, k, v, lens, bias, sink, **static)
    assert_close(got, decode_cases.reference(q, k, v, lens, bias, sink, **static), dtype, err_msg=variant)


def test_wide_tile():
    # The wide tile (128-row stages) with speculated tiles: its own bits, with and without.
    dtype, d, c = np.float16, 128, 1000
    _, q, k, v, lens = decode_cases.dense_inputs(5, 6, 32, 8, 1, d, c, dtype, lens=[1000, 0, 127, 128, 129, 640])
    for split_rows in (None, 256):
        got = _both(q, k, v, lens, scale=0.09, causal=True, tile128=True, split_rows=split_rows)
        assert_close(got, decode_cases.reference(q, k, v, lens, scale=0.09, causal=True), dtype)


def test_switch_is_ignored_where_it_does_not_apply():
    # A quantised cache (its tiles are converted with kv_len's bounds) and the producer warp: the
    # switch changes no bit.
    dtype, d, c, b = np.float16, 128, 1000, 3
    for bits in (8, 4):
        _, q, k, v, ks, vs, lens = decode_cases.quant_inputs(9, bits, "tensor", b, 32, 8, 1, d, c, dtype)

        def f(sp, quant_regs):
            call = jax.jit(functools.partial(cuda.decode_attention, scale=0.1, kv_bits=bits, speculate=sp,
                                             quant_regs=quant_regs))
            return np.asarray(call(q, k, v, lens, None, None, ks, vs))
        for regs in (False, True):
            np.testing.assert_array_equal(f(True, regs), f(False, regs), err_msg=f"kv_bits={bits} regs={regs}")
    _, q, k, v, lens = decode_cases.dense_inputs(9, b, 32, 8, 1, d, c, dtype)
    f = lambda sp: decode_cases.engine(q, k, v, lens, scale=0.1, producer=True, engine="decode", speculate=sp)
    np.testing.assert_array_equal(f(True), f(False))


# A decode loop (16 dependent attention calls, kv_len advancing on the device) run in a fresh process
# so XLA_FLAGS apply: B=8, 32/8, d128 (the cursor copies), capacity 2304 with lengths on and around
# tile boundaries; the switch on through JOA_DECODE_SPECULATE; captured, replayed with the same bits,
# and the same bits as the loop without it.
_LOOP = textwrap.dedent("""
    import functools, os
    os.environ["JOA_DECODE_SPECULATE"] = "1"
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops import cuda

    def steps(q, k, v, lens, speculate):
        attn = functools.partial(cuda.decode_attention, scale=0.09, speculate=speculate, engine="decode")
        # The outputs summed in f32, not stacked (a stacked output hides the call from the check).
        def body(i, carry):
            lens, acc = carry
            out = attn(q * (1.0 + 0.01 * i).astype(q.dtype), k, v, lens)
            return lens + 1, acc + out.astype(jnp.float32)
        return jax.lax.fori_loop(0, 16, body, (lens, jnp.zeros(q.shape, jnp.float32)))[1]

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((8, 32, 1, 128)), jnp.float16)
    k = jnp.asarray(rng.standard_normal((8, 8, 2304, 128)), jnp.float16)
    v = jnp.asarray(rng.standard_normal((8, 8, 2304, 128)), jnp.float16)
    lens = jnp.array([2000, 1500, 0, 63, 127, 128, 1000, 2280], jnp.int32)
    f = jax.jit(functools.partial(steps, speculate=None))  # None: JOA_DECODE_SPECULATE, at trace time
    hlo = f.lower(q, k, v, lens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_decode_attention"' in l]
    assert "speculate = true" in f.lower(q, k, v, lens).as_text()
    print("CUSTOM_CALL_NAMES", *names)
    got = f(q, k, v, lens)
    got2 = f(q, k, v, lens)  # replay
    want = jax.jit(functools.partial(steps, speculate=False))(q, k, v, lens)
    assert np.array_equal(np.asarray(got), np.asarray(got2)), "replay changed the bits"
    assert np.array_equal(np.asarray(got), np.asarray(want)), "speculation changed the bits"
    print("LOOP_OK")
""")


def test_decode_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "decode_attention", tmp_path)
