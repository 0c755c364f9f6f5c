"""The graph interpreter: runs an ONNX graph node by node at trace time.

It is called inside `jax.jit` once per input-shape signature. Each node's handler gets NumPy inputs
where they are known at trace time and jax arrays otherwise, and computes in NumPy when every input is
NumPy (constant folding of shape arithmetic), in jax.numpy otherwise. Subgraphs (If branches) run in
a scope that sees the enclosing values.

A `hook` lets the fixed-capacity cache step intercept nodes (KV Concat, attention masks, the
builder's GQA) without the op handlers knowing about it.
"""

from __future__ import annotations

from collections import ChainMap
from typing import Any, Callable

import jax.numpy as jnp
import numpy as np
import onnx

from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.values import ShapeOnly, attribute_value, is_static, np_dtype, to_jax, \
    traced_dtype

#: hook(ctx, inputs) -> outputs (a tuple) to replace the node's handler, or None to run it.
Hook = Callable[["NodeContext", list], Any]


class NodeContext:
    """Everything a handler may need besides its inputs.

    node: the NodeProto; key: its resolved OpKey (ctx.version is key.since_version); attrs: decoded
    attributes; xp: numpy when every input is static, else jax.numpy; interp: the Interpreter (for
    subgraphs and the values of other nodes); env: the current scope's values.
    """

    def __init__(self, node: onnx.NodeProto, key: registry.OpKey, inputs: list, interp: "Interpreter",
                 env):
        self.node = node
        self.key = key
        self.version = key.since_version
        self.attrs = {a.name: attribute_value(a) for a in node.attribute}
        self.interp = interp
        self.env = env
        self.static = all(v is None or is_static(v) for v in inputs)
        self.xp = np if self.static else jnp

    def attr(self, name: str, default=None):
        """The node's attribute `name` as a Python value (see `attribute_value`), or `default`."""
        return self.attrs.get(name, default)

    def wants(self, index: int) -> bool:
        """True when the node names its output `index` (an omitted optional output is "" or absent)."""
        return len(self.node.output) > index and bool(self.node.output[index])

    def fail(self, msg: str, exc=ValueError):
        """Raise `exc` with `msg` prefixed by the op key and the node's name (never returns)."""
        raise exc(f"{self.key} node {self.node.name or self.node.output[0]!r}: {msg}")

    def operands(self, *values):
        """Values in the world of ctx.xp: unchanged for NumPy, jax arrays (int64 clipped) otherwise."""
        if self.static:
            return values if len(values) != 1 else values[0]
        out = tuple(to_jax(v) for v in values)
        return out if len(out) != 1 else out[0]

    def static_value(self, v, what: str) -> np.ndarray:
        """An input that must be known at trace time (a shape, axes, pads, ...)."""
        if v is None:
            return None
        if not is_static(v):
            self.fail(f"{what} must be known at trace time (it decides a shape), but it depends on "
                      f"the model's inputs or weights")
        return np.asarray(v)

    def dtype(self, elem_type: int) -> np.dtype:
        """The dtype an ONNX elem type maps to here (after load(dtype=...) and, traced, JAX's)."""
        d = self.interp.map_dtype(np_dtype(elem_type))
        return d if self.static else traced_dtype(d)

    @property
    def collecting_status(self) -> bool:
        """True when the run collects device statuses (`LoweredModel.apply_with_status`): a handler
        that can see a bad runtime value computes its status only then."""
        return self.interp.status_sink is not None

    def report_status(self, status) -> None:
        """Record this node's int32 device status (flags of `jax_onnx_attn.ops.status`; any shape,
        e.g. [B] or a scalar) for `LoweredModel.apply_with_status`; a no-op when not collecting.
        Statuses of one node (a subgraph run twice) are ORed."""
        sink = self.interp.status_sink
        if sink is None:
            return
        name = self.node.name or self.node.output[0]
        key = f"{self.node.op_type} {name!r}"
        sink[key] = status if key not in sink else sink[key] | status

    def producer(self, name: str):
        """The node that outputs `name` (None for graph inputs and initializers)."""
        return self.interp.producers.get(name)

    def value(self, name: str):
        """The value named `name` in the current scope (None for "" or an unknown name)."""
        return self.env.get(name) if name else None


