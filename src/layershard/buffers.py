"""The preallocated buffers units take turns in: sized once at ``shard()``, never freed.

Note: buffer ownership. Units are assigned a gather slot once, alternating (unit i uses slot
i % 2), so that unit i+1 can be gathered while unit i computes; all units share one gradient slot.
A gather slot holds one unit's weights at a time: ``owner`` is the unit whose weights are in it (or on their way:
``pending``), ``busy`` says the owner is computing with them. A gather into a slot is issued only
when its previous owner is no longer busy; a prefetch that finds the slot busy is ``deferred`` and
issued when the owner releases it. Autograd saves views of a slot (the weights a matmul needs in
backward); those views are valid again once their unit is re-gathered into the same slot before its
backward, which is why a unit's slot never changes. The views come from ``alias`` (``.data`` of the
buffer): it has its own version counter, so refilling the buffer does not trip autograd's checks.

A gradient slot holds one unit's unsharded gradients (cast to the reduce dtype) from the end of
the unit's backward until its reduce-scatter has read them; ``pending`` is that reduce-scatter,
which leaves this rank's chunk of the sum in ``scratch`` (or, on gloo, in the buffer itself) and
then adds it into the fp32 gradient slices.
"""

from __future__ import annotations

import torch

from layershard.collectives import Pending


class GatherSlot:
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self.alias = self.data.data
        self.owner = None  # a schedule.Unit
        self.pending: list[Pending] = []
        self.busy = False
        self.deferred = None

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []

    def reset(self) -> None:
        self.wait()
        self.owner, self.busy, self.deferred = None, False, None


class GradSlot:
    def __init__(self, numel: int, shard_numel: int, dtype: torch.dtype, device: torch.device):
        self.data = torch.empty(numel, dtype=dtype, device=device)
        self._scratch_spec = (shard_numel, dtype, device)
        # The reduce-scatter output, allocated on first use: gloo reduces in place and needs none.
        self.scratch: torch.Tensor | None = None
        self.pending: list[Pending] = []

    def get_scratch(self) -> torch.Tensor:
        if self.scratch is None:
            n, dtype, device = self._scratch_spec
            self.scratch = torch.empty(n, dtype=dtype, device=device)
        return self.scratch

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s storage actually allocated (a released gradient counts 0)."""
    return 0 if t is None else t.untyped_storage().nbytes()
