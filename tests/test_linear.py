"""linear / matmul_nbits on CPU: the reference against a float64 NumPy oracle and onnxruntime's
MatMulNBits, prepare_nbits on every onnxruntime input form, the gate / up layout, every validation
error, the GEMV plan, and a NumPy emulation of the kernel's index maps (the k-permutation, the
bit-level int4 / int8 dequantisation and its pair order, the x staging layout, the MMA fragments,
the accumulator -> reduction -> epilogue mapping), so the layout logic is proven before a GPU runs it.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from jax_onnx_attn import ops
from jax_onnx_attn.onnx.handlers.linalg import dequantize_nbits as lowering_dequantize
from jax_onnx_attn import build_info
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import split_gate_up
from jax_onnx_attn.ops.reference import linear as reference
from jax_onnx_attn.testing import assert_close

BF16 = ml_dtypes.bfloat16
DTYPES = [np.float32, np.float16, BF16]


def _round(a, dtype):
    return np.asarray(a, np.float64).astype(dtype).astype(np.float64)


def _silu(v):
    return v / (1.0 + np.exp(-v))


def oracle_linear(x, w, bias=None, residual=None, norm_weight=None, eps=1e-6, gated=False):
    """float64 math, rounded to x's dtype where the spec rounds."""
    dt = x.dtype
    xf = x.astype(np.float64)
    if norm_weight is not None:
        r = 1.0 / np.sqrt(np.mean(xf ** 2, axis=-1, keepdims=True) + eps)
        xf = _round(xf * r * norm_weight.astype(np.float64), dt)
    y = _round(xf @ w.astype(np.float64).T, dt)
    if bias is not None:
        y = _round(y + bias.astype(np.float64), dt)
    if gated:
        n = y.shape[-1]
        blocks = y.reshape(y.shape[:-1] + (n // 16, 2, 8))
        g = blocks[..., 0, :].reshape(y.shape[:-1] + (n // 2,))
        u = blocks[..., 1, :].reshape(y.shape[:-1] + (n // 2,))
        y = _round(_silu(g) * u, dt)
    if residual is not None:
        y = _round(y + residual.astype(np.float64), dt)
    return y


def _rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


# --- reference vs oracle ------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("fusion", ["plain", "bias", "residual", "norm", "gated", "all"])
def test_reference_linear_matches_oracle(dtype, fusion):
    rng = np.random.default_rng(hash(fusion) % 1000)
    lead, k, n = (2, 3), 64, 48
    x = _rand(rng, lead + (k,), dtype)
    w = _rand(rng, (n, k), dtype, 1 / math.sqrt(k))
    gated = fusion in ("gated", "all")
    n_out = n // 2 if gated else n
    kw = dict(gated=gated)
    if fusion in ("bias", "all"):
        kw["bias"] = _rand(rng, (n,), dtype)
    if fusion in ("residual", "all"):
        kw["residual"] = _rand(rng, lead + (n_out,), dtype)
    if fusion in ("norm", "all"):
        kw["norm_weight"] = _rand(rng, (k,), dtype)
        kw["norm_epsilon"] = 1e-5
    got = jax.jit(lambda x, w: ops.linear(x, w, **kw, backend="reference"))(x, w)
    assert got.shape == lead + (n_out,) and got.dtype == dtype
    want = oracle_linear(x, w, kw.get("bias"), kw.get("residual"), kw.get("norm_weight"),
                         kw.get("norm_epsilon", 1e-6), gated)
    assert_close(got, want, dtype)


def test_gated_is_silu_of_gate_times_up():
    rng = np.random.default_rng(1)
    k, i = 32, 24
    x = _rand(rng, (5, k), np.float32)
    wg, wu = _rand(rng, (i, k), np.float32), _rand(rng, (i, k), np.float32)
    bg, bu = _rand(rng, (i,), np.float32), _rand(rng, (i,), np.float32)
    w = ops.interleave_gate_up(wg, wu)
    b = ops.interleave_gate_up(bg, bu)
    got = ops.linear(x, w, b, gated=True, backend="reference")
    g = x.astype(np.float64) @ wg.T + bg
    u = x.astype(np.float64) @ wu.T + bu
    assert_close(got, _silu(g) * u, np.float32)


def test_interleave_layout_and_inverse():
    g = np.arange(16 * 3).reshape(16, 3)
    u = -np.arange(16 * 3).reshape(16, 3)
    w = ops.interleave_gate_up(g, u)
    assert isinstance(w, np.ndarray) and w.shape == (32, 3)
    np.testing.assert_array_equal(w[0:8], g[0:8])
    np.testing.assert_array_equal(w[8:16], u[0:8])
    np.testing.assert_array_equal(w[16:24], g[8:16])
    np.testing.assert_array_equal(w[24:32], u[8:16])
    g2, u2 = ops.deinterleave_gate_up(w)
    np.testing.assert_array_equal(g2, g)
    np.testing.assert_array_equal(u2, u)
    gj, uj = split_gate_up(jnp.asarray(w.T))  # the same layout along the last axis
    np.testing.assert_array_equal(np.asarray(gj), g.T)
    np.testing.assert_array_equal(np.asarray(uj), u.T)
    # The n-bit form interleaves every operand's rows alike.
    bq = np.arange(16 * 2 * 4, dtype=np.uint8).reshape(16, 2, 4)
    s = np.ones((16, 2), np.float16)
    z = np.full((16, 2), 3, np.uint8)
    b2, s2, z2 = ops.interleave_gate_up_nbits((bq, s, z), (bq + 1, s * 2, z + 1))
    np.testing.assert_array_equal(b2[8:16], bq[0:8] + 1)
    np.testing.assert_array_equal(s2[16:24], s[8:16])
    np.testing.assert_array_equal(z2[24:32], z[8:16] + 1)
    assert ops.interleave_gate_up_nbits((bq, s, None), (bq, s, None))[2] is None


# --- MatMulNBits: forms, dequantisation, onnxruntime ---------------------------------------------

def _quantized(rng, n, k, bits, block, *, zp: bool, dtype=np.float32):
    """onnxruntime's initialiser forms: b_quant [N, kb, blob], scales [N * kb], zero points packed
    [N * ceil(kb * bits / 8)] or None; plus the dense W [N, K] they stand for (float64)."""
    kb = k // block
    q = rng.integers(0, 1 << bits, size=(n, kb, block)).astype(np.uint8)
    if bits == 4:
        b_quant = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
    else:
        b_quant = q
    scales = (rng.uniform(0.5, 1.5, size=(n * kb,)) / (1 << bits)).astype(dtype)
    zpv = rng.integers(0, 1 << bits, size=(n, kb)).astype(np.uint8) if zp else None
    packed = None
    if zp:
        if bits == 4:
            padded = np.concatenate([zpv, np.zeros((n, kb % 2), np.uint8)], axis=1)
            packed = (padded[:, 0::2] | (padded[:, 1::2] << 4)).astype(np.uint8).reshape(-1)
        else:
            packed = zpv.reshape(-1)
    mid = np.float64(1 << (bits - 1))
    z = zpv.astype(np.float64)[..., None] if zp else mid
    w = ((q.astype(np.float64) - z) * scales.astype(np.float64).reshape(n, kb, 1)).reshape(n, k)
    return b_quant, scales, packed, w.astype(dtype).astype(np.float64), zpv


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 128])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [np.float16, BF16, np.float32], ids=lambda d: np.dtype(d).name)
def test_prepare_and_dequantize_match_the_lowering(bits, block, zp, dtype):
    rng = np.random.default_rng(bits * block)
    n, k = 24, 3 * block
    b_quant, scales, packed, w, zpv = _quantized(rng, n, k, bits, block, zp=zp, dtype=dtype)
    bq, s, z = ops.prepare_nbits(b_quant.reshape(-1), scales, packed, k=k, n=n, bits=bits,
                                 block_size=block)
    assert bq.shape == (n, k // block, block * bits // 8) and s.shape == (n, k // block)
    if zp:
        np.testing.assert_array_equal(z, zpv)
    else:
        assert z is None
    ours = np.asarray(reference.dequantize_nbits(bq, s, z, bits=bits, block_size=block, dtype=dtype))
    lowering = np.asarray(lowering_dequantize(b_quant, scales, packed, k=k, n=n, bits=bits,
                                              block_size=block, dtype=dtype)).T
    np.testing.assert_array_equal(ours, lowering)  # the same values, bit for bit
    np.testing.assert_array_equal(ours.astype(np.float64), w)
    # 2-D scales, 3-D b_quant: the same result.
    bq2, s2, z2 = ops.prepare_nbits(b_quant, scales.reshape(n, -1), packed, k=k, n=n, bits=bits,
                                    block_size=block)
    np.testing.assert_array_equal(bq2, bq)
    np.testing.assert_array_equal(s2, s)


def test_prepare_nbits_rejects_what_the_kernels_do_not_take():
    rng = np.random.default_rng(0)
    b_quant, scales, packed, _, _ = _quantized(rng, 8, 64, 4, 32, zp=True)
    with pytest.raises(NotImplementedError, match="zero_points of dtype float32"):
        ops.prepare_nbits(b_quant, scales, np.zeros(16, np.float32), k=64, n=8, bits=4, block_size=32)
    with pytest.raises(NotImplementedError, match="not a multiple of block_size"):
        ops.prepare_nbits(b_quant, scales, packed, k=60, n=8, bits=4, block_size=32)
    with pytest.raises(NotImplementedError, match="bits=2"):
        ops.prepare_nbits(b_quant, scales, None, k=64, n=8, bits=2, block_size=32)
    with pytest.raises(ValueError, match="block_size must be a power of two"):
        ops.prepare_nbits(b_quant, scales, None, k=64, n=8, bits=4, block_size=24)
    with pytest.raises(ValueError, match="b_quant must be uint8"):
        ops.prepare_nbits(b_quant[:4], scales, None, k=64, n=8, bits=4, block_size=32)
    with pytest.raises(ValueError, match="scales must have"):
        ops.prepare_nbits(b_quant, scales[:3], None, k=64, n=8, bits=4, block_size=32)
    with pytest.raises(ValueError, match="scales must be float"):
        ops.prepare_nbits(b_quant, scales.astype(np.int32), None, k=64, n=8, bits=4, block_size=32)
    with pytest.raises(ValueError, match="zero_points must be uint8"):
        ops.prepare_nbits(b_quant, scales, packed[:3], k=64, n=8, bits=4, block_size=32)
    with pytest.raises(ValueError, match="K and N must be positive"):
        ops.prepare_nbits(b_quant, scales, None, k=0, n=8, bits=4, block_size=32)


def _ort_matmul_nbits(x, b_quant, scales, packed_zp, bias, *, k, n, bits, block):
    inputs = [helper.make_tensor_value_info("A", TensorProto.FLOAT, list(x.shape))]
    inits = [helper.make_tensor("B", TensorProto.UINT8, list(b_quant.shape), b_quant.tobytes(), raw=True),
             helper.make_tensor("scales", TensorProto.FLOAT, list(scales.shape), scales.tobytes(), raw=True)]
    names = ["A", "B", "scales"]
    names.append("zero_points" if packed_zp is not None else "")
    if packed_zp is not None:
        inits.append(helper.make_tensor("zero_points", TensorProto.UINT8, list(packed_zp.shape),
                                        packed_zp.tobytes(), raw=True))
    if bias is not None:
        names += ["", "bias"]  # g_idx absent
        inits.append(helper.make_tensor("bias", TensorProto.FLOAT, list(bias.shape), bias.tobytes(), raw=True))
    while names and names[-1] == "":
        names.pop()
    node = helper.make_node("MatMulNBits", names, ["Y"], domain="com.microsoft", K=k, N=n, bits=bits,
                            block_size=block)
    graph = helper.make_graph([node], "g", inputs,
                              [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, {"A": x})[0]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("with_bias", [False, True], ids=["nobias", "bias"])
def test_matmul_nbits_matches_onnxruntime(bits, block, zp, with_bias):
    rng = np.random.default_rng(bits + block + zp)
    n, k = 40, 2 * block
    b_quant, scales, packed, _, _ = _quantized(rng, n, k, bits, block, zp=zp)
    x = _rand(rng, (3, k), np.float32)
    bias = _rand(rng, (n,), np.float32) if with_bias else None
    want = _ort_matmul_nbits(x, b_quant, scales, packed, bias, k=k, n=n, bits=bits, block=block)
    bq, s, z = ops.prepare_nbits(b_quant, scales, packed, k=k, n=n, bits=bits, block_size=block)
    got = jax.jit(lambda x: ops.matmul_nbits(x, bq, s, z, bias, k=k, n=n, bits=bits,
                                             block_size=block))(x)  # auto: the reference on CPU
    assert_close(got, want, np.float32)


@pytest.mark.parametrize("dtype", [np.float16, BF16], ids=lambda d: np.dtype(d).name)
def test_matmul_nbits_fusions_equal_linear_on_the_dequantized_weight(dtype):
    rng = np.random.default_rng(3)
    n, k, block = 32, 64, 32
    b_quant, scales, packed, _, _ = _quantized(rng, n, k, 4, block, zp=True, dtype=dtype)
    bq, s, z = ops.prepare_nbits(b_quant, scales, packed, k=k, n=n, bits=4, block_size=block)
    w = reference.dequantize_nbits(bq, s, z, bits=4, block_size=block, dtype=dtype)
    x = _rand(rng, (2, k), dtype)
    kw = dict(bias=_rand(rng, (n,), dtype), residual=_rand(rng, (2, n // 2), dtype),
              norm_weight=_rand(rng, (k,), dtype), gated=True, backend="reference")
    got = ops.matmul_nbits(x, bq, s, z, k=k, n=n, bits=4, block_size=block, **kw)
    want = ops.linear(x, w, **kw)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


# --- validation ---------------------------------------------------------------------------------

def _nb(n=16, k=64, bits=4, block=32):
    return (np.zeros((n, k // block, block * bits // 8), np.uint8), np.ones((n, k // block), np.float16),
            None)


@pytest.mark.parametrize("call, exc, match", [
    (lambda: ops.linear(np.ones((2, 12), np.float16), np.ones((8, 12), np.float16)), ValueError,
     "x: K=12 must be a positive multiple of 8"),
    (lambda: ops.linear(np.ones((2, 16), np.int32), np.ones((8, 16), np.int32)), TypeError, "linear: x must be"),
    (lambda: ops.linear(np.ones((), np.float16), np.ones((8, 16), np.float16)), ValueError, "got a scalar"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 24), np.float16)), ValueError,
     "w must be \\[N, K\\] with x's K=16"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float32)), TypeError,
     "w must have x's dtype"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((12, 16), np.float16)), ValueError,
     "w: N=12 must be a multiple of 8"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float16), gated=True),
     ValueError, "w: N=8 must be a multiple of 16"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float16), np.ones(4, np.float16)),
     ValueError, "bias must have shape \\[8\\]"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float16), np.ones(8, np.float32)),
     TypeError, "bias must have x's dtype"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((16, 16), np.float16), gated=True,
                        residual=np.ones((2, 16), np.float16)), ValueError, "residual must have shape \\[2, 8\\]"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float16),
                        norm_weight=np.ones(8, np.float16)), ValueError, "norm_weight must have shape \\[16\\]"),
    (lambda: ops.linear(np.ones((2, 16), np.float16), np.ones((8, 16), np.float16), backend="gpu"),
     ValueError, "backend must be one of"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb(), k=64, n=16, bits=2, block_size=32),
     NotImplementedError, "bits=2"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb(), k=64, n=16, bits=4, block_size=48),
     ValueError, "block_size must be a power of two"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb(), k=32, n=16, bits=4, block_size=32),
     ValueError, "x: K=64 differs from the attribute k=32"),
    (lambda: ops.matmul_nbits(np.ones((2, 48), np.float16), *_nb(k=64), k=48, n=16, bits=4, block_size=32),
     ValueError, "k=48 is not a multiple of block_size=32"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb(bits=8), k=64, n=16, bits=4, block_size=32),
     ValueError, "b_quant must be uint8 \\[16, 2, 16\\]"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), _nb()[0], np.ones((16, 4), np.float16),
                              k=64, n=16, bits=4, block_size=32), ValueError, "scales must be \\[16, 2\\]"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), _nb()[0], np.ones((2, 2, 16), np.float16),
                              k=64, n=16, bits=4, block_size=32), ValueError, "or tiled \\[1, 2, 16\\]"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), _nb()[0], np.ones((1, 2, 16), np.float16),
                              np.ones((16, 2), np.uint8), k=64, n=16, bits=4, block_size=32), ValueError,
     "zero_points must be uint8 in scales' layout \\[1, 2, 16\\]"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), _nb()[0], np.ones((16, 2), np.float32),
                              k=64, n=16, bits=4, block_size=32), TypeError, "scales must have x's dtype"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb()[:2], np.ones((16, 2), np.float16),
                              k=64, n=16, bits=4, block_size=32), ValueError, "zero_points must be uint8 in scales' layout \\[16, 2\\]"),
    (lambda: ops.matmul_nbits(np.ones((2, 64), np.float16), *_nb(n=8), k=64, n=8, bits=4, block_size=32,
                              gated=True), ValueError, "b_quant: N=8 must be a multiple of 16"),
    (lambda: ops.interleave_gate_up(np.ones((8, 2)), np.ones((16, 2))), ValueError, "differ"),
    (lambda: ops.interleave_gate_up(np.ones((12, 2)), np.ones((12, 2))), ValueError, "multiple of 8 rows"),
    (lambda: ops.deinterleave_gate_up(np.ones((8, 2))), ValueError, "multiple of 16 rows"),
    (lambda: ops.interleave_gate_up_nbits(_nb(), (_nb()[0], _nb()[1], np.zeros((16, 2), np.uint8))),
     ValueError, "both or neither"),
])
def test_validation_errors_name_the_input(call, exc, match):
    with pytest.raises(exc, match=match):
        call()


