"""The engine's contract (docs/engine.md), one named check per behaviour: a unit's weights are
gathered again before its backward computes whatever its forward returned; every rank issues
the same collectives in the same order even when a unit's backward is reached on some ranks only;
one rank's failure raises on every rank instead of hanging the others; after backward nothing
is held but what the plan counts. Each check failed on the engine before its fix."""

from __future__ import annotations

import copy
import functools
import gc
import weakref

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks
from torch import nn

import layershard as ls

checks = RankChecks(world_size=2)


def _grad_error(model, reference) -> float:
    """Largest |our gradient slice - the reference's| over every trainable slice, relative to the
    reference gradient's largest entry (a missing gradient counts as zero)."""
    worst = 0.0
    for f in model.flat_params:
        for slot, p in zip(f.slots, f.shard_params):
            a, b = f.local_param_range(slot)
            if not f.requires_grad or b <= a:
                continue
            ref = reference.get_parameter(slot.name).grad
            ref = torch.zeros(slot.numel) if ref is None else ref.reshape(-1)
            ref = ref[a:b]
            ours = torch.zeros_like(ref) if p.grad is None else p.grad
            scale = max(ref.abs().max().item(), 1e-12)
            worst = max(worst, ((ours - ref).abs().max() / scale).item())
    return worst


def _nothing_in_flight(model) -> None:
    s = model._schedule
    assert not any(u.slot.pending for u in model.units), "a gather is still in flight"
    assert not any(g.pending for g in s.grad_slots), "a reduce-scatter is still in flight"


def _rows(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    n = x.shape[0] // world
    return x[rank * n : (rank + 1) * n]


# ---- 1. a unit's output of any type: its weights are gathered again before its backward -----------
class Box:
    """A small class holding a tensor (no tuple, dict or dataclass)."""

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


class Slotted:
    __slots__ = ("h",)

    def __init__(self, h: torch.Tensor) -> None:
        self.h = h


def _unwrap(b):
    if isinstance(b, (Box, Slotted)):
        return b.h
    if isinstance(b, functools.partial):  # a tensor no container walk finds (a closure)
        return b()
    if isinstance(b, tuple):
        return b[0]
    return b


class AnyOutBlock(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(8, 8)

    def forward(self, b):
        h = torch.tanh(self.lin(_unwrap(b)))
        if self.kind == "box":
            return Box(h)
        if self.kind == "slots":
            return Slotted(h)
        if self.kind == "opaque":
            return functools.partial(torch.Tensor.mul, h, 1.0)
        return (h,)


class AnyOut(nn.Module):
    def __init__(self, kind: str) -> None:
        super().__init__()
        self.layers = nn.ModuleList(AnyOutBlock(kind) for _ in range(4))
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        b = x
        for layer in self.layers:
            b = layer(b)
        return self.head(_unwrap(b))


def _outputs_of_any_type(rank: int, world: int) -> None:
    """Blocks returning a small class holding tensors, a ``__slots__`` class, or a closure over a
    tensor: ``p.grad`` right after ``backward()`` equals the single-process gradient, and so does
    ``clip_grad_norm_``'s norm. These blocks got no pre-backward hook, so their backward computed
    with whatever weights their slot held by then, racing the gathers in flight into it: relative
    gradient errors of 1e-3 to 1 (mean loss) with no error raised."""
    cases = [("tuple", 0), ("box", 0), ("slots", 0), ("opaque", 0), ("box", 2), ("slots", 2)]
    for kind, ckpt in cases:
        for reduction in ("mean", "sum"):
            torch.manual_seed(0)
            reference = AnyOut(kind)
            model = ls.shard(copy.deepcopy(reference), activation_checkpointing=ckpt)
            g = torch.Generator().manual_seed(0)
            for step in range(3):  # the first forward learns the order
                x = torch.randn(8, 8, generator=g)
                out, ref = model(_rows(x, rank, world)), reference(x)
                if reduction == "mean":
                    loss, ref_loss = out.pow(2).mean(), ref.pow(2).mean()
                else:  # summed per rank; the reference sums the global batch / world
                    loss, ref_loss = out.pow(2).sum(), ref.pow(2).sum() / world
                loss.backward()
                ref_loss.backward()
                _nothing_in_flight(model)
                err = _grad_error(model, reference)
                assert err < 1e-5, (kind, ckpt, reduction, step, err)
                norm = model.clip_grad_norm_(1e9)
                ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9)
                torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=0)
                model.zero_grad(set_to_none=True)
                reference.zero_grad(set_to_none=True)


checks.check(_outputs_of_any_type)


@checks.check
def _missed_gather_is_an_error(rank: int, world: int) -> None:
    """If a unit's backward ever ran without its weights gathered again (a trigger the engine
    does not know), post-backward raises, naming the unit: an error, never a wrong number."""
    torch.manual_seed(0)
    model = ls.shard(AnyOut("tuple"))
    x = torch.randn(4, 8)
    model(x).sum().backward()  # learns the order
    s = model._schedule
    s.begin_backward_use = lambda u, use: None  # as if no trigger had fired
    with pytest.raises(RuntimeError, match=r"head: its backward ran without its weights"):
        model(x).sum().backward()


