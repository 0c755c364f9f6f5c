"""The embedded tiny decoder: a byte-level `DecoderConfig` model with random weights, no download.

It is the demo model of the CLI and a parity oracle (onnxruntime CPU runs it). The graph is the
builder's (`jax_onnx_attn.models.builder`: opset 22 + com.microsoft 1, GroupQueryAttention with
packed QKV and rotary, SkipSimplifiedLayerNormalization, SiLU MLP, separate LM head), the weights
`jax_onnx_attn.models.weights`'. The vocabulary is 256 bytes ("byte-level tokenizer": `encode` /
`decode`); the LM head has zero columns for bytes that are not printable ASCII or newline, so greedy
and sampled text stays printable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from jax_onnx_attn.models.builder import MS_DOMAIN, OPSET, build_decoder
from jax_onnx_attn.models.config import BYTE_VOCAB, DTYPES, DecoderConfig, canonical_dtype
from jax_onnx_attn.models.weights import make_weights, printable_ids, rotary_cache


@dataclass(frozen=True)
class TinyConfig:
    """Shape and seed of the tiny decoder (a byte-level `DecoderConfig` with a printable LM head).

    head_size = hidden // heads must be a multiple of 16 (GroupQueryAttention with rotary needs it).
    """

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 256
    max_positions: int = 512
    dtype: str = "float32"
    seed: int = 0
    rms_eps: float = 1e-6
    rope_theta: float = 10000.0
    #: Standard deviation of the logits (before the non-printable columns are zeroed).
    logit_scale: float = 4.0

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if not 1 <= self.vocab <= BYTE_VOCAB:
            raise ValueError(f"vocab must be in [1, {BYTE_VOCAB}] (byte-level), got {self.vocab}")
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        self.decoder_config()  # the general checks (heads / kv_heads, head size multiple of 16)

    @property
    def head_size(self) -> int:
        """hidden // heads."""
        return self.hidden // self.heads

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of `dtype` (the model's float type)."""
        return DTYPES[self.dtype][0]

    def decoder_config(self) -> DecoderConfig:
        """The same model as a `DecoderConfig` (printable byte-level LM head)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return DecoderConfig(**fields, printable=True, name="tiny-bytes")


# --------------------------------------------------------------------------------------------------
# Byte-level "tokenizer": token id == byte value.

def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids (0..255)."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 is replaced, not raised."""
    return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


def tiny_weights(config: TinyConfig = TinyConfig()) -> dict[str, np.ndarray]:
    """Every initializer of the tiny decoder by its builder-style name, in config.dtype.

    MatMul weights are [in, out]. The same config (seed included) gives the same weights.
    """
    return make_weights(config.decoder_config())


def build_tiny_decoder(config: TinyConfig | None = None, **overrides) -> "onnx.ModelProto":  # noqa: F821
    """The tiny decoder as an ONNX ModelProto (see `jax_onnx_attn.models.builder` for the graph).

    Args:
      config: shape, dtype and seed; keyword overrides replace its fields, e.g.
        `build_tiny_decoder(layers=1, dtype="f16")`.
    """
    config = dataclasses.replace(config or TinyConfig(), **overrides)
    return build_decoder(config.decoder_config())


__all__ = ["TinyConfig", "build_tiny_decoder", "tiny_weights", "rotary_cache", "encode", "decode",
           "printable_ids", "OPSET", "MS_DOMAIN"]
