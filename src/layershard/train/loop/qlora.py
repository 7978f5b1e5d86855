"""``layershard train --qlora``: the ``--init-from`` model loaded in 4 bits (bitsandbytes NF4 with
double quantization, ``from_pretrained`` quantizes while it loads) with PEFT LoRA adapters on
every linear, before ``ls.shard`` (engine/four_bit.py); the run's ``final/`` is the adapter."""

from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from layershard.train.config import TrainConfig


def build_qlora(cfg: TrainConfig, precision: str, device: torch.device) -> nn.Module:
    """The 4-bit base with fresh adapters (seeded by ``cfg.seed``: equal on every rank); what
    is not quantized stays fp32 (layershard's master weights), compute in ``precision``."""
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
        cfg.init_from, quantization_config=quant, dtype=torch.float32, device_map=place,
        trust_remote_code=False,
    )  # fmt: skip
    torch.manual_seed(cfg.seed)
    lora = peft.LoraConfig(
        r=cfg.lora_rank, lora_alpha=2 * cfg.lora_rank, target_modules="all-linear",
        lora_dropout=0.0,
    )  # fmt: skip
    return peft.get_peft_model(model, lora)


def save_adapter(model: nn.Module, folder: Path) -> None:
    """The adapters in PEFT's format (collective; rank 0 writes)."""
    from layershard.hf.qlora import save_adapter as save

    save(model, folder)
