"""The buffers units take turns in: gather slots (preallocated at ``shard()``; the two in turns
give their bytes back between forward and backward) and gradient slots (held during backward
only).

Note: buffer ownership. Units are assigned a gather slot once (``gather_slots.assign_gather_slots``), taking
two slots in turn so that one unit can be gathered while the other computes. A small unit (a final
norm: at most 1/64 of the largest) gets a slot of its own instead: in the alternation it would sit
between two large units (last block, head) with almost no compute to hide the head's gather behind,
and would push the last block out of its slot before backward. Out of the alternation, the head's
gather overlaps the last block and the last block stays gathered into backward. A gather slot holds one unit's
weights at a time: ``owner`` is the unit whose weights are in it (or on their way: ``pending``),
``busy`` says the owner is computing with them. A gather into a slot is issued only when its
owner is no longer busy (``take`` raises otherwise: that would overwrite weights in use); a
prefetch that finds the slot busy is ``deferred`` and issued when the owner releases it.
Autograd saves views of a slot (the weights a matmul needs in backward); those views are valid
again once their unit is re-gathered into the same slot before its backward, which is why a
unit's slot never changes. The views come from ``alias`` (``.data`` of the buffer): it has its own
version counter, so refilling the buffer does not trip autograd's checks.

A gradient slot holds one unit's unsharded gradients (cast to the reduce dtype) from the end of
the unit's backward until its reduce-scatter has read them; ``pending`` is that reduce-scatter,
which leaves this rank's chunk of the sum in the slot's own ``scratch`` (on gloo, the scratch
receives every rank's chunk and their sum goes into the buffer's own chunk) and then adds it into
the fp32 gradient slices. Each slot has its own scratch: a
reduce-scatter completes (and its chunk is read) only when its slot is waited for, which can be
after the other slot's reduce-scatter has started. The two gradient slots are taken in turn, in
the order units finish their backward, so a reduce-scatter has the next unit's whole backward to
finish before its slot is needed again. Gradient slots exist only during backward: allocated at
their first use in a backward (grown if a later unit is larger, as a tied embedding reduced last
is) and freed at its end, after every reduce-scatter has been waited for. So they add nothing to
the forward's peak, which the loss's logits set. On CUDA the free comes after the compute stream
has waited for the reduce-scatters' events: the caching allocator may then hand the memory to the
compute stream without ``record_stream``.

Note: units larger than a block. The shared slots (gather and gradient) are sized for the largest
block (``gather_slots.slot_limit``), never for a larger unit: with a large vocabulary the
embedding and the LM head are each several blocks (Llama 3 8B: 525M elements against 218M), and
sizing every slot for them would hold head-sized buffers for the whole step (gather) or the
whole backward (gradients). Such a unit takes storage of its own instead, a transient
``GatherSlot``: taken when its gather is issued, at its turn (when the unit two turns before
it releases its slot, so the gather overlaps the unit before it, as a block's does); given back
when it releases the slot after its forward; gathered again for its backward (its first op waits
for that gather: nothing comes before it in the backward to overlap with, as under FSDP2) and
given back after it. An embedding is not gathered again (its backward needs no weights). So at
the plain loss, where the logits make the forward's peak, no large unit's weights exist; the
chunked loss runs inside the head's call and holds them. Its gradients go through a transient
``GradSlot`` of their own size with its own reduce scratch, or, when autograd's gradient is the
unit's whole flat buffer in an fp32 reduce dtype (one parameter, no padding: an embedding, a head
in fp32), are reduce-scattered from that gradient itself, which the reduction only reads. The slot
is given back at the first reduction after its reduce-scatter finished, or when the next large
unit needs it (which waits), or at the end of backward; the weights are released before the
gradients are reduced. One all-gather per unit and use, one reduce-scatter per unit and use, on
the same bytes as through a shared slot: results are bitwise the same. The price: the head's
gather for its backward (kept weights would cost a head-sized buffer at the loss).
``memory_report()`` counts the largest such storage as ``large_gather`` and ``large_grad``; one
large unit holds it at a time as long as large units are not neighbours in forward order
(embedding first, head last).

Note: spare storage. What large units give back goes to one ``Spare`` block of bytes, which the
next large unit's weights, gradient buffer or scratch take instead of allocating (the embedding's
storage becomes the head's in forward; the head's weights become its reduce scratch in backward).
It holds at most one block, never larger than the largest large role, which a role takes only
if it needs more than half of it and otherwise lets go before allocating; it is emptied when the
forward's last unit is done (nothing of it is alive at the loss, which a causal LM computes
inside its forward) and at the end of backward, so the memory model is unchanged. Without it
each large unit and use allocated anew, and on CPU every freed large tensor goes back to the OS
and faults again on first touch (about 40 ms for 96 MiB on this project's 2-core machine); the
CUDA caching allocator would serve them from its cache.

Note: between the passes. Where the forward's peak is, at the loss, the next thing to compute is
the backward of the last unit of the forward (the LM head): its weights are needed, nobody
else's. So at the last unit's post-forward (a forward that records a graph, under a strategy
that gathers again in backward) the two slots in turns give their storage back (``vacate``:
the last block, say, is gathered again for its backward, overlapping the head's backward, as
under FSDP2, or, after a head larger than a block, its reduce-scatter: schedule.py), except the
last unit's own slot, which keeps only its weights (``trim``: a head smaller than a block holds a
head's bytes, not a block's). The next gather into either slot regrows it
(``take``), without copying. So at the plain loss the gather buffers hold the head's weights at
most, which is what FSDP2 keeps there (its root and tail stay gathered), instead of two blocks
(the chunked loss runs inside the head's call, before this). The
price: one more all-gather per step (two with a large head, which is gathered again anyway) and
two allocations per step, which the CUDA caching allocator serves from its cache. Slots of
their own (small units; every unit under ``grad_op``/``no_shard``) keep their weights.
"""