def test_cuda_backend_refuses_what_the_kernels_do_not_take():
    x = np.ones((33, 16), np.float16)  # M = 33 > 32
    with pytest.raises(NotImplementedError, match="1 to 32 rows"):
        ops.linear(x, np.ones((8, 16), np.float16), backend="cuda")
    with pytest.raises(NotImplementedError, match="float32"):
        ops.linear(np.ones((2, 16), np.float32), np.ones((8, 16), np.float32), backend="cuda")
    bq, s, _ = _nb(k=64, bits=4, block=16)
    with pytest.raises(NotImplementedError, match="block_size 16 with 4-bit weights"):
        ops.matmul_nbits(np.ones((2, 64), np.float16), bq, s, k=64, n=16, bits=4, block_size=16,
                         backend="cuda")
    # "auto" runs those on the reference.
    got = ops.linear(x, np.ones((8, 16), np.float16))
    assert got.shape == (33, 8) and float(got[0, 0]) == 16.0
    assert ops.linear(np.ones((0, 16), np.float16), np.ones((8, 16), np.float16)).shape == (0, 8)


@pytest.mark.skipif(not build_info()["cuda"], reason="without a CUDA build 'auto' is the reference alone")
def test_auto_backend_on_cpu_computes_the_reference_through_platform_dependent():
    # With a CUDA build "auto" traces both branches (lax.platform_dependent); on the CPU the
    # reference runs.
    rng = np.random.default_rng(0)
    x, w = _rand(rng, (4, 32), np.float16), _rand(rng, (16, 32), np.float16)
    got = jax.jit(lambda x, w: ops.linear(x, w))(x, w)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(ops.linear(x, w, backend="reference")))


