"""The training command's optimizer settings: which parameters get weight decay, and the
learning rate at each step."""

from __future__ import annotations

import fnmatch
import math
from typing import Any

from torch import nn

from layershard.train.config import TrainConfig


def param_groups(named_params, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Weight decay by parameter NAME (sharded parameters are 1-D, so ndim says nothing):
    names matching ``cfg.no_decay`` (norms, biases, embeddings by default) get none."""
    decay: list[nn.Parameter] = []
    no_decay: list[nn.Parameter] = []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        skip = any(fnmatch.fnmatchcase(name, pat) for pat in cfg.no_decay)
        (no_decay if skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)
