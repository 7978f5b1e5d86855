"""One backward pass: the plan the ranks agreed on for it, the units gathered for it alone, the
reductions deferred to its end, and the uses whose backward has begun.

Note: one owner per backward. Everything that lives for one backward lives in its
``BackwardPass``, made when the backward's first hook fires (``Schedule.backward_pass``) and
dropped at its end (``Schedule.end_backward``, autograd's final callback). A backward that raises
(a user's hook, an out-of-memory, an anomaly check) runs no final callback: its pass is then
dropped by the next forward or by any writer of shards (``Schedule.quiesce``), which first waits
for what the pass has in flight. Nothing of it reaches the next step: not the buffer a unit was
gathered into for it alone (the next forward would compute with the weights of before a load),
not the gradients it added to the accumulators (the step it belonged to is void: the caller
zeroes the gradients and redoes it), not its record of which uses began.

Note: every rank issues the same collectives in the same order. A unit's backward gather and
reduction are collectives, issued from its backward's hooks, which run on the ranks whose loss
depends on the unit: not always every rank (an auxiliary head in one rank's loss). So when a
backward that communicates begins, the ranks agree, with one small all-reduce (three int64 per
unit, once per backward whatever the number of units), on how many uses of each unit every rank's
backward will reach (autograd knows which nodes the pass in progress will execute). Units reached
as often everywhere are gathered and reduced by their hooks, as always. For the others
("divergent"), every rank gathers the weights at once, in unit order, into a buffer of their own
(the unpack hook points the weights their forward saved at it), their hooks issue no collective
and touch no slot, and their gradients accumulate and are reduced at the end of backward, in unit
order, with zeros from the ranks that did not reach them. Gradients a ``no_sync`` backward left in
the accumulator of a unit this backward does not reach go the same way. So every collective is
issued by an event every rank sees, or at the start or the end of backward. The precondition: every
rank's backward reaches at least one unit (a rank whose loss does not depend on the model at all
never joins the agreement, and the others wait for it until the timeout, which names the
agreement).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layershard.engine.backward_hooks import Use
from layershard.engine.collectives import Comm, Pending
from layershard.engine.units import Unit
from layershard.engine.waits import waiting


@dataclass
class PrivateGather:
    """A divergent unit's weights, gathered for this backward into a buffer of its own (laid out
    as in its slot), and the views its parameters are bound to."""

    buffer: torch.Tensor
    pending: list[Pending]
    views: list[torch.Tensor]

    def wait(self) -> None:
        for p in self.pending:
            p.wait()


class BackwardPass:
    """The state of one backward (see the note above)."""

    def __init__(
        self,
        deferred: list[Unit] | None = None,
        private: dict[int, PrivateGather] | None = None,
        unreached: set[int] | None = None,
    ) -> None:
        self.deferred = deferred or []  # reduced at the end, in this order (every rank)
        self._deferred_ids = {id(u) for u in self.deferred}
        self.private = private or {}  # id(unit) -> its own buffer (divergent units)
        self.unreached = unreached or set()  # ids of units no rank's backward reaches
        self.began_uses: set[int] = set()  # uses whose backward began
        self.began_units: set[int] = set()  # ids of units with a use whose backward began

    def begin(self, u: Unit, use: int | None) -> bool:
        """``u``'s ``use`` begins its backward; False when it already had in this pass (``use``
        None: a checkpoint's recompute, part of a use whose backward began)."""
        if self.began(u, use):
            return False
        if use is not None:
            self.began_uses.add(use)
        self.began_units.add(id(u))
        return True

    def began(self, u: Unit, use: int | None) -> bool:
        if use is not None:
            return use in self.began_uses
        return id(u) in self.began_units

    def defers(self, u: Unit) -> bool:
        """Are ``u``'s gradients reduced at the end of this backward (not by its hook)?"""
        return id(u) in self._deferred_ids

    def takes_slot(self, u: Unit) -> bool:
        """Does ``u``'s backward take its gather slot? (Not an embedding, nor a divergent or
        unreached unit.)"""
        return u.gather_in_backward and id(u) not in self.private and id(u) not in self.unreached

    def finish(self, reduce_accumulated) -> None:
        """End of backward: reduce the deferred units (every rank, in unit order), and wait for
        the private gathers (a unit no hook of this rank needed is still in flight)."""
        for u in self.deferred:
            reduce_accumulated(u)
        self.abandon()

    def abandon(self) -> None:
        """Wait for what this pass has in flight (issued on every rank), reduce nothing more."""
        for g in self.private.values():
            g.wait()
        self.private = {}


def plan_backward(
    units: Iterable[Unit],
    uses: Iterable[Use],
    comm: Comm,
    no_sync: bool,
    root: Unit | None,
) -> BackwardPass:
    """The plan of the backward that begins (see the note above): one all-reduce of three flags
    per unit (how many of its uses this rank reaches, the negation of that, and whether its
    accumulator holds gradients), then the divergent units' private gathers."""
    gathers = comm.sharding.gathers_in_backward
    if no_sync and not gathers:  # no collective in this backward
        return BackwardPass()
    planned = [
        u for u in units if u.trainables or (u.gather_in_backward and gathers and u is not root)
    ]
    reached = dict.fromkeys((id(u) for u in planned), 0)
    for record in uses:
        if id(record.unit) in reached and record.reached():
            reached[id(record.unit)] += 1
    flags = torch.tensor(
        [[reached[id(u)], -reached[id(u)], int(u.acc_dirty)] for u in planned], dtype=torch.int64
    ).reshape(-1, 3)
    if comm.control_size > 1 and planned:
        comm.stats.record("all_reduce", "backward", flags.numel() * 8, "all")
        with waiting("agreement on the units this backward reaches"):
            dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=comm.control)
    deferred, private, unreached = [], {}, set()
    for u, (most, least, dirty) in zip(planned, flags.tolist()):
        divergent = most != -least
        if u.trainables and not no_sync and (divergent or (most == 0 and dirty)):
            deferred.append(u)
        if divergent and u.gather_in_backward and gathers and u is not root:
            private[id(u)] = gather_private(u, comm)
        if most == 0:  # no rank's backward reaches it: nothing to prefetch for it
            unreached.add(id(u))
    return BackwardPass(deferred, private, unreached)


def gather_private(u: Unit, comm: Comm) -> PrivateGather:
    """All-gather ``u``'s weights for its backward into a buffer of its own (every rank)."""
    if any(f.packed for f in u.flats):  # decided by an all-reduce: raises on every rank
        raise RuntimeError(
            f"layershard: unit {u.name} holds 4-bit weights and only some ranks' backward "
            "reaches it; its 4-bit matmuls read their weights from the unit's gather slot in "
            "backward (four_bit.py), which a private gather does not fill. Make every rank's "
            "loss depend on it"
        )
    buf = torch.empty(u.gather_numel, dtype=u.slot.dtype, device=u.slot.device)
    pending = []
    over = comm.sharding.backward_gather_group
    for i, (f, off) in enumerate(zip(u.flats, u.flat_offsets)):
        out = buf[off : off + f.padded_numel]
        if u.secondary is not None:
            pending.append(comm.all_gather(out, u.secondary[i], "backward", u.name, over=over))
        else:  # as its forward gathered it (quantized when weights travel so)
            pending.append(comm.gather_weights(out, f, "backward", u.name))
    views = [
        v
        for f, o in zip(u.flats, u.flat_offsets)
        for v in f.views(buf.data[o : o + f.padded_numel])
    ]
    return PrivateGather(buf, pending, views)
