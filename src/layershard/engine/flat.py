"""FlatParam: one unit's parameters (all trainable, or all frozen) as a single flat fp32 tensor
(a frozen group of another floating-point dtype keeps that dtype: ``build._by_dtype``).

A unit's frozen 4-bit weights are a flat group of their own whose elements carry their packed
bytes in the gather slot's dtype (``dtype``; a ``Packed`` kind): see ``four_bit.py``. What kind
of parameter each slot holds (plain, 4-bit bytes, some experts, a DTensor's local shard, a
Float8Linear's weight) is its ``kind`` (``param_kind.py``), which this module asks.

The flat layout concatenates the parameters in registration order, each starting on an aligned
offset, and pads the end so that it splits into ``world_size`` equal contiguous slices, each a
multiple of the alignment. Each rank stores only its own slice (``shard``) and exposes, per
original parameter, the part of that parameter that falls inside the slice as a 1-D
``nn.Parameter`` view (``shard_params``): that is what the optimizer steps on.

    flat (padded):  | p0 ........ |.| p1 .... |.| p2 .............. |pad |
    rank slices:    |   rank 0      |    rank 1     |   rank 2         |
    shard_params of rank 1: tail of p0, all of p1, head of p2  (views into rank 1's shard)

Note: alignment. Every parameter offset and every rank's slice start at a multiple of ``ALIGN``
elements, so every weight view of a gather buffer, every chunk a collective reads or writes, and
every slice the optimizer steps on starts on a 16-byte boundary in any dtype of 2 bytes or more
(vectorized kernels need it; YaFSDP pads the same way). The gaps between parameters are zero in
the weights and in the gradients.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from layershard.engine.param_kind import PLAIN, ParamKind

ALIGN = 8  # elements: 16 bytes of bf16/fp16, 32 bytes of fp32


def align(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass
class ParamUse:
    """One place where a parameter is reachable: ``module.<attr>``, known as ``name``."""

    name: str
    module: nn.Module
    attr: str


@dataclass
class ParamSlot:
    """An original parameter's place in its flat tensor. ``uses[0].name`` is its canonical name;
    ``shape`` its shape in the flat storage (this rank's part of it, before data-parallel
    sharding); ``kind`` what else the engine must know of it (``param_kind.py``)."""

    uses: list[ParamUse]
    shape: torch.Size
    offset: int
    requires_grad: bool
    kind: ParamKind = PLAIN

    @property
    def name(self) -> str:
        return self.uses[0].name

    @property
    def numel(self) -> int:
        return self.shape.numel()

    @property
    def whole_shape(self) -> torch.Size:
        """The parameter's shape as checkpoints and full state dicts hold it (all experts, every
        TP rank's shard)."""
        return self.kind.whole_shape(self.shape)

    @property
    def whole_offset(self) -> int:
        """Where this rank's part starts in the flattened whole parameter (an expert-parallel
        one's; a TP shard need not be contiguous in it: checkpoint/boxes.py)."""
        return self.kind.whole_offset

    def part_of(self, whole: torch.Tensor) -> torch.Tensor:
        """This rank's part (``shape``) of the whole parameter ``whole``."""
        return self.kind.local_part(whole, self.shape)


