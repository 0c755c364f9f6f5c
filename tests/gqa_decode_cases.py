"""Inputs of GroupQueryAttention decode / verify steps on a shared fixed-capacity cache, shared by the
GPU tests of the CUDA path and the CPU test of its composition (tests/test_decode_paths.py)."""

import numpy as np


def gqa_inputs(seed, dtype, *, b=3, s=1, n=16, hkv=4, d=128, cap=160, packed=True, rotary=0,
               bias=False, sink=False, norm=False, position_ids=False, kv_bits=0,
               quant_type="PER_TENSOR"):
    """Random inputs of one step; the last batch row's seqlens_k is beyond the capacity (refused).

    rotary: 0 none, 1 half-split, 2 interleaved (partial: R = D / 2); position_ids: random rotary
    positions (int64, as ONNX gives them) instead of past_b + s. kv_bits 8 / 4: an int8 / int4
    (uint8, D / 2) past cache of random levels with float32 k_scale / v_scale (quant_type
    PER_TENSOR or PER_CHANNEL); quant_attrs(kv_bits, quant_type) gives the matching attributes."""
    rng = np.random.default_rng(seed)
    total = cap - 3  # shorter than the capacity: keys past it get no bias
    past = rng.integers(0, total - s + 1, size=b)
    seqlens = (past + s - 1).astype(np.int32)
    seqlens[-1] = cap + 2  # out of range: refused, status set, output 0
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    inp = dict(past_key=x(b, hkv, cap, d), past_value=x(b, hkv, cap, d), seqlens_k=seqlens,
               total_sequence_length=total)
    if packed:
        inp["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        inp.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    if rotary:
        ang = rng.uniform(0, 2 * np.pi, (cap, d // 4))  # partial rotary: R = D / 2
        inp.update(cos_cache=np.cos(ang).astype(dtype), sin_cache=np.sin(ang).astype(dtype))
        if position_ids:
            inp["position_ids"] = rng.integers(0, cap, size=(b, s))
    if bias:
        inp["attention_bias"] = x(1 if seed % 2 else b, n, s, total)
    if sink:
        inp["head_sink"] = x(n)
    if norm:
        inp.update(q_norm_weight=x(d), k_norm_weight=x(d))
    if kv_bits:
        shape = (1,) if quant_type == "PER_TENSOR" else (1, hkv, 1, d)
        qmax = 127 if kv_bits == 8 else 7
        k_scale, v_scale = [(rng.uniform(1.0, 3.0, shape) / qmax).astype(np.float32) for _ in "kv"]
        storage, cache_d, hi = (np.int8, d, 128) if kv_bits == 8 else (np.uint8, d // 2, 256)
        inp.update({name: rng.integers(-128 if kv_bits == 8 else 0, hi, (b, hkv, cap, cache_d))
                    .astype(storage) for name in ("past_key", "past_value")})
        inp.update(k_scale=k_scale, v_scale=v_scale)
    return inp


def quant_attrs(kv_bits: int, quant_type: str = "PER_TENSOR") -> dict:
    """The GroupQueryAttention attributes of a quantised cache from gqa_inputs (none for 0)."""
    if not kv_bits:
        return {}
    return dict(k_quant_type=quant_type, v_quant_type=quant_type, kv_cache_bit_width=kv_bits)
