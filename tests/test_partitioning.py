"""ops.partitioning on one device: the FFI wrappers' batching rules (with each target's executable
spec standing in for its kernel, so the wrapper's own rule code runs on the CPU: one folded call,
the per-example plan pinned, the per-example loop's values), the public ops under jax.vmap, the
layouts' checks, and the tensor-parallel plan of real graphs.

The partitioning side (several devices) is tests/mesh/, run by tests/test_mesh.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda, cuda_matmul, partitioning
from jax_onnx_attn.testing import assert_close

from kernel_specs import use_specs

FIXTURES = "tests/fixtures"


@pytest.fixture
def kernels(monkeypatch):
    """The FFI calls as their specs (tests/kernel_specs.py); the list of calls made."""
    return use_specs(monkeypatch)


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _per_example(fn, batched: dict, shared: dict, n: int):
    """[fn(example i) for i < n] stacked leaf by leaf."""
    outs = [fn(**{k: v[i] for k, v in batched.items()}, **shared) for i in range(n)]
    return jax.tree.map(lambda *xs: np.stack([np.asarray(x) for x in xs]), *outs)


def _assert_equal_trees(got, want, what, exact: bool = True):
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves), what
    for i, (g, w) in enumerate(zip(got_leaves, want_leaves)):
        if exact:
            np.testing.assert_array_equal(np.asarray(g), np.asarray(w), err_msg=f"{what} result {i}")
        else:
            assert_close(g, w, err_msg=f"{what} result {i}")


def _check_fold(kernels, target, fn, batched: dict, shared: dict, n: int, exact: bool = True):
    """vmap(fn) over `batched` equals the per-example loop, and ran as one folded call of `target`
    over n times the rows. exact=False: within the dtype's tolerance (XLA:CPU may order a spec's
    reductions by the batch size; the kernels' bitwise equality is tests/gpu/test_spmd_gpu.py's)."""
    names = list(batched)
    got = jax.jit(jax.vmap(lambda *xs: fn(**dict(zip(names, xs)), **shared)))(
        *[batched[k] for k in names])
    del kernels[:]
    want = _per_example(fn, batched, shared, n)
    per_example_rows = kernels[0][1][0]
    del kernels[:]
    jax.jit(jax.vmap(lambda *xs: fn(**dict(zip(names, xs)), **shared)))(
        *[batched[k] for k in names])
    # (Traces of the per-example shapes are recorded too: the rule reads the results' shapes.)
    folded = [c for c in kernels if c[0] == target and c[1][0] == n * per_example_rows]
    assert folded, kernels
    _assert_equal_trees(got, want, target, exact)
    return folded[0][2]


def test_kv_append_folds(kernels):
    rng, n = np.random.default_rng(0), 3
    batched = dict(cache=_normal(rng, (n, 2, 2, 8, 4)), new=_normal(rng, (n, 2, 2, 2, 4)),
                   start=np.array([[0, 6], [7, 1], [3, 3]], np.int32))
    _check_fold(kernels, "kv_append", cuda.kv_append, batched, {}, n)


def test_decode_attention_folds_with_the_per_example_plan(kernels):
    rng, n, b, hkv, g, s, c, d = np.random.default_rng(1), 3, 2, 2, 2, 2, 64, 32
    batched = dict(q=_normal(rng, (n, b, hkv * g, s, d), np.float16),
                   k_cache=_normal(rng, (n, b, hkv, c, d), np.float16),
                   v_cache=_normal(rng, (n, b, hkv, c, d), np.float16),
                   kv_len=rng.integers(s, c, (n, b)).astype(np.int32))
    shared = dict(bias=_normal(rng, (1, hkv * g, s, c)), sink=_normal(rng, (hkv * g,)),
                  scale=0.125, causal=True)
    static = _check_fold(kernels, "decode", cuda.decode_attention, batched, shared, n, exact=False)
    plan = cuda.decode_plan(b, hkv * g, hkv, s, c, d)
    assert (static["split_rows"], static["cluster"]) == (plan["split_rows"], plan["cluster"])


def test_decode_attention_folds_with_the_per_example_kernel_of_a_quantised_cache(kernels):
    # The planner picks an int8 cache's kernel by the call's size (plan.h QuantPath): each example
    # here (1 x 32 heads x 1024 rows) takes the tile kernel, the folded call (twice the rows) alone
    # would take the register one. The fold keeps the per-example kernel (the same bits on a GPU).
    rng, n, b, hkv, c, d = np.random.default_rng(4), 2, 1, 32, 1024, 64
    batched = dict(q=_normal(rng, (n, b, hkv, 1, d), np.float16),
                   k_cache=rng.integers(-128, 128, (n, b, hkv, c, d), dtype=np.int8),
                   v_cache=rng.integers(-128, 128, (n, b, hkv, c, d), dtype=np.int8),
                   kv_len=rng.integers(1, c, (n, b)).astype(np.int32))
    shared = dict(k_scale=np.float32([0.02]), v_scale=np.float32([0.03]), scale=0.125, kv_bits=8)
    assert not cuda.decode_plan(b, hkv, hkv, 1, c, d, 8, quant_regs=None)["quant_regs"]
    assert cuda.decode_plan(n * b, hkv, hkv, 1, c, d, 8, quant_regs=None)["quant_regs"]
    static = _check_fold(kernels, "decode", cuda.decode_attention, batched, shared, n, exact=False)
    assert static["quant_regs"] is False


def test_decode_attention_loops_over_a_mapped_operand_without_batch_axis(kernels):
    """sink [Hq] mapped: it has no batch axis to fold into, so one call per example."""
    rng, n = np.random.default_rng(2), 2
    q, cache = _normal(rng, (1, 4, 1, 32), np.float16), _normal(rng, (1, 2, 64, 32), np.float16)
    sinks = _normal(rng, (n, 4))
    fn = jax.vmap(lambda sink: cuda.decode_attention(q, cache, cache, np.array([5], np.int32),
                                                     sink=sink, scale=0.2))
    got = jax.jit(fn)(sinks)
    for i in range(n):
        want = cuda.decode_attention(q, cache, cache, np.array([5], np.int32), sink=sinks[i],
                                     scale=0.2)
        assert_close(got[i], want)


def test_general_attention_folds(kernels):
    rng, n = np.random.default_rng(3), 2
    batched = dict(q=_normal(rng, (n, 2, 4, 3, 8)), k=_normal(rng, (n, 2, 2, 5, 8)),
                   v=_normal(rng, (n, 2, 2, 5, 6)), kv_len=np.array([[5, 3], [1, 4]], np.int32))
    _check_fold(kernels, "general", cuda.general_attention, batched,
                dict(scale=0.3, causal=True, qk_mode=2), n, exact=False)


@pytest.mark.parametrize("packed", [False, True])
def test_gqa_prepare_folds(kernels, packed):
    rng, n, b, s, heads, hkv, d, c = np.random.default_rng(4), 2, 2, 2, 4, 2, 32, 16
    width = (heads + 2 * hkv) * d if packed else heads * d
    batched = dict(query=_normal(rng, (n, b, s, width), np.float16),
                   k_cache=_normal(rng, (n, b, hkv, c, d), np.float16),
                   v_cache=_normal(rng, (n, b, hkv, c, d), np.float16),
                   seqlens_k=np.array([[3, 9], [1, 15]], np.int32))
    if not packed:
        batched["key"] = _normal(rng, (n, b, s, hkv * d), np.float16)
        batched["value"] = _normal(rng, (n, b, s, hkv * d), np.float16)
    cos, sin = _normal(rng, (64, 8), np.float16), _normal(rng, (64, 8), np.float16)
    shared = dict(cos_cache=cos, sin_cache=sin, num_heads=heads, kv_num_heads=hkv)
    if packed:
        shared.update(key=None, value=None)
    _check_fold(kernels, "gqa_prepare", cuda.gqa_prepare, batched, shared, n)


@pytest.mark.parametrize("gated,norm", [(False, False), (True, True)])
def test_linear_folds_with_the_per_example_plan(kernels, gated, norm):
    rng, n, m, k, rows = np.random.default_rng(5), 3, 2, 64, 32
    batched = dict(x=_normal(rng, (n, m, k), np.float16),
                   residual=_normal(rng, (n, m, rows // 2 if gated else rows), np.float16))
    shared = dict(w=_normal(rng, (rows, k), np.float16), bias=_normal(rng, (rows,), np.float16),
                  norm_weight=_normal(rng, (k,), np.float16) if norm else None, gated=gated)
    static = _check_fold(kernels, "linear", cuda_matmul.linear, batched, shared, n, exact=False)
    plan = cuda_matmul.gemv_plan(m, rows, k, cuda_matmul.DENSE_BITS, gated, norm)
    assert (static["cluster"], static["warps_k"]) == (plan["cluster"], plan["warps_k"])


def test_matmul_nbits_folds(kernels):
    rng, n, m, k, rows, block = np.random.default_rng(6), 2, 3, 64, 16, 32
    b_quant = rng.integers(0, 256, (rows, k // block, block // 2)).astype(np.uint8)
    shared = dict(b_quant=b_quant,
                  scales=ops.tile_nbits_meta(_normal(rng, (rows, k // block), np.float16)),
                  zero_points=ops.tile_nbits_meta(rng.integers(0, 16, (rows, k // block)).astype(np.uint8)),
                  bits=4, block_size=block)
    _check_fold(kernels, "nbits", cuda_matmul.matmul_nbits,
                dict(x=_normal(rng, (n, m, k), np.float16)), shared, n, exact=False)


def test_matmul_nbits_wants_tiled_meta():
    rng, k, rows, block = np.random.default_rng(6), 64, 16, 32
    b_quant = rng.integers(0, 256, (rows, k // block, block // 2)).astype(np.uint8)
    with pytest.raises(ValueError, match=r"scales must be tiled \[1, 2, 16\]"):
        cuda_matmul.matmul_nbits(_normal(rng, (1, k), np.float16), b_quant,
                                 _normal(rng, (rows, k // block), np.float16), bits=4, block_size=block)


def test_linear_loops_where_the_folded_rows_leave_the_plan(kernels):
    """Folding 8 examples of 8 rows would give 64 rows, beyond the engine's M: one call each."""
    rng, n = np.random.default_rng(7), 8
    x, w = _normal(rng, (n, 8, 64), np.float16), _normal(rng, (32, 64), np.float16)
    got = jax.jit(jax.vmap(lambda x: cuda_matmul.linear(x, w)))(x)
    assert kernels and all(c[1][0] == 8 for c in kernels if c[0] == "linear")
    for i in range(n):
        assert_close(got[i], cuda_matmul.linear(x[i], w))


