"""L2 prefetch of weights a decode step is about to stream (ffi/handlers/l2_prefetch.cu).

In a decode step the attention, its preparation and the gaps around them are latency-bound: at
short contexts they read a few MB of KV in ~10 µs a layer while HBM could move ~40 MB. `l2_prefetch`
starts moving the next projection's weights (the one that reads the attention's output) into L2
before the attention, so that GEMV reads part of them from L2. The lowering calls it on the
attention's query (which orders it after the query's producer and before the attention); it
returns the query unchanged.

How many bytes (JOA_L2_PREFETCH_MB) and how the requests are made (JOA_L2_PREFETCH_MODE) are read at
trace time, here only. Nothing is prefetched on the reference backend, for calls of more than
`MAX_ROWS` query rows (prompts: the step is compute-bound), inside `disabled()` (a session on a
mesh: each device would need its own shard's bytes), or with a budget of 0.
"""

from __future__ import annotations

import contextlib
import contextvars
import os

import jax
import jax.numpy as jnp

from jax_onnx_attn.ops.backend import dispatch

#: The environment variable with the prefetch budget in MB (decimal, 0 = off).
BUDGET_ENV = "JOA_L2_PREFETCH_MB"
#: The budget when the variable is unset: off until measured on the whole step.
DEFAULT_BUDGET_MB = 0.0
#: The environment variable that picks how the requests are made: one of MODES.
MODE_ENV = "JOA_L2_PREFETCH_MODE"
#: kernels/prefetch/l2.cuh Mode, by value: bulk copies to L2 (the TMA unit), the same with the
#: evict_last policy, or one prefetch instruction per 128-byte line.
MODES = ("bulk", "bulk-evict-last", "lines")
#: Query rows (B·S) above which a call is a prompt and nothing is prefetched.
MAX_ROWS = 32
#: CTAs of the prefetch kernel (each issues its share of the bytes).
CTAS = 132
#: Buffers one call prefetches at most (kernels/prefetch/l2.cuh kMaxBuffers).
MAX_BUFFERS = 4

_off = contextvars.ContextVar("joa_l2_prefetch_off", default=False)


@contextlib.contextmanager
def disabled():
    """Traces inside this context prefetch nothing (a session on a mesh)."""
    token = _off.set(True)
    try:
        yield
    finally:
        _off.reset(token)


def budget_bytes() -> int:
    """JOA_L2_PREFETCH_MB in bytes (unset: DEFAULT_BUDGET_MB); ValueError names a bad value."""
    raw = os.environ.get(BUDGET_ENV)
    try:
        mb = DEFAULT_BUDGET_MB if raw in (None, "") else float(raw)
    except ValueError:
        raise ValueError(f"{BUDGET_ENV} must be a number of MB, got {raw!r}") from None
    if not mb >= 0:
        raise ValueError(f"{BUDGET_ENV} must be >= 0, got {raw!r}")
    return int(mb * 2**20)


def mode() -> str:
    """JOA_L2_PREFETCH_MODE (unset: "bulk"), one of MODES."""
    value = os.environ.get(MODE_ENV) or MODES[0]
    if value not in MODES:
        raise ValueError(f"{MODE_ENV} must be one of {MODES}, got {value!r}")
    return value


def l2_prefetch(x, buffers, *, max_bytes: int | None = None, how: str | None = None,
                backend: str = "auto"):
    """x unchanged, with the first `max_bytes` of `buffers`' concatenation requested into L2 on the
    way (CUDA backend; see the module doc for when nothing is requested).

    Args:
      x: the array that orders the call (an attention's query): its producer runs before, its
        readers after. Returned as is.
      buffers: up to MAX_BUFFERS arrays (a projection's weight, scales, zero points), any dtype.
      max_bytes: the budget (None: `budget_bytes()`).
      how: one of MODES (None: `mode()`).
      backend: "auto", "reference" (nothing requested) or "cuda".
    """
    buffers = [b for b in buffers if b is not None]
    if len(buffers) > MAX_BUFFERS:
        raise ValueError(f"l2_prefetch: buffers: at most {MAX_BUFFERS}, got {len(buffers)}")
    budget = budget_bytes() if max_bytes is None else int(max_bytes)
    how = mode() if how is None else how
    if how not in MODES:
        raise ValueError(f"l2_prefetch: how must be one of {MODES}, got {how!r}")
    x = jnp.asarray(x)
    rows = x.size // x.shape[-1] if x.ndim else 1
    if budget <= 0 or not buffers or _off.get() or rows > MAX_ROWS or backend == "reference":
        return x
    from jax_onnx_attn.ops import cuda

    def on_cuda(x, *bufs):
        return cuda.l2_prefetch(x, bufs, max_bytes=budget, mode=MODES.index(how), ctas=CTAS)

    return dispatch("l2_prefetch", backend, lambda x, *bufs: x, on_cuda, x, *buffers)


__all__ = ["l2_prefetch", "disabled", "budget_bytes", "mode", "MODES", "BUDGET_ENV", "MODE_ENV"]
