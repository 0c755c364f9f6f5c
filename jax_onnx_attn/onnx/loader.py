"""`load`: an ONNX model as a params pytree and a pure, jittable `apply(params, inputs)`."""

from __future__ import annotations

import functools
import os
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

import jax
import numpy as np
import onnx
import onnx.defs
import onnx.inliner

from jax_onnx_attn.onnx import handlers as _handlers  # noqa: F401  (registers every handler)
from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.files import model_file
from jax_onnx_attn.onnx.fusion import fuse_decoder
from jax_onnx_attn.onnx.interpreter import Hook, Interpreter
from jax_onnx_attn.onnx.values import ShapeOnly, Static, is_traced, np_dtype, tensor_to_numpy, \
    to_jax, traced_dtype
from jax_onnx_attn.ops.dtypes import FLOAT_DTYPES

#: Integer initializers up to this many elements (rank <= 1) stay NumPy so that shape arithmetic
#: built on them folds; everything else (weights, packed quantised weights) is a param.
STATIC_INIT_MAX = 1024


def _is_static_initializer(arr: np.ndarray) -> bool:
    return (not np.issubdtype(arr.dtype, np.floating) and arr.ndim <= 1
            and arr.size <= STATIC_INIT_MAX)


def _primary_float(arrays) -> np.dtype | None:
    """The float dtype holding most weight bytes: the model's compute type (f32, f16 or bf16)."""
    nbytes: dict[np.dtype, int] = {}
    for a in arrays:
        if a.dtype in FLOAT_DTYPES:
            nbytes[a.dtype] = nbytes.get(a.dtype, 0) + a.nbytes
    return max(nbytes, key=nbytes.get) if nbytes else None


#: Ops whose output depends on their input's shape only: value dependence stops there.
_SHAPE_ONLY_OPS = ("Shape", "Size")


def _reads(node: onnx.NodeProto) -> list[str]:
    """The values a node reads: its inputs and, for If / Loop / Scan, every value its subgraphs
    read (outer-scope references included)."""
    names = [i for i in node.input if i]
    for attr in node.attribute:
        subs = [attr.g] if attr.type == onnx.AttributeProto.GRAPH else list(attr.graphs)
        for g in subs:
            for sub in registry.iter_nodes(g):
                names.extend(i for i in sub.input if i)
            names.extend(o.name for o in g.output)
    return names


def find_static_inputs(model: onnx.ModelProto, input_names) -> dict[str, str]:
    """{graph input name: where its value sets a shape} for the inputs whose values must be known at
    trace time: those that reach a static input position (`registry.static_inputs`) of some node,
    through any chain of nodes other than Shape / Size (which read only the shape).

    Args:
      model: the ModelProto (subgraphs included).
      input_names: the graph's input names (initializers excluded).
    """
    opsets = registry.model_opsets(model)
    producers = {}
    for node in registry.iter_nodes(model.graph):
        for o in node.output:
            if o:
                producers[o] = node
    inputs = set(input_names)
    found: dict[str, str] = {}
    for node in registry.iter_nodes(model.graph):
        positions = registry.static_inputs(registry.resolve(node.domain, node.op_type, opsets))
        for pos in positions:
            if pos >= len(node.input) or not node.input[pos]:
                continue
            where = f"{node.op_type} node {node.name or node.output[0]!r} input {pos}"
            stack, seen = [node.input[pos]], set()
            while stack:
                name = stack.pop()
                if name in seen:
                    continue
                seen.add(name)
                if name in inputs:
                    found.setdefault(name, where)
                    continue
                prod = producers.get(name)
                if prod is None or prod.op_type in _SHAPE_ONLY_OPS:
                    continue
                stack.extend(_reads(prod))
    return {n: found[n] for n in input_names if n in found}


@functools.lru_cache(maxsize=None)
def _jax_lacks(dtype: np.dtype) -> str | None:
    """Why jax cannot hold `dtype` (e.g. float6, which ml_dtypes has and XLA lacks), or None."""
    try:
        jax.numpy.zeros((0,), traced_dtype(dtype))
    except Exception as e:  # noqa: BLE001 - jax's error varies by dtype and version
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    return None


def _check_jax_dtype(name: str, dtype) -> None:
    """TypeError naming input `name` when jax cannot hold `dtype`."""
    why = _jax_lacks(np.dtype(dtype))
    if why is not None:
        raise TypeError(f"apply: input {name!r} has dtype {np.dtype(dtype)}, which jax cannot hold "
                        f"({why})")


