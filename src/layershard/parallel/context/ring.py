"""Ring attention: causal attention over a sequence split across a context-parallel (CP) group in
the load-balanced layout (``layout.py``), the keys and values travelling around the ring.

Each rank holds its local queries, keys and values: two chunks of ``c = T / (2 cp)`` tokens each,
chunks ``r`` and ``2 cp - 1 - r`` of the whole. In ``cp`` steps every rank sees every rank's keys
and values: at step ``t`` rank ``r`` holds those of rank ``r - t`` (mod ``cp``), and before it
computes with them it starts sending them on to rank ``r + 1`` and receiving the next block from
rank ``r - 1`` (``dist.batch_isend_irecv``), so the transfer overlaps the attention where the
backend runs point-to-point operations in the background (gloo's threads, NCCL's stream).

Per step, each of the four (query chunk ``i``, key chunk ``j``) pairs is, by the chunks' global
indices, full (``i > j``), causal (``i == j``: the chunks have the same positions) or skipped
(``i < j``), so every rank computes the same number of chunk pairs. Each pair's attention comes
with its log-sum-exp; the partial outputs merge by it exactly as softmax over the union would
(``_merge``), in fp32. With ``doc_ids`` a pair is also restricted to equal documents (an additive
``-inf`` mask per pair, ``c x c``), and a pair with no allowed (query, key) is skipped.

Backward (the standard ring-attention backward, as ring-flash-attention and Megatron-Core do it):
the keys and values travel the ring again, and each pair's gradients come from the attention
kernel's own backward given the *merged* output and the *merged* log-sum-exp, which makes each
pair's softmax the whole row's. The queries' gradient accumulates on its rank; the keys' and
values' gradients (fp32) travel with their block, each rank adding its pairs' share, and a last
hop brings them home to their owner.

Grouped-query attention: keys and values travel with their own ``kv_heads`` heads (communication
as without groups) and are repeated (``repeat_interleave``, as HF's ``repeat_kv``) on arrival, one
block at a time; their gradients are summed back over each group before they travel.

Kernels: ``_kernels`` is the one place that picks them. On CPU, ATen's flash attention for CPU
and its backward (memory per ``c x c`` block, fp32 accumulation). On any other device, plain
blockwise math (``q k^T``, masks, ``logsumexp``; memory per block too), which is device-agnostic
but slower: a CUDA build would put ``_scaled_dot_product_flash_attention`` /
``_efficient_attention`` and their backwards there. Only the CPU paths (flash and math) are
tested; nothing here has run on CUDA.

Note: the ring's buffers. A tensor being sent is the one this step computes with, and nothing
writes it until its send is waited for (the end of the step); every receive lands in a new
buffer, so a block is never overwritten while in use. Every rank issues its operations in the
same order (forward: keys/values of step ``t``; backward: keys/values of step ``t``, then the
gradients of step ``t``), and keys/values and gradients carry different tags, so each receive
matches the send meant for it on gloo (which matches by tag and order) and on NCCL (order only).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
from torch.autograd.function import once_differentiable

from layershard.engine.collectives import all_gather_single
from layershard.parallel.context.layout import chunk_ids

_KV_TAG, _GRAD_TAG = 1, 2
_NEG_INF = float("-inf")

Forward = Callable[..., tuple[torch.Tensor, torch.Tensor]]
Backward = Callable[..., tuple[torch.Tensor, torch.Tensor, torch.Tensor]]


# ---- block kernels -------------------------------------------------------------------------


def _flash_cpu_forward(q, k, v, causal: bool, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q, k, v, 0.0, causal, attn_mask=mask, scale=scale
    )


def _flash_cpu_backward(dout, q, k, v, out, lse, causal: bool, mask, scale):
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout, q, k, v, out, lse, 0.0, causal, attn_mask=mask, scale=scale
    )


def _scores(q, k, causal: bool, mask, scale) -> torch.Tensor:
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        above = torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).triu(1)
        s = s.masked_fill(above, _NEG_INF)
    return s if mask is None else s + mask.float()


def _math_forward(q, k, v, causal: bool, mask, scale):
    s = _scores(q, k, causal, mask, scale)
    lse = s.logsumexp(-1)
    p = torch.exp(s - lse.masked_fill(lse == _NEG_INF, 0.0)[..., None])  # empty rows: p = 0
    return (p @ v.float()).to(q.dtype), lse


def _math_backward(dout, q, k, v, out, lse, causal: bool, mask, scale):
    scale = scale if scale is not None else 1.0 / math.sqrt(q.shape[-1])
    p = torch.exp(_scores(q, k, causal, mask, scale) - lse[..., None])
    do = dout.float()
    dv = p.transpose(-1, -2) @ do
    delta = (do * out.float()).sum(-1, keepdim=True)
    ds = p * (do @ v.float().transpose(-1, -2) - delta) * scale
    dq, dk = ds @ k.float(), ds.transpose(-1, -2) @ q.float()
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def _kernels(device: torch.device) -> tuple[Forward, Backward]:
    """The block attention kernels for ``device``: ``forward(q, k, v, causal, mask, scale) ->
    (out, lse)`` and ``backward(dout, q, k, v, out, lse, causal, mask, scale) -> (dq, dk, dv)``.
    A CUDA path (flash or memory-efficient attention, unverified here) goes here."""
    if device.type == "cpu":
        return _flash_cpu_forward, _flash_cpu_backward
    return _math_forward, _math_backward


# ---- the ring ------------------------------------------------------------------------------


class _Pair(NamedTuple):
    """One (query chunk, key chunk) pair to compute: local halves ``q`` and ``kv`` (0 or 1), the
    kernel's causal flag, the additive document mask (batch, 1, c, c) and its empty rows."""

    q: int
    kv: int
    causal: bool
    mask: torch.Tensor | None
    empty: torch.Tensor | None


