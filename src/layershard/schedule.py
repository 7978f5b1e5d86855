"""The hooks that move a unit's weights and gradients around its forward and backward.

One training step, for units 0..n-1 in forward order (two slots taken in turn, slot = i % 2;
a small unit has a slot of its own and is left out of the count, see buffers.py):

    forward   start:   issue AG(0), AG(1)                          (both slots are free)
              pre(i):  wait AG(i); bind weights
              post(i): unbind; release slot(i); issue AG(i+2) into it
    backward  pre(i):  wait AG(i) (the last unit of each slot in the forward is still gathered;
                       an embedding, whose backward needs no weights, is never re-gathered)
              post(i): release slot(i); issue AG(i-2) into it; then grads -> grad slot, RS(i)
    end of backward:   wait every collective still in flight (gathers included: a prefetch for
                       a unit whose backward never runs); free the grad slots

So the gather of the next unit to compute never queues behind a reduce-scatter: it was issued a
whole unit earlier, and in backward the gather into a freed slot is issued before the freed unit's
reduce-scatter (on CUDA both go to one comm stream; on CPU to gloo's queue).

``pre-backward`` is a hook on the unit's output tensors; ``post-backward`` is the backward of
``_BindUnit``, the autograd Function whose outputs are the unit's weights: autograd calls it once,
with every weight gradient of that unit, after the unit's whole backward. The root unit (tied and
root-owned parameters) is bound at the model's pre-forward and stays gathered until the end of its
backward (or of the forward, without grad).

Outside its forward a module's weight attributes are unbound: ``module.weight`` is then the rank's
1-D fp32 slice registered under that name (what ``parameters()`` yields), never a view of a gather
buffer that another unit may have refilled. ``ShardedModule.full_weights()`` gives full weights.
"""

from __future__ import annotations

import enum
import logging
import math
from collections.abc import Callable, Iterator
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from layershard.buffers import GatherSlot, GradSlot
from layershard.collectives import Comm, Pending
from layershard.flat import FlatParam, ParamSlot
from layershard.precision import MixedPrecision

