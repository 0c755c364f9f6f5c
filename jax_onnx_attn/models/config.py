"""The shape of a builder-style decoder (`DecoderConfig`) and the named real-size presets.

A config fixes everything a made model depends on: shape, float type, weight format (float, or int4 /
int8 `com.microsoft::MatMulNBits` with a block size and optional zero points) and the seed of its
random weights. Sizes and parameter counts are computed from the config alone (`weight_shapes`,
`param_count`, `file_bytes`), without making any weight.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import ml_dtypes
import numpy as np
from onnx import TensorProto

from jax_onnx_attn.models.quant import BITS, nbits_bytes

#: dtype name -> (NumPy dtype, ONNX element type).
DTYPES = {"float32": (np.dtype(np.float32), TensorProto.FLOAT),
          "float16": (np.dtype(np.float16), TensorProto.FLOAT16),
          "bfloat16": (np.dtype(ml_dtypes.bfloat16), TensorProto.BFLOAT16)}
DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "float32": "float32",
                 "f16": "float16", "fp16": "float16", "float16": "float16",
                 "bf16": "bfloat16", "bfloat16": "bfloat16"}
#: The largest vocabulary the byte-level tokenizer (`encode` / `decode`) covers.
BYTE_VOCAB = 256
#: onnxruntime-genai's builder default: accuracy_level 4 for its CPU target (float32 models), 0 (the
#: attribute left out) for CUDA (float16 / bfloat16 models).
BUILDER_ACCURACY_LEVEL = {"float32": 4, "float16": 0, "bfloat16": 0}


def canonical_dtype(dtype) -> str:
    """"float32" / "float16" / "bfloat16" for any alias ("fp16", "bf16", np.float16, ...)."""
    key = np.dtype(dtype).name if not isinstance(dtype, str) else dtype.lower()
    name = DTYPE_ALIASES.get(key)
    if name is None:
        raise ValueError(f"dtype must be one of {sorted(DTYPE_ALIASES)}, got {dtype!r}")
    return name


@dataclass(frozen=True)
class DecoderConfig:
    """A llama-shaped decoder as onnxruntime-genai's model builder exports it (see models.builder).

    Attributes:
      layers, hidden, heads, kv_heads, intermediate, vocab: the transformer's shape.
      head_size: per-head width; 0 means hidden // heads. A multiple of 16 (GroupQueryAttention's
        rotary needs it).
      max_positions: rows of the cos/sin caches (the longest sequence the model takes).
      dtype: the float type of weights, activations and the KV cache ("float32", "float16",
        "bfloat16"; aliases "fp16", "bf16", ...).
      weight_bits: 0 (float MatMul weights) or 4 / 8: every projection and the LM head as
        com.microsoft::MatMulNBits (the embedding stays float, as the builder writes it).
      block_size: MatMulNBits block size along K (32 is the builder's default; 128 also common).
      zero_points: asymmetric quantisation with a zero-points input (the builder's default is
        symmetric: none).
      accuracy_level: MatMulNBits' attribute; None takes the builder's default for the dtype
        (`BUILDER_ACCURACY_LEVEL`); 0 leaves the attribute out, as the builder does.
      seed: the weights' seed (same config, same bytes).
      rms_eps, rope_theta: RMSNorm epsilon and the RoPE base.
      logit_scale: standard deviation of the logits of a unit-RMS final hidden state.
      printable: zero the LM-head columns of bytes that are not printable ASCII or newline
        (byte-level models, vocab <= 256), so generated text stays printable.
      name: a label (the preset's name) for file names and reports.
    """

    layers: int = 2
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    vocab: int = 256
    head_size: int = 0
    max_positions: int = 512
    dtype: str = "float32"
    weight_bits: int = 0
    block_size: int = 32
    zero_points: bool = False
    accuracy_level: int | None = None
    seed: int = 0
    rms_eps: float = 1e-5
    rope_theta: float = 10000.0
    logit_scale: float = 4.0
    printable: bool = False
    name: str = "custom"

    def __post_init__(self):
        object.__setattr__(self, "dtype", canonical_dtype(self.dtype))
        if self.head_size == 0:
            if self.hidden % self.heads:
                raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}; "
                                 "give head_size explicitly")
            object.__setattr__(self, "head_size", self.hidden // self.heads)
        for field in ("layers", "hidden", "heads", "kv_heads", "intermediate", "vocab", "max_positions"):
            if getattr(self, field) < 1:
                raise ValueError(f"{field} must be >= 1, got {getattr(self, field)}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_size % 16:
            raise ValueError(f"head_size {self.head_size} must be a multiple of 16 "
                             "(GroupQueryAttention with rotary)")
        if self.weight_bits not in (0,) + BITS:
            raise ValueError(f"weight_bits must be 0 (float) or one of {BITS}, got {self.weight_bits}")
        if self.weight_bits:
            if self.block_size < 16 or self.block_size & (self.block_size - 1):
                raise ValueError(f"block_size must be a power of two >= 16, got {self.block_size}")
            ks = {"hidden": self.hidden, "heads * head_size": self.q_width,
                  "intermediate": self.intermediate}
            bad = {k: v for k, v in ks.items() if v % self.block_size}
            if bad:
                raise ValueError(f"quantised weights need every K (a projection's input width) to be a "
                                 f"multiple of block_size {self.block_size}; not: {bad}")
        if self.printable and self.vocab > BYTE_VOCAB:
            raise ValueError(f"printable applies to byte-level vocabularies (<= {BYTE_VOCAB}), "
                             f"got vocab {self.vocab}")

    # -- derived sizes -------------------------------------------------------------------------
    @property
    def q_width(self) -> int:
        """heads * head_size."""
        return self.heads * self.head_size

    @property
    def kv_width(self) -> int:
        """kv_heads * head_size."""
        return self.kv_heads * self.head_size

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of `dtype`."""
        return DTYPES[self.dtype][0]

    @property
    def onnx_type(self) -> int:
        """The ONNX element type of `dtype`."""
        return DTYPES[self.dtype][1]

    @property
    def byte_level(self) -> bool:
        """True when token ids are bytes (vocab <= 256): `encode` / `decode` apply."""
        return self.vocab <= BYTE_VOCAB

    @property
    def level(self) -> int:
        """The MatMulNBits accuracy_level written (0: the attribute is left out)."""
        return BUILDER_ACCURACY_LEVEL[self.dtype] if self.accuracy_level is None else int(self.accuracy_level)

    @property
    def weights_label(self) -> str:
        """"fp16" / "bf16" / "fp32" or "int4" / "int8" (+ block size when not 32, "-zp" with zero points)."""
        if not self.weight_bits:
            return {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}[self.dtype]
        label = f"int{self.weight_bits}"
        if self.block_size != 32:
            label += f"-b{self.block_size}"
        return label + ("-zp" if self.zero_points else "")

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """{initializer base name: (K, N)} of every MatMul weight (projections and LM head), in graph order."""
        h = self.hidden
        out = {}
        for i in range(self.layers):
            p = f"model.layers.{i}."
            out[p + "attn.qkv_proj.MatMul.weight"] = (h, self.q_width + 2 * self.kv_width)
            out[p + "attn.o_proj.MatMul.weight"] = (self.q_width, h)
            out[p + "mlp.gate_proj.MatMul.weight"] = (h, self.intermediate)
            out[p + "mlp.up_proj.MatMul.weight"] = (h, self.intermediate)
            out[p + "mlp.down_proj.MatMul.weight"] = (self.intermediate, h)
        out["lm_head.MatMul.weight"] = (h, self.vocab)
        return out

    def norm_names(self) -> list[str]:
        """The RMSNorm weights, in graph order (the builder names the final one after layer L)."""
        names = []
        for i in range(self.layers):
            names += [f"model.layers.{i}.input_layernorm.weight",
                      f"model.layers.{i}.post_attention_layernorm.weight"]
        return names + [f"model.layers.{self.layers}.final_norm_layernorm.weight"]

    def param_count(self) -> int:
        """Logical parameters: embedding, projections and LM head (K x N each), norms; not the
        cos/sin tables."""
        linear = sum(k * n for k, n in self.linear_shapes().values())
        return self.vocab * self.hidden + linear + len(self.norm_names()) * self.hidden

    def file_bytes(self) -> int:
        """Bytes of every initializer (the size of model.onnx.data, without alignment padding)."""
        item = self.np_dtype.itemsize
        size = (self.vocab * self.hidden + len(self.norm_names()) * self.hidden) * item
        size += 2 * self.max_positions * (self.head_size // 2) * item  # cos / sin caches
        for k, n in self.linear_shapes().values():
            if self.weight_bits:
                size += nbits_bytes(k, n, self.weight_bits, self.block_size, not self.zero_points, item)
            else:
                size += k * n * item
        return size

    def replace(self, **changes) -> "DecoderConfig":
        """A copy with `changes` applied (dataclasses.replace, validated again)."""
        return dataclasses.replace(self, **changes)


#: Real-size shapes. A separate LM head and embedding each (the builder writes both, tied or not).
PRESETS: dict[str, DecoderConfig] = {
    # Llama-3.2-1B: 1.50 B parameters with the untied LM head (2.99 GB in fp16).
    "llama-3.2-1b": DecoderConfig(layers=16, hidden=2048, heads=32, kv_heads=8, head_size=64,
                                  intermediate=8192, vocab=128256, max_positions=131072,
                                  rope_theta=500000.0, dtype="float16", name="llama-3.2-1b"),
    # Llama-3.1-8B: 8.03 B parameters (16.1 GB in fp16).
    "llama-3.1-8b": DecoderConfig(layers=32, hidden=4096, heads=32, kv_heads=8, head_size=128,
                                  intermediate=14336, vocab=128256, max_positions=131072,
                                  rope_theta=500000.0, dtype="float16", name="llama-3.1-8b"),
    # The 0.73 B shape of issue 12 and bench/results' baseline (byte vocabulary, head size 64).
    "issue": DecoderConfig(layers=12, hidden=2048, heads=32, kv_heads=8, head_size=64,
                           intermediate=8192, vocab=256, max_positions=131072, dtype="float16",
                           rms_eps=1e-6, printable=True, name="issue"),
    # A CPU-sized stand-in for tests and the harness's own checks (ids beyond the byte range).
    "tiny": DecoderConfig(layers=2, hidden=128, heads=4, kv_heads=2, head_size=32, intermediate=256,
                          vocab=1000, max_positions=4096, dtype="float16", name="tiny"),
}
#: Short names accepted by `preset` (and the e2e bench).
PRESET_ALIASES = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b", "0.7b": "issue"}


def preset(preset_name: str, /, **overrides) -> DecoderConfig:
    """The preset `preset_name` (or an alias: "1b", "8b") with `overrides` applied (any DecoderConfig
    field, `name` included), e.g. `preset("8b", weight_bits=4)`."""
    key = PRESET_ALIASES.get(preset_name, preset_name)
    if key not in PRESETS:
        raise ValueError(f"unknown preset {preset_name!r}; known: {sorted(PRESETS)} "
                         f"(aliases {sorted(PRESET_ALIASES)})")
    return PRESETS[key].replace(**overrides)


__all__ = ["DecoderConfig", "PRESETS", "PRESET_ALIASES", "preset", "canonical_dtype", "DTYPES",
           "BYTE_VOCAB", "BUILDER_ACCURACY_LEVEL"]
