"""The slots kernel reading the record layout (matmul_nbits with 4-bit weights in the record layout:
ffi/kernels/gemv/slots.cuh's RecordFormat, ops.to_record_layout) on a GPU.

The record reader runs the slots kernel's plan and sums on the same values, so every output is held
bit for bit to the slots kernel on the same weight in the wide format with tiled metadata (which
tests/gpu/test_linear_gpu.py holds to the reference), and to the reference within the dtype's
tolerance where no bias can cancel a product's rounding (the decoder's fusions). Blocks 32-512, f16
/ bf16, with and without zero points, every fusion (norm prologue, bias, residual, gated SiLU), more
tiles than CTAs (a CTA re-enters its cursor), fewer chunks than warps; the ~1B / ~8B decoder shapes;
every output element written; bitwise repeatability and PDL invariance; vmap; the handler's
refusals; the auto backend's routing (one row on the kernel, prompts on the reference); a decode-like
loop captured in a command buffer; a session of batch 1 in the layout generating the same tokens.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn._extension import target
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.testing import assert_close

import command_buffer
from nbits_cases import fusion_operands, nbits_weights

pytestmark = pytest.mark.gpu

FUSIONS = ["plain", "bias", "residual", "norm", "gated", "gated_bias", "all"]
# (name, K, N, fusion): the one-row projections of the ~1B and ~8B Llama-shaped decoders.
SHAPES = [("1b-o", 2048, 2048, "plain"), ("1b-qkv", 2048, 3072, "norm"),
          ("1b-gate-up", 2048, 16384, "norm_gated"), ("1b-down", 8192, 2048, "residual"),
          ("1b-lm", 2048, 128256, "norm"),
          ("8b-o", 4096, 4096, "plain"), ("8b-qkv", 4096, 6144, "norm"),
          ("8b-gate-up", 4096, 28672, "norm_gated"), ("8b-down", 14336, 4096, "residual"),
          ("8b-lm", 4096, 128256, "norm")]
COMBOS = [(d, b, z) for d in (jnp.float16, jnp.bfloat16) for b in (32, 128) for z in (False, True)]


def _name(d):
    return jnp.dtype(d).name


@functools.cache
def _weights(k, n, block, zp, dtype, seed=0):
    """(x [1, K], the weight in the record layout on the device, the same in prepare_nbits' form
    with tiled scales / zero points (the slots kernel's input))."""
    b_quant, scales, zeros = nbits_weights(n, k, block, zp, seed, jnp.dtype(dtype))
    x = jnp.asarray(np.random.default_rng(seed + 1).normal(size=(1, k)), dtype)
    rec = jnp.asarray(ops.to_record_layout(b_quant, scales, zeros))
    tiled = (jnp.asarray(b_quant), jnp.asarray(ops.tile_nbits_meta(scales)),
             None if zeros is None else jnp.asarray(ops.tile_nbits_meta(zeros)))
    return x, rec, tiled


@functools.cache
def _record_fn(backend="cuda", **kw):
    return jax.jit(lambda x, rec, **a: ops.matmul_nbits(x, rec, None, layout="record", backend=backend,
                                                        **kw, **a))


def _slots(monkeypatch, x, tiled, arrays, **kw):
    """The slots kernel on the wide format (a fresh trace under JOA_GEMV_SLOTS=1)."""
    monkeypatch.setenv(cuda_matmul.SLOTS_ENV, "1")
    fn = jax.jit(lambda x, *w, **a: ops.matmul_nbits(x, *w, backend="cuda", wide=True, **kw, **a))
    return np.asarray(fn(x, *tiled, **arrays))


def _reference(x, tiled, arrays, **kw):
    return np.asarray(jax.jit(lambda x, *w, **a: ops.matmul_nbits(x, *w, backend="reference", **kw, **a))(
        x, *tiled, **arrays))


def _check(got, want, dtype, what):
    got, want = np.asarray(got), np.asarray(want)
    assert np.isfinite(got).all(), f"{what}: non-finite outputs"
    assert_close(got, want, dtype, err_msg=what)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=_name)
@pytest.mark.parametrize("block", [32, 64, 128, 256, 512])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_record_kernel_is_the_slots_kernel_bit_for_bit(block, zp, dtype, monkeypatch):
    # K = 1536: 6 chunks, so warps 6 and 7 of a CTA have none; N = 9616: 601 tiles, more than the
    # plan's CTAs (a CTA enters several tiles). Every fusion, the slots kernel's bits; without a bias
    # (which can cancel a product's rounding: test_linear_gpu's slack) the reference's tolerance.
    k, n = 1536, 9616
    x, rec, tiled = _weights(k, n, block, zp, dtype, seed=1)
    for fusion in FUSIONS:
        static, arrays = fusion_operands(fusion, k, n, 1, dtype, seed=2)
        plan = cuda_matmul.gemv_plan(1, n, k, 4, static["gated"], "norm_weight" in arrays,
                                     block_size=block, record_layout=True)
        assert plan["error"] is None and plan["record_layout"] and plan["blocks"] > plan["grid"], plan
        kw = dict(k=k, n=n, bits=4, block_size=block, **static)
        got = np.asarray(_record_fn(**kw)(x, rec, **arrays))
        what = f"{fusion} block={block} zp={zp}"
        np.testing.assert_array_equal(got, _slots(monkeypatch, x, tiled, arrays, **kw), err_msg=what)
        if "bias" not in arrays:
            _check(got, _reference(x, tiled, arrays, **kw), dtype, what)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: s[0])
