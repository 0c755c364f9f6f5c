"""The `jax-onnx-attn` command (also `python -m jax_onnx_attn`).

  jax-onnx-attn demo                          build the embedded tiny decoder and generate from it
  jax-onnx-attn generate MODEL --prompt TEXT  generate from an exported decoder (text through its
                                              tokenizer.json and chat template)
  jax-onnx-attn generate MODEL --ids 1,2,3    the same with token ids in
  jax-onnx-attn parity MODEL --prompt TEXT    compare logits and greedy tokens with onnxruntime CPU

MODEL is an .onnx file or an export folder holding one (onnxruntime-genai's model builder output:
model.onnx, genai_config.json, tokenizer.json; or a torch.onnx.export with the tokenizer saved
beside it).

Timings: compiling is reported apart, and by default a warm-up (compile + one short run of each
executable) comes before the timed run, so that time to first token and decode tokens/s are steady
state (--no-warmup times the first run as it is, one-time set-up included).

Exit status: 0 success; 1 parity mismatch; 2 usage error (arguments, paths, a missing tokenizer);
3 the model could not be loaded or run (the message says why); 4 internal error (a bug: --traceback
prints the traceback); 130 interrupted. With --json, stdout holds exactly one JSON object, also on
an error ({"ok": false, "exit_code": N, "error": ...}).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback
from collections.abc import Sequence
from pathlib import Path

TINY_PRODUCER = "jax_onnx_attn.models.tiny"
DTYPES = ("float32", "float16", "bfloat16")

EXIT_OK = 0
EXIT_MISMATCH = 1
EXIT_USAGE = 2
EXIT_MODEL = 3
EXIT_INTERNAL = 4
EXIT_INTERRUPTED = 130


class CliError(Exception):
    """A usage error (arguments, paths, a missing tokenizer): one line on stderr, exit status 2."""


class ModelError(Exception):
    """The model could not be loaded or run: one line on stderr, exit status 3."""


# --------------------------------------------------------------------------------------------------
# Argument types: each names what it expects, and argparse names the option.

def _int_at_least(lo: int):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {text!r}") from None
        if value < lo:
            raise argparse.ArgumentTypeError(f"expected an integer >= {lo}, got {value}")
        return value

    parse.__name__ = f"integer >= {lo}"
    return parse


def _float_in(lo: float, hi: float, lo_open: bool = False):
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not (lo < value if lo_open else lo <= value) or not value <= hi or math.isnan(value):
            bound = f"{'(' if lo_open else '['}{lo:g}, {hi:g}]"
            raise argparse.ArgumentTypeError(f"expected a number in {bound}, got {text}")
        return value

    parse.__name__ = "number"
    return parse


def _token_ids(allow_empty: bool):
    def parse(text: str) -> list[int]:
        parts = [t for t in text.replace(" ", ",").split(",") if t]
        try:
            ids = [int(t) for t in parts]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated token ids (integers >= 0), "
                                             f"got {text!r}") from None
        if any(i < 0 for i in ids):
            raise argparse.ArgumentTypeError(f"token ids are >= 0, got {text!r}")
        if not ids and not allow_empty:
            raise argparse.ArgumentTypeError("expected at least one token id, got none")
        return ids

    parse.__name__ = "token ids"
    return parse


# --------------------------------------------------------------------------------------------------
# Models, tokenizers, prompts

def _model_file(path: str) -> Path:
    from jax_onnx_attn.onnx.files import model_file

    try:
        return model_file(path)
    except (FileNotFoundError, ValueError) as e:
        raise CliError(str(e)) from None


def _model_meta(model_file: Path) -> tuple[str, int | None]:
    """(producer name, vocabulary size or None) from the graph, without reading the weights."""
    import onnx

    try:
        proto = onnx.load(str(model_file), load_external_data=False)
    except Exception as e:  # protobuf's DecodeError, OSError: not a model we can read
        raise ModelError(f"{model_file} cannot be read as an ONNX model: {type(e).__name__}: {e}") from None
    vocab = None
    for out in proto.graph.output:
        if out.name == "logits":
            dims = out.type.tensor_type.shape.dim
            if dims and dims[-1].HasField("dim_value"):
                vocab = int(dims[-1].dim_value)
    return proto.producer_name, vocab


class _BytesTokenizer:
    """The tiny model's tokenizer: UTF-8 bytes are the token ids (vocabulary 256)."""

    path = "byte-level (the tiny model's: UTF-8 bytes are the tokens)"
    chat_template = None
    chat_template_source = None
    vocab_size = 256

    @staticmethod
    def encode(text: str, add_special_tokens: bool = True) -> list[int]:
        from jax_onnx_attn.models import tiny

        return tiny.encode(text)

    @staticmethod
    def decode(ids, skip_special_tokens: bool = True) -> str:
        from jax_onnx_attn.models import tiny

        return tiny.decode(ids)


