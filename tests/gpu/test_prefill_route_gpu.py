"""GroupQueryAttention's first prompt on our prefill engine (JOA_PREFILL_ENGINE=1,
ops/decode_paths.py `_gqa_prefill_engine`) against the reference backend: ragged seqlens_k
(right-padded rows, a one-key row, a refused row), B > 1, GQA groups 1 / 4 / 8, head dims 64 / 128
(and 80 / 96 / 256),
float16 / bfloat16, causal or not; local windows, head_sink / smooth softmax and softcap; with the
switch off the prompt stays on cuDNN; a lowered decoder's
long prompt takes the engine inside DecoderSession. Needs an sm_90 GPU (H100 / H200).

    pytest -q tests/gpu/test_prefill_route_gpu.py
"""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.models import build_tiny_decoder, encode
from jax_onnx_attn.runtime import DecoderSession
from jax_onnx_attn.testing import assert_close, tolerance
from prefill_cases import gqa_prompt, needs_sm90

pytestmark = pytest.mark.gpu

BF16, F16 = ml_dtypes.bfloat16, np.float16
ENV = "JOA_PREFILL_ENGINE"
ENGINE = "jax_onnx_attn_prefill_attention"


def _run(inp, backend, total, **attrs):
    fn = jax.jit(lambda a: ops.group_query_attention(
        **a, total_sequence_length=total, **attrs, shared_buffer=True, past_empty=True,
        backend=backend))
    return fn, fn(inp)


@needs_sm90
@pytest.mark.parametrize("dtype,n,hkv,d,causal", [
    (F16, 8, 8, 64, 1), (BF16, 8, 8, 128, 1), (F16, 16, 4, 128, 1), (BF16, 16, 4, 64, 1),
    (BF16, 32, 4, 128, 1), (F16, 32, 4, 64, 1), (F16, 16, 4, 128, 0), (BF16, 32, 4, 64, 0)])
def test_gqa_prompt_on_the_engine_equals_the_reference(monkeypatch, dtype, n, hkv, d, causal):
    _gqa_prompt_on_the_engine(monkeypatch, dtype, n, hkv, d, causal)


@needs_sm90
@pytest.mark.parametrize("dtype,n,hkv,d,causal", [
    (BF16, 32, 8, 256, 1), (F16, 16, 4, 256, 0), (F16, 16, 4, 96, 1), (BF16, 8, 8, 80, 0)],
    ids=["d256-causal", "d256-noncausal", "d96-causal", "d80-noncausal"])
def test_gqa_prompt_on_the_engine_d80_d96_d256(monkeypatch, dtype, n, hkv, d, causal):
    """Head sizes 80 / 96 (the engine's 128-wide tiles) and 256 (80-key tiles) take the engine."""
    _gqa_prompt_on_the_engine(monkeypatch, dtype, n, hkv, d, causal)


def _gqa_prompt_on_the_engine(monkeypatch, dtype, n, hkv, d, causal):
    monkeypatch.setenv(ENV, "1")
    b, s, cap = 4, 320, 384
    # full, right-padded (T_b = 131: not a tile multiple), one key, refused (beyond the cache)
    seqlens = [s - 1, 130, 0, cap + 5]
    inp = gqa_prompt(n * d + causal, dtype, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap, seqlens=seqlens,
                  packed=(n // hkv) % 2 == 0)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal)
    fn, got = _run(inp, "cuda", s, **attrs)  # total == S: GQA's first prompt
    hlo = fn.lower(inp).compile().as_text()
    assert ENGINE in hlo and "jax_onnx_attn_gqa_prepare" in hlo and "cudnn" not in hlo.lower()
    _, want = _run(inp, "reference", s, **attrs)
    for name in ("output", "present_key", "present_value"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    out = np.asarray(got.output).astype(np.float32)
    assert np.isfinite(out).all() and not out[-1].any()
    assert out[1, 131:].any()  # padded rows see the T_b keys


@needs_sm90
@pytest.mark.parametrize("dtype,d,causal,variant", [
    (F16, 128, 1, dict(local_window_size=100)),
    (BF16, 64, 1, dict(local_window_size=7, smooth_softmax=1)),
    (F16, 64, 0, dict(head_sink=True)),
    (BF16, 128, 1, dict(softcap=30.0, head_sink=True, local_window_size=200)),
    (F16, 128, 0, dict(softcap=5.0, smooth_softmax=1))], ids=lambda x: str(x))
def test_gqa_prompt_variants_on_the_engine_equal_the_reference(monkeypatch, dtype, d, causal, variant):
    """Local windows (padded rows read the last W keys), head_sink / smooth softmax and softcap
    take the engine (not cuDNN, not the reference) and agree with the reference."""
    monkeypatch.setenv(ENV, "1")
    b, s, cap, n, hkv = 4, 320, 384, 16, 4
    inp = gqa_prompt(d + causal, dtype, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap,
                  seqlens=[s - 1, 130, 0, cap + 5], packed=True)
    variant = dict(variant)
    if variant.pop("head_sink", False):
        inp["head_sink"] = np.linspace(-2.0, 4.0, n).astype(dtype)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal, **variant)
    fn, got = _run(inp, "cuda", s, **attrs)
    hlo = fn.lower(inp).compile().as_text()
    assert ENGINE in hlo and "cudnn" not in hlo.lower()
    _, want = _run(inp, "reference", s, **attrs)
    for name in ("output", "present_key", "present_value"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@needs_sm90
def test_switch_off_keeps_cudnn(monkeypatch):
    monkeypatch.setenv(ENV, "0")
    b, s, cap, n, hkv, d = 2, 256, 320, 16, 4, 128
    inp = gqa_prompt(3, BF16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap, seqlens=[s - 1] * b, packed=True)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1)
    fn, got = _run(inp, "cuda", cap, **attrs)
    hlo = fn.lower(inp).compile().as_text()
    assert "cudnn" in hlo.lower() and ENGINE not in hlo
    monkeypatch.setenv(ENV, "1")
    fn_on, got_on = _run(inp, "cuda", cap, **attrs)
    assert ENGINE in fn_on.lower(inp).compile().as_text()
    _, want = _run(inp, "reference", cap, **attrs)
    for y in (got, got_on):
        assert_close(np.asarray(y.output), np.asarray(want.output), BF16)


@needs_sm90
@pytest.mark.parametrize("value", [None, "1"])
def test_session_long_prompt_runs_the_engine_and_matches_the_reference(monkeypatch, value):
    if value is None:  # the default
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    jax.clear_caches()  # a jit traced under another setting keeps its route
    model = build_tiny_decoder(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2,
                               dtype="f16")
    prompt = encode("A prompt long enough to be prefill rather than a decode step. " * 2)
    assert len(prompt) > 64
    gpu = DecoderSession(model, max_length=256)
    result = gpu.generate([prompt], max_new_tokens=8)
    hlo = "\n".join(gpu.compiled_text("prefill"))
    assert ENGINE in hlo and "cudnn" not in hlo.lower()
    sequence = result.sequences[0]
    with jax.default_device(jax.devices("cpu")[0]):
        reference = DecoderSession(model, max_length=256).logits(sequence, len(prompt))
    ours = gpu.logits(sequence, len(prompt))
    rtol, atol = tolerance(np.float16)
    scale = float(np.abs(reference).max())
    assert float(np.abs(ours - reference).max()) <= atol + rtol * scale
