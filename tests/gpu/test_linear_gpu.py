"""The GEMV kernels (linear, matmul_nbits targets) on a GPU against the reference backend.

Dense and n-bit weights (n-bit in both formats: one or two 16-byte pieces a lane per chunk, `wide`)
over f16 / bf16 x M in {1, 2, 3, 8, 16, 32} x the 1B / 8B Llama projection
shapes, every fusion, forced plans (K split over warps and clusters of 1-16 CTAs), ragged shapes
(N not a multiple of 16, K ending inside a chunk), bitwise repeatability, every output element
written (the output buffer poisoned with NaN), PDL on / off, and a decode-like loop captured in a
command buffer. References are computed once per weight at M = 32: rows are independent.
"""

from __future__ import annotations

import functools
import math
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn._extension import target
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import split_gate_up
from jax_onnx_attn.ops.reference import linear as reference_linear
from jax_onnx_attn.testing import assert_close

import command_buffer

pytestmark = pytest.mark.gpu

DTYPES = [jnp.float16, jnp.bfloat16]
MS = [1, 2, 3, 8, 16, 32]
# (K, N): 1B qkv, o, gate_up, down; 8B qkv, o, gate_up, down; the 128k-vocabulary head.
SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (4096, 6144), (4096, 4096),
          (4096, 28672), (14336, 4096), (2048, 128256)]


def _name(d):
    return jnp.dtype(d).name


# The default run splits the rows between the dtypes (every M is covered, each once) and keeps the
# wider grids to a few rows; `pytest -m "gpu and slow"` (conftest: a markexpr naming slow) runs all.
FULL = pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)],
                               ids=["", "full"])


# The n-bit format: one 16-byte piece a lane per chunk (the default) or two (JOA_GEMV_NBITS_WIDE=1).
WIDE = pytest.mark.parametrize("wide", [False, True], ids=["narrow", "wide"])


def _rows(full, dtype, rows=MS):
    if full:
        return rows
    first = jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16)
    return [m for i, m in enumerate(rows) if (i % 2 == 0) == first] or list(rows)


@functools.cache
def _dense(k, n, dtype, seed=0):
    kx, kw = jax.random.split(jax.random.PRNGKey(seed + k + n))
    x = jax.random.normal(kx, (32, k), dtype)
    w = (jax.random.normal(kw, (n, k), jnp.float32) / math.sqrt(k)).astype(dtype)
    return x, w


