"""What onnxruntime's CPU GroupQueryAttention lacks, checked against the same math built another way.

- bfloat16 (onnxruntime: NOT_IMPLEMENTED): our bf16 op against onnxruntime in float32 on the same
  (exactly upcast) inputs, with the bf16 tolerance.
- q/k norm weights (onnxruntime CPU: rejected): our op against onnxruntime without them, fed the
  query and key RMS-normalised beforehand in float64 NumPy.
- Sliding-window cache extras (qk_output, KV-shared layers, right-padded first prompts): against our
  full-cache path (itself parity-tested against onnxruntime) holding the same positions.
- The reference pieces (rotary, RMS norm, quantisation) against NumPy written from their formulas,
  and the in-place update of a donated shared buffer.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import group_query_attention
from jax_onnx_attn.ops.reference import quant
from jax_onnx_attn.ops.reference.gqa import resident_length
from jax_onnx_attn.ops.reference.norm import rms_norm
from jax_onnx_attn.ops.reference.rotary import rotary_embedding
from jax_onnx_attn.testing import assert_close, hlo_copies_of
from ort_gqa import Case, assert_matches, make_inputs, ort_reference, run_ours

BF16 = np.dtype(ml_dtypes.bfloat16)
W = "local_window_size"
SLIDING = (("sliding_window_cache", 1),)


def _as_f32(inputs: dict) -> dict:
    return {k: v.astype(np.float32) if isinstance(v, np.ndarray) and v.dtype == BF16 else v
            for k, v in inputs.items()}


BF16_CASES = [
    Case(dtype="bfloat16", batch=3, seq=35, heads=(6, 3), head_size=64, rotary="half",
         head_sink=True, packed=True, attrs=((W, 7), ("softcap", 50.0))),
    Case(dtype="bfloat16", batch=3, seq=1, past=64, step="decode", heads=(9, 3), head_size=32,
         bias=(2, 1), attrs=(("qk_output", 2), ("smooth_softmax", 1))),
    Case(dtype="bfloat16", batch=1, seq=16, past=48, step="chunk", cache="grow", heads=(32, 8),
         head_size=128, rotary="interleaved", position_ids=True),
    Case(dtype="bfloat16", batch=3, seq=1, past=6, total_len=30, step="decode", rotary="half",
         attrs=SLIDING + ((W, 4),)),
    Case(dtype="bfloat16", batch=3, seq=1, past=40, step="decode", kv_shared=True, bias=(1, 2)),
    Case(dtype="bfloat16", batch=3, seq=1, past=32, step="decode", quant=(8, "PER_CHANNEL")),
]


@pytest.mark.parametrize("case", BF16_CASES, ids=Case.id)
def test_bfloat16_against_onnxruntime_float32(case):
    for draw in range(3):
        inputs = make_inputs(case, draw)
        ours = run_ours(case, inputs)
        ref = ort_reference(dataclasses.replace(case, dtype="float32"), _as_f32(inputs))
        what = f"{case.id()} draw {draw}"
        assert ours.output.dtype == jnp.bfloat16
        assert_close(ours.output, ref["output"], BF16, err_msg=what)
        if case.quant:
            # K/V round to bf16 before quantisation: a code may sit one step off float32's.
            diff = np.asarray(ours.present_key).astype(int) - ref["present_key"].astype(int)
            assert np.abs(diff).max() <= 1, what
        else:
            assert_close(ours.present_key, ref["present_key"], BF16, err_msg=what)
            assert_close(ours.present_value, ref["present_value"], BF16, err_msg=what)
        if "output_qk" in ref:
            assert_close(ours.output_qk, ref["output_qk"], BF16, err_msg=what)


def _rms_norm_np(x, w, eps):
    x64 = x.astype(np.float64)
    return x64 / np.sqrt(np.mean(x64 ** 2, axis=-1, keepdims=True) + eps) * w.astype(np.float64)


def _normalise_heads(x, heads, d, w, eps, dtype):
    b, s, _ = x.shape
    y = _rms_norm_np(x.reshape(b, s, heads, d), w, eps)
    return y.reshape(b, s, heads * d).astype(dtype)


QK_NORM_CASES = [
    Case(batch=3, seq=12, heads=(6, 3), head_size=32, rotary="half",
         attrs=((W, 5), ("softcap", 30.0))),
    Case(batch=3, seq=1, past=40, step="decode", heads=(9, 3), head_size=64, rotary="interleaved"),
    Case(dtype="float16", batch=1, seq=8, past=32, step="chunk", heads=(4, 2), head_size=32,
         packed=True, rotary="half", position_ids=True),
    Case(dtype="bfloat16", batch=3, seq=1, past=24, step="decode", heads=(6, 3), head_size=32,
         rotary="half", attrs=(("softcap", 2.0),)),
]


@pytest.mark.parametrize("case", QK_NORM_CASES, ids=Case.id)
def test_qk_norm_is_rms_norm_of_q_and_k_before_rotary(case):
    n, hkv = case.heads
    d = case.head_size
    eps = 1e-5
    rng = np.random.default_rng(7)
    for draw in range(2):
        inputs = make_inputs(case, draw)
        dt = inputs["query"].dtype
        qw = rng.uniform(0.5, 1.5, d).astype(dt)
        kw = rng.uniform(0.5, 1.5, d).astype(dt)
        ours = jax.jit(lambda x: group_query_attention(
            **x, q_norm_weight=qw, k_norm_weight=kw, total_sequence_length=case.total,
            shared_buffer=case.past > 0 and case.cache == "shared", qk_norm_epsilon=eps,
            **case.attributes()))({k: v for k, v in inputs.items() if k != "total_sequence_length"})
        # The oracle: onnxruntime (f32 for bf16) without norm weights on pre-normalised Q and K.
        ort_dt = np.float32 if dt == BF16 else dt
        pre = _as_f32(inputs) if dt == BF16 else dict(inputs)
        if case.packed:
            q, k, v = np.split(inputs["query"], [n * d, (n + hkv) * d], axis=-1)
            pre["query"] = np.concatenate([_normalise_heads(q, n, d, qw, eps, dt),
                                           _normalise_heads(k, hkv, d, kw, eps, dt), v],
                                          axis=-1).astype(ort_dt)
        else:
            pre["query"] = _normalise_heads(inputs["query"], n, d, qw, eps, dt).astype(ort_dt)
            pre["key"] = _normalise_heads(inputs["key"], hkv, d, kw, eps, dt).astype(ort_dt)
        ref = ort_reference(dataclasses.replace(case, dtype=np.dtype(ort_dt).name), pre)
        assert_close(ours.output, ref["output"], dt, err_msg=f"{case.id()} draw {draw}")
        assert_close(ours.present_key, ref["present_key"], dt, err_msg=f"{case.id()} draw {draw}")


def test_separate_q_and_k_norm_epsilons():
    """q_norm_epsilon / k_norm_epsilon (onnxruntime 1.32) override qk_norm_epsilon per side."""
    case = Case(batch=2, seq=6, heads=(4, 2), head_size=16)
    inputs = make_inputs(case, 0)
    w = np.ones(16, np.float32)
    # Q and K scaled down so that the epsilons matter.
    small = dict(inputs, query=inputs["query"] * 1e-2, key=inputs["key"] * 1e-2)
    run = lambda **eps: np.asarray(group_query_attention(
        **small, q_norm_weight=w, k_norm_weight=w, **case.attributes(), **eps).output)
    both = run(qk_norm_epsilon=1e-6, q_norm_epsilon=1e-2, k_norm_epsilon=1e-3)
    np.testing.assert_array_equal(both, run(qk_norm_epsilon=1e-2, k_norm_epsilon=1e-3))
    assert np.abs(both - run(qk_norm_epsilon=1e-6)).max() > 1e-2   # the override matters


# ---- sliding-window cache: the same positions held by a full cache give the same results ----

def _full_and_window(rng, b, hkv, d, t, capacity, window, dtype=np.float32):
    """A full cache holding positions [0, t_b) and the windowed cache onnxruntime's layout derives
    from it (rows [0, L) = positions t_b - L ... t_b - 1)."""
    full = rng.standard_normal((b, hkv, int(t.max()) + 8, d)).astype(dtype)
    win = rng.standard_normal((b, hkv, capacity, d)).astype(dtype)
    for i, ti in enumerate(t):
        keep = int(resident_length(np.int32(ti), capacity, window))
        win[i, :, :keep] = full[i, :, ti - keep:ti]
    return full, win


@pytest.mark.parametrize("qk_output", [1, 2])
def test_sliding_window_cache_qk_output(qk_output):
    """onnxruntime: not implemented. Ours puts each resident row's score at its absolute column."""
    rng = np.random.default_rng(3)
    b, s, n, hkv, d, cap, w = 3, 2, 4, 2, 16, 6, 4
    past = np.array([9, 3, 14])                      # tokens before this step
    full_k, win_k = _full_and_window(rng, b, hkv, d, past, cap, w)
    full_v, win_v = _full_and_window(rng, b, hkv, d, past, cap, w)
    total = int(past.max()) + s
    common = dict(query=rng.standard_normal((b, s, n * d)).astype(np.float32),
                  key=rng.standard_normal((b, s, hkv * d)).astype(np.float32),
                  value=rng.standard_normal((b, s, hkv * d)).astype(np.float32),
                  seqlens_k=(past + s - 1).astype(np.int32), total_sequence_length=total,
                  num_heads=n, kv_num_heads=hkv, local_window_size=w, qk_output=qk_output)
    ref = group_query_attention(**common, past_key=full_k, past_value=full_v, shared_buffer=True)
    got = group_query_attention(**common, past_key=win_k, past_value=win_v, sliding_window_cache=1)
    assert_close(got.output, ref.output, np.float32)
    assert_close(got.output_qk, ref.output_qk, np.float32)
    for i in range(b):
        t = int(past[i]) + s
        keep = int(resident_length(np.int32(t), cap, w))
        assert_close(np.asarray(got.present_key)[i, :, :keep],
                     np.asarray(ref.present_key)[i, :, t - keep:t], np.float32)


