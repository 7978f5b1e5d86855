"""Which gather slot each unit takes: plain arithmetic on unit sizes, shared by the engine
(``shard()`` builds the slots, buffers.py says how they are used) and the planner (``layershard
plan`` sizes them without torch)."""

from __future__ import annotations

from collections.abc import Sequence

# A unit with at most 1/SMALL_UNIT of the largest unit's elements gets a gather slot of its own.
SMALL_UNIT = 64


def assign_gather_slots(numels: Sequence[int], first_is_lookup: bool = False) -> list[int]:
    """Each unit's gather slot, in forward order: 0 and 1 are the two slots taken in turn, 2, 3...
    a slot of its own for each small unit. The large units alternate, except that when the first
    unit is a lookup (an embedding: ``first_is_lookup``) it shares slot 0 with the second if that
    makes the slots smaller. An untied embedding and head then share the larger slot, and the
    second unit's gather waits behind a lookup instead of overlapping a block."""
    big = max(numels, default=0)
    small = [n * SMALL_UNIT <= big for n in numels]
    turns = [i for i, is_small in enumerate(small) if not is_small]

    def capacity(parity: list[int]) -> int:
        return sum(
            max((numels[i] for i, p in zip(turns, parity) if p == k), default=0) for k in (0, 1)
        )

    strict = [k % 2 for k in range(len(turns))]
    paired = [max(k - 1, 0) % 2 for k in range(len(turns))]
    parity = paired if first_is_lookup and capacity(paired) < capacity(strict) else strict
    out = [0] * len(numels)
    for i, p in zip(turns, parity):
        out[i] = p
    own = [i for i, is_small in enumerate(small) if is_small]
    for k, i in enumerate(own):
        out[i] = 2 + k
    return out


def slot_numels(which: Sequence[int], numels: Sequence[int]) -> dict[int, int]:
    """Elements of each gather slot: the largest unit that takes it."""
    sizes: dict[int, int] = {0: 0, 1: 0}
    for k, n in zip(which, numels):
        sizes[k] = max(sizes.get(k, 0), n)
    return sizes
