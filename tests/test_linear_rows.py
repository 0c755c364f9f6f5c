"""The rows layout of 4-bit MatMulNBits weights (ops.to_rows_layout, the rows kernel's input:
ffi/kernels/gemv/rows.cuh) on the CPU: the transform and its inverse, the fragments the kernel reads
out of it (emulated in NumPy), the reference through it equal to the reference on the ONNX layout,
trace-time refusals, and the rows kernel's plan (plan.h's MakeRowsPlan)."""

from __future__ import annotations


import jax.numpy as jnp
import numpy as np
import pytest

from jax_onnx_attn import ops
from jax_onnx_attn._extension import _ffi
from jax_onnx_attn.ops import cuda_matmul
from jax_onnx_attn.ops.linear import ROWS_GROUP, interleave_gate_up_nbits

from nbits_cases import nbits_weights as _weights

needs_ext = pytest.mark.skipif(_ffi is None, reason="needs the compiled extension (plan.h)")


@pytest.mark.parametrize("n,k,block", [(8, 16, 16), (72, 256, 32), (200, 384, 128), (4096, 512, 128)])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
def test_rows_layout_round_trip(n, k, block, zp):
    b_quant, scales, zeros = _weights(n, k, block, zp)
    w, s, z = ops.to_rows_layout(b_quant, scales, zeros)
    groups = -(-n // ROWS_GROUP)
    assert w.shape == (groups, k // 16, 512) and w.dtype == np.uint8
    assert s.shape == (groups, k // block, ROWS_GROUP) and s.dtype == scales.dtype
    assert (z is None) == (zeros is None)
    for xp in (np, jnp):
        back = ops.from_rows_layout(xp.asarray(w), xp.asarray(s), None if z is None else xp.asarray(z),
                                    n=n, block_size=block)
        np.testing.assert_array_equal(np.asarray(back[0]), b_quant)
        np.testing.assert_array_equal(np.asarray(back[1]), scales)
        if zp:
            np.testing.assert_array_equal(np.asarray(back[2]), zeros)
    # Rows past N are zeros (the kernel computes them and never stores them).
    if groups * ROWS_GROUP > n:
        flat_s = s.reshape(groups, -1, 8, 4, 2).transpose(0, 3, 4, 2, 1).reshape(groups * ROWS_GROUP, -1)
        assert not flat_s[n:].any()


def test_rows_layout_gives_the_fragments_the_kernel_reads():
    # rows.cuh: lane (g, t) of k16 step j of row group rg, word i holds the m16n8k16 A fragment of
    # tile i; MagicNibbles (weights.cuh) takes a[e] = nibbles (e, e + 4) as the pair's (low, high)
    # halves (bf16: v >> 4 e; f16: the masks 0x000F000F / 0x00F000F0 of v and v >> 8, the same),
    # and a[0..3] must be A[g][2t, 2t+1], A[g+8][2t, ..], A[g][2t+8, ..], A[g+8][2t+8, ..].
    n, k, block = 136, 96, 32
    b_quant, scales, zeros = _weights(n, k, block, True, seed=3)
    q = np.stack([b_quant & 15, b_quant >> 4], -1).reshape(n, k)
    w, s, z = ops.to_rows_layout(b_quant, scales, zeros)
    words = w.reshape(w.shape[0], k // 16, 32, 4, 4).astype(np.uint32)
    words = words[..., 0] | words[..., 1] << 8 | words[..., 2] << 16 | words[..., 3] << 24  # [rg, j, lane, i]
    qp = np.zeros((w.shape[0] * ROWS_GROUP, k), np.uint8)
    qp[:n] = q
    for rg in range(w.shape[0]):
        for j in range(k // 16):
            for lane in range(32):
                g, t = lane // 4, lane % 4
                for i in range(4):
                    v = int(words[rg, j, lane, i])
                    r = rg * ROWS_GROUP + 16 * i + g
                    kk = 16 * j + 2 * t
                    want = [(qp[r, kk], qp[r, kk + 1]), (qp[r + 8, kk], qp[r + 8, kk + 1]),
                            (qp[r, kk + 8], qp[r, kk + 9]), (qp[r + 8, kk + 8], qp[r + 8, kk + 9])]
                    for e in range(4):
                        assert ((v >> (4 * e)) & 15, (v >> (4 * e + 16)) & 15) == want[e]
                    # f16's masks: the same nibbles (1024 + q, or 1024 + 16 q for a[1], a[3]).
                    v8 = v >> 8
                    f16 = [v & 0x000F000F, (v & 0x00F000F0) >> 4, v8 & 0x000F000F, (v8 & 0x00F000F0) >> 4]
                    for e in range(4):
                        assert (f16[e] & 15, f16[e] >> 16) == want[e]
    # Metadata: value 8 g + 2 i + h of (rg, block) is row 64 rg + 16 i + 8 h + g.
    for rg in range(s.shape[0]):
        for g in range(8):
            for i in range(4):
                for h in range(2):
                    r = rg * ROWS_GROUP + 16 * i + 8 * h + g
                    got_s, got_z = s[rg, :, 8 * g + 2 * i + h], z[rg, :, 8 * g + 2 * i + h]
                    np.testing.assert_array_equal(got_s, scales[r] if r < n else 0)
                    np.testing.assert_array_equal(got_z, zeros[r] if r < n else 0)


FUSIONS = ["plain", "bias", "residual", "norm", "gated", "all"]


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.float32], ids=lambda d: jnp.dtype(d).name)
@pytest.mark.parametrize("block", [32, 128])
@pytest.mark.parametrize("zp", [False, True], ids=["sym", "zp"])
@pytest.mark.parametrize("fusion", FUSIONS)
def test_reference_through_the_rows_layout_equals_the_onnx_layout(fusion, zp, block, dtype):
    gated = fusion in ("gated", "all")
    k, n = 256, 144 if gated else 136  # N not a multiple of 64: a partial row group
    np_dt = jnp.dtype(dtype)
    if gated:
        halves = [_weights(n // 2, k, block, zp, seed=s, dtype=np_dt) for s in (1, 2)]
        b_quant, scales, zeros = interleave_gate_up_nbits(*halves)
    else:
        b_quant, scales, zeros = _weights(n, k, block, zp, dtype=np_dt)
    rows = ops.to_rows_layout(b_quant, scales, zeros)
    rng = np.random.default_rng(5)
    for m in (1, 2, 8, 33):  # 33: past the kernels' rows (prefill), the reference in both
        x = jnp.asarray(rng.normal(size=(m, k)), dtype)
        n_out = n // 2 if gated else n
        kw = dict(k=k, n=n, bits=4, block_size=block, gated=gated, backend="reference")
        if fusion in ("bias", "all"):
            kw["bias"] = jnp.asarray(rng.normal(size=n), dtype)
        if fusion in ("residual", "all"):
            kw["residual"] = jnp.asarray(rng.normal(size=(m, n_out)), dtype)
        if fusion in ("norm", "all"):
            kw["norm_weight"] = jnp.asarray(1 + 0.1 * rng.normal(size=k), dtype)
        want = ops.matmul_nbits(x, b_quant, scales, zeros, **kw)
        got = ops.matmul_nbits(x, *rows, layout="rows", **kw)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        auto = ops.matmul_nbits(x, *rows, layout="rows", **{**kw, "backend": "auto"})
        np.testing.assert_array_equal(np.asarray(auto), np.asarray(want))


def test_pack_nbits_rows_takes_the_onnx_initialisers():
    n, k, block = 72, 128, 32
    b_quant, scales, zeros = _weights(n, k, block, True)
    kb = k // block
    packed_zp = np.zeros((n, -(-kb // 2)), np.uint8)  # two 4-bit zero points a byte, low first
    for b in range(kb):
        packed_zp[:, b // 2] |= zeros[:, b] << (4 * (b % 2))
    got = ops.pack_nbits_rows(b_quant.reshape(-1), scales.reshape(-1), packed_zp.reshape(-1), k=k, n=n,
                              bits=4, block_size=block)
    for a, b in zip(got, ops.to_rows_layout(b_quant, scales, zeros)):
        np.testing.assert_array_equal(a, b)
    with pytest.raises(NotImplementedError, match="4-bit"):
        ops.pack_nbits_rows(b_quant, scales, None, k=k, n=n, bits=8, block_size=block)


def test_rows_layout_refusals_name_the_input():
    n, k, block = 64, 128, 32
    b_quant, scales, zeros = _weights(n, k, block, True)
    w, s, z = ops.to_rows_layout(b_quant, scales, zeros)
    x = jnp.ones((4, k), jnp.float16)
    kw = dict(k=k, n=n, bits=4, block_size=block, layout="rows")
    with pytest.raises(ValueError, match="b_quant in the rows layout"):
        ops.matmul_nbits(x, b_quant, s, z, **kw)
    with pytest.raises(ValueError, match="scales in the rows layout"):
        ops.matmul_nbits(x, w, scales, z, **kw)
    with pytest.raises(TypeError, match="scales must have x's dtype"):
        ops.matmul_nbits(x, w, s.astype(np.float32), z, **kw)
    with pytest.raises(ValueError, match="zero_points in the rows layout"):
        ops.matmul_nbits(x, w, s, zeros, **kw)
    with pytest.raises(NotImplementedError, match="4-bit"):
        ops.matmul_nbits(x, w, s, z, **{**kw, "bits": 8})
    with pytest.raises(ValueError, match="layout must be one of"):
        ops.matmul_nbits(x, w, s, z, **{**kw, "layout": "tiles"})
    with pytest.raises(ValueError, match="zero_points must be uint8"):
        ops.to_rows_layout(b_quant, scales, zeros + 16)


@needs_ext
def test_rows_group_agrees_with_the_kernel():
    assert _ffi.limits()["gemv"]["rows_group"] == ROWS_GROUP


# (K, N, gated, norm) -> (warps_n, cluster) the plan takes at M = 8 on the ~8B shapes (plan.h's kRows*
# targets and RowsPreferredWarps: 4-warp CTAs, 8 in K slices of 2048 for the many row groups of the
# gate-up and the LM head).
PLANNED = {(4096, 4096, False, False): (4, 8), (4096, 6144, False, True): (4, 8),
           (4096, 28672, True, True): (8, 2), (14336, 4096, False, False): (4, 16),
           (4096, 128256, False, True): (8, 2)}


@needs_ext
@pytest.mark.parametrize("shape", list(PLANNED), ids=str)
def test_rows_plan_on_the_8b_shapes(shape):
    k, n, gated, norm = shape
    for block in (32, 128):
        plan = cuda_matmul.gemv_plan(8, n, k, 4, gated, norm, block_size=block, rows_layout=True)
        assert plan["error"] is None and plan["rows_layout"]
        assert (plan["warps_n"], plan["cluster"]) == PLANNED[shape]
        # A ring of depth 2 a warp (depth 4 was never faster on the H200), occupancy 1.
        assert (plan["stages"], plan["ctas_per_sm"]) == (2, 1)
    for m in (2, 16, 32):
        plan = cuda_matmul.gemv_plan(m, n, k, 4, gated, norm, block_size=128, rows_layout=True)
        assert plan["error"] is None
        assert plan["smem_bytes"] <= 232448 and plan["nt"] == (1 if m <= 8 else 2 if m <= 16 else 4)
        assert k % (plan["cluster"] * 128) == 0 and 64 * plan["warps_n"] // plan["cluster"] >= 16
        # No planned K split leaves a CTA less than 256 of K (plan.h's kRowsMinSliceK).
        assert plan["cluster"] == 1 or k // plan["cluster"] >= 256


# (K, N, M) -> (warps_n, cluster): session 24's H200 sweep of the rows kernel with 1280-byte ring
# stages (block 32, depth 2, clusters 1-16 x 2 / 4 / 8 warps; tools/probes/rows_kernel_times.py,
# bench/results/2026-12-03-c97125e-rows-sweep-{1b,8b}.json) on the ~1B and ~8B projections: the
# fastest measured layout, which the planner takes, or (marked) one within 2% of it.
FASTEST = {(2048, 3072, 8): (4, 8), (2048, 3072, 32): (4, 8), (2048, 2048, 8): (4, 8), (2048, 2048, 32): (4, 8),
           (2048, 16384, 8): (4, 2), (2048, 16384, 32): (4, 2), (8192, 2048, 8): (4, 16),
           (8192, 2048, 32): (4, 16), (2048, 128256, 8): (8, 1), (2048, 128256, 32): (8, 1),
           (4096, 6144, 8): (4, 8), (4096, 6144, 32): (4, 8),  # 17.31 µs; 8 x 8 17.15
           (4096, 4096, 8): (4, 8),  # 9.36; 4 x 16 9.22
           (4096, 4096, 32): (4, 8),  # 15.71; 8 x 8 15.44
           (4096, 28672, 8): (8, 2),  # 27.82; 8 x 4 27.39
           (4096, 28672, 32): (8, 2), (14336, 4096, 8): (4, 16), (14336, 4096, 32): (4, 16),
           (4096, 128256, 8): (8, 2), (4096, 128256, 32): (8, 2)}


@needs_ext
@pytest.mark.parametrize("case", list(FASTEST), ids=str)
def test_rows_plan_takes_the_fastest_measured_layouts(case):
    k, n, m = case
    plan = cuda_matmul.gemv_plan(m, n, k, 4, False, block_size=32, rows_layout=True)
    assert plan["error"] is None and (plan["warps_n"], plan["cluster"], plan["stages"]) == (*FASTEST[case], 2)


@needs_ext
def test_rows_plan_refusals_and_overrides():
    def plan(m=8, n=4096, k=4096, block=128, **kw):
        return cuda_matmul.gemv_plan(m, n, k, 4, False, block_size=block, rows_layout=True, **kw)
    assert "block_size must be 32 or 128" in plan(block=64)["error"]
    assert "1 to 32 rows" in plan(m=33)["error"]
    assert "multiple of 8" in plan(n=100)["error"]
    assert "4-bit" in cuda_matmul.gemv_plan(8, 4096, 4096, 8, False, block_size=128, rows_layout=True)["error"]
    forced = plan(cluster=2, warps_n=2, depth=2)
    assert (forced["cluster"], forced["warps_n"], forced["stages"]) == (2, 2, 2)
    assert "depth" in plan(depth=3)["error"]
    assert "no layout fits" in plan(k=4096 + 128, cluster=2)["error"]  # 2 does not split 33 blocks
    assert cuda_matmul.rows_unsupported(8, 4096, 4096, 128, False) is None
    assert "block_size" in cuda_matmul.rows_unsupported(8, 4096, 4096, 64, False)


@needs_ext
def test_rows_plan_occupancy_overrides():
    def plan(m=8, n=4096, k=4096, block=128, **kw):
        return cuda_matmul.gemv_plan(m, n, k, 4, False, block_size=block, rows_layout=True, **kw)
    planned = plan()
    assert (planned["ctas_per_sm"], planned["stages"]) == (1, 2)
    # Occupancy 2 on the planner's layout where its shared memory fits twice an SM (x's slice and
    # the 4-warp rings: with 1280-byte ring stages those of depth 4 too, beside a small slice).
    two = plan(occupancy=2)
    assert (two["ctas_per_sm"], two["stages"]) == (2, 2)
    assert (two["cluster"], two["warps_n"]) == (planned["cluster"], planned["warps_n"])
    assert two["smem_bytes"] <= 115712
    deep = plan(occupancy=2, depth=4)
    assert deep["error"] is None and deep["smem_bytes"] <= 115712
    assert "twice an SM (occupancy 2)" in plan(k=8192, cluster=2, occupancy=2, depth=4)["error"]
    assert (plan(occupancy=1)["ctas_per_sm"], plan(occupancy=1)["stages"]) == (1, 2)
    forced = plan(cluster=2, warps_n=4, depth=2, occupancy=2)
    assert (forced["cluster"], forced["warps_n"], forced["stages"], forced["ctas_per_sm"]) == (2, 4, 2, 2)
    assert "occupancy must be" in plan(occupancy=3)["error"]
    assert "occupancy must be" in plan(occupancy=-1)["error"]
    # Where the kernel would spill under 128 registers (plan.h's RowsOccupancy2Fits): M > 16, and
    # M 9-16 at 4 stages of block-32 W.
    assert "occupancy 2" in plan(m=32, occupancy=2)["error"]
    assert "occupancy 2" in plan(m=16, block=32, occupancy=2, depth=4)["error"]
    assert plan(m=16, block=32, occupancy=2)["error"] is None
    assert plan(m=16, block=128, occupancy=2)["error"] is None
    assert plan(m=32, occupancy=1)["error"] is None
    # x's slice twice an SM: M = 8, K = 8192 in one CTA takes 128 KB (one CTA an SM only).
    assert plan(k=8192, cluster=1, occupancy=1)["error"] is None
    assert "twice an SM (occupancy 2)" in plan(k=8192, cluster=1, occupancy=2)["error"]
    wide = plan(k=8192, occupancy=2)  # planned cluster: one whose slice fits twice
    assert wide["error"] is None and wide["cluster"] > 1 and wide["smem_bytes"] <= 115712
    assert cuda_matmul.rows_unsupported(8, 4096, 4096, 128, False, occupancy=2) is None
    assert "occupancy 2" in cuda_matmul.rows_unsupported(32, 4096, 4096, 128, False, occupancy=2)


@needs_ext
def test_rows_plan_below_sm90_takes_no_cluster():
    plan = _ffi.gemv_plan(8, 4096, 4096, 4, False, False, False, block_size=128, rows_layout=True)
    assert plan["error"] is None and plan["cluster"] == 1
    assert "sm_90" in _ffi.gemv_plan(8, 4096, 4096, 4, False, False, False, cluster=2, block_size=128,
                                     rows_layout=True)["error"]


def test_partitioning_rule_folds_vmap_into_the_batch():
    # cuda_matmul.matmul_nbits_rows goes through partitioning.MATMUL_NBITS_ROWS; with the reference
    # in the kernel's place (the same signature), a vmapped call folds into the batch axis and gives
    # each example's result.
    import jax

    from jax_onnx_attn.ops import partitioning
    from jax_onnx_attn.ops.reference import linear as reference

    def spec(x, w, scales, zp, bias, residual, norm_weight, *, n, block_size, eps, gated, **_):
        b_quant, s, z = ops.from_rows_layout(w, scales, zp, n=n, block_size=block_size)
        return reference.matmul_nbits(x, b_quant, s, z, bias, residual, norm_weight, eps, gated, bits=4,
                                      block_size=block_size)

    n, k, block = 128, 256, 32
    rows = [jnp.asarray(a) for a in ops.to_rows_layout(*_weights(n, k, block, True))]
    static = dict(n=n, block_size=block, eps=1e-6, gated=False, pdl=False, cluster=0, warps_n=0, depth=0,
                  occupancy=0)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(2, 4, k)), jnp.float16)
    r = jnp.asarray(rng.normal(size=(2, 4, n)), jnp.float16)
    call = lambda x, r: partitioning.MATMUL_NBITS_ROWS.apply(spec, (x, *rows, None, r, None), static)
    got = jax.jit(jax.vmap(call))(x, r)
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(got[i]), np.asarray(spec(x[i], *rows, None, r[i], None, **static)))


@needs_ext
def test_vmap_pins_the_per_example_rows_plan():
    # A vmapped rows-kernel call folds the examples into its rows with the per-example plan's K split,
    # warps, depth and occupancy (the same sums, the same bits), or runs one call per example past 32
    # rows or past what a forced occupancy 2 takes.
    import jax

    static = dict(n=4096, block_size=128, eps=1e-6, gated=False, pdl=False, cluster=0, warps_n=0, depth=0,
                  occupancy=0)
    x = jax.ShapeDtypeStruct((8, 4096), jnp.float16)
    w = jax.ShapeDtypeStruct((64, 256, 512), jnp.uint8)
    plan = cuda_matmul.gemv_plan(8, 4096, 4096, 4, False, block_size=128, rows_layout=True)
    assert cuda_matmul._rows_pin(static, 4, x, w, None, None, None, None, None) == dict(
        cluster=plan["cluster"], warps_n=plan["warps_n"], depth=plan["stages"], occupancy=plan["ctas_per_sm"])
    assert cuda_matmul._rows_pin(static, 5, x, w, None, None, None, None, None) is None  # 40 rows
    two = {**static, "occupancy": 2}
    assert cuda_matmul._rows_pin(two, 2, x, w, None, None, None, None, None)["occupancy"] == 2  # 16 rows
    assert cuda_matmul._rows_pin(two, 4, x, w, None, None, None, None, None) is None  # 32 rows
    # With the norm prologue too: its sums of squares do not depend on a row's n8 tile of x.
    gamma = jax.ShapeDtypeStruct((4096,), jnp.float16)
    assert cuda_matmul._rows_pin(static, 2, x, w, None, None, None, None, gamma) is not None  # 8 -> 16
    x3 = jax.ShapeDtypeStruct((3, 4096), jnp.float16)
    assert cuda_matmul._rows_pin(static, 4, x3, w, None, None, None, None, gamma) is not None  # 3 -> 12
