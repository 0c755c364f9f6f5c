"""ops.attention against two independent executable oracles on seeded random calls.

- onnxruntime's CPU Attention kernel (f32 and f16, opsets 23/24), restricted to what it accepts
  and gets right (onnx-attention.md §5): masks of rank 2-4 whose last two dims are (S, T), no bf16,
  no opset 25, no int mask with causal (both oracles crash) or with nonpad (onnxruntime 1.32's
  result differs from the spec and onnx's reference), and past only with L == S (with L != S
  onnxruntime aligns causal to T - S where the spec says P). Its mode-2 output holds the dtype's
  lowest finite value where the spec has -inf; that is mapped back before comparing.
- onnx's ReferenceEvaluator (numpy) for what onnxruntime lacks: bf16, opset-25 windows, rank-1 and
  short masks, past with L != S, int masks with nonpad, every softmax_precision, float64.

Each call is a single-node model built with onnx.helper (`conformance.attention_model`).
"""

from __future__ import annotations

import functools

import jax
import ml_dtypes
import numpy as np
import onnxruntime as ort
import pytest
from onnx.reference import ReferenceEvaluator

from jax_onnx_attn import conformance, ops
from jax_onnx_attn.testing import assert_close

STATIC = ("is_causal", "scale", "softcap", "q_num_heads", "kv_num_heads", "qk_matmul_output_mode",
          "softmax_precision", "left_window_size", "right_window_size", "opset", "return_qk")
_attention = jax.jit(ops.attention, static_argnames=STATIC)

#: Seeds of the sampled calls (test_sampled_calls_cover_every_feature checks they cover the features).
ORT_SEEDS = range(24)
REF_SEEDS = range(1010, 1034)
BF16 = np.dtype(ml_dtypes.bfloat16)
_PRECISION_DTYPES = {1: np.dtype(np.float32), 10: np.dtype(np.float16), 11: np.dtype(np.float64),
                     16: BF16}


