"""Prefill attention kernels: our Hopper prefill engine (`cuda.prefill_attention`) against
`jax.nn.dot_product_attention` (implementation "cudnn" and "xla") on the same shapes, one process.

Cases: causal / non-causal x sequence lengths S (= T, self-attention over the whole prompt) with
B·S held near `--tokens` (16k: B = 16, 8, 4, 2, 1 at S = 1k .. 16k), GQA Hq/Hkv, head size D
(`--dims`: any of cuda.PREFILL_HEAD_DIMS, 64 / 80 / 96 / 128 / 256; TFLOP/s count D, not the
padded tile width 80 and 96 run in), bf16 / fp16. `--max-seconds` stops starting new cases after
that long (the cases run in the order causal x heads x D x dtype x S). Timing: K dependent calls (each call's output is the next call's query) in one jitted
function whose query is donated, dispatched M times; per-call time = wall time / (M·K), the median
of several samples. TFLOP/s = 4·B·Hq·S·T·D / time, halved for causal (DESIGN.md). Our engine runs
on sm_90 only; an impl that cannot run a case is recorded with the reason ({"skip": ...}).

JSON (--out): {"suite": "prefill", "env": ..., "args": ..., "results": [{batch, ctx, q_len,
q_heads, kv_heads, head_dim, dtype, causal, label, flops, impls: {impl: {us, tflops} | {skip}}}]},
the schema `jax_onnx_attn.bench.plots` reads.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
import time

from jax_onnx_attn.bench.decode import (_jax_dtype, _time_loop, _warm_up, add_timing_args, environment,
                                        run_cases, runnable_impls)

#: "ours": the engine's serial consumer schedule; "ours-<schedule>": its others (cuda.prefill_attention).
IMPLS = ("ours", "ours-overlap", "ours-pingpong", "jax-cudnn", "jax-xla")
MAX_LOGIT_BYTES = 8 << 30  # the xla implementation materialises [B, Hq, S, T] f32 logits


@dataclasses.dataclass(frozen=True)
class Case:
    """One prompt shape: B prompts of S tokens attending to themselves (T = S)."""

    batch: int
    seq: int
    q_heads: int
    kv_heads: int
    head_dim: int
    dtype: str
    causal: bool

    def label(self) -> str:
        """A short name for tables: batch, length, heads, head size, dtype, mask."""
        mask = "causal" if self.causal else "noncausal"
        return (f"B{self.batch} S{self.seq} {self.q_heads}/{self.kv_heads} d{self.head_dim} "
                f"{self.dtype} {mask}")

    @property
    def flops(self) -> float:
        """4·B·Hq·S·T·D (QKᵀ and PV), halved for causal."""
        f = 4.0 * self.batch * self.q_heads * self.seq * self.seq * self.head_dim
        return f / 2 if self.causal else f


def default_cases(args) -> list[Case]:
    """The cases of the command line: causal x heads x head size x dtype x S, B = tokens // S."""
    cases = []
    for causal in args.causal:
        for heads in args.heads:
            hq, hkv = (int(x) for x in heads.split("/"))
            for d in args.dims:
                for dtype in args.dtypes:
                    for s in args.seqlens:
                        b = max(1, args.tokens // s)
                        cases.append(Case(b, s, hq, hkv, d, dtype, causal == "causal"))
    return cases


def _within(cases: list[Case], seconds: float):
    """The cases, until `seconds` have passed since the first was handed out."""
    start = time.perf_counter()
    for case in cases:
        if time.perf_counter() - start > seconds:
            print(f"time budget reached: stopping before {case.label()}", flush=True)
            return
        yield case


def _impl_skip(case: Case, impl: str) -> str | None:
    logits = 4 * case.batch * case.q_heads * case.seq * case.seq
    if impl == "jax-xla" and logits > MAX_LOGIT_BYTES:
        return f"xla logits would take {logits / 2**30:.0f} GiB"
    return None


def bench_case(case: Case, impl: str, calls: int, target_s: float, reps: int) -> float:
    """Median seconds per call of `impl` on random inputs of `case`."""
    import jax
    import jax.numpy as jnp

    from jax_onnx_attn.ops import cuda

    b, s, hq, hkv, d = case.batch, case.seq, case.q_heads, case.kv_heads, case.head_dim
    dt = _jax_dtype(case.dtype)
    scale = 1.0 / math.sqrt(d)
    keys = jax.random.split(jax.random.PRNGKey(s + b), 3)
    if impl.startswith("ours"):  # BHSD
        q_shape, kv_shape = (b, hq, s, d), (b, hkv, s, d)
        lens = jnp.full((b,), s, jnp.int32)

        def attn(q, k, v):
            return cuda.prefill_attention(q, k, v, lens, lens, scale=scale, causal=case.causal,
                                          schedule=impl.partition("-")[2] or "serial")
    else:  # BTNH
        q_shape, kv_shape = (b, s, hq, d), (b, s, hkv, d)
        which = impl.split("-")[1]

        def attn(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, scale=scale, is_causal=case.causal,
                                                implementation=which)
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


def _row(case: Case) -> dict:
    """A result's fields (the schema `plots` reads: a prompt attends to itself, ctx = q_len = S)."""
    return {"batch": case.batch, "ctx": case.seq, "q_len": case.seq, "q_heads": case.q_heads,
            "kv_heads": case.kv_heads, "head_dim": case.head_dim, "dtype": case.dtype,
            "causal": case.causal, "label": case.label(), "flops": case.flops}


def main(argv: list[str] | None = None) -> int:
    """Run the prefill suite (see --help); print a table, optionally write JSON. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench prefill", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seqlens", type=int, nargs="+", default=[1024, 2048, 4096, 8192, 16384])
    ap.add_argument("--tokens", type=int, default=16384, help="B = tokens // S")
    ap.add_argument("--heads", nargs="+", default=["32/8"], help="Hq/Hkv pairs")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--causal", nargs="+", default=["causal", "noncausal"],
                    choices=["causal", "noncausal"])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    add_timing_args(ap, calls=4, target_ms=100.0)
    ap.add_argument("--max-seconds", type=float, default=float("inf"),
                    help="stop starting new cases after this long (partial results are kept)")
    args = ap.parse_args(argv)

    env = environment()
    args.impls, gpu = runnable_impls(args.impls, "ours", env)
    if gpu:
        _warm_up(0.5)
    run_cases(_within(default_cases(args), args.max_seconds), args, env, "prefill", _row,
              lambda case, impl: bench_case(case, impl, args.calls, args.target_ms / 1e3, args.reps),
              lambda case, sec: {"tflops": case.flops / sec / 1e12},
              lambda m: f"{m['us']:.0f}us/{m['tflops']:.0f}TF", _impl_skip)
    return 0


if __name__ == "__main__":
    sys.exit(main())
