"""Context parallelism's core (parallel/context/, issue 49): the load-balanced layout, ring
attention and all-to-all attention, against one process.

The reference is one process's ``F.scaled_dot_product_attention(..., is_causal=True)`` over the
whole sequence (with documents: an explicit block-diagonal causal mask), fp32, grouped-query
heads repeated as ``models.llama.causal_attention`` does. Every rank holds the same whole
tensors, runs the reference, splits q, k, v in the layout, runs the CP attention and compares
its output and the gradients of its local q, k, v (from the same upstream gradient ``w``) with
the same slices of the reference's. At 2 ranks (the whole world), and at 4: the whole world,
and two CP groups of 2 that are not consecutive ranks ({0, 2}, {1, 3}), so that the ring's peers
are group ranks, not global ones.
"""

from __future__ import annotations

from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist import RankChecks

from layershard.parallel.context import (
    all_to_all_attention,
    check_seq_len,
    document_ids,
    gather,
    layout_order,
    loss_sum_and_count,
    positions,
    ring,
    ring_attention,
    shift_labels,
    split,
    target_count,
)

BATCH, HEAD_DIM, SEQ = 2, 16, 64
HEAD_SHAPES = [(4, 2), (4, 1)]  # (q heads, kv heads): grouped-query and multi-query attention
# Documents per batch row (lengths): row 0 crosses chunk boundaries at every cp tested, with a
# 3-token document inside one chunk; row 1 is two halves.
DOCS = [[5, 20, 3, 36], [30, 34]]

# Error = max |cp - ref| / max |ref| over each of out, dq, dk, dv, per rank. Largest measured
# (2 and 4 ranks, the CP groups of 2 in 4 included, with and without documents, over
# ATEN_CPU_CAPABILITY avx512 (this machine), avx2 and default): ring with CPU flash 1.09e-6 (cp 4
# with documents), ring with the blockwise math kernels 1.09e-6, all-to-all 1.31e-7 at cp 2 and
# 0 at cp 4 (one head per rank: the reference's kernel on the same rows). fp32 eps is 1.19e-7:
# the worst is ~9 eps. The CP results differ from one process only in the order of fp32 sums
# (softmaxes merged by log-sum-exp: a few exp/log roundings a row; dk, dv added up over the
# ring's steps), a few eps each over SEQ-term sums. 64 eps (7.6e-6) is 7x the worst, room for
# other CPUs' kernels, while a wrong mask, block or head gives errors of order 1e-1 and a 1e-4
# relative error in one gradient (tried on dv) fails.
RTOL = 64 * torch.finfo(torch.float32).eps


