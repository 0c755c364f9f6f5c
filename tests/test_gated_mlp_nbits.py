"""The fused gated MLP on 4-bit weights (ops.gated_mlp_nbits; ffi/kernels/gemv/mlp_nbits.cuh) on the
CPU: the down projection's slice-record layout and its inverse; the kernel's algorithm emulated in
NumPy at the level of its loads, MMA fragments and f32 fix-ups (the slice records read at the
addresses its cursor walks, every lane's registers through an m16n8k16 emulator, the warps' record
ranges and shared-memory slots of the gate / up phase, the staged h slice and its per-piece sums,
the CTAs' partials) against the exact product and the reference op; the grid rule; trace-time
refusals naming the input; the ONNX fusion (pass 6b) and the session's switch."""

from __future__ import annotations

import numpy as np
import pytest
import jax
import jax.numpy as jnp
import ml_dtypes

import jax_onnx_attn
from jax_onnx_attn import ops
from jax_onnx_attn._extension import _ffi
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import RECORD_BYTES, RECORD_K, SLICE_BYTES, SLICE_K, SLICE_W_BYTES
from jax_onnx_attn.testing import tolerance

from nbits_cases import nbits_weights as _nbits

needs_ext = pytest.mark.skipif(_ffi is None, reason="needs the compiled extension (mlp_nbits.h)")
DTYPES = {"f16": np.float16, "bf16": ml_dtypes.bfloat16}