log = logging.getLogger("layershard")


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


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
            v
            for f, o in zip(flats, self.flat_offsets)
            for v in f.views(slot.alias[o : o + f.padded_numel])
        ]
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        # reshard_after_forward=K: per flat, this rank's 1/K of the gathered weights, kept from
        # the forward to the backward, which gathers within the K ranks (see strategy.py)
        self.secondary: list[torch.Tensor] | None = None
        self.bound = False
        self.span: record_function | None = None  # profiler label of the compute in progress

    def __repr__(self) -> str:
        return f"Unit({self.name})"

    def bind(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Make the modules' weight attributes resolve to ``tensors`` (plain tensors, which
        shadow the registered slices while bound)."""
        for slot, t in zip(self.param_slots, tensors):
            for use in slot.uses:
                use.module.__dict__[use.attr] = t
        self.bound = True

    def unbind(self) -> None:
        """Weight attributes resolve to the registered 1-D slices again."""
        if self.bound:
            for slot in self.param_slots:
                for use in slot.uses:
                    use.module.__dict__.pop(use.attr, None)
            self.bound = False

    def open_span(self, what: str) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.close_span()
            self.span = record_function(f"layershard::{what}[{self.name}]")
            self.span.__enter__()

    def close_span(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.__exit__(None, None, None)


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


class Schedule:
    def __init__(
        self,
        root: Unit | None,
        units: list[Unit],
        grad_slots: list[GradSlot],
        comm: Comm,
        precision: MixedPrecision,
        offload: bool = False,
    ):
        self.root, self.units, self.comm, self.precision = root, units, comm, precision
        self.grad_slots = grad_slots
        self.offload = offload  # shards and their gradients live in CPU memory
        self.world_size = comm.world_size
        # gradients are averaged over every data-parallel rank: the shard group and its replicas
        self.data_parallel = comm.world_size * comm.sharding.replicas
        self.order: list[Unit] = list(units)  # forward execution order, learned on first forward
        self._recorded: list[Unit] | None = []
        self._link()
        self.phase = Phase.IDLE
        self.no_sync = False
        self.accumulated = False  # a backward ran under no_sync since the last synced one
        self.full_weights_open = False  # inside ShardedModule.full_weights(): no forward
        self._n_reduced = 0  # reduce-scatters issued this backward: picks the next gradient slot
        self._callback_queued = False
        # A unit may run more than once before one backward (shared weights, or two forwards
        # before one backward): each run is a "use", numbered in forward order. Its weights are
        # gathered again for each use's backward, and its gradients reduced once per use.
        self._uses = 0
        self._use_of: dict[int, int] = {}  # id(unit) -> its current use (pre- to post-forward)
        self._bw_uses: set[int] = set()  # uses whose backward began (this backward)
        self._bw_units: set[int] = set()  # ids of units with a use whose backward began
        self._reduced: dict[int, Pending] = {}  # id(flat) -> its last reduction this backward

    def _link(self) -> None:
        self._next = {id(a): b for a, b in zip(self.order, self.order[1:])}
        self._prev = {id(b): a for a, b in zip(self.order, self.order[1:])}
        # The next unit, in each phase's order, to take the same gather slot (see refill).
        self._slot_next: dict[Phase, dict[int, Unit | None]] = {}
        for phase, seq in ((Phase.FORWARD, self.order[::-1]), (Phase.BACKWARD, self.order)):
            later: dict[int, Unit] = {}  # id(slot) -> its next user after the unit at hand
            nxt: dict[int, Unit | None] = {}
            for u in seq:
                nxt[id(u)] = later.get(id(u.slot))
                if phase is Phase.FORWARD or u.gather_in_backward:
                    later[id(u.slot)] = u
            self._slot_next[phase] = nxt

    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root else []) + self.units

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> list:
        handles = [
            model.register_forward_pre_hook(lambda m, a: self.root_pre_forward()),
            model.register_forward_hook(lambda m, a, out: self.root_post_forward()),
        ]
        for u in self.units:
            assert u.module is not None  # only the root unit has no module
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
        if self.full_weights_open:
            raise RuntimeError(
                "layershard: forward inside model.full_weights(): leave the context first (it "
                "holds the full weights in place of the sharded ones)"
            )
        self._learn_order()
        if torch.is_grad_enabled():
            self._check_requires_grad()
        # A new forward: weights may have changed since the last one, and a backward that raised
        # may have left state behind.
        self._free_grad_slots()
        for u in self.all_units():
            u.unbind()
            u.slot.reset()
            if u.trainable is not None and torch.is_grad_enabled():
                u.trainable.release_grad()
        self.phase, self._callback_queued = Phase.FORWARD, False
        self._bw_uses.clear()
        self._bw_units.clear()
        if self.root is not None:
            self._issue_gather(self.root, Phase.FORWARD)
            self.root.slot.wait()
            self._bind(self.root)
        first: list[Unit] = []  # every slot is free: start the gathers of the first two units
        for u in self.order:  # that take different slots
            if len(first) == 2:
                break
            if all(v.slot is not u.slot for v in first):
                first.append(u)
                self.gather(u, Phase.FORWARD)

    def _check_requires_grad(self) -> None:
        """``shard()`` split each unit into trainable and frozen shards; a flag changed since
        then would be ignored (a frozen slice still trained, or an unfrozen one never)."""
        for u in self.all_units():
            for f in u.flats:
                for slot, p in zip(f.slots, f.shard_params):
                    if p.requires_grad != f.requires_grad:
                        raise RuntimeError(
                            f"layershard: {slot.name}.requires_grad changed to "
                            f"{p.requires_grad} after shard(): freeze or unfreeze parameters "
                            "before ls.shard(), which splits each unit into trainable and "
                            "frozen shards (to change it later, shard the model again)"
                        )

    def root_post_forward(self) -> None:
        # Without grad no backward follows; with grad the root stays bound (its graph tensors
        # are what checkpointed blocks see when recomputed) until the end of backward.
        if not self._in_backward() and not torch.is_grad_enabled():
            if self.root is not None:
                self.root.unbind()
            # No gather may still read a shard once forward returns: the caller may write the
            # shards next (a load, an edit). On CUDA this is a stream wait.
            for u in self.all_units():
                u.slot.wait()
        if not self._in_backward():
            self.phase = Phase.IDLE

    def pre_forward(self, u: Unit) -> None:
        if self._in_backward():  # recompute under activation checkpointing
            self._enter_backward()
            self.ensure(u, Phase.BACKWARD)
            self._bind(u)
            return
        if self._recorded is not None:
            self._recorded.append(u)
        self._uses += 1
        self._use_of[id(u)] = self._uses
        u.open_span("forward")
        self.ensure(u, Phase.FORWARD)
        self._bind(u)
        self.gather_next(u, self._next, Phase.FORWARD)

    def post_forward(self, u: Unit, out):
        u.unbind()
        use: int | None = None  # a checkpoint's recompute: part of a use already in backward
        if not self._in_backward():
            use = self._use_of.get(id(u))
            u.close_span()
            if u.secondary is not None:  # also under no_grad: a reentrant checkpoint's forward
                self._keep_secondary(u)
            self.release(u)
            self.refill(u, self._next, Phase.FORWARD)
        if torch.is_grad_enabled():
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u, use=use: self.pre_backward(u, use))
        return None

    def pre_backward(self, u: Unit, use: int | None) -> None:
        """The first gradient of one of ``u``'s outputs in ``use`` arrived: the use's backward
        begins (its other outputs' gradients come later or not at all)."""
        self._enter_backward()
        if use in self._bw_uses or (use is None and id(u) in self._bw_units):
            return
        if use is not None:
            self._bw_uses.add(use)
        self._bw_units.add(id(u))
        u.open_span("backward")
        if u.gather_in_backward:
            self.ensure(u, Phase.BACKWARD)
            # Bound for the unit's backward: a checkpointed forward recomputed now reads its
            # weights from the attributes (HF checkpoints ``forward``, outside the hooks). Under
            # grad, so that a reentrant recompute's graph ends in a _BindUnit (post-backward).
            with torch.enable_grad():
                self._bind(u)
        self.gather_next(u, self._prev, Phase.BACKWARD)

    def post_backward(self, u: Unit, grads: tuple) -> None:
        self._enter_backward()
        u.close_span()
        u.unbind()
        # The unit's weights are no longer needed: the gather that will use its slot next goes
        # first, the reduce-scatter (needed only at the end of backward) after it.
        self.release(u)
        self.refill(u, self._prev, Phase.BACKWARD)
        with record_function(f"layershard::reduce[{u.name}]"):
            self.reduce(u, grads)

    def _enter_backward(self) -> None:
        self.accumulated |= self.no_sync
        self.phase = Phase.BACKWARD
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    def end_backward(self) -> None:
        """Nothing is in flight once backward returns: the optimizer, ``clip_grad_norm_`` and a
        checkpoint see the final gradient slices and no gather still reads a shard."""
        if self.accumulated and not self.no_sync:
            self._reduce_accumulated()
        for u in self.all_units():
            u.slot.wait()
            # Nothing computes any more. A frozen unit (no post-backward) or a backward that
            # needed no weight gradients (autograd.grad of an input) left its slot busy, which
            # a second backward through the same graph (retain_graph) would trip over.
            u.slot.busy, u.slot.deferred = False, None
            u.close_span()
            u.unbind()
        self._free_grad_slots()
        self.phase = Phase.IDLE
        self._callback_queued = False
        self._bw_uses.clear()
        self._bw_units.clear()

    # ---- gather ----------------------------------------------------------------------------------

    def _bind(self, u: Unit) -> None:
        if torch.is_grad_enabled() and u.trainable is not None:
            u.bind(_BindUnit.apply(self, u, u.anchor, *u.full_views))
        else:
            u.bind(u.full_views)

    def ensure(self, u: Unit, phase: Phase) -> None:
        """Block the compute stream until ``u``'s weights are in its slot; mark it busy."""
        s = u.slot
        if s.owner is not u:
            if s.busy and phase is Phase.BACKWARD and id(s.owner) in self._bw_units:
                # The owner's backward began and ``u``'s comes later, so it is over: autograd
                # runs a unit's post-backward before any op of an earlier unit, and a unit
                # without trainable weights (frozen) has no post-backward to release its slot.
                s.busy = False
            self._issue_gather(u, phase)
        s.wait()
        s.busy = True

    def gather(self, u: Unit, phase: Phase) -> None:
        """Prefetch: start ``u``'s all-gather now if its slot is free, else when it is released."""
        s = u.slot
        if s.owner is u:
            return
        if s.busy:
            s.deferred = u
        else:
            self._issue_gather(u, phase)

    def _step(self, u: Unit | None, step: dict[int, Unit], phase: Phase) -> Unit | None:
        """The unit after ``u`` in execution order (``step``: ``_next`` in forward, ``_prev`` in
        backward), past units that are not gathered for their backward."""
        nxt = step.get(id(u)) if u is not None else None
        while nxt is not None and phase is Phase.BACKWARD and not nxt.gather_in_backward:
            nxt = step.get(id(nxt))
        return nxt

    def gather_next(self, u: Unit, step: dict[int, Unit], phase: Phase) -> None:
        """Make sure the next unit's gather is on its way (normally issued a unit earlier)."""
        nxt = self._step(u, step, phase)
        if nxt is not None:
            self.gather(nxt, phase)

    def refill(self, u: Unit, step: dict[int, Unit], phase: Phase) -> None:
        """``u`` released its slot: start the gathers of the next unit that takes that slot and
        of the unit after next if its slot is free (its own slot: grad_op, no_shard, a small
        unit), never evicting weights a sooner unit waits for."""
        after = self._step(self._step(u, step, phase), step, phase)
        if after is not None and after.slot is not u.slot:
            s = after.slot
            if s.owner is after or (not s.busy and s.owner is None):
                self.gather(after, phase)
        # The slot's next user: usually the unit after next; further when a small unit with a
        # slot of its own comes between (last block, norm, head: the head's gather overlaps the
        # last block) or when the first two units share a slot.
        nxt = self._slot_next[phase].get(id(u))
        if nxt is not None:
            s = nxt.slot
            if s.owner is nxt or (not s.busy and s.owner in (None, u)):
                self.gather(nxt, phase)

    def release(self, u: Unit) -> None:
        s = u.slot
        if s.owner is u:
            s.busy = False
        if s.deferred is not None and not s.busy:
            d, s.deferred = s.deferred, None
            self._issue_gather(d, self.phase if self.phase is not Phase.IDLE else Phase.FORWARD)

    def _issue_gather(self, u: Unit, phase: Phase) -> None:
        s = u.slot
        s.take(u)
        secondary = u.secondary if phase is Phase.BACKWARD else None
        for i, (f, off) in enumerate(zip(u.flats, u.flat_offsets)):
            out = s.data[off : off + f.padded_numel]
            if secondary is not None:  # within the K ranks of reshard_after_forward=K
                p = self.comm.all_gather(out, secondary[i], phase.value, u.name, over="hpz")
            else:
                p = self.comm.all_gather(out, f.shard, phase.value, u.name)
            s.pending.append(p)

    def _keep_secondary(self, u: Unit) -> None:
        """After the forward: keep this rank's 1/K of the unit's gathered weights."""
        _, j, k = self.comm._members("hpz")
        for buf, f, off in zip(u.secondary or [], u.flats, u.flat_offsets):
            m = f.padded_numel // k
            buf.copy_(u.slot.data[off + j * m : off + (j + 1) * m])

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
        pairs = [  # (flat view, gradient) of the trainable slots, which come first
            (s.offset, s.numel, g.reshape(-1))
            for s, g in zip(f.slots, grads[: len(f.slots)])
            if g is not None
        ]
        if self.no_sync or f.acc_dirty:  # accumulate in fp32 (see no_sync())
            acc = self._accumulator(f)
            if pairs:
                torch._foreach_add_([acc[o : o + n] for o, n, _ in pairs], [g for *_, g in pairs])
            f.acc_dirty = True
            if self.no_sync:
                return
        earlier = self._reduced.get(id(f))
        if earlier is not None:  # f's second use: its gradient is added, after the first's
            earlier.wait()  # (on gloo a reduction's post runs at its wait, in any slot order)
        gs = self.grad_slots[self._n_reduced % len(self.grad_slots)]
        self._n_reduced += 1
        buf = gs.acquire(f.padded_numel)
        if f.acc is not None and f.acc_dirty:
            buf.copy_(f.acc)  # one cast of the fp32 sum
            f.acc.zero_()
            f.acc_dirty = False
        else:
            covered = {o for o, _, _ in pairs}
            for s in f.slots:  # parameters without a gradient this step
                if s.offset not in covered:
                    buf[s.offset : s.offset + s.numel].zero_()
            if pairs:
                torch._foreach_copy_([buf[o : o + n] for o, n, _ in pairs], [g for *_, g in pairs])
            for a, b in f.gaps:
                buf[a:b].zero_()
        pre, post_factor = reduce_factors(buf.dtype, self.data_parallel)
        if pre != 1.0:
            buf.mul_(pre)
        fresh = self._attach_grads(f)
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
        scratch = gs.get_scratch() if gs.scratch_numel else None
        pending = self.comm.reduce_scatter(buf, scratch, "backward", u.name, post, host_post)
        gs.pending.append(pending)
        self._reduced[id(f)] = pending

    def _reduce_accumulated(self) -> None:
        """Reduce what ``no_sync`` accumulated for units this synced backward did not reach (a
        task's head when the last micro-batch is another task's): it belongs to this step. A
        unit counts if it did on any rank (a rank's micro-batches may not use it); every rank
        entered no_sync, so every rank takes part."""
        self.accumulated = False
        units = [(u, f) for u in self.all_units() if (f := u.trainable) is not None]
        left = torch.tensor([float(f.acc_dirty) for _, f in units], device=self.comm.device)
        if dist.get_world_size(self.comm.full) > 1:
            self.comm.stats.record("all_reduce", "backward", left.numel() * 4, "all")
            dist.all_reduce(left, op=dist.ReduceOp.MAX, group=self.comm.full)
        for (u, _), flag in zip(units, left.tolist()):
            if flag:
                self.reduce(u, ())

    def _free_grad_slots(self) -> None:
        """Wait for every reduce-scatter, then free the gradient slots until the next backward."""
        for gs in self.grad_slots:
            gs.release()
        self._n_reduced = 0
        self._reduced.clear()

    def _accumulator(self, f: FlatParam) -> torch.Tensor:
        if f.acc is None:  # beside the gradients it sums (the device, also under CPU offload)
            f.acc = torch.zeros(f.padded_numel, dtype=torch.float32, device=self.comm.device)
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