# --- the plan -----------------------------------------------------------------------------------

MODEL_SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (4096, 6144), (4096, 4096),
                (4096, 28672), (14336, 4096), (2048, 128256)]


def _plan(*a, **kw):
    try:
        return cuda_matmul.gemv_plan(*a, **kw)
    except RuntimeError as e:
        pytest.skip(str(e))


@pytest.mark.parametrize("k, n", MODEL_SHAPES, ids=str)
@pytest.mark.parametrize("bits, wide", [(16, False), (8, False), (4, False), (8, True), (4, True)])
def test_plan_covers_the_model_shapes(k, n, bits, wide):
    for m in (1, 2, 3, 8, 16, 32):
        for gated, norm in ((False, False), (True, True)):
            p = _plan(m, n, k, bits, gated, norm, wide=wide)
            assert p["wide"] == wide
            assert p["error"] is None, p
            assert p["nt"] == (1 if m <= 8 else 2 if m <= 16 else 4)
            assert p["grid"] == p["groups"] * p["cluster"] and p["groups"] <= p["blocks"]
            assert p["blocks"] * p["rows_block"] >= n and p["warps_n"] * p["warps_k"] == 8
            assert p["cluster"] * p["warps_k"] * p["cpp"] >= p["kc"] == -(-k // p["chunk_k"])
            assert p["waves"] * p["groups"] >= p["blocks"]
            assert 2 <= p["stages"] <= 8
            assert p["smem_bytes"] <= (115712 if p["ctas_per_sm"] == 2 else 232448)
            assert p["x_bytes"] >= m * p["slice_chunks"] * p["chunk_k"] * 2
            assert p == _plan(m, n, k, bits, gated, norm, wide=wide)  # a pure function of the shape


def test_plan_overrides_and_refusals():
    p = _plan(8, 4096, 4096, 16, False, cluster=4, warps_k=2)
    assert not p["norm"] and _plan(8, 4096, 4096, 16, False, True)["norm"]
    assert p["error"] is None and p["cluster"] == 4 and p["warps_k"] == 2 and p["warps_n"] == 4
    assert "1 to 32 rows" in _plan(33, 64, 64, 16, False)["error"]
    assert "multiple of 8" in _plan(1, 64, 60, 16, False)["error"]
    assert "multiple of 16" in _plan(1, 24, 64, 16, True)["error"]
    assert "power of two" in _plan(1, 64, 64, 16, False, cluster=3)["error"]
    assert "warps_k" in _plan(1, 64, 64, 16, False, warps_k=3)["error"]
    assert "bits" in _plan(1, 64, 64, 2, False)["error"]


def test_nbits_wide_is_chosen_by_the_environment_default_on(monkeypatch):
    monkeypatch.delenv(cuda_matmul.NBITS_WIDE_ENV, raising=False)
    assert cuda_matmul.nbits_wide()
    p = _plan(1, 2048, 2048, 4, False)
    assert p["wide"] and p["chunk_k"] == 256 and p["pieces"] == 2
    monkeypatch.setenv(cuda_matmul.NBITS_WIDE_ENV, "0")
    assert not cuda_matmul.nbits_wide()
    assert not _plan(1, 2048, 2048, 4, False)["wide"]
    monkeypatch.setenv(cuda_matmul.NBITS_WIDE_ENV, "1")
    assert cuda_matmul.nbits_wide()
    assert not _plan(1, 2048, 2048, 4, False, wide=False)["wide"]  # an explicit choice wins
    assert not _plan(1, 2048, 2048, 16, False)["wide"]  # dense weights have one format
    # Blocks must hold a 16-byte piece in either format (32 int4 / 16 int8 elements).
    assert cuda_matmul.unsupported(1, 64, 256, 4, False, block_size=32) is None
    assert cuda_matmul.unsupported(1, 64, 256, 8, False, block_size=16) is None
    assert ">= 32" in cuda_matmul.unsupported(1, 64, 256, 4, False, block_size=16)
    monkeypatch.setenv(cuda_matmul.NBITS_WIDE_ENV, "yes")
    with pytest.raises(ValueError, match="JOA_GEMV_NBITS_WIDE"):
        cuda_matmul.nbits_wide()


@pytest.mark.parametrize("block", [32, 64, 128, 256, 512])
def test_plan_takes_the_slots_kernel_for_one_row_of_4bit_wide_weights(block):
    for k, n in MODEL_SHAPES:
        for gated, norm in ((False, False), (True, True), (False, True)):
            p = _plan(1, n, k, 4, gated, norm, wide=True, block_size=block, slots=True)
            assert p["error"] is None, p
            if not p["slots"]:
                # x and gamma, each twice (staged and as multicast), past two CTAs an SM.
                assert norm and 8 * k * 2 > 115712, (k, n, gated, norm)
                continue
            assert p["warps_k"] == 8 and p["cpp"] * 8 >= p["kc"] and p["blocks"] * 16 >= n
            assert p["grid"] % p["cluster"] == 0 and p["cluster"] in (1, 2) and p["grid"] <= 264
            assert p["smem_bytes"] <= 115712  # two CTAs an SM
            assert p == _plan(1, n, k, 4, gated, norm, wide=True, block_size=block, slots=True)
    # Anything else keeps the ring kernel: more rows, 8 bits, the one-piece format, blocks the
    # slots kernel does not take, a forced layout, or slots off.
    for args, kw in (((2, 2048, 2048, 4, False), dict(wide=True, block_size=32)),
                     ((1, 2048, 2048, 8, False), dict(wide=True, block_size=32)),
                     ((1, 2048, 2048, 4, False), dict(wide=False, block_size=32)),
                     ((1, 2048, 2048, 4, False), dict(wide=True, block_size=16)),
                     ((1, 2048, 2048, 4, False), dict(wide=True, block_size=32, cluster=1)),
                     ((1, 2048, 2048, 4, False), dict(wide=True, block_size=32, warps_k=8))):
        p = _plan(*args, slots=True, **kw)
        assert p["error"] is None and not p["slots"], (args, kw)
    assert not _plan(1, 2048, 2048, 4, False, wide=True, block_size=32)["slots"]


@pytest.mark.parametrize("env, enabled", [(cuda_matmul.SLOTS_ENV, cuda_matmul.slots_enabled),
                                          (cuda_matmul.DENSE_ROW_ENV, cuda_matmul.dense_row_enabled)],
                         ids=["slots", "dense_row"])
def test_one_row_kernels_are_chosen_by_the_environment_default_on(env, enabled, monkeypatch):
    monkeypatch.delenv(env, raising=False)
    assert enabled()
    monkeypatch.setenv(env, "0")
    assert not enabled()
    monkeypatch.setenv(env, "on")
    with pytest.raises(ValueError, match=env):
        enabled()


def test_plan_takes_the_dense_row_kernel_for_one_row_of_dense_weights():
    for k, n in MODEL_SHAPES:
        for gated, norm in ((False, False), (True, True), (False, True)):
            p = _plan(1, n, k, 16, gated, norm, slots=True)
            assert p["error"] is None and p["dense_row"] and not p["slots"], p
            assert p["warps_k"] == 8 and p["cpp"] * 8 == p["kc"] == k // 64 and p["blocks"] * 16 == n
            assert p["cluster"] == 1 and p["grid"] == min(p["blocks"], 264) and p["rows_block"] == 16
            # x, a zero unit, two sets of 8 warps' 16 partial row sums, the norm's warp sums.
            assert p["smem_bytes"] == 2 * k + 16 + 2 * 8 * 16 * 4 + 8 * 4 <= 115712
            assert p == _plan(1, n, k, 16, gated, norm, slots=True)
    # Anything else keeps the ring kernel: more rows, K not a multiple of 512, N not of 16, a
    # forced layout, the switch off, n-bit weights.
    for args, kw in (((2, 2048, 2048, 16, False), {}), ((1, 2048, 2304, 16, False), {}),
                     ((1, 2056, 2048, 16, False), {}), ((1, 2048, 2048, 16, False), dict(cluster=1)),
                     ((1, 2048, 2048, 16, False), dict(warps_k=8)),
                     ((1, 2048, 2048, 4, False), dict(wide=True, block_size=32))):
        p = _plan(*args, slots=True, **kw)
        assert p["error"] is None and not p["dense_row"], (args, kw)
    assert not _plan(1, 2048, 2048, 16, False)["dense_row"]


# --- NumPy emulation of the kernel's index maps --------------------------------------------------
#
# A faithful model of one warp of GemvKernel (ffi/kernels/gemv/kernel.cuh): the bytes each lane
# copies (weights.cuh Issue), the A fragments Fragments() builds from them with the same magic
# numbers, the x staging (stage.cuh) and the B fragments read from it, mma.m16n8k16's fragment
# semantics, and the accumulator -> reduction buffer -> epilogue unit maps.

def _prmt(a, b, sel):
    """PTX prmt.b32 (default mode) on Python ints."""
    data = a | (b << 32)
    out = 0
    for i in range(4):
        out |= ((data >> (8 * ((sel >> (4 * i)) & 7))) & 0xFF) << (8 * i)
    return out


def _pair(word, dtype):
    """A 32-bit register as (low, high) 16-bit floats, as float64."""
    return np.array([word & 0xFFFF, word >> 16], np.uint16).view(dtype).astype(np.float64)


def _bits16(v, dtype):
    return int(np.array([v], np.float64).astype(dtype).view(np.uint16)[0])


def _word(lo, hi, dtype):
    """Round two floats to dtype (each once) and pack them like the kernel's half2 registers."""
    return _bits16(lo, dtype) | (_bits16(hi, dtype) << 16)


def _sub_mul(a, b, s, dtype):
    """SubMul: (a - b) rounded, times s rounded (a - b is exact here)."""
    pa, pb, ps = _pair(a, dtype), _pair(b, dtype), _pair(s, dtype)
    d = (pa - pb).astype(dtype).astype(np.float64)
    r = (d * ps).astype(dtype)
    return _word(r[0], r[1], dtype)


def _fragments(chunk, q, bits, dtype):
    """NbitsWeights / DenseWeights::Fragments of quad q of one Read: a[2][4] 32-bit registers.
    chunk: {"w": [row g's words, row g + 8's], "scale": [2], "zero": [2]} of the read (dense: both
    pieces, 8 words a row; n-bit: one 16-byte piece, quad q of it)."""
    a = [[0] * 4 for _ in range(2)]
    if bits == 16:
        w0, w1 = (w[4 * q:4 * q + 4] for w in chunk["w"])
        a[0] = [w0[0], w1[0], w0[1], w1[1]]
        a[1] = [w0[2], w1[2], w0[3], w1[3]]
        return a
    for h in range(2):
        s2 = chunk["scale"][h] | (chunk["scale"][h] << 16)
        z = chunk["zero"][h]
        w4 = chunk["w"][h]
        if bits == 4:
            v = w4[q]
            if dtype == np.float16:
                sub = (0x6400 | z) * 0x10001
                add = (0xD400 | (z << 4)) * 0x10001
                v8 = v >> 8

                def lop(x, mask):
                    return (x & mask) | 0x64006400

                def fma16(x):
                    r = (_pair(x, np.float16) * 0.0625 + _pair(add, np.float16)).astype(np.float16)
                    return _word(r[0], r[1], np.float16)
                raw = [_sub_mul(lop(v, 0x000F000F), sub, 0x3C003C00, dtype),
                       fma16(lop(v, 0x00F000F0)),
                       _sub_mul(lop(v8, 0x000F000F), sub, 0x3C003C00, dtype),
                       fma16(lop(v8, 0x00F000F0))]
                pr = []
                for r in raw:
                    m = (_pair(r, np.float16) * _pair(s2, np.float16)).astype(np.float16)
                    pr.append(_word(m[0], m[1], np.float16))
            else:
                sub = (0x4300 | z) * 0x10001
                pr = [_sub_mul(((v >> (4 * i)) & 0x000F000F) | 0x43004300, sub, s2, dtype)
                      for i in range(4)]
            a[0][h], a[0][2 + h], a[1][h], a[1][2 + h] = pr
        else:
            for s in range(2):
                v = w4[2 * q + s]
                if dtype == np.float16:
                    sub = (0x6400 | z) * 0x10001
                    a[s][h] = _sub_mul(_prmt(v, 0x64646464, 0x4140), sub, s2, dtype)
                    a[s][2 + h] = _sub_mul(_prmt(v, 0x64646464, 0x4342), sub, s2, dtype)
                else:
                    zf = np.float32(8388608.0 + z)
                    sf = np.array([chunk["scale"][h] << 16], np.uint32).view(np.float32)[0]
                    f = [np.float32(np.float32(np.array([_prmt(v, 0x4B000000, 0x7440 + e)],
                                                        np.uint32).view(np.float32)[0]) - zf) * sf
                         for e in range(4)]
                    a[s][h] = _word(f[0], f[1], dtype)
                    a[s][2 + h] = _word(f[2], f[3], dtype)
    return a


def _words(b16):
    """16 bytes -> 4 little-endian 32-bit words."""
    return [int(x) for x in np.frombuffer(bytes(b16), np.uint32)]


def _mma(acc, a, b0, b1, dtype):
    """mma.m16n8k16.row.col: acc[lane][4] += A (16 x 16) B (16 x 8) from all lanes' fragments."""
    A = np.zeros((16, 16))
    B = np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]):
            A[row, col:col + 2] = _pair(a[lane][reg], dtype)
        B[2 * t:2 * t + 2, g] = _pair(b0[lane], dtype)
        B[2 * t + 8:2 * t + 10, g] = _pair(b1[lane], dtype)
    D = A @ B
    for lane in range(32):
        g, t = lane // 4, lane % 4
        acc[lane] += np.array([D[g, 2 * t], D[g, 2 * t + 1], D[g + 8, 2 * t], D[g + 8, 2 * t + 1]])