def test_pin_and_broadcast_of_unmapped_batch_operands():
    """An unmapped operand with a batch axis is repeated for every example; pin's statics reach
    the folded call; pin returning None loops instead."""
    seen = []

    def impl(x, y, *, scale, pinned=None):
        seen.append((x.shape, pinned))
        return x * scale + y

    rule = partitioning.Rule("test", lambda x, y, **s: partitioning.Layout(("b w", "b w"),
                                                                           ("b w",)))
    x, y = np.arange(12.0).reshape(3, 2, 2), np.ones((2, 2))
    fold = jax.vmap(lambda x: rule.apply(impl, (x, y), dict(scale=2.0),
                                         pin=lambda static, n, x, y: dict(pinned=n)))
    np.testing.assert_array_equal(fold(x), x * 2 + y)
    assert seen[-1] == ((6, 2), 3)
    seen.clear()
    loop = jax.vmap(lambda x: rule.apply(impl, (x, y), dict(scale=2.0), pin=lambda *a: None))
    np.testing.assert_array_equal(loop(x), x * 2 + y)
    assert seen and all(shape == (2, 2) for shape, _ in seen)


def test_layout_mismatch_is_a_clear_error():
    rule = partitioning.Rule("bad", lambda x, **s: partitioning.Layout(("b h d",), ("b h d",)))
    with pytest.raises(AssertionError, match="bad: layout 'b h d' has 3 axes"):
        rule.apply(lambda x: x, (np.zeros((2, 3)),))
    with pytest.raises(ValueError, match="role .* must be the major factor"):
        partitioning._parse("b (g h) d")