def sample_call(seed: int, oracle: str):
    """A random Attention call: (opset, inputs by ONNX name, attributes, ONNX outputs wanted).

    oracle="ort" keeps to what onnxruntime's CPU kernel accepts; "reference" also draws bf16, opset 25
    windows, rank-1 / short masks, past with L != S and int masks with nonpad.
    """
    r = np.random.default_rng(seed)
    ref = oracle == "reference"
    dtype = np.dtype([np.float32, np.float16, BF16][seed % 3 if ref else seed % 2])
    opset = int(r.choice([23, 24, 25] if ref else [23, 24]))
    batch = int(r.integers(1, 3))
    hkv, group = [(1, 1), (2, 1), (2, 2), (1, 4), (3, 2)][r.integers(5)]
    hq = hkv * group
    s = int(r.choice([1, 2, 4, 5]))
    d = int(r.choice([8, 16]))
    dv = int(r.choice([d, 8, 12]))
    cache = str(r.choice(["none", "past", "nonpad"] if opset >= 24 else ["none", "past"]))
    past = int(r.integers(1, 6)) if cache == "past" else 0
    if cache == "nonpad":
        length = int(r.integers(s, s + 5))
    elif cache == "past" and not ref:
        length = s
    else:
        length = int(r.integers(1, 7))
    total = past + length
    causal = bool(r.random() < 0.5)

    def normal(shape):
        return r.standard_normal(shape).astype(dtype)

    inputs = {"Q": normal((batch, hq, s, d)), "K": normal((batch, hkv, length, d)),
              "V": normal((batch, hkv, length, dv))}
    if cache == "past":
        inputs["past_key"] = normal((batch, hkv, past, d))
        inputs["past_value"] = normal((batch, hkv, past, dv))
    if cache == "nonpad":
        inputs["nonpad_kv_seqlen"] = r.integers(0, length + 1, size=batch).astype(np.int64)

    kinds = ["none", "bool", "float"]
    if not causal and (ref or cache != "nonpad"):
        kinds.append("int")  # int + causal crashes both oracles
    kind = str(r.choice(kinds))
    if kind != "none":
        rank = int(r.integers(1 if ref else 2, 5))
        # A query dim of 1 only without causal: onnx's reference then takes S from the mask
        # (test_causal_with_query_broadcast_mask covers it against the broadcast mask).
        shape = [batch if r.random() < 0.6 else 1, hq if r.random() < 0.6 else 1,
                 s if not ref or causal or r.random() < 0.7 else 1, total]
        if ref and opset >= 24 and kind != "int" and r.random() < 0.4:
            shape[3] = int(r.integers(1, total + 1))  # short mask, padded with -inf
        shape = shape[4 - rank:]
        if kind == "bool":
            mask = r.random(shape) < 0.8
        elif kind == "float":
            mask = np.where(r.random(shape) < 0.15, -np.inf, r.standard_normal(shape)).astype(dtype)
        else:
            mask = r.integers(-3, 3, size=shape).astype(np.int64)
        inputs["attn_mask"] = mask

    attrs = {}
    if causal:
        attrs["is_causal"] = 1
    if r.random() < 0.3:
        attrs["softcap"] = float(r.choice([2.0, 5.0]))
    if r.random() < 0.3:
        attrs["scale"] = float(r.uniform(0.05, 0.5))
    if ref and r.random() < 0.3:
        attrs["softmax_precision"] = int(r.choice(list(_PRECISION_DTYPES)))
    elif dtype == np.float16 and r.random() < 0.4:
        attrs["softmax_precision"] = 1
    if opset >= 25 and r.random() < 0.7:
        attrs["left_window_size"] = int(r.integers(-1, 4))
        attrs["right_window_size"] = int(r.integers(-1, 4))
    want_qk = bool(r.random() < 0.5)
    if want_qk:
        mode = int(r.integers(0, 4))
        if ref and mode == 0 and "softcap" in attrs:
            mode = 1  # onnx's reference returns softcapped values in mode 0; the spec says raw
        attrs["qk_matmul_output_mode"] = mode
    if r.random() < 0.3:
        attrs["q_num_heads"], attrs["kv_num_heads"] = hq, hkv
        for name in ("Q", "K", "V"):
            x = inputs[name]
            inputs[name] = x.transpose(0, 2, 1, 3).reshape(x.shape[0], x.shape[2], -1)
    outputs = ["Y"] + (["present_key", "present_value"] if cache == "past" else [])
    if want_qk:
        outputs.append("qk_matmul_output")
    return opset, inputs, attrs, outputs


@functools.lru_cache(maxsize=None)
def _ort_options():
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1  # the CI machine is small and shared
    options.inter_op_num_threads = 1
    options.log_severity_level = 3
    return options


def run_ort(opset, inputs, attrs, outputs):
    model = conformance.attention_model(inputs, attrs, outputs, opset=opset)
    session = ort.InferenceSession(model.SerializeToString(), _ort_options(),
                                   providers=["CPUExecutionProvider"])
    return dict(zip(outputs, session.run(outputs, inputs)))


def run_reference(opset, inputs, attrs, outputs):
    model = conformance.attention_model(inputs, attrs, outputs, opset=opset)
    return dict(zip(outputs, ReferenceEvaluator(model).run(outputs, inputs)))


def run_ours(opset, inputs, attrs, outputs):
    result = _attention(**inputs, **attrs, opset=opset, return_qk="qk_matmul_output" in outputs)
    return dict(zip(conformance.ATTENTION_OUTPUTS, result))


def _compare_dtype(inputs, attrs):
    """The tolerance follows the least precise type the computation went through."""
    dtypes = [np.dtype(inputs["Q"].dtype), np.dtype(inputs["V"].dtype)]
    if "softmax_precision" in attrs:
        dtypes.append(_PRECISION_DTYPES[attrs["softmax_precision"]])
    return max(dtypes, key=lambda t: ml_dtypes.finfo(t).eps)