@pytest.mark.parametrize("k", [512, 1024])
def test_dense_row_kernel_index_maps_give_x_w(k):
    """ffi/kernels/gemv/dense_row.cuh's maps, one tile, on the register words: each warp's loads
    (rows g/2 + {0, 8, 4, 12}, 16 bytes at k = 64 s + 32 (g & 1) + 8 t), the loaded words as A
    fragments, lanes 0-7's x units as B columns 0 / 1 (the rest zeros), the row sum from lanes
    (g, 0) and (g ^ 1, 0) and the reduction slot it goes to: the 16 sums are exactly W x."""
    dtype = np.float16
    rng = np.random.default_rng(0)
    w = rng.integers(-8, 8, (16, k)).astype(dtype)
    x = rng.integers(-8, 8, k).astype(dtype)
    warps, nsteps = 8, k // 512
    red = np.zeros((warps, 16))
    for wk in range(warps):
        acc = np.zeros((2, 2, 32, 4))
        for s in range(nsteps):
            k0 = (wk * nsteps + s) * 64
            xw = [_words(x[k0 + 8 * lane:k0 + 8 * lane + 8].tobytes()) if lane < 8 else [0] * 4
                  for lane in range(32)]
            for rg in range(2):
                lo, hi = [], []
                for lane in range(32):
                    g, t = lane >> 2, lane & 3
                    at = k0 + 32 * (g & 1) + 8 * t
                    lo.append(_words(w[(g >> 1) + 4 * rg, at:at + 8].tobytes()))
                    hi.append(_words(w[(g >> 1) + 4 * rg + 8, at:at + 8].tobytes()))
                for chain, (i0, i1) in enumerate(((0, 1), (2, 3))):
                    a = [[lo[ln][i0], hi[ln][i0], lo[ln][i1], hi[ln][i1]] for ln in range(32)]
                    _mma(acc[rg, chain], a, [xw[ln][i0] for ln in range(32)], [xw[ln][i1] for ln in range(32)],
                         dtype)
        for rg in range(2):
            for h in range(2):
                c0 = acc[rg, 0, :, 2 * h] + acc[rg, 1, :, 2 * h]
                c1 = acc[rg, 0, :, 2 * h + 1] + acc[rg, 1, :, 2 * h + 1]
                v = np.where((np.arange(32) >> 2) & 1, c1, c0)
                v = v + v[np.arange(32) ^ 4]  # __shfl_xor_sync(v, 4)
                for lane in range(0, 32, 8):  # t == 0, g even
                    red[wk, (lane >> 3) + 4 * rg + 8 * h] = v[lane]
    np.testing.assert_array_equal(red.sum(axis=0), w.astype(np.float64) @ x.astype(np.float64))


