"""Decoders in the exact graph shape of onnxruntime-genai's model builder (0.18, llama family).

    input_ids int64 [batch_size, sequence_length]
    attention_mask int64 [batch_size, total_sequence_length]
    past_key_values.N.key / .value  T [batch_size, kv_heads, past_sequence_length, kv_cache_dim]
      -> logits T [batch_size, sequence_length, vocab]
         present.N.key / .value  T [batch_size, kv_heads, total_sequence_length, kv_cache_dim]

    Constant /model/constants/INT64/[1] and /1; attention-mask subgraph:
      seqlens_k = int32(ReduceSum(mask, [1]) - [1]), total_sequence_length = int32(Shape(mask)[1])
    Gather(embed) -> SimplifiedLayerNormalization (layer 0's input norm) -> per layer i:
        qkv_proj MatMul (or com.microsoft::MatMulNBits ..._Q4 / _Q8) -> GroupQueryAttention
        (packed QKV, do_rotary=1, cos/sin caches) -> o_proj -> SkipSimplifiedLayerNormalization
        (post-attention; inputs residual, o_proj) -> gate / up -> SiLU as Sigmoid * Mul -> Mul ->
        down -> SkipSimplifiedLayerNormalization (layer i+1's input norm, or
        /model/layers.L/final_norm_layernorm with its one output)
    -> /lm_head/MatMul (or MatMulNBits) -> logits

T is the config's dtype (float32, float16 or bfloat16). Quantised models replace every MatMul but the
embedding's Gather by MatMulNBits (K, N, bits, block_size, accuracy_level unless 0) with inputs
name_Q{bits}, name_scales (and name_zero_points). Names of nodes, values and initializers are the
builder's, so anything keyed on them (our lowering, roofline, the e2e bench's peers) sees a real
export. `tests/test_models_builder.py` checks the structure against tests/fixtures/builder_llama_*.

Three ways to get a model:
  * `build_decoder(config)`: an in-memory ModelProto with its weights inline (< 2 GB);
  * `save_decoder(config, folder)`: model.onnx + model.onnx.data (+ genai_config.json) as the builder
    writes them, the weights streamed to the data file one tensor at a time (never two copies);
  * `ensure_model(config, root)`: save_decoder into root/<name>-<weights>, reused while the
    config stamp written beside it matches.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from pathlib import Path
from typing import Callable, Iterable

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from jax_onnx_attn.models.config import DecoderConfig
from jax_onnx_attn.models.weights import WeightMaker

#: Opsets of the builder's graphs.
OPSET = 22
MS_DOMAIN = "com.microsoft"
MS_OPSET = 1
#: producer_name of byte-level models (the CLI reads it to pick the byte tokenizer).
BYTE_PRODUCER = "jax_onnx_attn.models.tiny"
#: producer_name of the other models.
PRODUCER = "jax_onnx_attn.models.builder"
#: The protobuf limit: a model with more initializer bytes needs external data.
PROTO_LIMIT = 2 ** 31 - 1
#: Tensors of at least this many bytes start at a multiple of ALIGN in the data file (onnx's rule).
ALIGN_THRESHOLD = 1 << 20
ALIGN = 1 << 16
DATA_FILE = "model.onnx.data"
MODEL_FILE = "model.onnx"
STAMP_FILE = "jax_onnx_attn_model.json"
#: Default folder of `ensure_model`'s cached models.
DEFAULT_ROOT = Path(os.environ.get("JOA_MODELS_DIR", "/tmp/joa-models"))


class _Graph:
    """Collects nodes with builder-style names (/model/layers.0/attn/...)."""

    def __init__(self):
        self.nodes: list[onnx.NodeProto] = []

    def node(self, op: str, name: str, inputs, n_out: int = 1, domain: str = "", outputs=None,
             **attrs) -> list[str]:
        outputs = outputs or [f"{name}/output_{i}" for i in range(n_out)]
        self.nodes.append(helper.make_node(op, list(inputs), outputs, name=name, domain=domain, **attrs))
        return outputs


def _constant(g: _Graph, label: str, value: np.ndarray) -> str:
    """A Constant node as the builder writes shared constants (/model/constants/INT64/<label>)."""
    out = f"/model/constants/INT64/{label}"
    tensor = numpy_helper.from_array(np.asarray(value, np.int64), out)
    g.node("Constant", f"/model/constant_nodes/INT64/{label}", [], outputs=[out], value=tensor)
    return out


def _graph_nodes(config: DecoderConfig) -> list[onnx.NodeProto]:
    """Every node of the decoder graph (see the module docstring)."""
    c = config
    g = _Graph()
    one_vec = _constant(g, "[1]", np.array([1]))
    m = "/model/attn_mask_reformat/attn_mask_subgraph"
    (mask_sum,) = g.node("ReduceSum", f"{m}/ReduceSum", ["attention_mask", one_vec], keepdims=0)
    (seqlens,) = g.node("Sub", f"{m}/Sub", [mask_sum, one_vec])
    (seqlens_k,) = g.node("Cast", f"{m}/Sub/Cast", [seqlens], to=TensorProto.INT32)
    (mask_shape,) = g.node("Shape", f"{m}/Shape", ["attention_mask"])
    one = _constant(g, "1", np.array(1))
    (total,) = g.node("Gather", f"{m}/Gather", [mask_shape, one], axis=0)
    (total_len,) = g.node("Cast", f"{m}/Gather/Cast", [total], to=TensorProto.INT32)

    def matmul(x, where, weight, outputs=None):
        """A projection: MatMul, or MatMulNBits named as onnxruntime's quantiser names it."""
        outs = outputs or [f"{where}/MatMul/output_0"]
        if not c.weight_bits:
            return g.node("MatMul", f"{where}/MatMul", [x, weight], outputs=outs)[0]
        k, n = c.linear_shapes()[weight]
        inputs = [x, f"{weight}_Q{c.weight_bits}", f"{weight}_scales"]
        if c.zero_points:
            inputs.append(f"{weight}_zero_points")
        attrs = dict(K=k, N=n, bits=c.weight_bits, block_size=c.block_size)
        if c.level:
            attrs["accuracy_level"] = c.level
        return g.node("MatMulNBits", f"{where}/MatMul_Q{c.weight_bits}", inputs, domain=MS_DOMAIN,
                      outputs=outs, **attrs)[0]

    eps = float(np.float32(c.rms_eps))
    (x,) = g.node("Gather", "/model/embed_tokens/Gather", ["model.embed_tokens.weight", "input_ids"])
    (h,) = g.node("SimplifiedLayerNormalization", "/model/layers.0/input_layernorm/LayerNorm",
                  [x, "model.layers.0.input_layernorm.weight"],
                  outputs=["/model/layers.0/input_layernorm/output_0"], axis=-1, epsilon=eps, stash_type=1)
    residual = x
    for i in range(c.layers):
        p, n = f"model.layers.{i}.", f"/model/layers.{i}"
        qkv = matmul(h, f"{n}/attn/qkv_proj", p + "attn.qkv_proj.MatMul.weight")
        attn, _, _ = g.node(
            "GroupQueryAttention", f"{n}/attn/GroupQueryAttention",
            [qkv, "", "", f"past_key_values.{i}.key", f"past_key_values.{i}.value", seqlens_k,
             total_len, "cos_cache", "sin_cache", "", "", ""],
            domain=MS_DOMAIN,
            outputs=[f"{n}/attn/GroupQueryAttention/output_0", f"present.{i}.key", f"present.{i}.value"],
            num_heads=c.heads, kv_num_heads=c.kv_heads, scale=float(1.0 / np.sqrt(c.head_size)),
            local_window_size=-1, softcap=0.0, do_rotary=1, rotary_interleaved=0)
        o = matmul(attn, f"{n}/attn/o_proj", p + "attn.o_proj.MatMul.weight")
        # Outputs 0 (normalised) and 3 (input + skip: the new residual), as the builder wires them.
        where = f"{n}/post_attention_layernorm"
        h, _, _, residual = g.node(
            "SkipSimplifiedLayerNormalization", f"{where}/SkipLayerNorm",
            [residual, o, p + "post_attention_layernorm.weight"], domain=MS_DOMAIN,
            outputs=[f"{where}/output_0", "", "", f"{where}/output_3"], epsilon=eps)
        gate = matmul(h, f"{n}/mlp/gate_proj", p + "mlp.gate_proj.MatMul.weight")
        up = matmul(h, f"{n}/mlp/up_proj", p + "mlp.up_proj.MatMul.weight")
        (sig,) = g.node("Sigmoid", f"{n}/mlp/act_fn/Sigmoid", [gate])
        (act,) = g.node("Mul", f"{n}/mlp/act_fn/Mul", [gate, sig])
        (prod,) = g.node("Mul", f"{n}/mlp/Mul", [act, up])
        down = matmul(prod, f"{n}/mlp/down_proj", p + "mlp.down_proj.MatMul.weight")
        if i + 1 < c.layers:
            where = f"/model/layers.{i + 1}/input_layernorm"
            h, _, _, residual = g.node(
                "SkipSimplifiedLayerNormalization", f"{where}/SkipLayerNorm",
                [residual, down, f"model.layers.{i + 1}.input_layernorm.weight"], domain=MS_DOMAIN,
                outputs=[f"{where}/output_0", "", "", f"{where}/output_3"], epsilon=eps)
        else:
            where = f"/model/layers.{c.layers}/final_norm_layernorm"
            (h,) = g.node("SkipSimplifiedLayerNormalization", f"{where}/SkipLayerNorm",
                          [residual, down, f"model.layers.{c.layers}.final_norm_layernorm.weight"],
                          domain=MS_DOMAIN, outputs=[f"{where}/output_0"], epsilon=eps)
    matmul(h, "/lm_head", "lm_head.MatMul.weight", outputs=["logits"])
    return g.nodes


