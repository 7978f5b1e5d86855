"""Frozen 4-bit weights (bitsandbytes ``Params4bit``, NF4 or FP4; torchao ``NF4Tensor``): stored as
their packed bytes.

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

Note: torchao's ``NF4Tensor`` (torchtune's QLoRA: a Linear whose weight is one, computing
``linear_nf4(x, weight)``) is the same design: its ``quantized_data`` (uint8, two codes per byte)
goes into the packed flat group, and its state (``quantized_scalers``: int8 per block of 64,
``quantization_factor`` per scaler block, ``scaler_mean``, the 16-entry ``nf4`` code book, block
sizes, shape and stride: ~1/32 of the bytes at torchtune's block sizes) stays whole on every rank.
At each bind the weight is an ``NF4Tensor`` built over the slot's bytes (``__tensor_unflatten__``
with the gathered view as ``quantized_data``: no copy, nothing dequantized but by ``linear_nf4``
per matmul). torchtune under FSDP2 shards each NF4 tensor along dim 0 instead (its
``fsdp_pre_all_gather`` gathers bytes, scalers and factors as three tensors, which needs the row
count to split into whole scaler blocks per rank); here a unit's weights are one flat buffer split
anywhere, so the bytes, which need no alignment to blocks, are split and the state, which would,
is not. ``LinearNF4`` saves the weight with ``save_for_backward``: the saved-tensor hooks keep it
as a detached ``NF4Tensor`` over the same slot storage, which the engine gathers the unit into
again before its backward reads it (the next note), as for ``MatMul4Bit``.

Note: ``MatMul4Bit`` keeps the weight view in its autograd context (not a saved tensor), so its
backward reads the unit's gather slot: the engine gathers the unit again before its backward
(invariant 3), into the same slot (invariant 1). A unit larger than a block (storage allocated per
gather) or one gathered into a private buffer (a unit only some ranks' backward reaches) would
leave that view on old storage: both are refused or raise (``check_quantized``,
``Schedule._issue_private``).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from layershard.engine.param_kind import ParamKind


def params4bit_class() -> type | None:
    """bitsandbytes' ``Params4bit``, if bitsandbytes is imported (never import it ourselves: no
    model can hold one otherwise)."""
    mod = sys.modules.get("bitsandbytes.nn.modules")
    return getattr(mod, "Params4bit", None) if mod is not None else None


# where torchao defines NF4Tensor: 0.18's module, then the one of earlier releases
_NF4_MODULES = (
    "torchao.quantization.quantize_.workflows.nf4.nf4_tensor",
    "torchao.dtypes.nf4tensor",
)


def nf4_classes() -> list[type]:
    """torchao's ``NF4Tensor`` classes among the modules imported (never imported here)."""
    mods = (sys.modules.get(name) for name in _NF4_MODULES)
    return [c for m in mods if m is not None and (c := getattr(m, "NF4Tensor", None)) is not None]


def is_nf4(p: torch.Tensor) -> bool:
    return any(isinstance(p, c) for c in nf4_classes())


def is_packed(p: torch.Tensor) -> bool:
    """A frozen 4-bit weight stored as its packed bytes: bitsandbytes or torchao NF4."""
    cls = params4bit_class()
    return (cls is not None and isinstance(p, cls)) or is_nf4(p)


@dataclass
class NF4State:
    """What an ``NF4Tensor`` holds besides its bytes, whole: its class, the tensors of its
    state and the metadata of ``__tensor_flatten__`` (block sizes, shape, stride, dtype)."""

    cls: Any  # NF4Tensor
    inner: dict[str, torch.Tensor]
    meta: Any
    size: torch.Size
    stride: tuple[int, ...]

    @staticmethod
    def of(p: Any, device: torch.device) -> NF4State:  # an NF4Tensor: torch's stubs lack it
        names, meta = p.__tensor_flatten__()
        inner = {n: getattr(p, n).to(device) for n in names if n != "quantized_data"}
        tmeta = meta.get("tensor_meta")
        if getattr(tmeta, "device", device) != device:  # a dataclass (SubclassTensorArgs)
            meta = {**meta, "tensor_meta": replace(tmeta, device=device)}
        return NF4State(type(p), inner, meta, p.size(), p.stride())

    def wrap(self, data: torch.Tensor) -> torch.Tensor:
        """The ``NF4Tensor`` whose bytes are ``data`` (a view of a gather slot: not copied)."""
        inner = {**self.inner, "quantized_data": data}
        return self.cls.__tensor_unflatten__(inner, self.meta, self.size, self.stride)


def packed_bytes(p: Any) -> torch.Tensor:
    """The tensor holding ``p``'s packed bytes: an ``NF4Tensor``'s ``quantized_data``, else
    ``p`` (a ``Params4bit``, or bytes as ``full_state_dict`` gives them)."""
    return p.quantized_data if is_nf4(p) else p


def release(p: Any) -> None:
    """Free the full copy of an original parameter that ``shard()`` has stored."""
    p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    if is_nf4(p):  # its bytes live in an attribute, not in its (wrapper) storage
        p.quantized_data = torch.empty(0, dtype=torch.uint8, device=p.device)


