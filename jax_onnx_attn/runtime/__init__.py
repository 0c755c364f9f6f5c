"""Running lowered decoders: DecoderSession (fixed-capacity KV cache, jitted prefill/decode,
generate), sampling, and onnxruntime as the parity oracle."""

from jax_onnx_attn.runtime.onnxruntime_ref import OrtDecoder
from jax_onnx_attn.runtime.parity import ParityReport, compare_with_onnxruntime
from jax_onnx_attn.runtime.sampling import SamplingConfig, sample, sampling_probs
from jax_onnx_attn.runtime.session import (DecoderSession, GenerationResult, Timings,
                                           describe_backend)

__all__ = ["DecoderSession", "GenerationResult", "Timings", "SamplingConfig", "sample",
           "sampling_probs", "OrtDecoder", "describe_backend",
           "ParityReport", "compare_with_onnxruntime"]
