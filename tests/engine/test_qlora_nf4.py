"""QLoRA on torchao NF4 weights (torchtune's way: ``linear_nf4`` on a frozen ``NF4Tensor``, LoRA
beside it), sharded by ``ls.shard`` against the same model trained on one process on the same
global batch (engine/four_bit.py)."""

from __future__ import annotations

import copy
import gc
from functools import partial

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("torchao")

from _dist import RankChecks, shared_tmp  # noqa: E402
from _nf4 import nf4, nf4_llama, nf4_weights  # noqa: E402
from _parity import (  # noqa: E402
    EPS,
    LR,
    SPREAD_FACTOR,
    batches,
    grad_error,
    grads_in_orders,
    lm_loss,
    local,
    loss_bound,
    param_bound,
    shard_grad_error,
    train_in_orders,
    train_losses,
)
from _qlora import check_base_untrained  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.engine.flat import ALIGN  # noqa: E402

STEPS = 10


def _bound_weights(model) -> dict[int, torch.Tensor]:
    """Forward hooks recording, per NF4 linear, the weight its forward computed with."""
    seen: dict[int, torch.Tensor] = {}
    for m in model.modules():
        if hasattr(m, "lora_a"):
            m.register_forward_hook(lambda m, a, out: seen.__setitem__(id(m), m.weight))
    return seen


