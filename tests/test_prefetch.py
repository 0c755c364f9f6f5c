"""The L2 prefetch before a decode step's attention (ops.prefetch, NodeContext.next_projection_weights):
what the lowering hands it, when it requests nothing, and that it never changes a value. Its kernel
runs in tests/gpu/test_l2_prefetch_gpu.py."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_onnx_attn
from jax_onnx_attn.models.builder import build_decoder
from jax_onnx_attn.models.config import DecoderConfig
from jax_onnx_attn.onnx.fusion import JOA_DOMAIN
from jax_onnx_attn.onnx.interpreter import Interpreter
from jax_onnx_attn.ops import prefetch
from jax_onnx_attn.runtime import DecoderSession


def _lowered(bits: int):
    cfg = DecoderConfig(layers=2, hidden=64, heads=4, kv_heads=2, intermediate=128, vocab=64,
                        dtype="float16", weight_bits=bits, block_size=32, zero_points=bits == 4,
                        max_positions=64)
    return jax_onnx_attn.load(build_decoder(cfg))


@pytest.mark.parametrize("bits", [0, 4])
def test_each_attention_names_the_weights_of_its_output_projection(bits):
    lowered = _lowered(bits)
    graph = lowered.model.graph
    interp = Interpreter(lowered.model)
    readers = {}
    for node in graph.node:
        for name in node.input:
            readers.setdefault(name, []).append(node)
    attentions = [n for n in graph.node if n.op_type == "GroupQueryAttention"]
    assert len(attentions) == 2
    for node in attentions:
        (proj,) = readers[node.output[0]]
        assert proj.op_type == "Linear" and proj.domain == JOA_DOMAIN
        names = interp.next_projection_weights(node)
        # w (packed bits), scales, zero points (int4) or w (fp16): the projection's own inputs.
        assert names == [n for n in proj.input[1:4] if n]
        assert len(names) == (3 if bits else 1)
        assert all(n in lowered.params for n in names)
        assert lowered.params[names[0]].shape[0] == 64  # o_proj: N = hidden rows
    # Any other node, or an output read by more than a Linear's x: nothing.
    others = [n for n in graph.node if n.op_type not in ("GroupQueryAttention",)]
    assert all(interp.next_projection_weights(n) == [] for n in others
               if not any(r.op_type == "Linear" for r in readers.get(n.output[0], [])) and n.output)


def test_the_reference_backend_and_prompts_request_nothing():
    x = jnp.arange(6.0, dtype=jnp.float16).reshape(1, 1, 6)
    w = jnp.ones((64, 64), jnp.float16)
    # The reference backend (and "auto" on a machine without our kernels): x itself.
    for backend in ("reference", "auto"):
        y = jax.jit(lambda x, w: prefetch.l2_prefetch(x, [w], max_bytes=1 << 20, backend=backend))(x, w)
        np.testing.assert_array_equal(np.asarray(y), np.asarray(x))
    # More query rows than a decode step has: a prompt, nothing requested even on "cuda".
    big = jnp.zeros((1, prefetch.MAX_ROWS + 1, 6), jnp.float16)
    assert prefetch.l2_prefetch(big, [w], max_bytes=1 << 20, backend="cuda") is not None
    # A zero budget, or inside disabled(): no call on "cuda" either (no GPU needed to return x).
    assert prefetch.l2_prefetch(x, [w], max_bytes=0, backend="cuda").shape == x.shape
    with prefetch.disabled():
        assert prefetch.l2_prefetch(x, [w], max_bytes=1 << 20, backend="cuda").shape == x.shape


def test_bad_settings_name_themselves(monkeypatch):
    x = jnp.zeros((1, 1, 8), jnp.float16)
    w = jnp.zeros((8,), jnp.float16)
    with pytest.raises(ValueError, match="buffers: at most 4"):
        prefetch.l2_prefetch(x, [w] * 5, max_bytes=1)
    with pytest.raises(ValueError, match="how must be one of"):
        prefetch.l2_prefetch(x, [w], max_bytes=1, how="tma")
    monkeypatch.setenv(prefetch.BUDGET_ENV, "lots")
    with pytest.raises(ValueError, match="JOA_L2_PREFETCH_MB must be a number"):
        prefetch.budget_bytes()
    monkeypatch.setenv(prefetch.BUDGET_ENV, "-1")
    with pytest.raises(ValueError, match="must be >= 0"):
        prefetch.budget_bytes()
    monkeypatch.setenv(prefetch.BUDGET_ENV, "1.5")
    assert prefetch.budget_bytes() == 3 << 19
    monkeypatch.setenv(prefetch.MODE_ENV, "dma")
    with pytest.raises(ValueError, match="JOA_L2_PREFETCH_MODE must be one of"):
        prefetch.mode()
    monkeypatch.delenv(prefetch.MODE_ENV)
    monkeypatch.delenv(prefetch.BUDGET_ENV)
    assert prefetch.mode() == "bulk" and prefetch.budget_bytes() == int(prefetch.DEFAULT_BUDGET_MB * 2**20)


@pytest.mark.parametrize("bits", [0, 4])
def test_a_session_with_a_budget_generates_the_same_tokens(bits, monkeypatch):
    lowered = _lowered(bits)
    prompt = [3, 1, 4, 1, 5, 9, 2, 6]
    monkeypatch.setenv(prefetch.BUDGET_ENV, "0")
    off = DecoderSession(lowered, max_length=32, steps_per_call=4).generate([prompt], max_new_tokens=8)
    monkeypatch.setenv(prefetch.BUDGET_ENV, "64")
    on = DecoderSession(lowered, max_length=32, steps_per_call=4).generate([prompt], max_new_tokens=8)
    assert on.tokens == off.tokens
