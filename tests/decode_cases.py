"""Feature axes of the decode-engine GPU sweeps (dense and quantised caches share them)."""

import itertools

import ml_dtypes
import numpy as np

BIASES = [None, "f32_full", "bool_b1s_short", "bf16_h1_long"]
WINDOWS = [(-1, -1), (37, -1), (0, -1), (-1, 5), (20, 3)]
#: (causal, (left, right), softcap, bias kind, sink)
FEATURES = list(itertools.product([True, False], WINDOWS, [0.0, 30.0], BIASES, [False, True]))


def bias(kind, rng, b, hq, s, c):
    """A bias of one BIASES kind for [B, Hq, S, C] caches: f32 with -inf holes and a fully masked
    row, a short broadcast bool keep-mask, or a bf16 bias longer than the cache."""
    if kind is None:
        return None
    if kind == "f32_full":
        x = (rng.standard_normal((b, hq, s, c)) * 2).astype(np.float32)
        x[rng.random(x.shape) < 0.1] = -np.inf
        x[0, 1, 0, :] = -np.inf  # a fully masked row
        return x
    if kind == "bool_b1s_short":
        return rng.random((b, 1, 1, c - 7)) < 0.8
    if kind == "bf16_h1_long":
        return rng.standard_normal((1, hq, s, c + 5)).astype(ml_dtypes.bfloat16)
    raise ValueError(kind)
