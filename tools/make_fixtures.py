"""Make the ONNX decoder fixtures under tests/fixtures/ with the REAL producers.

Each fixture is a tiny, randomly initialised Hugging Face decoder (2 layers, hidden 64, 4 query heads,
2 KV heads, head size 16, vocabulary 320) saved locally together with a byte-level BPE tokenizer
trained here (tokenizer.json + tokenizer_config.json with a small chat template), then exported by

  * onnxruntime-genai's model builder (`python -m onnxruntime_genai.models.builder`, offline) at the
    precisions it offers for CPU/CUDA: fp32 (cpu), fp16 (cuda), int4 and int8 (cpu, MatMulNBits),
    for the llama, qwen2, phi3 (LongRoPE), mistral (sliding_window set) and gemma2 (alternating
    sliding/global layers, softcaps) families, and
  * `torch.onnx.export(dynamo=True)` at opset 20 (fully decomposed) and opset 23 (ai.onnx Attention,
    RotaryEmbedding, RMSNormalization), through a wrapper with flat past/present tensors.

The producers are not test dependencies: CI only reads the committed files. Re-run this script (in an
environment with the producers installed) to regenerate them:

    pip install torch==2.13.0 transformers==5.24.0 onnxruntime-genai==0.18.0 onnxscript
    python tools/make_fixtures.py [--only NAME ...] [--out tests/fixtures]

The tokenizer files alone need only `tokenizers` (pip install tokenizers):

    python tools/make_fixtures.py --tokenizers-only

The same torch export, of any Hugging Face causal LM (the README's route to a real model):

    python tools/make_fixtures.py --export-torch Qwen/Qwen2.5-0.5B-Instruct --out qwen-torch

Every fixture folder gets `model.onnx` (+ `model.onnx.data` where the producer writes external data),
the tokenizer files (so `jax-onnx-attn generate FOLDER --prompt TEXT` works on it) and `fixture.json`
(producer, precision, family, the versions that made it); builder fixtures also keep the builder's
`genai_config.json` (how onnxruntime-genai drives the model: sliding-window layers and their cache
sizes). The output is deterministic: re-running reproduces the files byte for byte.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

# The builder and transformers must never reach the network: the checkpoints are local folders.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["TRANSFORMERS_OFFLINE"] = "1"

ROOT = Path(__file__).resolve().parent.parent
VOCAB = 320
SEED = 1234
#: Sliding window of the windowed families: prompts plus 32 generated tokens cross it, and the
#: window-sized cache onnxruntime-genai gives such layers (WINDOW + 16 rows on CPU, WINDOW on CUDA),
#: in the parity tests.
WINDOW = 8

# Shared decoder shape: small enough that all fixtures together stay a few MB, with GQA (4 q heads on
# 2 kv heads) and head size 16 (GroupQueryAttention's fused rotary needs a multiple of 16).
COMMON = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
              rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2,
              pad_token_id=0)

FAMILIES = {
    "llama": dict(model_type="llama", cls="LlamaForCausalLM", cfg="LlamaConfig", extra=dict(head_dim=16)),
    "qwen2": dict(model_type="qwen2", cls="Qwen2ForCausalLM", cfg="Qwen2Config",
                  extra=dict(use_sliding_window=False)),
    # Long-context Phi-3: LongRoPE makes the builder emit an If choosing the short/long cos/sin caches.
    "phi3": dict(model_type="phi3", cls="Phi3ForCausalLM", cfg="Phi3Config",
                 extra=dict(original_max_position_embeddings=64, pad_token_id=0,
                            rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.05 * i for i in range(8)],
                                          "long_factor": [1.5 + 0.25 * i for i in range(8)]})),
    # Mistral with a sliding window: the builder keys windows on HF's per-layer `layer_types`, which
    # MistralConfig does not have, so every layer is exported as full attention (local_window_size
    # -1) although the HF model itself applies the window (see tests/test_onnx_models.py).
    "mistral": dict(model_type="mistral", cls="MistralForCausalLM", cfg="MistralConfig",
                    extra=dict(head_dim=16, sliding_window=WINDOW)),
    # Gemma-2: layer 0 slides over a window of WINDOW keys (GQA local_window_size with a window-sized
    # cache, sliding_window_cache=1), layer 1 is global; attention and final logit softcapping are
    # set low enough to bite on this model's scores and logits; scale = query_pre_attn_scalar^-0.5.
    "gemma2": dict(model_type="gemma2", cls="Gemma2ForCausalLM", cfg="Gemma2Config",
                   extra=dict(head_dim=16, sliding_window=WINDOW, query_pre_attn_scalar=16,
                              layer_types=["sliding_attention", "full_attention"],
                              attn_logit_softcapping=2.0, final_logit_softcapping=8.0)),
}

# (fixture name, producer, family, precision, execution provider / opset)
FIXTURES = [
    ("builder_llama_fp32", "builder", "llama", "fp32", "cpu"),
    ("builder_llama_fp16", "builder", "llama", "fp16", "cuda"),
    ("builder_llama_int4", "builder", "llama", "int4", "cpu"),
    ("builder_llama_int8", "builder", "llama", "int8", "cpu"),
    ("builder_qwen2_fp32", "builder", "qwen2", "fp32", "cpu"),
    ("builder_qwen2_fp16", "builder", "qwen2", "fp16", "cuda"),
    ("builder_qwen2_int4", "builder", "qwen2", "int4", "cpu"),
    ("builder_phi3_fp32", "builder", "phi3", "fp32", "cpu"),
    ("builder_phi3_fp16", "builder", "phi3", "fp16", "cuda"),
    ("builder_phi3_int4", "builder", "phi3", "int4", "cpu"),
    ("builder_mistral_fp32", "builder", "mistral", "fp32", "cpu"),
    # No mistral fp16/int4: the builder exports mistral without its window, so those graphs are
    # byte-identical to llama's (checked 2026-11-29); builder_mistral_fp32 records that.
    ("builder_gemma2_fp32", "builder", "gemma2", "fp32", "cpu"),
    ("builder_gemma2_fp16", "builder", "gemma2", "fp16", "cuda"),
    ("builder_gemma2_int4", "builder", "gemma2", "int4", "cpu"),
    ("torch_llama_op20", "torch", "llama", "fp32", 20),
    ("torch_llama_op23", "torch", "llama", "fp32", 23),
    ("torch_qwen2_op23", "torch", "qwen2", "fp32", 23),
]


#: Special tokens, ids 0-3 in this order: the checkpoints' pad / bos / eos ids (COMMON) match them.
SPECIAL_TOKENS = ["<pad>", "<s>", "</s>", "<unk>"]
#: A small chat template (role headers between <s> and </s>), so that the chat-template path of
#: `jax-onnx-attn generate --prompt` runs on the fixtures as it does on a real instruct model's export.
CHAT_TEMPLATE = ("{% for message in messages %}{{ bos_token + message['role'] + '\\n' + "
                 "message['content'] + eos_token + '\\n' }}{% endfor %}"
                 "{% if add_generation_prompt %}{{ bos_token + 'assistant\\n' }}{% endif %}")
#: Files the tokenizer consists of (what `write_tokenizer` writes and every fixture keeps).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def train_tokenizer():
    """A byte-level BPE of VOCAB tokens (4 special, 256 bytes, merges) trained on a small generated
    corpus: deterministic, offline, and needs only the `tokenizers` package."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = ("the model reads tokens and writes logits while attention looks back over the cache of "
             "keys and values for every layer in the decoder stack").split()
    corpus = [" ".join(words[(i * 7 + j) % len(words)] for j in range(12)) for i in range(200)]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus, trainer)
    assert tok.get_vocab_size() == VOCAB, tok.get_vocab_size()
    return tok