def _tokenizer(model_file: Path, producer: str, required: bool):
    """The tokenizer for --prompt and for printing text: the tiny model's bytes, or the export's
    tokenizer.json; None when there is none and it is not required."""
    from jax_onnx_attn.runtime.tokenizer import TokenizerError, load_tokenizer

    if producer == TINY_PRODUCER:
        return _BytesTokenizer()
    try:
        tok = load_tokenizer(model_file.parent)
    except TokenizerError as e:
        if required:
            raise CliError(f"--prompt: {e}; or pass token ids with --ids") from None
        return None
    if tok is None and required:
        raise CliError(f"--prompt needs the export's tokenizer.json beside the model (none in "
                       f"{model_file.parent}); pass token ids with --ids, or export the model with "
                       "its tokenizer (README: 'From a Hugging Face model to text')")
    return tok


def _encode(args, tok, text: str) -> list[int]:
    from jax_onnx_attn.runtime.tokenizer import TokenizerError

    use_chat = tok.chat_template is not None and not args.raw
    if args.system is not None and not use_chat:
        raise CliError("--system needs a chat template, and "
                       + ("--raw turns it off" if args.raw else f"{tok.path} has none"))
    try:
        if use_chat:
            messages = ([{"role": "system", "content": args.system}] if args.system is not None
                        else []) + [{"role": "user", "content": text}]
            return tok.encode_chat(messages)
        return tok.encode(text)
    except TokenizerError as e:
        raise CliError(f"--prompt: {e}") from None


def _prompts(args, model_file: Path) -> tuple[list[list[int]], object, int | None]:
    """(prompt token ids per row, tokenizer or None, model vocabulary or None)."""
    if bool(args.ids) == bool(args.prompt):
        raise CliError("give the prompt as --ids 1,2,3 or as --prompt TEXT (either may repeat, one "
                       "row each), not both")
    producer, vocab = _model_meta(model_file)
    tok = _tokenizer(model_file, producer, required=bool(args.prompt))
    if args.ids:
        prompts = [list(ids) for ids in args.ids]
    else:
        prompts = [_encode(args, tok, text) for text in args.prompt]
        for text, ids in zip(args.prompt, prompts):
            if not ids:
                raise CliError(f"--prompt {text!r} encodes to no tokens")
    if vocab is not None:
        for ids in prompts:
            bad = [i for i in ids if i >= vocab]
            if bad:
                raise CliError(f"token id {bad[0]} is outside the model's vocabulary of {vocab} "
                               f"(ids 0..{vocab - 1})")
    return prompts, tok, vocab


def _stop_tokens(args, model_file: Path) -> tuple[list[int], str | None]:
    """(stop tokens, where they come from): --stop, else the export's eos_token_id."""
    if args.stop is not None:
        return list(args.stop), "--stop"
    from jax_onnx_attn.runtime.tokenizer import TokenizerError, eos_token_ids

    try:
        ids, source = eos_token_ids(model_file.parent)
    except TokenizerError as e:
        raise CliError(f"reading the stop tokens: {e}; give them with --stop") from None
    return ids, (Path(source).name if source else None)


def _context_length(model_file: Path) -> tuple[int | None, str | None]:
    """(the model's context length, the file that says so): genai_config.json's
    model.context_length, else config.json's max_position_embeddings; (None, None) if neither."""
    for name, keys in (("genai_config.json", ("model", "context_length")),
                       ("config.json", ("max_position_embeddings",))):
        path = model_file.parent / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text())
        except ValueError:
            raise CliError(f"{path} is not valid JSON") from None
        for k in keys:
            value = value.get(k) if isinstance(value, dict) else None
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value, name
    return None, None


