"""ai.onnx Attention on the CUDA backend (decode engine + general kernel) against the reference
backend of the same op, jitted.

- Every ONNX conformance case with S <= 64 runs with backend="cuda" (all are covered) and matches its
  golden and the reference.
- A random sweep (tests/attention_cases.py): float32 / float16 / bfloat16 (V sometimes of another
  type), 3D / 4D, 1 / 2 / 8 query heads per KV head, D in {64, 128, 72}, Dv != D, past (L = S and
  L != S) / no cache (S < L, S > L) / ragged nonpad with NaN in the padding rows, bool / float / int
  / short masks of ranks 2-4, causal, windows, softcap, qk modes 0-3, softmax_precision; the lowered
  step holds the kernel the routing promises. Plus every way the kernels' query positions meet the
  spec's causal offset (past with L != S, no cache with S < L / S > L, nonpad) on both kernels.
- attention_with_cache with every qk mode, f32 / f16 / bf16, Dv != D, a refused row, and cache rows
  past the valid length holding garbage or NaN.
- The general kernel alone against its spec (reference.general) on the shapes its tiling splits:
  several row blocks, key tiles and value-column blocks, head sizes not a multiple of its chunk,
  kv_len clamped (beyond C, negative, 0), a bias longer than C, large pos_shift.
- Bitwise-identical repeats, and a decode loop of the general kernel captured in a command buffer.
"""

import functools
import textwrap

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn import conformance, ops
from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.decode_paths import MAX_QUERY_ROWS
from jax_onnx_attn.ops.reference import general as general_reference
from jax_onnx_attn.testing import assert_close, tolerance

import attention_cases
import command_buffer

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16
TARGETS = {"engine": "jax_onnx_attn_decode_attention", "general": "jax_onnx_attn_general_attention"}


# --- conformance cases ----------------------------------------------------------------------------

STATIC = ("is_causal", "scale", "softcap", "q_num_heads", "kv_num_heads", "qk_matmul_output_mode",
          "softmax_precision", "left_window_size", "right_window_size", "opset", "return_qk",
          "backend")
_attention = jax.jit(ops.attention, static_argnames=STATIC)


def _query_rows(case) -> int:
    q = case.inputs[case.model.graph.input[0].name]
    return q.shape[2] if q.ndim == 4 else q.shape[1]


DECODE_CASES = [c.name for c in conformance.attention_cases(expanded=False)
                if _query_rows(c) <= MAX_QUERY_ROWS]


@pytest.mark.parametrize("name", DECODE_CASES, ids=[n.removeprefix("test_attention_") for n in DECODE_CASES])
def test_conformance_case(name):
    case = conformance.attention_case(name)
    arrays, attributes, produced = conformance.node_call(case)
    kw = dict(attributes, opset=case.opset, return_qk="qk_matmul_output" in produced)
    got = dict(zip(conformance.ATTENTION_OUTPUTS, _attention(**arrays, **kw, backend="cuda")))
    want = dict(zip(conformance.ATTENTION_OUTPUTS, _attention(**arrays, **kw, backend="reference")))
    for (_, golden), slot in zip(case.outputs.items(), produced):
        actual = np.asarray(got[slot])
        assert actual.shape == golden.shape and actual.dtype == golden.dtype, slot
        assert_close(actual, golden, err_msg=f"{slot} vs the golden")
        assert_close(actual, np.asarray(want[slot]), golden.dtype, err_msg=f"{slot} vs reference")


def test_every_conformance_case_is_decode_sized():
    """So every case runs on the CUDA backend above (none is left to the reference)."""
    assert len(DECODE_CASES) == len(conformance.attention_cases(expanded=False))


# --- random sweep of ops.attention ---------------------------------------------------------------

