"""End to end on the GPU: a lowered decoder generates with our CUDA kernels in its decode step, and its
logits match the same session run on the reference backend (XLA on the CPU device)."""

import jax
import numpy as np
import pytest

from jax_onnx_attn.models import build_tiny_decoder, encode
from jax_onnx_attn.runtime import DecoderSession
from jax_onnx_attn.testing import tolerance

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", ["f16"])
def test_decode_runs_our_kernels_and_matches_the_reference(dtype):
    # head size 64: a size the decode engine is built for (the default tiny model's 16 is not).
    model = build_tiny_decoder(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2, dtype=dtype)
    prompt = encode("The kernels ")
    gpu = DecoderSession(model, max_length=64)
    result = gpu.generate([prompt], max_new_tokens=24)
    hlo = "\n".join(gpu.compiled_text("decode"))
    assert 'custom_call_target="jax_onnx_attn_decode_attention"' in hlo
    assert 'custom_call_target="jax_onnx_attn_gqa_prepare"' in hlo  # the tiny model's GQA step
    sequence = result.sequences[0]
    with jax.default_device(jax.devices("cpu")[0]):
        reference = DecoderSession(model, max_length=64).logits(sequence, len(prompt))
    ours = gpu.logits(sequence, len(prompt))
    rtol, atol = tolerance(np.float16)
    scale = float(np.abs(reference).max())
    err = float(np.abs(ours - reference).max())
    print(f"max |logit diff| {err:.3g} at logit scale {scale:.3g}")
    assert err <= atol + rtol * scale


def test_batched_session_reads_kn_weights_and_matches_the_reference():
    # A session of 2+ rows loads its dense weights [K, N] (runtime.session.dense_layout_for) and runs
    # them on XLA's GEMM; each row's logits must still match the reference session's (CPU, batch 1).
    model = build_tiny_decoder(hidden=256, heads=4, kv_heads=2, intermediate=256, layers=2, dtype="f16")
    prompts = [encode("The kernels "), encode("A cache"), encode("Four rows of"), encode("x")]
    gpu = DecoderSession(model, max_length=64, batch=len(prompts))
    linears = [n for n in gpu.lowered.model.graph.node if n.op_type == "Linear"]
    assert linears and all(any(a.name == "layout" and a.s == b"kn" for a in n.attribute) for n in linears)
    result = gpu.generate(prompts, max_new_tokens=16)
    _rows_match_the_reference(gpu, model, prompts, result)


def _rows_match_the_reference(gpu, model, prompts, result):
    """Each row's logits along its generated sequence match a reference session's (CPU, batch 1)."""
    rtol, atol = tolerance(np.float16)
    for prompt, sequence in zip(prompts, result.sequences):
        with jax.default_device(jax.devices("cpu")[0]):
            reference = DecoderSession(model, max_length=64).logits(sequence, len(prompt))
        ours = gpu.logits(sequence, len(prompt))
        scale = float(np.abs(reference).max())
        err = float(np.abs(ours - reference).max())
        print(f"max |logit diff| {err:.3g} at logit scale {scale:.3g}")
        assert err <= atol + rtol * scale
