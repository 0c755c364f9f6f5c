"""ONNX's backend node test suite run through `jax_onnx_attn.load(...).apply`.

The cases are the ones `onnx.backend.test` ships as generators (`onnx.backend.test.case.node`),
produced at run time from the installed onnx (no download): one single-node model per case, its
`_expanded` function-body twins, each with its inputs and expected outputs. A case is *covered* when
every op type it uses (subgraphs included) has a handler in the registry at some schema version; a
covered case whose op version has no handler is a failure, not a skip (the lowering should know the
op's newest schema).

    from jax_onnx_attn import node_suite
    report = node_suite.run(jit=True)           # every covered case, under jax.jit
    print(report.summary())

A case runs as a user would run it: `load(model)`, then `apply(params, inputs)` with every graph
input (unjitted), or `jax.jit(apply)(params, inputs)` (jitted) with the inputs that set shapes
passed as `jax_onnx_attn.onnx.Static` values (`LoweredModel.static_inputs`), the rest traced.
Outputs are compared as onnx's own backend runner compares them (`np.testing.assert_allclose` with
the case's rtol / atol, rtol at least 2**-6 for bfloat16, exact for strings, bools and integers),
and the dtype must be the expected one or its JAX-canonical form (int64 -> int32 and float64 ->
float32 without jax_enable_x64).
"""

from __future__ import annotations

import dataclasses
import functools
import re
import time
import warnings
from collections import Counter
from typing import Callable, Iterable, Mapping

import jax
import ml_dtypes
import numpy as np
import onnx
from onnx import numpy_helper

from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.handlers.elementwise import SUB_BYTE_INTS
from jax_onnx_attn.onnx.values import traced_dtype


@dataclasses.dataclass(frozen=True)
class NodeCase:
    """One generated backend node case.

    name: onnx's test name (e.g. "test_reshape_negative_dim", "test_softmax_axis_0_expanded").
    model: the ModelProto.
    data_sets: ((inputs {graph input name: array}, outputs {graph output name: array}), ...).
    rtol, atol: the tolerances onnx's runner uses for this case.
    op_types: every (domain, op_type) the model uses, subgraphs included ("" = ai.onnx).
    """

    name: str
    model: onnx.ModelProto
    data_sets: tuple
    rtol: float
    atol: float
    op_types: frozenset

    @property
    def covered(self) -> bool:
        """True when every op type of the model has a handler at some schema version."""
        have = registered_op_types()
        return all(op in have for op in self.op_types)


def registered_op_types() -> frozenset:
    """{(domain, op_type)} with a handler at any since_version ("" = ai.onnx)."""
    return frozenset((k.domain, k.op_type) for k in registry.registered())


def _array(x):
    if isinstance(x, onnx.TensorProto):
        return numpy_helper.to_array(x)
    return x


@functools.cache
def _float_to_sub_byte_wraps() -> bool:
    """Whether this ml_dtypes casts an out-of-range float to int4 modulo 16, as the ONNX spec's
    Cast does (up to ml_dtypes 0.6 it did; 0.7 gives 0 and warns "invalid value")."""
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        return int(np.array([-9.0], np.float32).astype(ml_dtypes.int4)[0]) == 7


#: Cases whose expected outputs, as onnx's generators compute them here, are not the spec's: name ->
#: why. Left out of node_cases() (so of every count), listed by Report.summary.
ORACLE_UNUSABLE: dict[str, str] = {}


def _oracle_unusable(op_types, ins, outs) -> str | None:
    """Why a case's generated expected outputs cannot be trusted here, or None. onnx computes a
    float -> int4 / uint4 / int2 / uint2 Cast's expected output with ml_dtypes' own float cast; with
    ml_dtypes >= 0.7 that gives 0 for an out-of-range value, where the spec (and onnx's stored
    test data) wraps it."""
    casts = {("", "Cast"), ("", "CastLike")} & set(op_types)
    if not casts or _float_to_sub_byte_wraps():
        return None
    if any(np.asarray(x).dtype in SUB_BYTE_INTS for x in outs) and \
            any(np.asarray(x).dtype.kind == "f" for x in ins):
        return (f"expected output generated with ml_dtypes {ml_dtypes.__version__}'s float -> "
                "sub-byte int cast, which does not wrap out-of-range values as Cast does")
    return None