def layout(numels: list[int], world_size: int) -> tuple[list[int], int, int]:
    """``(offsets, numel, shard_numel)`` of parameters of ``numels`` elements laid out flat:
    aligned offsets, the end of the last parameter, and each rank's slice length."""
    offsets, end = [], 0
    for n in numels:
        offsets.append(end)
        end = align(end + n) if n else end
    numel = offsets[-1] + numels[-1] if numels else 0
    shard_numel = align(-(-numel // world_size))
    return offsets, numel, shard_numel


@dataclass
class FlatParam:
    slots: list[ParamSlot]
    requires_grad: bool
    world_size: int
    rank: int
    device: torch.device
    storage: torch.Tensor | None = field(default=None, repr=False)  # zeroed, shard_numel long
    dtype: torch.dtype = torch.float32  # a packed group's carrier: the gather slot's dtype
    # the group it is sharded over (engine/collectives.py ``Comm.members``): "shard", or
    # "expert" for experts of an expert-parallel layer (the ranks holding the same experts)
    over: str = "shard"
    numel: int = field(init=False)  # up to the end of the last parameter
    padded_numel: int = field(init=False)
    shard_numel: int = field(init=False)
    # no_sync(): this rank's unsharded fp32 gradient sum, until the next synchronized backward
    acc: torch.Tensor | None = field(init=False, default=None)
    acc_dirty: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        offsets, self.numel, self.shard_numel = layout(
            [s.numel for s in self.slots], self.world_size
        )
        assert [s.offset for s in self.slots] == offsets, "slots must be laid out by layout()"
        self.padded_numel = self.shard_numel * self.world_size
        # The gaps between parameters and the tail: zero in every gradient the rank reduces.
        ends = [s.offset + s.numel for s in self.slots]
        starts = [s.offset for s in self.slots[1:]] + [self.padded_numel]
        self.gaps = [(a, b) for a, b in zip(ends, starts) if b > a]
        if self.storage is not None:
            self.shard = self.storage
        else:
            self.shard = torch.zeros(self.shard_numel, dtype=self.dtype, device=self.device)
        self.storage = None
        self.grad = torch.zeros_like(self.shard) if self.requires_grad else None
        self.shard_params: list[nn.Parameter] = []
        self._make_params()

    def _make_params(self) -> None:
        """Per parameter, its part of this rank's slice as a 1-D ``nn.Parameter`` (sharing storage
        and version counter with the flat shard), with ``.grad`` a view of the flat gradient."""
        self.shard_params = []
        for slot in self.slots:
            lo, hi = self.local_range(slot)
            piece = self.shard[lo - self.shard_start : hi - self.shard_start]
            if slot.kind.packed:  # bytes, so that nothing takes them for weights
                piece = piece.view(torch.uint8)
            p = nn.Parameter(piece, requires_grad=False)
            p.requires_grad_(self.requires_grad)
            if self.grad is not None:
                p.grad = self.grad[lo - self.shard_start : hi - self.shard_start]
            self.shard_params.append(p)

    def pin(self) -> None:
        """Move the shard and its gradient into pinned host memory (CPU offload with CUDA), so
        that copies to and from the GPU are asynchronous. Call before any view is taken."""
        self.shard = self.shard.pin_memory()
        if self.grad is not None:
            self.grad = self.grad.pin_memory()
        self._make_params()

    @property
    def shard_start(self) -> int:
        return self.rank * self.shard_numel

    def local_range(self, slot: ParamSlot) -> tuple[int, int]:
        """The part of ``slot`` held by this rank, in flat coordinates (may be empty)."""
        return self.range_on(slot, self.rank)

    def range_on(self, slot: ParamSlot, rank: int) -> tuple[int, int]:
        """The part of ``slot`` held by ``rank``, in flat coordinates (may be empty)."""
        start = rank * self.shard_numel
        lo = min(max(slot.offset, start), start + self.shard_numel)
        hi = max(min(slot.offset + slot.numel, start + self.shard_numel), lo)
        return lo, hi

    def local_param_range(self, slot: ParamSlot) -> tuple[int, int]:
        """The part of ``slot`` held by this rank, in the flattened parameter's coordinates."""
        lo, hi = self.local_range(slot)
        return lo - slot.offset, hi - slot.offset

    def param_ranges(self, slot: ParamSlot) -> list[tuple[int, int]]:
        """For every rank of its group, the part ``[a, b)`` of the flattened whole parameter
        ``slot`` (all experts, for an expert slot) it holds."""
        at = slot.whole_offset - slot.offset
        return [
            (lo + at, hi + at)
            for lo, hi in (self.range_on(slot, r) for r in range(self.world_size))
        ]

    def views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter's full-shape view into ``flat``, a tensor of this layout
        (``padded_numel`` elements: a gather buffer, or a gathered copy)."""
        return [s.kind.view(flat[s.offset : s.offset + s.numel], s.shape) for s in self.slots]

    @property
    def packed(self) -> bool:
        """Its slots are 4-bit weights' bytes (four_bit.py)."""
        return any(s.kind.packed for s in self.slots)

    @torch.no_grad()
    def copy_from_full(self, slot: ParamSlot, full: torch.Tensor) -> None:
        """Store this rank's part of ``full`` (the whole parameter ``slot``)."""
        a, b = self.local_param_range(slot)
        lo = slot.offset + a - self.shard_start
        full = slot.kind.to_flat(full, self.dtype)  # 4-bit bytes: reinterpreted, never converted
        self.shard[lo : lo + b - a].copy_(full.detach().reshape(-1)[a:b])

    def drop_accumulated(self) -> None:
        """Forget what ``acc`` holds (a backward that raised: its step is void)."""
        if self.acc is not None:
            self.acc.zero_()
        self.acc_dirty = False

    def release_grad(self) -> None:
        """Free the gradient slice's memory while no parameter slice points at it (after
        ``zero_grad(set_to_none=True)``): like torch, set-to-none gives the memory back until the
        next backward. The tensor and its views stay; only the storage is resized. Memory torch
        cannot resize (pinned host memory: CPU offload on CUDA) is kept."""
        if self.grad is not None and all(p.grad is None for p in self.shard_params):
            storage = self.grad.untyped_storage()
            if storage.resizable():
                storage.resize_(0)

    def ensure_grad(self) -> None:
        assert self.grad is not None, "a frozen flat parameter has no gradient"
        storage = self.grad.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.shard_numel * self.grad.element_size())

    def grad_view(self, i: int) -> torch.Tensor:
        assert self.grad is not None, "a frozen flat parameter has no gradient"
        lo, hi = self.local_range(self.slots[i])
        return self.grad[lo - self.shard_start : hi - self.shard_start]


def view_keys(shapes: list[tuple[int, torch.Size]]) -> dict[tuple, int]:
    """``(offset, shape, stride) -> index`` of a unit's parameter views in its gathered buffer,
    from their ``(offset, shape)`` (contiguous views): how the saved-tensor hooks recognize a
    saved weight as one of them."""
    keys = {}
    for i, (offset, shape) in enumerate(shapes):
        stride, step = [], 1
        for n in reversed(shape):
            stride.append(step)
            step *= n
        keys[(offset, torch.Size(shape), tuple(reversed(stride)))] = i
    return keys
