"""Device time per call of dense half projections at decode's 8-32 rows of x: the dense rows kernel
(ffi/kernels/gemv/dense_rows.cuh; its load map and carveout variants, session 25's knobs), the ring
kernel (JOA_GEMV_DENSE_ROWS=0) and XLA's dot, from
jax.profiler's kernel events (median of the calls), on the ~1B and ~8B decoders' projection shapes:
    python tools/probes/dense_rows_times.py OUT.json [m8]
Each call reads a different copy of W (>= 256 MB of copies: no shape stays in the 50 MB L2). M 8 and
32 (with "m8" only 8). Command buffers off, so each call is a plain stream launch the profiler sees."""

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

# (K, N, what): the ~1B then the ~8B decoder's qkv, o, gate-up, down and LM head.
SHAPES = [(2048, 3072, "1b qkv"), (2048, 2048, "1b o"), (2048, 16384, "1b gate-up"), (8192, 2048, "1b down"),
          (2048, 128256, "1b lm head"), (4096, 6144, "8b qkv"), (4096, 4096, "8b o"), (4096, 28672, "8b gate-up"),
          (14336, 4096, "8b down"), (4096, 128256, "8b lm head")]
MIN_BYTES = 256 << 20


def device_us(fn, args, match, calls):
    """Median device µs of the kernels whose name contains one of `match` (all kernels: None) over
    3 traced runs of fn(*args), and their names."""
    fn(*args).block_until_ready()
    with tempfile.TemporaryDirectory() as d:
        with jax.profiler.trace(d):
            for _ in range(3):
                fn(*args).block_until_ready()
        kernels, _ = device_kernel_events(read_trace(d))
    names = {}
    for e in kernels or []:
        name = str(e.get("name", ""))
        if match is None or any(s in name for s in match):
            names.setdefault(name[:70], []).append(float(e["dur"]))
    if not names:
        return None, {}
    gemm = max(names, key=lambda nm: sum(names[nm]))  # the call's main kernel
    return float(np.median(names[gemm])), {nm: [round(float(np.median(v)), 2), len(v) / 3 / calls] for nm, v in names.items()}


def main():
    ms = (8,) if "m8" in sys.argv[2:] else (8, 32)
    rng = np.random.default_rng(0)
    out = []
    for k, n, what in SHAPES:
        w_bytes = n * k * 2
        copies = max(2, min(16, -(-MIN_BYTES // w_bytes)))
        w0 = jnp.asarray(rng.standard_normal((n, k), np.float32) / 64, jnp.float16)
        ws = [w0] + [w0 + jnp.float16(i * 1e-3) for i in range(1, copies)]
        for m in ms:
            x = jnp.asarray(rng.standard_normal((m, k)), jnp.float16)
            row = {"what": what, "k": k, "n": n, "m": m, "w_bytes": w_bytes, "copies": copies,
                   "plan": {f: v for f, v in cuda_matmul.gemv_plan(m, n, k, 16, False, slots=True).items()
                            if f in ("dense_rows", "ctas_per_sm", "grid", "smem_bytes", "error")}}
            # A different x for each copy of W: XLA would otherwise fuse the dots sharing x into one
            # over the concatenated weights (a copy of every W a call).
            xs = [x * jnp.float16(1 + i / 64) for i in range(copies)]
            impls = [(f"dense-rows[{loads},{carve}]", "1", ("GemvDenseRows",), loads, carve)
                     for loads in ("half", "full") for carve in ("max", "fit", "default")]
            impls += [("ring", "0", ("GemvKernel",), None, None), ("xla", None, None, None, None)]
            ours = {}  # one trace per JOA_GEMV_DENSE_ROWS (read at trace time); the knobs per launch
            for impl, env, match, loads, carve in impls:
                if env is not None:
                    os.environ[cuda_matmul.DENSE_ROWS_ENV] = env
                    if loads is not None:  # read by the launch (ffi/kernels/gemv/launch.cuh), per call
                        os.environ["JOA_DENSE_ROWS_LOADS"], os.environ["JOA_DENSE_ROWS_CARVEOUT"] = loads, carve
                    if env not in ours:
                        ours[env] = jax.jit(lambda xs, ws: jnp.stack([cuda_matmul.linear(x, t).sum(0)
                                                                     for x, t in zip(xs, ws)]))
                    fn = ours[env]
                else:
                    fn = jax.jit(lambda xs, ws: jnp.stack([(x @ t.T).sum(0) for x, t in zip(xs, ws)]))
                try:
                    us, kernels = device_us(fn, (xs, ws), match, copies)
                except Exception as e:  # a shape a kernel refuses is a result
                    row[impl] = {"skip": f"{type(e).__name__}: {str(e)[:120]}"}
                    continue
                row[impl] = {"us": us, "tb_s": w_bytes / us / 1e6 if us else None, "kernels": kernels}
            print(json.dumps({kk: (v if not isinstance(v, dict) or "us" not in v else round(v["us"] or 0, 2))
                              for kk, v in row.items() if kk != "plan"}), flush=True)
            out.append(row)
        del ws, w0
    for var in (cuda_matmul.DENSE_ROWS_ENV, "JOA_DENSE_ROWS_LOADS", "JOA_DENSE_ROWS_CARVEOUT"):
        os.environ.pop(var, None)
    doc = {"suite": "dense-rows-times", "commit": os.environ.get("JOA_GIT_COMMIT", "unknown"),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__,
           "what": "tools/probes/dense_rows_times.py " + " ".join(sys.argv[2:]) + ": profiler device time per call "
                   "(median) of dense fp16 projections: the dense rows kernel, the ring kernel, XLA's dot",
           "results": out}
    json.dump(doc, open(sys.argv[1], "w"), indent=1)


if __name__ == "__main__":
    main()
