"""Random ai.onnx Attention calls of decode size (S <= 64) for the tests of its CUDA path, shared by
the GPU tests (tests/gpu/test_attention_cuda_gpu.py) and the CPU test of the composition with the
kernels swapped for their specs (tests/test_attention_cuda_paths.py).

A case is one `ops.attention` call: float32 / float16 / bfloat16 (V sometimes of another type), 3D or
4D, 1 / 2 / 8 query heads per KV head, head sizes that the decode engine takes and that it does not
(72, Dv != D), a past (with L = S and L != S), no cache (S < L top-left, S > L) or nonpad_kv_seqlen
(ragged, 0 and < S included), masks of every kind and rank, causal, windows, softcap, the four
qk_matmul_output modes and softmax_precision. With nonpad the padding rows of K / V hold NaN in the
arrays the CUDA backend gets and random numbers in the ones the reference gets: padding keys must not
reach y, so both runs give the same y.
"""

from __future__ import annotations

import dataclasses
import itertools

import jax
import ml_dtypes
import numpy as np

from jax_onnx_attn import ops
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.testing import assert_close, tolerance

BF16 = ml_dtypes.bfloat16
DTYPES = (np.dtype(np.float32), np.dtype(np.float16), np.dtype(BF16))
CACHES = ("past", "none", "nonpad")
#: (D, Dv): the engine takes the first two in half precision; 72 and Dv != D take the general kernel.
HEAD_SIZES = ((64, 64), (128, 128), (72, 72), (64, 128), (128, 40))
MASKS = (None, "bool_rank2", "float_rank3", "bool_rank4_short", "float_rank4_short", "int_rank2",
         "t1_rank4")
#: softmax_precision enum -> dtype (ONNX TensorProto: FLOAT, FLOAT16, BFLOAT16).
SOFTMAX_ENUM = {1: np.dtype(np.float32), 10: np.dtype(np.float16), 16: np.dtype(BF16)}
OPSET = 25  # windows; every other feature exists there too


@dataclasses.dataclass(frozen=True)
class AttentionCase:
    """One `ops.attention` call: shapes, dtypes and attributes (the arrays come from `inputs`)."""

    seed: int
    dtype: np.dtype    # T1: Q, K, Y, qk
    v_dtype: np.dtype  # T2: V
    three_d: bool
    b: int
    hq: int
    hkv: int
    s: int             # query rows
    l: int             # new K / V rows (the whole buffer with nonpad)
    past: int          # P (0 without past)
    d: int
    dv: int
    cache: str         # "past", "none" or "nonpad"
    mask: str | None
    causal: int
    left: int
    right: int
    softcap: float
    qk_mode: int | None
    softmax_precision: int | None

    @property
    def total(self) -> int:
        return self.past + self.l

    @property
    def id(self) -> str:
        qk = "" if self.qk_mode is None else f"-qk{self.qk_mode}"
        sm = "" if self.softmax_precision is None else f"-sm{self.softmax_precision}"
        v = "" if self.v_dtype == self.dtype else f"-v_{self.v_dtype.name}"
        return (f"{self.seed}-{self.dtype.name}{v}-{'3d' if self.three_d else '4d'}-"
                f"{self.hq}q{self.hkv}kv-s{self.s}l{self.l}p{self.past}-d{self.d}v{self.dv}-"
                f"{self.cache}-{self.mask}-c{self.causal}w{self.left},{self.right}-"
                f"cap{self.softcap:g}{qk}{sm}")

    def attributes(self) -> dict:
        """Attributes of `ops.attention` (static)."""
        attrs = dict(is_causal=self.causal, softcap=self.softcap, left_window_size=self.left,
                     right_window_size=self.right, opset=OPSET, return_qk=self.qk_mode is not None,
                     qk_matmul_output_mode=self.qk_mode or 0,
                     softmax_precision=self.softmax_precision)
        if self.three_d:
            attrs.update(q_num_heads=self.hq, kv_num_heads=self.hkv)
        return attrs

    def kernel(self) -> str:
        """"engine" when the split-KV decode engine covers the call, else "general"."""
        engine = (self.dtype != np.float32 and self.d in cuda.DECODE_HEAD_DIMS and self.dv == self.d
                  and self.v_dtype == self.dtype and self.qk_mode is None
                  and self.softmax_precision in (None, 1))
        return "engine" if engine else "general"

    def compare_dtype(self) -> np.dtype:
        """The dtype whose tolerance the outputs are held to: T1, or a coarser softmax dtype."""
        candidates = [self.dtype]
        if self.softmax_precision is not None:
            candidates.append(SOFTMAX_ENUM[self.softmax_precision])
        return max(candidates, key=lambda t: tolerance(t)[0])


