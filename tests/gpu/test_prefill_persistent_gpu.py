"""The prefill engine's persistent kernels (ffi/kernels/prefill/engine.cuh RunPersistent: one CTA an
SM looping over the tiles, two Q buffers, the K / V ring running on across tiles) against the
one-tile-a-CTA kernels, bit for bit (each tile's arithmetic is theirs), and both against the spec,
`jax_onnx_attn.ops.reference.prefill.prefill_attention`.

Causal / non-causal, ragged q_len / kv_len (0 included: tiles whose rows see no key still take
their turn on the Q buffers), lengths past the buffers, windows, softcap, sinks, head sizes 64 / 80 /
96 / 128 (persistent) and 256 (the launch runs it one tile a CTA: its tiling cannot hold two Q
tiles), f16 / bf16, GQA 32 / 8 and 8 / 8; more tiles than the 132 SMs (each CTA several tiles: both
Q buffers and the ring's phases wrap) and fewer; several L2 sections of heads (params.h
PersistentSectionHeads), the last narrower; the default tunes (D 128 pingpong-fold-lazy and its
plain fallback at scale <= 0, D 64's pingpong-fold-lazy-m192-s4 and the 128-row pingpong it falls
back to with sinks); a named schedule (not persistent: the same bits); the switch
JOA_PREFILL_PERSISTENT; a loop of persistent calls inside an XLA command buffer. Split-KV stays one
tile a CTA: every call here pins splits=1 so the persistent kernel runs. Tolerances:
jax_onnx_attn.testing.

Needs an sm_90 GPU (H100 / H200): elsewhere the engine refuses to launch and these tests skip.
"""

import jax
import ml_dtypes
import numpy as np
import pytest

from jax_onnx_attn.ops import cuda
from jax_onnx_attn.ops.reference import prefill as prefill_reference
from jax_onnx_attn.testing import assert_close

import command_buffer
from prefill_cases import engine_inputs as _inputs, needs_sm90

pytestmark = pytest.mark.gpu

BF16 = ml_dtypes.bfloat16

_reference = jax.jit(prefill_reference.prefill_attention,
                     static_argnames=("scale", "causal", "softcap", "left", "right"))
_engine = jax.jit(cuda.prefill_attention,
                  static_argnames=("scale", "causal", "softcap", "left", "right", "schedule", "splits",
                                   "persistent"))


def _check(q, k, v, q_len, kv_len, sink=None, *, causal, scale=None, **variant):
    """The persistent engine bitwise equal to the one-tile engine, both against the spec (splits=1:
    split-KV kernels are never persistent). variant: the spec's other keywords and the engine's
    schedule. Returns the persistent output."""
    scale = float(scale if scale is not None else q.shape[-1] ** -0.5)
    spec_kw = {k_: v_ for k_, v_ in variant.items() if k_ != "schedule"}
    want = _reference(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, **spec_kw)
    got = {on: np.asarray(_engine(q, k, v, q_len, kv_len, sink, scale=scale, causal=causal, splits=1,
                                  persistent=on, **variant))
           for on in (False, True)}
    for on, y in got.items():
        assert y.shape == q.shape and y.dtype == q.dtype
        assert_close(y, want, q.dtype, err_msg=f"persistent={on}")
    assert np.array_equal(got[False], got[True], equal_nan=True), "persistent changed the bits"
    return got[True]