def test_public_ops_under_vmap_equal_the_loop():
    """group_query_attention (inner batching: vmap traces into the implementation) per example."""
    rng, n, b, s, heads, hkv, d, c = np.random.default_rng(8), 3, 2, 1, 4, 2, 16, 8
    query = _normal(rng, (n, b, s, heads * d))
    key, value = _normal(rng, (n, b, s, hkv * d)), _normal(rng, (n, b, s, hkv * d))
    past = _normal(rng, (n, b, hkv, c, d))
    seqlens = np.array([[2, 5], [0, 7], [3, 3]], np.int32)

    def gqa(query, key, value, past_key, seqlens_k):
        return ops.group_query_attention(query, key, value, past_key, past_key, seqlens_k,
                                         np.int32(c), num_heads=heads, kv_num_heads=hkv,
                                         shared_buffer=True)
    got = jax.jit(jax.vmap(gqa))(query, key, value, past, seqlens)
    want = _per_example(gqa, dict(query=query, key=key, value=value, past_key=past,
                                  seqlens_k=seqlens), {}, n)
    for field, g, w in zip(ops.GroupQueryAttentionOutput._fields, got, want):
        if w is None:
            assert g is None
        else:
            np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-6, atol=1e-6,
                                       err_msg=field)


# --------------------------------------------------------------------------------------------------
# The tensor-parallel plan of real graphs