def _inputs(heads: int, kv_heads: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """The same whole-sequence q, k, v and upstream gradient ``w`` on every rank."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)
    k = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=g)
    v = torch.randn(BATCH, kv_heads, SEQ, HEAD_DIM, generator=g)
    w = torch.randn(BATCH, heads, SEQ, HEAD_DIM, generator=g)
    return q, k, v, w


def _doc_ids() -> torch.Tensor:
    pos = torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])
    return document_ids(pos)


def _reference(q, k, v, w, docs=None) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """One process: the output and the gradients of q, k, v."""
    q, k, v = (t.clone().requires_grad_() for t in (q, k, v))
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if docs is None:
        y = F.scaled_dot_product_attention(q, kk, vv, is_causal=True)
    else:
        causal = torch.ones(SEQ, SEQ, dtype=torch.bool).tril()
        mask = (docs[:, :, None] == docs[:, None, :]) & causal
        y = F.scaled_dot_product_attention(q, kk, vv, attn_mask=mask[:, None])
    (y * w).sum().backward()
    return y.detach(), [t.grad for t in (q, k, v)]


def _compare(attention, group, docs=None, label: str = "") -> None:
    """The CP attention's output and local gradients against one process's, for every head
    shape, within RTOL."""
    cp, rank = dist.get_world_size(group), dist.get_rank(group)
    for heads, kv_heads in HEAD_SHAPES:
        q, k, v, w = _inputs(heads, kv_heads)
        ref, ref_grads = _reference(q, k, v, w, docs)
        local = [split(t, cp, rank, dim=2).requires_grad_() for t in (q, k, v)]
        local_docs = None if docs is None else split(docs, cp, rank, dim=1)
        out = attention(*local, group, doc_ids=local_docs)
        (out * split(w, cp, rank, dim=2)).sum().backward()
        pairs = [("out", out.detach(), ref)] + [
            (f"d{n}", t.grad, g) for n, t, g in zip("qkv", local, ref_grads, strict=True)
        ]
        for name, got, want in pairs:
            want = split(want, cp, rank, dim=2)
            err = ((got - want).abs().max() / want.abs().max()).item()
            assert err <= RTOL, f"{label} {name} heads={heads}/{kv_heads}: {err:.2e} > {RTOL:.2e}"


def _math_kernels(device: torch.device):
    return ring._math_forward, ring._math_backward


def _check_ring(group, docs=None) -> None:
    _compare(ring_attention, group, docs, "ring flash")
    with mock.patch.object(ring, "_kernels", _math_kernels):  # the non-CPU path, on CPU
        _compare(ring_attention, group, docs, "ring math")


def _check_all_to_all(group, docs=None) -> None:
    _compare(all_to_all_attention, group, docs, "all-to-all")


# ---- the checks ----------------------------------------------------------------------------


def _layout(rank: int, world: int) -> None:
    """split/gather round trip, global positions, and the layout's chunks."""
    group = dist.group.WORLD
    x = torch.randn(BATCH, SEQ, 3, generator=torch.Generator().manual_seed(1))
    local = split(x, world, rank, dim=1)
    c = SEQ // (2 * world)
    assert torch.equal(local[:, :c], x[:, rank * c : (rank + 1) * c])
    assert torch.equal(local[:, c:], x[:, (2 * world - 1 - rank) * c : (2 * world - rank) * c])
    assert torch.equal(gather(local, group, dim=1), x)
    heads_first = x.transpose(1, 2)  # the sequence along another dim
    assert torch.equal(gather(split(heads_first, world, rank, dim=2), group, dim=2), heads_first)
    pos = positions(SEQ, world, rank)
    assert torch.equal(pos, split(torch.arange(SEQ), world, rank, dim=0))
    assert torch.equal(local, x[:, pos])  # what RoPE must index with
    assert sorted(layout_order(SEQ, world).tolist()) == list(range(SEQ))
    # balance: every rank's queries have the same number of causal (query, key) pairs
    work = torch.zeros(1)
    work += (pos[:, None] >= torch.arange(SEQ)[None, :]).sum()
    works = [torch.zeros(1) for _ in range(world)]
    dist.all_gather(works, work)
    assert len({t.item() for t in works}) == 1, works


def _labels_and_loss(rank: int, world: int) -> None:
    """Labels shifted over the whole sequence, and the ranks' losses (local sum / whole count)
    adding up to the one-process mean, gradients included."""
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(2)
    vocab = 11
    labels = torch.randint(0, vocab, (BATCH, SEQ), generator=g)
    labels[0, 3:9] = -100  # masked targets, some on a chunk boundary at every cp tested
    logits = torch.randn(BATCH, SEQ, vocab, generator=g)
    shifted = shift_labels(labels)
    assert torch.equal(shifted[:, :-1], labels[:, 1:]) and (shifted[:, -1] == -100).all()
    # one process: HF's loss, the logits at i predicting labels[i + 1]
    whole = logits.clone().requires_grad_()
    ref = F.cross_entropy(whole[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    ref.backward()
    local_labels = split(shifted, world, rank)
    mine = split(logits, world, rank).requires_grad_()
    total, count = loss_sum_and_count(mine, local_labels, group)
    assert count.item() == (labels[:, 1:] != -100).sum().item()
    assert torch.equal(count, target_count(local_labels, group))
    loss = total / count
    loss.backward()
    summed = loss.detach().clone()
    dist.all_reduce(summed, group=group)
    assert torch.allclose(summed, ref.detach(), rtol=1e-6), (summed, ref)
    assert torch.allclose(mine.grad, split(whole.grad, world, rank), rtol=1e-5, atol=1e-8)


def _ring(rank: int, world: int) -> None:
    """Ring attention (ATen's CPU flash kernels, and the blockwise math of other devices)."""
    _check_ring(dist.group.WORLD)


def _per_chunk_causal(q, k, v, group, doc_ids=None) -> torch.Tensor:
    """The bug a CP attention must not have: the causal mask applied to this rank's tokens
    alone (each chunk attends only within the rank's own part, positions local)."""
    rep = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, kk, vv, is_causal=True)


def _per_chunk_mask_is_caught(rank: int, world: int) -> None:
    """Negative control: the comparison fails, far outside RTOL, for a causal mask per chunk."""
    with pytest.raises(AssertionError, match=r"out heads=.* > "):
        _compare(_per_chunk_causal, dist.group.WORLD, label="per-chunk mask")


def _ring_documents(rank: int, world: int) -> None:
    """Ring attention within documents (block masks, skipped blocks)."""
    _check_ring(dist.group.WORLD, _doc_ids())


def _all_to_all(rank: int, world: int) -> None:
    """All-to-all attention, kv heads fewer than cp repeated."""
    _check_all_to_all(dist.group.WORLD)


def _all_to_all_documents(rank: int, world: int) -> None:
    """All-to-all attention within documents."""
    _check_all_to_all(dist.group.WORLD, _doc_ids())


def _refuses(match: str, fn, *args) -> None:
    with pytest.raises(ValueError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value), str(e.value)


def _refusals(rank: int, world: int) -> None:
    """One line each: a sequence that does not split in 2 cp chunks, heads not divisible by
    cp, a local sequence that is not two chunks."""
    group = dist.group.WORLD
    _refuses(r"sequence length 30 must be divisible by 2 x cp = 8", check_seq_len, 30, 4)
    bad = torch.zeros(1, 2 * world + 1)
    _refuses(rf"divisible by 2 x cp = {2 * world}", split, bad, world, rank)
    q = torch.zeros(1, 2 * world + 1, 4, 8)
    heads = rf"heads \({2 * world + 1}\) divisible by cp \({world}\)"
    _refuses(heads, all_to_all_attention, q, q, q, group)
    odd = torch.zeros(1, 2, 3, 8)
    _refuses(
        "local sequence length 3 is not two equal chunks", ring_attention, odd, odd, odd, group
    )


def _subgroups(rank: int, world: int) -> None:
    """Both modes on CP groups {0, 2} and {1, 3}: group ranks, not global ones, in the ring."""
    groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    group = groups[rank % 2]
    _check_ring(group, _doc_ids())
    _check_all_to_all(group)


checks = RankChecks(world_size=2, suffix="_cp2")
for _fn in (_layout, _labels_and_loss, _ring, _ring_documents, _all_to_all,
            _all_to_all_documents, _refusals, _per_chunk_mask_is_caught):  # fmt: skip
    checks.check(_fn)
checks.collect(globals())

checks4 = RankChecks(world_size=4)
for _fn in (_layout, _labels_and_loss, _ring, _ring_documents, _all_to_all,
            _all_to_all_documents, _subgroups):  # fmt: skip
    checks4.check(_fn, name=f"{_fn.__name__.lstrip('_')}_cp4")
checks4.collect(globals())
