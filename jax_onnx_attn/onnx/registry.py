"""Op registry: handlers keyed by (domain, op_type, since_version), and the model-wide coverage check.

A node resolves to the `since_version` of the schema that its model's opset import selects
(`onnx.defs.get_schema(op, max_inclusive_version=opset, domain=domain)`), exactly as onnxruntime
does. A handler declares every since_version whose semantics it implements; a schema version that
no handler declares is unsupported, so a future opset that changes an op is reported, not silently
run with old semantics. Ops that onnx.defs does not know (onnxruntime contrib ops, in com.microsoft or
registered by onnxruntime in the ai.onnx domain) resolve to the newest registered since_version that
is <= the domain's imported version.
"""

from __future__ import annotations

from typing import Callable, Iterable, NamedTuple

import onnx
import onnx.defs

#: The ai.onnx domain is spelled "" or "ai.onnx"; everything is keyed by "".
ONNX_DOMAIN = ""
MS_DOMAIN = "com.microsoft"

Handler = Callable  # (ctx: NodeContext, *inputs) -> tuple of outputs


class OpKey(NamedTuple):
    """An op schema version: (domain ("" for ai.onnx), op_type, since_version)."""

    domain: str
    op_type: str
    since_version: int

    def __str__(self) -> str:
        return f"{self.domain or 'ai.onnx'}::{self.op_type}-{self.since_version}"


_REGISTRY: dict[OpKey, Handler] = {}
#: {OpKey: input positions whose values must be known at trace time (they set shapes)}.
_STATIC_INPUTS: dict[OpKey, tuple[int, ...]] = {}


def normalize_domain(domain: str) -> str:
    """"" for the ai.onnx domain (spelled "" or "ai.onnx"); any other domain unchanged."""
    return ONNX_DOMAIN if domain in ("", "ai.onnx") else domain


def register(op_type: str, *since_versions: int, domain: str = ONNX_DOMAIN,
             static_inputs: tuple[int, ...] = ()):
    """Decorator: `fn` implements `op_type` at each listed schema since_version of `domain`.

    static_inputs: the input positions whose values decide output shapes (a Reshape's shape, a
    Slice's starts, ...). The handler reads them with `NodeContext.static_value`; a graph input that
    reaches one of them is one of the model's `LoweredModel.static_inputs`.
    """
    if not since_versions:
        raise ValueError(f"register({op_type!r}): list the since_versions the handler implements")

    def deco(fn: Handler) -> Handler:
        for v in since_versions:
            key = OpKey(normalize_domain(domain), op_type, int(v))
            if key in _REGISTRY:
                raise ValueError(f"{key} is registered twice")
            _REGISTRY[key] = fn
            _STATIC_INPUTS[key] = tuple(int(i) for i in static_inputs)
        return fn

    return deco


def registered() -> dict[OpKey, Handler]:
    """A copy of the registry (for introspection and docs)."""
    return dict(_REGISTRY)


def resolve(domain: str, op_type: str, opsets: dict[str, int]) -> OpKey:
    """The (domain, op_type, since_version) a node of `op_type` has under the model's `opsets`."""
    domain = normalize_domain(domain)
    imported = opsets.get(domain)
    if imported is None:
        # A node whose domain the model does not import is invalid ONNX; report it as version 0.
        return OpKey(domain, op_type, 0)
    try:
        schema = onnx.defs.get_schema(op_type, max_inclusive_version=imported, domain=domain)
        return OpKey(domain, op_type, schema.since_version)
    except onnx.defs.SchemaError:
        pass
    candidates = [k.since_version for k in _REGISTRY
                  if k.domain == domain and k.op_type == op_type and k.since_version <= imported]
    return OpKey(domain, op_type, max(candidates) if candidates else imported)


def static_inputs(key: OpKey) -> tuple[int, ...]:
    """The input positions of `key` whose values must be known at trace time (see `register`)."""
    return _STATIC_INPUTS.get(key, ())


def lookup(key: OpKey) -> Handler | None:
    """The handler registered for `key`, or None."""
    return _REGISTRY.get(key)


class UnsupportedOpsError(NotImplementedError):
    """The model uses ops (domain, op_type, since_version) that have no handler; `missing` lists all."""

    def __init__(self, missing: Iterable[OpKey]):
        self.missing = sorted(set(missing))
        lines = "\n".join(f"  {k.domain or 'ai.onnx'} {k.op_type} (since_version {k.since_version})"
                          for k in self.missing)
        super().__init__(f"the model uses {len(self.missing)} op(s) jax_onnx_attn does not "
                         f"implement:\n{lines}")


def model_opsets(model: onnx.ModelProto) -> dict[str, int]:
    """{normalized domain: imported opset version} of the model's opset_import."""
    return {normalize_domain(o.domain): int(o.version) for o in model.opset_import}


def iter_graphs(graph: onnx.GraphProto):
    """`graph` and every subgraph under it (If branches, Loop/Scan bodies), depth first."""
    yield graph
    for node in graph.node:
        for attr in node.attribute:
            subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else (
                attr.graphs if attr.type == onnx.AttributeProto.GRAPHS else [])
            for g in subs:
                yield from iter_graphs(g)


def iter_nodes(graph: onnx.GraphProto):
    """Every node of `graph` and of its subgraphs."""
    for g in iter_graphs(graph):
        yield from g.node


def check_coverage(model: onnx.ModelProto) -> None:
    """Resolve every node of the model (subgraphs included); raise UnsupportedOpsError listing all
    the missing ops at once."""
    opsets = model_opsets(model)
    missing = set()
    for node in iter_nodes(model.graph):
        key = resolve(node.domain, node.op_type, opsets)
        if key not in _REGISTRY:
            missing.add(key)
    if missing:
        raise UnsupportedOpsError(missing)