def test_decoder_shapes(shape, monkeypatch):
    name, k, n, fusion = shape
    for i in range(2):  # two of the (dtype, block, zero points) combos per shape, rotating
        dtype, block, zp = COMBOS[(SHAPES.index(shape) * 2 + i) % len(COMBOS)]
        x, rec, tiled = _weights(k, n, block, zp, dtype)
        static, arrays = fusion_operands(fusion, k, n, 1, dtype, seed=3)
        kw = dict(k=k, n=n, bits=4, block_size=block, **static)
        got = np.asarray(_record_fn(**kw)(x, rec, **arrays))
        what = f"{name} {_name(dtype)} block={block} zp={zp}"
        np.testing.assert_array_equal(got, _slots(monkeypatch, x, tiled, arrays, **kw), err_msg=what)
        _check(got, _reference(x, tiled, arrays, **kw), dtype, what)


def _poisoned(n, k, block, gated, dtype, rec, x):
    """The handler with y aliased to a NaN-filled buffer in the residual slot (unused), so every
    element the kernel does not write stays NaN."""
    n_out = n // 2 if gated else n
    ph = jnp.zeros((1,), dtype)

    def call(x):
        poison = jnp.full((1, n_out), jnp.nan, dtype)
        f = jax.ffi.ffi_call(target("matmul_nbits"), jax.ShapeDtypeStruct((1, n_out), dtype),
                             input_output_aliases={5: 0})
        return f(x, rec, ph, jnp.zeros((1,), jnp.uint8), ph, poison, ph, bits=4, block_size=block,
                 has_zero_points=False, has_bias=False, has_residual=False, has_norm=False, gated=gated,
                 eps=np.float32(1e-6), cluster=0, warps_k=0, wide=True, pdl=False, slots=True, rows=False,
                 warps_n=0, depth=0, occupancy=0, record_layout=True)
    return jax.jit(call)(x)


