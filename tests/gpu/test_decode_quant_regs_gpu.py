"""The decode engine's register-dequantising path for int8 / int4 caches (quant_regs: the
JOA_DECODE_QUANT_REGS switch, engine_qregs.cuh) against the reference.

The path feeds exact integer levels to the MMAs and applies the scales where they factor out (a
per-tensor K scale on the logits, a per-channel one on Q once per CTA, V's on the f32 O columns), so
it is not bitwise equal to the shared-memory path (which rounds T(q * scale) per value like the
reference): it is checked against the reference at the dtype's tolerance (jax_onnx_attn.testing's
table), and bitwise only against itself (repeats, PDL, batch invariance, bytes past kv_len, a scale
of 0 against a scale of 1). Sweeps int8 / int4 x per-tensor / per-channel x f16 / bf16 x head dims
x GQA shapes x ragged lengths x variant features x splits (the path forced: quant_regs=True); plus
the default: the kernel the plan picks for the call's size (plan.h QuantPath::kAuto), bit for bit,
and the tile kernel with JOA_DECODE_QUANT_REGS=0 (read at trace time). Every test runs both register
kernels (the `kernel` fixture): keys as the MMA rows (key_rows.cuh, where a block holds <= 8 query
rows; the default) and query rows as the MMA rows (DecodeSplitKernelQRegs' two forms).
"""

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.testing import assert_close

import decode_cases
from decode_cases import FEATURES
from decode_cases import quant_cache as _cache
from decode_cases import quant_inputs as _inputs

pytestmark = pytest.mark.gpu

BF16, F16 = ml_dtypes.bfloat16, np.float16
DTYPES = [F16, BF16]
HEAD_DIMS = [64, 80, 96, 128, 256]
BITS = [8, 4]
# (Hq, Hkv, S): packed rows 4 (1x4 warps), 1, 8 (the key-rows kernel's most), 8 of two query
# positions, 32 (2x2), 64 (4x1), 256 (8x1, two M blocks), 9.
HEADS = [(32, 8, 1), (8, 8, 1), (16, 2, 1), (4, 1, 2), (32, 8, 8), (16, 2, 8), (16, 1, 16), (6, 2, 3)]
_KEY_ROWS = [True]  # the register kernel of the running test (the `kernel` fixture)


@pytest.fixture(autouse=True, params=["key-rows", "query-rows"])
def kernel(request):
    """Which register kernel `_regs` forces: keys or query rows as the MMA rows (key_rows)."""
    _KEY_ROWS[0] = request.param == "key-rows"
    return request.param


def _regs(**static):
    """cuda.decode_attention on the register path (quant_regs=True) with the test's kernel, jitted."""
    return _regs_jit(_KEY_ROWS[0], **static)


@functools.cache
def _regs_jit(key_rows, **static):
    return jax.jit(functools.partial(cuda.decode_attention, quant_regs=True, key_rows=key_rows, **static))


@functools.cache
def _reference(**static):
    return jax.jit(functools.partial(decode_attention, backend="reference", **static))


def _run_regs(q, k, v, lens, bias=None, sink=None, ks=None, vs=None, **static):
    return np.asarray(_regs(**static)(q, k, v, lens, bias, sink, ks, vs))


def _check(q, k, v, ks, vs, lens, bits, bias=None, sink=None, *, split_rows, **static):
    """The register path vs the reference at the dtype's tolerance. Returns its output."""
    got = _run_regs(q, k, v, lens, bias, sink, ks, vs, kv_bits=bits, split_rows=split_rows, **static)
    assert not np.isnan(got.astype(np.float32)).any(), "NaN in the kernel output"
    want = np.asarray(_reference(kv_bits=bits, **static)(q, k, v, lens, bias, sink, ks, vs))
    assert_close(got, want, q.dtype)
    return got


