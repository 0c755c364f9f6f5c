"""The record layout of 4-bit MatMulNBits weights (ops.to_record_layout, the input of the slots
kernel's record reader: ffi/kernels/gemv/slots.cuh's RecordFormat) on the CPU: the transform and its
inverse; what each lane reads out of a record (the kernel's pointer walk emulated in NumPy) equal to
what the slots kernel's loads read from the wide format with tiled metadata (so the same sums, the
same bits) and dequantising to the reference's weights; the reference through the layout equal to
the ONNX layout's; trace-time refusals naming the input; the plan (plan.h's MakeRecordPlan); a
lowered model in the layout and the session's switch."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_onnx_attn
from jax_onnx_attn import ops
from jax_onnx_attn._extension import _ffi
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import (RECORD_BYTES, RECORD_K, RECORD_ROWS, RECORD_W_BYTES,
                                      interleave_gate_up_nbits)

from nbits_cases import fusion_operands
from nbits_cases import nbits_weights as _nbits

needs_ext = pytest.mark.skipif(_ffi is None, reason="needs the compiled extension (plan.h)")
FUSIONS = ["plain", "bias", "residual", "norm", "gated", "all"]


def _dequant(b_quant, scales, zeros):
    """W [N, K] in f64, (q - zp) * scale, as the reference dequantises (ONNX nibble order)."""
    n, kb, blob = b_quant.shape
    q = np.stack([b_quant & 15, b_quant >> 4], -1).reshape(n, kb, 2 * blob).astype(np.float64)
    zp = 8.0 if zeros is None else zeros[..., None].astype(np.float64)
    return ((q - zp) * scales.astype(np.float64)[..., None]).reshape(n, -1)


@pytest.mark.parametrize("n,k,block", [(16, 256, 32), (48, 512, 64), (32, 768, 128), (16, 1024, 512)])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", [np.float16, jnp.bfloat16], ids=["f16", "bf16"])
def test_record_layout_round_trip(n, k, block, zp, dtype):
    b_quant, scales, zeros = _nbits(n, k, block, zp, dtype=jnp.dtype(dtype))
    rec = ops.to_record_layout(b_quant, scales, zeros)
    assert rec.shape == (n // RECORD_ROWS, k // RECORD_K, RECORD_BYTES) and rec.dtype == np.uint8
    for xp in (np, jnp):
        back = ops.from_record_layout(xp.asarray(rec), n=n, block_size=block, dtype=scales.dtype)
        np.testing.assert_array_equal(np.asarray(back[0]), b_quant)
        assert back[1].dtype == scales.dtype
        np.testing.assert_array_equal(np.asarray(back[1]).view(np.uint16), scales.view(np.uint16))
        want_z = np.full(scales.shape, 8, np.uint8) if zeros is None else zeros
        np.testing.assert_array_equal(np.asarray(back[2]), want_z)
    # Traceable: the reference unpacks it under jit.
    jitted = jax.jit(lambda r: ops.from_record_layout(r, n=n, block_size=block, dtype=scales.dtype))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(rec))[0]), b_quant)


def _slots_loads(b_quant, scales_t, zeros_t, block, tile, c, lane):
    """What SlotFormat::Load (slots.cuh) reads for lane (g, t) of `tile`, chunk c from the wide format
    (W rows of K / 2 bytes) and the tiled metadata ([tiles, k_blocks, 16]): W bytes [h][piece] (16
    each), scale bits [h][e], zero points [h][e] (8 without)."""
    n, kb, blob = b_quant.shape
    rows = b_quant.reshape(n, kb * blob)
    g, t = lane // 4, lane % 4
    w = [[rows[tile * 16 + g + 8 * h, 128 * c + 16 * t + 64 * pc:][:16] for pc in range(2)] for h in range(2)]
    slot_k = [32 * (s % 4) + 128 * (s // 4) for s in (2 * t, 2 * t + 1)]
    blocks = [(c * 256 + sk) // block for sk in slot_k]
    scale = [[int(scales_t.view(np.uint16)[tile, b, g + 8 * h]) for b in blocks] for h in range(2)]
    zero = [[8 if zeros_t is None else int(zeros_t[tile, b, g + 8 * h]) for b in blocks] for h in range(2)]
    return w, scale, zero


class _RecordWalk:
    """RecordFormat's loads (slots.cuh) on the record bytes as one flat buffer: Enter sets the lane's
    cursor at its tile's first chunk, Next reads a chunk and advances it one record."""

    def __init__(self, rec):
        self.flat = rec.reshape(-1)
        self.kc = rec.shape[1]

    def enter(self, tile, c_begin, lane):
        return (tile * self.kc + c_begin) * RECORD_BYTES + 16 * lane

    def next(self, cursor, lane):
        f = self.flat
        w = [[f[cursor + 512 * (2 * h + pc):][:16] for pc in range(2)] for h in range(2)]
        meta = cursor + RECORD_W_BYTES - 12 * lane  # metadata word 0 of this lane

        def word(m):
            return int(f[meta + 128 * m:][:4].view("<u4")[0])

        scale = [[(word(h) >> (16 * e)) & 0xFFFF for e in range(2)] for h in range(2)]
        zero = [[(word(2) >> (8 * (2 * h + e))) & 0xFF for e in range(2)] for h in range(2)]
        return (w, scale, zero), cursor + RECORD_BYTES