@pytest.mark.parametrize("gated", [False, True], ids=["store", "gated"])
def test_every_output_element_is_written(gated, monkeypatch):
    # No element left NaN, and the slots kernel's bits (the reference differs by roundings a gate
    # can leave uncancelled: on the H200 one bf16 output of 520 at K 8192, 0.0096 against -0.024).
    dtype = jnp.bfloat16
    for k, n, block in ((2048, 4112, 32), (8192, 1040, 128), (256, 16, 256)):
        x, rec, tiled = _weights(k, n, block, True, dtype, seed=3)
        got = np.asarray(_poisoned(n, k, block, gated, dtype, rec, x))
        assert np.isfinite(got).all(), f"K={k} N={n} gated={gated}: elements not written"
        np.testing.assert_array_equal(
            got, _slots(monkeypatch, x, tiled, {}, k=k, n=n, bits=4, block_size=block, gated=gated),
            err_msg=f"K={k} N={n} gated={gated}")


def test_bitwise_repeatable_and_pdl_invariant():
    # The norm prologue where the decoder has one (qkv, gate-up); the down projection's K (14336)
    # has none (its x and gamma would not fit the slots kernel's shared memory).
    for k, n, block, norm in ((4096, 6144, 128, True), (14336, 4096, 32, False), (4096, 28672, 128, True)):
        x, rec, _ = _weights(k, n, block, True, jnp.float16, seed=4)
        arrays = {"norm_weight": jnp.ones((k,), jnp.float16)} if norm else {}
        f = _record_fn(k=k, n=n, bits=4, block_size=block)
        first = np.asarray(f(x, rec, **arrays))
        for _ in range(3):
            np.testing.assert_array_equal(np.asarray(f(x, rec, **arrays)), first)
        pdl = _record_fn(k=k, n=n, bits=4, block_size=block, pdl=True)(x, rec, **arrays)
        np.testing.assert_array_equal(np.asarray(pdl), first)


def test_vmap_runs_one_call_per_example():
    k, n = 2048, 3072
    x, rec, _ = _weights(k, n, 32, False, jnp.float16, seed=5)
    xs = jnp.concatenate([x, -x, 2 * x])[:, None]  # 3 examples of one row
    f = _record_fn(k=k, n=n, bits=4, block_size=32)
    got = np.asarray(jax.jit(jax.vmap(lambda x: f(x, rec)))(xs))
    for i in range(3):
        np.testing.assert_array_equal(got[i], np.asarray(f(xs[i], rec)))


def test_handler_refusals_name_the_input():
    k, n, block, dtype = 512, 64, 32, jnp.float16
    x, rec, _ = _weights(k, n, block, False, dtype)
    ph = jnp.zeros((1,), dtype)

    def call(x, rec, n_out=n, block_size=block):
        f = jax.ffi.ffi_call(target("matmul_nbits"), jax.ShapeDtypeStruct((x.shape[0], n_out), dtype))
        return f(x, rec, ph, jnp.zeros((1,), jnp.uint8), ph, ph, ph, bits=4, block_size=block_size,
                 has_zero_points=False, has_bias=False, has_residual=False, has_norm=False, gated=False,
                 eps=np.float32(1e-6), cluster=0, warps_k=0, wide=True, pdl=False, slots=True, rows=False,
                 warps_n=0, depth=0, occupancy=0, record_layout=True)
    for args, match in (((x, rec[:, :1]), "b_quant must be uint8"), ((x, rec, n + 16), "b_quant must be uint8"),
                        ((jnp.concatenate([x, x]), rec), "one row"),
                        ((x, rec, n, 16), "block_size must be a power of two >= 32")):
        with pytest.raises(Exception, match=match):
            jax.block_until_ready(call(*args))


def test_auto_backend_takes_the_record_kernel_for_one_row_only():
    k, n = 2048, 2048
    x, rec, _ = _weights(k, n, 128, True, jnp.float16)
    kw = dict(k=k, n=n, bits=4, block_size=128, layout="record")
    hlo = jax.jit(lambda x: ops.matmul_nbits(x, rec, None, **kw)).lower(x).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_matmul_nbits"' in hlo
    x8 = jnp.concatenate([x] * 8)
    hlo = jax.jit(lambda x: ops.matmul_nbits(x, rec, None, **kw)).lower(x8).compile().as_text()
    assert "jax_onnx_attn_matmul_nbits" not in hlo  # a prompt: the reference over from_record_layout


