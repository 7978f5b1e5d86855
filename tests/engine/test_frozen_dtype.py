"""Frozen parameters that are not fp32 (a QLoRA model loaded in bf16: its embedding, norms and
head frozen beside the 4-bit base) are kept sharded in their own dtype (engine/build.py
``_by_dtype``), cast into the compute dtype by the gather: against the same model trained on one
process with those weights' values in fp32 (the cast the gather makes, exact)."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from _dist import RankChecks, shared_tmp  # noqa: E402
from _parity import (  # noqa: E402
    local,
    loss_bound,
    param_bound,
    train_in_orders,
    train_losses,
)
from _qlora import V, batches, causal_loss, qlora_model  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.engine.flat import ALIGN  # noqa: E402
from layershard.engine.four_bit import is_packed  # noqa: E402
from layershard.plan.model import ModelShape  # noqa: E402
from layershard.plan.qlora import QLoRASettings, qlora_memory  # noqa: E402

STEPS, BATCH, SEQ, LR = 6, 8, 12, 1e-2


def _data(steps: int = STEPS) -> list[torch.Tensor]:
    return batches(steps, seed=2, batch=BATCH, seq=SEQ)


_loss = causal_loss


def _bf16_frozen() -> tuple[torch.nn.Module, dict[str, torch.Tensor]]:
    """The QLoRA model with every frozen weight that is not 4-bit in bf16 (as loaded with
    ``dtype=torch.bfloat16``), and those weights by name."""
    model = qlora_model(seed=5)
    frozen = {}
    for name, p in model.named_parameters():
        if not p.requires_grad and not is_packed(p):
            p.data = p.data.to(torch.bfloat16)
            frozen[name] = p.data.clone()
    assert any("embed_tokens" in k for k in frozen) and any("lm_head" in k for k in frozen)
    return model, frozen


def _in_fp32(model: torch.nn.Module) -> torch.nn.Module:
    ref = copy.deepcopy(model)
    for p in ref.parameters():
        if p.dtype == torch.bfloat16:
            p.data = p.data.float()
    return ref


def _frozen_bf16(rank: int, world: int) -> None:
    """Losses and adapters within the spread of the reference's own orders; the bf16 weights
    bitwise unchanged and in bf16 in full_state_dict; their shard bf16/N bytes (no fp32 copy,
    memory_report); a checkpoint holds them in bf16 and restores them."""
    base, frozen = _bf16_frozen()
    data = _data()
    ref = _in_fp32(base)
    runs = train_in_orders(ref, data, world, loss=_loss)
    model = ls.shard(copy.deepcopy(base))
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = train_losses(model, data, rank, world, opt, loss=_loss)
    reference = runs[0]
    bound = loss_bound(reference.losses, runs[1:])
    worst = max(abs(x - r) / r for x, r in zip(losses, reference.losses))
    assert worst <= max(bound, 1e-6), (worst, bound, losses, reference.losses)
    full = model.full_state_dict(rank0_only=False)
    for k, v in frozen.items():
        assert full[k].dtype == torch.bfloat16 and torch.equal(full[k], v), k
    if rank == 0:
        ref_model = copy.deepcopy(ref)
        for k, v in ref_model.named_parameters():
            v.data.copy_(reference.params[k])
        adapters = {k: v for k, v in reference.params.items() if "lora_" in k}
        worst_p = max((full[k] - v).abs().max().item() for k, v in adapters.items())
        pbound = param_bound(ref_model, *runs[1:])
        assert worst_p <= pbound, (worst_p, pbound)
    # memory: the bf16 weights' bytes / N (+ alignment padding), in bf16 flats only
    kept = [f for f in model.flat_params if f.dtype == torch.bfloat16 and not f.packed]
    assert {s.name for f in kept for s in f.slots} == set(frozen)
    assert all(f.shard.dtype == torch.bfloat16 and f.grad is None for f in kept)
    bf16_bytes = sum(2 * v.numel() for v in frozen.values())
    mine = sum(f.shard.numel() * 2 for f in kept)
    units = len(model.units)
    assert (
        bf16_bytes / world <= mine <= bf16_bytes / world + (len(frozen) + units * world) * 2 * ALIGN
    )
    fp32 = sum(f.shard.numel() * 4 for f in model.flat_params if f.dtype == torch.float32)
    trainable = sum(p.numel() for p in base.parameters() if p.requires_grad)
    packed = sum(f.shard.numel() * 4 for f in model.flat_params if f.packed)
    assert fp32 - packed <= 4 * trainable / world + units * 2 * 4 * ALIGN * world
    assert model.memory_report()["params"] == fp32 + mine
    # `layershard plan --qlora` for a model loaded in bf16 predicts that shard from the shape
    shape = ModelShape(
        vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, family="hf-llama"
    )
    plan = qlora_memory(shape, QLoRASettings(world=world, lora_rank=4, compute_dtype="bf16"))
    assert (
        plan["frozen_other"]
        <= mine
        <= plan["frozen_other"] + (len(frozen) + units * world) * 2 * ALIGN
    )
    # a checkpoint: bf16 in the manifest and the files; a model with other frozen values
    # (zeros) resumes with the saved ones and trains on as the saved one does
    ls.save_checkpoint(shared_tmp("ckpt"), model, opt)
    after = train_losses(model, _data(2), rank, world, opt, loss=_loss)
    other, _ = _bf16_frozen()
    for name, p in other.named_parameters():
        if name in frozen:
            p.data.zero_()
    again = ls.shard(other)
    opt2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=LR)
    ls.load_checkpoint(shared_tmp("ckpt"), again, opt2)
    restored = again.full_state_dict(rank0_only=False)
    for k, v in frozen.items():
        assert restored[k].dtype == torch.bfloat16 and torch.equal(restored[k], v), k
    assert train_losses(again, _data(2), rank, world, opt2, loss=_loss) == after


def _other_paths(rank: int, world: int) -> None:
    """A trainable bf16 parameter (trl's cast of the adapters, undone by ls.hf) is refused in
    one line: it would need an fp32 master. Under bf16 compute the frozen bf16 weights gather
    as they are; under no_shard in fp32 (whose units compute on their shards in place) a unit
    with a bf16 group gathers into a slot: the same losses as full sharding."""
    base, _ = _bf16_frozen()
    a = next(p for n, p in base.named_parameters() if "lora_A" in n)
    a.data = a.data.to(torch.bfloat16)
    with pytest.raises(ValueError, match="trainable parameter .*lora_A.* is bfloat16") as e:
        ls.shard(base)
    assert "\n" not in str(e.value)
    x = local(_data(1)[0], rank, world)
    base, _ = _bf16_frozen()  # and under bf16 compute the frozen bf16 weights are not cast
    model = ls.shard(base, mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16))
    loss = _loss(model, x)
    assert torch.isfinite(loss)
    loss.backward()
    data = _data(3)
    runs = []
    for strategy in ("full", "no_shard"):
        base, frozen = _bf16_frozen()
        model = ls.shard(base, strategy=strategy)
        kept = [f for f in model.flat_params for s in f.slots if s.name in frozen]
        assert kept and all(f.shard.dtype == torch.bfloat16 for f in kept), strategy
        opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
        runs.append(train_losses(model, data, rank, world, opt, loss=_loss))
        full = model.full_state_dict(rank0_only=False)
        assert all(torch.equal(full[k], v) for k, v in frozen.items())
    assert runs[0] == pytest.approx(runs[1], rel=1e-5), runs


checks = RankChecks(world_size=2)
checks.check(_frozen_bf16)
checks.check(_other_paths)
checks.collect(globals())
