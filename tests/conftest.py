"""Shared pytest setup: GPU tests skip where no CUDA GPU or CUDA build exists, wide sweeps skip unless
selected, and the run ends with the skipped tests counted per reason (one line per reason, not per
test), so a plain `pytest` says why it skipped what it skipped."""

from __future__ import annotations

import os
from collections import Counter

# GPU tests may run in parallel processes (pytest -n): none may grab most of the GPU up front.
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Without a GPU (CI), XLA's CPU compiler at its lowest LLVM optimisation level: the suite mostly
# compiles small graphs and runs them once (tests/test_prefill_route.py -n 2: 108 -> 72 s). The
# computations are the same (no fast-math either way). Flags already in XLA_FLAGS come after ours
# and win; JOA_TEST_FAST_COMPILE=0 turns this off. Never on a GPU machine, where it would slow
# the kernels the GPU tests and benchmarks run.
FAST_COMPILE_FLAGS = "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true"
_xla_flags = os.environ.get("XLA_FLAGS", "")
if (not os.path.exists("/dev/nvidiactl") and os.environ.get("JOA_TEST_FAST_COMPILE", "1") != "0"
        and FAST_COMPILE_FLAGS not in _xla_flags):  # xdist workers inherit the controller's
    os.environ["XLA_FLAGS"] = f"{FAST_COMPILE_FLAGS} {_xla_flags}".strip()

import jax  # noqa: E402
import pytest  # noqa: E402

import jax_onnx_attn  # noqa: E402


def pytest_ignore_collect(collection_path, config):
    """tests/mesh needs 4 devices, made when jax starts: it runs in its own process
    (tests/test_mesh.py, or JOA_MESH_SUITE=1 pytest tests/mesh)."""
    if collection_path.name == "mesh" and collection_path.parent.name == "tests":
        return None if os.environ.get("JOA_MESH_SUITE") else True
    return None


def _gpu_skip_reason() -> str | None:
    info = jax_onnx_attn.build_info()
    if not info["cuda"]:
        return f"the extension has no CUDA kernels: {info['reason']}"
    try:
        if not jax.devices("gpu"):
            return "no CUDA GPU visible to jax"
    except RuntimeError as e:
        return f"no CUDA GPU visible to jax ({str(e).splitlines()[0]})"
    return None


def pytest_collection_modifyitems(config, items):
    # Wide sweeps run only when asked for (`pytest -m slow`); a plain `pytest` (CI) skips them.
    if "slow" not in (config.getoption("markexpr") or ""):
        skip_slow = pytest.mark.skip(reason="wide sweep: select it with -m slow")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip_slow)
    reason = _gpu_skip_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=f"GPU test: {reason}")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def skip_reason(report) -> str:
    """The reason of a skipped test's report, without pytest's "Skipped: " prefix."""
    longrepr = report.longrepr
    reason = longrepr[2] if isinstance(longrepr, tuple) and len(longrepr) == 3 else str(longrepr)
    return reason.removeprefix("Skipped: ")


def skip_summary(reports) -> list[str]:
    """Lines counting skipped reports per reason, most frequent first."""
    counts = Counter(skip_reason(r) for r in reports)
    return [f"{n:6d}  {reason}" for reason, n in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    skipped = terminalreporter.stats.get("skipped", [])
    if not skipped:
        return
    terminalreporter.write_sep("-", f"{len(skipped)} skipped, by reason")
    for line in skip_summary(skipped):
        terminalreporter.write_line(line)
