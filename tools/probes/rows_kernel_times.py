"""Device time of the int4 rows kernel (ffi/kernels/gemv/rows.cuh) per call, from jax.profiler's
kernel events (not wall time / calls, which carries the harness's per-call overhead at small
shapes), with XLA's fp16 dot on a dense weight of the same shape beside it:
    python tools/probes/rows_kernel_times.py OUT.json [planned] [8b] [d2] [m16] [w2]
Shapes: the ~1B (or, with "8b", the ~8B) decoder's projections (qkv, o, gate-up, down, LM head) at
M 8 and 32 (with "m16" also 16); plans: the planner's and the forced ones of PLANS ((cluster,
warps_n, depth)), with "d2" only those of depth 2, with "w2" also 2-warp CTAs, with "planned" the
planner's only. Command buffers off, so each call is a plain stream launch the profiler sees."""

import json
import os
import sys
import tempfile

# Off for the whole process that imports this module: import write_results from probe_results instead.
os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import device_kernel_events, read_trace, traced_kernel_events  # noqa: E402
from jax_onnx_attn.ops import cuda_matmul  # noqa: E402
from jax_onnx_attn.ops.linear import to_rows_layout  # noqa: E402
from probe_results import write_results  # noqa: E402,F401  (this folder; re-exported for record_kernel_times)

SHAPES = [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048), (2048, 128256)]
SHAPES_8B = [(4096, 6144), (4096, 4096), (4096, 28672), (14336, 4096), (4096, 128256)]
PLANS = [(0, 0, 0)] + [(c, w, d) for c in (1, 2, 4, 8, 16) for w in (4, 8) for d in (2, 4)]
COPIES, BLOCK = 4, 32


def kernel_table(fn, args):
    """{kernel name[:60]: [median µs, count]} of a traced run of fn(*args), the 3 longest by total."""
    by = {}
    for e in traced_kernel_events(fn, args):
        by.setdefault(str(e.get("name", ""))[:60], []).append(float(e["dur"]))
    top = sorted(by.items(), key=lambda kv: -sum(kv[1]))[:3]
    return {name: [float(np.median(v)), len(v)] for name, v in top}




def rows_weights(k, n, rng):
    """Random int4 weights of a (K, N) projection (block 32, zero points) in the rows layout, on
    the device: (w, scales, zero_points)."""
    bq = rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, k // BLOCK)) / 16).astype(np.float16)
    z = rng.integers(0, 16, (n, k // BLOCK), dtype=np.uint8)
    return tuple(jnp.asarray(t) for t in to_rows_layout(bq, s, z))


def main():
    plans = PLANS[:1] if "planned" in sys.argv[2:] else PLANS
    if "w2" in sys.argv[2:] and "planned" not in sys.argv[2:]:
        plans = plans + [(c, 2, d) for c in (1, 2, 4, 8, 16) for d in (2, 4)]
    if "d2" in sys.argv[2:]:
        plans = [pl for pl in plans if pl[2] in (0, 2)]
    ms = (8, 16, 32) if "m16" in sys.argv[2:] else (8, 32)
    shapes = SHAPES_8B if "8b" in sys.argv[2:] else SHAPES
    out = []
    rng = np.random.default_rng(0)
    for k, n in shapes:
        packed = rows_weights(k, n, rng)
        copies = [packed] + [tuple(jnp.copy(t) for t in packed) for _ in range(COPIES - 1)]
        dense = [jnp.asarray(rng.standard_normal((n, k), np.float32) / 64, jnp.float16) for _ in range(2)]
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
            row = {"k": k, "n": n, "m": m, "w_bytes": int(sum(t.nbytes for t in packed))}
            fns = []
            for plan in plans:
                c, w, d = plan
                p = cuda_matmul.gemv_plan(m, n, k, 4, False, cluster=c, block_size=BLOCK, rows_layout=True, warps_n=w,
                                          depth=d)
                name = "planned" if plan == (0, 0, 0) else f"c{c},w{w},d{d}"
                if p["error"]:
                    row[name] = {"skip": p["error"][:80]}
                    continue
                fn = jax.jit(lambda x, ws, c=c, w=w, d=d: jnp.stack([cuda_matmul.matmul_nbits_rows(
                    x, *t, n=n, block_size=BLOCK, cluster=c, warps_n=w, depth=d)[0, :8] for t in ws]))
                try:
                    fn(x, copies).block_until_ready()  # compiled and warm outside the trace
                except Exception as e:  # a plan the launch refuses is a result
                    row[name] = {"skip": f"{type(e).__name__}: {str(e)[:120]}"}
                    continue
                fns.append((name, fn, {f: p[f] for f in ("cluster", "warps_n", "stages", "grid", "ctas_per_sm", "smem_bytes")}))
            # One trace for every plan, run one after another: the i-th run's kernels, in time order.
            with tempfile.TemporaryDirectory() as tdir:
                with jax.profiler.trace(tdir):
                    for _, fn, _ in fns:
                        for _ in range(3):
                            fn(x, copies).block_until_ready()
                kernels, _ = device_kernel_events(read_trace(tdir))
            rows_k = sorted((float(e["ts"]), float(e["dur"])) for e in kernels or [] if "GemvRows" in str(e.get("name", "")))
            per = 3 * COPIES
            for i, (name, _, plan_fields) in enumerate(fns):
                durs = [dur for _, dur in rows_k[i * per:(i + 1) * per]]
                us = float(np.median(durs)) if len(durs) == per else None
                row[name] = {"us": us, "tb_s": row["w_bytes"] / us / 1e6 if us else None, "plan": plan_fields}
            fd = jax.jit(lambda x, ws: jnp.stack([(x @ t.T)[0, :8] for t in ws]))
            row["xla-fp16"] = kernel_table(fd, (x, dense))
            print(json.dumps(row), flush=True)
            out.append(row)
        del copies, dense
    write_results(sys.argv[1], "rows-kernel-times", "tools/probes/rows_kernel_times.py " + " ".join(sys.argv[2:]) +
                  ": profiler device time per call of the int4 rows kernel (block 32, fp16 x), planned and forced"
                  " layouts; xla-fp16: XLA's dot on a dense fp16 weight of the same shape", out)


if __name__ == "__main__":
    main()