@functools.cache
def _nbits(k, n, bits, block, zp, dtype, seed=0):
    """Kernel-form MatMulNBits operands with random bytes, scales ~ 1 / (2^bits sqrt(K)); scales and
    zero points tiled as the loader stores them (ops.tile_nbits_meta)."""
    keys = jax.random.split(jax.random.PRNGKey(seed + 7 * k + n + bits), 4)
    kb = k // block
    b_quant = jax.random.randint(keys[0], (n, kb, block * bits // 8), 0, 256, jnp.int32).astype(jnp.uint8)
    scales = (jax.random.uniform(keys[1], (n, kb), jnp.float32, 0.5, 1.5)
              / ((1 << bits) * math.sqrt(k) / 4)).astype(dtype)
    zeros = (jax.random.randint(keys[2], (n, kb), 0, 1 << bits, jnp.int32).astype(jnp.uint8)
             if zp else None)
    x = jax.random.normal(keys[3], (32, k), dtype)
    return x, b_quant, ops.tile_nbits_meta(scales), None if zeros is None else ops.tile_nbits_meta(zeros)


@functools.cache
def _linear_fn(backend, **kw):
    return jax.jit(functools.partial(ops.linear, backend=backend, **kw))


@functools.cache
def _nbits_fn(backend, **kw):
    return jax.jit(functools.partial(ops.matmul_nbits, backend=backend, **kw))


def _check(got, want, dtype, what, slack=None):
    """got == want within dtype's tolerance; where `slack` is given, an element may also differ by
    up to slack (see _bias_slack)."""
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    if slack is not None:
        within = np.abs(got.astype(np.float64) - want.astype(np.float64)) <= slack
        got = np.where(within, want, got)
    assert_close(got, want, dtype, err_msg=what)


def _product_x(x, arrays):
    """The x the product sees, in f64: x itself, or each row RMS-normed (eps 1e-5, _fusion_operands')
    times norm_weight when the call has the norm prologue."""
    x = np.asarray(x, np.float64)
    if "norm_weight" not in arrays:
        return x
    return x / np.sqrt(np.mean(x ** 2, axis=-1, keepdims=True) + 1e-5) * np.asarray(arrays["norm_weight"], np.float64)


def _bias_slack(x, w, dtype, gated):
    """What one rounding of a product can move an output by when a bias cancels it.

    The kernels and XLA's GEMM sum x W^T in f32 in different orders, so the product rounded to
    dtype may differ by one ulp (2^-7 |p| for bf16, 2^-10 for f16); + bias then cancels the
    leading bits (p ~ -b, both ~ N(0, 1) here) and the ulp shows in full. Gated, it is scaled by
    the other factor: |silu(g)| for an up ulp, |silu'(g)| |u| <= 1.1 |u| for a gate ulp.
    """
    ulp = 2.0 ** (-7 if jnp.dtype(dtype) == jnp.dtype(jnp.bfloat16) else -10)
    p = np.abs(np.asarray(x, np.float64) @ np.asarray(w, np.float64).T)
    if not gated:
        return 2 * ulp * p
    pg, pu = split_gate_up(p)
    bound = np.abs(pg) + 4.0  # |g| <= |p| + |bias| (bias ~ N(0, 1))
    return 2 * ulp * (pu * bound + 1.1 * pg * (np.abs(pu) + 4.0))


@FULL
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}_N{s[1]}")
def test_dense_matches_reference(shape, dtype, full):
    k, n = shape
    x, w = _dense(k, n, dtype)
    ref = _linear_fn("reference")(x, w)
    for m in _rows(full, dtype):
        got = _linear_fn("cuda")(x[:m], w)
        _check(got, ref[:m], dtype, f"K={k} N={n} M={m} plan={cuda_matmul.gemv_plan(m, n, k, 16, False, False)}")


@FULL
@WIDE
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"K{s[0]}_N{s[1]}")
def test_nbits_matches_reference(shape, bits, dtype, wide, full):
    k, n = shape
    i = SHAPES.index(shape)
    if not full and (i + bits // 4 + wide) % 2 != (jnp.dtype(dtype) == jnp.dtype(jnp.float16)):
        pytest.skip("the default run takes one dtype per (shape, bits, format); -m slow both")
    block, zp = (32, 128)[i % 2], i % 3 != 0  # every (block, zero points) pair over the shapes
    x, bq, s, z = _nbits(k, n, bits, block, zp, dtype)
    kw = dict(k=k, n=n, bits=bits, block_size=block)
    ref = _nbits_fn("reference", **kw)(x, bq, s, z)
    for m in (1, 3, 8, 32) if full else (1, 8, 32):
        got = _nbits_fn("cuda", wide=wide, **kw)(x[:m], bq, s, z)
        _check(got, ref[:m], dtype, f"K={k} N={n} M={m} bits={bits} block={block} zp={zp} wide={wide}")


@FULL
@WIDE
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("block", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_nbits_blocks_and_zero_points(bits, block, zp, dtype, wide, full):
    if bits == 4 and block == 16:
        pytest.skip("the kernels take 4-bit blocks >= 32 (routed to the reference)")
    if not full and (block.bit_length() + zp + wide) % 2 != (jnp.dtype(dtype) == jnp.dtype(jnp.float16)):
        pytest.skip("the default run takes one dtype per (block, zero points, format); -m slow both")
    # K = 1024 + a block (>= 32): the last chunk is ragged in both formats but for wide int4 with
    # block 256 (block 32: the last wide int4 chunk has one piece of 8 in K).
    k, n = 1024 + max(block, 32), 512
    x, bq, s, z = _nbits(k, n, bits, block, zp, dtype, seed=1)
    kw = dict(k=k, n=n, bits=bits, block_size=block)
    ref = _nbits_fn("reference", **kw)(x, bq, s, z)
    assert cuda_matmul.unsupported(32, n, k, bits, False, False, block, wide=wide) is None
    for m in (1, 5, 32) if full else (5, 32):
        got = _nbits_fn("cuda", wide=wide, **kw)(x[:m], bq, s, z)
        _check(got, ref[:m], dtype, f"M={m} wide={wide}")


FUSIONS = ["bias", "residual", "norm", "gated", "gated_bias", "all"]


def _fusion_operands(fusion, k, n, m, dtype, seed):
    keys = jax.random.split(jax.random.PRNGKey(seed), 3)
    gated = fusion.startswith("gated") or fusion == "all"
    n_out = n // 2 if gated else n
    kw = {"gated": gated}
    if fusion in ("bias", "gated_bias", "all"):
        kw["bias"] = jax.random.normal(keys[0], (n,), dtype)
    if fusion in ("residual", "all"):
        kw["residual"] = jax.random.normal(keys[1], (m, n_out), dtype)
    if fusion in ("norm", "all"):
        kw["norm_weight"] = (1 + 0.1 * jax.random.normal(keys[2], (k,), jnp.float32)).astype(dtype)
        kw["norm_epsilon"] = 1e-5
    return kw


def _split(kw):
    arrays = {a: kw[a] for a in ("bias", "residual", "norm_weight") if a in kw}
    static = {a: v for a, v in kw.items() if a not in arrays}
    return arrays, static


@FULL
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("shape", [(2048, 3072), (8192, 2048), (4096, 28672)], ids=lambda s: f"K{s[0]}_N{s[1]}")
def test_dense_fusions(shape, fusion, dtype, full):
    k, n = shape
    x, w = _dense(k, n, dtype, seed=1)
    for m in _rows(full, dtype, (1, 8, 32)):
        arrays, static = _split(_fusion_operands(fusion, k, n, m, dtype, seed=m))
        ref = _linear_fn("reference", **static)(x[:m], w, **arrays)
        got = _linear_fn("cuda", **static)(x[:m], w, **arrays)
        slack = _bias_slack(x[:m], w, dtype, static["gated"]) if "bias" in arrays else None
        _check(got, ref, dtype, f"{fusion} M={m}", slack)


@FULL
@WIDE
@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("fusion", FUSIONS)
@pytest.mark.parametrize("bits", [4, 8])
def test_nbits_fusions(bits, fusion, dtype, wide, full):
    f16 = jnp.dtype(dtype) == jnp.dtype(jnp.float16)
    if wide and not full and (FUSIONS.index(fusion) + bits // 4) % 2 != f16:
        pytest.skip("the default run takes one dtype per (fusion, bits) in the wide format; -m slow both")
    k, n, block = 4096, 6144, 32
    x, bq, s, z = _nbits(k, n, bits, block, True, dtype, seed=2)
    for m in _rows(full, dtype, (1, 8, 32)):
        arrays, static = _split(_fusion_operands(fusion, k, n, m, dtype, seed=m))
        kw = dict(k=k, n=n, bits=bits, block_size=block, **static)
        ref = _nbits_fn("reference", **kw)(x[:m], bq, s, z, **arrays)
        got = _nbits_fn("cuda", wide=wide, **kw)(x[:m], bq, s, z, **arrays)
        _check(got, ref, dtype, f"{fusion} M={m} wide={wide}")


def _slots_call(enabled, monkeypatch, **kw):
    """A fresh jit of the CUDA matmul_nbits traced under JOA_GEMV_SLOTS=enabled (read at trace time)."""
    monkeypatch.setenv(cuda_matmul.SLOTS_ENV, "1" if enabled else "0")
    fn = jax.jit(lambda *a, **arrays: ops.matmul_nbits(*a, backend="cuda", wide=True, **kw, **arrays))
    return lambda *a, **arrays: np.asarray(fn(*a, **arrays))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("block", [32, 64, 128, 256, 512])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_slots_kernel_matches_the_reference_and_the_ring_kernel(block, zp, dtype, monkeypatch):
    # One row of 4-bit wide weights: the slots kernel (scales applied per piece in f32) against the
    # reference and against the ring kernel, every fusion; K = 1024 + a block (a ragged last chunk
    # below block 256; blocks past 32 span several slots), N = 8 mod 16 (a half-empty row tile) but
    # gated; bitwise repeatable.
    k = 1024 + block
    for fusion in FUSIONS:
        n = 528 if fusion.startswith("gated") or fusion == "all" else 520  # gate / up rows come in 16s
        arrays, static = _split(_fusion_operands(fusion, k, n, 1, dtype, seed=7))
        assert cuda_matmul.gemv_plan(1, n, k, 4, static["gated"], "norm_weight" in arrays, wide=True,
                                     block_size=block, slots=True)["slots"]
        x, bq, s, z = _nbits(k, n, 4, block, zp, dtype, seed=6)
        kw = dict(k=k, n=n, bits=4, block_size=block, **static)
        ref = _nbits_fn("reference", **kw)(x[:1], bq, s, z, **arrays)
        slots = _slots_call(True, monkeypatch, **kw)
        got = slots(x[:1], bq, s, z, **arrays)
        # The reference rounds each dequantised weight to the dtype, the slots kernel does not, and
        # both kernels sum in another order than the reference: an output may differ by those
        # roundings (bf16: 2^-9 |w| each), which a bias, a residual or the gate can leave
        # uncancelled; _bias_slack bounds them (2 ulp |x| |W|, propagated). On the H200 one bf16
        # element (all fusions, block 128) came out 0.164 from both kernels against 0.203.
        w = reference_linear.dequantize_nbits(
            bq, ops.untile_nbits_meta(s, n), None if z is None else ops.untile_nbits_meta(z, n),
            bits=4, block_size=block, dtype=jnp.float32)
        slack = _bias_slack(_product_x(x[:1], arrays), w, dtype, static["gated"])
        _check(got, ref, dtype, f"slots {fusion} block={block} zp={zp}", slack)
        _check(_slots_call(False, monkeypatch, **kw)(x[:1], bq, s, z, **arrays), ref, dtype,
               f"ring {fusion} block={block} zp={zp}", slack)
        np.testing.assert_array_equal(slots(x[:1], bq, s, z, **arrays), got)


def _dense_row_call(enabled, monkeypatch, **kw):
    """A fresh jit of the CUDA linear traced under JOA_GEMV_DENSE_ROW=enabled (read at trace time)."""
    monkeypatch.setenv(cuda_matmul.DENSE_ROW_ENV, "1" if enabled else "0")
    fn = jax.jit(lambda *a, **arrays: ops.linear(*a, backend="cuda", **kw, **arrays))
    return lambda *a, **arrays: np.asarray(fn(*a, **arrays))


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("k", [512, 1536, 4096])
def test_dense_row_kernel_matches_the_reference_and_the_ring_kernel(k, dtype, monkeypatch):
    # One row of dense weights: the dense row kernel against the reference and against the ring
    # kernel, every fusion; K = 512 (one step a warp), 1536 (three: the depth), 4096; N = 4816 /
    # 4832 rows (300+ tiles: more than one tile a CTA on 264 CTAs, N not a multiple of 128);
    # bitwise repeatable.
    for fusion in FUSIONS:
        gated = fusion.startswith("gated") or fusion == "all"
        n = 4832 if gated else 4816
        arrays, static = _split(_fusion_operands(fusion, k, n, 1, dtype, seed=9))
        assert cuda_matmul.gemv_plan(1, n, k, 16, gated, "norm_weight" in arrays, slots=True)["dense_row"]
        x, w = _dense(k, n, dtype, seed=3)
        ref = _linear_fn("reference", **static)(x[:1], w, **arrays)
        row = _dense_row_call(True, monkeypatch, **static)
        got = row(x[:1], w, **arrays)
        slack = _bias_slack(_product_x(x[:1], arrays), w, dtype, gated) if ("bias" in arrays or gated) else None
        _check(got, ref, dtype, f"dense row {fusion} K={k}", slack)
        _check(_dense_row_call(False, monkeypatch, **static)(x[:1], w, **arrays), ref, dtype,
               f"ring {fusion} K={k}", slack)
        np.testing.assert_array_equal(row(x[:1], w, **arrays), got)


# (cluster, warps_k) forced through the plan's overrides: every reduction path.
PLANS = [(1, 1), (1, 2), (1, 8), (2, 4), (4, 2), (8, 1), (16, 1), (16, 8)]


@functools.cache
def _forced(kind, cluster, warps_k, **kw):
    fn = cuda_matmul.linear if kind == "dense" else cuda_matmul.matmul_nbits
    return jax.jit(functools.partial(fn, cluster=cluster, warps_k=warps_k, **kw))


@FULL
@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"c{p[0]}_wk{p[1]}")
@pytest.mark.parametrize("gated", [False, True], ids=["store", "gated"])
def test_forced_plans(plan, gated, full):
    if plan[0] > 1 and not cuda_matmul.sm90():
        pytest.skip("thread-block clusters need sm_90")
    dtype = jnp.bfloat16
    k, n = 2048, 1024
    x, w = _dense(k, n, dtype, seed=3)
    _, bq, s, z = _nbits(k, n, 4, 128, True, dtype, seed=3)
    gamma = jnp.full((k,), 1.25, dtype)
    i = PLANS.index(plan) + gated
    for m in (1, 9, 32) if full else ((1, 32) if i % 2 else (9,)):
        ref = _linear_fn("reference", gated=gated)(x[:m], w, norm_weight=gamma)
        got = _forced("dense", *plan, gated=gated)(x[:m], w, norm_weight=gamma)
        _check(got, ref, dtype, f"dense plan={plan} M={m}")
        ref = _nbits_fn("reference", k=k, n=n, bits=4, block_size=128, gated=gated)(x[:m], bq, s, z)
        for wide in (False, True):
            # A forced plan may not fit (more K parts than int4's 16 chunks, 8 wide, at M = 32): it
            # must say so.
            fn = _forced("nbits", *plan, bits=4, block_size=128, gated=gated, wide=wide)
            why = cuda_matmul.unsupported(m, n, k, 4, gated, False, 128, *plan, wide=wide)
            if why is not None:
                assert "shared memory" in why, why
                with pytest.raises(Exception, match="shared memory"):
                    fn(x[:m], bq, s, z).block_until_ready()
                continue
            _check(fn(x[:m], bq, s, z), ref, dtype, f"int4 plan={plan} M={m} wide={wide}")


@pytest.mark.parametrize("dtype", DTYPES, ids=_name)
@pytest.mark.parametrize("shape", [(72, 8), (200, 24), (1000, 1032), (8, 64), (4104, 2056)], ids=str)
def test_ragged_shapes(shape, dtype):
    # K ending inside a 32-element chunk, N = 8 mod 16 (a half-empty row tile), tiny K and N.
    k, n = shape
    x, w = _dense(k, n, dtype, seed=4)
    bias = jnp.linspace(-1, 1, n).astype(dtype)
    for m in _rows(False, dtype, (1, 7, 17, 32)):
        ref = _linear_fn("reference")(x[:m], w, bias)
        _check(_linear_fn("cuda")(x[:m], w, bias), ref, dtype, f"M={m}")


def test_bitwise_repeatable_and_pdl_invariant():
    for k, n, m in ((2048, 2048, 1), (8192, 2048, 32), (14336, 4096, 8)):
        x, w = _dense(k, n, jnp.float16, seed=5)
        gamma = jnp.ones((k,), jnp.float16)
        f = _linear_fn("cuda", norm_epsilon=1e-6)
        first = np.asarray(f(x[:m], w, norm_weight=gamma))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x[:m], w, norm_weight=gamma)), first)
        pdl = _linear_fn("cuda", norm_epsilon=1e-6, pdl=True)(x[:m], w, norm_weight=gamma)
        np.testing.assert_array_equal(np.asarray(pdl), first)
        _, bq, s, z = _nbits(k, n, 4, 32, True, jnp.float16, seed=5)
        for wide in (False, True):
            g = _nbits_fn("cuda", k=k, n=n, bits=4, block_size=32, wide=wide)
            first = np.asarray(g(x[:m], bq, s, z))
            np.testing.assert_array_equal(np.asarray(g(x[:m], bq, s, z)), first)
            # Row-major scales / zero points (tiled on the call) give the same bits.
            rows = [ops.untile_nbits_meta(a, n) for a in (s, z)]
            np.testing.assert_array_equal(np.asarray(g(x[:m], bq, *rows)), first)