@functools.lru_cache(maxsize=1)
def node_cases() -> tuple[NodeCase, ...]:
    """Every node case of the installed onnx's generators, sorted by name (generated once; about 4 s).

    Cases whose data sets are not plain tensors (sequences, optionals, maps) are left out: the
    lowering's values are tensors.
    """
    from onnx.backend.test.case import node as node_cases_module

    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore")
        raw = list(node_cases_module.collect_testcases(None))
    seen, out = set(), []
    for case in raw:
        if case.name in seen or case.model is None:
            continue
        seen.add(case.name)
        graph = case.model.graph
        data_sets = []
        ok = True
        for inputs, outputs in case.data_sets:
            ins = [_array(x) for x in inputs]
            outs = [_array(x) for x in outputs]
            if not all(isinstance(x, (np.ndarray, np.generic)) for x in ins + outs):
                ok = False
                break
            data_sets.append(({vi.name: np.asarray(x) for vi, x in zip(graph.input, ins)},
                              {vi.name: np.asarray(x) for vi, x in zip(graph.output, outs)}))
        if not ok:
            continue
        ops = frozenset((registry.normalize_domain(n.domain), n.op_type)
                        for n in registry.iter_nodes(graph))
        why = next((w for w in (_oracle_unusable(ops, list(i.values()), list(o.values()))
                                for i, o in data_sets) if w), None)
        if why:
            ORACLE_UNUSABLE[case.name] = why
            continue
        out.append(NodeCase(case.name, case.model, tuple(data_sets), float(case.rtol),
                            float(case.atol), ops))
    return tuple(sorted(out, key=lambda c: c.name))


def covered_cases() -> tuple[NodeCase, ...]:
    """The cases whose every op type has a handler (`NodeCase.covered`)."""
    return tuple(c for c in node_cases() if c.covered)


@dataclasses.dataclass(frozen=True)
class Result:
    """The outcome of one data set: `error` is None when it passed, else a one-line reason."""

    name: str
    index: int
    jit: bool
    error: str | None

    @property
    def passed(self) -> bool:
        """True when every output matched."""
        return self.error is None


def compare(got: Mapping, expected: Mapping, rtol: float, atol: float) -> str | None:
    """None when `got` matches `expected` as onnx's backend runner checks it, else the first problem.

    Args:
      got: {output name: array} from apply.
      expected: {output name: array}, the case's goldens.
      rtol, atol: float tolerances (the case's).
    """
    if list(got) != list(expected):
        return f"outputs {list(got)} != expected {list(expected)}"
    for name, exp in expected.items():
        act = np.asarray(got[name])
        exp = np.asarray(exp)
        if act.shape != exp.shape:
            return f"{name}: shape {act.shape} != {exp.shape}"
        if act.dtype != exp.dtype and act.dtype != traced_dtype(exp.dtype):
            return f"{name}: dtype {act.dtype} != {exp.dtype}"
        if exp.dtype == object or exp.dtype.kind in "biuUS":
            if not np.array_equal(act.astype(exp.dtype), exp):
                return f"{name}: values differ"
            continue
        # onnx's runner allows two bfloat16 ulps (rtol 2**-6) for bfloat16 outputs.
        out_rtol = max(rtol, 2.0 ** -6) if exp.dtype.name == "bfloat16" else rtol
        try:
            np.testing.assert_allclose(act.astype(np.float64), exp.astype(np.float64),
                                       rtol=out_rtol, atol=atol)
        except AssertionError as e:
            lines = [ln for ln in str(e).splitlines() if ln.strip()]
            return f"{name}: values differ ({'; '.join(lines[1:4])})"
    return None


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0] if text else ''}"[:300]


