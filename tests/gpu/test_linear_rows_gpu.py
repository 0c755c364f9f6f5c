"""The rows kernel (matmul_nbits with 4-bit weights in the rows layout: ffi/kernels/gemv/rows.cuh) on
a GPU against the reference backend.

The ~1B / ~8B decoder projections with the decoder's fusions (o; qkv + norm; gate-up + norm, gated;
down + residual; the LM head + norm) at M in {2, 8, 16, 32}, f16 / bf16, blocks 32 / 128, with and
without zero points; ragged shapes (a partial row group, K of one block); every forced plan shape
(K split 1-16, 1-8 warps a CTA, W rings of depth 2 / 4: every reduction path); occupancy 2 (the
128-register instantiations) at M in {1, 8, 16, 32}, the same bits as occupancy 1 on the same layout;
every output element written; bitwise repeatability
and PDL invariance; a decode-like loop captured in a command buffer. Tolerances:
jax_onnx_attn.testing's table. References are computed once per weight at M = 32 (rows are
independent).
"""

from __future__ import annotations

import functools
import math
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn._extension import target
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.testing import assert_close

import command_buffer
from nbits_cases import fusion_operands as _fusion

pytestmark = pytest.mark.gpu

MS = [2, 8, 16, 32]
# (name, K, N, fusion): the projections of the ~1B and ~8B Llama-shaped decoders.
SHAPES = [("1b-o", 2048, 2048, "plain"), ("1b-qkv", 2048, 3072, "norm"),
          ("1b-gate-up", 2048, 16384, "norm_gated"), ("1b-down", 8192, 2048, "residual"),
          ("1b-lm", 2048, 128256, "norm"),
          ("8b-o", 4096, 4096, "plain"), ("8b-qkv", 4096, 6144, "norm"),
          ("8b-gate-up", 4096, 28672, "norm_gated"), ("8b-down", 14336, 4096, "residual"),
          ("8b-lm", 4096, 128256, "norm")]
# (dtype, block, zero points): the default run takes two per shape (rotating), -m slow all eight.
COMBOS = [(d, b, z) for d in (jnp.float16, jnp.bfloat16) for b in (32, 128) for z in (False, True)]
FULL = pytest.mark.parametrize("full", [False, pytest.param(True, marks=pytest.mark.slow)],
                               ids=["", "full"])


