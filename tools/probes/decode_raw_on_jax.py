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

import jax
import jax.numpy as jnp
import numpy as np

from jax_onnx_attn.bench.decode import _time_loop
from jax_onnx_attn.ops import cuda

COPIES, CALLS = 16, 128


def main():
    lib = ctypes.CDLL(sys.argv[1])
    rng = np.random.default_rng(0)
    out = {"allocator": os.environ.get("XLA_PYTHON_CLIENT_ALLOCATOR", "default"),
           "preallocate": os.environ.get("XLA_PYTHON_CLIENT_PREALLOCATE", "default"), "results": []}
    for ctx in (2304, 4096, 8192):
        draw = lambda shape: jnp.asarray(rng.standard_normal(shape), jnp.bfloat16)  # noqa: E731
        q = draw((1, 32, 1, 128))
        ks = [draw((1, 8, ctx, 128)) for _ in range(COPIES)]
        vs = [draw((1, 8, ctx, 128)) for _ in range(COPIES)]
        lens = jnp.full((1,), ctx, jnp.int32)
        res = jnp.zeros_like(q)
        for a in (q, *ks, *vs, lens, res):
            a.block_until_ready()
        ptr = lambda arrays: (ctypes.c_void_p * len(arrays))(*[a.unsafe_buffer_pointer() for a in arrays])  # noqa: E731
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

        def chain(q, ks, vs):
            for i in range(CALLS):
                q = cuda.decode_attention(q, ks[i % COPIES], vs[i % COPIES], lens, scale=0.088, engine="decode",
                                          split_rows=(ctx + 63) // 64 * 64)
            return q
        run = jax.jit(chain, donate_argnums=0)
        state = {"q": jnp.copy(q)}

        def go():
            state["q"] = run(state["q"], ks, vs)
        xla = 1e6 * _time_loop(go, lambda: state["q"].block_until_ready(), CALLS, 0.01, 5)
        row = {"ctx": ctx, "raw_on_jax_buffers_us": on_jax, "raw_on_own_buffers_us": on_own, "xla_us": xla,
               "k0_ptr_mod_2mb": ks[0].unsafe_buffer_pointer() % (2 << 20)}
        print(json.dumps(row), flush=True)
        out["results"].append(row)
    if len(sys.argv) > 2:
        json.dump(out, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
