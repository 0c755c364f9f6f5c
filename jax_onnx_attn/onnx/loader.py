"""`load`: an ONNX model as a params pytree and a pure, jittable `apply(params, inputs)`."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Mapping

import jax
import numpy as np
import onnx
import onnx.inliner

from jax_onnx_attn.onnx import handlers as _handlers  # noqa: F401  (registers every handler)
from jax_onnx_attn.onnx import registry
from jax_onnx_attn.onnx.files import model_file
from jax_onnx_attn.onnx.fusion import fuse_decoder
from jax_onnx_attn.onnx.interpreter import Hook, Interpreter
from jax_onnx_attn.onnx.values import ShapeOnly, np_dtype, tensor_to_numpy, to_jax
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
    def _prepare_input(self, value):
        if isinstance(value, ShapeOnly):
            return value  # a placeholder of the cache step: only Shape reads it
        arr = value if isinstance(value, jax.Array) else np.asarray(value)
        mapped = self._interp.map_dtype(np.dtype(arr.dtype))
        if mapped != arr.dtype:
            arr = arr.astype(mapped)
        # Inputs are always traced (jax arrays): folding the graph on concrete input data would run
        # a different (NumPy) code path than the jitted one.
        return to_jax(arr)

    def run(self, params: Mapping, inputs: Mapping, hook: Hook | None = None) -> dict:
        """`apply` with an optional node hook (used by the fixed-capacity cache step).

        Args:
          params: {initializer name: jax.Array} as in `params` (weights in their loaded dtype).
          inputs: {graph input name: array or ShapeOnly}, exactly `input_names`; shapes and dtypes
            as the graph declares them (`input_info`), e.g. input_ids int64 [B, S]. Floats of the
            model's float type are cast to `dtype`; int64 becomes int32 without jax_enable_x64.
          hook: hook(ctx, inputs) -> outputs or None, run before each node's handler (see
            `interpreter.Hook`); None runs the plain graph.

        Returns:
          {output name: jax.Array} in `output_names` order.
        """
        missing = [n for n in self.input_names if n not in inputs]
        extra = [n for n in inputs if n not in self.input_names]
        if missing or extra:
            raise ValueError(f"apply: inputs missing {missing}, unknown {extra}; the model's inputs "
                             f"are {self.input_names}")
        env: dict = dict(self._constants)
        env.update(params)
        for name in self.input_names:
            env[name] = self._prepare_input(inputs[name])
        interp = self._interp if hook is None else Interpreter(self.model, self._float_map, hook,
                                                               self._options)
        outs = interp.run_graph(self.model.graph, env)
        return {n: to_jax(v) for n, v in zip(self.output_names, outs)}

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
        """
        return OrderedDict(self.run(params, inputs))

    __call__ = apply

    def fixed_cache_step(self, batch: int, capacity: int):
        """A decode/prefill step over fixed-capacity KV buffers: see `FixedCacheStep`."""
        from jax_onnx_attn.onnx.cache_step import FixedCacheStep
        return FixedCacheStep(self, batch, capacity)


def load(model, dtype=None, *, base_dir: str | os.PathLike | None = None,
         int8_activations: bool = False, fuse: bool = True) -> LoweredModel:
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

    Returns:
      LoweredModel (`params`, `apply`, `fixed_cache_step`, `input_names`, `output_names`, `model`).

    Raises:
      UnsupportedOpsError: listing every (domain, op_type, since_version) without a handler.
    """
    if isinstance(model, (str, os.PathLike)):
        path = model_file(model)
        # External data is read straight into NumPy (memory-mapped), not through the proto: a
        # multi-GB model is then held once on the host, not twice.
        model = onnx.load(str(path), load_external_data=False)
        base_dir = path.parent
    elif not isinstance(model, onnx.ModelProto):
        raise TypeError(f"load: expected a path or an onnx.ModelProto, got {type(model).__name__}")
    if model.functions:
        # Model-local functions (onnxscript/torch exports may carry them) become plain nodes.
        model = onnx.inliner.inline_local_functions(model)
    registry.check_coverage(model)

    arrays = {}
    for t in (t for g in registry.iter_graphs(model.graph) for t in g.initializer):
        arrays[t.name] = tensor_to_numpy(t, None if base_dir is None else str(base_dir))
    float_type = _primary_float(a for a in arrays.values() if not _is_static_initializer(a))
    fusions = None
    if fuse:
        model, arrays, fusions = fuse_decoder(model, arrays, nbits=not int8_activations)
    float_map = {}
    if dtype is not None and float_type is not None:
        float_map[float_type] = np.dtype(dtype)
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