def _check_against_reference(case):
    """backend="cuda" equals the reference on `case`, and lowers to exactly the kernel it names."""
    arrays, clean = attention_cases.inputs(case)
    got = attention_cases.run(case, arrays, "cuda")
    want = attention_cases.run(case, clean, "reference")
    attention_cases.check(case, got, want, arrays)
    lowered = attention_cases.lowered(case, arrays, "cuda")
    assert [t for t in TARGETS.values() if t in lowered] == [TARGETS[case.kernel()]]


@pytest.mark.parametrize("case", attention_cases.sweep(), ids=lambda c: c.id)
def test_sweep(case):
    _check_against_reference(case)


@pytest.mark.parametrize("case", attention_cases.position_cases(d=128), ids=lambda c: c.id)
def test_query_positions(case):
    """Past with L != S, no cache with S < L and S > L, nonpad: on the engine and the general kernel."""
    _check_against_reference(case)


# --- attention_with_cache with qk -----------------------------------------------------------------

def _cache_inputs(seed, dtype, v_dtype, dv, *, poison):
    """(arrays, clean, valid): with poison, cache rows at or past the valid length after the append
    hold NaN in `arrays` (random in `clean`, the reference's input)."""
    rng = np.random.default_rng(seed)
    b, hq, hkv, s, d, cap = 4, 16, 2, 3, 64, 130
    x = lambda t, *shape: rng.standard_normal(shape).astype(t)  # noqa: E731
    lengths = np.array([0, 7, 90, cap - 2], np.int32)  # the last does not fit: refused, y 0
    valid = np.where(lengths + s <= cap, lengths + s, 0)
    clean = dict(Q=x(dtype, b, hq, s, d), K=x(dtype, b, hkv, s, d), V=x(v_dtype, b, hkv, s, dv),
                 key_cache=x(dtype, b, hkv, cap, d), value_cache=x(v_dtype, b, hkv, cap, dv),
                 cache_lengths=lengths, attn_mask=rng.random((b, 1, s, cap - 20)) < 0.85)
    arrays = dict(clean)
    if poison:
        arrays["key_cache"], arrays["value_cache"] = clean["key_cache"].copy(), clean["value_cache"].copy()
        for bi, n in enumerate(valid):
            arrays["key_cache"][bi, :, n:] = np.nan
            arrays["value_cache"][bi, :, n:] = np.nan
    return arrays, clean, valid


@functools.cache
def _cache_jit(backend, mode):
    attrs = dict(is_causal=1, softcap=30.0, opset=25, left_window_size=40, return_qk=mode is not None,
                 qk_matmul_output_mode=mode or 0)
    return jax.jit(lambda a: ops.attention_with_cache(**a, **attrs, backend=backend))


@pytest.mark.parametrize("poison", [False, True])
@pytest.mark.parametrize("mode", [None, 0, 1, 2, 3])
@pytest.mark.parametrize("dtype,v_dtype,dv", [(np.float32, np.float32, 64), (np.float16, np.float16, 96),
                                              (BF16, BF16, 64), (np.float32, BF16, 40)],
                         ids=lambda p: getattr(p, "__name__", str(p)))
def test_attention_with_cache(dtype, v_dtype, dv, mode, poison):
    arrays, clean, valid = _cache_inputs(dv + (mode or 0), dtype, v_dtype, dv, poison=poison)
    got = _cache_jit("cuda", mode)(arrays)
    want = _cache_jit("reference", mode)(clean)
    y = np.asarray(got.y)
    assert not np.isnan(y.astype(np.float32)).any()
    assert_close(y, np.asarray(want.y), dtype, err_msg="y")
    assert not y[-1].astype(np.float32).any()  # the refused row
    names = ("cache_lengths", "status") + (() if poison else ("key_cache", "value_cache"))
    for name in names:
        np.testing.assert_array_equal(np.asarray(getattr(got, name)), np.asarray(getattr(want, name)),
                                      err_msg=name)
    if mode is None:
        assert got.qk is None
        return
    g, w = np.asarray(got.qk), np.asarray(want.qk)
    if poison and mode in (0, 1):  # defined on every key: NaN at the poisoned rows
        keep = np.arange(g.shape[-1]) < valid[:, None, None, None]
        g, w = np.where(keep, g, 0), np.where(keep, w, 0)
    assert_close(g, w, dtype, err_msg=f"qk mode {mode}")


