"""The fake-mesh suite (tests/mesh/: ops and DecoderSession on 4 CPU devices), in a process of its
own: XLA makes the devices when jax starts, so the flag cannot reach this process's jax."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

TESTS = Path(__file__).parent
#: The suite takes about 1.5 min on two cores.
TIMEOUT_S = 900


def test_fake_mesh_suite(pytestconfig):
    env = dict(os.environ, JOA_MESH_SUITE="1")
    # GSPMD (jax's older partitioner) runs with `-m slow`; a plain run (CI) checks the rules under
    # Shardy, jax's default. Deselected rather than skipped, so the summary below stays skip-free.
    wide = "slow" in (pytestconfig.getoption("markexpr") or "")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider",
                           "-m", "slow or not slow" if wide else "not slow", str(TESTS / "mesh")],
                          cwd=TESTS.parent, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, f"tests/mesh failed:\n{proc.stdout[-20000:]}\n{proc.stderr[-5000:]}"
    assert " passed" in proc.stdout and " skipped" not in proc.stdout.splitlines()[-1], proc.stdout
