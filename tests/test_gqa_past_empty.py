"""GroupQueryAttention's `past_empty` promise (a first prompt on a fixed-capacity cache): the
attention reads only the first S cache rows, and the result equals the general static-cache step."""

import re

import jax
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.models import build_tiny_decoder
from jax_onnx_attn.onnx import load
from jax_onnx_attn.testing import assert_close


def _prompt(seed, dtype, *, b=2, s=24, n=8, hkv=2, d=32, cap=64, packed=True, rotary=True):
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    inp = dict(past_key=x(b, hkv, cap, d), past_value=x(b, hkv, cap, d),
               seqlens_k=np.full((b,), s - 1, np.int32), total_sequence_length=cap)
    if packed:
        inp["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        inp.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    if rotary:
        ang = rng.uniform(0, 2 * np.pi, (cap, d // 2))
        inp.update(cos_cache=np.cos(ang).astype(dtype), sin_cache=np.sin(ang).astype(dtype))
    return inp


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("window,softcap,packed", [(-1, 0.0, True), (5, 0.0, False),
                                                   (-1, 20.0, True)])
def test_past_empty_equals_the_static_cache_step(dtype, window, softcap, packed):
    inp = _prompt(3, dtype, packed=packed)
    attrs = dict(num_heads=8, kv_num_heads=2, local_window_size=window, softcap=softcap,
                 do_rotary=1, shared_buffer=True, backend="reference")
    want = ops.group_query_attention(**inp, **attrs)
    got = ops.group_query_attention(**inp, **attrs, past_empty=True)
    for name in ("output", "present_key", "present_value", "status"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                     dtype if name != "status" else np.float32, err_msg=name)


def _dot_shapes(inp, attrs, past_empty):
    hlo = jax.jit(lambda q: ops.group_query_attention(**{**inp, "query": q}, **attrs,
                                                       past_empty=past_empty).output
                  ).lower(inp["query"]).as_text()
    return set(re.findall(r"dot_general[^\n]*-> tensor<([0-9x]+)xf32>", hlo))


def test_past_empty_reads_only_the_new_rows():
    inp = _prompt(5, np.float32, s=8, cap=512)
    attrs = dict(num_heads=8, kv_num_heads=2, do_rotary=1, shared_buffer=True, backend="reference")
    # Logits [B, Hkv, G, S, keys]: over the whole capacity in general, over the S new rows here.
    assert "2x2x4x8x512" in _dot_shapes(inp, attrs, False)
    shapes = _dot_shapes(inp, attrs, True)
    assert "2x2x4x8x8" in shapes and not any(s.endswith("x512") for s in shapes)


def test_past_empty_needs_a_shared_cache():
    inp = _prompt(1, np.float32)
    with pytest.raises(ValueError, match="past_empty"):
        ops.group_query_attention(**inp, num_heads=8, kv_num_heads=2, do_rotary=1,
                                  past_empty=True, backend="reference")


@pytest.mark.parametrize("model", ["tiny", "torch_llama_op20", "torch_qwen2_op23"])
def test_cache_step_prefill_with_empty_cache_equals_the_general_step(model):
    model = load(build_tiny_decoder(layers=2, dtype="f32") if model == "tiny"
                 else f"tests/fixtures/{model}/model.onnx")
    step = model.fixed_cache_step(batch=2, capacity=96)
    ids = np.random.default_rng(0).integers(0, 256, (2, 32)).astype(np.int32)
    zeros, num_new = np.zeros(2, np.int32), np.array([32, 17], np.int32)
    want, _ = step(model.params, ids, zeros, num_new, step.init_cache())
    want_cache = step(model.params, ids, zeros, num_new, step.init_cache())[1]
    got, cache = step(model.params, ids, zeros, num_new, step.init_cache(), empty_cache=True)
    for b, n in enumerate(num_new):
        assert_close(np.asarray(got)[b, :n], np.asarray(want)[b, :n], np.float32)
    for name in want_cache:  # the buffers are written the same way
        assert_close(np.asarray(cache[name]), np.asarray(want_cache[name]), np.float32)
    # The prompt's attention is S x S: no [.., 32, 96] logits in the traced step.
    hlo = jax.jit(lambda p, i: step(p, i, zeros, num_new, step.init_cache(), empty_cache=True)[0]
                  ).lower(model.params, ids).as_text()
    assert "x32x96x" not in hlo