# --- the general kernel against its spec ----------------------------------------------------------

F32, F16 = np.float32, np.float16
EDGES = [
    # (dtype, v_dtype, hq, hkv, s, d, dv, c, kv_len, pos_shift, bias, causal, window, qk_mode, softmax)
    (F32, F32, 16, 2, 5, 200, 300, 150, [500, -3, 0, 149], 0, "bf16_long", True, (-1, -1), 3, None),
    (F32, F16, 8, 8, 1, 8, 10, 7, [7, 3, 1, 0], 0, None, False, (-1, -1), 0, None),
    (BF16, F16, 4, 1, 64, 72, 72, 300, [300, 64, 10, 200], -7, "bool", True, (20, 3), 2, BF16),
    (F16, F16, 12, 4, 2, 256, 256, 1000, [1000, 999, 65, 64], 40, "f32", False, (50, 5), 1, F16),
    (F32, BF16, 6, 3, 16, 96, 520, 64, [64, 63, 1, 33], 3, "f16_heads", True, (-1, 0), None, F16),
]


def _bias(kind, rng, b, hq, s, c):
    if kind is None:
        return None
    if kind == "bf16_long":  # longer than C: the extra columns are never read
        return rng.standard_normal((1, hq, s, c + 5)).astype(BF16)
    if kind == "bool":  # short: keys past it are hidden
        return rng.random((b, 1, s, c - 9)) < 0.8
    if kind == "f32":
        x = rng.standard_normal((b, hq, s, c)).astype(np.float32)
        x[rng.random(x.shape) < 0.2] = -np.inf
        x[0, 0, 0] = -np.inf  # a fully masked row
        return x
    if kind == "f16_heads":
        return rng.standard_normal((1, hq, 1, c)).astype(np.float16)
    raise ValueError(kind)


@pytest.mark.parametrize("edge", EDGES, ids=[f"edge{i}" for i in range(len(EDGES))])
def test_general_kernel_against_its_spec(edge):
    dtype, v_dtype, hq, hkv, s, d, dv, c, kv_len, pos_shift, bias_kind, causal, window, mode, sm = edge
    rng = np.random.default_rng(c + d)
    b = len(kv_len)
    q = rng.standard_normal((b, hq, s, d)).astype(dtype)
    k = rng.standard_normal((b, hkv, c, d)).astype(dtype)
    v = rng.standard_normal((b, hkv, c, dv)).astype(v_dtype)
    lens = np.asarray(kv_len, np.int32)
    valid = np.clip(lens, 0, c)
    for bi, n in enumerate(valid):  # rows past the valid length hold NaN: never read for y
        k[bi, :, n:] = np.nan
        v[bi, :, n:] = np.nan
    bias = _bias(bias_kind, rng, b, hq, s, c)
    static = dict(scale=float(d) ** -0.5, softcap=25.0 if causal else 0.0, causal=causal,
                  left=window[0], right=window[1], pos_shift=pos_shift, qk_mode=mode,
                  softmax_dtype=sm)
    got_y, got_qk = jax.jit(functools.partial(cuda.general_attention, **static))(q, k, v, lens, bias)
    want_y, want_qk = jax.jit(functools.partial(general_reference.general_attention, **static))(
        q, k, v, lens, bias)
    tol = max([np.dtype(dtype)] + ([np.dtype(sm)] if sm is not None else []),
              key=lambda t: tolerance(t)[0])
    got_y = np.asarray(got_y)
    assert not np.isnan(got_y.astype(np.float32)).any()
    assert_close(got_y, np.asarray(want_y), tol, err_msg="y")
    assert not got_y[np.asarray(valid) == 0].astype(np.float32).any()  # no key: 0
    if mode is None:
        assert got_qk is None
        return
    # NaN where the spec has NaN (modes 0 and 1 read every key); assert_close matches NaN places.
    assert_close(np.asarray(got_qk).astype(np.float32), np.asarray(want_qk).astype(np.float32), tol,
                 err_msg=f"qk mode {mode}")