def test_sliding_window_cache_kv_shared_layer():
    """onnxruntime: not supported. Key/value with 0 rows read the resident window as it is."""
    rng = np.random.default_rng(4)
    b, s, n, hkv, d, cap, w = 3, 1, 4, 2, 16, 8, 5
    t = np.array([20, 6, 9])
    full_k, win_k = _full_and_window(rng, b, hkv, d, t, cap, w)
    full_v, win_v = _full_and_window(rng, b, hkv, d, t, cap, w)
    empty = np.zeros((b, 0, hkv * d), np.float32)
    common = dict(query=rng.standard_normal((b, s, n * d)).astype(np.float32), key=empty,
                  value=empty, seqlens_k=(t - 1).astype(np.int32),
                  total_sequence_length=int(t.max()), num_heads=n, kv_num_heads=hkv,
                  local_window_size=w)
    ref = group_query_attention(**common, past_key=full_k, past_value=full_v, shared_buffer=True)
    got = group_query_attention(**common, past_key=win_k, past_value=win_v, sliding_window_cache=1)
    assert_close(got.output, ref.output, np.float32)
    np.testing.assert_array_equal(np.asarray(got.present_key), win_k)   # nothing appended


def test_sliding_window_cache_right_padded_first_prompt():
    """onnxruntime rejects T_b < S here. Ours: padding rows never enter the window."""
    rng = np.random.default_rng(5)
    b, s, n, hkv, d, cap, w = 3, 10, 4, 2, 16, 6, 4
    t = np.array([10, 4, 7])
    common = dict(query=rng.standard_normal((b, s, n * d)).astype(np.float32),
                  key=rng.standard_normal((b, s, hkv * d)).astype(np.float32),
                  value=rng.standard_normal((b, s, hkv * d)).astype(np.float32),
                  seqlens_k=(t - 1).astype(np.int32), total_sequence_length=s,
                  num_heads=n, kv_num_heads=hkv, local_window_size=w)
    zeros = lambda c: np.zeros((b, hkv, c, d), np.float32)
    ref = group_query_attention(**common, past_key=zeros(s), past_value=zeros(s), shared_buffer=True)
    got = group_query_attention(**common, past_key=zeros(cap), past_value=zeros(cap),
                                sliding_window_cache=1)
    assert_close(got.output, ref.output, np.float32)
    for i, ti in enumerate(t):
        keep = int(resident_length(np.int32(ti), cap, w))
        assert_close(np.asarray(got.present_key)[i, :, :keep],
                     np.asarray(ref.present_key)[i, :, ti - keep:ti], np.float32)


