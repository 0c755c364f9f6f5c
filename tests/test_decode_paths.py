"""The Python composition of the operators' CUDA decode paths (ops/decode_paths.py), on the CPU.

The kernels are swapped for their executable specs (reference kv_append, decode_attention, GQA's
prepare_step, and linear_gqa_prepare's from tests/kernel_specs.py), so what is checked is everything around them — the lengths, bias padding, sinks,
window translation, status — against each operator's own reference backend, and that the specs
compose to the operator. The kernels themselves are checked against those specs on a GPU
(tests/gpu/). Also: gqa_prepare's result shapes.
"""

import functools
import itertools

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn.ops import backend, cuda
from jax_onnx_attn.ops.reference import decode as decode_reference
from jax_onnx_attn.ops.reference import gqa as gqa_reference
from jax_onnx_attn.ops.reference import kv_cache as kv_reference
from jax_onnx_attn.testing import assert_close

from gqa_decode_cases import gqa_inputs, quant_attrs
from kernel_specs import use_specs


@pytest.fixture
def kernels_as_specs(monkeypatch):
    monkeypatch.setattr(backend, "has_cuda", lambda: True)
    monkeypatch.setattr(backend, "no_cuda_device", lambda: None)  # the specs run on the CPU
    monkeypatch.setattr(cuda, "kv_append", kv_reference.kv_append)
    monkeypatch.setattr(cuda, "decode_attention", decode_reference.decode_attention)
    monkeypatch.setattr(cuda, "gqa_prepare", gqa_reference.prepare_step)


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


@pytest.mark.parametrize("s", [1, 3])
@pytest.mark.parametrize("bits,quant_type", [(8, "PER_TENSOR"), (8, "PER_CHANNEL"), (4, "PER_TENSOR"),
                                             (4, "PER_CHANNEL")])
def test_gqa_decode_path_with_a_quantised_cache(kernels_as_specs, bits, quant_type, s):
    """Quantised caches on the CUDA path (prepare writes levels, the engine reads them dequantised
    to the query dtype) against the operator's reference (which dequantises to float32)."""
    dtype = np.float16 if s == 1 else ml_dtypes.bfloat16
    inp = gqa_inputs(bits + s, dtype, b=3, s=s, n=4, hkv=2, d=64, cap=24, rotary=1, sink=s == 3,
                     kv_bits=bits, quant_type=quant_type)
    total = inp.pop("total_sequence_length")
    attrs = dict(num_heads=4, kv_num_heads=2, do_rotary=1, total_sequence_length=total,
                 shared_buffer=True, **quant_attrs(bits, quant_type))
    run = lambda b: jax.jit(lambda x: ops.group_query_attention(**x, **attrs, backend=b))(inp)  # noqa: E731
    got, want = run("cuda"), run("reference")
    assert_close(np.asarray(got.output), np.asarray(want.output), dtype)
    for name in ("present_key", "present_value", "status"):  # the same jnp steps: bitwise
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)


@pytest.mark.parametrize("rotary,packed", [(1, True), (2, False)])
def test_gqa_decode_path_with_position_ids_and_norm(kernels_as_specs, rotary, packed):
    inp = gqa_inputs(11 + rotary, np.float16, b=3, s=3, n=6, hkv=2, d=64, cap=24, packed=packed,
                     rotary=rotary, norm=True, position_ids=True)
    total = inp.pop("total_sequence_length")
    attrs = dict(num_heads=6, kv_num_heads=2, do_rotary=1, rotary_interleaved=int(rotary == 2),
                 qk_norm_epsilon=1e-5, total_sequence_length=total, shared_buffer=True)
    run = lambda b: jax.jit(lambda x: ops.group_query_attention(**x, **attrs, backend=b))(inp)  # noqa: E731
    got, want = run("cuda"), run("reference")
    assert_close(np.asarray(got.output), np.asarray(want.output), np.float16)
    for name in ("present_key", "present_value", "status"):  # the same jnp steps: bitwise
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)


