"""Ulysses-style context parallelism (DeepSpeed-Ulysses): trade the sequence for the heads by
an all-to-all, attend over the whole sequence with a share of the heads, and trade back.

Each rank of the CP group enters with its local sequence (the load-balanced layout of
``layout.py``) and all heads; the first all-to-all gives it the whole sequence for ``heads / cp``
heads (rank ``j``: heads ``j heads / cp .. (j + 1) heads / cp - 1``), put in natural order; it
runs causal ``scaled_dot_product_attention`` on them (one process's kernel, so the output is
one process's for those heads), and the reverse all-to-all returns its local sequence with all
heads. Both all-to-alls are ``all_to_all_single_autograd``: the backward is the reverse exchange
of the gradients, so nothing needs a custom backward.

Compared with ring attention: two all-to-alls of q, k, v and the output instead of ``cp - 1``
hops of k and v, and the attention kernel sees whole sequences; but the heads must divide by
``cp``, and a rank holds the whole sequence for its heads (activation memory of attention as
one process's for ``heads / cp`` heads).

Grouped-query attention: the kv heads go through the all-to-all as they are when ``cp`` divides
them. When it does not, each kv head is first repeated (``repeat_interleave``) to
``lcm(kv_heads, cp)`` heads, which ``heads`` (a multiple of both) divides; rank ``j``'s q heads
then use exactly its kv heads. Repeated heads cost their share of the exchange, and their
gradients are summed back by ``repeat_interleave``'s backward. On the rank, the kernel gets its
q heads and kv heads as the one-process model gives them (``parallel.attention.causal_attention``:
grouped where the kernel takes them exactly, else repeated), so that it saves the same bytes per
head for backward; with documents' dense mask (math or flash with a mask) they are repeated.

Documents (``doc_ids``): the whole sequence's document ids make a dense (batch, 1, T, T) boolean
mask with causality, so the mask costs ``T^2`` bytes per sequence on every rank: for long packed
sequences ring attention (a ``c x c`` mask per block) is the economical mode.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed._functional_collectives import all_to_all_single_autograd

from layershard.parallel.attention import causal_attention
from layershard.parallel.context.layout import gather, layout_order


def _to_heads(x: torch.Tensor, group: dist.ProcessGroup, natural: torch.Tensor) -> torch.Tensor:
    """(batch, H, local_seq, d) on each rank -> (batch, H / cp, T, d), the sequence in natural
    order (``natural``: for each global position, where it sits in rank-major layout order)."""
    cp = dist.get_world_size(group)
    b, h, s, d = x.shape
    send = x.view(b, cp, h // cp, s, d).movedim(1, 0).contiguous()
    recv = all_to_all_single_autograd(send, None, None, group)  # block j: rank j's tokens
    whole = recv.view(cp, b, h // cp, s, d).permute(1, 2, 0, 3, 4).reshape(b, h // cp, cp * s, d)
    return whole.index_select(2, natural)


def _to_seq(y: torch.Tensor, group: dist.ProcessGroup, order: torch.Tensor) -> torch.Tensor:
    """``_to_heads``'s inverse: (batch, H / cp, T, d) in natural order -> (batch, H, local_seq,
    d), this rank's tokens in the layout (``order``: ``layout.layout_order``)."""
    cp = dist.get_world_size(group)
    b, h, t, d = y.shape
    s = t // cp
    send = y.index_select(2, order).view(b, h, cp, s, d).permute(2, 0, 1, 3, 4).contiguous()
    recv = all_to_all_single_autograd(send, None, None, group)  # block j: head group j
    return recv.view(cp, b, h, s, d).movedim(0, 1).reshape(b, cp * h, s, d)


def all_to_all_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence, by two all-to-alls over
    the CP ``group`` (module doc). Arguments and result as ``ring.ring_attention``: ``q``
    (batch, heads, local_seq, head_dim), ``k``, ``v`` (batch, kv_heads, local_seq, head_dim) in
    the load-balanced layout, ``doc_ids`` (batch, local_seq) in the same layout; returns this
    rank's rows, in ``q``'s dtype, differentiable in ``q``, ``k``, ``v``.

    ``heads`` must be divisible by the group's size (``ValueError`` otherwise); kv heads that are
    not are repeated (module doc)."""
    cp = dist.get_world_size(group)
    if q.dim() != 4 or k.dim() != 4 or k.shape != v.shape:
        raise ValueError(
            f"all_to_all_attention takes q (batch, heads, seq, head_dim) and k, v of one shape "
            f"(batch, kv_heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads % cp or heads % kv_heads:
        raise ValueError(
            f"all-to-all context parallelism needs heads ({heads}) divisible by cp ({cp}) and by "
            f"kv_heads ({kv_heads}); use ring attention or another cp"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:]:
        raise ValueError(
            f"q and k/v must share batch, local sequence and head_dim; got {tuple(q.shape)} and "
            f"{tuple(k.shape)}"
        )
    seq = q.shape[2] * cp
    order = layout_order(seq, cp, q.device)
    natural = torch.argsort(order)
    widen = math.lcm(kv_heads, cp) // kv_heads
    if widen > 1:
        k, v = k.repeat_interleave(widen, dim=1), v.repeat_interleave(widen, dim=1)
    qh, kh, vh = (_to_heads(x, group, natural) for x in (q, k, v))
    if doc_ids is None:  # grouped heads as the one-process model passes them (same bytes saved)
        y = causal_attention(qh, kh, vh, scale=scale)
    else:
        rep = qh.shape[1] // kh.shape[1]
        if rep > 1:
            kh, vh = kh.repeat_interleave(rep, dim=1), vh.repeat_interleave(rep, dim=1)
        docs = gather(doc_ids, group, dim=1)
        causal = torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril()
        mask = (docs[:, :, None] == docs[:, None, :]) & causal
        y = F.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask[:, None], scale=scale)
    return _to_seq(y, group, order)
