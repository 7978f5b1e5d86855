"""Choosing and building the model: a layershard preset, any transformers config (random
init), or local HF safetensors weights (fine-tuning, read by ``layershard.load_hf``)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layershard.models import LlamaForCausalLM, build_config
from layershard.models.hf import load_hf_config
from layershard.train.config import ConfigError, TrainConfig


def round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _hf_config(path: str) -> Any:
    try:
        return load_hf_config(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def model_spec(cfg: TrainConfig, vocab_size: int | None) -> tuple[str, Any, int]:
    """(kind, config, max sequence length) where kind is 'preset' or 'hf'. ``vocab_size`` is the
    tokenizer's (None when not known yet); a preset's vocabulary follows the tokenizer."""
    if cfg.hf_config or cfg.init_from:
        hf = _hf_config(cfg.hf_config or cfg.init_from)
        if vocab_size is not None and hf.vocab_size < vocab_size and not cfg.init_from:
            hf.vocab_size = round_up(vocab_size)  # random init: room for every token
        max_len = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", 0)
        return "hf", hf, int(max_len or 1 << 30)
    overrides = dict(cfg.model_overrides)
    if vocab_size is not None:
        overrides.setdefault("vocab_size", round_up(vocab_size))
    try:
        lc = build_config(cfg.model, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model {cfg.model}: {e}") from e
    return "preset", lc, lc.max_seq_len


def check_seq_len(cfg: TrainConfig, max_len: int) -> None:
    if cfg.seq_len > max_len:
        raise ConfigError(
            f"seq_len={cfg.seq_len} exceeds the model's maximum sequence length {max_len}; "
            f"lower --seq-len or raise it (--model-override max_seq_len={cfg.seq_len} for presets)"
        )


def build_model(kind: str, spec: Any, cfg: TrainConfig, meta: bool = False) -> nn.Module:
    """The model in fp32 on the CPU (or on the meta device), initialized from ``cfg.seed``.
    ``--init-from`` weights are not read here: ``layershard.load_hf`` reads them after sharding,
    each rank only its slices."""
    torch.manual_seed(cfg.seed)  # identical init on every rank
    ctx = torch.device("meta") if meta else torch.device("cpu")
    if kind == "preset":
        with ctx:
            return LlamaForCausalLM(spec)
    import transformers

    with ctx:
        # (no dtype= here: it would put a torch.dtype into the config, which is not JSON)
        model = transformers.AutoModelForCausalLM.from_config(spec, trust_remote_code=False)
    return model.float()