def _quad_k(plan, q):
    """plan.h's QuadK: the K offset of quad q of a lane from the lane's first element."""
    per_piece = plan["quads"] // plan["pieces"]
    return plan["piece_stride"] * (q // per_piece) + plan["quad_stride"] * (q % per_piece)


def _emulate_tile(x, w_bytes, row_bytes, scales, zeros, bits, block, plan, dtype, row0):
    """One warp over rows row0 .. row0 + 15 and all of K: its accumulators, acc[n8 tile][lane][4]."""
    m, k = x.shape
    quads, chunk_k = plan["quads"], plan["chunk_k"]
    lane_stride, pieces, piece_stride = plan["lane_stride"], plan["pieces"], plan["piece_stride"]
    # Read() calls per chunk (weights.cuh kReads): dense one (both pieces), n-bit one per piece.
    reads = 1 if bits == 16 else pieces
    read_quads = quads // reads
    nt = plan["nt"]
    kc = -(-k // chunk_k)
    n_rows = w_bytes.shape[0]
    # x staging (stage.cuh): unit u = ((c * quads + q) * M + mr) * 4 + t, the whole K as one slice.
    units = {}
    xb = x.view(np.uint16)
    for c in range(kc):
        for q in range(quads):
            for mr in range(m):
                for t in range(4):
                    kk = c * chunk_k + lane_stride * t + _quad_k(plan, q)
                    vals = xb[mr, kk:kk + 8] if kk < k else np.zeros(8, np.uint16)
                    if bits == 4:
                        vals = vals[[0, 4, 1, 5, 2, 6, 3, 7]]
                    units[((c * quads + q) * m + mr) * 4 + t] = [int(v) for v in
                                                                vals.view(np.uint32)]
    acc = np.zeros((nt, 32, 4))
    for c in range(kc):
        chunks = []  # chunks[lane][read]
        for lane in range(32):
            g, t = lane // 4, lane % 4
            kk0 = c * chunk_k + lane_stride * t
            lane_reads = [{"w": [[], []], "scale": [], "zero": []} for _ in range(reads)]
            for pc in range(pieces):
                # Piece pc of the lane: elements kk .. kk + 128 / bits - 1 (64 pc + 16 t bytes into
                # the chunk's run of each row); a piece past K or N lands as zeros.
                kk = kk0 + piece_stride * pc
                ch = lane_reads[pc if reads > 1 else 0]
                for h in range(2):
                    r = row0 + g + 8 * h
                    valid = r < n_rows and kk < k
                    # Issue(): dense pieces at element QuadK, n-bit ones 64 bytes apart.
                    off = kk * 2 if bits == 16 else kk0 * bits // 8 + 64 * pc
                    piece = w_bytes[r, off:off + 16] if valid else np.zeros(16, np.uint8)
                    ch["w"][h] += _words(piece)
                    if bits != 16:
                        blk = kk // block  # each piece has its own block (wide: maybe another)
                        ch["scale"].append(int(scales[r, blk].view(np.uint16)) if valid else 0)
                        # Read(): the copied zero-point word, zero-filled for an invalid piece.
                        ch["zero"].append(1 << (bits - 1) if zeros is None else
                                          int(zeros[r, blk]) if valid else 0)
            chunks.append(lane_reads)
        for q in range(quads):
            frags = [_fragments(chunks[lane][q // read_quads], q % read_quads, bits, dtype)
                     for lane in range(32)]
            for n in range(nt):
                xv = [units[((c * quads + q) * m + min(8 * n + lane // 4, m - 1)) * 4 + lane % 4]
                      for lane in range(32)]
                for s in range(2):
                    _mma(acc[n], [f[s] for f in frags], [v[2 * s] for v in xv],
                         [v[2 * s + 1] for v in xv], dtype)
    return acc


def _emulate(x, w_bytes, scales, zeros, bits, block, dtype, gated, warps_n, wide=False):
    """The whole output through the reduction buffer and the epilogue units (one CTA, warps_k 1)."""
    m, k = x.shape
    n_rows = w_bytes.shape[0]
    plan = _plan(m, n_rows, k, bits, gated, wide=wide)
    assert plan["wide"] == (wide and bits != 16)
    rows_block = 16 * warps_n
    rs = rows_block + 4
    n_out = n_rows // 2 if gated else n_rows
    y = np.full((m, n_out), np.nan)
    for block_i in range(-(-n_rows // rows_block)):
        red = np.full((m, rs), np.nan)
        for wn in range(warps_n):
            acc = _emulate_tile(x, w_bytes, None, scales, zeros, bits, block, plan, dtype,
                                block_i * rows_block + wn * 16)
            for n in range(plan["nt"]):
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    for e in range(2):
                        mm = 8 * n + 2 * t + e
                        if mm < m:
                            red[mm, wn * 16 + g] = acc[n][lane][e]
                            red[mm, wn * 16 + g + 8] = acc[n][lane][2 + e]
        out_cols = rows_block // 2 if gated else rows_block
        for unit in range(m * (out_cols // 8)):
            mm, oc = unit // (out_cols // 8), (unit % (out_cols // 8)) * 8
            if gated:
                o0 = block_i * out_cols + oc
                if o0 >= n_out:
                    continue
                gv = _round(red[mm, 2 * oc:2 * oc + 8], dtype)
                uv = _round(red[mm, 2 * oc + 8:2 * oc + 16], dtype)
                y[mm, o0:o0 + 8] = _round(_silu(gv) * uv, dtype)
            else:
                n0 = block_i * rows_block + oc
                if n0 >= n_out:
                    continue
                y[mm, n0:n0 + 8] = _round(red[mm, oc:oc + 8], dtype)
    return y


@pytest.mark.parametrize("bits, wide", [(16, 0), (8, 0), (8, 1), (4, 0), (4, 1)])
def test_formats_cover_each_chunk_once_in_64_byte_runs(bits, wide):
    # plan.h's FormatInfo: the quads of the 4 lanes tile a chunk's K once; quad q of a lane is the
    # 8 elements 8 (q % per-piece quads) into its piece q / per-piece quads (what Fragments() reads
    # from the piece's words); a warp's copy instruction for piece pc reads bytes 64 pc .. 64 pc + 63
    # of each row's chunk run (whole 64-byte runs of 8 rows, as Issue() places them).
    p = _plan(1, 64, 4096, bits, False, wide=bool(wide))
    assert p["wide"] == bool(wide and bits != 16)
    assert p["lane_k"] == 8 * p["quads"] and p["chunk_k"] == 4 * p["lane_k"]
    assert p["pieces"] == (2 if bits == 16 or wide else 1) and p["lane_stride"] == 128 // bits
    per_piece = p["quads"] // p["pieces"]
    ks = sorted(p["lane_stride"] * t + _quad_k(p, q) + j
                for t in range(4) for q in range(p["quads"]) for j in range(8))
    assert ks == list(range(p["chunk_k"]))
    for q in range(p["quads"]):
        assert _quad_k(p, q) == p["piece_stride"] * (q // per_piece) + 8 * (q % per_piece)
    for pc in range(p["pieces"]):
        starts = [(p["lane_stride"] * t + p["piece_stride"] * pc) * bits // 8 for t in range(4)]
        assert starts == [64 * pc + 16 * t for t in range(4)]
    # A ring slot: the chunk's W (2 KB with two pieces) and, n-bit, its scales and zero points
    # (32 + 16 bytes for each of up to chunk_k / piece_k blocks; 512 reserved with one piece).
    w_bytes = 1024 * p["pieces"]
    assert p["stage_bytes"] == w_bytes + (0 if bits == 16 else 48 * 8 if wide else 512)


@pytest.mark.parametrize("bits, wide", [(4, 0), (4, 1), (8, 0), (8, 1)])
@pytest.mark.parametrize("block", [16, 32, 64, 128, 256, 512])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_ring_slot_scales_and_zero_points(bits, wide, block, zp):
    # NbitsWeights' slot layout: MakeLane() / Issue() copy 16 bytes of the tile's scales or zero
    # points a lane (lanes 0 .. 2 nb - 1: half a block's scales, 2 nb .. 3 nb - 1: a block's zero
    # points; past k_blocks or N: zeros) after the chunk's W; Read() finds row g / g + 8's scale and
    # zero point of each piece's block at kScalesAt + 2 u (+ 16) and kScalesAt + 32 nb + u (+ 8),
    # u = 16 j + g. Emulated byte for byte against the row-major values.
    if block < 128 // bits:
        pytest.skip("blocks must hold a 16-byte piece")
    p = _plan(1, 64, 4096, bits, False, wide=bool(wide))
    chunk_k, pieces = p["chunk_k"], p["pieces"]
    shift = block.bit_length() - 1
    k = 3 * max(block, chunk_k) + block  # ragged: the last chunk has blocks past K
    n, kb = 40, k // block  # the third row tile is half empty
    rng = np.random.default_rng(block + bits + wide)
    scales = rng.uniform(0.5, 1.5, (n, kb)).astype(np.float16)
    zeros = rng.integers(0, 1 << bits, (n, kb), dtype=np.uint8) if zp else None
    st = ops.tile_nbits_meta(scales).view(np.uint8).reshape(-1)
    zt = ops.tile_nbits_meta(zeros).reshape(-1) if zp else None
    scales_at = 1024 * pieces
    nb = max(1, chunk_k >> shift)
    assert 3 * nb <= 32 and scales_at + 48 * nb <= p["stage_bytes"]
    for tile in range(-(-n // 16)):
        for c in range(-(-k // chunk_k)):
            slot = np.full(p["stage_bytes"], 0xAB, np.uint8)  # what no copy writes stays poison
            for lane in range(32):
                if lane < 2 * nb:
                    meta_b, zp_lane, half = lane >> 1, False, (lane & 1) * 16
                elif zp and lane < 3 * nb:
                    meta_b, zp_lane, half = lane - 2 * nb, True, 0
                else:
                    continue
                b = ((c * chunk_k) >> shift) + meta_b
                valid = tile * 16 < n and b < kb
                rec = tile * kb + b
                src = (zt[rec * 16:rec * 16 + 16] if zp_lane else st[rec * 32 + half:rec * 32 + half + 16])
                slot[scales_at + 16 * lane:scales_at + 16 * lane + 16] = src if valid else 0
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for pc in range(pieces):
                    kk = c * chunk_k + p["lane_stride"] * t + p["piece_stride"] * pc
                    j = (p["lane_stride"] * t + p["piece_stride"] * pc) >> shift
                    assert j < nb and (kk >> shift) == ((c * chunk_k) >> shift) + j
                    u = 16 * j + g
                    for h in range(2):
                        r = 16 * tile + g + 8 * h
                        at = scales_at + 2 * u + 16 * h
                        got_s = slot[at:at + 2].view(np.float16)[0]
                        got_z = slot[scales_at + 32 * nb + u + 8 * h] if zp else 1 << (bits - 1)
                        if kk < k and r < n:
                            assert got_s == scales[r, kk >> shift], (tile, c, lane, pc, h)
                            assert got_z == (zeros[r, kk >> shift] if zp else 1 << (bits - 1))
                        else:  # a piece past K or a row past N: scale 0 (the product is 0)
                            assert got_s == 0


def test_weight_policies_run_on_the_host(tmp_path):
    # The emulations above model weights.cuh; this runs its own source. MakeLane / Issue / Read of
    # DenseWeights and NbitsWeights (4 / 8 bits, one or two pieces, blocks 16 .. 512, with and
    # without zero points, ragged K and N) compiled for the host with cp.async as a copy
    # (tests/host/gemv_weights_host.cpp): every lane's bytes, scales and zero points of every chunk
    # and row tile, no write past the slot, every copy source an aligned address in its buffer.
    import pathlib
    import shutil
    import subprocess

    cxx = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if cxx is None:
        pytest.skip("no host C++ compiler")
    root = pathlib.Path(__file__).resolve().parents[1]
    src = (root / "ffi/kernels/gemv/weights.cuh").read_text()
    start = src.find("// Dense T weights")
    assert start > 0, "weights.cuh: the policies' opening comment moved (see gemv_weights_host.cpp)"
    (tmp_path / "weights_policies.h").write_text("namespace joa::gemv {\n" + src[start:])
    exe = tmp_path / "gemv_weights_host"
    subprocess.run([cxx, "-std=c++17", "-O1", "-w", "-I", str(tmp_path), "-I", str(root / "ffi"),
                    str(root / "tests/host/gemv_weights_host.cpp"), "-o", str(exe)], check=True)
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "failures 0, bad copy sources 0" in run.stdout


@pytest.mark.parametrize("bits, dtype, wide",
                         [(16, np.float16, 0), (16, BF16, 0), (8, np.float16, 0), (8, BF16, 0),
                          (4, np.float16, 0), (4, BF16, 0), (8, np.float16, 1), (8, BF16, 1),
                          (4, np.float16, 1), (4, BF16, 1)],
                         ids=lambda v: str(v) if isinstance(v, int) else np.dtype(v).name)
@pytest.mark.parametrize("m", [1, 3, 11])
def test_kernel_index_maps_reproduce_the_product(bits, dtype, wide, m):
    rng = np.random.default_rng(bits * 10 + m)
    block = 32
    # K ends inside a chunk (lanes past K read zeros); wide: int4 160 = 128 + 32, int8 160 = 128 +
    # 32, so lane 0's second piece is in K and the others' are not (int4), or the last chunk's
    # first pieces are half in (int8); with block 32 each piece of a lane has its own scale and
    # zero point.
    k = {16: 72, 8: 160 if wide else 96, 4: 160}[bits]
    n = 24  # the second row tile is half empty
    x = _rand(rng, (m, k), dtype)
    zeros = scales = None
    if bits == 16:
        w = _rand(rng, (n, k), dtype, 1 / math.sqrt(k))
        w_bytes = np.ascontiguousarray(w).view(np.uint8).reshape(n, 2 * k)
        w_eff = w.astype(np.float64)
    else:
        b_quant, s_flat, packed, _, _ = _quantized(rng, n, k, bits, block, zp=True, dtype=dtype)
        b_quant, scales, zeros = ops.prepare_nbits(b_quant, s_flat, packed, k=k, n=n, bits=bits,
                                                   block_size=block)
        w_bytes = b_quant.reshape(n, -1)
        w_eff = np.asarray(reference.dequantize_nbits(b_quant, scales, zeros, bits=bits,
                                                      block_size=block, dtype=dtype)).astype(np.float64)
    got = _emulate(x, w_bytes, scales, zeros, bits, block, dtype, False, warps_n=2, wide=bool(wide))
    want = _round(x.astype(np.float64) @ w_eff.T, dtype)
    # The A fragments hold exactly the reference's dequantised values, so the only difference is
    # the order of the float64 sum: the same bits after rounding, but for a rare last-ulp tie.
    assert np.isfinite(got).all()
    np.testing.assert_allclose(got, want, rtol=1e-2 if dtype == BF16 else 2e-3, atol=1e-3)
    assert (got == want).mean() > 0.97


@pytest.mark.parametrize("bits, wide", [(16, 0), (4, 0), (4, 1)])
def test_kernel_gated_epilogue_maps_gate_and_up_rows(bits, wide):
    rng = np.random.default_rng(7)
    m, k, i, block = 2, 128, 16, 32
    dtype = np.float16
    x = _rand(rng, (m, k), dtype)
    if bits == 16:
        wg, wu = _rand(rng, (i, k), dtype, 0.2), _rand(rng, (i, k), dtype, 0.2)
        w = ops.interleave_gate_up(wg, wu)
        got = _emulate(x, w.view(np.uint8).reshape(2 * i, -1), None, None, 16, block, dtype, True, 1)
    else:
        parts = []
        for seed in (1, 2):
            bq, s, p, _, _ = _quantized(np.random.default_rng(seed), i, k, 4, block, zp=True, dtype=dtype)
            parts.append(ops.prepare_nbits(bq, s, p, k=k, n=i, bits=4, block_size=block))
        bq, s, z = ops.interleave_gate_up_nbits(*parts)
        got = _emulate(x, bq.reshape(2 * i, -1), s, z, 4, block, dtype, True, 1, wide=bool(wide))
        wg, wu = (np.asarray(reference.dequantize_nbits(*pp, bits=4, block_size=block, dtype=dtype))
                  for pp in parts)
    g = _round(x.astype(np.float64) @ wg.astype(np.float64).T, dtype)
    u = _round(x.astype(np.float64) @ wu.astype(np.float64).T, dtype)
    np.testing.assert_allclose(got, _round(_silu(g) * u, dtype), rtol=2e-3, atol=1e-3)


# --- the benchmark harness ----------------------------------------------------------------------

def test_bench_linear_times_the_xla_peers_on_cpu_and_writes_json(tmp_path, capsys):
    import json

    from jax_onnx_attn.bench import __main__ as bench_main
    from jax_onnx_attn.bench import linear as bench

    out = tmp_path / "linear.json"
    rc = bench_main.main(["linear", "--shapes", "64x32", "--rows", "1", "2", "--formats", "fp16",
                          "int4", "--target-ms", "2", "--reps", "2", "--plans", "1,8",
                          "--nbits-wide", "0", "1", "--out", str(out)])
    assert rc == 0
    doc = json.loads(out.read_text())
    assert doc["suite"] == "linear" and len(doc["results"]) == 4
    for res in doc["results"]:
        case = bench.Case(res["k"], res["n"], res["m"], res["fmt"])
        # Small weights: the most copies (past L2), one call each.
        assert res["bytes"] == case.bytes and res["rotations"] == case.rotations == bench.MAX_ROTATIONS
        assert res["calls"] == case.calls == bench.MAX_ROTATIONS
        lm_head = bench.Case(2048, 128256, 1, "int4")
        assert lm_head.calls == lm_head.rotations == bench.MIN_CALLS
        assert bench.Case(4096, 128256, 1, "fp16").rotations * (4096 * 128256 * 2) <= bench.MAX_COPY_BYTES
        assert res["impls"]["xla-kn"]["us"] > 0, res
        if res["fmt"] == "fp16":
            assert res["impls"]["xla-nk"]["us"] > 0
        assert "skip" in res["impls"]["ours"] and "skip" in res["impls"]["torch"]
        assert "skip" in res["impls"]["ours[wide]"] and res["wide"] is False
    assert doc["results"][2]["weight_bytes"] == 32 * 64 // 2 + 3 * 32 * 2  # int4 + scales + zp
    assert "ours and torch skipped" in capsys.readouterr().err


@pytest.mark.parametrize("n", [16, 24, 40])
def test_tiled_scales_and_zero_points(n):
    # tile_nbits_meta is a permutation with zero rows past N; matmul_nbits gives the same bits on
    # either layout (the reference un-tiles, the kernels tile row-major operands on the call).
    k, block = 64, 32
    rng = np.random.default_rng(n)
    bq = rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8)
    s = rng.uniform(0.5, 1.5, (n, k // block)).astype(np.float16)
    z = rng.integers(0, 16, (n, k // block), dtype=np.uint8)
    st, zt = ops.tile_nbits_meta(s), ops.tile_nbits_meta(z)
    assert st.shape == (-(-n // 16), k // block, 16) and zt.dtype == np.uint8
    np.testing.assert_array_equal(ops.untile_nbits_meta(st, n), s)
    np.testing.assert_array_equal(st[1 if n > 16 else 0, 1, 3], s[(16 if n > 16 else 0) + 3, 1])
    if n % 16:
        assert not st[-1, :, n % 16:].any() and not zt[-1, :, n % 16:].any()  # rows past N
    x = rng.standard_normal((3, k)).astype(np.float16)
    kw = dict(k=k, n=n, bits=4, block_size=block, backend="reference")
    np.testing.assert_array_equal(np.asarray(ops.matmul_nbits(x, bq, st, zt, **kw)),
                                  np.asarray(ops.matmul_nbits(x, bq, s, z, **kw)))


def test_issue_aware_layout_fills_the_sms_and_is_opt_in(monkeypatch):
    # The 1B gate-up projection: the stream model's plan runs one CTA of 8 warps an SM; counting
    # the busiest SM's instruction issue picks a layout with about two.
    monkeypatch.delenv(cuda_matmul.PLAN_MODEL_ENV, raising=False)
    assert cuda_matmul.plan_model() == "stream"
    stream = _plan(1, 16384, 2048, 4, True, norm=True, wide=True)
    cluster, warps_k = cuda_matmul.issue_aware_layout(1, 16384, 2048, 4, True, True, True)
    issue = _plan(1, 16384, 2048, 4, True, norm=True, cluster=cluster, warps_k=warps_k, wide=True)
    assert issue["error"] is None and issue["grid"] > stream["grid"] >= 128
    assert cuda_matmul.issue_estimate_us(issue) < cuda_matmul.issue_estimate_us(stream)
    # Every choice is a plan the engine takes, K split no finer than its chunks.
    for k, n in ((2048, 3072), (2048, 2048), (8192, 2048), (4096, 28672), (256, 64)):
        c, wk = cuda_matmul.issue_aware_layout(1, n, k, 4, False, False, True)
        p = _plan(1, n, k, 4, False, cluster=c, warps_k=wk, wide=True)
        assert p["error"] is None and c * wk <= p["kc"], (k, n, c, wk)
    monkeypatch.setenv(cuda_matmul.PLAN_MODEL_ENV, "fastest")
    with pytest.raises(ValueError, match="JOA_GEMV_PLAN_MODEL"):
        cuda_matmul.plan_model()


@pytest.mark.parametrize("fusion", ["plain", "gated_bias_residual_norm"])
def test_kn_weights_give_the_nk_results(fusion):
    # w_layout="kn": W stored [K, N] (gated: gate / up columns interleaved in blocks of 8) is the
    # same projection as its transpose [N, K], within the dtype's rounding (XLA sums the two GEMM
    # layouts in its own orders).
    rng = np.random.default_rng(4)
    k, n, m = 64, 48, 3
    x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
    w_nk = jnp.asarray(rng.standard_normal((n, k)) / 8, jnp.float16)
    kw = {}
    if fusion != "plain":
        kw = dict(gated=True, bias=jnp.asarray(rng.standard_normal(n), jnp.float16),
                  residual=jnp.asarray(rng.standard_normal((m, n // 2)), jnp.float16),
                  norm_weight=jnp.asarray(1 + rng.standard_normal(k) / 8, jnp.float16))
    want = ops.linear(x, w_nk, **kw)
    got = ops.linear(x, w_nk.T, w_layout="kn", **kw)
    assert got.shape == want.shape
    assert_close(np.asarray(got), np.asarray(want), np.float16)
    with pytest.raises(ValueError, match=r"w must be \[K, N\] with x's K=64"):
        ops.linear(x, w_nk, w_layout="kn")
    with pytest.raises(ValueError, match="w_layout"):
        ops.linear(x, w_nk, w_layout="tn")
