"""ai.onnx Attention's CUDA path (ops/decode_paths.py: attention_cuda) composed on the CPU, with the
kernels swapped for their executable specs (reference kv_append, decode_attention, general_attention).

What is checked is everything around the kernels: present = concat(past, new), the kv_len /
pos_shift that put each query row at the spec's position (past with L != S, no cache with S < L and
S > L, nonpad), mask plumbing (bool / int / float, ranks 1-4, short), the choice between the decode
engine and the general kernel, qk modes and softmax dtypes, against the reference backend of the
same op and the ONNX conformance goldens. The kernels are held to these specs on a GPU
(tests/gpu/test_attention_cuda_gpu.py).
"""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import conformance, ops
from jax_onnx_attn.ops import backend, cuda, decode_paths
from jax_onnx_attn.ops.reference import decode as decode_reference
from jax_onnx_attn.ops.reference import general as general_reference
from jax_onnx_attn.ops.reference import kv_cache as kv_reference
from jax_onnx_attn.testing import assert_close

import attention_cases

BF16 = ml_dtypes.bfloat16


@pytest.fixture
def kernels(monkeypatch):
    """The kernels as their specs; returns the list of kernels called ("engine" / "general")."""
    calls = []

    def recording(name, fn):
        def wrapped(*args, **kwargs):
            calls.append(name)
            return fn(*args, **kwargs)
        return wrapped

    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)  # the specs run on the CPU
    monkeypatch.setattr(cuda, "kv_append", kv_reference.kv_append)
    monkeypatch.setattr(cuda, "decode_attention",
                        recording("engine", decode_reference.decode_attention))
    monkeypatch.setattr(cuda, "general_attention",
                        recording("general", general_reference.general_attention))
    return calls


BASE = [c.name for c in conformance.attention_cases(expanded=False)]


@pytest.mark.parametrize("name", BASE, ids=[n.removeprefix("test_attention_") for n in BASE])
def test_conformance_case(kernels, name):
    case = conformance.attention_case(name)
    arrays, attributes, produced = conformance.node_call(case)
    kw = dict(attributes, opset=case.opset, return_qk="qk_matmul_output" in produced)
    got = jax.jit(lambda a: ops.attention(**a, **kw, backend="cuda"))(arrays)
    assert kernels, "the CUDA path ran no kernel"
    got = dict(zip(conformance.ATTENTION_OUTPUTS, got))
    for (_, golden), slot in zip(case.outputs.items(), produced):
        actual = np.asarray(got[slot])
        assert actual.shape == golden.shape and actual.dtype == golden.dtype, slot
        assert_close(actual, golden, err_msg=f"{slot} vs the golden")


SWEEP = attention_cases.sweep()


@pytest.mark.parametrize("case", SWEEP[::5], ids=lambda c: c.id)
def test_sweep(kernels, case):
    arrays, clean = attention_cases.inputs(case)
    got = attention_cases.run(case, arrays, "cuda")
    want = attention_cases.run(case, clean, "reference")
    attention_cases.check(case, got, want, arrays)
    assert kernels[-1:] == [case.kernel()]


@pytest.mark.parametrize("case", attention_cases.position_cases(), ids=lambda c: c.id)
def test_query_positions(kernels, case):
    arrays, clean = attention_cases.inputs(case)
    got = attention_cases.run(case, arrays, "cuda")
    want = attention_cases.run(case, clean, "reference")
    attention_cases.check(case, got, want, arrays)
    assert kernels == [case.kernel()]


@pytest.mark.parametrize("mode", [0, 1, 2, 3])
@pytest.mark.parametrize("dtype,v_dtype,dv", [(np.float32, np.float32, 64), (BF16, BF16, 48),
                                              (np.float16, np.float32, 64)])
def test_attention_with_cache_qk(kernels, dtype, v_dtype, dv, mode):
    rng = np.random.default_rng(mode)
    b, hq, hkv, s, d, cap = 3, 8, 2, 2, 64, 20
    x = lambda t, *shape: rng.standard_normal(shape).astype(t)  # noqa: E731
    args = (x(dtype, b, hq, s, d), x(dtype, b, hkv, s, d), x(v_dtype, b, hkv, s, dv),
            x(dtype, b, hkv, cap, d), x(v_dtype, b, hkv, cap, dv),
            np.array([0, 7, cap - 1], np.int32))  # the last row does not fit: refused, y 0
    mask = rng.random((b, 1, s, cap - 4)) < 0.8
    attrs = dict(is_causal=1, softcap=20.0, opset=25, left_window_size=6, return_qk=True,
                 qk_matmul_output_mode=mode)
    run = lambda bk: jax.jit(lambda *a: ops.attention_with_cache(*a, mask, **attrs, backend=bk))(*args)  # noqa: E731
    got, want = run("cuda"), run("reference")
    assert kernels == ["general"]
    for name in ("y", "qk"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    for name in ("key_cache", "value_cache", "cache_lengths", "status"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))


