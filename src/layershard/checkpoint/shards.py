"""Shards as DCP sees them: every parameter (and its per-element optimizer state) is one 1-D
tensor of which each rank holds the slice its flat parameter gives it; plus the small helpers
every part of the checkpoint code shares."""

from __future__ import annotations

import json
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
)

# ---- shards as DCP-native sharded tensors -------------------------------------------------------


class Shard1D(torch.Tensor):
    """A 1-D tensor of ``numel`` elements of which this rank holds ``[lo, hi)`` as ``local`` (a view
    into the flat parameter or the optimizer state: DCP reads into it in place).

    It speaks DCP's public checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``, as DTensor does), so DCP saves and reshards uneven 1-D slices without
    the deprecated ShardedTensor (``torch.distributed``'s ``_shard`` package). The chunks on disk are the ones
    ShardedTensor wrote (offset ``lo``, size ``hi - lo``, nothing for an empty slice), so checkpoints
    of either kind load with the other. A tensor subclass only because DCP looks shards up through
    ``isinstance(obj, torch.Tensor)``; it carries no data of its own and refuses every operation.
    """

    _local: torch.Tensor
    _lo: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, numel: int, lo: int) -> Shard1D:
        if local.dim() != 1 or not 0 <= lo <= lo + local.numel() <= numel:
            raise ValueError(
                f"Shard1D: a 1-D slice [{lo}, {lo + local.numel()}) of a tensor of {numel} "
                "elements was expected"
            )
        t = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device, requires_grad=False
        )
        t._local, t._lo = local, lo
        return t

    # torch's own idiom (nn.Parameter's too); its stubs type the attribute as a method
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # the stubs declare Tensor.__torch_dispatch__ as the disabled implementation's function
    # rather than the classmethod protocol every subclass implements (DTensor ignores it too)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"Shard1D only describes a checkpoint shard to DCP; {func} is not supported on it "
            "(use its local slice)"
        )

    # the default repr would dispatch; Tensor's takes a tensor_contents= that this one ignores
    def __repr__(self) -> str:  # type: ignore[override]
        return f"Shard1D(numel={self.shape[0]}, local=[{self._lo}, {self._hi}), {self.dtype})"

    @property
    def _hi(self) -> int:
        return self._lo + self._local.numel()

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(
            offsets=torch.Size([self._lo]), sizes=torch.Size([self._local.numel()])
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self._local.numel() == 0:  # this rank holds none of it: another rank writes it all
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self._lo])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    # the properties ShardedTensor recorded: only the dtype is not a default
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self._local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self._lo,):
            raise ValueError(
                f"{index.fqn}: this rank holds the slice at offset {self._lo}, not {tuple(index.offset)}"
            )
        return self._local


def sharded_1d(model, f, slot, local: torch.Tensor, save: bool) -> torch.Tensor:
    """``local`` (this rank's part of parameter ``slot`` of flat ``f``, or of its per-element
    optimizer state) as DCP should see it: a slice of the flattened whole parameter (all
    experts, for an expert-parallel layer's). The layout comes from the flat parameter, not from
    a collective. The ranks that hold a replica of another rank's slice (``hybrid``,
    ``no_shard``) write nothing: every chunk is saved once, and loads into every replica."""
    numel = slot.whole_shape.numel()
    if numel == 0:
        return local
    if save and not model.sharding.writes_slices:
        return Shard1D(local[:0], numel, 0)
    lo, hi = f.param_ranges(slot)[f.rank]
    if local.numel() != hi - lo:
        raise CheckpointError(
            f"internal: a local slice of {local.numel()} elements for the range [{lo}, {hi})"
        )
    # an empty slice lies wholly before or after the parameter: its position does not matter
    return Shard1D(local, numel, lo if hi > lo else 0)


def params(model):
    """``(flat, slot, shard_param)`` for every parameter, in unit order, but frozen 4-bit weights
    (engine/quantized.py): a QLoRA checkpoint holds what training changes; the packed base is
    read again from the model folder it was quantized from (bitsandbytes' quantization is
    deterministic), as a PEFT adapter checkpoint does."""
    for f in model.flat_params:
        if f.packed:
            continue
        for slot, p in zip(f.slots, f.shard_params):
            yield f, slot, p


def buffers(model):
    return model.persistent_buffers()


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    """The ``torch.dtype`` a manifest names ("float32"); anything else (a manifest is user input:
    ``getattr(torch, "load")`` is a function) is a corrupt manifest."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"{where}: {name!r} is not a torch dtype (corrupt manifest)")
    return dtype


def jsonable(value, what: str):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serializable (dicts, lists, numbers, strings): {e}"
        ) from None
