"""Prompts on the GPU, the cuDNN route (JOA_PREFILL_ENGINE=0; the default route, our prefill engine,
has tests/gpu/test_prefill_route_gpu.py): GroupQueryAttention's first prompt on a fixed-capacity
cache (past_empty) runs gqa_prepare then cuDNN's flash attention, and equals the reference backend; a
lowered decoder's long prompt takes that route inside DecoderSession."""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.models import build_tiny_decoder, encode
from jax_onnx_attn.ops import decode_paths
from jax_onnx_attn.runtime import DecoderSession
from jax_onnx_attn.testing import assert_close, tolerance

pytestmark = pytest.mark.gpu


@pytest.fixture(autouse=True)
def _cudnn_route(monkeypatch):
    """These tests are about the cuDNN route of prompts: JOA_PREFILL_ENGINE=0 (the switch is read at
    trace time, and a jit traced earlier in this process keeps the route it took: clear jax's
    caches so that nothing traced under another setting is reused)."""
    monkeypatch.setenv(decode_paths.PREFILL_ENGINE_ENV, "0")
    jax.clear_caches()

BF16, F16 = ml_dtypes.bfloat16, np.float16


def _prompt(seed, dtype, *, b=3, s=256, n=16, hkv=4, d=128, cap=384, packed=True, norm=False):
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    seqlens = np.full((b,), s - 1, np.int32)
    seqlens[-1] = cap + 5  # beyond the capacity: refused, status set, output 0
    inp = dict(past_key=x(b, hkv, cap, d), past_value=x(b, hkv, cap, d), seqlens_k=seqlens,
               total_sequence_length=cap)
    if packed:
        inp["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        inp.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    ang = rng.uniform(0, 2 * np.pi, (cap, d // 2))
    inp.update(cos_cache=np.cos(ang).astype(dtype), sin_cache=np.sin(ang).astype(dtype))
    if norm:
        inp.update(q_norm_weight=x(d), k_norm_weight=x(d))
    return inp


def _run(inp, backend, **attrs):
    arrays = {k: v for k, v in inp.items() if k != "total_sequence_length"}
    total = inp["total_sequence_length"]
    fn = jax.jit(lambda a: ops.group_query_attention(
        **a, total_sequence_length=total, **attrs, shared_buffer=True, past_empty=True,
        backend=backend))
    return fn, fn(arrays), arrays


@pytest.mark.parametrize("dtype", [BF16, F16])
@pytest.mark.parametrize("d,s,window,packed,norm", [
    (128, 256, -1, True, False), (64, 128, -1, False, True), (128, 512, 100, True, False),
    (64, 300, 33, False, False)])
def test_gqa_prompt_on_cudnn_equals_the_reference(dtype, d, s, window, packed, norm):
    inp = _prompt(d + s, dtype, s=s, d=d, cap=s + 64, packed=packed, norm=norm)
    attrs = dict(num_heads=16, kv_num_heads=4, do_rotary=1, local_window_size=window)
    fn, got, arrays = _run(inp, "cuda", **attrs)
    hlo = fn.lower(arrays).compile().as_text()
    assert "jax_onnx_attn_gqa_prepare" in hlo and "cudnn" in hlo.lower()
    _, want, _ = _run(inp, "reference", **attrs)
    for name in ("output", "present_key", "present_value"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert np.asarray(got.status)[-1] != 0
    assert not np.asarray(got.output)[-1].astype(np.float32).any()


def test_uncovered_prompt_falls_back_under_auto_and_raises_under_cuda():
    inp = _prompt(1, F16, s=128, d=64)
    attrs = dict(num_heads=16, kv_num_heads=4, do_rotary=1, softcap=30.0)
    _, got, _ = _run(inp, "auto", **attrs)
    _, want, _ = _run(inp, "reference", **attrs)
    assert_close(np.asarray(got.output), np.asarray(want.output), F16)
    with pytest.raises(NotImplementedError, match="softcap"):
        _run(inp, "cuda", **attrs)


def test_session_long_prompt_runs_cudnn_and_matches_the_reference():
    model = build_tiny_decoder(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2,
                               dtype="f16")
    prompt = encode("A prompt long enough to be prefill rather than a decode step. " * 2)
    assert len(prompt) > 64
    gpu = DecoderSession(model, max_length=256)
    result = gpu.generate([prompt], max_new_tokens=8)
    hlo = "\n".join(gpu.compiled_text("prefill"))
    assert "cudnn" in hlo.lower() and "jax_onnx_attn_gqa_prepare" in hlo
    sequence = result.sequences[0]
    with jax.default_device(jax.devices("cpu")[0]):
        reference = DecoderSession(model, max_length=256).logits(sequence, len(prompt))
    ours = gpu.logits(sequence, len(prompt))
    rtol, atol = tolerance(np.float16)
    scale = float(np.abs(reference).max())
    assert float(np.abs(ours - reference).max()) <= atol + rtol * scale