def _model(config: DecoderConfig, initializers: list[onnx.TensorProto]) -> onnx.ModelProto:
    c = config
    kv = ["batch_size", c.kv_heads, "past_sequence_length", "kv_cache_dim"]
    present = ["batch_size", c.kv_heads, "total_sequence_length", "kv_cache_dim"]
    inputs = [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch_size", "sequence_length"]),
              helper.make_tensor_value_info("attention_mask", TensorProto.INT64,
                                            ["batch_size", "total_sequence_length"])]
    outputs = [helper.make_tensor_value_info("logits", c.onnx_type, ["batch_size", "sequence_length", c.vocab])]
    for which in ("key", "value"):  # every layer's keys, then every layer's values (the builder's order)
        for i in range(c.layers):
            inputs.append(helper.make_tensor_value_info(f"past_key_values.{i}.{which}", c.onnx_type, kv))
            outputs.append(helper.make_tensor_value_info(f"present.{i}.{which}", c.onnx_type, present))
    graph = helper.make_graph(_graph_nodes(c), "main_graph", inputs, outputs, initializer=initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET),
                                                    helper.make_opsetid(MS_DOMAIN, MS_OPSET)],
                              producer_name=BYTE_PRODUCER if c.byte_level else PRODUCER)
    model.ir_version = 10  # the builder's (what onnxruntime 1.2x reads)
    helper.set_model_props(model, {"config": repr(c)})
    return model


