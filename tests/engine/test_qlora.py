"""QLoRA: a 4-bit (bitsandbytes) frozen base with LoRA adapters, sharded by ``ls.shard`` against
the same PEFT model trained on one process on the same global batch (engine/four_bit.py)."""

from __future__ import annotations

import copy
import gc
from functools import partial
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from _dist import RankChecks, shared_tmp  # noqa: E402
from _parity import (  # noqa: E402
    EPS,
    SPREAD_FACTOR,
    grad_error,
    grads_in_orders,
    local,
    loss_bound,
    param_bound,
    shard_grad_error,
    train_in_orders,
    train_losses,
)
from _qlora import (  # noqa: E402
    V,
    batches,
    causal_loss,
    check_base_untrained,
    load_4bit,
    lora_config,
    packed_weights,
    qlora_model,
    save_base,
)

import layershard as ls  # noqa: E402
from layershard.engine.flat import ALIGN  # noqa: E402
from layershard.plan.model import ModelShape  # noqa: E402
from layershard.plan.qlora import QLoRASettings, qlora_memory  # noqa: E402

# SEQ 12: no activation of a rank's tokens (BATCH / N x SEQ rows) has the shape of a 4-bit
# weight (out x in: 32, 64 or 128 rows), which _memory_per_rank looks for
STEPS, BATCH, SEQ, LR = 20, 8, 12, 1e-2


def _data(steps: int = STEPS) -> list[torch.Tensor]:
    return batches(steps, seed=1, batch=BATCH, seq=SEQ)


_loss = causal_loss


def _parity(rank: int, world: int, quant_type: str, double_quant: bool, steps: int = STEPS) -> None:
    """Every loss over 20 steps, the first step's adapter gradients and the final adapters
    within the spread of other legitimate orders of the reference's sums (tests/_parity.py);
    the 4-bit bytes bitwise those loaded."""
    base = qlora_model(quant_type, double_quant)
    data = _data(steps)
    ref_grads, grad_runs = grads_in_orders(base, data[0], world, loss=_loss)
    runs = train_in_orders(base, data, world, loss=_loss)
    model = ls.shard(copy.deepcopy(base))
    # every parameter, as a user passes them: the 4-bit slices are frozen bytes, never stepped
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _loss(model, local(data[0], rank, world)).backward()
    # AdamW divides a gradient's scale out: check the first gradients themselves
    err = shard_grad_error(model, ref_grads)
    grad_bound = SPREAD_FACTOR * max(grad_error(g, ref_grads) for g in grad_runs) + EPS
    assert err <= grad_bound, (err, grad_bound)
    opt.zero_grad()
    losses = train_losses(model, data, rank, world, opt, loss=_loss)
    reference = runs[0]  # rank order: the reference's own sum
    bound = loss_bound(reference.losses, runs[1:]) if len(runs) > 1 else 1e-5
    worst = max(abs(x - r) / r for x, r in zip(losses, reference.losses))
    assert worst <= max(bound, 1e-6), (worst, bound, losses, reference.losses)
    full = model.full_state_dict()
    if rank == 0:
        ref_model = copy.deepcopy(base)
        for k, v in ref_model.named_parameters():
            v.data.copy_(reference.params[k])
        adapters = {k: v for k, v in reference.params.items() if "lora_" in k}
        assert adapters
        worst_p = max((full[k] - v).abs().max().item() for k, v in adapters.items())
        pbound = param_bound(ref_model, *runs[1:])
        assert worst_p <= pbound, (worst_p, pbound)
        moved = max(
            (v - dict(base.named_parameters())[k]).abs().max().item() for k, v in adapters.items()
        )
        assert moved > 100 * pbound  # the adapters trained: the bound means something
        for k, p in packed_weights(base).items():
            assert full[k].dtype == p.dtype and torch.equal(full[k], p.data), k