def _check(got, expected, inputs, attrs, label):
    dtype = _compare_dtype(inputs, attrs)
    for name, want in expected.items():
        have = np.asarray(got[name])
        assert have.shape == want.shape, f"{label} {name}: shape {have.shape} != {want.shape}"
        assert have.dtype == want.dtype, f"{label} {name}: dtype {have.dtype} != {want.dtype}"
        assert_close(have, want, dtype, err_msg=f"{label} {name}")


def _describe(opset, inputs, attrs):
    shapes = ", ".join(f"{k}={np.dtype(v.dtype).name}{list(v.shape)}" for k, v in inputs.items())
    return f"opset {opset}: {shapes} {attrs}"


@pytest.mark.parametrize("seed", ORT_SEEDS)
def test_matches_onnxruntime(seed):
    opset, inputs, attrs, outputs = sample_call(seed, "ort")
    expected = run_ort(opset, inputs, attrs, outputs)
    if "qk_matmul_output" in expected and attrs.get("qk_matmul_output_mode") == 2:
        # onnxruntime writes the dtype's lowest finite value where the spec (and we) keep -inf.
        qk = expected["qk_matmul_output"]
        lowest = np.finfo(qk.dtype).min
        expected["qk_matmul_output"] = np.where(qk <= lowest, -np.inf, qk).astype(qk.dtype)
    _check(run_ours(opset, inputs, attrs, outputs), expected, inputs, attrs,
           _describe(opset, inputs, attrs))


@pytest.mark.parametrize("seed", REF_SEEDS)
def test_matches_onnx_reference(seed):
    opset, inputs, attrs, outputs = sample_call(seed, "reference")
    expected = run_reference(opset, inputs, attrs, outputs)
    _check(run_ours(opset, inputs, attrs, outputs), expected, inputs, attrs,
           _describe(opset, inputs, attrs))


def test_float64_matches_onnx_reference():
    """float64 end to end (jax_enable_x64 on): the reference keeps f64 and agrees to 1e-9."""
    r = np.random.default_rng(7)
    inputs = {"Q": r.standard_normal((2, 4, 3, 8)), "K": r.standard_normal((2, 2, 5, 8)),
              "V": r.standard_normal((2, 2, 5, 6)),
              "attn_mask": np.where(r.random((3, 7)) < 0.2, -np.inf, r.standard_normal((3, 7))),
              "past_key": r.standard_normal((2, 2, 2, 8)),
              "past_value": r.standard_normal((2, 2, 2, 6))}
    attrs = {"is_causal": 1, "softcap": 3.0, "qk_matmul_output_mode": 3}
    outputs = ["Y", "present_key", "present_value", "qk_matmul_output"]
    expected = run_reference(24, inputs, attrs, outputs)
    with jax.enable_x64(True):
        got = run_ours(24, inputs, attrs, outputs)
        _check(got, expected, inputs, attrs, "float64")


@pytest.mark.parametrize("oracle", [run_ort, run_reference], ids=["ort", "reference"])
def test_masked_row_sentinels(oracle):
    """A row of -inf is fully masked (y = 0, mode-3 row 0); a row of a finite sentinel (-1e9) is
    not: it attends every key equally (y = mean of V), as in both oracles."""
    r = np.random.default_rng(11)
    inputs = {"Q": _normal_f32(r, (1, 2, 3, 8)), "K": _normal_f32(r, (1, 2, 4, 8)),
              "V": _normal_f32(r, (1, 2, 4, 8))}
    mask = r.standard_normal((3, 4)).astype(np.float32)
    mask[0], mask[1] = -np.inf, -1e9
    inputs["attn_mask"] = mask
    attrs = {"qk_matmul_output_mode": 3}
    expected = oracle(23, inputs, attrs, ["Y", "qk_matmul_output"])
    got = run_ours(23, inputs, attrs, ["Y", "qk_matmul_output"])
    _check(got, expected, inputs, attrs, "sentinels")
    y = np.asarray(got["Y"])
    np.testing.assert_array_equal(y[:, :, 0], 0.0)
    np.testing.assert_array_equal(np.asarray(got["qk_matmul_output"])[:, :, 0], 0.0)
    assert_close(y[:, :, 1], np.broadcast_to(inputs["V"].mean(axis=2), y[:, :, 1].shape))