def _poisoned_call(name, m, n_out, dtype, args, **attrs):
    """Calls the handler with y aliased to a NaN-filled buffer passed in the residual slot (unused:
    has_residual is false), so every element the kernel does not write stays NaN."""
    slot = 3 if name == "linear" else 5
    poison = jnp.full((m, n_out), jnp.nan, dtype)
    args = list(args)
    args[slot] = poison
    call = jax.ffi.ffi_call(target(name), jax.ShapeDtypeStruct((m, n_out), dtype),
                            input_output_aliases={slot: 0})
    return call(*args, **attrs)


@pytest.mark.parametrize("gated", [False, True], ids=["store", "gated"])
def test_every_output_element_is_written(gated):
    dtype = jnp.bfloat16
    ph = jnp.zeros((1,), dtype)
    common = dict(has_residual=False, has_norm=False, gated=gated, eps=np.float32(1e-6),
                  warps_k=0, pdl=False)
    for (k, n), m, cluster in (((2048, 4112), 1, 0), ((8200, 1040), 32, 0), ((2048, 1024), 8, 16),
                               ((4096, 2048), 17, 4)):
        if cluster > 1 and not cuda_matmul.sm90():
            continue
        x, w = _dense(k, n, dtype, seed=6)
        n_out = n // 2 if gated else n
        got = jax.jit(lambda x, w: _poisoned_call("linear", m, n_out, dtype, (x, w, ph, None, ph),
                                                  has_bias=False, cluster=cluster, slots=True,
                                                  **common))(x[:m], w)
        _check(got, _linear_fn("reference", gated=gated)(x[:m], w), dtype, f"K={k} N={n} M={m}")
        _, bq, s, z = _nbits(k - k % 32, n, 4, 32, True, dtype, seed=6)
        xk = x[:m, :k - k % 32]
        ref = _nbits_fn("reference", k=k - k % 32, n=n, bits=4, block_size=32, gated=gated)(xk, bq, s, z)
        for wide in (False, True):
            # A forced cluster may not split K into more parts than it has chunks (2 KB wide ones).
            kc = cuda_matmul.gemv_plan(m, n, k - k % 32, 4, gated, wide=wide)["kc"]
            c = min(cluster, kc) if cluster else 0
            got = jax.jit(lambda x: _poisoned_call(
                "matmul_nbits", m, n_out, dtype, (x, bq, s, z, ph, None, ph), bits=4, block_size=32,
                has_zero_points=True, has_bias=False, cluster=c, wide=wide, slots=True, rows=False,
                warps_n=0, depth=0, occupancy=0, record_layout=False, **common))(xk)
            _check(got, ref, dtype, f"int4 K={k} N={n} M={m} wide={wide}")


