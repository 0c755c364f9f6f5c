"""ops.gated_mlp (a gated MLP: the fused kernel for one row on a GPU, tests/gpu/test_gated_mlp_gpu.py)
on the CPU: the reference against a NumPy oracle that rounds where the graph rounds, the two-call
route it takes where the kernel does not run, and the errors that name the bad operand."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from jax_onnx_attn import ops
from jax_onnx_attn.testing import assert_close


def _operands(h=64, inter=96, lead=(1,), dtype=np.float16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal(lead + (h,)).astype(dtype)
    w_gate = (rng.standard_normal((inter, h)) / np.sqrt(h)).astype(dtype)
    w_up = (rng.standard_normal((inter, h)) / np.sqrt(h)).astype(dtype)
    w_down = (rng.standard_normal((h, inter)) / np.sqrt(inter)).astype(dtype)
    gamma = (1 + 0.1 * rng.standard_normal(h)).astype(dtype)
    residual = rng.standard_normal(lead + (h,)).astype(dtype)
    return x, w_gate, w_up, w_down, gamma, residual


def _oracle(x, w_gate, w_up, w_down, gamma, residual, eps):
    """f64 products, rounded to x's dtype where the graph rounds (norm, gate, up, activation, down,
    residual)."""
    dt = x.dtype
    f = lambda a: np.asarray(a, np.float64)
    xf = f(x)
    n = (xf / np.sqrt(np.mean(xf ** 2, axis=-1, keepdims=True) + eps) * f(gamma)).astype(dt)
    g = (f(n) @ f(w_gate).T).astype(dt)
    u = (f(n) @ f(w_up).T).astype(dt)
    h = (f(g) / (1 + np.exp(-f(g))) * f(u)).astype(dt)
    y = (f(h) @ f(w_down).T).astype(dt)
    return (f(y) + f(residual)).astype(dt)


@pytest.mark.parametrize("lead", [(1,), (3,), (2, 2)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_gated_mlp_equals_the_rounded_oracle(lead, dtype):
    x, w_gate, w_up, w_down, gamma, residual = _operands(lead=lead, dtype=dtype)
    got = ops.gated_mlp(x, ops.interleave_gate_up(w_gate, w_up), w_down, residual=residual,
                        norm_weight=gamma, norm_epsilon=1e-5)
    assert got.shape == x.shape and got.dtype == x.dtype
    assert_close(np.asarray(got), _oracle(x, w_gate, w_up, w_down, gamma, residual, 1e-5), dtype)


def test_gated_mlp_is_the_two_linear_calls():
    x, w_gate, w_up, w_down, gamma, residual = _operands()
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    for norm, res in ((gamma, residual), (None, None), (gamma, None), (None, residual)):
        got = ops.gated_mlp(x, w_gu, w_down, residual=res, norm_weight=norm, norm_epsilon=1e-5)
        hidden = ops.linear(x, w_gu, norm_weight=norm, norm_epsilon=1e-5, gated=True)
        want = ops.linear(hidden, w_down, residual=res)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_gated_mlp_errors_name_the_operand():
    x, w_gate, w_up, w_down, gamma, residual = _operands()
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    with pytest.raises(ValueError, match="w_down must be"):
        ops.gated_mlp(x, w_gu, w_down.T)
    with pytest.raises(ValueError, match="w_gate_up must be"):
        ops.gated_mlp(x, w_gu[:, :32], w_down)
    with pytest.raises(ValueError, match="w_down must be a matrix of x's dtype"):
        ops.gated_mlp(x, w_gu, w_down.astype(np.float32))
    with pytest.raises(ValueError, match="residual must be"):
        ops.gated_mlp(x, w_gu, w_down, residual=residual[:, :32])
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        ops.gated_mlp(x, w_gu, w_down, norm_weight=gamma[:32])
    with pytest.raises(ValueError, match="K=60"):
        ops.gated_mlp(x[:, :60], w_gu, w_down)


def test_backend_cuda_says_why_it_cannot_run_here():
    x, w_gate, w_up, w_down, _, _ = _operands()
    with pytest.raises(NotImplementedError, match="gated_mlp: backend='cuda'"):
        ops.gated_mlp(x, ops.interleave_gate_up(w_gate, w_up), w_down, backend="cuda")


def test_gated_mlp_traces_under_jit_and_vmap():
    x, w_gate, w_up, w_down, gamma, residual = _operands(lead=(1,))
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    f = jax.jit(lambda x, r: ops.gated_mlp(x, w_gu, w_down, residual=r, norm_weight=gamma, norm_epsilon=1e-5))
    one = f(jnp.asarray(x), jnp.asarray(residual))
    xs = jnp.stack([jnp.asarray(x)] * 3)
    rs = jnp.stack([jnp.asarray(residual)] * 3)
    many = jax.vmap(f)(xs, rs)
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(many[i]), np.asarray(one))


def test_the_split_switch_and_each_splits_grid(monkeypatch):
    from jax_onnx_attn.ops import cuda_matmul

    monkeypatch.delenv(cuda_matmul.GATED_MLP_SPLIT_ENV, raising=False)
    assert cuda_matmul.gated_mlp_split() == "k"
    monkeypatch.setenv(cuda_matmul.GATED_MLP_SPLIT_ENV, "n")
    assert cuda_matmul.gated_mlp_split() == "n"
    monkeypatch.setenv(cuda_matmul.GATED_MLP_SPLIT_ENV, "rows")
    with pytest.raises(ValueError, match=cuda_matmul.GATED_MLP_SPLIT_ENV):
        cuda_matmul.gated_mlp_split()
    x, w_gate, w_up, w_down, _, _ = _operands()
    with pytest.raises(ValueError, match="split must be one of"):
        ops.gated_mlp(x, ops.interleave_gate_up(w_gate, w_up), w_down, split="m")
    # The plan is host code, in every build: on 132 SMs the K split takes the most CTAs dividing the
    # I / 8 gate-up tiles, the N split (the row chain's rule) those that also divide the H / 16 down
    # tiles here.
    from jax_onnx_attn import _ffi

    for h, inter in ((2048, 8192), (4096, 14336)):
        k_grid, n_grid = _ffi.gated_mlp_grid(h, inter, 132, False), _ffi.gated_mlp_grid(h, inter, 132, True)
        assert 0 < k_grid <= 132 and (inter // 8) % k_grid == 0
        assert n_grid == 128 and (inter // 8) % n_grid == 0 and (h // 16) % n_grid == 0
        assert _ffi.gated_mlp_workspace(h, inter, k_grid, False) == k_grid * h
        assert _ffi.gated_mlp_workspace(h, inter, n_grid, True) == inter // 2
    assert _ffi.gated_mlp_grid(896, 4864, 132, True) == 0  # H not a multiple of 8 warps x 64
