"""A float64 NumPy oracle for decode attention, written row by row from the definition (no shared
code with the reference): query row i of S at position kv_len - S + i (+ pos_shift) sees key j when j < kv_len,
j < bias length, and the causal / window conditions hold; softcap, then bias, then a softmax whose
denominator may carry a sink logit; rows with no visible key give 0."""

from __future__ import annotations

import numpy as np


def decode_attention(q, k, v, kv_len, bias=None, sink=None, *, scale, softcap=0.0, causal=True,
                     left=-1, right=-1, pos_shift=0):
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    b_, hq, s_, d = q.shape
    hkv, c = k.shape[1], k.shape[2]
    g = hq // hkv
    out = np.zeros((b_, hq, s_, d))
    for b in range(b_):
        n = int(min(max(int(kv_len[b]), 0), c))
        for h in range(hq):
            for i in range(s_):
                pos = n - s_ + i + pos_shift
                xs, vs = [], []
                for j in range(n):
                    if causal and j > pos:
                        continue
                    if left >= 0 and pos - j > left:
                        continue
                    if right >= 0 and j - pos > right:
                        continue
                    x = scale * float(q[b, h, i] @ k[b, h // g, j])
                    if softcap > 0:
                        x = softcap * np.tanh(x / softcap)
                    if bias is not None:
                        bb = bias[b if bias.shape[0] > 1 else 0, h if bias.shape[1] > 1 else 0,
                                  i if bias.shape[2] > 1 else 0]
                        if j >= bb.shape[-1]:
                            continue
                        x = x + (0.0 if bb[j] else -np.inf) if bb.dtype == np.bool_ else x + float(bb[j])
                    xs.append(x)
                    vs.append(v[b, h // g, j])
                xs = np.array(xs)
                finite = xs[np.isfinite(xs)] if len(xs) else xs
                if len(finite) == 0:
                    continue
                m = finite.max()
                if sink is not None:
                    m = max(m, float(sink[h]))
                e = np.exp(xs - m)
                den = e.sum() + (np.exp(float(sink[h]) - m) if sink is not None else 0.0)
                out[b, h, i] = (e[:, None] * np.array(vs)).sum(0) / den
    return out
