"""Clear the outputs of the notebooks in notebooks/ (they are committed without outputs).

    python tools/clear_notebooks.py           # clear in place
    python tools/clear_notebooks.py --check   # exit 1, listing them, if any notebook has outputs
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import nbformat

ROOT = Path(__file__).resolve().parent.parent


def dirty(nb) -> bool:
    return any(c.cell_type == "code" and (c.outputs or c.execution_count is not None) for c in nb.cells)


def clear(nb) -> None:
    for cell in nb.cells:
        if cell.cell_type == "code":
            cell.outputs = []
            cell.execution_count = None
        cell.metadata.pop("execution", None)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="only report notebooks with outputs")
    ap.add_argument("paths", nargs="*", type=Path, help="default: notebooks/*.ipynb")
    args = ap.parse_args(argv)
    paths = args.paths or sorted((ROOT / "notebooks").glob("*.ipynb"))
    found = []
    for path in paths:
        nb = nbformat.read(path, as_version=4)
        if dirty(nb):
            found.append(path)
            if not args.check:
                clear(nb)
                nbformat.write(nb, path)
    for path in found:
        print(f"{'has outputs' if args.check else 'cleared'}: {path}")
    return 1 if args.check and found else 0


if __name__ == "__main__":
    sys.exit(main())
