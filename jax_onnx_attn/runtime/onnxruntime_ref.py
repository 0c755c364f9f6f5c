"""onnxruntime (CPU) as the oracle for decoder models with the builder's I/O convention.

Inputs `input_ids` [B, S], optional `attention_mask` [B, total] and `position_ids` [B, S],
`past_key_values.N.key/value` [B, kv_heads, past, head_size]; outputs `logits` [B, S, V] and
`present.N.key/value`. One sequence (batch 1) at a time, the cache grown by onnxruntime itself
(present fed back as past), with no padding: the plainest way to run the model.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence

import numpy as np
import onnx

_PAST = re.compile(r"^past_key_values\.(\d+)\.(key|value)$")
_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(int64)": np.int64, "tensor(int32)": np.int32}


def _import_onnxruntime():
    try:
        import onnxruntime
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("onnxruntime is needed as the parity oracle: pip install onnxruntime") from e
    return onnxruntime


class OrtDecoder:
    """A decoder model in an onnxruntime CPU session.

    Args:
      model: a path (external data beside it is found) or an onnx.ModelProto.
    """

    def __init__(self, model: str | os.PathLike | onnx.ModelProto,
                 providers: Sequence[str] = ("CPUExecutionProvider",)):
        ort = _import_onnxruntime()
        src = model.SerializeToString() if isinstance(model, onnx.ModelProto) else os.fspath(model)
        options = ort.SessionOptions()
        options.log_severity_level = 3  # keep the oracle quiet about graph-optimisation notes
        self.session = ort.InferenceSession(src, options, providers=list(providers))
        inputs = {i.name: i for i in self.session.get_inputs()}
        if "input_ids" not in inputs:
            raise ValueError(f"the model has no `input_ids` input (inputs: {sorted(inputs)}); only "
                             "decoders with the onnxruntime-genai builder's I/O names are supported")
        self._ids_dtype = _ORT_TYPES.get(inputs["input_ids"].type, np.int64)
        self._mask = inputs.get("attention_mask")
        self._position_ids = inputs.get("position_ids")
        self._past: dict[str, tuple[int, int, type]] = {}
        for name, info in inputs.items():
            if _PAST.match(name):
                kv_heads, head_size = info.shape[1], info.shape[3]
                if not (isinstance(kv_heads, int) and isinstance(head_size, int)):
                    raise ValueError(f"{name} has shape {info.shape}: kv_heads and head_size (dims 1, 3) "
                                     "must be fixed numbers")
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

    def _empty_past(self) -> dict[str, np.ndarray]:
        return {n: np.zeros((1, h, 0, d), dt) for n, (h, d, dt) in self._past.items()}

    def _feed(self, tokens: Sequence[int], past: dict[str, np.ndarray], past_len: int):
        """Run S new tokens after `past_len` cached ones -> (logits float32 [S, V], next past)."""
        s = len(tokens)
        feed = {"input_ids": np.asarray([tokens], self._ids_dtype), **past}
        if self._mask is not None:
            feed["attention_mask"] = np.ones((1, past_len + s), _ORT_TYPES[self._mask.type])
        if self._position_ids is not None:
            feed["position_ids"] = np.arange(past_len, past_len + s, dtype=_ORT_TYPES[
                self._position_ids.type])[None]
        out = dict(zip(self._outputs, self.session.run(self._outputs, feed)))
        present = {n: out[n.replace("past_key_values", "present")] for n in self._past}
        return np.asarray(out["logits"][0], np.float32), present

    def logits(self, sequence: Sequence[int], prompt_len: int) -> np.ndarray:
        """float32 [len(sequence), V]: row t is the distribution after token t. The first prompt_len
        rows come from one prefill of the prompt, each later row from a one-token decode step."""
        if not 1 <= prompt_len <= len(sequence):
            raise ValueError(f"prompt_len {prompt_len} must be in [1, {len(sequence)}]")
        rows, past = self._feed(sequence[:prompt_len], self._empty_past(), 0)
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
        rows, past = self._feed(list(prompt), self._empty_past(), 0)
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
