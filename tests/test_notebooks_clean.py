"""The notebooks are committed with their outputs cleared (small diffs); `pytest` executes them."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_notebooks_are_committed_without_outputs():
    pytest.importorskip("nbformat")
    check = subprocess.run([sys.executable, str(ROOT / "tools" / "clear_notebooks.py"), "--check"],
                           capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, f"run `python tools/clear_notebooks.py`:\n{check.stdout}"
