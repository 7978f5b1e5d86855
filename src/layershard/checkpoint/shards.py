"""Shards as DCP sees them: every parameter (and its per-element optimizer state) is one tensor,
1-D or (a row-parallel weight, boxes.py) in its N-D shape, of which each rank holds the chunks
its flat parameter gives it; plus the small helpers every part of the checkpoint code shares."""

from __future__ import annotations

import json
import weakref
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from layershard.checkpoint import boxes
from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
)
from layershard.engine import dtensor

# ---- shards as DCP-native sharded tensors -------------------------------------------------------


class Chunked(torch.Tensor):
    """A tensor of ``size`` of which this rank holds ``chunks``: ``(offsets, local)`` pairs,
    ``local`` a view into the flat parameter or the optimizer state of the shape of the chunk
    (DCP reads into it in place). A rank's slice of a parameter is one chunk of a 1-D tensor,
    or, for a parameter stored N-D (a row-parallel weight: ``boxes.stored_size``), a few N-D
    boxes of it (a 1-D checkpoint loaded into a row-parallel layout: a 1-D run per row).

    It speaks DCP's public checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``, as DTensor does), so DCP saves and reshards uneven slices without
    the deprecated ShardedTensor (``torch.distributed``'s ``_shard`` package). A 1-D slice's chunk
    on disk is the one ShardedTensor wrote (offset ``lo``, size ``hi - lo``, nothing for an empty
    slice), so checkpoints of either kind load with the other. A tensor subclass only because DCP
    looks shards up through ``isinstance(obj, torch.Tensor)``; it carries no data of its own and
    refuses every operation.
    """

    _chunks: dict[tuple[int, ...], torch.Tensor]

    @staticmethod
    def __new__(
        cls,
        size: Sequence[int],
        chunks: Sequence[tuple[Sequence[int], torch.Tensor]],
        dtype: torch.dtype,
        device: torch.device,
    ) -> Chunked:
        mine = {tuple(o): t for o, t in chunks}
        for o, t in mine.items():
            if (
                len(o) != len(size)
                or t.dim() != len(size)
                or any(not 0 <= a <= a + n <= s for a, n, s in zip(o, t.shape, size))
            ):
                raise ValueError(
                    f"Chunked: a chunk of shape {tuple(t.shape)} at {o} does not fit in a "
                    f"tensor of size {tuple(size)}"
                )
        t = torch.Tensor._make_wrapper_subclass(
            cls, tuple(size), dtype=dtype, device=device, requires_grad=False
        )
        t._chunks = mine
        return t

    # torch's own idiom (nn.Parameter's too); its stubs type the attribute as a method
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # the stubs declare Tensor.__torch_dispatch__ as the disabled implementation's function
    # rather than the classmethod protocol every subclass implements (DTensor ignores it too)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"Chunked only describes a checkpoint shard to DCP; {func} is not supported on it "
            "(use its chunks)"
        )

    # the default repr would dispatch; Tensor's takes a tensor_contents= that this one ignores
    def __repr__(self) -> str:  # type: ignore[override]
        held = [(o, tuple(t.shape)) for o, t in self._chunks.items()]
        return f"Chunked(size={tuple(self.shape)}, chunks={held}, {self.dtype})"

    @property
    def chunks(self) -> list[tuple[tuple[int, ...], torch.Tensor]]:
        return list(self._chunks.items())

    def with_locals(self, locals_: Sequence[torch.Tensor]) -> Chunked:
        """The same chunks over other tensors (a staged copy), in ``chunks`` order."""
        held = [(o, t) for o, t in zip(self._chunks, locals_)]
        device = locals_[0].device if locals_ else self.device
        return Chunked(self.shape, held, self.dtype, device)

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(o)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=_chunk(o, t),
                    # the properties ShardedTensor recorded: only the dtype is not a default
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
            for o, t in self._chunks.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [_chunk(o, t) for o, t in self._chunks.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        at = tuple(index.offset) if index.offset is not None else None
        if at is None and len(self._chunks) == 1:
            return next(iter(self._chunks.values()))
        if at not in self._chunks:
            raise ValueError(
                f"{index.fqn}: this rank holds the chunks at {list(self._chunks)}, not {at}"
            )
        return self._chunks[at]


def _chunk(offsets: tuple[int, ...], t: torch.Tensor) -> ChunkStorageMetadata:
    return ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=t.shape)


_TP_RANK: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its TP rank


def tp_rank(model) -> int:
    """``model``'s rank in its TP group (0 without tensor parallelism)."""
    if model not in _TP_RANK:
        group = dtensor.tp_group(s.kind for f in model.flat_params for s in f.slots)
        _TP_RANK[model] = 0 if group is None else dist.get_rank(group)
    return _TP_RANK[model]


def sharded(model, f, slot, local: torch.Tensor, save: bool, size=None) -> torch.Tensor:
    """``local`` (this rank's slice of parameter ``slot`` of flat ``f``, or of its per-element
    optimizer state) as DCP should see it: chunks of the whole parameter (all experts, for an
    expert-parallel layer's; every TP rank's shard, for a tensor-parallel one's), stored with
    ``size``: ``boxes.stored_size`` when saving, what the checkpoint stores when loading (1-D
    ``[numel]`` or the N-D whole shape). The layout comes from the flat parameter and the
    parameter's placement, not from a collective. The ranks that hold a replica of another
    rank's slice (``hybrid``, ``no_shard``, and every TP rank but the first for a parameter not
    split over TP) write nothing: every chunk is saved once, and loads into every replica."""
    whole = slot.whole_shape
    if whole.numel() == 0:
        return local
    size = list(size) if size is not None else boxes.stored_size(slot)
    a, b = f.local_param_range(slot)
    if local.numel() != b - a:
        raise CheckpointError(
            f"internal: a local slice of {local.numel()} elements for the range [{a}, {b})"
        )
    replica = not model.sharding.writes_slices or (
        tp_rank(model) != 0 and not dtensor.split_over_tp(slot)  # experts differ over TP
    )
    chunks: list[tuple[Sequence[int], torch.Tensor]] = []
    if save and replica:
        return Chunked(size, chunks, local.dtype, local.device)
    if len(size) > 1:  # stored N-D: the boxes themselves
        for (at, sizes), start in boxes.pieces(slot, a, b):
            chunks.append((at, boxes.local_chunk(local, start - a, sizes)))
        return Chunked(size, chunks, local.dtype, local.device)
    spans: list[list[int]] = []  # stored 1-D: [whole start, local start, length] of each run
    for box, start in boxes.pieces(slot, a, b):
        for lo, n in boxes.runs(whole, box):
            last = spans[-1] if spans else None
            if last is not None and last[0] + last[2] == lo and last[1] + last[2] == start - a:
                last[2] += n  # adjacent in the whole and in the slice: one chunk
            else:
                spans.append([lo, start - a, n])
            start += n
    chunks = [((lo,), local[at : at + n]) for lo, at, n in spans]
    return Chunked(size, chunks, local.dtype, local.device)


def params(model):
    """``(flat, slot, shard_param)`` for every parameter, in unit order, but frozen 4-bit weights
    (engine/four_bit.py): a QLoRA checkpoint holds what training changes; the packed base is
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
