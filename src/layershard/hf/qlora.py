"""Saving a sharded QLoRA model (a PEFT LoRA model on a 4-bit bitsandbytes base):

- ``save_adapter``: the adapters alone, in PEFT's format (``PeftModel.from_pretrained`` loads
  them onto the 4-bit base); only the trainable units are gathered, never the base;
- ``export_merged``: a plain Hugging Face model (no quantization, no PEFT), each 4-bit weight
  dequantized and its adapter merged (W + scaling x B @ A), in bf16 safetensors, written unit by
  unit: rank 0 holds one unit's weights at a time, never the model.

Both are collective (every rank calls them); rank 0 writes, and every rank raises its error
(``engine/agreement.py``): the others would otherwise wait for it until the timeout.

- ``offload_checkpointed_inputs``: a memory lever for fine-tuning on small GPUs (issue 52): the
  inputs of the blocks ``ls.shard(activation_checkpointing=K)`` checkpoints kept in host memory
  from their forward to their recompute, as ALST and torchtune do.
"""

from __future__ import annotations

import copy
import functools
import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from layershard.engine.four_bit import Packed
from layershard.engine.units import Unit
from layershard.full_state import agreed_by_model, keeps_full_state
from layershard.hf.accelerator import sharded_of
from layershard.sharded import ShardedModule

PEFT_PREFIX = "base_model.model."


def save_adapter(model: Any, folder: str | os.PathLike) -> None:
    """Write the PEFT adapters of a sharded PEFT model into ``folder`` (``adapter_config.json``,
    ``adapter_model.safetensors``). Collective; one rank writes, and its failure is every
    rank's."""
    sharded = _sharded_peft(model, "save_adapter")
    sd = sharded.full_state_dict(rank0_only=True, packed=False)
    with agreed_by_model(sharded):
        if keeps_full_state(sharded):
            _check_folder(Path(folder), "save_adapter")
            copies = {k: v.clone() for k, v in sd.items()}  # views of one buffer: own storage each
            peft_model: Any = sharded.module
            peft_model.save_pretrained(str(folder), state_dict=copies)


def export_merged(
    model: Any, folder: str | os.PathLike, dtype: torch.dtype = torch.bfloat16
) -> None:
    """Write a Hugging Face model folder (``config.json`` without the quantization, safetensors
    in ``dtype``, one file per unit and an index) with every LoRA adapter merged into its
    dequantized base weight, loadable with ``from_pretrained``. Collective; gathers one unit at
    a time; one rank writes, and its failure is every rank's."""
    from safetensors.torch import save_file

    sharded = _sharded_peft(model, "export_merged")
    peft_model: Any = sharded.module
    lora_layers = _lora_layers(peft_model)
    writer = keeps_full_state(sharded)
    out = Path(folder)
    with agreed_by_model(sharded):
        if writer:
            _check_folder(out, "export_merged")
            out.mkdir(parents=True, exist_ok=True)
    units = sharded.units
    weight_map: dict[str, str] = {}
    error: Exception | None = None  # the writer's, kept until every unit is gathered
    for i, u in enumerate(units):
        tensors = _unit_tensors(sharded, u)  # collective: every rank gathers the unit
        if not writer or error is not None:
            continue
        try:
            merged = _merge_unit(u, tensors, lora_layers, dtype)
            name = f"model-{i + 1:05d}-of-{len(units):05d}.safetensors"
            save_file(merged, str(out / name), metadata={"format": "pt"})
            weight_map.update((k, name) for k in merged)
        except Exception as e:  # noqa: BLE001 - raised on every rank below
            error = e
    with agreed_by_model(sharded):
        if error is not None:
            raise error
        if writer:
            _write_rest(sharded, out, weight_map, dtype)


def _check_folder(out: Path, what: str) -> None:
    if out.exists() and not out.is_dir():
        raise ValueError(f"ls.hf.{what}: {out} exists and is not a folder; choose another folder")


