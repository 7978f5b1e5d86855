"""The hooks that move a unit's weights around its forward and backward.

One training step, for units 0..n-1 in forward order (two slots taken in turn, slot = i % 2;
a small unit has a slot of its own and is left out of the count, see buffers.py):

    forward   start:   issue AG(0), AG(1)                          (both slots are free)
              pre(i):  wait AG(i); bind weights
              post(i): unbind; release slot(i); issue AG(i+2) into it
              post(n-1): the slots give their bytes back, but the last unit's weights
    backward  start:   the ranks agree on the units this backward reaches (one small all-reduce)
              pre(i):  wait AG(i) (the forward's last unit is still gathered: see buffers.py,
                       "between the passes"; an embedding, whose backward needs no weights,
                       is never re-gathered)
              post(i): release slot(i); issue AG(i-2) into it; then grads -> grad slot, RS(i)
    end of backward:   wait every collective still in flight (gathers included: a prefetch for
                       a unit whose backward never runs); free the grad slots

So the gather of the next unit to compute never queues behind a reduce-scatter: it was issued a
whole unit earlier, and in backward the gather into a freed slot is issued before the freed unit's
reduce-scatter (on CUDA both go to one comm stream; on CPU to gloo's queue). The reductions
themselves are the ``Reducer``'s; what begins and ends a unit's backward is in backward.py.

The root unit (tied and root-owned parameters) is bound at the model's pre-forward and stays
gathered until the end of its backward (or of the forward, without grad). Outside its forward a
module's weight attributes are unbound: ``module.weight`` is then the rank's 1-D fp32 slice
registered under that name (what ``parameters()`` yields), never a view of a gather buffer that
another unit may have refilled. ``ShardedModule.full_weights()`` gives full weights.
"""

from __future__ import annotations

import enum
import logging
from collections import Counter
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import record_function

from layershard.engine.backward import (
    BindUnit,
    Use,
    mark_inputs,
    output_tensors,
    weight_saving_hooks,
)
from layershard.engine.buffers import Spare
from layershard.engine.collectives import Comm, Pending
from layershard.engine.precision import MixedPrecision
from layershard.engine.reducer import Reducer
from layershard.engine.units import Unit
from layershard.engine.waits import waiting

log = logging.getLogger("layershard")


class Phase(enum.Enum):
    IDLE = "idle"
    FORWARD = "forward"
    BACKWARD = "backward"


