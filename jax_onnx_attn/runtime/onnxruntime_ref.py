"""onnxruntime (CPU) as the oracle for decoder models with the builder's I/O convention.

Inputs `input_ids` [B, S], optional `attention_mask` [B, total] and `position_ids` [B, S],
`past_key_values.N.key/value` [B, kv_heads, past, head_size]; outputs `logits` [B, S, V] and
`present.N.key/value`. One sequence (batch 1) at a time, the cache grown by onnxruntime itself
(present fed back as past), with no padding: the plainest way to run the model.

Two departures from running the file as it is, both the op's math rather than an onnxruntime
setting:
  * MatMulNBits runs at accuracy_level 0 (exact dequantised weights) by default: the builder's
    level 4 quantises activations to int8 on CPU, a speed choice (`load(int8_activations=True)`
    models it; `OrtDecoder(..., accuracy_level=None)` keeps the file's level).
  * A model whose GroupQueryAttention keeps a window-sized cache (sliding_window_cache=1, the
    builder's Gemma-2) cannot grow its past from 0 rows: it runs as onnxruntime-genai 0.18 runs it
    on CPU, every past bound to its present (IOBinding) in buffers of the sequence's length, the
    windowed layers' of min(window + slack, length) rows (slack: genai_config.json's cache_slack,
    else genai's CPU default 16), where GQA evicts.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32}


#: onnxruntime-genai's CPU default for the extra rows of a sliding-window layer's cache.
GENAI_CPU_WINDOW_SLACK = 16


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("onnxruntime is needed as the parity oracle: pip install onnxruntime") from e
    return onnxruntime


def _static_width(graph: onnx.GraphProto, name: str, depth: int = 8) -> int | None:
    """The last dimension of value `name` where the graph fixes it: an initializer, a MatMul by an
    initializer, MatMulNBits (its N), elementwise ops and casts of such a value; else None."""
    inits = {t.name: t for t in graph.initializer}
    producers = {o: n for n in graph.node for o in n.output if o}
    for _ in range(depth):
        if name in inits:
            dims = inits[name].dims
            return int(dims[-1]) if dims else None
        node = producers.get(name)
        if node is None:
            return None
        if node.op_type == "MatMulNBits":
            return next((int(a.i) for a in node.attribute if a.name == "N"), None)
        if node.op_type == "MatMul" and node.input[1] in inits:
            name = node.input[1]
        elif node.op_type in ("Add", "Sub", "Mul") and len(node.input) == 2:
            # A bias or scale initializer of the full width, else the other operand.
            bias = next((i for i in node.input if i in inits and len(inits[i].dims) >= 1
                         and inits[i].dims[-1] > 1), None)
            name = bias or node.input[0]
        elif node.op_type in ("Cast", "Identity"):
            name = node.input[0]
        else:
            return None
    return None


def _inferred_kv_dims(model: str | os.PathLike | onnx.ModelProto) -> dict[str, tuple[int, int]]:
    """{past input: (kv_heads, head_size)} for past inputs whose shape the model leaves symbolic.

    From each com.microsoft GroupQueryAttention node: kv_num_heads, and head_size = the static
    width of its key / kv_num_heads, or of its packed query / (num_heads + 2 kv_num_heads). Failing
    that, from onnxruntime-genai's genai_config.json beside a model file (decoder.head_size,
    decoder.num_key_value_heads).
    """
    proto = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model),
                                                                      load_external_data=False)
    found: dict[str, tuple[int, int]] = {}
    for node in proto.graph.node:
        if node.op_type != "GroupQueryAttention":
            continue
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        n, hkv = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
        ins = list(node.input) + [""] * 5
        if ins[1]:
            width, heads = _static_width(proto.graph, ins[1]), hkv
        else:
            width, heads = _static_width(proto.graph, ins[0]), n + 2 * hkv
        if width and width % heads == 0:
            for past in ins[3:5]:
                if past:
                    found[past] = (hkv, width // heads)
    if not isinstance(model, onnx.ModelProto):
        config = Path(os.fspath(model)).parent / "genai_config.json"
        if config.exists():
            decoder = json.loads(config.read_text()).get("model", {}).get("decoder", {})
            if "head_size" in decoder and "num_key_value_heads" in decoder:
                dims = (int(decoder["num_key_value_heads"]), int(decoder["head_size"]))
                for i in proto.graph.input:
                    if _PAST.match(i.name):
                        found.setdefault(i.name, dims)
    return found


class OrtDecoder:
    """A decoder model in an onnxruntime CPU session.

    Args:
      model: a path (external data beside it is found) or an onnx.ModelProto.
      providers: onnxruntime execution providers.
      accuracy_level: the accuracy_level every MatMulNBits runs at (0: exact dequantised weights,
        the default); None keeps the model's.
    """

    def __init__(self, model: str | os.PathLike | onnx.ModelProto,
                 providers: Sequence[str] = ("CPUExecutionProvider",), *,
                 accuracy_level: int | None = 0):
        ort = _import_onnxruntime()
        options = ort.SessionOptions()
        options.log_severity_level = 3  # keep the oracle quiet about graph-optimisation notes
        proto = model if isinstance(model, onnx.ModelProto) else onnx.load(os.fspath(model),
                                                                          load_external_data=False)
        levels = [a for n in proto.graph.node if n.op_type == "MatMulNBits"
                  for a in n.attribute if a.name == "accuracy_level"]
        if accuracy_level is not None and any(a.i != accuracy_level for a in levels):
            if not isinstance(model, onnx.ModelProto):
                proto = onnx.load(os.fspath(model), load_external_data=False)  # a copy to edit
                options.add_session_config_entry(
                    "session.model_external_initializers_file_folder_path",
                    str(Path(os.fspath(model)).resolve().parent))
            else:
                proto = onnx.ModelProto.FromString(model.SerializeToString())
            for node in proto.graph.node:
                for a in node.attribute:
                    if node.op_type == "MatMulNBits" and a.name == "accuracy_level":
                        a.i = accuracy_level
            src = proto.SerializeToString()
        else:
            src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else os.fspath(model)
        self.session = ort.InferenceSession(src, options, providers=list(providers))
        #: {past input: window} of the GQA layers with a window-sized cache (sliding_window_cache=1).
        self._windows: dict[str, int] = {}
        for node in proto.graph.node:
            if node.op_type == "GroupQueryAttention":
                attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
                if attrs.get("sliding_window_cache", 0) == 1:
                    for past in list(node.input)[3:5]:
                        if past:
                            self._windows[past] = int(attrs["local_window_size"])
        slack = 0
        if self._windows and not isinstance(model, onnx.ModelProto):
            config = Path(os.fspath(model)).parent / "genai_config.json"
            if config.exists():
                decoder = json.loads(config.read_text()).get("model", {}).get("decoder", {})
                slack = int(decoder.get("sliding_window", {}).get("cache_slack", 0) or 0)
        self._window_slack = slack or GENAI_CPU_WINDOW_SLACK
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "input_ids" not in inputs:
            raise ValueError(f"the model has no `input_ids` input (inputs: {sorted(inputs)}); only "
                             "decoders with the onnxruntime-genai builder's I/O names are supported")
        self._ids_dtype = _ORT_TYPES.get(inputs["input_ids"].type, np.int64)
        self._mask = inputs.get("attention_mask")
        self._position_ids = inputs.get("position_ids")
        self._past: dict[str, tuple[int, int, type]] = {}
        inferred = None
        for name, info in inputs.items():
            if _PAST.match(name):
                kv_heads, head_size = info.shape[1], info.shape[3]
                if not (isinstance(kv_heads, int) and isinstance(head_size, int)):
                    # The builder declares head_size as the symbol `kv_cache_dim`.
                    if inferred is None:
                        inferred = _inferred_kv_dims(model)
                    if name not in inferred:
                        raise ValueError(
                            f"{name} has shape {info.shape}: kv_heads and head_size (dims 1, 3) are "
                            "not fixed numbers, and neither the GroupQueryAttention node it feeds nor "
                            "a genai_config.json beside the model gives them")
                    kv_heads, head_size = inferred[name]
                self._past[name] = (kv_heads, head_size, _ORT_TYPES[info.type])
        other = set(inputs) - set(self._past) - {"input_ids", "attention_mask", "position_ids"}
        if other:
            raise ValueError(f"unsupported decoder inputs {sorted(other)}")
        outputs = {o.name: o for o in self.session.get_outputs()}
        if "logits" not in outputs:
            raise ValueError(f"the model has no `logits` output (outputs: {sorted(outputs)})")
        self._outputs = list(outputs)
        #: dtype of the model's logits (results are returned as float32).
        self.logits_dtype = np.dtype(_ORT_TYPES.get(outputs["logits"].type, np.float32))

    def _empty_past(self, length: int) -> dict:
        """The cache before the first call of a sequence of `length` tokens: empty pasts, or (for a
        window-sized GQA cache) zeroed shared buffers (OrtValues) of onnxruntime-genai's sizes."""
        if not self._windows:
            return {n: np.zeros((1, h, 0, d), dt) for n, (h, d, dt) in self._past.items()}
        ort = _import_onnxruntime()
        bufs = {}
        for n, (h, d, dt) in self._past.items():
            rows = length
            if n in self._windows:
                rows = max(min(self._windows[n] + self._window_slack, length), self._windows[n])
            bufs[n] = ort.OrtValue.ortvalue_from_numpy(np.zeros((1, h, rows, d), dt))
        return bufs

    def _feed(self, tokens: Sequence[int], past: dict, past_len: int):
        """Run S new tokens after `past_len` cached ones -> (logits float32 [S, V], next past)."""
        s = len(tokens)
        feed = {"input_ids": np.asarray([tokens], self._ids_dtype)}
        if self._mask is not None:
            feed["attention_mask"] = np.ones((1, past_len + s), _ORT_TYPES[self._mask.type])
        if self._position_ids is not None:
            feed["position_ids"] = np.arange(past_len, past_len + s, dtype=_ORT_TYPES[
                self._position_ids.type])[None]
        if not self._windows:
            out = dict(zip(self._outputs, self.session.run(self._outputs, {**feed, **past})))
            present = {n: out[n.replace("past_key_values", "present")] for n in self._past}
            return np.asarray(out["logits"][0], np.float32), present
        # Shared buffers: GQA reads seqlens_k = past_len + S - 1 from the mask and writes the new
        # rows in place (evicting in a window-sized buffer).
        io = self.session.io_binding()
        for name, value in feed.items():
            io.bind_cpu_input(name, value)
        io.bind_output("logits")
        for name, buf in past.items():
            io.bind_ortvalue_input(name, buf)
            io.bind_ortvalue_output(name.replace("past_key_values", "present"), buf)
        self.session.run_with_iobinding(io)
        return np.asarray(io.copy_outputs_to_cpu()[0][0], np.float32), past

    def logits(self, sequence: Sequence[int], prompt_len: int) -> np.ndarray:
        """float32 [len(sequence), V]: row t is the distribution after token t. The first prompt_len
        rows come from one prefill of the prompt, each later row from a one-token decode step."""
        if not 1 <= prompt_len <= len(sequence):
            raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(sequence)}]")
        rows, past = self._feed(sequence[:prompt_len], self._empty_past(len(sequence)), 0)
        out = [rows]
        for t in range(prompt_len, len(sequence)):
            row, past = self._feed(sequence[t:t + 1], past, t)
            out.append(row)
        return np.concatenate(out, axis=0)

    def greedy(self, prompt: Sequence[int], max_new_tokens: int,
               stop_tokens: Sequence[int] = ()) -> list[int]:
        """Greedy continuation of `prompt` (argmax, ties to the lowest id); a stop token ends it and is
        included."""
        if not prompt:
            raise ValueError("the prompt must have at least one token")
        rows, past = self._feed(list(prompt), self._empty_past(len(prompt) + max_new_tokens), 0)
        out: list[int] = []
        length = len(prompt)
        while len(out) < max_new_tokens:
            token = int(np.argmax(rows[-1]))
            out.append(token)
            if token in stop_tokens or len(out) == max_new_tokens:
                break
            rows, past = self._feed([token], past, length)
            length += 1
        return out


__all__ = ["OrtDecoder"]
