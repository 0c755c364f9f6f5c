"""The FFI calls of `ops.cuda` / `ops.cuda_matmul` replaced by their executable specs, so that the
wrappers' own code (their batching and partitioning rules) runs on the CPU as it runs on a GPU."""

from __future__ import annotations

from jax_onnx_attn.ops import cuda, cuda_matmul
from jax_onnx_attn.ops.linear import (from_record_layout, from_rotary_pair_order, rotary_pair_order,
                                      untile_nbits_meta)
from jax_onnx_attn.ops.reference import decode as decode_reference
from jax_onnx_attn.ops.reference import general as general_reference
from jax_onnx_attn.ops.reference import gqa as gqa_reference
from jax_onnx_attn.ops.reference import kv_cache as kv_reference
from jax_onnx_attn.ops.reference import linear as linear_reference
from jax_onnx_attn.ops.reference import prefill as prefill_reference


def _linear(x, w, bias, residual, norm_weight, *, eps, gated):
    return linear_reference.linear(x, w, bias, residual, norm_weight, eps, gated)


def _nbits(x, b_quant, scales, zero_points, bias, residual, norm_weight, *, bits, block_size, eps,
           gated):
    # The target takes scales / zero points tiled (ops.tile_nbits_meta); the reference row-major.
    if scales.ndim == 3:
        n = b_quant.shape[0]
        scales = untile_nbits_meta(scales, n)
        zero_points = None if zero_points is None else untile_nbits_meta(zero_points, n)
    return linear_reference.matmul_nbits(x, b_quant, scales, zero_points, bias, residual,
                                         norm_weight, eps, gated, bits=bits, block_size=block_size)


def _nbits_record(x, rec, bias, residual, norm_weight, *, n, block_size, eps, gated):
    b_quant, scales, zero_points = from_record_layout(rec, n=n, block_size=block_size, dtype=x.dtype)
    return linear_reference.matmul_nbits(x, b_quant, scales, zero_points, bias, residual, norm_weight, eps,
                                         gated, bits=4, block_size=block_size)


def linear_gqa_prepare(x, w, bias, norm_weight, k_cache, v_cache, seqlens_k, cos_cache, sin_cache,
                       position_ids, *, num_heads, kv_num_heads, bits, block_size, eps):
    """The spec of the linear_gqa_prepare target: the projection (dense, or 4-bit in the record
    layout) of W in the rotary-pair order, put back in order, then gqa_prepare's spec."""
    d = k_cache.shape[3]
    rows = (num_heads + 2 * kv_num_heads) * d
    if bits == 16:
        y = linear_reference.linear(x, w, bias, None, norm_weight, eps)
    else:
        b_quant, scales, zero_points = from_record_layout(w, n=rows, block_size=block_size, dtype=x.dtype)
        y = linear_reference.matmul_nbits(x, b_quant, scales, zero_points, bias, None, norm_weight, eps,
                                          bits=bits, block_size=block_size)
    order = rotary_pair_order(num_heads, kv_num_heads, d, cos_cache.shape[1])
    query = from_rotary_pair_order(y, order).reshape(x.shape[0], 1, rows)
    return gqa_reference.prepare_step(query, None, None, k_cache, v_cache, seqlens_k, cos_cache, sin_cache,
                                      position_ids, num_heads=num_heads, kv_num_heads=kv_num_heads)


def use_specs(monkeypatch) -> list:
    """Replace each target's FFI call (the wrapper's body under its rule) with its spec, keyword
    arguments the spec does not take (the kernels' plan overrides) dropped. Returns the list that
    gets (target, first operand's shape, static keywords) per call (traces included)."""
    calls = []

    def spec(name, fn, drop=()):
        def call(*operands, **static):
            calls.append((name, operands[0].shape, dict(static)))
            return fn(*operands, **{k: v for k, v in static.items() if k not in drop})
        return call

    monkeypatch.setattr(cuda, "_kv_append", spec("kv_append", kv_reference.kv_append))
    monkeypatch.setattr(cuda, "_decode_attention",
                        spec("decode", decode_reference.decode_attention,
                             drop=("split_rows", "pdl", "cluster", "quant_regs", "plan_policy",
                                   "cursor_loads", "producer", "tile128", "key_rows")))
    monkeypatch.setattr(cuda, "_general_attention",
                        spec("general", general_reference.general_attention))
    monkeypatch.setattr(cuda, "_gqa_prepare", spec("gqa_prepare", gqa_reference.prepare_step))
    monkeypatch.setattr(cuda, "_prefill_attention",
                        spec("prefill", prefill_reference.prefill_attention,
                             drop=("schedule", "splits", "persistent")))
    monkeypatch.setattr(cuda_matmul, "_linear",
                        spec("linear", _linear, drop=("pdl", "cluster", "warps_k", "slots")))
    monkeypatch.setattr(cuda_matmul, "_matmul_nbits",
                        spec("nbits", _nbits, drop=("pdl", "cluster", "warps_k", "wide", "slots")))
    monkeypatch.setattr(cuda_matmul, "_matmul_nbits_record",
                        spec("nbits_record", _nbits_record, drop=("pdl",)))
    monkeypatch.setattr(cuda_matmul, "_linear_gqa_prepare",
                        spec("linear_gqa_prepare", linear_gqa_prepare, drop=("pdl",)))
    return calls
