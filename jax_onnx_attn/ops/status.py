"""Device-side error status, shared by every kernel that can see a bad runtime value.

Ops that write a KV cache return an int32 status per batch row: 0 when everything was written,
otherwise a bitwise OR of the flags below. The write that caused a flag was skipped (never out of
bounds). Checking the status is the caller's choice, so the hot path never synchronises.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

OK = 0
#: The rows to write into the KV cache fall outside [0, capacity): that batch row's write was skipped.
KV_WRITE_OUT_OF_RANGE = 1

_NAMES = {KV_WRITE_OUT_OF_RANGE: "KV write out of range (write skipped)"}


def kv_write_status(fits):
    """int32 status (traced or not, `fits`' shape): OK where `fits`, else KV_WRITE_OUT_OF_RANGE.

    Args:
      fits: bool [B], whether each batch row's KV write lies inside the cache (and was done).
    """
    return jnp.where(fits, OK, KV_WRITE_OUT_OF_RANGE).astype(jnp.int32)


def describe(status) -> list[str]:
    """Human-readable problems in a status array (host side; this synchronises).

    Args:
      status: int32 [B] (any shape is flattened to batch rows), a bitwise OR of the flags above per row.

    Returns:
      One "batch b: problem" line per set flag; empty when every row is OK.
    """
    status = np.asarray(status)
    problems = []
    for b, value in enumerate(status.reshape(-1)):
        for flag, name in _NAMES.items():
            if int(value) & flag:
                problems.append(f"batch {b}: {name}")
    return problems


def check(status) -> None:
    """Raise RuntimeError if any flag is set (host side; this synchronises).

    Args:
      status: int32 [B], as returned by the ops that write a KV cache (see `describe`).
    """
    problems = describe(status)
    if problems:
        raise RuntimeError("device status: " + "; ".join(problems))
