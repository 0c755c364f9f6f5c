"""The route of GQA first prompts to our prefill engine (the default; JOA_PREFILL_ENGINE=0 for
cuDNN's, ops/decode_paths.py), on the CPU: the switch's parsing, which route a prompt takes and why, and
the q_len / kv_len mapping with the kernels swapped for their specs (reference gqa_prepare and
prefill_attention) against GQA's reference backend. The engine itself is checked on a GPU
(tests/gpu/test_prefill_route_gpu.py)."""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import backend, cuda, decode_paths
from jax_onnx_attn.ops.reference import gqa as gqa_reference
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close
from prefill_cases import gqa_prompt

ENV = "JOA_PREFILL_ENGINE"


@pytest.mark.parametrize("value,want", [(None, True), ("0", False), ("1", True)])
def test_switch_parses_0_and_1_default_on(monkeypatch, value, want):
    if value is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    assert decode_paths.prefill_engine_enabled() is want


@pytest.mark.parametrize("value", ["", "2", "true", "on", " 1"])
def test_switch_rejects_other_values_naming_the_variable(monkeypatch, value):
    monkeypatch.setenv(ENV, value)
    with pytest.raises(ValueError, match=ENV):
        decode_paths.prefill_engine_enabled()


def _config(**kw):
    base = dict(num_heads=8, kv_num_heads=2, head_size=64, total_sequence_length=160,
                present_length=160, scale=0.125, causal=True, shared_buffer=True,
                first_prompt=False, past_empty=True)
    base.update(kw)
    return gqa_reference.GQAConfig(**base)


def _route(config, dtype=np.float16, s=128, b=2):
    c = config
    query = jax.ShapeDtypeStruct((b, s, (c.num_heads + 2 * c.kv_num_heads) * c.head_size), dtype)
    past = jax.ShapeDtypeStruct((b, c.kv_num_heads, c.present_length, c.head_size), dtype)
    return decode_paths.gqa_cuda(c, query=query, key=None, past_key=past, query_seqlens=None)


@pytest.fixture
def gpu_like(monkeypatch):
    """cuDNN and an sm_90 GPU as far as the routes can tell."""
    monkeypatch.setattr(decode_paths, "cudnn_attention_available", lambda: True)
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: True)


def test_switch_off_keeps_the_cudnn_route(gpu_like, monkeypatch):
    monkeypatch.setenv(ENV, "0")
    fn, why = _route(_config())
    assert why is None and fn.func is decode_paths._gqa_prefill
    # and an uncovered prompt's reason is the cuDNN route's, word for word
    _, why = _route(_config(softcap=30.0))
    assert why == "softcap on a prompt runs on the reference (cuDNN has no softcap)"


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype,d", [(np.float16, 64), (ml_dtypes.bfloat16, 128), (np.float16, 80),
                                     (ml_dtypes.bfloat16, 96), (ml_dtypes.bfloat16, 256)])
@pytest.mark.parametrize("value", [None, "1"])
def test_switch_on_routes_covered_prompts_to_the_engine(gpu_like, monkeypatch, causal, dtype, d, value):
    if value is None:  # the default
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, value)
    fn, why = _route(_config(causal=causal, head_size=d), dtype)
    assert why is None and fn.func is decode_paths._gqa_prefill_engine


@pytest.mark.parametrize("kw,dtype,match", [
    (dict(local_window_size=0), np.float16, "local_window_size 0"),
    (dict(kv_bits=8), np.float16, "quantised"),
    (dict(qk_output=1), np.float16, "output_qk"),
    (dict(head_size=112), np.float16, "head size 112"),
    (dict(), np.float32, "float32"),
])
def test_engine_route_reasons(gpu_like, kw, dtype, match):
    c = _config(**kw)
    query = jax.ShapeDtypeStruct((2, 128, (8 + 4) * c.head_size), dtype)
    past = jax.ShapeDtypeStruct((2, 2, 160, c.head_size), dtype)
    fn, why = decode_paths.gqa_prefill_engine_route(c, query=query, key=None, past_key=past)
    assert fn is None and match in why


def test_engine_route_needs_sm90(monkeypatch):
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: False)
    c = _config()
    query = jax.ShapeDtypeStruct((2, 128, 12 * 64), np.float16)
    past = jax.ShapeDtypeStruct((2, 2, 160, 64), np.float16)
    fn, why = decode_paths.gqa_prefill_engine_route(c, query=query, key=None, past_key=past)
    assert fn is None and "sm_90" in why