def _bytes_never_trained(rank: int, world: int) -> None:
    """After training: the 4-bit bytes every rank holds are bitwise the loaded ones; no gradient
    and no optimizer state touches them; the registered slices are bytes (uint8)."""
    base = qlora_model()
    originals = {k: p.data.clone() for k, p in packed_weights(base).items()}
    model = ls.shard(base)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    train_losses(model, _data(3), rank, world, opt, loss=_loss)
    check_base_untrained(model, opt)
    full = model.full_state_dict(rank0_only=False)
    for k, v in originals.items():
        assert torch.equal(full[k], v), k


def _memory_per_rank(rank: int, world: int) -> None:
    """memory_report(): the 4-bit base takes its packed bytes / N (each weight padded to the
    flat alignment) and no float copy of it exists anywhere, at rest or during a forward."""
    base = qlora_model()
    weights = packed_weights(base)
    shapes = {tuple(p.quant_state.shape) for p in weights.values()}
    packed_bytes = sum(p.numel() for p in weights.values())  # uint8
    fp32_bytes = sum(4 * p.numel() for p in base.parameters() if p.dtype == torch.float32)
    model = ls.shard(base)
    report = model.memory_report()
    # each 4-bit weight starts on an aligned element of the carrier (fp32: 32 bytes), and each
    # unit's flat pads to N equal slices: at most that much above packed/N
    pad = 4 * ALIGN
    units = len(model.units)
    limit = packed_bytes / world + len(weights) * pad + units * pad * world
    mine = sum(f.shard.numel() * f.shard.element_size() for f in model.flat_params if f.packed)
    assert packed_bytes / world <= mine <= limit, (mine, packed_bytes / world, limit)
    others = report["params"] - mine
    limit_fp32 = fp32_bytes / world + units * 2 * pad * world
    assert others <= limit_fp32  # the fp32 parameters / N
    # a block's gather slot: its fp32 weights and its packed bytes, never its 4-bit weights in
    # floats (8 bytes per packed byte)
    block_packed = max(
        sum(p.numel() for k, p in weights.items() if f".layers.{i}." in k) for i in range(2)
    )
    assert report["gather_buffers"] < 2 * (block_packed + fp32_bytes) + 4096
    # `layershard plan --qlora` (plan/qlora.py) predicts the same model states from the shape
    shape = ModelShape(
        vocab_size=V, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, family="hf-llama"
    )
    plan = qlora_memory(shape, QLoRASettings(world=world, lora_rank=4, compute_dtype="fp32"))
    assert plan["packed_base"] <= mine <= limit
    assert plan["frozen_other"] + plan["adapters"] <= others <= limit_fp32
    grads = report["grads"]
    assert plan["adapter_grads"] <= grads <= plan["adapter_grads"] + units * 2 * pad * world
    seen = []

    def no_float_copy(*_):
        gc.collect()
        for o in gc.get_objects():
            if isinstance(o, torch.Tensor) and o.is_floating_point() and tuple(o.shape) in shapes:
                seen.append(tuple(o.shape))

    layer = model.module.base_model.model.model.layers[1].mlp
    handle = layer.register_forward_pre_hook(no_float_copy)
    train_losses(
        model, _data(1), rank, world, torch.optim.AdamW(model.parameters(), lr=LR), loss=_loss
    )
    no_float_copy()
    handle.remove()
    assert not seen, seen


def _bf16_carrier_keeps_bytes(rank: int, world: int) -> None:
    """Under MixedPrecision(bf16) the packed bytes travel as bf16 elements: bit patterns that
    are NaNs in bf16 (one element in 128 of random bytes) must arrive unchanged. Every 4-bit
    weight a forward sees is bitwise the loaded one."""
    base = qlora_model(seed=3)
    originals = {id(p): p.data.clone() for p in packed_weights(base).values()}
    modules = [m for m in base.modules() if id(getattr(m, "weight", None)) in originals]
    expected = {id(m): originals[id(m.weight)] for m in modules}
    carried = torch.cat([v.view(-1) for v in originals.values()])
    carried = carried[: carried.numel() // 2 * 2].view(torch.bfloat16)
    assert torch.isnan(carried).any()  # the test means something
    model = ls.shard(base, mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16))
    checked = []

    def same_bytes(m, _):
        assert torch.equal(m.weight, expected[id(m)])
        checked.append(id(m))

    for m in modules:
        m.register_forward_pre_hook(same_bytes)
    x = local(_data(1)[0], rank, world)
    loss = _loss(model, x)
    assert torch.isfinite(loss)
    loss.backward()
    assert len(set(checked)) == len(modules)


