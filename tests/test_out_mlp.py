"""ops.out_mlp (the attention's output projection and the gated MLP: one persistent kernel for one row
on a GPU, tests/gpu/test_out_mlp_gpu.py) on the CPU: the reference against a NumPy oracle that rounds
where the graph rounds, the two calls it takes where the kernel does not run, the errors that name
the bad operand, the kernel's grid rule (host code, in every build) and the session switch (the
fusion pass: tests/test_fusion.py)."""

from __future__ import annotations

import numpy as np
import pytest

import jax
import jax.numpy as jnp

import jax_onnx_attn
from jax_onnx_attn import ops
from jax_onnx_attn.testing import assert_close

import session_switch
from test_gated_mlp import _operands, _oracle as _mlp_oracle


def _o_operands(h=64, ho=32, lead=(1,), dtype=np.float16, seed=1):
    rng = np.random.default_rng(seed)
    a = rng.standard_normal(lead + (ho,)).astype(dtype)
    w_o = (rng.standard_normal((h, ho)) / np.sqrt(ho)).astype(dtype)
    return a, w_o


@pytest.mark.parametrize("lead", [(1,), (3,)])
@pytest.mark.parametrize("dtype", [np.float16, np.float32])
def test_out_mlp_equals_the_rounded_oracle(lead, dtype):
    x, w_gate, w_up, w_down, gamma, _ = _operands(lead=lead, dtype=dtype)
    a, w_o = _o_operands(lead=lead, dtype=dtype)
    got = ops.out_mlp(a, w_o, x, ops.interleave_gate_up(w_gate, w_up), w_down, norm_weight=gamma,
                      norm_epsilon=1e-5)
    assert got.shape == x.shape and got.dtype == x.dtype
    f = lambda v: np.asarray(v, np.float64)
    x1 = ((f(a) @ f(w_o).T).astype(dtype).astype(np.float64) + f(x)).astype(dtype)
    assert_close(np.asarray(got), _mlp_oracle(x1, w_gate, w_up, w_down, gamma, x1, 1e-5), dtype)


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_out_mlp_is_the_linear_and_gated_mlp_calls(backend):
    x, w_gate, w_up, w_down, gamma, _ = _operands()
    a, w_o = _o_operands()
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    for norm in (gamma, None):
        got = ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=norm, norm_epsilon=1e-5, backend=backend)
        x1 = ops.linear(a, w_o, residual=x, backend=backend)
        want = ops.gated_mlp(x1, w_gu, w_down, residual=x1, norm_weight=norm, norm_epsilon=1e-5, backend=backend)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_out_mlp_errors_name_the_operand():
    x, w_gate, w_up, w_down, gamma, _ = _operands()
    a, w_o = _o_operands()
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    with pytest.raises(ValueError, match="w_o must be"):
        ops.out_mlp(a, w_o.T, x, w_gu, w_down)
    with pytest.raises(ValueError, match="out_mlp: a: K=28"):
        ops.out_mlp(a[:, :28], w_o[:, :28], x, w_gu, w_down)
    with pytest.raises(TypeError, match="out_mlp: a must be one of"):
        ops.out_mlp(a.astype(np.int32), w_o, x, w_gu, w_down)
    with pytest.raises(ValueError, match="out_mlp: x must be"):
        ops.out_mlp(a[0], w_o, x[0, 0], w_gu, w_down)  # a scalar x
    with pytest.raises(TypeError, match="x must have a's dtype"):
        ops.out_mlp(a, w_o, x.astype(np.float32), w_gu, w_down)
    with pytest.raises(ValueError, match="x must be"):
        ops.out_mlp(a, w_o, np.concatenate([x, x]), w_gu, w_down)
    with pytest.raises(ValueError, match="w_down must be"):
        ops.out_mlp(a, w_o, x, w_gu, w_down[:, :-8])
    with pytest.raises(ValueError, match="norm_weight"):
        ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma[:-1])


