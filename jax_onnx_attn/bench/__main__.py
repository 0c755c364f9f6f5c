"""`python -m jax_onnx_attn.bench <suite> [options]`: benchmark suites (decode, prefill, gqa, linear, e2e),
and `breakdown FILE.json`: where a profiled e2e decode step's time goes against its bound;
`targets FILE.json`: issue 12's whole-model targets met or missed."""

from __future__ import annotations

import importlib
import sys

SUITES = ("decode", "prefill", "gqa", "linear", "e2e", "breakdown", "targets")


def main(argv: list[str] | None = None) -> int:
    """Dispatch `argv[0]` to its suite's main; 2 with a usage line for an unknown suite."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] not in SUITES:
        print(f"usage: python -m jax_onnx_attn.bench {{{','.join(SUITES)}}} [--help]", file=sys.stderr)
        return 2
    return importlib.import_module(f"jax_onnx_attn.bench.{argv[0]}").main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
