"""``context_batch``: a rank's part of a whole-sequence batch under context parallelism, ready
for the model's forward (``model(**context_batch(model, input_ids, labels))``).

Every rank of a CP group holds the same whole sequences (the group's data-parallel
micro-batch); each keeps its two chunks of every per-token tensor (``layout.split``), with:

- ``position_ids``: the global positions of its tokens, for RoPE (``layout.positions``); given
  position ids (packed documents, restarting at 0 at each document) are split as they are;
- ``shift_labels``: the labels shifted over the whole sequence *before* the split, so that a
  chunk's last token predicts the first token of the next chunk, wherever that lives;
- ``document_ids``: only for packed sequences (position ids other than ``0 .. seq - 1``), the
  documents the attention keeps apart (``layout.document_ids``);
- for a transformers model, with labels, also ``labels`` (the shifted labels again: its forward
  computes a loss only when ``labels`` is given, and ``ForCausalLMLoss`` reads ``shift_labels``
  first) and ``num_items_in_batch``, the loss's divisor (below); and ``use_cache=False``: with a
  cache (``use_cache`` defaults to the config's, true) transformers does not mask packed
  documents apart from their position ids, and under CP a cache of a rank's own keys means
  nothing.

Note: a transformers model's loss is ``sum of this rank's token losses / num_items_in_batch``
(``ForCausalLMLoss``). ``num_items_in_batch`` is the whole micro-batch's target count over
``cp``, the divisor of ``ContextParallel.loss_divisor`` (its Note says why ``/ cp``): every rank
of the group holds the whole sequences here, so it counts them without a collective, and the
rank's loss is the built-in model's. On one process (``cp == 1``) it is the count itself: the
mean over the batch's targets, as ``labels=`` alone gives.

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
from layershard.parallel.context.state import ContextParallel, is_transformers_model


@dataclass(frozen=True)
class ContextBatch:
    """This rank's part of a batch, as the model's forward takes it: a mapping of the keywords
    that are set (``model(**batch)``), also readable as attributes. Each is (batch, seq / cp),
    but ``num_items_in_batch``, a scalar, and ``use_cache`` (transformers models only, as
    ``labels``)."""

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    shift_labels: torch.Tensor | None = None
    document_ids: torch.Tensor | None = None
    labels: torch.Tensor | None = None
    num_items_in_batch: torch.Tensor | None = None
    use_cache: bool | None = None

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def __getitem__(self, key: str) -> Any:
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
    batch); a transformers model also gets ``labels``, ``num_items_in_batch`` and
    ``use_cache=False``. ``input_ids``, ``labels``: (batch, seq), labels unshifted as for
    ``model(input_ids, labels=labels)``; ``position_ids``: (batch, seq) or (seq,), default
    ``0 .. seq - 1``. ``seq`` must be divisible by ``2 x cp`` (``ValueError`` otherwise).

    Packing documents, mask each document's first label (``ignore_index``) so that no document
    learns to predict the next one's first token, as transformers' ``DataCollatorWithFlattening``
    does."""
    ctx = model if isinstance(model, ContextParallel) else getattr(model, "context_parallel", None)
    cp, rank = (1, 0) if ctx is None else (ctx.size, ctx.rank)
    hf = ctx.transformers if ctx is not None else is_transformers_model(model)
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

    ids, pos, targets = local(input_ids), local(position_ids), local(shifted)
    assert ids is not None and pos is not None
    if not hf:
        return ContextBatch(ids, pos.contiguous(), targets, local(docs))
    # the whole micro-batch's target count (module Note)
    num = None if shifted is None else (shifted != ignore_index).sum().float() / cp
    return ContextBatch(ids, pos.contiguous(), targets, local(docs), targets, num, use_cache=False)
