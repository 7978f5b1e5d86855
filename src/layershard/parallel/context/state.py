"""What a model computes with under context parallelism: ``ContextParallel``, the one piece of
state ``ls.parallelize(cp=...)`` gives the built-in Llama or a transformers model (the model and
each of its attention modules hold the same object), and the attention of packed documents on
one process.

The object is static for the run: the CP group, the mode, and where the group's micro-batch
sits in the data-parallel split. What changes per batch (positions, document ids, shifted
labels) is passed to the model's forward as arguments (``batch.context_batch`` makes them), and
through the blocks as arguments too, so that a checkpointed block's recompute in backward sees
its own batch's document ids, whatever ran in between.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layershard.parallel.context.all_to_all import all_to_all_attention
from layershard.parallel.context.layout import IGNORE_INDEX, target_count
from layershard.parallel.context.ring import ring_attention

MODES = ("ring", "all_to_all")


@dataclass(frozen=True, eq=False)
class ContextParallel:
    """A model's context parallelism: its sequences split over the ranks of ``group`` in the
    load-balanced layout (``layout.py``), attention by ``mode`` (``"ring"``: ``ring.py``;
    ``"all_to_all"``: ``all_to_all.py``). ``data_rank`` / ``data_size``: which of the
    data-parallel micro-batches the group trains on, and how many there are (``ls.parallelize``
    makes the CP groups of consecutive ranks: ``rank // cp`` of ``world // cp``).
    ``transformers``: the model is a transformers model, whose forward takes transformers'
    keywords (``batch.context_batch`` adds ``labels`` and ``num_items_in_batch``)."""

    group: dist.ProcessGroup
    mode: str = "ring"
    data_rank: int = 0
    data_size: int = 1
    transformers: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"cp_mode must be 'ring' or 'all_to_all', got {self.mode!r}")

    @property
    def size(self) -> int:
        """The number of ranks one sequence is split over (cp)."""
        return dist.get_world_size(self.group)

    @property
    def rank(self) -> int:
        """This rank's place in the CP group: which two chunks of each sequence it holds."""
        return dist.get_rank(self.group)

    def check_inputs(self, position_ids: torch.Tensor | None, labels: torch.Tensor | None) -> None:
        """Refuse, in one line, a forward that would be silently wrong: without positions RoPE
        would take ``0 .. seq / cp - 1`` on every rank, and labels shifted locally would lose
        the target of each chunk's last token, which lives on another rank."""
        if position_ids is None or labels is not None:
            raise ValueError(
                "under context parallelism pass this rank's position_ids and shift_labels, not "
                "labels: model(**context_batch(model, input_ids, labels)) (layershard.parallel."
                "context)"
            )

    def attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        doc_ids: torch.Tensor | None = None,
        scale: float | None = None,
    ) -> torch.Tensor:
        """This rank's rows of causal attention over the whole sequence (within documents when
        ``doc_ids`` is given): q (batch, heads, local_seq, head_dim), k and v with their kv
        heads, RoPE applied with the global positions; ``scale`` default ``1 / sqrt(head_dim)``.
        Every rank of the group calls it."""
        attend = ring_attention if self.mode == "ring" else all_to_all_attention
        return attend(q, k, v, self.group, doc_ids=doc_ids, scale=scale)

    def loss_divisor(
        self, local_labels: torch.Tensor, ignore_index: int = IGNORE_INDEX
    ) -> torch.Tensor:
        """What this rank divides the sum of its token losses by: the whole sequence's target
        count (``layout.target_count``, an all-reduce over the group) over ``cp``.

        Note: the gradient reduction of ``ls.shard`` averages over every rank of the model,
        which with CP is ``dp x cp`` ranks (the weights are sharded over both), while the
        batch's loss is the mean over its ``dp`` micro-batches of each micro-batch's mean over
        its tokens, that is of the *sum* of its ``cp`` ranks' shares ``local_sum / count``.
        Dividing by ``count / cp`` makes each rank's loss ``cp`` times its share, so the
        average over ``dp x cp`` ranks is that mean again, and so is the averaged gradient:
        the single process's, with the engine's divisor untouched (the other way, leaving
        the CP ranks out of the divisor, would change every reduction of the engine). The
        mean of the ranks' returned losses over the whole world is the batch's loss, as
        under plain data parallelism; over one CP group, the group's micro-batch's."""
        return target_count(local_labels, self.group, ignore_index) / self.size


def is_transformers_model(model: object) -> bool:
    """Whether ``model`` (or the model a ``ShardedModule`` wraps) is a transformers
    ``PreTrainedModel``. Without transformers imported no model can be one, so this layer
    neither needs nor imports it."""
    tf = sys.modules.get("transformers")
    inner = getattr(model, "module", model)
    return tf is not None and isinstance(inner, tf.PreTrainedModel)


def document_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, doc_ids: torch.Tensor
) -> torch.Tensor:
    """Causal attention within documents on one process: q (batch, heads, seq, head_dim) over
    k, v (batch, kv_heads, seq, head_dim), a query attending to the earlier keys of its own
    document (``doc_ids`` (batch, seq): equal ids, one document). A dense boolean mask,
    ``seq^2`` bytes a row, as ``all_to_all_attention``'s; kv heads repeated as
    ``parallel.attention.causal_attention`` does where the kernel would not take them grouped."""
    t, rep = q.shape[2], q.shape[1] // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
    mask = (doc_ids[:, :, None] == doc_ids[:, None, :]) & causal
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None])
