"""B=1 decode calls chained in XLA's command buffer, timed like bench decode (32 dependent calls a
jitted function, q donated, 16 K / V copies read in turn), with the planner's splits (two launches a
call: split kernel + PDL combine kernel) and with one split (split_rows = capacity: one launch), to
set beside tools/probes/decode_last_cta.cu's raw CUDA graph of the same kernels (`one-split` for the
second): whether XLA's cost is a custom call's or a launch's.
    python tools/probes/decode_xla_chain.py OUT.json [CALLS, default 32] [data]
More calls a jitted function amortise its host dispatch (a run of 32 B=1 calls is ~300 µs of GPU
work, close to what jax takes to dispatch it with 33 arguments)."""

import json
import math
import sys

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.bench.decode import _time_loop
from jax_onnx_attn.ops import cuda
from probe_results import write_results  # this folder: on sys.path as a script

COPIES = 16
CALLS = 32  # calls a jitted function (main takes argv[2])


def inputs(ctx, data="normal", seed=None):
    """(q, ks, vs, lens) of a B=1 32/8 d128 bf16 call on a full cache of ctx rows, COPIES K / V copies;
    data "normal" (bench decode's) or "uniform" (in [-2, 2): the raw probe's FillBf16)."""
    rng = np.random.default_rng(ctx if seed is None else seed)

    def draw(shape):
        x = rng.standard_normal(shape) if data == "normal" else rng.uniform(-2, 2, shape)
        return jnp.asarray(x, jnp.bfloat16)
    q = draw((1, 32, 1, 128))
    ks = [draw((1, 8, ctx, 128)) for _ in range(COPIES)]
    vs = [draw((1, 8, ctx, 128)) for _ in range(COPIES)]
    return q, ks, vs, jnp.full((1,), ctx, jnp.int32)


def time_xla(q, ks, vs, lens, split_rows, calls=None, reps=7):
    """µs a call of `calls` dependent decode calls a jitted function (q donated: a copy of it is)."""
    calls = calls or CALLS

    def chain(q, ks, vs):
        for i in range(calls):
            q = cuda.decode_attention(q, ks[i % len(ks)], vs[i % len(vs)], lens, scale=0.088, engine="decode",
                                      split_rows=split_rows)
        return q
    run = jax.jit(chain, donate_argnums=0)
    state = {"q": jnp.copy(q)}

    def go():
        state["q"] = run(state["q"], ks, vs)
    return 1e6 * _time_loop(go, lambda: state["q"].block_until_ready(), calls, 0.01, reps)


def time_chain(ctx, split_rows, data="normal"):
    """µs a call on fresh inputs (`inputs`)."""
    return time_xla(*inputs(ctx, data), split_rows)


def main():
    global CALLS
    CALLS = int(sys.argv[2]) if len(sys.argv) > 2 else CALLS
    out = []
    if len(sys.argv) > 3 and sys.argv[3] == "data":  # one split at 4096, normal against uniform data
        for data in ("normal", "uniform", "normal", "uniform"):
            row = {"ctx": 4096, "data": data, "one_split_us": time_chain(4096, 4096, data)}
            print(json.dumps(row), flush=True)
            out.append(row)
        write_results(sys.argv[1], "decode-xla-chain", "tools/probes/decode_xla_chain.py ... data: one split at "
                      f"4096, {CALLS} calls a jit, normal vs uniform [-2, 2) data", out)
        return
    for ctx in (2304, 4096, 8192):
        plan = cuda.decode_plan(1, 32, 8, 1, ctx, 128)
        row = {"ctx": ctx, "planned": {"splits": plan["splits"], "split_rows": plan["split_rows"],
                                       "us": time_chain(ctx, None)},
               "one_split": {"split_rows": math.ceil(ctx / 64) * 64, "us": time_chain(ctx, math.ceil(ctx / 64) * 64)}}
        print(json.dumps(row), flush=True)
        out.append(row)
    write_results(sys.argv[1], "decode-xla-chain", "tools/probes/decode_xla_chain.py: B=1 32/8 d128 bf16 decode "
                  f"calls, {CALLS} a jitted function in XLA's command buffer, us a call (median of 7)", out)


if __name__ == "__main__":
    main()
