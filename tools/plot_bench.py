"""Regenerate docs/images/*.png from the committed benchmark JSON in bench/results/.

    python tools/plot_bench.py [--results bench/results] [--out docs/images]

Prints the figures written (the kernel suites', gqa_step.png, and e2e_decode.png once whole-model
results of `python -m jax_onnx_attn.bench e2e` are there). With no results it says what is missing
and exits with status 1.
The plotting code is `jax_onnx_attn.bench.plots` (also used by notebooks/04_performance.ipynb).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")

from jax_onnx_attn.bench import plots  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--results", type=Path, default=ROOT / plots.RESULTS_DIR,
                        help="folder of benchmark JSON (default: bench/results)")
    parser.add_argument("--out", type=Path, default=ROOT / plots.IMAGES_DIR,
                        help="folder for the PNG figures (default: docs/images)")
    args = parser.parse_args(argv)
    try:
        written = plots.regenerate(args.results, args.out)
    except plots.NoResults as e:
        print(f"plot_bench: {e}", file=sys.stderr)
        return 1
    for path in written:
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
