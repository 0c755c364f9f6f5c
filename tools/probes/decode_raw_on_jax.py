"""Session 31's open question, in one process: the decode engine's one-split B=1 launch as a raw CUDA
graph (tools/probes/decode_raw_on_jax.cu, built into decode_raw_on_jax.so) on jax arrays' buffers
against the same data copied into buffers the library allocates with cudaMalloc, then the same calls
through jax (XLA's command buffer, 128 calls a jitted function):
    python tools/probes/decode_raw_on_jax.py PATH/decode_raw_on_jax.so [OUT.json]
Run it also with XLA_PYTHON_CLIENT_ALLOCATOR=platform (one cudaMalloc an array) and with
XLA_PYTHON_CLIENT_PREALLOCATE=false to see whether jax's BFC arena's placement is what costs."""

import ctypes
import json
import os
import sys

import jax.numpy as jnp

from decode_xla_chain import COPIES, inputs, time_xla  # this folder: on sys.path as a script

CALLS = 128


def main():
    lib = ctypes.CDLL(sys.argv[1])
    out = {"allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
           "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default"), "results": []}
    for ctx in (2304, 4096, 8192):
        q, ks, vs, lens = inputs(ctx, seed=0)
        res = jnp.zeros_like(q)
        for a in (q, *ks, *vs, lens, res):
            a.block_until_ready()

        def ptr(arrays):
            return (ctypes.c_void_p * len(arrays))(*[a.unsafe_buffer_pointer() for a in arrays])
        us = ctypes.c_float(0)

        def raw(k_ptrs, v_ptrs):
            err = lib.joa_time_one_split(ctypes.c_void_p(q.unsafe_buffer_pointer()), k_ptrs, v_ptrs, COPIES,
                                         ctypes.c_void_p(lens.unsafe_buffer_pointer()),
                                         ctypes.c_void_p(res.unsafe_buffer_pointer()), ctx, ctypes.byref(us))
            assert err == 0, f"cuda error {err}"
            return us.value
        on_jax = raw(ptr(ks), ptr(vs))
        # The same bytes in the library's own cudaMalloc'd buffers.
        nbytes = ks[0].nbytes
        own = []
        for a in (*ks, *vs):
            p = ctypes.c_void_p()
            assert lib.joa_malloc(ctypes.byref(p), ctypes.c_size_t(nbytes)) == 0
            assert lib.joa_memcpy_d2d(p, ctypes.c_void_p(a.unsafe_buffer_pointer()), ctypes.c_size_t(nbytes)) == 0
            own.append(p.value)
        on_own = raw((ctypes.c_void_p * COPIES)(*own[:COPIES]), (ctypes.c_void_p * COPIES)(*own[COPIES:]))
        for p in own:
            lib.joa_free(ctypes.c_void_p(p))
        xla = time_xla(q, ks, vs, lens, (ctx + 63) // 64 * 64, calls=CALLS, reps=5)
        row = {"ctx": ctx, "raw_on_jax_buffers_us": on_jax, "raw_on_own_buffers_us": on_own, "xla_us": xla,
               "k0_ptr_mod_2mb": ks[0].unsafe_buffer_pointer() % (2 << 20)}
        print(json.dumps(row), flush=True)
        out["results"].append(row)
    if len(sys.argv) > 2:
        json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
