"""The reduce half of the schedule: a unit's gradients, at the end of its backward, into this
rank's fp32 gradient slice.

Per unit and use: the gradients are copied (cast to the reduce dtype) into one of two gradient
slots taken in turn, reduce-scattered over the shard group (then all-reduced over the replicas),
and this rank's chunk is scaled by 1/N and written (the first reduction of a step) or added
(later ones) into the fp32 slice; under CPU offload the chunk travels to host memory first.
Gradients that must not be reduced yet (``no_sync``; a unit the ranks reduce at the end of
backward, see ``Schedule.plan_backward``) are added into an unsharded fp32 accumulator, reduced
later in one cast.

Note: reduction order. A unit used twice before one backward is reduced twice; its second
reduction waits for its first, whose post (overwrite the slice) must run before the second's
(add), since on gloo a reduction's post runs at its wait, in any slot order.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch

from layershard.engine.buffers import GradSlot
from layershard.engine.collectives import Comm, Pending
from layershard.engine.flat import FlatParam
from layershard.engine.units import Unit


def reduce_factors(dtype: torch.dtype, world_size: int) -> tuple[float, float]:
    """``(pre, post)``: the reduce-scatter sums ``pre * grad`` in ``dtype``; the fp32 gradient
    slice gets ``post * sum``; ``pre * post = 1 / N``. fp16 sums overflow at 65504, and under a
    loss scaler gradients are large, so fp16 divides by sqrt(N) before and after (as FSDP2 does);
    bf16 and fp32 have fp32's range and divide once, after, in fp32."""
    if dtype == torch.float16 and world_size > 1:
        pre = 1.0 / math.sqrt(world_size)
        return pre, 1.0 / (world_size * pre)
    return 1.0, 1.0 / world_size


def scale_into(grad: torch.Tensor, chunk: torch.Tensor, factor: float, fresh: bool) -> None:
    """``grad (fp32) = [grad +] factor * chunk``, computed in fp32 whatever ``chunk``'s dtype
    (``torch.mul(bf16, s, out=fp32)`` would multiply in bf16 and round before the cast)."""
    if not fresh:
        grad.add_(chunk, alpha=factor)  # fp32 self: computed in fp32
    elif chunk.dtype == grad.dtype:
        torch.mul(chunk, factor, out=grad)
    else:
        grad.copy_(chunk)
        grad.mul_(factor)


