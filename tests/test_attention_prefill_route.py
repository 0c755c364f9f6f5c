"""ai.onnx Attention prompts (more than decode_paths.MAX_QUERY_ROWS query rows) on the prefill engine
(ops/decode_paths.py: attention_prefill_route, _attention_prefill), on the CPU: which calls route and
why the others stay on the reference, and the mapping of the spec's query positions onto the
engine's bottom-right rule (q_len / kv_len) with the engine swapped for its spec
(reference/prefill.py) against the op's reference backend and the ONNX conformance goldens. The
engine itself is checked on a GPU (tests/gpu/test_attention_prefill_route_gpu.py).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import conformance, ops
from jax_onnx_attn.ops import backend, cuda, decode_paths
from jax_onnx_attn.ops.reference import kv_cache as kv_reference
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close
from prefill_cases import BF16, COVERED_PROMPTS, UNCOVERED_PROMPTS

ENV = "JOA_PREFILL_ENGINE"


@pytest.fixture
def gpu_like(monkeypatch):
    """An sm_90 GPU with the engine switched on, as far as the route can tell."""
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: True)
    monkeypatch.delenv(ENV, raising=False)


@pytest.fixture
def engine(monkeypatch, gpu_like):
    """The prefill engine as its spec, the other kernels refusing to run; returns the list of the
    engine's calls (their static arguments, and q_len / kv_len once the call ran)."""
    calls = []

    def recording(q, k, v, q_len, kv_len, sink=None, **kw):
        call = dict(sink=sink, **kw)
        calls.append(call)

        def lengths(q_len, kv_len):  # their values, inside the jit too
            call.update(q_len=np.asarray(q_len), kv_len=np.asarray(kv_len))
        jax.debug.callback(lengths, q_len, kv_len)
        return prefill_reference.prefill_attention(q, k, v, q_len, kv_len, sink, **kw)

    def refuse(*_, **__):
        raise AssertionError("a prompt reached a decode kernel")

    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)  # the specs run on the CPU
    monkeypatch.setattr(cuda, "prefill_attention", recording)
    monkeypatch.setattr(cuda, "kv_append", kv_reference.kv_append)
    monkeypatch.setattr(cuda, "decode_attention", refuse)
    monkeypatch.setattr(cuda, "general_attention", refuse)
    return calls


def _attrs(**over):
    attrs = dict(scale=0.125, softcap=0.0, is_causal=True, qk_matmul_output_mode=0,
                 softmax_dtype=None, left_window_size=-1, right_window_size=-1)
    attrs.update(over)
    return attrs


def _spec(shape, dtype=np.float16):
    return jax.ShapeDtypeStruct(shape, np.dtype(dtype))


def _route(attrs=None, *, s=128, l=128, past=0, cache="none", d=64, dv=None, dtype=np.float16,
           v_dtype=None, return_qk=False, has_mask=False):
    t = past + l
    fn, why = decode_paths.attention_cuda(
        attrs or _attrs(), return_qk=return_qk, q=_spec((2, 8, s, d), dtype),
        present_key=_spec((2, 2, t, d), dtype),
        present_value=_spec((2, 2, t, dv or d), v_dtype or dtype), cache=cache, new_rows=l,
        has_mask=has_mask)
    return fn, why


# --- which calls route, and why the others do not --------------------------------------------

@pytest.mark.parametrize("kw,attrs,kv_rows", [
    (dict(), dict(), 128),                                            # S == L, causal
    (dict(), dict(is_causal=False), 128),
    (dict(s=100, l=300), dict(), 100),                                # S < L, top-left causal
    (dict(s=100, l=300), dict(is_causal=False), 300),                 # positions do not matter
    (dict(s=100, l=300), dict(is_causal=False, right_window_size=0, left_window_size=5), 100),
    (dict(past=40, cache="past"), dict(), 168),                       # S == L after a past
    (dict(s=70, l=150, past=40, cache="past"), dict(), 110),          # S < L: offset P
    (dict(s=100, l=2, past=50, cache="past"), dict(is_causal=False), 52),  # S > L, no positions
    (dict(cache="nonpad"), dict(), None),                             # kv_len = nonpad
    (dict(cache="nonpad", s=100, l=60), dict(left_window_size=3), None),
    (dict(cache="nonpad"), dict(is_causal=False), None),
    (dict(), dict(left_window_size=31, right_window_size=4), 128),
    (dict(), dict(softcap=30.0, softmax_dtype=np.dtype(np.float32)), 128),
    (dict(d=256, dtype=BF16), dict(), 128),
    (dict(d=80), dict(), 128),
    (dict(d=96), dict(), 128),
])
def test_covered_prompts_route_to_the_engine(gpu_like, kw, attrs, kv_rows):
    fn, why = _route(_attrs(**attrs), **kw)
    assert why is None and fn.func is decode_paths._attention_prefill
    assert fn.keywords["kv_rows"] == kv_rows