# (kv_cache_bit_width, quant type): the float cache, int8 and int4, per tensor and per channel.
CACHES = [(0, "NONE"), (8, "PER_TENSOR"), (8, "PER_CHANNEL"), (4, "PER_TENSOR"), (4, "PER_CHANNEL")]


@pytest.mark.parametrize("bits,quant_type", CACHES)
def test_prepare_step_writes_the_operators_present(bits, quant_type):
    """prepare_step (gqa_prepare's spec) appends, quantises and refuses rows bit for bit as the
    operator's reference does in a shared-buffer decode step."""
    b, s, n, hkv, d, cap = 4, 2, 4, 2, 32, 12
    inp = gqa_inputs(bits + len(quant_type), np.float16, b=b, s=s, n=n, hkv=hkv, d=d, cap=cap,
                     packed=bits != 8, rotary=1, norm=True)
    total = inp.pop("total_sequence_length")
    inp["seqlens_k"][0] = s - 2  # past_b = -1: refused as well
    rng = np.random.default_rng(bits)
    quant = {}
    if bits:
        shape = (1,) if quant_type == "PER_TENSOR" else (1, hkv, 1, d)
        qmax = 127 if bits == 8 else 7
        k_scale, v_scale = [(rng.uniform(0.5, 2.0, shape) / qmax).astype(np.float32) for _ in "kv"]
        if quant_type == "PER_CHANNEL":
            k_scale[0, 1, 0, 3] = 0.0  # a zero scale counts as 1
        storage, cache_d = (np.int8, d) if bits == 8 else (np.uint8, d // 2)
        past_key, past_value = [rng.integers(0, 100, (b, hkv, cap, cache_d)).astype(storage)
                                for _ in "kv"]
        inp.update(past_key=past_key, past_value=past_value, k_scale=k_scale, v_scale=v_scale)
        quant = dict(k_quant_type=quant_type, v_quant_type=quant_type, kv_cache_bit_width=bits)
    attrs = dict(num_heads=n, kv_num_heads=hkv, do_rotary=1, total_sequence_length=total,
                 shared_buffer=True, **quant)
    want = jax.jit(lambda x: ops.group_query_attention(**x, **attrs, backend="reference"))(inp)
    spec = functools.partial(gqa_reference.prepare_step, num_heads=n, kv_num_heads=hkv, kv_bits=bits)
    args = [inp.get(k) for k in ("query", "key", "value", "past_key", "past_value", "seqlens_k",
                                 "cos_cache", "sin_cache", "position_ids", "q_norm_weight",
                                 "k_norm_weight", "k_scale", "v_scale")]
    _, k_cache, v_cache, status = jax.jit(spec)(*args)
    np.testing.assert_array_equal(np.asarray(k_cache), np.asarray(want.present_key))
    np.testing.assert_array_equal(np.asarray(v_cache), np.asarray(want.present_value))
    np.testing.assert_array_equal(np.asarray(status), np.asarray(want.status))
    assert np.asarray(status).tolist() == [1, 0, 0, 1]


def _prepare_args(packed=True, *, b=2, s=3, n=4, hkv=2, d=64, cap=16, bits=0, dtype=jnp.bfloat16):
    z = lambda *shape, t=dtype: jnp.zeros(shape, t)  # noqa: E731
    cache_d, cache_t = (d // 2, jnp.uint8) if bits == 4 else (d, jnp.int8 if bits else dtype)
    args = dict(query=z(b, s, (n + 2 * hkv) * d) if packed else z(b, s, n * d),
                key=None if packed else z(b, s, hkv * d), value=None if packed else z(b, s, hkv * d),
                k_cache=z(b, hkv, cap, cache_d, t=cache_t), v_cache=z(b, hkv, cap, cache_d, t=cache_t),
                seqlens_k=z(b, t=jnp.int32), cos_cache=z(cap, d // 4), sin_cache=z(cap, d // 4),
                position_ids=z(b, s, t=jnp.int32), q_norm_weight=z(d), k_norm_weight=z(d))
    if bits:
        args.update(k_scale=z(1, t=jnp.float32), v_scale=z(1, hkv, 1, d, t=jnp.float32))
    return args, dict(num_heads=n, kv_num_heads=hkv, kv_bits=bits)


@pytest.mark.parametrize("packed,bits", [(True, 0), (False, 8), (True, 4)])
def test_gqa_prepare_results_have_the_specs_shapes(monkeypatch, packed, bits):
    # Shapes need no kernel: the target's name stands in where the extension has none compiled
    # (a CPU machine's build skips them, JOA_ENABLE_CUDA=AUTO).
    monkeypatch.setattr(cuda, "target", lambda name: "jax_onnx_attn_" + name)
    args, attrs = _prepare_args(packed, bits=bits)
    got = jax.eval_shape(functools.partial(cuda.gqa_prepare, **attrs), **args)
    want = jax.eval_shape(functools.partial(gqa_reference.prepare_step, **attrs), **args)
    assert [(x.shape, x.dtype) for x in got] == [(x.shape, x.dtype) for x in want]


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


@pytest.mark.parametrize("bits,norm", [(16, True), (16, False), (4, True)])
def test_gqa_decode_path_computes_a_projected_query_in_one_call(kernels_as_specs, monkeypatch, bits, norm):
    """A query given with its projection (ops.QkvProjection, onnx.fusion's qkv_prepare): the CUDA route
    of one row calls linear_gqa_prepare (its spec here: tests/kernel_specs.py) instead of gqa_prepare,
    and the step equals the operator's reference on the query; a refused row is reported."""
    calls = use_specs(monkeypatch)
    n, hkv, d, half, k, cap = 4, 2, 64, 32, 512, 24
    rng = np.random.default_rng(bits + norm)
    dtype = np.float16
    order = ops.rotary_pair_order(n, hkv, d, half)
    rows = (n + 2 * hkv) * d
    x = jnp.asarray(rng.standard_normal((1, 1, k)), dtype)
    gamma = jnp.asarray(1 + 0.1 * rng.standard_normal(k), dtype) if norm else None
    if bits == 16:
        w = jnp.asarray(ops.to_rotary_pair_order(rng.standard_normal((rows, k)) / np.sqrt(k), order), dtype)
        y = ops.linear(x, w, norm_weight=gamma, norm_epsilon=1e-5, backend="reference")
    else:
        b_quant = rng.integers(0, 256, (rows, k // 32, 16), dtype=np.uint8)
        scales = (rng.uniform(0.5, 1.5, (rows, k // 32)) / 64).astype(dtype)
        w = jnp.asarray(ops.to_record_layout(*(ops.to_rotary_pair_order(a, order) for a in (b_quant, scales)), None))
        y = ops.matmul_nbits(x, w, None, norm_weight=gamma, norm_epsilon=1e-5, k=k, n=rows, bits=4,
                             block_size=32, layout="record", backend="reference")
    query = ops.from_rotary_pair_order(y, order)
    projection = ops.QkvProjection(x, w, None, gamma, 1e-5, bits, 32 if bits == 4 else 0, half)
    ang = rng.uniform(0, 6.28, (cap, half))
    for seqlens in ([9], [cap]):  # a row that fits, and one whose write is refused
        args = dict(past_key=jnp.asarray(rng.standard_normal((1, hkv, cap, d)), dtype),
                    past_value=jnp.asarray(rng.standard_normal((1, hkv, cap, d)), dtype),
                    seqlens_k=jnp.asarray(seqlens, jnp.int32), total_sequence_length=cap,
                    cos_cache=jnp.asarray(np.cos(ang), dtype), sin_cache=jnp.asarray(np.sin(ang), dtype),
                    num_heads=n, kv_num_heads=hkv, do_rotary=1, shared_buffer=True)
        del calls[:]
        got = ops.group_query_attention(query, **args, query_projection=projection, backend="cuda")
        assert [c[0] for c in calls] == ["linear_gqa_prepare"], calls
        want = ops.group_query_attention(query, **args, backend="reference")
        for name in ("output", "present_key", "present_value"):
            assert_close(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)), dtype, err_msg=name)
        np.testing.assert_array_equal(np.asarray(got.status), np.asarray(want.status))
    assert np.asarray(got.status).tolist() != [0]
