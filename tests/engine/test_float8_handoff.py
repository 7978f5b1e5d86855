"""fp8 weights handed to torchao's ``Float8Linear`` as gathered (issue 34; engine/float8.py).

With ``gather_dtype=torch.float8_e4m3fn`` a ``Float8Linear``'s weight travels as the e4m3 bytes
its own cast would compute (torchao's scale from the weight's amax over every rank), and the
module gets a ``Float8TrainingTensor`` over the gathered bytes. Its matmuls are then the ones
``Float8Linear`` runs on one process, op for op: the checks compare bit for bit against that
process on each rank's part of the batch (the reference's gradient is the mean of the ranks',
summed in rank order and halved, as the engine's reduction sums them; 2 ranks: exact).
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from _dist import RankChecks
from torch import nn

import layershard as ls
from layershard.engine.float8 import Float8Weight

float8 = pytest.importorskip("torchao.float8")
from torchao.float8.float8_linear import Float8Linear  # noqa: E402

_gather = getattr(torch.distributed, "all_gather_single", None)
_gather = _gather or torch.distributed.all_gather_into_tensor

FP8 = torch.float8_e4m3fn
V, D, HIDDEN, BIG_V = 64, 32, 64, 512


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(D, HIDDEN, bias=False), nn.Linear(HIDDEN, D, bias=False)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(F.gelu(self.up(h)))


class Net(nn.Module):
    """Blocks of two linears and a head larger than a block (storage of its own per gather,
    buffers.py: what the backward re-gathers is a new buffer)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, D)
        self.layers = nn.ModuleList(Block() for _ in range(3))
        self.head = nn.Linear(D, BIG_V, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        for layer in self.layers:
            h = layer(h)
        return self.head(h)


def fp8_net(recipe: str | None = None) -> nn.Module:
    """``Net`` with every linear a ``Float8Linear``. Its other weights, which travel as fp8 too
    but are dequantized (the embedding), are frozen at values e4m3 carries exactly (e4m3 values
    times 2**-12, amax 448 * 2**-12: their scale is 2**-12), so that the one process computes
    with the same weights without quantizing them."""
    torch.manual_seed(0)
    model = Net()
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        w = model.embed.weight.view(-1)
        v = (torch.randn(w.shape, generator=g) * 40).clamp(-448, 448)
        w.copy_(v.to(FP8).float() * 2.0**-12)
        w[::8] = 448 * 2.0**-12
    model.embed.weight.requires_grad_(False)
    config = float8.Float8LinearConfig.from_recipe_name(recipe) if recipe else None
    return float8.convert_to_float8_training(model, config=config)


def data(steps: int, world: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, V, (2 * world, 16), generator=g) for _ in range(steps)]


def loss_of(model: nn.Module, x: torch.Tensor) -> torch.Tensor:
    logits = model(x)
    return F.cross_entropy(logits[:, :-1].reshape(-1, BIG_V), x[:, 1:].reshape(-1))