@pytest.mark.parametrize("kw,attrs,match", [
    (dict(dtype=np.float32), dict(), "Q is float32: the prefill engine takes float16 and bfloat16"),
    (dict(v_dtype=BF16), dict(), "V is bfloat16 and Q float16"),
    (dict(d=72), dict(), "head size 72: the prefill engine is compiled for"),
    (dict(dv=128), dict(), "V's head size 128 differs from Q's 64"),
    (dict(return_qk=True), dict(), "qk_matmul_output: the prefill engine has no qk output"),
    (dict(), dict(softmax_dtype=np.dtype(np.float16)), "softmax_precision float16"),
    (dict(has_mask=True), dict(), "attn_mask: the prefill engine takes no mask"),
    (dict(s=100, l=70), dict(), "100 query rows over 70 new keys (no cache)"),
    (dict(s=100, l=70), dict(is_causal=False, left_window_size=3), "100 query rows over 70"),
    (dict(s=100, l=2, past=50, cache="past"), dict(), "100 query rows over 2 new keys (past 50)"),
    (dict(s=100, l=300), dict(is_causal=False, left_window_size=7),
     "without causal or right_window_size 0"),
    (dict(s=100, l=300), dict(is_causal=False, right_window_size=3),
     "without causal or right_window_size 0"),
])
def test_uncovered_prompts_stay_on_the_reference_with_the_reason(gpu_like, kw, attrs, match):
    fn, why = _route(_attrs(**attrs), **kw)
    assert fn is None
    assert why.startswith(f"more than {decode_paths.MAX_QUERY_ROWS} query rows (prefill) run on "
                          f"the reference backend: ")
    assert match in why


def test_the_route_needs_sm90_and_the_switch(monkeypatch):
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: False)
    fn, why = _route()
    assert fn is None and why.endswith("the prefill engine runs on sm_90 (H100 / H200) only")
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: True)
    monkeypatch.setenv(ENV, "0")
    fn, why = _route()
    assert fn is None and why.endswith(f"{ENV}=0 keeps prompts off the prefill engine")
    monkeypatch.setenv(ENV, "1")
    assert _route()[1] is None
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        _route()


def test_decode_steps_keep_their_kernels(gpu_like):
    """S <= MAX_QUERY_ROWS never takes the prefill route."""
    fn, why = _route(s=decode_paths.MAX_QUERY_ROWS, l=decode_paths.MAX_QUERY_ROWS)
    assert why is None and fn.func is decode_paths._attention_step and fn.keywords["engine"]


# --- the routed computation against the reference ---------------------------------------------

def _run(case, arrays, backend_name):
    attrs = case.attributes()
    return jax.jit(lambda a: ops.attention(**a, **attrs, backend=backend_name))(arrays)


@pytest.mark.parametrize("case", COVERED_PROMPTS, ids=lambda c: c.name)
def test_covered_prompt_matches_the_reference(engine, case):
    arrays, clean = case.inputs()
    got = _run(case, arrays, "cuda")
    jax.effects_barrier()  # the lengths' callback has run
    assert len(engine) == 1 and engine[0]["sink"] is None
    call = engine[0]
    np.testing.assert_array_equal(call["q_len"], case.s)
    want_kv = (np.clip(case.nonpad, 0, None) if case.cache == "nonpad" else
               case.past + case.l if not (case.causal or case.right == 0) or case.s == case.l
               else case.past + case.s)
    np.testing.assert_array_equal(call["kv_len"], want_kv)
    assert (call["causal"], call["left"], call["right"]) == (bool(case.causal), case.left, case.right)
    want = _run(case, clean, "reference")
    assert_close(np.asarray(got.y).astype(np.float32), np.asarray(want.y).astype(np.float32),
                 case.dtype, err_msg="y")
    # present = concat(past, new), or K / V as given (NaN padding included)
    same = _run(case, arrays, "reference")
    for name in ("present_key", "present_value"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(same, name)), err_msg=name)
    assert got.qk is None
    y = np.asarray(got.y).astype(np.float32)
    assert np.isfinite(y).all()
    for bi, n in enumerate(case.nonpad):  # (4D cases)
        if n == 0:  # no key: 0
            assert not y[bi].any()
        elif case.causal and n < case.s:  # the first S - nonpad rows sit before key 0: 0
            assert not y[bi, :, : case.s - n].any() and y[bi, :, case.s - n:].all(axis=-1).any()


@pytest.mark.parametrize("case,match", UNCOVERED_PROMPTS, ids=lambda c: getattr(c, "name", ""))
def test_uncovered_prompt_raises_on_cuda_and_runs_the_reference_on_auto(engine, case, match):
    arrays, clean = case.inputs()
    with pytest.raises(NotImplementedError, match="query rows"):
        _run(case, arrays, "cuda")
    try:
        _run(case, arrays, "cuda")
    except NotImplementedError as e:
        assert match in str(e)
    got, want = _run(case, arrays, "auto"), _run(case, clean, "reference")
    for name in ("y", "present_key", "present_value"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)),
                                      np.asarray(getattr(want, name)), err_msg=name)
    assert engine == []