# ---- 2. a unit whose backward some ranks reach and others do not -------------------------------------
class AuxHead(nn.Module):
    """A trunk of blocks, a main head, and an auxiliary head that every rank runs forward but
    only some ranks put into their loss."""

    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(3))
        self.head = nn.Linear(8, 2)
        self.aux = nn.Linear(8, 2)

    def forward(self, x):
        h = self.layers[0](x)
        aux = self.aux(h)
        for layer in self.layers[1:]:
            h = layer(h)
        return self.head(h), aux


def _aux_loss(out, aux, use_aux: bool) -> torch.Tensor:
    loss = out.pow(2).mean()
    return loss + aux.pow(2).mean() if use_aux else loss


def _unit_reached_on_some_ranks(rank: int, world: int) -> None:
    """The auxiliary head's backward runs on rank 0 only: every rank still reduces it (zeros where
    it was not reached), so nobody hangs, and the gradients equal the single-process ones over
    the same global batch. With ``no_sync`` micro-batches too. Before: rank 0 issued a
    reduce-scatter the others never did, and the job hung until the timeout."""
    for strategy in ("full", "grad_op", "no_shard"):
        for micro in (1, 2):
            torch.manual_seed(0)
            reference = AuxHead()
            model = ls.shard(copy.deepcopy(reference), strategy=strategy)
            g = torch.Generator().manual_seed(1)
            for step in range(3):
                x = torch.randn(4 * world * micro, 8, generator=g)
                parts = _rows(x, rank, world).chunk(micro)
                for m, xm in enumerate(parts):
                    # the aux loss: rank 0's first micro-batch (and, at step 2, nobody's)
                    use = rank == 0 and m == 0 and step != 2
                    if m < micro - 1:
                        with model.no_sync():
                            (_aux_loss(*model(xm), use) / micro).backward()
                    else:
                        (_aux_loss(*model(xm), use) / micro).backward()
                _nothing_in_flight(model)
                for r in range(world):  # the reference: every rank's losses, averaged
                    for m, xm in enumerate(_rows(x, r, world).chunk(micro)):
                        use = r == 0 and m == 0 and step != 2
                        (_aux_loss(*reference(xm), use) / micro / world).backward()
                err = _grad_error(model, reference)
                assert err < 1e-5, (strategy, micro, step, err)
                aux_grads = [p.grad for n, p in model.named_parameters() if n.startswith("aux")]
                if step == 2:  # reached on no rank: no gradient, as in torch
                    assert all(gr is None for gr in aux_grads), strategy
                model.zero_grad(set_to_none=True)
                reference.zero_grad(set_to_none=True)


checks.check(_unit_reached_on_some_ranks)


# ---- 3. load_full_state_dict: a wrong call raises on every rank -------------------------------------
@checks.check
def _load_full_state_dict_rank0_without_dict(rank: int, world: int) -> None:
    """``None`` on rank 0 and dicts elsewhere is an error on every rank (it raised on rank 0 only
    and the others waited in the next collective until the timeout)."""
    torch.manual_seed(0)
    base = AuxHead()
    model = ls.shard(copy.deepcopy(base))
    with pytest.raises(ValueError, match="rank 0 must pass"):
        model.load_full_state_dict(None if rank == 0 else base.state_dict())
    model.load_full_state_dict(base.state_dict() if rank == 0 else None)  # still usable


# ---- 6. after backward nothing is held but what the plan counts ----------------------------------
def _live_bytes() -> int:
    """Bytes of every tensor storage alive in this process (unique storages)."""
    gc.collect()
    seen: dict[int, int] = {}
    for obj in gc.get_objects():
        if isinstance(obj, torch.Tensor) and not obj.is_meta:
            try:
                st = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):
                continue
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def _one_step(model, opt, x) -> int:
    model(x)[0].pow(2).mean().backward()
    held = _live_bytes()
    opt.step()
    return held


checks4 = RankChecks(world_size=4, suffix="_ws4")


@checks4.check
def _hybrid_frees_gradient_slots(rank: int, world: int) -> None:
    """``hybrid`` on gloo (2 x 2): once backward returns, the gradient slots are freed, as the
    memory model and the planner say; the bytes alive after backward are the same at every step.
    The two-stage reduction list kept a slot alive until the next backward."""
    torch.manual_seed(0)
    model = ls.shard(AuxHead(), strategy="hybrid", shard_size=2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    slots = model._schedule.grad_slots
    seen = []
    real = type(slots[0]).acquire

    def acquire(self, numel):
        out = real(self, numel)
        seen.append(weakref.ref(self.data))
        return out

    for gs in slots:
        gs.acquire = acquire.__get__(gs)
    x = torch.randn(4, 8)
    held = [_one_step(model, opt, x) for _ in range(3)]
    gc.collect()
    assert seen and all(r() is None for r in seen), "a gradient slot outlived its backward"
    assert held[1] == held[2], held
    assert model.memory_report()["grad_buffers"] > 0  # what backward takes, not what stays


checks.collect(globals())
checks4.collect(globals())


def test_grad_slots_helper_is_exact():
    """The live-bytes probe counts a storage once, however many views point at it."""
    before = _live_bytes()
    t = torch.empty(1 << 20)
    views = [t[:10], t[5:], t.view(2, -1)]
    assert _live_bytes() - before == t.untyped_storage().nbytes()
    del views, t
    assert _live_bytes() == before
    assert dist.is_available()
