"""The packed QKV projection with GroupQueryAttention's step preparation in its epilogue
(linear_gqa_prepare: ffi/handlers/linear_gqa_prepare.cu, kernels/gemv/epilogue.cuh's
QkvRotaryEpilogue) on a GPU.

The oracle is the two launches it replaces, on the same device: the projection (`cuda_matmul.linear`
on dense weights, `matmul_nbits_record` on 4-bit weights in the record layout; each held to the
reference by its own tests) of the weight in the rotary-pair order, put back in the original order,
then `cuda.gqa_prepare` (held to `reference.gqa.prepare_step` by tests/gpu/test_gqa_prepare_gpu.py).
The fused call must give the same bits: q, the new cache rows, the rows it must leave alone, the
status of a row that does not fit. Also: f16 / bf16, full and partial rotary, position_ids, bias,
the norm prologue, the ~1B / ~8B shapes; bitwise repeatability; the caches donated (no copy); a
decode-like loop captured in a command buffer; sessions of batch 1 (dense and 4-bit) generating the
tokens of the unfused session (logits within tolerance) with one kernel a layer fewer.
"""

from __future__ import annotations

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda, cuda_matmul
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.testing import hlo_copies_of, tolerance

import command_buffer
from nbits_cases import nbits_weights

pytestmark = pytest.mark.gpu

BF16, F16 = ml_dtypes.bfloat16, np.float16

# (name, heads, kv heads, head dim, rotary half, K): the ~1B / ~8B Llama shapes, a small one,
# partial rotary.
SHAPES = [("1b", 32, 8, 64, 32, 2048), ("8b", 32, 8, 128, 64, 4096), ("small", 4, 2, 64, 32, 512),
          ("partial", 8, 2, 128, 16, 1024)]
#: (bias, norm, position_ids, fits) spread over the cases.
VARIANTS = [(False, True, False, True), (True, False, False, True), (False, False, True, True),
            (True, True, False, False), (False, True, True, True)]


def _case(name, dtype, bits, variant, seed=0, capacity=96):
    """(fused arguments, static attributes, unfused chain) of one case."""
    _, n, hkv, d, half, k = next(s for s in SHAPES if s[0] == name)
    use_bias, use_norm, use_positions, fits = variant
    rng = np.random.default_rng(seed)
    rows = (n + 2 * hkv) * d
    order = ops.rotary_pair_order(n, hkv, d, half)
    x = jnp.asarray(rng.standard_normal((1, k)), dtype)
    if bits == 16:
        w = rng.standard_normal((rows, k)) / np.sqrt(k)
        w_fused = jnp.asarray(ops.to_rotary_pair_order(w, order), dtype)
    else:
        b_quant, scales, _ = nbits_weights(rows, k, 32, False, seed=seed, dtype=dtype)
        w_fused = jnp.asarray(ops.to_record_layout(ops.to_rotary_pair_order(b_quant, order),
                                                   ops.to_rotary_pair_order(scales, order), None))
    bias = jnp.asarray(ops.to_rotary_pair_order(rng.standard_normal(rows), order), dtype) if use_bias else None
    norm = jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype) if use_norm else None
    k_cache = jnp.asarray(rng.standard_normal((1, hkv, capacity, d)), dtype)
    v_cache = jnp.asarray(rng.standard_normal((1, hkv, capacity, d)), dtype)
    seqlens = jnp.asarray([17 if fits else capacity], jnp.int32)  # the refused row: past_b = C
    ang = rng.uniform(0, 2 * np.pi, (capacity + 4, half))
    cos, sin = jnp.asarray(np.cos(ang), dtype), jnp.asarray(np.sin(ang), dtype)
    positions = jnp.asarray([[capacity + 9]], jnp.int32) if use_positions else None  # clipped
    args = (x, w_fused, bias, norm, k_cache, v_cache, seqlens, cos, sin, positions)
    attrs = dict(num_heads=n, kv_num_heads=hkv, bits=bits, block_size=32 if bits == 4 else 0, eps=1e-5)

    def unfused(x, w, bias, norm, k_cache, v_cache, seqlens, cos, sin, positions):
        if bits == 16:
            y = cuda_matmul.linear(x, w, bias, None, norm, eps=1e-5)
        else:
            y = cuda_matmul.matmul_nbits_record(x, w, bias, None, norm, n=rows, block_size=32, eps=1e-5)
        query = ops.from_rotary_pair_order(y, order).reshape(1, 1, rows)
        return cuda.gqa_prepare(query, None, None, k_cache, v_cache, seqlens, cos, sin, positions,
                                num_heads=n, kv_num_heads=hkv)
    return args, attrs, unfused


