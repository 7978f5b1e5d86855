"""Which gather slot each unit takes: plain arithmetic on unit sizes, shared by the engine
(``shard()`` builds the slots, buffers.py says how they are used) and the planner (``layershard
plan`` sizes them without torch)."""

from __future__ import annotations

from collections.abc import Sequence

# A unit with at most 1/SMALL_UNIT of the shared slots' size gets a gather slot of its own.
SMALL_UNIT = 64

# The "slot" of a unit larger than every block: storage of its own, allocated when its gather
# is issued and freed when it releases it (see buffers.py, "Note: units larger than a block").
OWN = -1

# The two slots units take in turn: the only ones that give their storage back between forward
# and backward (see buffers.py, "Note: between the passes").
TURNS = (0, 1)


def slot_limit(numels: Sequence[int], blocks: Sequence[bool] | None = None) -> int:
    """Elements of the largest unit that may size the shared slots: the largest block (units
    above it are "large"); without blocks (``blocks`` None or no True in it), the largest unit,
    so that nothing is large."""
    in_blocks = [n for n, b in zip(numels, blocks or []) if b]
    return max(in_blocks or list(numels) or [0])


def assign_gather_slots(
    numels: Sequence[int],
    first_is_lookup: bool = False,
    blocks: Sequence[bool] | None = None,
) -> list[int]:
    """Each unit's gather slot, in forward order: 0 and 1 are the two slots taken in turn, 2, 3...
    a slot of its own for each small unit, ``OWN`` storage of its own for a unit larger than
    every block (``blocks``: which units are blocks; None: no unit is large). The other units
    alternate, except that when the first unit is a lookup (an embedding: ``first_is_lookup``)
    it shares slot 0 with the second if that makes the slots smaller. An untied embedding and
    head then share the larger slot, and the second unit's gather waits behind a lookup instead
    of overlapping a block."""
    limit = slot_limit(numels, blocks)
    large = [n > limit for n in numels]
    small = [not big and n * SMALL_UNIT <= limit for n, big in zip(numels, large)]
    turns = [i for i in range(len(numels)) if not small[i] and not large[i]]

    def capacity(parity: list[int]) -> int:
        return sum(
            max((numels[i] for i, p in zip(turns, parity) if p == k), default=0) for k in (0, 1)
        )

    strict = [k % 2 for k in range(len(turns))]
    paired = [max(k - 1, 0) % 2 for k in range(len(turns))]
    lookup_first = first_is_lookup and bool(turns) and turns[0] == 0
    parity = paired if lookup_first and capacity(paired) < capacity(strict) else strict
    out = [OWN] * len(numels)
    for i, p in zip(turns, parity):
        out[i] = p
    own = [i for i, is_small in enumerate(small) if is_small]
    for k, i in enumerate(own):
        out[i] = 2 + k
    return out


def slot_numels(which: Sequence[int], numels: Sequence[int]) -> dict[int, int]:
    """Elements of each preallocated gather slot: the largest unit that takes it (``OWN``
    storage is not a slot: see ``own_numel``)."""
    sizes: dict[int, int] = {0: 0, 1: 0}
    for k, n in zip(which, numels):
        if k != OWN:
            sizes[k] = max(sizes.get(k, 0), n)
    return sizes


def own_numel(which: Sequence[int], numels: Sequence[int]) -> int:
    """Elements of the largest unit with storage of its own (0: none). One such unit holds its
    storage at a time (each frees it when it releases it)."""
    return max((n for k, n in zip(which, numels) if k == OWN), default=0)


def gathered_into_backward(which: Sequence[int]) -> list[bool]:
    """Which units are still gathered when backward starts: small units, in slots of their own,
    and the forward's last unit if it takes a slot in turns (the slots in turns give the rest
    back between the passes; storage of its own is freed after its forward)."""
    out = [k not in TURNS and k != OWN for k in which]
    if which and which[-1] in TURNS:
        out[-1] = True
    return out


def released_numel(which: Sequence[int], numels: Sequence[int]) -> int:
    """Elements the slots in turns give back between the passes: their sizes, less the forward's
    last unit's weights when it takes one of them (it keeps them for its backward)."""
    sizes = slot_numels(which, numels)
    kept = numels[-1] if which and which[-1] in TURNS else 0
    return sum(sizes[k] for k in TURNS) - kept
