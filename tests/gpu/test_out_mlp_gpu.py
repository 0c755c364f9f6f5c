"""The attention's output projection and the gated MLP of one decode row as one persistent kernel
(out_mlp: ffi/handlers/gated_mlp.cu, ffi/kernels/gemv/row_chain.cuh, three phases and two grid
barriers) on a GPU.

Oracles: the separate kernels it replaces (`cuda_matmul.linear` for o with the residual, then the
fused MLP's N split, which gives the two GEMVs' bits: tests/gpu/test_gated_mlp_gpu.py) — the same
bits, as both add every sum in the dense row kernel's order — and the reference backend (XLA, f32
sums of the same rounded products) within the dtype's tolerance. Also: f16 / bf16, with and without
the norm, the ~1B / ~8B shapes and a small one; bitwise repeatability; a decode-like loop captured in
a command buffer; what the handler refuses; sessions of batch 1 under JOA_OUT_MLP=1 generating the
same tokens with one kernel a layer fewer.
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
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.testing import assert_close, tolerance

import command_buffer
import session_switch

pytestmark = pytest.mark.gpu

# (name, H, Ho, I): the ~1B and ~8B Llama layers and a small one.
SHAPES = [("1b", 2048, 2048, 8192), ("8b", 4096, 4096, 14336), ("small", 1024, 1024, 4096)]
DTYPES = [jnp.float16, jnp.bfloat16]


@functools.cache
def _operands(h, ho, inter, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed + h + inter), 6)
    a = jax.random.normal(keys[0], (1, ho), dtype)
    w_o = (jax.random.normal(keys[1], (h, ho), jnp.float32) / math.sqrt(ho)).astype(dtype)
    x = jax.random.normal(keys[2], (1, h), dtype)
    w_gu = (jax.random.normal(keys[3], (2 * inter, h), jnp.float32) / math.sqrt(h)).astype(dtype)
    w_down = (jax.random.normal(keys[4], (h, inter), jnp.float32) / math.sqrt(inter)).astype(dtype)
    gamma = (1 + 0.1 * jax.random.normal(keys[5], (h,), jnp.float32)).astype(dtype)
    return a, w_o, x, w_gu, w_down, gamma


@functools.cache
def _fn(backend, norm):
    def f(a, w_o, x, w_gu, w_down, gamma):
        return ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma if norm else None, norm_epsilon=1e-5,
                           backend=backend)
    return jax.jit(f)


@functools.cache
def _separate_kernels(norm):
    def f(a, w_o, x, w_gu, w_down, gamma):
        x1 = cuda_matmul.linear(a, w_o, None, x)
        return cuda_matmul.gated_mlp(x1, w_gu, w_down, gamma if norm else None, x1, eps=1e-5, split="n")
    return jax.jit(f)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_out_mlp_equals_the_separate_kernels_and_the_reference(shape, norm, dtype):
    _, h, ho, inter = shape
    assert cuda_matmul.out_mlp_grid(h, ho, inter) > 0
    args = _operands(h, ho, inter, dtype)
    got = np.asarray(_fn("cuda", norm)(*args))
    assert np.isfinite(got).all()
    np.testing.assert_array_equal(got, np.asarray(_separate_kernels(norm)(*args)),
                                  err_msg="out_mlp vs o + the N-split MLP")
    assert_close(got, np.asarray(_fn("reference", norm)(*args)), dtype, err_msg="vs reference")


@pytest.mark.parametrize("grid", [1, 100, "sms"], ids=str)
def test_any_grid_gives_the_same_bits(monkeypatch, grid):
    # The sums do not depend on the grid. At 100 / all SMs the CTAs have unequal tiles, and from CTA 64
    # on none in o and down (64 tiles each): they must still cross both barriers (a hang otherwise).
    h, ho, inter = 1024, 1024, 4096
    args = _operands(h, ho, inter, jnp.float16)
    want = np.asarray(_separate_kernels(True)(*args))
    g = cuda_matmul.sm_count() if grid == "sms" else grid
    monkeypatch.setattr(cuda_matmul, "out_mlp_grid", lambda *shape: g)
    got = jax.jit(lambda a, w_o, x, w_gu, w_down, gamma: cuda_matmul.out_mlp(a, w_o, x, w_gu, w_down, gamma,
                                                                             eps=1e-5))(*args)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_out_mlp_is_deterministic():
    args = _operands(2048, 2048, 8192, jnp.float16, seed=3)
    f = _fn("cuda", True)
    first = np.asarray(f(*args))
    for _ in range(3):
        assert np.array_equal(np.asarray(f(*args)), first)


def test_auto_takes_the_kernel_under_the_switch_for_one_row(monkeypatch):
    a, w_o, x, w_gu, w_down, gamma = _operands(2048, 2048, 8192, jnp.bfloat16)
    lower = lambda a, x: jax.jit(lambda a, x: ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma)).lower(
        a, x).as_text()
    monkeypatch.setenv(cuda_matmul.OUT_MLP_ENV, "1")
    assert "jax_onnx_attn_out_mlp" in lower(a, x)
    assert "jax_onnx_attn_out_mlp" not in lower(jnp.concatenate([a, a]), jnp.concatenate([x, x]))
    monkeypatch.setenv(cuda_matmul.OUT_MLP_ENV, "0")
    assert "jax_onnx_attn_out_mlp" not in lower(a, x)


def test_handler_refuses_a_geometry_the_kernel_does_not_take():
    # The handler checks what it is given, whoever calls it: H = 1000 is not a multiple of 8 x 64.
    from jax_onnx_attn._extension import target

    h, inter = 1000, 4096
    call = jax.ffi.ffi_call(target("out_mlp"), (jax.ShapeDtypeStruct((1, h), jnp.float16),
                                                jax.ShapeDtypeStruct((h + inter,), jnp.float32)))
    z = lambda *s: jnp.zeros(s, jnp.float16)
    with pytest.raises(Exception, match="geometry"):
        y, _ = call(z(1, h), z(h, h), z(1, h), z(2 * inter, h), z(h, inter), z(1), has_norm=False,
                    eps=np.float32(1e-5), grid=64)
        np.asarray(y)  # jax raises an FFI handler's error when the result is read


# A decode-like loop in a fresh process (XLA_FLAGS apply): 8 chains in a fori_loop, x donated.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    h, i = 2048, 8192
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    w_o = (jax.random.normal(keys[0], (h, h)) / h ** 0.5).astype(jnp.bfloat16)
    w_gu = (jax.random.normal(keys[1], (2 * i, h)) / h ** 0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[2], (h, i)) / i ** 0.5).astype(jnp.bfloat16)
    gamma = jnp.ones((h,), jnp.bfloat16)
    x0 = jax.random.normal(keys[3], (1, h), jnp.bfloat16)

    def steps(x, backend, pdl):
        def body(_, x):
            # The layer's output as the next attention output and residual stream, scaled down.
            return ops.out_mlp(x * 0.5, w_o, x, w_gu, w_down, norm_weight=gamma, backend=backend, pdl=pdl)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("out_mlp", rel_tol=0.06)
# rel_tol: as linear_gqa_prepare's loop (tests/gpu/test_linear_gqa_prepare_gpu.py): bf16 roundings
# of three projections a step carried through 8 steps, against the reference's other sum order.


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "out_mlp", tmp_path)


def _kernel_counts(session) -> dict:
    hlo = "\n".join(session.compiled_text("decode"))
    return {t: hlo.count(f'custom_call_target="jax_onnx_attn_{t}"') for t in ("linear", "gated_mlp", "out_mlp")}


def test_session_of_batch_one_runs_o_and_the_mlp_as_one_kernel(monkeypatch):
    monkeypatch.setenv(cuda_matmul.GATED_MLP_ENV, "1")
    pair = session_switch.sessions_with_switch(monkeypatch, cuda_matmul.OUT_MLP_ENV)
    layers = session_switch.LAYERS
    assert pair.session.lowered.fusions.out_mlp == layers
    before, after = _kernel_counts(pair.plain), _kernel_counts(pair.session)
    assert before["out_mlp"] == 0 and after["out_mlp"] == layers, (before, after)
    assert after["gated_mlp"] == before["gated_mlp"] - layers, (before, after)
    assert after["linear"] == before["linear"] - layers, (before, after)
    # The plain session's MLP is the fused K split (another sum order): tokens and logits within
    # the dtype's tolerance, not its bits.
    assert pair.got.tokens == pair.want.tokens
    ours, want_logits = pair.logits()
    rtol, atol = tolerance(np.float16)
    assert float(np.abs(ours - want_logits).max()) <= atol + rtol * float(np.abs(want_logits).max())