def _tensor(name: str, array: np.ndarray, onnx_type: int | None = None) -> onnx.TensorProto:
    """A TensorProto of `array` (bfloat16 arrays as raw bytes of the BFLOAT16 type)."""
    if array.dtype.name == "bfloat16":
        t = TensorProto(name=name, data_type=TensorProto.BFLOAT16, dims=list(array.shape))
        t.raw_data = np.ascontiguousarray(array).tobytes()
        return t
    return numpy_helper.from_array(np.ascontiguousarray(array), name)


def _onnx_type(array: np.ndarray) -> int:
    if array.dtype.name == "bfloat16":
        return TensorProto.BFLOAT16
    return helper.np_dtype_to_tensor_dtype(array.dtype)


def build_decoder(config: DecoderConfig | None = None, **overrides) -> onnx.ModelProto:
    """The decoder of `config` (keyword overrides replace its fields) as an in-memory ModelProto with
    inline weights. Raises ValueError for a model of 2 GB or more: use `save_decoder`."""
    config = dataclasses.replace(config or DecoderConfig(), **overrides)
    if config.file_bytes() >= PROTO_LIMIT:
        raise ValueError(f"{config.name}: {config.file_bytes() / 1e9:.2f} GB of weights do not fit an "
                         "in-memory ONNX proto (2 GB); write it with save_decoder(config, folder)")
    inits = [_tensor(name, arr) for name, arr in WeightMaker(config).initializers()]
    return _model(config, inits)


def genai_config(config: DecoderConfig) -> dict:
    """onnxruntime-genai's genai_config.json for the model, as the builder writes it."""
    c = config
    provider = [] if c.dtype == "float32" else [{"cuda": {"enable_cuda_graph": "0"}}]
    return {
        "model": {
            "bos_token_id": 1, "context_length": c.max_positions,
            "decoder": {
                "session_options": {"log_id": "onnxruntime-genai", "provider_options": provider},
                "filename": MODEL_FILE, "head_size": c.head_size, "hidden_size": c.hidden,
                "inputs": {"input_ids": "input_ids", "attention_mask": "attention_mask",
                           "past_key_names": "past_key_values.%d.key",
                           "past_value_names": "past_key_values.%d.value"},
                "outputs": {"logits": "logits", "present_key_names": "present.%d.key",
                            "present_value_names": "present.%d.value"},
                "num_attention_heads": c.heads, "num_hidden_layers": c.layers,
                "num_key_value_heads": c.kv_heads},
            "eos_token_id": 2, "pad_token_id": 0, "type": "llama", "vocab_size": c.vocab},
        "search": {"diversity_penalty": 0.0, "do_sample": False, "early_stopping": True,
                   "length_penalty": 1.0, "max_length": c.max_positions, "min_length": 0,
                   "no_repeat_ngram_size": 0, "num_beams": 1, "num_return_sequences": 1,
                   "past_present_share_buffer": True, "repetition_penalty": 1.0, "temperature": 1.0,
                   "top_k": 50, "top_p": 1.0},
    }


