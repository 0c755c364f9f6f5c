"""Shared inputs and markers of the prefill-engine tests (CPU route tests and GPU tests)."""

import dataclasses
from typing import Any

import jax
import ml_dtypes
import numpy as np
import pytest

BF16 = ml_dtypes.bfloat16


def _other_gpu() -> bool:
    """A GPU that is not sm_90 (without any GPU the gpu marker skips these tests, tests/conftest.py)."""
    try:
        dev = jax.devices("gpu")[0]
    except RuntimeError:
        return False
    return str(getattr(dev, "compute_capability", "")) != "9.0"


needs_sm90 = pytest.mark.skipif(_other_gpu(), reason="the prefill engine runs on sm_90 (H100 / H200) only")


def engine_inputs(seed, b, hq, hkv, s, t, d, dtype, q_len, kv_len):
    """q [B, Hq, S, D], k / v [B, Hkv, T, D] of random values, keys past each row's kv_len NaN (garbage
    the engine must skip), and the lengths as int32."""
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, t, d)).astype(dtype)
    q_len, kv_len = np.asarray(q_len, np.int32), np.asarray(kv_len, np.int32)
    for bi, n in enumerate(kv_len):
        k[bi, :, max(int(n), 0):] = np.nan
        v[bi, :, max(int(n), 0):] = np.nan
    return q, k, v, q_len, kv_len