class Schedule:
    def __init__(
        self,
        root: Unit | None,
        units: list[Unit],
        reducer: Reducer,
        comm: Comm,
        precision: MixedPrecision,
        spare: Spare | None = None,
    ):
        self.root, self.units, self.comm, self.precision = root, units, comm, precision
        self.reducer, self.spare = reducer, spare or Spare()  # buffers.py, "spare storage"
        self.world_size = comm.world_size
        self.order: list[Unit] = list(units)  # forward execution order, learned on first forward
        self._recorded: list[Unit] | None = []
        self._link()
        self.phase = Phase.IDLE
        self.no_sync = False
        self.full_weights_open = False  # inside ShardedModule.full_weights(): no forward
        self._callback_queued = False
        self._grad_forward = False  # the model's forward in progress records autograd graphs
        # A unit may run more than once before one backward (shared weights, or two forwards
        # before one backward): each run is a "use", numbered in forward order. Its weights are
        # gathered again for each use's backward, and its gradients reduced once per use.
        self._uses = 0
        self._use_of: dict[int, int] = {}  # id(unit) -> its current use (pre- to post-forward)
        self._forward_uses: dict[int, Use] = {}  # uses since the last backward (grad forwards)
        self._bw_uses: set[int] = set()  # uses whose backward began (this backward)
        self._bw_units: set[int] = set()  # ids of units with a use whose backward began
        self._hooks: list[tuple[Unit, saved_tensors_hooks]] = []  # pushed at pre-forward
        # This backward's plan (see plan_backward): the units some ranks reach and others do
        # not, gathered at its start into a buffer of their own (id -> buffer, its gathers),
        # and the units no rank reaches.
        self._private: dict[int, tuple[torch.Tensor, list[Pending]]] = {}
        self._unreached: set[int] = set()

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
        # A unit larger than a block (storage of its own, buffers.py) is gathered when the unit
        # two turns before it (small units left out) releases its slot, as a block would be.
        users = Counter(id(u.slot) for u in self.order)
        self._early: dict[Phase, dict[int, list[Unit]]] = {}
        for phase, seq in ((Phase.FORWARD, self.order), (Phase.BACKWARD, self.order[::-1])):
            turns = [
                u
                for u in seq
                if (u.slot.transient or users[id(u.slot)] > 1)
                and (phase is Phase.FORWARD or u.gather_in_backward)
            ]
            early: dict[int, list[Unit]] = {}
            for k, u in enumerate(turns):
                if u.slot.transient and k >= 2:
                    early.setdefault(id(turns[k - 2]), []).append(u)
            self._early[phase] = early

    def all_units(self) -> list[Unit]:
        return ([self.root] if self.root else []) + self.units

    def buffer_bytes(self, shard_storages: set[int]) -> dict[str, int]:
        """``memory_report()``'s buffers (buffers.py); not shards no_shard in fp32 computes on."""
        slots = {id(u.slot): u.slot for u in self.all_units()}.values()
        # a slot's capacity, not its storage's bytes of the moment (given back between passes)
        fixed = [(s.capacity, s.alias) for s in slots if not s.transient and s.alias is not None]
        secondary = [t for u in self.units for t in (u.secondary or [])]
        own = self.reducer.own
        return {
            "gather_buffers": sum(
                n for n, a in fixed if a.untyped_storage().data_ptr() not in shard_storages
            )
            + sum(t.untyped_storage().nbytes() for t in secondary),
            "grad_buffers": sum(g.capacity for g in self.reducer.grad_slots),
            "reduce_scratch": sum(g.scratch_capacity for g in self.reducer.grad_slots),
            "large_gather": max((s.capacity for s in slots if s.transient), default=0),
            "large_grad": 0 if own is None else own.capacity + own.scratch_capacity,
        }

    # ---- hooks ---------------------------------------------------------------------------------

    def install(self, model: nn.Module) -> list:
        handles = [
            model.register_forward_pre_hook(lambda m, a: self.root_pre_forward()),
            model.register_forward_hook(lambda m, a, out: self.root_post_forward()),
        ]
        for u in self.units:
            assert u.module is not None  # only the root unit has no module
            handles.append(
                u.module.register_forward_pre_hook(
                    lambda m, a, kw, u=u: self.pre_forward(u, a, kw), with_kwargs=True
                )
            )
            handles.append(
                u.module.register_forward_hook(lambda m, a, out, u=u: self.post_forward(u, out))
            )
            # A forward that raised ran no post-forward: leave its saved-tensor hooks anyway,
            # or they would outlive it and see every later forward, of any model.
            handles.append(
                u.module.register_forward_hook(
                    lambda m, a, out, u=u: self._pop_saved_tensor_hooks(u), always_call=True
                )
            )
        return handles

    @staticmethod
    def in_backward() -> bool:
        """Is autograd executing a backward pass (a forward now is a checkpoint's recompute)?"""
        return torch._C._current_graph_task_id() != -1

    def root_pre_forward(self) -> None:
        if self.in_backward():
            return
        if self.full_weights_open:
            raise RuntimeError(
                "layershard: forward inside model.full_weights(): leave the context first (it "
                "holds the full weights in place of the sharded ones)"
            )
        self._learn_order()
        if torch.is_grad_enabled():
            self._check_requires_grad()
        # A new forward: weights may have changed since the last one, and a forward or backward
        # that raised may have left state behind.
        self._pop_saved_tensor_hooks()
        self.reducer.finish()
        for u in self.all_units():
            u.unbind()
            u.slot.reset()
            if u.trainable is not None and torch.is_grad_enabled():
                u.trainable.release_grad()
        self.phase, self._callback_queued = Phase.FORWARD, False
        self._grad_forward = torch.is_grad_enabled()
        self._bw_uses.clear()
        self._bw_units.clear()
        if self.root is not None:
            self._issue_gather(self.root, Phase.FORWARD)
            self.root.slot.wait()
            self._bind(self.root, None)
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
        if not self.in_backward() and not torch.is_grad_enabled():
            if self.root is not None:
                self.root.unbind()
            # No gather may still read a shard once forward returns: the caller may write the
            # shards next (a load, an edit). On CUDA this is a stream wait.
            self.quiesce()
        if not self.in_backward():
            self.phase = Phase.IDLE
            self.spare.clear()  # also where the forward's last unit did not run

    def quiesce(self) -> None:
        """Wait for every collective in flight that reads or writes a shard or a buffer. Every
        writer of shards (loads, ``full_weights(writeback=True)``) calls it first: on CUDA a
        gather's cast of the shard is queued on the comm stream and may not have run yet."""
        for u in self.all_units():
            u.slot.wait()
        self.reducer.quiesce()

    def pre_forward(self, u: Unit, args: tuple = (), kwargs: dict | None = None):
        if self.in_backward():  # a recompute of a checkpoint that calls the module itself
            self._enter_backward()
            self._bw_units.add(id(u))
            self._ensure_for_backward(u)
            self._bind(u, None)
            return None
        if self._recorded is not None:
            self._recorded.append(u)
        self._uses += 1
        use = self._use_of[id(u)] = self._uses
        grad = torch.is_grad_enabled()
        if self._grad_forward:  # a backward may follow (a no-grad unit inside: a checkpoint's)
            self._forward_uses[use] = Use(u)
        u.open_span("forward")
        self.ensure(u, Phase.FORWARD)
        self._bind(u, use)
        self.gather_next(u, self._next, Phase.FORWARD)
        if grad and u.gather_in_backward:
            self._push_saved_tensor_hooks(u, use)
        if grad and u.trainable is None and use in self._forward_uses:
            return mark_inputs(self._forward_uses[use], args, kwargs or {})
        return None

    def post_forward(self, u: Unit, out):
        use: int | None = None  # a checkpoint's recompute: part of a use already in backward
        if not self.in_backward():
            self._pop_saved_tensor_hooks(u)
            use = self._use_of.get(id(u))
        u.unbind()
        if use is not None:
            u.close_span()
            if u.secondary is not None:  # also under no_grad: a reentrant checkpoint's forward
                self._keep_secondary(u)
            self.release(u)
            self.refill(u, self._next, Phase.FORWARD)
            if u is self.order[-1]:
                self._between_passes(u)
        if torch.is_grad_enabled():
            record = self._forward_uses.get(use) if use is not None else None
            for t in output_tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u, use=use: self.begin_backward_use(u, use))
                    if record is not None and isinstance(t.grad_fn, BackwardCFunction):
                        record.note(t.grad_fn)  # a reentrant checkpoint's node, say
        return None

    def _between_passes(self, last: Unit) -> None:
        """The forward's last unit is done: nothing spare is kept to the loss, and until backward
        only its weights are needed (buffers.py, "spare storage", "between the passes")."""
        self.spare.clear()  # a causal LM's loss may run inside the model's forward
        if not self._grad_forward:  # no backward follows
            return
        for slot in {id(v.slot): v.slot for v in self.units}.values():
            if slot.owner is last:
                slot.trim(last.gather_numel)
            else:
                slot.vacate()

    # Note: what begins a unit's backward. Its weights must be in its buffer before any of its
    # backward ops reads them, whatever its forward returned. Three triggers, whichever fires
    # first (``begin_backward_use`` acts once per use and backward):
    #   1. the gradient of any tensor in its output (``output_tensors`` walks containers and
    #      objects);
    #   2. the first tensor its forward saved for backward being unpacked (saved-tensor hooks
    #      around the forward): every weight a backward op reads is such a tensor, so this
    #      fires before the first read even when no output tensor was found. The hooks save
    #      a weight as a ``WeightView`` (where, not the tensor) and unpack it from the buffer
    #      the weights are in for this backward;
    #   3. a checkpoint's recompute of its forward (``checkpoint_forward``, ``pre_forward``).
    # post_backward checks that it happened: a miss raises instead of computing with the weights
    # of whichever unit took the slot since.

    def _push_saved_tensor_hooks(self, u: Unit, use: int) -> None:
        assert u.slot.alias is not None  # gathered: pre_forward ensured it

        def begin() -> None:
            if self.in_backward() and use not in self._bw_uses:
                self.begin_backward_use(u, use)

        hooks = weight_saving_hooks(u.slot.alias, begin, lambda: self.backward_weights(u))
        if hooks is not None:
            hooks.__enter__()
            self._hooks.append((u, hooks))

    def _pop_saved_tensor_hooks(self, u: Unit | None = None) -> None:
        """Leave the hooks of ``u``'s forward (None: of every forward a raise left open)."""
        while self._hooks and (u is None or self._hooks[-1][0] is u):
            _, hooks = self._hooks.pop()
            hooks.__exit__(None, None, None)
            if u is not None:
                return

    def checkpoint_forward(self, u: Unit, forward: Callable, *args, **kwargs):
        """``forward`` under non-reentrant activation checkpointing; its recompute in backward
        begins the use's backward (trigger 3 above)."""
        if not torch.is_grad_enabled():
            return forward(*args, **kwargs)
        use = self._use_of.get(id(u))

        def run(*a, **kw):
            if self.in_backward():
                self.begin_backward_use(u, use)
            return forward(*a, **kw)

        return torch.utils.checkpoint.checkpoint(run, *args, use_reentrant=False, **kwargs)

    def begin_backward_use(self, u: Unit, use: int | None) -> None:
        """The backward of ``u``'s ``use`` begins: gather its weights into its slot (they were
        resharded after its forward) and prefetch the next unit's."""
        self._enter_backward()
        if use in self._bw_uses or (use is None and id(u) in self._bw_units):
            return
        if use is not None:
            self._bw_uses.add(use)
        self._bw_units.add(id(u))
        u.open_span("backward")
        if u.gather_in_backward:
            self._ensure_for_backward(u)
            # Bound for the unit's backward: a checkpointed forward recomputed now reads its
            # weights from the attributes (HF checkpoints ``forward``, outside the hooks). Under
            # grad, so that a reentrant recompute's graph ends in a BindUnit (post-backward).
            with torch.enable_grad():
                self._bind(u, use)
        if id(u) not in self._private:  # a divergent unit's events issue no collective
            self.gather_next(u, self._prev, Phase.BACKWARD)

    def _ensure_for_backward(self, u: Unit) -> None:
        if id(u) in self._private:  # gathered at the start of backward, on every rank
            for p in self._private[id(u)][1]:
                p.wait()
        else:
            self.ensure(u, Phase.BACKWARD)

    def backward_weights(self, u: Unit) -> torch.Tensor:
        """The buffer holding ``u``'s gathered weights in this backward (laid out as in its
        slot): its slot, or its own buffer when only some ranks reach it."""
        private = self._private.get(id(u))
        if private is not None:
            return private[0]
        assert u.slot.alias is not None  # gathered: its backward began
        return u.slot.alias

    def post_backward(self, u: Unit, use: int | None, grads: tuple) -> None:
        self._enter_backward()
        # The root unit stays gathered from the model's forward to the end of its backward.
        began = u is self.root or (
            use in self._bw_uses if use is not None else id(u) in self._bw_units
        )
        private = id(u) in self._private
        if u.gather_in_backward and not (began and (private or u.slot.owner is u)):
            raise RuntimeError(
                f"layershard: {u.name}: its backward ran without its weights gathered again for "
                "it (no hook saw this unit's backward begin), so its gradients would be wrong; "
                "please report it with the type of the unit's forward output"
            )
        u.close_span()
        u.unbind()
        if not private:
            # The unit's weights are no longer needed: the gather that will use its slot next
            # goes first, the reduce-scatter (needed only at the end of backward) after it.
            self.release(u)
            self.refill(u, self._prev, Phase.BACKWARD)
        with record_function(f"layershard::reduce[{u.name}]"):
            self.reducer.reduce(u, grads, self.no_sync)

    def _enter_backward(self) -> None:
        self.phase = Phase.BACKWARD
        if not self._callback_queued:
            self._callback_queued = True
            self.plan_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    # Note: every rank issues the same collectives in the same order. A unit's backward gather
    # and reduction are collectives, issued from its backward's hooks, which run on the ranks
    # whose loss depends on the unit: not always every rank (an auxiliary head in one rank's
    # loss). So at the start of each backward that communicates the ranks agree, with one
    # small all-reduce, on how many uses of each unit every rank's backward will reach
    # (autograd knows which nodes the pass in progress will execute). Units reached as often
    # everywhere are gathered and reduced by their hooks, as always. For the others
    # ("divergent"), every rank gathers the weights right away, in unit order, into a buffer of
    # their own (the unpack hook points the weights their forward saved at it), their hooks
    # issue no collective and touch no slot, and their gradients accumulate and are reduced at
    # the end of backward, in unit order, with zeros from the ranks that did not reach them.
    # Gradients a no_sync backward left in the accumulator of a unit this backward does not
    # reach go the same way. So every collective is issued either by an event every rank sees,
    # or at the start or end of backward.

    def plan_backward(self) -> None:
        self._private, self._unreached = {}, set()
        gathers = self.comm.sharding.gathers_in_backward
        if self.no_sync and not gathers:  # no collective in this backward
            return
        units = [
            u
            for u in self.all_units()
            if u.trainable is not None or (u.gather_in_backward and gathers and u is not self.root)
        ]
        reached = dict.fromkeys((id(u) for u in units), 0)
        for record in self._forward_uses.values():
            if id(record.unit) in reached and record.reached():
                reached[id(record.unit)] += 1
        flags = torch.tensor(
            [[reached[id(u)], -reached[id(u)], int(u.acc_dirty)] for u in units], dtype=torch.int64
        ).reshape(-1, 3)
        if self.comm.control_size > 1 and units:
            self.comm.stats.record("all_reduce", "backward", flags.numel() * 8, "all")
            with waiting("agreement on the units this backward reaches"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.comm.control)
        deferred = []
        for u, (most, least, dirty) in zip(units, flags.tolist()):
            divergent = most != -least
            if (
                u.trainable is not None
                and not self.no_sync
                and (divergent or (most == 0 and dirty))
            ):
                deferred.append(u)
            if divergent and u.gather_in_backward and gathers and u is not self.root:
                self.gather_private(u)
            if most == 0:  # no rank's backward reaches it: nothing to prefetch for it
                self._unreached.add(id(u))
        self.reducer.defer(deferred)

    def gather_private(self, u: Unit) -> None:
        """All-gather ``u``'s weights for its backward into a buffer of its own (every rank)."""
        buf = torch.empty(u.gather_numel, dtype=u.slot.dtype, device=u.slot.device)
        pending = []
        over = self.comm.sharding.backward_gather_group
        for i, (f, off) in enumerate(zip(u.flats, u.flat_offsets)):
            src = u.secondary[i] if u.secondary is not None else f.shard
            out = buf[off : off + f.padded_numel]
            pending.append(self.comm.all_gather(out, src, "backward", u.name, over=over))
        self._private[id(u)] = (buf, pending)
        u.private_views = [
            v
            for f, o in zip(u.flats, u.flat_offsets)
            for v in f.views(buf.data[o : o + f.padded_numel])
        ]

    def end_backward(self) -> None:
        """Nothing is in flight once backward returns: the optimizer, ``clip_grad_norm_`` and a
        checkpoint see the final gradient slices and no gather still reads a shard."""
        self.reducer.reduce_deferred()  # every rank, in unit order (see plan_backward)
        for _, pending in self._private.values():
            for p in pending:
                p.wait()
        self._private, self._unreached = {}, set()
        for u in self.all_units():
            u.private_views = None
            # Nothing computes any more. A frozen unit (no post-backward) or a backward that
            # needed no weight gradients (autograd.grad of an input) left its slot busy, which
            # a second backward through the same graph (retain_graph) would trip over.
            u.slot.settle()
            u.close_span()
            u.unbind()
        self.reducer.finish()
        self.spare.clear()
        self.phase = Phase.IDLE
        self._callback_queued = False
        self._bw_uses.clear()
        self._bw_units.clear()
        self._forward_uses.clear()

    # ---- gather ----------------------------------------------------------------------------------

    def _bind(self, u: Unit, use: int | None) -> None:
        full_views = u.private_views if u.private_views is not None else u.full_views
        if torch.is_grad_enabled() and u.trainable is not None:
            views = BindUnit.apply(self, u, use, u.anchor, *full_views)
            record = self._forward_uses.get(use) if use is not None else None
            if record is not None and views:
                record.note(views[0].grad_fn)
            u.bind(views)
        else:
            u.bind(full_views)

    def ensure(self, u: Unit, phase: Phase) -> None:
        """Block the compute stream until ``u``'s weights are in its slot; occupy it."""
        s = u.slot
        if s.owner is not u:
            if phase is Phase.BACKWARD and id(s.owner) in self._bw_units:
                # The owner's backward began and ``u``'s comes later, so it is over: autograd
                # runs a unit's post-backward before any op of an earlier unit, and a unit
                # without trainable weights (frozen) has no post-backward to release its slot.
                s.hand_over()
            self._issue_gather(u, phase)
        s.occupy(u)

    def gather(self, u: Unit, phase: Phase) -> None:
        """Prefetch: start ``u``'s all-gather now if its slot is free, else when it is released."""
        s = u.slot
        if s.owner is u:
            return
        if s.busy:
            s.defer(u)
        else:
            self._issue_gather(u, phase)

    def _step(self, u: Unit | None, step: dict[int, Unit], phase: Phase) -> Unit | None:
        """The unit after ``u`` in execution order (``step``: ``_next`` in forward, ``_prev`` in
        backward), past units whose backward takes no slot."""
        nxt = step.get(id(u)) if u is not None else None
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = step.get(id(nxt))
        return nxt

    def _slot_user(self, u: Unit) -> bool:
        """Does ``u``'s backward take its gather slot? (Not an embedding, nor a divergent or
        unreached unit.)"""
        return u.gather_in_backward and id(u) not in self._private and id(u) not in self._unreached

    def gather_next(self, u: Unit, step: dict[int, Unit], phase: Phase) -> None:
        """Make sure the next unit's gather is on its way (normally issued a unit earlier)."""
        nxt = self._step(u, step, phase)
        if nxt is not None:
            self.gather(nxt, phase)
            # In backward the unit after it too, when its slot was given back between the
            # passes (a small unit between: the final norm): the last block's gather then
            # overlaps the head's backward instead of the norm's.
            after = self._step(nxt, step, phase)
            if (
                phase is Phase.BACKWARD
                and after is not None
                and after.slot not in (u.slot, nxt.slot)
                and after.slot.owner is None
                and not after.slot.busy
            ):
                self.gather(after, phase)

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
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = self._slot_next[phase].get(id(nxt))
        if nxt is not None:
            s = nxt.slot
            if s.owner is nxt or (not s.busy and s.owner in (None, u)):
                self.gather(nxt, phase)
        for big in self._early[phase].get(id(u), []):
            if phase is Phase.FORWARD or self._slot_user(big):
                self.gather(big, phase)

    def release(self, u: Unit) -> None:
        waiting_unit = u.slot.release(u)
        if waiting_unit is not None:
            assert isinstance(waiting_unit, Unit)
            phase = self.phase if self.phase is not Phase.IDLE else Phase.FORWARD
            self._issue_gather(waiting_unit, phase)

    def _issue_gather(self, u: Unit, phase: Phase) -> None:
        s = u.slot
        s.take(u)
        assert s.data is not None  # take() allocates a transient slot's storage
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
        _, j, k = self.comm.members("hpz")
        assert u.slot.data is not None  # still gathered: called before the slot is released
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
