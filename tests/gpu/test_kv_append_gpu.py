"""The CUDA KV-append kernel on a GPU: values, status, in-place donation and command-buffer capture."""

import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import status
from jax_onnx_attn.testing import hlo_copies_of

import command_buffer
import kv_oracle

pytestmark = pytest.mark.gpu

DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16]
# (B, H, C, D, S): D chosen so rows take the 16-, 8-, 4- and 2-byte copy paths.
SHAPES = [(4, 8, 64, 128, 1), (3, 2, 40, 64, 7), (2, 3, 17, 4, 5), (5, 1, 9, 3, 2), (1, 4, 256, 80, 256)]


def _cuda_append(cache, new, start):
    return jax.jit(lambda c, n, p: ops.kv_append(c, n, p, backend="cuda"))(cache, new, start)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_kernel_equals_reference_with_ragged_starts(dtype, shape):
    b, h, c, d, s = shape
    rng = np.random.default_rng(sum(shape))
    cache = rng.standard_normal((b, h, c, d)).astype(dtype)
    new = rng.standard_normal((b, h, s, d)).astype(dtype)
    start = rng.integers(0, c - s + 1, size=b).astype(np.int32)
    got = _cuda_append(cache, new, start)
    ref = jax.jit(lambda *a: ops.kv_append(*a, backend="reference"))(cache, new, start)
    oracle = kv_oracle.kv_append(cache, new, start)
    for g, r, o in zip(got, ref, oracle):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(r))  # a copy must be bitwise
        np.testing.assert_array_equal(np.asarray(g), o)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_out_of_range_sets_status_and_leaves_cache_intact(dtype):
    b, h, c, d, s = 6, 2, 16, 64, 4
    rng = np.random.default_rng(5)
    cache = rng.standard_normal((b, h, c, d)).astype(dtype)
    new = rng.standard_normal((b, h, s, d)).astype(dtype)
    start = np.array([0, c - s, c - s + 1, c, -1, 2**30], np.int32)
    got_cache, got_status = _cuda_append(cache, new, start)
    want_cache, want_status = kv_oracle.kv_append(cache, new, start)
    np.testing.assert_array_equal(np.asarray(got_status), want_status)
    assert np.asarray(got_status).tolist() == [0, 0, 1, 1, 1, 1]
    np.testing.assert_array_equal(np.asarray(got_cache), want_cache)
    np.testing.assert_array_equal(np.asarray(got_cache)[2:], cache[2:])  # skipped rows untouched
    with pytest.raises(RuntimeError, match="KV write out of range"):
        status.check(got_status)


def test_donation_updates_the_cache_in_place():
    cache = jnp.asarray(np.random.default_rng(0).standard_normal((2, 8, 1024, 128)), jnp.bfloat16)
    new = jnp.ones((2, 8, 1, 128), jnp.bfloat16)
    start = jnp.array([5, 700], jnp.int32)
    step = jax.jit(lambda c, n, p: ops.kv_append(c, n, p, backend="cuda"), donate_argnums=0)
    hlo = step.lower(cache, new, start).compile().as_text()
    assert "custom_call_target=\"jax_onnx_attn_kv_append\"" in hlo
    assert "input_output_alias={ {0}: (0, {}" in hlo
    assert hlo_copies_of(hlo, cache.shape, cache.dtype) == [], "the donated cache was copied"
    pointer = cache.unsafe_buffer_pointer()
    out, flags = step(cache, new, start)
    assert out.unsafe_buffer_pointer() == pointer
    assert cache.is_deleted()
    assert np.asarray(flags).tolist() == [0, 0]
    assert float(out[1, 3, 700, 7]) == 1.0


# The decode-like loop runs in a fresh process so that XLA_FLAGS apply; it prints the name of the
# custom-call instruction so the test can find it in XLA's command-buffer log and thunk dump.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax_onnx_attn import ops

    def steps(cache, start):
        def body(i, carry):
            cache, pos, flags = carry
            new = jnp.full((cache.shape[0], cache.shape[1], 1, cache.shape[3]), i, cache.dtype)
            cache, st = ops.kv_append(cache, new, pos, backend="cuda")
            return cache, pos + 1, flags | st
        return jax.lax.fori_loop(0, 16, body, (cache, start, jnp.zeros_like(start)))

    f = jax.jit(steps, donate_argnums=0)
    cache = jnp.zeros((2, 4, 64, 128), jnp.float16)
    start = jnp.array([0, 10], jnp.int32)
    hlo = f.lower(cache, start).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_kv_append"' in l]
    print("CUSTOM_CALL_NAMES", *names)
    out, pos, flags = f(cache, start)
    out2, pos, flags = f(jnp.zeros_like(out), start)  # replay
    assert int(flags.max()) == 0, flags
    assert float(out2[1, 0, 10 + 15, 0]) == 15.0 and float(out2[0, 0, 0, 0]) == 0.0
    print("LOOP_OK")
""")


def test_handler_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "kv_append", tmp_path)


def test_auto_backend_picks_the_kernel_without_a_conditional_or_copy():
    cache = jnp.zeros((2, 4, 256, 64), jnp.float16)
    new = jnp.ones((2, 4, 3, 64), jnp.float16)
    start = jnp.array([0, 100], jnp.int32)
    step = jax.jit(lambda c, n, p: ops.kv_append(c, n, p), donate_argnums=0)  # backend="auto"
    hlo = step.lower(cache, new, start).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_kv_append"' in hlo
    assert " conditional(" not in hlo, "platform_dependent left a runtime branch"
    assert hlo_copies_of(hlo, cache.shape, cache.dtype) == []
