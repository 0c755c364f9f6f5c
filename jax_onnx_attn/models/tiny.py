"""An embedded tiny decoder in the shape onnxruntime-genai's model builder emits, with random weights.

The model is made here, from a seed, with no download: it is the demo model of the CLI and a parity
oracle (onnxruntime CPU runs it). Its graph follows the builder (opset 22 + com.microsoft 1):

    input_ids int64 [batch_size, sequence_length]
    attention_mask int64 [batch_size, total_sequence_length]
    past_key_values.N.key / .value  T [batch_size, kv_heads, past_sequence_length, head_size]
      -> logits T [batch_size, sequence_length, vocab]
         present.N.key / .value  T [batch_size, kv_heads, total_sequence_length, head_size]

    Gather(embed) -> SimplifiedLayerNormalization -> per layer:
        packed QKV MatMul -> com.microsoft::GroupQueryAttention (packed QKV, do_rotary=1,
        cos/sin cache initializers, seqlens_k = int32(ReduceSum(mask, 1) - 1),
        total_sequence_length = int32(Shape(mask)[1])) -> o_proj MatMul
        -> SkipSimplifiedLayerNormalization -> MLP (down(SiLU(gate) * up), SiLU = Sigmoid * Mul)
        -> SkipSimplifiedLayerNormalization (the next layer's input norm, or the final norm)
    -> LM-head MatMul

T is float32 or float16 (the builder's io dtype). The vocabulary is 256 bytes ("byte-level
tokenizer": `encode` / `decode`); the LM head has zero columns for bytes that are not printable ASCII
or newline, so greedy and sampled text stays printable.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

#: Opsets of the builder's graphs.
OPSET = 22
MS_DOMAIN = "com.microsoft"
MS_OPSET = 1

_DTYPES = {"float32": (np.float32, TensorProto.FLOAT), "float16": (np.float16, TensorProto.FLOAT16)}
_DTYPE_ALIASES = {"f32": "float32", "fp32": "float32", "float32": "float32",
                  "f16": "float16", "fp16": "float16", "float16": "float16"}


@dataclass(frozen=True)
class TinyConfig:
    """Shape and seed of the tiny decoder.

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
        dtype = _DTYPE_ALIASES.get(str(self.dtype).lower())
        if dtype is None:
            raise ValueError(f"TinyConfig.dtype must be one of {sorted(_DTYPE_ALIASES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if self.hidden % self.heads:
            raise ValueError(f"hidden {self.hidden} is not a multiple of heads {self.heads}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads {self.heads} is not a multiple of kv_heads {self.kv_heads}")
        if self.head_size % 16:
            raise ValueError(f"head_size = hidden / heads = {self.head_size} must be a multiple of 16 "
                             "(GroupQueryAttention with rotary)")
        if not 1 <= self.vocab <= 256:
            raise ValueError(f"vocab must be in [1, 256] (byte-level), got {self.vocab}")

    @property
    def head_size(self) -> int:
        """hidden // heads."""
        return self.hidden // self.heads

    @property
    def np_dtype(self) -> np.dtype:
        """The NumPy dtype of `dtype` (the model's float type)."""
        return np.dtype(_DTYPES[self.dtype][0])


# --------------------------------------------------------------------------------------------------
# Byte-level "tokenizer": token id == byte value.

def encode(text: str) -> list[int]:
    """UTF-8 bytes of `text` as token ids (0..255)."""
    return list(text.encode("utf-8"))


def decode(ids) -> str:
    """Token ids (bytes) back to text; invalid UTF-8 is replaced, not raised."""
    return bytes(int(i) & 0xFF for i in ids).decode("utf-8", errors="replace")


def printable_ids(vocab: int = 256) -> np.ndarray:
    """bool [vocab]: the ids the tiny model can emit (printable ASCII and newline)."""
    ids = np.arange(vocab)
    return ((ids >= 32) & (ids < 127)) | (ids == 10)


# --------------------------------------------------------------------------------------------------
# Weights

def rotary_cache(config: TinyConfig) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin caches [max_positions, head_size / 2] (non-interleaved RoPE, base rope_theta)."""
    d = config.head_size
    inv_freq = 1.0 / (config.rope_theta ** (np.arange(0, d, 2, dtype=np.float64) / d))
    angles = np.outer(np.arange(config.max_positions, dtype=np.float64), inv_freq)
    return np.cos(angles).astype(config.np_dtype), np.sin(angles).astype(config.np_dtype)


def tiny_weights(config: TinyConfig = TinyConfig()) -> dict[str, np.ndarray]:
    """Every initializer of the tiny decoder by its builder-style name, in config.dtype.

    MatMul weights are [in, out]. The same config (seed included) gives the same weights.
    """
    rng = np.random.default_rng(config.seed)
    h, d = config.hidden, config.head_size
    qkv_out = (config.heads + 2 * config.kv_heads) * d

    def linear(n_in, n_out, scale=1.0):
        return rng.standard_normal((n_in, n_out)) * (scale / np.sqrt(n_in))

    def norm():
        return 1.0 + 0.1 * rng.standard_normal(h)

    w = {"model.embed_tokens.weight": rng.standard_normal((config.vocab, h))}
    for i in range(config.layers):
        p = f"model.layers.{i}."
        w[p + "input_layernorm.weight"] = norm()
        w[p + "attn.qkv_proj.MatMul.weight"] = linear(h, qkv_out)
        w[p + "attn.o_proj.MatMul.weight"] = linear(config.heads * d, h)
        w[p + "post_attention_layernorm.weight"] = norm()
        w[p + "mlp.gate_proj.MatMul.weight"] = linear(h, config.intermediate)
        w[p + "mlp.up_proj.MatMul.weight"] = linear(h, config.intermediate)
        w[p + "mlp.down_proj.MatMul.weight"] = linear(config.intermediate, h)
    w["model.norm.weight"] = norm()
    head = linear(h, config.vocab, config.logit_scale)
    head[:, ~printable_ids(config.vocab)] = 0.0
    w["lm_head.MatMul.weight"] = head
    w = {k: v.astype(config.np_dtype) for k, v in w.items()}
    w["cos_cache"], w["sin_cache"] = rotary_cache(config)
    return w


# --------------------------------------------------------------------------------------------------
# Graph

class _Graph:
    """Collects nodes with builder-style names (/model/layers.0/attn/...)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []
        self.initializers: list[onnx.TensorProto] = []

    def const(self, name: str, value: np.ndarray) -> str:
        self.initializers.append(numpy_helper.from_array(np.asarray(value), name))
        return name

    def node(self, op: str, name: str, inputs, n_out: int = 1, domain: str = "", outputs=None,
             **attrs) -> list[str]:
        outputs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, domain=domain,
                                           **attrs))
        return outputs


