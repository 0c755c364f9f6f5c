"""Where a B=1 decode call's time goes: a chain of 32 dependent decode_attention calls (32/8 d128, bf16,
kv_len = capacity) in one jitted loop inside XLA's command buffer, profiled; per call the split
kernel's and the combine kernel's device durations, the split kernel's start to the combine's end,
and the start-to-start period (what `bench decode` times):
    python tools/probes/decode_b1_timeline.py OUT.json [CTX ...]   (default 2304 4096 8192)
Each context runs with the speculated first tiles off and on (JOA_DECODE_SPECULATE)."""

import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()

import functools  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import traced_kernel_events  # noqa: E402
from jax_onnx_attn.ops import cuda  # noqa: E402
from probe_results import write_results  # this folder: on sys.path as a script  # noqa: E402

CALLS = 32


def chain(ctx, speculate):
    rng = np.random.default_rng(ctx)
    q = jnp.asarray(rng.standard_normal((1, 32, 1, 128)), jnp.bfloat16)
    k = jnp.asarray(rng.standard_normal((1, 8, ctx, 128)), jnp.bfloat16)
    v = jnp.asarray(rng.standard_normal((1, 8, ctx, 128)), jnp.bfloat16)
    lens = jnp.full((1,), ctx, jnp.int32)
    attn = functools.partial(cuda.decode_attention, scale=0.088, speculate=speculate, engine="decode")
    fn = jax.jit(lambda q: jax.lax.fori_loop(0, CALLS, lambda i, q: attn(q, k, v, lens), q))
    return fn, (q,)


def summarise(events):
    """Per call (a split kernel and the combine kernel after it): durations and periods, medians."""
    ev = sorted((e for e in events if "Decode" in str(e.get("name", ""))), key=lambda e: float(e["ts"]))
    splits = [e for e in ev if "Split" in str(e["name"])]
    combines = [e for e in ev if "Combine" in str(e["name"])]
    row = {"splits": len(splits), "combines": len(combines),
           "split_us": float(np.median([float(e["dur"]) for e in splits])) if splits else None}
    if combines:
        row["combine_us"] = float(np.median([float(e["dur"]) for e in combines]))
        # each split's start to the first combine ending after it
        spans = []
        for s in splits:
            t0 = float(s["ts"])
            ends = [float(c["ts"]) + float(c["dur"]) for c in combines if float(c["ts"]) + float(c["dur"]) > t0]
            if ends:
                spans.append(min(ends) - t0)
        row["split_start_to_combine_end_us"] = float(np.median(spans)) if spans else None
    starts = [float(e["ts"]) for e in splits]
    row["period_us"] = float(np.median(np.diff(starts))) if len(starts) > 1 else None
    return row


def main():
    ctxs = [int(c) for c in sys.argv[2:]] or [2304, 4096, 8192]
    out = []
    for ctx in ctxs:
        for speculate in (False, True):
            fn, args = chain(ctx, speculate)
            row = {"ctx": ctx, "speculate": speculate, "plan": {
                k: v for k, v in cuda.decode_plan(1, 32, 8, 1, ctx, 128).items()
                if k in ("splits", "split_rows", "cluster", "grid")}}
            row.update(summarise(traced_kernel_events(fn, args, runs=3)))
            print(json.dumps(row), flush=True)
            out.append(row)
    write_results(sys.argv[1], "decode-b1-timeline", "tools/probes/decode_b1_timeline.py " + " ".join(sys.argv[2:]) +
                  ": B=1 32/8 d128 bf16 decode calls chained in a command buffer, profiled (device µs, medians)", out)


if __name__ == "__main__":
    main()