# --- determinism and command buffers -----------------------------------------------------------

def test_bitwise_repeatable():
    rng = np.random.default_rng(9)
    q = rng.standard_normal((2, 32, 4, 72)).astype(np.float32)
    k = rng.standard_normal((2, 4, 2048, 72)).astype(np.float32)
    v = rng.standard_normal((2, 4, 2048, 100)).astype(BF16)
    lens = np.array([2048, 1300], np.int32)
    f = jax.jit(functools.partial(cuda.general_attention, scale=0.1, causal=True, left=500,
                                  qk_mode=3, softmax_dtype=jnp.float16))
    first = [np.asarray(x) for x in f(q, k, v, lens)]
    for _ in range(4):
        again = [np.asarray(x) for x in f(q, k, v, lens)]
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)
    # The op end to end: past concatenated, general kernel, qk.
    g = jax.jit(lambda *a: ops.attention(*a, is_causal=1, return_qk=True, qk_matmul_output_mode=2,
                                         backend="cuda"))
    args = (q, k[:, :, :4], k[:, :, :4], None, k, k)
    first = [np.asarray(x) for x in g(*args)]
    for _ in range(3):
        for a, b in zip(first, [np.asarray(x) for x in g(*args)]):
            np.testing.assert_array_equal(a, b)


# A decode loop of 16 dependent general-kernel calls (f32 Q / K, bf16 V, qk mode 3, f16 softmax),
# kv_len advancing on the device, run in a fresh process so XLA_FLAGS apply.
_LOOP = textwrap.dedent("""
    import functools, jax, jax.numpy as jnp, numpy as np
    from jax_onnx_attn.ops import cuda

    attn = functools.partial(cuda.general_attention, scale=0.1, causal=True, qk_mode=3,
                             softmax_dtype=jnp.float16)
    def steps(q, k, v, lens):
        def body(i, carry):
            q, lens, total = carry
            y, qk = attn(q, k, v, lens)
            return y, lens + 1, total + qk.astype(jnp.float32)
        zero = jnp.zeros(q.shape[:3] + (k.shape[2],), jnp.float32)
        return jax.lax.fori_loop(0, 16, body, (q, lens, zero))

    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.standard_normal((2, 8, 2, 72)), jnp.float32)
    k = jnp.asarray(rng.standard_normal((2, 2, 512, 72)), jnp.float32)
    v = jnp.asarray(rng.standard_normal((2, 2, 512, 72)), jnp.bfloat16)
    lens = jnp.array([100, 300], jnp.int32)
    f = jax.jit(steps)
    hlo = f.lower(q, k, v, lens).compile().as_text()
    names = [l.split("=")[0].strip().lstrip("%") for l in hlo.splitlines()
             if 'custom_call_target="jax_onnx_attn_general_attention"' in l]
    print("CUSTOM_CALL_NAMES", *names)
    got = f(q, k, v, lens)
    got2 = f(q, k, v, lens)  # replay
    want, l2, total = q, lens, jnp.zeros_like(got[2])
    for i in range(16):
        want, qk = attn(want, k, v, l2)
        l2, total = l2 + 1, total + qk.astype(jnp.float32)
    for a, b, c in zip(got, got2, (want, l2, total)):
        assert np.array_equal(np.asarray(a), np.asarray(b))
        assert np.array_equal(np.asarray(a), np.asarray(c))
    print("LOOP_OK")
""")


def test_general_kernel_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "general_attention", tmp_path)
