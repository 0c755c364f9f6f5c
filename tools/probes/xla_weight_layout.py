"""XLA's half GEMM at decode's rows of x, the weight stored [N, K] (the loader's weight-major layout,
x @ W^T) against [K, N] (ONNX's, x @ W): profiler device time per call (median), on the ~1B and ~8B
decoders' projection shapes: python tools/probes/xla_weight_layout.py OUT.json
Each call reads a different copy of W and x (no shape stays in L2; XLA cannot fuse the dots into one
over concatenated weights). Command buffers off, so each call is a kernel the profiler sees."""

import json
import os
import sys

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from jax_onnx_attn.bench.e2e import traced_kernel_events  # noqa: E402

SHAPES = [(2048, 3072, "1b qkv"), (2048, 2048, "1b o"), (2048, 16384, "1b gate-up"), (8192, 2048, "1b down"),
          (2048, 128256, "1b lm head"), (4096, 6144, "8b qkv"), (4096, 4096, "8b o"), (4096, 28672, "8b gate-up"),
          (14336, 4096, "8b down"), (4096, 128256, "8b lm head")]
MIN_BYTES = 256 << 20


def gemm_us(fn, args, calls):
    """Median device µs of the call's GEMM kernels ('gemm' or 'dot' in the name) over 3 traced runs."""
    kernels = traced_kernel_events(fn, args)
    durs = [float(e["dur"]) for e in kernels if "gemm" in str(e.get("name", "")) or "dot" in str(e.get("name", ""))]
    names = sorted({str(e.get("name", ""))[:40] for e in kernels})
    return (float(np.median(durs)) if len(durs) >= 3 * calls else None), names


def main():
    rng = np.random.default_rng(0)
    out = []
    for k, n, what in SHAPES:
        copies = max(2, min(16, -(-MIN_BYTES // (n * k * 2))))
        w_kn = [jnp.asarray(rng.standard_normal((k, n), np.float32) / 64, jnp.float16) for _ in range(copies)]
        w_nk = [jnp.asarray(w.T) for w in w_kn]
        for m in (8, 32):
            xs = [jnp.asarray(rng.standard_normal((m, k)), jnp.float16) for _ in range(copies)]
            kn = jax.jit(lambda xs, ws: jnp.stack([(x @ w).sum(0) for x, w in zip(xs, ws)]))
            nk = jax.jit(lambda xs, ws: jnp.stack([(x @ w.T).sum(0) for x, w in zip(xs, ws)]))
            us_kn, names_kn = gemm_us(kn, (xs, w_kn), copies)
            us_nk, names_nk = gemm_us(nk, (xs, w_nk), copies)
            row = {"what": what, "k": k, "n": n, "m": m, "copies": copies, "w_bytes": n * k * 2,
                   "kn_us": us_kn, "nk_us": us_nk, "kn_kernels": names_kn, "nk_kernels": names_nk}
            print(json.dumps({f: row[f] for f in ("what", "m", "kn_us", "nk_us")}), flush=True)
            out.append(row)
        del w_kn, w_nk
    doc = {"suite": "xla-weight-layout", "commit": os.environ.get("JOA_GIT_COMMIT", "unknown"),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "what": "tools/probes/xla_weight_layout.py: XLA's half GEMM device time per call (median), W [K, N] "
                   "(x @ W) vs W [N, K] (x @ W^T)", "results": out}
    json.dump(doc, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