def _refusals(rank: int, world: int) -> None:
    """A 4-bit base on a path that cannot take it fails with one line before training."""
    # units larger than every block get storage per gather, freed after forward: 4-bit weights
    # there would leave Linear4bit's backward reading freed bytes (four_bit.py)
    small = qlora_model()
    norms = [b.input_layernorm for b in small.base_model.model.model.layers]
    with pytest.raises(ValueError, match="larger than every block") as e:
        ls.shard(small, layers=norms)
    assert "\n" not in str(e.value)
    # bf16 storage (accelerate's FSDP recipe) is the only way a 4-bit weight can require grad
    base = qlora_model(storage=torch.bfloat16)
    name, p = next(iter(packed_weights(base).items()))
    p.requires_grad_(True)  # "fp16 with the base unfrozen": nothing can step 4-bit codes
    with pytest.raises(ValueError, match=r"4-bit .*requires_grad=True") as e:
        ls.shard(base)
    assert "\n" not in str(e.value)
    p.requires_grad_(False)
    originals = {k: q.data.clone() for k, q in packed_weights(base).items()}
    model = ls.shard(base)  # bf16 storage is bytes too: it trains, its bytes unchanged
    train_losses(
        model, _data(2), rank, world, torch.optim.AdamW(model.parameters(), lr=LR), loss=_loss
    )
    full = model.full_state_dict(rank0_only=False)
    for k, v in originals.items():  # bytes: bf16 NaN patterns are not equal to themselves
        assert full[k].dtype == torch.bfloat16, k
        assert torch.equal(full[k].view(torch.uint8), v.view(torch.uint8)), k
    muon_on_base = [n for n, q in model.named_parameters() if q.dtype == torch.uint8][:1]
    with pytest.raises(ValueError, match="frozen 4-bit") as e:
        ls.optim.Muon(model, muon_params=muon_on_base)
    assert "\n" not in str(e.value)


def _saving(rank: int, world: int) -> None:
    """After training: the adapter alone (ls.hf.save_adapter) loads with PeftModel.from_pretrained
    onto the 4-bit base and gives the sharded model's logits; the merged export loads with
    from_pretrained (no missing or unexpected keys), each weight PEFT's own merge of the same
    adapter (dequantized base + get_delta_weight) in bf16."""
    import peft
    import transformers as T
    from bitsandbytes.functional import dequantize_4bit

    folder = shared_tmp("base")
    if rank == 0:
        save_base(str(folder))
    dist.barrier()
    torch.manual_seed(1)
    base = peft.get_peft_model(load_4bit(str(folder)), lora_config())
    model = ls.shard(base)
    train_losses(
        model, _data(3), rank, world, torch.optim.AdamW(model.parameters(), lr=LR), loss=_loss
    )
    ls.hf.save_adapter(model, shared_tmp("adapter"))
    ls.hf.export_merged(model, shared_tmp("merged"))
    x = _data(1)[0][:2]
    with torch.no_grad():
        live = model(input_ids=x).logits
    if rank != 0:
        return
    files = sorted(p.name for p in shared_tmp("adapter").iterdir())
    assert "adapter_model.safetensors" in files and not any(f.startswith("model") for f in files)
    loaded = peft.PeftModel.from_pretrained(load_4bit(str(folder)), str(shared_tmp("adapter")))
    with torch.no_grad():
        again = loaded(input_ids=x).logits
    assert (again - live).abs().max() <= 1e-5 * live.abs().max()  # fp32 rounding of the logits
    merged, info = T.AutoModelForCausalLM.from_pretrained(
        str(shared_tmp("merged")), output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"], info
    assert getattr(merged.config, "quantization_config", None) is None
    plain = dict(merged.named_parameters())
    seen = 0
    for name, m in loaded.named_modules():
        if isinstance(m, peft.tuners.lora.LoraLayer):
            w = m.get_base_layer().weight
            expected = dequantize_4bit(w.data, w.quant_state).float() + m.get_delta_weight(
                "default"
            )
            key = name.removeprefix("base_model.model.") + ".weight"
            assert plain[key].dtype == torch.bfloat16
            assert torch.equal(plain[key], expected.to(torch.bfloat16)), key
            seen += 1
    assert seen == 14


def _checkpoint_resumes(rank: int, world: int) -> None:
    """ls.save_checkpoint / load_checkpoint on a QLoRA model: the adapters and their optimizer
    state are saved (not the 4-bit base, read again from the model folder), and a fresh model
    resumed from it trains on exactly as the saved one does; export_hf refuses in one line."""
    data = _data(4)
    model = ls.shard(qlora_model())
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR)
    train_losses(model, data[:2], rank, world, opt, loss=_loss)
    ls.save_checkpoint(shared_tmp("ckpt"), model, opt)
    after = train_losses(model, data[2:], rank, world, opt, loss=_loss)
    again = ls.shard(qlora_model())
    opt2 = torch.optim.AdamW([p for p in again.parameters() if p.requires_grad], lr=LR)
    ls.load_checkpoint(shared_tmp("ckpt"), again, opt2)
    assert train_losses(again, data[2:], rank, world, opt2, loss=_loss) == after
    with pytest.raises(ValueError, match="export_merged") as e:
        ls.export_hf(again, shared_tmp("hf"))
    assert "\n" not in str(e.value)