def _check_context(model_file: Path, max_length: int, what: str) -> None:
    ctx, source = _context_length(model_file)
    if ctx is not None and max_length > ctx:
        raise CliError(f"{what} {max_length} exceeds the model's context length {ctx} ({source}); "
                       "ask for fewer tokens")


def _dtype(name: str | None):
    if name is None:
        return None
    import jax.numpy as jnp

    return jnp.dtype(name)


def _load_session(model, args, max_length: int, batch: int, progress: bool, label: str):
    """A DecoderSession, loading errors turned into ModelError; (session, seconds)."""
    from jax_onnx_attn.runtime import DecoderSession
    from jax_onnx_attn.runtime.progress import spinner

    mesh = None
    if getattr(args, "devices", None):
        from jax_onnx_attn.runtime.mesh import make_mesh

        try:
            mesh = make_mesh(args.devices, data=args.data_parallel)
        except ValueError as e:
            raise CliError(f"--devices {args.devices} --data-parallel {args.data_parallel}: "
                           f"{e}") from None
    t0 = time.perf_counter()
    try:
        with spinner(f"loading and lowering {label}", progress):
            session = DecoderSession(model, max_length=max_length, batch=batch,
                                     dtype=_dtype(getattr(args, "dtype", None)), mesh=mesh)
    except (NotImplementedError, ValueError, TypeError, OSError, RuntimeError) as e:
        raise ModelError(f"could not load {label}: {type(e).__name__}: {e}") from e
    return session, time.perf_counter() - t0


# --------------------------------------------------------------------------------------------------
# The one place where a decode rate becomes a fraction of the memory-bandwidth bound.

def bandwidth_bound(session, timings) -> dict | None:
    """The decode rate against the memory-bandwidth bound of the device, or None where it is not
    computed (it is only meaningful on a GPU).

    Returns {"bytes_per_step": ..., "achieved_gb_s": ..., "peak_gb_s": ..., "fraction": ...}.

    The bound is `runtime.roofline`'s: every weight byte a step reads plus the KV bytes at the
    run's mean context (a step's bytes are affine in the context), over the HBM bandwidth of the
    device (`roofline.hbm_bytes_per_s`: the H200's 4.8 TB/s, the H100's; None for a GPU not in
    its table).
    """
    import jax

    from jax_onnx_attn.runtime import roofline

    device = jax.devices()[0]
    step_s = getattr(timings, "step_s", float("nan"))
    bandwidth = roofline.hbm_bytes_per_s(str(device.device_kind))
    if device.platform != "gpu" or bandwidth is None or not step_s > 0:
        return None
    cost = roofline.step_cost(session.lowered)
    rows = max(int(getattr(timings, "rows", 1) or 1), 1)
    ctx = int(timings.prompt_tokens / rows + getattr(timings, "decode_steps", 0) / 2)
    batch = session.batch
    bytes_per_step = cost.decode_bytes(batch, ctx)
    # With a mesh every device streams its share of the bytes: the bound is all of them together.
    layout = getattr(session, "layout", None)
    devices = layout.mesh.devices.size if layout is not None else 1
    peak = bandwidth * devices
    return {"bytes_per_step": bytes_per_step, "achieved_gb_s": bytes_per_step / step_s / 1e9,
            "peak_gb_s": peak / 1e9, "fraction": cost.fraction_of_bound(step_s, batch, ctx, peak)}


# --------------------------------------------------------------------------------------------------
# Output

def _ms(seconds: float) -> str:
    if seconds != seconds:  # NaN
        return "n/a"
    return f"{seconds * 1e3:.2f} ms" if seconds < 1 else f"{seconds:.2f} s"


def _rate(x: float) -> str:
    return "n/a" if x != x else f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


def _print_warmup(w, out) -> None:
    if w is None:
        print("warm-up: skipped (--no-warmup): the timings below include compiling's first runs",
              file=out)
        return
    print(f"warm-up: {_ms(w.compile_s + w.total_s)} (compile {_ms(w.compile_s)}, first runs "
          f"{_ms(w.total_s)}), not counted below", file=out)