def gqa_prompt(seed, dtype, *, b, s, n, hkv, d, cap, seqlens, packed):
    """GroupQueryAttention inputs of a prompt: packed or separate Q/K/V [B, S, ...], random caches
    [B, Hkv, C, D] (rows past the prompt hold garbage), seqlens_k, rotary caches for C positions."""
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    inp = dict(past_key=x(b, hkv, cap, d), past_value=x(b, hkv, cap, d),
               seqlens_k=np.asarray(seqlens, np.int32))
    if packed:
        inp["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        inp.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    ang = rng.uniform(0, 2 * np.pi, (cap, d // 2))
    inp.update(cos_cache=np.cos(ang).astype(dtype), sin_cache=np.sin(ang).astype(dtype))
    return inp


# --- ai.onnx Attention prompts (the prefill route of ops.attention, decode_paths.attention_prefill_route)

@dataclasses.dataclass(frozen=True)
class AttentionPrompt:
    """One `ops.attention` call of more than 64 query rows. cache: "none", "past" (P = past rows) or
    "nonpad" (K / V hold L rows, nonpad_kv_seqlen = `nonpad`; rows past it are NaN in the arrays
    the route gets and random in the reference's)."""

    name: str
    dtype: Any = np.float16
    b: int = 2
    hq: int = 8
    hkv: int = 2
    s: int = 96
    l: int = 96
    past: int = 0
    d: int = 64
    dv: int | None = None
    cache: str = "none"
    nonpad: tuple = ()
    causal: int = 1
    left: int = -1
    right: int = -1
    softcap: float = 0.0
    scale: float | None = None
    three_d: bool = False
    mask: bool = False
    return_qk: bool = False
    softmax_precision: int | None = None
    seed: int = 0

    def attributes(self) -> dict:
        attrs = dict(is_causal=self.causal, softcap=self.softcap, left_window_size=self.left,
                     right_window_size=self.right, scale=self.scale, opset=25,
                     return_qk=self.return_qk, softmax_precision=self.softmax_precision)
        if self.three_d:
            attrs.update(q_num_heads=self.hq, kv_num_heads=self.hkv)
        return attrs

    def inputs(self):
        """(arrays, clean): the call's inputs by ONNX name, for the route and for the reference."""
        rng = np.random.default_rng(self.seed)
        dv = self.dv or self.d
        x = lambda *shape: rng.standard_normal(shape).astype(self.dtype)  # noqa: E731
        arrays = dict(Q=x(self.b, self.hq, self.s, self.d), K=x(self.b, self.hkv, self.l, self.d),
                      V=x(self.b, self.hkv, self.l, dv))
        if self.softcap:
            arrays["Q"] = arrays["Q"] * np.asarray(4, self.dtype)  # logits well past the cap
        if self.cache == "past":
            arrays.update(past_key=x(self.b, self.hkv, self.past, self.d),
                          past_value=x(self.b, self.hkv, self.past, dv))
        if self.mask:
            arrays["attn_mask"] = rng.random((self.s, self.past + self.l)) < 0.9
        clean = dict(arrays)
        if self.cache == "nonpad":
            nonpad = np.asarray(self.nonpad, np.int64)
            arrays["nonpad_kv_seqlen"] = clean["nonpad_kv_seqlen"] = nonpad
            for name in ("K", "V"):
                poisoned = arrays[name].copy()
                for bi, n in enumerate(nonpad):
                    poisoned[bi, :, max(int(n), 0):] = np.nan
                arrays[name] = poisoned
        if self.three_d:
            for inp in (arrays, clean):
                for name in ("Q", "K", "V"):
                    b, h, n, e = inp[name].shape
                    inp[name] = inp[name].transpose(0, 2, 1, 3).reshape(b, n, h * e)
        return arrays, clean


#: Prompts the prefill route covers: every feature it maps (positions, windows, softcap, scale, GQA,
#: 3D, head sizes, dtypes). The GPU test runs them on the engine, the CPU test on its spec.
COVERED_PROMPTS = (
    AttentionPrompt("causal-s130", s=130, l=130),
    AttentionPrompt("noncausal-bf16-d128", dtype=BF16, hq=4, hkv=4, s=65, l=65, d=128, causal=0),
    AttentionPrompt("noncausal-s100-l300", s=100, l=300, causal=0, seed=1),
    AttentionPrompt("causal-topleft-s100-l300", s=100, l=300, seed=2),
    AttentionPrompt("past-causal-bf16", dtype=BF16, hkv=1, s=90, l=90, past=200, cache="past"),
    AttentionPrompt("past-causal-s70-l150", s=70, l=150, past=40, cache="past", seed=3),
    AttentionPrompt("past-noncausal", s=80, l=80, past=33, cache="past", causal=0, seed=4),
    AttentionPrompt("nonpad-causal", b=4, s=96, l=300, cache="nonpad", nonpad=(300, 150, 50, 0)),
    AttentionPrompt("nonpad-noncausal-bf16", dtype=BF16, b=3, s=70, l=200, cache="nonpad",
                    nonpad=(200, 71, 5), causal=0, seed=5),
    AttentionPrompt("window-causal-left31", s=200, l=200, left=31, seed=6),
    AttentionPrompt("window-bidirectional", s=150, l=150, causal=0, left=16, right=8, seed=7),
    AttentionPrompt("window-right0-s100-l160", s=100, l=160, causal=0, left=10, right=0, seed=8),
    AttentionPrompt("window-past", s=80, l=80, past=100, cache="past", left=50, seed=9),
    AttentionPrompt("window-nonpad", b=3, s=72, l=160, cache="nonpad", nonpad=(160, 90, 40),
                    left=20, seed=10),
    AttentionPrompt("softcap-past-scale", s=96, l=96, past=64, cache="past", softcap=30.0,
                    scale=0.2, seed=11),
    AttentionPrompt("softcap-noncausal-bf16", dtype=BF16, s=100, l=100, causal=0, softcap=5.0,
                    seed=12),
    AttentionPrompt("3d-gqa-causal", s=96, l=96, three_d=True, seed=13),
    AttentionPrompt("d256-bf16", dtype=BF16, hq=4, hkv=2, s=80, l=80, d=256, seed=14),
    AttentionPrompt("d80", hq=4, hkv=1, s=80, l=80, d=80, seed=15),
    AttentionPrompt("d96-nonpad", dtype=BF16, hq=4, hkv=2, s=75, l=120, d=96, cache="nonpad",
                    nonpad=(120, 80), seed=16),
    AttentionPrompt("softmax-f32", s=66, l=66, softmax_precision=1, seed=17),
)

#: Prompts the route leaves on the reference, with a piece of the reason.
UNCOVERED_PROMPTS = (
    (AttentionPrompt("float32", dtype=np.float32), "Q is float32"),
    (AttentionPrompt("mask", mask=True), "attn_mask"),
    (AttentionPrompt("qk", return_qk=True), "qk_matmul_output"),
    (AttentionPrompt("dv-ne-d", dv=128), "V's head size 128"),
    (AttentionPrompt("d72", d=72), "head size 72"),
    (AttentionPrompt("softmax-f16", softmax_precision=10), "softmax_precision float16"),
    (AttentionPrompt("s-gt-l", s=100, l=70), "100 query rows over 70 new keys (no cache)"),
    (AttentionPrompt("past-s-gt-l", s=100, l=2, past=50, cache="past"),
     "100 query rows over 2 new keys (past 50)"),
    (AttentionPrompt("noncausal-left-s-lt-l", s=80, l=120, causal=0, left=7),
     "without causal or right_window_size 0"),
)