def part(x: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    return x.chunk(world)[rank]


def per_rank_reference(base: nn.Module, x: torch.Tensor, world: int):
    """``base`` on one process, each rank's part separately: the logits of each part and the
    gradient the ranks' mean makes (summed in rank order, then halved)."""
    logits, grads = [], []
    for r in range(world):
        m = copy.deepcopy(base)
        xr = part(x, r, world)
        logits.append(m(xr).detach())
        loss_of(m, xr).backward()
        grads.append({n: p.grad for n, p in m.named_parameters() if p.requires_grad})
    mean = {}
    for n in grads[0]:
        total = grads[0][n].clone()
        for g in grads[1:]:
            total += g[n]
        mean[n] = total * (1.0 / world)
    return logits, mean


def wire() -> ls.MixedPrecision:
    return ls.MixedPrecision(torch.float32, torch.float32, gather_dtype=FP8)


def full_grads(model) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient, whole (a collective)."""
    out = {}
    for f in (f for f in model.flat_params if f.requires_grad):
        grad = torch.zeros(f.padded_numel)
        mine = f.grad if f.grad is not None else torch.zeros(f.shard_numel)
        _gather(grad, mine.contiguous())
        for slot in f.slots:
            out[slot.name] = grad[slot.offset : slot.offset + slot.numel].view(slot.shape)
    return out


checks = RankChecks(world_size=2)


def _bound_types(model: nn.Module) -> list[str]:
    """The class of the weight every Float8Linear computes with, recorded at each forward."""
    seen: list[str] = []
    for m in model.modules():
        if isinstance(m, Float8Linear):
            m.register_forward_pre_hook(lambda mod, args: seen.append(type(mod.weight).__name__))
    return seen


@checks.check
def forward_and_gradients_equal_float8linear_on_one_process(rank: int, world: int) -> None:
    base = fp8_net()
    x = data(1, world)[0]
    ref_logits, ref_grads = per_rank_reference(base, x, world)
    model = ls.shard(copy.deepcopy(base), mixed_precision=wire())
    types = _bound_types(model)
    logits = model(part(x, rank, world))
    # dequantized and cast again by the module: 0.1 off
    assert torch.equal(logits, ref_logits[rank]), (logits - ref_logits[rank]).abs().max()
    assert set(types) == {"Float8TrainingTensor"}, types
    handed = [
        s.name for f in model.flat_params for s in f.slots if isinstance(s.kind, Float8Weight)
    ]
    assert len(handed) == 7, handed  # two per block and the head
    loss_of(model, part(x, rank, world)).backward()
    for name, g in full_grads(model).items():
        assert torch.equal(g, ref_grads[name]), (name, (g - ref_grads[name]).abs().max())
    assert len(ref_grads) == 7


@checks.check
def strategies_checkpointing_and_offload(rank: int, world: int) -> None:
    """The same gradients bit for bit under grad_op (the forward's gather kept for backward),
    activation checkpointing (the forward recomputed, binding the bytes again) and CPU
    offload; bf16 compute runs and hands the module bf16-sized carriers (no reference: the
    module's own bf16 weights would round before the cast)."""
    base = fp8_net()
    x = data(1, world)[0]
    _, ref_grads = per_rank_reference(base, x, world)
    configs = {
        "grad_op": {"strategy": "grad_op"},
        "checkpointing": {"activation_checkpointing": 3},
        "offload": {"offload": ls.CPUOffload()},
    }
    for label, kw in configs.items():
        model = ls.shard(copy.deepcopy(base), mixed_precision=wire(), **kw)
        loss_of(model, part(x, rank, world)).backward()
        for name, g in full_grads(model).items():
            assert torch.equal(g, ref_grads[name]), (label, name, (g - ref_grads[name]).abs().max())
    mp = ls.MixedPrecision(torch.bfloat16, torch.float32, gather_dtype=FP8)
    model = ls.shard(copy.deepcopy(base), mixed_precision=mp)
    types = _bound_types(model)
    loss = loss_of(model, part(x, rank, world))
    loss.backward()
    assert set(types) == {"Float8TrainingTensor"} and torch.isfinite(loss), (types, loss)
    ref_loss = loss_of(copy.deepcopy(base), part(x, rank, world))
    assert abs(loss.item() - ref_loss.item()) < 0.02 * ref_loss.item(), (loss, ref_loss)


@checks.check
def backward_reads_the_bytes_gathered_for_it(rank: int, world: int) -> None:
    """The head (storage of its own per gather) saved its weight for backward; the backward
    must read it from the buffer gathered for the backward. The forward's buffer is poisoned
    after the forward (a reference kept here keeps it alive): a saved tensor that still pointed
    there would give the head's input gradient, and every earlier gradient, from NaNs."""
    base = fp8_net()
    x = data(1, world)[0]
    _, ref_grads = per_rank_reference(base, x, world)
    model = ls.shard(copy.deepcopy(base), mixed_precision=wire())
    head = next(u for u in model.units if u.name == "head")
    assert head.slot.transient
    kept: list[torch.Tensor] = []
    head.module.register_forward_pre_hook(lambda m, a: kept.append(head.slot.data))
    loss = loss_of(model, part(x, rank, world))
    assert len(kept) == 1
    kept[0].view(torch.uint8).fill_(0x7F)  # e4m3 NaN in every byte
    loss.backward()
    for name, g in full_grads(model).items():
        assert torch.equal(g, ref_grads[name]), (name, (g - ref_grads[name]).abs().max())


@checks.check
def training_equals_float8linear_on_one_process(rank: int, world: int) -> None:
    """Five AdamW steps: the engine's losses and final weights against one process running each
    rank's part and averaging the gradients (DDP's arithmetic)."""
    base = fp8_net()
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-2)
    model = ls.shard(copy.deepcopy(base), mixed_precision=wire())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for x in data(5, world):
        loss_of(model, part(x, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        _, grads = per_rank_reference(ref, x, world)
        for n, p in ref.named_parameters():
            p.grad = grads.get(n)
        ref_opt.step()
        ref_opt.zero_grad()
    got = model.full_state_dict(rank0_only=False)
    for n, p in ref.named_parameters():
        assert torch.equal(got[n], p.detach()), (n, (got[n] - p).abs().max())


@checks.check
def other_float8_recipes_are_dequantized(rank: int, world: int) -> None:
    """A rowwise recipe casts each row with its own scale: not the tensorwise bytes the wire
    carries, so its weights are dequantized and the module casts them itself."""
    model = ls.shard(fp8_net("rowwise"), mixed_precision=wire())
    assert not any(isinstance(s.kind, Float8Weight) for f in model.flat_params for s in f.slots)
    types = _bound_types(model)
    model(part(data(1, world)[0], rank, world))
    assert "Float8TrainingTensor" not in types, types


checks.collect(globals())
