"""The `jax-onnx-attn` command.

  jax-onnx-attn demo                      build the embedded tiny decoder and generate from it
  jax-onnx-attn generate MODEL --ids 1,2  generate from any supported decoder (token ids in and out)
  jax-onnx-attn parity MODEL --ids 1,2    compare logits and greedy tokens with onnxruntime CPU

MODEL is an .onnx file or a folder holding one (e.g. onnxruntime-genai builder output with
genai_config.json and tokenizer.json beside model.onnx).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TINY_PRODUCER = "jax_onnx_attn.models.tiny"
DTYPES = ("float32", "float16", "bfloat16")


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


# --------------------------------------------------------------------------------------------------
# Models, tokenizers, prompts

def _model_file(path: str) -> Path:
    p = Path(path)
    if p.is_dir():
        candidates = [p / "model.onnx"] if (p / "model.onnx").exists() else sorted(p.glob("*.onnx"))
        if len(candidates) != 1:
            raise CliError(f"{p} holds {len(candidates)} .onnx files; name the model file")
        p = candidates[0]
    if not p.exists():
        raise CliError(f"no model at {p}")
    return p


class _Tokenizer:
    """encode / decode for --prompt: the tiny model's bytes, or tokenizer.json via `tokenizers`."""

    def __init__(self, encode, decode, name):
        self.encode, self.decode, self.name = encode, decode, name


def _tokenizer(model_file: Path, required: bool) -> _Tokenizer | None:
    import onnx

    producer = onnx.load(str(model_file), load_external_data=False).producer_name
    if producer == TINY_PRODUCER:
        from jax_onnx_attn.models import tiny

        return _Tokenizer(tiny.encode, tiny.decode, "byte-level (tiny model)")
    path = model_file.parent / "tokenizer.json"
    if not path.exists():
        if required:
            raise CliError(f"--prompt needs a tokenizer.json next to the model ({path} is missing); "
                           "pass token ids with --ids instead")
        return None
    try:
        from tokenizers import Tokenizer
    except ImportError:
        if required:
            raise CliError(f"--prompt reads {path} with the `tokenizers` package, which is not "
                           "installed (pip install tokenizers); or pass token ids with --ids") from None
        return None
    tok = Tokenizer.from_file(str(path))
    return _Tokenizer(lambda text: tok.encode(text).ids, lambda ids: tok.decode(list(ids)), str(path))


def _parse_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.replace(" ", ",").split(",") if t]
    except ValueError:
        raise CliError(f"--ids takes comma-separated integers, got {text!r}") from None
    if not ids:
        raise CliError("--ids is empty")
    return ids


def _prompts(args, model_file: Path) -> tuple[list[list[int]], _Tokenizer | None]:
    if bool(args.ids) == bool(args.prompt):
        raise CliError("give the prompt as --ids 1,2,3 or as --prompt TEXT (either may repeat, one "
                       "row each)")
    tok = _tokenizer(model_file, required=bool(args.prompt))
    if args.ids:
        return [_parse_ids(t) for t in args.ids], tok
    prompts = [tok.encode(t) for t in args.prompt]
    if not all(prompts):
        raise CliError("a --prompt encodes to no tokens")
    return prompts, tok


def _genai_config(model_file: Path) -> dict:
    path = model_file.parent / "genai_config.json"
    if path.exists():
        try:
            return json.loads(path.read_text())
        except json.JSONDecodeError as e:
            raise CliError(f"{path} is not valid JSON: {e}") from None
    return {}


def _default_stop_tokens(model_file: Path) -> list[int]:
    """eos_token_id from onnxruntime-genai's genai_config.json (an int or a list), if present."""
    eos = _genai_config(model_file).get("model", {}).get("eos_token_id", [])
    return [int(t) for t in (eos if isinstance(eos, list) else [eos])]


def _dtype(name: str | None):
    if name is None:
        return None
    import jax.numpy as jnp

    return jnp.dtype(name)


# --------------------------------------------------------------------------------------------------
# Output

def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _print_timings(t, out) -> None:
    print(f"prefill: {t.prompt_tokens} prompt tokens in {_ms(t.prefill_s)}; "
          f"decode: {t.new_tokens - t.rows} tokens in {_ms(t.decode_s)} "
          f"({t.decode_tokens_per_s:.1f} tokens/s)", file=out)
    print(f"throughput: {t.new_tokens} new tokens in {_ms(t.total_s)} = {t.tokens_per_s:.1f} tokens/s "
          f"(compile {_ms(t.compile_s)}, not counted)", file=out)