class Interpreter:
    """Runs a model's main graph (and subgraphs) for one set of input values.

    float_map: {onnx float dtype: dtype} applied to constants, casts and inputs (load(dtype=...)).
    options: lowering choices that handlers read (load's keyword options, e.g. int8_activations).
    """

    def __init__(self, model: onnx.ModelProto, float_map: dict | None = None,
                 hook: Hook | None = None, options: dict | None = None):
        self.model = model
        self.opsets = registry.model_opsets(model)
        self.float_map = {np.dtype(k): np.dtype(v) for k, v in (float_map or {}).items()}
        self.hook = hook
        self.options = dict(options or {})
        self.producers: dict[str, onnx.NodeProto] = {}
        for node in registry.iter_nodes(model.graph):
            for o in node.output:
                if o:
                    self.producers[o] = node
        self._keys: dict[int, registry.OpKey] = {}
        #: {node label: int32 status} while a run collects device statuses, else None.
        self.status_sink: dict | None = None

    def map_dtype(self, dtype) -> np.dtype:
        """`dtype` after load(dtype=...)'s float_map (e.g. float32 -> bfloat16); others unchanged."""
        dtype = np.dtype(dtype)
        return self.float_map.get(dtype, dtype)

    def key(self, node: onnx.NodeProto) -> registry.OpKey:
        """The node's resolved OpKey under the model's opsets (cached per node)."""
        k = self._keys.get(id(node))
        if k is None:
            k = self._keys[id(node)] = registry.resolve(node.domain, node.op_type, self.opsets)
        return k

    def run_graph(self, graph: onnx.GraphProto, env) -> list:
        """Run `graph`'s nodes in `env` (a dict or ChainMap, updated in place); return its outputs."""
        for node in graph.node:
            self.run_node(node, env)
        missing = [o.name for o in graph.output if o.name not in env]
        if missing:
            raise ValueError(f"graph {graph.name!r}: outputs {missing} were never computed")
        return [env[o.name] for o in graph.output]

    def run_subgraph(self, graph: onnx.GraphProto, env) -> list:
        """Run a subgraph (If branch) in a child scope of `env`."""
        scope = ChainMap({}, env)
        for init in graph.initializer:
            # Subgraph initializers are params (see loader); they are in the outer env by name.
            if init.name not in env:
                raise KeyError(f"subgraph initializer {init.name!r} is not loaded")
        return self.run_graph(graph, scope)

    def run_node(self, node: onnx.NodeProto, env) -> None:
        """Run one node: read its inputs from `env`, call the hook or its handler, store its outputs.

        Raises ValueError for an input not computed yet, UnsupportedOpsError for an op without a
        handler, NotImplementedError when the handler leaves a wanted output unproduced.
        """
        try:
            inputs = [env[n] if n else None for n in node.input]
        except KeyError as e:
            raise ValueError(f"node {node.name or node.op_type!r} reads {e.args[0]!r}, which is not "
                             f"computed before it (the graph is not topologically sorted, or the "
                             f"input is missing)") from None
        key = self.key(node)
        ctx = NodeContext(node, key, inputs, self, env)
        outputs = self.hook(ctx, inputs) if self.hook is not None else None
        if outputs is None:
            handler = registry.lookup(key)
            if handler is None:
                raise registry.UnsupportedOpsError([key])
            shape_only = [n for n, v in zip(node.input, inputs) if isinstance(v, ShapeOnly)]
            if shape_only and node.op_type != "Shape":
                ctx.fail(f"reads {shape_only}, whose data the fixed-capacity cache step replaces; "
                         f"only Shape may read it ({inputs[node.input.index(shape_only[0])].why})")
            outputs = handler(ctx, *inputs)
        if not isinstance(outputs, (tuple, list)):
            outputs = (outputs,)
        for name, value in zip(node.output, outputs):
            if name:
                env[name] = value
        wanted = [n for n in node.output[len(outputs):] if n]
        if wanted:
            ctx.fail(f"outputs {wanted} are not produced by this implementation", NotImplementedError)


def run_model(interp: Interpreter, env: dict) -> list:
    """Run the main graph; `env` must hold every graph input and initializer."""
    return interp.run_graph(interp.model.graph, env)
