"""Parity of a lowered decoder with onnxruntime CPU: logits along one sequence, and greedy tokens."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from jax_onnx_attn.onnx.files import model_file
from jax_onnx_attn.runtime.onnxruntime_ref import OrtDecoder
from jax_onnx_attn.runtime.session import DecoderSession
from jax_onnx_attn.testing import tolerance


@dataclass
class ParityReport:
    """What `compare_with_onnxruntime` found.

    prefill_max_abs / decode_max_abs: max |ours - onnxruntime| over the prompt's logits (one
      prefill) and over the logits of each later token (one-token cached decode steps), both along
      onnxruntime's greedy sequence so that the inputs are the same.
    logits_scale: max |onnxruntime logit|.
    logits_within_tolerance: max |diff| <= atol + rtol * logits_scale, a max-norm test: an f16
      model's logits differ by a few ulps of their largest value between two correct runtimes,
      which an elementwise test would flag on the small logits.
    first_divergence: index of the first generated token where our greedy tokens differ from
      onnxruntime's, None when they are identical.
    divergence_gap: at the first divergence, onnxruntime's logit of its token minus its logit of
      ours (same inputs on both sides up to there). A gap within the logits' tolerance is a near-tie
      that either runtime may break either way: parity still holds.
    tolerance: (rtol, atol) of `logits_dtype` from jax_onnx_attn.testing.
    """

    prompt: list[int]
    ort_tokens: list[int]
    jax_tokens: list[int]
    logits_dtype: np.dtype
    prefill_max_abs: float
    decode_max_abs: float
    logits_scale: float
    logits_within_tolerance: bool
    first_divergence: int | None
    divergence_gap: float | None = None

    @property
    def tolerance(self) -> tuple[float, float]:
        """(rtol, atol) for logits_dtype, from jax_onnx_attn.testing."""
        return tolerance(self.logits_dtype)

    @property
    def logits_bound(self) -> float:
        """The largest logit difference the tolerance allows: atol + rtol * logits_scale."""
        rtol, atol = self.tolerance
        return atol + rtol * self.logits_scale

    @property
    def divergence_is_tie(self) -> bool:
        """True when the greedy tokens diverge at a near-tie (divergence_gap <= logits_bound)."""
        return self.divergence_gap is not None and self.divergence_gap <= self.logits_bound

    @property
    def ok(self) -> bool:
        """Parity holds: logits within tolerance and greedy tokens identical up to a near-tie."""
        return self.logits_within_tolerance and (self.first_divergence is None or self.divergence_is_tie)

    def lines(self) -> list[str]:
        """The report as human-readable lines (token counts, logit diffs, divergence, verdict)."""
        rtol, atol = self.tolerance
        out = [
            f"prompt: {len(self.prompt)} tokens; greedy: {len(self.ort_tokens)} tokens from onnxruntime, "
            f"{len(self.jax_tokens)} from jax_onnx_attn",
            f"logits max |diff|: prefill {self.prefill_max_abs:.3g}, decode {self.decode_max_abs:.3g}; "
            f"max |logit| {self.logits_scale:.3g} "
            f"({'within' if self.logits_within_tolerance else 'OUTSIDE'} {self.logits_dtype.name} tolerance: "
            f"max |diff| <= {atol:g} + {rtol:g} * max |logit|)",
        ]
        if self.first_divergence is None:
            out.append("greedy tokens: identical")
        else:
            i = self.first_divergence
            ours = self.jax_tokens[i] if i < len(self.jax_tokens) else "(ended)"
            theirs = self.ort_tokens[i] if i < len(self.ort_tokens) else "(ended)"
            line = (f"greedy tokens: first divergence at new token {i}: jax_onnx_attn {ours}, "
                    f"onnxruntime {theirs}")
            if self.divergence_gap is not None:
                line += (f"; onnxruntime's logits of the two differ by {self.divergence_gap:.3g} "
                         f"({'a near-tie, within' if self.divergence_is_tie else 'more than'} the "
                         f"tolerance {self.logits_bound:.3g})")
            out.append(line)
        out.append("parity: OK" if self.ok else "parity: MISMATCH")
        return out


def _eps(dtype: np.dtype) -> float:
    """Machine epsilon of a float dtype, bfloat16 included (np.finfo does not know ml_dtypes')."""
    return float(ml_dtypes.finfo(dtype).eps)


def _first_divergence(a: Sequence[int], b: Sequence[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_with_onnxruntime(model, prompt: Sequence[int], max_new_tokens: int = 16, *, dtype=None,
                             stop_tokens: Sequence[int] = (), lowered=None) -> ParityReport:
    """Run `model` in onnxruntime CPU and in jax_onnx_attn on the same prompt and compare.

    Args:
      model: a path (an .onnx file or an export folder holding one) or an onnx.ModelProto
        (onnxruntime runs it; jax_onnx_attn loads it unless `lowered` is given).
      prompt: token ids.
      dtype: the jax side's dtype (None: the model's), e.g. jnp.bfloat16; the tolerance is that of
        the less precise of it and onnxruntime's logits.
    """
    prompt = [int(t) for t in prompt]
    if isinstance(model, (str, os.PathLike)):
        model = str(model_file(model))
    ort = OrtDecoder(model)
    ort_tokens = ort.greedy(prompt, max_new_tokens, stop_tokens)
    session = DecoderSession(lowered if lowered is not None else model,
                             max_length=len(prompt) + max_new_tokens + 1, batch=1, dtype=dtype)
    jax_tokens = session.generate([prompt], max_new_tokens, stop_tokens=stop_tokens,
                                  progress=False).tokens[0]
    sequence = prompt + ort_tokens
    ours = session.logits(sequence, len(prompt))
    theirs = ort.logits(sequence, len(prompt))
    diff = np.abs(ours.astype(np.float64) - theirs)
    logits_dtype = np.dtype(ort.logits_dtype)
    if dtype is not None and _eps(np.dtype(dtype)) > _eps(logits_dtype):
        logits_dtype = np.dtype(dtype)
    rtol, atol = tolerance(logits_dtype)
    scale = float(np.abs(theirs).max())
    p = len(prompt)
    first = _first_divergence(jax_tokens, ort_tokens)
    gap = None
    if first is not None and first < min(len(jax_tokens), len(ort_tokens)):
        row = theirs[p + first - 1]  # the logits that chose new token `first`
        gap = float(row[ort_tokens[first]] - row[jax_tokens[first]])
    return ParityReport(
        prompt=prompt, ort_tokens=ort_tokens, jax_tokens=jax_tokens, logits_dtype=logits_dtype,
        prefill_max_abs=float(diff[:p].max()),
        decode_max_abs=float(diff[p:].max()) if len(diff) > p else float("nan"),
        logits_scale=scale, logits_within_tolerance=bool(diff.max() <= atol + rtol * scale),
        first_divergence=first, divergence_gap=gap)


__all__ = ["ParityReport", "compare_with_onnxruntime"]