@functools.cache
def _weights(k, n, block, zp, dtype, seed=0):
    """(x [32, K], weights in the rows layout on the device, the same in prepare_nbits' form)."""
    rng = np.random.default_rng(seed + k + n + block)
    kb = k // block
    b_quant = rng.integers(0, 256, (n, kb, block // 2), dtype=np.uint8)
    scales = (rng.uniform(0.5, 1.5, (n, kb)) / (16 * math.sqrt(k) / 4)).astype(jnp.dtype(dtype))
    zeros = rng.integers(0, 16, (n, kb), dtype=np.uint8) if zp else None
    x = jnp.asarray(rng.normal(size=(32, k)), dtype)
    rows = tuple(None if a is None else jnp.asarray(a) for a in ops.to_rows_layout(b_quant, scales, zeros))
    onnx = tuple(None if a is None else jnp.asarray(a) for a in (b_quant, scales, zeros))
    return x, rows, onnx


@functools.cache
def _fn(backend, layout, **kw):
    return jax.jit(functools.partial(ops.matmul_nbits, backend=backend, layout=layout, **kw))


@functools.cache
def _rows_fn(n, block, gated, eps=1e-6, **plan):
    """The rows kernel through cuda_matmul.matmul_nbits_rows with a forced plan (cluster, warps_n,
    depth, occupancy), jitted: f(x, w, scales, zero_points, bias, residual, norm_weight)."""
    return jax.jit(functools.partial(cuda_matmul.matmul_nbits_rows, n=n, block_size=block, gated=gated,
                                     eps=eps, **plan))


def _check(got, want, dtype, what):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    assert_close(got, want, dtype, err_msg=what)


def _run_shape(k, n, fusion, dtype, block, zp, ms, seed=0):
    x, rows, onnx = _weights(k, n, block, zp, dtype, seed)
    static, arrays = _fusion(fusion, k, n, 32, dtype)
    kw = dict(k=k, n=n, bits=4, block_size=block, **static)
    ref = _fn("reference", "onnx", **kw)(x, *onnx, **arrays)  # once: rows are independent
    for m in ms:
        sliced = {a: v[:m] if a == "residual" else v for a, v in arrays.items()}
        plan = cuda_matmul.gemv_plan(m, n, k, 4, static["gated"], "norm_weight" in arrays, block_size=block,
                                     rows_layout=True)
        assert plan["error"] is None, plan["error"]
        got = _fn("cuda", "rows", **kw)(x[:m], *rows, **sliced)
        _check(got, ref[:m], dtype, f"K={k} N={n} {fusion} M={m} block={block} zp={zp} "
               f"plan=(warps_n {plan['warps_n']}, cluster {plan['cluster']}, depth {plan['stages']})")


@FULL
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_rows_kernel_matches_the_reference(shape, full):
    name, k, n, fusion = shape
    i = SHAPES.index(shape)
    combos = COMBOS if full else [COMBOS[i % 8], COMBOS[(i + 3) % 8]]
    for dtype, block, zp in combos:
        _run_shape(k, n, fusion, dtype, block, zp, MS)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("fusion", ["plain", "bias", "residual", "norm", "gated", "all"])
def test_rows_kernel_fusions_and_ragged_shapes(fusion, dtype):
    # N = 8 / 16 mod 64 (a partial row group), K = one block and 33 blocks (no K split divides it).
    gated = fusion in ("gated", "all")
    for k, block in ((128, 128), (33 * 32, 32), (1024, 32)):
        n = 528 if gated else 520
        _run_shape(k, n, fusion, dtype, block, True, (2, 9, 32), seed=1)


# (cluster, warps_n, depth) forced: every K split, CTA width and ring depth the plan may take where
# x's slice and the rings fit (a cluster of 16 twice an SM).
PLANS = [(1, 1, 2), (1, 4, 2), (2, 4, 2), (4, 2, 4), (8, 4, 4), (16, 4, 2), (8, 8, 2), (4, 8, 2)]


@pytest.mark.parametrize("plan", PLANS, ids=lambda p: f"c{p[0]}_w{p[1]}_d{p[2]}")
@pytest.mark.parametrize("fusion", ["norm", "norm_gated", "all"])
def test_rows_kernel_forced_plans(plan, fusion):
    if plan[0] > 1 and not cuda_matmul.sm90():
        pytest.skip("thread-block clusters need sm_90")
    dtype = jnp.bfloat16 if plan[1] % 2 else jnp.float16
    k, n = 2048, 2048  # x's whole K at M = 32 fits one CTA (cluster 1)
    for block in (32, 128):
        x, rows, onnx = _weights(k, n, block, block == 32, dtype, seed=2)
        for m in (3, 9, 32):
            static, arrays = _fusion(fusion, k, n, m, dtype)
            kw = dict(k=k, n=n, bits=4, block_size=block, **static)
            why = cuda_matmul.rows_unsupported(m, n, k, block, static["gated"], "norm_weight" in arrays, *plan)
            assert why is None, why
            ref = _fn("reference", "onnx", **kw)(x[:m], *onnx, **arrays)
            got = _rows_fn(n, block, static["gated"], static.get("norm_epsilon", 1e-6), cluster=plan[0],
                           warps_n=plan[1], depth=plan[2])(
                x[:m], *rows, arrays.get("bias"), arrays.get("residual"), arrays.get("norm_weight"))
            _check(got, ref, dtype, f"plan={plan} {fusion} M={m} block={block}")


# (name, K, N, fusion, warps_n forced or 0): the planner's layouts on ~8B gate-up / down and ~1B qkv,
# forced 2-warp CTAs on the ~1B o shape, with the decoder's fusions.
OCC2_SHAPES = [("8b-gate-up", 4096, 28672, "norm_gated", 0), ("8b-down", 14336, 4096, "residual", 0),
               ("1b-o", 2048, 2048, "all", 2), ("1b-qkv", 2048, 3072, "norm", 0)]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("shape", OCC2_SHAPES, ids=lambda s: s[0])
def test_rows_kernel_occupancy_2(shape, dtype):
    # Occupancy 2 (__launch_bounds__(256, 2): 128 registers a thread) at depth 2 (depth 4's rings do
    # not fit twice an SM); M = 32 is refused (it would spill: plan.h's RowsOccupancy2Fits). Within
    # tolerance of the reference, the same bits as occupancy 1 on the same layout (only the register
    # cap differs), and the same bits again on a second call.
    name, k, n, fusion, warps_n = shape
    for block in (32, 128):
        x, rows, onnx = _weights(k, n, block, block == 128, dtype, seed=6)
        static, arrays = _fusion(fusion, k, n, 32, dtype)
        gated, norm, eps = static["gated"], "norm_weight" in arrays, static.get("norm_epsilon", 1e-6)
        ref = _fn("reference", "onnx", k=k, n=n, bits=4, block_size=block, **static)(x, *onnx, **arrays)
        for m in (1, 8, 16, 32):
            why = cuda_matmul.rows_unsupported(m, n, k, block, gated, norm, 0, warps_n, 2, 2)
            if why is not None:
                assert m > 16 and "occupancy 2" in why, why
                continue
            plan = cuda_matmul.gemv_plan(m, n, k, 4, gated, norm, block_size=block, rows_layout=True,
                                         warps_n=warps_n, depth=2, occupancy=2)
            assert (plan["ctas_per_sm"], plan["stages"]) == (2, 2)
            operands = (x[:m], *rows, arrays.get("bias"),
                        arrays["residual"][:m] if "residual" in arrays else None, arrays.get("norm_weight"))
            layout = dict(cluster=plan["cluster"], warps_n=plan["warps_n"], depth=2)
            run = {occ: _rows_fn(n, block, gated, eps, occupancy=occ, **layout) for occ in (1, 2)}
            got = np.asarray(run[2](*operands))
            what = (f"{name} M={m} block={block} occupancy 2 (warps_n {plan['warps_n']}, cluster "
                    f"{plan['cluster']}, depth 2)")
            _check(got, ref[:m], dtype, what)
            np.testing.assert_array_equal(got, np.asarray(run[2](*operands)), err_msg=what + ": repeat")
            np.testing.assert_array_equal(got, np.asarray(run[1](*operands)), err_msg=what + ": vs occupancy 1")


def _poisoned(m, n, k, block, gated, dtype, rows, x):
    """The handler with y aliased to a NaN-filled buffer in the residual slot (unused), so every
    element the kernel does not write stays NaN."""
    n_out = n // 2 if gated else n
    ph = jnp.zeros((1,), dtype)
    w, s, z = rows

    def call(x):
        poison = jnp.full((m, n_out), jnp.nan, dtype)
        f = jax.ffi.ffi_call(target("matmul_nbits"), jax.ShapeDtypeStruct((m, n_out), dtype),
                             input_output_aliases={5: 0})
        return f(x, w, s, z, ph, poison, ph, bits=4, block_size=block, has_zero_points=True,
                 has_bias=False, has_residual=False, has_norm=False, gated=gated, eps=np.float32(1e-6),
                 cluster=0, warps_k=0, wide=False, pdl=False, slots=False, rows=True, warps_n=0, depth=0,
                 occupancy=0, record_layout=False)
    return jax.jit(call)(x)


@pytest.mark.parametrize("gated", [False, True], ids=["store", "gated"])
def test_every_output_element_is_written(gated):
    dtype = jnp.bfloat16
    for k, n, m, block in ((2048, 4112, 2, 32), (8192, 1040, 32, 128), (1024, 13856, 17, 32)):
        x, rows, onnx = _weights(k, n, block, True, dtype, seed=3)
        got = _poisoned(m, n, k, block, gated, dtype, rows, x[:m])
        ref = _fn("reference", "onnx", k=k, n=n, bits=4, block_size=block, gated=gated)(x[:m], *onnx)
        _check(got, ref, dtype, f"K={k} N={n} M={m} gated={gated}")


def test_bitwise_repeatable_and_pdl_invariant():
    for k, n, m, block in ((4096, 6144, 8, 128), (14336, 4096, 32, 32), (4096, 28672, 16, 128)):
        x, rows, _ = _weights(k, n, block, True, jnp.float16, seed=4)
        gamma = jnp.ones((k,), jnp.float16)
        f = _fn("cuda", "rows", k=k, n=n, bits=4, block_size=block)
        first = np.asarray(f(x[:m], *rows, norm_weight=gamma))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x[:m], *rows, norm_weight=gamma)), first)
        pdl = _fn("cuda", "rows", k=k, n=n, bits=4, block_size=block, pdl=True)(x[:m], *rows, norm_weight=gamma)
        np.testing.assert_array_equal(np.asarray(pdl), first)