def test_switch_on_falls_back_to_cudnn_then_the_reference_with_both_reasons(gpu_like, monkeypatch):
    monkeypatch.setenv(ENV, "1")
    # head size 112: the engine is not compiled for it, cuDNN takes it
    fn, why = _route(_config(head_size=112))
    assert why is None and fn.func is decode_paths._gqa_prefill
    # not sm_90: cuDNN
    monkeypatch.setattr(decode_paths, "prefill_engine_available", lambda: False)
    fn, why = _route(_config())
    assert why is None and fn.func is decode_paths._gqa_prefill
    # a quantised cache: neither; the reason names both
    fn, why = _route(_config(kv_bits=8))
    assert fn is None
    assert why.startswith("a prompt into a quantised cache runs on the reference") and "prefill engine" in why


def test_switch_is_read_at_trace_time_and_validated(gpu_like, monkeypatch):
    monkeypatch.setenv(ENV, "maybe")
    with pytest.raises(ValueError, match=ENV):
        _route(_config())


# --- the q_len / kv_len mapping, with the kernels swapped for their specs ----------------------

@pytest.fixture
def engine_as_spec(monkeypatch, gpu_like):
    monkeypatch.setenv(ENV, "1")
    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)  # the specs run on the CPU
    monkeypatch.setattr(cuda, "gqa_prepare", gqa_reference.prepare_step)
    monkeypatch.setattr(cuda, "prefill_attention", prefill_reference.prefill_attention)


def _gqa(inp, attrs, backend):
    return jax.jit(lambda a: ops.group_query_attention(**a, **attrs, backend=backend))(inp)


def _cuda_and_reference(inp, attrs, dtype, backend="cuda"):
    """(got, want): the op on `backend` and on the reference, their output and present K / V
    checked equal within dtype's tolerance."""
    got, want = _gqa(inp, attrs, backend), _gqa(inp, attrs, "reference")
    for name in ("output", "present_key", "present_value"):
        assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype,
                     err_msg=name)
    return got, want


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("dtype,n,hkv,d,packed,pos_ids", [
    (np.float16, 4, 4, 64, True, False), (ml_dtypes.bfloat16, 8, 2, 64, False, True),
    (np.float16, 8, 1, 128, True, False)])
def test_engine_route_matches_the_reference_on_ragged_prompts(engine_as_spec, first, causal, dtype,
                                                             n, hkv, d, packed, pos_ids):
    """first: total_sequence_length == S (GQA's first prompt: a row with T_b < S is right-padded,
    its padded query rows see the T_b keys); else total = C (past_empty alone: T_b < S would start
    before position 0, so such a row is refused, as on a decode step)."""
    b, s, cap = 4, 72, 96
    # full, padded, one key, refused (beyond the cache: status set, output 0)
    seqlens = [s - 1, 40, 0, cap + 5]
    inp = gqa_prompt(n * d + causal, dtype, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap, seqlens=seqlens,
                  packed=packed)
    if pos_ids:
        inp["position_ids"] = (np.arange(s, dtype=np.int64)[None] + np.arange(b)[:, None] * 3)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal,
                 total_sequence_length=s if first else cap, shared_buffer=True, past_empty=True)
    got, want = _cuda_and_reference(inp, attrs, dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    out = np.asarray(got.output).astype(np.float32)
    assert not out[-1].any() and np.isfinite(out).all()
    assert out[1, 41:].any() == first  # the padded rows see the T_b keys (refused: 0)


@pytest.mark.parametrize("window", [1, 5, 30, 72, 500])
@pytest.mark.parametrize("first", [True, False])
def test_engine_route_local_windows_match_the_reference(engine_as_spec, first, window):
    """GQA's local_window_size W (causal only): a row sees keys [L - W, L), L = p + 1 (left = W - 1)
    or T_b (padded rows of a first prompt: the last W keys); W >= S: no limit."""
    causal = 1
    b, s, cap, n, hkv, d = 4, 72, 96, 8, 2, 64
    seqlens = [s - 1, 40, 0, cap + 5]
    inp = gqa_prompt(window + causal, np.float16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap,
                  seqlens=seqlens, packed=True)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal,
                 total_sequence_length=s if first else cap, shared_buffer=True, past_empty=True,
                 local_window_size=window)
    fn, why = _route(_config(local_window_size=window, causal=bool(causal), first_prompt=first,
                             total_sequence_length=s if first else cap), s=s)
    assert why is None and fn.func is decode_paths._gqa_prefill_engine
    got, want = _cuda_and_reference(inp, attrs, np.float16)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