def sweep(seeds: int = 3) -> list[AttentionCase]:
    """dtype x cache x head sizes x seeds cases; every other feature drawn per case."""
    cases = []
    for i, (dtype, cache, (d, dv), _) in enumerate(
            itertools.product(DTYPES, CACHES, HEAD_SIZES, range(seeds))):
        rng = np.random.default_rng(1000 + i)
        pick = lambda options: options[rng.integers(len(options))]  # noqa: E731
        group, hkv = pick((1, 2, 8)), pick((1, 2))
        s = pick((1, 1, 2, 5, 16, 64))
        if cache == "past":
            past, l = int(rng.integers(1, 40)), pick((s, s, 1, s + 2))
        elif cache == "none":
            past, l = 0, pick((s, s + 7, max(1, s - 1)))
        else:
            past, l = 0, int(rng.integers(max(s, 8), 90))
        v_dtype = dtype if rng.random() < 0.8 else pick([t for t in DTYPES if t != dtype])
        qk_mode = None if rng.random() < 0.6 else int(rng.integers(4))
        softmax = None
        if rng.random() < 0.3:
            softmax = pick((1, 10, 16) if dtype == np.float32 else
                           (1, 10 if dtype == np.float16 else 16))
        window = pick(((-1, -1), (-1, -1), (3, -1), (17, -1), (0, -1), (4, 2), (-1, 0)))
        cases.append(AttentionCase(
            seed=i, dtype=dtype, v_dtype=v_dtype, three_d=bool(rng.random() < 0.3),
            b=3 if cache == "nonpad" else 2, hq=group * hkv, hkv=hkv, s=s, l=l, past=past, d=d,
            dv=dv, cache=cache, mask=pick(MASKS), causal=int(rng.integers(2)), left=window[0],
            right=window[1], softcap=pick((0.0, 0.0, 20.0)), qk_mode=qk_mode,
            softmax_precision=softmax))
    return cases


# The kernels place query row i at kv_len - S + i + pos_shift; the spec at i + offset (P with past,
# nonpad - S with nonpad, else 0). (cache, S, L, P): every way the two meet.
POSITIONS = [("past", 3, 1, 10), ("past", 1, 4, 7), ("past", 4, 4, 5), ("none", 2, 9, 0),
             ("none", 6, 3, 0), ("none", 5, 5, 0), ("nonpad", 4, 12, 0), ("nonpad", 1, 9, 0)]


def position_cases(d: int = 64) -> list[AttentionCase]:
    """POSITIONS x windows x kernels (engine: float16; general: float32), causal, no mask."""
    cases = []
    for (cache, s, l, past), (left, right), dtype in itertools.product(
            POSITIONS, [(-1, -1), (2, -1), (1, 1)], [np.dtype(np.float16), np.dtype(np.float32)]):
        cases.append(AttentionCase(
            seed=s * 31 + l, dtype=dtype, v_dtype=dtype, three_d=False,
            b=3 if cache == "nonpad" else 2, hq=4, hkv=2, s=s, l=l, past=past, d=d, dv=d,
            cache=cache, mask=None, causal=1, left=left, right=right, softcap=0.0, qk_mode=None,
            softmax_precision=None))
    return cases


def _mask(kind, rng, case: AttentionCase):
    b, hq, s, t = case.b, case.hq, case.s, case.total
    if kind is None:
        return None
    if kind == "bool_rank2":
        m = rng.random((s, t)) < 0.8
        m[-1] = False  # a fully masked row: y and mode-3 qk are 0 there
        return m
    if kind == "float_rank3":
        m = (rng.standard_normal((hq, s, t)) * 2).astype(np.float32)
        m[rng.random(m.shape) < 0.1] = -np.inf
        m[0, -1] = -np.inf
        return m
    if kind == "bool_rank4_short":  # shorter than T: the keys past it are hidden
        return rng.random((b, 1, s, max(1, t - 3))) < 0.85
    if kind == "float_rank4_short":
        return rng.standard_normal((1, hq, 1, max(1, t - 2))).astype(np.float32)
    if kind == "int_rank2":  # added as numbers
        return rng.integers(-3, 2, size=(1, t)).astype(np.int32)
    if kind == "t1_rank4":
        return rng.standard_normal((b, hq, s, t)).astype(case.dtype)
    raise ValueError(kind)


