"""Memory levers for QLoRA on small GPUs (issue 52), each exact, at 2 ranks on a 4-bit base:
the checkpointed block inputs in host memory (``ls.hf.qlora.offload_checkpointed_inputs``), the
packed base and every state in host memory (``ls.CPUOffload``), the chunked loss on the PEFT
model's base (``ls.chunked_loss``); and bf16 compute on a base loaded in bf16 against a bf16
reference on one process. On this CPU "host" is the memory the model already lives in: what is
checked is that each lever changes nothing computed (bitwise), and that it moved what it says."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from _dist import RankChecks, shared_tmp  # noqa: E402
from _parity import local, train_losses  # noqa: E402
from _qlora import HIDDEN, batches, causal_loss, qlora_model  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.hf.qlora import offload_checkpointed_inputs  # noqa: E402

STEPS, BATCH, SEQ, LR = 3, 8, 12, 1e-2
LAYERS = 2  # _qlora's model


def _data(steps: int = STEPS) -> list[torch.Tensor]:
    return batches(steps, seed=1, batch=BATCH, seq=SEQ)


def _adapters(model) -> dict[str, torch.Tensor]:
    return {k: v for k, v in model.full_state_dict(rank0_only=False).items() if "lora_" in k}


def _train(
    model, rank: int, world: int, steps: int = STEPS
) -> tuple[list[float], dict[str, torch.Tensor]]:
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    losses = train_losses(model, _data(steps), rank, world, opt, loss=causal_loss)
    return losses, _adapters(model)


def _same(a, b) -> None:
    assert a[0] == b[0], (a[0], b[0])  # every step's loss, bitwise
    assert a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def _host_inputs(rank: int, world: int) -> None:
    """Every block checkpointed, its input kept in host memory until its recompute: the same
    losses and adapters bitwise as without; what moved is each block's input of each forward
    (this rank's micro-batch x seq x hidden, fp32) and nothing else."""
    base = qlora_model()
    plain = _train(ls.shard(copy.deepcopy(base), activation_checkpointing=LAYERS), rank, world, 2)
    model = ls.shard(copy.deepcopy(base), activation_checkpointing=LAYERS)
    moved = offload_checkpointed_inputs(model)
    _same(_train(model, rank, world, 2), plain)
    assert moved.bytes == 2 * LAYERS * (BATCH // world) * SEQ * HIDDEN * 4, moved.bytes
    moved.remove()
    with pytest.raises(ValueError, match="no block of this model is checkpointed") as e:
        offload_checkpointed_inputs(ls.shard(copy.deepcopy(base)))
    assert "\n" not in str(e.value)


def _cpu_offload(rank: int, world: int) -> None:
    """ls.CPUOffload(): the packed 4-bit slices (and every other) in host memory, gathered from
    there unit by unit: the same losses and adapters bitwise as without."""
    base = qlora_model()
    plain = _train(ls.shard(copy.deepcopy(base)), rank, world, 2)
    model = ls.shard(copy.deepcopy(base), offload=ls.CPUOffload())
    packed = [f for f in model.flat_params if f.packed]
    assert packed and all(f.shard.device.type == "cpu" for f in packed)
    _same(_train(model, rank, world, 2), plain)


def _chunked_loss(rank: int, world: int) -> None:
    """ls.chunked_loss on the PEFT model's base (the transformers causal LM inside it): no
    logits at the loss, the losses and adapters those of the plain loss to fp32 rounding (the
    chunked log-sum-exp sums in another order: measured <= 2e-7 relative)."""
    base = qlora_model()
    plain = _train(ls.shard(copy.deepcopy(base)), rank, world)
    chunked = copy.deepcopy(base)
    ls.chunked_loss(chunked.get_base_model(), 4)
    model = ls.shard(chunked)
    assert model(input_ids=_data()[0][:2], labels=_data()[0][:2]).logits is None
    losses, adapters = _train(model, rank, world)
    worst = max(abs(a - b) / b for a, b in zip(losses, plain[0]))
    assert worst <= 1e-6, worst
    drift = max((adapters[k] - plain[1][k]).abs().max().item() for k in adapters)
    assert drift <= 1e-5, drift  # AdamW steps of lr 1e-2 from equal gradients to 1e-6


def _bf16_model():
    """_qlora's model loaded as a bf16 run loads it (train/loop/qlora.py): the embedding, head
    and norms in bf16, bitsandbytes computing in bf16, the adapters fp32 (PEFT's autocast)."""
    import tempfile

    import peft
    import transformers as T
    from _qlora import lora_config, save_base

    with tempfile.TemporaryDirectory() as d:
        save_base(d)
        q = T.BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
        )  # fmt: skip
        base = T.AutoModelForCausalLM.from_pretrained(
            d, quantization_config=q, device_map="cpu", dtype=torch.bfloat16
        )
    ls.engine.four_bit.disable_cpu_repacking(base)  # as ls.shard does: the training kernels
    torch.manual_seed(1)
    model = peft.get_peft_model(base, lora_config())
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    return model.eval()


def _bf16_parity(rank: int, world: int) -> None:
    """bf16 compute on a base loaded in bf16 (frozen embedding, head and norms stored in bf16,
    gathered without a cast): every step's loss that of one process computing the same model in
    bf16 on the whole batch (adapters cast from fp32 masters, AdamW on the masters); the
    adapters stay fp32 masters and land nearer that reference than an fp32-compute run does."""
    base = _bf16_model()
    kinds = {(p.dtype, p.requires_grad) for p in base.parameters() if p.dtype != torch.uint8}
    assert kinds == {(torch.bfloat16, False), (torch.float32, True)}
    model = ls.shard(copy.deepcopy(base), mixed_precision=ls.MixedPrecision(torch.bfloat16))
    frozen = [f for f in model.flat_params if not f.packed and not f.requires_grad]
    assert frozen and all(f.shard.dtype == torch.bfloat16 for f in frozen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    compute = copy.deepcopy(base)
    train = {n: p for n, p in compute.named_parameters() if p.requires_grad}
    master = {n: p.detach().clone().requires_grad_() for n, p in train.items()}
    ref_opt = torch.optim.AdamW(master.values(), lr=LR)
    for p in train.values():
        p.data = p.data.to(torch.bfloat16)
    for step, batch in enumerate(_data()):
        loss = causal_loss(model, local(batch, rank, world))
        loss.backward()
        opt.step()
        opt.zero_grad()
        with torch.no_grad():
            for n, p in train.items():
                p.copy_(master[n])
        ref = causal_loss(compute, batch)
        ref.backward()
        for n, p in train.items():
            master[n].grad, p.grad = p.grad.float(), None
        ref_opt.step()
        ref_opt.zero_grad()
        mean = loss.detach().clone()
        torch.distributed.all_reduce(mean)
        # each rank's bf16 half-batch mean, averaged in fp32, against the whole batch's bf16
        # mean: bf16 rounding of the sums, measured 0, 1.1e-5, 4.6e-5 relative (10x that)
        assert abs(mean.item() / world / ref.item() - 1) <= 5e-4, (step, mean, ref)
    full = _adapters(model)
    assert all(v.dtype == torch.float32 for v in full.values())
    start = dict(base.named_parameters())

    def dist(a, b) -> float:
        return sum(((a[k].detach() - b[k].detach()) ** 2).sum().item() for k in master) ** 0.5

    # AdamW's steps are +-lr wherever a gradient is near zero, where bf16 rounding can flip
    # its sign: the distance to the reference relative to how far training went, measured 0.025
    rel = dist(full, master) / dist(master, start)
    assert rel <= 0.1, rel


def _dora(rank: int, world: int) -> None:
    """PEFT's DoRA: refused in one line on a 4-bit base (PEFT reads that base weight as a
    Params4bit, four_bit.py check_quantized); on an unquantized base it trains as on one
    process (losses within fp32 rounding of the sums' order)."""
    import peft
    import transformers as T
    from _qlora import TARGETS, load_4bit, save_base

    folder = shared_tmp("base")
    if rank == 0:
        save_base(str(folder))
    torch.distributed.barrier()
    dora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, use_dora=True)
    with pytest.raises(ValueError, match="DoRA magnitude .* on a bitsandbytes 4-bit base") as e:
        ls.shard(peft.get_peft_model(load_4bit(str(folder)), dora))
    assert "\n" not in str(e.value)
    plain = T.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
    torch.manual_seed(1)
    base = peft.get_peft_model(plain, dora).eval()
    ref = copy.deepcopy(base)
    ref_opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=LR)
    expected = []
    for batch in _data():
        loss = causal_loss(ref, batch)
        loss.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        expected.append(loss.item())
    losses, adapters = _train(ls.shard(base), rank, world)
    assert any("lora_magnitude_vector" in k for k in adapters)
    worst = max(abs(a - b) / b for a, b in zip(losses, expected))
    assert worst <= 1e-5, (worst, losses, expected)  # fp32: measured ~1e-7


checks = RankChecks(world_size=2)
checks.check(_host_inputs)
checks.check(_cpu_offload)
checks.collect(globals())

# bf16 matmuls (~20x slower than fp32 on this CPU) and three more trainings: outside the fast tier
slow = RankChecks(world_size=2, suffix="_more", slow=True)
slow.check(_chunked_loss)
slow.check(_bf16_parity)
slow.check(_dora)
slow.collect(globals())
