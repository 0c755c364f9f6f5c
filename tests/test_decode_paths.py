"""The Python composition of the operators' CUDA decode paths (ops/decode_paths.py), on the CPU.

The two kernels are swapped for their executable specs (reference kv_append and decode_attention),
so what is checked is everything around them — the split, q/k norm, rotary, lengths, bias padding,
sinks, window translation, status — against each operator's own reference backend. The kernels
themselves are checked against those specs on a GPU (tests/gpu/).
"""

import itertools

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import backend, cuda
from jax_onnx_attn.ops.reference import decode as decode_reference
from jax_onnx_attn.ops.reference import kv_cache as kv_reference
from jax_onnx_attn.testing import assert_close

from gqa_decode_cases import gqa_inputs


@pytest.fixture
def kernels_as_specs(monkeypatch):
    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(cuda, "kv_append", kv_reference.kv_append)
    monkeypatch.setattr(cuda, "decode_attention", decode_reference.decode_attention)


CASES = list(itertools.product(
    [1, 4],                                   # S (decode, verify)
    [True, False],                            # packed QKV
    [0, 1, 2],                                # rotary: none, half-split, interleaved
    [(-1, 0.0, 1), (5, 0.0, 1), (-1, 30.0, 0)],  # (local_window_size, softcap, causal)
    ["none", "sink", "smooth", "bias", "norm"],
))


@pytest.mark.parametrize("s,packed,rotary,window_softcap_causal,extra", CASES[::4])
def test_gqa_decode_path_matches_the_reference(kernels_as_specs, s, packed, rotary,
                                               window_softcap_causal, extra):
    window, softcap, causal = window_softcap_causal
    dtype = ml_dtypes.bfloat16 if s == 1 else np.float16
    inp = gqa_inputs(s * 7 + rotary, dtype, b=3, s=s, n=4, hkv=2, d=64, cap=24, packed=packed,
                     rotary=rotary, bias=extra == "bias", sink=extra == "sink", norm=extra == "norm")
    total = inp.pop("total_sequence_length")
    attrs = dict(num_heads=4, kv_num_heads=2, local_window_size=window, softcap=softcap,
                 causal=causal, do_rotary=int(rotary > 0), rotary_interleaved=int(rotary == 2),
                 smooth_softmax=1 if extra == "smooth" else -1, total_sequence_length=total,
                 shared_buffer=True)
    run = lambda b: jax.jit(lambda x: ops.group_query_attention(**x, **attrs, backend=b))(inp)  # noqa: E731
    got, want = run("cuda"), run("reference")
    for name in ("output", "present_key", "present_value"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert np.asarray(got.status)[-1] != 0  # the refused row is reported by both


def test_attention_with_cache_path_matches_the_reference(kernels_as_specs):
    rng = np.random.default_rng(0)
    b, hq, hkv, s, d, cap = 3, 8, 2, 2, 64, 20
    x = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    args = (x(b, hq, s, d), x(b, hkv, s, d), x(b, hkv, s, d), x(b, hkv, cap, d), x(b, hkv, cap, d),
            np.array([0, 7, cap - 1], np.int32))  # the last row does not fit: refused
    attrs = dict(is_causal=1, softcap=20.0, opset=25, left_window_size=4)
    run = lambda bk: jax.jit(lambda *a: ops.attention_with_cache(*a, **attrs, backend=bk))(*args)  # noqa: E731
    got, want = run("cuda"), run("reference")
    for g, w in zip(got[:3], want[:3]):
        assert_close(np.asarray(g), np.asarray(w), np.float16)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert np.asarray(got.status).tolist()[-1] != 0