def run_case(case: NodeCase, *, jit: bool) -> list[Result]:
    """Load `case.model` and run each data set through apply (jax.jit(apply) when `jit`)."""
    from jax_onnx_attn.onnx import Static, load

    results = []
    try:
        lowered = load(case.model)
    except Exception as e:  # noqa: BLE001 - the reason is the result
        return [Result(case.name, i, jit, "load: " + _one_line(e)) for i in range(len(case.data_sets))]
    fn = jax.jit(lowered.apply) if jit else lowered.apply
    static = set(lowered.static_inputs)
    for i, (inputs, expected) in enumerate(case.data_sets):
        feeds = {k: Static(v) if jit and k in static else v for k, v in inputs.items()}
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                got = fn(lowered.params, feeds)
            got = {k: np.asarray(v) for k, v in got.items()}
            error = compare(got, expected, case.rtol, case.atol)
        except Exception as e:  # noqa: BLE001
            error = _one_line(e)
        results.append(Result(case.name, i, jit, error))
    return results


@dataclasses.dataclass
class Report:
    """The outcome of a run: `results` (one per data set) and the covered / uncovered counts."""

    results: list
    jit: bool
    uncovered: int
    seconds: float

    @property
    def passed(self) -> int:
        """Data sets that passed."""
        return sum(r.passed for r in self.results)

    @property
    def total(self) -> int:
        """Data sets of the covered cases."""
        return len(self.results)

    def failures(self) -> list:
        """The failed results."""
        return [r for r in self.results if not r.passed]

    def summary(self, details: bool = True) -> str:
        """A printable summary: the count, then (with details) every failure grouped by reason."""
        mode = "jax.jit(apply)" if self.jit else "apply (unjitted)"
        pct = 100.0 * self.passed / self.total if self.total else 0.0
        lines = [f"ONNX backend node suite through {mode}: {self.passed} / {self.total} data sets "
                 f"of the covered cases pass ({pct:.1f}%); {self.uncovered} cases use an op "
                 f"without a handler; {self.seconds:.0f} s"]
        if ORACLE_UNUSABLE:
            lines.append(f"  {len(ORACLE_UNUSABLE)} cases left out, their generated expected "
                         f"outputs not the spec's: {', '.join(sorted(ORACLE_UNUSABLE))} "
                         f"({next(iter(ORACLE_UNUSABLE.values()))})")
        if details:
            for r in self.failures():
                lines.append(f"  FAIL {r.name}[{r.index}]: {r.error}")
        return "\n".join(lines)


def run(*, jit: bool, cases: Iterable[NodeCase] | None = None,
        progress: Callable[[NodeCase, list], None] | None = None) -> Report:
    """Run the covered cases (or `cases`) and return a Report.

    Args:
      jit: run under jax.jit (shape-setting inputs as Static values) instead of unjitted.
      cases: the cases to run; default every covered case.
      progress: called after each case with (case, its results).
    """
    start = time.perf_counter()
    all_cases = node_cases()
    cases = covered_cases() if cases is None else tuple(cases)
    results = []
    for case in cases:
        res = run_case(case, jit=jit)
        results.extend(res)
        if progress is not None:
            progress(case, res)
        if len(results) % 200 < len(res):
            jax.clear_caches()  # thousands of small executables: keep the process's memory flat
    uncovered = sum(not c.covered for c in all_cases)
    return Report(results, jit, uncovered, time.perf_counter() - start)


def failure_kinds(report: Report) -> Counter:
    """Counter of failure reasons with names and numbers stripped (a rough grouping for notes)."""
    kinds = Counter()
    for r in report.failures():
        kinds[re.sub(r"'[^']*'|\d+|\[[^\]]*\]", "_", r.error)[:120]] += 1
    return kinds


__all__ = ["NodeCase", "Result", "Report", "node_cases", "covered_cases", "registered_op_types",
           "compare", "run_case", "run", "failure_kinds"]
