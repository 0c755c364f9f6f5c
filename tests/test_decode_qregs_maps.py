"""Host emulation of the decode engine's register dequantisation (QuantRegKv, kv_format.cuh, and
DecodeSplitKernelQRegs, engine_qregs.cuh): the fragment maps, the bit tricks and the ring pitches.

The kernels are not run on the CPU; this mirrors, lane by lane, what they compute: each lane's
packed-word loads from a ring row laid out as the writer lays out a cache row (kv_quant.cuh), the
integer -> f16 pair conversions (magic numbers; the MMAs run on f16 for f16 and bf16 caches alike),
the m16n8k16 fragment layouts, Q's permutation (KChan) and O's (VChan), and checks that Q' K^T and
P V come out exactly as Q K^T and P V on the dequantised cache; Q's power-of-two row scale (RowExp)
keeps a bf16 row within f16's range without losing its bits; the key-rows kernel's transposed
maps (key_rows.cuh, QRegKeyRowStages: the same fragments as A operands, P^T by movmatrix). Plus: the ring pitches (plan.h
RegKPitch / RegVPitch) leave the fragment loads free of bank conflicts.
"""

import itertools

import ml_dtypes
import numpy as np
import pytest

HEAD_DIMS = [64, 80, 96, 128, 256]
BITS = [8, 4]


# --- the C++ maps, transcribed ----------------------------------------------------------------

def is_tail(d, kk):
    return d % 32 != 0 and kk == d // 16 - 1