def _ids():
    for name, *_ in SHAPES:
        for dtype in (F16, BF16):
            for bits in (16, 4):
                yield name, dtype, bits


CASES = [(name, dtype, bits, VARIANTS[i % len(VARIANTS)]) for i, (name, dtype, bits) in enumerate(_ids())]


def _case_id(case):
    name, dtype, bits, (bias, norm, positions, fits) = case
    flags = "".join(f"-{f}" for f, on in (("bias", bias), ("norm", norm), ("pos", positions),
                                         ("refused", not fits)) if on)
    return f"{name}-{np.dtype(dtype).name}-{'dense' if bits == 16 else 'int4'}{flags}"


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_fused_call_gives_the_bits_of_the_projection_then_gqa_prepare(case):
    name, dtype, bits, variant = case
    args, attrs, unfused = _case(name, dtype, bits, variant, seed=len(_case_id(case)))
    rows = (attrs["num_heads"] + 2 * attrs["kv_num_heads"]) * args[4].shape[3]
    assert cuda_matmul.qkv_prepare_unsupported(rows, args[0].shape[1], bits, args[3] is not None,
                                               attrs["block_size"]) is None
    got = [np.asarray(r) for r in jax.jit(functools.partial(cuda_matmul.linear_gqa_prepare, **attrs))(*args)]
    want = [np.asarray(r) for r in jax.jit(unfused)(*args)]
    fits = variant[3]
    assert got[3].tolist() == [st.OK if fits else st.KV_WRITE_OUT_OF_RANGE]
    for what, g, w in zip(("q", "k_cache", "v_cache", "status"), got, want):
        np.testing.assert_array_equal(g, w, err_msg=what)
    if not fits:  # a refused row writes no K / V
        np.testing.assert_array_equal(got[1], np.asarray(args[4]))
        np.testing.assert_array_equal(got[2], np.asarray(args[5]))


def test_fused_call_is_deterministic():
    args, attrs, _ = _case("8b", BF16, 16, VARIANTS[0])
    f = jax.jit(functools.partial(cuda_matmul.linear_gqa_prepare, **attrs))
    first, second = f(*args), f(*args)
    for a, b in zip(first, second):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_donated_caches_are_updated_in_place():
    args, attrs, _ = _case("8b", F16, 16, VARIANTS[0], capacity=1024)
    x, w, _, norm, k_cache, v_cache, seqlens, cos, sin, _ = args

    def step(k_cache, v_cache, x, w, norm, seqlens, cos, sin):
        return cuda_matmul.linear_gqa_prepare(x, w, None, norm, k_cache, v_cache, seqlens, cos, sin, **attrs)

    f = jax.jit(step, donate_argnums=(0, 1))
    hlo = f.lower(k_cache, v_cache, x, w, norm, seqlens, cos, sin).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_linear_gqa_prepare"' in hlo
    assert hlo_copies_of(hlo, k_cache.shape, k_cache.dtype) == [], "a donated cache was copied"
    pointers = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
    _, k_out, v_out, status = f(k_cache, v_cache, x, w, norm, seqlens, cos, sin)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert np.asarray(status).tolist() == [st.OK]


def test_handler_refuses_what_it_cannot_take():
    args, attrs, _ = _case("small", F16, 16, VARIANTS[0])
    x, w = args[0], args[1]
    with pytest.raises(ValueError, match="x: must be"):
        cuda_matmul.linear_gqa_prepare(jnp.concatenate([x, x]), *args[1:], **attrs)
    with pytest.raises(ValueError, match="w: must be"):
        jax.jit(functools.partial(cuda_matmul.linear_gqa_prepare, **attrs))(x, w[:-16], *args[2:])
    # The handler holds the same rule when the wrapper's checks are bypassed (its error comes when
    # the call runs).
    raw = jax.jit(functools.partial(cuda_matmul._linear_gqa_prepare, pdl=True, **attrs))
    with pytest.raises(Exception, match="w must be"):
        jax.block_until_ready(raw(x, w[:-16], *args[2:]))


