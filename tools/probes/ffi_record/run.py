"""Run the FFI record-stage probe (record_probe.cu) on a GPU: does XLA call the record stage, do
the outputs match today's captured path bit for bit, and what does a call cost in a dependent chain
(tiny kernels: the boundary; 8 / 32 MB weight streams: the overlap PDL buys)?

    python3 run.py LIB CUBIN [--out F]      (build commands: record_probe.cu's header)
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

THREADS = 256


def setup(lib_path: str, cubin: str) -> ctypes.CDLL:
    lib = ctypes.CDLL(lib_path)
    lib.joa_register_record.restype = ctypes.c_char_p
    for name in ("joa_execute_calls", "joa_record_creates", "joa_record_updates"):
        getattr(lib, name).restype = ctypes.c_long
    jax.ffi.register_ffi_target("joa_probe_api", jax.ffi.pycapsule(lib.JoaApiProbe), platform="CUDA")
    jax.ffi.register_ffi_target("joa_probe_cap", jax.ffi.pycapsule(lib.JoaStreamExecute), platform="CUDA")
    if lib.joa_api_minor() < 0:  # registration did not call the handler with a frame: run it once
        out = jax.ShapeDtypeStruct((1,), jnp.float32)
        jax.jit(lambda: jax.ffi.ffi_call("joa_probe_api", out, has_side_effect=True)())().block_until_ready()
    print("XLA_FFI_Api minor version:", lib.joa_api_minor(), flush=True)
    err = lib.joa_register_record(b"joa_probe_rec", cubin.encode()).decode()
    if err:
        raise SystemExit(f"record registration failed: {err}")
    return lib


def chain(target: str, n_weights: int, grid: int, steps: int, pdl: bool, wait_first: bool, xla_between: bool):
    """A jitted, x-donating loop of `steps` x `n_weights` dependent calls."""
    out = jax.ShapeDtypeStruct((grid * THREADS,), jnp.float32)

    def call(w, x):
        if target == "xla":  # the same bytes through XLA's own reduce fusion
            return x * 0 + (jnp.sum(w) * 1e-6 + x[0])
        return jax.ffi.ffi_call(target, out)(w, x, grid=np.int64(grid), pdl=pdl, wait_first=wait_first)

    def run(x, ws):
        def body(_, x):
            for w in ws:
                x = call(w, x)
                if xla_between:
                    x = x * 1.0001
            return x
        return lax.fori_loop(0, steps, body, x)

    return jax.jit(run, donate_argnums=(0,))


def time_chain(fn, x, ws, calls_per_rep: int, reps: int = 5):
    x = fn(x, ws)
    x = fn(x, ws)
    x.block_until_ready()
    samples = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls_per_rep):
            x = fn(x, ws)
        x.block_until_ready()
        samples.append((time.perf_counter() - t0) / calls_per_rep)
    return statistics.median(samples), x


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("lib")
    ap.add_argument("cubin")
    ap.add_argument("--out")
    ap.add_argument("--quick", action="store_true", help="one small case (for the VLOG run)")
    a = ap.parse_args()
    lib = setup(a.lib, a.cubin)
    cases = [("tiny 4 KB", 64, 4 << 10, 1), ("8 MB", 32, 8 << 20, 528), ("32 MB", 16, 32 << 20, 528)]
    variants = [  # (name, target, pdl, wait_first, xla_between)
        ("captured", "joa_probe_cap", False, True, False),
        ("record", "joa_probe_rec", False, True, False),
        ("record+pdl wait first", "joa_probe_rec", True, True, False),
        ("record+pdl stream first", "joa_probe_rec", True, False, False),
        ("xla reduce", "xla", False, True, False),
        ("captured, xla op between", "joa_probe_cap", False, True, True),
        ("record+pdl, xla op between", "joa_probe_rec", True, False, True),
    ]
    if a.quick:
        cases, variants = [("tiny 4 KB", 8, 4 << 10, 1)], variants[:4]
    steps = 2 if a.quick else 20
    rows = []
    for label, n_w, nbytes, grid in cases:
        key = jax.random.PRNGKey(nbytes)
        ws = [jax.random.normal(k, (nbytes // 4,), jnp.float32) for k in jax.random.split(key, n_w)]
        outputs = {}
        for name, target, pdl, wait_first, between in variants:
            before = (lib.joa_execute_calls(), lib.joa_record_creates(), lib.joa_record_updates())
            fn = chain(target, n_w, grid, steps, pdl, wait_first, between)
            x0 = jnp.zeros((grid * THREADS,), jnp.float32) + 1.0
            first = np.asarray(fn(x0, ws))  # one call from a fresh x: the values compared below
            sec, _ = time_chain(fn, jnp.zeros((grid * THREADS,), jnp.float32) + 1.0, ws, 1 if a.quick else 10)
            after = (lib.joa_execute_calls(), lib.joa_record_creates(), lib.joa_record_updates())
            if target == "joa_probe_cap":
                outputs[("joa_probe_cap", between)] = first
            ref = outputs.get(("joa_probe_cap", between))
            same_as_captured = None if ref is None or target == "xla" else bool(np.array_equal(ref, first))
            us_per_call = sec / (steps * n_w) * 1e6
            row = {"case": label, "variant": name, "us_per_call": round(us_per_call, 3),
                   "gbs": round(nbytes / (us_per_call * 1e-6) / 1e9, 1),
                   "execute_calls": after[0] - before[0], "record_creates": after[1] - before[1],
                   "record_updates": after[2] - before[2], "same_as_captured": same_as_captured,
                   "finite": bool(np.isfinite(first).all())}
            rows.append(row)
            print(json.dumps(row), flush=True)
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"jax": jax.__version__, "device": str(jax.devices()[0].device_kind),
                       "steps": steps, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
