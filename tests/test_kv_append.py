"""Reference KV append (CPU): values against a NumPy oracle, the status, donation, and input errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from hypothesis import given, settings, strategies as hst

from jax_onnx_attn import ops
from jax_onnx_attn.ops import status
from jax_onnx_attn.ops.dtypes import FLOAT_DTYPES
from jax_onnx_attn.testing import hlo_copies_of

import kv_oracle

DTYPES = FLOAT_DTYPES


def _random(rng, shape, dtype):
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
def test_matches_oracle_with_ragged_and_out_of_range_starts(dtype):
    rng = np.random.default_rng(0)
    b, h, c, d, s = 5, 2, 16, 8, 3
    cache = _random(rng, (b, h, c, d), dtype)
    new = _random(rng, (b, h, s, d), dtype)
    start = np.array([0, 7, c - s, c - s + 1, -1], np.int32)  # last two do not fit
    want_cache, want_status = kv_oracle.kv_append(cache, new, start)
    with _x64(dtype == np.float64):
        got_cache, got_status = jax.jit(ops.kv_append)(cache, new, start)
        np.testing.assert_array_equal(np.asarray(got_cache), want_cache)  # a copy: bitwise
    np.testing.assert_array_equal(np.asarray(got_status), want_status)
    assert status.describe(got_status) == [f"batch 3: {status._NAMES[1]}", f"batch 4: {status._NAMES[1]}"]


def _x64(enabled):
    """float64 needs x64 mode; `jax.enable_x64` is the spelling on both supported jax versions."""
    return jax.enable_x64(enabled) if hasattr(jax, "enable_x64") else jax.experimental.enable_x64(enabled)


@settings(max_examples=25, deadline=None)
@given(b=hst.integers(1, 3), s=hst.integers(1, 5), c=hst.integers(5, 9), data=hst.data())
def test_random_shapes_and_starts(b, s, c, data):
    start = np.array(data.draw(hst.lists(hst.integers(-2, c), min_size=b, max_size=b)), np.int32)
    rng = np.random.default_rng(int(start.sum()) + 7)
    cache = _random(rng, (b, 2, c, 4), np.float32)
    new = _random(rng, (b, 2, s, 4), np.float32)
    want_cache, want_status = kv_oracle.kv_append(cache, new, start)
    got_cache, got_status = ops.kv_append(cache, new, start, backend="reference")
    np.testing.assert_array_equal(np.asarray(got_cache), want_cache)
    np.testing.assert_array_equal(np.asarray(got_status), want_status)


def test_donated_cache_is_updated_without_a_copy():
    cache = jnp.zeros((2, 2, 32, 8), jnp.float32)
    new = jnp.ones((2, 2, 1, 8), jnp.float32)
    start = jnp.array([3, 9], jnp.int32)
    step = jax.jit(lambda c, n, p: ops.kv_append(c, n, p), donate_argnums=0)
    hlo = step.lower(cache, new, start).compile().as_text()
    assert "input_output_alias={ {0}: (0, {}" in hlo
    assert hlo_copies_of(hlo, cache.shape, cache.dtype) == []
    out, flags = step(cache, new, start)
    assert cache.is_deleted()
    assert np.asarray(flags).tolist() == [0, 0]
    assert float(out[1, 0, 9, 0]) == 1.0 and float(out[1, 0, 8, 0]) == 0.0


def test_works_under_vmap():
    rng = np.random.default_rng(1)
    cache = _random(rng, (3, 2, 2, 6, 4), np.float32)  # extra leading axis of 3
    new = _random(rng, (3, 2, 2, 2, 4), np.float32)
    start = np.array([[0, 4], [5, 1], [2, 2]], np.int32)
    got_cache, got_status = jax.vmap(ops.kv_append)(cache, new, start)
    for i in range(3):
        want_cache, want_status = kv_oracle.kv_append(cache[i], new[i], start[i])
        np.testing.assert_array_equal(np.asarray(got_cache[i]), want_cache)
        np.testing.assert_array_equal(np.asarray(got_status[i]), want_status)


@pytest.mark.parametrize("cache_shape,new_shape,start,dtype,match", [
    ((2, 2, 8), (2, 2, 1, 4), [0, 0], np.float32, "cache must be"),
    ((2, 2, 8, 4), (2, 2, 4), [0, 0], np.float32, "new must be"),
    ((2, 2, 8, 4), (2, 3, 1, 4), [0, 0], np.float32, "does not match cache"),
    ((2, 2, 8, 4), (2, 2, 9, 4), [0, 0], np.float32, "more than the cache capacity"),
    ((2, 2, 8, 4), (2, 2, 1, 4), [0], np.float32, "start must be"),
    ((2, 2, 8, 4), (2, 2, 1, 4), [0, 0], np.int32, "cache must be one of"),
])
def test_bad_inputs_name_the_input(cache_shape, new_shape, start, dtype, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ops.kv_append(np.zeros(cache_shape, dtype), np.zeros(new_shape, dtype), np.array(start, np.int32))


def test_dtype_mismatch_is_rejected():
    with pytest.raises(TypeError, match="new has dtype float16 but cache has float32"):
        ops.kv_append(np.zeros((1, 1, 4, 4), np.float32), np.zeros((1, 1, 1, 4), np.float16),
                      np.zeros((1,), np.int32))


def test_hlo_copy_detector_sees_a_copy_without_donation():
    """The no-copy assertion above can fail: without donation XLA must copy the cache."""
    cache = jnp.zeros((2, 2, 32, 8), jnp.float32)
    step = jax.jit(lambda c, n, p: ops.kv_append(c, n, p))
    hlo = step.lower(cache, jnp.ones((2, 2, 1, 8)), jnp.array([3, 9], jnp.int32)).compile().as_text()
    assert "input_output_alias" not in hlo
    assert len(hlo_copies_of(hlo, cache.shape, cache.dtype)) == 1
