"""NumPy oracle for the in-place KV append, written from the contract (not from the JAX code)."""

import numpy as np

from jax_onnx_attn.ops import status


def kv_append(cache, new, start):
    cache = np.array(cache, copy=True)
    flags = np.zeros(cache.shape[0], np.int32)
    capacity, s = cache.shape[2], new.shape[2]
    for b, pos in enumerate(np.asarray(start)):
        if 0 <= pos and pos + s <= capacity:
            cache[b, :, pos:pos + s] = new[b]
        else:
            flags[b] = status.KV_WRITE_OUT_OF_RANGE
    return cache, flags
