"""One process, one set of jax buffers, the decode engine's one-split B=1 launch (bf16 32/8 d128,
2304 rows) two ways, for ncu to profile side by side (session 32): `raw` as a raw CUDA graph
(decode_raw_on_jax.so's joa_time_one_split on the jax arrays' pointers), `xla` through jax (XLA's
command buffer, 32 dependent calls a jitted function). Session 31 measured the same launch at 27.5
µs raw and 29.6 in XLA under ncu with the same DRAM bytes; this gives ncu's full section set of both.
    ncu --set full -k regex:DecodeSplit --launch-skip 40 --launch-count 1 \
        python3 decode_ncu_pair.py LIB.so raw|xla"""

import ctypes
import sys

import jax.numpy as jnp

from decode_xla_chain import COPIES, inputs, time_xla  # this folder: on sys.path as a script

CTX = 2304


def main():
    lib, mode = ctypes.CDLL(sys.argv[1]), sys.argv[2]
    q, ks, vs, lens = inputs(CTX, seed=0)
    res = jnp.zeros_like(q)
    for a in (q, *ks, *vs, lens, res):
        a.block_until_ready()
    if mode == "raw":
        def ptrs(arrays):
            return (ctypes.c_void_p * len(arrays))(*[a.unsafe_buffer_pointer() for a in arrays])
        us = ctypes.c_float(0)
        err = lib.joa_time_one_split(ctypes.c_void_p(q.unsafe_buffer_pointer()), ptrs(ks), ptrs(vs), COPIES,
                                     ctypes.c_void_p(lens.unsafe_buffer_pointer()),
                                     ctypes.c_void_p(res.unsafe_buffer_pointer()), CTX, ctypes.byref(us))
        assert err == 0, f"cuda error {err}"
        print(f"raw {us.value:.2f} us a call")
    else:
        print(f"xla {time_xla(q, ks, vs, lens, CTX, calls=32, reps=2):.2f} us a call")


if __name__ == "__main__":
    main()
