"""Where a DecoderSession's arrays live on a device mesh (tensor and data parallelism).

A mesh has a "model" axis (tensor parallelism: the weights split Megatron-style, the attention
and the KV cache by heads; `onnx.sharding`) and optionally a "data" axis (the batch rows split).
One process drives every device of the mesh; across hosts the same code runs in every process
after `jax.distributed.initialize()` (docs/multi_gpu.md).

    mesh = make_mesh(2)                       # 2 devices on the model axis
    session = DecoderSession(path, max_length=4096, mesh=mesh)
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jax_onnx_attn.onnx.sharding import TensorParallelPlan, plan_tensor_parallel

MODEL_AXIS, DATA_AXIS = "model", "data"


def make_mesh(devices: int | Sequence | None = None, *, data: int = 1) -> Mesh:
    """A (data, model) mesh.

    Args:
      devices: how many of `jax.devices()` to use (the first ones), or the devices themselves;
        None: all of them.
      data: devices along the data (batch) axis; the rest, devices / data, form the model axis.

    Raises ValueError when the count does not split into data x model, or asks for more devices
    than jax sees.
    """
    available = jax.devices()
    if devices is None:
        devices = available
    elif isinstance(devices, int):
        if not 1 <= devices <= len(available):
            raise ValueError(f"make_mesh: {devices} devices asked for, jax sees {len(available)} "
                             f"({available[0].platform})")
        devices = available[:devices]
    devices = list(devices)
    if data < 1 or len(devices) % data:
        raise ValueError(f"make_mesh: {len(devices)} devices do not split into data={data} rows")
    return Mesh(np.array(devices).reshape(data, len(devices) // data), (DATA_AXIS, MODEL_AXIS))


class MeshLayout:
    """The shardings of one session's arrays on `mesh`.

    Args:
      mesh: a jax Mesh whose axes are "model" and / or "data" (others must have size 1).
      lowered: the session's LoweredModel (its projections are placed by `plan_tensor_parallel`).
      batch: the session's rows per call (a multiple of the data axis).
      logits_name: the output holding the logits (its projection splits by vocabulary).

    Attributes:
      plan: the tensor-parallel plan (`onnx.sharding.TensorParallelPlan`).
      model, data: the sizes of the two axes (1 where the mesh lacks one).
    """

    def __init__(self, mesh: Mesh, lowered, batch: int, logits_name: str | None = None):
        if not isinstance(mesh, Mesh):
            raise TypeError(f"mesh must be a jax.sharding.Mesh, got {type(mesh).__name__}")
        extra = [a for a in mesh.axis_names if a not in (MODEL_AXIS, DATA_AXIS) and mesh.shape[a] > 1]
        if extra:
            raise ValueError(f"mesh axes {extra} are neither {MODEL_AXIS!r} (tensor parallel) nor "
                             f"{DATA_AXIS!r} (batch); name the mesh's axes so (see make_mesh)")
        self.mesh = mesh
        self.model = int(mesh.shape.get(MODEL_AXIS, 1))
        self.data = int(mesh.shape.get(DATA_AXIS, 1))
        if batch % self.data:
            raise ValueError(f"batch {batch} does not split over the mesh's {DATA_AXIS!r} axis of "
                             f"{self.data} devices (make the batch a multiple of it)")
        self._model = MODEL_AXIS if self.model > 1 else None
        self._data = DATA_AXIS if self.data > 1 else None
        self.plan: TensorParallelPlan = plan_tensor_parallel(lowered, self.model, logits_name)

    def sharding(self, spec: PartitionSpec) -> NamedSharding:
        """spec on this layout's mesh."""
        return NamedSharding(self.mesh, spec)

    # -- weights ----------------------------------------------------------------------------------
    def param_spec(self, name: str, ndim: int) -> PartitionSpec:
        """A weight's spec: split along its plan axis over the model axis, else whole."""
        split = self.plan.splits.get(name)
        if split is None or self._model is None:
            return PartitionSpec()
        return PartitionSpec(*([None] * split.axis + [self._model]))

    def place_params(self, params: dict) -> dict:
        """The params on the mesh: packed QKV rows regrouped (plan.prepare), each weight put with
        its spec. Each device gets its piece from the host value (every process reads its own
        devices' pieces: the same code on every host)."""
        prepared = self.plan.prepare({name: np.asarray(x) for name, x in params.items()})
        placed = {}
        for name, host in prepared.items():
            sharding = self.sharding(self.param_spec(name, host.ndim))
            placed[name] = jax.make_array_from_callback(host.shape, sharding,
                                                        lambda index, h=host: h[index])
        return placed

    # -- the cache and per-row state -------------------------------------------------------------
    def cache_spec(self, shape) -> PartitionSpec:
        """A KV buffer [B, Hkv, C, D]: batch over data, KV heads over model."""
        if self._model is not None and shape[1] % self.model:
            raise ValueError(f"a KV cache of {shape[1]} KV heads does not split over the mesh's "
                             f"{MODEL_AXIS!r} axis of {self.model} devices (the attention splits "
                             f"by KV heads): use a model axis that divides {shape[1]}")
        return PartitionSpec(self._data, self._model)

    def cache_shardings(self, cache_shapes: dict) -> dict:
        """{past name: NamedSharding} of the buffers (`FixedCacheStep.cache_shapes`)."""
        return {name: self.sharding(self.cache_spec(shape))
                for name, (shape, _) in cache_shapes.items()}

    def rows(self, ndim: int) -> NamedSharding:
        """An array whose leading axis is the batch rows: split over data."""
        return self.sharding(PartitionSpec(self._data) if ndim else PartitionSpec())

    def whole(self) -> NamedSharding:
        """Whole on every device of the mesh."""
        return self.sharding(PartitionSpec())

    def describe(self) -> str:
        """One line: the mesh and what splits."""
        counts = self.plan.counts()
        roles = ", ".join(f"{n} {r}" for r, n in sorted(counts.items())) or "none"
        return (f"mesh {dict(self.mesh.shape)} ({self.mesh.devices.size} "
                f"{self.mesh.devices.flat[0].platform} devices): projections split: {roles}; "
                f"KV cache by heads")


__all__ = ["make_mesh", "MeshLayout", "MODEL_AXIS", "DATA_AXIS"]
