"""What flows along the edges of a graph at trace time, and the dtype rules for it.

A value is one of
  * a NumPy array: known at trace time (initializers kept static, Constant nodes, shape arithmetic).
    Ops whose inputs are all NumPy compute in NumPy, so Reshape / Slice / Expand / Range see
    concrete shapes and the traced program has static shapes;
  * a jax.Array (a tracer under jit): everything that depends on the model's inputs or weights;
  * `ShapeOnly`: a placeholder that has a shape and dtype but no data, for graph inputs whose data
    the fixed-capacity cache step replaces (Shape may read it; any other use is an error);
  * None: an omitted optional input.

Integer tensors follow ONNX (int64) while static; traced ones follow JAX's canonical dtypes, so int64
becomes int32 unless jax_enable_x64 is on (static int64 values are clipped into int32 range when they
enter a traced computation, which is what INT64_MAX-style sentinels need).
"""

from __future__ import annotations

import os
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import onnx
from onnx import helper, numpy_helper


class ShapeOnly:
    """A graph value whose shape and dtype are known but whose data is deliberately absent."""

    def __init__(self, shape, dtype, why: str):
        self.shape = tuple(int(s) for s in shape)
        self.dtype = np.dtype(dtype)
        self.ndim = len(self.shape)
        self.why = why

    def __repr__(self) -> str:
        return f"ShapeOnly({self.shape}, {self.dtype}, {self.why!r})"


class Static:
    """A graph input passed by value: static under `jax.jit`, one compile per distinct value.

    Inputs that set shapes (a Reshape's shape, Slice's starts, TopK's k, ...: the model's
    `LoweredModel.static_inputs`) must be known at trace time. Wrap them in Static to pass them
    through `jax.jit(lowered.apply)`: Static is a pytree without leaves whose value is part of the
    tree's structure, so jit hashes it and retraces when it changes. Unjitted, a NumPy array works
    as well.

    Args:
      value: any array-like (NumPy array or scalar, a concrete jax array, a list); kept as NumPy.
    """

    __slots__ = ("value", "_key")

    def __init__(self, value):
        if isinstance(value, Static):
            value = value.value
        arr = np.asarray(value)  # a tracer fails here: a Static needs a concrete value
        arr.setflags(write=False)
        self.value = arr
        self._key = (arr.dtype.str, arr.shape, arr.tobytes())

    def __hash__(self) -> int:
        return hash(self._key)

    def __eq__(self, other) -> bool:
        return isinstance(other, Static) and self._key == other._key

    def __repr__(self) -> str:
        return f"Static({self.value!r})"


jax.tree_util.register_pytree_node(Static, lambda s: ((), s), lambda aux, _: aux)


def is_static(v: Any) -> bool:
    """True for values known at trace time (NumPy arrays / scalars).

    Args:
      v: a graph value: NumPy array or scalar (any shape/dtype) -> True; jax.Array / tracer,
        `ShapeOnly` or None -> False.
    """
    return isinstance(v, (np.ndarray, np.generic))


try:  # the public name (jax 0.10 - 0.12); the private one if a later jax drops it
    _TRACER = jax.core.Tracer
except AttributeError:  # pragma: no cover
    from jax._src.core import Tracer as _TRACER


def is_traced(v: Any) -> bool:
    """True for a tracer (a value inside jax.jit / vmap / grad whose data is not known yet)."""
    return isinstance(v, _TRACER)


def np_dtype(elem_type: int) -> np.dtype:
    """numpy dtype of an ONNX TensorProto elem type (bfloat16 / float8 via ml_dtypes)."""
    if elem_type == onnx.TensorProto.BFLOAT16:
        return np.dtype(ml_dtypes.bfloat16)
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def traced_dtype(dtype) -> np.dtype:
    """The dtype a traced value of `dtype` has in JAX (int64 -> int32 without x64)."""
    return np.dtype(jax.dtypes.canonicalize_dtype(np.dtype(dtype)))


def to_jax(v):
    """A value as a jax array, clipping static 64-bit integers into the traced integer range.

    Args:
      v: a graph value: NumPy array/scalar (any shape and dtype), jax.Array or None.

    Returns:
      A jax.Array of v's shape in `traced_dtype(v.dtype)` (int64 -> int32 without x64; other
      dtypes unchanged), v itself for a jax.Array, None for None. Raises TypeError for `ShapeOnly`.
    """
    if v is None or isinstance(v, jax.Array):
        return v
    if isinstance(v, ShapeOnly):
        raise TypeError(f"{v} has no data; it can only be read by Shape")
    arr = np.asarray(v)
    target = traced_dtype(arr.dtype)
    if arr.dtype != target and np.issubdtype(arr.dtype, np.integer):
        info = np.iinfo(target)
        arr = np.clip(arr, info.min, info.max).astype(target)
    return jnp.asarray(arr)


def _external_memmap(t: onnx.TensorProto, base_dir: str) -> np.ndarray | None:
    """A tensor stored in an external data file as a read-only memory map of that file, or None for
    element types NumPy cannot map directly (the caller then reads it through onnx)."""
    info = {e.key: e.value for e in t.external_data}
    dtype = {onnx.TensorProto.BFLOAT16: np.dtype(np.uint16)}.get(t.data_type)
    if dtype is None:
        try:
            dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type))
        except (KeyError, TypeError, ValueError):
            return None
    if dtype.kind not in "fiub" or "location" not in info:
        return None
    shape = tuple(int(d) for d in t.dims)
    count = int(np.prod(shape, dtype=np.int64))
    offset = int(info.get("offset", 0))
    length = int(info.get("length", count * dtype.itemsize))
    if length < count * dtype.itemsize:
        raise ValueError(f"initializer {t.name!r}: its external data holds {length} bytes, its shape "
                         f"{list(shape)} needs {count * dtype.itemsize}")
    path = os.path.join(base_dir, info["location"])
    if count == 0:
        return np.zeros(shape, dtype)
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape)


def tensor_to_numpy(t: onnx.TensorProto, base_dir: str | None = None) -> np.ndarray:
    """A TensorProto as NumPy (external data read from base_dir when not loaded yet: memory-mapped
    from its file, so the weights are not copied into the proto first)."""
    arr = None
    if base_dir is not None and onnx.external_data_helper.uses_external_data(t):
        arr = _external_memmap(t, base_dir)
        if arr is None:
            onnx.external_data_helper.load_external_data_for_tensor(t, base_dir)
    if arr is None:
        arr = numpy_helper.to_array(t)
    if t.data_type == onnx.TensorProto.BFLOAT16 and arr.dtype != ml_dtypes.bfloat16:
        arr = arr.view(ml_dtypes.bfloat16)
    return arr


def attribute_value(attr: onnx.AttributeProto):
    """An attribute as a Python value: ints/floats/str, lists, NumPy (tensors), GraphProto."""
    if attr.type == onnx.AttributeProto.TENSOR:
        return tensor_to_numpy(attr.t)
    if attr.type == onnx.AttributeProto.TENSORS:
        return [tensor_to_numpy(t) for t in attr.tensors]
    v = helper.get_attribute_value(attr)
    if isinstance(v, bytes):
        return v.decode()
    if isinstance(v, list) and v and isinstance(v[0], bytes):
        return [s.decode() for s in v]
    return v