@pytest.mark.parametrize("sink", ["head_sink", "smooth", "huge", "tiny"])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("causal", [1, 0])
def test_engine_route_sinks_match_the_reference(engine_as_spec, first, causal, sink):
    """GQA's head_sink [N] (any dtype) or smooth_softmax (a sink of 0): an extra logit per query head
    in the softmax's max and denominator, no value row; on every call of the route (the padded rows'
    too). huge / tiny: sinks of +-1e4 (all the weight on the sink: output ~0; none: no change)."""
    b, s, cap, n, hkv, d = 4, 72, 96, 8, 2, 64
    seqlens = [s - 1, 40, 0, cap + 5]
    inp = gqa_prompt(causal + 2 * first, np.float16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap,
                  seqlens=seqlens, packed=True)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal,
                 total_sequence_length=s if first else cap, shared_buffer=True, past_empty=True)
    if sink == "smooth":
        attrs["smooth_softmax"] = 1
    else:
        value = {"head_sink": np.linspace(-3, 3, n), "huge": np.full(n, 1e4),
                 "tiny": np.full(n, -1e4)}[sink]
        inp["head_sink"] = value.astype(np.float16)  # GQA: the query's dtype
    fn, why = _route(_config(smooth_softmax=sink == "smooth", causal=bool(causal),
                             first_prompt=first, total_sequence_length=s if first else cap), s=s)
    assert why is None and fn.func is decode_paths._gqa_prefill_engine
    got, want = _cuda_and_reference(inp, attrs, np.float16)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    out = np.asarray(got.output).astype(np.float32)
    assert np.isfinite(out).all()
    if sink == "huge":
        assert np.abs(out).max() < 1e-3


@pytest.mark.parametrize("softcap,window,smooth", [(30.0, -1, 0), (5.0, 20, 1), (0.5, -1, 0)])
@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("causal", [1, 0])
def test_engine_route_softcap_matches_the_reference(engine_as_spec, first, causal, softcap, window,
                                                    smooth):
    """GQA's softcap: logits -> softcap * tanh(logit / softcap) before the mask, on every call of
    the route; with a window and smooth softmax too (causal only: GQA's windows)."""
    window = window if causal else -1
    b, s, cap, n, hkv, d = 4, 72, 96, 8, 2, 64
    inp = gqa_prompt(int(softcap) + causal, np.float16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap,
                  seqlens=[s - 1, 40, 0, cap + 5], packed=True)
    inp["query"] = inp["query"] * np.float16(4)  # logits well past the cap
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=causal, softcap=softcap,
                 total_sequence_length=s if first else cap, shared_buffer=True, past_empty=True,
                 local_window_size=window, smooth_softmax=smooth)
    fn, why = _route(_config(softcap=softcap, causal=bool(causal), first_prompt=first,
                             local_window_size=window, smooth_softmax=bool(smooth),
                             total_sequence_length=s if first else cap), s=s)
    assert why is None and fn.func is decode_paths._gqa_prefill_engine
    got, want = _cuda_and_reference(inp, attrs, np.float16)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))


def test_bench_environment_records_the_switch(monkeypatch):
    from jax_onnx_attn.bench.decode import environment
    monkeypatch.setenv(ENV, "1")
    env = environment()
    assert env["prefill_engine"] is True and env["joa_env"][ENV] == "1"
    monkeypatch.delenv(ENV)
    env = environment()
    assert env["prefill_engine"] is True and ENV not in env["joa_env"]
    monkeypatch.setenv(ENV, "0")
    assert environment()["prefill_engine"] is False
    monkeypatch.setenv(ENV, "yes")
    with pytest.raises(ValueError, match=ENV):
        environment()


@pytest.mark.parametrize("first,causal,calls", [(True, 1, 2), (False, 1, 1), (True, 0, 1),
                                                (False, 0, 1)])