def _nan_case(kind, dtype):
    """(inputs, attributes, the fully masked (b, h, s) row) of a call with a NaN / +inf logit at a
    key its mask hides, in a row the mask leaves no key; other rows see the NaN too (poisoned)."""
    rng = np.random.default_rng(len(kind))
    b, h, s, n, d = 2, 2, 3, 5, 64
    x = {"Q": rng.standard_normal((b, h, s, d)).astype(dtype),
         "K": rng.standard_normal((b, h, n, d)).astype(dtype),
         "V": rng.standard_normal((b, h, n, d)).astype(dtype)}
    if kind == "bool_row_empty_k_nan":        # the bool mask hides row 1; K NaN at key 1
        mask = np.ones((s, n), bool)
        mask[1] = False
        x["K"][0, 0, 1, 0] = np.nan
        return dict(x, attn_mask=mask), {}, (0, 0, 1)
    if kind == "float_row_neginf_k_inf":      # the float mask hides row 2; K +inf at key 3
        mask = np.zeros((b, 1, s, n), np.float32)
        mask[1, 0, 2] = -np.inf
        x["K"][1, 1, 3] = np.inf
        return dict(x, attn_mask=mask), {}, (1, 1, 2)
    # mask_and_causal_empty_q_nan: row 0 keeps key 4 only, which causal hides; Q NaN in row 0
    mask = np.ones((s, n), bool)
    mask[0, :4] = False
    x["Q"][0, 1, 0, 0] = np.nan
    x["Q"][0, 1, 2, 0] = np.nan
    return dict(x, attn_mask=mask), {"is_causal": 1}, (0, 1, 0)


@pytest.mark.parametrize("qk", [False, True], ids=["y", "y_qk3"])
@pytest.mark.parametrize("dtype", [np.float32, np.float16], ids=lambda t: np.dtype(t).name)
@pytest.mark.parametrize("kind", ["bool_row_empty_k_nan", "float_row_neginf_k_inf",
                                  "mask_and_causal_empty_q_nan"])
def test_nan_rule_fully_masked_rows(kernels, kind, dtype, qk):
    """The NaN / Inf rule through the composition (docs/attention.md, "NaN and Inf"): the kernels
    add a mask's -inf to the logit, so a NaN or +inf logit at a masked key is NaN there; a row the
    mask leaves no key is still 0 (the spec decides on the bias), the poisoned rows stay NaN."""
    inputs, attrs, empty = _nan_case(kind, dtype)
    if qk:
        attrs.update(return_qk=True, qk_matmul_output_mode=3)
    run = lambda bk: jax.jit(lambda a: ops.attention(**a, **attrs, backend=bk))(inputs)  # noqa: E731
    got, want = run("cuda"), run("reference")
    assert kernels
    outputs = ("y", "qk") if qk else ("y",)
    for name in outputs:
        g = np.asarray(getattr(got, name)).astype(np.float32)
        assert_close(g, np.asarray(getattr(want, name)), dtype, err_msg=name)
        np.testing.assert_array_equal(g[empty], 0, err_msg=f"{name}: the fully masked row")
        assert np.isnan(g).any(), f"{name}: the poisoned rows"


def _attrs(**over):
    attrs = dict(scale=0.1, softcap=0.0, is_causal=False, qk_matmul_output_mode=0,
                 softmax_dtype=None, left_window_size=-1, right_window_size=-1)
    attrs.update(over)
    return attrs


def _spec(shape, dtype):
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def test_routing_and_reasons():
    q16, k16 = _spec((1, 8, 4, 128), np.float16), _spec((1, 2, 30, 128), np.float16)

    def route(attrs=None, return_qk=False, q=q16, k=k16, v=k16):
        fn, why = decode_paths.attention_cuda(attrs or _attrs(), return_qk=return_qk, q=q,
                                              present_key=k, present_value=v)
        return (fn.keywords["engine"] if fn else None), why

    assert route() == (True, None)
    assert route(_attrs(softmax_dtype=jnp.dtype(jnp.float32))) == (True, None)
    # Everything else of decode size takes the general kernel.
    assert route(return_qk=True) == (False, None)
    assert route(_attrs(softmax_dtype=jnp.dtype(jnp.float16))) == (False, None)
    assert route(v=_spec((1, 2, 30, 64), np.float16)) == (False, None)
    assert route(v=_spec((1, 2, 30, 128), BF16)) == (False, None)
    assert route(q=_spec((1, 8, 4, 72), np.float16), k=_spec((1, 2, 30, 72), np.float16),
                 v=_spec((1, 2, 30, 72), np.float16)) == (False, None)
    f32 = _spec((1, 2, 30, 128), np.float32)
    assert route(q=_spec((1, 8, 4, 128), np.float32), k=f32, v=f32) == (False, None)
    assert route(k=_spec((1, 2, 0, 128), np.float16), v=_spec((1, 2, 0, 128), np.float16)) == \
        (False, None)
    # What stays on the reference, and why.
    _, why = route(q=_spec((1, 8, decode_paths.MAX_QUERY_ROWS + 1, 128), np.float16))
    assert "query rows" in why
    _, why = route(v=_spec((1, 2, 30, 128), np.float64))
    assert why.startswith("V is float64")
    _, why = route(_attrs(softmax_dtype=np.dtype(np.float64)))
    assert "softmax_precision float64" in why
    big = cuda.GENERAL_MAX_KEYS + 1
    _, why = route(q=_spec((1, 8, 1, 72), np.float16), k=_spec((1, 2, big, 72), np.float16),
                   v=_spec((1, 2, big, 72), np.float16))
    assert "keys" in why


def test_prefill_raises_under_cuda_and_falls_back_under_auto(kernels):
    rng = np.random.default_rng(0)
    q, k = (rng.standard_normal((1, 2, 65, 8)).astype(np.float32) for _ in range(2))
    with pytest.raises(NotImplementedError, match="more than 64 query rows"):
        ops.attention(q, k, k, backend="cuda")
    auto = ops.attention(q, k, k)
    want = ops.attention(q, k, k, backend="reference")
    np.testing.assert_array_equal(np.asarray(auto.y), np.asarray(want.y))
    assert kernels == []
