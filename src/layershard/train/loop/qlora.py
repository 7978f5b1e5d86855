"""``layershard train --qlora``: the ``--init-from`` model loaded in 4 bits (bitsandbytes NF4 with
double quantization, ``from_pretrained`` quantizes while it loads) with PEFT LoRA adapters on
every linear, before ``ls.shard`` (engine/four_bit.py); the run's ``final/`` is the adapter.

What is neither 4-bit nor an adapter (embedding, LM head, norms) is frozen and loaded in the
compute dtype: ``ls.shard`` keeps a frozen parameter in its own dtype, sharded 1/N in a flat group
of that dtype and gathered without a cast (engine/build.py ``_by_dtype``), so a bf16 run holds
them in 2 bytes, not in fp32 (Llama-3-70B: 1.96 GiB per GPU less at 2 GPUs). The adapters are
fp32 master weights whatever the load dtype (PEFT's ``autocast_adapter_dtype``, checked here).

A large vocabulary (``CHUNKED_VOCAB`` and up: Llama 3's 128256) computes the loss in
``LOSS_CHUNKS`` chunks, or ``--loss-chunks K`` in K (``ls.chunked_loss`` on the transformers
model inside the PEFT one: the logits never whole; equal to the plain loss to fp32 rounding), for
``--task pretrain`` and ``sft`` alike."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from layershard.train.config import TrainConfig

CHUNKED_VOCAB = 32768
LOSS_CHUNKS = 8


def build_qlora(cfg: TrainConfig, precision: str, device: torch.device) -> nn.Module:
    """The 4-bit base with fresh adapters (seeded by ``cfg.seed``: equal on every rank); the
    frozen weights that are not quantized in the compute dtype ``precision`` (fp32 on CPU), the
    adapters in fp32 (layershard's master weights)."""
    try:
        import bitsandbytes  # noqa: F401
        import peft
        import transformers
    except ImportError as e:
        raise RuntimeError(
            f"--qlora needs bitsandbytes and peft ({e}): pip install 'layershard[hf,qlora]'"
        ) from e

    assert cfg.init_from is not None  # TrainConfig refuses --qlora without it
    compute = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision, torch.float32)
    quant = transformers.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute,
    )
    place = {"": device.index or 0} if device.type == "cuda" else "cpu"
    model = transformers.AutoModelForCausalLM.from_pretrained(
        cfg.init_from, quantization_config=quant, dtype=compute, device_map=place,
        trust_remote_code=False,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    lora = peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules="all-linear",
        lora_dropout=0.0,
    )  # fmt: skip
    peft_model = peft.get_peft_model(model, lora, autocast_adapter_dtype=True)
    # layershard steps fp32 masters only: an adapter PEFT left in 16 bits would train in them
    low = [
        n for n, p in peft_model.named_parameters() if p.requires_grad and p.dtype != torch.float32
    ]
    if low:
        raise RuntimeError(f"--qlora: PEFT left adapters in 16 bits ({low[0]}); upgrade peft")
    chunks = cfg.loss_chunks or (LOSS_CHUNKS if model.config.vocab_size >= CHUNKED_VOCAB else 0)
    if chunks:
        from layershard.loss import chunked_loss

        try:  # the causal LM PEFT wraps (its head is not adapted)
            chunked_loss(model, chunks)
        except (TypeError, ValueError):  # logits transformed before the loss: the plain loss
            if cfg.loss_chunks:  # asked for: say why not
                raise
            pass
    return peft_model


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapters in PEFT's format (collective; rank 0 writes)."""
    from layershard.hf.qlora import save_adapter as save

    save(model, folder)
