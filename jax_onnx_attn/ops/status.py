"""Device-side error status, shared by every kernel that can see a bad runtime value.

Ops that write a KV cache return an int32 status per batch row: 0 when everything was written,
otherwise a bitwise OR of the flags below. The write that caused a flag was skipped (never out of
bounds). Checking the status is the caller's choice, so the hot path never synchronises.

KV_WRITE_OUT_OF_RANGE is written by the CUDA kernels too (ffi/common/status.h mirrors it); the other
flags are computed by XLA code of the lowering only.
"""

from __future__ import annotations

from collections.abc import Mapping

import jax.numpy as jnp
import numpy as np

OK = 0
#: The rows to write into the KV cache fall outside [0, capacity): that batch row's write was skipped.
KV_WRITE_OUT_OF_RANGE = 1
#: An index (a Gather's, e.g. a token id into the embedding) is outside [-dim, dim): jax's gather
#: clamped it, so the value read is the nearest row's, not an error as in onnxruntime.
INDEX_OUT_OF_RANGE = 2
#: GroupQueryAttention's total_sequence_length, only known on the device, breaks onnxruntime's rule
#: (S on a first prompt, P + S for a growing cache, <= P for a static one, within the tables).
TOTAL_SEQUENCE_LENGTH_INVALID = 4

_NAMES = {KV_WRITE_OUT_OF_RANGE: "KV write out of range (write skipped)",
          INDEX_OUT_OF_RANGE: "index out of range (clamped by the gather)",
          TOTAL_SEQUENCE_LENGTH_INVALID: "total_sequence_length out of range for the step"}


def flag_unless(ok, flag: int):
    """int32 status (ok's shape): OK where `ok`, else `flag`.

    Args:
      ok: bool array (traced or not), e.g. [B] per batch row or a scalar.
      flag: one of the flags above.
    """
    return jnp.where(ok, OK, flag).astype(jnp.int32)


def kv_write_status(fits):
    """int32 status (traced or not, `fits`' shape): OK where `fits`, else KV_WRITE_OUT_OF_RANGE.

    Args:
      fits: bool [B], whether each batch row's KV write lies inside the cache (and was done).
    """
    return jnp.where(fits, OK, KV_WRITE_OUT_OF_RANGE).astype(jnp.int32)


def _lines(status, prefix: str) -> list[str]:
    status = np.asarray(status)
    problems = []
    rows = status.reshape(-1)
    for b, value in enumerate(rows):
        for flag, name in _NAMES.items():
            if int(value) & flag:
                where = f"batch {b}: " if status.ndim else ""
                problems.append(f"{prefix}{where}{name}")
    return problems


def describe(status) -> list[str]:
    """Human-readable problems in a status array (host side; this synchronises).

    Args:
      status: int32 [B] (any shape is flattened to batch rows; a scalar is one value), a bitwise OR
        of the flags above per row; or a mapping {where: such an array} (e.g. the per-node statuses
        of `LoweredModel.apply_with_status`), whose keys prefix the lines.

    Returns:
      One "batch b: problem" (or "where: batch b: problem") line per set flag; empty when all OK.
    """
    if isinstance(status, Mapping):
        return [line for where, s in status.items() for line in _lines(s, f"{where}: ")]
    return _lines(status, "")


def check(status) -> None:
    """Raise RuntimeError if any flag is set (host side; this synchronises).

    Args:
      status: int32 [B] as returned by the ops that write a KV cache, or a mapping of them (see
        `describe`).
    """
    problems = describe(status)
    if problems:
        raise RuntimeError("device status: " + "; ".join(problems))
