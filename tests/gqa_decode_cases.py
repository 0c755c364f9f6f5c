"""Inputs of GroupQueryAttention decode / verify steps on a shared fixed-capacity cache, shared by the
GPU tests of the CUDA path and the CPU test of its composition (tests/test_decode_paths.py)."""

import numpy as np


def gqa_inputs(seed, dtype, *, b=3, s=1, n=16, hkv=4, d=128, cap=160, packed=True, rotary=0,
               bias=False, sink=False, norm=False):
    """Random inputs of one step; the last batch row's seqlens_k is beyond the capacity (refused)."""
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
    if bias:
        inp["attention_bias"] = x(1 if seed % 2 else b, n, s, total)
    if sink:
        inp["head_sink"] = x(n)
    if norm:
        inp.update(q_norm_weight=x(d), k_norm_weight=x(d))
    return inp