@pytest.mark.parametrize("fixture,counts", [
    ("builder_llama_fp32", {"column": 4, "row": 4, "vocab": 1}),
    ("builder_gemma2_fp16", {"column": 6, "row": 4, "vocab": 1}),
    ("torch_llama_op20", {"column": 8, "row": 4, "vocab": 1}),
    ("torch_qwen2_op23", {"column": 8, "row": 4, "vocab": 1}),
])
def test_plan_finds_the_projections(fixture, counts):
    """Per layer: Q, K, V (or the packed QKV) and gate / up column-parallel, o and down row-parallel
    (builder: packed QKV and the fused gate_up, 2 column a layer; torch: separate q, k, v);
    the LM head by vocabulary."""
    from jax_onnx_attn.onnx import load
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel

    lowered = load(f"{FIXTURES}/{fixture}")
    plan = plan_tensor_parallel(lowered, 2)
    assert plan.counts() == counts, (plan.roles, plan.whole)
    assert not plan.whole
    packed = fixture.startswith("builder")
    assert len(plan.regrouped_queries) == (2 if packed else 0)
    for name, split in plan.splits.items():
        assert lowered.params[name].shape[split.axis] % 2 == 0, name


def test_plan_refuses_heads_that_do_not_split():
    from jax_onnx_attn.models import build_decoder, preset
    from jax_onnx_attn.onnx import load
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel

    lowered = load(build_decoder(preset("tiny", dtype="float32")))  # 4 heads, 2 KV heads
    with pytest.raises(ValueError, match="kv_num_heads=2, not a multiple of 4"):
        plan_tensor_parallel(lowered, 4)


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_regrouped_rows_unpack_to_the_original_q_k_v(groups):
    """regroup_packed_rows then a projection then unpack_regrouped_qkv = the graph's own split."""
    from jax_onnx_attn.onnx.cache_step import unpack_regrouped_qkv
    from jax_onnx_attn.onnx.sharding import regroup_packed_rows

    rng, heads, hkv, d, k = np.random.default_rng(9), 8, 4, 8, 16
    w = _normal(rng, ((heads + 2 * hkv) * d, k))
    x = _normal(rng, (2, 3, k))
    y = x @ regroup_packed_rows(w, heads, hkv, d, groups).T
    q, key, value = unpack_regrouped_qkv(jnp.asarray(y), heads, hkv, groups)
    want = x @ w.T
    np.testing.assert_allclose(np.asarray(q), want[..., :heads * d], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(key), want[..., heads * d:(heads + hkv) * d], rtol=1e-6)
    np.testing.assert_allclose(np.asarray(value), want[..., (heads + hkv) * d:], rtol=1e-6)


def test_session_on_a_one_device_mesh_equals_the_plain_session():
    from jax_onnx_attn.models import build_decoder, preset
    from jax_onnx_attn.onnx import load
    from jax_onnx_attn.runtime import DecoderSession
    from jax_onnx_attn.runtime.mesh import make_mesh

    lowered = load(build_decoder(preset("tiny", dtype="float32")))
    prompts = [[3, 1, 4, 1, 5]]
    want = DecoderSession(lowered, max_length=16).generate(prompts, 6).tokens
    session = DecoderSession(lowered, max_length=16, mesh=make_mesh(1))
    assert session.generate(prompts, 6).tokens == want
    assert session.layout.plan.splits == {}  # a model axis of one device splits nothing
