"""CUDA backend of the projections: `jax.ffi.ffi_call` wrappers for the GEMV engine's targets
(`linear`, `matmul_nbits`; ffi/handlers/linear.cu and matmul_nbits.cu, engine in ffi/kernels/gemv/) and its launch plan.

Inputs reach these wrappers validated and in the kernels' layout (`jax_onnx_attn.ops.linear` does
that): x is 2-D [M, K] with M <= 32. The plan (grid, warp layout, cluster) is decided in C++
(ffi/kernels/gemv/plan.h) from static shapes; `gemv_plan` asks it, so no kernel constant is
re-derived here. Every handler is command-buffer compatible.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn._extension import _ffi, target
from jax_onnx_attn.ops import partitioning
from jax_onnx_attn.ops.switches import switch as _switch

#: Bits per weight element of the dense format in the plan (the n-bit formats are 4 and 8).
DENSE_BITS = 16
#: The environment variable that selects the wide (two-piece) n-bit format by default.
NBITS_WIDE_ENV = "JOA_GEMV_NBITS_WIDE"
#: The environment variable that lets one row of 4-bit wide weights take the slots kernel.
SLOTS_ENV = "JOA_GEMV_SLOTS"
#: The environment variable that lets one row of dense weights take the dense row kernel.
DENSE_ROW_ENV = "JOA_GEMV_DENSE_ROW"
#: The environment variable that stores dense weights [K, N] for decode sessions of batch >= 2
#: (`dense_kn_enabled`).
DENSE_KN_ENV = "JOA_DENSE_KN"
#: The environment variable that stores 4-bit weights in the rows layout for decode sessions of
#: batch >= 2 (`rows_layout_enabled`).
ROWS_ENV = "JOA_GEMV_ROWS"
#: The environment variable that stores 4-bit weights in the record layout for decode sessions of
#: batch 1 (`record_layout_enabled`).
RECORD_ENV = "JOA_GEMV_RECORD"
#: The environment variable that fuses GroupQueryAttention's step preparation into the packed QKV
#: projection of decode sessions of batch 1 (`qkv_prepare_enabled`).
QKV_PREPARE_ENV = "JOA_QKV_PREPARE"
#: The environment variable that runs the gated MLP of decode sessions of batch 1 as one kernel
#: (`gated_mlp_enabled`).
GATED_MLP_ENV = "JOA_GATED_MLP"
#: The environment variable that runs the attention's output projection and the gated MLP of decode
#: sessions of batch 1 as one kernel (`out_mlp_enabled`).
OUT_MLP_ENV = "JOA_OUT_MLP"
#: The environment variable that picks the fused MLP's split (`gated_mlp_split`): "k" or "n".
GATED_MLP_SPLIT_ENV = "JOA_GATED_MLP_SPLIT"
GATED_MLP_SPLITS = ("k", "n")


def nbits_wide() -> bool:
    """Whether n-bit weights run in the wide format by default: each lane copies two 16-byte pieces
    of a row per chunk (2 KB a chunk, like the dense format) instead of one (ffi/kernels/gemv/plan.h's
    FormatInfo). On by default (H200, bench/results/2026-12-01-e2e-notes.md: 1.2-1.35x the one-piece
    format's GB/s on the 8B and LM-head shapes, the 1B int4 step 0.995 -> 0.943 ms);
    JOA_GEMV_NBITS_WIDE=0 selects the one-piece format (read at trace time, here only).
    `matmul_nbits(..., wide=)` overrides it per call."""
    return _switch(NBITS_WIDE_ENV)


def _switch_where_kernels_run(name: str) -> bool:
    """A 0 / 1 environment switch whose default is whether the kernels run here (a CUDA build and a
    GPU in this process): for weight layouts only the kernels read (the reference would unpack them
    every call)."""
    if name not in os.environ:
        from jax_onnx_attn._extension import cuda_usable
        return cuda_usable()
    return _switch(name)


def slots_enabled() -> bool:
    """Whether one row of x against 4-bit weights in the wide format (block_size >= 32) runs
    on the slots kernel (ffi/kernels/gemv/slots.cuh: scales applied once per 32-element piece in
    f32, W straight into registers, x shared by clusters of two CTAs) rather than the ring kernel.
    On by default (H200, bench/results/2026-12-01-gemv-slots.json: the 1B shapes 0.7-1.7 us faster a
    call, the LM head 61 -> 53 us, the 1B int4 B=1 step 1.03 -> 0.83 ms); JOA_GEMV_SLOTS=0 keeps
    the ring kernel (read at trace time, here only)."""
    return _switch(SLOTS_ENV)


def dense_row_enabled() -> bool:
    """Whether one row of x against dense half weights (K a multiple of 512, N of 16) runs on the
    dense row kernel (ffi/kernels/gemv/dense_row.cuh: W straight into registers as MMA operands, 8
    lanes a 128-byte line of a row, a few instructions a KB) rather than the ring kernel. On by
    default (H200, tools/probes/gemv_dense_m1.cu, bench/results/2026-12-02-gemv-dense-row.json:
    0.90-0.99x of a kernel that only reads W on the ~8B shapes, 1.1-1.7x the ring kernel);
    JOA_GEMV_DENSE_ROW=0 keeps the ring kernel (read at trace time, here only). It is also what
    lets `ops.linear`'s "auto" put one-row dense projections on ours (`ops.linear.kernel_formats`)."""
    return _switch(DENSE_ROW_ENV)


def dense_kn_enabled() -> bool:
    """Whether a `DecoderSession` of batch >= 2 on one device loads its dense projection weights
    [K, N] (ONNX's layout, `load(dense_layout="kn")`) rather than [N, K] (why and what it gains:
    `runtime.session.dense_layout_for`). On by default; JOA_DENSE_KN=0 keeps [N, K] (read when the
    session loads the model)."""
    return _switch(DENSE_KN_ENV)


def rows_layout_enabled() -> bool:
    """Whether a `DecoderSession` of batch >= 2 (one device) loads its 4-bit MatMulNBits weights in
    the rows layout (`ops.to_rows_layout`), so that its decode steps' projections (M = batch rows)
    run on the rows kernel (ffi/kernels/gemv/rows.cuh) instead of the ring kernel. On by default
    where the kernels run (a CUDA build and a GPU in this process): on the H200 the ~8B int4 B=8
    step at ctx 2k took 4.03 ms against 4.93, ~1B B=32 at 1k 2.08 against 2.52, ~1B B=8 1.28
    against 1.31; a prompt then dequantises the weights out of the layout each prefill (~1B B=8 x
    1k tokens 31.3 ms against 29.2; bench/results/2026-12-02-8ad1b19-e2e-rows.json). Off without
    the kernels (the reference would unpack the layout every call). JOA_GEMV_ROWS=0 / 1 overrides
    (read when the session loads the model)."""
    return _switch_where_kernels_run(ROWS_ENV)


def record_layout_enabled() -> bool:
    """Whether a `DecoderSession` of batch 1 (one device) loads its 4-bit MatMulNBits weights in the
    record layout (`ops.to_record_layout`), so that its decode steps' projections (one row of x)
    run on the slots kernel reading records (ffi/kernels/gemv/slots.cuh's RecordFormat: a lane's
    W, scales and zero points of a chunk in one record, addresses by pointer increments) instead of
    the wide format with tiled metadata; the same bits. On by default where the kernels run (a CUDA
    build and a GPU in this process): on the H200 the ~8B int4 B=1 step at ctx 2k took 2.320 ms
    against 2.477, ~1B 0.709 against 0.771, the same tokens; the ~8B LM head GEMV 45.0 µs against
    57.3 (bench/results/2026-12-02-3c6c98d-e2e-record.json, -linear-record.json). A prompt then
    dequantises the weights out of the layout each prefill, as the rows layout does (~8B int4 2k
    TTFT 54.5 ms against 52.2). Off without the kernels (the reference would unpack the layout every
    call). JOA_GEMV_RECORD=0 / 1 overrides (read when the session loads the model)."""
    return _switch_where_kernels_run(RECORD_ENV)


def _wide(bits: int, wide: bool | None) -> bool:
    """The format a call runs in: dense weights have one; n-bit ones follow `wide`, else the env."""
    if bits == DENSE_BITS:
        return False
    return nbits_wide() if wide is None else bool(wide)


@functools.cache
def sm90() -> bool:
    """Whether the GPU is sm_90+ (thread-block clusters, 227 KB of shared memory a CTA), which the
    plan may use; the handler asks the device the same question.

    Without a GPU visible to jax it answers True (the kernels never run there; shapes are judged as
    for the H200)."""
    try:
        dev = jax.devices("gpu")[0]
    except (RuntimeError, ValueError, IndexError):
        return True
    try:
        return int(str(getattr(dev, "compute_capability", "9")).split(".")[0]) >= 9
    except ValueError:
        return True


def gemv_plan(rows: int, n_rows: int, k: int, bits: int, gated: bool, norm: bool = False,
              cluster: int = 0, warps_k: int = 0, wide: bool | None = None, block_size: int = 0,
              slots: bool = False, rows_layout: bool = False, warps_n: int = 0,
              depth: int = 0, occupancy: int = 0, record_layout: bool = False) -> dict:
    """The engine's launch plan for x [rows, k] against a weight of n_rows rows of `bits`-bit
    elements (16: dense; 8, 4: MatMulNBits), with the RMS-norm prologue or not, as a dict (ffi/kernels/gemv/plan.h: grid, warp
    layout, cluster, ring stages, shared memory, the model's estimate in µs). 'error' is None when
    the engine takes the shape, else why not. cluster / warps_k > 0 force that choice (sweeps).
    wide: n-bit weights in the two-piece format; None: `nbits_wide()`. slots (with the weights'
    block_size): whether one row may take a one-row kernel, the slots kernel for 4-bit wide
    weights, the dense row kernel for dense ones ('slots' / 'dense_row' in the dict say whether it
    does). rows_layout: 4-bit weights in the rows layout (`ops.linear.to_rows_layout`) on the rows
    kernel (ffi/kernels/gemv/rows.cuh; 'rows_layout' in the dict); cluster, warps_n, depth,
    occupancy > 0 force its K split, warps a CTA, W stages in flight a warp and the CTAs an SM its
    registers are capped for ('ctas_per_sm'). record_layout: one row of 4-bit weights in the record
    layout (`ops.linear.to_record_layout`) on the slots kernel reading records ('record_layout' in
    the dict; the slots kernel's geometry). Raises RuntimeError without the compiled extension."""
    return _plan(int(rows), int(n_rows), int(k), int(bits), bool(gated), bool(norm), int(cluster),
                 int(warps_k), _wide(bits, wide) and not rows_layout, int(block_size), bool(slots),
                 bool(rows_layout), int(warps_n), int(depth), int(occupancy), bool(record_layout))


@functools.cache
def _plan(rows, n_rows, k, bits, gated, norm, cluster, warps_k, wide, block_size, slots, rows_layout,
          warps_n, depth, occupancy, record_layout) -> dict:
    if _ffi is None or not hasattr(_ffi, "gemv_plan"):
        raise RuntimeError("the compiled extension jax_onnx_attn._ffi (with gemv_plan) is missing")
    if record_layout:  # only an extension that knows the layout is asked about it
        return dict(_ffi.gemv_plan(rows, n_rows, k, bits, gated, norm, sm90(), cluster, warps_k, wide,
                                   block_size, slots, rows_layout, warps_n, depth, occupancy,
                                   record_layout=True))
    return dict(_ffi.gemv_plan(rows, n_rows, k, bits, gated, norm, sm90(), cluster, warps_k, wide,
                               block_size, slots, rows_layout, warps_n, depth, occupancy))


def unsupported(rows: int, n_rows: int, k: int, bits: int, gated: bool, norm: bool = False,
                block_size: int = 0, cluster: int = 0, warps_k: int = 0,
                wide: bool | None = None) -> str | None:
    """Why the engine does not take this call (None when it does): the plan's reason, or for
    n-bit weights a block_size that is not a power of two >= the K of one 16-byte piece of a lane
    (lane_stride: 32 for 4 bits, 16 for 8, in either format)."""
    try:
        plan = gemv_plan(rows, n_rows, k, bits, gated, norm, cluster, warps_k, wide)
    except RuntimeError as e:
        return str(e)
    if plan["error"]:
        return plan["error"]
    piece_k = plan["lane_stride"]
    if bits != DENSE_BITS and (block_size < piece_k or block_size & (block_size - 1)):
        return (f"block_size {block_size} with {bits}-bit weights: the kernels take powers of two "
                f">= {piece_k}")
    return None


def rows_unsupported(rows: int, n_rows: int, k: int, block_size: int, gated: bool,
                     norm: bool = False, cluster: int = 0, warps_n: int = 0,
                     depth: int = 0, occupancy: int = 0) -> str | None:
    """Why the rows kernel does not take this call of 4-bit weights in the rows layout (None when
    it does): the plan's reason (ffi/kernels/gemv/plan.h's MakeRowsPlan)."""
    try:
        plan = gemv_plan(rows, n_rows, k, 4, gated, norm, cluster, block_size=block_size,
                         rows_layout=True, warps_n=warps_n, depth=depth, occupancy=occupancy)
    except RuntimeError as e:
        return str(e)
    return plan["error"]


def record_unsupported(rows: int, n_rows: int, k: int, block_size: int, gated: bool,
                       norm: bool = False) -> str | None:
    """Why the slots kernel does not take this call of 4-bit weights in the record layout (None
    when it does): the plan's reason (ffi/kernels/gemv/plan.h's MakeRecordPlan: one row of x, N a
    multiple of 16, K of 256, block_size a power of two >= 32, x's K in shared memory)."""
    try:
        plan = gemv_plan(rows, n_rows, k, 4, gated, norm, block_size=block_size, record_layout=True)
    except (RuntimeError, TypeError) as e:  # TypeError: an extension built before the layout
        return str(e)
    return plan["error"]


def qkv_prepare_enabled() -> bool:
    """Whether decode sessions of batch 1 fuse GroupQueryAttention's step preparation into the packed
    QKV projection's epilogue (`linear_gqa_prepare`: one launch and one kernel boundary a layer
    less; `onnx.fusion`'s qkv_prepare). On where the kernels run (H200, bench/results/
    2026-12-05-5323e5a-e2e-qkv-prepare-{1b,8b}.json, B=1 steps: ~1B fp16 1.014 -> 0.991 ms, int4
    0.674 -> 0.633, ~8B fp16 4.296 -> 4.302, the same tokens); elsewhere the reordered rows would only
    cost the reference a gather. JOA_QKV_PREPARE=0 / 1 overrides (read at load, here only)."""
    return _switch_where_kernels_run(QKV_PREPARE_ENV)


def qkv_prepare_unsupported(n_rows: int, k: int, bits: int, norm: bool = False,
                            block_size: int = 0) -> str | None:
    """Why `linear_gqa_prepare` does not take a packed QKV projection of one row of x (None when it
    does): dense weights need the dense row kernel's plan, 4-bit weights the record plan."""
    if bits == DENSE_BITS:
        try:
            plan = gemv_plan(1, n_rows, k, DENSE_BITS, False, norm, slots=True)
        except RuntimeError as e:
            return str(e)
        if plan["error"]:
            return plan["error"]
        return None if plan.get("dense_row") else "the shape has no dense row plan"
    if bits == 4:
        return record_unsupported(1, n_rows, k, block_size, False, norm)
    return f"bits must be {DENSE_BITS} or 4, got {bits}"


def gated_mlp_enabled() -> bool:
    """Whether decode sessions of batch 1 run a dense gated MLP (norm + gate / up + SiLU·up + down +
    residual) as one kernel (`gated_mlp`; `onnx.fusion`'s gated_mlp) rather than two GEMVs. On where
    the kernels run: at 16 warps x 2 steps in flight its K split takes 15-25 µs of kernel time off
    the ~1B fp16 B=1 step on the H100 (1131-1141 -> 1116-1118 µs a step, 92 -> 76 kernels; steps
    1.229 -> 1.193 ms over three rounds, 1.237 -> 1.222 in a second run; bench/results/
    2026-12-05-bcffdf0-e2e-gated-mlp-1b-h100-run{1,2}.json); elsewhere the fused node is the two
    Linears' calls. JOA_GATED_MLP=0 / 1 overrides (read at load, here only)."""
    return _switch_where_kernels_run(GATED_MLP_ENV)


@functools.cache
def sm_count() -> int:
    """The GPU's SMs (the fused MLP's grid is at most one CTA an SM); 132 (an H100 / H200) without a
    GPU visible to jax."""
    try:
        return int(jax.devices("gpu")[0].core_count)
    except (RuntimeError, ValueError, IndexError, AttributeError, TypeError):
        return 132


def gated_mlp_split(split: str | None = None) -> str:
    """The fused MLP's split (K: ffi/kernels/gemv/mlp_row.cuh, N: row_chain.cuh): `split` when given, else
    JOA_GATED_MLP_SPLIT (read at trace time), else "k". "k": CTA c streams the down weight's K slice
    of the h it made, f32 partials reduced after the grid barrier (measured, session 37); "n": h to
    global memory, the barrier in the middle, whole rows of y a CTA, no partials; at the dense row
    kernel's warps, the two GEMVs' bits (the ~1B step no faster than with "k" on the H100, session
    39). ValueError names a split that is neither."""
    if split is None:
        split, what = os.environ.get(GATED_MLP_SPLIT_ENV, "k"), GATED_MLP_SPLIT_ENV
    else:
        what = "gated_mlp: split"
    if split not in GATED_MLP_SPLITS:
        raise ValueError(f"{what} must be one of {GATED_MLP_SPLITS}, got {split!r}")
    return split


def gated_mlp_grid(h: int, inter: int, split: str | None = None) -> int:
    """The fused MLP's CTAs for hidden size h and intermediate size inter on this GPU with
    `gated_mlp_split(split)`, 0 where the kernel does not take the shape or the extension is
    missing (or predates the N split)."""
    split = gated_mlp_split(split)
    if _ffi is None or not hasattr(_ffi, "gated_mlp_workspace"):
        return 0
    return int(_ffi.gated_mlp_grid(int(h), int(inter), sm_count(), split == "n"))


def _row_call(name: str, h: int, dtype, workspace: int):
    """The FFI call of a fused one-row target `name`: results y [1, h] of `dtype` and an f32 workspace
    of `workspace` elements (discarded); under vmap each example is its own call."""
    return jax.ffi.ffi_call(target(name),
                            (jax.ShapeDtypeStruct((1, h), dtype), jax.ShapeDtypeStruct((workspace,), jnp.float32)),
                            vmap_method="sequential")


def gated_mlp(x, w_gate_up, w_down, norm_weight=None, residual=None, *, eps: float = 1e-6,
              split: str | None = None):
    """x [1, H] f16/bf16, w_gate_up [2 I, H] (`ops.interleave_gate_up`), w_down [H, I] -> [1, H]:
    `linear(x, w_gate_up, norm_weight=, gated=True)` then `linear(., w_down, residual=)` in one
    launch (ffi/handlers/gated_mlp.cu). split (`gated_mlp_split`) "k": the down
    projection's f32 sums in another order than the two calls (within the dtype's tolerance of
    them, not the same bits); "n": the two calls' bits. norm_weight [H] and residual [1, H] or
    None. The shape must have a grid (`gated_mlp_grid`); under vmap each example is its own call."""
    split = gated_mlp_split(split)
    h, inter = x.shape[1], w_down.shape[1]
    grid = gated_mlp_grid(h, inter, split)
    if grid == 0:
        raise ValueError(f"gated_mlp: H={h}, I={inter}: the fused MLP kernel ({split} split) does not take "
                         f"this shape")
    n_split = split == "n"
    workspace = int(_ffi.gated_mlp_workspace(int(h), int(inter), grid, n_split))
    call = _row_call("gated_mlp", h, x.dtype, workspace)
    ph = _placeholder(x.dtype)
    y, _ = call(x, w_gate_up, w_down, ph if norm_weight is None else norm_weight,
                ph if residual is None else residual, has_norm=norm_weight is not None,
                has_residual=residual is not None, eps=np.float32(eps), grid=int(grid), n_split=n_split)
    return y


def out_mlp_enabled() -> bool:
    """Whether decode sessions of batch 1 run the attention's output projection and the gated MLP
    after it as one kernel (`out_mlp`; `onnx.fusion`'s out_mlp, on top of gated_mlp). Off: the
    same bits as the separate kernels, but the ~1B fp16 B=1 step is slower with it (H100, session
    40: 1.188 against 1.162 ms; bench/results/2026-12-05-2689bfb-e2e-out-mlp-1b-h100.json).
    JOA_OUT_MLP=1 turns it on (read when a session loads a model, and by `ops.out_mlp`'s "auto"
    route at trace time)."""
    return _switch(OUT_MLP_ENV, "0")


def out_mlp_grid(h: int, ho: int, inter: int) -> int:
    """out_mlp's CTAs for the output projection [h, ho] and the MLP of hidden size h and intermediate
    size inter on this GPU, 0 where the kernel does not take the shapes or the extension is missing
    (or predates it)."""
    if _ffi is None or not hasattr(_ffi, "out_mlp_grid"):
        return 0
    return int(_ffi.out_mlp_grid(int(h), int(ho), int(inter), sm_count()))


def out_mlp(a, w_o, x, w_gate_up, w_down, norm_weight=None, *, eps: float = 1e-6):
    """a [1, Ho] f16/bf16 (the attention's output), w_o [H, Ho], x [1, H] (the residual stream),
    w_gate_up [2 I, H] (`ops.interleave_gate_up`), w_down [H, I] -> [1, H]: x1 = `linear(a, w_o,
    residual=x)`, then `gated_mlp(x1, w_gate_up, w_down, norm_weight, residual=x1)` as one chain of
    three phases in one launch (ffi/handlers/gated_mlp.cu, kernels/gemv/row_chain.cuh): the separate
    dense row kernels' bits (the MLP's as two GEMVs, the N split's). The shapes must have a grid
    (`out_mlp_grid`); under vmap each example is its own call."""
    h, ho, inter = x.shape[1], a.shape[1], w_down.shape[1]
    grid = out_mlp_grid(h, ho, inter)
    if grid == 0:
        raise ValueError(f"out_mlp: H={h}, Ho={ho}, I={inter}: the kernel does not take these shapes")
    workspace = int(_ffi.out_mlp_workspace(int(h), int(inter)))
    call = _row_call("out_mlp", h, x.dtype, workspace)
    y, _ = call(a, w_o, x, w_gate_up, w_down, _placeholder(x.dtype) if norm_weight is None else norm_weight,
                has_norm=norm_weight is not None, eps=np.float32(eps), grid=int(grid))
    return y


def linear_gqa_prepare(x, w, bias, norm_weight, k_cache, v_cache, seqlens_k, cos_cache, sin_cache,
                       position_ids=None, *, num_heads: int, kv_num_heads: int, bits: int = DENSE_BITS,
                       block_size: int = 0, eps: float = 1e-6, pdl: bool = True):
    """A GroupQueryAttention decode step's packed QKV projection and its step preparation in one
    launch (ffi/handlers/linear_gqa_prepare.cu): `linear` (bits 16; `matmul_nbits_record` for bits 4)
    of x [1, K] by w, whose rows are in `ops.linear.rotary_pair_order`, then `cuda.gqa_prepare` on
    the packed query: rotary (not interleaved) at past_b + s (or position_ids), Q out, the K / V
    rows written in place into the float caches [1, Hkv, C, D] (aliased: donate them).

    Returns (q [1, N, 1, D], k_cache, v_cache, status int32 [1]), the bits of the two calls it
    replaces. bias [N] (the same order) and norm_weight [K] (RMS-norm prologue, eps) or None.
    `qkv_prepare_unsupported` says which shapes it takes; under vmap each example is its own call.
    """
    _check_linear_gqa_prepare(x, w, bias, norm_weight, k_cache, v_cache, cos_cache, sin_cache,
                              int(num_heads), int(kv_num_heads), int(bits))
    static = dict(num_heads=int(num_heads), kv_num_heads=int(kv_num_heads), bits=int(bits),
                  block_size=int(block_size), eps=eps, pdl=pdl)
    return partitioning.LINEAR_GQA_PREPARE.apply(
        _linear_gqa_prepare, (x, w, bias, norm_weight, k_cache, v_cache, seqlens_k, cos_cache,
                              sin_cache, position_ids), static, pin=lambda *a: None)


def _check_linear_gqa_prepare(x, w, bias, norm_weight, k_cache, v_cache, cos_cache, sin_cache,
                              num_heads, kv_num_heads, bits):
    """The handler's shape and dtype rules at trace time, naming the operand (the handler's own
    error would come only when the call runs)."""
    from jax_onnx_attn.ops.dtypes import HALF_DTYPES
    from jax_onnx_attn.ops.linear import _check_operands, record_shape  # linear imports this module

    op = "linear_gqa_prepare"

    def bad(name, want, got):
        raise ValueError(f"{op}: {name}: must be {want}, got {got}")

    if x.ndim != 2 or x.shape[0] != 1:
        bad("x", "[1, K] (one decode row)", tuple(x.shape))
    if x.dtype not in HALF_DTYPES:
        bad("x", "float16 or bfloat16", x.dtype)
    k = x.shape[1]
    if k_cache.ndim != 4 or k_cache.shape[:2] != (1, kv_num_heads) or k_cache.dtype != x.dtype:
        bad("k_cache", f"[1, {kv_num_heads}, C, D] in {x.dtype}", f"{tuple(k_cache.shape)} {k_cache.dtype}")
    if v_cache.shape != k_cache.shape or v_cache.dtype != x.dtype:
        bad("v_cache", f"k_cache's {tuple(k_cache.shape)} in {x.dtype}", f"{tuple(v_cache.shape)} {v_cache.dtype}")
    n = (num_heads + 2 * kv_num_heads) * k_cache.shape[3]
    if bits == DENSE_BITS:
        if w.shape != (n, k) or w.dtype != x.dtype:
            bad("w", f"[{n}, {k}] in {x.dtype} ((num_heads + 2 kv_num_heads) D rows)",
                f"{tuple(w.shape)} {w.dtype}")
    elif bits == 4:
        want = record_shape(n, k)
        if w.shape != want or w.dtype != jnp.uint8:
            bad("w", f"uint8 {list(want)} (the record layout)", f"{tuple(w.shape)} {w.dtype}")
    else:
        raise ValueError(f"{op}: bits: must be {DENSE_BITS} or 4, got {bits}")
    _check_operands(op, x, n, "w", False, bias, None, norm_weight)  # bias [N], norm_weight [K]
    for name, t in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        if t.ndim != 2 or t.shape != cos_cache.shape or t.dtype != x.dtype:
            bad(name, f"[max_position, R/2] in {x.dtype}, cos_cache's shape", f"{tuple(t.shape)} {t.dtype}")


def _linear_gqa_prepare(x, w, bias, norm_weight, k_cache, v_cache, seqlens_k, cos_cache, sin_cache,
                        position_ids, *, num_heads, kv_num_heads, bits, block_size, eps, pdl):
    b, _, _, d = k_cache.shape
    call = jax.ffi.ffi_call(
        target("linear_gqa_prepare"),
        (jax.ShapeDtypeStruct((b, num_heads, 1, d), x.dtype),
         jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype), jax.ShapeDtypeStruct((b,), jnp.int32)),
        input_output_aliases={4: 1, 5: 2},
    )
    ph = _placeholder(x.dtype)
    return call(x, w, ph if bias is None else bias, ph if norm_weight is None else norm_weight,
                k_cache, v_cache, seqlens_k.astype(jnp.int32), cos_cache, sin_cache,
                (jnp.zeros((1,), jnp.int32) if position_ids is None else position_ids).astype(jnp.int32),
                num_heads=int(num_heads), kv_num_heads=int(kv_num_heads), bits=int(bits),
                block_size=int(block_size), has_bias=bias is not None,
                has_norm=norm_weight is not None, has_position_ids=position_ids is not None,
                eps=np.float32(eps), pdl=bool(pdl))


