"""Where a model is: an .onnx file, or an export folder holding one.

Producers write folders: onnxruntime-genai's model builder writes `model.onnx` (+ `model.onnx.data`),
`genai_config.json` (whose model.decoder.filename names the ONNX file) and the tokenizer files;
`torch.onnx.export` users save `model.onnx` beside `save_pretrained`'s tokenizer. Every function of
the package that takes a model path takes such a folder too, through `model_file`.
"""

from __future__ import annotations

import json
import os
from pathlib import Path


def model_file(path: str | os.PathLike) -> Path:
    """The ONNX file that `path` names: `path` itself when it is a file; for a folder, the file
    that its genai_config.json names (model.decoder.filename), else `model.onnx`, else its only
    `*.onnx` file.

    Raises:
      FileNotFoundError: nothing exists at `path`, or the folder holds no .onnx file.
      ValueError: the folder holds several .onnx files and none of the rules above picks one.
    """
    p = Path(path)
    if p.is_file():
        return p
    if not p.exists():
        raise FileNotFoundError(f"no model at {p}: expected an .onnx file or a folder holding one")
    if not p.is_dir():
        raise FileNotFoundError(f"{p} is neither an .onnx file nor a folder")
    config = p / "genai_config.json"
    if config.is_file():
        try:
            name = json.loads(config.read_text())["model"]["decoder"]["filename"]
        except (ValueError, KeyError, TypeError):
            name = None
        if isinstance(name, str) and (p / name).is_file():
            return p / name
    if (p / "model.onnx").is_file():
        return p / "model.onnx"
    found = sorted(p.glob("*.onnx"))
    if len(found) == 1:
        return found[0]
    if not found:
        raise FileNotFoundError(f"{p} is a folder without an .onnx file")
    raise ValueError(f"{p} holds {len(found)} .onnx files ({', '.join(f.name for f in found)}) and no "
                     "model.onnx; name the model file")


__all__ = ["model_file"]
