"""Prefill attention kernels: our Hopper prefill engine (`cuda.prefill_attention`) against
`jax.nn.dot_product_attention` (implementation "cudnn" and "xla"), jax's Mosaic GPU flash attention
(`jax.experimental.pallas.ops.gpu.attention_mgpu`) and torch SDPA (flash, cuDNN) on the same shapes,
one process. "ours" is the engine at its default consumer schedule (what the model path runs),
"ours-serial" / "ours-overlap" / "ours-pingpong" with that schedule pinned (until 2026-12-02 the
bench's "ours" was the serial schedule: bench/results/ files before then say "ours" for it);
"ours-pingpong-fold" / "-lazy" / "-fold-lazy" / "-n176" / "-fold-lazy-n176" / "-fold-lazy-s4" /
"-n192" / "-fold-lazy-n192" / "-fold-lazy-n192-s4" / "-fold-lazy-m192" / "-fold-lazy-m192-s4" the
tuned pingpong kernels (TUNED_IMPLS, opt-in: not in the default --impls); "ours-nosplit" the engine
with split-KV off (splits=1: the engine before split-KV; SPLIT_IMPLS, opt-in), to A/B the split plan
against it; "ours-persistent" / "ours-nopersistent" the engine with its persistent kernels on / off
(persistent=True: one CTA an SM looping over the tiles; False: one tile a CTA; PERSISTENT_IMPLS,
opt-in), to A/B them whatever "ours" takes (JOA_PREFILL_PERSISTENT, else persistent over at
most cuda.PREFILL_PERSISTENT_MAX_KEYS key rows).

Cases (each causal and / or not, x GQA Hq/Hkv x head size D x bf16 / fp16; `--dims`: any of
cuda.PREFILL_HEAD_DIMS, 64 / 80 / 96 / 128 / 256, TFLOP/s counting D, not the padded 128-wide tile
80 and 96 run in; `--max-seconds` stops starting new cases after that long):

- self-attention (--seqlens): B prompts of S tokens attending to themselves (T = S), B = --tokens // S
  (16k: B = 16, 8, 4, 2, 1 at S = 1k .. 16k);
- ragged (--ragged [S ...]): the same, right-padded: row b holds L_b tokens (q_len = kv_len = L_b),
  L_b drawn deterministically in [S/2, S] (`ragged_lengths`); bare --ragged adds a ragged twin of
  every --seqlens case, --ragged 4096 ragged cases at S = 4096 only;
- chunked prefill (--chunked S:T ...): S new queries at the bottom right of T keys (kv_len = T, a
  cache of T - S tokens plus the chunk), B = --chunk-batch or --tokens // S.

FLOPs (QKᵀ and PV, 4·Hq·D per visible query-key pair): self 4·B·Hq·S²·D, halved for causal;
ragged 4·Hq·D·Σ_b L_b², halved for causal (the real lengths, not the padding); chunked
4·B·Hq·D·S·T, causal 4·B·Hq·D·(S·(T - S) + S²/2) (every query sees the whole cache, then a
triangle of the chunk). TFLOP/s = FLOPs / time.

Semantics are the same for every impl: ours runs bottom-right causal (query row i at position
kv_len - q_len + i). Where a peer's own causal flag is top-left (jax's is_causal, Mosaic's
TuningConfig.causal, torch's is_causal) and S < T, the peer gets the bottom-right mask some other
way, said in the result's "note": jax cuDNN / XLA an explicit bool mask [1, 1, S, T]
(`bottom_right_mask`), torch-flash `torch.nn.attention.bias.causal_lower_right(S, T)` (the flash
kernel, whose own causal is bottom-right), torch-cudnn that bias materialised as a bool [S, T] mask
before timing; Mosaic has none and skips. Ragged rows: our engine and jax (query_seq_lengths /
key_value_seq_lengths; causal with padding, top-left = bottom-right when q_len = kv_len per row)
take per-row lengths; Mosaic and torch SDPA have none and skip. An impl that cannot run a case is
recorded with the reason ({"skip": ...}); one that fails at run time too ("error: ...").

Peers: jax-mosaic is fp16 only (its shared-memory tiles are float16), block_q 64, block_kv 128 (64 at
D 256, for shared memory), 2 stages, GQA native (K/V heads not repeated), and has no softmax scale
argument (runs with scale 1: the same work). torch-flash / torch-cudnn run under
`torch.nn.attention.sdpa_kernel` with only that backend allowed (no silent fallback), enable_gqa when
Hq != Hkv, skipped without torch or a CUDA device for it.

Timing: K dependent calls (each call's output is the next call's query) in one jitted function whose
query is donated (torch: one captured CUDA graph), dispatched M times; per-call time = wall time /
(M·K), the median of several samples. Our engine runs on sm_90 only.

The issue-14 grid (--issue14: S 512 .. 32k with B·S = 32k, 32/8 and 64/8 heads, D 64 / 128 / 256,
bf16 / fp16, causal and not, ragged at S 4k / 16k, chunked 2048:8192 and 2048:30720; ours at its
default schedule and the five peers; 264 cases, about 1120 measured (case, impl) pairs at 30 ms x 3
samples) should take about 30 minutes on an H200 (an estimate, not a measurement: ~1 s of
compilation / graph capture per pair plus its timed calls; each result's "started_s" gives the real
pace). Options given beside --issue14 win over its values. Split it with --part K/N (cases K, K+N,
...; the figures merge the files), e.g. 10 parts of about 3 minutes each, --max-seconds keeping a
part inside a 4-minute call:

    python -m jax_onnx_attn.bench prefill --issue14 --part 1/10 --max-seconds 200 --out FILE.json

JSON (--out): {"suite": "prefill", "env": ..., "args": ..., "results": [{batch, ctx, q_len,
q_heads, kv_heads, head_dim, dtype, causal, kind ("self" | "ragged" | "chunked"), lengths (ragged:
[L_b]), label, flops, started_s (seconds into the run), impls: {impl: {us, tflops[, note]} |
{skip}}}]}, the schema `jax_onnx_attn.bench.plots` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import sys
import time

from jax_onnx_attn.bench.decode import (_jax_dtype, _time_loop, _warm_up, add_timing_args, environment,
                                        run_cases, runnable_impls, time_torch_graph)

#: "ours": cuda.prefill_attention with its default consumer schedule (what the model path runs);
#: "ours-<schedule>": that schedule pinned (cuda.PREFILL_SCHEDULES).
OURS_IMPLS = ("ours", "ours-serial", "ours-overlap", "ours-pingpong")
#: The tuned pingpong schedules (params.h Tune, docs/kernels.md "Main-loop tunings"), opt-in for A/B
#: runs: -fold (the scale in the exp2's FFMA), -lazy (the O rescale skipped when no row's max moved),
#: -n176 (176-key tiles, D 128), -s4 (4 K / V stages, D 64), -n192 (192-key tiles, D 64), -m192 (192-row
#: CTAs, three consumer warpgroups, D 64); fold and lazy at D 64 and 128, without sinks / softcap only
#: (elsewhere they run plain pingpong).
TUNED_IMPLS = ("ours-pingpong-fold", "ours-pingpong-lazy", "ours-pingpong-fold-lazy", "ours-pingpong-n176",
               "ours-pingpong-fold-lazy-n176", "ours-pingpong-fold-lazy-s4", "ours-pingpong-n192",
               "ours-pingpong-fold-lazy-n192", "ours-pingpong-fold-lazy-n192-s4", "ours-pingpong-fold-lazy-m192",
               "ours-pingpong-fold-lazy-m192-s4")
#: Ours at its default schedule with split-KV off (splits=1, ffi/kernels/prefill/plan.h), opt-in: "ours"
#: takes the plan's splits, so the pair measures what split-KV gives few-query calls.
SPLIT_IMPLS = ("ours-nosplit",)
#: Ours at its default schedule with the persistent kernels on / off (persistent=True / False,
#: engine.cuh RunPersistent), opt-in: the same bits, so the pair measures the persistent tile loop.
PERSISTENT_IMPLS = ("ours-persistent", "ours-nopersistent")
PEERS = ("jax-cudnn", "jax-xla", "jax-mosaic", "torch-flash", "torch-cudnn")
IMPLS = OURS_IMPLS + TUNED_IMPLS + SPLIT_IMPLS + PERSISTENT_IMPLS + PEERS
#: The default --impls: ours, its other schedules (pingpong is the default one at D 128), the peers.
DEFAULT_IMPLS = tuple(i for i in IMPLS
                      if i != "ours-pingpong" and i not in TUNED_IMPLS + SPLIT_IMPLS + PERSISTENT_IMPLS)
MAX_LOGIT_BYTES = 8 << 30  # the xla implementation materialises [B, Hq, S, T] f32 logits
#: jax-mosaic's TuningConfig: query rows per warpgroup, keys per stage (D 256: MOSAIC_BLOCK_KV_D256,
#: so that the two float16 K / V stages fit in shared memory), stages.
MOSAIC_BLOCK_Q, MOSAIC_BLOCK_KV, MOSAIC_BLOCK_KV_D256, MOSAIC_STAGES = 64, 128, 64, 2

#: --issue14: the issue's full grid (see the module docstring; split it with --part), for the
#: options the command line leaves at their defaults. Ours at its default schedule only.
ISSUE14 = dict(seqlens=[512, 1024, 2048, 4096, 8192, 16384, 32768], tokens=32768,
               heads=["32/8", "64/8"], dims=[64, 128, 256], dtypes=["bf16", "fp16"],
               causal=["causal", "noncausal"], ragged=[4096, 16384], chunked=["2048:8192", "2048:30720"],
               impls=["ours", *PEERS], target_ms=30.0, reps=3)


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt shape: B rows of S queries against T = `ctx` keys (0: T = S, self-attention).

    lengths (ragged self-attention): row b's real length L_b <= S (q_len = kv_len = L_b, the rest
    padding); empty: every row full. ctx > seq: chunked prefill, the S queries at the bottom right
    of the T keys (q_len = S, kv_len = T)."""

    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool
    ctx: int = 0
    lengths: tuple[int, ...] = ()

    def __post_init__(self):
        if self.ctx and self.ctx < self.seq:
            raise ValueError(f"chunked prefill needs T >= S, got S={self.seq} T={self.ctx}")
        if self.lengths and (len(self.lengths) != self.batch or self.ctx not in (0, self.seq)
                             or not all(0 < n <= self.seq for n in self.lengths)):
            raise ValueError(f"ragged rows need B={self.batch} lengths in [1, S={self.seq}] and T = S, "
                             f"got {self.lengths} (T={self.ctx})")

    @property
    def keys(self) -> int:
        """T, the keys of a row (S for self-attention)."""
        return self.ctx or self.seq

    @property
    def kind(self) -> str:
        """"self" (every row full, T = S), "ragged" (per-row lengths) or "chunked" (T > S)."""
        return "ragged" if self.lengths else "chunked" if self.keys > self.seq else "self"

    @property
    def q_lens(self) -> tuple[int, ...]:
        """Per-row query lengths (S, or the ragged rows' L_b)."""
        return self.lengths or (self.seq,) * self.batch

    @property
    def kv_lens(self) -> tuple[int, ...]:
        """Per-row key lengths (T, or the ragged rows' L_b)."""
        return self.lengths or (self.keys,) * self.batch

    def label(self) -> str:
        """A short name for tables: batch, lengths, heads, head size, dtype, mask."""
        mask = "causal" if self.causal else "noncausal"
        shape = {"self": f"S{self.seq}", "chunked": f"S{self.seq} T{self.keys}",
                 "ragged": f"S{self.seq} ragged"}[self.kind]
        return f"B{self.batch} {shape} {self.q_heads}/{self.kv_heads} d{self.head_dim} {self.dtype} {mask}"

    @property
    def flops(self) -> float:
        """4·Hq·D per visible query-key pair (QKᵀ and PV): see the module docstring."""
        per_pair = 4.0 * self.q_heads * self.head_dim
        if self.lengths:
            pairs = sum(n * n for n in self.lengths)
            return per_pair * (pairs / 2 if self.causal else pairs)
        s, t = self.seq, self.keys
        pairs = s * (t - s) + s * s / 2 if self.causal else s * t
        return per_pair * self.batch * pairs


