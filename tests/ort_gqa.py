"""Single-node com.microsoft::GroupQueryAttention models built with onnx.helper, run on onnxruntime CPU.

The oracle of the GQA parity tests. `run_ort(inputs, **attributes)` takes the operator's inputs by
their ONNX names (NumPy arrays; None or absent = not given) and returns its outputs by name.
`shared_buffer=True` binds past_key/past_value and present_key/present_value to the same OrtValue
through IOBinding, which is how onnxruntime recognises a fixed-capacity (shared) KV cache.
"""

from __future__ import annotations

import functools

import numpy as np
import onnx
from onnx import TensorProto, helper

INPUTS = ("query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length",
          "cos_cache", "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale",
          "v_scale", "q_norm_weight", "k_norm_weight")
OUTPUTS = ("output", "present_key", "present_value", "output_qk")

_ELEM = {np.dtype(np.float32): TensorProto.FLOAT, np.dtype(np.float16): TensorProto.FLOAT16,
         np.dtype(np.int32): TensorProto.INT32, np.dtype(np.int64): TensorProto.INT64,
         np.dtype(np.int8): TensorProto.INT8, np.dtype(np.uint8): TensorProto.UINT8}


def _model_bytes(signature: tuple, attributes: tuple) -> bytes:
    """signature: ((name, dtype str, shape), ...) of the given inputs; attributes: sorted items."""
    given = {name: (np.dtype(dt), shape) for name, dt, shape in signature}
    last = max(INPUTS.index(name) for name in given)
    node_inputs = [name if name in given else "" for name in INPUTS[:last + 1]]
    attrs = dict(attributes)
    t = given["query"][0]
    cache_t = given["past_key"][0] if "past_key" in given else t
    out_types = {"output": t, "present_key": cache_t, "present_value": cache_t, "output_qk": t}
    outputs = list(OUTPUTS if attrs.get("qk_output", 0) else OUTPUTS[:3])
    node = helper.make_node("GroupQueryAttention", node_inputs, outputs, domain="com.microsoft",
                            **attrs)
    graph = helper.make_graph(
        [node], "gqa",
        [helper.make_tensor_value_info(n, _ELEM[dt], list(shape)) for n, (dt, shape) in given.items()],
        [helper.make_tensor_value_info(n, _ELEM[out_types[n]], None) for n in outputs])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    model.ir_version = 10
    return model.SerializeToString()


@functools.lru_cache(maxsize=256)
def _session(model: bytes):
    import onnxruntime as ort
    options = ort.SessionOptions()
    # Small single-node models: one intra-op thread keeps CI on 2 shared cores predictable.
    options.intra_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    # Rejections are expected in the error tests; the exception carries the message, not the log.
    options.log_severity_level = 4
    return ort.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def run_ort(inputs: dict, *, shared_buffer: bool = False, **attributes) -> dict:
    """Run one GroupQueryAttention node on onnxruntime CPU.

    Args:
      inputs: ONNX input name -> NumPy array (None = not given). total_sequence_length may be an int.
      shared_buffer: bind past and present KV to one buffer (fixed-capacity cache) via IOBinding.
      attributes: the node's attributes (num_heads, kv_num_heads, ...).

    Returns:
      output name -> NumPy array. Raises onnxruntime's exception where it rejects the node.
    """
    feeds = {}
    for name, value in inputs.items():
        if value is None:
            continue
        if name not in INPUTS:
            raise KeyError(name)
        if name == "total_sequence_length":
            value = np.asarray(value, np.int32)
        feeds[name] = np.ascontiguousarray(value)
    signature = tuple((n, str(feeds[n].dtype), feeds[n].shape) for n in INPUTS if n in feeds)
    attributes = {k: v for k, v in attributes.items() if v is not None}
    sess = _session(_model_bytes(signature, tuple(sorted(attributes.items()))))
    names = [o.name for o in sess.get_outputs()]
    if not shared_buffer:
        return dict(zip(names, sess.run(None, feeds)))
    import onnxruntime as ort
    binding = sess.io_binding()
    shared = {}
    for name, value in feeds.items():
        if name in ("past_key", "past_value"):
            # The copy is ours: onnxruntime writes the present rows into it.
            shared[name] = ort.OrtValue.ortvalue_from_numpy(value.copy())
            binding.bind_ortvalue_input(name, shared[name])
        else:
            binding.bind_cpu_input(name, value)
    for name in names:
        past = name.replace("present", "past")
        if past in shared:
            binding.bind_ortvalue_output(name, shared[past])
        else:
            binding.bind_output(name)
    sess.run_with_iobinding(binding)
    return dict(zip(names, binding.copy_outputs_to_cpu()))


def ort_error(inputs: dict, **attributes) -> str | None:
    """onnxruntime's error message for these inputs, or None when it runs."""
    try:
        run_ort(inputs, **attributes)
    except Exception as e:  # onnxruntime raises its own exception types (Fail, InvalidArgument, ...)
        return str(e)
    return None


def check_model(inputs: dict, **attributes) -> None:
    """onnx.checker on the model these inputs would build (used once in the tests)."""
    feeds = {k: np.asarray(v, np.int32) if k == "total_sequence_length" else np.asarray(v)
             for k, v in inputs.items() if v is not None}
    signature = tuple((n, str(feeds[n].dtype), feeds[n].shape) for n in INPUTS if n in feeds)
    onnx.checker.check_model(onnx.load_from_string(
        _model_bytes(signature, tuple(sorted(attributes.items())))))