def test_vmap_folds_with_the_same_bits():
    # A vmapped call folds the examples into the kernel's rows with the per-example plan pinned
    # (cuda_matmul._rows_pin): each example's outputs are those of its own call, bit for bit, with
    # the RMS-norm prologue too wherever a row lands among the n8 tiles (2 -> 8, 3 -> 12 rows across
    # a tile edge, 8 -> 16); past 32 rows it runs one call per example.
    k, n = 4096, 6144
    x, rows, _ = _weights(k, n, 128, True, jnp.float16, seed=5)
    gamma = jnp.full((k,), 1.5, jnp.float16)
    f = _fn("cuda", "rows", k=k, n=n, bits=4, block_size=128)
    x = jnp.concatenate([x, x[::-1]])  # 64 rows: 4 examples of 16 fold past 32 rows
    for examples, m in ((4, 2), (4, 3), (2, 8), (4, 16)):
        xs = x[:examples * m].reshape(examples, m, k)
        folded = jax.jit(jax.vmap(lambda x: f(x, *rows, norm_weight=gamma)))
        if examples * m <= 32:  # one call on the folded rows
            assert f"f16[{examples * m},{k}]" in folded.lower(xs).compile().as_text()
        got = np.asarray(folded(xs))
        for i in range(examples):
            np.testing.assert_array_equal(got[i], np.asarray(f(xs[i], *rows, norm_weight=gamma)))


