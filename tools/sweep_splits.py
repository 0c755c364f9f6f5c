"""Time the decode engine at one shape over several split sizes (and the cluster plan), with the
benchmark's method (a donated jit chain of dependent calls): what the split planner should pick.

    python tools/sweep_splits.py --batch 8 --ctx 131072 --split-rows 32768 4032 2048 --out f.json
"""

from __future__ import annotations

import argparse
import functools
import json
import math

import jax
import jax.numpy as jnp

from jax_onnx_attn.bench import decode as bench
from jax_onnx_attn.ops import cuda


def time_split(case: bench.Case, split_rows, cluster, target_s=0.04, reps=5) -> float:
    """Median seconds per call of cuda.decode_attention with this split plan."""
    b, s, hq, hkv, d, c = case.batch, case.q_len, case.q_heads, case.kv_heads, case.head_dim, case.ctx
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[case.dtype]
    r, k_calls = case.rotations, case.calls
    keys = jax.random.split(jax.random.PRNGKey(c), 2 * r + 1)
    q = jax.random.normal(keys[0], (b, hq, s, d), dt)
    ks = [jax.random.normal(keys[1 + i], (b, hkv, c, d), dt) for i in range(r)]
    vs = [jax.random.normal(keys[1 + r + i], (b, hkv, c, d), dt) for i in range(r)]
    lens = jnp.full((b,), c, jnp.int32)
    attn = functools.partial(cuda.decode_attention, scale=1 / math.sqrt(d), split_rows=split_rows,
                             cluster=cluster)

    def chain(q, ks, vs, lens):
        for i in range(k_calls):
            q = attn(q, ks[i % r], vs[i % r], lens)
        return q

    run = jax.jit(chain, donate_argnums=(0,))
    state = {"q": q}

    def go():
        state["q"] = run(state["q"], ks, vs, lens)

    return bench._time_loop(go, lambda: state["q"].block_until_ready(), k_calls, target_s, reps)


def main() -> None:
    """Parse a shape and split sizes; print and optionally write µs and GB/s per plan."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--ctx", type=int, default=131072)
    ap.add_argument("--qlen", type=int, default=1)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16")
    ap.add_argument("--split-rows", type=int, nargs="*", default=[])
    ap.add_argument("--cluster", action="store_true", help="also time the cluster plan")
    ap.add_argument("--cluster-splits", type=int, nargs="*", default=[],
                    help="also time cluster plans of exactly these split counts (2-16)")
    ap.add_argument("--out")
    a = ap.parse_args()
    hq, hkv = map(int, a.heads.split("/"))
    case = bench.Case(a.batch, a.ctx, a.qlen, hq, hkv, a.dim, a.dtype)
    rows = hq // hkv * a.qlen
    plans = [("planner", None, False)] + [(f"split_rows={n}", n, False) for n in a.split_rows]
    if a.cluster:
        plans.append(("cluster", cuda.decode_cluster_split_rows(a.batch, hkv, rows, a.ctx, a.dim), True))
    tiles = -(-a.ctx // cuda.DECODE_BLOCK_N)
    for n in a.cluster_splits:
        plans.append((f"cluster splits={n}", -(-tiles // n) * cuda.DECODE_BLOCK_N, True))
    bench._warm_up()
    out = []
    for name, sr, cl in plans:
        sec = time_split(case, sr, cl)
        splits = -(-a.ctx // (sr or cuda.decode_split_rows(a.batch, hkv, rows, a.ctx, a.dim)))
        out.append({"plan": name, "splits": splits, "us": sec * 1e6, "gbs": case.kv_bytes / sec / 1e9})
        print(f"{case.label()}  {name:22s} splits={splits:4d}  {sec * 1e6:9.1f} us  "
              f"{case.kv_bytes / sec / 1e9:7.0f} GB/s", flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"case": case.label(), "plans": out}, f, indent=1)


if __name__ == "__main__":
    main()