def _print_timings(t, batch: int, bound: dict | None, out) -> None:
    if t.compile_s:
        print(f"compile: {_ms(t.compile_s)} (not counted below)", file=out)
    steady = "steady state" if t.warm else "includes first-run set-up, not steady state"
    print(f"time to first token: {_ms(t.ttft_s)} (prefill of {t.prompt_tokens} prompt tokens: "
          f"{_rate(t.prefill_tokens_per_s)} tokens/s)", file=out)
    if t.decode_tokens:
        print(f"decode: {t.decode_tokens} tokens in {_ms(t.decode_s)} = "
              f"{_rate(t.decode_tokens_per_s)} tokens/s ({_ms(t.step_s)} a step at batch {batch}; "
              f"{steady})", file=out)
    else:
        print("decode: no decode step ran (every row ended at its first token)", file=out)
    if bound is not None:
        print(f"bandwidth bound: {bound['fraction']:.1%} of {bound['peak_gb_s']:.0f} GB/s "
              f"({bound['achieved_gb_s']:.0f} GB/s achieved)", file=out)


def _rows(result, tok) -> list[dict]:
    rows = []
    for prompt, tokens, reason in zip(result.prompts, result.tokens, result.finish_reasons):
        rows.append({"prompt_ids": prompt, "tokens": tokens, "finish_reason": reason,
                     "prompt_text": tok.decode(prompt, skip_special_tokens=False) if tok else None,
                     "text": tok.decode(tokens) if tok else None})
    return rows


def _print_rows(rows, out) -> None:
    for i, row in enumerate(rows):
        head = f"[{i}] " if len(rows) > 1 else ""
        if row["prompt_text"] is not None:
            print(f"{head}prompt: {row['prompt_text']!r} ({len(row['prompt_ids'])} tokens)", file=out)
        else:
            print(f"{head}prompt ids: {','.join(map(str, row['prompt_ids']))}", file=out)
        print(f"{head}generated ids ({len(row['tokens'])}, finish: {row['finish_reason']}): "
              f"{','.join(map(str, row['tokens']))}", file=out)
        if row["text"] is not None:
            print(f"{head}text: {row['text']!r}", file=out)


def _sampling_kwargs(args) -> dict:
    return dict(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)


def _generate(session, prompts, args, stop, progress):
    """(warm-up Timings or None, GenerationResult) of the timed run."""
    try:
        warm = None
        if args.warmup:
            warm = session.warmup(prompts, stop_tokens=stop, progress=progress,
                                  **_sampling_kwargs(args))
        result = session.generate(prompts, args.max_new_tokens, stop_tokens=stop, seed=args.seed,
                                  progress=progress, **_sampling_kwargs(args))
    except (RuntimeError, ValueError, NotImplementedError) as e:
        # trace-time checks of the ops (shapes beyond what the model supports), a refused cache
        # write on the device, compile failures: the model cannot run this way
        raise ModelError(f"generation failed: {type(e).__name__}: {e}") from e
    return warm, result


def _emit(args, out, lines: list[str], record: dict) -> None:
    if args.json:
        print(json.dumps(record, indent=1, default=str), file=out)
    else:
        for line in lines:
            print(line, file=out)


def _backend() -> dict:
    import jax_onnx_attn
    from jax_onnx_attn.runtime import describe_backend

    info = jax_onnx_attn.build_info()
    return {"description": describe_backend(), "cuda_compiled": info["cuda_compiled"],
            "cuda_usable": info["cuda_usable"], "why_not_cuda": info["usable_reason"]}


# --------------------------------------------------------------------------------------------------
# Commands

