"""What kind of parameter a ``ParamSlot`` holds, asked by the engine instead of branching on it.

Most parameters are plain: this rank's elements of them are a range of a flat fp32 group, the
module computes with a view of the gathered buffer, and checkpoints hold them as they are. A few
kinds differ, each in a few answers, and each answers them in its own module:

- ``Packed`` (four_bit.py): a frozen 4-bit weight, whose flat elements carry its packed bytes in
  the gather slot's dtype; the module computes with those bytes and the quantization state.
- ``ExpertPart`` (here): some experts of an expert-parallel layer, a slice along dim 0 of a
  larger whole that checkpoints and full state dicts hold.
- ``TPInfo`` (dtensor.py): a ``DTensor`` parameter's local shard, wrapped again as the
  ``DTensor`` before the module computes; whole over the TP group.
- ``Float8Weight`` (float8.py): a torchao ``Float8Linear`` weight handed its gathered fp8 bytes.

``ParamKind`` itself is the plain kind (``PLAIN``): every answer here is the plain one, and a kind
overrides only what differs. A parameter has one kind; two at once are refused at ``shard()``
(build.py ``kind_of``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from layershard.engine.waits import waiting
from layershard.engine.wire_dtype import dequantize_fp8, quantize_fp8


class ParamKind:
    """A plain parameter (see the module docstring); subclasses answer what differs."""

    @property
    def packed(self) -> bool:
        """Its flat elements are bytes, not weights: gathered without a cast, never trained."""
        return False

    @property
    def split_over_tp(self) -> bool:
        """Does each TP rank of a replica hold a different part of it (its gradient's squares
        summed over the TP group in the gradient norm), or every TP rank the same (counted
        once)?"""
        return False

    # ---- shapes: the part this rank holds and the whole that checkpoints hold -----------------
    def whole_shape(self, shape: torch.Size) -> torch.Size:
        """The parameter's shape as checkpoints and full state dicts hold it, from ``shape``,
        the shape of this rank's part in the flat storage."""
        return shape

    def state_shape(self, shape: torch.Size) -> torch.Size:
        """The shape ``load_full_state_dict`` expects of it."""
        return self.whole_shape(shape)

    @property
    def whole_offset(self) -> int:
        """Where this rank's part starts in the flattened whole parameter (a contiguous part's)."""
        return 0

    def part_offsets(self, whole: tuple[int, ...]) -> list[int]:
        """Where this rank's part starts in the whole of shape ``whole``, per dim."""
        return [0] * len(whole)

    def contiguous(self, whole: torch.Size) -> bool:
        """Is every rank's part a contiguous range of the flattened whole?"""
        return True

    def local_part(self, whole: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """This rank's part (of shape ``shape``) of the whole parameter ``whole``."""
        return whole

    def gather_whole(self, part: torch.Tensor, sharding: Any) -> torch.Tensor:
        """The whole parameter from this rank's ``part`` (collective where parts differ)."""
        return part

    # ---- the flat storage ---------------------------------------------------------------------
    def to_flat(self, full: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``full`` (this rank's part, whole) as the elements a flat group of ``dtype`` stores."""
        return full

    def view(self, piece: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        """The parameter as stored, from its ``piece`` of a flat tensor (no copy)."""
        return piece.view(shape)

    # ---- compute --------------------------------------------------------------------------------
    def bind(self, t: torch.Tensor) -> torch.Tensor:
        """What the module computes with, from its view ``t`` of the gathered buffer."""
        return t

    # ---- quantized gathers (wire_dtype.py) ------------------------------------------------------
    def set_fp8_scale(self, amax: torch.Tensor) -> None:
        """This forward's fp8 amax of the parameter, over every rank."""

    def quantize_fp8(self, x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """``out`` (bytes) <- this rank's elements ``x`` as they travel in an fp8 gather."""
        quantize_fp8(x, scale, out)

    def dequantize_fp8(self, q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
        """``out`` (compute dtype) <- the gathered bytes ``q`` of the parameter."""
        dequantize_fp8(q, scale, out)


PLAIN = ParamKind()


@dataclass(frozen=True)
class ExpertPart(ParamKind):
    """Where a rank's experts sit in the whole parameter of an expert-parallel layer (experts
    split over the ``ep`` ranks along dim 0, parallel/expert.py): its shape, and the elements of
    the flattened whole before this rank's part. Checkpoints and ``full_state_dict`` speak of the
    whole; the flat storage holds the part."""

    whole: torch.Size
    offset: int

    @property
    def split_over_tp(self) -> bool:
        return True  # with TP, the ranks of a replica hold different experts

    def whole_shape(self, shape: torch.Size) -> torch.Size:
        return self.whole

    @property
    def whole_offset(self) -> int:
        return self.offset

    def part_offsets(self, whole: tuple[int, ...]) -> list[int]:
        at = [0] * len(whole)
        if whole:
            at[0] = self.offset // max(int(torch.Size(whole[1:]).numel()), 1)
        return at

    def local_part(self, whole: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return whole.reshape(-1)[self.offset : self.offset + shape.numel()].view(shape)

    def gather_whole(self, part: torch.Tensor, sharding: Any) -> torch.Tensor:
        parts = [torch.empty_like(part) for _ in range(sharding.ep_size)]
        with waiting("all-gather of experts (full_state_dict)"):
            dist.all_gather(parts, part.contiguous(), group=sharding.ep_group)
        out = torch.cat(parts)
        assert out.shape == self.whole, (out.shape, self.whole)
        return out


EXPERT_ATTR = "_layershard_expert"  # an ExpertPart on a parameter that holds some experts only


def expert_part(p: torch.Tensor) -> ExpertPart | None:
    return getattr(p, EXPERT_ATTR, None)