# A decode-like loop: each step's x is the previous q's first K features, the caches carried. Backend
# "cuda" is the fused call, "unfused" the two launches it replaces (the same bits), "reference" the
# jnp specs (reference.linear + reference.gqa.prepare_step).
_LOOP = textwrap.dedent("""
    import functools, jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn import ops
    from jax_onnx_attn.ops import cuda, cuda_matmul
    from jax_onnx_attn.ops.reference import gqa as gqa_reference, linear as linear_reference

    N, HKV, D, HALF, K, C = 8, 2, 64, 32, 512, 64
    rng = np.random.default_rng(0)
    order = ops.rotary_pair_order(N, HKV, D, HALF)
    w = jnp.asarray(ops.to_rotary_pair_order(rng.standard_normal(((N + 2 * HKV) * D, K)) / 24, order), jnp.bfloat16)
    ang = rng.uniform(0, 6.28, (C, HALF))
    cos, sin = jnp.asarray(np.cos(ang), jnp.bfloat16), jnp.asarray(np.sin(ang), jnp.bfloat16)
    x0 = jnp.asarray(rng.standard_normal((1, K)), jnp.bfloat16)
    heads = dict(num_heads=N, kv_num_heads=HKV)

    def step(backend, pdl, x, k_cache, v_cache, seqlens):
        if backend == "cuda":
            return cuda_matmul.linear_gqa_prepare(x, w, None, None, k_cache, v_cache, seqlens, cos, sin,
                                                  pdl=pdl, **heads)
        if backend == "unfused":
            y, prepare = cuda_matmul.linear(x, w, pdl=pdl), cuda.gqa_prepare
        else:
            y, prepare = linear_reference.linear(x, w), gqa_reference.prepare_step
        query = ops.from_rotary_pair_order(y, order).reshape(1, 1, -1)
        return prepare(query, None, None, k_cache, v_cache, seqlens, cos, sin, **heads)

    def steps(x, backend, pdl):
        def body(i, carry):
            x, k_cache, v_cache = carry
            q, k_cache, v_cache, _ = step(backend, pdl, x, k_cache, v_cache, jnp.full((1,), i, jnp.int32))
            return (q.reshape(1, -1)[:, :K] + k_cache[0, 0, i, 0]).astype(x.dtype), k_cache, v_cache
        zeros = jnp.zeros((1, HKV, C, D), jnp.bfloat16)
        return jax.lax.fori_loop(0, 8, body, (x, zeros, zeros))[0]
""") + command_buffer.loop_checks("linear_gqa_prepare", same_bits_as="unfused", rel_tol=0.06)
# rel_tol: three bf16 roundings a step (the projection, the rotation, the fed-back sum), each
# landing apart from the jnp specs' where their sums are ordered differently, carried through 8
# steps of a random linear map: 4.3% on the H200. The exact check is the unfused launches' bits.


def test_loop_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "linear_gqa_prepare", tmp_path)


def _kernel_counts(session) -> dict:
    hlo = "\n".join(session.compiled_text("decode"))
    return {t: hlo.count(f'custom_call_target="jax_onnx_attn_{t}"')
            for t in ("linear", "matmul_nbits", "gqa_prepare", "linear_gqa_prepare")}


@pytest.mark.parametrize("bits", [0, 4])
def test_session_of_batch_one_fuses_the_step_preparation(monkeypatch, bits):
    # JOA_QKV_PREPARE=1: a session of batch 1 loads its packed QKV projections in the rotary-pair
    # order; each decode step's layer runs linear_gqa_prepare instead of the projection and
    # gqa_prepare (the unread projection dropped by XLA), and generates the unfused session's tokens.
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig
    from jax_onnx_attn.runtime import DecoderSession

    layers = 2
    model = build_decoder(DecoderConfig(layers=layers, hidden=512, heads=8, kv_heads=2, intermediate=1024,
                                        vocab=512, dtype="float16", weight_bits=bits, block_size=32))
    prompts = [[1, 2, 3, 4, 5, 6]]
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    monkeypatch.setenv(cuda_matmul.QKV_PREPARE_ENV, "0")
    plain = DecoderSession(model, max_length=64, batch=1)
    want = plain.generate(prompts, max_new_tokens=16)
    monkeypatch.setenv(cuda_matmul.QKV_PREPARE_ENV, "1")
    session = DecoderSession(model, max_length=64, batch=1)
    assert session.lowered.fusions.qkv_pairs == layers
    got = session.generate(prompts, max_new_tokens=16)
    assert got.tokens == want.tokens
    before, after = _kernel_counts(plain), _kernel_counts(session)
    projection = "matmul_nbits" if bits else "linear"
    assert before["gqa_prepare"] > 0 and after["gqa_prepare"] == 0, (before, after)
    assert after["linear_gqa_prepare"] == before["gqa_prepare"], (before, after)
    assert after[projection] == before[projection] - before["gqa_prepare"], (before, after)
    # The prompt runs XLA's GEMM on the reordered weight (the same sums, perhaps not the same bits),
    # so the logits are held to the dtype's tolerance; the op test above holds the fused step's bits.
    sequence = got.sequences[0]
    ours, want_logits = session.logits(sequence, len(prompts[0])), plain.logits(sequence, len(prompts[0]))
    rtol, atol = tolerance(np.float16)
    assert float(np.abs(ours - want_logits).max()) <= atol + rtol * float(np.abs(want_logits).max())
