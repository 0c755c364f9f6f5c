"""Models the package makes itself (no download): the embedded tiny decoder of the demo and tests."""

from jax_onnx_attn.models.tiny import TinyConfig, build_tiny_decoder, decode, encode

__all__ = ["TinyConfig", "build_tiny_decoder", "encode", "decode"]