def _per_example_plan(bits: int):
    """pin of a folded call (vmap): the per-example plan's cluster and K split, so the folded rows
    are reduced as each example's own call reduces them; None (one call per example) where the
    folded rows leave the engine's plan, or where each example's call takes a one-row kernel
    (slots or dense row: no folded call reduces the same way)."""
    def pin(static, axis_size, x, w, *rest):
        rows, n_rows, k = x.shape[0], w.shape[0], x.shape[1]
        norm = rest[-1] is not None
        wide = static.get("wide")
        plan = gemv_plan(rows, n_rows, k, bits, static["gated"], norm, static["cluster"],
                         static["warps_k"], wide, static.get("block_size", 0), static.get("slots", False))
        if plan["error"] or plan["slots"] or plan["dense_row"]:
            return None
        folded = gemv_plan(axis_size * rows, n_rows, k, bits, static["gated"], norm,
                           plan["cluster"], plan["warps_k"], wide)
        if folded["error"]:
            return None
        return dict(cluster=plan["cluster"], warps_k=plan["warps_k"])
    return pin


#: The environment variable that picks how the n-bit kernels' layout is chosen: "stream" (default:
#: plan.h's model of the weight stream alone) or "issue" (an experiment: also the instruction
#: issue of the busiest SM, see `issue_aware_layout`).
PLAN_MODEL_ENV = "JOA_GEMV_PLAN_MODEL"
# Static SASS instructions a warp issues per KB of W in the chunk loop (docs/kernels.md, M = 1,
# f16): (bits, wide) -> count. Dense is ~70.
_INSTR_PER_KB = {(16, False): 70.0, (8, False): 266.0, (8, True): 177.0, (4, False): 336.0,
                 (4, True): 250.0}