def _print_rows(result, tok, out) -> None:
    for i, (prompt, tokens, reason) in enumerate(zip(result.prompts, result.tokens,
                                                     result.finish_reasons)):
        head = f"[{i}] " if len(result.prompts) > 1 else ""
        if tok is not None:
            print(f"{head}prompt: {tok.decode(prompt)!r} ({len(prompt)} tokens)", file=out)
        else:
            print(f"{head}prompt ids: {','.join(map(str, prompt))}", file=out)
        print(f"{head}generated ids ({len(tokens)}, finish: {reason}): {','.join(map(str, tokens))}",
              file=out)
        if tok is not None:
            print(f"{head}text: {tok.decode(tokens)!r}", file=out)


def _sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, seed=args.seed)


# --------------------------------------------------------------------------------------------------
# Commands

def cmd_demo(args, out) -> int:
    """`demo`: build the tiny decoder from `args`, generate from --prompt, print to `out`; 0."""
    from jax_onnx_attn.models import tiny
    from jax_onnx_attn.runtime import DecoderSession, describe_backend

    try:
        config = tiny.TinyConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 kv_heads=args.kv_heads, dtype=args.dtype, seed=args.model_seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    model = tiny.build_tiny_decoder(config)
    print(f"model: embedded tiny decoder ({config.layers} layers, hidden {config.hidden}, "
          f"{config.heads} heads / {config.kv_heads} KV heads, vocab {config.vocab}, {config.dtype}; "
          f"random weights, seed {config.seed})", file=out)
    if args.save:
        import onnx

        path = Path(args.save)
        path.mkdir(parents=True, exist_ok=True)
        onnx.save(model, str(path / "model.onnx"))
        print(f"saved: {path / 'model.onnx'} (try: jax-onnx-attn parity {path / 'model.onnx'} "
              f"--prompt 'Hello')", file=out)
    prompt = tiny.encode(args.prompt)
    if not prompt:
        raise CliError("--prompt is empty")
    t0 = time.perf_counter()
    session = DecoderSession(model, max_length=len(prompt) + args.max_new_tokens + 1, batch=1)
    load_s = time.perf_counter() - t0
    print(f"backend: {describe_backend()}", file=out)
    print(f"loaded and lowered in {_ms(load_s)}", file=out)
    result = session.generate([prompt], args.max_new_tokens, progress=args.progress,
                              **_sampling_kwargs(args))
    _print_rows(result, _Tokenizer(tiny.encode, tiny.decode, "bytes"), out)
    _print_timings(result.timings, out)
    return 0


def cmd_generate(args, out) -> int:
    """`generate`: load args.model, generate from its prompts (one row each), print to `out`; 0."""
    from jax_onnx_attn.runtime import DecoderSession, describe_backend

    model_file = _model_file(args.model)
    prompts, tok = _prompts(args, model_file)
    stop = [int(t) for t in args.stop.split(",") if t] if args.stop is not None else \
        _default_stop_tokens(model_file)
    longest = max(map(len, prompts))
    max_length = args.max_length or longest + args.max_new_tokens + 1
    if longest >= max_length:
        raise CliError(f"--max-length {max_length} leaves no room after a prompt of {longest} tokens")
    t0 = time.perf_counter()
    session = DecoderSession(str(model_file), max_length=max_length, batch=args.batch or len(prompts),
                             dtype=_dtype(args.dtype))
    print(f"model: {model_file} (loaded and lowered in {_ms(time.perf_counter() - t0)})", file=out)
    print(f"backend: {describe_backend()}", file=out)
    if stop:
        print(f"stop tokens: {','.join(map(str, stop))}", file=out)
    result = session.generate(prompts, args.max_new_tokens, stop_tokens=stop, progress=args.progress,
                              **_sampling_kwargs(args))
    _print_rows(result, tok, out)
    _print_timings(result.timings, out)
    return 0