from __future__ import annotations

import enum
from typing import Protocol

import torch

from layershard.engine.collectives import Pending


class SlotUser(Protocol):
    """What a slot knows of the unit that owns it (units.py imports this module, not back)."""

    name: str


class SlotState(enum.Enum):
    """A gather slot's life. Transitions are the methods of ``GatherSlot``, nothing else:

    FREE --take--> GATHERING --wait--> READY --occupy--> BUSY --release--> READY --take--> ...
    any --reset--> FREE (a new forward); BUSY --hand_over--> READY (see ``hand_over``)
    READY or FREE --vacate--> FREE, its storage given back (between the passes, ``vacate``)
    """

    FREE = "free"  # no owner
    GATHERING = "gathering"  # the owner's gather is in flight into it
    READY = "ready"  # the owner's weights are in it; nobody computes with them
    BUSY = "busy"  # the owner computes with them: no gather may be issued into it


class Spare:
    """At most one block of bytes large units gave back, for the next to take (see the note
    above, "spare storage")."""

    def __init__(self) -> None:
        self.block: torch.Tensor | None = None  # uint8 over the whole storage given back

    def take(self, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """``numel`` elements of ``dtype``: the spare block if it is large enough and less than
        twice that (a shard-sized scratch does not hold a head-sized block), else new."""
        nbytes = numel * dtype.itemsize
        block, self.block = self.block, None  # not taken: let go before allocating
        if block is not None and nbytes <= block.numel() < 2 * nbytes and block.device == device:
            return block[:nbytes].view(dtype)
        del block
        return torch.empty(numel, dtype=dtype, device=device)

    def give(self, t: torch.Tensor | None) -> None:
        """Keep ``t``'s storage (nobody else may use it any more) if it is larger than the
        block held, which is then let go."""
        if t is None:
            return
        storage = t.untyped_storage()
        if self.block is None or storage.nbytes() > self.block.numel():
            self.block = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)

    def clear(self) -> None:
        self.block = None

    @property
    def nbytes(self) -> int:
        return 0 if self.block is None else self.block.numel()


