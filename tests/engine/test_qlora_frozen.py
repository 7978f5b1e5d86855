"""Frozen weights in their own dtype (issue 52): a model loaded in bf16 keeps its frozen base
(plain LoRA) or its frozen embedding, head and norms (QLoRA) in bf16 flat groups, 1/N per rank,
with no gradient and no optimizer state; the adapters stay fp32 masters. Measured at world size 2
on torch's fake process group (tests/_qlora_budget.py: this process is rank 0, its bytes exact)."""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("peft")

from _parity import TINY_HF, tiny_hf_llama  # noqa: E402
from _qlora_budget import bytes_by_kind, fake_world, in_own_process, step_peak  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.engine.flat import ALIGN  # noqa: E402

WORLD = 2


def _llama():
    return tiny_hf_llama(hidden_size=64, intermediate_size=128)


def _lora(model):
    import peft

    lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", lora_dropout=0.0)
    return peft.get_peft_model(model, lora)  # autocast_adapter_dtype: the adapters in fp32


def _measure(model) -> tuple[dict[str, int], int, dict]:
    """Bytes by kind after two steps at bf16 compute, and MemTracker's peak of the second."""
    with fake_world(WORLD):
        sm = ls.shard(model, mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16))
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-3)
        x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            sm(input_ids=x, labels=x).loss.backward()
            opt.step()
            opt.zero_grad()

        step()
        peak = step_peak(sm, opt, step)
        dtypes = {(f.shard.dtype, f.requires_grad, f.packed) for f in sm.flat_params}
        return bytes_by_kind(sm, opt), peak, {"dtypes": dtypes, "opt": opt, "model": sm}


@in_own_process
def test_lora_frozen_base_in_bf16_halves_its_bytes_and_the_peak_falls_by_as_much():
    """Plain LoRA: the base loaded in bf16 instead of fp32 takes half the bytes per rank (2 per
    weight / N instead of 4), the adapters, their gradients and AdamW state are the same, and
    MemTracker's peak of a training step falls by that difference."""
    frozen = sum(p.numel() for p in _lora(_llama()).parameters() if not p.requires_grad)
    fp32, peak32, _ = _measure(_lora(_llama()))
    bf16, peak16, info = _measure(_lora(_llama().to(torch.bfloat16)))
    assert info["dtypes"] == {(torch.float32, True, False), (torch.bfloat16, False, False)}
    # the same elements (padded alike) in half the bytes: exactly
    assert fp32["frozen_other"] == 2 * bf16["frozen_other"]
    # 2 bytes per frozen weight / N, each parameter padded to the flat alignment at most
    n_frozen = sum(not p.requires_grad for p in info["model"].module.parameters())
    assert 2 * frozen / WORLD <= bf16["frozen_other"] <= 2 * frozen / WORLD + n_frozen * 2 * ALIGN
    for kind in ("adapters", "adapter_grads", "optimizer", "gather_slots"):
        assert fp32[kind] == bf16[kind], kind  # nothing else changed (the slots are bf16 both)
    # no optimizer state but the adapters' (two fp32 moments each, and a step count)
    assert bf16["optimizer"] >= 2 * bf16["adapters"] and bf16["adapter_grads"] == bf16["adapters"]
    saved = fp32["frozen_other"] - bf16["frozen_other"]
    # the peak: measured 86368 bytes less for 86336 saved (32 bytes: a transient's rounding)
    assert abs((peak32 - peak16) / saved - 1) <= 0.01, (peak32, peak16, saved)


@in_own_process
def test_train_qlora_loads_the_frozen_weights_in_the_compute_dtype():
    """``layershard train --qlora`` (build_qlora): at bf16 the embedding, head and norms are
    bf16 (stored so by ls.shard), the 4-bit base packed, the adapters fp32; at fp32 (CPU's
    default precision) all of them fp32."""
    pytest.importorskip("bitsandbytes")
    from _qlora import save_base

    from layershard.train.loop.qlora import build_qlora

    with tempfile.TemporaryDirectory() as d:
        save_base(d)
        cfg = SimpleNamespace(init_from=d, seed=0, lora_rank=4, task="pretrain", loss_chunks=0)
        for precision, frozen in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            model = build_qlora(cfg, precision, torch.device("cpu"))  # type: ignore[arg-type]
            kinds = {
                (type(p).__name__, p.dtype, p.requires_grad) for p in model.parameters()
            }  # fmt: skip
            assert kinds == {
                ("Params4bit", torch.uint8, False),
                ("Parameter", frozen, False),
                ("Parameter", torch.float32, True),
            }, precision
        with fake_world(WORLD):
            sm = ls.shard(model, mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16))
            assert {(f.shard.dtype, f.requires_grad, f.packed) for f in sm.flat_params} == {
                (torch.float32, True, False),  # adapters
                (torch.float32, False, False),  # embedding, head, norms at fp32 precision
                (torch.bfloat16, False, True),  # packed bytes in the bf16 carrier
            }


def test_train_qlora_chunks_the_loss_of_a_large_vocabulary():
    """``layershard train --qlora`` on a vocabulary of 32768 or more, ``--task pretrain`` and
    ``sft`` alike: the loss in 8 chunks (no logits with labels), or in ``--loss-chunks K``,
    equal to the plain loss of the same model's logits to fp32 rounding (measured 1.8e-7
    relative)."""
    pytest.importorskip("bitsandbytes")
    import transformers as T

    from layershard.train.loop.qlora import CHUNKED_VOCAB, build_qlora

    cfg = T.LlamaConfig(**{**TINY_HF, "vocab_size": CHUNKED_VOCAB, "hidden_size": 64,
                           "intermediate_size": 128, "num_hidden_layers": 1})  # fmt: skip
    x = torch.randint(0, CHUNKED_VOCAB, (2, 12), generator=torch.Generator().manual_seed(0))
    with tempfile.TemporaryDirectory() as d:
        torch.manual_seed(0)
        T.LlamaForCausalLM(cfg).save_pretrained(d)
        for task, chunks in (("pretrain", 0), ("sft", 0), ("sft", 3)):
            run = SimpleNamespace(init_from=d, seed=0, lora_rank=4, task=task, loss_chunks=chunks)
            model = build_qlora(run, "fp32", torch.device("cpu"))  # type: ignore[arg-type]
            out = model(input_ids=x, labels=x)
            assert out.logits is None, (task, chunks)
            logits = model(input_ids=x).logits  # without labels: the logits, the plain loss
            plain = torch.nn.functional.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), x[:, 1:].flatten()
            )
            assert abs(out.loss.item() / plain.item() - 1) <= 1e-6, (task, chunks)