class Reducer:
    def __init__(
        self, grad_slots: list[GradSlot], comm: Comm, offload: bool, own: GradSlot | None = None
    ) -> None:
        self.grad_slots, self.comm = grad_slots, comm
        # the gradient buffer of units larger than the slots (transient; see buffers.py)
        self.own = own
        self.slot_numel = grad_slots[0].numel if grad_slots else 0
        self.offload = offload  # gradient slices live in CPU memory
        # gradients are averaged over every data-parallel rank: the shard group and its replicas
        self.data_parallel = comm.world_size * comm.sharding.replicas
        self._n_reduced = 0  # reductions issued this backward: picks the next gradient slot
        self._reduced: dict[int, Pending] = {}  # id(flat) -> its last reduction this backward
        # units after which (in backward order) no reduction takes a gradient slot: see tail
        self.tail: set[int] = set()

    def plan_tail(self, backward_order: list[Unit], last: Unit | None) -> None:
        """``tail``: the units whose backward begins after the last reduction into the shared
        gradient slots was issued (an embedding larger than a block, last in backward). At their
        backward's start the slots are given back (``release_slots``) instead of at the end of
        backward: with the loss outside the model, an embedding's gradient and its reduce
        scratch come on top of whatever is still held then (issue 34: 108 MiB of block slots
        beside a 48 MiB embedding gradient and its scratch made layershard's peak 1.11x
        FSDP2's). ``last`` (the root unit, reduced last) is a shared-slot user when small."""
        self.tail = set()
        users = backward_order + ([last] if last is not None else [])
        for u in reversed(users):
            if any(f.padded_numel <= self.slot_numel for f in u.trainables):
                break
            self.tail.add(id(u))

    def release_own(self, wait: bool = False) -> None:
        """Give back the large units' gradient buffer if its reduction is over (``wait``: once
        it is)."""
        if self.own is not None and (wait or self.own.finished()):
            self.own.release()

    def release_slots(self) -> None:
        """Wait for the shared gradient slots' reductions and free them (see ``plan_tail``); a
        later reduction into them would allocate them again."""
        for gs in self.grad_slots:
            gs.release()

    def reduce(self, u: Unit, grads: tuple, later: bool) -> None:
        """``u``'s backward ended with ``grads`` (one per parameter, None where it got none):
        reduce them now, or (``later``: ``no_sync``, or a unit this backward reduces at its end)
        add them to the fp32 accumulator."""
        for f, fgrads in u.trainable_grads(grads):
            pairs = [  # (flat offset, numel, gradient) of the flat's slots
                (s.offset, s.numel, g.reshape(-1)) for s, g in zip(f.slots, fgrads) if g is not None
            ]
            if later or f.acc_dirty:
                acc = self._accumulator(f)
                if pairs:
                    torch._foreach_add_(
                        [acc[o : o + n] for o, n, _ in pairs], [g for *_, g in pairs]
                    )
                f.acc_dirty = True
                if later:
                    continue
                pairs = []  # the accumulator holds them (and what no_sync backwards left)
            self._reduce_now(u, f, pairs)

    def reduce_accumulated(self, u: Unit) -> None:
        """End of backward: reduce what ``u``'s accumulators hold (zeros on a rank whose
        backward did not reach it; every rank calls it, in the same unit order)."""
        for f in u.trainables:
            self._reduce_now(u, f, [])

    def _reduce_now(
        self, u: Unit, f: FlatParam, pairs: list[tuple[int, int, torch.Tensor]]
    ) -> None:
        """Reduce ``pairs`` (gradients of ``u``'s flat ``f``), or the accumulator when it holds
        something."""
        earlier = self._reduced.get(id(f))
        if earlier is not None:  # f's second use: its gradient is added, after the first's
            earlier.wait()
        if self.own is not None and self.own.finished():  # a large unit's reduction is over:
            self.own.release()  # free its buffer (a large unit next waits for it in acquire)
        if f.padded_numel > self.slot_numel:
            assert self.own is not None, f"{u.name}: no gradient buffer is large enough"
            gs = self.own
        else:
            gs = self.grad_slots[self._n_reduced % len(self.grad_slots)]
            self._n_reduced += 1
        pre, post_factor = reduce_factors(gs.dtype, self.data_parallel)
        whole = self._whole_gradient(f, pairs, gs, pre)
        if whole is not None:  # reduced as autograd made it: no copy, no buffer
            buf = gs.lend(whole)
        else:
            buf = self._fill(gs, f, pairs)
            if pre != 1.0:
                buf.mul_(pre)
        fresh = _attach_grads(f)
        grad = f.grad
        assert grad is not None
        post: Callable[[torch.Tensor], object]
        host_post: Callable[[], object] | None = None
        if self.offload:  # the chunk travels to host memory; the CPU adds it into the slice
            staging = gs.get_staging()[: f.shard_numel]
            post = partial(staging.copy_, non_blocking=True)
            host_post = partial(scale_into, grad, staging, post_factor, fresh)
        else:
            post = lambda chunk: scale_into(grad, chunk, post_factor, fresh)  # noqa: E731
        need = self.comm.scratch_numel(f.padded_numel, f.shard_numel, f.over, buf.dtype)
        scratch = gs.get_scratch(need) if need else None
        pending = self.comm.reduce_scatter(
            buf, scratch, "backward", u.name, post, host_post, over=f.over
        )
        gs.reducing(pending)
        self._reduced[id(f)] = pending

    def _whole_gradient(
        self, f: FlatParam, pairs: list[tuple[int, int, torch.Tensor]], gs: GradSlot, pre: float
    ) -> torch.Tensor | None:
        """Autograd's gradient when it is ``f``'s whole flat buffer as the reduction wants it
        (one parameter, no padding, fp32 as the reduce dtype (gloo sums 16-bit dtypes into the
        buffer), nothing accumulated, no pre-scaling, a collective that only reads it): reduced
        without a copy (buffers.py, "units larger than a block")."""
        if f.gaps or len(f.slots) != 1 or len(pairs) != 1 or f.acc_dirty or pre != 1.0:
            return None
        g = pairs[0][2]
        same = g.dtype == gs.dtype == torch.float32 and g.device == gs.device
        same = same and g.is_contiguous()
        return g if same and self.comm.communicates(f.over) else None

    def _fill(
        self, gs: GradSlot, f: FlatParam, pairs: list[tuple[int, int, torch.Tensor]]
    ) -> torch.Tensor:
        """``f``'s gradients (or its fp32 accumulator) cast into ``gs``'s buffer."""
        buf = gs.acquire(f.padded_numel)
        if f.acc is not None and f.acc_dirty:
            buf.copy_(f.acc)  # one cast of the fp32 sum
            f.acc.zero_()
            f.acc_dirty = False
            return buf
        covered = {o for o, _, _ in pairs}
        for s in f.slots:  # parameters without a gradient this step
            if s.offset not in covered:
                buf[s.offset : s.offset + s.numel].zero_()
        if pairs:
            torch._foreach_copy_([buf[o : o + n] for o, n, _ in pairs], [g for *_, g in pairs])
        for a, b in f.gaps:
            buf[a:b].zero_()
        return buf

    @property
    def all_slots(self) -> list[GradSlot]:
        return self.grad_slots + ([self.own] if self.own is not None else [])

    def quiesce(self) -> None:
        for gs in self.all_slots:
            gs.wait()

    def finish(self) -> None:
        """Wait for every reduction, then free the gradient slots until the next backward."""
        self.comm.finish()
        for gs in self.all_slots:
            gs.release()
        self._n_reduced = 0
        self._reduced.clear()

    def _accumulator(self, f: FlatParam) -> torch.Tensor:
        if f.acc is None:  # beside the gradients it sums (the device, also under CPU offload)
            f.acc = torch.zeros(f.padded_numel, dtype=torch.float32, device=self.comm.device)
        return f.acc


def _attach_grads(f: FlatParam) -> bool:
    """Point every slice's ``.grad`` at the flat gradient; return True when all were None
    (after ``zero_grad(set_to_none=True)``: the reduction overwrites). Slices whose ``.grad``
    alone was None start again from zero."""
    missing = [i for i, p in enumerate(f.shard_params) if p.grad is None]
    fresh = len(missing) == len(f.shard_params)
    f.ensure_grad()
    for i in missing:
        g = f.grad_view(i)
        if not fresh:
            g.zero_()
        f.shard_params[i].grad = g
    return fresh