def _declared(vi: onnx.ValueInfoProto):
    """(numpy dtype or None, dims or None) of a graph input's declared tensor type."""
    if not vi.type.HasField("tensor_type"):
        return None, None
    tt = vi.type.tensor_type
    dtype = None
    if tt.elem_type:
        try:
            dtype = np_dtype(tt.elem_type)
        except (KeyError, ValueError, TypeError):
            dtype = None
    dims = None
    if tt.HasField("shape"):
        dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                     for d in tt.shape.dim)
    return dtype, dims


class LoweredModel:
    """An ONNX model lowered to JAX.

    Attributes:
      model: the ModelProto (local functions inlined).
      params: {initializer name: jax.Array}: weights (float tensors, cast to `dtype` when given) and
        packed quantised weights. Small integer initializers are kept as trace-time constants.
      input_names, output_names: the graph's inputs (initializers excluded) and outputs, in order.
      dtype: the dtype the model's float type was mapped to, or None.
      float_type: the model's own float type (the dtype of most weight bytes), or None.
      fusions: what load's fusion rewrote (`onnx.fusion.FusionReport`), or None with fuse=False.
        After fusion `model` is the rewritten graph; its main-graph initializers carry names,
        shapes and types only (the values are `params`).
      static_inputs: {graph input name: where its value sets a shape}: the inputs whose values must
        be known at trace time (a Reshape's shape fed as an input, ...). Unjitted, pass them as
        arrays; under `jax.jit` pass them as `jax_onnx_attn.onnx.Static(value)` (one compile per
        distinct value), or use `jit()`, which does it.
    """

    fusions = None

    def __init__(self, model: onnx.ModelProto, params: dict, constants: dict, float_map: dict,
                 float_type, options: dict | None = None):
        self.model = model
        self.params = params
        self._constants = constants
        self._float_map = float_map
        self.float_type = float_type
        self.dtype = float_map.get(float_type) if float_type is not None else None
        init_names = {t.name for t in model.graph.initializer}
        self.input_names = [i.name for i in model.graph.input if i.name not in init_names]
        self.output_names = [o.name for o in model.graph.output]
        self._options = dict(options or {})
        self._interp = Interpreter(model, float_map, options=self._options)
        self._declared = {vi.name: _declared(vi) for vi in model.graph.input
                          if vi.name in self.input_names}
        self.static_inputs = find_static_inputs(model, self.input_names)
        self._checked = None
        for name, (dtype, _) in self._declared.items():
            if dtype is not None and dtype.kind in "OSU":
                self.static_inputs.setdefault(
                    name, "a string tensor: jax has no string type, so it is passed by value")

    # -- introspection -------------------------------------------------------------------------
    def input_info(self) -> dict[str, tuple[tuple, np.dtype]]:
        """{input name: (dims, dtype)}; a dim is an int or the producer's symbolic name (str)."""
        out = {}
        for vi in self.model.graph.input:
            if vi.name in self.input_names:
                tt = vi.type.tensor_type
                dims = tuple(d.dim_value if d.HasField("dim_value") else (d.dim_param or None)
                             for d in tt.shape.dim)
                out[vi.name] = (dims, self._interp.map_dtype(np_dtype(tt.elem_type)))
        return out

    # -- running ---------------------------------------------------------------------------------
    def _accepts(self, declared: np.dtype, got: np.dtype) -> bool:
        """Whether a feed of dtype `got` may stand for an input declared `declared`: the same type,
        the type load(dtype=...) maps it to, or either's JAX-canonical form (int64 -> int32,
        float64 -> float32 without jax_enable_x64)."""
        mapped = self._interp.map_dtype(declared)
        return got in {declared, mapped, traced_dtype(declared), traced_dtype(mapped)}

    def _check_feeds(self, arrays: dict) -> None:
        """Feeds against the declared inputs: dtype, rank, fixed dims, and one size per symbolic dim
        name across all inputs. Raises TypeError / ValueError naming the input and the rule."""
        bound: dict[str, tuple[int, str]] = {}
        for name, arr in arrays.items():
            if isinstance(arr, ShapeOnly):
                continue
            dtype, dims = self._declared.get(name, (None, None))
            got = np.dtype(arr.dtype)
            if dtype is not None and not self._accepts(dtype, got):
                want = {str(dtype), str(self._interp.map_dtype(dtype))}
                raise TypeError(f"apply: input {name!r} has dtype {got}, but the model declares "
                                f"{' / '.join(sorted(want))} (cast it before the call: a silent "
                                f"conversion could change its values)")
            if dims is None:
                continue
            shape = tuple(arr.shape)
            if len(shape) != len(dims):
                raise ValueError(f"apply: input {name!r} has shape {list(shape)} (rank {len(shape)}), "
                                 f"but the model declares rank {len(dims)}: {list(dims)}")
            for axis, (have, want) in enumerate(zip(shape, dims)):
                if isinstance(want, int) and want > 0 and have != want:
                    raise ValueError(f"apply: input {name!r} has shape {list(shape)}, but the model "
                                     f"declares dim {axis} = {want} ({list(dims)})")
                if isinstance(want, str):
                    prev = bound.setdefault(want, (have, name))
                    if prev[0] != have:
                        raise ValueError(
                            f"apply: input {name!r} dim {axis} ({want!r}) is {have}, but input "
                            f"{prev[1]!r} has {want!r} = {prev[0]}: a symbolic dim has one size")

    def _prepare_input(self, name: str, value):
        if isinstance(value, ShapeOnly):
            return value  # a placeholder of the cache step: only Shape reads it
        if isinstance(value, Static):
            arr = value.value
        elif is_traced(value):
            if name in self.static_inputs:
                raise TypeError(
                    f"apply: input {name!r} sets a shape ({self.static_inputs[name]}), so its value "
                    f"must be known at trace time, but it is traced: under jax.jit pass it as "
                    f"jax_onnx_attn.onnx.Static(value) (one compile per distinct value), or call "
                    f"LoweredModel.jit()")
            arr = value
        else:
            arr = value if isinstance(value, jax.Array) else np.asarray(value)
        if np.dtype(arr.dtype).kind in "OSU":
            return np.asarray(arr)  # strings are host values (checked against the declared type)
        _check_jax_dtype(name, arr.dtype)
        mapped = self._interp.map_dtype(np.dtype(arr.dtype))
        if name in self.static_inputs and not is_traced(arr):
            # A shape-setting input stays NumPy, so the shapes it decides are static.
            arr = np.asarray(arr)
            return arr.astype(mapped) if mapped != arr.dtype else arr
        if mapped != arr.dtype:
            arr = arr.astype(mapped)
        # Other inputs are always traced (jax arrays): folding the graph on concrete input data
        # would run a different (NumPy) code path than the jitted one.
        return to_jax(arr)

    def run(self, params: Mapping, inputs: Mapping, hook: Hook | None = None,
            statuses: dict | None = None) -> dict:
        """`apply` with an optional node hook (used by the fixed-capacity cache step).

        Args:
          params: {initializer name: jax.Array} as in `params` (weights in their loaded dtype).
          inputs: {graph input name: array or ShapeOnly}, exactly `input_names`; shapes and dtypes
            as the graph declares them (`input_info`), e.g. input_ids int64 [B, S]. Floats of the
            model's float type are cast to `dtype`; int64 becomes int32 without jax_enable_x64.
          hook: hook(ctx, inputs) -> outputs or None, run before each node's handler (see
            `interpreter.Hook`); None runs the plain graph.
          statuses: a dict that receives {node label: int32 device status} from every node that can
            see a bad runtime value (see `apply_with_status`); None collects nothing.

        Returns:
          {output name: jax.Array} in `output_names` order (string outputs stay NumPy).
        """
        missing = [n for n in self.input_names if n not in inputs]
        extra = [n for n in inputs if n not in self.input_names]
        if missing or extra:
            raise ValueError(f"apply: inputs missing {missing}, unknown {extra}; the model's inputs "
                             f"are {self.input_names}")
        arrays = {n: (inputs[n].value if isinstance(inputs[n], Static) else
                      inputs[n] if hasattr(inputs[n], "dtype") or isinstance(inputs[n], ShapeOnly)
                      else np.asarray(inputs[n])) for n in self.input_names}
        self._check_feeds(arrays)
        env: dict = dict(self._constants)
        env.update(params)
        for name in self.input_names:
            env[name] = self._prepare_input(name, inputs[name])
        interp = self._interp if hook is None else Interpreter(self.model, self._float_map, hook,
                                                               self._options)
        interp.status_sink = statuses
        try:
            outs = interp.run_graph(self.model.graph, env)
        finally:
            interp.status_sink = None
        return {n: v if v is not None and np.dtype(v.dtype).kind in "OSU" else to_jax(v)
                for n, v in zip(self.output_names, outs)}

    def apply(self, params: Mapping, inputs: Mapping) -> dict:
        """Run the model: pure and jittable.

        Args:
          params: the `params` pytree (or one of the same structure, e.g. on another device).
          inputs: {graph input name: array}, every input of `input_names`. Floats of the model's
            float type are cast to `dtype`; int64 inputs become int32 unless jax_enable_x64 is on.

        Returns:
          {output name: jax.Array} in the model's declared order (`output_names`), also under
          `jax.jit`: an OrderedDict, whose order jax keeps (a plain dict comes out of jit with its
          keys sorted).

        Values that only the device sees are not checked here: jax's gather clamps an index out of
        range (a token id beyond the vocabulary reads the last row, where onnxruntime raises), and a
        GroupQueryAttention row whose seqlens_k does not fit its cache outputs 0 (onnxruntime
        raises). `apply_with_status` returns the device statuses that flag both;
        `checked_apply` raises on them.
        """
        return OrderedDict(self.run(params, inputs))

    __call__ = apply

    def apply_with_status(self, params: Mapping, inputs: Mapping):
        """`apply` plus the device statuses of every node that can see a bad runtime value: pure
        and jittable, nothing synchronises.

        Args:
          params, inputs: as in `apply`.

        Returns:
          (outputs as `apply` returns them, statuses): statuses is {node label: int32 array} with
          the flags of `jax_onnx_attn.ops.status` (0 = fine): "Gather 'name'" int32 [] per Gather
          with traced indices (INDEX_OUT_OF_RANGE: an index outside [-dim, dim) was clamped),
          "GroupQueryAttention 'name'" int32 [B] (KV_WRITE_OUT_OF_RANGE: the row's seqlens_k does not
          fit its cache, the row was not written and outputs 0; TOTAL_SEQUENCE_LENGTH_INVALID).
          Read them with `jax_onnx_attn.ops.status.check` / `describe`.
        """
        statuses: dict = {}
        outputs = OrderedDict(self.run(params, inputs, statuses=statuses))
        return outputs, statuses

    def checked_apply(self, params: Mapping, inputs: Mapping):
        """`apply` under `jit()` that raises RuntimeError (naming the node, batch row and problem)
        when a device status is set: the checked mode, onnxruntime's behaviour for out-of-range
        token ids and GroupQueryAttention lengths. It reads the statuses back to the host, so it
        synchronises once per call and cannot itself run under a jit.

        Args:
          params, inputs: as in `apply`.

        Returns:
          The outputs, as `apply` returns them.
        """
        from jax_onnx_attn.ops import status as st

        if self._checked is None:
            self._checked = self.jit(fn=self.apply_with_status)
        outputs, statuses = self._checked(params, inputs)
        st.check(statuses)
        return outputs

    @property
    def max_positions(self) -> int | None:
        """Positions the model supports: the fewest rows among the rotary cos tables (weights) of
        its GroupQueryAttention / RotaryEmbedding nodes, or None when it has none. A sequence
        longer than this has no rotary angles for its last positions."""
        rows = []
        for node in registry.iter_nodes(self.model.graph):
            if node.op_type == "GroupQueryAttention" and len(node.input) > 7:
                name = node.input[7]
            elif node.op_type == "RotaryEmbedding":
                name = node.input[2] if node.domain == registry.MS_DOMAIN else node.input[1]
            else:
                continue
            table = self.params.get(name) if name else None
            if table is None and name:
                table = self._constants.get(name)
            if table is not None and table.ndim == 2:
                rows.append(int(table.shape[0]))
        return min(rows) if rows else None

    @property
    def vocab_size(self) -> int | None:
        """Rows of the token embedding (the Gather reading graph input "input_ids" from a weight),
        or None when the model has no such Gather. Token ids must lie in [0, vocab_size)."""
        for node in self.model.graph.node:
            if node.op_type == "Gather" and len(node.input) == 2 and node.input[1] == "input_ids":
                table = self.params.get(node.input[0])
                if table is None:
                    table = self._constants.get(node.input[0])
                if table is not None and table.ndim >= 1:
                    return int(table.shape[0])
        return None

    def jit(self, fn=None, **jit_kwargs):
        """`jax.jit(apply)` that passes the `static_inputs` as `Static` values (one compile per
        distinct value of them) and traces every other input.

        Args:
          fn: the method to jit, `apply` (default) or `apply_with_status`.
          **jit_kwargs: passed to `jax.jit` (e.g. donate_argnums).

        Returns:
          fn(params, inputs) -> what `fn` returns ({output name: jax.Array} for apply).
        """
        jitted = jax.jit(fn or self.apply, **jit_kwargs)
        static = set(self.static_inputs)

        def call(params, inputs):
            # The feeds are checked here, on the host: inside the jit, jax has already turned
            # float64 / int64 arrays into 32-bit ones (without jax_enable_x64).
            self._check_feeds({k: v.value if isinstance(v, Static) else
                               v if hasattr(v, "dtype") else np.asarray(v)
                               for k, v in inputs.items() if k in self.input_names})
            return jitted(params, {k: Static(v) if k in static and not isinstance(v, Static) else v
                                   for k, v in inputs.items()})
        return call

    def fixed_cache_step(self, batch: int, capacity: int, **options):
        """A decode/prefill step over fixed-capacity KV buffers: see `FixedCacheStep` (options are
        its keyword arguments)."""
        from jax_onnx_attn.onnx.cache_step import FixedCacheStep
        return FixedCacheStep(self, batch, capacity, **options)