def test_auto_backend_takes_the_rows_kernel_and_the_reference_past_32_rows():
    k, n = 2048, 2048
    x, rows, _ = _weights(k, n, 128, True, jnp.float16)
    kw = dict(k=k, n=n, bits=4, block_size=128, layout="rows")
    hlo = jax.jit(lambda x: ops.matmul_nbits(x[:8], *rows, **kw)).lower(x).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_matmul_nbits"' in hlo
    x64 = jnp.concatenate([x, x])
    hlo = jax.jit(lambda x: ops.matmul_nbits(x, *rows, **kw)).lower(x64).compile().as_text()
    assert "jax_onnx_attn_matmul_nbits" not in hlo


# A decode-like loop in a fresh process (XLA_FLAGS apply): norm + gated gate-up, then down with the
# residual, both in the rows layout, 8 steps in a fori_loop, x donated (M = 8). Prints the
# custom-call names for the check.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    k, i, block = 2048, 4096, 128
    rng = np.random.default_rng(0)
    def weights(n, kk):
        bq = rng.integers(0, 256, (n, kk // block, block // 2), dtype=np.uint8)
        s = (rng.uniform(0.5, 1.5, (n, kk // block)) / (4 * kk ** 0.5)).astype(jnp.bfloat16)
        z = rng.integers(0, 16, (n, kk // block), dtype=np.uint8)
        return tuple(jnp.asarray(a) for a in ops.to_rows_layout(bq, s, z))
    up, down = weights(2 * i, k), weights(k, i)
    gamma = jnp.ones((k,), jnp.bfloat16)
    x0 = jnp.asarray(rng.normal(size=(8, k)), jnp.bfloat16)

    def steps(x, backend, pdl):
        def body(_, x):
            h = ops.matmul_nbits(x, *up, k=k, n=2 * i, bits=4, block_size=block, norm_weight=gamma,
                                 gated=True, backend=backend, pdl=pdl, layout="rows")
            return ops.matmul_nbits(h, *down, k=i, n=k, bits=4, block_size=block, residual=x,
                                    backend=backend, pdl=pdl, layout="rows")
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("matmul_nbits")


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "matmul_nbits", tmp_path)
