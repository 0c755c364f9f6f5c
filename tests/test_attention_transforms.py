"""ops.attention under jax.vmap and jax.jit, and the fixed-capacity form `attention_with_cache`.

Oracles: vmap must equal the op applied to each slice; the fixed-capacity form must equal the
functional form with past = the valid rows of the cache (itself checked against the ONNX cases and
onnxruntime); a decode loop must reproduce full causal attention over the whole sequence.
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import status
from jax_onnx_attn.testing import assert_close

STATIC = ("is_causal", "scale", "softcap", "q_num_heads", "kv_num_heads", "qk_matmul_output_mode",
          "softmax_precision", "left_window_size", "right_window_size", "opset", "return_qk")
_attention = jax.jit(ops.attention, static_argnames=STATIC)
_cached = jax.jit(ops.attention_with_cache, static_argnames=STATIC)


def _normal(r, shape, dtype=np.float32):
    return r.standard_normal(shape).astype(dtype)


def _to_3d(x):
    """[B, H, S, d] -> [B, S, H * d]."""
    return x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)


# ---------------------------------------------------------------------------------------------------
# vmap
# ---------------------------------------------------------------------------------------------------

VMAP_CONFIGS = {
    "4d-past-mask-causal-qk": dict(
        shapes=dict(Q=(2, 4, 3, 8), K=(2, 2, 3, 8), V=(2, 2, 3, 6), past_key=(2, 2, 4, 8),
                    past_value=(2, 2, 4, 6), attn_mask=(4, 3, 7)),
        attrs=dict(is_causal=1, softcap=4.0, qk_matmul_output_mode=2, return_qk=True, opset=23)),
    "3d-nonpad-window": dict(
        shapes=dict(Q=(2, 4, 16), K=(2, 6, 8), V=(2, 6, 12), nonpad_kv_seqlen=(2,)),
        attrs=dict(is_causal=1, q_num_heads=2, kv_num_heads=1, left_window_size=2, opset=25)),
}


@pytest.mark.parametrize("name", VMAP_CONFIGS)
def test_vmap_equals_per_example(name):
    """vmap over an extra leading axis equals stacking the op's per-example results."""
    config, r, n = VMAP_CONFIGS[name], np.random.default_rng(0), 3
    inputs = {}
    for key, shape in config["shapes"].items():
        if key == "nonpad_kv_seqlen":
            inputs[key] = r.integers(0, 7, size=(n,) + shape).astype(np.int32)
        else:
            inputs[key] = _normal(r, (n,) + shape)
    attrs = config["attrs"]
    mapped = jax.jit(jax.vmap(lambda kw: ops.attention(**kw, **attrs)))(inputs)
    for i in range(n):
        single = _attention(**{k: v[i] for k, v in inputs.items()}, **attrs)
        for field, got, want in zip(single._fields, mapped, single):
            if want is None:
                assert got is None, field
            else:
                assert_close(got[i], want, err_msg=f"{name} example {i} {field}")


def test_vmap_with_shared_mask():
    """in_axes=None for the mask: one mask broadcast over the mapped axis."""
    r = np.random.default_rng(1)
    q, k, v = _normal(r, (3, 1, 2, 4, 8)), _normal(r, (3, 1, 2, 5, 8)), _normal(r, (3, 1, 2, 5, 8))
    mask = r.random((4, 5)) < 0.7
    mapped = jax.vmap(lambda q, k, v, m: ops.attention(q, k, v, m).y, in_axes=(0, 0, 0, None))
    got = jax.jit(mapped)(q, k, v, mask)
    for i in range(3):
        assert_close(got[i], _attention(q[i], k[i], v[i], mask).y)


# ---------------------------------------------------------------------------------------------------
# Fixed-capacity form
# ---------------------------------------------------------------------------------------------------

