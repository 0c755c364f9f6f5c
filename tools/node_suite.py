#!/usr/bin/env python
"""Run ONNX's backend node test suite through `jax_onnx_attn.load(...).apply` and print the count.

    python tools/node_suite.py                 # unjitted and under jax.jit, every covered case
    python tools/node_suite.py --jit           # only under jax.jit
    python tools/node_suite.py -k reshape      # cases whose name contains "reshape"
    python tools/node_suite.py --kinds         # failures grouped by reason

The cases are generated from the installed onnx (`onnx.backend.test.case.node`); see
`jax_onnx_attn.node_suite` for what "covered" and "pass" mean.
"""

from __future__ import annotations

import argparse
import sys

from jax_onnx_attn import node_suite


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group()
    mode.add_argument("--jit", action="store_true", help="only under jax.jit")
    mode.add_argument("--eager", action="store_true", help="only unjitted")
    ap.add_argument("-k", default=None, help="only cases whose name contains this")
    ap.add_argument("--kinds", action="store_true", help="group the failures by reason")
    ap.add_argument("--quiet", action="store_true", help="only the counts")
    ap.add_argument("--min-pass", type=float, default=None,
                    help="exit 1 when a run passes less than this fraction (e.g. 0.97)")
    args = ap.parse_args(argv)
    cases = [c for c in node_suite.covered_cases() if args.k is None or args.k in c.name]
    modes = [True] if args.jit else [False] if args.eager else [False, True]
    rc = 0
    for jit in modes:
        report = node_suite.run(jit=jit, cases=cases)
        print(report.summary(details=not args.quiet and not args.kinds))
        if args.kinds:
            for kind, n in node_suite.failure_kinds(report).most_common():
                print(f"  {n:4d}  {kind}")
        if args.min_pass is not None and report.passed < args.min_pass * report.total:
            rc = 1
    return rc


if __name__ == "__main__":
    sys.exit(main())
