"""Device time of the record-layout slots kernel (ffi/kernels/gemv/slots.cuh's RecordFormat) per
call with each L2 prefetch distance (JOA_GEMV_L2_PREFETCH: records a warp asks L2 for ahead of
its register loads), on the ~1B and ~8B decoders' projections at M = 1, block 32 with zero points:
    python tools/probes/record_l2_prefetch.py OUT.json [DISTANCES, default 0 2 4 8]
The distances of a shape are traced in turn, two rounds (each call reads its own copy of the weight:
4 copies, past the 50 MB L2 at ~8B), so run-to-run drift falls on all of them alike; each result
also checks that the outputs equal distance 0's bit for bit (a prefetch changes no arithmetic).
Command buffers off: each call is a plain stream launch."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import traced_kernel_events  # noqa: E402
from jax_onnx_attn.ops import cuda_matmul  # noqa: E402
from record_kernel_times import COPIES, BLOCK, record_weights  # this folder: on sys.path as a script  # noqa: E402
from rows_kernel_times import SHAPES, SHAPES_8B, write_results  # noqa: E402


ROUNDS = 2


def traced(distance, n, x, copies):
    """One jitted call per weight copy at this prefetch distance (read at trace time)."""
    os.environ[cuda_matmul.L2_PREFETCH_ENV] = str(distance)
    try:
        fn = jax.jit(lambda x, ws: jnp.concatenate(
            [cuda_matmul.matmul_nbits_record(x, t, n=n, block_size=BLOCK) for t in ws]))
        fn.lower(x, copies).compile()
        return fn
    finally:
        os.environ.pop(cuda_matmul.L2_PREFETCH_ENV, None)


def main():
    distances = [int(d) for d in sys.argv[2:]] or [0, 2, 4, 8]
    out = []
    rng = np.random.default_rng(0)
    for k, n in SHAPES + SHAPES_8B:
        rec = record_weights(k, n, rng)
        copies = [rec] + [jnp.copy(rec) for _ in range(COPIES - 1)]
        x = jnp.asarray(rng.standard_normal((1, k)), jnp.float16)
        fns = {d: traced(d, n, x, copies) for d in distances}
        ref = np.asarray(fns[distances[0]](x, copies))
        row = {"k": k, "n": n, "m": 1, "w_bytes": int(rec.nbytes)}
        durs = {d: [] for d in distances}
        for _ in range(ROUNDS):  # round-robin: drift falls on every distance alike
            for d in distances:
                durs[d] += [float(e["dur"]) for e in traced_kernel_events(fns[d], (x, copies), runs=2)
                            if "GemvSlots" in str(e.get("name", ""))]
        for d in distances:
            us = float(np.median(durs[d])) if durs[d] else None
            same = bool(np.array_equal(np.asarray(fns[d](x, copies)), ref))
            row[f"pf{d}"] = {"us": us, "tb_s": row["w_bytes"] / us / 1e6 if us else None, "calls": len(durs[d]),
                             "same_bits": same}
        print(json.dumps(row), flush=True)
        out.append(row)
        del copies
    write_results(sys.argv[1], "record-l2-prefetch", "tools/probes/record_l2_prefetch.py " + " ".join(sys.argv[2:]) +
                  ": profiler device time per call of the record-layout slots kernel by L2 prefetch distance (M 1,"
                  " block 32, zero points, fp16 x; distances in turn, 2 rounds)", out)


if __name__ == "__main__":
    main()
