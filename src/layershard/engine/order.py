"""The order units run in, and what follows each unit in it: the tables the schedule's prefetches
read (which gather a unit's events issue next).

In forward the units run in ``units`` order (learned on the first forward), in backward in
reverse. For each phase: the unit after a unit (``after``); the next unit to take the same gather
slot (``slot_next``: the unit after next in the two slots taken in turn, further when a small unit
with a slot of its own or a shared first slot comes between); and the units larger than a block
(storage of their own, buffers.py) whose gather is issued when a unit releases its slot, at the
turn they would have in the alternation (``early``: two turns before them, small units left out),
so that their gather overlaps the unit before them as a block's does.
"""

from __future__ import annotations

import enum
from collections import Counter

from layershard.engine.units import Unit


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Order:
    def __init__(self, units: list[Unit]) -> None:
        self.units = units
        fwd, bwd = Phase.FORWARD, Phase.BACKWARD
        self.after: dict[Phase, dict[int, Unit]] = {
            fwd: {id(a): b for a, b in zip(units, units[1:])},
            bwd: {id(b): a for a, b in zip(units, units[1:])},
        }
        self.slot_next: dict[Phase, dict[int, Unit | None]] = {}
        for phase, seq in ((fwd, units[::-1]), (bwd, units)):
            later: dict[int, Unit] = {}  # id(slot) -> its next user after the unit at hand
            nxt: dict[int, Unit | None] = {}
            for u in seq:
                nxt[id(u)] = later.get(id(u.slot))
                if phase is fwd or u.gather_in_backward:
                    later[id(u.slot)] = u
            self.slot_next[phase] = nxt
        users = Counter(id(u.slot) for u in units)
        self.early: dict[Phase, dict[int, list[Unit]]] = {}
        for phase, seq in ((fwd, units), (bwd, units[::-1])):
            turns = [
                u
                for u in seq
                if (u.slot.transient or users[id(u.slot)] > 1)
                and (phase is fwd or u.gather_in_backward)
            ]
            early: dict[int, list[Unit]] = {}
            for k, u in enumerate(turns):
                if u.slot.transient and k >= 2:
                    early.setdefault(id(turns[k - 2]), []).append(u)
            self.early[phase] = early

    @property
    def last(self) -> Unit:
        return self.units[-1]
