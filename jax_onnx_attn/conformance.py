"""The ONNX backend node cases of ai.onnx Attention, generated at run time from the installed onnx.

onnx wheels ship no node test data for Attention, so the cases are produced by running onnx's own
test-case generators, the ones `onnx.backend.test.case.node.collect_testcases("Attention")` runs
(only those: the other ops' generators are not run). With onnx 1.23.x that gives 186 cases: 93 base
models (a single Attention node) and their 93 `_expanded` twins (the node's function body as
primitive ops, same inputs and outputs). Generation takes about two seconds, once per process.

    from jax_onnx_attn.conformance import attention_cases
    for case in attention_cases():                 # base + _expanded
        run(case.model, case.inputs) ~= case.outputs

Treat the arrays as read-only: they are shared by every caller in the process.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import os
import sys
import warnings
from typing import Any, Mapping

import numpy as np
import onnx
from onnx import helper, numpy_helper

#: The operator's inputs and outputs in ONNX order (optional ones may be absent or "").
ATTENTION_INPUTS = ("Q", "K", "V", "attn_mask", "past_key", "past_value", "nonpad_kv_seqlen")
ATTENTION_OUTPUTS = ("Y", "present_key", "present_value", "qk_matmul_output")


@dataclasses.dataclass(frozen=True)
class ConformanceCase:
    """One generated backend test case.

    name: e.g. "test_attention_4d_causal" or "test_attention_4d_causal_expanded".
    opset: the model's ai.onnx opset import (23, 24 or 25 for Attention).
    model: the ModelProto (one Attention node, or its expansion into primitive ops).
    inputs: graph input name -> array, in graph-input order (bf16 as ml_dtypes.bfloat16).
    outputs: graph output name -> expected array, in graph-output order.
    expanded: True for the `_expanded` twin.
    """

    name: str
    opset: int
    model: onnx.ModelProto
    inputs: Mapping[str, np.ndarray]
    outputs: Mapping[str, np.ndarray]
    expanded: bool

    @property
    def base_name(self) -> str:
        """The name of the base case (the same name for a base case)."""
        return self.name[: -len("_expanded")] if self.expanded else self.name


def _opset(model: onnx.ModelProto) -> int:
    return next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))


def _is_attention_node_case(case) -> bool:
    nodes = case.model.graph.node
    return len(nodes) == 1 and nodes[0].op_type == "Attention" and nodes[0].domain in ("", "ai.onnx")


def _generate_raw() -> list:
    """onnx TestCase objects of the Attention generators (base and expanded)."""
    # Importing the generators of every op prints their numpy warnings (divide by zero, ...).
    with warnings.catch_warnings(), np.errstate(all="ignore"):
        warnings.simplefilter("ignore", RuntimeWarning)
        return _run_generators()


def _run_generators() -> list:
    from onnx.backend.test.case import node as node_cases

    module = "onnx.backend.test.case.node.attention"
    previous = node_cases._TargetOpType
    node_cases._TargetOpType = "Attention"
    try:
        if module not in sys.modules:
            # Importing only the Attention generators runs them (onnx's exporter metaclass) into
            # onnx's global list: what collect_testcases("Attention") gives, without running the
            # generators of every other op.
            start = len(node_cases._NodeTestCases)
            importlib.import_module(module)
            return _attention_only(node_cases._NodeTestCases[start:])
        cases = _attention_only(node_cases._NodeTestCases)
        if cases:
            return cases
        # An earlier collection for another op type ran the generators without keeping Attention
        # (and without reserving its names): run its exporters again into a scratch tail.
        from onnx.backend.test.case.base import Base

        start = len(node_cases._NodeTestCases)
        try:
            for obj in vars(sys.modules[module]).values():
                if isinstance(obj, type) and issubclass(obj, Base) and obj is not Base:
                    for key, value in vars(obj).items():
                        if key.startswith("export"):
                            np.random.seed(0)  # as onnx's exporter metaclass does
                            value.__func__()
            return _attention_only(node_cases._NodeTestCases[start:])
        finally:
            del node_cases._NodeTestCases[start:]
    finally:
        node_cases._TargetOpType = previous


def _attention_only(cases) -> list:
    base = {c.name for c in cases if _is_attention_node_case(c)}
    return [c for c in cases if c.name in base or
            (c.name.endswith("_expanded") and c.name[: -len("_expanded")] in base)]


@functools.lru_cache(maxsize=1)
def _all_cases() -> tuple[ConformanceCase, ...]:
    out = []
    for case in _generate_raw():
        (inputs, outputs), = case.data_sets
        graph = case.model.graph
        out.append(ConformanceCase(
            name=case.name, opset=_opset(case.model), model=case.model,
            inputs={vi.name: np.asarray(x) for vi, x in zip(graph.input, inputs)},
            outputs={vi.name: np.asarray(x) for vi, x in zip(graph.output, outputs)},
            expanded=case.name.endswith("_expanded")))
    if not out:
        raise RuntimeError(f"onnx {onnx.__version__} generated no Attention backend test cases")
    return tuple(sorted(out, key=lambda c: c.name))


def attention_cases(*, expanded: bool | None = None) -> tuple[ConformanceCase, ...]:
    """The Attention backend cases, sorted by name (generated once per process).

    expanded: None for all (base and `_expanded`), False for the base cases, True for the twins.
    """
    cases = _all_cases()
    if expanded is None:
        return cases
    return tuple(c for c in cases if c.expanded == expanded)


def attention_case(name: str) -> ConformanceCase:
    """One case by name, with or without the "test_attention_" prefix."""
    full = name if name.startswith("test_") else "test_attention_" + name
    for case in _all_cases():
        if case.name == full:
            return case
    raise KeyError(f"no Attention conformance case named {name!r}")


def node_call(case: ConformanceCase) -> tuple[dict[str, np.ndarray], dict[str, Any], list[str]]:
    """A base case as an operator call: (arrays by ONNX input name, attributes, ONNX output names).

    Inputs left out of the node ("" or absent) are absent from the dict; the output names are those
    of `ATTENTION_OUTPUTS` the node produces, in the order of `case.outputs`.
    """
    if case.expanded:
        raise ValueError(f"{case.name} is an expanded case: it has no single Attention node")
    node, = case.model.graph.node
    arrays = {slot: case.inputs[edge] for slot, edge in zip(ATTENTION_INPUTS, node.input) if edge}
    attributes = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    slots = {edge: slot for slot, edge in zip(ATTENTION_OUTPUTS, node.output) if edge}
    return arrays, attributes, [slots[name] for name in case.outputs]


def save_cases(directory: str | os.PathLike, cases=None) -> list[str]:
    """Write cases in onnx's on-disk layout: DIR/<name>/model.onnx and
    DIR/<name>/test_data_set_0/{input_i,output_j}.pb. Returns the case directories."""
    written = []
    for case in attention_cases() if cases is None else cases:
        root = os.path.join(os.fspath(directory), case.name)
        data = os.path.join(root, "test_data_set_0")
        os.makedirs(data, exist_ok=True)
        onnx.save(case.model, os.path.join(root, "model.onnx"))
        for prefix, arrays in (("input", case.inputs), ("output", case.outputs)):
            for i, (name, array) in enumerate(arrays.items()):
                tensor = numpy_helper.from_array(array, name)
                with open(os.path.join(data, f"{prefix}_{i}.pb"), "wb") as f:
                    f.write(tensor.SerializeToString())
        written.append(root)
    return written


def attention_model(inputs: Mapping[str, np.ndarray], attributes: Mapping[str, Any] | None = None,
                    outputs=("Y",), *, opset: int = 24) -> onnx.ModelProto:
    """A single-node Attention model for `inputs` (ONNX input name -> array; absent = not given).

    The graph inputs take the inputs' names, dtypes and shapes; `outputs` names the ONNX outputs to
    produce (a subset of `ATTENTION_OUTPUTS`). Run it with onnxruntime or onnx's ReferenceEvaluator
    to get an oracle for any call of `jax_onnx_attn.ops.attention`.
    """
    unknown = set(inputs) - set(ATTENTION_INPUTS) | set(outputs) - set(ATTENTION_OUTPUTS)
    if unknown:
        raise ValueError(f"unknown Attention inputs / outputs: {sorted(unknown)}")
    last_in = max(ATTENTION_INPUTS.index(n) for n in inputs)
    node_inputs = [n if n in inputs else "" for n in ATTENTION_INPUTS[:last_in + 1]]
    last_out = max(ATTENTION_OUTPUTS.index(n) for n in outputs)
    node_outputs = [n if n in outputs else "" for n in ATTENTION_OUTPUTS[:last_out + 1]]
    elem = {n: helper.np_dtype_to_tensor_dtype(np.asarray(x).dtype) for n, x in inputs.items()}
    out_elem = {"Y": elem["Q"], "present_key": elem["K"], "present_value": elem["V"],
                "qk_matmul_output": elem["Q"]}
    node = helper.make_node("Attention", node_inputs, node_outputs, **dict(attributes or {}))
    graph = helper.make_graph(
        [node], "attention",
        [helper.make_tensor_value_info(n, elem[n], np.shape(inputs[n])) for n in node_inputs if n],
        [helper.make_tensor_value_info(n, out_elem[n], None) for n in node_outputs if n])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 10  # onnxruntime reads IR 10; newer onnx writes a newer default
    return model
