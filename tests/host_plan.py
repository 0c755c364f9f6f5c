"""Compiles a small host program against the kernels' host-only headers (decode/plan.h and what it
includes) with the host C++ compiler, for CPU tests that check the plans and layouts of this tree's
headers without a build of the extension (tests/test_decode_plan_tile128.py,
tests/test_decode_tile_swizzle.py)."""

from __future__ import annotations

import pathlib
import shutil
import subprocess
import textwrap

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
#: The head dims the programs are compiled for (cmake/decode_instances.cmake's list).
HEAD_DIMS = (64, 80, 96, 128, 256)
CXX = shutil.which("g++") or shutil.which("clang++")


def compile_program(tmp: pathlib.Path, source: str, name: str = "plan_probe") -> pathlib.Path:
    """The executable of `source` (C++17, with ffi/ and a generated kernels/decode/instances.h of
    HEAD_DIMS on the include path), built in `tmp`; skips the test where there is no compiler."""
    if CXX is None:
        pytest.skip("no host C++ compiler")
    gen = tmp / "generated" / "kernels" / "decode"
    gen.mkdir(parents=True, exist_ok=True)
    (gen / "instances.h").write_text(textwrap.dedent(f"""\
        #pragma once
        #define JOA_DECODE_HEAD_DIMS {", ".join(map(str, HEAD_DIMS))}
        """))
    src, exe = tmp / f"{name}.cc", tmp / name
    src.write_text(source)
    subprocess.run([CXX, "-std=c++17", "-O1", "-I", str(ROOT / "ffi"), "-I", str(tmp / "generated"),
                    str(src), "-o", str(exe)], check=True, capture_output=True, text=True)
    return exe