# A decode-like loop in a fresh process (XLA_FLAGS apply): norm + gated gate-up, then down with the
# residual, both in the record layout, 8 steps in a fori_loop, x donated (M = 1). Prints the
# custom-call names for the check; replays and PDL off give the same bits, the same loop on the slots
# kernel (the wide format with tiled metadata) too, and the reference (on the raw weights) is within
# 8 layers of bf16 roundings. The reference reads the raw weights, not the record layout through
# from_record_layout: with jax 0.11.2 on the GPU a jitted function that closes over a record array of
# 10 MB as a constant computes a wrong unpack (0.2-0.45 of the output's max; passed as an argument it
# is exact, and so is the CPU: tools/probes/record_ref_diag.py, session 18). Sessions pass their
# weights as arguments.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops

    k, i, block = 2048, 4096, 128
    rng = np.random.default_rng(0)
    def weights(n, kk):
        bq = rng.integers(0, 256, (n, kk // block, block // 2), dtype=np.uint8)
        s = (rng.uniform(0.5, 1.5, (n, kk // block)) / (4 * kk ** 0.5)).astype(jnp.bfloat16)
        z = rng.integers(0, 16, (n, kk // block), dtype=np.uint8)
        wide = (jnp.asarray(bq), jnp.asarray(ops.tile_nbits_meta(s)), jnp.asarray(ops.tile_nbits_meta(z)))
        return jnp.asarray(ops.to_record_layout(bq, s, z)), wide
    (up, up_wide), (down, down_wide) = weights(2 * i, k), weights(k, i)
    gamma = jnp.ones((k,), jnp.bfloat16)
    x0 = jnp.asarray(rng.normal(size=(1, k)), jnp.bfloat16)

    def steps(x, impl, pdl):  # "cuda": the record layout; "slots": the wide format; "reference": raw
        def proj(x, w, wide, **kw):
            if impl == "reference":
                return ops.matmul_nbits(x, *wide, backend="reference", wide=True, **kw)
            if impl == "cuda":
                return ops.matmul_nbits(x, w, None, backend="cuda", pdl=pdl, layout="record", **kw)
            return ops.matmul_nbits(x, *wide, backend="cuda", pdl=pdl, wide=True, **kw)
        def body(_, x):
            h = proj(x, up, up_wide, k=k, n=2 * i, bits=4, block_size=block, norm_weight=gamma, gated=True)
            return proj(h, down, down_wide, k=i, n=k, bits=4, block_size=block, residual=x)
        return jax.lax.fori_loop(0, 8, body, x)
""") + command_buffer.loop_checks("matmul_nbits", same_bits_as="slots")


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "matmul_nbits", tmp_path)


def test_session_of_batch_one_in_the_record_layout(monkeypatch):
    # JOA_GEMV_RECORD=1: a session of batch 1 loads its 4-bit weights in the record layout (decode
    # steps on the record kernel, the prompt on the reference through the layout) and generates the
    # tokens of the default layout (the same bits at each decode step).
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig
    from jax_onnx_attn.runtime import DecoderSession

    model = build_decoder(DecoderConfig(layers=2, hidden=512, heads=8, kv_heads=2, intermediate=1024,
                                        vocab=512, dtype="float16", weight_bits=4, block_size=32))
    prompts = [[1, 2, 3, 4, 5, 6]]
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "0")
    plain = DecoderSession(model, max_length=64, batch=1).generate(prompts, max_new_tokens=16)
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    session = DecoderSession(model, max_length=64, batch=1)
    layouts = [a.s for n in session.lowered.model.graph.node for a in n.attribute if a.name == "layout"]
    assert layouts and set(layouts) == {b"record"}
    assert session.generate(prompts, max_new_tokens=16).tokens == plain.tokens