@dataclass
class Packed(ParamKind):
    """A 4-bit weight's bytes: its shape and dtype as stored, its byte count, and the
    quantization state (whole, shared by every view): a bitsandbytes ``QuantState``, or the
    state of an ``NF4Tensor`` (``nf4``). Its slot's flat elements are these bytes carried in the
    gather slot's dtype (``carrier_numel`` of them)."""

    shape: torch.Size
    dtype: torch.dtype
    nbytes: int
    quant_state: Any
    nf4: NF4State | None = None

    @property
    def packed(self) -> bool:
        return True

    @staticmethod
    def of(p: Any, device: torch.device | None = None) -> Packed:
        if is_nf4(p):
            data = p.quantized_data
            state = NF4State.of(p, device if device is not None else data.device)
            return Packed(data.shape, data.dtype, data.numel() * data.element_size(), None, state)
        state = getattr(p, "quant_state")  # noqa: B009 - a Params4bit attribute torch's stubs lack
        return Packed(p.shape, p.dtype, p.numel() * p.element_size(), state)

    def carrier_numel(self, carrier: torch.dtype) -> int:
        """Elements of the carrier dtype that hold the bytes (the last one padded with zeros)."""
        size = torch.empty(0, dtype=carrier).element_size()
        return -(-self.nbytes // size)

    def state_shape(self, shape: torch.Size) -> torch.Size:
        return self.shape  # the bytes as stored, not their carrier elements

    def to_flat(self, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``full``'s bytes as a 1-D tensor of the carrier ``dtype`` (a copy, zero-padded)."""
        raw = packed_bytes(full).detach().contiguous().reshape(-1).view(torch.uint8)
        size = torch.empty(0, dtype=dtype).element_size()
        out = torch.zeros(self.carrier_numel(dtype) * size, dtype=torch.uint8, device=full.device)
        out[: self.nbytes].copy_(raw)
        return out.view(dtype)

    def view(self, piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The weight as stored, viewed from its carrier elements (no copy)."""
        return piece.view(torch.uint8)[: self.nbytes].view(self.dtype).view(self.shape)

    def bind(self, t: torch.Tensor) -> torch.Tensor:
        """The weight a module computes with, from its bytes ``t``: for bitsandbytes ``t`` with
        what ``Linear4bit.forward`` reads besides the bytes; for torchao the ``NF4Tensor`` over
        ``t``."""
        if self.nf4 is not None:
            return self.nf4.wrap(t)
        t.quant_state = self.quant_state  # type: ignore[attr-defined]
        return t


def check_quantized(specs: list, largest_block_numel: int | None = None) -> None:
    """Refuse quantized weights the engine cannot keep, each in one line:

    - a bitsandbytes 8-bit one (``Int8Params``: ``load_in_8bit``, ``Linear8bitLt``): its int8
      codes would be sharded, but its scales (``CB``/``SCB``, attributes of the weight) are not
      carried by a gathered view, so its first forward failed (``AttributeError: ... 'CB'``);
    - a 4-bit trainable one: 4-bit codes have no gradient (``Linear4bit``'s backward computes none)
      and no optimizer can step them; train adapters on a frozen base (PEFT's LoRA);
    - one not yet quantized (``bnb_quantized`` False: bitsandbytes quantizes on ``.to(device)``):
      its data is still the full-precision weight;
    - one on the meta device (its bytes do not exist yet);
    - PEFT's DoRA (``use_dora=True``) beside a bitsandbytes 4-bit base: DoRA's forward
      dequantizes the base weight from the module's ``Params4bit`` parameter
      (``peft.utils.integrations.dequantize_module_weight``), and while a unit runs the module's
      weight is a view of its gathered bytes, which PEFT takes for an unquantized weight (the
      "FSDP edge case": it returns the bytes as the weight; on a CPU it then assigns the
      parameter back, replacing the registered slice).
    """
    int8 = getattr(sys.modules.get("bitsandbytes.nn.modules"), "Int8Params", None)
    dora = [u.name for s in specs for _, uses in s.params for u in uses
            if "lora_magnitude_vector" in u.name]  # fmt: skip
    four_bit = params4bit_class()
    if (
        dora
        and four_bit is not None
        and any(isinstance(p, four_bit) for s in specs for p, _ in s.params)
    ):
        raise ValueError(
            f"shard(): {dora[0]} is a DoRA magnitude (LoraConfig(use_dora=True)) on a bitsandbytes "
            "4-bit base, which layershard cannot run (PEFT's DoRA reads the base weight as a "
            "Params4bit, not as the gathered bytes); train LoRA (use_dora=False) on the 4-bit "
            "base, or DoRA on a bf16 base"
        )
    for s in specs:
        for p, uses in s.params:
            name = uses[0].name
            if int8 is not None and isinstance(p, int8):
                raise ValueError(
                    f"shard(): {name} is a bitsandbytes 8-bit weight (load_in_8bit, "
                    "Linear8bitLt), which layershard cannot shard; load the base in 4 bits for "
                    "QLoRA (BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type='nf4')) or "
                    "in bf16/fp32"
                )
            if not is_packed(p):
                continue
            kind = "torchao NF4" if is_nf4(p) else "bitsandbytes"
            if p.requires_grad:
                raise ValueError(
                    f"shard(): {name} is a 4-bit ({kind}) weight with requires_grad=True; "
                    "4-bit weights are frozen (no gradient, no optimizer state): freeze the base "
                    "and train adapters (peft.get_peft_model with a LoraConfig, or LoRA beside "
                    "torchtune's frozen NF4 linears) before ls.shard()"
                )
            if is_nf4(p):
                if p.quantized_data.is_meta:
                    raise ValueError(
                        f"shard(): {name} is a torchao NF4Tensor on the meta device; quantize "
                        "materialized weights (to_nf4) before ls.shard()"
                    )
                continue
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