def _pairs(
    rank: int, src: int, cp: int, c: int, docs: torch.Tensor | None, dtype: torch.dtype
) -> list[_Pair]:
    """The pairs of this rank's queries with rank ``src``'s keys that have work (module doc)."""
    out = []
    for a, i in enumerate(chunk_ids(cp, rank)):
        for b, j in enumerate(chunk_ids(cp, src)):
            if i < j:
                continue
            if docs is None:
                out.append(_Pair(a, b, i == j, None, None))
                continue
            dq, dk = docs[rank][:, a * c : (a + 1) * c], docs[src][:, b * c : (b + 1) * c]
            allowed = same = dq[:, :, None] == dk[:, None, :]
            if i == j:
                allowed = same & torch.ones(c, c, dtype=torch.bool, device=same.device).tril()
            if not allowed.any():
                continue
            if same.all():  # one document: the plain pair
                out.append(_Pair(a, b, i == j, None, None))
                continue
            mask = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device)
            mask = mask.masked_fill(~allowed, _NEG_INF)[:, None]
            empty = ~allowed.any(-1)[:, None]
            out.append(_Pair(a, b, False, mask, empty if empty.any() else None))
    return out


def _exchange(t: torch.Tensor, group: dist.ProcessGroup, tag: int) -> tuple[torch.Tensor, list]:
    """Start sending ``t`` to the next rank of the ring and receiving the previous rank's into a
    new buffer; returns the buffer and the works to wait for (module Note)."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    recv = torch.empty_like(t)
    ops = [
        dist.P2POp(dist.isend, t, group=group, group_peer=(rank + 1) % cp, tag=tag),
        dist.P2POp(dist.irecv, recv, group=group, group_peer=(rank - 1) % cp, tag=tag),
    ]
    return recv, dist.batch_isend_irecv(ops)


def _wait(works: list) -> None:
    for w in works:
        w.wait()


def _merge(acc: tuple | None, out: torch.Tensor, lse: torch.Tensor) -> tuple:
    """Two softmax-weighted partial outputs of the same queries as one, by their log-sum-exps.
    Rows empty in both stay empty (output 0, log-sum-exp ``-inf``)."""
    if acc is None:
        return out.float(), lse
    acc_out, acc_lse = acc
    new = torch.logaddexp(acc_lse, lse)
    ref = new.masked_fill(new == _NEG_INF, 0.0)
    merged = (
        acc_out * torch.exp(acc_lse - ref)[..., None]
        + out.float() * torch.exp(lse - ref)[..., None]
    )
    return merged, new


def _repeat(t: torch.Tensor, rep: int) -> torch.Tensor:
    return t.repeat_interleave(rep, dim=1) if rep > 1 else t


def _fold(g: torch.Tensor, rep: int) -> torch.Tensor:
    """A repeated kv head's gradient summed back over its group (repeat_interleave's backward)."""
    return g.unflatten(1, (-1, rep)).sum(2) if rep > 1 else g


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        group: dist.ProcessGroup,
        docs: torch.Tensor | None,
        scale: float | None,
    ) -> torch.Tensor:
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        forward, _ = _kernels(q.device)
        acc: list[tuple | None] = [None, None]
        kv = torch.stack([k, v])
        for step in range(cp):
            if step + 1 < cp:
                arriving, works = _exchange(kv, group, _KV_TAG)
            kk, vv = _repeat(kv[0], rep), _repeat(kv[1], rep)
            for p in _pairs(rank, (rank - step) % cp, cp, c, docs, q.dtype):
                qs, ks = slice(p.q * c, (p.q + 1) * c), slice(p.kv * c, (p.kv + 1) * c)
                o, lse = forward(q[:, :, qs], kk[:, :, ks], vv[:, :, ks], p.causal, p.mask, scale)
                if p.empty is not None:  # the kernel gives such rows a log-sum-exp of 0
                    lse = lse.masked_fill(p.empty, _NEG_INF)
                acc[p.q] = _merge(acc[p.q], o, lse)
            if step + 1 < cp:
                _wait(works)
                kv = arriving
        # every query chunk meets its own diagonal pair at step 0, so both are set
        out = torch.cat([a[0] for a in acc], dim=2).to(q.dtype)  # type: ignore[index]
        lse = torch.cat([a[1] for a in acc], dim=2)  # type: ignore[index]
        ctx.save_for_backward(q, k, v, out, lse, docs)
        ctx.group, ctx.scale = group, scale
        return out

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, dout: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        q, k, v, out, lse, docs = ctx.saved_tensors
        group, scale = ctx.group, ctx.scale
        cp, rank = dist.get_world_size(group), dist.get_rank(group)
        c, rep = q.shape[2] // 2, q.shape[1] // k.shape[1]
        _, backward = _kernels(q.device)
        dout = dout.contiguous()
        dq = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
        kv = torch.stack([k, v])
        grads: torch.Tensor | None = None  # the gradient of the block in hand, ranks before
        grad_works: list = []
        for step in range(cp):
            if step + 1 < cp:
                arriving, kv_works = _exchange(kv, group, _KV_TAG)
            kk, vv = _repeat(kv[0], rep), _repeat(kv[1], rep)
            dkv = torch.zeros((2, *k.shape), dtype=torch.float32, device=k.device)
            for p in _pairs(rank, (rank - step) % cp, cp, c, docs, q.dtype):
                qs, ks = slice(p.q * c, (p.q + 1) * c), slice(p.kv * c, (p.kv + 1) * c)
                gq, gk, gv = backward(
                    dout[:, :, qs], q[:, :, qs], kk[:, :, ks], vv[:, :, ks],
                    out[:, :, qs], lse[:, :, qs], p.causal, p.mask, scale,
                )  # fmt: skip
                dq[:, :, qs] += gq
                dkv[0, :, :, ks] += _fold(gk, rep)
                dkv[1, :, :, ks] += _fold(gv, rep)
            if grads is not None:
                _wait(grad_works)
                dkv += grads
            if cp > 1:  # on to the next rank; after the last step, home to the block's owner
                grads, grad_works = _exchange(dkv, group, _GRAD_TAG)
            if step + 1 < cp:
                _wait(kv_works)
                kv = arriving
        if grads is not None:
            _wait(grad_works)
            dkv = grads
        return dq.to(q.dtype), dkv[0].to(k.dtype), dkv[1].to(v.dtype), None, None, None


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    group: dist.ProcessGroup,
    *,
    doc_ids: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal attention of this rank's queries over the whole sequence's keys and values, the
    sequence split over the CP ``group`` in the load-balanced layout (``layout.split``).

    ``q``: (batch, heads, local_seq, head_dim); ``k``, ``v``: (batch, kv_heads, local_seq,
    head_dim), ``heads`` a multiple of ``kv_heads`` (grouped-query attention, kv head ``j``
    serving q heads ``j n_rep .. (j + 1) n_rep - 1``); RoPE already applied with the global
    positions (``layout.positions``). ``doc_ids``: (batch, local_seq) document ids in the same
    layout (``layout.document_ids`` of the whole position ids, split): a token attends only to
    earlier tokens of its own document. ``scale``: default ``1 / sqrt(head_dim)``.

    Returns (batch, heads, local_seq, head_dim) in ``q``'s dtype: this rank's rows of
    ``scaled_dot_product_attention(..., is_causal=True)`` over the whole sequence. Differentiable
    in ``q``, ``k`` and ``v``; every rank of ``group`` must call it (forward and backward)."""
    cp = dist.get_world_size(group)
    if q.dim() != 4 or k.shape != v.shape or k.dim() != 4:
        raise ValueError(
            f"ring_attention takes q (batch, heads, seq, head_dim) and k, v of one shape "
            f"(batch, kv_heads, seq, head_dim); got {tuple(q.shape)}, {tuple(k.shape)}, "
            f"{tuple(v.shape)}"
        )
    if q.shape[0] != k.shape[0] or q.shape[2:] != k.shape[2:] or q.shape[1] % k.shape[1]:
        raise ValueError(
            f"ring_attention needs q and k/v of the same batch, local sequence and head_dim, and "
            f"heads ({q.shape[1]}) a multiple of kv_heads ({k.shape[1]}); got {tuple(q.shape)} "
            f"and {tuple(k.shape)}"
        )
    if q.shape[2] % 2:
        raise ValueError(
            f"local sequence length {q.shape[2]} is not two equal chunks: split the sequence "
            f"with layershard.parallel.context.layout.split (cp={cp})"
        )
    docs = None
    if doc_ids is not None:
        if doc_ids.shape != (q.shape[0], q.shape[2]):
            raise ValueError(
                f"doc_ids must be (batch, local_seq) = {(q.shape[0], q.shape[2])}, got "
                f"{tuple(doc_ids.shape)}"
            )
        # every rank's document ids, so that each pair's mask is made where it is used
        docs = doc_ids.new_empty((cp * doc_ids.shape[0], doc_ids.shape[1]))
        all_gather_single(docs, doc_ids.contiguous(), group=group)
        docs = docs.view(cp, *doc_ids.shape)
    out = _RingAttention.apply(q, k, v, group, docs, scale)
    assert isinstance(out, torch.Tensor)
    return out
