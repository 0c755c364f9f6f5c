"""The read-ahead of the one-row projection kernels on a GPU (`linear(read_ahead=)`,
`linear_gqa_prepare(read_ahead=)`, `onnx.fusion` pass 7): each CTA past its last tile asks the L2 for
its share of the next kernel's weight (ptx::PrefetchL2Share), which changes no value.

Oracles: the same call without the read-ahead (the same bits: the hint touches no register, shared
memory or output), the reference for the loop, and the plain session's tokens and logits. Also: the
handler refuses bytes past the operand whoever calls it; a decode-like loop with read-aheads runs
inside a command buffer.
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

import command_buffer
import session_switch

pytestmark = pytest.mark.gpu

MIB = 1 << 20
# (name, N, K, gated, norm, residual): a ~1B layer's one-row projections.
PROJECTIONS = [("qkv", 3072, 2048, False, True, False), ("o", 2048, 2048, False, False, True),
               ("gate-up", 16384, 2048, True, True, False), ("down", 2048, 8192, False, False, True)]


@functools.cache
def _operands(n, k, gated, dtype, seed=0):
    keys = jax.random.split(jax.random.PRNGKey(seed + n + k), 5)
    x = jax.random.normal(keys[0], (1, k), dtype)
    w = (jax.random.normal(keys[1], (n, k), jnp.float32) / math.sqrt(k)).astype(dtype)
    gamma = (1 + 0.1 * jax.random.normal(keys[2], (k,), jnp.float32)).astype(dtype)
    residual = jax.random.normal(keys[3], (1, n // 2 if gated else n), dtype)
    following = jax.random.normal(keys[4], (8192, 2048), dtype)  # a 32 MiB "next weight"
    return x, w, gamma, residual, following


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
@pytest.mark.parametrize("name,n,k,gated,norm,residual", PROJECTIONS)
def test_read_ahead_gives_the_same_bits(name, n, k, gated, norm, residual, dtype):
    x, w, gamma, res, following = _operands(n, k, gated, dtype)

    @functools.partial(jax.jit, static_argnums=0)
    def f(nbytes, x, w, gamma, res, following):
        return ops.linear(x, w, norm_weight=gamma if norm else None, residual=res if residual else None,
                          gated=gated, backend="cuda", pdl=True,
                          read_ahead=following if nbytes else None, read_ahead_bytes=nbytes)

    want = np.asarray(f(0, x, w, gamma, res, following))
    for nbytes in (16, 4 * MIB, following.nbytes):
        np.testing.assert_array_equal(np.asarray(f(nbytes, x, w, gamma, res, following)), want,
                                      err_msg=f"{name} read_ahead_bytes={nbytes}")


def test_rows_kernels_take_the_operand_and_ignore_it():
    # Four rows run the ring kernel, which does not read ahead: the operand passes, the bits hold.
    x, w, gamma, res, following = _operands(2048, 2048, False, jnp.float16)
    x4 = jnp.tile(x, (4, 1))
    want = ops.linear(x4, w, norm_weight=gamma, backend="cuda")
    got = ops.linear(x4, w, norm_weight=gamma, backend="cuda", read_ahead=following, read_ahead_bytes=4 * MIB)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_handler_refuses_bytes_past_the_operand():
    # The handler checks what it is given, whoever calls it (the wrapper refuses this at trace time).
    from jax_onnx_attn._extension import target

    x, w, _, _, following = _operands(2048, 2048, False, jnp.float16)
    call = jax.ffi.ffi_call(target("linear"), jax.ShapeDtypeStruct((1, 2048), jnp.float16))
    ph = jnp.zeros((1,), jnp.float16)
    with pytest.raises(Exception, match="read_ahead_bytes"):
        y = call(x, w, ph, ph, ph, following, has_bias=False, has_residual=False, has_norm=False, gated=False,
                 eps=np.float32(1e-6), cluster=0, warps_k=0, pdl=False, slots=True,
                 read_ahead_bytes=np.int64(following.nbytes + 16))
        np.asarray(y)  # jax raises an FFI handler's error when the result is read


# A decode-like loop in a fresh process (XLA_FLAGS apply): 8 projections in a fori_loop, each
# reading ahead the next one's weight, x donated.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    h = 2048
    keys = jax.random.split(jax.random.PRNGKey(0), 4)
    w = (jax.random.normal(keys[0], (2, h, h)) / h ** 0.5).astype(jnp.bfloat16)
    gamma = jnp.ones((h,), jnp.bfloat16)
    x0 = jax.random.normal(keys[2], (1, h), jnp.bfloat16)

    def steps(x, backend, pdl):
        def body(i, x):
            return ops.linear(x, w[i % 2], norm_weight=gamma, residual=x, backend=backend, pdl=pdl,
                              read_ahead=w[(i + 1) % 2], read_ahead_bytes=4 << 20)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("linear")


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "linear", tmp_path)


def test_session_of_batch_one_reads_ahead_and_generates_the_same_tokens(monkeypatch):
    pair = session_switch.sessions_with_switch(monkeypatch, cuda_matmul.READ_AHEAD_ENV)
    # Per layer qkv -> o -> gate-up -> down -> the next qkv (the last down -> the LM head).
    assert pair.session.lowered.fusions.read_ahead == 4 * session_switch.LAYERS
    assert pair.plain.lowered.fusions.read_ahead == 0
    assert "read_ahead_bytes" in "\n".join(pair.session.compiled_text("decode"))
    assert pair.got.tokens == pair.want.tokens
    ours, plain = pair.logits()
    np.testing.assert_array_equal(np.asarray(ours), np.asarray(plain))