CACHE_CONFIGS = {
    "f32-4d-causal-window-mask-softmax": dict(
        dtype=np.float32, three_d=False, mask="float",
        attrs=dict(is_causal=1, left_window_size=3, softcap=5.0, qk_matmul_output_mode=3,
                   return_qk=True, opset=25)),
    "f16-3d-boolmask-bias": dict(
        dtype=np.float16, three_d=True, mask="bool",
        attrs=dict(qk_matmul_output_mode=2, return_qk=True, softmax_precision=1)),
    "bf16-4d-causal": dict(dtype=ml_dtypes.bfloat16, three_d=False, mask=None,
                           attrs=dict(is_causal=1, scale=0.2)),
}


def _cache_problem(dtype, three_d, mask_kind, seed=0, lengths=(0, 3, 5), s=2, capacity=9):
    r = np.random.default_rng(seed)
    b, hq, hkv, d, dv = len(lengths), 4, 2, 8, 6
    q, k, v = _normal(r, (b, hq, s, d), dtype), _normal(r, (b, hkv, s, d), dtype), \
        _normal(r, (b, hkv, s, dv), dtype)
    # Stale data past each valid length: it must never leak into the result.
    key_cache = _normal(r, (b, hkv, capacity, d), dtype) * np.array(100, dtype)
    value_cache = _normal(r, (b, hkv, capacity, dv), dtype) * np.array(100, dtype)
    mask = None
    if mask_kind == "float":
        mask = _normal(r, (b, 1, s, capacity), dtype)
    elif mask_kind == "bool":
        mask = r.random((b, 1, s, capacity)) < 0.75
    call = dict(Q=q, K=k, V=v, key_cache=key_cache, value_cache=value_cache,
                cache_lengths=np.array(lengths, np.int32), attn_mask=mask)
    if three_d:
        call.update(Q=_to_3d(q), K=_to_3d(k), V=_to_3d(v))
    return call


@pytest.mark.parametrize("name", CACHE_CONFIGS)
def test_cache_form_equals_functional_with_past(name):
    """Per batch row b: attention_with_cache == attention(past = key_cache[b, :, :len_b])."""
    config = CACHE_CONFIGS[name]
    call = _cache_problem(config["dtype"], config["three_d"], config["mask"])
    attrs = dict(config["attrs"])
    if config["three_d"]:
        attrs.update(q_num_heads=4, kv_num_heads=2)
    out = _cached(**call, **attrs)
    lengths, s = call["cache_lengths"], 2

    np.testing.assert_array_equal(out.status, np.zeros(len(lengths), np.int32))
    np.testing.assert_array_equal(out.cache_lengths, lengths + s)
    for b, n in enumerate(lengths):
        one = {key: call[key][b:b + 1] for key in ("Q", "K", "V")}
        mask = None if call["attn_mask"] is None else call["attn_mask"][b:b + 1, ..., :n + s]
        want = _attention(**one, attn_mask=mask, past_key=call["key_cache"][b:b + 1, :, :n],
                          past_value=call["value_cache"][b:b + 1, :, :n], **attrs)
        label = f"{name} batch {b} (length {n})"
        assert_close(out.y[b:b + 1], want.y, err_msg=label)
        # The caches hold the old rows then the new ones (= the functional present), and the stale
        # rows after them untouched.
        np.testing.assert_array_equal(np.asarray(out.key_cache[b, :, :n + s]), want.present_key[0])
        np.testing.assert_array_equal(np.asarray(out.value_cache[b, :, :n + s]),
                                      want.present_value[0])
        np.testing.assert_array_equal(np.asarray(out.key_cache[b, :, n + s:]),
                                      call["key_cache"][b, :, n + s:])
        if want.qk is not None:
            qk = np.asarray(out.qk[b:b + 1])
            assert_close(qk[..., :n + s], want.qk, err_msg=label + " qk")
            beyond = qk[..., n + s:]  # keys past the valid length are masked
            masked = -np.inf if attrs["qk_matmul_output_mode"] == 2 else 0.0
            assert np.all(beyond == masked), label


