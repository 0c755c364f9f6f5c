"""Models the package makes itself (no download), in the graph shape of onnxruntime-genai's builder.

* `DecoderConfig` / `preset(name)`: a llama-shaped decoder's shape, float type (fp32 / fp16 / bf16),
  weight format (float, or int4 / int8 MatMulNBits) and seed; presets "llama-3.2-1b", "llama-3.1-8b",
  "issue" (0.73 B) and "tiny".
* `build_decoder(config)`: an in-memory ModelProto; `save_decoder(config, folder)`: model.onnx +
  model.onnx.data as the builder writes them; `ensure_model(config)`: the same, cached on disk.
* `quantize_nbits`: onnxruntime's MatMulNBits quantisation, byte for byte.
* The embedded tiny decoder of the demo and tests: `TinyConfig`, `build_tiny_decoder`, and its
  byte-level tokenizer `encode` / `decode`.
"""

from jax_onnx_attn.models.builder import build_decoder, ensure_model, save_decoder
from jax_onnx_attn.models.config import PRESETS, DecoderConfig, preset
from jax_onnx_attn.models.quant import dequantize_nbits, quantize_nbits
from jax_onnx_attn.models.tiny import TinyConfig, build_tiny_decoder, decode, encode

__all__ = ["TinyConfig", "build_tiny_decoder", "encode", "decode", "DecoderConfig", "PRESETS", "preset",
           "build_decoder", "save_decoder", "ensure_model", "quantize_nbits", "dequantize_nbits"]
