"""The fused GroupQueryAttention step preparation (gqa_prepare, ffi/handlers/gqa_prepare.cu) on a GPU against
its jnp spec `reference.gqa.prepare_step` run on the CPU: Q, the appended K/V rows (float, and int8 /
int4 per tensor and per channel bit for bit), the rows it must leave alone, status, determinism,
in-place donation and command-buffer capture."""

import functools
import itertools
import textwrap
import zlib

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops import status as st
from jax_onnx_attn.ops.reference import gqa as gqa_reference
from jax_onnx_attn.ops.reference import quant
from jax_onnx_attn.testing import assert_close, hlo_copies_of

import command_buffer

pytestmark = pytest.mark.gpu

BF16, F16, F32 = ml_dtypes.bfloat16, np.float16, np.float32
ARGS = ("query", "key", "value", "k_cache", "v_cache", "seqlens_k", "cos_cache", "sin_cache",
        "position_ids", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale")
#: rotary mode -> (rotary, interleaved, partial, position_ids)
ROTARY = {"none": (False, False, False, False), "half": (True, False, False, False),
          "interleaved": (True, True, False, False), "partial_half": (True, False, True, False),
          "partial_interleaved": (True, True, True, False), "position_ids": (True, False, False, True)}
#: cache -> (kv_bits, per_channel)
CACHES = {"float": (0, False), "int8_tensor": (8, False), "int8_channel": (8, True),
          "int4_tensor": (4, False), "int4_channel": (4, True)}


def _inputs(seed, dtype, *, s, n, hkv, d, packed, rotary, norm, cache, b=6):
    """One step's kernel arguments (in ARGS order) and attributes. Row 0 starts at the last row
    that fits, rows 1..b-4 at random fitting rows; the last three are refused: one row past the
    end, past_b = -1, and seqlens_k = 2^30."""
    rng = np.random.default_rng(seed)
    x = lambda *shape: rng.standard_normal(shape).astype(dtype)  # noqa: E731
    cap = s + 29
    bits, per_channel = CACHES[cache]
    use_rotary, interleaved, partial, use_positions = ROTARY[rotary]
    past = rng.integers(0, cap - s + 1, size=b)
    past[0] = cap - s
    past[-3:] = [cap - s + 1, -1, 2**30]
    a = dict.fromkeys(ARGS)
    a["seqlens_k"] = (past + s - 1).astype(np.int32)
    if packed:
        a["query"] = x(b, s, (n + 2 * hkv) * d)
    else:
        a.update(query=x(b, s, n * d), key=x(b, s, hkv * d), value=x(b, s, hkv * d))
    if bits == 0:
        a["k_cache"], a["v_cache"] = x(b, hkv, cap, d), x(b, hkv, cap, d)
    else:
        storage, cache_d = (np.int8, d) if bits == 8 else (np.uint8, d // 2)
        info = np.iinfo(storage)
        for name in ("k_cache", "v_cache"):
            a[name] = rng.integers(info.min, info.max + 1, (b, hkv, cap, cache_d)).astype(storage)
        qmax = 127 if bits == 8 else 7
        for name in ("k_scale", "v_scale"):
            if per_channel:  # random scales, one of them 0 (counts as 1)
                scale = (rng.uniform(0.5, 1.5, (1, hkv, 1, d)) * 2.5 / qmax).astype(np.float32)
                scale[0, -1, 0, 1] = 0.0
            else:  # a power of two: many x / scale land on ties (round half to even)
                scale = np.full((1,), 2.0 ** -(5 if bits == 8 else 1), np.float32)
            a[name] = scale
    if use_rotary:
        half = max(8, d // 4 // 8 * 8) if partial else d // 2
        positions = cap + s
        ang = rng.uniform(0, 2 * np.pi, (positions, half))
        a["cos_cache"], a["sin_cache"] = np.cos(ang).astype(dtype), np.sin(ang).astype(dtype)
        if use_positions:  # a few outside the table: the gather clips
            a["position_ids"] = rng.integers(-3, positions + 5, (b, s)).astype(np.int32)
    if norm:  # weights near 1, as trained models have them
        a["q_norm_weight"], a["k_norm_weight"] = [(1 + 0.5 * x(d)).astype(dtype) for _ in "qk"]
    attrs = dict(num_heads=n, kv_num_heads=hkv, rotary_interleaved=interleaved, kv_bits=bits,
                 q_norm_epsilon=1e-6, k_norm_epsilon=1e-5)
    return [a[k] for k in ARGS], attrs


@functools.cache
def _kernel(**attrs):
    return jax.jit(functools.partial(cuda.gqa_prepare, **attrs))


def _run_kernel(args, attrs):
    return [np.asarray(r) for r in _kernel(**attrs)(*args)]


def _on_cpu(f, *args):
    with jax.default_device(jax.devices("cpu")[0]):
        return [np.asarray(r) for r in jax.jit(f)(*args)]


def _spec(args, attrs):
    return _on_cpu(functools.partial(gqa_reference.prepare_step, **attrs), *args)


def _written(seqlens, s, shape):
    """bool [B, Hkv, C]: the cache rows the step writes (none for a refused batch row)."""
    past = seqlens.astype(np.int64) + 1 - s
    mask = np.zeros(shape[:3], bool)
    for b, p in enumerate(past):
        if 0 <= p <= shape[2] - s:
            mask[b, :, p:p + s] = True
    return mask


def _levels(q, bits):
    """Quantised cache rows -> their integer levels (int4 unpacked, bias removed)."""
    if bits == 8:
        return q.astype(np.int32)
    return np.stack([(q & 15).astype(np.int32) - 8, (q >> 4).astype(np.int32) - 8], -1).reshape(
        *q.shape[:-1], -1)


def _check(args, attrs, dtype):
    a = dict(zip(ARGS, args))
    s = a["query"].shape[1]
    bits = attrs["kv_bits"]
    got = _run_kernel(args, attrs)
    want = _spec(args, attrs)
    q, k_cache, v_cache, status = got

    past = a["seqlens_k"].astype(np.int64) + 1 - s
    fits = (past >= 0) & (past <= a["k_cache"].shape[2] - s)
    np.testing.assert_array_equal(status, np.where(fits, st.OK, st.KV_WRITE_OUT_OF_RANGE))
    np.testing.assert_array_equal(status, want[3])
    assert_close(q, want[0], dtype, err_msg="q")

    written = _written(a["seqlens_k"], s, a["k_cache"].shape)
    transformed = a["cos_cache"] is not None or a["q_norm_weight"] is not None
    for name, g, w in (("k_cache", k_cache, want[1]), ("v_cache", v_cache, want[2])):
        # Refused batch rows, and rows outside [past_b, past_b + S): untouched, bit for bit.
        np.testing.assert_array_equal(g[~written], a[name][~written], err_msg=f"{name} untouched rows")
        if name == "v_cache" or not transformed:  # a copy, or a copy quantised: bit for bit
            np.testing.assert_array_equal(g[written], w[written], err_msg=f"{name} new rows")
        elif bits == 0:
            assert_close(g[written], w[written], dtype, err_msg=f"{name} new rows")
        else:
            # Normed / rotated K may differ from the spec's by an ulp of T, hence by one level at a
            # rounding edge; the quantisation itself is bit for bit that of the kernel's own float K.
            assert np.abs(_levels(g[written], bits) - _levels(w[written], bits)).max() <= 1, name
            float_args, float_attrs = _with_float_caches(args, attrs)
            k_float = _run_kernel(float_args, float_attrs)[1]
            assert_close(k_float[written], _spec(float_args, float_attrs)[1][written], dtype,
                         err_msg="k before quantisation")
            scale = a["k_scale"].reshape(()) if a["k_scale"].size == 1 else a["k_scale"]
            requantised = _on_cpu(lambda k: [quant.quantize(k, scale, bits)], k_float)[0]
            np.testing.assert_array_equal(g[written], requantised[written], err_msg="quantised k")


def _with_float_caches(args, attrs):
    """The same step on zero caches of the query's dtype (kv_bits 0, no scales)."""
    a = dict(zip(ARGS, args))
    heads = attrs["num_heads"] + (2 * attrs["kv_num_heads"] if a["key"] is None else 0)
    d = a["query"].shape[2] // heads
    zeros = np.zeros(a["k_cache"].shape[:3] + (d,), a["query"].dtype)
    a.update(k_cache=zeros, v_cache=zeros, k_scale=None, v_scale=None)
    return [a[k] for k in ARGS], dict(attrs, kv_bits=0)


def _spread(options, n, seed):
    """n picks of `options`, each equally often (up to one), in a fixed shuffled order."""
    picks = [options[i % len(options)] for i in range(n)]
    order = np.random.default_rng(seed).permutation(n)
    return [picks[i] for i in order]


# Every (dtype, rotary, cache) combination; heads, head dim, S, packing and q/k norm spread over them.
_GRID = list(itertools.product([BF16, F16], ROTARY, CACHES))
CASES = list(zip(_GRID,
                 _spread([(32, 8), (8, 8), (6, 2), (64, 8)], len(_GRID), 1),
                 _spread([64, 80, 96, 128, 256], len(_GRID), 2),
                 _spread([1, 2, 5, 16], len(_GRID), 3),
                 _spread([True, False], len(_GRID), 4),
                 _spread([False, True], len(_GRID), 5)))
# float32 (a template instantiation of the same kernel): a few.
CASES += [((F32, "half", "float"), (8, 2), 128, 4, True, True),
          ((F32, "partial_interleaved", "int8_channel"), (6, 2), 64, 1, False, False),
          ((F32, "position_ids", "int4_tensor"), (32, 8), 96, 3, True, True)]


def _case_id(case):
    (dtype, rotary, cache), (n, hkv), d, s, packed, norm = case
    return (f"{np.dtype(dtype).name}-{rotary}-{cache}-{n}x{hkv}-d{d}-s{s}"
            f"-{'packed' if packed else 'split'}{'-norm' if norm else ''}")


@pytest.mark.parametrize("case", CASES, ids=_case_id)
def test_kernel_matches_the_spec(case):
    (dtype, rotary, cache), (n, hkv), d, s, packed, norm = case
    args, attrs = _inputs(zlib.crc32(_case_id(case).encode()), dtype, s=s, n=n, hkv=hkv, d=d,
                          packed=packed, rotary=rotary, norm=norm, cache=cache)
    _check(args, attrs, dtype)


def test_kernel_is_deterministic():
    args, attrs = _inputs(7, BF16, s=4, n=32, hkv=8, d=128, packed=True, rotary="half", norm=True,
                          cache="int4_channel")
    first, second = _run_kernel(args, attrs), _run_kernel(args, attrs)
    for x, y in zip(first, second):
        np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("bits", [0, 8, 4])
def test_donated_caches_are_updated_in_place(bits):
    cache = "float" if bits == 0 else f"int{bits}_channel"
    args, attrs = _inputs(bits, BF16, b=4, s=1, n=32, hkv=8, d=128, packed=True, rotary="half",
                          norm=False, cache=cache)
    a = dict(zip(ARGS, args))
    big = (4, 8, 1024, a["k_cache"].shape[3])  # a realistic capacity
    k_cache = jnp.asarray(np.resize(a["k_cache"], big))
    v_cache = jnp.asarray(np.resize(a["v_cache"], big))
    seqlens = np.array([5, 1000, 17, 1023], np.int32)  # all fit (the last one exactly)
    rest = (a["query"], a["cos_cache"], a["sin_cache"], a["k_scale"], a["v_scale"])

    def step(prepare, k_cache, v_cache, seqlens, query, cos, sin, k_scale, v_scale):
        return prepare(query, None, None, k_cache, v_cache, seqlens, cos, sin, None, None, None,
                       k_scale, v_scale, **attrs)

    f = jax.jit(functools.partial(step, cuda.gqa_prepare), donate_argnums=(0, 1))
    hlo = f.lower(k_cache, v_cache, seqlens, *rest).compile().as_text()
    assert 'custom_call_target="jax_onnx_attn_gqa_prepare"' in hlo
    assert hlo_copies_of(hlo, big, k_cache.dtype) == [], "a donated cache was copied"
    pointers = k_cache.unsafe_buffer_pointer(), v_cache.unsafe_buffer_pointer()
    want = _on_cpu(functools.partial(step, gqa_reference.prepare_step), np.asarray(k_cache),
                   np.asarray(v_cache), seqlens, *rest)
    q, k_out, v_out, status = f(k_cache, v_cache, seqlens, *rest)
    assert (k_out.unsafe_buffer_pointer(), v_out.unsafe_buffer_pointer()) == pointers
    assert k_cache.is_deleted() and v_cache.is_deleted()
    assert np.asarray(status).tolist() == [0, 0, 0, 0]
    np.testing.assert_array_equal(np.asarray(v_out), want[2])
    assert_close(np.asarray(q), want[0], BF16)


# A decode loop in a fresh process (so that XLA_FLAGS apply): step i writes V = K = i at row
# seqlens_k + i; the script prints the custom-call names for the command-buffer log and dump.
_LOOP = textwrap.dedent("""
    import jax, jax.numpy as jnp
    from jax_onnx_attn.ops import cuda

    B, N, HKV, D, C = 2, 8, 2, 64, 64

    def steps(k_cache, v_cache, seqlens):
        def body(i, carry):
            k_cache, v_cache, seqlens, flags = carry
            query = jnp.full((B, 1, (N + 2 * HKV) * D), i, jnp.bfloat16)
            _, k_cache, v_cache, st = cuda.gqa_prepare(query, None, None, k_cache, v_cache, seqlens,
                                                       num_heads=N, kv_num_heads=HKV)
            return k_cache, v_cache, seqlens + 1, flags | st
        return jax.lax.fori_loop(0, 16, body, (k_cache, v_cache, seqlens, jnp.zeros_like(seqlens)))

    f = jax.jit(steps, donate_argnums=(0, 1))
    k = jnp.zeros((B, HKV, C, D), jnp.bfloat16)
    v = jnp.zeros((B, HKV, C, D), jnp.bfloat16)
    seqlens = jnp.array([0, 10], jnp.int32)
    hlo = f.lower(k, v, seqlens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_gqa_prepare"' in l]
    print("CUSTOM_CALL_NAMES", *names)
    k1, v1, _, flags = f(k, v, seqlens)
    k2, v2, _, flags = f(jnp.zeros_like(k1), jnp.zeros_like(v1), seqlens)  # replay
    assert int(flags.max()) == 0, flags
    assert float(v2[1, 0, 10 + 15, 0]) == 15.0 and float(k2[0, 1, 3, 5]) == 3.0, (v2, k2)
    assert float(v2[0, 0, 16, 0]) == 0.0 and float(k2[1, 1, 9, 0]) == 0.0
    print("LOOP_OK")
""")


def test_handler_is_captured_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "gqa_prepare", tmp_path)
