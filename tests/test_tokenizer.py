"""runtime/tokenizer.py: an export folder's tokenizer.json, special tokens, chat template and eos ids,
on the committed fixtures (each carries a real byte-level BPE tokenizer of its model's vocabulary)
and on hand-made folders for the other layouts transformers writes.

Oracles: the `tokenizers` library run directly, and chat templates' renderings written out by hand.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import onnx
import pytest
from tokenizers import Tokenizer

from jax_onnx_attn.runtime.tokenizer import (TextTokenizer, TokenizerError, eos_token_ids,
                                             load_tokenizer)

FIXTURES = Path(__file__).parent / "fixtures"
FOLDERS = sorted(p for p in FIXTURES.iterdir() if (p / "model.onnx").exists())
LLAMA = FIXTURES / "builder_llama_fp32"


def _logits_width(folder: Path) -> int:
    proto = onnx.load(str(folder / "model.onnx"), load_external_data=False)
    (logits,) = [o for o in proto.graph.output if o.name == "logits"]
    return logits.type.tensor_type.shape.dim[-1].dim_value


@pytest.mark.parametrize("folder", FOLDERS, ids=lambda p: p.name)
def test_every_fixture_carries_a_tokenizer_of_its_vocabulary(folder):
    tok = load_tokenizer(folder)
    assert tok is not None, f"{folder.name} has no tokenizer.json"
    assert tok.vocab_size == _logits_width(folder) == 320
    # special tokens match the checkpoint's ids (pad 0, bos 1, eos 2)
    assert (tok.bos_token, tok.bos_token_id, tok.eos_token, tok.eos_token_id) == ("<s>", 1, "</s>", 2)
    text = "the decoder reads keys and values"
    ids = tok.encode(text)
    assert ids == Tokenizer.from_file(str(folder / "tokenizer.json")).encode(text).ids
    assert len(ids) < len(text.encode())  # merges learnt, not bytes only
    assert tok.decode(ids) == text
    assert eos_token_ids(folder)[0] == [2]


def test_fixture_tokenizers_are_what_make_fixtures_writes(tmp_path):
    """tools/make_fixtures.py --tokenizers-only reproduces the committed files byte for byte."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "make_fixtures", Path(__file__).parent.parent / "tools" / "make_fixtures.py")
    make_fixtures = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_fixtures)
    make_fixtures.write_tokenizer(tmp_path)
    for name in make_fixtures.TOKENIZER_FILES:
        assert (tmp_path / name).read_bytes() == (LLAMA / name).read_bytes(), name


def test_chat_template_renders_as_written():
    tok = load_tokenizer(LLAMA)
    assert tok.chat_template_source == str(LLAMA / "tokenizer_config.json")
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    assert tok.apply_chat_template(messages) == "<s>system\nS</s>\n<s>user\nU</s>\n<s>assistant\n"
    assert tok.apply_chat_template(messages, add_generation_prompt=False) == \
        "<s>system\nS</s>\n<s>user\nU</s>\n"
    ids = tok.encode_chat(messages)
    raw = Tokenizer.from_file(str(LLAMA / "tokenizer.json"))
    assert ids == raw.encode("<s>system\nS</s>\n<s>user\nU</s>\n<s>assistant\n",
                             add_special_tokens=False).ids
    assert ids[0] == 1 and ids.count(2) == 2  # <s> and </s> are single special tokens
    assert tok.decode(ids, skip_special_tokens=False).startswith("<s>system")


def _folder_with(tmp_path, config: dict | None = None, files: dict | None = None) -> Path:
    shutil.copy(LLAMA / "tokenizer.json", tmp_path / "tokenizer.json")
    if config is not None:
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (tmp_path / name).write_text(text)
    return tmp_path


def test_chat_template_locations(tmp_path):
    """chat_template.jinja over chat_template.json over tokenizer_config.json; the list form's
    "default" entry; special tokens given as {"content": ...}."""
    config = {"bos_token": {"content": "<s>"}, "eos_token": "</s>",
              "chat_template": [{"name": "tool_use", "template": "TOOLS"},
                                {"name": "default", "template": "{{ bos_token }}{{ messages[0]['content'] }}"}]}
    folder = _folder_with(tmp_path, config)
    tok = TextTokenizer(folder)
    assert tok.bos_token_id == 1 and tok.apply_chat_template([{"role": "user", "content": "x"}]) == "<s>x"
    (folder / "chat_template.json").write_text(json.dumps({"chat_template": "J{{ eos_token }}"}))
    assert TextTokenizer(folder).apply_chat_template([]) == "J</s>"
    (folder / "chat_template.jinja").write_text("{% for m in messages %}[{{ m.role }}]{% endfor %}")
    tok = TextTokenizer(folder)
    assert tok.chat_template_source == str(folder / "chat_template.jinja")
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "[user]"


def test_chat_template_errors(tmp_path):
    folder = _folder_with(tmp_path, {"eos_token": "</s>"})
    tok = TextTokenizer(folder)
    assert tok.chat_template is None and tok.bos_token_id is None and tok.eos_token_id == 2
    with pytest.raises(TokenizerError, match="has no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "x"}])
    (folder / "chat_template.jinja").write_text(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first must be user') }}{% endif %}ok")
    tok = TextTokenizer(folder)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "ok"
    with pytest.raises(TokenizerError, match="refused the messages: first must be user"):
        tok.apply_chat_template([{"role": "system", "content": "x"}])
    (folder / "chat_template.jinja").write_text("{% for %}")
    with pytest.raises(TokenizerError, match="TemplateSyntaxError"):
        TextTokenizer(folder).apply_chat_template([])


def test_missing_and_broken_tokenizers(tmp_path):
    assert load_tokenizer(tmp_path) is None
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(TokenizerError, match="not a tokenizer the `tokenizers` package can read"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.json").unlink()
    with pytest.raises(TokenizerError, match="no tokenizer at"):
        TextTokenizer(tmp_path)


def test_eos_ids_sources(tmp_path):
    """genai_config.json, then generation_config.json, then config.json, then the tokenizer."""
    folder = _folder_with(tmp_path, {"eos_token": "</s>"})
    assert eos_token_ids(folder) == ([2], str(folder / "tokenizer.json"))
    (folder / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert eos_token_ids(folder) == ([7], str(folder / "config.json"))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [5, 6]}))
    assert eos_token_ids(folder / "model.onnx") == ([5, 6], str(folder / "generation_config.json"))
    (folder / "genai_config.json").write_text(json.dumps({"model": {"eos_token_id": 3}}))
    assert eos_token_ids(folder) == ([3], str(folder / "genai_config.json"))
    (tmp_path / "bare").mkdir()
    assert eos_token_ids(tmp_path / "bare") == ([], None)
