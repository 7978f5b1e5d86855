"""Checks of a run that need the tokenizer and the prepared data, made by the launcher after data
preparation and before it writes the run folder or starts a rank (``launch.prepare``). The config
itself is validated by its schema (``config.TrainConfig``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from layershard.train.config import ConfigError, TrainConfig
from layershard.train.data.batches import TokenSplit
from layershard.train.modeling import model_spec

_CHUNK = 1 << 24  # mask bytes read at a time: the check streams through the memory map


def check_prepared(cfg: TrainConfig, vocab_size: int, manifest: dict[str, Any]) -> None:
    """The model has a row for every token id; an SFT split has something to train on."""
    model_spec(cfg, vocab_size)
    if cfg.task == "sft":
        check_sft_targets(cfg, TokenSplit.from_dict(manifest["train"]))


def check_sft_targets(cfg: TrainConfig, split: TokenSplit) -> None:
    """Refuse an SFT training split in which no window of ``seq_len`` tokens holds a response
    token as a target (every prompt longer than the sequence: it would train on nothing)."""
    _, mask = split.open()
    n = cfg.seq_len
    windows = split.n_tokens // n
    if mask is None or windows == 0:
        return
    per_chunk = max(1, _CHUNK // n)
    for start in range(0, windows, per_chunk):
        stop = min(windows, start + per_chunk)
        block = np.asarray(mask[start * n : stop * n]).reshape(-1, n)
        if block[:, 1:].any():  # the first token of a window is never a target
            return
    raise ConfigError(
        f"--task sft: no response token falls within the first {n} tokens of a sequence in the "
        f"training split (prompts longer than --seq-len {n}?), so there is nothing to train on; "
        "raise --seq-len or shorten the prompts"
    )