def ragged_lengths(batch: int, seq: int) -> tuple[int, ...]:
    """B row lengths drawn uniformly in [S/2, S] from a generator seeded by (B, S): the same rows in
    every run and for every impl."""
    import numpy as np

    rng = np.random.default_rng(1_000_003 * seq + batch)
    return tuple(int(n) for n in rng.integers(max(1, seq // 2), seq + 1, size=batch))


def parse_chunk(spec: str) -> tuple[int, int]:
    """"S:T" (queries : keys, T >= S > 0) -> (S, T); raises argparse.ArgumentTypeError."""
    try:
        s, t = (int(x) for x in spec.split(":"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected S:T (e.g. 2048:30720), got {spec!r}") from None
    if not 0 < s <= t:
        raise argparse.ArgumentTypeError(f"chunk {spec!r}: needs 0 < S <= T")
    return s, t


def default_cases(args) -> list[Case]:
    """The cases of the command line: for each causal x heads x head size x dtype, the
    self-attention S of --seqlens (B = tokens // S) each followed by its ragged twin (bare
    --ragged), then the ragged S of --ragged S ..., then the chunked S:T of --chunked."""
    ragged = getattr(args, "ragged", None)
    chunked = getattr(args, "chunked", None) or []
    cases = []
    for causal in args.causal:
        for heads in args.heads:
            hq, hkv = (int(x) for x in heads.split("/"))
            for d in args.dims:
                for dtype in args.dtypes:
                    def case(s, **kw):
                        return Case(kw.pop("b", max(1, args.tokens // s)), s, hq, hkv, d, dtype,
                                    causal == "causal", **kw)
                    for s in args.seqlens:
                        cases.append(case(s))
                        if ragged == []:
                            cases.append(case(s, lengths=ragged_lengths(max(1, args.tokens // s), s)))
                    for s in ragged or []:
                        cases.append(case(s, lengths=ragged_lengths(max(1, args.tokens // s), s)))
                    for s, t in chunked:
                        b = getattr(args, "chunk_batch", None) or max(1, args.tokens // s)
                        cases.append(case(s, b=b, ctx=t))
    return cases


def bottom_right_mask(s: int, t: int):
    """Bool [1, 1, S, T]: query row i (at position T - S + i) sees key j iff j <= T - S + i, the
    bottom-right causal mask a peer with a top-left causal flag needs when S < T."""
    import jax.numpy as jnp

    i = jnp.arange(s, dtype=jnp.int32)[:, None]
    j = jnp.arange(t, dtype=jnp.int32)[None, :]
    return (j <= i + (t - s))[None, None]


# --------------------------------------------------------------------------------------------------
# What each impl can run

@functools.lru_cache(maxsize=None)
def _torch_status() -> str | None:
    """None when torch imports and sees a CUDA device, else why not."""
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install
        return f"torch not installed ({type(e).__name__}: {str(e)[:80]})"
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    return None


@functools.lru_cache(maxsize=None)
def _mosaic_status() -> str | None:
    """None when jax's Mosaic GPU attention imports and jax sees a GPU, else why not."""
    import jax

    if not any(dev.platform == "gpu" for dev in jax.devices()):
        return "needs a CUDA GPU (Mosaic GPU)"
    try:
        from jax.experimental.pallas.ops.gpu import attention_mgpu  # noqa: F401
    except Exception as e:
        return f"jax {jax.__version__} has no usable attention_mgpu ({type(e).__name__}: {str(e)[:80]})"
    return None


def mosaic_block_kv(head_dim: int) -> int:
    """jax-mosaic's keys per stage at this head size (see MOSAIC_BLOCK_KV)."""
    return MOSAIC_BLOCK_KV if head_dim <= 128 else MOSAIC_BLOCK_KV_D256


def _impl_skip(case: Case, impl: str) -> str | None:
    """Why `impl` cannot run `case` (None: it can); a skip the harness records as {"skip": why}."""
    if impl == "jax-xla":
        logits = 4 * case.batch * case.q_heads * case.seq * case.keys
        if logits > MAX_LOGIT_BYTES:
            return f"xla logits would take {logits / 2**30:.0f} GiB"
    if impl == "jax-mosaic":
        if case.kind == "ragged":
            return "no per-row lengths"
        if case.causal and case.kind == "chunked":
            return "causal is top-left only (TuningConfig.causal): no bottom-right causal for S < T"
        if case.dtype != "fp16":
            return "fp16 only (its shared-memory tiles are float16)"
        block_kv = mosaic_block_kv(case.head_dim)
        if case.head_dim % 64 or case.seq % (2 * MOSAIC_BLOCK_Q) or case.keys % block_kv:
            return f"needs D % 64, S % {2 * MOSAIC_BLOCK_Q}, T % {block_kv} == 0"
        return _mosaic_status()
    if impl.startswith("torch-"):
        if case.kind == "ragged":
            return "SDPA has no per-row lengths"
        return _torch_status()
    return None


def _impl_note(case: Case, impl: str) -> str | None:
    """How `impl` computes `case`'s semantics when that is not its plain call (the result's "note")."""
    chunk_causal = case.causal and case.kind == "chunked"
    if impl in ("jax-cudnn", "jax-xla"):
        if chunk_causal:
            return "bottom-right causal via an explicit bool mask [1,1,S,T] (jax's is_causal is top-left)"
        if case.kind == "ragged":
            return "per-row lengths via query_seq_lengths / key_value_seq_lengths"
    if impl == "jax-mosaic":
        return (f"block_q {MOSAIC_BLOCK_Q}, block_kv {mosaic_block_kv(case.head_dim)}, "
                f"{MOSAIC_STAGES} stages, GQA native, softmax scale 1 (no scale argument)")
    if impl == "torch-flash" and chunk_causal:
        return "bottom-right causal via causal_lower_right(S, T) (flash's own causal is bottom-right)"
    if impl == "torch-cudnn" and chunk_causal:
        return "bottom-right causal via causal_lower_right(S, T) materialised as a bool [S, T] mask"
    return None


# --------------------------------------------------------------------------------------------------
# The calls

def jax_attention(case: Case, impl: str):
    """(fn(q, k, v) -> like q, layout) of an "ours*" or "jax-*" impl on `case`: layout "BHSD" (ours:
    q [B, Hq, S, D], k / v [B, Hkv, T, D]) or "BTNH" (jax's: q [B, S, Hq, D], k / v [B, T, Hkv, D]).
    Every impl computes the same rows (module docstring); the test oracle calls this too."""
    import jax
    import jax.numpy as jnp

    scale = 1.0 / math.sqrt(case.head_dim)
    q_lens = jnp.asarray(case.q_lens, jnp.int32)
    kv_lens = jnp.asarray(case.kv_lens, jnp.int32)
    if impl.startswith("ours"):
        from jax_onnx_attn.ops import cuda

        pinned = impl.partition("-")[2]
        schedule = (dict(splits=1) if impl in SPLIT_IMPLS
                    else dict(persistent=impl == "ours-persistent") if impl in PERSISTENT_IMPLS
                    else dict(schedule=pinned) if pinned else {})

        def ours(q, k, v):
            return cuda.prefill_attention(q, k, v, q_lens, kv_lens, scale=scale, causal=case.causal,
                                          **schedule)
        return ours, "BHSD"
    if impl == "jax-mosaic":
        from jax.experimental.pallas.ops.gpu import attention_mgpu

        config = attention_mgpu.TuningConfig(block_q=MOSAIC_BLOCK_Q, block_kv=mosaic_block_kv(case.head_dim),
                                             max_concurrent_steps=MOSAIC_STAGES, causal=case.causal)

        def mosaic(q, k, v):
            return attention_mgpu.attention(q, k, v, config)
        return mosaic, "BTNH"
    which = impl.split("-")[1]
    kw = dict(scale=scale, implementation=which)
    if case.kind == "ragged":
        kw.update(is_causal=case.causal, query_seq_lengths=q_lens, key_value_seq_lengths=kv_lens)
    elif case.causal and case.kind == "chunked":
        kw.update(mask=bottom_right_mask(case.seq, case.keys))
    else:
        kw.update(is_causal=case.causal)

    def peer(q, k, v):
        return jax.nn.dot_product_attention(q, k, v, **kw)
    return peer, "BTNH"


def shapes(case: Case, layout: str) -> tuple[tuple, tuple]:
    """(q shape, k / v shape) of `case` in `layout` ("BHSD" or "BTNH")."""
    b, s, t, hq, hkv, d = case.batch, case.seq, case.keys, case.q_heads, case.kv_heads, case.head_dim
    if layout == "BHSD":
        return (b, hq, s, d), (b, hkv, t, d)
    return (b, s, hq, d), (b, t, hkv, d)


def bench_case(case: Case, impl: str, calls: int, target_s: float, reps: int) -> float:
    """Median seconds per call of `impl` on random inputs of `case`."""
    if impl.startswith("torch-"):
        return bench_torch(case, impl, calls, target_s, reps)
    import jax

    attn, layout = jax_attention(case, impl)
    q_shape, kv_shape = shapes(case, layout)
    dt = _jax_dtype(case.dtype)
    keys = jax.random.split(jax.random.PRNGKey(case.seq + case.keys + case.batch), 3)
    q = jax.random.normal(keys[0], q_shape, dt)
    k = jax.random.normal(keys[1], kv_shape, dt)
    v = jax.random.normal(keys[2], kv_shape, dt)

    def chain(q, k, v):
        for _ in range(calls):
            q = attn(q, k, v).astype(q.dtype)
        return q

    run = jax.jit(chain, donate_argnums=(0,))
    state = {"q": q}

    def go():
        state["q"] = run(state["q"], k, v)

    try:
        return _time_loop(go, lambda: state["q"].block_until_ready(), calls, target_s, reps)
    finally:
        del k, v, state


def torch_attention(case: Case, impl: str, device):
    """fn(q, k, v) -> like q of "torch-flash" / "torch-cudnn" on `case` (BHSD torch tensors: q [B, Hq,
    S, D], k / v [B, Hkv, T, D]): SDPA with only that backend allowed, enable_gqa when Hq != Hkv,
    the bottom-right causal of a chunk as the module docstring says (a torch-cudnn mask made here,
    once, on `device`). The bench's call; tools/probes/prefill_peers.sh checks it against the
    reference."""
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend, sdpa_kernel

    backend = {"torch-flash": SDPBackend.FLASH_ATTENTION, "torch-cudnn": SDPBackend.CUDNN_ATTENTION}[impl]
    kw = dict(enable_gqa=True) if case.q_heads != case.kv_heads else {}
    if case.causal and case.kind == "chunked":
        from torch.nn.attention.bias import causal_lower_right
        bias = causal_lower_right(case.seq, case.keys)
        # torch-cudnn: the mask made once, outside any timed graph (CausalBias would materialise it
        # in every call when flash is not allowed).
        kw["attn_mask"] = bias if impl == "torch-flash" else bias._materialize(device)
    else:
        kw["is_causal"] = case.causal

    def attn(q, k, v):
        with sdpa_kernel([backend]):
            return F.scaled_dot_product_attention(q, k, v, **kw)
    return attn


def bench_torch(case: Case, impl: str, calls: int, target_s: float, reps: int) -> float:
    """Median seconds per call of torch SDPA (`torch_attention`, BHSD): `calls` dependent calls
    captured in one CUDA graph, replayed (bench.decode's timing)."""
    import torch

    b, s, t, hq, hkv, d = case.batch, case.seq, case.keys, case.q_heads, case.kv_heads, case.head_dim
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16}[case.dtype]
    g = torch.Generator(device="cuda").manual_seed(s + t + b)
    q0 = torch.randn(b, hq, s, d, dtype=dt, device="cuda", generator=g)
    k = torch.randn(b, hkv, t, d, dtype=dt, device="cuda", generator=g)
    v = torch.randn(b, hkv, t, d, dtype=dt, device="cuda", generator=g)
    attn = torch_attention(case, impl, q0.device)
    try:
        def step(q):
            for _ in range(calls):
                q = attn(q, k, v)
            return q

        return time_torch_graph(step, q0, calls, target_s, reps)
    finally:
        del k, v, attn
        torch.cuda.empty_cache()


def _row(case: Case) -> dict:
    """A result's fields (the schema `plots` reads: ctx = T, q_len = S)."""
    row = {"batch": case.batch, "ctx": case.keys, "q_len": case.seq, "q_heads": case.q_heads,
           "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dtype": case.dtype,
           "causal": case.causal, "kind": case.kind, "label": case.label(), "flops": case.flops}
    if case.lengths:
        row["lengths"] = list(case.lengths)
    return row


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (see --help), with --issue14's values filled in where it is given."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="*", default=[1024, 2048, 4096, 8192, 16384],
                    help="self-attention S (none: only --ragged S / --chunked cases)")
    ap.add_argument("--tokens", type=int, default=16384, help="B = tokens // S")
    ap.add_argument("--heads", nargs="+", default=["32/8"], help="Hq/Hkv pairs")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--causal", nargs="+", default=["causal", "noncausal"],
                    choices=["causal", "noncausal"])
    ap.add_argument("--ragged", type=int, nargs="*", default=None, metavar="S",
                    help="ragged rows (lengths in [S/2, S]): bare, a twin of every --seqlens case; "
                         "with S values, ragged cases at those S")
    ap.add_argument("--chunked", type=parse_chunk, nargs="+", default=[], metavar="S:T",
                    help="chunked prefill: S queries at the bottom right of T keys (e.g. 2048:30720)")
    ap.add_argument("--chunk-batch", type=int, default=None, help="B of the chunked cases "
                    "(default tokens // S)")
    ap.add_argument("--impls", nargs="+", default=list(DEFAULT_IMPLS), choices=IMPLS)
    ap.add_argument("--issue14", action="store_true",
                    help="issue 14's full grid (module docstring): the options not given take "
                         "ISSUE14's values (--target-ms 30 --reps 3, ours at its default schedule)")
    ap.add_argument("--part", default=None, metavar="K/N",
                    help="run cases K, K+N, K+2N, ... only (1 <= K <= N): a long grid in N calls")
    add_timing_args(ap, calls=4, target_ms=100.0)
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop starting new cases after this long (partial results are kept)")
    args = ap.parse_args(argv)
    if args.issue14:
        given = _given_options(ap, argv)
        for key, value in ISSUE14.items():
            if key not in given:
                setattr(args, key, [parse_chunk(c) for c in value] if key == "chunked" else list(value)
                        if isinstance(value, list) else value)
    if args.part is not None:
        try:
            k, n = (int(x) for x in args.part.split("/"))
            assert 1 <= k <= n
        except (ValueError, AssertionError):
            ap.error(f"--part: expected K/N with 1 <= K <= N, got {args.part!r}")
        args.part = (k, n)
    return args


def _given_options(ap: argparse.ArgumentParser, argv: list[str] | None) -> set[str]:
    """The destinations of the options `argv` gives explicitly (parsed again without defaults)."""
    saved = [(action, action.default) for action in ap._actions]
    try:
        for action, _ in saved:
            action.default = argparse.SUPPRESS
        return set(vars(ap.parse_args(argv)))
    finally:
        for action, default in saved:
            action.default = default


def _within(cases: list[Case], seconds: float):
    """The cases, until `seconds` have passed since the first was handed out."""
    start = time.perf_counter()
    for case in cases:
        if time.perf_counter() - start > seconds:
            print(f"time budget reached: stopping before {case.label()}", flush=True)
            return
        yield case


def select_part(cases: list, part: tuple[int, int] | None) -> list:
    """Cases K-1, K-1+N, ... of `cases` for part (K, N) (every case for None)."""
    if part is None:
        return list(cases)
    k, n = part
    return list(cases)[k - 1::n]


def main(argv: list[str] | None = None) -> int:
    """Run the prefill suite (see --help); print a line a case, optionally write JSON. Returns 0."""
    args = parse_args(argv)
    env = environment()
    args.impls, gpu = runnable_impls(args.impls, "ours", env)
    if gpu:
        _warm_up(0.5)
    cases = select_part(default_cases(args), args.part)
    start = time.perf_counter()

    def row(case):
        r = _row(case)
        r["started_s"] = round(time.perf_counter() - start, 1)
        return r

    def seconds(case, impl):
        return bench_case(case, impl, args.calls, args.target_ms / 1e3, args.reps)

    run_cases(_within(cases, args.max_seconds), args, env, "prefill", row, seconds,
              lambda case, sec: {"tflops": case.flops / sec / 1e12},
              lambda m: f"{m['us']:.0f}us/{m['tflops']:.0f}TF", _impl_skip, _impl_note)
    print(f"{len(cases)} cases planned, {time.perf_counter() - start:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
