"""The buffers units take turns in: gather slots (preallocated at ``shard()``, never freed) and
gradient slots (held during backward only).

Note: buffer ownership. Units are assigned a gather slot once, alternating (unit i uses slot
i % 2), so that unit i+1 can be gathered while unit i computes. A gather slot holds one unit's
weights at a time: ``owner`` is the unit whose weights are in it (or on their way: ``pending``),
``busy`` says the owner is computing with them. A gather into a slot is issued only when its
previous owner is no longer busy; a prefetch that finds the slot busy is ``deferred`` and issued
when the owner releases it. Autograd saves views of a slot (the weights a matmul needs in
backward); those views are valid again once their unit is re-gathered into the same slot before
its backward, which is why a unit's slot never changes. The views come from ``alias`` (``.data``
of the buffer): it has its own version counter, so refilling the buffer does not trip autograd's
checks.

A gradient slot holds one unit's unsharded gradients (cast to the reduce dtype) from the end of
the unit's backward until its reduce-scatter has read them; ``pending`` is that reduce-scatter,
which leaves this rank's chunk of the sum in a ``ReduceScratch`` (on gloo, in the buffer itself)
and then adds it into the fp32 gradient slices. The two gradient slots are taken in turn, in the
order units finish their backward, so a reduce-scatter has the next unit's whole backward to
finish before its slot is needed again (with one slot, a small unit after a large one, as the
final norm after the head, waits for the head's reduce-scatter). Gradient slots exist only during
backward: allocated at their first use in a backward (grown if a later unit is larger, as a tied
embedding reduced last is) and freed at its end, after every reduce-scatter has been waited for.
So they add nothing to the forward's peak, which the loss's logits set, and a large unit reduced
last takes its room when the activations are gone. On CUDA the free comes after the compute
stream has waited for the reduce-scatters' events: the caching allocator may then hand the memory
to the compute stream without ``record_stream``.
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
    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device  # numel: the largest unit's
        self.data: torch.Tensor | None = None  # exists only during backward (see the note)
        self.pending: list[Pending] = []

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []

    def acquire(self, numel: int) -> torch.Tensor:
        """``numel`` elements of the buffer, free (its previous reduce-scatter has read them)."""
        self.wait()
        if self.data is None or self.data.numel() < numel:
            self.data = None  # grow: a unit larger than any before it in this backward
            self.data = torch.empty(numel, dtype=self.dtype, device=self.device)
        return self.data[:numel]

    def release(self) -> None:
        self.wait()
        self.data = None

    @property
    def capacity(self) -> int:
        """Bytes the slot can take during a backward (sized for the largest unit)."""
        return self.numel * self.dtype.itemsize


class ReduceScratch:
    """This rank's chunk of a reduce-scatter's sum, before it is added into the gradient slice.
    Allocated on first use (gloo reduces in place and needs none) and shared by the gradient
    slots: on CUDA every reduce-scatter and the add that reads its chunk are queued on the one comm
    stream, so one reduce-scatter's output is read before the next one writes it."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device):
        self.numel, self.dtype, self.device = numel, dtype, device
        self.data: torch.Tensor | None = None

    def get(self) -> torch.Tensor:
        if self.data is None:
            self.data = torch.empty(self.numel, dtype=self.dtype, device=self.device)
        return self.data


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s storage actually allocated (a released gradient counts 0)."""
    return 0 if t is None else t.untyped_storage().nbytes()