def _to_3d(x):  # [B, H, L, d] -> [B, L, H * d]
    b, h, n, d = x.shape
    return x.transpose(0, 2, 1, 3).reshape(b, n, h * d)


def inputs(case: AttentionCase):
    """(arrays, clean): the call's inputs by ONNX name. With nonpad, K / V rows at or past
    nonpad[b] are NaN in `arrays` and random in `clean` (the reference's input); otherwise the two
    are the same."""
    rng = np.random.default_rng(case.seed)
    x = lambda dtype, *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    b, hq, hkv, s, l = case.b, case.hq, case.hkv, case.s, case.l
    q, k, v = x(case.dtype, b, hq, s, case.d), x(case.dtype, b, hkv, l, case.d), \
        x(case.v_dtype, b, hkv, l, case.dv)
    arrays = {}
    if case.cache == "past":
        arrays.update(past_key=x(case.dtype, b, hkv, case.past, case.d),
                      past_value=x(case.v_dtype, b, hkv, case.past, case.dv))
    clean_k, clean_v = k, v
    if case.cache == "nonpad":
        nonpad = rng.integers(0, l + 1, size=b)
        nonpad[0] = l
        nonpad[1] = min(s - 1, l)  # fewer keys than query rows: the first rows see nothing
        nonpad[2] = 0
        arrays["nonpad_kv_seqlen"] = nonpad.astype(np.int64)
        k, v = k.copy(), v.copy()
        for bi, n in enumerate(nonpad):
            k[bi, :, n:] = np.nan
            v[bi, :, n:] = np.nan
    mask = _mask(case.mask, rng, case)
    if mask is not None:
        arrays["attn_mask"] = mask
    to = _to_3d if case.three_d else (lambda a: a)
    clean = dict(arrays, Q=to(q), K=to(clean_k), V=to(clean_v))
    arrays.update(Q=to(q), K=to(k), V=to(v))
    return arrays, clean


def expected_present(case: AttentionCase, arrays):
    """present_key / present_value the spec gives for `arrays`: concat(past, K / V) in 4D."""
    def bhsd(a, d):
        if not case.three_d:
            return a
        bb, n, _ = a.shape
        return a.reshape(bb, n, case.hkv, d).transpose(0, 2, 1, 3)

    k, v = bhsd(arrays["K"], case.d), bhsd(arrays["V"], case.dv)
    if case.cache == "past":
        k = np.concatenate([arrays["past_key"], k], axis=2)
        v = np.concatenate([arrays["past_value"], v], axis=2)
    return k, v


_JITS = {}


def run(case: AttentionCase, arrays, backend: str):
    """ops.attention jitted (one executable per case signature) on `arrays`."""
    key = (case, backend)
    if key not in _JITS:
        attrs = case.attributes()
        _JITS[key] = jax.jit(lambda a: ops.attention(**a, **attrs, backend=backend))
    return _JITS[key](arrays)


def lowered(case: AttentionCase, arrays, backend: str) -> str:
    """The lowered (StableHLO) text of `run`'s jitted call: it names the custom-call targets."""
    run(case, arrays, backend)
    return _JITS[(case, backend)].lower(arrays).as_text()


def check(case: AttentionCase, got, want, arrays):
    """got: backend "cuda" on `arrays`; want: the reference on the clean arrays."""
    dtype = case.compare_dtype()
    y = np.asarray(got.y)
    assert y.dtype == case.dtype and y.shape == np.asarray(want.y).shape
    assert not np.isnan(y.astype(np.float32)).any(), "NaN in y"
    assert_close(y, np.asarray(want.y), dtype, err_msg="y")
    for name, expected in zip(("present_key", "present_value"), expected_present(case, arrays)):
        # As float32 (exact for all three types): numpy's NaN matching skips bfloat16.
        np.testing.assert_array_equal(np.asarray(getattr(got, name)).astype(np.float32),
                                      expected.astype(np.float32), err_msg=name)
    if case.qk_mode is None:
        assert got.qk is None
        return
    g, w = np.asarray(got.qk), np.asarray(want.qk)
    assert g.dtype == case.dtype and g.shape == w.shape == (case.b, case.hq, case.s, case.total)
    if case.cache == "nonpad" and case.qk_mode in (0, 1):
        # Modes 0 and 1 are defined on every key: at the poisoned rows the CUDA run's are NaN.
        valid = np.arange(case.total) < arrays["nonpad_kv_seqlen"][:, None, None, None]
        g, w = np.where(valid, g, 0), np.where(valid, w, 0)
    assert_close(g, w, dtype, err_msg=f"qk mode {case.qk_mode}")