def test_padded_rows_cost_a_second_call_on_first_prompts_only(engine_as_spec, monkeypatch, first,
                                                              causal, calls):
    seen = []

    def counting(*args, **kw):
        seen.append(kw["causal"])
        return prefill_reference.prefill_attention(*args, **kw)

    monkeypatch.setattr(cuda, "prefill_attention", counting)
    s, cap = 72, 96
    inp = gqa_prompt(0, np.float16, b=2, s=s, n=4, hkv=2, d=64, cap=cap, seqlens=[s - 1, 30],
                  packed=True)
    attrs = dict(num_heads=4, kv_num_heads=2, causal=causal, total_sequence_length=s if first else cap,
                 shared_buffer=True, past_empty=True)
    jax.make_jaxpr(lambda a: ops.group_query_attention(**a, **attrs, backend="cuda"))(inp)
    assert len(seen) == calls and seen[0] == bool(causal)


@pytest.fixture
def cudnn_as_spec(monkeypatch, gpu_like):
    """The cuDNN route with its kernels swapped for specs: reference gqa_prepare, and jax's own
    (XLA) dot_product_attention for cuDNN's."""
    monkeypatch.setenv(ENV, "0")
    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)
    monkeypatch.setattr(cuda, "gqa_prepare", gqa_reference.prepare_step)
    xla_attention = jax.nn.dot_product_attention

    def spec(q, k, v, *a, implementation=None, **kw):
        assert implementation == "cudnn"
        f32 = [t.astype(np.float32) for t in (q, k, v)]  # CPU dots take no f16 x f16 -> f32
        return xla_attention(*f32, *a, implementation="xla", **kw).astype(q.dtype)

    monkeypatch.setattr(jax.nn, "dot_product_attention", spec)


@pytest.mark.parametrize("first", [True, False])
@pytest.mark.parametrize("dtype,n,hkv,d,packed,pos_ids", [
    (np.float16, 4, 4, 64, True, False), (ml_dtypes.bfloat16, 8, 2, 64, False, True)])
def test_cudnn_route_matches_the_reference_on_ragged_prompts(cudnn_as_spec, first, dtype, n, hkv, d,
                                                             packed, pos_ids):
    """The default route of a prompt (cuDNN) on right-padded first prompts: the padded rows see the
    T_b keys, as GQA says (it used to hand gqa_prepare seqlens_k, which refused such a row: output
    0 and KV_WRITE_OUT_OF_RANGE)."""
    b, s, cap = 4, 72, 96
    seqlens = [s - 1, 40, 0, cap + 5]
    inp = gqa_prompt(n * d + 7, dtype, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap, seqlens=seqlens,
                  packed=packed)
    if pos_ids:
        inp["position_ids"] = (np.arange(s, dtype=np.int64)[None] + np.arange(b)[:, None] * 3)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=1,
                 total_sequence_length=s if first else cap, shared_buffer=True, past_empty=True)
    got, want = _cuda_and_reference(inp, attrs, dtype)
    np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    out = np.asarray(got.output).astype(np.float32)
    assert not out[-1].any() and np.isfinite(out).all()
    assert out[1, 41:].any() == first


@pytest.mark.parametrize("engine", ["0", "1"])
@pytest.mark.parametrize("extra", ["head_sink", "attention_bias"])
def test_prompts_with_a_sink_or_bias_input_fall_back_and_match(cudnn_as_spec, monkeypatch, engine,
                                                               extra):
    """head_sink without smooth_softmax, or attention_bias, on a prompt: a route that cannot take it
    says so (it used to pass the route's checks and stop at an AssertionError inside)."""
    monkeypatch.setenv(ENV, engine)
    monkeypatch.setattr(cuda, "prefill_attention", prefill_reference.prefill_attention)
    b, s, cap, n, hkv, d = 2, 72, 96, 4, 2, 64
    inp = gqa_prompt(3, np.float16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap, seqlens=[s - 1, 40],
                  packed=True)
    rng = np.random.default_rng(4)
    if extra == "head_sink":
        inp["head_sink"] = rng.standard_normal(n).astype(np.float16)
    else:
        inp["attention_bias"] = rng.standard_normal((1, n, s, cap)).astype(np.float16)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, causal=1, total_sequence_length=cap,
                 shared_buffer=True, past_empty=True)
    if engine != "1" or extra != "head_sink":  # only the engine takes a sink
        with pytest.raises(NotImplementedError, match="runs on the reference"):
            _gqa(inp, attrs, "cuda")
    _cuda_and_reference(inp, attrs, np.float16, backend="auto")