def _write_external(tensors: Iterable[tuple[str, np.ndarray]], data_path: Path,
                    progress: Callable[[int], None] | None = None) -> list[onnx.TensorProto]:
    """Stream `tensors` into `data_path`; returns their TensorProtos pointing into it."""
    protos = []
    offset = 0
    with open(data_path, "wb") as f:
        for name, array in tensors:
            array = np.ascontiguousarray(array)
            nbytes = array.nbytes
            if nbytes >= ALIGN_THRESHOLD and offset % ALIGN:
                pad = ALIGN - offset % ALIGN
                f.write(b"\0" * pad)
                offset += pad
            f.write(array.reshape(-1).view(np.uint8).data)
            t = TensorProto(name=name, data_type=_onnx_type(array), dims=list(array.shape))
            t.data_location = TensorProto.EXTERNAL
            for key, value in (("location", data_path.name), ("offset", str(offset)),
                               ("length", str(nbytes))):
                entry = t.external_data.add()
                entry.key, entry.value = key, value
            protos.append(t)
            offset += nbytes
            if progress is not None:
                progress(nbytes)
    return protos


def save_decoder(config: DecoderConfig, folder: str | os.PathLike, *, progress: bool | None = None
                 ) -> Path:
    """Write the decoder of `config` into `folder` as the builder does: model.onnx (graph only),
    model.onnx.data (every initializer, tensors of >= 1 MB aligned to 64 KB) and genai_config.json.
    Weights are made and written one tensor at a time. Returns the path of model.onnx.

    progress: a tqdm bar over the bytes written (None: when stderr is a terminal).
    """
    from tqdm.auto import tqdm

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    if progress is None:
        progress = os.isatty(2) and not os.environ.get("CI")
    with tqdm(total=config.file_bytes(), unit="B", unit_scale=True, disable=not progress,
              desc=f"making {config.name} {config.weights_label}", leave=False) as bar:
        inits = _write_external(WeightMaker(config).initializers(), folder / DATA_FILE, bar.update)
    model = _model(config, inits)
    onnx.save(model, str(folder / MODEL_FILE))
    (folder / "genai_config.json").write_text(json.dumps(genai_config(config), indent=4) + "\n")
    return folder / MODEL_FILE


def model_dirname(config: DecoderConfig) -> str:
    """<name>-<weights label>[-<dtype> when weights are quantised]-s<seed>: the cache folder's name."""
    label = config.weights_label
    if config.weight_bits:
        label += f"-{config.dtype}"
    return f"{config.name}-{label}-s{config.seed}"


def _stamp(config: DecoderConfig) -> dict:
    from jax_onnx_attn.models import weights
    return {"config": dataclasses.asdict(config), "format": 1,
            "pool": [weights.POOL_SIZE, weights.WINDOW]}


def ensure_model(config: DecoderConfig, root: str | os.PathLike | None = None, *,
                 progress: bool | None = None) -> tuple[Path, float]:
    """The model.onnx of `config` under root/model_dirname(config), made by `save_decoder` unless a
    complete copy with the same config is there. Returns (path, seconds spent making it: 0 when
    reused). The folder is written under a temporary name and renamed when complete."""
    root = Path(root) if root is not None else DEFAULT_ROOT
    folder = root / model_dirname(config)
    stamp = folder / STAMP_FILE
    if stamp.exists():
        try:
            if json.loads(stamp.read_text()) == _stamp(config) and (folder / MODEL_FILE).exists():
                return folder / MODEL_FILE, 0.0
        except ValueError:
            pass
    t0 = time.perf_counter()
    tmp = root / (folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    save_decoder(config, tmp, progress=progress)
    (tmp / STAMP_FILE).write_text(json.dumps(_stamp(config), indent=1))
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder / MODEL_FILE, time.perf_counter() - t0


__all__ = ["build_decoder", "save_decoder", "ensure_model", "genai_config", "model_dirname", "OPSET",
           "MS_DOMAIN", "PRODUCER", "BYTE_PRODUCER", "DEFAULT_ROOT", "MODEL_FILE", "DATA_FILE"]