def k_chan(bits, d, kk, t, h, e):
    """QuantRegKv::KChan: the channel behind k index 2t + e + 8h of k step kk."""
    if is_tail(d, kk):
        return 16 * kk + 4 * t + h + 2 * e
    if bits == 8:
        return 32 * (kk // 2) + 8 * t + 4 * (kk & 1) + h + 2 * e
    return 32 * (kk // 2) + 8 * t + 2 * (kk & 1) + h + 4 * e


def seg_w(bits, d, start):
    w = 32 if bits == 8 else 64
    while start + w > d:
        w //= 2
    return w


def segments(bits, d):
    out, s = [], 0
    while s < d:
        w = seg_w(bits, d, s)
        out.append((s, w))
        s += w
    return out


def v_chan(bits, d, dt, col):
    """QuantRegKv::VChan: the channel of column col of O n8 tile dt."""
    for s, w in segments(bits, d):
        if s <= 8 * dt < s + w:
            return s + (w // 8) * col + (dt - s // 8)
    raise AssertionError


def reg_k_pitch(row_bytes, bits):
    p = row_bytes
    while (p % 64 != 32) if bits == 8 else (p % 32 != 16):
        p += 1
    return p


def reg_v_pitch(row_bytes):
    p = row_bytes
    while p % 32 != 16:
        p += 1
    return p


# --- bit-level helpers ------------------------------------------------------------------------

def byte_perm(a, b, s):
    src = [(a >> (8 * i)) & 0xFF for i in range(4)] + [(b >> (8 * i)) & 0xFF for i in range(4)]
    return sum(src[(s >> (4 * k)) & 7] << (8 * k) for k in range(4))


def halves(y):
    lo, hi = np.array([y & 0xFFFF, y >> 16], np.uint16).view(np.float16)
    return float(lo), float(hi)


def i4_lo(x):
    """QuantRegKv::I4Lo: the nibbles at bits [0, 4) and [16, 20), stored q + 8."""
    lo, hi = halves((x & 0x000F000F) | 0x64006400)
    return lo - 1032.0, hi - 1032.0


def i4_hi(x):
    """QuantRegKv::I4Hi: the nibbles at bits [4, 8) and [20, 24), 1024 + 16 n times 1/16 minus 72
    (one HFMA2, exact: the f16 results are checked to be what the float arithmetic says)."""
    out = []
    for y in halves((x & 0x00F000F0) | 0x64006400):
        r = np.float16(np.float16(y) * np.float16(1 / 16) + np.float16(-72.0))
        assert float(r) == y / 16 - 72
        out.append(float(r))
    return tuple(out)


def i8_pair(x):
    """QuantRegKv::I8Pair: bytes 0 and 2 of x."""
    lo, hi = halves(((x & 0x00FF00FF) ^ 0x64806480) & 0xFFFFFFFF)
    return lo - 1152.0, hi - 1152.0


def word(row, off, nb):
    return int.from_bytes(bytes(row[off:off + nb]), "little")


# --- caches as the writer lays them out -------------------------------------------------------

def pack_rows(levels, bits):
    """levels int [n, d] -> raw bytes [n, d * bits / 8] (kv_quant.cuh: int4 column 2i low nibble,
    stored q + 8)."""
    if bits == 8:
        return levels.astype(np.int8).view(np.uint8)
    u = (levels + 8).astype(np.uint8)
    return (u[:, 0::2] | (u[:, 1::2] << 4)).astype(np.uint8)


def permute_q(q, bits, d):
    """PrepareQ: Q'[r][16 kk + k] = Q[r][KChan(kk, k)] (k = 2t + e + 8h)."""
    qp = np.zeros_like(q)
    for kk in range(d // 16):
        for k in range(16):
            t, e, h = (k >> 1) & 3, k & 1, k >> 3
            qp[:, 16 * kk + k] = q[:, k_chan(bits, d, kk, t, h, e)]
    return qp


def random_levels(rng, bits, shape):
    lo, hi = (-128, 128) if bits == 8 else (-8, 8)
    return rng.integers(lo, hi, size=shape)


# --- the lanes ----------------------------------------------------------------------------------

def k_fragments(raw_row, bits, d, kk, t):
    """The (b0, b1) pairs lane (g, t) builds for k step kk from its K row (KPair / KTail)."""
    if is_tail(d, kk):
        if bits == 8:
            w = word(raw_row, 16 * kk + 4 * t, 4)
            return i8_pair(w), i8_pair(w >> 8)
        h = word(raw_row, 8 * kk + 2 * t, 2)
        x = byte_perm(h, 0, 0x4140)
        return i4_lo(x), i4_hi(x)
    kp, odd = kk // 2, kk & 1
    if bits == 8:
        w = word(raw_row, 32 * kp + 8 * t + 4 * odd, 4)
        return i8_pair(w), i8_pair(w >> 8)
    w = word(raw_row, 16 * kp + 4 * t, 4) >> (8 * odd)
    return i4_lo(w), i4_hi(w)


def v_fragments(raw_rows, bits, d, g):
    """{dt: (b0, b1)} lane (g, t) builds for one k16 step; raw_rows: its 4 rows 2t, 2t + 1, 2t + 8,
    2t + 9 (PvSegment: channel i of a word is its byte i, int4: byte i // 2, nibble i % 2)."""
    out = {}
    for start, w in segments(bits, d):
        ch = w // 8
        nb = ch * bits // 8
        ws = [word(r, start * bits // 8 + nb * g, nb) for r in raw_rows]
        for i in range(ch):
            byte = i if bits == 8 else i // 2
            sel = byte | ((4 + byte) << 8)
            y0, y1 = byte_perm(ws[0], ws[1], sel), byte_perm(ws[2], ws[3], sel)
            conv = i8_pair if bits == 8 else (i4_lo if i % 2 == 0 else i4_hi)
            out[start // 8 + i] = (conv(y0), conv(y1))
    return out


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_maps_are_permutations(bits, d):
    # Every k step's 16 channels, over all steps, are the channels once each; a pair's steps
    # (2 kp, 2 kp + 1) stay inside their 32-channel group (PrepareQ permutes a group in place).
    allc = [k_chan(bits, d, kk, t, h, e) for kk in range(d // 16) for t in range(4) for h in range(2)
            for e in range(2)]
    assert sorted(allc) == list(range(d))
    for kk in range(d // 16):
        grp = kk // 2
        for t, h, e in itertools.product(range(4), range(2), range(2)):
            assert 32 * grp <= k_chan(bits, d, kk, t, h, e) < 32 * grp + 32
    assert sorted(v_chan(bits, d, dt, c) for dt in range(d // 8) for c in range(8)) == list(range(d))


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_qk_fragments(bits, d):
    """S = Q' K^T over the lanes' fragments equals Q K^T on the integer levels, exactly."""
    rng = np.random.default_rng(bits * 1000 + d)
    lev = random_levels(rng, bits, (8, d))  # the 8 K rows of one n8 tile
    raw = pack_rows(lev, bits)
    q = rng.integers(-50, 50, size=(16, d)).astype(np.float64)  # exact products
    qp = permute_q(q, bits, d)
    s = np.zeros((16, 8))
    for kk in range(d // 16):
        a = qp[:, 16 * kk:16 * kk + 16]
        bmat = np.zeros((16, 8))
        for g in range(8):
            for t in range(4):
                (x0, x1), (y0, y1) = k_fragments(raw[g], bits, d, kk, t)
                bmat[2 * t, g], bmat[2 * t + 1, g] = x0, x1
                bmat[2 * t + 8, g], bmat[2 * t + 9, g] = y0, y1
        s += a @ bmat
    np.testing.assert_array_equal(s, q @ lev.T.astype(np.float64))


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_pv_fragments(bits, d):
    """O = P V over the lanes' fragments, columns un-permuted by VChan, equals P V on the levels."""
    rng = np.random.default_rng(bits * 7 + d)
    lev = random_levels(rng, bits, (16, d))  # the 16 KV rows of one k16 step
    raw = pack_rows(lev, bits)
    p = rng.integers(0, 5, size=(16, 16)).astype(np.float64)
    o = np.zeros((16, d // 8, 8))  # [row, n8 tile, column]
    for g in range(8):
        for t in range(4):
            rows = [raw[2 * t], raw[2 * t + 1], raw[2 * t + 8], raw[2 * t + 9]]
            for dt, ((x0, x1), (y0, y1)) in v_fragments(rows, bits, d, g).items():
                bcol = np.zeros(16)
                bcol[2 * t], bcol[2 * t + 1], bcol[2 * t + 8], bcol[2 * t + 9] = x0, x1, y0, y1
                ks = [2 * t, 2 * t + 1, 2 * t + 8, 2 * t + 9]
                o[:, dt, g] += p[:, ks] @ bcol[ks]
    got = np.zeros((16, d))
    for dt in range(d // 8):
        for col in range(8):
            got[:, v_chan(bits, d, dt, col)] = o[:, dt, col]
    np.testing.assert_array_equal(got, p @ lev.astype(np.float64))


# --- the key-rows form (key_rows.cuh, engine_qregs.cuh QRegKeyRowStages): keys as the MMA rows ---
# m16n8k16 fragments of lane (g, t): A[16 x 16]: a0 (row g, k 2t, 2t + 1), a1 (row g + 8, same k),
# a2 (row g, k 2t + 8, 2t + 9), a3 (row g + 8, same); B[16 x 8]: b0 (k 2t, 2t + 1, column g), b1
# (k 2t + 8, 2t + 9, column g); C[16 x 8]: c0, c1 (row g, columns 2t, 2t + 1), c2, c3 (row g + 8).

def a_matrix(frags):
    """frags[(g, t)] = (a0, a1, a2, a3), each a pair -> the 16 x 16 A operand."""
    a = np.zeros((16, 16))
    for (g, t), (a0, a1, a2, a3) in frags.items():
        a[g, 2 * t:2 * t + 2], a[g + 8, 2 * t:2 * t + 2] = a0, a1
        a[g, 2 * t + 8:2 * t + 10], a[g + 8, 2 * t + 8:2 * t + 10] = a2, a3
    return a


def b_matrix(frags):
    """frags[(g, t)] = (b0, b1), each a pair -> the 16 x 8 B operand."""
    b = np.zeros((16, 8))
    for (g, t), (b0, b1) in frags.items():
        b[2 * t:2 * t + 2, g], b[2 * t + 8:2 * t + 10, g] = b0, b1
    return b


def movmatrix_trans(frag):
    """movmatrix.m8n8.trans.b16 over a warp: frag[(g, t)] = the pair (M[g][2t], M[g][2t + 1]) ->
    the same lanes holding (M[2t][g], M[2t + 1][g])."""
    m = np.zeros((8, 8))
    for (g, t), pair in frag.items():
        m[g, 2 * t:2 * t + 2] = pair
    return {(g, t): (m[2 * t, g], m[2 * t + 1, g]) for g in range(8) for t in range(4)}


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_key_rows_qk_fragments(bits, d):
    """S^T = K Q'^T with A from the K fragments of rows g and g + 8 ({lo[0], hi[0], lo[1], hi[1]} of
    KPair / KTail) and B from Q' rows 0-7 (ldmatrix, KeyRows::LoadQ) equals K Q^T exactly."""
    rng = np.random.default_rng(bits * 31 + d)
    lev = random_levels(rng, bits, (16, d))  # the 16 K rows of one key tile
    raw = pack_rows(lev, bits)
    q = rng.integers(-50, 50, size=(8, d)).astype(np.float64)
    qp = permute_q(q, bits, d)
    st = np.zeros((16, 8))
    for kk in range(d // 16):
        a = {}
        for g, t in itertools.product(range(8), range(4)):
            lo, hi = k_fragments(raw[g], bits, d, kk, t), k_fragments(raw[g + 8], bits, d, kk, t)
            a[(g, t)] = (lo[0], hi[0], lo[1], hi[1])
        b = {(g, t): (qp[g, 16 * kk + 2 * t:16 * kk + 2 * t + 2], qp[g, 16 * kk + 8 + 2 * t:16 * kk + 10 + 2 * t])
             for g in range(8) for t in range(4)}
        st += a_matrix(a) @ b_matrix(b)
    np.testing.assert_array_equal(st, lev.astype(np.float64) @ q.T)


@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("bits", BITS)
def test_key_rows_pv_fragments(bits, d):
    """O^T += V^T P^T: P^T's B fragment is the S^T accumulator's halves transposed by movmatrix, the
    A fragment of O^T m16 tile i is PvSegment's B fragments of O n8 tiles 2i and 2i + 1
    (PvSegmentKeyRows); rows un-permuted (row g: VChan(2i, g), row g + 8: VChan(2i + 1, g)) it is
    (P V)^T on the levels, exactly."""
    rng = np.random.default_rng(bits * 13 + d)
    lev = random_levels(rng, bits, (16, d))  # the 16 KV rows of one k16 step
    raw = pack_rows(lev, bits)
    p = rng.integers(0, 5, size=(8, 16)).astype(np.float64)  # 8 query rows x 16 keys
    # The S^T accumulator layout: lane (g, t) holds keys g / g + 8 of queries 2t, 2t + 1.
    c_lo = {(g, t): (p[2 * t, g], p[2 * t + 1, g]) for g in range(8) for t in range(4)}
    c_hi = {(g, t): (p[2 * t, g + 8], p[2 * t + 1, g + 8]) for g in range(8) for t in range(4)}
    t_lo, t_hi = movmatrix_trans(c_lo), movmatrix_trans(c_hi)
    pb = b_matrix({gt: (t_lo[gt], t_hi[gt]) for gt in t_lo})
    np.testing.assert_array_equal(pb, p.T)  # P^T as the B operand: keys x queries
    ot = np.zeros((d // 16, 16, 8))
    frags = {}
    for g, t in itertools.product(range(8), range(4)):
        rows = [raw[2 * t], raw[2 * t + 1], raw[2 * t + 8], raw[2 * t + 9]]
        frags[(g, t)] = v_fragments(rows, bits, d, g)
    for mt in range(d // 16):
        a = {gt: (f[2 * mt][0], f[2 * mt + 1][0], f[2 * mt][1], f[2 * mt + 1][1]) for gt, f in frags.items()}
        ot[mt] = a_matrix(a) @ pb
    got = np.zeros((d, 8))
    for mt in range(d // 16):
        for g in range(8):
            got[v_chan(bits, d, 2 * mt, g)] = ot[mt, g]
            got[v_chan(bits, d, 2 * mt + 1, g)] = ot[mt, g + 8]
    np.testing.assert_array_equal(got, (p @ lev.astype(np.float64)).T)


def row_exp(mx_bits):
    """QRegStages::RowExp: the exponent e that puts a row's largest |value| (its f32 bits) times 2^e
    in [2^14, 2^15); 0 for a zero row and for inf / NaN."""
    ex = mx_bits >> 23
    if mx_bits == 0 or ex == 255:
        return 0
    return min(max(14 - (ex - 127), -126), 126)


def test_q_row_scale_keeps_bf16_rows_exact_in_f16():
    """PrepareQ stages Q' = f16(Q * 2^e) for the f16 MMAs: any bf16 row (magnitudes 2^-126 to
    2^127) fits f16's range and comes back bit for bit (Q' / 2^e == Q), for values within 2^20 of
    the row's largest; zero rows and rows with inf / NaN are left unscaled."""
    rng = np.random.default_rng(0)
    for k in range(-126, 127, 3):
        mag = 2.0 ** rng.uniform(k - 20, k + 1, size=128)
        v = (rng.choice([-1.0, 1.0], size=128) * mag).astype(ml_dtypes.bfloat16).astype(np.float32)
        v = v[np.isfinite(v) & (v != 0)]
        mx = np.abs(v).max()
        e = row_exp(int(np.array([mx], np.float32).view(np.uint32)[0]))
        q16 = (v.astype(np.float64) * 2.0 ** e).astype(np.float16)
        assert np.isfinite(q16).all() and np.abs(q16).max() <= 32768, k
        keep = np.abs(v) >= mx * 2.0 ** -20
        np.testing.assert_array_equal(q16[keep].astype(np.float64) / 2.0 ** e, v[keep], err_msg=str(k))
    assert row_exp(0) == 0
    assert row_exp(0x7F800000) == 0 and row_exp(0x7FC00000) == 0
    assert row_exp(1) == 126  # a subnormal maximum: scaled up as far as f32 allows


def _wavefronts(addrs):
    """Shared-memory wavefronts of one warp-wide load: addrs [lane] -> (start byte, bytes)."""
    # 8-byte loads are served per half warp; 4-byte and smaller per warp. A wavefront serves each
    # bank once (distinct 4-byte words in one bank conflict; the same word broadcasts).
    width = max(n for _, n in addrs)
    groups = [addrs[:16], addrs[16:]] if width == 8 else [addrs]
    total = 0
    for grp in groups:
        banks = {}
        for a, n in grp:
            for wd in range(a // 4, (a + n - 1) // 4 + 1):
                banks.setdefault(wd % 32, set()).add(wd)
        total += max(len(v) for v in banks.values())
    return total


@pytest.mark.parametrize("d", [64, 96, 128, 256])
@pytest.mark.parametrize("bits", BITS)
def test_pitches_are_conflict_free(bits, d):
    row = d * bits // 8
    kp, vp = reg_k_pitch(row, bits), reg_v_pitch(row)
    assert kp >= row and vp >= row and kp % 16 == 0 and vp % 16 == 0
    for kk in range(0, d // 16, 2):  # K: lane (g, t) reads its row's word of a k-step pair
        if bits == 8:
            addrs = [(g * kp + 32 * (kk // 2) + 8 * t, 8) for g in range(8) for t in range(4)]
            assert _wavefronts(addrs) == 2
        else:
            addrs = [(g * kp + 16 * (kk // 2) + 4 * t, 4) for g in range(8) for t in range(4)]
            assert _wavefronts(addrs) == 1
    for start, w in segments(bits, d):  # V: row 2t + c, the column's word
        nb = (w // 8) * bits // 8
        if nb < 4:
            continue
        for c in (0, 1, 8, 9):
            addrs = [((2 * t + c) * vp + start * bits // 8 + nb * g, nb) for g in range(8) for t in range(4)]
            assert _wavefronts(addrs) == 1
