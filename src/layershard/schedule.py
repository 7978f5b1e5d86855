"""The hooks that move a unit's weights and gradients around its forward and backward.

One training step, for units 0..n-1 in forward order (slot = i % 2):

    forward   start:   issue AG(0), AG(1)                          (both slots are free)
              pre(i):  wait AG(i); bind weights; issue AG(i+1)     (prefetch before compute)
              post(i): release slot(i)                             (AG(i+2) may now reuse it)
    backward  pre(i):  wait AG(i) (none for the last two: still gathered; none for an
                       embedding, whose backward needs no weights); issue AG(i-1)
              post(i): grads -> grad slot; issue RS(i); release slot(i)
    end of backward:   wait every RS (gradient slices now hold the averaged gradients);
                       free the grad slots

``pre-backward`` is a hook on the unit's output tensors; ``post-backward`` is the backward
of ``_BindUnit``, the autograd Function whose outputs are the unit's weights: autograd calls it
once, with every weight gradient of that unit, after the unit's whole backward. The root unit
(tied and root-owned parameters) is bound at the model's pre-forward and stays gathered until its
backward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch
from torch import nn

from layershard.buffers import GatherSlot, GradSlot, ReduceScratch
from layershard.collectives import Comm
from layershard.flat import FlatParam, ParamSlot
from layershard.precision import MixedPrecision

log = logging.getLogger("layershard")


class Unit:
    """A unit's flat groups (trainable first, then frozen) and its places in the slots."""

    def __init__(
        self,
        name: str,
        module: nn.Module | None,
        is_block: bool,
        flats: list[FlatParam],
        slot: GatherSlot,
        device: torch.device,
        gather_in_backward: bool = True,
    ):
        self.name, self.module, self.is_block = name, module, is_block
        self.flats, self.slot = flats, slot
        self.gather_in_backward = gather_in_backward  # False: an embedding (see units.py)
        self.trainable = next((f for f in flats if f.requires_grad), None)
        self.param_slots: list[ParamSlot] = [s for f in flats for s in f.slots]
        self.flat_offsets, off = [], 0
        for f in flats:
            self.flat_offsets.append(off)
            off += f.padded_numel
        self.gather_numel = off
        # Persistent full-size views of the gathered weights (see buffers.py for why `alias`).
        self.full_views = [
            slot.alias[o + s.offset : o + s.offset + s.numel].view(s.shape)
            for f, o in zip(flats, self.flat_offsets)
            for s in f.slots
        ]
        self.anchor = torch.empty(0, device=device, requires_grad=True)

    def __repr__(self) -> str:
        return f"Unit({self.name})"

    def bind(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Make the modules' weight attributes point at ``tensors`` (plain tensors, not Parameters)."""
        for slot, t in zip(self.param_slots, tensors):
            for use in slot.uses:
                use.module.__dict__[use.attr] = t


class _BindUnit(torch.autograd.Function):
    """Forward: the unit's gathered weights as graph tensors. Backward: the unit's post-backward."""

    @staticmethod
    def forward(ctx, schedule: Schedule, unit: Unit, anchor: torch.Tensor, *views):
        ctx.schedule, ctx.unit = schedule, unit
        outs = tuple(v.view_as(v) for v in views)
        frozen = [o for o, s in zip(outs, unit.param_slots) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.schedule.post_backward(ctx.unit, grads)
        return (None, None, None) + (None,) * len(grads)


def _tensors(out) -> Iterator[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)
    elif isinstance(out, dict):
        for o in out.values():
            yield from _tensors(o)
    elif hasattr(out, "__dataclass_fields__"):
        for name in out.__dataclass_fields__:
            yield from _tensors(getattr(out, name, None))


class Schedule:
    def __init__(
        self,
        root: Unit | None,
        units: list[Unit],
        grad_slots: list[GradSlot],
        scratch: ReduceScratch | None,
        comm: Comm,
        precision: MixedPrecision,
    ):
        self.root, self.units, self.comm, self.precision = root, units, comm, precision
        self.grad_slots, self.scratch = grad_slots, scratch
        self._n_reduced = 0  # reduce-scatters issued this backward: picks the next gradient slot
        self.world_size = comm.world_size
        self.order: list[Unit] = list(units)  # forward execution order, learned on first forward
        self._recorded: list[Unit] | None = []
        self._link()
        self.phase = "idle"  # "forward" | "backward" | "idle"
        self.no_sync = False
        self._callback_queued = False
        self._bw_seen: set[int] = set()
        self._lowp: dict[int, tuple[torch.Tensor, int]] = {}  # flat id -> (copy, shard version)

    def _link(self) -> None:
        self._next = {id(a): b for a, b in zip(self.order, self.order[1:])}
        self._prev = {id(b): a for a, b in zip(self.order, self.order[1:])}

    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root else []) + self.units

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> list:
        handles = [model.register_forward_pre_hook(lambda m, a: self.root_pre_forward())]
        for u in self.units:
            handles.append(
                u.module.register_forward_pre_hook(lambda m, a, u=u: self.pre_forward(u))
            )
            handles.append(
                u.module.register_forward_hook(lambda m, a, out, u=u: self.post_forward(u, out))
            )
        return handles

    @staticmethod
    def _in_backward() -> bool:
        """Is autograd executing a backward pass (a forward now is a checkpoint's recompute)?"""
        return torch._C._current_graph_task_id() != -1

    def root_pre_forward(self) -> None:
        if self._in_backward():
            return
        self._learn_order()
        # A new forward: weights may have changed since the last one, and a backward that raised
        # may have left state behind.
        self._free_grad_slots()
        for u in self.all_units():
            u.slot.reset()
            if u.trainable is not None and torch.is_grad_enabled():
                u.trainable.release_grad()
        self.phase, self._callback_queued = "forward", False
        self._bw_seen.clear()
        if self.root is not None:
            self._issue_gather(self.root, "forward")
            self.root.slot.wait()
            self._bind(self.root)
        if self.order:  # both slots are free: start the first two units' gathers
            self.gather(self.order[0], "forward")
            self.prefetch(self.order[0], self._next, "forward")

    def pre_forward(self, u: Unit) -> None:
        if self._in_backward():  # recompute under (reentrant) activation checkpointing
            self._enter_backward()
            self.ensure(u, "backward")
            self._bind(u)
            return
        if self._recorded is not None:
            self._recorded.append(u)
        self.ensure(u, "forward")
        self._bind(u)
        self.prefetch(u, self._next, "forward")

    def post_forward(self, u: Unit, out):
        if not self._in_backward():
            self.release(u)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u: self.pre_backward(u))
        return None

    def pre_backward(self, u: Unit) -> None:
        self._enter_backward()
        if id(u) in self._bw_seen:
            return
        self._bw_seen.add(id(u))
        if u.gather_in_backward:
            self.ensure(u, "backward")
        self.prefetch(u, self._prev, "backward")

    def post_backward(self, u: Unit, grads: tuple) -> None:
        self._enter_backward()
        self.reduce(u, grads)
        self.release(u)

    def _enter_backward(self) -> None:
        self.phase = "backward"
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        self._free_grad_slots()
        self.phase = "idle"
        self._callback_queued = False
        self._bw_seen.clear()

    # ---- gather ----------------------------------------------------------------------------------

    def _bind(self, u: Unit) -> None:
        if torch.is_grad_enabled() and u.trainable is not None:
            u.bind(_BindUnit.apply(self, u, u.anchor, *u.full_views))
        else:
            u.bind(u.full_views)

    def ensure(self, u: Unit, phase: str) -> None:
        """Block the compute stream until ``u``'s weights are in its slot; mark it busy."""
        s = u.slot
        if s.owner is not u:
            # Execution is sequential, so a previous owner still marked busy has finished.
            self._issue_gather(u, phase)
        s.wait()
        s.busy = True

    def gather(self, u: Unit, phase: str) -> None:
        """Prefetch: start ``u``'s all-gather now if its slot is free, else when it is released."""
        s = u.slot
        if s.owner is u:
            return
        if s.busy:
            s.deferred = u
        else:
            self._issue_gather(u, phase)

    def prefetch(self, u: Unit, step: dict[int, Unit], phase: str) -> None:
        """Gather the unit after ``u`` in execution order (``step``: ``_next`` in forward,
        ``_prev`` in backward), past units that are not gathered for their backward."""
        nxt = step.get(id(u))
        while nxt is not None and phase == "backward" and not nxt.gather_in_backward:
            nxt = step.get(id(nxt))
        if nxt is not None:
            self.gather(nxt, phase)

    def release(self, u: Unit) -> None:
        s = u.slot
        if s.owner is u:
            s.busy = False
        if s.deferred is not None and not s.busy:
            d, s.deferred = s.deferred, None
            self._issue_gather(d, self.phase if self.phase != "idle" else "forward")

    def _issue_gather(self, u: Unit, phase: str) -> None:
        s = u.slot
        s.wait()
        s.owner, s.busy, s.deferred = u, False, None
        for f, off in zip(u.flats, u.flat_offsets):
            out = s.data[off : off + f.padded_numel]
            src = self.gather_input(f)
            if self.world_size == 1:
                out.copy_(src)
            else:
                s.pending.append(self.comm.all_gather(out, src, phase))

    def gather_input(self, f: FlatParam) -> torch.Tensor:
        """The rank's slice in the compute dtype, cast once per change of the fp32 master."""
        dtype = self.precision.param_dtype
        if dtype == torch.float32:
            return f.shard
        copy, version = self._lowp.get(id(f), (None, -1))
        if copy is None:
            copy = torch.empty(f.shard_numel, dtype=dtype, device=f.shard.device)
        if version != f.shard._version:  # the optimizer (or a load) changed the master slice
            copy.copy_(f.shard)
            self._lowp[id(f)] = (copy, f.shard._version)
        return copy

    def _learn_order(self) -> None:
        if self._recorded is None or not self._recorded:
            return
        rec, self._recorded = self._recorded, None
        if len(rec) == len(self.units) and {id(u) for u in rec} == {id(u) for u in self.units}:
            self.order = rec
            self._link()
        else:
            log.warning(
                "layershard: units did not run once each in the first forward; prefetching in "
                "registration order (correct, but with less overlap)"
            )

    # ---- reduce ----------------------------------------------------------------------------------

    def reduce(self, u: Unit, grads: tuple) -> None:
        f = u.trainable
        if f is None:
            return
        grads = grads[: len(f.slots)]  # trainable slots come first
        if self.no_sync:
            acc = self._accumulator(f)
            pairs = [
                (acc[s.offset : s.offset + s.numel], g.reshape(-1))
                for s, g in zip(f.slots, grads)
                if g is not None
            ]
            if pairs:
                torch._foreach_add_([a for a, _ in pairs], [g for _, g in pairs])
            f.acc_dirty = True
            return
        gs = self.grad_slots[self._n_reduced % len(self.grad_slots)]
        self._n_reduced += 1
        buf = gs.acquire(f.padded_numel)
        dst, src = [], []
        for s, g in zip(f.slots, grads):
            view = buf[s.offset : s.offset + s.numel]
            if g is None:
                view.zero_()
            else:
                dst.append(view)
                src.append(g.reshape(-1))
        if dst:
            torch._foreach_copy_(dst, src)
        buf[f.numel :].zero_()
        if getattr(f, "acc_dirty", False):
            buf.add_(f.acc)
            f.acc.zero_()
            f.acc_dirty = False
        fresh = self._attach_grads(f)
        scale = 1.0 / self.world_size  # the one division by the world size

        def post(chunk: torch.Tensor, f=f, fresh=fresh, scale=scale) -> None:
            if fresh:  # every slice's .grad was None: overwrite instead of zero-then-add
                torch.mul(chunk, scale, out=f.grad)
            else:
                f.grad.add_(chunk, alpha=scale)

        if self.world_size == 1:
            post(buf)
        else:
            gs.pending.append(self.comm.reduce_scatter(buf, self.scratch.get, "backward", post))

    def _free_grad_slots(self) -> None:
        """Wait for every reduce-scatter, then free the gradient slots until the next backward."""
        for gs in self.grad_slots:
            gs.release()
        self._n_reduced = 0

    def _accumulator(self, f: FlatParam) -> torch.Tensor:
        if getattr(f, "acc", None) is None:
            f.acc = torch.zeros(
                f.padded_numel, dtype=self.precision.reduce_dtype, device=f.shard.device
            )
            f.acc_dirty = False
        return f.acc

    @staticmethod
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
