"""Run one decode-engine shape a few times, for a profiler (ncu) to pick its kernels up.

    ncu --clock-control none -k regex:Decode --launch-skip 4 --launch-count 2 --set full \
        python tools/profile_decode.py --batch 8 --ctx 131072 --qlen 1 [--kv-bits 4]

Command buffers are switched off (XLA_FLAGS) so every launch is a plain stream launch ncu can see.
"""

from __future__ import annotations

import argparse
import math
import os

os.environ.setdefault("XLA_FLAGS", "--xla_gpu_enable_command_buffer=")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jax_onnx_attn.ops import cuda  # noqa: E402


def main() -> None:
    """Parse the shape, run the kernel `--iters` times, block."""
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=1024)
    ap.add_argument("--qlen", type=int, default=1)
    ap.add_argument("--heads", default="32/8")
    ap.add_argument("--dim", type=int, default=128)
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--kv-bits", type=int, default=0, choices=[0, 8, 4],
                    help="an int8 / int4 cache (random bytes, per-tensor scales) instead of dtype's")
    ap.add_argument("--iters", type=int, default=8)
    a = ap.parse_args()
    hq, hkv = map(int, a.heads.split("/"))
    dt = {"bf16": jnp.bfloat16, "fp16": jnp.float16}[a.dtype]
    keys = jax.random.split(jax.random.PRNGKey(0), 3)
    q = jax.random.normal(keys[0], (a.batch, hq, a.qlen, a.dim), dt)
    if a.kv_bits:  # every byte a valid int8 / packed int4 value, as bench decode makes them
        shape = (a.batch, hkv, a.ctx, a.dim // 2 if a.kv_bits == 4 else a.dim)
        lo, hi, store = (-128, 128, jnp.int8) if a.kv_bits == 8 else (0, 256, jnp.uint8)
        k, v = (jax.random.randint(key, shape, lo, hi, jnp.int32).astype(store) for key in keys[1:])
        scales = dict(k_scale=jnp.full((1,), 0.02, jnp.float32), v_scale=jnp.full((1,), 0.02, jnp.float32),
                      kv_bits=a.kv_bits)
    else:
        k = jax.random.normal(keys[1], (a.batch, hkv, a.ctx, a.dim), dt)
        v = jax.random.normal(keys[2], (a.batch, hkv, a.ctx, a.dim), dt)
        scales = {}
    lens = jnp.full((a.batch,), a.ctx, jnp.int32)
    f = jax.jit(lambda q, k, v, n: cuda.decode_attention(q, k, v, n, scale=1 / math.sqrt(a.dim), **scales))
    for _ in range(a.iters):
        q = f(q, k, v, lens)
    q.block_until_ready()
    print("ran", a)


if __name__ == "__main__":
    main()
