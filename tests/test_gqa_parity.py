"""GroupQueryAttention parity: our op under jax.jit against onnxruntime's CPU kernel.

Each test item is one static signature (shapes + attributes); its draws are configurations with
fresh random data and fresh per-batch lengths (ragged past lengths, right padding) that reuse the
compiled function. Outputs, present caches (bit-exact when quantised) and output_qk are compared
with the tolerances of jax_onnx_attn.testing. The default run covers every feature alone and
combined over onnxruntime's CPU test axes (batch 1/3, head configs (6,6) (6,3) (9,3) (32,8),
head sizes 32-256, prompt and past lengths 1 to a few hundred, f32 and f16); `-m slow` adds the
full feature x step x dtype product.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from ort_gqa import (Case, assert_matches, check_case, make_inputs, ort_has_input, ort_reference,
                     run_ours)

W = "local_window_size"


# (B, S, heads, D) of first prompts; (B, P, heads, D) of decode steps; (B, S, P, heads, D) of
# chunks (multi-token steps with a past). Cycled over the features so every shape meets several.
PROMPT_SHAPES = [(3, 35, (6, 3), 64), (1, 35, (6, 6), 32), (3, 16, (32, 8), 128),
                 (1, 127, (9, 3), 32), (3, 8, (6, 3), 256), (1, 20, (9, 3), 96)]
DECODE_SHAPES = [(3, 64, (6, 3), 32), (1, 339, (9, 3), 64), (3, 128, (32, 8), 128),
                 (1, 200, (6, 6), 256), (3, 48, (9, 3), 160)]
CHUNK_SHAPES = [(1, 35, 128, (6, 3), 64), (3, 8, 64, (9, 3), 32), (1, 128, 256, (6, 6), 32),
                (3, 3, 40, (32, 8), 64)]

# Every feature alone, then combined. Values are Case fields (attrs merged by name).
FEATURES = {
    "plain": {},
    "packed": dict(packed=True),
    "rope": dict(rotary="half"),
    "rope-interleaved": dict(rotary="interleaved"),
    "rope-partial": dict(rotary="half", rotary_dim=16),
    "rope-position_ids": dict(rotary="half", position_ids=True),
    "window1": dict(attrs={W: 1}),
    "window5": dict(attrs={W: 5}),
    "window17": dict(attrs={W: 17}),
    "softcap": dict(attrs={"softcap": 2.0}),
    "smooth": dict(attrs={"smooth_softmax": 1}),
    "sink": dict(head_sink=True),
    "sink-smooth": dict(head_sink=True, attrs={"smooth_softmax": 1}),
    "bias-BN": dict(bias=("B", "N")),
    "bias-11": dict(bias=(1, 1)),
    "bias-B1": dict(bias=("B", 1)),
    "bias-1N": dict(bias=(1, "N")),
    "qk1": dict(attrs={"qk_output": 1}),
    "qk2": dict(attrs={"qk_output": 2}),
    "causal0": dict(attrs={"causal": 0}),
    "scale": dict(attrs={"scale": 0.3}),
    "rope-window-softcap-sink-packed": dict(rotary="half", head_sink=True, packed=True,
                                            attrs={W: 7, "softcap": 50.0}),
    "rope-il-posid-bias-smooth-qk2": dict(rotary="interleaved", position_ids=True,
                                          bias=("B", 1), attrs={"smooth_softmax": 1, "qk_output": 2}),
    "window-bias-softcap-qk1": dict(bias=(1, "N"), attrs={W: 4, "softcap": 2.0, "qk_output": 1}),
    "causal0-rope-partial-bias-sink-scale": dict(rotary="half", rotary_dim=16, bias=("B", "N"),
                                                 head_sink=True, attrs={"causal": 0, "scale": 0.2}),
    "packed-rope-il-window-smooth-qk1": dict(packed=True, rotary="interleaved",
                                            attrs={W: 3, "smooth_softmax": 1, "qk_output": 1}),
}

STEPS = ("prompt", "decode", "chunk")


def feature_case(feature: str, step: str, dtype: str, index: int) -> Case:
    """One feature bundle at one step type; `index` cycles shapes and cache modes."""
    spec = dict(FEATURES[feature])
    attrs = dict(spec.pop("attrs", {}))
    # Alternate between a shared (fixed-capacity) cache and a growing one.
    cache = "shared" if index % 2 else "grow"
    if step == "prompt":
        b, s, heads, d = PROMPT_SHAPES[index % len(PROMPT_SHAPES)]
        shape = dict(batch=b, seq=s, heads=heads, head_size=d)
    elif step == "decode":
        b, p, heads, d = DECODE_SHAPES[index % len(DECODE_SHAPES)]
        shape = dict(batch=b, seq=1, past=p, heads=heads, head_size=d, step="decode", cache=cache)
    else:
        b, s, p, heads, d = CHUNK_SHAPES[index % len(CHUNK_SHAPES)]
        shape = dict(batch=b, seq=s, past=p, heads=heads, head_size=d, step="chunk", cache=cache)
    if "bias" in spec:
        spec["bias"] = tuple(1 if x == 1 else 2 for x in spec["bias"])  # 2: full (B or N)
    return Case(dtype=dtype, attrs=tuple(sorted(attrs.items())), **shape, **spec)


def _feature_cases(default: bool):
    """Default: every feature at every step type, f32 and f16 alternating. Slow: the rest of the
    feature x step x dtype x cache-mode product."""
    cases = []
    for i, feature in enumerate(FEATURES):
        for j, step in enumerate(STEPS):
            for k, dtype in enumerate(("float32", "float16")):
                for shift in (0, 1):
                    chosen = (i + j + k) % 2 == 0 and shift == 0
                    if chosen == default and (shift == 0 or step != "prompt"):
                        cases.append(feature_case(feature, step, dtype, i + j + shift))
    return cases


DEFAULT_CASES = _feature_cases(default=True)
SLOW_CASES = _feature_cases(default=False)


def _draws(case: Case) -> int:
    return 3 if case.step == "prompt" else 4


@pytest.mark.parametrize("case", DEFAULT_CASES, ids=Case.id)
def test_feature(case):
    check_case(case, _draws(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", SLOW_CASES, ids=Case.id)
def test_feature_slow(case):
    check_case(case, _draws(case))


# ---- quantised KV cache: int8 / int4 x per tensor / per channel, f32 and f16 ----
QUANT_SETUPS = [
    dict(dtype="float32", batch=3, seq=16, past=16, heads=(6, 3), head_size=32, step="prompt"),
    dict(dtype="float16", batch=1, seq=1, past=64, heads=(9, 3), head_size=64, step="decode",
         rotary="half"),
    dict(dtype="float32", batch=3, seq=1, past=33, heads=(6, 6), head_size=32, step="decode",
         cache="grow", bias=(1, 2)),
    dict(dtype="float16", batch=1, seq=4, past=40, heads=(4, 2), head_size=16, step="chunk",
         packed=True, attrs=((W, 3),)),
]
QUANT_FORMATS = [(8, "PER_TENSOR"), (8, "PER_CHANNEL"), (4, "PER_TENSOR"), (4, "PER_CHANNEL")]
# Default: each format in two setups (one f32, one f16); slow: every format in every setup.
QUANT_CASES = [Case(quant=fmt, **QUANT_SETUPS[(i + shift) % 4])
               for i, fmt in enumerate(QUANT_FORMATS) for shift in (0, 1)]
QUANT_SLOW_CASES = [Case(quant=fmt, **setup) for fmt in QUANT_FORMATS for setup in QUANT_SETUPS
                    if Case(quant=fmt, **setup) not in QUANT_CASES]


@pytest.mark.parametrize("case", QUANT_CASES, ids=Case.id)
def test_quantized_cache(case):
    check_case(case, _draws(case))


@pytest.mark.slow
@pytest.mark.parametrize("case", QUANT_SLOW_CASES, ids=Case.id)
def test_quantized_cache_slow(case):
    check_case(case, _draws(case))


# ---- cache modes and lengths ----
CACHE_CASES = [
    # A static (non-shared) cache longer than total: present keeps P rows, zeros past the writes.
    Case(batch=3, seq=1, past=96, step="decode", cache="static", rotary="half"),
    Case(batch=1, seq=6, past=48, step="chunk", cache="static", attrs=((W, 9),)),
    # A first prompt into a shared buffer (rows past S untouched) and into a static cache; the
    # cache is longer than total, bias and output_qk are not.
    Case(batch=3, seq=12, past=40, rotary="interleaved", position_ids=True, bias=(2, 1),
         attrs=(("qk_output", 1),)),
    Case(batch=3, seq=12, past=40, cache="static", head_sink=True),
    # Long pasts (onnxruntime's CPU past sweep) with the biggest head configs.
    Case(batch=3, seq=1, past=512, step="decode", heads=(32, 8), head_size=256, rotary="half"),
    Case(batch=1, seq=1, past=1024, step="decode", heads=(9, 3), head_size=64, attrs=((W, 100),)),
    Case(dtype="float16", batch=3, seq=1, past=300, step="decode", heads=(32, 8), head_size=128,
         attrs=(("softcap", 50.0),)),
    # Head sizes that are multiples of 8 but not of 16 (no rotary), and 80 with rotary.
    Case(batch=3, seq=1, past=128, step="decode", heads=(9, 3), head_size=40, attrs=((W, 20),)),
    Case(dtype="float16", batch=3, seq=35, heads=(6, 6), head_size=80, rotary="half", packed=True),
    # Chunks of every batch size (onnxruntime: B=1 only; B>1 checked row by row).
    Case(batch=3, seq=32, past=128, step="chunk", rotary="half", position_ids=True),
    Case(batch=1, seq=128, past=129, step="chunk", heads=(9, 3), head_size=32, cache="grow"),
    Case(dtype="float16", batch=3, seq=16, past=64, step="chunk", rotary="interleaved",
         bias=(2, 2), attrs=(("qk_output", 2), (W, 6))),
]


@pytest.mark.parametrize("case", CACHE_CASES, ids=Case.id)
def test_cache_modes(case):
    check_case(case, _draws(case))


# ---- KV-shared layers: key/value with 0 rows ----
KV_SHARED_CASES = [
    Case(batch=3, seq=1, past=40, step="decode", kv_shared=True, rotary="half"),
    Case(dtype="float16", batch=3, seq=1, past=40, step="decode", cache="grow", kv_shared=True,
         attrs=((W, 6),)),
    Case(batch=3, seq=5, past=40, step="chunk", kv_shared=True, bias=(2, 1), rotary="half"),
    Case(batch=2, seq=12, past=24, kv_shared=True, head_sink=True),   # first prompt
]


@pytest.mark.parametrize("case", KV_SHARED_CASES, ids=Case.id)
def test_kv_shared_layer(case):
    check_case(case, _draws(case))


# ---- sliding-window cache: block eviction, absolute positions ----
SLIDING = (("sliding_window_cache", 1),)
SLIDING_CASES = [
    Case(batch=3, seq=1, past=6, total_len=40, step="decode", attrs=SLIDING + ((W, 4),)),
    Case(batch=3, seq=1, past=8, total_len=50, step="decode", rotary="half", position_ids=True,
         bias=(2, 1), attrs=SLIDING + ((W, 3),)),
    Case(dtype="float16", batch=2, seq=1, past=4, total_len=30, step="decode",
         attrs=SLIDING + ((W, 4), ("softcap", 2.0))),
    Case(batch=1, seq=9, past=6, total_len=30, step="chunk", rotary="interleaved",
         attrs=SLIDING + ((W, 4),)),
    Case(batch=3, seq=3, past=8, total_len=40, step="chunk", head_sink=True,
         attrs=SLIDING + ((W, 5),)),
    Case(batch=2, seq=10, past=6, rotary="half", attrs=SLIDING + ((W, 4),)),  # first prompt S > C
    Case(batch=3, seq=1, past=12, total_len=60, step="decode", cache="static",
         quant=(8, "PER_CHANNEL"), attrs=SLIDING + ((W, 7),)),
]


@pytest.mark.parametrize("case", SLIDING_CASES, ids=Case.id)
def test_sliding_window_cache(case):
    check_case(case, _draws(case))


@pytest.mark.parametrize("capacity,window", [(6, 4), pytest.param(8, 3, marks=pytest.mark.slow)])
def test_sliding_window_cache_multi_step(capacity, window):
    """A whole generation: each step's present is the next step's past on both sides."""
    steps = [5, 1, 3, 9, 1, 2]
    base = Case(batch=1, past=capacity, heads=(4, 2), head_size=16, rotary="half",
                attrs=SLIDING + ((W, window),))
    ours_past = ort_past = None
    t = 0
    for i, s in enumerate(steps):
        t += s
        case = dataclasses.replace(base, seq=s, total_len=t, step="prompt" if i == 0 else "chunk")
        inputs = make_inputs(case, i)
        inputs["seqlens_k"] = np.array([t - 1], np.int32)
        if i:
            inputs.update(ort_past)
        ref = ort_reference(case, inputs)
        ours = run_ours(case, {**inputs, **(ours_past or {})})
        assert_matches(case, inputs, ours, ref, f"step {i} t={t}")
        ours_past = dict(past_key=np.asarray(ours.present_key), past_value=np.asarray(ours.present_value))
        ort_past = dict(past_key=ref["present_key"], past_value=ref["present_value"])


# ---- right-padded chunks (query_seqlens, onnxruntime >= 1.32) ----
QUERY_SEQLENS_CASES = [
    Case(batch=3, seq=4, past=32, step="chunk", query_seqlens=True, rotary="half", position_ids=True),
    Case(dtype="float16", batch=3, seq=6, past=40, step="chunk", query_seqlens=True,
         attrs=((W, 5), ("softcap", 2.0))),
    Case(batch=3, seq=1, past=24, step="decode", query_seqlens=True, bias=(2, 2)),
    Case(batch=2, seq=5, past=6, total_len=30, step="chunk", query_seqlens=True,
         attrs=SLIDING + ((W, 4),)),
]


@pytest.mark.skipif(not ort_has_input("query_seqlens"), reason="onnxruntime < 1.32: no query_seqlens")
@pytest.mark.parametrize("case", QUERY_SEQLENS_CASES, ids=Case.id)
def test_query_seqlens(case):
    check_case(case, 3)


def test_first_prompt_reads_only_position_ids_00():
    """onnxruntime's first-prompt quirk: every row rotates with s + position_ids[0, 0]."""
    case = Case(batch=3, seq=10, heads=(4, 2), head_size=32, rotary="half", position_ids=True)
    inputs = make_inputs(case, 0)
    inputs["position_ids"] = np.array([[3], [5], [7]]) + np.arange(10)   # rows differ
    ours = run_ours(case, inputs)
    assert_matches(case, inputs, ours, ort_reference(case, inputs))
    # ... and it is the same as giving row 0's ids to every row.
    same = dict(inputs, position_ids=np.broadcast_to(inputs["position_ids"][:1], (3, 10)).copy())
    np.testing.assert_array_equal(np.asarray(run_ours(case, same).output), np.asarray(ours.output))
