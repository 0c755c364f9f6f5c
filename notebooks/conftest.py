"""`pytest` executes every notebook in this folder, top to bottom, as one test each.

The notebooks run through nbmake (the `notebooks` extra: `pip install -e ".[notebooks]"`) without
`--nbmake` on the command line, so `pytest` alone runs them (pyproject's testpaths include this
folder). Where the notebook packages are missing (e.g. after `pip install -e ".[test]"`) each notebook
is reported as skipped, with the reason, instead of failing collection. Kernels run in the
interpreter that runs pytest. Select or drop the notebooks with `-m notebook` / `-m "not notebook"`.
A cell that raises fails its notebook's test; the failure shows the cell and its traceback.
Per-cell timeout: `--nbmake-timeout` (default 300 s).
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest

_NEEDED = ("nbmake", "nbclient", "nbformat", "ipykernel", "matplotlib")

# The kernels started for the notebooks run `python` from PATH (the "python3" kernel spec): make that
# the interpreter running pytest, so the notebooks see the same environment (e.g. `.venv/bin/pytest`
# without an activated venv).
os.environ["PATH"] = os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", "")


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _missing() -> list[str]:
    return [name for name in _NEEDED if not _installed(name)]


class _SkippedNotebook(pytest.Item):
    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def runtest(self):
        pytest.skip(self.reason)

    def reportinfo(self):
        return self.path, 0, self.name


class _SkippedNotebookFile(pytest.File):
    def __init__(self, *, reason: str, **kwargs):
        super().__init__(**kwargs)
        self.reason = reason

    def collect(self):
        yield _SkippedNotebook.from_parent(self, name=self.path.name, reason=self.reason)


def pytest_collect_file(file_path, parent):
    if file_path.suffix != ".ipynb" or ".ipynb_checkpoints" in file_path.parts:
        return None
    missing = _missing()
    if missing:
        return _SkippedNotebookFile.from_parent(
            parent, path=file_path,
            reason=f"notebook: {', '.join(missing)} not installed (pip install -e \".[notebooks]\")")
    if parent.config.getoption("nbmake", default=False):
        return None  # `pytest --nbmake` given: nbmake's own hook collects the file
    from nbmake.pytest_items import NotebookFile

    return NotebookFile.from_parent(parent, path=file_path)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.path.suffix == ".ipynb":
            item.add_marker(pytest.mark.notebook)
