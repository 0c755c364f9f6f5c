"""The FFI calls of `ops.cuda` / `ops.cuda_matmul` replaced by their executable specs, so that the
wrappers' own code (their batching and partitioning rules) runs on the CPU as it runs on a GPU."""

from __future__ import annotations

from jax_onnx_attn.ops import cuda, cuda_matmul
from jax_onnx_attn.ops.linear import untile_nbits_meta
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
    return calls