def _write_rest(sharded: ShardedModule, out: Path, weight_map: dict[str, str], dtype) -> None:
    """After the units: the buffers, the index and the config without the quantization."""
    from safetensors.torch import save_file

    peft_model: Any = sharded.module
    buffers = {
        _hf_name(k): b.detach().to("cpu", dtype if b.is_floating_point() else b.dtype)
        for k, b in sharded.persistent_buffers()
    }
    if buffers:
        name = "model-buffers.safetensors"
        save_file(buffers, str(out / name), metadata={"format": "pt"})
        weight_map.update((k, name) for k in buffers)
    index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
    (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = copy.deepcopy(peft_model.get_base_model().config)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = dtype
    config.save_pretrained(str(out))


def _sharded_peft(model: Any, what: str) -> ShardedModule:
    sharded = sharded_of(model) if not isinstance(model, ShardedModule) else model
    if sharded is None:
        raise ValueError(f"ls.hf.{what}(model): pass the model ls.shard() returned")
    try:
        from peft import PeftModel
    except ImportError as e:  # pragma: no cover - depends on the install
        raise ImportError(f"ls.hf.{what} needs peft: pip install 'layershard[hf]'") from e
    if not isinstance(sharded.module, PeftModel):
        raise ValueError(
            f"ls.hf.{what}(model): the sharded model is not a PEFT model "
            "(peft.get_peft_model before ls.shard); for a plain model use ls.export_hf"
        )
    return sharded


def _lora_layers(peft_model: nn.Module) -> dict[int, Any]:
    """id(base layer) -> its LoRA layer, for every LoRA layer of the model."""
    from peft.tuners.lora import LoraLayer

    out: dict[int, Any] = {}
    for m in peft_model.modules():
        if isinstance(m, LoraLayer):
            if any(m.use_dora.values()):
                raise ValueError("ls.hf.export_merged: DoRA adapters are not supported")
            out[id(m.get_base_layer())] = m
    return out


def _unit_tensors(sharded: ShardedModule, u: Unit) -> dict[str, torch.Tensor]:
    """The unit's parameters, whole, by canonical name (packed bytes for 4-bit weights)."""
    out = {}
    for f in u.flats:
        for slot, t in zip(f.slots, sharded.whole_views(f, sharded.gather_flat(f))):
            out[slot.name] = t
    return out


def _merge_unit(
    u: Unit, tensors: dict[str, torch.Tensor], lora_layers: dict[int, Any], dtype
) -> dict[str, torch.Tensor]:
    """The unit's weights as the plain model has them: 4-bit ones dequantized, each LoRA
    layer's delta added to its base weight, adapters dropped, names without PEFT's wrappers."""
    from bitsandbytes.functional import dequantize_4bit

    merged: dict[str, torch.Tensor] = {}
    for slot in u.param_slots:
        name = slot.name
        module, attr = slot.uses[0].module, slot.uses[0].attr
        if ".lora_A." in name or ".lora_B." in name or ".lora_embedding_" in name:
            continue
        w = tensors[name]
        if isinstance(slot.kind, Packed):  # its bytes, with the quantization state
            w = dequantize_4bit(w, slot.kind.quant_state).float()
        else:
            w = w.float()
        lora = lora_layers.get(id(module))
        if lora is not None and attr == "weight":
            for adapter in lora.active_adapters:
                a = tensors[_adapter_name(slot.name, "lora_A", adapter)]
                b = tensors[_adapter_name(slot.name, "lora_B", adapter)]
                delta = (b.float() @ a.float()) * lora.scaling[adapter]
                w = w + (delta.T if getattr(lora, "fan_in_fan_out", False) else delta)
        merged[_hf_name(name)] = w.to(dtype).contiguous()
    return merged


def _adapter_name(base: str, which: str, adapter: str) -> str:
    """``<layer>.base_layer.weight`` -> ``<layer>.<which>.<adapter>.weight``."""
    layer = base.removesuffix(".weight").removesuffix(".base_layer")
    return f"{layer}.{which}.{adapter}.weight"


def _hf_name(name: str) -> str:
    """A PEFT model's parameter name as the plain model's."""
    return name.removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")


class HostInputs:
    """What ``offload_checkpointed_inputs`` installed: ``bytes`` moved to host memory so far
    (every forward adds its blocks' inputs), ``remove()`` to undo it."""

    def __init__(self, modules: list[nn.Module], pin: bool) -> None:
        self.pin, self.bytes = pin, 0
        self._modules = modules
        self._inner = [m.forward for m in modules]
        for m, inner in zip(modules, self._inner):
            m.forward = functools.partial(self._forward, inner)

    def _forward(self, inner, *args, **kwargs):
        with torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack):
            return inner(*args, **kwargs)

    def _pack(self, t: torch.Tensor) -> tuple[torch.device, torch.Tensor]:
        host = torch.empty(t.size(), dtype=t.dtype, layout=t.layout, pin_memory=self.pin)
        host.copy_(t)  # from a GPU: to pinned memory, so that the copy back can be asynchronous
        self.bytes += host.numel() * host.element_size()
        return t.device, host

    def _unpack(self, packed: tuple[torch.device, torch.Tensor]) -> torch.Tensor:
        device, host = packed
        return host.to(device, non_blocking=self.pin)

    def remove(self) -> None:
        for m, inner in zip(self._modules, self._inner):
            m.forward = inner
        self._modules, self._inner = [], []


def offload_checkpointed_inputs(model: Any, pin_memory: bool | None = None) -> HostInputs:
    """Keep the inputs of every checkpointed block of a sharded model in host memory from the
    block's forward to its recompute in backward; exact (the same values come back).

    ``ls.shard(activation_checkpointing=K)`` recomputes the first K blocks in backward from their
    inputs (non-reentrant ``torch.utils.checkpoint``), which are all the forward keeps of them:
    one ``micro-batch x seq x hidden`` tensor per block (Llama-3-70B at 2048 tokens in bf16: 32
    MiB a block, 2.5 GiB for 80). Here each checkpointed block's call runs under saved-tensor
    hooks that copy what autograd saves there, which is the checkpoint's inputs only (inside it,
    the checkpoint's own hooks take over), to host memory (``torch.autograd.graph.save_on_cpu``'s
    way, pinned on CUDA) and bring it back to the device when the recompute reads it. On a CPU the
    host is the same memory (the copy costs time, saves nothing); on CUDA the copies are
    synchronous to host and asynchronous back, and the CUDA path has not run on a GPU here.
    Call after ``ls.shard``; returns a ``HostInputs`` (``.bytes`` moved, ``.remove()``)."""
    sharded = sharded_of(model) if not isinstance(model, ShardedModule) else model
    if sharded is None:
        raise ValueError("offload_checkpointed_inputs(model): pass the model ls.shard() returned")
    blocks = [
        m
        for u in sharded.units
        if u.is_block
        for m in u.modules
        if getattr(getattr(m.forward, "func", None), "__name__", "") == "checkpoint_forward"
    ]
    if not blocks:
        raise ValueError(
            "offload_checkpointed_inputs: no block of this model is checkpointed; pass "
            "activation_checkpointing=K to ls.shard (the inputs of those K blocks go to host)"
        )
    pin = torch.cuda.is_available() if pin_memory is None else pin_memory
    return HostInputs(blocks, pin)