@pytest.mark.parametrize("block", [32, 64, 128, 512])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_record_reads_what_the_slots_kernel_reads_and_dequantises_to_the_reference(block, zp):
    # Every lane of every warp, walking its chunk range as the kernel does (warp w of a CTA takes
    # chunks [w cpp, (w + 1) cpp) of each tile), reads from the record exactly what the slots kernel
    # reads from the wide format and the tiled metadata: the same operands in the same order, so the
    # same bits. And the values it reads dequantise to the reference's W.
    n, k = 48, 1024
    b_quant, scales, zeros = _nbits(n, k, block, zp, seed=7)
    rec = ops.to_record_layout(b_quant, scales, zeros)
    scales_t = ops.tile_nbits_meta(scales)
    zeros_t = None if zeros is None else ops.tile_nbits_meta(zeros)
    walk = _RecordWalk(rec)
    kc = k // RECORD_K
    cpp = -(-kc // 8)
    w_hat = np.full((n, k), np.nan)
    for tile in range(n // 16):
        for warp in range(8):
            c_begin = warp * cpp
            for lane in range(32):
                g, t = lane // 4, lane % 4
                cursor = None
                for j in range(cpp):
                    c = c_begin + j
                    if c >= kc:
                        break
                    if j == 0:
                        cursor = walk.enter(tile, c_begin, lane)
                    got, cursor = walk.next(cursor, lane)
                    want = _slots_loads(b_quant, scales_t, zeros_t, block, tile, c, lane)
                    for h in range(2):
                        for pc in range(2):
                            np.testing.assert_array_equal(got[0][h][pc], want[0][h][pc])
                    assert got[1:] == want[1:], (tile, c, lane)
                    # The lane's pieces (row g + 8 h, slot s = 4 pc + t) dequantised with the scale
                    # and zero point of slot s: held by lane (g, s // 2) as its e = s % 2.
                    for h in range(2):
                        for pc in range(2):
                            s = 4 * pc + t
                            owner = walk.next(walk.enter(tile, c, 4 * g + s // 2), 4 * g + s // 2)[0]
                            sc = np.array([owner[1][h][s % 2]], np.uint16).view(scales.dtype)[0]
                            zpv = owner[2][h][s % 2]
                            piece = got[0][h][pc]
                            q = np.stack([piece & 15, piece >> 4], -1).reshape(-1).astype(np.float64)
                            k0 = 256 * c + 32 * t + 128 * pc
                            w_hat[tile * 16 + g + 8 * h, k0:k0 + 32] = (q - zpv) * np.float64(sc)
    np.testing.assert_array_equal(w_hat, _dequant(b_quant, scales, zeros))


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_reference_through_the_record_layout_equals_the_onnx_layout(fusion, zp, block, dtype):
    gated = fusion in ("gated", "all")
    k, n = 512, 96
    np_dt = jnp.dtype(dtype)
    if gated:
        halves = [_nbits(n // 2, k, block, zp, seed=s, dtype=np_dt) for s in (1, 2)]
        b_quant, scales, zeros = interleave_gate_up_nbits(*halves)
    else:
        b_quant, scales, zeros = _nbits(n, k, block, zp, dtype=np_dt)
    rec = ops.to_record_layout(b_quant, scales, zeros)
    rng = np.random.default_rng(5)
    for m in (1, 2, 33):  # M > 1: no record kernel (prefill), the reference in both
        x = jnp.asarray(rng.normal(size=(m, k)), dtype)
        static, arrays = fusion_operands(fusion, k, n, m, dtype, seed=6)
        kw = dict(k=k, n=n, bits=4, block_size=block, backend="reference", **static, **arrays)
        want = ops.matmul_nbits(x, b_quant, scales, zeros, **kw)
        got = ops.matmul_nbits(x, rec, None, layout="record", **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        auto = ops.matmul_nbits(x, rec, None, layout="record", **{**kw, "backend": "auto"})
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(want))


def test_record_layout_refusals_name_the_input():
    n, k, block = 32, 256, 32
    b_quant, scales, zeros = _nbits(n, k, block, True)
    rec = ops.to_record_layout(b_quant, scales, zeros)
    x = jnp.ones((1, k), jnp.float16)
    kw = dict(k=k, n=n, bits=4, block_size=block, layout="record")
    with pytest.raises(ValueError, match="b_quant in the record layout"):
        ops.matmul_nbits(x, b_quant, None, **kw)
    with pytest.raises(ValueError, match="b_quant in the record layout"):
        ops.matmul_nbits(x, rec[:1], None, **kw)
    with pytest.raises(ValueError, match="scales=None"):
        ops.matmul_nbits(x, rec, scales, **kw)
    with pytest.raises(ValueError, match="scales=None"):
        ops.matmul_nbits(x, rec, None, zeros, **kw)
    with pytest.raises(NotImplementedError, match="4-bit"):
        ops.matmul_nbits(x, rec, None, **{**kw, "bits": 8})
    with pytest.raises(ValueError, match="block_size >= 32"):
        ops.matmul_nbits(x, rec, None, **{**kw, "block_size": 16})
    with pytest.raises(ValueError, match="K a multiple of 256"):
        ops.matmul_nbits(jnp.ones((1, 128), jnp.float16), rec, None, **{**kw, "k": 128})
    with pytest.raises(ValueError, match="N of 16"):
        ops.matmul_nbits(x, rec, None, **{**kw, "n": 24})
    with pytest.raises(ValueError, match="bias must have shape"):
        ops.matmul_nbits(x, rec, None, bias=jnp.ones((n + 1,), jnp.float16), **kw)
    # The transform refuses what the layout cannot hold (the fusion keeps such weights "onnx").
    with pytest.raises(NotImplementedError, match="K=128 must be a multiple of 256"):
        ops.to_record_layout(*_nbits(n, 128, 32, False))
    with pytest.raises(NotImplementedError, match="N=24"):
        ops.to_record_layout(*_nbits(24, 256, 32, False))
    with pytest.raises(NotImplementedError, match="block_size=16"):
        ops.to_record_layout(*_nbits(n, 256, 16, False))
    with pytest.raises(ValueError, match="scales must be float16 / bfloat16"):
        ops.to_record_layout(b_quant, scales.astype(np.float32), zeros)
    with pytest.raises(ValueError, match="zero_points must be uint8"):
        ops.to_record_layout(b_quant, scales, zeros + 16)


@needs_ext
def test_record_constants_agree_with_the_kernel():
    gemv = _ffi.limits()["gemv"]
    assert (gemv["record_rows"], gemv["record_k"], gemv["record_w_bytes"], gemv["record_bytes"]) == (
        RECORD_ROWS, RECORD_K, RECORD_W_BYTES, RECORD_BYTES)


SHAPES_1B_8B = [(2048, 2048, False, False), (2048, 3072, False, True), (2048, 16384, True, True),
                (8192, 2048, False, False), (2048, 128256, False, True), (4096, 4096, False, False),
                (4096, 6144, False, True), (4096, 28672, True, True), (14336, 4096, False, False),
                (4096, 128256, False, True)]


@needs_ext
@pytest.mark.parametrize("block", [32, 128])
def test_record_plan_is_the_slots_plan(block):
    # The record reader runs the slots kernel's geometry: the same plan, hence the same sums.
    for k, n, gated, norm in SHAPES_1B_8B:
        slots = cuda_matmul.gemv_plan(1, n, k, 4, gated, norm, wide=True, block_size=block, slots=True)
        rec = cuda_matmul.gemv_plan(1, n, k, 4, gated, norm, block_size=block, record_layout=True)
        assert slots["slots"] and rec["slots"] and rec["record_layout"] and not slots["record_layout"]
        assert {**rec, "record_layout": False} == slots, (k, n)


@needs_ext
def test_record_plan_refusals():
    why = cuda_matmul.record_unsupported
    assert why(1, 4096, 4096, 32, False) is None
    assert "one row" in why(2, 4096, 4096, 32, False)
    assert "multiple of 16" in why(1, 4104, 4096, 32, False)
    assert "multiple of 256" in why(1, 4096, 4224, 128, False)
    assert "power of two >= 32" in why(1, 4096, 4096, 16, False)
    assert "power of two >= 32" in why(1, 4096, 4096, 96, False)
    assert "4-bit" in cuda_matmul.gemv_plan(1, 4096, 4096, 8, False, block_size=32,
                                            record_layout=True)["error"]


def test_record_switch(monkeypatch):
    from jax_onnx_attn.runtime.session import nbits_layout_for

    from jax_onnx_attn._extension import cuda_usable

    monkeypatch.delenv(cuda_matmul.RECORD_ENV, raising=False)
    assert cuda_matmul.record_layout_enabled() == cuda_usable()  # on where the kernels run
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "0")
    assert not cuda_matmul.record_layout_enabled() and nbits_layout_for(1) == "onnx"
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    assert cuda_matmul.record_layout_enabled()
    assert nbits_layout_for(1) == "record" and nbits_layout_for(1, mesh=object()) == "onnx"
    monkeypatch.setenv(cuda_matmul.ROWS_ENV, "0")
    assert nbits_layout_for(8) == "onnx"  # batch >= 2 is the rows layout's, never the record's
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "2")
    with pytest.raises(ValueError, match="JOA_GEMV_RECORD"):
        cuda_matmul.record_layout_enabled()


def _model(**overrides):
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig

    cfg = dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=256, dtype="float16",
               weight_bits=4, block_size=32)
    return build_decoder(DecoderConfig(**{**cfg, **overrides}))


def _decoder_feeds(lowered, s, rng, past=3):
    """One row of s new tokens after `past` cached ones (random cache)."""
    feeds = {}
    kv_shapes = lowered.fixed_cache_step(1, past + s).cache_shapes  # (Hkv, D) of each past input
    for name, (dims, dtype) in lowered.input_info().items():
        if name == "input_ids":
            feeds[name] = rng.integers(0, 200, (1, s)).astype(np.int64)
        elif name == "attention_mask":
            feeds[name] = np.ones((1, past + s), np.int64)
        elif name == "position_ids":
            feeds[name] = np.arange(past, past + s)[None].astype(np.int64)
        else:  # past key / value [B, Hkv, P, D]
            (_, hkv, _, d), _ = kv_shapes[name]
            feeds[name] = rng.standard_normal((1, hkv, past, d)).astype(dtype)
    return feeds


@needs_ext
@pytest.mark.parametrize("dtype, block, zp", [("float16", 32, False), ("bfloat16", 128, True)])
def test_load_in_the_record_layout_keeps_the_logits(dtype, block, zp, monkeypatch):
    # nbits_layout="record": every 4-bit projection of a model whose shapes fit (K % 256, N % 16)
    # holds W, scales and zero points in one record array (attribute layout="record"); the reference
    # through it gives the "onnx" layout's logits bit for bit, at a decode step (one row) and a
    # prompt (several). A session of batch 1 loads it under JOA_GEMV_RECORD=1 and generates the
    # same tokens.
    from jax_onnx_attn.runtime import DecoderSession

    model = _model(dtype=dtype, block_size=block, zero_points=zp)
    onnx_layout = jax_onnx_attn.load(model)
    record = jax_onnx_attn.load(model, nbits_layout="record")
    linears = [n for n in record.model.graph.node if n.op_type == "Linear"]
    moved = [n for n in linears if any(a.name == "layout" and a.s == b"record" for a in n.attribute)]
    assert len(moved) == len(linears) == 9  # 4 a layer and the LM head
    for n in moved:
        assert record.params[n.input[1]].shape[-1] == RECORD_BYTES
        assert not any(n.input[2:4])  # scales / zero points live in the records
    rng = np.random.default_rng(3)
    for s in (1, 5):
        feeds = _decoder_feeds(onnx_layout, s, rng)
        got, want = record.apply(record.params, feeds), onnx_layout.apply(onnx_layout.params, feeds)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel
    plan = plan_tensor_parallel(record, 2)
    assert all("record layout" in why for why in plan.whole.values())

    prompts = [[1, 2, 3, 4, 5]]
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "0")
    plain = DecoderSession(model, max_length=16, batch=1).generate(prompts, max_new_tokens=6)
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    session = DecoderSession(model, max_length=16, batch=1)
    assert any(a.s == b"record" for n in session.lowered.model.graph.node for a in n.attribute
               if a.name == "layout")
    assert session.generate(prompts, max_new_tokens=6).tokens == plain.tokens


@needs_ext
def test_load_in_the_record_layout_keeps_unfit_shapes_in_the_onnx_layout():
    # hidden 64: no K is a multiple of 256, every projection stays "onnx" (decided at load).
    model = _model(hidden=64, heads=4, kv_heads=2, intermediate=128)
    record = jax_onnx_attn.load(model, nbits_layout="record")
    assert not any(a.name == "layout" for n in record.model.graph.node for a in n.attribute)
    # load(dtype=...) casts floats after the fusion: the records hold the cast scales.
    model = _model(dtype="float32")
    cast = jax_onnx_attn.load(model, dtype="bfloat16", nbits_layout="record")
    plain = jax_onnx_attn.load(model, dtype="bfloat16")
    assert any(a.s == b"record" for n in cast.model.graph.node for a in n.attribute if a.name == "layout")
    feeds = _decoder_feeds(plain, 2, np.random.default_rng(0))
    got, want = cast.apply(cast.params, feeds), plain.apply(plain.params, feeds)
    for name in want:
        np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)