def read_model(path: str | os.PathLike, load_external_data: bool = True) -> onnx.ModelProto:
    """The ModelProto in the .onnx file `path`; errors name the file.

    Raises FileNotFoundError for a missing file and ValueError for an empty (0-byte), truncated or
    corrupt one.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"load: {str(path)!r} does not exist or is not a file")
    if path.stat().st_size == 0:
        raise ValueError(f"load: {str(path)!r} is empty (0 bytes): not an ONNX model")
    try:
        return onnx.load(str(path), load_external_data=load_external_data)
    except Exception as e:  # noqa: BLE001 - protobuf / IO errors differ by version
        raise ValueError(f"load: {str(path)!r} is not a readable ONNX model (truncated or corrupt "
                         f"file, or its external data is missing): {type(e).__name__}: {e}") from e


def check_model(model: onnx.ModelProto) -> None:
    """Structural rules the lowering relies on, checked at load (ValueError naming the value):
    a graph with at least one output; unique graph input and output names; every value produced
    once (no two nodes, inputs or initializers define one name); ai.onnx nodes within their schema's
    input and output counts."""
    graph = model.graph
    if not graph.output:
        raise ValueError(f"load: the model's graph {graph.name!r} has no outputs (an empty model?)")
    for what, names in (("input", [i.name for i in graph.input]),
                        ("output", [o.name for o in graph.output])):
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise ValueError(f"load: graph {what} name(s) {dup} appear more than once")
    init_names = {t.name for t in graph.initializer}
    defined = {i.name: "a graph input" for i in graph.input if i.name not in init_names}
    defined.update({n: "an initializer" for n in init_names})
    opsets = registry.model_opsets(model)
    for node in graph.node:
        label = f"node {node.name or node.op_type!r} ({node.op_type})"
        for o in node.output:
            if not o:
                continue
            if o in defined:
                raise ValueError(f"load: {label} outputs {o!r}, which {defined[o]} already defines "
                                 f"(every value must be produced once)")
            defined[o] = label
        domain = registry.normalize_domain(node.domain)
        if domain not in opsets:
            continue
        try:
            schema = onnx.defs.get_schema(node.op_type, max_inclusive_version=opsets[domain],
                                          domain=domain)
        except onnx.defs.SchemaError:
            continue
        n_in = len(node.input)
        if n_in > schema.max_input or sum(1 for i in node.input if i) < schema.min_input:
            raise ValueError(f"load: {label} has {n_in} inputs; {node.op_type}-"
                             f"{schema.since_version} takes {schema.min_input} to "
                             f"{schema.max_input}")
        if len(node.output) > schema.max_output:
            raise ValueError(f"load: {label} has {len(node.output)} outputs; {node.op_type}-"
                             f"{schema.since_version} has at most {schema.max_output}")


def load(model, dtype=None, *, base_dir: str | os.PathLike | None = None,
         int8_activations: bool = False, fuse: bool = True, nbits_layout: str = "onnx",
         decode_rows: int = 2, dense_layout: str = "nk", qkv_prepare: bool = False,
         gated_mlp: bool = False, out_mlp: bool = False) -> LoweredModel:
    """Lower an ONNX model to JAX.

    Args:
      model: a path to a .onnx file (external data next to it is read) or to an export folder
        holding one (`onnx.files.model_file` says which), or a ModelProto (external
        data is read from `base_dir` when the proto does not carry it yet).
      dtype: None keeps the model's types; a float dtype (e.g. jnp.bfloat16) replaces the model's
        float type (the dtype of most weight bytes) everywhere: weights, constants, casts, inputs.
        Norms, softmax and attention still accumulate in float32.
      base_dir: where external data lives for a ModelProto argument.
      int8_activations: False computes com.microsoft MatMulNBits as the exact product with the
        dequantised weight. True reproduces onnxruntime's CPU kernel at accuracy_level=4 (the
        builder's default for int4/int8): per block of block_size along K, the activation is
        quantised to int8 (symmetric, scale max|A|/127, round half to even) before the product.
        Nodes with another accuracy_level are computed exactly either way.
      fuse: rewrite the graph once into the lowering's fused nodes (`onnx.fusion`: projections on
        `ops.linear` / `ops.matmul_nbits` with their weights stored in the kernels' layouts, the
        SwiGLU, residual adds and RMSNorms folded into them). The math is the graph's; False
        runs the graph node by node as written.
      nbits_layout: with fuse, "onnx", "rows": 4-bit MatMulNBits weights in the rows kernel's
        layout, for decode steps of decode_rows (2..32) rows of x, or "record": in the record
        layout of the slots kernel, for decode steps of one row (`onnx.fusion.fuse_decoder`);
        same results.
      dense_layout: with fuse, "nk" (dense projection weights [N, K], the kernels' layout) or
        "kn" (ONNX's [K, N], read by XLA's GEMM only: for sessions of 2+ rows,
        `runtime.session.dense_layout_for`); results within the dtype's rounding.
      qkv_prepare: with fuse, GroupQueryAttention's packed QKV projections in the rotary-pair order
        (`onnx.fusion` pass 5), for decode steps of one row: the CUDA route then computes each
        projection and its step preparation in one launch; same results.
      gated_mlp: with fuse, dense gated MLPs as one node (`onnx.fusion` pass 4b), for decode steps
        of one row: the CUDA route runs each as one kernel (`ops.gated_mlp`: its K split within the
        dtype's rounding of the two projections, its N split their bits).
      out_mlp: with gated_mlp, each fused MLP and the attention output projection before it as one
        node (`onnx.fusion` pass 4c), for decode steps of one row: the CUDA route runs them as one
        kernel (`ops.out_mlp`: the separate one-row kernels' bits).

    Returns:
      LoweredModel (`params`, `apply`, `fixed_cache_step`, `input_names`, `output_names`, `model`).

    Raises:
      UnsupportedOpsError: listing every (domain, op_type, since_version) without a handler.
    """
    if isinstance(model, (str, os.PathLike)):
        path = model_file(model)
        # External data is read straight into NumPy (memory-mapped), not through the proto: a
        # multi-GB model is then held once on the host, not twice.
        model = read_model(path, load_external_data=False)
        base_dir = path.parent
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"load: expected a path or an onnx.ModelProto, got {type(model).__name__}")
    check_model(model)
    if model.functions:
        # Model-local functions (onnxscript/torch exports may carry them) become plain nodes.
        model = onnx.inliner.inline_local_functions(model)
    registry.check_coverage(model)

    arrays = {}
    for t in (t for g in registry.iter_graphs(model.graph) for t in g.initializer):
        arrays[t.name] = tensor_to_numpy(t, None if base_dir is None else str(base_dir))
    float_type = _primary_float(a for a in arrays.values() if not _is_static_initializer(a))
    float_map = {}
    if dtype is not None and float_type is not None:
        float_map[float_type] = np.dtype(dtype)
    fusions = None
    if fuse:
        model, arrays, fusions = fuse_decoder(model, arrays, nbits=not int8_activations,
                                              nbits_layout=nbits_layout, decode_rows=decode_rows,
                                              float_map=float_map, dense_layout=dense_layout,
                                              qkv_prepare=qkv_prepare, gated_mlp=gated_mlp, out_mlp=out_mlp)
    params, constants = {}, {}
    for name, arr in arrays.items():
        if _is_static_initializer(arr):
            constants[name] = arr
        else:
            if arr.dtype in float_map:
                arr = arr.astype(float_map[arr.dtype])
            params[name] = to_jax(arr)
    lowered = LoweredModel(model, params, constants, float_map, float_type,
                           {"int8_activations": bool(int8_activations)})
    lowered.fusions = fusions
    return lowered