def _run_and_report(args, out, session, model_label, prompts, tok, stop, stop_source, load_s,
                    extra: dict) -> int:
    progress = args.progress
    warm, result = _generate(session, prompts, args, stop, progress)
    rows = _rows(result, tok)
    bound = bandwidth_bound(session, result.timings)
    backend = _backend()
    record = {"command": args.command, "ok": True, "exit_code": EXIT_OK, "model": model_label,
              **extra, "backend": backend, "load_s": load_s,
              "tokenizer": str(tok.path) if tok is not None else None,
              "chat_template": (tok.chat_template_source
                                if tok is not None and not getattr(args, "raw", False) else None),
              "stop_tokens": stop, "batch": session.batch, "max_length": session.max_length,
              "mesh": _mesh_record(session),
              "warmup": warm.to_dict() if warm is not None else None, "rows": rows,
              "timings": result.timings.to_dict(), "bandwidth_bound": bound}
    if args.json:
        _emit(args, out, [], record)
        return EXIT_OK
    print(f"backend: {backend['description']}", file=out)
    if record["mesh"] is not None:
        print(record["mesh"]["description"], file=out)
    if tok is not None:
        line = f"tokenizer: {tok.path}"
        if record["chat_template"]:
            line += f"; chat template: {record['chat_template']} (--raw sends the prompt as is)"
        print(line, file=out)
    if stop:
        print(f"stop tokens: {','.join(map(str, stop))}"
              + (f" (from {stop_source})" if stop_source else ""), file=out)
    _print_warmup(warm, out)
    _print_rows(rows, out)
    _print_timings(result.timings, session.batch, bound, out)
    return EXIT_OK


def _mesh_record(session) -> dict | None:
    """The session's mesh for the report: axis sizes, what splits; None on one device."""
    layout = getattr(session, "layout", None)
    if layout is None:
        return None
    return {"devices": int(layout.mesh.devices.size), "model": layout.model, "data": layout.data,
            "projections_split": layout.plan.counts(), "projections_whole": dict(layout.plan.whole),
            "description": layout.describe()}


def cmd_demo(args, out) -> int:
    """`demo`: build the tiny decoder from `args`, generate from --prompt, print to `out`; 0."""
    from jax_onnx_attn.models import tiny

    try:
        config = tiny.TinyConfig(layers=args.layers, hidden=args.hidden, heads=args.heads,
                                 kv_heads=args.kv_heads, dtype=args.dtype, seed=args.model_seed)
    except ValueError as e:
        raise CliError(str(e)) from None
    prompt = tiny.encode(args.prompt)
    if not prompt:
        raise CliError("--prompt is empty")
    model = tiny.build_tiny_decoder(config)
    label = (f"the embedded tiny decoder ({config.layers} layers, hidden {config.hidden}, "
             f"{config.heads} heads / {config.kv_heads} KV heads, vocab {config.vocab}, "
             f"{config.dtype}; random weights, seed {config.seed})")
    saved = None
    if args.save:
        import onnx

        path = Path(args.save)
        try:
            path.mkdir(parents=True, exist_ok=True)
            onnx.save(model, str(path / "model.onnx"))
        except OSError as e:
            raise CliError(f"--save {args.save}: {e}") from None
        saved = str(path / "model.onnx")
    session, load_s = _load_session(model, args, len(prompt) + args.max_new_tokens + 1, 1,
                                    args.progress, "the tiny decoder")
    if not args.json:
        print(f"model: {label}", file=out)
        if saved:
            print(f"saved: {saved} (try: jax-onnx-attn generate {path} --prompt 'Hello'; "
                  f"jax-onnx-attn parity {path} --prompt 'Hello')", file=out)
        print(f"loaded and lowered in {_ms(load_s)}", file=out)
    return _run_and_report(args, out, session, label, [prompt], _BytesTokenizer(), [], None, load_s,
                           {"saved": saved})


def cmd_generate(args, out) -> int:
    """`generate`: load args.model, generate from its prompts (one row each), print to `out`; 0."""
    model_file = _model_file(args.model)
    prompts, tok, _ = _prompts(args, model_file)
    stop, stop_source = _stop_tokens(args, model_file)
    longest = max(map(len, prompts))
    max_length = args.max_length or longest + args.max_new_tokens + 1
    if longest >= max_length:
        raise CliError(f"--max-length {max_length} leaves no room after a prompt of {longest} tokens")
    _check_context(model_file, max_length, "--max-length" if args.max_length else
                   "prompt + --max-new-tokens + 1 =")
    session, load_s = _load_session(str(model_file), args, max_length, args.batch or len(prompts),
                                    args.progress, str(model_file))
    if not args.json:
        kind = session.lowered.float_type
        print(f"model: {model_file} ({kind.name if kind is not None else 'no float weights'}"
              f"{'' if args.dtype is None else f', computed in {args.dtype}'}; loaded and lowered "
              f"in {_ms(load_s)})", file=out)
    return _run_and_report(args, out, session, str(model_file), prompts, tok, stop, stop_source,
                           load_s, {})