_ISSUE_PER_WARP = 0.25   # instructions a cycle one warp of the dependent dequantise + MMA chain issues
_ISSUE_PER_SM = 2.8      # instructions a cycle an SM sustains (4 schedulers, ~0.7 each)
_CLOCK_MHZ = 1980.0      # the H200's SM clock under load


def plan_model() -> str:
    """How the n-bit kernels' warp layout is chosen (JOA_GEMV_PLAN_MODEL, read at trace time)."""
    value = os.environ.get(PLAN_MODEL_ENV, "stream")
    if value not in ("stream", "issue"):
        raise ValueError(f"{PLAN_MODEL_ENV} must be 'stream' or 'issue', got {value!r}")
    return value


def issue_estimate_us(plan: dict) -> float:
    """The plan's time with the busiest SM's instruction issue counted: its warps' chunk loops
    (instructions per KB x KB a warp streams) at the issue rate its warps can sustain, against
    plan.h's weight-stream estimate; the larger. Why: the 1B int4 gate-up projection (2048 x 16384)
    ran 15 µs (1.1 TB/s) on one CTA of 8 warps an SM, where the stream model saw no cost in
    leaving half the SM's warp slots empty (in-graph profile, session 6)."""
    kb = (2.0 if plan["pieces"] == 2 or plan["bits"] == DENSE_BITS else 1.0)
    per_warp = plan["waves"] * plan["cpp"] * kb * _INSTR_PER_KB[(plan["bits"], bool(plan["wide"]))]
    busiest = -(-plan["grid"] // 132)
    warps = busiest * 8
    issue = min(_ISSUE_PER_SM, warps * _ISSUE_PER_WARP)
    compute_us = warps * per_warp / (issue * _CLOCK_MHZ)
    return max(plan["est_us"], compute_us)


@functools.cache
def issue_aware_layout(rows: int, n_rows: int, k: int, bits: int, gated: bool, norm: bool,
                       wide: bool) -> tuple[int, int]:
    """(cluster, warps_k) with the least `issue_estimate_us` among the plans the engine takes
    (ties within 1%: fewer K parts); (0, 0) when none does (the handler then reports why)."""
    best, best_us = (0, 0), None
    for cluster in (1, 2, 4, 8, 16):
        for warps_k in (1, 2, 4, 8):
            plan = gemv_plan(rows, n_rows, k, bits, gated, norm, cluster, warps_k, wide)
            if plan["error"] or cluster * warps_k > plan["kc"]:
                continue
            us = issue_estimate_us(plan)
            if best_us is None or us < 0.99 * best_us:
                best, best_us = (cluster, warps_k), us
    return best


def matmul_nbits_rows(x, w, scales, zero_points=None, bias=None, residual=None, norm_weight=None,
                      *, n: int, block_size: int, eps: float = 1e-6, gated: bool = False,
                      pdl: bool = False, cluster: int = 0, warps_n: int = 0, depth: int = 0,
                      occupancy: int = 0):
    """x [M, K] f16/bf16 against 4-bit weights in the rows layout (`ops.linear.to_rows_layout`): w
    uint8 [ceil(N / 64), K / 16, 512], scales [ceil(N / 64), K / block_size, 64] of x's dtype,
    zero_points uint8 of that shape or None -> [M, N_out]; N = n W rows (2 N_out when gated).

    Semantics of `jax_onnx_attn.ops.reference.linear.matmul_nbits` on the weights
    `ops.linear.from_rows_layout` gives back. The rows kernel (ffi/kernels/gemv/rows.cuh) dequantises
    each weight to x's dtype as the reference does. cluster / warps_n / depth / occupancy > 0 force
    its plan (sweeps; occupancy 1 or 2 CTAs of 256 threads an SM, the kernel's register cap); other
    arguments as `matmul_nbits`. The plan's depth and occupancy change no bits.
    """
    static = dict(n=n, block_size=block_size, eps=eps, gated=gated, pdl=pdl, cluster=cluster,
                  warps_n=warps_n, depth=depth, occupancy=occupancy)
    return partitioning.MATMUL_NBITS_ROWS.apply(
        _matmul_nbits_rows, (x, w, scales, zero_points, bias, residual, norm_weight), static,
        pin=_rows_pin)


def _rows_pin(static, axis_size, x, w, *rest):
    """pin of a folded rows-kernel call (vmap): the per-example plan's K split, warps, depth and
    occupancy, so each example's rows are summed as its own call sums them (the same bits: the
    kernel's sums, the RMS-norm prologue's included, do not depend on a row's place among the
    rows); None (one call per example) where the folded rows leave the kernel's plan (more than
    32, or more than occupancy 2 takes)."""
    rows, k, norm = x.shape[0], x.shape[1], rest[-1] is not None
    plan = gemv_plan(rows, static["n"], k, 4, static["gated"], norm, static["cluster"],
                     block_size=static["block_size"], rows_layout=True, warps_n=static["warps_n"],
                     depth=static["depth"], occupancy=static["occupancy"])
    if plan["error"]:
        return None
    pinned = dict(cluster=plan["cluster"], warps_n=plan["warps_n"], depth=plan["stages"],
                  occupancy=plan["ctas_per_sm"])
    folded = gemv_plan(axis_size * rows, static["n"], k, 4, static["gated"], norm,
                       block_size=static["block_size"], rows_layout=True, **pinned)
    if folded["error"]:
        return None
    return pinned


def _matmul_nbits_rows(x, w, scales, zero_points, bias, residual, norm_weight, *, n, block_size, eps,
                       gated, pdl, cluster, warps_n, depth, occupancy):
    return _nbits_call(x, w, scales, zero_points, bias, residual, norm_weight, n_out=n // 2 if gated else n,
                       bits=4, block_size=block_size, eps=eps, gated=gated, pdl=pdl, cluster=cluster,
                       warps_k=0, wide=False, slots=False, rows=True, warps_n=warps_n, depth=depth,
                       occupancy=occupancy)


def matmul_nbits_record(x, rec, bias=None, residual=None, norm_weight=None, *, n: int, block_size: int,
                        eps: float = 1e-6, gated: bool = False, pdl: bool = False):
    """x [1, K] f16/bf16 against 4-bit weights in the record layout (`ops.linear.to_record_layout`):
    rec uint8 [N / 16, K / 256, 2432] holding W, its scales (x's dtype) and zero points -> [1, N_out];
    N = n W rows (2 N_out when gated).

    Semantics of `jax_onnx_attn.ops.reference.linear.matmul_nbits` on the weights
    `ops.linear.from_record_layout` gives back; the slots kernel's plan and sums (the same bits as
    `matmul_nbits` on the same weight in the wide format with tiled metadata on the slots kernel).
    Other arguments as `matmul_nbits`. Under vmap each example is its own call (the kernel takes one
    row)."""
    static = dict(n=n, block_size=block_size, eps=eps, gated=gated, pdl=pdl)
    return partitioning.MATMUL_NBITS_RECORD.apply(
        _matmul_nbits_record, (x, rec, bias, residual, norm_weight), static, pin=lambda *a: None)


def _matmul_nbits_record(x, rec, bias, residual, norm_weight, *, n, block_size, eps, gated, pdl):
    return _nbits_call(x, rec, None, None, bias, residual, norm_weight, n_out=n // 2 if gated else n,
                       bits=4, block_size=block_size, eps=eps, gated=gated, pdl=pdl, cluster=0,
                       warps_k=0, wide=True, slots=True, rows=False, warps_n=0, depth=0, occupancy=0,
                       record_layout=True)


def _nbits_call(x, w, scales, zero_points, bias, residual, norm_weight, *, n_out, bits, block_size, eps,
                gated, pdl, cluster, warps_k, wide, slots, rows, warps_n, depth, occupancy,
                record_layout=False):
    """The matmul_nbits FFI call (ffi/handlers/matmul_nbits.cu): absent operands as placeholders
    with their has_* flags, every attribute as the handler binds it."""
    call = jax.ffi.ffi_call(target("matmul_nbits"), jax.ShapeDtypeStruct((x.shape[0], n_out), x.dtype))
    ph = _placeholder(x.dtype)
    return call(x, w, ph if scales is None else scales,
                jnp.zeros((1,), jnp.uint8) if zero_points is None else zero_points,
                ph if bias is None else bias, ph if residual is None else residual,
                ph if norm_weight is None else norm_weight,
                bits=int(bits), block_size=int(block_size), has_zero_points=zero_points is not None,
                has_bias=bias is not None, has_residual=residual is not None,
                has_norm=norm_weight is not None, gated=bool(gated), eps=np.float32(eps),
                cluster=int(cluster), warps_k=int(warps_k), wide=bool(wide), pdl=bool(pdl),
                slots=bool(slots), rows=bool(rows), warps_n=int(warps_n), depth=int(depth),
                occupancy=int(occupancy), record_layout=bool(record_layout))


def _placeholder(dtype):
    return jnp.zeros((1,), dtype)


def linear(x, w, bias=None, residual=None, norm_weight=None, *, eps: float = 1e-6,
           gated: bool = False, pdl: bool = False, cluster: int = 0, warps_k: int = 0):
    """x [M, K] f16/bf16, w [N, K] -> [M, N_out] (N_out = N / 2 when gated).

    Semantics of `jax_onnx_attn.ops.reference.linear.linear`. bias [N], residual [M, N_out],
    norm_weight [K] or None. pdl: programmatic dependent launch (W is read before the previous
    kernel has finished: only for weights no kernel of the program writes). cluster / warps_k > 0
    override the plan. One row takes the dense row kernel where the plan has it and
    `dense_row_enabled()` (decided here at trace time; results within the dtype's tolerance of the
    ring kernel's, not the same bits).
    """
    static = dict(eps=eps, gated=gated, pdl=pdl, cluster=cluster, warps_k=warps_k,
                  slots=dense_row_enabled())
    return partitioning.LINEAR.apply(_linear, (x, w, bias, residual, norm_weight), static,
                                     pin=_per_example_plan(DENSE_BITS))


def _linear(x, w, bias, residual, norm_weight, *, eps, gated, pdl, cluster, warps_k, slots):
    m, n = x.shape[0], w.shape[0]
    n_out = n // 2 if gated else n
    call = jax.ffi.ffi_call(target("linear"), jax.ShapeDtypeStruct((m, n_out), x.dtype))
    ph = _placeholder(x.dtype)
    return call(x, w, ph if bias is None else bias, ph if residual is None else residual,
                ph if norm_weight is None else norm_weight,
                has_bias=bias is not None, has_residual=residual is not None,
                has_norm=norm_weight is not None, gated=bool(gated), eps=np.float32(eps),
                cluster=int(cluster), warps_k=int(warps_k), pdl=bool(pdl), slots=bool(slots))


@functools.cache
def meta_tile_rows() -> int:
    """W rows per tile of the kernels' scale / zero-point layout (`ops.tile_nbits_meta`): the GEMV
    engine's kMetaTileRows (ffi/kernels/gemv/plan.h), asked from the extension."""
    if _ffi is None:
        raise RuntimeError("the compiled extension jax_onnx_attn._ffi (with limits) is missing")
    return int(_ffi.limits()["gemv"]["meta_tile_rows"])


def tiled_meta_shape(n_rows: int, k_blocks: int) -> tuple[int, int, int]:
    """The shape of tiled scales / zero points of an [n_rows, k_blocks] MatMulNBits weight."""
    rows = meta_tile_rows()
    return (-(-n_rows // rows), k_blocks, rows)


def matmul_nbits(x, b_quant, scales, zero_points=None, bias=None, residual=None, norm_weight=None,
                 *, bits: int, block_size: int, eps: float = 1e-6, gated: bool = False,
                 pdl: bool = False, cluster: int = 0, warps_k: int = 0, wide: bool | None = None):
    """x [M, K] f16/bf16, b_quant uint8 [N, K / block_size, block_size * bits / 8], scales
    [ceil(N / 16), k_blocks, 16] of x's dtype and zero_points uint8 of that shape or None, tiled by
    `jax_onnx_attn.ops.linear.tile_nbits_meta` -> [M, N_out].

    Semantics of `jax_onnx_attn.ops.reference.linear.matmul_nbits`; other arguments as `linear`.
    wide: the two-piece n-bit format (same results; a speed choice); None: `nbits_wide()`, decided
    here at trace time, as is `slots_enabled()` (the slots kernel for one row of 4-bit wide weights:
    results within the dtype's tolerance of the ring kernel's, not the same bits).
    """
    want = tiled_meta_shape(b_quant.shape[0], b_quant.shape[1])
    for name, meta in (("scales", scales), ("zero_points", zero_points)):
        if meta is not None and tuple(meta.shape) != want:
            raise ValueError(f"matmul_nbits: {name} must be tiled {list(want)} "
                             f"(ops.tile_nbits_meta), got {list(meta.shape)}")
    static = dict(bits=bits, block_size=block_size, eps=eps, gated=gated, pdl=pdl,
                  cluster=cluster, warps_k=warps_k, wide=_wide(bits, wide), slots=slots_enabled())
    return partitioning.MATMUL_NBITS.apply(
        _matmul_nbits, (x, b_quant, scales, zero_points, bias, residual, norm_weight), static,
        pin=_per_example_plan(bits))


def _matmul_nbits(x, b_quant, scales, zero_points, bias, residual, norm_weight, *, bits, block_size,
                  eps, gated, pdl, cluster, warps_k, wide, slots):
    m, n = x.shape[0], b_quant.shape[0]
    n_out = n // 2 if gated else n
    if cluster == 0 and warps_k == 0 and plan_model() == "issue":
        cluster, warps_k = issue_aware_layout(m, n, x.shape[1], bits, gated, norm_weight is not None,
                                              bool(wide))
    return _nbits_call(x, b_quant, scales, zero_points, bias, residual, norm_weight, n_out=n_out, bits=bits,
                       block_size=block_size, eps=eps, gated=gated, pdl=pdl, cluster=cluster,
                       warps_k=warps_k, wide=wide, slots=slots, rows=False, warps_n=0, depth=0,
                       occupancy=0)
