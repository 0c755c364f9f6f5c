"""The L2 prefetch kernel (ffi/handlers/l2_prefetch.cu) on the GPU: x comes back bit for bit and in
place (aliased, no copy), whatever the mode, budget and buffer sizes; it runs inside a decode loop's
command buffer; a session with a budget emits it once a layer and generates the same bits as one
without."""

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_onnx_attn
from jax_onnx_attn.models.builder import build_decoder
from jax_onnx_attn.models.config import DecoderConfig
from jax_onnx_attn.ops import prefetch
from jax_onnx_attn.runtime import DecoderSession

import command_buffer

pytestmark = pytest.mark.gpu
TARGET = 'custom_call_target="jax_onnx_attn_l2_prefetch"'


@pytest.mark.parametrize("how", prefetch.MODES)
@pytest.mark.parametrize("budget", [1, 100, 4096 + 8, 1 << 30])
def test_x_comes_back_unchanged_and_in_place(how, budget):
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1, 1, 3072)), jnp.float16)
    w = jnp.asarray(rng.integers(0, 255, (4096, 1001)), jnp.uint8)  # not a multiple of 16 bytes
    s = jnp.asarray(rng.standard_normal((129, 7)), jnp.float16)
    f = jax.jit(lambda x, w, s: prefetch.l2_prefetch(x * 2, [w, s], max_bytes=budget, how=how) + 1)
    hlo = f.lower(x, w, s).compile().as_text()
    assert TARGET in hlo
    assert "copy(" not in hlo.split(TARGET)[0].splitlines()[-1]  # the aliased operand is not copied
    np.testing.assert_array_equal(np.asarray(f(x, w, s)), np.asarray(x * 2 + 1))


def test_under_vmap_and_without_budget():
    x = jnp.ones((4, 1, 1, 64), jnp.float16)
    w = jnp.ones((256, 64), jnp.float16)
    f = jax.jit(jax.vmap(lambda x: prefetch.l2_prefetch(x, [w], max_bytes=1 << 20)))
    np.testing.assert_array_equal(np.asarray(f(x)), np.asarray(x))
    g = jax.jit(lambda x: prefetch.l2_prefetch(x, [w], max_bytes=0))
    assert TARGET not in g.lower(x[0]).compile().as_text()


_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops import prefetch

    w = jnp.asarray(np.random.default_rng(0).standard_normal((2048, 2048)), jnp.float16)

    def steps(x):
        def body(i, x):
            x = prefetch.l2_prefetch(x, [w], max_bytes=4 << 20)
            return jnp.tanh(x @ w.T * 0.01).astype(x.dtype)
        return jax.lax.fori_loop(0, 8, body, x)

    x = jnp.ones((1, 2048), jnp.float16)
    f = jax.jit(steps)
    hlo = f.lower(x).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_l2_prefetch"' in l]
    print("CUSTOM_CALL_NAMES", *names)
    a, b = f(x), f(x)
    ref = x
    for i in range(8):
        ref = jnp.tanh(ref @ w.T * 0.01).astype(x.dtype)
    assert np.array_equal(np.asarray(a), np.asarray(b)), "replay changed the bits"
    assert np.array_equal(np.asarray(a), np.asarray(jax.jit(lambda x: jax.lax.fori_loop(
        0, 8, lambda i, x: jnp.tanh(x @ w.T * 0.01).astype(x.dtype), x))(x))), "the prefetch changed the bits"
    print("LOOP_OK")
""")


def test_prefetch_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "l2_prefetch", tmp_path)


@pytest.mark.parametrize("bits", [0, 4])
def test_a_session_prefetches_each_layer_and_keeps_its_bits(bits, monkeypatch):
    cfg = DecoderConfig(layers=3, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=256,
                        dtype="float16", weight_bits=bits, block_size=32, max_positions=128)
    lowered = jax_onnx_attn.load(build_decoder(cfg))
    prompt = list(range(5, 25))
    out = {}
    for budget in ("0", "64"):
        monkeypatch.setenv(prefetch.BUDGET_ENV, budget)
        session = DecoderSession(lowered, max_length=96, steps_per_call=8)
        out[budget] = session.generate([prompt], max_new_tokens=24)
        hlo = "\n".join(session.compiled_text("decode"))
        n = hlo.count(TARGET)  # once a layer in each decode executable
        assert (n > 0 and n % cfg.layers == 0) if budget != "0" else n == 0, n
        if budget != "0":
            # Prompts (more than MAX_ROWS rows) request nothing.
            assert TARGET not in "\n".join(session.compiled_text("prefill"))
        out[budget + "logits"] = session.logits(out[budget].sequences[0], len(prompt))
    assert out["64"].tokens == out["0"].tokens
    np.testing.assert_array_equal(out["64logits"], out["0logits"])
