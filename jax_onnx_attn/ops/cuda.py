"""CUDA backend: one thin `jax.ffi.ffi_call` wrapper per FFI target of `jax_onnx_attn._ffi`.

Inputs reach these wrappers already validated and in the kernels' layout (the public ops in
`jax_onnx_attn.ops` do that). Caches are aliased to their outputs (`input_output_aliases`) so a
donated cache is updated in place. Every handler is command-buffer compatible.

Each wrapper runs under its target's rule (`ops.partitioning`): under `jax.vmap` the mapped axis
joins the batch axis (one launch), under a sharded `jax.jit` the call splits over batch and heads
and each device launches the kernel on its shard.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn import _extension
from jax_onnx_attn._extension import target
from jax_onnx_attn.ops import partitioning
from jax_onnx_attn.ops.dtypes import HALF_DTYPES


def kv_append(cache, new, start):
    """cache [B, H, C, D] (aliased), new [B, H, S, D], start int32 [B] -> (cache, status int32 [B])."""
    return partitioning.KV_APPEND.apply(_kv_append, (cache, new, start.astype(jnp.int32)))


def _kv_append(cache, new, start):
    b = cache.shape[0]
    call = jax.ffi.ffi_call(
        target("kv_append"),
        (jax.ShapeDtypeStruct(cache.shape, cache.dtype), jax.ShapeDtypeStruct((b,), jnp.int32)),
        input_output_aliases={0: 0},
    )
    return call(cache, new, start)


# --- the kernels' limits and the decode plan: asked from the extension ---------------------------
# ffi/kernels/decode/plan.h and ffi/kernels/general/params.h define them once (host-only C++, also in a
# build without CUDA); `_ffi.limits()` and `_ffi.decode_plan(...)` export them. Nothing here
# re-derives a kernel rule.

def _limits() -> dict:
    found = _extension.limits()
    if found is None:
        raise RuntimeError(f"the kernels' limits are unknown: {_extension.build_info()['reason']}")
    return found


#: Module attributes read from the extension's limits on first use (PEP 562).
_LIMITS = {
    "DECODE_BLOCK_N": lambda lim: lim["decode"]["block_n"],          # KV rows per split step
    "DECODE_MAX_SPLITS": lambda lim: lim["decode"]["max_splits"],    # most splits of one call
    "DECODE_HEAD_DIMS": lambda lim: tuple(lim["decode"]["head_dims"]),
    "DECODE_MAX_CLUSTER_SPLITS": lambda lim: lim["decode"]["max_cluster_splits"],
    "_CLUSTER_PLANS": lambda lim: tuple(tuple(c) for c in lim["decode"]["cluster_plans"]),
    # How the planner sizes a cluster plan (plan.h PlanPolicy), indexed by its value; the first is
    # the default.
    "DECODE_PLAN_POLICIES": lambda lim: tuple(lim["decode"]["plan_policies"]),
    # Softmax dtypes of the general kernel, indexed by its SoftmaxType.
    "GENERAL_SOFTMAX_DTYPES": lambda lim: tuple(jnp.dtype(t) for t in lim["general"]["softmax_types"]),
    "GENERAL_MAX_KEYS": lambda lim: lim["general"]["max_keys"],
    "PREFILL_HEAD_DIMS": lambda lim: tuple(lim["prefill"]["head_dims"]),
    # Per head size: {"padded": tile / O width, "block_n": keys per step, "stages": K / V ring,
    # "schedule": the default schedule} (params.h TilingFor; 80 and 96 run in 128-wide tiles, 256
    # in 80-key tiles).
    "PREFILL_TILING": lambda lim: {int(d): dict(t) for d, t in lim["prefill"]["tiling"].items()},
    # The prefill engine's consumer schedules, indexed by its Schedule value.
    "PREFILL_SCHEDULES": lambda lim: tuple(lim["prefill"]["schedules"]),
    # Most split-KV splits of one prefill call (ffi/kernels/prefill/plan.h kMaxSplits).
    "PREFILL_MAX_SPLITS": lambda lim: lim["prefill"]["max_splits"],
}


def __getattr__(name: str):
    if name in _LIMITS:
        return _LIMITS[name](_limits())
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@functools.cache
def _cluster_capable() -> bool:
    """Whether the local GPU runs thread-block clusters (sm_90+); False without a GPU. The one device
    query the plan depends on."""
    try:
        dev = jax.devices("gpu")[0]
        return int(str(getattr(dev, "compute_capability", "0")).split(".")[0]) >= 9
    except (RuntimeError, ValueError, IndexError):
        return False


#: The decode planner's policy (plan.h PlanPolicy, one of DECODE_PLAN_POLICIES): unset or "wave"
#: is the default (cluster plans capped by one wave of clusters; B=1 at head dim 128 on splits of
#: >= 4 tiles and the combine kernel); "fit" lets a capped cluster's splits grow instead of falling
#: back to the split plan; "ladder" is the uncapped plan of sessions 14-26, kept for A/B runs
#: (issue 15, docs/kernels.md "The decode engine").
PLAN_POLICY_ENV = "JOA_DECODE_PLAN"


def decode_plan_policy() -> str | None:
    """The plan policy of decode calls that name none: JOA_DECODE_PLAN, or None when unset (the
    planner's default, the first of DECODE_PLAN_POLICIES). The one place the switch is read, at
    trace time; the plan checks the name."""
    return os.environ.get(PLAN_POLICY_ENV) or None


def decode_plan(batch: int, q_heads: int, kv_heads: int, q_len: int, capacity: int, head_dim: int,
                kv_bits: int = 0, split_rows: int | None = None, cluster: bool | None = None,
                cluster_capable: bool | None = None, policy: str | None = None,
                tile128: bool = False, quant_regs: bool | None = False) -> dict:
    """The decode engine's plan for a call (ffi/kernels/decode/plan.h, through `_ffi.decode_plan`): a
    pure function of static shapes, so one call shape always gets the same bits.

    Returns {split_rows, splits, cluster, workspace_elems, block_rows, ctas_per_sm, tile_rows,
    quant_regs}.
    split_rows / cluster override the planner (None: it chooses; it offers a cluster only with
    split_rows None, a float cache (or a quantised one with quant_regs) and a GPU that runs
    clusters, `cluster_capable`, None: this
    process's GPU). policy: how a cluster plan is sized, one of DECODE_PLAN_POLICIES (None:
    `decode_plan_policy()`; an unknown name raises ValueError). tile128: the plan of the wide KV tile
    (`decode_tile128`; where it applies its splits are whole 128-row tiles, tile_rows 128).
    quant_regs: the kernel of an int8 / int4 cache: False the tile kernel (dequantising into shared
    memory), True the register-dequantising one, None the faster of the two for the call's size
    (plan.h `QuantPath`; the register kernel where the call streams enough KV rows). The plan's
    quant_regs says which runs (False for a float cache); its splits fill that kernel's CTA slots.
    """
    if cluster_capable is None:
        cluster_capable = _cluster_capable()
    return _decode_plan(int(batch), int(q_heads), int(kv_heads), int(q_len), int(capacity),
                        int(head_dim), int(kv_bits), int(split_rows or 0),
                        -1 if cluster is None else int(bool(cluster)), bool(cluster_capable),
                        policy or decode_plan_policy(), bool(tile128),
                        0 if not kv_bits else 1 if quant_regs is None else 2 * bool(quant_regs))


@functools.cache
def _decode_plan(batch, q_heads, kv_heads, q_len, capacity, head_dim, kv_bits, split_rows, cluster,
                 cluster_capable, policy, tile128=False, quant_path=0) -> dict:
    policies = __getattr__("DECODE_PLAN_POLICIES")
    if policy is not None and policy not in policies:
        raise ValueError(f"decode plan policy {policy!r} ({PLAN_POLICY_ENV}): must be one of {policies}")
    # The keywords only when set: the plan without them is the same in every build of the extension.
    wide = dict(tile128=True) if tile128 else {}
    if quant_path:
        wide["quant_path"] = quant_path
    return _extension.decode_plan(
        batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_len=q_len, capacity=capacity,
        head_dim=head_dim, kv_bits=kv_bits, cluster_capable=cluster_capable, split_rows=split_rows,
        cluster=cluster, policy=0 if policy is None else policies.index(policy), **wide)


def decode_split_rows(batch: int, kv_heads: int, rows: int, capacity: int, head_dim: int,
                      kv_bits: int = 0) -> int:
    """KV rows per split of the plan without a cluster, for `rows` = (Hq / Hkv) * S packed rows."""
    return decode_plan(batch, kv_heads * rows, kv_heads, 1, capacity, head_dim, kv_bits,
                       cluster=False)["split_rows"]


def decode_cluster_split_rows(batch: int, kv_heads: int, rows: int, capacity: int,
                              head_dim: int = 128, policy: str | None = None) -> int | None:
    """KV rows per split when the plan combines the splits inside a thread-block cluster (on a GPU
    that runs clusters, a float cache), else None."""
    plan = decode_plan(batch, kv_heads * rows, kv_heads, 1, capacity, head_dim, 0,
                       cluster_capable=True, policy=policy)
    return plan["split_rows"] if plan["cluster"] else None


# --- decode attention (ffi/handlers/decode_attention.cu, engine in ffi/kernels/decode/) -----------

#: The switch of the register-dequantising path for int8 / int4 caches (engine_qregs.cuh): on by
#: default, where the plan finds it faster (calls of enough KV rows: 1.3-1.9x the tile path's speed
#: on the H200, slower below; plan.h kQuantRegsMinRows); "0" always dequantises tile by tile in
#: shared memory (docs/kernels.md, "Quantised caches").
QUANT_REGS_ENV = "JOA_DECODE_QUANT_REGS"


def decode_quant_regs() -> bool:
    """Whether decode_attention may dequantise an int8 / int4 cache in registers (the default: where
    the plan finds it faster; JOA_DECODE_QUANT_REGS=0: always tile by tile in shared memory): the
    one place the switch is read, at trace time."""
    return os.environ.get(QUANT_REGS_ENV, "1") != "0"


#: The switch of the cursor loads for float caches (DenseCursorKv, kv_format.cuh): "1" / "0" force
#: copying K / V tiles from per-thread row cursors or by strided addresses; unset, head dim 128 takes
#: the cursors (issue 15, docs/kernels.md "The decode engine"). The same bits either way.
CURSOR_LOADS_ENV = "JOA_DECODE_CURSOR_LOADS"

#: Head dims whose float caches take the cursor loads by default. Measured on the H200 (fp16, 32/8,
#: bench/results/2026-12-02-42c28fd-decode-b8-ab.json): d128 B=1 2k / 4k / 8k 10.8 -> 10.3, 14.1 ->
#: 13.4, 21.2 -> 19.1 us, B=8 2k 36.4 -> 32.7; d64 mixed (B=1 2k 8.0 -> 8.3, 4k 10.0 -> 9.6).
CURSOR_LOADS_HEAD_DIMS = (128,)


def decode_cursor_loads(head_dim: int) -> bool:
    """Whether decode_attention copies a float cache's tiles through per-thread row cursors: the one
    place the switch (JOA_DECODE_CURSOR_LOADS) and the default rule are read, at trace time."""
    forced = os.environ.get(CURSOR_LOADS_ENV)
    if forced in ("0", "1"):
        return forced == "1"
    return head_dim in CURSOR_LOADS_HEAD_DIMS


#: The switch of the producer warp for float caches (DenseProducerKv, kv_format.cuh): "1" has one
#: extra warp of each CTA issue the K / V copies into an mbarrier ring while the other warps only
#: compute (sm_90; the handler ignores it on other GPUs, like the cursor loads where they do not
#: apply). Off unless set (issue 15, docs/kernels.md "The decode engine"). The same bits either way.
PRODUCER_ENV = "JOA_DECODE_PRODUCER"


def decode_producer() -> bool:
    """Whether decode_attention copies a float cache's tiles by a producer warp: the one place the
    switch (JOA_DECODE_PRODUCER) is read, at trace time; off by default."""
    return os.environ.get(PRODUCER_ENV) == "1"


#: The switch of the wide KV tile for float caches (LaunchOptions::tile128, WideTileKv, plan.h
#: kWideTileN): "1" streams a 16-row block's (G * S <= 16) K / V in 128-row tiles, each of the 4
#: warps taking 32 columns in one softmax update, at head dims 64 and 128 (others keep their tiles),
#: and plans its splits in whole 128-row tiles. Off unless set (issue 15 / 12, docs/kernels.md "The
#: decode engine"). Not the default tile's bits: one softmax update a 128 rows instead of a 64.
TILE128_ENV = "JOA_DECODE_TILE128"


def decode_tile128() -> bool:
    """Whether decode_attention streams a float cache in the wide (128-row) KV tile: the one place
    the switch (JOA_DECODE_TILE128) is read, at trace time; off by default."""
    return os.environ.get(TILE128_ENV) == "1"


#: The switch of the register kernel's key-rows form (key_rows.cuh, LaunchOptions::key_rows): where
#: an int8 / int4 cache is dequantised in registers and a block holds at most KEY_ROWS_MAX_ROWS
#: query rows (G * S: every GQA decode step up to 8 query heads a KV head), keys are the rows of the
#: kernel's MMAs and the query rows its 8 columns: half the MMAs and score work of the query-rows
#: form (4 of an MMA's 16 rows at 32/8). On unless "0" (issue 15, docs/kernels.md "Quantised
#: caches", session 30: B=8 128k int4 379 -> 323 us on the H200). Not the query-rows form's bits
#: (the sums add in another order).
KEY_ROWS_ENV = "JOA_DECODE_KEY_ROWS"
KEY_ROWS_MAX_ROWS = 8


def decode_key_rows() -> bool:
    """Whether decode_attention's register kernel takes keys as its MMA rows where a block allows
    (KEY_ROWS_MAX_ROWS query rows at most): the one place the switch (JOA_DECODE_KEY_ROWS) is read,
    at trace time; on by default."""
    return os.environ.get(KEY_ROWS_ENV, "1") != "0"


#: Few-query steps on the prefill engine (issue 14): a decode / verify step whose packed query rows
#: (Hq / Hkv x S) fill the prefill engine's 128-row tiles well enough runs on it instead of the
#: decode engine's ldmatrix layout (every warp of which re-reads each K / V tile). The rule
#: (`decode_engine`) is a pure function of static shapes; JOA_DECODE_ENGINE ("decode" / "prefill")
#: forces one for A/B runs. Measured on the H200: docs/kernels.md "Few-query steps".
DECODE_ENGINE_ENV = "JOA_DECODE_ENGINE"
DECODE_ENGINES = ("decode", "prefill")
#: The fewest packed rows (Hq / Hkv x S) a step needs for the prefill engine.
FEW_QUERY_MIN_ROWS = 64


def decode_engine(q_heads: int, kv_heads: int, q_len: int) -> str:
    """Which engine runs a decode step of these static shapes where both cover it: "prefill" when
    the step has at least FEW_QUERY_MIN_ROWS packed rows (its split-KV plan fills the GPU at any
    batch), else "decode"; JOA_DECODE_ENGINE forces one (read at trace time).

    Measured on the H200 (bf16 32/8, µs decode / prefill engine with split-KV;
    bench/results/2026-12-02-a7544ee-decode-fewquery.json): d128 q_len 16 (64 rows) B=1 4k 28.9 /
    17.5, B=1 32k 83.8 / 45.2, B=8 32k 472.6 / 282.7; q_len 32 B=8 32k 947.6 / 286.3; d64 q_len 16
    B=8 32k 309.3 / 189.6; q_len 4 (16 rows) mixed: B=1 4k 14.7 / 16.6, B=8 32k d64 152.3 / 188.2."""
    forced = os.environ.get(DECODE_ENGINE_ENV)
    if forced:
        if forced not in DECODE_ENGINES:
            raise ValueError(f"{DECODE_ENGINE_ENV}={forced!r}: must be one of {DECODE_ENGINES}")
        return forced
    return "prefill" if (q_heads // kv_heads) * q_len >= FEW_QUERY_MIN_ROWS else "decode"


def _prefill_engine_refuses(q, bias, kv_bits, pos_shift, split_rows, cluster) -> str | None:
    """Why a decode step cannot run on the prefill engine (None: it can)."""
    if kv_bits:
        return "a quantised cache (the prefill engine reads float caches)"
    if bias is not None:
        return "a bias (the prefill engine has none)"
    if pos_shift:
        return "pos_shift (the prefill engine places rows bottom-right)"
    if split_rows is not None or cluster is not None:
        return "split_rows / cluster name a decode-engine plan"
    if q.shape[-1] not in __getattr__("PREFILL_HEAD_DIMS"):
        return f"head size {q.shape[-1]} (the prefill engine has {__getattr__('PREFILL_HEAD_DIMS')})"
    from jax_onnx_attn.ops.decode_paths import prefill_engine_available
    if not prefill_engine_available():
        return "the prefill engine runs on sm_90 only"
    return None


def decode_attention(q, k_cache, v_cache, kv_len, bias=None, sink=None, k_scale=None, v_scale=None,
                     *, scale: float, softcap: float = 0.0, causal: bool = True, left: int = -1,
                     right: int = -1, pos_shift: int = 0, kv_bits: int = 0,
                     split_rows: int | None = None, pdl: bool = True, cluster: bool | None = None,
                     quant_regs: bool | None = None, plan_policy: str | None = None,
                     cursor_loads: bool | None = None, producer: bool | None = None,
                     tile128: bool | None = None, engine: str | None = None,
                     key_rows: bool | None = None):
    """q [B, Hq, S, D] f16/bf16, k_cache / v_cache [B, Hkv, C, D], kv_len int32 [B] -> [B, Hq, S, D].

    Semantics of `jax_onnx_attn.ops.reference.decode.decode_attention`. bias: None or
    [B|1, Hq|1, S|1, T] f32/f16/bf16/bool; sink: None or [Hq]. kv_bits 8: int8 caches
    [B, Hkv, C, D]; 4: uint8 [B, Hkv, C, D / 2]; both with float k_scale / v_scale of 1 element
    (per tensor) or Hkv·D elements (per channel, e.g. [1, Hkv, 1, D]). split_rows and cluster
    override the plan (`decode_plan`: split_rows a multiple of DECODE_BLOCK_N; cluster combines the
    splits inside a thread-block cluster, sm_90+, <= 16 splits of a 16-row block); pdl launches the
    combine as a programmatic dependent launch. quant_regs: True dequantises a quantised cache in
    registers, False tile by tile in shared memory, None as `decode_quant_regs()` allows (the
    JOA_DECODE_QUANT_REGS switch, on by default: the faster of the two for the call's size, as
    `decode_plan` decides); ignored for a float cache. plan_policy: how the
    planner sizes a cluster plan, one of DECODE_PLAN_POLICIES (None: `decode_plan_policy()`, the
    JOA_DECODE_PLAN switch). cursor_loads: copy a float cache's tiles through per-thread row
    cursors (None: `decode_cursor_loads(D)`: JOA_DECODE_CURSOR_LOADS, else D == 128; the same bits
    either way); ignored for a quantised cache. producer: copy a float cache's tiles by a producer
    warp into an mbarrier ring (None: `decode_producer()`, JOA_DECODE_PRODUCER, off; the same bits;
    sm_90 only, ignored on other GPUs and for a quantised cache; where it applies it takes the place
    of the cursor loads). tile128: stream a float cache in 128-row KV tiles where that applies
    (16-row blocks at head dims 64 / 128; None: `decode_tile128()`, JOA_DECODE_TILE128, off; not the
    default tile's bits, the plan's splits are whole 128-row tiles; with the cursor loads where they
    apply; ignored for a quantised cache and where the producer warp runs). key_rows: where the
    register kernel runs and a block holds at most KEY_ROWS_MAX_ROWS query rows, keys as its MMA rows
    (None: `decode_key_rows()`, JOA_DECODE_KEY_ROWS, on; not the other register kernel's bits;
    ignored for a float cache). engine: "decode" (the
    split-KV decode engine), "prefill" (the prefill engine, `prefill_attention` with q_len = S: the
    same semantics; only a float cache without bias or pos_shift, sm_90) or None (`decode_engine`'s
    rule where the prefill engine covers the call, else the decode engine). Naming "prefill" for a
    call it does not cover raises ValueError.
    """
    if engine is not None and engine not in DECODE_ENGINES:
        raise ValueError(f"decode_attention: engine: must be one of {DECODE_ENGINES} or None, got {engine!r}")
    b, hq, s, _ = q.shape
    if engine != "decode":
        why = _prefill_engine_refuses(q, bias, kv_bits, pos_shift, split_rows, cluster)
        if engine == "prefill" and why:
            raise ValueError(f"decode_attention: engine='prefill' does not cover this call: {why}")
        if why is None and (engine == "prefill" or decode_engine(hq, k_cache.shape[1], s) == "prefill"):
            return prefill_attention(q, k_cache, v_cache, jnp.full((b,), s, jnp.int32), kv_len, sink,
                                     scale=scale, causal=causal, softcap=softcap, left=left, right=right)
    if quant_regs is None:
        quant_regs = None if decode_quant_regs() else False  # None: the plan's choice
    else:
        quant_regs = bool(quant_regs)
    tile128 = decode_tile128() if tile128 is None else bool(tile128)
    cursor_loads = decode_cursor_loads(q.shape[-1]) if cursor_loads is None else bool(cursor_loads)
    producer = decode_producer() if producer is None else bool(producer)
    key_rows = decode_key_rows() if key_rows is None else bool(key_rows)
    static = dict(scale=scale, softcap=softcap, causal=causal, left=left, right=right,
                  pos_shift=pos_shift, kv_bits=kv_bits, split_rows=split_rows, pdl=pdl,
                  cluster=cluster, quant_regs=quant_regs if kv_bits else False,
                  plan_policy=plan_policy or decode_plan_policy(),
                  cursor_loads=bool(cursor_loads and not kv_bits),
                  producer=bool(producer and not kv_bits),
                  tile128=bool(tile128 and not kv_bits),
                  key_rows=bool(key_rows and kv_bits))
    return partitioning.DECODE_ATTENTION.apply(
        _decode_attention, (q, k_cache, v_cache, kv_len, bias, sink, k_scale, v_scale), static,
        pin=_per_example_plan)


def _per_example_plan(static, axis_size, q, k_cache, *rest) -> dict:
    """The plan of one example's call, kept by a call over folded examples (vmap): the same splits
    and the same kernel for a quantised cache (the planner picks it by the call's size, and the
    folded call is axis_size times larger), so the same bits, as the per-example loop."""
    b, hq, s, d = q.shape
    plan = decode_plan(b, hq, k_cache.shape[1], s, k_cache.shape[2], d, static["kv_bits"],
                       static["split_rows"], static["cluster"], policy=static["plan_policy"],
                       tile128=static.get("tile128", False), quant_regs=static.get("quant_regs", False))
    return dict(split_rows=plan["split_rows"], cluster=plan["cluster"], quant_regs=plan["quant_regs"])


def _decode_attention(q, k_cache, v_cache, kv_len, bias, sink, k_scale, v_scale, *, scale, softcap,
                      causal, left, right, pos_shift, kv_bits, split_rows, pdl, cluster,
                      quant_regs: bool | None = False, plan_policy=None, cursor_loads=False, producer=False,
                      tile128=False, key_rows=False):
    b, hq, s, d = q.shape
    hkv, c = k_cache.shape[1], k_cache.shape[2]
    plan = decode_plan(b, hq, hkv, s, c, d, kv_bits, split_rows, cluster, policy=plan_policy,
                       tile128=tile128, quant_regs=quant_regs)
    ws = plan["workspace_elems"]
    placeholder = jnp.zeros((1,), jnp.float32)
    call = jax.ffi.ffi_call(
        target("decode_attention"),
        (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct((ws,), jnp.float32)),
    )
    out, _ = call(q, k_cache, v_cache, kv_len.astype(jnp.int32),
                  placeholder if bias is None else bias,
                  placeholder if sink is None else sink.astype(jnp.float32),
                  placeholder if k_scale is None else jnp.ravel(k_scale).astype(jnp.float32),
                  placeholder if v_scale is None else jnp.ravel(v_scale).astype(jnp.float32),
                  scale=np.float32(scale), softcap=np.float32(softcap if softcap > 0 else 0.0),
                  causal=bool(causal), left=int(left), right=int(right), pos_shift=int(pos_shift),
                  has_bias=bias is not None, has_sink=sink is not None, kv_bits=int(kv_bits),
                  split_rows=plan["split_rows"], pdl=bool(pdl), cluster=plan["cluster"],
                  quant_regs=plan["quant_regs"], cursor_loads=bool(cursor_loads),
                  producer=bool(producer), tile128=bool(tile128), key_rows=bool(key_rows))
    return out


# --- GroupQueryAttention step preparation (ffi/handlers/gqa_prepare.cu, ffi/kernels/gqa/) ---------

def gqa_prepare(query, key, value, k_cache, v_cache, seqlens_k, cos_cache=None, sin_cache=None,
                position_ids=None, q_norm_weight=None, k_norm_weight=None, k_scale=None,
                v_scale=None, *, num_heads: int, kv_num_heads: int, rotary_interleaved: bool = False,
                q_norm_epsilon: float = 1e-6, k_norm_epsilon: float = 1e-6, kv_bits: int = 0):
    """A GroupQueryAttention decode / verify step's preparation in one launch: split (packed or
    separate Q/K/V), q/k RMS norm, rotary, and the new K/V rows written in place (quantised when
    kv_bits is 8 or 4) at rows [past_b, past_b + S), past_b = seqlens_k[b] + 1 - S.

    Arguments and results of `jax_onnx_attn.ops.reference.gqa.prepare_step`: (q [B, N, S, D],
    k_cache, v_cache, status int32 [B]). The caches are aliased to their outputs (donate them);
    seqlens_k and position_ids are read on the device. Raises ValueError / TypeError
    "gqa_prepare: <input>: <rule>" from the handler for shapes it cannot take; the rules of
    GroupQueryAttention are checked once, by `ops.group_query_attention`.
    """
    static = dict(num_heads=int(num_heads), kv_num_heads=int(kv_num_heads),
                  rotary_interleaved=bool(rotary_interleaved), q_norm_epsilon=q_norm_epsilon,
                  k_norm_epsilon=k_norm_epsilon, kv_bits=int(kv_bits))
    return partitioning.GQA_PREPARE.apply(
        _gqa_prepare, (query, key, value, k_cache, v_cache, seqlens_k, cos_cache, sin_cache,
                       position_ids, q_norm_weight, k_norm_weight, k_scale, v_scale), static)


def _gqa_prepare(query, key, value, k_cache, v_cache, seqlens_k, cos_cache, sin_cache, position_ids,
                 q_norm_weight, k_norm_weight, k_scale, v_scale, *, num_heads, kv_num_heads,
                 rotary_interleaved, q_norm_epsilon, k_norm_epsilon, kv_bits):
    n, hkv, bits = num_heads, kv_num_heads, kv_bits
    b, s, hidden = query.shape
    d = hidden // (n if key is not None else n + 2 * hkv)
    t = query.dtype

    def or_placeholder(x, dtype):  # an absent input: one element the kernel never reads
        return jnp.zeros((1,), dtype) if x is None else x

    call = jax.ffi.ffi_call(
        target("gqa_prepare"),
        (jax.ShapeDtypeStruct((b, n, s, d), t), jax.ShapeDtypeStruct(k_cache.shape, k_cache.dtype),
         jax.ShapeDtypeStruct(v_cache.shape, v_cache.dtype), jax.ShapeDtypeStruct((b,), jnp.int32)),
        input_output_aliases={3: 1, 4: 2},
    )
    q, k_cache, v_cache, status = call(
        query, or_placeholder(key, t), or_placeholder(value, t), k_cache, v_cache,
        seqlens_k.astype(jnp.int32), or_placeholder(cos_cache, t), or_placeholder(sin_cache, t),
        or_placeholder(position_ids, jnp.int32).astype(jnp.int32),
        or_placeholder(q_norm_weight, t), or_placeholder(k_norm_weight, t),
        or_placeholder(k_scale, jnp.float32).reshape(-1),
        or_placeholder(v_scale, jnp.float32).reshape(-1),
        num_heads=n, kv_num_heads=hkv, packed=key is None, do_rotary=cos_cache is not None,
        rotary_interleaved=rotary_interleaved, has_position_ids=position_ids is not None,
        has_norm=q_norm_weight is not None, q_norm_epsilon=np.float32(q_norm_epsilon),
        k_norm_epsilon=np.float32(k_norm_epsilon), kv_bits=bits)
    return q, k_cache, v_cache, status


# --- general attention (ffi/handlers/general_attention.cu, kernels in ffi/kernels/general/) --------


def general_attention(q, k, v, kv_len, bias=None, *, scale: float, softcap: float = 0.0,
                      causal: bool = False, left: int = -1, right: int = -1, pos_shift: int = 0,
                      qk_mode: int | None = None, softmax_dtype=None):
    """q [B, Hq, S, D], k [B, Hkv, C, D] of q's dtype, v [B, Hkv, C, Dv] (f32/f16/bf16 each),
    kv_len int32 [B] -> (y [B, Hq, S, Dv], qk [B, Hq, S, C] or None), both in q's dtype.

    Semantics of `jax_onnx_attn.ops.reference.general.general_attention` (the CUDA-core kernel for
    what the decode engine does not take). bias: None or [B|1, Hq|1, S|1, T] f32/f16/bf16/bool;
    qk_mode: None or a qk_matmul_output_mode (0-3); softmax_dtype: one of GENERAL_SOFTMAX_DTYPES or
    None (float32). The f32 score workspace [B, Hq, S, C] is an extra result.
    """
    static = dict(scale=scale, softcap=softcap, causal=causal, left=left, right=right,
                  pos_shift=pos_shift, qk_mode=qk_mode, softmax_dtype=softmax_dtype)
    return partitioning.GENERAL_ATTENTION.apply(_general_attention, (q, k, v, kv_len, bias), static)


def _general_attention(q, k, v, kv_len, bias, *, scale, softcap, causal, left, right, pos_shift,
                       qk_mode, softmax_dtype):
    b, hq, s, _ = q.shape
    c, dv = k.shape[2], v.shape[3]
    softmax_dtype = jnp.dtype(jnp.float32 if softmax_dtype is None else softmax_dtype)
    qk_shape = (b, hq, s, c) if qk_mode is not None else (1,)
    call = jax.ffi.ffi_call(
        target("general_attention"),
        (jax.ShapeDtypeStruct((b, hq, s, dv), q.dtype), jax.ShapeDtypeStruct(qk_shape, q.dtype),
         jax.ShapeDtypeStruct((max(1, b * hq * s * c),), jnp.float32)),
    )
    y, qk, _ = call(q, k, v, kv_len.astype(jnp.int32),
                    jnp.zeros((1,), jnp.float32) if bias is None else bias,
                    scale=np.float32(scale), softcap=np.float32(softcap if softcap > 0 else 0.0),
                    causal=bool(causal), left=int(left), right=int(right), pos_shift=int(pos_shift),
                    has_bias=bias is not None, qk_mode=-1 if qk_mode is None else int(qk_mode),
                    softmax_type=__getattr__("GENERAL_SOFTMAX_DTYPES").index(softmax_dtype))
    return y, (qk if qk_mode is not None else None)


# --- prefill attention (ffi/handlers/prefill_attention.cu, engine in ffi/kernels/prefill/) ---------
# GQA first prompts route here (ops/decode_paths.py `gqa_prefill_engine_route`; docs/kernels.md).


#: The switch of the prefill engine's persistent kernels (engine.cuh RunPersistent): "1" runs one CTA
#: an SM, each looping over its share of the (batch row, KV head, row block) tiles in a static
#: longest-first order and loading the next tile's Q and first K / V tiles while it finishes this
#: one; "0" one CTA a tile. Applies to the head size's default schedule unsplit where its tiling
#: holds two Q tiles (D 64 / 80 / 96 / 128; the launch ignores it elsewhere). The same bits either
#: way (issue 14, docs/kernels.md "The prefill engine").
PREFILL_PERSISTENT_ENV = "JOA_PREFILL_PERSISTENT"
#: With the switch unset, calls over at most this many key rows (T, a static shape) run persistent:
#: there a CTA's fixed cost (Q load, pipeline fill, epilogue: ~3 key tiles' worth) is a large share
#: of its few key tiles and the loop overlaps it with the neighbouring tile. Measured on the H200
#: (session 20, bf16 32/8, B·S 16k, `bench/results/2026-12-03-e28a101-prefill-persistent.json`),
#: TFLOP/s one tile a CTA -> persistent: D 128 causal 1k 392 -> 438 (jax cuDNN 415), 2k 503 -> 513,
#: 4k 591 -> 573, 16k 664 -> 631; non-causal 1k 549 = 549, 2k 604 -> 599; D 64 causal 1k 229 -> 273,
#: non-causal 1k 391 -> 438. Past 2k the static tile order balances causal rows worse than the
#: hardware's CTA scheduler does.
PREFILL_PERSISTENT_MAX_KEYS = 2048


def prefill_persistent(kv_rows: int) -> bool:
    """Whether prefill_attention over kv_rows key rows runs the persistent kernels: the one place
    the switch (JOA_PREFILL_PERSISTENT: "1" on, "0" off) and the default rule (kv_rows <=
    PREFILL_PERSISTENT_MAX_KEYS) are read, at trace time."""
    forced = os.environ.get(PREFILL_PERSISTENT_ENV)
    if forced is None or forced == "":
        return int(kv_rows) <= PREFILL_PERSISTENT_MAX_KEYS
    return forced == "1"


def prefill_plan(batch: int, q_heads: int, kv_heads: int, q_rows: int, kv_rows: int, head_dim: int,
                 causal: bool = True, left: int = -1, right: int = -1,
                 splits: int | None = None) -> dict:
    """The prefill engine's split-KV plan for a call (ffi/kernels/prefill/plan.h, through
    `_ffi.prefill_plan`): a pure function of static shapes, so one call shape always gets the same
    bits.

    Returns {splits, ctas, tiles, workspace_elems}: the splits of each (batch row, KV head, M block)
    CTA's key tiles, the CTAs before splitting, the key tiles the planner splits, and the f32
    elements of the workspace result. splits overrides the planner (None: it chooses).
    """
    return _prefill_plan(int(batch), int(q_heads), int(kv_heads), int(q_rows), int(kv_rows),
                         int(head_dim), bool(causal), int(left), int(right), int(splits or 0))


@functools.cache
def _prefill_plan(batch, q_heads, kv_heads, q_rows, kv_rows, head_dim, causal, left, right,
                  splits) -> dict:
    return _extension.prefill_plan(batch=batch, q_heads=q_heads, kv_heads=kv_heads, q_rows=q_rows,
                                   kv_rows=kv_rows, head_dim=head_dim, causal=causal, left=left,
                                   right=right, splits=splits)


def prefill_attention(q, k, v, q_len, kv_len, sink=None, *, scale: float, causal: bool,
                      softcap: float = 0.0, left: int = -1, right: int = -1,
                      schedule: str | None = None, splits: int | None = None,
                      persistent: bool | None = None):
    """q [B, Hq, S, D], k / v [B, Hkv, T, D] (float16 or bfloat16, one dtype; D in
    PREFILL_HEAD_DIMS; one whose PREFILL_TILING "padded" width is larger runs in those wider tiles,
    zero-filled past D; Hq a multiple of Hkv), q_len / kv_len integer [B] -> [B, Hq, S, D].

    The Hopper prefill engine (sm_90 only). Semantics of
    `jax_onnx_attn.ops.reference.prefill.prefill_attention`: query row i < q_len[b] sits at
    position kv_len[b] - q_len[b] + i (bottom-right aligned) and sees keys j < kv_len[b] (and,
    causal, j <= its position); rows past q_len[b] and rows that see no key are 0. Lengths are read
    on the device and clamped to [0, S] / [0, T]. left / right (-1: unbounded): local windows, the
    decode engine's: key j is hidden from a row at position p when p - j > left or j - p > right
    (GroupQueryAttention's local_window_size W, causal: left = W - 1). sink: None or [Hq] (taken as
    float32, decode_attention's input): a per-query-head extra logit in the softmax's max and
    denominator with no value row (GQA's head_sink; smooth_softmax is a sink of 0). softcap > 0:
    logits x -> softcap * tanh(x / softcap) before the mask (tanhf, not the approximate tanh; its own
    kernels, so calls without softcap run the plain ones; <= 0: off). schedule (one of PREFILL_SCHEDULES): how the
    engine's two consumer warpgroups order their work on a key tile: "serial" (Q K^T, softmax, P V
    one after another), "overlap" (Q K^T of the next tile and P V of this one in flight during the
    softmax: FA3's intra-warpgroup pipelining), "pingpong" ("overlap", the two warpgroups taking
    turns at the tensor cores); None: the head size's default, PREFILL_TILING[D]["schedule"]
    ("pingpong", the fastest at D 128 on the H200; "overlap" at D 256, FA3's choice there); all
    add in the same order, so they give the same bits. The tuned pingpong schedules (opt-in, for
    A/B runs; docs/kernels.md): "pingpong-fold" (the scale folded into the exp2's FFMA: other bits),
    "pingpong-lazy" (the O rescale skipped where no row's max moved: pingpong's bits),
    "pingpong-fold-lazy", "pingpong-n176" (176-key tiles: other bits) and
    "pingpong-fold-lazy-n176" (D 128 only); the D 64 tilings "pingpong-fold-lazy-s4" (4 K / V
    stages: "pingpong-fold-lazy"'s bits), "pingpong-n192", "pingpong-fold-lazy-n192" (192-key tiles:
    other bits), "pingpong-fold-lazy-n192-s4" ("pingpong-fold-lazy-n192"'s bits),
    "pingpong-fold-lazy-m192" / "-m192-s4" (192-row CTAs, three consumer warpgroups:
    "pingpong-fold-lazy"'s bits). Fold and lazy
    are compiled for D 64 and 128, each tiling for its head size, without sinks / softcap and with
    scale > 0; a tuned name runs plain "pingpong" anywhere else. splits: split-KV, each CTA's key
    tiles cut into that many ranges whose partial results a combine kernel merges in a fixed order
    (1.. PREFILL_MAX_SPLITS; None: `prefill_plan`'s choice for the call's static shapes when no
    schedule is named, more than 1 only where the (batch row, KV head, row block) CTAs leave SMs
    idle: few-query calls; with a named schedule 1; splits=1 is the engine without split-KV, its
    bits). More than 1 runs the head size's default schedule only (the split kernels are compiled
    for it). The bits depend on the splits, so on the shapes the plan sees; a vmapped call keeps
    each example's plan. persistent: one CTA an SM looping over the row-block tiles (None:
    `prefill_persistent(T)`: JOA_PREFILL_PERSISTENT, else T <= PREFILL_PERSISTENT_MAX_KEYS); it
    applies where the call runs the head size's default schedule unsplit at D 64 / 80 / 96 / 128 and
    is ignored elsewhere; the same bits either way. Raises TypeError / ValueError "prefill_attention: <input>: <rule>" at trace
    time.
    """
    _check_prefill(q, k, v, q_len, kv_len)
    schedules = __getattr__("PREFILL_SCHEDULES")
    default = __getattr__("PREFILL_TILING")[q.shape[3]]["schedule"]
    named = schedule is not None
    if schedule is None:
        schedule = default
    if schedule not in schedules:
        raise ValueError(f"prefill_attention: schedule: must be one of {schedules}, got {schedule!r}")
    for name, w in (("left", left), ("right", right)):
        if int(w) < -1:
            raise ValueError(f"prefill_attention: {name}: must be -1 (unbounded) or >= 0, got {w}")
    if sink is not None and tuple(jnp.shape(sink)) != (q.shape[1],):
        raise ValueError(f"prefill_attention: sink: must be [Hq={q.shape[1]}], got {jnp.shape(sink)}")
    if splits is not None:
        most = __getattr__("PREFILL_MAX_SPLITS")
        if isinstance(splits, bool) or not isinstance(splits, (int, np.integer)) or not 1 <= splits <= most:
            raise ValueError(f"prefill_attention: splits: must be None (the plan) or an integer in "
                             f"1..{most}, got {splits!r}")
        if splits > 1 and schedule != default:
            raise ValueError(f"prefill_attention: splits: split-KV runs the head size's default schedule "
                             f"{default!r} only (its kernels are compiled for it), got schedule={schedule!r}")
    elif named:
        # A named schedule pins the engine as it runs unsplit (A/B runs of schedules compare like
        # with like; split kernels exist for the default schedule only): no plan.
        splits = 1
    static = dict(scale=float(scale), causal=bool(causal), softcap=float(max(softcap, 0.0)),
                  left=int(left), right=int(right), schedule=schedule,
                  splits=None if splits is None else int(splits),
                  persistent=prefill_persistent(k.shape[2]) if persistent is None else bool(persistent))
    return partitioning.PREFILL_ATTENTION.apply(
        _prefill_attention, (q, k, v, jnp.asarray(q_len).astype(jnp.int32),
                             jnp.asarray(kv_len).astype(jnp.int32),
                             None if sink is None else jnp.asarray(sink).astype(jnp.float32)), static,
        pin=_per_example_prefill_plan)


def _per_example_prefill_plan(static, axis_size, q, k, *rest) -> dict:
    """The splits of one example's call, kept by a call over folded examples (vmap): the same
    splits, so the same bits, as the per-example loop."""
    b, hq, s, d = q.shape
    plan = prefill_plan(b, hq, k.shape[1], s, k.shape[2], d, static["causal"], static["left"],
                        static["right"], static["splits"])
    return dict(splits=plan["splits"])


def _check_prefill(q, k, v, q_len, kv_len) -> None:
    """The engine's rules on shapes and dtypes, naming the input that breaks one."""
    def fail(exc, what, rule):
        raise exc(f"prefill_attention: {what}: {rule}")

    for name, x in (("q", q), ("k", k), ("v", v)):
        if jnp.ndim(x) != 4:
            fail(ValueError, name, f"must be rank 4, got shape {jnp.shape(x)}")
    if jnp.dtype(q.dtype) not in HALF_DTYPES:
        fail(TypeError, "q", f"must be float16 or bfloat16, got {jnp.dtype(q.dtype)}")
    for name, x in (("k", k), ("v", v)):
        if jnp.dtype(x.dtype) != jnp.dtype(q.dtype):
            fail(TypeError, name, f"must have q's dtype {jnp.dtype(q.dtype)}, got {jnp.dtype(x.dtype)}")
    b, hq, _, d = q.shape
    head_dims = __getattr__("PREFILL_HEAD_DIMS")
    if d not in head_dims:
        fail(ValueError, "q", f"head size {d} is not one the engine is compiled for {head_dims}")
    if k.shape[0] != b or k.shape[3] != d:
        fail(ValueError, "k", f"must be [B={b}, Hkv, T, D={d}], got {k.shape}")
    if k.shape[1] == 0 or hq % k.shape[1]:
        fail(ValueError, "k", f"KV heads {k.shape[1]} must divide the query heads {hq}")
    if tuple(v.shape) != tuple(k.shape):
        fail(ValueError, "v", f"must have k's shape {k.shape}, got {v.shape}")
    for name, x in (("q_len", q_len), ("kv_len", kv_len)):
        if tuple(jnp.shape(x)) != (b,) or not jnp.issubdtype(jnp.result_type(x), jnp.integer):
            fail(TypeError if jnp.shape(x) == (b,) else ValueError, name,
                 f"must be an integer [B={b}] array, got {jnp.result_type(x)} {jnp.shape(x)}")


def _prefill_attention(q, k, v, q_len, kv_len, sink=None, *, scale, causal, softcap, left, right,
                       schedule, splits=None, persistent=False):
    b, hq, s, d = q.shape
    plan = prefill_plan(b, hq, k.shape[1], s, k.shape[2], d, causal, left, right, splits)
    # The split partials' f32 workspace: a second result, discarded (XLA allocates it, so the
    # handler allocates nothing and stays capturable in a command buffer).
    call = jax.ffi.ffi_call(target("prefill_attention"),
                            (jax.ShapeDtypeStruct(q.shape, q.dtype),
                             jax.ShapeDtypeStruct((plan["workspace_elems"],), jnp.float32)))
    placeholder = jnp.zeros((1,), jnp.float32)
    y, _ = call(q, k, v, q_len, kv_len, placeholder if sink is None else sink,
                scale=np.float32(scale), softcap=np.float32(softcap), causal=bool(causal),
                left=int(left), right=int(right),
                has_sink=sink is not None, schedule=__getattr__("PREFILL_SCHEDULES").index(schedule),
                splits=int(plan["splits"]), persistent=bool(persistent))
    return y