checks = RankChecks(world_size=2)
checks.check(partial(_parity, quant_type="nf4", double_quant=True), "parity_nf4_double_quant")
checks.check(partial(_parity, quant_type="fp4", double_quant=False, steps=10), "parity_fp4")
checks.check(_bytes_never_trained)
checks.check(_memory_per_rank)
checks.check(_bf16_carrier_keeps_bytes)
checks.check(_refusals)
checks.check(_saving)
checks.check(_checkpoint_resumes)
checks.collect(globals())

checks4 = RankChecks(world_size=4, suffix="_ws4", slow=True)
# 4 steps: every rank trains the reference in 6 orders at 4 parts (most of this spawn's time);
# the 20-step runs are at 2 ranks
checks4.check(
    partial(_parity, quant_type="nf4", double_quant=True, steps=4), "parity_nf4_double_quant"
)
checks4.collect(globals())


def test_plan_qlora_llama3_70b_by_hand(capsys):
    """`layershard plan --qlora`: Llama-3-70B's packed base and quantization state by hand; on
    2 x 24 GB it does not fit without offload and fits with it (README's table)."""
    from layershard.cli import main

    config = str(Path(__file__).resolve().parents[2] / "benchmarks/qlora/configs/llama3-70b")
    d, f, kv = 8192, 28672, 8 * 128
    per_block = d * d + 2 * d * kv + d * d + 3 * d * f  # q, k, v, o, gate, up, down
    linear = 80 * per_block
    shape = ModelShape.from_hf_config(config)
    m = qlora_memory(shape, QLoRASettings(world=2, lora_rank=16, seq_len=2048))
    assert m["packed_base"] == linear // 2 // 2  # half a byte per weight, over 2 ranks
    # double quant: one byte per 64 weights + 4 bytes per 256 of those, 1.1 KiB per tensor
    assert m["quant_state"] == int(linear / 64 * (1 + 4 / 256)) + 80 * 7 * (16 * 4 + 256 * 4 + 68)
    # r (in + out) per linear: q 2d, k and v d + kv, o 2d, gate and up d + f, down f + d
    assert m["adapters"] == 4 * 80 * 16 * (9 * d + 2 * kv + 3 * f) // 2  # fp32, over 2 ranks
    args = ["plan", "--qlora", "--hf-config", config, "--gpus", "2", "--gpu-memory", "24"]
    args += ["--seq-len", "2048", "--gpu", "a100-40g"]
    assert main(args) == 0
    assert "DOES NOT FIT" in capsys.readouterr().out
    assert main([*args, "--offload"]) == 0
    out = capsys.readouterr().out
    assert "fits" in out and "DOES NOT FIT" not in out
