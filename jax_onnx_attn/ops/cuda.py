"""CUDA backend: one thin `jax.ffi.ffi_call` wrapper per FFI target of `jax_onnx_attn._ffi`.

Inputs reach these wrappers already validated and in the kernels' layout (the public ops in
`jax_onnx_attn.ops` do that). Caches are aliased to their outputs (`input_output_aliases`) so a
donated cache is updated in place. Every handler is command-buffer compatible.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jax_onnx_attn._extension import target


def kv_append(cache, new, start):
    """cache [B, H, C, D] (aliased), new [B, H, S, D], start int32 [B] -> (cache, status int32 [B])."""
    b = cache.shape[0]
    call = jax.ffi.ffi_call(
        target("kv_append"),
        (jax.ShapeDtypeStruct(cache.shape, cache.dtype), jax.ShapeDtypeStruct((b,), jnp.int32)),
        input_output_aliases={0: 0},
        vmap_method="sequential",
    )
    return call(cache, new, start.astype(jnp.int32))