class GatherSlot:
    """One preallocated gather buffer and who owns it (see the note above)."""

    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        data: torch.Tensor | None = None,
        transient: bool = False,
        in_turns: bool = False,
        spare: Spare | None = None,
    ):
        # ``data``: an existing buffer (no_shard in fp32: the unit's flat shards themselves).
        # ``transient``: the storage of one unit larger than a block, allocated when its gather
        # is issued and freed when it releases the slot (see the note above).
        # ``in_turns``: one of the two slots units take in turn, whose storage is given back
        # between forward and backward (see the note above, "between the passes").
        self.numel, self.dtype, self.device, self.transient = numel, dtype, device, transient
        self.in_turns = in_turns and data is None
        self.spare = spare  # transient: where its storage comes from and goes back to
        self.data: torch.Tensor | None = None
        self.alias: torch.Tensor | None = None
        self.generation = 0  # counts allocations: views of an earlier one are stale
        if not transient:
            self._allocate(data)
        self.state = SlotState.FREE
        self.owner: SlotUser | None = None
        self.pending: list[Pending] = []
        self.next: SlotUser | None = None  # a prefetch waiting for the owner to release it

    def _allocate(self, data: torch.Tensor | None = None) -> None:
        if self.data is None:
            if data is None and self.spare is not None:
                data = self.spare.take(self.numel, self.dtype, self.device)
            elif data is None:
                data = torch.empty(self.numel, dtype=self.dtype, device=self.device)
            self.data, self.alias = data, data.data
            self.generation += 1

    def _free(self) -> None:
        """Transient storage only: give it back (nobody computes with it, nothing is in
        flight into it)."""
        if self.transient:
            if self.spare is not None:
                self.spare.give(self.data)
            self.data = self.alias = None

    @property
    def busy(self) -> bool:
        return self.state is SlotState.BUSY

    @property
    def capacity(self) -> int:
        """Bytes the slot holds (transient: while its unit is gathered)."""
        return self.numel * self.dtype.itemsize

    def take(self, u: SlotUser) -> None:
        """Make ``u`` the owner, before its gather is issued into the slot (a gather is issued
        only into a slot nobody computes with)."""
        if self.busy and self.owner is not u:
            assert self.owner is not None
            raise RuntimeError(
                f"layershard: gathering {u.name} into the buffer that {self.owner.name} is still "
                "computing with (an engine bug: please report it with the model's structure)"
            )
        self.wait()
        self._allocate()
        self._regrow()
        self.owner, self.next, self.state = u, None, SlotState.GATHERING

    def gathering(self, p: Pending) -> None:
        """``p`` is a gather into the slot, issued after ``take``."""
        assert self.state is SlotState.GATHERING, self.state
        self.pending.append(p)

    def wait(self) -> None:
        """Block (the compute stream, on CUDA) until the gathers into the slot are done."""
        for p in self.pending:
            p.wait()
        self.pending = []
        if self.state is SlotState.GATHERING:
            self.state = SlotState.READY

    def occupy(self, u: SlotUser) -> None:
        """``u``, the owner, computes with the weights: wait for them, then hold the slot."""
        assert self.owner is u, (
            f"{u.name} occupies a slot that {getattr(self.owner, 'name', None)} owns"
        )
        self.wait()
        self.state = SlotState.BUSY

    def release(self, u: SlotUser) -> SlotUser | None:
        """``u`` is done computing; returns the unit whose prefetch waited for the slot."""
        if self.owner is u and self.busy:
            self.state = SlotState.READY
            if self.transient:  # resharded: gathered again for the unit's backward
                self.reset()
        if self.busy or self.next is None:
            return None
        waiting, self.next = self.next, None
        return waiting

    def defer(self, u: SlotUser) -> None:
        """Gather ``u`` into the slot when its owner releases it."""
        self.next = u

    def hand_over(self) -> None:
        """The owner's backward is over although it never released the slot: a unit without
        trainable weights has no post-backward (see Schedule.ensure)."""
        if self.busy:
            self.state = SlotState.READY

    def settle(self) -> None:
        """End of backward: nothing computes or waits any more; the weights stay."""
        self.wait()
        self.hand_over()
        self.next = None
        if self.transient:
            self.reset()

    def reset(self) -> None:
        """A new forward: the slot holds nobody's weights that anyone may rely on."""
        self.wait()
        self.owner, self.next, self.state = None, None, SlotState.FREE
        self._free()

    def vacate(self) -> None:
        """Between the passes: give the storage back and forget the owner, whose backward
        gathers it again (a slot in turns only, when nobody computes with it, nothing is in
        flight into it and no prefetch waits for it)."""
        if self.in_turns and not self.busy and not self.pending and self.next is None:
            self.owner, self.state = None, SlotState.FREE
            self._resize(0)

    def trim(self, numel: int) -> None:
        """Between the passes: keep only the owner's weights, the first ``numel`` elements (its
        views stay valid: they are views of this same storage)."""
        if self.in_turns and not self.busy and not self.pending:
            self._resize(numel * self.dtype.itemsize)

    def _regrow(self) -> None:
        """Before a gather: the whole storage again (nothing in it is kept: no copy)."""
        if self.in_turns and self.alias is not None:
            if self.alias.untyped_storage().nbytes() < self.capacity:
                self._resize(0)
                self._resize(self.capacity)

    def _resize(self, nbytes: int) -> None:
        # Note: resizing the storage keeps every tensor over it (``data``, ``alias``, the units'
        # bound views, what autograd saved) pointing at it; only the bytes come and go, as
        # FSDP's own resharding does. CPU and CUDA resize copy the kept prefix on the current
        # stream; on CUDA nothing is in flight on the comm stream into a slot given back or
        # trimmed (no pending gather), and a regrown slot's gather waits for the compute stream.
        assert self.alias is not None
        self.alias.untyped_storage().resize_(nbytes)