class _Params(torch.nn.Module):
    """Parameters by name, for ``param_bound``'s reference."""

    def __init__(self, params: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.params = params

    def named_parameters(self, *args, **kwargs):
        return iter(self.params.items())

    def parameters(self, *args, **kwargs):
        return iter(self.params.values())


def _reference(base, data: list[torch.Tensor], world: int) -> list:
    """The single-process reference in every order of its sums (tests/_parity.py), reduced to
    what ``_parity`` checks: the first step's gradients and their bound, the losses and their
    bound, the final adapters and their bound."""
    ref_grads, grad_runs = grads_in_orders(base, data[0], world)
    runs = train_in_orders(base, data, world)
    gbound = SPREAD_FACTOR * max(grad_error(g, ref_grads) for g in grad_runs) + EPS
    reference = runs[0]
    lbound = loss_bound(reference.losses, runs[1:])
    adapters = {k: v for k, v in reference.params.items() if ".lora_" in k}
    # param_bound over the trained parameters (an NF4Tensor has no subtraction)
    pbound = param_bound(_Params(adapters), *runs[1:])
    return [ref_grads, gbound, reference.losses, lbound, adapters, pbound]


def _parity(rank: int, world: int, steps: int = STEPS, one_reference: bool = False) -> None:
    """Every loss, the first step's adapter gradients and the final adapters within the spread
    of other legitimate orders of the reference's sums (tests/_parity.py); each forward computes
    with an NF4Tensor over the unit's gather slot; the NF4 bytes bitwise those built. With
    ``one_reference`` rank 0 trains the reference (the same on every rank) and sends it: at 4
    ranks on 2 cores that is most of the spawn's time."""
    base = nf4_llama()
    data = batches(steps)
    if one_reference:
        box = _reference(base, data, world) if rank == 0 else [None] * 6
        dist.broadcast_object_list(box, src=0)
    else:
        box = _reference(base, data, world)
    ref_grads, bound, ref_losses, lbound, adapters, pbound = box
    model = ls.shard(copy.deepcopy(base))
    seen = _bound_weights(model.module)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    lm_loss(model, local(data[0], rank, world)).backward()
    # the weights a forward saw: NF4Tensors whose bytes are views of the gather slots
    slots = [u.slot.alias for u in model.units if any(f.packed for f in u.flats)]
    ranges = [(s.data_ptr(), s.data_ptr() + s.numel() * s.element_size()) for s in slots]
    assert len(seen) == len(nf4_weights(base)), len(seen)
    for w in seen.values():
        assert isinstance(w, nf4().NF4Tensor), type(w)
        ptr = w.quantized_data.data_ptr()
        assert any(lo <= ptr < hi for lo, hi in ranges)
    err = shard_grad_error(model, ref_grads)
    assert err <= bound, (err, bound)
    opt.zero_grad()
    losses = train_losses(model, data, rank, world, opt)
    worst = max(abs(x - r) / r for x, r in zip(losses, ref_losses))
    assert worst <= max(lbound, 1e-6), (worst, lbound, losses, ref_losses)
    full = model.full_state_dict()
    if rank == 0:
        assert len(adapters) == 2 * len(nf4_weights(base))
        worst_p = max((full[k] - v).abs().max().item() for k, v in adapters.items())
        assert worst_p <= pbound, (worst_p, pbound)
        start = dict(base.named_parameters())
        moved = max((v - start[k]).abs().max().item() for k, v in adapters.items())
        assert moved > 100 * pbound  # the adapters trained: the bound means something
        for k, p in nf4_weights(base).items():
            assert full[k].dtype == torch.uint8 and torch.equal(full[k], p.quantized_data), k


def _bytes_never_trained(rank: int, world: int) -> None:
    """After training: every rank's NF4 bytes bitwise the built ones; no gradient and no
    optimizer state touches them; the registered slices are bytes (uint8)."""
    base = nf4_llama()
    originals = {k: p.quantized_data.clone() for k, p in nf4_weights(base).items()}
    model = ls.shard(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_losses(model, batches(3), rank, world, opt)
    assert opt.state
    check_base_untrained(model, opt)
    full = model.full_state_dict(rank0_only=False)
    for k, v in originals.items():
        assert torch.equal(full[k], v), k


def _memory_per_rank(rank: int, world: int) -> None:
    """memory_report(): the NF4 base takes its packed bytes / N (each weight padded to the flat
    alignment), and no float copy of it exists at rest or during a forward."""
    base = nf4_llama()
    weights = nf4_weights(base)
    shapes = {tuple(p.shape) for p in weights.values()}
    packed_bytes = sum(p.quantized_data.numel() for p in weights.values())  # uint8
    fp32_bytes = sum(4 * p.numel() for n, p in base.named_parameters() if n not in weights)
    model = ls.shard(base)
    report = model.memory_report()
    pad, units = 4 * ALIGN, len(model.units)  # carrier fp32: 32 bytes per aligned element
    mine = sum(f.shard.numel() * f.shard.element_size() for f in model.flat_params if f.packed)
    limit = packed_bytes / world + len(weights) * pad + units * pad * world
    assert packed_bytes / world <= mine <= limit, (mine, packed_bytes / world, limit)
    others = report["params"] - mine
    assert others <= fp32_bytes / world + units * 2 * pad * world, (others, fp32_bytes)
    block_packed = max(
        sum(p.quantized_data.numel() for k, p in weights.items() if f"layers.{i}." in k)
        for i in range(3)
    )
    # a gather slot holds a block's bytes and fp32 weights, never its NF4 weights in floats
    assert report["gather_buffers"] < 2 * (block_packed + fp32_bytes) + 4096, report
    cls = nf4().NF4Tensor
    seen = []

    def no_float_copy(*_):
        gc.collect()
        for o in gc.get_objects():
            if (
                isinstance(o, torch.Tensor)
                and not isinstance(o, cls)  # the weights themselves: bytes and state
                and o.is_floating_point()
                and tuple(o.shape) in shapes
            ):
                seen.append(tuple(o.shape))

    handle = model.module.layers[1].mlp.register_forward_pre_hook(no_float_copy)
    # 12 tokens a row: no activation of a rank's (4 x 12, dim) tokens has a weight's shape
    x = torch.randint(0, 96, (8, 12), generator=torch.Generator().manual_seed(1))
    train_losses(model, [x], rank, world, torch.optim.AdamW(model.parameters(), lr=LR))
    no_float_copy()
    handle.remove()
    assert not seen, seen


def _backward_reads_regathered_bytes(rank: int, world: int) -> None:
    """LinearNF4 saves its weight for backward (save_for_backward): an NF4Tensor over block 0's
    gather slot, which block 2 fills with its own bytes before block 0's backward. The weight
    that LinearNF4's backward reads must hold block 0's bytes again (the engine gathers the
    unit again into the same slot first)."""
    base = nf4_llama()
    expected = nf4_weights(base)["layers.0.mlp.w1.weight"].quantized_data.clone()
    model = ls.shard(base)
    first = model.module.layers[0].mlp.w1  # its input needs a gradient (attention LoRA)
    nodes, during_block2, in_backward = [], [], []

    def keep_node(m, args, out):
        node = out.grad_fn.next_functions[0][0]  # linear_nf4's, before the LoRA sum
        assert "LinearNF4" in type(node).__name__, type(node).__name__
        node.register_prehook(lambda grads: in_backward.append(node.saved_tensors[0]))
        nodes.append((node, m.weight))

    def other_bytes(*_):
        during_block2.append(not torch.equal(nodes[0][1].quantized_data, expected))

    first.register_forward_hook(keep_node)
    model.module.layers[2].mlp.register_forward_pre_hook(other_bytes)
    x = local(batches(1)[0], rank, world)
    lm_loss(model, x).backward()
    assert during_block2 == [True]  # the slot held another block's bytes: the check means something
    (saved,) = in_backward
    assert isinstance(saved, nf4().NF4Tensor)
    # its bytes are in block 0's slot (not a copy taken at forward), and block 0's again
    slot = next(u.slot.alias for u in model.units if u.module is model.module.layers[0])
    lo = slot.data_ptr()
    assert lo <= saved.quantized_data.data_ptr() < lo + slot.numel() * slot.element_size()
    assert torch.equal(saved.quantized_data, expected)


def _refusals(rank: int, world: int) -> None:
    """An NF4 base on a path that cannot take it fails with one line before training."""
    base = nf4_llama()
    w = nf4_weights(base)["layers.0.attn.wq.weight"]
    w.requires_grad_(True)
    with pytest.raises(ValueError, match=r"torchao NF4\) weight with requires_grad=True") as e:
        ls.shard(base)
    assert "\n" not in str(e.value)
    # units larger than every block get storage per gather, freed after their forward: the
    # weight LinearNF4 saved would point at freed bytes in backward
    small = nf4_llama()
    norms = [b.attn_norm for b in small.layers]
    with pytest.raises(ValueError, match="larger than every block") as e:
        ls.shard(small, layers=norms)
    assert "\n" not in str(e.value)
    w.requires_grad_(False)
    model = ls.shard(base)
    on_base = [n for n, q in model.named_parameters() if q.dtype == torch.uint8][:1]
    assert on_base
    with pytest.raises(ValueError, match="frozen 4-bit") as e:
        ls.optim.Muon(model, muon_params=on_base)
    assert "\n" not in str(e.value)


def _checkpoint_resumes(rank: int, world: int) -> None:
    """ls.save_checkpoint / load_checkpoint on an NF4 QLoRA model: a fresh model resumed from it
    trains on exactly as the saved one does; inside full_weights() the weight is whole, an
    NF4Tensor again."""
    data = batches(4)
    model = ls.shard(nf4_llama())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    train_losses(model, data[:2], rank, world, opt)
    ls.save_checkpoint(shared_tmp("ckpt"), model, opt)
    after = train_losses(model, data[2:], rank, world, opt)
    again = ls.shard(nf4_llama())
    opt2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=LR)
    ls.load_checkpoint(shared_tmp("ckpt"), again, opt2)
    assert train_losses(again, data[2:], rank, world, opt2) == after
    with again.full_weights():
        w = again.module.layers[0].attn.wq.weight
        assert isinstance(w, nf4().NF4Tensor) and w.shape == (32, 32)


checks = RankChecks(world_size=2)
checks.check(_parity)
checks.check(_bytes_never_trained)
checks.check(_memory_per_rank)
checks.check(_backward_reads_regathered_bytes)
checks.check(_refusals)
checks.check(_checkpoint_resumes)
checks.collect(globals())

# At 4 ranks: one spawn, 3 steps, the reference trained by rank 0 only; the other checks do
# not depend on the world size and stay at 2 ranks.
checks4 = RankChecks(world_size=4, suffix="_ws4")
checks4.check(partial(_parity, steps=3, one_reference=True), "parity")
checks4.collect(globals())
