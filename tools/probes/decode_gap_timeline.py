"""Session 32: where the decode launch's 2-4 µs a call in XLA's command buffer goes (s32_xla_gap.sh:
the same one-split B=1 launch, bf16 32/8 d128, runs 26.4 / 44.6 / 86.0 µs a call in a raw CUDA graph
and 28.5 / 48.1 / 89.8 in XLA's, on the same jax buffers in one process, and ncu times the kernel
alone the same both ways). One process, one profiler: the raw graph (decode_raw_on_jax.so's
joa_replay_one_split, 64 calls a graph) and the same 64 calls a jitted function through XLA; per
way the kernels' device durations, their start-to-start periods and the gaps between one's end and
the next one's start (medians, and the gaps' 90th percentile):
    python tools/probes/decode_gap_timeline.py LIB.so OUT.json [CTX ...]   (default 2304 4096)"""

import ctypes
import json
import os
import sys

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_enable_command_buffers_during_profiling=true").strip()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from decode_xla_chain import COPIES, inputs  # noqa: E402  (this folder: on sys.path as a script)
from jax_onnx_attn.bench.e2e import traced_kernel_events  # noqa: E402
from jax_onnx_attn.ops import cuda  # noqa: E402
from probe_results import write_results  # noqa: E402

CALLS = 64  # the library's kCalls


def stats(events):
    ev = sorted((e for e in events if "DecodeSplit" in str(e.get("name", ""))), key=lambda e: float(e["ts"]))
    ts = np.array([float(e["ts"]) for e in ev])
    dur = np.array([float(e["dur"]) for e in ev])
    gaps = ts[1:] - (ts[:-1] + dur[:-1])
    return {"kernels": len(ev), "dur_us": float(np.median(dur)), "period_us": float(np.median(np.diff(ts))),
            "gap_us": float(np.median(gaps)), "gap_p90_us": float(np.percentile(gaps, 90)),
            "gap_max_us": float(gaps.max())}


def main():
    lib = ctypes.CDLL(sys.argv[1])
    out = []
    for ctx in [int(c) for c in sys.argv[3:]] or [2304, 4096]:
        q, ks, vs, lens = inputs(ctx, seed=0)
        res = jnp.zeros_like(q)

        def ptrs(arrays):
            return (ctypes.c_void_p * len(arrays))(*[a.unsafe_buffer_pointer() for a in arrays])
        kp, vp = ptrs(ks), ptrs(vs)

        def raw(_):
            err = lib.joa_replay_one_split(ctypes.c_void_p(q.unsafe_buffer_pointer()), kp, vp, COPIES,
                                           ctypes.c_void_p(lens.unsafe_buffer_pointer()),
                                           ctypes.c_void_p(res.unsafe_buffer_pointer()), ctx, 2)
            assert err == 0, f"cuda error {err}"
            return res

        def chain(q, ks, vs):
            for i in range(CALLS):
                q = cuda.decode_attention(q, ks[i % len(ks)], vs[i % len(vs)], lens, scale=0.088, engine="decode",
                                          split_rows=ctx)
            return q
        xla = jax.jit(chain)
        row = {"ctx": ctx, "raw_graph": stats(traced_kernel_events(raw, (None,), runs=2)),
               "xla": stats(traced_kernel_events(xla, (q, ks, vs), runs=2))}
        print(json.dumps(row), flush=True)
        out.append(row)
    write_results(sys.argv[2], "decode-gap-timeline", "tools/probes/decode_gap_timeline.py " + " ".join(sys.argv[3:]) +
                  ": one-split B=1 32/8 d128 bf16 launches, 64 a graph, raw vs XLA, profiled in one process", out)


if __name__ == "__main__":
    main()
