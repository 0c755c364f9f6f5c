"""The CUDA decode engine on int8 / int4 KV caches (kv_bits 8 / 4) against the reference: the path
that dequantises tile by tile in shared memory (JOA_DECODE_QUANT_REGS=0, set for every test here;
the default register path has tests/gpu/test_decode_quant_regs_gpu.py).

That path streams the packed cache bytes and converts each tile to the query dtype in shared memory
with the rounding of `reference.quant.dequantize`; the MMAs and softmax are the dense path's. So
besides the reference (dequantize, then dense attention; the dtype's tolerance), most cases also
check the quantised call against the dense kernel on the reference-dequantised cache at the same
split size: bitwise equal. Sweeps int8 / int4 x per-tensor / per-channel scales x f16 / bf16 x head
dims x GQA shapes (packed M 1..256, q_len 1..16) x ragged lengths (0, < S, > capacity) x variant
features x splits (1 to many); plus: bytes past kv_len do not matter, a scale of 0 reads as 1,
bitwise repeats with and without PDL, batch invariance at a fixed split size.
"""

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.ops.reference.decode import dequantize_cache
from jax_onnx_attn.testing import assert_close

import decode_cases
from decode_cases import FEATURES
from decode_cases import quant_cache as _cache
from decode_cases import quant_inputs as _inputs

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _tile_path(monkeypatch):
    """Every call here traces the shared-memory tile path (the switch is read at trace time)."""
    monkeypatch.setenv(cuda.QUANT_REGS_ENV, "0")

BF16, F16 = ml_dtypes.bfloat16, np.float16
DTYPES = [F16, BF16]
HEAD_DIMS = [64, 80, 96, 128, 256]
BITS = [8, 4]
# (Hq, Hkv, S): packed rows G * S = 4 (1x4 warps), 1, 32 (2x2), 64 (4x1), 128 (8x1),
# 256 (8x1, two M blocks), 9.
HEADS = [(32, 8, 1), (8, 8, 1), (32, 8, 8), (16, 2, 8), (64, 8, 16), (16, 1, 16), (6, 2, 3)]


@functools.cache
def _jitted(backend, **static):  # traced under _tile_path: cached jits stay on the tile path
    return jax.jit(functools.partial(decode_attention, backend=backend, **static))


def _run(backend, q, k, v, lens, bias=None, sink=None, ks=None, vs=None, **static):
    return np.asarray(_jitted(backend, **static)(q, k, v, lens, bias, sink, ks, vs))


def _dequantized(k, v, ks, vs, bits, dtype):
    return (np.asarray(dequantize_cache(k, ks, bits, dtype)),
            np.asarray(dequantize_cache(v, vs, bits, dtype)))


def _check(q, k, v, ks, vs, lens, bits, bias=None, sink=None, *, split_rows, **static):
    """The quantised kernel vs the reference (tolerance) and vs the dense kernel on the
    dequantised cache at the same split size (bitwise). Returns the kernel's output."""
    got = _run("cuda", q, k, v, lens, bias, sink, ks, vs, kv_bits=bits, split_rows=split_rows,
               **static)
    assert not np.isnan(got.astype(np.float32)).any(), "NaN in the kernel output"
    want = _run("reference", q, k, v, lens, bias, sink, ks, vs, kv_bits=bits, **static)
    assert_close(got, want, q.dtype)
    kd, vd = _dequantized(k, v, ks, vs, bits, q.dtype)
    dense = _run("cuda", q, kd, vd, lens, bias, sink, split_rows=split_rows, **static)
    np.testing.assert_array_equal(got, dense, err_msg="quantised != dense kernel on the dequantised cache")
    return got