def _tiles(b, hq, hkv, s, d):
    """The (batch row, KV head, row block) tiles of a call at the head size's default tiling."""
    block_m = 192 if d == 64 else 128  # D 64's default is the 192-row m192 tiling
    return b * hkv * -(-(hq // hkv) * s // block_m)


# Many tiles (B 4 x Hkv 8 x 22 row blocks at 128 rows: 704, ~5 a CTA) with ragged rows: full, short,
# q_len 0 (no rows), kv_len 0 (no keys); and few (B 2 x 8 x 2 = 32 tiles, fewer than the SMs).
_MANY = dict(b=4, hq=32, hkv=8, s=700, t=700, q_len=[700, 333, 0, 700], kv_len=[700, 500, 700, 0])
_FEW = dict(b=2, hq=8, hkv=8, s=200, t=260, q_len=[200, 150], kv_len=[260, 151])


# Each head size once in each dtype at 64 / 128, once elsewhere.
_DIM_DTYPES = [(64, np.float16), (64, BF16), (80, np.float16), (96, BF16), (128, np.float16), (128, BF16),
               (256, BF16)]


@needs_sm90
@pytest.mark.parametrize("shape", ["many", "few"])
@pytest.mark.parametrize("d,dtype", _DIM_DTYPES,
                         ids=[f"d{d}-{'f16' if t is np.float16 else 'bf16'}" for d, t in _DIM_DTYPES])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_values(causal, d, dtype, shape):
    c = dict(_MANY if shape == "many" else _FEW)
    tiles = _tiles(c["b"], c["hq"], c["hkv"], c["s"], d)
    assert (tiles > 132) if shape == "many" else (tiles < 132)
    args = _inputs(d + len(shape), c["b"], c["hq"], c["hkv"], c["s"], c["t"], d, dtype, c["q_len"], c["kv_len"])
    got = _check(*args, causal=causal).astype(np.float32)
    if shape == "many":  # no query rows, no keys: zeros
        assert not got[2].any() and not got[3].any()


@needs_sm90
@pytest.mark.parametrize("d", [64, 128], ids=["d64", "d128"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_length_edge_cases(causal, d):
    """q_len 0, kv_len 0, q_len > kv_len (causal: early rows see nothing), lengths past the buffers
    (clamped) and negative (0): tiles without keys among tiles with."""
    q_len = [0, 150, 200, 999, -4, 200]
    kv_len = [300, 0, 90, 5000, 300, -1]
    args = _inputs(7 + d, 6, 32, 8, 200, 300, d, BF16, q_len, kv_len)
    got = _check(*args, causal=causal).astype(np.float32)
    assert not got[0].any() and not got[1].any() and not got[4].any() and not got[5].any()


@needs_sm90
@pytest.mark.parametrize("causal,left,right", [(True, 0, -1), (True, 100, -1), (False, 40, 0),
                                               (False, 200, 300), (False, -1, 5)], ids=lambda x: str(x))
@pytest.mark.parametrize("d", [64, 96, 128], ids=["d64", "d96", "d128"])
def test_local_windows(d, causal, left, right):
    """Windows skip whole key tiles: tiles of very different lengths (and none) in one CTA's loop."""
    args = _inputs(d + left + right, 3, 32, 8, 600, 900, d, np.float16, [600, 587, 300], [900, 895, 400])
    _check(*args, causal=causal, left=left, right=right)


def _sinks(hq, seed):
    fixed = np.array([-1e4, 0.0, 1e4, -30.0], np.float32)
    rng = np.random.default_rng(seed)
    return np.concatenate([fixed, rng.uniform(-4, 8, hq - 4).astype(np.float32)])[:hq]


@needs_sm90
@pytest.mark.parametrize("d", [64, 80, 128, 256], ids=["d64", "d80", "d128", "d256"])
@pytest.mark.parametrize("causal,left", [(True, -1), (False, -1), (True, 300)], ids=lambda x: str(x))
def test_sinks(causal, left, d):
    """The sink kernels (D 64: the 128-row pingpong, not the m192 tune)."""
    args = _inputs(d + 3, 4, 32, 8, 500, 500, d, BF16, [500, 480, 0, 500], [500, 490, 500, 0])
    _check(*args, _sinks(32, d), causal=causal, left=left)


@needs_sm90
@pytest.mark.parametrize("d", [64, 96, 128], ids=["d64", "d96", "d128"])
@pytest.mark.parametrize("causal,softcap,left,sinks", [(True, 30.0, -1, False), (False, 5.0, 150, True)],
                         ids=lambda x: str(x))
def test_softcap(d, causal, softcap, left, sinks):
    args = _inputs(int(softcap) + left + d, 3, 32, 8, 400, 600, d, BF16, [400, 390, 100], [600, 500, 120])
    _check(*args, _sinks(32, 3) if sinks else None, causal=causal, softcap=softcap, left=left)


@needs_sm90
@pytest.mark.parametrize("group", [4, 1], ids=["gqa32-8", "mha8-8"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_tiles_crossing_heads(causal, group):
    """S not a multiple of the row tile: tiles span two query heads; the last key tile reads past T."""
    args = _inputs(11 + group, 3, 8 * group, 8, 45, 45, 128, np.float16, [45, 30, 45], [45, 40, 3])
    _check(*args, causal=causal)


@needs_sm90
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_l2_sections(causal):
    """K / V of 4 MB a head (T 8192, D 128, bf16): 8 heads a section, 12 heads make two sections,
    the last of 4. A chunk of 200 queries at the bottom right of the keys."""
    b, hq, hkv, s, t, d = 3, 16, 4, 200, 8192, 128
    args = _inputs(5, b, hq, hkv, s, t, d, BF16, [200, 77, 200], [8192, 6000, 200])
    _check(*args, causal=causal)


@needs_sm90
def test_default_tunes_and_their_fallbacks():
    """D 128's default pingpong-fold-lazy and its plain pingpong kernel (scale <= 0: no fold); D 64's
    pingpong-fold-lazy-m192-s4 (192-row tiles, three consumer warpgroups) and its fallback."""
    for d in (128, 64):
        args = _inputs(13 + d, 4, 32, 8, 700, 700, d, BF16, [700, 333, 0, 700], [700, 500, 700, 0])
        _check(*args, causal=True)
        _check(*args, causal=True, scale=-0.05)
        _check(*args, causal=False, scale=0.0)


@needs_sm90
def test_a_named_schedule_ignores_the_switch():
    """Only the default schedule has persistent kernels: a named one runs one tile a CTA."""
    args = _inputs(17, 2, 32, 8, 300, 300, 128, np.float16, [300, 211], [300, 250])
    for name in ("serial", "pingpong"):
        _check(*args, causal=True, schedule=name)


@needs_sm90
def test_repeatable_and_the_switch(monkeypatch):
    """Bitwise repeatable, and JOA_PREFILL_PERSISTENT read at trace time gives the same bits."""
    args = _inputs(19, 4, 32, 8, 700, 700, 128, BF16, [700, 333, 0, 700], [700, 500, 700, 0])
    first = np.asarray(_engine(*args, scale=0.1, causal=True, splits=1, persistent=True))
    for _ in range(3):
        again = np.asarray(_engine(*args, scale=0.1, causal=True, splits=1, persistent=True))
        assert np.array_equal(first, again, equal_nan=True)
    for value in ("0", "1"):
        monkeypatch.setenv(cuda.PREFILL_PERSISTENT_ENV, value)
        fresh = jax.jit(lambda *a: cuda.prefill_attention(*a, scale=0.1, causal=True, splits=1))
        assert np.array_equal(first, np.asarray(fresh(*args)), equal_nan=True), value


# A loop of persistent prefill calls (each query the previous output) under jit: XLA captures the
# custom call into a command buffer and replays it. Runs in a fresh process so XLA_FLAGS apply.
_LOOP = command_buffer.prefill_loop("scale=0.1, causal=True, splits=1, persistent=True", 512, 640, (512, 300),
                                    (640, 500))


@needs_sm90
def test_persistent_loop_in_a_command_buffer(tmp_path):
    command_buffer.assert_captured(_LOOP, "prefill_attention", tmp_path)
