"""The gated MLP of one decode row on 4-bit weights as one kernel (gated_mlp_nbits:
ffi/handlers/gated_mlp.cu, ffi/kernels/gemv/mlp_nbits.cuh) on a GPU.

Oracles: the two kernels it replaces (the slots kernel on the record layout, gated with the norm,
then on the "onnx" layout with the residual; each held to the reference by
tests/gpu/test_linear_record_gpu.py and test_linear_gpu.py), within the dtype's tolerance (the sums
are added in another order: not the same bits); and the reference backend (XLA over the weights the
layouts give back), within the dtype's tolerance of the output's scale: the reference rounds every
dequantised weight to the dtype, the slots kernels (and this one) do not, and through two
projections that moves a bf16 output by up to ~0.04 on outputs of ~3 (H100, session 41). Also: f16 / bf16, with and without the norm,
the residual and zero points, block sizes 32 and 128, the ~1B / ~8B shapes and a small one; bitwise
repeatability; a decode-like loop captured in a command buffer; what the handler and the op refuse;
a batch-1 session of a 4-bit model whose MLPs run as one kernel.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.testing import assert_close, tolerance

import command_buffer
from nbits_cases import nbits_weights

pytestmark = pytest.mark.gpu

# (name, H, I): the ~1B and ~8B Llama MLPs (grids 128 and 112 on 132 SMs) and a small one.
SHAPES = [("1b", 2048, 8192), ("8b", 4096, 14336), ("small", 512, 2048)]
DTYPES = [jnp.float16, jnp.bfloat16]


@functools.cache
def _operands(h, inter, dtype, block=32, zp=True, seed=0):
    dt = jnp.dtype(dtype)
    gate = nbits_weights(inter, h, block, zp, seed=seed + 1, dtype=dt)
    up = nbits_weights(inter, h, block, zp, seed=seed + 2, dtype=dt)
    down = nbits_weights(h, inter, block, zp, seed=seed + 3, dtype=dt)
    gu = ops.interleave_gate_up_nbits(list(gate), list(up))
    keys = jax.random.split(jax.random.PRNGKey(seed + h + inter), 3)
    x = jax.random.normal(keys[0], (1, h), dtype)
    gamma = (1 + 0.1 * jax.random.normal(keys[1], (h,), jnp.float32)).astype(dtype)
    residual = jax.random.normal(keys[2], (1, h), dtype)
    return dict(gu=gu, down=down, gu_rec=jnp.asarray(ops.to_record_layout(*gu)),
                dn_rec=jnp.asarray(ops.to_slice_record_layout(*down)), x=x, gamma=gamma, residual=residual,
                block=block)


@functools.cache
def _fn(backend, norm, residual, block):
    def f(x, gu_rec, dn_rec, gamma, res):
        return ops.gated_mlp_nbits(x, gu_rec, dn_rec, block_size=block, norm_weight=gamma if norm else None,
                                   residual=res if residual else None, norm_epsilon=1e-5, backend=backend)
    return jax.jit(f)


def _two_kernels(o, norm, residual):
    h, inter = o["x"].shape[1], o["dn_rec"].shape[1] * 64
    hidden = cuda_matmul.matmul_nbits_record(o["x"], o["gu_rec"], None, None, o["gamma"] if norm else None,
                                             n=2 * inter, block_size=o["block"], eps=1e-5, gated=True)
    b, s, z = o["down"]
    return ops.matmul_nbits(hidden, jnp.asarray(b), jnp.asarray(s), None if z is None else jnp.asarray(z), k=inter,
                            n=h, bits=4, block_size=o["block"], residual=o["residual"] if residual else None,
                            backend="cuda")


def _args(o):
    return o["x"], o["gu_rec"], o["dn_rec"], o["gamma"], o["residual"]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("norm,residual", [(True, True), (False, False), (True, False), (False, True)])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_fused_mlp_equals_the_reference_and_the_two_kernels(shape, norm, residual, dtype):
    _, h, inter = shape
    assert cuda_matmul.gated_mlp_nbits_grid(h, inter) > 0
    o = _operands(h, inter, dtype)
    got = np.asarray(_fn("cuda", norm, residual, o["block"])(*_args(o)))
    assert np.isfinite(got).all()
    assert_close(got, np.asarray(_two_kernels(o, norm, residual)), dtype, err_msg="vs the two kernels")
    _near_reference(got, np.asarray(_fn("reference", norm, residual, o["block"])(*_args(o))), dtype)


def _near_reference(got, want, dtype):
    """Within the dtype's rtol of the output's scale (the module doc: the reference's rounded weights)."""
    rtol, _ = tolerance(dtype)
    np.testing.assert_allclose(got.astype(np.float64), want.astype(np.float64), rtol=rtol,
                               atol=rtol * float(np.abs(want.astype(np.float64)).max()), err_msg="vs reference")


@pytest.mark.parametrize("block,zp", [(128, False), (32, False), (128, True)])
def test_block_sizes_and_zero_points(block, zp):
    o = _operands(2048, 8192, jnp.bfloat16, block=block, zp=zp, seed=1)
    got = np.asarray(_fn("cuda", True, True, block)(*_args(o)))
    assert_close(got, np.asarray(_two_kernels(o, True, True)), jnp.bfloat16, err_msg="vs the two kernels")
    _near_reference(got, np.asarray(_fn("reference", True, True, block)(*_args(o))), jnp.bfloat16)


def test_fused_mlp_is_deterministic():
    o = _operands(4096, 14336, jnp.float16, seed=3)
    f = _fn("cuda", True, True, o["block"])
    first = np.asarray(f(*_args(o)))
    for _ in range(3):
        assert np.array_equal(np.asarray(f(*_args(o))), first)


def test_auto_takes_the_kernel_for_one_row_under_the_switch(monkeypatch):
    o = _operands(2048, 8192, jnp.bfloat16)
    x, gu_rec, dn_rec, gamma, _ = _args(o)

    def lower(x):
        return jax.jit(lambda x: ops.gated_mlp_nbits(x, gu_rec, dn_rec, block_size=32, norm_weight=gamma)).lower(
            x).as_text()

    monkeypatch.delenv(cuda_matmul.GATED_MLP_NBITS_ENV, raising=False)  # off by default: untimed
    assert "jax_onnx_attn_gated_mlp_nbits" not in lower(x)
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "1")
    assert "jax_onnx_attn_gated_mlp_nbits" in lower(x)
    x2 = jnp.concatenate([x, x])
    assert "jax_onnx_attn_gated_mlp_nbits" not in lower(x2)  # a prompt: the reference
    with pytest.raises(NotImplementedError, match="one"):
        ops.gated_mlp_nbits(x2, gu_rec, dn_rec, block_size=32, backend="cuda")
    two = ops.gated_mlp_nbits(x2, gu_rec, dn_rec, block_size=32, norm_weight=gamma)  # the reference
    one = ops.gated_mlp_nbits(x, gu_rec, dn_rec, block_size=32, norm_weight=gamma)
    _near_reference(np.asarray(one), np.asarray(two[1:]), jnp.bfloat16)