def cmd_parity(args, out) -> int:
    """`parity`: logits and greedy tokens vs onnxruntime CPU for one prompt; 0 agree, 1 differ."""
    from jax_onnx_attn.runtime import compare_with_onnxruntime
    from jax_onnx_attn.runtime.progress import spinner

    model_file = _model_file(args.model)
    prompts, tok, _ = _prompts(args, model_file)
    if len(prompts) != 1:
        raise CliError("parity compares one prompt at a time (give one --ids or --prompt)")
    _check_context(model_file, len(prompts[0]) + args.max_new_tokens + 1,
                   "prompt + --max-new-tokens + 1 =")
    try:
        with spinner("running onnxruntime and jax_onnx_attn", args.progress):
            report = compare_with_onnxruntime(str(model_file), prompts[0], args.max_new_tokens,
                                              dtype=_dtype(args.dtype))
    except ImportError as e:
        raise CliError(f"parity needs onnxruntime as its oracle: {e}") from None
    except (NotImplementedError, ValueError, TypeError, OSError, RuntimeError) as e:
        raise ModelError(f"could not run {model_file}: {type(e).__name__}: {e}") from e
    code = EXIT_OK if report.ok else EXIT_MISMATCH
    backend = _backend()
    texts = {}
    if tok is not None:
        texts = {"onnxruntime_text": tok.decode(report.ort_tokens),
                 "jax_onnx_attn_text": tok.decode(report.jax_tokens)}
    lines = [f"model: {model_file}", f"backend: {backend['description']}; oracle: onnxruntime CPU",
             *report.lines()]
    lines += [f"onnxruntime text: {texts['onnxruntime_text']!r}",
              f"jax_onnx_attn text: {texts['jax_onnx_attn_text']!r}"] if texts else []
    record = {"command": "parity", "ok": report.ok, "exit_code": code, "model": str(model_file),
              "backend": backend, "prompt_ids": report.prompt, "onnxruntime_tokens": report.ort_tokens,
              "jax_onnx_attn_tokens": report.jax_tokens, **texts,
              "logits_dtype": report.logits_dtype.name, "tolerance": list(report.tolerance),
              "prefill_max_abs": report.prefill_max_abs,
              "decode_max_abs": None if math.isnan(report.decode_max_abs) else report.decode_max_abs,
              "logits_scale": report.logits_scale, "logits_bound": report.logits_bound,
              "logits_within_tolerance": report.logits_within_tolerance,
              "first_divergence": report.first_divergence, "divergence_gap": report.divergence_gap,
              "divergence_is_tie": report.divergence_is_tie, "lines": report.lines()}
    _emit(args, out, lines, record)
    return code


# --------------------------------------------------------------------------------------------------
# Parser

class _Parser(argparse.ArgumentParser):
    """argparse that raises CliError (exit 2, and a JSON record under --json) instead of exiting."""

    def error(self, message):
        raise CliError(f"{message} (see {self.prog} --help)")


def _version() -> str:
    try:
        from importlib.metadata import version

        ours = version("jax-onnx-attn")
    except Exception:  # noqa: BLE001 - a source tree that was never installed
        from jax_onnx_attn import __version__ as ours
    import jax

    import jax_onnx_attn

    info = jax_onnx_attn.build_info()
    if info["cuda_usable"]:
        kernels = f"CUDA kernels: usable ({', '.join(info['cuda_devices'])})"
    elif info["cuda_compiled"]:
        kernels = f"CUDA kernels: compiled, not usable here: {info['usable_reason']}"
    else:
        kernels = f"CUDA kernels: not compiled: {info['reason']}"
    return f"jax-onnx-attn {ours} (jax {jax.__version__}; {kernels})"


