"""One GroupQueryAttention decode step as a model runs it: our kernels vs the XLA-compiled reference.

The step is the whole op — packed QKV split, rotary, the in-place append into a shared
fixed-capacity cache (donated), attention over the valid rows — with backend "cuda" (gqa_prepare +
the split-KV engine) and backend "reference" (the jnp spec compiled by XLA), in one process on the
same inputs. Timing: K dependent steps (each step's output is written into the next step's query, the
caches are carried) in one jitted function whose inputs are donated, dispatched M times; per-step
time = wall time / (M * K), the median of several samples. GB/s counts the K+V bytes of the valid
rows each step reads. On a CPU machine only "reference" runs (a check of the harness itself).
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys

# A step's shape is a decode Case (the cache [B, Hkv, ctx, D] is full after the step's S rows).
from jax_onnx_attn.bench.decode import (Case, _time_loop, _warm_up, add_timing_args, default_cases,
                                        environment, run_cases, runnable_impls)

IMPLS = ("cuda", "reference")


def bench_step(case: Case, impl: str, calls: int, target_s: float, reps: int) -> float:
    """Median seconds per step of `ops.group_query_attention(..., backend=impl)` on `case`."""
    import jax
    import jax.numpy as jnp

    from jax_onnx_attn import ops

    b, s, n, hkv, d, c = case.batch, case.q_len, case.q_heads, case.kv_heads, case.head_dim, case.ctx
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[case.dtype]
    keys = jax.random.split(jax.random.PRNGKey(c + b), 4)
    query = jax.random.normal(keys[0], (b, s, (n + 2 * hkv) * d), dt)
    quant = {}
    if case.kv_bits:
        storage, cache_d = (jnp.int8, d) if case.kv_bits == 8 else (jnp.uint8, d // 2)
        lo, hi = (-128, 128) if case.kv_bits == 8 else (0, 256)
        k_cache = jax.random.randint(keys[1], (b, hkv, c, cache_d), lo, hi).astype(storage)
        v_cache = jax.random.randint(keys[2], (b, hkv, c, cache_d), lo, hi).astype(storage)
        scale = jnp.full((1,), 0.02, jnp.float32)
        quant = dict(k_scale=scale, v_scale=scale, k_quant_type="PER_TENSOR",
                     v_quant_type="PER_TENSOR", kv_cache_bit_width=case.kv_bits)
    else:
        k_cache = jax.random.normal(keys[1], (b, hkv, c, d), dt)
        v_cache = jax.random.normal(keys[2], (b, hkv, c, d), dt)
    angles = jax.random.uniform(keys[3], (c, d // 2), jnp.float32, 0, 2 * math.pi)
    cos, sin = jnp.cos(angles).astype(dt), jnp.sin(angles).astype(dt)
    seqlens = jnp.full((b,), c - 1, jnp.int32)  # the step's rows go to c - S .. c - 1

    def chain(query, k_cache, v_cache):
        for _ in range(calls):
            out = ops.group_query_attention(
                query, None, None, k_cache, v_cache, seqlens, c, cos, sin, num_heads=n,
                kv_num_heads=hkv, do_rotary=1, shared_buffer=True, backend=impl, **quant)
            k_cache, v_cache = out.present_key, out.present_value
            query = query.at[..., :n * d].set(out.output)  # the next step depends on this one
        return query, k_cache, v_cache

    # Donated: the caches are updated in place and every execution sees the same addresses, so XLA
    # replays its command buffers instead of re-recording them.
    run = jax.jit(chain, donate_argnums=(0, 1, 2))
    state = {"args": (query, k_cache, v_cache)}

    def go():
        state["args"] = run(*state["args"])

    return _time_loop(go, lambda: jax.block_until_ready(state["args"]), calls, target_s, reps)


def main(argv: list[str] | None = None) -> int:
    """Run the GQA step suite (see --help); print a table, optionally write JSON. Returns 0."""
    ap = argparse.ArgumentParser(prog="python -m jax_onnx_attn.bench gqa", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--ctx", type=int, nargs="+", default=[1024, 4096, 16384])
    ap.add_argument("--qlen", type=int, nargs="+", default=[1])
    ap.add_argument("--heads", nargs="+", default=["32/8"], help="N/Hkv pairs")
    ap.add_argument("--dims", type=int, nargs="+", default=[128])
    ap.add_argument("--dtypes", nargs="+", default=["bf16"], choices=["bf16", "fp16"])
    ap.add_argument("--kv-bits", type=int, nargs="+", default=[0], choices=[0, 8, 4])
    ap.add_argument("--impls", nargs="+", default=list(IMPLS), choices=IMPLS)
    add_timing_args(ap, calls=16, target_ms=40.0)
    args = ap.parse_args(argv)

    env = environment()
    args.impls, _ = runnable_impls(args.impls, "cuda", env)
    _warm_up(0.5)
    run_cases(default_cases(args), args, env, "gqa",
              lambda case: {**dataclasses.asdict(case), "label": case.label(), "kv_bytes": case.kv_bytes,
                            "calls_per_graph": args.calls},
              lambda case, impl: bench_step(case, impl, args.calls, args.target_ms / 1e3, args.reps),
              lambda case, sec: {"gbs": case.kv_bytes / sec / 1e9},
              lambda m: f"{m['us']:.1f}us/{m['gbs']:.0f}GB/s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
