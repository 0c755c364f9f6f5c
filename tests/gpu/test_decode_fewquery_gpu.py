"""Few-query decode steps on the prefill engine (cuda.decode_attention(engine="prefill") and the
auto rule `cuda.decode_engine`) against the reference decode attention: the features the prefill
engine covers (causal or not, windows, softcap, sinks; no bias, float caches), ragged lengths with
rows of no key, fewer keys than queries and lengths past the capacity, NaN past every row's length;
head dims 64-256, f16 / bf16; bitwise repeatability; the auto rule's choice in the lowered HLO."""

import functools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode import decode_attention
from jax_onnx_attn.testing import assert_close

import decode_cases
from decode_cases import WINDOWS

pytestmark = pytest.mark.gpu

# (Hq, Hkv, S): packed rows G * S = 64, 128, 16 (below the auto rule), 256 (two 128-row tiles), 48.
SHAPES = [(32, 8, 16), (64, 8, 16), (32, 8, 4), (16, 1, 16), (6, 2, 16)]


def _check(q, k, v, lens, sink=None, **static):
    f = jax.jit(functools.partial(cuda.decode_attention, engine="prefill", **static))
    got = np.asarray(f(q, k, v, lens, None, sink))
    want = decode_cases.reference(q, k, v, lens, None, sink, **static)
    assert not np.isnan(got.astype(np.float32)).any(), "NaN in the kernel output"
    assert_close(got, want, q.dtype)
    return got


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"{s[0]}q{s[1]}kv_s{s[2]}")
@pytest.mark.parametrize("d", [64, 80, 128, 256])
@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16], ids=lambda t: np.dtype(t).name)
def test_shapes(dtype, d, shape):
    hq, hkv, s = shape
    _, q, k, v, lens = decode_cases.dense_inputs(d + s, 4, hq, hkv, s, d, 1000, dtype)
    _check(q, k, v, lens, scale=float(1 / np.sqrt(d)))


@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("softcap", [0.0, 30.0])
@pytest.mark.parametrize("window", WINDOWS)
@pytest.mark.parametrize("causal", [True, False])
def test_features(causal, window, softcap, sink):
    _, q, k, v, lens = decode_cases.dense_inputs(11, 4, 32, 8, 16, 128, 700, ml_dtypes.bfloat16)
    sink_v = np.linspace(-1, 2, 32).astype(np.float32) if sink else None
    _check(q, k, v, lens, sink_v, scale=0.09, causal=causal, left=window[0], right=window[1],
           softcap=softcap)


def test_lengths_past_capacity_and_empty_rows():
    _, q, k, v, _ = decode_cases.dense_inputs(4, 4, 32, 8, 16, 64, 300, np.float16, lens=[300] * 4)
    lens = np.array([900, -3, 0, 5], np.int32)
    got = _check(q, k, v, lens, scale=0.125)
    assert not got[1:3].astype(np.float32).any()         # no key at all
    assert not got[3, :, :11].astype(np.float32).any()   # rows before position 0


def test_long_context_bitwise_repeatable():
    _, q, k, v, lens = decode_cases.dense_inputs(5, 2, 32, 8, 16, 128, 16384, ml_dtypes.bfloat16,
                                                 lens=[16384, 9000])
    f = jax.jit(functools.partial(cuda.decode_attention, scale=0.09, engine="prefill"))
    first = _check(q, k, v, lens, scale=0.09)
    for _ in range(3):
        np.testing.assert_array_equal(np.asarray(f(q, k, v, lens)), first)


def test_auto_rule_in_the_hlo():
    """Where `cuda.decode_engine` says prefill (G * S >= FEW_QUERY_MIN_ROWS) the auto engine lowers to
    the prefill target, below it to the decode target; a bias keeps the decode engine."""
    def targets(hq, s, bias=None):
        _, q, k, v, lens = decode_cases.dense_inputs(1, 8, hq, 8, s, 128, 512, np.float16)
        f = jax.jit(lambda q, k, v, lens: decode_attention(q, k, v, lens, bias, scale=0.1, backend="cuda"))
        hlo = f.lower(q, k, v, lens).as_text()
        return ("prefill_attention" in hlo, "decode_attention" in hlo)

    rows = cuda.FEW_QUERY_MIN_ROWS
    assert targets(32, rows // 4) == (True, False)
    assert targets(32, max(rows // 8, 1)) == (False, True)
    assert targets(32, rows // 4, bias=np.zeros((1, 1, 1, 512), np.float32)) == (False, True)
    assert cuda.decode_engine(32, 8, rows // 4) == "prefill"
