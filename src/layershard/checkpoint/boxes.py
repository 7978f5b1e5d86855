"""Where a rank's slice of a parameter lies in the whole parameter, as checkpoints and HF files
hold it (row-major, whole shape).

A rank holds a contiguous range ``[a, b)`` of its *part* of a parameter, flattened: the whole
parameter, a few experts of it (expert parallelism: a block along dim 0), or its tensor-parallel
shard (a block along the placement's dim). A block along dim 0 keeps a range contiguous in the
whole; a block along another dim (a row-parallel weight, ``Shard(1)``) does not: every row of
the part is a run of its own in the whole. So a range is described as N-D boxes, not runs:

- ``boxes(shape, a, b)``: ``[a, b)`` of a row-major ``shape`` as at most ``2 * ndim - 1`` boxes
  (the tail of a first row, whole rows, the head of a last row, recursively), each contiguous in
  ``shape``'s flattening, so each is a view of the rank's 1-D slice;
- ``pieces(slot, a, b)``: those boxes moved to the whole parameter's coordinates;
- ``runs(shape, box)``: a box as 1-D runs of the flattened whole (what a checkpoint that stores
  the parameter 1-D needs). A row-parallel weight's box has one run per row: 8192 of them for a
  70B model's, per rank and per weight, each a DCP item. That is why such a parameter is saved in
  its N-D shape (``stored_size``); a few boxes describe any rank's part of it.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

import torch

Box = tuple[tuple[int, ...], tuple[int, ...]]  # (offsets, sizes)


def boxes(shape: Sequence[int], a: int, b: int) -> list[Box]:
    """``[a, b)`` of a row-major tensor of ``shape`` (flattened) as boxes in order, each
    contiguous in the flattening; at most ``2 * len(shape) - 1`` of them."""
    shape = tuple(shape) or (1,)  # a 0-d tensor: one element
    if a >= b:
        return []
    if len(shape) == 1:
        return [((a,), (b - a,))]
    inner = math.prod(shape[1:])
    rest = shape[1:]

    def row(r: int, lo: int, hi: int) -> list[Box]:
        return [((r, *o), (1, *s)) for o, s in boxes(rest, lo, hi)]

    first, last = a // inner, b // inner  # rows of a and b
    if first == last:
        return row(first, a % inner, b % inner)
    out = []
    if a % inner:
        out += row(first, a % inner, inner)
        first += 1
    if last > first:
        out.append(((first,) + (0,) * len(rest), (last - first, *rest)))
    if b % inner:
        out += row(last, 0, b % inner)
    return out


def flat_index(shape: Sequence[int], offsets: Sequence[int]) -> int:
    """The row-major position of ``offsets`` in ``shape``."""
    i = 0
    for n, o in zip(shape, offsets):
        i = i * n + o
    return i


def runs(shape: Sequence[int], box: Box) -> list[tuple[int, int]]:
    """``box`` of a row-major tensor of ``shape`` as ``(start, length)`` runs of its flattening,
    in order: one per index of the dims before the box's contiguous tail."""
    shape = tuple(shape) or (1,)
    offsets, sizes = box
    if not offsets:
        offsets, sizes = (0,), (1,)
    k = len(shape) - 1  # the box is contiguous over dims k.. once every later dim is whole
    while k > 0 and sizes[k] == shape[k]:
        k -= 1
    length = math.prod(sizes[k:])
    lead = [range(o, o + s) for o, s in zip(offsets[:k], sizes[:k])]
    return [(flat_index(shape, (*idx, *offsets[k:])), length) for idx in itertools.product(*lead)]


def part_offsets(slot) -> tuple[int, ...]:
    """Where a rank's part of parameter ``slot`` (``slot.shape``) starts in the whole
    (``slot.whole_shape``): an expert-parallel rank's experts along dim 0, a tensor-parallel
    shard along its placement's dim (torch's ``Shard``: ``ceil(n / tp)`` rows per rank, the last
    ones fewer), anything else at the origin."""
    whole = tuple(slot.whole_shape)
    try:
        at = slot.kind.part_offsets(whole)  # ParamKind: experts along dim 0, a TP shard's dim
    except NotImplementedError as e:
        raise NotImplementedError(f"checkpoint of {slot.name}: {e}") from None
    if any(o + s > n for o, s, n in zip(at, slot.shape, whole)):
        raise ValueError(
            f"{slot.name}: a part of shape {tuple(slot.shape)} at {tuple(at)} does not fit in "
            f"the whole {whole}"
        )
    return tuple(at)


def pieces(slot, a: int, b: int) -> list[tuple[Box, int]]:
    """``[a, b)`` of this rank's part of ``slot`` (its flattening) as boxes of the whole
    parameter, each with where it starts in the part's flattening."""
    shape = tuple(slot.shape) or (1,)
    at = part_offsets(slot) or (0,)
    return [
        ((tuple(o + t for o, t in zip(offs, at)), sizes), flat_index(shape, offs))
        for offs, sizes in boxes(shape, a, b)
    ]


def contiguous(slot) -> bool:
    """Is every rank's part of ``slot`` a contiguous range of the flattened whole (a block
    along dim 0, or the whole)?"""
    return slot.kind.contiguous(slot.whole_shape)


def stored_size(slot) -> list[int]:
    """The size a new checkpoint stores parameter ``slot`` (and its per-element optimizer
    state) with: 1-D (``[numel]``), as every checkpoint did before tensor parallelism, unless a
    rank's part is not contiguous in it (a row-parallel weight): then its whole N-D shape. Every
    rank knows every parameter's placement, so every rank describes it with the same size, as
    DCP needs."""
    whole = slot.whole_shape
    return [whole.numel()] if contiguous(slot) else list(whole)


def covers(chunks, size: Sequence[int]) -> str:
    """``""`` when the N-D ``chunks`` (DCP's ``ChunkStorageMetadata``, each within ``size``:
    validate.check_storage checks that) cover ``size`` exactly once; else what is wrong."""
    total = sum(math.prod(c.sizes) for c in chunks)
    if total != math.prod(size):
        return f"its chunks hold {total} of {math.prod(size)} elements"
    order = sorted(chunks, key=lambda c: tuple(c.offsets))
    for i, c in enumerate(order):  # a sweep along dim 0: only chunks whose rows meet compared
        end = c.offsets[0] + c.sizes[0]
        for d in order[i + 1 :]:
            if d.offsets[0] >= end:
                break
            if all(
                o1 < o2 + s2 and o2 < o1 + s1
                for o1, s1, o2, s2 in zip(c.offsets, c.sizes, d.offsets, d.sizes)
            ):
                return f"its chunks at {list(c.offsets)} and {list(d.offsets)} overlap"
    return ""


def local_chunk(local: torch.Tensor, start: int, sizes: Sequence[int]) -> torch.Tensor:
    """The box of ``sizes`` starting at ``start`` of the 1-D ``local`` slice, as a view."""
    return local[start : start + math.prod(sizes)].view(tuple(sizes))
