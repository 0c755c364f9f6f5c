"""The environment switches of the CUDA routes (JOA_*): 0 / 1 values, read when asked (at trace or
load time, as each switch's reader says), a bad value refused naming the variable."""

from __future__ import annotations

import os


def switch(name: str, default: str = "1") -> bool:
    """A 0 / 1 environment switch (on by default unless `default` says otherwise), read when asked;
    ValueError names the variable for any other value."""
    value = os.environ.get(name, default)
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return value == "1"
