"""Reading a Hugging Face transformers config from disk (nothing is downloaded, no code is run)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_hf_config(path: str | Path) -> Any:
    """A ``transformers`` config from a ``config.json`` file or a model folder holding one.
    Raises ``ValueError`` naming the problem.

    Configs that ask for custom code (``auto_map``, the ``trust_remote_code`` models) are refused:
    layershard never runs Python from a model folder a user may have been handed, and
    transformers would otherwise ask at a terminal prompt whether to run it."""
    import transformers

    p = Path(path)
    file = p / "config.json" if p.is_dir() else p
    if p.is_dir() and not file.is_file():
        raise ValueError(f"{p} has no config.json; point at a transformers model folder")
    if not file.is_file():
        raise ValueError(f"HF config {path} does not exist; pass a config.json or its folder")
    try:
        raw = json.loads(file.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise ValueError(f"{file}: not a JSON config ({e})") from None
    if not isinstance(raw, dict) or "model_type" not in raw:
        raise ValueError(f"{file} has no model_type; is it a transformers config.json?")
    if "auto_map" in raw:
        raise ValueError(
            f"{file}: the config asks for custom model code (auto_map: "
            f"{', '.join(sorted(raw['auto_map']))}); layershard does not run code from model "
            "folders. Use an architecture that transformers ships (remove auto_map and set "
            "model_type to one of them)"
        )
    try:
        if p.is_dir():
            return transformers.AutoConfig.from_pretrained(str(p), trust_remote_code=False)
        return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"{file}: not a config transformers can read ({e})") from None
