"""All 186 ONNX Attention backend cases (93 single-node + 93 `_expanded` primitive-op graphs), each
loaded as a model through `jax_onnx_attn.load` and run under `jax.jit`, vs the cases' goldens.

The `_expanded` twins exercise the primitive-op lowering (Shape/Slice/Where/Softmax/... arithmetic
folded at trace time); the base cases exercise the Attention handler (attributes -> `ops.attention`).
To keep CI fast the cases are traced one by one (so an error names its case) and then compiled in
groups of GROUP models per executable.
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

import jax_onnx_attn
from jax_onnx_attn.conformance import attention_cases
from jax_onnx_attn.testing import assert_close

GROUP = 12
CASES = attention_cases()
NAMES = [c.name for c in CASES]


@pytest.fixture(scope="module")
def results():
    """{case name: {output name: array} or the exception its lowering raised}."""
    out = {}
    runnable = []
    for case in CASES:
        try:
            lowered = jax_onnx_attn.load(case.model)
            jax.eval_shape(lowered.apply, lowered.params, dict(case.inputs))
            runnable.append((case, lowered))
        except Exception as e:  # noqa: BLE001 - reported by the case's own test
            out[case.name] = e
    for i in range(0, len(runnable), GROUP):
        group = runnable[i:i + GROUP]

        def run_all(params, inputs, group=group):
            return [lowered.apply(p, x) for (_, lowered), p, x in zip(group, params, inputs)]

        got = jax.jit(run_all)([lw.params for _, lw in group], [dict(c.inputs) for c, _ in group])
        for (case, _), res in zip(group, got):
            out[case.name] = {k: np.asarray(v) for k, v in res.items()}
    return out


def test_case_count():
    assert len(CASES) == 186
    assert sum(c.expanded for c in CASES) == 93


@pytest.mark.parametrize("name", NAMES)
def test_attention_case(results, name):
    case = next(c for c in CASES if c.name == name)
    got = results[name]
    if isinstance(got, Exception):
        raise got
    assert list(got) == list(case.outputs), "output names differ"
    for out_name, expected in case.outputs.items():
        assert got[out_name].shape == expected.shape, out_name
        assert_close(got[out_name], expected, err_msg=f"{name}: {out_name}")