def build_tiny_decoder(config: TinyConfig | None = None, **overrides) -> onnx.ModelProto:
    """The tiny decoder as an ONNX ModelProto (see the module docstring for the graph).

    Args:
      config: shape, dtype and seed; keyword overrides replace its fields, e.g.
        `build_tiny_decoder(layers=1, dtype="f16")`.
    """
    config = dataclasses.replace(config or TinyConfig(), **overrides)
    _, elem = _DTYPES[config.dtype]
    w = tiny_weights(config)
    g = _Graph()
    for name, value in w.items():
        g.const(name, value)

    # Attention-mask arithmetic shared by every layer, as the builder writes it.
    m = "/model/attn_mask_reformat/attn_mask_subgraph"
    axes = g.const(f"{m}/ReduceSum/axes", np.array([1], np.int64))
    one = g.const(f"{m}/Sub/B", np.array(1, np.int64))
    (mask_sum,) = g.node("ReduceSum", f"{m}/ReduceSum", ["attention_mask", axes], keepdims=0)
    (seqlens,) = g.node("Sub", f"{m}/Sub", [mask_sum, one])
    (seqlens_k,) = g.node("Cast", f"{m}/Sub/Cast", [seqlens], to=TensorProto.INT32)
    (mask_shape,) = g.node("Shape", f"{m}/Shape", ["attention_mask"])
    idx = g.const(f"{m}/Gather/indices", np.array(1, np.int64))
    (total,) = g.node("Gather", f"{m}/Gather", [mask_shape, idx], axis=0)
    (total_len,) = g.node("Cast", f"{m}/Cast", [total], to=TensorProto.INT32)

    (x,) = g.node("Gather", "/model/embed_tokens/Gather", ["model.embed_tokens.weight", "input_ids"])
    eps = float(config.rms_eps)
    (h,) = g.node("SimplifiedLayerNormalization", "/model/layers.0/input_layernorm/LayerNorm",
                  [x, "model.layers.0.input_layernorm.weight"], axis=-1, epsilon=eps, stash_type=1)
    residual = x
    for i in range(config.layers):
        p, n = f"model.layers.{i}.", f"/model/layers.{i}"
        (qkv,) = g.node("MatMul", f"{n}/attn/qkv_proj/MatMul", [h, p + "attn.qkv_proj.MatMul.weight"])
        attn, _, _ = g.node(
            "GroupQueryAttention", f"{n}/attn/GroupQueryAttention",
            [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k,
             total_len, "cos_cache", "sin_cache"],
            domain=MS_DOMAIN,
            outputs=[f"{n}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
            num_heads=config.heads, kv_num_heads=config.kv_heads,
            scale=float(1.0 / np.sqrt(config.head_size)), do_rotary=1, rotary_interleaved=0,
            local_window_size=-1, softcap=0.0)
        (o,) = g.node("MatMul", f"{n}/attn/o_proj/MatMul", [attn, p + "attn.o_proj.MatMul.weight"])
        # Outputs 0 (normalised) and 3 (input + skip, the new residual), as the builder wires them.
        h, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization", f"{n}/post_attention_layernorm/SkipLayerNorm",
            [o, residual, p + "post_attention_layernorm.weight"], n_out=4, domain=MS_DOMAIN,
            epsilon=eps)
        (gate,) = g.node("MatMul", f"{n}/mlp/gate_proj/MatMul", [h, p + "mlp.gate_proj.MatMul.weight"])
        (sig,) = g.node("Sigmoid", f"{n}/mlp/act_fn/Sigmoid", [gate])
        (act,) = g.node("Mul", f"{n}/mlp/act_fn/Mul", [gate, sig])
        (up,) = g.node("MatMul", f"{n}/mlp/up_proj/MatMul", [h, p + "mlp.up_proj.MatMul.weight"])
        (prod,) = g.node("Mul", f"{n}/mlp/Mul", [act, up])
        (down,) = g.node("MatMul", f"{n}/mlp/down_proj/MatMul", [prod, p + "mlp.down_proj.MatMul.weight"])
        if i + 1 < config.layers:
            norm_name, weight = f"/model/layers.{i + 1}/input_layernorm/SkipLayerNorm", \
                f"model.layers.{i + 1}.input_layernorm.weight"
        else:
            norm_name, weight = "/model/norm/SkipLayerNorm", "model.norm.weight"
        h, _, _, residual = g.node("SkipSimplifiedLayerNormalization", norm_name,
                                   [down, residual, weight], n_out=4, domain=MS_DOMAIN, epsilon=eps)
    g.node("MatMul", "/lm_head/MatMul", [h, "lm_head.MatMul.weight"], outputs=["logits"])

    kv_shape = ["batch_size", config.kv_heads, "past_sequence_length", config.head_size]
    present_shape = ["batch_size", config.kv_heads, "total_sequence_length", config.head_size]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", elem, ["batch_size", "sequence_length", config.vocab])]
    for i in range(config.layers):
        for kv in ("key", "value"):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{kv}", elem, kv_shape))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{kv}", elem, present_shape))
    graph = helper.make_graph(g.nodes, "tiny_decoder", inputs, outputs, initializer=g.initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, MS_OPSET)],
                              producer_name="jax_onnx_attn.models.tiny")
    model.ir_version = 10  # what onnxruntime 1.2x reads; onnx 1.23 would write a newer one
    helper.set_model_props(model, {"config": repr(config)})
    return model


__all__ = ["TinyConfig", "build_tiny_decoder", "tiny_weights", "rotary_cache", "encode", "decode",
           "printable_ids", "OPSET", "MS_DOMAIN"]
