"""Issue 18 on GPUs: our kernels under jax.vmap (one GPU) and split over two GPUs (nvidia-h200-x2),
and the tensor-parallel DecoderSession against the one-GPU session.

One GPU: vmap of each FFI wrapper equals the per-example loop bit for bit (the folded launch keeps
the per-example plan). Two GPUs: each target split by heads (projections by rows or K) gives the
one-GPU results with no collective but a row-parallel projection's all-reduce; a two-GPU session
(builder decoder, fp16 and int4 weights) gives the one-GPU logits and greedy tokens, its decode
executable holds two all-reduces a layer, gathers nothing of activation size and writes each
device's cache shard in place. The CPU suite holds the same rules to the kernels' specs
(tests/test_partitioning.py, tests/mesh/); tools/device_multi_gpu.sh runs this file and the e2e
scaling bench.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_onnx_attn import ops
from jax_onnx_attn.models import build_decoder, preset
from jax_onnx_attn.onnx import load
from jax_onnx_attn.ops import cuda, cuda_matmul
from jax_onnx_attn.runtime import DecoderSession
from jax_onnx_attn.runtime.mesh import make_mesh
from jax_onnx_attn.testing import assert_close, hlo_collectives, hlo_copies_of, tolerance

pytestmark = pytest.mark.gpu
F16 = np.float16


@pytest.fixture
def two_gpus():
    gpus = jax.devices("gpu")
    if len(gpus) < 2:
        pytest.skip("needs two GPUs (the device tool's nvidia-h200-x2)")
    return Mesh(np.array(gpus[:2]), ("model",))


def _normal(rng, shape, dtype=F16):
    return rng.standard_normal(shape).astype(dtype)


def _stack(outs):
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


def _equal(got, want, what):
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} result {i}")


# --------------------------------------------------------------------------------------------------
# One GPU: vmap

def test_vmap_of_the_kernels_equals_the_loop_bitwise():
    rng, n = np.random.default_rng(0), 3
    # decode: a context long enough for several splits (the plan depends on the batch size).
    q, cache = _normal(rng, (n, 1, 8, 1, 128)), _normal(rng, (n, 1, 2, 4096, 128))
    kv_len = np.array([[4000], [17], [4096]], np.int32)

    def decode(q, k, kv):
        return cuda.decode_attention(q, k, k, kv, scale=0.088)
    assert cuda.decode_plan(1, 8, 2, 1, 4096, 128)["splits"] > 1
    _equal(jax.jit(jax.vmap(decode))(q, cache, kv_len),
           _stack([decode(q[i], cache[i], kv_len[i]) for i in range(n)]), "decode_attention")

    # An int8 cache: the planner picks its kernel by the call's size, so each example (tile kernel:
    # 32 x 1024 KV rows, under plan.h's kQuantRegsMinRows) and the folded call (3 x that: the
    # register kernel's size) differ; the fold keeps the examples' kernel.
    hkv, c, d = 32, 1024, 64
    q8 = _normal(rng, (n, 1, hkv, 1, d)).astype(np.float16)
    k8 = rng.integers(-128, 128, (n, 1, hkv, c, d), dtype=np.int8)
    v8 = rng.integers(-128, 128, (n, 1, hkv, c, d), dtype=np.int8)
    len8 = rng.integers(1, c, (n, 1)).astype(np.int32)
    assert not cuda.decode_plan(1, hkv, hkv, 1, c, d, 8, quant_regs=None)["quant_regs"]
    assert cuda.decode_plan(n, hkv, hkv, 1, c, d, 8, quant_regs=None)["quant_regs"]

    def decode8(q, k, v, kv):
        return cuda.decode_attention(q, k, v, kv, k_scale=np.float32([0.02]),
                                     v_scale=np.float32([0.03]), scale=0.125, kv_bits=8)
    _equal(jax.jit(jax.vmap(decode8))(q8, k8, v8, len8),
           _stack([decode8(q8[i], k8[i], v8[i], len8[i]) for i in range(n)]), "decode_attention int8")

    query, key = _normal(rng, (n, 2, 1, 8 * 128)), _normal(rng, (n, 2, 1, 2 * 128))
    k_cache = _normal(rng, (n, 2, 2, 64, 128))
    seqlens = np.array([[3, 60], [0, 63], [20, 20]], np.int32)

    def prepare(query, key, k_cache, seqlens):
        return cuda.gqa_prepare(query, key, key, k_cache, k_cache, seqlens, num_heads=8,
                                kv_num_heads=2)
    _equal(jax.jit(jax.vmap(prepare))(query, key, k_cache, seqlens),
           _stack([prepare(query[i], key[i], k_cache[i], seqlens[i]) for i in range(n)]),
           "gqa_prepare")

    new = _normal(rng, (n, 2, 2, 1, 128))
    start = np.array([[0, 63], [64, 5], [1, 2]], np.int32)
    _equal(jax.jit(jax.vmap(cuda.kv_append))(k_cache, new, start),
           _stack([cuda.kv_append(k_cache[i], new[i], start[i]) for i in range(n)]), "kv_append")

    x, w = _normal(rng, (n, 2, 1024)), _normal(rng, (2048, 1024)) / 32
    _equal(jax.jit(jax.vmap(lambda x: cuda_matmul.linear(x, w)))(x),
           _stack([cuda_matmul.linear(x[i], w) for i in range(n)]), "linear")
    b_quant = rng.integers(0, 256, (2048, 1024 // 32, 16)).astype(np.uint8)
    scales = ops.tile_nbits_meta(_normal(rng, (2048, 1024 // 32)) / 100)  # the target's layout

    def nbits(x):
        return cuda_matmul.matmul_nbits(x, b_quant, scales, bits=4, block_size=32)
    _equal(jax.jit(jax.vmap(nbits))(x), _stack([nbits(x[i]) for i in range(n)]), "matmul_nbits")


# --------------------------------------------------------------------------------------------------
# Two GPUs: the kernels split

def _split(mesh, fn, args, specs, *, donate=()):
    """(results on one GPU, results split over the mesh, the split program's HLO)."""
    one = jax.jit(fn)(*args)
    placed = [jax.device_put(a, NamedSharding(mesh, s or P())) for a, s in zip(args, specs)]
    compiled = jax.jit(fn, donate_argnums=donate).lower(*placed).compile()
    return one, compiled(*placed), compiled.as_text()


def test_attention_kernels_split_by_heads(two_gpus):
    rng, heads = np.random.default_rng(1), P(None, "model")
    q, cache = _normal(rng, (2, 8, 1, 128)), _normal(rng, (2, 2, 2048, 128))
    kv_len = np.array([1500, 2048], np.int32)

    def decode(q, k, v, kv_len):
        return cuda.decode_attention(q, k, v, kv_len, scale=0.088)
    one, two, hlo = _split(two_gpus, decode, [q, cache, cache.copy(), kv_len],
                           [heads, heads, heads, None])
    assert hlo_collectives(hlo) == []
    assert 'custom_call_target="jax_onnx_attn_decode_attention"' in hlo
    assert_close(two, one, F16)  # the plan of 1 KV head per GPU may split the context otherwise

    query, key = _normal(rng, (2, 1, 8 * 128)), _normal(rng, (2, 1, 2 * 128))
    seqlens = np.array([10, 2047], np.int32)

    def prepare(query, key, value, k_cache, v_cache, seqlens):
        return cuda.gqa_prepare(query, key, value, k_cache, v_cache, seqlens, num_heads=8,
                                kv_num_heads=2)
    features = P(None, None, "model")
    one, two, hlo = _split(two_gpus, prepare, [query, key, key.copy(), cache, cache.copy(), seqlens],
                           [features, features, features, heads, heads, None], donate=(3, 4))
    assert hlo_collectives(hlo) == []
    assert hlo_copies_of(hlo, (2, 1, 2048, 128), F16, inside_fusions=False) == []
    _equal(two, one, "gqa_prepare")


@pytest.mark.parametrize("bits", [16, 4])
def test_projections_split_by_rows_and_by_k(two_gpus, bits):
    rng, m, k, n = np.random.default_rng(2), 2, 2048, 4096
    x = _normal(rng, (m, k))
    if bits == 16:
        weights = [_normal(rng, (n, k)) / 45]

        def project(x, w):
            return cuda_matmul.linear(x, w)
    else:
        weights = [rng.integers(0, 256, (n, k // 32, 16)).astype(np.uint8),
                   ops.tile_nbits_meta(_normal(rng, (n, k // 32)) / 100)]  # split between tiles

        def project(x, b_quant, scales):
            return cuda_matmul.matmul_nbits(x, b_quant, scales, bits=4, block_size=32)
    one, two, hlo = _split(two_gpus, project, [x] + weights, [None] + [P("model")] * len(weights))
    assert hlo_collectives(hlo) == []
    assert_close(two, one, F16)
    by_k = [P(None, "model")] * (1 + len(weights))
    one, two, hlo = _split(two_gpus, project, [x] + weights, by_k)
    assert [c[0] for c in hlo_collectives(hlo)] == ["all-reduce"]
    assert_close(two, one, F16)


# --------------------------------------------------------------------------------------------------
# Two GPUs: the session

@pytest.mark.parametrize("weights", ["fp16", "int4"])
def test_tensor_parallel_session_matches_one_gpu(two_gpus, weights):
    config = preset("tiny", layers=2, hidden=1024, heads=8, kv_heads=2, head_size=128,
                    intermediate=2048, vocab=2048, weight_bits=4 if weights == "int4" else 0)
    lowered = load(build_decoder(config))
    prompts = [[5, 17, 42, 9, 3], [7, 7, 64, 100, 1000, 2]]
    one = DecoderSession(lowered, max_length=64, batch=2)
    two = DecoderSession(lowered, max_length=64, batch=2, mesh=make_mesh(2))
    assert two.layout.plan.counts() == {"column": 4, "row": 4, "vocab": 1}
    want, got = one.generate(prompts, 24), two.generate(prompts, 24)
    sequence = want.sequences[0]
    rtol, atol = tolerance(F16)
    ref, ours = one.logits(sequence, len(prompts[0])), two.logits(sequence, len(prompts[0]))
    err, scale = float(np.abs(ours - ref).max()), float(np.abs(ref).max())
    print(f"{weights}: max |logit diff| {err:.3g} at logit scale {scale:.3g}")
    assert err <= atol + rtol * scale
    assert got.tokens == want.tokens

    hlo = two.compiled_text("decode")[0]
    for target in ("gqa_prepare", "decode_attention") + (("matmul_nbits",) if weights == "int4" else ()):
        assert f'custom_call_target="jax_onnx_attn_{target}"' in hlo, target
    collectives = hlo_collectives(hlo)
    reduced = [c for c in collectives if c[0] == "all-reduce" and c[2] and c[2][-1] == config.hidden]
    assert len(reduced) == 2 * config.layers, collectives
    assert [c for c in collectives if c[0] != "all-reduce" and np.prod(c[2]) >= config.hidden] == []
    for buffer in two.cache.values():
        shard = buffer.sharding.shard_shape(buffer.shape)
        assert hlo_copies_of(hlo, shard, buffer.dtype, inside_fusions=False) == []