class GradSlot:
    def __init__(
        self,
        numel: int,
        dtype: torch.dtype,
        device: torch.device,
        shard_numel: int,
        scratch_numel: int,
        host: torch.device | None = None,
        transient: bool = False,
        spare: Spare | None = None,
    ):
        # numel: the largest unit's that uses the slot. ``transient``: the gradient buffer of
        # units larger than a block, allocated at each one's size and freed at the next
        # reduction (see the note above).
        self.numel, self.dtype, self.device = numel, dtype, device
        self.transient = transient
        self.shard_numel = shard_numel  # the largest unit's shard (host staging)
        self.scratch_numel = scratch_numel  # see Comm.scratch_numel (0: none)
        self.data: torch.Tensor | None = None  # exists only during backward (see the note)
        self.scratch: torch.Tensor | None = None
        self.host = host  # CPU offload: reduced chunks are staged in (pinned) host memory
        self.staging: torch.Tensor | None = None
        self.pending: list[Pending] = []
        self.spare = spare  # transient: where its buffers come from and go back to
        self.lent: torch.Tensor | None = None  # autograd's gradient, reduced without a copy

    def reducing(self, p: Pending) -> None:
        """``p`` is a reduce-scatter reading the slot's buffer (or the gradient it lent)."""
        self.pending.append(p)

    def wait(self) -> None:
        for p in self.pending:
            p.wait()
        self.pending = []
        self.lent = None

    def finished(self) -> bool:
        """Its reduce-scatters are over (``wait`` would not block)."""
        return all(p.finished() for p in self.pending)

    def acquire(self, numel: int) -> torch.Tensor:
        """``numel`` elements of the buffer, free (its previous reduce-scatter has read them)."""
        self.wait()
        if self.data is None or self.data.numel() < numel:
            self._give(self.data)  # grow: a unit larger than any before it in this backward
            self.data = self._new(numel)
        return self.data[:numel]

    def lend(self, grad: torch.Tensor) -> torch.Tensor:
        """Reduce ``grad`` itself (autograd's, the unit's whole flat buffer): the slot waits
        for its previous reduce-scatter and keeps ``grad`` alive until this one is done."""
        self.wait()
        self.lent = grad
        return grad

    def _new(self, numel: int) -> torch.Tensor:
        if self.spare is not None:
            return self.spare.take(numel, self.dtype, self.device)
        return torch.empty(numel, dtype=self.dtype, device=self.device)

    def _give(self, t: torch.Tensor | None) -> None:
        if self.spare is not None:
            self.spare.give(t)

    def get_scratch(self, numel: int) -> torch.Tensor:
        """The reduce-scatter's scratch, ``numel`` elements of it: allocated at that size and
        grown when a larger unit's reduction takes the slot, as the buffer is (``acquire``).
        Sized for the slot's largest unit at once, the final norm's reduction (first in
        backward, a few KiB of gradient) allocated a block-sized scratch on top of the head's
        reduce-scatter buffers: the EP bench's peak (issue 32); and a slot that only dense
        flats take (the units' experts go to the other) held an experts-sized one."""
        if self.scratch is None or self.scratch.numel() < numel:
            self._give(self.scratch)  # grow: taken by a larger unit
            self.scratch = None  # let go before allocating
            self.scratch = self._new(numel)
        return self.scratch[:numel]

    def get_staging(self) -> torch.Tensor:
        """Host memory for one reduced chunk (CPU offload), kept: pinning is slow."""
        if self.staging is None:
            pin = self.device.type == "cuda"
            self.staging = torch.empty(
                self.shard_numel, dtype=self.dtype, device=self.host, pin_memory=pin
            )
        return self.staging

    def release(self) -> None:
        self.wait()
        self._give(self.data)
        self._give(self.scratch)
        self.data = self.scratch = None

    @property
    def capacity(self) -> int:
        """Bytes the slot can take during a backward (sized for the largest unit)."""
        return self.numel * self.dtype.itemsize

    @property
    def scratch_capacity(self) -> int:
        return self.scratch_numel * self.dtype.itemsize


def nbytes(t: torch.Tensor | None) -> int:
    """Bytes of ``t``'s storage actually allocated (a released gradient counts 0)."""
    return 0 if t is None else t.untyped_storage().nbytes()
