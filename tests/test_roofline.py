"""jax_onnx_attn.runtime.roofline: the decode bound and prefill FLOPs, read off lowered models.

Oracle: the sizes each model's config (or fixture file) implies, counted independently here.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import numpy_helper

import jax_onnx_attn
from jax_onnx_attn.models import build_decoder, preset
from jax_onnx_attn.models.quant import nbits_bytes
from jax_onnx_attn.runtime import roofline

FIXTURES = Path(__file__).parent / "fixtures"


def _expected(config):
    """(full-read weight bytes, gathered bytes per token, KV bytes per token, matmul params) from
    the config alone."""
    item = config.np_dtype.itemsize
    linear = config.linear_shapes()
    if config.weight_bits:
        weights = sum(nbits_bytes(k, n, config.weight_bits, config.block_size, not config.zero_points, item)
                      for k, n in linear.values())
    else:
        weights = sum(k * n for k, n in linear.values()) * item
    weights += len(config.norm_names()) * config.hidden * item
    rows = config.hidden * item + 2 * (config.head_size // 2) * item  # embedding row + cos + sin rows
    kv = 2 * config.layers * config.kv_heads * config.head_size * item
    return weights, rows, kv, sum(k * n for k, n in linear.values())


@pytest.mark.parametrize("overrides", [dict(), dict(dtype="float32"), dict(weight_bits=4),
                                       dict(weight_bits=8, block_size=128, zero_points=True)])
def test_step_cost_of_our_models(overrides):
    config = preset("tiny", vocab=700, **overrides)
    cost = roofline.step_cost(jax_onnx_attn.load(build_decoder(config)))
    weights, rows, kv, matmul = _expected(config)
    assert (cost.weight_bytes, cost.row_bytes, cost.kv_bytes_per_token, cost.matmul_params) == \
        (weights, rows, kv, matmul)
    assert cost.attention_qd == (config.heads * config.head_size,) * config.layers
    b, t = 8, 2048
    assert cost.decode_bytes(b, t) == weights + b * rows + b * t * kv
    assert cost.decode_seconds(b, t) == pytest.approx(cost.decode_bytes(b, t) / 4.8e12)
    assert cost.decode_seconds(b, t, hbm_bytes_per_s=2e12) == pytest.approx(cost.decode_bytes(b, t) / 2e12)
    assert cost.fraction_of_bound(2 * cost.decode_seconds(b, t), b, t) == pytest.approx(0.5)
    qd = config.heads * config.head_size
    head = config.hidden * config.vocab  # the LM head: once per row in a prefill
    assert cost.head_params == head
    assert cost.prefill_flops(2, 512) == pytest.approx(
        2 * (matmul - head) * 2 * 512 + 2 * head * 2 + config.layers * 4 * 2 * qd * 512 * 512 / 2)
    assert cost.prefill_flops(2, 512, causal=False) - cost.prefill_flops(2, 512) == pytest.approx(
        config.layers * 4 * 2 * qd * 512 * 512 / 2)
    assert cost.decode_flops(1, 100) == pytest.approx(2 * matmul + config.layers * 4 * qd * 100)
    assert cost.breakdown["matmul_nbits" if config.weight_bits else "matmul"] + cost.breakdown["other"] \
        == weights


def test_builder_fixture_int4_counts_packed_bytes_scales_and_norms():
    """A real builder export: weight bytes are exactly the file's _Q4 + _scales + norm tensors."""
    path = FIXTURES / "builder_llama_int4" / "model.onnx"
    inits = {t.name: numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}
    full = sum(a.nbytes for n, a in inits.items() if n.endswith(("_Q4", "_scales", "layernorm.weight")))
    cost = roofline.step_cost(jax_onnx_attn.load(path))
    assert cost.weight_bytes == full
    assert cost.row_bytes == inits["model.embed_tokens.weight"][0].nbytes + 2 * inits["cos_cache"][0].nbytes
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4  # K and V, 2 layers, 2 KV heads, d 16, fp32


@pytest.mark.parametrize("name", ["torch_llama_op20", "torch_llama_op23"])
def test_torch_exports_are_read_too(name):
    """torch.onnx exports (Concat caches, decomposed or ai.onnx attention): every MatMul weight and
    norm read in full, the embedding by rows, the KV cache of both layers."""
    path = FIXTURES / name / "model.onnx"
    lowered = jax_onnx_attn.load(path)
    cost = roofline.step_cost(lowered)
    assert cost.kv_bytes_per_token == 2 * 2 * 2 * 16 * 4
    assert cost.matmul_params == 94208  # 2 layers x (q 64x64, k/v 64x32, o 64x64, 3 x 64x128) + head 64x320
    assert cost.head_params == 64 * 320
    embed = [n for n in lowered.params if "embed" in n]
    assert embed and cost.row_bytes >= lowered.params[embed[0]].shape[1] * 4
    assert len(cost.attention_qd) == 2
    assert cost.weight_bytes >= 4 * cost.matmul_params


def test_h200_numbers():
    assert roofline.H200_HBM_BYTES_PER_S == 4.8e12
    from jax_onnx_attn.bench import plots
    assert plots.H200.hbm_gbps * 1e9 == roofline.H200_HBM_BYTES_PER_S  # one source for the bound


@pytest.mark.parametrize("kind, bandwidth", [("NVIDIA H200", 4.8e12), ("NVIDIA H100 80GB HBM3", 3.35e12),
                                             ("NVIDIA H100 PCIe", 2.0e12), ("NVIDIA H100 NVL", 3.9e12),
                                             ("NVIDIA A100-SXM4-80GB", None), (None, None)])
def test_bandwidth_of_the_gpu_measured_on(kind, bandwidth):
    """The bound uses the bandwidth of the GPU that ran (jax's device_kind), the PCIe / NVL H100
    parts before the SXM one their names contain; an unknown GPU has none."""
    assert roofline.hbm_bytes_per_s(kind) == bandwidth


def test_bad_batch_is_named():
    cost = roofline.StepCost(1, 1, 1, 1, (1,))
    with pytest.raises(ValueError, match="batch=0"):
        cost.decode_bytes(0, 10)
    assert np.isclose(cost.decode_bytes(1, 0), 2)
