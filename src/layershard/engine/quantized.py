"""Frozen 4-bit weights (bitsandbytes ``Params4bit``, NF4 or FP4): stored as their packed bytes.

A QLoRA model's base weights are packed 4-bit codes (two per byte) plus a quantization state
(``absmax`` per block of 64, the code book, with double quantization ``absmax`` in 8 bits and its
own small state). Storing them in the fp32 flat storage would turn each byte into a float (8x the
packed size) and a gather would cast them. Instead a unit's 4-bit weights form a flat group of
their own (``FlatParam`` with ``packed`` slots) whose elements are *bytes carried in the gather
slot's dtype*: the packed bytes are reinterpreted, never converted, so the shard is packed/N bytes,
the all-gather moves exactly the packed bytes into the unit's slot (the same slot as its other
weights: one gather buffer, one schedule), and the slot's bytes are viewed back as the weight
(uint8, or the ``quant_storage`` dtype it was built with). Nothing is ever dequantized except by
``Linear4bit`` itself, per forward and per backward, into temporaries.

Note: the quantization state stays whole on every rank, attached to the weight view at each bind
(``Linear4bit.forward`` reads ``weight.quant_state``). It is small with double quantization (the
default of QLoRA recipes: ~1/32 of the packed bytes) and 1/8 without; gathering it with the bytes
would save that fraction per rank but must rebind the state's tensors for every gather, and the
backward reads the state from the autograd context (``MatMul4Bit`` keeps the state object, not its
tensors), so it must stay valid from forward to backward. Kept whole, it is.

Note: ``MatMul4Bit`` keeps the weight view in its autograd context (not a saved tensor), so its
backward reads the unit's gather slot: the engine gathers the unit again before its backward
(invariant 3), into the same slot (invariant 1). A unit larger than a block (storage allocated per
gather) or one gathered into a private buffer (a unit only some ranks' backward reaches) would
leave that view on old storage: both are refused or raise (``check_quantized``,
``Schedule._issue_private``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


def params4bit_class() -> type | None:
    """bitsandbytes' ``Params4bit``, if bitsandbytes is imported (never import it ourselves: no
    model can hold one otherwise)."""
    mod = sys.modules.get("bitsandbytes.nn.modules")
    return getattr(mod, "Params4bit", None) if mod is not None else None


def is_packed(p: torch.Tensor) -> bool:
    cls = params4bit_class()
    return cls is not None and isinstance(p, cls)


@dataclass
class Packed:
    """A 4-bit weight's bytes: its shape and dtype as stored, its byte count, and the
    quantization state (whole, shared by every view)."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    quant_state: Any

    @staticmethod
    def of(p: torch.Tensor) -> Packed:
        state = getattr(p, "quant_state")  # noqa: B009 - a Params4bit attribute torch's stubs lack
        return Packed(p.shape, p.dtype, p.numel() * p.element_size(), state)

    def carrier_numel(self, carrier: torch.dtype) -> int:
        """Elements of the carrier dtype that hold the bytes (the last one padded with zeros)."""
        size = torch.empty(0, dtype=carrier).element_size()
        return -(-self.nbytes // size)

    def to_carrier(self, p: torch.Tensor, carrier: torch.dtype) -> torch.Tensor:
        """``p``'s bytes as a 1-D tensor of the carrier dtype (a copy, zero-padded)."""
        raw = p.detach().contiguous().reshape(-1).view(torch.uint8)
        size = torch.empty(0, dtype=carrier).element_size()
        out = torch.zeros(self.carrier_numel(carrier) * size, dtype=torch.uint8, device=p.device)
        out[: self.nbytes].copy_(raw)
        return out.view(carrier)

    def view(self, carrier: torch.Tensor) -> torch.Tensor:
        """The weight as stored, viewed from its carrier elements (no copy)."""
        return carrier.view(torch.uint8)[: self.nbytes].view(self.dtype).view(self.shape)


def attach_state(t: torch.Tensor, packed: Packed) -> torch.Tensor:
    """What ``Linear4bit.forward`` reads from its weight besides the bytes."""
    t.quant_state = packed.quant_state  # type: ignore[attr-defined]
    return t


def check_quantized(specs: list, largest_block_numel: int | None = None) -> None:
    """Refuse 4-bit weights the engine cannot keep packed, each in one line:

    - a trainable one: 4-bit codes have no gradient (``Linear4bit``'s backward computes none)
      and no optimizer can step them; train adapters on a frozen base (PEFT's LoRA);
    - one not yet quantized (``bnb_quantized`` False: bitsandbytes quantizes on ``.to(device)``):
      its data is still the full-precision weight;
    - one on the meta device (its bytes do not exist yet).
    """
    for s in specs:
        for p, uses in s.params:
            if not is_packed(p):
                continue
            name = uses[0].name
            if p.requires_grad:
                raise ValueError(
                    f"shard(): {name} is a 4-bit (bitsandbytes) weight with requires_grad=True; "
                    "4-bit weights are frozen (no gradient, no optimizer state): freeze the base "
                    "and train adapters (peft.get_peft_model with a LoraConfig) before ls.shard()"
                )
            if p.is_meta or not getattr(p, "bnb_quantized", False) or p.quant_state is None:
                raise ValueError(
                    f"shard(): {name} is a bitsandbytes Params4bit that is not quantized yet; "
                    "load the model with BitsAndBytesConfig(load_in_4bit=True) or move it with "
                    ".to(device) (bitsandbytes quantizes there) before ls.shard()"
                )


def disable_cpu_repacking(model: nn.Module) -> None:
    """bitsandbytes repacks a ``Linear4bit``'s weight in place for its CPU inference kernel (eval,
    no grad, AVX512-BF16 CPUs) and flags the *shared* quantization state as repacked: the next
    gather would bring back bytes in the original layout under a state that says otherwise."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            setattr(m, "support_avx512bf16_for_cpu", False)  # noqa: B010 - not a torch attribute
