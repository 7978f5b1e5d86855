"""What the training loop feeds the model, with or without ``--cp`` (context parallelism).

Under CP (``ls.parallelize(cp=...)``, docs/context-parallel.md) the ranks of a CP group read the
same whole sequences, and each gives the model its part of them: its two chunks of every
sequence, their global positions and the labels shifted over the whole sequence
(``context_batch``). Without CP the model takes the whole batch as ``(input_ids, labels=)``.

The loop's loss weighting needs no change under CP. Rank ``r`` of a CP group returns ``loss_r =
cp x S_r / c`` (``ContextParallel.loss_divisor``): ``S_r`` the sum of its own token losses, ``c``
the group's micro-batch's target count, which ``count_targets`` also reads, the same on each of
the group's ranks (they read the whole sequences). The step's ``total`` sums that count over every
rank, so it is ``cp x G`` (``G``: the global batch's targets), and weights the micro-batch by ``w =
c x world / total``. The engine averages the gradients over the ``world = dp x cp`` ranks:
``(1 / world) sum_r w grad(loss_r) = sum_r grad(S_r) / G``, the gradient of the global batch's
mean, as without CP. The logged loss, ``sum_r loss_r x c / total = sum_r S_r / G``, is that mean
too, and evaluation (``loss x c`` and ``c`` summed over the world) the validation mean.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layershard.parallel.context import context_batch, positions


def model_inputs(
    model: Any,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    to_device: Callable[[torch.Tensor], torch.Tensor],
) -> dict[str, Any]:
    """The forward's keywords for a whole-sequence micro-batch (CPU tensors, ``(batch, seq)``):
    under CP this rank's part, split on the CPU so that only it goes to the device."""
    if getattr(model, "context_parallel", None) is None:
        return {"input_ids": to_device(input_ids), "labels": to_device(labels)}
    batch = context_batch(model, input_ids, labels=labels)
    # (tensors to the device; a flag such as a transformers model's use_cache as it is)
    return {k: to_device(v) if isinstance(v := batch[k], torch.Tensor) else v for k in batch}


def next_token_logits(model: Any, ids: torch.Tensor) -> torch.Tensor:
    """The logits of the token after ``ids`` (``(1, t)``, on the model's device): the last row of
    ``model(ids).logits``. Under CP every rank of the group calls it with the same ids: the
    sequence is padded on the right to a multiple of ``2 x cp`` (causal attention: the padding
    changes no earlier position's output), split as in training, and the rank that holds
    position ``t - 1`` shares its row with the group (an all-reduce of one row)."""
    ctx = getattr(model, "context_parallel", None)
    if ctx is None:
        return model(ids).logits[0, -1]
    t = ids.shape[1]
    padded = F.pad(ids, (0, (-t) % (2 * ctx.size)), value=0)
    batch = context_batch(model, padded)
    logits = model(**batch).logits[0]  # this rank's rows, in the layout's order
    mine = positions(padded.shape[1], ctx.size, ctx.rank, device=logits.device) == t - 1
    row = logits[mine].float().sum(0)  # the row, or zeros on the ranks that do not hold it
    dist.all_reduce(row, group=ctx.group)
    return row