class _VersionAction(argparse.Action):
    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings=option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(_version(), file=getattr(parser, "out", None) or sys.stdout)
        parser.exit(0)


def _add_common(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true",
                   help="print one JSON object on stdout (results, timings; errors too)")
    g.add_argument("--no-progress", dest="progress", action="store_false", default=None,
                   help="no spinner or progress bar (default: shown when stderr is a terminal)")
    g.add_argument("--traceback", action="store_true",
                   help="on an error, print the Python traceback too")


def _add_sampling(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (default: greedy)")
    g.add_argument("--temperature", type=_float_in(0.0, math.inf), default=0.0,
                   help="0 = greedy (default)")
    g.add_argument("--top-k", type=_int_at_least(0), default=0,
                   help="keep the k most likely tokens (0 = off)")
    g.add_argument("--top-p", type=_float_in(0.0, 1.0, lo_open=True), default=1.0,
                   help="nucleus mass to keep, in (0, 1] (1 = off)")
    g.add_argument("--seed", type=int, default=0, help="sampler seed")


def _add_prompt(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", help="an .onnx file, or an export folder holding one")
    g = p.add_argument_group("prompt (one of --ids / --prompt; either may repeat, one row each)")
    g.add_argument("--ids", action="append", type=_token_ids(allow_empty=False), metavar="IDS",
                   help="prompt token ids, comma-separated")
    g.add_argument("--prompt", action="append", metavar="TEXT",
                   help="prompt text, encoded with the export's tokenizer.json (the `text` extra) "
                        "and, where the export has one, its chat template")
    g.add_argument("--raw", action="store_true",
                   help="encode --prompt as it is, without the chat template")
    g.add_argument("--system", metavar="TEXT", help="a system message before each --prompt "
                                                    "(chat template only)")
    p.add_argument("--dtype", choices=DTYPES, help="compute dtype on the jax side (default: the model's)")


def _add_run(p: argparse.ArgumentParser, max_new_tokens: int) -> None:
    p.add_argument("--max-new-tokens", type=_int_at_least(1), default=max_new_tokens,
                   help=f"tokens to generate per row (default {max_new_tokens})")
    p.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="time the first run as it is (compile is still reported apart); by default "
                        "a warm-up run comes first so the timings are steady state")


def build_parser() -> argparse.ArgumentParser:
    """The argparse parser of `jax-onnx-attn` and its demo / generate / parity subcommands."""
    parser = _Parser(
        prog="jax-onnx-attn",
        description="ONNX decoder models as jitted JAX, with attention on our own kernels.",
        epilog="exit status: 0 ok, 1 parity mismatch, 2 usage error, 3 the model could not be "
               "loaded or run, 4 internal error, 130 interrupted")
    parser.add_argument("--version", action=_VersionAction,
                        help="print the version, jax's, and whether the CUDA kernels are usable")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)

    demo = sub.add_parser("demo", help="generate from the embedded tiny decoder (no download)",
                          description="Build the embedded tiny decoder (random weights, byte-level "
                                      "vocabulary) and generate from it.")
    demo.add_argument("--prompt", default="Hello, JAX!", help="prompt text (UTF-8 bytes are the tokens)")
    _add_run(demo, 48)
    g = demo.add_argument_group("the tiny model")
    g.add_argument("--layers", type=_int_at_least(1), default=2)
    g.add_argument("--hidden", type=_int_at_least(1), default=64)
    g.add_argument("--heads", type=_int_at_least(1), default=4)
    g.add_argument("--kv-heads", type=_int_at_least(1), default=2)
    g.add_argument("--dtype", default="float32", choices=("float32", "float16"))
    g.add_argument("--model-seed", type=int, default=0, help="seed of the random weights")
    g.add_argument("--save", metavar="DIR", help="also write the model to DIR/model.onnx")
    _add_sampling(demo)
    _add_common(demo)
    demo.set_defaults(func=cmd_demo)

    gen = sub.add_parser("generate", help="generate from an ONNX decoder",
                         description="Generate from an ONNX decoder: text in (--prompt, through "
                                     "the export's tokenizer) or token ids (--ids); tokens and "
                                     "text out, with time to first token and decode tokens/s.")
    _add_prompt(gen)
    _add_run(gen, 32)
    gen.add_argument("--max-length", type=_int_at_least(2),
                     help="KV-cache capacity per row (default: longest prompt + max-new-tokens + 1)")
    gen.add_argument("--batch", type=_int_at_least(1),
                     help="rows per call (default: the number of prompts)")
    gen.add_argument("--devices", type=_int_at_least(1), metavar="N",
                     help="run on the first N devices (tensor parallel: weights, attention heads "
                          "and the KV cache split over them; default: one device)")
    gen.add_argument("--data-parallel", type=_int_at_least(1), default=1, metavar="D",
                     help="of the --devices, D split the batch rows (the rest split the model); "
                          "--batch must be a multiple of D (default 1)")
    gen.add_argument("--stop", type=_token_ids(allow_empty=True), metavar="IDS",
                     help="stop token ids, comma-separated (default: eos_token_id from the export's "
                          "genai_config.json, generation_config.json or tokenizer; '' for none)")
    _add_sampling(gen)
    _add_common(gen)
    gen.set_defaults(func=cmd_generate)

    par = sub.add_parser("parity", help="compare logits and greedy tokens with onnxruntime CPU",
                         description="Run the model in onnxruntime CPU and in jax_onnx_attn on one "
                                     "prompt; print the logits' max abs difference and the first "
                                     "divergent greedy token. Exit status 1 on a mismatch.")
    _add_prompt(par)
    par.add_argument("--max-new-tokens", type=_int_at_least(1), default=16,
                     help="greedy tokens to compare (default 16)")
    _add_common(par)
    par.set_defaults(func=cmd_parity)
    return parser