@pytest.mark.parametrize("n,k,block", [(16, 64, 32), (48, 512, 64), (32, 256, 128), (16, 1024, 512)])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
def test_slice_record_layout_round_trip(n, k, block, zp, dtype):
    if k % block:
        pytest.skip("K must hold whole blocks")
    b_quant, scales, zeros = _nbits(n, k, block, zp, dtype=DTYPES[dtype])
    rec = ops.to_slice_record_layout(b_quant, scales, zeros)
    assert rec.shape == (n // 16, k // SLICE_K, SLICE_BYTES) and rec.dtype == np.uint8
    for xp in (np, jnp):
        back = ops.from_slice_record_layout(xp.asarray(rec), n=n, block_size=block, dtype=scales.dtype)
        np.testing.assert_array_equal(np.asarray(back[0]), b_quant)
        assert back[1].dtype == scales.dtype
        np.testing.assert_array_equal(np.asarray(back[1]).view(np.uint16), scales.view(np.uint16))
        np.testing.assert_array_equal(np.asarray(back[2]), np.full(scales.shape, 8, np.uint8) if zeros is None
                                      else zeros)
    jitted = jax.jit(lambda r: ops.from_slice_record_layout(r, n=n, block_size=block, dtype=scales.dtype))
    np.testing.assert_array_equal(np.asarray(jitted(jnp.asarray(rec))[0]), b_quant)


def test_slice_record_layout_refusals():
    b_quant, scales, zeros = _nbits(16, 128, 32, True)
    with pytest.raises(NotImplementedError, match="block_size=16"):
        ops.to_slice_record_layout(*_nbits(16, 128, 16, False))
    with pytest.raises(NotImplementedError, match="K=96"):
        ops.to_slice_record_layout(*_nbits(16, 96, 32, False))
    with pytest.raises(NotImplementedError, match="N=8"):
        ops.to_slice_record_layout(*_nbits(8, 128, 32, False))
    with pytest.raises(ValueError, match="scales must be float16 / bfloat16"):
        ops.to_slice_record_layout(b_quant, scales.astype(np.float32), zeros)
    with pytest.raises(ValueError, match="zero_points must be uint8"):
        ops.to_slice_record_layout(b_quant, scales, zeros + 16)


@needs_ext
def test_slice_constants_and_grid_agree_with_the_kernel():
    gemv = _ffi.limits()["gemv"]
    assert (gemv["slice_k"], gemv["slice_w_bytes"], gemv["slice_bytes"]) == (SLICE_K, SLICE_W_BYTES, SLICE_BYTES)
    assert (gemv["record_k"], gemv["record_bytes"]) == (RECORD_K, RECORD_BYTES)
    # The ~1B and ~8B Llama MLPs on 132 SMs: T = I / 8 / G gate-up tiles a CTA, a multiple of 8.
    assert _ffi.gated_mlp_nbits_grid(2048, 8192, 132) == 128
    assert _ffi.gated_mlp_nbits_grid(4096, 14336, 132) == 112
    for h, inter, sms in ((2048, 8192, 132), (4096, 14336, 132), (3584, 18944, 132), (256, 512, 132)):
        g = _ffi.gated_mlp_nbits_grid(h, inter, sms)
        assert 0 < g <= sms and (inter // 8) % g == 0 and (inter // 8 // g) % 8 == 0
        assert _ffi.gated_mlp_nbits_workspace(h, g) == g * h
    assert _ffi.gated_mlp_nbits_grid(896, 4864, 132) == 0   # H not a multiple of 256 (whole records)
    assert _ffi.gated_mlp_nbits_grid(256, 96, 132) == 0     # I not a multiple of 64
    assert _ffi.gated_mlp_nbits_grid(256, 8, 132) == 0
    # The final reduction takes at most one thread a row of y: 1024 rows on one CTA of 512 threads
    # is not a geometry (the dense K split has the same rule).
    assert _ffi.gated_mlp_nbits_grid(1024, 512, 1) == 0 and _ffi.gated_mlp_nbits_grid(1024, 512, 2) == 2
    assert _ffi.gated_mlp_grid(1024, 8192, 1, False) == 0


# ---------------------------------------------------------------------------------------------------
# The kernel emulated (mlp_nbits.cuh). kW warps a CTA; values are float64 unless the kernel rounds.

KW = 16  # kMlpNbitsWarps


def _mma(a, b):
    """m16n8k16 on lane fragments: a [32, 4, 2] (regs a0..a3, halves), b [32, 2, 2] -> c [32, 4]."""
    A, B = np.zeros((16, 16)), np.zeros((16, 8))
    for lane in range(32):
        g, t = lane // 4, lane % 4
        for i in range(2):
            A[g, 2 * t + i], A[g + 8, 2 * t + i] = a[lane, 0, i], a[lane, 1, i]
            A[g, 2 * t + 8 + i], A[g + 8, 2 * t + 8 + i] = a[lane, 2, i], a[lane, 3, i]
            B[2 * t + i, g], B[2 * t + 8 + i, g] = b[lane, 0, i], b[lane, 1, i]
    C = A @ B
    return np.array([[C[l // 4, 2 * (l % 4)], C[l // 4, 2 * (l % 4) + 1], C[l // 4 + 8, 2 * (l % 4)],
                      C[l // 4 + 8, 2 * (l % 4) + 1]] for l in range(32)])


def _magic(v, half):
    """MagicNibbles<T> of a 32-bit word (nibble i = element i): 4 registers x 2 halves, as values."""
    off, mul = (1024.0, (1, 16, 1, 16)) if half else (128.0, (1, 1, 1, 1))
    return [(off + mul[i] * ((v >> (4 * i)) & 15), off + mul[i] * ((v >> (4 * i + 16)) & 15)) for i in range(4)]


def _stage_unit(x8, half):
    """SlotsStageUnit: (x0, x4, x1, x5, x2, x6, x3, x7), f16 words 1 and 3 at 1/16; (unit, staged sum,
    full sum)."""
    p = [x8[0], x8[4], x8[1], x8[5], x8[2], x8[6], x8[3], x8[7]]
    if half:
        p = [v / 16 if i in (2, 3, 6, 7) else v for i, v in enumerate(p)]
    return p, sum(p), sum(x8)


def _round(v, dtype):
    return np.asarray(v, np.float32).astype(dtype).astype(np.float64)


def _emulate(x, gamma, residual, gu_rec, dn_rec, w_gu, w_dn, grid, dtype, eps=1e-5):
    """The kernel's y [H] (float64 of T values) and, per CTA, its down partials next to the exact
    product of its h slice (for a tight check of the slice records' maps)."""
    half = dtype == np.float16
    off = 1024.0 if half else 128.0
    h_dim, inter = w_dn.shape
    tiles = inter // 8 // grid
    kc = h_dim // RECORD_K
    rt = tiles // 8
    dtiles = h_dim // 16
    xn = x.astype(np.float64)
    if gamma is not None:
        r = 1 / np.sqrt(np.mean(np.square(x.astype(np.float32))) + eps)
        xn = _round(x.astype(np.float32) * np.float32(r) * gamma.astype(np.float32), dtype)
    partials = np.zeros((grid, h_dim))
    exact = np.zeros((grid, h_dim))
    gu_flat, dn_flat = gu_rec.reshape(-1), dn_rec.reshape(-1)
    for c in range(grid):
        # Gate / up: warp w's records [a_begin, a_end) of the CTA's T x kc, flushed into slots.
        ra = tiles * kc
        qa = -(-ra // KW)
        red = np.zeros((tiles, KW, 16))
        covered = np.zeros((tiles, kc), int)
        for w in range(KW):
            a_begin = min(w * qa, ra)
            a_end = min(a_begin + qa, ra)
            ga = (c * ra + a_begin) * RECORD_BYTES
            tot = np.zeros(16)
            for f in range(a_begin, a_end):
                tile, chunk = divmod(f, kc)
                assert ga == ((c * tiles + tile) * kc + chunk) * RECORD_BYTES  # the cursor's record
                ga += RECORD_BYTES
                covered[tile, chunk] += 1
                rows = w_gu[(c * tiles + tile) * 16:][:16, chunk * RECORD_K:][:, :RECORD_K]
                tot += rows @ xn[chunk * RECORD_K:][:RECORD_K]
                if chunk == kc - 1 or f == a_end - 1:
                    red[tile, w] = tot
                    tot = np.zeros(16)
        assert (covered == 1).all()
        # h's slice: tile u's 8 outputs (warps' slots in order), rounded as GatedSiluEpilogue.
        vg, vu = red[:, :, :8].sum(1), red[:, :, 8:].sum(1)
        gr, ur = _round(vg, dtype), _round(vu, dtype)
        hs = _round(np.float32(gr) / (1 + np.exp(-np.float32(gr))) * np.float32(ur), dtype).reshape(-1)
        units, pieces = [], []
        for pc in range(tiles // 2):
            staged = full = 0.0
            for i in range(2):
                u, s, f_ = _stage_unit(hs[8 * (2 * pc + i):][:8], half)
                units.append(u)
                staged, full = staged + s, full + f_
            pieces.append((off * (staged if half else full), full))
        # Down: warp w's tiles w, w + KW, ..., rt slice records each, at the cursor's addresses.
        dn_row = (inter // SLICE_K) * SLICE_BYTES
        for w in range(KW):
            dn = w * dn_row + c * rt * SLICE_BYTES
            d, j = w, 0
            tot = np.zeros((32, 2))
            while d < dtiles:
                assert dn == (d * (inter // SLICE_K) + c * rt + j) * SLICE_BYTES
                # Per word q of the lane's rows g / g + 8: MMA 0 on registers 0, 1 of the magic
                # halves with x's halves 0-3, MMA 1 on registers 2, 3 with halves 4-7.
                a = np.zeros((2, 2, 32, 4, 2))  # [word q][MMA][lane]
                b = np.zeros((2, 2, 32, 2, 2))
                meta = []
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    words = dn_flat[dn + 16 * lane:][:16].view("<u4")
                    m = dn_flat[dn + SLICE_W_BYTES + 8 * (8 * (t & 1) + g):][:8]
                    meta.append((m[0:4].view("<u2"), m[4:6]))
                    for q in range(2):
                        pg, p8 = _magic(int(words[q]), half), _magic(int(words[2 + q]), half)
                        xv = units[8 * j + 2 * t + q] if g == t else [0.0] * 8
                        a[q, 0, lane] = [pg[0], p8[0], pg[1], p8[1]]
                        a[q, 1, lane] = [pg[2], p8[2], pg[3], p8[3]]
                        b[q, 0, lane] = [xv[0:2], xv[2:4]]
                        b[q, 1, lane] = [xv[4:6], xv[6:8]]
                cacc = sum(_mma(a[q, i], b[q, i]) for q in range(2) for i in range(2))
                for lane in range(32):
                    g, t = lane // 4, lane % 4
                    if t >= 2:
                        assert not cacc[lane].any()  # columns 4..7: no lane's piece
                        continue
                    sc, zp = meta[lane]
                    for e2 in range(2):
                        po, px = pieces[4 * j + 2 * t + e2]
                        for hh in range(2):
                            scale = float(np.array([sc[hh]], np.uint16).view(dtype)[0])
                            tot[lane, hh] += scale * (cacc[lane, 2 * hh + e2] - (po + float(zp[hh]) * px))
                dn += SLICE_BYTES
                j += 1
                if j == rt:
                    sums = tot.reshape(8, 4, 2).sum(1)  # the four lanes t of a row
                    partials[c, d * 16:d * 16 + 8] = sums[:, 0]
                    partials[c, d * 16 + 8:d * 16 + 16] = sums[:, 1]
                    j, tot = 0, np.zeros((32, 2))
                    dn += KW * dn_row - rt * SLICE_BYTES
                    d += KW
        cols = slice(8 * c * tiles, 8 * (c + 1) * tiles)
        exact[c] = w_dn[:, cols] @ hs
    y = _round(partials.sum(0), dtype)
    if residual is not None:
        y = _round(y + residual.astype(np.float64), dtype)
    return y, partials, exact


def _dequant(b_quant, scales, zeros):
    n, kb, blob = b_quant.shape
    q = np.stack([b_quant & 15, b_quant >> 4], -1).reshape(n, kb, 2 * blob).astype(np.float64)
    zp = 8.0 if zeros is None else zeros[..., None].astype(np.float64)
    return ((q - zp) * scales.astype(np.float64)[..., None]).reshape(n, -1)


def _mlp_operands(h, inter, block, zp, dtype, seed=0):
    rng = np.random.default_rng(seed)
    gate = _nbits(inter, h, block, zp, seed=seed + 1, dtype=dtype)
    up = _nbits(inter, h, block, zp, seed=seed + 2, dtype=dtype)
    down = _nbits(h, inter, block, zp, seed=seed + 3, dtype=dtype)
    gu = ops.interleave_gate_up_nbits(list(gate), list(up))
    x = rng.standard_normal(h).astype(dtype)
    gamma = (1 + 0.1 * rng.standard_normal(h)).astype(dtype)
    residual = rng.standard_normal(h).astype(dtype)
    return dict(gu=gu, down=down, gu_rec=ops.to_record_layout(*gu), dn_rec=ops.to_slice_record_layout(*down),
                x=x, gamma=gamma, residual=residual)


# (H, I, grid): T = I / 8 / grid gate-up tiles a CTA and rt = T / 8 slice records a down tile:
# (8, 1) with idle warps in the gate / up phase, (16, 2), (32, 4) with ranges across tiles.
EMULATED = [(256, 512, 8), (256, 1024, 8), (512, 1024, 4)]


@pytest.mark.parametrize("h,inter,grid", EMULATED)
@pytest.mark.parametrize("dtype", list(DTYPES), ids=str)
@pytest.mark.parametrize("norm,zp,block", [(True, True, 32), (False, False, 64), (True, True, 128)])
def test_kernel_emulation_gives_the_exact_product_and_the_reference(h, inter, grid, dtype, norm, zp, block):
    # The emulation follows the kernel's loads and fragments; its per-CTA down partials equal the
    # exact product of the CTA's h slice with W_down's columns (to f64 rounding: the slice records,
    # the staged h and the per-piece Off / X fix-up are right), and its y the reference op's (the
    # kernel's f32 sums within the dtype's tolerance). No residual here: y = round(round(down) +
    # residual) turns one ulp of the rounded down projection into a large relative error where the
    # residual cancels it (the GPU tests hold the kernel's residual path to the reference).
    dt = DTYPES[dtype]
    o = _mlp_operands(h, inter, block, zp, dt, seed=h + inter)
    w_gu = _dequant(*o["gu"])
    w_dn = _dequant(*o["down"])
    gamma = o["gamma"] if norm else None
    y, partials, exact = _emulate(o["x"], gamma, None, o["gu_rec"], o["dn_rec"], w_gu, w_dn, grid, dt)
    np.testing.assert_allclose(partials, exact, rtol=1e-9, atol=1e-9 * np.abs(exact).max())
    want = ops.gated_mlp_nbits(jnp.asarray(o["x"][None]), o["gu_rec"], o["dn_rec"], block_size=block,
                               norm_weight=None if gamma is None else jnp.asarray(gamma), norm_epsilon=1e-5,
                               backend="reference")
    # Against the reference's f32 sums: one ulp of an h element (the emulation rounds exact sums,
    # the reference f32 ones) moves y by up to ~ulp(h) |w|, so the bound is the dtype's rtol of y's
    # scale, not of each element.
    want = np.asarray(want)[0].astype(np.float64)
    rtol, _ = tolerance(dt)
    np.testing.assert_allclose(y, want, rtol=rtol, atol=rtol * np.abs(want).max())


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16])
def test_reference_route_equals_the_two_matmul_nbits_calls(dtype):
    # The op's reference is the two calls it replaces, bit for bit (the layouts hold the same
    # values): x rows of 1 and 3, with the norm and the residual.
    h, inter, block = 256, 512, 32
    o = _mlp_operands(h, inter, block, True, jnp.dtype(dtype), seed=5)
    rng = np.random.default_rng(1)
    for rows in (1, 3):
        x = jnp.asarray(rng.standard_normal((rows, h)), dtype)
        res = jnp.asarray(rng.standard_normal((rows, h)), dtype)
        nw = jnp.asarray(o["gamma"])
        got = ops.gated_mlp_nbits(x, o["gu_rec"], o["dn_rec"], block_size=block, residual=res, norm_weight=nw,
                                  norm_epsilon=1e-5)
        hidden = ops.matmul_nbits(x, *o["gu"], k=h, n=2 * inter, bits=4, block_size=block, gated=True,
                                  norm_weight=nw, norm_epsilon=1e-5, backend="reference")
        want = ops.matmul_nbits(hidden, *o["down"], k=inter, n=h, bits=4, block_size=block, residual=res,
                                backend="reference")
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_op_refusals_name_the_input():
    h, inter, block = 256, 512, 32
    o = _mlp_operands(h, inter, block, False, np.float16)
    x = jnp.zeros((1, h), jnp.float16)
    f = ops.gated_mlp_nbits
    with pytest.raises(ValueError, match="block_size must be a power of two >= 32"):
        f(x, o["gu_rec"], o["dn_rec"], block_size=16)
    with pytest.raises(ValueError, match="H=128 must be a multiple of 256"):
        f(jnp.zeros((1, 128), jnp.float16), o["gu_rec"], o["dn_rec"], block_size=block)
    with pytest.raises(ValueError, match="w_gate_up must be uint8"):
        f(x, o["gu_rec"][:, :, :100], o["dn_rec"], block_size=block)
    with pytest.raises(ValueError, match="w_down must be uint8"):
        f(x, o["gu_rec"], o["dn_rec"][:8], block_size=block)
    with pytest.raises(ValueError, match="residual must be"):
        f(x, o["gu_rec"], o["dn_rec"], block_size=block, residual=jnp.zeros((1, 8), jnp.float16))
    with pytest.raises(ValueError, match="norm_weight must have shape"):
        f(x, o["gu_rec"], o["dn_rec"], block_size=block, norm_weight=jnp.zeros((8,), jnp.float16))
    with pytest.raises(NotImplementedError, match="JOA_GATED_MLP_NBITS=0|backend='cuda'"):
        f(x, o["gu_rec"], o["dn_rec"], block_size=block, backend="cuda")


def _int4_model(**overrides):
    from jax_onnx_attn.models.builder import build_decoder
    from jax_onnx_attn.models.config import DecoderConfig

    cfg = dict(layers=2, hidden=256, heads=4, kv_heads=2, intermediate=512, vocab=256, dtype="float16",
               weight_bits=4, block_size=32)
    return build_decoder(DecoderConfig(**{**cfg, **overrides}))


@needs_ext
@pytest.mark.parametrize("dtype, block, zp", [("float16", 32, False), ("bfloat16", 128, True)])
def test_fusion_keeps_the_logits(dtype, block, zp):
    # Pass 6b: each layer's 4-bit gate / up and down projections become one GatedMlpNbits node (the
    # gate / up weight in records, the down weight in slice records); the reference through it gives
    # the unfused "onnx" layout's logits bit for bit, at a decode step and a prompt.
    from test_linear_record import _decoder_feeds

    model = _int4_model(dtype=dtype, block_size=block, zero_points=zp)
    plain = jax_onnx_attn.load(model)
    fused = jax_onnx_attn.load(model, nbits_layout="record", gated_mlp_nbits=True)
    assert fused.fusions.gated_mlp_nbits == 2
    nodes = [n for n in fused.model.graph.node if n.op_type == "GatedMlpNbits"]
    assert len(nodes) == 2
    for n in nodes:
        assert fused.params[n.input[1]].shape[-1] == RECORD_BYTES
        assert fused.params[n.input[2]].shape == (256 // 16, 512 // SLICE_K, SLICE_BYTES)
    assert jax_onnx_attn.load(model, nbits_layout="record").fusions.gated_mlp_nbits == 0
    assert jax_onnx_attn.load(model, gated_mlp_nbits=True).fusions.gated_mlp_nbits == 0  # record only
    from jax_onnx_attn.onnx.sharding import plan_tensor_parallel
    with pytest.raises(ValueError, match="gated_mlp_nbits=True"):  # a mesh splits Linear nodes only
        plan_tensor_parallel(fused, 2)
    rng = np.random.default_rng(3)
    for s in (1, 5):
        feeds = _decoder_feeds(plain, s, rng)
        got, want = fused.apply(fused.params, feeds), plain.apply(plain.params, feeds)
        for name in want:
            np.testing.assert_array_equal(np.asarray(got[name]), np.asarray(want[name]), err_msg=name)


@needs_ext
def test_fusion_leaves_shapes_without_a_grid():
    # hidden 128: no whole 256-element records for the gate / up weight, so no fused node.
    fused = jax_onnx_attn.load(_int4_model(hidden=128, heads=2, kv_heads=1), nbits_layout="record",
                               gated_mlp_nbits=True)
    assert fused.fusions.gated_mlp_nbits == 0


@needs_ext
def test_session_switch(monkeypatch):
    # JOA_GATED_MLP_NBITS (off by default: untimed) fuses the 4-bit MLPs of batch-1 sessions that
    # load the record layout; the tokens are the plain session's.
    from jax_onnx_attn.runtime import DecoderSession
    from jax_onnx_attn.runtime.session import gated_mlp_nbits_for

    monkeypatch.delenv(cuda_matmul.GATED_MLP_NBITS_ENV, raising=False)
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    assert not gated_mlp_nbits_for(1)
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "1")
    assert gated_mlp_nbits_for(1) and not gated_mlp_nbits_for(2) and not gated_mlp_nbits_for(1, mesh=object())
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "0")
    assert not gated_mlp_nbits_for(1)  # the record layout's switch first
    monkeypatch.setenv(cuda_matmul.RECORD_ENV, "1")
    model = _int4_model()
    prompts = [[1, 2, 3, 4, 5]]
    session = DecoderSession(model, max_length=16, batch=1)
    assert session.lowered.fusions.gated_mlp_nbits == 2
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "0")
    plain = DecoderSession(model, max_length=16, batch=1)
    assert plain.lowered.fusions.gated_mlp_nbits == 0
    assert session.generate(prompts, max_new_tokens=6).tokens == plain.generate(prompts, max_new_tokens=6).tokens
    monkeypatch.setenv(cuda_matmul.GATED_MLP_NBITS_ENV, "yes")
    with pytest.raises(ValueError, match=cuda_matmul.GATED_MLP_NBITS_ENV):
        gated_mlp_nbits_for(1)
