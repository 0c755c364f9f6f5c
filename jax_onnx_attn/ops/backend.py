"""Backend selection shared by every op: "reference" (pure jax.numpy, any platform), "cuda" (our FFI
kernels) or "auto" (the CUDA kernels where XLA compiles for a CUDA device, the reference elsewhere).
"""

from __future__ import annotations

import functools
from typing import Callable, Literal

import jax

from jax_onnx_attn._extension import build_info, has_cuda

Backend = Literal["auto", "reference", "cuda"]
BACKENDS: tuple[str, ...] = ("auto", "reference", "cuda")


def check_backend(backend: str) -> None:
    """Raise ValueError unless `backend` is one of BACKENDS ("auto", "reference", "cuda")."""
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")


@functools.cache
def no_cuda_device() -> str | None:
    """Why jax has no CUDA device in this process (None when it has one): backend="cuda" needs one,
    the compiled kernels alone are not enough (XLA would fail with "No FFI handler registered")."""
    try:
        devices = jax.devices("cuda")
    except RuntimeError as e:  # a CPU-only jaxlib, or no GPU / driver
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        return f"jax sees no CUDA device ({first})"
    return None if devices else "jax sees no CUDA device"


def dispatch(op: str, backend: str, reference_fn: Callable, cuda_fn: Callable | None, *args,
             unsupported: str | None = None, rule=None):
    """Call `reference_fn(*args)` or `cuda_fn(*args)`; both must return the same pytree of arrays.

    `cuda_fn=None` (with `unsupported` saying why) means the CUDA kernels do not cover this call:
    "auto" then uses the reference and "cuda" raises. `rule` (an `ops.partitioning.Rule`) gives
    either implementation the op's batching and partitioning; the functions are then
    functools.partials whose keywords are the static attributes.
    """
    check_backend(backend)
    if rule is not None:
        reference_fn = rule.bind(reference_fn)
        cuda_fn = None if cuda_fn is None else rule.bind(cuda_fn)
    if backend == "reference":
        return reference_fn(*args)
    if backend == "cuda":
        why = (unsupported if cuda_fn is None else
               f"the CUDA kernels were not compiled: {build_info()['reason']}" if not has_cuda()
               else no_cuda_device())
        if why:
            raise NotImplementedError(f"{op}: backend='cuda' is not available for this call: {why}")
        return cuda_fn(*args)
    if cuda_fn is None or not has_cuda():
        return reference_fn(*args)
    # "auto": XLA keeps only the branch of the platform it compiles for.
    return jax.lax.platform_dependent(*args, cuda=cuda_fn, default=reference_fn)
