"""Text in and out for an exported model: the tokenizer and chat template that its export folder carries.

Producers leave the Hugging Face tokenizer files beside the ONNX file: onnxruntime-genai's model
builder copies them into its output folder, and a `torch.onnx.export` user saves them with
`tokenizer.save_pretrained(folder)`. Read here:

  tokenizer.json          the tokenizer itself, run by the `tokenizers` library (Rust, no torch);
  tokenizer_config.json   special tokens (bos/eos) and, often, `chat_template`;
  chat_template.jinja / chat_template.json   where newer transformers save the chat template;
  genai_config.json, generation_config.json, config.json   eos_token_id (the default stop tokens).

Chat templates are Jinja templates rendered the way transformers renders them (a sandboxed Jinja2
environment with trim_blocks / lstrip_blocks, `messages`, `add_generation_prompt`, the special
tokens, `raise_exception`, `strftime_now`); the rendered text is then encoded without adding
special tokens again. Both libraries are the `text` extra: pip install "jax-onnx-attn[text]".
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path


class TokenizerError(Exception):
    """A tokenizer or chat template that cannot be used (missing file, missing package, bad
    template); the message says which file and what to do."""


def _folder(path: str | os.PathLike) -> Path:
    p = Path(path)
    return p if p.is_dir() else p.parent


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise TokenizerError(f"{path} cannot be read as JSON: {e}") from None
    if not isinstance(data, dict):
        raise TokenizerError(f"{path} is not a JSON object")
    return data


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or {"content": ...}."""
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    return None


def _as_ids(value) -> list[int]:
    if value is None:
        return []
    values = value if isinstance(value, (list, tuple)) else [value]
    return [int(v) for v in values if isinstance(v, int) and not isinstance(v, bool)]


def eos_token_ids(path: str | os.PathLike) -> tuple[list[int], str | None]:
    """(eos token ids, the file they come from) of an export folder (or a model file's folder):
    genai_config.json's model.eos_token_id, else generation_config.json's or config.json's
    eos_token_id, else the tokenizer's eos_token; ([], None) when none says."""
    folder = _folder(path)
    for name, keys in (("genai_config.json", ("model", "eos_token_id")),
                       ("generation_config.json", ("eos_token_id",)),
                       ("config.json", ("eos_token_id",))):
        f = folder / name
        if not f.is_file():
            continue
        value = _read_json(f)
        for k in keys:
            value = value.get(k) if isinstance(value, Mapping) else None
        ids = _as_ids(value)
        if ids:
            return ids, str(f)
    try:
        tok = load_tokenizer(folder)
    except TokenizerError:
        return [], None
    if tok is not None and tok.eos_token_id is not None:
        return [tok.eos_token_id], str(tok.path)
    return [], None


def _chat_template(folder: Path, config: dict) -> tuple[str | None, str | None]:
    """(template, where it came from) from the files transformers writes, newest convention first."""
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text(encoding="utf-8"), str(jinja)
    js = folder / "chat_template.json"
    if js.is_file():
        value = _read_json(js).get("chat_template")
        if isinstance(value, str):
            return value, str(js)
    value = config.get("chat_template")
    if isinstance(value, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        named = {t.get("name"): t.get("template") for t in value if isinstance(t, Mapping)}
        value = named.get("default")
    if isinstance(value, str):
        return value, str(folder / "tokenizer_config.json")
    return None, None


class TextTokenizer:
    """The tokenizer of an export folder: `encode`, `decode` and the chat template.

    Attributes:
      path: the tokenizer.json it reads.
      vocab_size: tokens in the vocabulary, added tokens included.
      bos_token / eos_token (str | None) and bos_token_id / eos_token_id (int | None): from
        tokenizer_config.json.
      chat_template (str | None) and chat_template_source (the file it came from).
    """

    def __init__(self, path: str | os.PathLike):
        path = Path(path)
        folder = path if path.is_dir() else path.parent
        if path.is_dir():
            path = path / "tokenizer.json"
        if not path.is_file():
            raise TokenizerError(f"no tokenizer at {path}")
        try:
            from tokenizers import Tokenizer
        except ImportError:
            raise TokenizerError(f"reading {path} needs the `tokenizers` package: "
                                 'pip install "jax-onnx-attn[text]"') from None
        try:
            self._tok = Tokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises its own Exception subclass
            raise TokenizerError(f"{path} is not a tokenizer the `tokenizers` package can read: "
                                 f"{e}") from None
        self.path = path
        cfg_path = folder / "tokenizer_config.json"
        self.config = _read_json(cfg_path) if cfg_path.is_file() else {}
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.bos_token_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None
        self.chat_template, self.chat_template_source = _chat_template(folder, self.config)

    @property
    def vocab_size(self) -> int:
        """Tokens in the vocabulary, added (special) tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; add_special_tokens runs the tokenizer's post-processor (e.g. a BOS
        that the model expects before a plain prompt)."""
        return list(self._tok.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """The text of token ids (special tokens left out unless skip_special_tokens=False)."""
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: Sequence[Mapping[str, str]],
                            add_generation_prompt: bool = True) -> str:
        """The chat template rendered for `messages` ([{"role": ..., "content": ...}, ...]), as
        transformers' `apply_chat_template(..., tokenize=False)` renders it.

        Raises:
          TokenizerError: the export has no chat template, jinja2 is missing, or the template
            fails (its own raise_exception message included).
        """
        if self.chat_template is None:
            raise TokenizerError(f"{self.path.parent} has no chat template (none in "
                                 "tokenizer_config.json, chat_template.jinja or chat_template.json)")
        try:
            import jinja2
            from jinja2.sandbox import ImmutableSandboxedEnvironment
        except ImportError:
            raise TokenizerError('chat templates are rendered with the `jinja2` package: pip install '
                                 '"jax-onnx-attn[text]"') from None

        def raise_exception(message):
            raise TokenizerError(f"the chat template of {self.chat_template_source} refused the "
                                 f"messages: {message}")

        def strftime_now(fmt):
            import datetime

            return datetime.datetime.now().strftime(fmt)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False, **_: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii)
        env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now)
        special = {k: _token_text(v) for k, v in self.config.items()
                   if k.endswith("_token") and _token_text(v) is not None}
        try:
            return env.from_string(self.chat_template).render(
                messages=list(messages), add_generation_prompt=add_generation_prompt, **special)
        except jinja2.TemplateError as e:
            raise TokenizerError(f"the chat template of {self.chat_template_source} failed: "
                                 f"{type(e).__name__}: {e}") from None

    def encode_chat(self, messages: Sequence[Mapping[str, str]],
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat template (special tokens come from the template itself,
        none are added)."""
        return self.encode(self.apply_chat_template(messages, add_generation_prompt),
                           add_special_tokens=False)


def load_tokenizer(path: str | os.PathLike) -> TextTokenizer | None:
    """The tokenizer of an export folder (or of a model file's folder), or None when the folder has
    no tokenizer.json. Raises TokenizerError when there is one that cannot be read (e.g. the
    `tokenizers` package is missing)."""
    folder = _folder(path)
    if not (folder / "tokenizer.json").is_file():
        return None
    return TextTokenizer(folder)


__all__ = ["TextTokenizer", "TokenizerError", "eos_token_ids", "load_tokenizer"]
