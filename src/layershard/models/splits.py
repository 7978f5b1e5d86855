"""Can a model be split ``tp`` and ``ep`` ways? The checks ``ls.parallelize`` makes before it
splits anything, and ``layershard train`` makes on a meta-device copy of the model before it
starts a rank, so that a split that cannot work is one line naming the layer and the fix, not a
matmul shape error in the first step.

- Tensor parallelism: every layer the model's TP plan splits column-wise (a ``Linear``'s output
  features, an ``Embedding``'s width) or row-wise (a ``Linear``'s input features, an
  ``Embedding``'s rows) must divide by ``tp``: torch's styles would shard it unevenly, and the
  heads' reshapes and the row-wise partial sums assume equal parts.
- Expert parallelism: the model has expert layers (the built-in MoE's ``Experts``, transformers'
  stacked experts), and ``ep`` divides each one's number of experts.
"""

from __future__ import annotations

import fnmatch

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from layershard.models.moe import Experts
from layershard.parallel.expert import is_hf_experts


def expert_counts(model: nn.Module) -> list[int]:
    """The number of experts of each expert layer of ``model`` (empty for a dense model)."""
    counts = []
    for m in model.modules():
        if isinstance(m, Experts):
            counts.append(m.n_experts)
        elif is_hf_experts(m):
            counts.append(int(getattr(m, "gate_up_proj").shape[0]))  # noqa: B009
    return counts


def check_ep(model: nn.Module, ep: int) -> None:
    """Raise ``ValueError`` (one line) unless ``model``'s experts split ``ep`` ways."""
    if ep == 1:
        return
    counts = expert_counts(model)
    if not counts:
        raise ValueError(
            f"ep={ep}: the model has no expert layers to split (the built-in MoE's Experts, "
            "transformers' Qwen3-MoE and Mixtral experts); use ep=1 for a dense model"
        )
    odd = sorted({n for n in counts if n % ep})
    if odd:
        raise ValueError(
            f"ep={ep} must divide every expert layer's number of experts (got {odd[0]}); choose "
            f"ep among the divisors of {odd[0]}"
        )


def _split_dim(module: nn.Module, style: ParallelStyle) -> tuple[str, int] | None:
    """(what the style splits, its size) for a column- or row-wise ``Linear`` or ``Embedding``."""
    column = isinstance(style, ColwiseParallel)
    if not column and not isinstance(style, RowwiseParallel):
        return None  # replicated styles (Qwen3's norms) split nothing
    if isinstance(module, nn.Linear):
        if column:
            return "output features (column-wise split)", module.out_features
        return "input features (row-wise split)", module.in_features
    if isinstance(module, nn.Embedding):
        if column:
            return "embedding width (column-wise split)", module.embedding_dim
        return "rows (row-wise split)", module.num_embeddings
    return None


def check_tp(root: nn.Module, plan: dict[str, ParallelStyle], tp: int, prefix: str = "") -> None:
    """Raise ``ValueError`` (one line) unless every module of ``root`` that ``plan`` (a
    ``parallelize_module`` plan for ``root``, names with ``*`` wildcards) splits divides by
    ``tp``. ``prefix``: ``root``'s name in the model, for the message."""
    if tp == 1:
        return
    for name, module in root.named_modules():
        for pattern, style in plan.items():
            if not fnmatch.fnmatchcase(name, pattern):
                continue
            split = _split_dim(module, style)
            if split is not None and split[1] % tp:
                what, n = split
                raise ValueError(
                    f"tp={tp} must divide the {what} of {prefix}{name}: {n}; choose tp among the "
                    f"divisors of {n}, or resize the layer"
                )