def write_tokenizer(folder: Path) -> None:
    """tokenizer.json and a tokenizer_config.json (special tokens, chat template) into `folder`, as
    transformers' PreTrainedTokenizerFast.save_pretrained lays them out: the model builder reads
    them from the checkpoint, and every fixture keeps them so `--prompt` works on it."""
    tok = train_tokenizer()
    folder.mkdir(parents=True, exist_ok=True)
    tok.save(str(folder / "tokenizer.json"))
    config = {
        "added_tokens_decoder": {str(i): {"content": t, "lstrip": False, "normalized": False,
                                          "rstrip": False, "single_word": False, "special": True}
                                 for i, t in enumerate(SPECIAL_TOKENS)},
        "bos_token": "<s>",
        "chat_template": CHAT_TEMPLATE,
        "clean_up_tokenization_spaces": False,
        "eos_token": "</s>",
        "extra_special_tokens": {},
        "model_max_length": COMMON["max_position_embeddings"],
        "pad_token": "<pad>",
        "tokenizer_class": "PreTrainedTokenizerFast",
        "unk_token": "<unk>",
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")


def make_checkpoint(family: str, folder: Path) -> None:
    """Save a random HF checkpoint (safetensors + config + tokenizer) of `family` into `folder`."""
    import torch
    import transformers

    spec = FAMILIES[family]
    cfg = getattr(transformers, spec["cfg"])(**{**COMMON, **spec["extra"]})
    torch.manual_seed(SEED)
    model = getattr(transformers, spec["cls"])(cfg).eval()
    with torch.no_grad():
        # HF initialises with std 0.02, which leaves the logits of a 2-layer model almost flat; a
        # wider spread keeps greedy decoding away from near-ties so parity tests are meaningful.
        for name, p in model.named_parameters():
            if p.ndim >= 2:
                p.normal_(0.0, 0.15)
            elif "bias" in name:
                p.normal_(0.0, 0.1)
            else:  # norm weights: around their neutral value (1 for RMSNorm, 0 for Gemma's 1+w)
                p.add_(torch.randn_like(p) * 0.1)
    model.save_pretrained(folder, safe_serialization=True)
    write_tokenizer(folder)


def run_builder(ckpt: Path, out: Path, precision: str, ep: str) -> None:
    cache = out.parent / (out.name + "_cache")
    cmd = [sys.executable, "-m", "onnxruntime_genai.models.builder", "-i", str(ckpt), "-o", str(out),
           "-p", precision, "-e", ep, "-c", str(cache)]
    subprocess.run(cmd, check=True, env={**os.environ, "HF_HUB_OFFLINE": "1"})
    shutil.rmtree(cache, ignore_errors=True)


class _FlatPast:
    """Wraps a HF causal LM so that the exported graph has flat past/present tensors.

    Inputs: input_ids [B, S] int64, attention_mask [B, P+S] int64, position_ids [B, S] int64,
    past_key_values.{i}.key/value [B, Hkv, P, D]. Outputs: logits [B, S, V], present.{i}.key/value.
    The names follow the builder's (and optimum's) convention.
    """

    @staticmethod
    def module(model, num_layers: int):
        import torch
        from transformers import DynamicCache

        class Wrapper(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.model = model

            def forward(self, input_ids, attention_mask, position_ids, *past):
                cache = DynamicCache(config=model.config)
                for i in range(num_layers):
                    cache.update(past[2 * i], past[2 * i + 1], i)
                out = self.model(input_ids=input_ids, attention_mask=attention_mask,
                                 position_ids=position_ids, past_key_values=cache, use_cache=True)
                flat = []
                for layer in out.past_key_values.layers:
                    flat += [layer.keys, layer.values]
                return (out.logits, *flat)

        return Wrapper()


def run_torch_export(ckpt: Path | str, out: Path, opset: int, external_data: bool = False) -> None:
    """torch.onnx.export(dynamo=True) of the causal LM at `ckpt` (a folder or a Hub id) into
    out/model.onnx with flat past/present I/O (_FlatPast); external_data writes the weights to
    model.onnx.data (needed past protobuf's 2 GB)."""
    import torch
    import transformers

    cfg = transformers.AutoConfig.from_pretrained(ckpt)
    # SDPA attention is what torchlib maps onto ai.onnx Attention at opset >= 23; at opset 20 it is
    # decomposed into MatMul/Softmax like every other op.
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, attn_implementation="sdpa",
                                                              dtype=torch.float32).eval()
    n_layers, hkv = cfg.num_hidden_layers, cfg.num_key_value_heads
    d = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    b, s, p = 2, 3, 5
    past = []
    for _ in range(2 * n_layers):
        past.append(torch.randn(b, hkv, p, d))
    args = (torch.randint(0, cfg.vocab_size, (b, s)), torch.ones(b, p + s, dtype=torch.int64),
            torch.arange(p, p + s).repeat(b, 1), *past)
    names_in = ["input_ids", "attention_mask", "position_ids"]
    names_out = ["logits"]
    for i in range(n_layers):
        names_in += [f"past_key_values.{i}.key", f"past_key_values.{i}.value"]
        names_out += [f"present.{i}.key", f"present.{i}.value"]
    # Dim.DYNAMIC lets torch.export relate the mask length to past + seq itself.
    dyn_dim = torch.export.Dim.DYNAMIC
    # The wrapper's *past is one positional tuple for torch.export.
    dyn = ({0: dyn_dim, 1: dyn_dim},) * 3 + (tuple({0: dyn_dim, 2: dyn_dim} for _ in past),)
    wrapper = _FlatPast.module(model, n_layers)
    with torch.no_grad():
        prog = torch.onnx.export(wrapper, args, dynamo=True, opset_version=opset, input_names=names_in,
                                 output_names=names_out, dynamic_shapes=dyn, optimize=True,
                                 external_data=False)
    out.mkdir(parents=True, exist_ok=True)
    prog.save(str(out / "model.onnx"), external_data=external_data)


def export_torch(model: str, out: Path, opset: int) -> None:
    """The README's torch route: export a Hugging Face causal LM (Hub id or local folder) as the
    torch fixtures are exported, weights in model.onnx.data, with its tokenizer (tokenizer.json,
    tokenizer_config.json / chat template) and generation_config.json (eos ids) beside it."""
    import transformers

    os.environ.pop("HF_HUB_OFFLINE", None)  # a Hub id may need the network here
    os.environ.pop("TRANSFORMERS_OFFLINE", None)
    run_torch_export(model, out, opset, external_data=True)
    transformers.AutoTokenizer.from_pretrained(model).save_pretrained(out)
    try:
        transformers.GenerationConfig.from_pretrained(model).save_pretrained(out)
    except OSError:  # a checkpoint without generation_config.json: eos then comes from the tokenizer
        pass


def versions() -> dict:
    out = {}
    for mod in ("torch", "transformers", "onnxruntime_genai", "onnxscript", "onnx"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a producer that is absent simply is not listed
            pass
    return out


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures"))
    ap.add_argument("--only", nargs="*", help="fixture names to (re)make; default all")
    ap.add_argument("--tokenizers-only", action="store_true",
                    help="only (re)write each fixture's tokenizer files (needs just `tokenizers`)")
    ap.add_argument("--export-torch", metavar="MODEL",
                    help="instead of the fixtures: export this Hugging Face causal LM (Hub id or "
                         "folder) with torch.onnx.export into --out, with its tokenizer")
    ap.add_argument("--opset", type=int, default=23, choices=(20, 23),
                    help="opset of --export-torch (23: ai.onnx Attention; 20: decomposed)")
    args = ap.parse_args(argv)
    if args.export_torch:
        if args.out == ap.get_default("out"):
            ap.error("--export-torch needs --out DIR (not the fixtures folder)")
        export_torch(args.export_torch, Path(args.out), args.opset)
        print(f"exported {args.export_torch} to {args.out}: jax-onnx-attn generate {args.out} "
              "--prompt TEXT", flush=True)
        return
    out_root = Path(args.out)
    wanted = [f for f in FIXTURES if not args.only or f[0] in args.only]
    if args.tokenizers_only:
        for name, *_ in wanted:
            write_tokenizer(out_root / name)
            print(f"{name}: {', '.join(TOKENIZER_FILES)}", flush=True)
        return
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        ckpts: dict[str, Path] = {}
        for name, producer, family, precision, target in wanted:
            if family not in ckpts:
                ckpts[family] = tmp / f"hf_{family}"
                make_checkpoint(family, ckpts[family])
            dest = out_root / name
            shutil.rmtree(dest, ignore_errors=True)
            work = tmp / name
            if producer == "builder":
                run_builder(ckpts[family], work, precision, target)
                dest.mkdir(parents=True)
                # genai_config.json says how onnxruntime-genai drives the model (cache sizes of
                # sliding-window layers); the parity tests' onnxruntime loop follows it.
                for f in ("model.onnx", "model.onnx.data", "genai_config.json"):
                    if (work / f).exists():
                        shutil.copy(work / f, dest / f)
            else:
                run_torch_export(ckpts[family], dest, target)
            # The checkpoint's tokenizer, as an export folder carries it (the builder copies it into
            # its output; a torch.onnx.export user saves it beside the model).
            for f in TOKENIZER_FILES:
                shutil.copy(ckpts[family] / f, dest / f)
            meta = dict(producer=producer, family=family, precision=precision,
                        target=target, versions=versions())
            (dest / "fixture.json").write_text(json.dumps(meta, indent=1) + "\n")
            size = sum(f.stat().st_size for f in dest.iterdir())
            print(f"{name}: {size / 1e6:.2f} MB", flush=True)


if __name__ == "__main__":
    main()