def test_no_visible_key_gives_zero():
    """local_window_size=0: every row is fully masked. onnxruntime f32 gives 0 (its flash path)
    and NaN elsewhere; ours gives 0 in every dtype, probabilities 0 too."""
    for dtype in ("float32", "float16", "bfloat16"):
        case = Case(dtype=dtype, batch=2, seq=5, heads=(4, 2), head_size=16,
                    attrs=((W, 0), ("qk_output", 2)))
        inputs = make_inputs(case, 1)
        ours = run_ours(case, inputs)
        np.testing.assert_array_equal(np.asarray(ours.output, np.float32), 0)
        np.testing.assert_array_equal(np.asarray(ours.output_qk, np.float32), 0)
        if dtype != "bfloat16":
            # Where onnxruntime has 0 or NaN, ours has 0 (assert_matches' rule).
            assert_matches(case, inputs, ours, ort_reference(case, inputs))


def test_shared_buffer_is_updated_in_place_when_donated():
    """A donated fixed-capacity cache is written in place: no copy of it in the compiled step."""
    case = Case(batch=2, seq=1, past=64, step="decode", heads=(4, 2), head_size=32, rotary="half")
    inputs = make_inputs(case, 0)
    arrays = {k: v for k, v in inputs.items() if k != "total_sequence_length"}
    past_k, past_v = arrays.pop("past_key"), arrays.pop("past_value")

    def step(pk, pv, x):
        r = group_query_attention(past_key=pk, past_value=pv, **x, total_sequence_length=64,
                                  shared_buffer=True, **case.attributes())
        return r.present_key, r.present_value, r.output

    hlo = jax.jit(step, donate_argnums=(0, 1)).lower(past_k, past_v, arrays).compile().as_text()
    assert hlo_copies_of(hlo, past_k.shape, past_k.dtype) == []
    got = jax.jit(step, donate_argnums=(0, 1))(jnp.asarray(past_k), jnp.asarray(past_v), arrays)
    ref = ort_reference(case, inputs)
    assert_close(got[0], ref["present_key"], np.float32)
    assert_close(got[2], ref["output"], np.float32)


