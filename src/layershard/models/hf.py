"""Reading a Hugging Face transformers config from disk (nothing is downloaded)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def load_hf_config(path: str | Path) -> Any:
    """A ``transformers`` config from a ``config.json`` file or a model folder holding one.
    Raises ``ValueError`` naming the problem."""
    import transformers

    p = Path(path)
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} has no config.json; point at a transformers model folder")
        return transformers.AutoConfig.from_pretrained(str(p))
    if not p.is_file():
        raise ValueError(f"HF config {path} does not exist; pass a config.json or its folder")
    raw = json.loads(p.read_text())
    if "model_type" not in raw:
        raise ValueError(f"{p} has no model_type; is it a transformers config.json?")
    return transformers.AutoConfig.for_model(raw.pop("model_type"), **raw)