def test_handler_refuses_a_grid_the_kernel_does_not_take():
    # 100 CTAs do not divide I / 8 = 1024 gate-up tiles.
    from jax_onnx_attn._extension import target

    o = _operands(2048, 8192, jnp.float16)
    call = jax.ffi.ffi_call(target("gated_mlp_nbits"), (jax.ShapeDtypeStruct((1, 2048), jnp.float16),
                                                        jax.ShapeDtypeStruct((100 * 2048,), jnp.float32)))
    ph = jnp.zeros((1,), jnp.float16)
    with pytest.raises(Exception, match="geometry"):
        y, _ = call(o["x"], o["gu_rec"], o["dn_rec"], ph, ph, has_norm=False, has_residual=False,
                    eps=np.float32(1e-5), grid=100)
        np.asarray(y)  # jax raises an FFI handler's error when the result is read


# A decode-like loop in a fresh process (XLA_FLAGS apply): 8 fused MLPs in a fori_loop, x donated.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops
    from jax_onnx_attn.ops import cuda_matmul

    h, i, block = 2048, 8192, 32
    rng = np.random.default_rng(0)

    # prepare_nbits' form, scales ~ 1 / (16 sqrt(K)). The oracle is the two kernels it replaces: the
    # reference rounds the dequantised weights, ~0.02 of max|x| a step apart (H100, session 41:
    # tools/probes/nbits_loop_diag.py, fused vs two kernels 0.0000 after 4 steps, 0.0023 after 8).
    def weights(n, k):
        return (rng.integers(0, 256, (n, k // block, block // 2), dtype=np.uint8),
                (rng.uniform(0.5, 1.5, (n, k // block)) / (16 * np.sqrt(k))).astype(jnp.bfloat16),
                rng.integers(0, 16, (n, k // block), dtype=np.uint8))

    gu = ops.interleave_gate_up_nbits(list(weights(i, h)), list(weights(i, h)))
    gu_rec = jnp.asarray(ops.to_record_layout(*gu))
    gamma = jnp.ones((h,), jnp.bfloat16)
    x0 = jax.random.normal(jax.random.PRNGKey(0), (1, h), jnp.bfloat16)

    down = weights(h, i)
    dn_rec = jnp.asarray(ops.to_slice_record_layout(*down))

    def steps(x, backend, pdl):
        def body(_, x):
            if backend == "two":  # the two slots kernels it replaces (their semantics: exact weights)
                hid = cuda_matmul.matmul_nbits_record(x, gu_rec, None, None, gamma, n=2 * i, block_size=block,
                                                      gated=True)
                return ops.matmul_nbits(hid, *(jnp.asarray(a) for a in down), k=i, n=h, bits=4,
                                        block_size=block, residual=x, backend="cuda")
            return ops.gated_mlp_nbits(x, gu_rec, dn_rec, block_size=block, norm_weight=gamma, residual=x,
                                       backend=backend)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("gated_mlp_nbits", oracle="two")


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "gated_mlp_nbits", tmp_path)


def test_session_of_batch_one_runs_each_mlp_as_one_kernel(monkeypatch):
    # A 4-bit decoder (the record layout at batch 1): with JOA_GATED_MLP_NBITS=1 each layer's MLP is
    # one launch, and the logits of the plain session's sequence stay within the dtype's tolerance.
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig
    from jax_onnx_attn.runtime import DecoderSession

    layers = 2
    model = build_decoder(DecoderConfig(layers=layers, hidden=1024, heads=8, kv_heads=2, intermediate=4096,
                                        vocab=512, dtype="float16", weight_bits=4, block_size=32))
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "0")
    plain = DecoderSession(model, max_length=64, batch=1)
    want = plain.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=16)
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "1")
    session = DecoderSession(model, max_length=64, batch=1)
    assert session.lowered.fusions.gated_mlp_nbits == layers
    got = session.generate([[1, 2, 3, 4, 5, 6]], max_new_tokens=16)
    hlo = "\n".join(session.compiled_text("decode"))  # compiled by generate
    assert hlo.count('custom_call_target="jax_onnx_attn_gated_mlp_nbits"') == layers
    sequence = want.sequences[0]
    ours, theirs = session.logits(sequence, 6), plain.logits(sequence, 6)
    rtol, atol = tolerance(np.float16)
    assert float(np.abs(ours - theirs).max()) <= atol + rtol * float(np.abs(theirs).max())
    assert got.tokens[0][:4] == want.tokens[0][:4]  # near-ties of random weights may part later
