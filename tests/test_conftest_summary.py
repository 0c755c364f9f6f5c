"""A plain `pytest` ends with the skipped tests counted per reason (tests/conftest.py): run pytest on a
small suite, with this repo's conftest, and read its output."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

SUITE = '''
import pytest

@pytest.mark.gpu
@pytest.mark.parametrize("i", range(5))
def test_on_gpu(i):
    pass

@pytest.mark.slow
@pytest.mark.parametrize("i", range(3))
def test_sweep(i):
    pass

@pytest.mark.parametrize("i", range(2))
def test_skips_itself(i):
    pytest.skip("not here")

def test_runs():
    assert True
'''


def test_skipped_tests_are_counted_per_reason(tmp_path):
    shutil.copy(Path(__file__).parent / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_suite.py").write_text(SUITE)
    proc = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr
    import jax_onnx_attn

    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if "skipped, by reason" in line)
    summary = [line.split(None, 1) for line in lines[start + 1:start + 4]]
    counts = {reason: int(n) for n, reason in summary}
    assert counts["wide sweep: select it with -m slow"] == 3
    assert counts["not here"] == 2
    if jax_onnx_attn.build_info()["cuda_usable"]:
        assert "6 passed, 5 skipped" in out
        assert not any(reason.startswith("GPU test: ") for reason in counts)
    else:
        gpu = [reason for reason in counts if reason.startswith("GPU test: ")]
        assert len(gpu) == 1 and counts[gpu[0]] == 5
        assert "1 passed, 10 skipped" in out
    assert "test_suite.py::test_on_gpu" not in out  # no line per test
