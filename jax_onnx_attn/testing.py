"""Test helpers shared by the test suite, notebooks and benchmarks: the one table of tolerances."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np

#: (rtol, atol) per dtype of the values being compared. One table for every test in the project.
TOLERANCES: dict[np.dtype, tuple[float, float]] = {
    np.dtype(np.float64): (1e-9, 1e-9),
    np.dtype(np.float32): (1e-4, 1e-4),
    np.dtype(np.float16): (5e-3, 5e-3),
    np.dtype(ml_dtypes.bfloat16): (3e-2, 3e-2),
}


def tolerance(dtype) -> tuple[float, float]:
    """(rtol, atol) for comparing values of `dtype`."""
    return TOLERANCES[np.dtype(dtype)]


def assert_close(actual, expected, dtype=None, *, err_msg: str = "") -> None:
    """assert_allclose in float64 with the tolerance of `dtype` (default: expected's dtype).

    Infinities must match exactly and NaN never passes unless both sides have it at the same place.
    """
    expected = np.asarray(expected)
    dtype = np.dtype(dtype) if dtype is not None else expected.dtype
    rtol, atol = tolerance(dtype)
    np.testing.assert_allclose(np.asarray(actual).astype(np.float64), expected.astype(np.float64),
                               rtol=rtol, atol=atol, err_msg=err_msg)


def hlo_copies_of(hlo_text: str, shape, dtype, *, inside_fusions: bool = True) -> list[str]:
    """Lines of compiled HLO text that copy a whole array of `shape`/`dtype` (e.g. a KV cache).

    Donation works when this is empty: XLA updated the buffer in place instead of copying it.
    inside_fusions=False leaves out the computations of fusions (where a copy is a fused kernel's
    layout change of a value it reads, not a buffer copied).
    """
    hlo_type = {"float32": "f32", "float16": "f16", "bfloat16": "bf16", "float64": "f64",
                "int32": "s32", "int8": "s8", "uint8": "u8"}[np.dtype(dtype).name]
    dims = ",".join(str(int(d)) for d in shape)
    pattern = re.compile(rf"= {hlo_type}\[{dims}\]\{{[^}}]*\}} copy(-start)?\(")
    lines = hlo_text.splitlines() if inside_fusions else _outside_fusions(hlo_text)
    return [line.strip() for line in lines if pattern.search(line)]


def _outside_fusions(hlo_text: str) -> list[str]:
    """The lines of the computations that no fusion calls."""
    fused = set(re.findall(r"\bfusion\(.*?calls=%?([\w.\-]+)", hlo_text))
    out, keep = [], True
    for line in hlo_text.splitlines():
        header = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if header:
            keep = header.group(1) not in fused
        if keep:
            out.append(line)
    return out


#: The collectives of XLA's SPMD partitioner.
COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "collective-permute", "reduce-scatter")


def hlo_collectives(hlo_text: str) -> list[tuple[str, str, tuple[int, ...]]]:
    """(op, element type, shape) of every collective in compiled HLO text (async pairs counted
    once, by their start)."""
    ops = "|".join(COLLECTIVES)
    pattern = re.compile(rf"= \(?(\w+)\[([\d,]*)\][^=]*? ({ops})(?:-start)?\(")
    found = []
    for line in hlo_text.splitlines():
        m = pattern.search(line)
        if m:
            dims = tuple(int(d) for d in m.group(2).split(",") if d)
            found.append((m.group(3), m.group(1), dims))
    return found