# ---- the reference pieces against NumPy written from their formulas ----

@pytest.mark.parametrize("interleaved", [False, True])
def test_rotary_embedding_against_numpy(interleaved):
    rng = np.random.default_rng(6)
    b, h, s, d, r = 2, 3, 5, 32, 16
    x = rng.standard_normal((b, h, s, d)).astype(np.float32)
    angles = rng.uniform(0, 2 * np.pi, (40, r // 2))
    pos = rng.integers(0, 40, (b, s))
    cos, sin = np.cos(angles), np.sin(angles)
    want = x.astype(np.float64).copy()
    c, sn = cos[pos][:, None], sin[pos][:, None]                    # [b, 1, s, r/2]
    i1 = np.arange(0, r, 2) if interleaved else np.arange(r // 2)
    i2 = i1 + 1 if interleaved else i1 + r // 2
    want[..., i1] = x[..., i1] * c - x[..., i2] * sn
    want[..., i2] = x[..., i2] * c + x[..., i1] * sn
    got = rotary_embedding(x, cos.astype(np.float32), sin.astype(np.float32), pos,
                           interleaved=interleaved)
    assert_close(got, want, np.float32)
    # Per-token cos/sin (positions=None) is the same rotation.
    per_token = rotary_embedding(x, cos[pos].astype(np.float32), sin[pos].astype(np.float32),
                                 interleaved=interleaved)
    np.testing.assert_array_equal(np.asarray(per_token), np.asarray(got))


def test_rms_norm_against_numpy():
    rng = np.random.default_rng(8)
    x = rng.standard_normal((3, 4, 32)).astype(np.float16)
    w = rng.uniform(0.5, 1.5, 32).astype(np.float16)
    got = rms_norm(x, w, 1e-5)
    assert got.dtype == jnp.float16
    assert_close(got, _rms_norm_np(x, w, 1e-5), np.float16)
    assert_close(rms_norm(x.astype(np.float32), None, 1e-5, axis=(-2, -1)),
                 x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=(-2, -1), keepdims=True) + 1e-5),
                 np.float32)


@pytest.mark.parametrize("bits", [8, 4])
def test_quantize_against_numpy(bits):
    rng = np.random.default_rng(9)
    qmax = 127 if bits == 8 else 7
    scale = np.float32(0.05)
    x = (rng.integers(-2 * qmax, 2 * qmax, (2, 3, 4, 16)) / 2 * scale).astype(np.float32)  # ties
    codes = np.clip(np.rint(x * (np.float32(1) / scale)), -qmax - 1, qmax).astype(np.int32)
    got = np.asarray(quant.quantize(x, scale, bits))
    if bits == 8:
        np.testing.assert_array_equal(got, codes.astype(np.int8))
    else:
        packed = ((codes[..., 0::2] + 8) | ((codes[..., 1::2] + 8) << 4)).astype(np.uint8)
        np.testing.assert_array_equal(got, packed)
    back = quant.dequantize(got, scale, bits, jnp.float32)
    np.testing.assert_array_equal(np.asarray(back), codes.astype(np.float32) * scale)
    # A zero scale counts as 1.
    np.testing.assert_array_equal(np.asarray(quant.quantize(x, np.float32(0), bits)),
                                  np.asarray(quant.quantize(x, np.float32(1), bits)))