def _normal_f32(r, shape):
    return r.standard_normal(shape).astype(np.float32)


def test_causal_with_query_broadcast_mask():
    """A mask whose query dim is 1 broadcasts over the S rows under causal too.

    onnx's ReferenceEvaluator derives the causal triangle from the mask's shape there (so it builds
    a 1 x T triangle); the function body and the spec broadcast first. The oracle is the reference
    run on the mask broadcast explicitly to (S, T).
    """
    r = np.random.default_rng(3)
    inputs = {"Q": r.standard_normal((2, 2, 4, 8)).astype(np.float32),
              "K": r.standard_normal((2, 2, 3, 8)).astype(np.float32),
              "V": r.standard_normal((2, 2, 3, 8)).astype(np.float32),
              "past_key": r.standard_normal((2, 2, 2, 8)).astype(np.float32),
              "past_value": r.standard_normal((2, 2, 2, 8)).astype(np.float32),
              "attn_mask": r.standard_normal((2, 1, 1, 5)).astype(np.float32)}
    attrs = {"is_causal": 1}
    explicit = dict(inputs, attn_mask=np.broadcast_to(inputs["attn_mask"], (2, 1, 4, 5)).copy())
    expected = run_reference(24, explicit, attrs, ["Y"])
    _check(run_ours(24, inputs, attrs, ["Y"]), expected, inputs, attrs, "query-broadcast mask")


def _features(call):
    opset, inputs, attrs, outputs = call
    q, k, v = inputs["Q"], inputs["K"], inputs["V"]
    mask = inputs.get("attn_mask")
    three_d = q.ndim == 3
    hq = attrs["q_num_heads"] if three_d else q.shape[1]
    hkv = attrs["kv_num_heads"] if three_d else k.shape[1]
    found = {f"dtype:{np.dtype(q.dtype).name}", f"opset:{opset}", "3d" if three_d else "4d",
             "mha" if hq == hkv else ("mqa" if hkv == 1 else "gqa")}
    if v.shape[-1] != k.shape[-1]:  # 3D: Hkv * Dv vs Hkv * D
        found.add("dv!=d")
    if mask is not None:
        found |= {f"mask:{np.dtype(mask.dtype).kind}", f"mask_rank:{mask.ndim}"}
    for key in ("past_key", "nonpad_kv_seqlen"):
        if key in inputs:
            found.add(key)
    for key in ("is_causal", "softcap", "scale", "softmax_precision", "left_window_size"):
        if key in attrs:
            found.add(key)
    if "qk_matmul_output" in outputs:
        found.add(f"qk_mode:{attrs['qk_matmul_output_mode']}")
        if attrs["qk_matmul_output_mode"] == 0 and "softcap" in attrs:
            found.add("qk_mode:0+softcap")  # mode 0 is the raw product even with softcap
    return found


@pytest.mark.parametrize("oracle,seeds", [("ort", ORT_SEEDS), ("reference", REF_SEEDS)])
def test_sampled_calls_cover_every_feature(oracle, seeds):
    """The seeds above must exercise every feature the oracle supports (guards the sampler)."""
    covered = set().union(*(_features(sample_call(seed, oracle)) for seed in seeds))
    needed = {"dtype:float32", "dtype:float16", "opset:23", "opset:24", "3d", "4d", "mha", "gqa",
              "mqa", "dv!=d", "mask:b", "mask:f", "mask:i", "mask_rank:2", "mask_rank:3",
              "mask_rank:4", "past_key", "nonpad_kv_seqlen", "is_causal", "softcap", "scale",
              "softmax_precision", "qk_mode:0", "qk_mode:1", "qk_mode:2", "qk_mode:3"}
    if oracle == "ort":
        needed.add("qk_mode:0+softcap")
    else:
        needed |= {"dtype:bfloat16", "opset:25", "left_window_size", "mask_rank:1"}
    assert needed <= covered, f"not covered: {sorted(needed - covered)}"