def _plan(q, k, bits):
    b, hq, s, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    return cuda.decode_split_rows(b, hkv, (hq // hkv) * s, c, d, bits)


def _split_rows(mode, q, k, bits):
    c = k.shape[2]
    return {"auto": _plan(q, k, bits), "single": -(-c // 64) * 64, "tile": 64}[mode]


@pytest.mark.parametrize("split", ["auto", "single", "tile"])
@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_shapes(bits, dtype, d, heads, split):
    if split != "auto" and (d in (80, 96) or heads not in (HEADS[0], HEADS[4])):
        pytest.skip("split modes are swept on head dims 64, 128, 256 and two GQA shapes")
    hq, hkv, s = heads
    mode = "channel" if HEADS.index(heads) % 2 == 0 else "tensor"  # both per (bits, dtype, d)
    c = 200 if d != 256 else 131  # not a multiple of the 64-row tile
    _, q, k, v, ks, vs, lens = _inputs(d + hq + s + bits, bits, mode, 3, hq, hkv, s, d, c, dtype)
    _check(q, k, v, ks, vs, lens, bits, split_rows=_split_rows(split, q, k, bits),
           scale=float(1 / np.sqrt(d)))


def _feature_case(bits, mode, dtype, hq, hkv, s, d, c, causal, window, softcap, bias_kind, sink,
                  seed, split_rows=None):
    rng, q, k, v, ks, vs, lens = _inputs(seed, bits, mode, 3, hq, hkv, s, d, c, dtype)
    bias = decode_cases.bias(bias_kind, rng, 3, hq, s, c)
    sink_v = rng.standard_normal(hq).astype(np.float32) if sink else None
    _check(q, k, v, ks, vs, lens, bits, bias, sink_v,
           split_rows=split_rows or _plan(q, k, bits), scale=float(1 / np.sqrt(d)),
           softcap=softcap, causal=causal, left=window[0], right=window[1])


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES[::4])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_features_bf16_gqa4_s4(bits, causal, window, softcap, bias_kind, sink):
    _feature_case(bits, "channel", BF16, 32, 8, 4, 128, 300, causal, window, softcap, bias_kind,
                  sink, 7)


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES[1::9])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_features_f16_gqa8_s1_d64_many_splits(bits, causal, window, softcap, bias_kind, sink):
    _feature_case(bits, "tensor", F16, 64, 8, 1, 64, 257, causal, window, softcap, bias_kind, sink,
                  8, split_rows=64)


@pytest.mark.parametrize("d", [80, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_all_features_at_once(bits, dtype, d):
    _feature_case(bits, "channel", dtype, 16, 2, 5, d, 190, True, (50, -1), 20.0, "f32_full", True, d)


@pytest.mark.parametrize("split_rows", [64, 256, None])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_splits_long_context(bits, split_rows):
    _, q, k, v, ks, vs, lens = _inputs(3, bits, "channel", 2, 32, 8, 4, 128, 2048, BF16,
                                       lens=[2048, 1500])
    _check(q, k, v, ks, vs, lens, bits, split_rows=split_rows or _plan(q, k, bits), scale=0.09)


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_kv_len_beyond_capacity_is_clamped_and_empty_rows_are_zero(bits):
    _, q, k, v, ks, vs, _ = _inputs(4, bits, "tensor", 4, 8, 2, 4, 64, 100, F16, lens=[100] * 4)
    lens = np.array([500, -3, 0, 2], np.int32)
    got = _check(q, k, v, ks, vs, lens, bits, split_rows=_plan(q, k, bits), scale=0.125)
    assert not got[1:3].astype(np.float32).any()        # no key at all
    assert not got[3, :, :2].astype(np.float32).any()  # rows before position 0


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("d", [80, 128])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_bytes_past_kv_len_do_not_matter(bits, d, dtype):
    rng, q, k, v, ks, vs, lens = _inputs(9, bits, "channel", 4, 32, 8, 3, d, 300, dtype,
                                         lens=[300, 0, 2, 131])
    first = _run("cuda", q, k, v, lens, None, None, ks, vs, kv_bits=bits, scale=0.1)
    k2, v2 = k.copy(), v.copy()
    for bi, n in enumerate(lens):
        k2[bi, :, n:] = _cache(rng, bits, 1, k.shape[1], k.shape[2] - n, d)[0]
        v2[bi, :, n:] = _cache(rng, bits, 1, k.shape[1], k.shape[2] - n, d)[0]
    np.testing.assert_array_equal(_run("cuda", q, k2, v2, lens, None, None, ks, vs, kv_bits=bits,
                                       scale=0.1), first)


@pytest.mark.parametrize("mode", ["tensor", "channel"])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_scale_zero_reads_as_one(bits, mode):
    rng, q, k, v, ks, vs, lens = _inputs(10, bits, mode, 2, 16, 4, 2, 128, 150, BF16)
    zero_k, zero_v = ks.copy(), vs.copy()
    if mode == "tensor":
        zero_k[:] = 0.0
    else:
        zero_k[rng.random(ks.shape) < 0.3] = 0.0
        zero_v[rng.random(vs.shape) < 0.3] = -0.0
    one_k = np.where(zero_k == 0, 1, zero_k).astype(np.float32)
    one_v = np.where(zero_v == 0, 1, zero_v).astype(np.float32)
    # Unit-scale values reach 128: a small softmax scale keeps the logits moderate. Bitwise checks
    # only (the reference's own rule is tested on CPU).
    sr = _plan(q, k, bits)
    got = _run("cuda", q, k, v, lens, None, None, zero_k, zero_v, kv_bits=bits, split_rows=sr,
               scale=0.01)
    ones = _run("cuda", q, k, v, lens, None, None, one_k, one_v, kv_bits=bits, split_rows=sr,
                scale=0.01)
    np.testing.assert_array_equal(got, ones)
    kd, vd = _dequantized(k, v, zero_k, zero_v, bits, BF16)
    np.testing.assert_array_equal(got, _run("cuda", q, kd, vd, lens, split_rows=sr, scale=0.01))


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_bitwise_deterministic_and_pdl_invariant(bits):
    _, q, k, v, ks, vs, lens = _inputs(5, bits, "channel", 2, 64, 8, 16, 128, 4096, BF16,
                                       lens=[4096, 3000])
    f = jax.jit(functools.partial(decode_attention, scale=0.09, kv_bits=bits, backend="cuda",
                                  split_rows=256))
    first = np.asarray(f(q, k, v, lens, None, None, ks, vs))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, lens, None, None, ks, vs)), first)
    no_pdl = jax.jit(lambda *a: cuda.decode_attention(*a, scale=0.09, kv_bits=bits, split_rows=256,
                                                      pdl=False))
    np.testing.assert_array_equal(np.asarray(no_pdl(q, k, v, lens, None, None, ks, vs)), first)


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_batch_invariant_at_a_fixed_split_size(bits):
    _, q, k, v, ks, vs, lens = _inputs(6, bits, "tensor", 4, 32, 8, 2, 96, 1024, F16,
                                       lens=[1024, 700, 3, 1000])
    f = jax.jit(functools.partial(decode_attention, scale=0.09, kv_bits=bits, backend="cuda",
                                  split_rows=128))
    batched = np.asarray(f(q, k, v, lens, None, None, ks, vs))
    for bi in range(4):
        sl = slice(bi, bi + 1)
        alone = np.asarray(f(q[sl], k[sl], v[sl], lens[sl], None, None, ks, vs))
        np.testing.assert_array_equal(alone[0], batched[bi])
