"""How a probe writes its run for bench/results/: one function, no side effects on import (session
32: the decode probes took it from rows_kernel_times.py, whose import turns XLA's command buffers
off for the whole process; that made session 31's "XLA 10-15% slower than a raw graph")."""

import json
import os


def write_results(path, suite, what, rows):
    """rows as bench/results/ holds a probe's run: a document with its suite, commit, GPU and what
    was measured (tools/plot_bench.py reads only the suites it plots)."""
    import jax
    doc = {"suite": suite, "commit": os.environ.get("JOA_GIT_COMMIT", "unknown"),
           "gpu": jax.devices()[0].device_kind, "jax": jax.__version__, "what": what, "results": rows}
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
