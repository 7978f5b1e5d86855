"""The load-balanced causal layout of a sequence over a context-parallel (CP) group, and the
labels and loss that go with it.

A sequence of ``T`` tokens is cut into ``2 cp`` chunks of ``T / (2 cp)``; CP rank ``r`` holds
chunks ``r`` and ``2 cp - 1 - r``, concatenated in that order (its *local* sequence, ``T / cp``
tokens). Under a causal mask the work of a query chunk grows with its index, so pairing an early
chunk with a late one gives every rank the same work (Megatron-Core's and ring-flash-attention's
"zigzag" layout). Rank 0 of cp 2 holds chunks 0 and 3 of 4, rank 1 chunks 1 and 2.

What a model step does with it (the model integration):

- every per-token input (ids, position ids, document ids, labels) is split with ``split``; RoPE
  takes the *global* positions of the local tokens (``positions``), not ``arange(T / cp)``;
- labels are shifted over the whole sequence *before* the split (``shift_labels``): position
  ``i`` predicts token ``i + 1``, so a chunk's last position predicts the first token of the
  next chunk, which may live on another rank;
- the loss is the mean over the valid targets of the whole sequence: each rank divides the sum
  of its own token losses by the number of valid targets of the whole sequence (all-reduced over
  the CP group, ``target_count``). The ranks' losses then add up to the one-process mean, and so
  do their gradients: a parameter's gradient must be *summed* over the CP group. A
  data-parallel reduction that averages over a world including the CP ranks divides by ``cp``
  too many: the integration then multiplies the loss by ``cp`` or leaves the CP ranks out of
  the divisor.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from layershard.engine.collectives import all_gather_single

IGNORE_INDEX = -100


def check_seq_len(seq_len: int, cp: int) -> None:
    """Raise ``ValueError`` unless ``seq_len`` splits into ``2 cp`` equal chunks."""
    if cp < 1 or seq_len % (2 * cp):
        raise ValueError(
            f"sequence length {seq_len} must be divisible by 2 x cp = {2 * cp} for context "
            f"parallelism over {cp} ranks (pad the sequence or choose another cp)"
        )


def chunk_ids(cp: int, rank: int) -> tuple[int, int]:
    """The indices, out of ``2 cp``, of the two chunks CP rank ``rank`` holds, in local order."""
    return rank, 2 * cp - 1 - rank


def split(x: torch.Tensor, cp: int, rank: int, dim: int = 1) -> torch.Tensor:
    """This rank's local part of the whole-sequence ``x`` (sequence along ``dim``): its two
    chunks concatenated (a copy)."""
    check_seq_len(x.shape[dim], cp)
    c = x.shape[dim] // (2 * cp)
    return torch.cat([x.narrow(dim, i * c, c) for i in chunk_ids(cp, rank)], dim=dim)


def positions(
    seq_len: int, cp: int, rank: int, device: torch.device | str | None = None
) -> torch.Tensor:
    """The global positions (int64, ``seq_len / cp``) of this rank's local tokens: what RoPE
    takes (``cos[positions]``) where one process would take ``arange(seq_len)``."""
    return split(torch.arange(seq_len, device=device), cp, rank, dim=0)


def layout_order(seq_len: int, cp: int, device: torch.device | str | None = None) -> torch.Tensor:
    """The global position of every token when the ranks' local sequences are concatenated in
    rank order (what an all-gather over the CP group returns): ``whole[layout_order] =
    concatenated``."""
    return torch.cat([positions(seq_len, cp, r, device) for r in range(cp)])


def gather(x_local: torch.Tensor, group: dist.ProcessGroup, dim: int = 1) -> torch.Tensor:
    """The whole sequence, in natural order, from every CP rank's local part (sequence along
    ``dim``), on every rank. Not differentiable (the result requires no gradient): for ids,
    labels, document ids and tests."""
    cp = dist.get_world_size(group)
    x = x_local.detach().movedim(dim, 0).contiguous()
    out = x.new_empty((cp * x.shape[0], *x.shape[1:]))
    all_gather_single(out, x, group=group)
    whole = torch.empty_like(out)
    whole[layout_order(out.shape[0], cp, out.device)] = out
    return whole.movedim(0, dim)


def shift_labels(labels: torch.Tensor, ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """The next-token targets of the whole sequence ``labels`` (batch, seq): position ``i``
    predicts ``labels[:, i + 1]``, the last position nothing (``ignore_index``), as
    ``chunked_causal_lm_loss`` and transformers' ``ForCausalLMLoss`` shift them. Shift first,
    then ``split``: the loss must not shift the local labels again (pass them as its
    ``shift_labels``)."""
    return F.pad(labels[..., 1:], (0, 1), value=ignore_index)


def document_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """Document ids (int64, same shape) of packed sequences from their whole-sequence position
    ids, which restart at 0 at each document: a new document at every 0. Split the result like
    the inputs and pass it as the attention's ``doc_ids``."""
    return (position_ids == 0).long().cumsum(-1)


def target_count(
    local_labels: torch.Tensor, group: dist.ProcessGroup, ignore_index: int = IGNORE_INDEX
) -> torch.Tensor:
    """The number of valid targets of the whole sequence (fp32, the same on every CP rank):
    the local shifted labels' count, summed over ``group``. The divisor of every rank's loss
    (``chunked_causal_lm_loss(..., num_items_in_batch=target_count(...))``)."""
    count = (local_labels != ignore_index).sum().float()
    dist.all_reduce(count, group=group)
    return count


def loss_sum_and_count(
    logits: torch.Tensor,
    local_labels: torch.Tensor,
    group: dist.ProcessGroup,
    ignore_index: int = IGNORE_INDEX,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sum of this rank's token cross-entropies (fp32 logits) against its local shifted
    labels, and the whole sequence's ``target_count``. ``sum / count`` is this rank's share of
    the whole-sequence mean: the shares add up to it over ``group``, as their gradients do."""
    total = F.cross_entropy(
        logits.float().flatten(0, -2),
        local_labels.flatten(),
        ignore_index=ignore_index,
        reduction="sum",
    )
    return total, target_count(local_labels, group, ignore_index)
