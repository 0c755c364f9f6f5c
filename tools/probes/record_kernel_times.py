"""Device time of the int4 slots kernel on the record layout (ffi/kernels/gemv/slots.cuh's
RecordFormat: B=1 decode's projections) per call, from jax.profiler's kernel events, beside XLA's
fp16 dot on a dense weight of the same shape:
    python tools/probes/record_kernel_times.py OUT.json
Shapes: the ~1B and ~8B decoders' projections (qkv, o, gate-up, down, LM head), M = 1, block 32 with
zero points. Each call reads its own copy of the weight (4 copies: past the 50 MB L2 at ~8B). Command
buffers off, so each call is a plain stream launch the profiler sees."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import traced_kernel_events  # noqa: E402
from jax_onnx_attn.ops import cuda_matmul  # noqa: E402
from jax_onnx_attn.ops.linear import to_record_layout  # noqa: E402
from rows_kernel_times import SHAPES, SHAPES_8B, kernel_table, write_results  # this folder: on sys.path as a script  # noqa: E402

COPIES, BLOCK = 4, 32


def record_weights(k, n, rng):
    bq = rng.integers(0, 256, (n, k // BLOCK, BLOCK // 2), dtype=np.uint8)
    s = (rng.uniform(0.5, 1.5, (n, k // BLOCK)) / 16).astype(np.float16)
    z = rng.integers(0, 16, (n, k // BLOCK), dtype=np.uint8)
    return jnp.asarray(to_record_layout(bq, s, z))


def main():
    out = []
    rng = np.random.default_rng(0)
    for k, n in SHAPES + SHAPES_8B:
        rec = record_weights(k, n, rng)
        copies = [rec] + [jnp.copy(rec) for _ in range(COPIES - 1)]
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float16)
        row = {"k": k, "n": n, "m": 1, "w_bytes": int(rec.nbytes),
               "plan": {f: v for f, v in cuda_matmul.gemv_plan(1, n, k, 4, False, block_size=BLOCK,
                                                               record_layout=True).items()
                        if f in ("cluster", "warps_n", "warps_k", "grid", "ctas_per_sm", "smem_bytes", "error")}}
        fn = jax.jit(lambda x, ws: jnp.stack([cuda_matmul.matmul_nbits_record(x, t, n=n, block_size=BLOCK)[0, :8]
                                             for t in ws]))
        durs = [float(e["dur"]) for e in traced_kernel_events(fn, (x, copies)) if "GemvSlots" in str(e.get("name", ""))]
        us = float(np.median(durs)) if durs else None
        row["record"] = {"us": us, "tb_s": row["w_bytes"] / us / 1e6 if us else None, "calls": len(durs)}
        dense = [jnp.asarray(rng.standard_normal((n, k), np.float32) / 64, jnp.float16) for _ in range(2)]
        row["xla-fp16"] = kernel_table(jax.jit(lambda x, ws: jnp.stack([(x @ t.T)[0, :8] for t in ws])), (x, dense))
        print(json.dumps(row), flush=True)
        out.append(row)
        del copies, dense
    write_results(sys.argv[1], "record-kernel-times", "tools/probes/record_kernel_times.py " + " ".join(sys.argv[2:]) +
                  ": profiler device time per call of the int4 slots kernel's record reader (M 1, block 32, zero"
                  " points, fp16 x)", out)


if __name__ == "__main__":
    main()
