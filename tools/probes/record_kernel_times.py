"""Device time of the int4 slots kernel on the record layout (ffi/kernels/gemv/slots.cuh's
RecordFormat: B=1 decode's projections) per call, from jax.profiler's kernel events, for its W
paths side by side: ring 0 (W straight into registers), the plan's ring, and rings of 2, 3, 4
records a warp forced (plan.h's MakeRecordPlan; a ring that does not fit two CTAs an SM is skipped
with the plan's reason), beside XLA's fp16 dot on a dense weight of the same shape:
    python tools/probes/record_kernel_times.py OUT.json [1b | 8b] [noxla]
Shapes: the ~1B and ~8B decoders' projections (qkv, o, gate-up, down, LM head; "1b" / "8b" one
set), M = 1, block 32 with zero points. Each call reads its own copy of the weight (4 copies: past
the 50 MB L2 at ~8B). Command buffers off, so each call is a plain stream launch the profiler sees.
Every ring's output is checked against ring 0's bits ("same_bits"). Prints a table (µs and TB/s
per path) as it goes; OUT.json holds the rows."""

import json
import os
import sys
import tempfile

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import device_kernel_events, read_trace  # noqa: E402
from jax_onnx_attn.ops import cuda_matmul  # noqa: E402
from jax_onnx_attn.ops.linear import to_record_layout  # noqa: E402
from rows_kernel_times import SHAPES, SHAPES_8B, kernel_table, write_results  # this folder: on sys.path as a script  # noqa: E402

COPIES, BLOCK = 4, 32
# (name, ring): None is the plan's.
PATHS = [("ring0", 0), ("planned", None), ("ring2", 2), ("ring3", 3), ("ring4", 4)]


def record_weights(k, n, rng):
    bq = rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, k // BLOCK)) / 16).astype(np.float16)
    z = rng.integers(0, 16, (n, k // BLOCK), dtype=np.uint8)
    return jnp.asarray(to_record_layout(bq, s, z))


def slots_us(fn, args):
    """Median device µs of the slots kernel's calls in a traced run of fn(*args) (3 repeats)."""
    with tempfile.TemporaryDirectory() as tdir:
        with jax.profiler.trace(tdir):
            for _ in range(3):
                fn(*args).block_until_ready()
        kernels, _ = device_kernel_events(read_trace(tdir))
    durs = [float(e["dur"]) for e in kernels or [] if "GemvSlots" in str(e.get("name", ""))]
    return (float(np.median(durs)) if durs else None), len(durs)


def main():
    args = sys.argv[2:]
    shapes = SHAPES if "1b" in args else SHAPES_8B if "8b" in args else SHAPES + SHAPES_8B
    out = []
    rng = np.random.default_rng(0)
    print(f"{'K x N':>14} " + " ".join(f"{name:>16}" for name, _ in PATHS) + "   (µs / TB/s)", flush=True)
    for k, n in shapes:
        rec = record_weights(k, n, rng)
        copies = [rec] + [jnp.copy(rec) for _ in range(COPIES - 1)]
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float16)
        row = {"k": k, "n": n, "m": 1, "w_bytes": int(rec.nbytes)}
        base = None
        for name, ring in PATHS:
            plan = cuda_matmul.gemv_plan(1, n, k, 4, False, block_size=BLOCK, record_layout=True, ring=ring)
            entry = {"plan": {f: v for f, v in plan.items()
                              if f in ("ring", "cluster", "warps_k", "grid", "ctas_per_sm", "smem_bytes")}}
            if plan["error"]:
                row[name] = {**entry, "skip": plan["error"]}
                continue
            full = np.asarray(jax.jit(lambda x, t, ring=ring: cuda_matmul.matmul_nbits_record(
                x, t, n=n, block_size=BLOCK, ring=ring))(x, rec))
            base = full if ring == 0 else base
            fn = jax.jit(lambda x, ws, ring=ring: jnp.stack([cuda_matmul.matmul_nbits_record(
                x, t, n=n, block_size=BLOCK, ring=ring)[0, :8] for t in ws]))
            fn(x, copies).block_until_ready()  # compiled and warm outside the trace
            us, calls = slots_us(fn, (x, copies))
            row[name] = {**entry, "us": us, "tb_s": row["w_bytes"] / us / 1e6 if us else None, "calls": calls,
                         "same_bits": bool(base is not None and np.array_equal(full, base))}
        if "noxla" not in args:
            dense = [jnp.asarray(rng.standard_normal((n, k), np.float32) / 64, jnp.float16) for _ in range(2)]
            row["xla-fp16"] = kernel_table(jax.jit(lambda x, ws: jnp.stack([(x @ t.T)[0, :8] for t in ws])),
                                           (x, dense))
            del dense
        cells = []
        for name, _ in PATHS:
            r = row[name]
            if "us" in r and r["us"]:
                mark = "" if r["same_bits"] else "!"
                cells.append(f"{r['us']:6.1f}/{r['tb_s']:4.2f}{mark}" + (f"[{r['plan']['ring']}]" if name == "planned" else ""))
            else:
                cells.append("-")
        print(f"{k:>6} x {n:<6} " + " ".join(f"{c:>16}" for c in cells), flush=True)
        print(json.dumps(row), flush=True)
        out.append(row)
        del copies
    write_results(sys.argv[1], "record-kernel-times", "tools/probes/record_kernel_times.py " + " ".join(args) +
                  ": profiler device time per call of the int4 slots kernel's record reader (M 1, block 32, zero"
                  " points, fp16 x): ring 0, the plan's ring, forced rings 2-4; same_bits: equal to ring 0", out)
    bad = [(r["k"], r["n"], name) for r in out for name, _ in PATHS if r[name].get("same_bits") is False]
    if bad:
        raise SystemExit(f"rings that did not give ring 0's bits: {bad}")


if __name__ == "__main__":
    main()