def cmd_parity(args, out) -> int:
    """`parity`: logits and greedy tokens vs onnxruntime CPU for one prompt; 0 agree, 1 differ."""
    from jax_onnx_attn.runtime import compare_with_onnxruntime, describe_backend

    model_file = _model_file(args.model)
    prompts, tok = _prompts(args, model_file)
    if len(prompts) != 1:
        raise CliError("parity compares one prompt at a time")
    print(f"model: {model_file}", file=out)
    print(f"backend: {describe_backend()}; oracle: onnxruntime CPU", file=out)
    report = compare_with_onnxruntime(str(model_file), prompts[0], args.max_new_tokens,
                                      dtype=_dtype(args.dtype))
    for line in report.lines():
        print(line, file=out)
    if tok is not None:
        print(f"onnxruntime text: {tok.decode(report.ort_tokens)!r}", file=out)
        print(f"jax_onnx_attn text: {tok.decode(report.jax_tokens)!r}", file=out)
    return 0 if report.ok else 1


# --------------------------------------------------------------------------------------------------
# Parser

def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int, default=0, help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus mass to keep (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampler seed")


def _add_prompt(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file, or a folder with one (model.onnx)")
    p.add_argument("--ids", action="append", help="prompt token ids, comma-separated (repeat for rows)")
    p.add_argument("--prompt", action="append",
                   help="prompt text, encoded with tokenizer.json beside the model (needs the "
                        "`tokenizers` package) or the tiny model's bytes (repeat for rows)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype on the jax side (default: the model's)")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `jax-onnx-attn` and its demo / generate / parity subcommands."""
    parser = argparse.ArgumentParser(
        prog="jax-onnx-attn",
        description="ONNX decoder models as jitted JAX, with attention on our own kernels.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    demo = sub.add_parser("demo", help="generate from the embedded tiny decoder (no download)",
                          description="Build the embedded tiny decoder (random weights, byte-level "
                                      "vocabulary) and generate from it.")
    demo.add_argument("--prompt", default="Hello, JAX!", help="prompt text (UTF-8 bytes are the tokens)")
    demo.add_argument("--max-new-tokens", type=int, default=48)
    demo.add_argument("--layers", type=int, default=2)
    demo.add_argument("--hidden", type=int, default=64)
    demo.add_argument("--heads", type=int, default=4)
    demo.add_argument("--kv-heads", type=int, default=2)
    demo.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    demo.add_argument("--model-seed", type=int, default=0, help="seed of the random weights")
    demo.add_argument("--save", metavar="DIR", help="also write the model to DIR/model.onnx")
    _add_sampling(demo)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate from an ONNX decoder",
                         description="Generate from an ONNX decoder; token ids in (--ids) or text "
                                     "(--prompt), token ids out.")
    _add_prompt(gen)
    gen.add_argument("--max-new-tokens", type=int, default=32)
    gen.add_argument("--max-length", type=int, help="KV-cache capacity per row (default: longest "
                                                    "prompt + max-new-tokens + 1)")
    gen.add_argument("--batch", type=int, help="rows per call (default: the number of prompts)")
    gen.add_argument("--stop", help="stop token ids, comma-separated (default: eos_token_id from "
                                    "genai_config.json; '' for none)")
    _add_sampling(gen)
    gen.set_defaults(func=cmd_generate)

    par = sub.add_parser("parity", help="compare logits and greedy tokens with onnxruntime CPU",
                         description="Run the model in onnxruntime CPU and in jax_onnx_attn on one "
                                     "prompt; print the logits' max abs difference and the first "
                                     "divergent greedy token. Exit status 1 on a mismatch.")
    _add_prompt(par)
    par.add_argument("--max-new-tokens", type=int, default=16)
    par.set_defaults(func=cmd_parity)

    for p in (demo, gen, par):
        p.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                       help="no progress bar (default: shown on a terminal)")
    return parser


def main(argv: Sequence[str] | None = None, out=None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 parity mismatch, 2 usage error)."""
    out = out or sys.stdout
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(out)
        return 2
    if getattr(args, "max_new_tokens", 1) < 1:
        parser.error("--max-new-tokens must be >= 1")
    try:
        return args.func(args, out)
    except CliError as e:
        print(f"jax-onnx-attn {args.command}: error: {e}", file=sys.stderr)
        return 2
    except (ValueError, NotImplementedError, RuntimeError) as e:
        # Loader and session errors (unsupported ops, shapes) name the problem; no traceback needed.
        print(f"jax-onnx-attn {args.command}: error: {type(e).__name__}: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
