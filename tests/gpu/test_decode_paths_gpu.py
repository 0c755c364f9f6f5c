"""The operators' CUDA decode paths (ops/decode_paths.py) against their reference backends:
GroupQueryAttention decode / verify steps on a shared fixed-capacity cache, and ai.onnx Attention's
fixed-capacity form `attention_with_cache`. Also: "auto" picks the kernels on a GPU, uncovered calls
fall back (auto) or raise (cuda), and a donated GQA cache is updated in place."""

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import decode_paths
from jax_onnx_attn.testing import assert_close, hlo_copies_of

from gqa_decode_cases import gqa_inputs as _gqa_inputs
from gqa_decode_cases import quant_attrs

pytestmark = pytest.mark.gpu

BF16, F16 = ml_dtypes.bfloat16, np.float16


@functools.cache
def _gqa_jit(backend, **attrs):
    def f(inp):
        return ops.group_query_attention(**inp, **attrs, shared_buffer=True, backend=backend)
    return jax.jit(f)


def _gqa_compare(inp, **attrs):
    attrs = dict(attrs)
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    attrs["total_sequence_length"] = inp["total_sequence_length"]
    cuda_step = _gqa_jit("cuda", **attrs)
    lowered = cuda_step.lower(arrays).as_text()  # one preparation launch, no separate appends
    assert "jax_onnx_attn_gqa_prepare" in lowered and "jax_onnx_attn_kv_append" not in lowered
    got = cuda_step(arrays)
    want = _gqa_jit("reference", **attrs)(arrays)
    dtype = inp["query"].dtype
    assert_close(np.asarray(got.output), np.asarray(want.output), dtype)
    assert_close(np.asarray(got.present_key), np.asarray(want.present_key), dtype)
    assert_close(np.asarray(got.present_value), np.asarray(want.present_value), dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert np.asarray(got.status)[-1] != 0 and not np.asarray(got.output)[-1].astype(np.float32).any()


GQA_FEATURES = list(itertools.product(
    [1, 4],                                   # S (decode, verify)
    [True, False],                            # packed QKV
    [0, 1, 2],                                # rotary: none, half-split, interleaved
    [(-1, 0.0), (33, 0.0), (-1, 30.0)],       # (local_window_size, softcap)
    ["none", "sink", "smooth", "bias", "norm"],
))


@pytest.mark.parametrize("s,packed,rotary,window_softcap,extra", GQA_FEATURES[::3])
def test_gqa_decode_bf16(s, packed, rotary, window_softcap, extra):
    window, softcap = window_softcap
    inp = _gqa_inputs(s * 7 + rotary, BF16, s=s, packed=packed, rotary=rotary, bias=extra == "bias",
                      sink=extra == "sink", norm=extra == "norm")
    _gqa_compare(inp, num_heads=16, kv_num_heads=4, local_window_size=window, softcap=softcap,
                 do_rotary=int(rotary > 0), rotary_interleaved=int(rotary == 2),
                 smooth_softmax=1 if extra == "smooth" else -1)


@pytest.mark.parametrize("d", [64, 80, 96, 256])
@pytest.mark.parametrize("causal", [1, 0])
def test_gqa_decode_f16_head_dims(d, causal):
    inp = _gqa_inputs(d, F16, s=2, n=8, hkv=2, d=d, rotary=1 if d % 32 == 0 else 0, sink=True)
    _gqa_compare(inp, num_heads=8, kv_num_heads=2, causal=causal,
                 do_rotary=int(d % 32 == 0), local_window_size=-1)


@pytest.mark.parametrize("rotary", [1, 2])
def test_gqa_decode_f16_position_ids_and_norm(rotary):
    inp = _gqa_inputs(40 + rotary, F16, s=3, n=32, hkv=8, d=128, rotary=rotary, norm=True,
                      position_ids=True, packed=rotary == 1)
    _gqa_compare(inp, num_heads=32, kv_num_heads=8, do_rotary=1, rotary_interleaved=int(rotary == 2))


def test_gqa_auto_uses_the_kernels_and_updates_the_cache_in_place():
    inp = _gqa_inputs(1, BF16, b=2, cap=1024, rotary=1)
    inp["seqlens_k"] = np.array([10, 700], np.int32)
    arrays = {k: jnp.asarray(v) for k, v in inp.items() if k != "total_sequence_length"}
    attrs = dict(num_heads=16, kv_num_heads=4, do_rotary=1, total_sequence_length=1000,
                 shared_buffer=True)

    def step(past_key, past_value, rest):
        return ops.group_query_attention(past_key=past_key, past_value=past_value, **rest, **attrs)

    rest = {k: v for k, v in arrays.items() if k not in ("past_key", "past_value")}
    f = jax.jit(step, donate_argnums=(0, 1))
    hlo = f.lower(arrays["past_key"], arrays["past_value"], rest).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_decode_attention"' in hlo
    assert 'custom_call_target="jax_onnx_attn_gqa_prepare"' in hlo
    assert 'custom_call_target="jax_onnx_attn_kv_append"' not in hlo
    assert hlo_copies_of(hlo, arrays["past_key"].shape, arrays["past_key"].dtype) == []
    want = jax.jit(lambda pk, pv, r: ops.group_query_attention(past_key=pk, past_value=pv, **r, **attrs,
                                                               backend="reference"))(
        arrays["past_key"], arrays["past_value"], rest)
    pointer = arrays["past_key"].unsafe_buffer_pointer()
    got = f(arrays["past_key"], arrays["past_value"], rest)
    assert got.present_key.unsafe_buffer_pointer() == pointer
    assert_close(np.asarray(got.output), np.asarray(want.output), BF16)


@pytest.mark.parametrize("s", [1, 4])
@pytest.mark.parametrize("bits,quant_type", [(8, "PER_TENSOR"), (8, "PER_CHANNEL"), (4, "PER_TENSOR"),
                                             (4, "PER_CHANNEL")])
def test_gqa_decode_quantised_cache(bits, quant_type, s):
    """int8 / int4 caches end to end on the kernels (gqa_prepare quantises the new rows, the engine
    dequantises in its load path) against the operator's reference. Present caches may differ by
    one level where XLA's GPU reciprocal of the scale rounds differently from the kernel's IEEE one."""
    inp = _gqa_inputs(bits * 3 + s, BF16 if s == 1 else F16, s=s, n=32, hkv=8, d=128, rotary=1,
                      kv_bits=bits, quant_type=quant_type)
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    attrs = dict(num_heads=32, kv_num_heads=8, do_rotary=1,
                 total_sequence_length=inp["total_sequence_length"], **quant_attrs(bits, quant_type))
    cuda_step = _gqa_jit("cuda", **attrs)
    lowered = cuda_step.lower(arrays).as_text()
    assert "jax_onnx_attn_gqa_prepare" in lowered and "jax_onnx_attn_decode_attention" in lowered
    got, want = cuda_step(arrays), _gqa_jit("reference", **attrs)(arrays)
    dtype = inp["query"].dtype
    assert_close(np.asarray(got.output), np.asarray(want.output), dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    for name in ("present_key", "present_value"):
        g, w = np.asarray(getattr(got, name)), np.asarray(getattr(want, name))
        if bits == 4:  # compare levels, not packed bytes
            g = np.stack([g & 15, g >> 4], -1)
            w = np.stack([w & 15, w >> 4], -1)
        diff = np.abs(g.astype(np.int32) - w.astype(np.int32))
        assert diff.max() <= 1 and (diff > 0).mean() < 1e-3, name


@pytest.mark.parametrize("s,window_softcap,extra,dtype", [
    (100, (-1, 0.0), "none", BF16), (260, (-1, 0.0), "sink", F16), (100, (70, 0.0), "norm", BF16),
    (130, (-1, 30.0), "smooth", F16)])
def test_gqa_chunk_on_a_filled_cache(s, window_softcap, extra, dtype):
    """More than MAX_QUERY_ROWS new rows on a filled cache (a later prompt chunk): gqa_prepare appends
    them, the prefill engine attends from each row's position (rotary, windows, softcap, sinks, q/k
    norm); the last batch row refused (status set, output 0)."""
    assert s > decode_paths.MAX_QUERY_ROWS
    window, softcap = window_softcap
    inp = _gqa_inputs(s + window, dtype, s=s, cap=512, rotary=1, sink=extra == "sink", norm=extra == "norm")
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    attrs = dict(num_heads=16, kv_num_heads=4, local_window_size=window, softcap=softcap, do_rotary=1,
                 smooth_softmax=1 if extra == "smooth" else -1)
    lowered = _gqa_jit("cuda", total_sequence_length=inp["total_sequence_length"], **attrs).lower(arrays).as_text()
    assert "jax_onnx_attn_prefill_attention" in lowered and "jax_onnx_attn_decode_attention" not in lowered
    _gqa_compare(inp, **attrs)


def test_gqa_uncovered_calls_fall_back_or_raise():
    inp = _gqa_inputs(2, BF16)
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    kw = dict(num_heads=16, kv_num_heads=4, total_sequence_length=inp["total_sequence_length"],
              qk_output=1, shared_buffer=True)
    auto = jax.jit(lambda a: ops.group_query_attention(**a, **kw))(arrays)
    assert auto.output_qk is not None
    with pytest.raises(NotImplementedError, match="output_qk"):
        ops.group_query_attention(**arrays, **kw, backend="cuda")


# --- ai.onnx Attention: attention_with_cache ------------------------------------------------------

def _attn_inputs(seed, dtype, *, b=3, hq=16, hkv=4, s=1, d=128, cap=200, mask=None, three_d=False):
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    lengths = rng.integers(0, cap - s + 1, size=b).astype(np.int32)
    lengths[-1] = cap - s + 1  # does not fit: status set, y 0
    q, k, v = x(b, hq, s, d), x(b, hkv, s, d), x(b, hkv, s, d)
    if three_d:
        q = q.transpose(0, 2, 1, 3).reshape(b, s, hq * d)
        k = k.transpose(0, 2, 1, 3).reshape(b, s, hkv * d)
        v = v.transpose(0, 2, 1, 3).reshape(b, s, hkv * d)
    m = None
    if mask == "bool":
        m = rng.random((b, 1, s, cap - 9)) < 0.85
    elif mask == "float":
        m = (rng.standard_normal((1, hq, s, cap)) * 2).astype(np.float32)
    elif mask == "int":
        m = rng.integers(-3, 2, size=(b, 1, 1, cap)).astype(np.int32)
    elif mask == "half":
        m = x(s, cap)  # rank 2, broadcast
    return dict(Q=q, K=k, V=v, key_cache=x(b, hkv, cap, d), value_cache=x(b, hkv, cap, d),
                cache_lengths=lengths, attn_mask=m)


ATTN_FEATURES = list(itertools.product(
    [1, 5],                                  # S
    [0, 1],                                  # is_causal
    [None, "bool", "float", "int", "half"],  # mask
    [(-1, -1, 0.0), (40, -1, 0.0), (20, 2, 15.0)],  # left, right, softcap
))


@functools.cache
def _attn_jit(backend, three_d, **attrs):
    heads = dict(q_num_heads=16, kv_num_heads=4) if three_d else {}
    return jax.jit(lambda inp: ops.attention_with_cache(**inp, **attrs, **heads, opset=25,
                                                        backend=backend))


@pytest.mark.parametrize("s,causal,mask,window", ATTN_FEATURES)
def test_attention_with_cache(s, causal, mask, window):
    dtype = BF16 if s == 1 else F16
    three_d = mask == "int"
    inp = _attn_inputs(s + causal, dtype, s=s, mask=mask, three_d=three_d)
    if inp["attn_mask"] is None:
        del inp["attn_mask"]
    left, right, softcap = window
    attrs = dict(is_causal=causal, left_window_size=left, right_window_size=right, softcap=softcap)
    got = _attn_jit("cuda", three_d, **attrs)(inp)
    want = _attn_jit("reference", three_d, **attrs)(inp)
    assert not np.isnan(np.asarray(got.y).astype(np.float32)).any()
    assert_close(np.asarray(got.y), np.asarray(want.y), dtype)
    for name in ("key_cache", "value_cache", "cache_lengths", "status"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


def test_attention_kernel_choice_and_uncovered_calls():
    inp = _attn_inputs(3, BF16)
    del inp["attn_mask"]

    def targets(**kw):
        hlo = jax.jit(lambda a: ops.attention_with_cache(**a, **kw)).lower(inp).compile().as_text()
        return {t for t in ("decode_attention", "general_attention")
                if f'custom_call_target="jax_onnx_attn_{t}"' in hlo}

    # "auto" on a GPU: the engine where it covers the call, the general kernel for the rest.
    assert targets() == {"decode_attention"}
    assert targets(return_qk=True) == {"general_attention"}
    assert targets(softmax_precision=16) == {"general_attention"}
    # Prefill-sized steps: the prefill engine on sm_90 (decode_paths.attention_prefill_route), the
    # reference elsewhere and for what the engine lacks (a mask): "auto" falls back, "cuda" says why.
    long = _attn_inputs(4, BF16, s=65)
    del long["attn_mask"]
    auto = jax.jit(lambda a: ops.attention_with_cache(**a))(long)
    assert auto.y.shape == (3, 16, 65, 128)
    if decode_paths.prefill_engine_available() and decode_paths.prefill_engine_enabled():
        hlo = jax.jit(lambda a: ops.attention_with_cache(**a)).lower(long).compile().as_text()
        assert 'custom_call_target="jax_onnx_attn_prefill_attention"' in hlo
        long = _attn_inputs(4, BF16, s=65, mask="bool")
    with pytest.raises(NotImplementedError, match="more than 64 query rows"):
        ops.attention_with_cache(**long, backend="cuda")
