"""The ops under a sharded jax.jit on a 2 x 2 (data, model) mesh of CPU devices: each FFI wrapper
(its spec standing in for the kernel: tests/kernel_specs.py) and each public op splits over batch
and heads with the results of the unsharded call and no collective (a row-parallel projection: one
all-reduce), a donated cache updated in place; under Shardy and GSPMD alike."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda, cuda_matmul
from jax_onnx_attn.testing import hlo_collectives, hlo_copies_of

from kernel_specs import use_specs

MESH = Mesh(np.array(jax.devices()[:4]).reshape(2, 2), ("data", "model"))
ROWS, HEADS, BOTH = P("data"), P(None, "model"), P("data", "model")


@pytest.fixture
def kernels(monkeypatch):
    return use_specs(monkeypatch)


def _normal(rng, shape, dtype=np.float32):
    return rng.standard_normal(shape).astype(dtype)


def _sharded(fn, args: list, specs: list, *, donate=()):
    """(results of jit(fn) on args put with specs (None: whole on every device), HLO text), after
    checking them against the unsharded call."""
    want = jax.jit(fn)(*args)
    placed = [jax.device_put(a, NamedSharding(MESH, P() if s is None else s))
              for a, s in zip(args, specs)]
    compiled = jax.jit(fn, donate_argnums=donate).lower(*placed).compile()
    got = compiled(*placed)
    for i, (g, w) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        np.testing.assert_allclose(np.asarray(g, np.float64), np.asarray(w, np.float64),
                                   rtol=2e-6, atol=2e-6, err_msg=f"result {i}")
    return got, compiled.as_text()


def _no_collectives(hlo: str):
    assert hlo_collectives(hlo) == []


def test_kv_append_splits_and_updates_in_place(kernels, partitioner):
    rng = np.random.default_rng(0)
    cache, new = _normal(rng, (4, 2, 16, 8)), _normal(rng, (4, 2, 3, 8))
    start = np.array([0, 13, 5, 14], np.int32)  # the last row does not fit: status, no write
    got, hlo = _sharded(cuda.kv_append, [cache, new, start], [BOTH, BOTH, ROWS], donate=(0,))
    _no_collectives(hlo)
    assert got[0].sharding.spec == BOTH
    assert hlo_copies_of(hlo, (2, 1, 16, 8), np.float32, inside_fusions=False) == []
    assert "input_output_alias={ {0}: (0" in hlo
    assert np.asarray(got[1]).tolist() == [0, 0, 0, ops.status.KV_WRITE_OUT_OF_RANGE]


def test_decode_attention_splits_by_batch_and_heads(kernels, partitioner):
    rng, b, hkv, g, s, c, d = np.random.default_rng(1), 4, 2, 3, 2, 32, 16
    args = [_normal(rng, (b, hkv * g, s, d)), _normal(rng, (b, hkv, c, d)),
            _normal(rng, (b, hkv, c, d)), rng.integers(s, c, b).astype(np.int32),
            _normal(rng, (1, hkv * g, s, c)), _normal(rng, (hkv * g,))]

    def fn(q, k, v, kv_len, bias, sink):
        return cuda.decode_attention(q, k, v, kv_len, bias, sink, scale=0.25, softcap=5.0)
    got, hlo = _sharded(fn, args, [BOTH, BOTH, BOTH, ROWS, None, None])
    _no_collectives(hlo)
    assert got.sharding.spec == BOTH


def test_decode_attention_of_an_int8_cache_with_per_channel_scales(kernels, partitioner):
    rng, b, hkv, s, c, d = np.random.default_rng(2), 2, 2, 1, 16, 16
    args = [_normal(rng, (b, 2 * hkv, s, d)), rng.integers(-127, 128, (b, hkv, c, d)).astype(np.int8),
            rng.integers(-127, 128, (b, hkv, c, d)).astype(np.int8),
            np.array([7, 16], np.int32), np.abs(_normal(rng, (1, hkv, 1, d))) / 100,
            np.abs(_normal(rng, (1, hkv, 1, d))) / 100]

    def fn(q, k, v, kv_len, k_scale, v_scale):
        return cuda.decode_attention(q, k, v, kv_len, k_scale=k_scale, v_scale=v_scale, scale=0.25,
                                     kv_bits=8)
    _, hlo = _sharded(fn, args, [BOTH, BOTH, BOTH, ROWS, None, None])
    _no_collectives(hlo)


def test_general_attention_splits_with_its_qk_output(kernels, partitioner):
    rng = np.random.default_rng(3)
    args = [_normal(rng, (2, 4, 3, 8)), _normal(rng, (2, 2, 5, 8)), _normal(rng, (2, 2, 5, 6)),
            np.array([5, 2], np.int32)]

    def fn(q, k, v, kv_len):
        return cuda.general_attention(q, k, v, kv_len, scale=0.3, causal=True, qk_mode=3)
    got, hlo = _sharded(fn, args, [BOTH, BOTH, BOTH, ROWS])
    _no_collectives(hlo)
    assert got[1].sharding.spec == BOTH


def test_gqa_prepare_splits_separate_qkv_by_heads(kernels, partitioner):
    rng, b, s, heads, hkv, d, c = np.random.default_rng(4), 2, 2, 4, 2, 16, 16
    args = [_normal(rng, (b, s, heads * d)), _normal(rng, (b, s, hkv * d)),
            _normal(rng, (b, s, hkv * d)), _normal(rng, (b, hkv, c, d)),
            _normal(rng, (b, hkv, c, d)), np.array([3, 15], np.int32),
            _normal(rng, (32, 8)), _normal(rng, (32, 8)), _normal(rng, (d,)), _normal(rng, (d,))]

    def fn(query, key, value, k_cache, v_cache, seqlens, cos, sin, q_norm, k_norm):
        return cuda.gqa_prepare(query, key, value, k_cache, v_cache, seqlens, cos, sin,
                                q_norm_weight=q_norm, k_norm_weight=k_norm, num_heads=heads,
                                kv_num_heads=hkv)
    features = P("data", None, "model")
    got, hlo = _sharded(fn, args, [features, features, features, BOTH, BOTH, ROWS] + [None] * 4,
                        donate=(3, 4))
    _no_collectives(hlo)
    assert [x.sharding.spec for x in got[:3]] == [BOTH] * 3
    assert hlo_copies_of(hlo, (1, 1, c, d), np.float32, inside_fusions=False) == []


def test_a_packed_query_keeps_its_heads_whole(kernels, partitioner):
    """[Q | K | V] does not split at one place: the call runs whole along heads (right, with the
    gathers it needs); the session regroups packed weights instead (onnx.sharding)."""
    rng, b, s, heads, hkv, d, c = np.random.default_rng(5), 2, 1, 4, 2, 16, 8
    args = [_normal(rng, (b, s, (heads + 2 * hkv) * d)), _normal(rng, (b, hkv, c, d)),
            _normal(rng, (b, hkv, c, d)), np.array([0, 5], np.int32)]

    def fn(query, k_cache, v_cache, seqlens):
        return cuda.gqa_prepare(query, None, None, k_cache, v_cache, seqlens, num_heads=heads,
                                kv_num_heads=hkv)
    got, _ = _sharded(fn, args, [ROWS, BOTH, BOTH, ROWS])
    assert got[0].sharding.spec in (P("data"), P("data", None))


@pytest.mark.parametrize("split", ["column", "row"])
def test_linear_column_needs_nothing_row_one_all_reduce(kernels, partitioner, split):
    rng, m, k, rows = np.random.default_rng(6), 4, 64, 32
    args = [_normal(rng, (m, k)), _normal(rng, (rows, k)), _normal(rng, (rows,)),
            _normal(rng, (m, rows))]

    def fn(x, w, bias, residual):
        return cuda_matmul.linear(x, w, bias, residual)
    specs = [None, P("model"), None, None] if split == "column" else [HEADS, HEADS, None, None]
    got, hlo = _sharded(fn, args, specs)
    if split == "column":
        _no_collectives(hlo)
        assert got.sharding.spec == HEADS
    else:
        assert [op for op, _, _ in hlo_collectives(hlo)] == ["all-reduce"]
        assert hlo_collectives(hlo)[0][2] == (m, rows)


def test_gated_linear_splits_gate_up_pairs(kernels, partitioner):
    rng, m, k, rows = np.random.default_rng(7), 2, 32, 64
    args = [_normal(rng, (m, k)), _normal(rng, (rows, k)), _normal(rng, (k,))]

    def fn(x, w, norm):
        return cuda_matmul.linear(x, w, norm_weight=norm, gated=True)
    got, hlo = _sharded(fn, args, [None, P("model"), None])
    _no_collectives(hlo)
    assert got.sharding.spec == HEADS


@pytest.mark.parametrize("split", ["column", "row"])
def test_matmul_nbits_splits_rows_or_whole_blocks(kernels, partitioner, split):
    rng, m, k, rows, block = np.random.default_rng(8), 2, 128, 32, 32
    args = [_normal(rng, (m, k)), rng.integers(0, 256, (rows, k // block, block // 2)).astype(np.uint8),
            _normal(rng, (rows, k // block)) / 10,
            rng.integers(0, 16, (rows, k // block)).astype(np.uint8)]
    args[2:] = [ops.tile_nbits_meta(a) for a in args[2:]]  # the target's layout: split by tiles

    def fn(x, b_quant, scales, zero_points):
        return cuda_matmul.matmul_nbits(x, b_quant, scales, zero_points, bits=4, block_size=block)
    weight = P("model") if split == "column" else HEADS
    _, hlo = _sharded(fn, args, [None if split == "column" else HEADS, weight, weight, weight])
    assert [op for op, _, _ in hlo_collectives(hlo)] == ([] if split == "column" else ["all-reduce"])


def test_public_ops_split_on_the_reference_backend(partitioner):
    """group_query_attention and attention_with_cache as the cache step calls them."""
    rng, b, heads, hkv, d, c = np.random.default_rng(9), 2, 4, 2, 16, 16
    query, key = _normal(rng, (b, 1, heads * d)), _normal(rng, (b, 1, hkv * d))
    value, past = _normal(rng, (b, 1, hkv * d)), _normal(rng, (b, hkv, c, d))
    seqlens = np.array([4, 9], np.int32)

    def gqa(query, key, value, k_cache, v_cache, seqlens_k):
        return ops.group_query_attention(query, key, value, k_cache, v_cache, seqlens_k,
                                         np.int32(c), num_heads=heads, kv_num_heads=hkv,
                                         shared_buffer=True, softcap=30.0)
    features = P("data", None, "model")
    got, hlo = _sharded(gqa, [query, key, value, past, past.copy(), seqlens],
                        [features, features, features, BOTH, BOTH, ROWS], donate=(3, 4))
    _no_collectives(hlo)
    assert got.present_key.sharding.spec == BOTH

    def cached(q, k, v, k_cache, v_cache, lengths):
        return ops.attention_with_cache(q, k, v, k_cache, v_cache, lengths, is_causal=1)
    q4, k4 = _normal(rng, (b, heads, 1, d)), _normal(rng, (b, hkv, 1, d))
    _, hlo = _sharded(cached, [q4, k4, k4.copy(), past, past.copy(), seqlens],
                      [BOTH, BOTH, BOTH, BOTH, BOTH, ROWS], donate=(3, 4))
    _no_collectives(hlo)


def test_an_operand_sharded_otherwise_is_resharded(kernels, partitioner):
    """q split along its query rows: the op takes it as its rule says (XLA moves it); results
    unchanged."""
    rng = np.random.default_rng(10)
    args = [_normal(rng, (2, 4, 4, 16)), _normal(rng, (2, 2, 16, 16)), _normal(rng, (2, 2, 16, 16)),
            np.array([9, 16], np.int32)]

    def fn(q, k, v, kv_len):
        return cuda.decode_attention(q, k, v, kv_len, scale=0.25)
    _sharded(fn, args, [P(None, None, "model"), BOTH, BOTH, ROWS])
