"""The gated MLP of one decode row as one kernel (gated_mlp: ffi/handlers/gated_mlp.cu,
ffi/kernels/gemv/mlp_row.cuh) on a GPU.

Oracles: the reference backend (XLA, f32 sums of the same rounded products) and the two kernels it
replaces (`cuda_matmul.linear` gated with the norm, then with the residual; each held to the
reference by tests/gpu/test_linear_gpu.py), both within the dtype's tolerance for the K split (the
down projection's f32 sums are added in another order: not the same bits); the N split gives the two
kernels' bits. Also: f16 / bf16, with and without the norm and the residual, the ~1B / ~8B shapes
and a small one; bitwise repeatability; a decode-like loop captured in a command buffer; what the handler and the op refuse; sessions of batch 1 whose
MLPs run as one kernel generating the two-kernel session's tokens.
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

# (name, H, I): the ~1B and ~8B Llama MLPs and a small one (a grid of 64 CTAs).
SHAPES = [("1b", 2048, 8192), ("8b", 4096, 14336), ("small", 1024, 4096)]
DTYPES = [jnp.float16, jnp.bfloat16]


@functools.cache
def _operands(h, inter, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed + h + inter), 5)
    x = jax.random.normal(keys[0], (1, h), dtype)
    w_gu = (jax.random.normal(keys[1], (2 * inter, h), jnp.float32) / math.sqrt(h)).astype(dtype)
    w_down = (jax.random.normal(keys[2], (h, inter), jnp.float32) / math.sqrt(inter)).astype(dtype)
    gamma = (1 + 0.1 * jax.random.normal(keys[3], (h,), jnp.float32)).astype(dtype)
    residual = jax.random.normal(keys[4], (1, h), dtype)
    return x, w_gu, w_down, gamma, residual


@functools.cache
def _fn(backend, norm, residual, split="k"):
    def f(x, w_gu, w_down, gamma, res):
        return ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma if norm else None,
                             residual=res if residual else None, norm_epsilon=1e-5, backend=backend,
                             split=split)
    return jax.jit(f)


@functools.cache
def _two_kernels(norm, residual):
    def f(x, w_gu, w_down, gamma, res):
        hidden = cuda_matmul.linear(x, w_gu, None, None, gamma if norm else None, eps=1e-5, gated=True)
        return cuda_matmul.linear(hidden, w_down, None, res if residual else None)
    return jax.jit(f)


@pytest.mark.parametrize("split", cuda_matmul.GATED_MLP_SPLITS)
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("norm,residual", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_fused_mlp_equals_the_reference_and_the_two_kernels(shape, norm, residual, dtype, split):
    _, h, inter = shape
    assert cuda_matmul.gated_mlp_grid(h, inter, split) > 0
    args = _operands(h, inter, dtype)
    got = np.asarray(_fn("cuda", norm, residual, split)(*args))
    assert np.isfinite(got).all()
    assert_close(got, np.asarray(_fn("reference", norm, residual)(*args)), dtype, err_msg="vs reference")
    two = np.asarray(_two_kernels(norm, residual)(*args))
    if split == "n":  # the dense row kernel's warps and sums in its order: its bits
        np.testing.assert_array_equal(got, two, err_msg="the N split vs the two kernels")
    else:
        assert_close(got, two, dtype, err_msg="vs the two kernels")


@pytest.mark.parametrize("split", cuda_matmul.GATED_MLP_SPLITS)
def test_fused_mlp_is_deterministic(split):
    args = _operands(2048, 8192, jnp.float16, seed=3)
    f = _fn("cuda", True, True, split)
    first = np.asarray(f(*args))
    for _ in range(3):
        assert np.array_equal(np.asarray(f(*args)), first)


def test_auto_takes_the_kernel_for_one_row_and_the_two_calls_otherwise(monkeypatch):
    monkeypatch.delenv(cuda_matmul.GATED_MLP_ENV, raising=False)  # the default: on where the kernels run
    x, w_gu, w_down, gamma, res = _operands(2048, 8192, jnp.bfloat16)
    hlo = jax.jit(lambda x: ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma, residual=res)).lower(x).as_text()
    assert "jax_onnx_attn_gated_mlp" in hlo
    x2 = jnp.concatenate([x, x])
    hlo2 = jax.jit(lambda x: ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma)).lower(x2).as_text()
    assert "jax_onnx_attn_gated_mlp" not in hlo2
    with pytest.raises(NotImplementedError, match="one"):
        ops.gated_mlp(x2, w_gu, w_down, backend="cuda")
    # Two rows through the fallback: each row equals the one-row result within tolerance.
    two = ops.gated_mlp(x2, w_gu, w_down, norm_weight=gamma)
    one = ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma)
    assert_close(np.asarray(two[1:]), np.asarray(one), jnp.bfloat16)


def test_shapes_without_a_grid_fall_back():
    # H = 896 (Qwen2-0.5B's): not a multiple of the 1024 the K split's 16 warps split K into, nor of
    # the N split's 512 (8 warps).
    h, inter = 896, 4864
    assert cuda_matmul.gated_mlp_grid(h, inter, "k") == 0 and cuda_matmul.gated_mlp_grid(h, inter, "n") == 0
    x, w_gu, w_down, gamma, res = _operands(h, inter, jnp.float16)
    got = ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma, residual=res, norm_epsilon=1e-5)
    assert_close(np.asarray(got), np.asarray(_fn("reference", True, True)(x, w_gu, w_down, gamma, res)),
                 jnp.float16)
    with pytest.raises(NotImplementedError, match="geometry"):
        ops.gated_mlp(x, w_gu, w_down, backend="cuda")


@pytest.mark.parametrize("n_split,grid", [(False, 100), (True, 0)])
def test_handler_refuses_a_grid_the_kernel_does_not_take(n_split, grid):
    # The handler checks what it is given, whoever calls it: the K split's 100 CTAs do not divide
    # I / 8 = 1024 gate-up tiles; the N split (the row chain) takes any grid of at least one CTA.
    from jax_onnx_attn._extension import target

    x, w_gu, w_down, _, _ = _operands(2048, 8192, jnp.float16)
    call = jax.ffi.ffi_call(target("gated_mlp"), (jax.ShapeDtypeStruct((1, 2048), jnp.float16),
                                                  jax.ShapeDtypeStruct((100 * 2048,), jnp.float32)))
    ph = jnp.zeros((1,), jnp.float16)
    with pytest.raises(Exception, match="geometry"):
        y, _ = call(x, w_gu, w_down, ph, ph, has_norm=False, has_residual=False, eps=np.float32(1e-5), grid=grid,
                    n_split=n_split)
        np.asarray(y)  # jax raises an FFI handler's error when the result is read


# A decode-like loop in a fresh process (XLA_FLAGS apply): 8 fused MLPs in a fori_loop, x donated.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    h, i = 2048, 8192
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    w_gu = (jax.random.normal(keys[0], (2 * i, h)) / h ** 0.5).astype(jnp.bfloat16)
    w_down = (jax.random.normal(keys[1], (h, i)) / i ** 0.5).astype(jnp.bfloat16)
    gamma = jnp.ones((h,), jnp.bfloat16)
    x0 = jax.random.normal(keys[2], (1, h), jnp.bfloat16)

    def steps(x, backend, pdl):
        def body(_, x):
            return ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma, residual=x, backend=backend, pdl=pdl,
                                 split=SPLIT)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("gated_mlp")


@pytest.mark.parametrize("split", cuda_matmul.GATED_MLP_SPLITS)
def test_loop_is_captured_in_a_command_buffer(tmp_path, split):
    command_buffer.assert_captured(_LOOP.replace("SPLIT", repr(split)), "gated_mlp", tmp_path)


def _kernel_counts(session) -> dict:
    hlo = "\n".join(session.compiled_text("decode"))
    return {t: hlo.count(f'custom_call_target="jax_onnx_attn_{t}"') for t in ("linear", "gated_mlp")}


def test_session_of_batch_one_runs_each_mlp_as_one_kernel(monkeypatch):
    pair = session_switch.sessions_with_switch(monkeypatch, cuda_matmul.GATED_MLP_ENV)
    layers = session_switch.LAYERS
    assert pair.session.lowered.fusions.gated_mlp == layers
    assert pair.got.tokens == pair.want.tokens
    before, after = _kernel_counts(pair.plain), _kernel_counts(pair.session)
    assert before["gated_mlp"] == 0 and after["gated_mlp"] == layers, (before, after)
    assert after["linear"] == before["linear"] - 2 * layers, (before, after)
    ours, want_logits = pair.logits()
    rtol, atol = tolerance(np.float16)
    assert float(np.abs(ours - want_logits).max()) <= atol + rtol * float(np.abs(want_logits).max())