@pytest.mark.parametrize("causal,left", [(1, -1), (0, -1), (1, 40)])
def test_attention_with_cache_prompt(engine, causal, left):
    """attention_with_cache's prompt is the external-cache form: kv_len = cache_lengths + S (0 for a
    row whose write does not fit: y 0), bottom-right; the cache rows past it are never read."""
    rng = np.random.default_rng(causal + left + 10)
    b, hq, hkv, s, d, cap = 3, 8, 2, 80, 64, 200
    x = lambda *shape: rng.standard_normal(shape).astype(np.float16)  # noqa: E731
    kc, vc = x(b, hkv, cap, d), x(b, hkv, cap, d)
    args = (x(b, hq, s, d), x(b, hkv, s, d), x(b, hkv, s, d), kc, vc,
            np.array([0, 50, 150], np.int32))  # the last does not fit: refused
    poisoned = list(args)
    for i in (3, 4):  # rows beyond every valid length: never read by the route
        poisoned[i] = args[i].copy()
        poisoned[i][:, :, 150:] = np.nan
    attrs = dict(is_causal=causal, left_window_size=left, opset=25)
    run = lambda bk, a: jax.jit(lambda *a: ops.attention_with_cache(*a, **attrs, backend=bk))(*a)  # noqa: E731
    got = run("cuda", poisoned)
    jax.effects_barrier()
    assert len(engine) == 1
    np.testing.assert_array_equal(engine[0]["kv_len"], [80, 130, 0])
    want = run("reference", args)
    assert_close(np.asarray(got.y), np.asarray(want.y), np.float16, err_msg="y")
    assert not np.asarray(got.y)[2].any()
    for name in ("cache_lengths", "status"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)))
    for name in ("key_cache", "value_cache"):
        np.testing.assert_array_equal(np.asarray(getattr(got, name))[:, :, :130],
                                      np.asarray(getattr(want, name))[:, :, :130])


# --- the ONNX conformance cases through the route ---------------------------------------------

#: The conformance cases the route takes once the engine's dtype / head-size limits are lifted
#: (they are f32 with head size 8 mostly) and every call counts as a prompt: those without a mask,
#: qk output, Dv != D or query rows the engine cannot place.
ROUTED_CASES = {
    "3d", "3d_causal", "3d_causal_bf16", "3d_gqa", "3d_gqa_causal", "3d_gqa_scaled",
    "3d_gqa_softcap", "3d_scaled", "3d_softcap", "3d_transpose_verification",
    "4d", "4d_causal", "4d_causal_bf16", "4d_causal_fp16", "4d_fp16", "4d_gqa", "4d_gqa_causal",
    "4d_gqa_scaled", "4d_gqa_softcap", "4d_scaled", "4d_softcap",
    "4d_causal_nonpad_batch_prefill", "4d_causal_nonpad_continued_prefill",
    "4d_causal_nonpad_negative_offset_structural_empty", "4d_gqa_causal_nonpad_decode",
    "4d_gqa_causal_nonpad_decode_fp16", "4d_causal_with_past_and_present",
    "bidirectional_window", "local_window", "local_window_default",
}

BASE = [c.name for c in conformance.attention_cases(expanded=False)]


@pytest.fixture
def every_call_a_prompt(monkeypatch, engine):
    """MAX_QUERY_ROWS 0 and the engine's dtype / head-size limits lifted (its spec takes any), so
    that the conformance cases exercise the route's position mapping."""
    monkeypatch.setattr(decode_paths, "MAX_QUERY_ROWS", 0)
    monkeypatch.setattr(decode_paths, "HALF_DTYPES",
                        tuple(decode_paths.HALF_DTYPES) + (jnp.dtype(jnp.float32),))
    dims = tuple(cuda.PREFILL_HEAD_DIMS)
    monkeypatch.setattr(cuda, "PREFILL_HEAD_DIMS", dims + (1, 4, 8, 10), raising=False)
    return engine


@pytest.mark.parametrize("name", BASE, ids=[n.removeprefix("test_attention_") for n in BASE])
def test_conformance_case_through_the_route(every_call_a_prompt, name):
    case = conformance.attention_case(name)
    arrays, attributes, produced = conformance.node_call(case)
    kw = dict(attributes, opset=case.opset, return_qk="qk_matmul_output" in produced)
    short = name.removeprefix("test_attention_")
    call = lambda bk: jax.jit(lambda a: ops.attention(**a, **kw, backend=bk))(arrays)  # noqa: E731
    if short not in ROUTED_CASES:
        with pytest.raises(NotImplementedError, match="query rows"):
            call("cuda")
        assert every_call_a_prompt == []
        return
    got = call("cuda")
    assert len(every_call_a_prompt) == 1, "the route ran no engine call"
    got = dict(zip(conformance.ATTENTION_OUTPUTS, got))
    for (_, golden), slot in zip(case.outputs.items(), produced):
        actual = np.asarray(got[slot])
        assert actual.shape == golden.shape and actual.dtype == golden.dtype, slot
        assert_close(actual, golden, err_msg=f"{slot} vs the golden")


def test_routed_conformance_cases_exist():
    names = {n.removeprefix("test_attention_") for n in BASE}
    assert ROUTED_CASES <= names