def test_auto_backend_picks_the_kernel(monkeypatch):
    x, w = _dense(2048, 2048, jnp.float16)
    # Dense weights go to XLA's GEMM under the default preference (ops.linear.kernel_formats) ...
    hlo = jax.jit(lambda x, w: ops.linear(x[:4], w)).lower(x, w).compile().as_text()
    assert "jax_onnx_attn_linear" not in hlo
    # ... and to ours when asked for.
    monkeypatch.setenv("JOA_LINEAR_KERNELS", "all")
    hlo = jax.jit(lambda x, w: ops.linear(x[:4], w)).lower(x, w).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_linear"' in hlo
    assert " conditional(" not in hlo, "platform_dependent left a runtime branch"
    # One row takes the dense row kernel, ours under the default preference.
    monkeypatch.delenv("JOA_LINEAR_KERNELS")
    hlo = jax.jit(lambda x, w: ops.linear(x[:1], w)).lower(x, w).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_linear"' in hlo
    monkeypatch.setenv(cuda_matmul.DENSE_ROW_ENV, "0")
    hlo = jax.jit(lambda x, w: ops.linear(x[1:2], w)).lower(x, w).compile().as_text()
    assert "jax_onnx_attn_linear" not in hlo
    # M > 32 is XLA's GEMM.
    hlo = jax.jit(lambda x, w: ops.linear(jnp.concatenate([x, x]), w)).lower(x, w).compile().as_text()
    assert "jax_onnx_attn_linear" not in hlo


# A decode-like loop in a fresh process (XLA_FLAGS apply): norm + gated projection, then a residual
# projection back, 8 steps in a fori_loop, x donated. Prints the custom-call names for the check.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    k, i = 2048, 4096
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    w_up = (jax.random.normal(keys[0], (2 * i, k)) / k ** 0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[1], (k, i)) / i ** 0.5).astype(jnp.bfloat16)
    gamma = jnp.ones((k,), jnp.bfloat16)
    x0 = jax.random.normal(keys[2], (8, k), jnp.bfloat16)

    def steps(x, backend, pdl):
        def body(_, x):
            h = ops.linear(x, w_up, norm_weight=gamma, gated=True, backend=backend, pdl=pdl)
            return ops.linear(h, w_down, residual=x, backend=backend, pdl=pdl)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("linear")


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "linear", tmp_path)
