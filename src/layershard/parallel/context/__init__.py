"""Context parallelism (issue 49, long sequences): one sequence split over the ranks of a
context-parallel (CP) group, each rank holding ``T / cp`` of its tokens.

- ``layout``: the load-balanced causal layout (rank ``r`` holds chunks ``r`` and ``2 cp - 1 - r``
  of ``2 cp``), global positions for RoPE, labels shifted over the whole sequence, and the loss
  normalized by the whole sequence's targets;
- ``ring``: ring attention, keys and values passed around the ring point to point;
- ``all_to_all``: Ulysses-style attention, heads exchanged for the sequence by two all-to-alls;
- ``state``: ``ContextParallel``, what a model parallelized with ``cp`` computes with (the group,
  the mode, the loss's divisor), and the attention of packed documents on one process;
- ``batch``: ``context_batch``, a rank's part of a whole-sequence batch for the model's forward
  (the built-in Llama's keywords, or a transformers model's).

Both attentions take q, k, v in the layout and return this rank's rows of causal attention over
the whole sequence, exact against one process up to fp32 rounding.
"""

from layershard.parallel.context.all_to_all import all_to_all_attention
from layershard.parallel.context.batch import ContextBatch, context_batch
from layershard.parallel.context.layout import (
    check_seq_len,
    document_ids,
    gather,
    layout_order,
    loss_sum_and_count,
    positions,
    shift_labels,
    split,
    target_count,
)
from layershard.parallel.context.ring import ring_attention
from layershard.parallel.context.state import (
    MODES,
    ContextParallel,
    document_attention,
    is_transformers_model,
)

__all__ = [
    "MODES",
    "ContextBatch",
    "ContextParallel",
    "all_to_all_attention",
    "check_seq_len",
    "context_batch",
    "document_attention",
    "document_ids",
    "gather",
    "is_transformers_model",
    "layout_order",
    "loss_sum_and_count",
    "positions",
    "ring_attention",
    "shift_labels",
    "split",
    "target_count",
]
