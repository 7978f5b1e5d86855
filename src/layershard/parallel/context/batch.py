"""``context_batch``: a rank's part of a whole-sequence batch under context parallelism, ready
for the model's forward (``model(**context_batch(model, input_ids, labels))``).

Every rank of a CP group holds the same whole sequences (the group's data-parallel
micro-batch); each keeps its two chunks of every per-token tensor (``layout.split``), with:

- ``position_ids``: the global positions of its tokens, for RoPE (``layout.positions``); given
  position ids (packed documents, restarting at 0 at each document) are split as they are;
- ``shift_labels``: the labels shifted over the whole sequence *before* the split, so that a
  chunk's last token predicts the first token of the next chunk, wherever that lives;
- ``document_ids``: only for packed sequences (position ids other than ``0 .. seq - 1``), the
  documents the attention keeps apart (``layout.document_ids``).

Without context parallelism (a model not parallelized with ``cp``, or ``cp == 1``) the same
call returns the whole batch with the same keywords: the single-process run of a CP run's
batch, as the tests compare them.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, fields
from typing import Any

import torch

from layershard.parallel.context.layout import (
    IGNORE_INDEX,
    check_seq_len,
    document_ids,
    shift_labels,
    split,
)
from layershard.parallel.context.state import ContextParallel


@dataclass(frozen=True)
class ContextBatch:
    """This rank's part of a batch, as the model's forward takes it: a mapping of the keywords
    that are set (``model(**batch)``), also readable as attributes. Each is (batch, seq / cp)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> torch.Tensor:
        if key not in self.keys():
            raise KeyError(key)
        return getattr(self, key)

    def __iter__(self) -> Iterator[str]:
        return iter(self.keys())


def context_batch(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor | None = None,
    position_ids: torch.Tensor | None = None,
    *,
    ignore_index: int = IGNORE_INDEX,
) -> ContextBatch:
    """This rank's ``input_ids``, ``position_ids``, ``shift_labels`` (with ``labels``) and, for
    packed sequences, ``document_ids``, out of the whole sequences of its CP group's
    micro-batch (the module doc). ``model``: a model parallelized by ``ls.parallelize(cp=...)``
    (or the model it wraps), its ``ContextParallel``, or any other model (no split: the whole
    batch). ``input_ids``, ``labels``: (batch, seq), labels unshifted as for
    ``model(input_ids, labels=labels)``; ``position_ids``: (batch, seq) or (seq,), default
    ``0 .. seq - 1``. ``seq`` must be divisible by ``2 x cp`` (``ValueError`` otherwise).

    Packing documents, mask each document's first label (``ignore_index``) so that no document
    learns to predict the next one's first token, as transformers' ``DataCollatorWithFlattening``
    does."""
    ctx = model if isinstance(model, ContextParallel) else getattr(model, "context_parallel", None)
    cp, rank = (1, 0) if ctx is None else (ctx.size, ctx.rank)
    if input_ids.dim() != 2:
        raise ValueError(
            f"context_batch: input_ids must be (batch, seq), got {tuple(input_ids.shape)}"
        )
    b, t = input_ids.shape
    if cp > 1:
        check_seq_len(t, cp)
    natural = torch.arange(t, device=input_ids.device).expand(b, t)
    docs = None
    if position_ids is None:
        position_ids = natural
    else:
        if position_ids.shape not in ((t,), (b, t)):
            raise ValueError(
                f"context_batch: position_ids must be (batch, seq) = {(b, t)} or (seq,), got "
                f"{tuple(position_ids.shape)}"
            )
        position_ids = position_ids.to(input_ids.device).expand(b, t)
        if not torch.equal(position_ids, natural):  # the same decision on every rank of the group
            docs = document_ids(position_ids)
    if labels is not None and labels.shape != input_ids.shape:
        raise ValueError(
            f"context_batch: labels {tuple(labels.shape)} and input_ids {tuple(input_ids.shape)} "
            "must have one shape"
        )
    shifted = None if labels is None else shift_labels(labels, ignore_index)

    def local(x: torch.Tensor | None) -> torch.Tensor | None:
        return x if x is None or cp == 1 else split(x, cp, rank)

    ids, pos = local(input_ids), local(position_ids)
    assert ids is not None and pos is not None
    return ContextBatch(ids, pos.contiguous(), local(shifted), local(docs))