def test_the_kernel_routes_reference_is_the_two_calls(monkeypatch):
    # Where "auto" takes the kernel's route off a CUDA platform, its reference function runs: the
    # same roundings as the two calls (the other tests here take the two calls themselves).
    import importlib

    from jax_onnx_attn._extension import has_cuda

    linear_ops = importlib.import_module("jax_onnx_attn.ops.linear")  # ops.linear is the function
    if has_cuda():
        pytest.skip("a CUDA build would trace the kernel's branch (these shapes have no grid)")
    monkeypatch.setattr(linear_ops, "_out_mlp_unsupported", lambda *args: None)
    x, w_gate, w_up, w_down, gamma, _ = _operands(dtype=np.float32)
    a, w_o = _o_operands(dtype=np.float32)
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    for norm in (gamma, None):
        got = ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=norm, norm_epsilon=1e-5)
        x1 = ops.linear(a, w_o, residual=x, backend="reference")
        want = ops.gated_mlp(x1, w_gu, w_down, residual=x1, norm_weight=norm, norm_epsilon=1e-5,
                             backend="reference")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_backend_cuda_says_why_it_cannot_run_here():
    x, w_gate, w_up, w_down, _, _ = _operands()
    a, w_o = _o_operands()
    with pytest.raises(NotImplementedError, match="out_mlp: backend='cuda'"):
        ops.out_mlp(a, w_o, x, ops.interleave_gate_up(w_gate, w_up), w_down, backend="cuda")


def test_out_mlp_traces_under_jit_and_vmap():
    x, w_gate, w_up, w_down, gamma, _ = _operands()
    a, w_o = _o_operands()
    w_gu = ops.interleave_gate_up(w_gate, w_up)
    one = ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma)
    jitted = jax.jit(lambda a, x: ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma))(a, x)
    np.testing.assert_array_equal(np.asarray(jitted), np.asarray(one))
    many = jax.vmap(lambda a, x: ops.out_mlp(a, w_o, x, w_gu, w_down, norm_weight=gamma))(
        jnp.stack([a, a]), jnp.stack([x, x]))
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(many[i]), np.asarray(one))


def test_the_chains_grid_and_workspace():
    # The plan is host code, in every build: on 132 SMs the most CTAs dividing every phase's 16-row
    # tiles (o H / 16, gate-up 2 I / 16, down H / 16), 0 where a K is not a multiple of 8 warps x 64.
    from jax_onnx_attn import _ffi

    for h, ho, inter in ((2048, 2048, 8192), (4096, 4096, 14336)):
        grid = _ffi.out_mlp_grid(h, ho, inter, 132)
        assert grid == 128 and (h // 16) % grid == 0 and (2 * inter // 16) % grid == 0
        assert _ffi.out_mlp_workspace(h, inter) == (h + inter + 1) // 2
    # The least W streamed by the busiest CTA over the phases (each ends at a barrier), the fewest CTAs
    # among equals: 94 CTAs (2 / 11 / 2 tiles) on 100 SMs, not 64 (2 / 16 / 2); every CTA where a
    # divisor of the tile counts is as good; uneven where it is not (H 3584, I 18944: 32 would divide).
    assert _ffi.out_mlp_grid(2048, 2048, 8192, 100) == 94
    assert _ffi.out_mlp_grid(1024, 1024, 4096, 132) == 128  # o / down 64 tiles: half the CTAs idle there
    assert _ffi.out_mlp_grid(3584, 3584, 18944, 132) == 132
    assert _ffi.out_mlp_grid(896, 896, 4864, 132) == 0  # Qwen2-0.5B: H not a multiple of 512
    assert _ffi.out_mlp_grid(2048, 2048, 8192, 0) == 0


def _tiny(dtype="float16"):
    from jax_onnx_attn.models import build_tiny_decoder

    return build_tiny_decoder(layers=2, hidden=128, heads=2, kv_heads=1, intermediate=96, dtype=dtype)


def test_tensor_parallel_plans_refuse_it():
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel

    with pytest.raises(ValueError, match="out_mlp"):
        plan_tensor_parallel(jax_onnx_attn.load(_tiny("f32"), gated_mlp=True, out_mlp=True), 2)


def test_sessions_of_one_row_take_it_under_the_switch_with_the_same_tokens(monkeypatch):
    from jax_onnx_attn.ops import cuda_matmul
    from jax_onnx_attn.runtime.session import out_mlp_for

    monkeypatch.setenv(cuda_matmul.GATED_MLP_ENV, "1")  # out_mlp fuses on top of the fused MLP
    session_switch.check_load_switch(monkeypatch, cuda_matmul.OUT_MLP_ENV, out_mlp_for, "out_mlp")