def _plan(q, k, bits):
    b, hq, s, d = q.shape
    return cuda.decode_split_rows(b, k.shape[1], (hq // k.shape[1]) * s, k.shape[2], d, bits)


@pytest.mark.parametrize("heads", HEADS, ids=lambda h: f"{h[0]}q{h[1]}kv_s{h[2]}")
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_shapes(bits, dtype, d, heads):
    if (HEAD_DIMS.index(d) + HEADS.index(heads)) % 2:
        pytest.skip("each head dim takes every other GQA shape (alternating across head dims)")
    hq, hkv, s = heads
    mode = "channel" if HEADS.index(heads) % 2 == 0 else "tensor"
    c = 200 if d != 256 else 131  # not a multiple of the 64-row tile
    _, q, k, v, ks, vs, lens = _inputs(d + hq + s + bits, bits, mode, 3, hq, hkv, s, d, c, dtype)
    _check(q, k, v, ks, vs, lens, bits, split_rows=_plan(q, k, bits), scale=float(1 / np.sqrt(d)))


@pytest.mark.parametrize("split", ["single", "tile"])
@pytest.mark.parametrize("mode", ["tensor", "channel"])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_split_modes(bits, d, mode, split):
    _, q, k, v, ks, vs, lens = _inputs(d + bits, bits, mode, 3, 32, 8, 1, d, 200, BF16)
    split_rows = {"single": 256, "tile": 64}[split]
    _check(q, k, v, ks, vs, lens, bits, split_rows=split_rows, scale=float(1 / np.sqrt(d)))


@pytest.mark.parametrize("causal,window,softcap,bias_kind,sink", FEATURES[::5])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_features(bits, causal, window, softcap, bias_kind, sink):
    rng, q, k, v, ks, vs, lens = _inputs(7, bits, "channel", 3, 32, 8, 4, 128, 300, BF16)
    bias = decode_cases.bias(bias_kind, rng, 3, 32, 4, 300)
    sink_v = rng.standard_normal(32).astype(np.float32) if sink else None
    _check(q, k, v, ks, vs, lens, bits, bias, sink_v, split_rows=_plan(q, k, bits),
           scale=float(1 / np.sqrt(128)), softcap=softcap, causal=causal, left=window[0],
           right=window[1])


@pytest.mark.parametrize("d", [80, 256])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_all_features_at_once(bits, dtype, d):
    rng, q, k, v, ks, vs, lens = _inputs(d, bits, "tensor", 3, 16, 2, 5, d, 190, dtype)
    bias = decode_cases.bias("f32_full", rng, 3, 16, 5, 190)
    sink_v = rng.standard_normal(16).astype(np.float32)
    _check(q, k, v, ks, vs, lens, bits, bias, sink_v, split_rows=64, scale=float(1 / np.sqrt(d)),
           softcap=20.0, causal=True, left=50, right=-1)


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
    assert not got[1:3].astype(np.float32).any()
    assert not got[3, :, :2].astype(np.float32).any()


@pytest.mark.parametrize("d", [80, 128])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_bytes_past_kv_len_do_not_matter(bits, d):
    rng, q, k, v, ks, vs, lens = _inputs(9, bits, "channel", 4, 32, 8, 3, d, 300, F16,
                                         lens=[300, 0, 2, 131])
    first = _run_regs(q, k, v, lens, None, None, ks, vs, kv_bits=bits, scale=0.1)
    k2, v2 = k.copy(), v.copy()
    for bi, n in enumerate(lens):
        k2[bi, :, n:] = _cache(rng, bits, 1, k.shape[1], k.shape[2] - n, d)[0]
        v2[bi, :, n:] = _cache(rng, bits, 1, k.shape[1], k.shape[2] - n, d)[0]
    np.testing.assert_array_equal(_run_regs(q, k2, v2, lens, None, None, ks, vs, kv_bits=bits,
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
    # Unit-scale values reach 128: bitwise checks only (as test_decode_quant_gpu: at that magnitude
    # a rounding of Q or K moves bf16 outputs past the table's tolerance, on either path).
    got = _run_regs(q, k, v, lens, None, None, zero_k, zero_v, kv_bits=bits, scale=0.01)
    ones = _run_regs(q, k, v, lens, None, None, one_k, one_v, kv_bits=bits, scale=0.01)
    np.testing.assert_array_equal(got, ones)


@pytest.mark.parametrize("mode", ["tensor", "channel"])
@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_bf16_queries_beyond_f16_range(bits, mode):
    # The MMAs run on f16 (QuantRegKv::MmaT) and a bf16 Q is staged under a power-of-two scale per
    # row (QRegStages::RowExp): heads of one KV group at 3e5, 1, 1e-5 and 2e4 (past f16's 65504 and
    # under its normal range) share a CTA, each row scaled on its own.
    _, q, k, v, ks, vs, lens = _inputs(12, bits, mode, 2, 32, 8, 2, 128, 700, BF16)
    mags = np.array([3e5, 1.0, 1e-5, 2e4], np.float32)
    q = (q.astype(np.float32) * np.tile(mags, 8)[None, :, None, None]).astype(BF16)
    _check(q, k, v, ks, vs, lens, bits, split_rows=256, scale=float(1.0 / 3e5 / np.sqrt(128)))


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_bitwise_deterministic_and_pdl_invariant(bits):
    _, q, k, v, ks, vs, lens = _inputs(5, bits, "channel", 2, 64, 8, 16, 128, 4096, BF16,
                                       lens=[4096, 3000])
    f = _regs(scale=0.09, kv_bits=bits, split_rows=256)
    first = np.asarray(f(q, k, v, lens, None, None, ks, vs))
    for _ in range(5):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, lens, None, None, ks, vs)), first)
    no_pdl = _regs(scale=0.09, kv_bits=bits, split_rows=256, pdl=False)
    np.testing.assert_array_equal(np.asarray(no_pdl(q, k, v, lens, None, None, ks, vs)), first)


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_batch_invariant_at_a_fixed_split_size(bits):
    _, q, k, v, ks, vs, lens = _inputs(6, bits, "tensor", 4, 32, 8, 2, 96, 1024, F16,
                                       lens=[1024, 700, 3, 1000])
    f = _regs(scale=0.09, kv_bits=bits, split_rows=128)
    batched = np.asarray(f(q, k, v, lens, None, None, ks, vs))
    for bi in range(4):
        sl = slice(bi, bi + 1)
        alone = np.asarray(f(q[sl], k[sl], v[sl], lens[sl], None, None, ks, vs))
        np.testing.assert_array_equal(alone[0], batched[bi])


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
@pytest.mark.parametrize("capacity,planned_regs", [(700, False), (32768, True)], ids=["small", "large"])
def test_default_takes_the_planned_kernel_and_the_environment_turns_registers_off(bits, capacity, planned_regs,
                                                                                  monkeypatch):
    # By default the plan picks the kernel by the call's size (plan.h QuantPath::kAuto: the tile
    # kernel below kQuantRegsMinRows KV rows, the register kernel from there on); the default's
    # output is that kernel's, bit for bit. JOA_DECODE_QUANT_REGS=0 always takes the tile kernel.
    batch = 2 if capacity < 1024 else 1
    _, q, k, v, ks, vs, lens = _inputs(11, bits, "channel", batch, 32, 8, 1, 128, capacity, BF16)
    args = (q, k, v, lens, None, None, ks, vs)
    static = dict(scale=0.09, kv_bits=bits, split_rows=128)
    plan = cuda.decode_plan(batch, 32, 8, 1, capacity, 128, bits, 128, quant_regs=None)
    assert plan["quant_regs"] is planned_regs
    smem = np.asarray(jax.jit(functools.partial(cuda.decode_attention, quant_regs=False, **static))(*args))
    regs = np.asarray(jax.jit(functools.partial(cuda.decode_attention, quant_regs=True, **static))(*args))
    monkeypatch.delenv(cuda.QUANT_REGS_ENV, raising=False)
    monkeypatch.delenv(cuda.KEY_ROWS_ENV, raising=False)
    default = np.asarray(jax.jit(lambda *a: cuda.decode_attention(*a, **static))(*args))
    np.testing.assert_array_equal(default, regs if planned_regs else smem)
    monkeypatch.setenv(cuda.QUANT_REGS_ENV, "0")
    off = np.asarray(jax.jit(lambda *a: cuda.decode_attention(*a, **static))(*args))
    np.testing.assert_array_equal(off, smem)
    # The two paths agree to the tolerance (not bitwise: the scales are applied elsewhere).
    assert_close(regs, smem.astype(np.float32), BF16)


def test_dense_cache_ignores_the_switch():
    rng = np.random.default_rng(12)
    q = rng.standard_normal((2, 32, 1, 128)).astype(BF16)
    k = rng.standard_normal((2, 8, 300, 128)).astype(BF16)
    v = rng.standard_normal((2, 8, 300, 128)).astype(BF16)
    lens = np.array([300, 200], np.int32)
    off = jax.jit(functools.partial(cuda.decode_attention, scale=0.09, quant_regs=False))(q, k, v, lens)
    on = jax.jit(functools.partial(cuda.decode_attention, scale=0.09, quant_regs=True))(q, k, v, lens)
    np.testing.assert_array_equal(np.asarray(on), np.asarray(off))


@pytest.mark.parametrize("bits,quant_type", [(8, "PER_CHANNEL"), (4, "PER_TENSOR")])
def test_gqa_decode_quantised_cache_with_the_switch_on(bits, quant_type, monkeypatch):
    """GroupQueryAttention end to end (gqa_prepare quantises the new rows, unchanged; the engine
    dequantises in registers: the default, JOA_DECODE_QUANT_REGS=1 here to be explicit) against the
    reference."""
    from gqa_decode_cases import gqa_inputs, quant_attrs

    from jax_onnx_attn import ops

    monkeypatch.setenv(cuda.QUANT_REGS_ENV, "1")
    inp = gqa_inputs(bits * 5, BF16, s=1, n=32, hkv=8, d=128, rotary=1, kv_bits=bits,
                     quant_type=quant_type)
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    attrs = dict(num_heads=32, kv_num_heads=8, do_rotary=1,
                 total_sequence_length=inp["total_sequence_length"], **quant_attrs(bits, quant_type))

    def step(backend):
        return jax.jit(lambda a: ops.group_query_attention(**a, **attrs, shared_buffer=True,
                                                           backend=backend))

    got, want = step("cuda")(arrays), step("reference")(arrays)
    assert_close(np.asarray(got.output), np.asarray(want.output), BF16)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@pytest.mark.parametrize("bits", BITS, ids=lambda x: f"int{x}")
def test_cluster_combine(bits):
    """The splits of a 16-row block combined inside a thread-block cluster (sm_90), forced."""
    _, q, k, v, ks, vs, lens = _inputs(13, bits, "channel", 2, 32, 8, 1, 128, 1024, BF16,
                                       lens=[1024, 517])
    got = _run_regs(q, k, v, lens, None, None, ks, vs, kv_bits=bits, split_rows=128, scale=0.09,
                    cluster=True)
    want = np.asarray(_reference(kv_bits=bits, scale=0.09)(q, k, v, lens, None, None, ks, vs))
    assert_close(got, want, BF16)
    plain = _run_regs(q, k, v, lens, None, None, ks, vs, kv_bits=bits, split_rows=128, scale=0.09,
                      cluster=False)
    assert_close(got, plain.astype(np.float32), BF16)