def test_cache_overflow_is_flagged_and_skipped():
    """A row whose new rows do not fit is not written, keeps its length, gets y = 0 and a flag."""
    call = _cache_problem(np.float32, False, None, lengths=(8, 2), capacity=9)
    out = _cached(**call, is_causal=1)
    np.testing.assert_array_equal(out.status, [status.KV_WRITE_OUT_OF_RANGE, status.OK])
    np.testing.assert_array_equal(out.cache_lengths, [8, 4])
    np.testing.assert_array_equal(np.asarray(out.key_cache[0]), call["key_cache"][0])
    np.testing.assert_array_equal(np.asarray(out.value_cache[0]), call["value_cache"][0])
    np.testing.assert_array_equal(np.asarray(out.y[0]), 0.0)
    want = _attention(call["Q"][1:], call["K"][1:], call["V"][1:], is_causal=1,
                      past_key=call["key_cache"][1:, :, :2], past_value=call["value_cache"][1:, :, :2])
    assert_close(out.y[1:], want.y)


def test_decode_loop_reproduces_full_causal_attention():
    """Prefill 4 tokens then decode 5 one at a time with donated caches: every step reuses one
    executable, the caches are aliased in place, and each output row equals full causal attention
    over the whole 9-token sequence."""
    r = np.random.default_rng(5)
    b, hq, hkv, total, prompt, d, capacity = 2, 4, 1, 9, 4, 8, 12
    q, k, v = _normal(r, (b, hq, total, d)), _normal(r, (b, hkv, total, d)), \
        _normal(r, (b, hkv, total, d))
    full = _attention(q, k, v, is_causal=1).y

    traces = []

    def step(q, k, v, key_cache, value_cache, lengths):
        traces.append(q.shape)  # runs at trace time only
        out = ops.attention_with_cache(q, k, v, key_cache, value_cache, lengths, is_causal=1)
        return out.y, out.key_cache, out.value_cache, out.cache_lengths

    jitted = jax.jit(step, donate_argnums=(3, 4))
    key_cache = jnp.zeros((b, hkv, capacity, d))
    value_cache = jnp.zeros((b, hkv, capacity, d))
    lengths = jnp.zeros(b, jnp.int32)
    rows = []
    for start, stop in [(0, prompt)] + [(t, t + 1) for t in range(prompt, total)]:
        y, key_cache, value_cache, lengths = jitted(q[:, :, start:stop], k[:, :, start:stop],
                                                    v[:, :, start:stop], key_cache, value_cache,
                                                    lengths)
        rows.append(y)
    assert traces == [(b, hq, prompt, d), (b, hq, 1, d)]  # no retrace per decode step
    np.testing.assert_array_equal(lengths, [total, total])
    assert_close(jnp.concatenate(rows, axis=2), full)

    hlo = jitted.lower(q[:, :, :1], k[:, :, :1], v[:, :, :1], key_cache, value_cache,
                       lengths).compile().as_text()
    aliases = re.search(r"input_output_alias=\{(.*?) \}", hlo)  # { {1}: (3, {}, may-alias), ... }
    assert aliases and "(3," in aliases.group(1) and "(4," in aliases.group(1), \
        "the donated caches (arguments 3 and 4) are not aliased to outputs"


# ---------------------------------------------------------------------------------------------------
# Backend selection
# ---------------------------------------------------------------------------------------------------

def test_backends():
    """"auto" runs the reference on the CPU (the kernels on a GPU); "cuda" says why it does not take
    a call."""
    r = np.random.default_rng(2)
    q, k, v = _normal(r, (1, 2, 3, 8)), _normal(r, (1, 2, 4, 8)), _normal(r, (1, 2, 4, 8))
    auto = _attention(q, k, v, is_causal=1).y
    reference = jax.jit(lambda q, k, v: ops.attention(q, k, v, is_causal=1, backend="reference").y)
    if jax.default_backend() == "cpu":
        np.testing.assert_array_equal(auto, reference(q, k, v))
    else:
        assert_close(auto, reference(q, k, v))
    prefill = _normal(r, (1, 2, 65, 8))
    with pytest.raises(NotImplementedError, match="more than 64 query rows"):
        ops.attention(prefill, k, v, backend="cuda")