def _fail(args_json: bool, command: str | None, code: int, kind: str, message: str, out) -> int:
    prog = f"jax-onnx-attn {command}" if command else "jax-onnx-attn"
    print(f"{prog}: error: {message}", file=sys.stderr)
    if args_json:
        print(json.dumps({"command": command, "ok": False, "exit_code": code, "error_kind": kind,
                          "error": message}, indent=1), file=out)
    return code


def main(argv: Sequence[str] | None = None, out=None) -> int:
    """Run the command line; returns the exit status (0 ok, 1 parity mismatch, 2 usage error,
    3 model could not be loaded or run, 4 internal error, 130 interrupted)."""
    out = out or sys.stdout
    argv = list(sys.argv[1:] if argv is None else argv)
    want_json = "--json" in argv
    want_tb = "--traceback" in argv or bool(os.environ.get("JAX_ONNX_ATTN_TRACEBACK"))
    parser = build_parser()
    parser.out = out
    command = next((a for a in argv if a in ("demo", "generate", "parity")), None)
    try:
        args = parser.parse_args(argv)
    except CliError as e:
        return _fail(want_json, command, EXIT_USAGE, "usage", str(e), out)
    except SystemExit as e:  # --help, --version
        return e.code if isinstance(e.code, int) else EXIT_OK
    if args.command is None:
        parser.print_help(out)
        return EXIT_USAGE
    if args.progress is None:
        from jax_onnx_attn.runtime.progress import progress_default

        args.progress = progress_default()
    try:
        return args.func(args, out)
    except CliError as e:
        return _fail(args.json, args.command, EXIT_USAGE, "usage", str(e), out)
    except ModelError as e:
        if want_tb:
            traceback.print_exc()
        return _fail(args.json, args.command, EXIT_MODEL, "model", str(e), out)
    except KeyboardInterrupt:
        return _fail(args.json, args.command, EXIT_INTERRUPTED, "interrupted", "interrupted", out)
    except BrokenPipeError:  # `jax-onnx-attn ... | head`: the reader left; nothing more to say
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        return EXIT_OK
    except Exception as e:  # noqa: BLE001 - a bug: one line (the traceback on request), exit 4
        if want_tb:
            traceback.print_exc()
        hint = "" if want_tb else " (--traceback prints the traceback; please report it)"
        return _fail(args.json, args.command, EXIT_INTERNAL, "internal",
                     f"internal error: {type(e).__name__}: {e}{hint}", out)


if __name__ == "__main__":
    sys.exit(main())
