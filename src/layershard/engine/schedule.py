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
themselves are the ``Reducer``'s; what begins and ends a unit's backward is in backward_hooks.py.

The root unit (tied and root-owned parameters) is bound at the model's pre-forward and stays
gathered until the end of its backward (or of the forward, without grad). Outside its forward a
module's weight attributes are unbound: ``module.weight`` is then the rank's 1-D fp32 slice
registered under that name (what ``parameters()`` yields), never a view of a gather buffer that
another unit may have refilled. ``ShardedModule.full_weights()`` gives full weights.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial

import torch
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import saved_tensors_hooks

from layershard.engine.backward_hooks import (
    BindUnit,
    UseLog,
    mark_inputs,
    output_tensors,
    weight_saving_hooks,
)
from layershard.engine.backward_pass import BackwardPass, plan_backward
from layershard.engine.block_runs import BlockRuns
from layershard.engine.buffers import Spare
from layershard.engine.collectives import Comm, profiled
from layershard.engine.order import Order, Phase
from layershard.engine.precision import MixedPrecision
from layershard.engine.reducer import Reducer
from layershard.engine.units import Unit

log = logging.getLogger("layershard")


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
        self.order = Order(list(units))  # forward execution order, learned on first forward
        self.reducer.plan_tail(units[::-1], root)
        self._recorded: list[Unit] | None = []
        self.phase = Phase.IDLE
        self.no_sync = False
        self.full_weights_open = False  # inside ShardedModule.full_weights(): no forward
        self._grad_forward = False  # the model's forward in progress records autograd graphs
        # A unit may run more than once before one backward (shared weights, or two forwards
        # before one backward): each run is a "use", numbered in forward order. Its weights are
        # gathered again for each use's backward, and its gradients reduced once per use.
        self._uses = 0
        self._use_of: dict[int, int] = {}  # id(unit) -> its current use (pre- to post-forward)
        self.uses = UseLog()  # the uses a backward may still reach
        self.bw: BackwardPass | None = None  # the backward in progress (backward_pass.py)
        self._hooks: list[tuple[Unit, saved_tensors_hooks]] = []  # pushed at pre-forward
        self.block_runs = BlockRuns()  # a unit of several blocks runs them in order

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
            first, last = u.modules[0], u.modules[-1]  # the same module but for several blocks
            handles.append(
                first.register_forward_pre_hook(
                    lambda m, a, kw, u=u: self.pre_forward(u, a, kw), with_kwargs=True
                )
            )
            for i, m in enumerate(u.modules[1:], 1):
                handles.append(m.register_forward_pre_hook(partial(self._later_block, u, i)))
            handles.append(
                last.register_forward_hook(lambda m, a, out, u=u: self.post_forward(u, out))
            )
            # A forward that raised ran no post-forward: leave its saved-tensor hooks anyway,
            # or they would outlive it and see every later forward, of any model. (One of a
            # unit's first blocks raising leaves them to the model's hook below.)
            handles.append(
                last.register_forward_hook(
                    lambda m, a, out, u=u: self._pop_saved_tensor_hooks(u), always_call=True
                )
            )
        # Once the model's forward returned or raised, no unit's forward is open.
        handles.append(
            model.register_forward_hook(
                lambda m, a, out: self._pop_saved_tensor_hooks(), always_call=True
            )
        )
        return handles

    def _later_block(self, u: Unit, i: int, module: nn.Module, args: tuple) -> None:
        """Block ``i`` > 0 of a unit of several blocks begins (block_runs.py)."""
        if self.in_backward():  # a recompute that calls the module (as pre_forward's)
            self.pre_forward(u)
        else:
            self.block_runs.check(u, i)

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
            for u in self.all_units():
                u.check_requires_grad()
        # A new forward: weights may have changed since the last one, and a forward or backward
        # that raised may have left state behind.
        self._drop_failed_pass()
        self._pop_saved_tensor_hooks()
        self.block_runs.reset()
        self.reducer.finish()
        for u in self.all_units():
            u.unbind()
            u.slot.reset()
            if torch.is_grad_enabled():
                for f in u.trainables:
                    f.release_grad()
        self.phase = Phase.FORWARD
        self._grad_forward = torch.is_grad_enabled()
        if self._grad_forward:
            self.uses.new_forward()
        if self.comm.wire is not None and self.comm.active:
            self.comm.wire.refresh(self.comm)  # fp8 scales of the weights as they are now
        if self.root is not None:
            self._issue_gather(self.root, Phase.FORWARD)
            self.root.slot.wait()
            self._bind(self.root, None)
        first: list[Unit] = []  # every slot is free: start the gathers of the first two units
        for u in self.order.units:  # that take different slots
            if len(first) == 2:
                break
            if all(v.slot is not u.slot for v in first):
                first.append(u)
                self.gather(u, Phase.FORWARD)

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
            self.block_runs.finish()  # a unit of several blocks left open raises

    def quiesce(self) -> None:
        """Wait for every collective in flight that reads or writes a shard or a buffer. Every
        writer of shards (loads, ``full_weights(writeback=True)``) calls it first: on CUDA a
        gather's cast of the shard is queued on the comm stream and may not have run yet. Outside
        a backward, a backward that raised is over: its state goes (backward_pass.py)."""
        if not self.in_backward():
            self._drop_failed_pass()
        for u in self.all_units():
            u.slot.wait()
        self.reducer.quiesce()

    def _drop_failed_pass(self) -> None:
        """The backward in progress raised (its end never ran): wait for what it has in flight,
        and drop it with the gradients it was accumulating (the step it belonged to is void)."""
        bw, self.bw = self.bw, None
        if bw is None:
            return
        log.warning(
            "layershard: the last backward raised before its end; its gradients and what no_sync "
            "accumulated before it are dropped (zero the gradients and redo the step)"
        )
        bw.abandon()
        self._settle()
        for u in self.all_units():
            for f in u.trainables:
                f.drop_accumulated()

    def pre_forward(self, u: Unit, args: tuple = (), kwargs: dict | None = None):
        if self.in_backward():  # a recompute of a checkpoint that calls the module itself
            bw = self.backward_pass()
            bw.begin(u, None)
            self._ensure_for_backward(u, bw)
            self._bind(u, None)
            return None
        self.block_runs.enter(u, self._grad_forward, self.phase is Phase.FORWARD)
        if self._recorded is not None:
            self._recorded.append(u)
        self._uses += 1
        use = self._use_of[id(u)] = self._uses
        grad = torch.is_grad_enabled()
        if self._grad_forward:  # a backward may follow (a no-grad unit inside: a checkpoint's)
            self.uses.add(use, u)
        u.open_span("forward")
        self.ensure(u, Phase.FORWARD)
        self._bind(u, use)
        self.gather_next(u, Phase.FORWARD)
        if grad and u.gather_in_backward:
            self._push_saved_tensor_hooks(u, use)
        record = self.uses.get(use) if grad and not u.trainables else None
        if record is not None:
            return mark_inputs(record, args, kwargs or {})
        return None

    def post_forward(self, u: Unit, out):
        use: int | None = None  # a checkpoint's recompute: part of a use already in backward
        self.block_runs.leave(u)
        if not self.in_backward():
            self._pop_saved_tensor_hooks(u)
            use = self._use_of.get(id(u))
        u.unbind()
        if use is not None:
            u.close_span()
            if u.secondary is not None:  # also under no_grad: a reentrant checkpoint's forward
                self._keep_secondary(u)
            self.release(u)
            self.refill(u, Phase.FORWARD)
            if u is self.order.last:
                self._between_passes(u)
        if torch.is_grad_enabled():
            record = self.uses.get(use)
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
            bw = self.bw
            if (bw is None or use not in bw.began_uses) and self.in_backward():
                self.begin_backward_use(u, use)

        hooks = weight_saving_hooks(
            u.slot.alias, u.view_keys, begin, lambda: self.backward_weights(u)
        )
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
        bw = self.backward_pass()
        if not bw.begin(u, use):
            return
        if id(u) in self.reducer.tail:  # no reduction into the gradient slots comes any more
            self.reducer.release_slots()
        if not u.slot.transient:
            # Between large units in backward (a head, blocks, an embedding), nothing of a large
            # unit is kept for the next: with the loss outside the model the blocks' backward
            # is the peak, and a head-sized spare block held through it made layershard's peak
            # 1.03x FSDP2's (issue 34). Cost: the embedding's scratch is allocated anew. A unit
            # gathered into the shared slots for its backward (a block) also waits for a large
            # unit's reduce-scatter still in flight, freeing its gradient and scratch (two
            # head-sized blocks on gloo), which otherwise lived through the last block's
            # backward: the peak of the EP bench, at 1.03x transformers' EP (issue 32). The
            # wait overlaps that block's own gather, issued with the reduce-scatter when the
            # head's backward ended; the small units between (the final norm) do not wait.
            self.reducer.release_own(wait=u.gather_in_backward and u.slot.in_turns)
            self.spare.clear()
        u.open_span("backward")
        if u.gather_in_backward:
            self._ensure_for_backward(u, bw)
            # Bound for the unit's backward: a checkpointed forward recomputed now reads its
            # weights from the attributes (HF checkpoints ``forward``, outside the hooks). Under
            # grad, so that a reentrant recompute's graph ends in a BindUnit (post-backward).
            with torch.enable_grad():
                self._bind(u, use)
        # A large unit (a head) prefetches the next unit when its backward ends, not before:
        # its backward (the logits' gradient, its weights and their gradient alive) is where a
        # large-vocabulary step peaks, and a block's weights prefetched into it held 10.5 MiB
        # more than transformers' EP there (issue 32). Cost: that one gather per step overlaps
        # the head's reduce-scatter, not its backward.
        if id(u) not in bw.private and not u.slot.transient:  # a divergent unit issues nothing
            self.comm.advance(routed_only=True)
            self.gather_next(u, Phase.BACKWARD)

    def _ensure_for_backward(self, u: Unit, bw: BackwardPass) -> None:
        private = bw.private.get(id(u))
        if private is not None:  # gathered at the start of backward, on every rank
            private.wait()
        else:
            self.ensure(u, Phase.BACKWARD)

    def backward_weights(self, u: Unit) -> tuple[list[torch.Tensor] | None, torch.Tensor]:
        """The parameter views (None: not kept) and the buffer holding ``u``'s gathered weights
        in this backward (laid out as in its slot): its slot, or its own buffer when only some
        ranks reach it."""
        private = self.bw.private.get(id(u)) if self.bw is not None else None
        if private is not None:
            return private.views, private.buffer
        assert u.slot.alias is not None  # gathered: its backward began
        return (None if u.slot.transient else u.full_views), u.slot.alias

    def post_backward(self, u: Unit, use: int | None, grads: tuple) -> None:
        bw = self.backward_pass()
        # The root unit stays gathered from the model's forward to the end of its backward.
        began = u is self.root or bw.began(u, use)
        private = id(u) in bw.private
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
            self.refill(u, Phase.BACKWARD)
            if u.slot.transient:  # deferred from its backward's start (begin_backward_use)
                self.gather_next(u, Phase.BACKWARD)
        with profiled(f"layershard::reduce[{u.name}]"):
            self.reducer.reduce(u, grads, later=self.no_sync or bw.defers(u))

    def backward_pass(self) -> BackwardPass:
        """The backward in progress, planned when its first hook fires: the ranks agree on the
        units it reaches (backward_pass.py); ``end_backward`` runs when autograd is done."""
        self.phase = Phase.BACKWARD
        if self.bw is None:
            units, no_sync = self.all_units(), self.no_sync
            self.bw = plan_backward(units, self.uses, self.comm, no_sync, self.root)
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)
        return self.bw

    def end_backward(self) -> None:
        """Nothing is in flight once backward returns: the optimizer, ``clip_grad_norm_`` and a
        checkpoint see the final gradient slices and no gather still reads a shard."""
        bw, self.bw = self.bw, None
        if bw is not None:
            bw.finish(self.reducer.reduce_accumulated)  # every rank, in unit order
        self._settle()

    def _settle(self) -> None:
        """Nothing computes any more. A frozen unit (no post-backward) or a backward that needed
        no weight gradients (autograd.grad of an input) left its slot busy, which a second
        backward through the same graph (retain_graph) would trip over."""
        for u in self.all_units():
            u.slot.settle()
            u.close_span()
            u.unbind()
        self.reducer.finish()
        self.spare.clear()
        self.phase = Phase.IDLE

    # ---- gather ----------------------------------------------------------------------------------

    def _bind(self, u: Unit, use: int | None) -> None:
        private = self.bw.private.get(id(u)) if self.bw is not None else None
        full_views = private.views if private is not None else u.full_views
        if torch.is_grad_enabled() and u.trainables:
            views = BindUnit.apply(self, u, use, u.anchor, *full_views)
            record = self.uses.get(use) if self.phase is Phase.FORWARD else None
            if record is not None and views:
                record.note(views[0].grad_fn)
            u.bind(views)
        else:
            u.bind(full_views)

    def ensure(self, u: Unit, phase: Phase) -> None:
        """Block the compute stream until ``u``'s weights are in its slot; occupy it."""
        s = u.slot
        if s.owner is not u:
            if phase is Phase.BACKWARD and self.bw and id(s.owner) in self.bw.began_units:
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

    def _step(self, u: Unit | None, phase: Phase) -> Unit | None:
        """The unit after ``u`` in the phase's execution order, past units whose backward takes
        no slot."""
        step = self.order.after[phase]
        nxt = step.get(id(u)) if u is not None else None
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = step.get(id(nxt))
        return nxt

    def _slot_user(self, u: Unit) -> bool:
        """Does ``u``'s backward take its gather slot? (backward_pass.py)"""
        return self.bw.takes_slot(u) if self.bw is not None else u.gather_in_backward

    def gather_next(self, u: Unit, phase: Phase) -> None:
        """Make sure the next unit's gather is on its way (normally issued a unit earlier)."""
        nxt = self._step(u, phase)
        if nxt is not None:
            self.gather(nxt, phase)
            # In backward the unit after it too, when its slot was given back between the
            # passes and the next is a small unit (the final norm): the last block's gather then
            # overlaps the head's reduce-scatter and the norm's backward, not only the norm's.
            # Not after a block: the unit after it has that block's backward to overlap, and
            # from the norm's backward this regrew the other slot under the head's
            # reduce-scatter buffers, which the last block's backward waits for (issue 32).
            after = self._step(nxt, phase)
            if (
                phase is Phase.BACKWARD
                and not nxt.slot.in_turns
                and after is not None
                and after.slot not in (u.slot, nxt.slot)
                and after.slot.owner is None
                and not after.slot.busy
            ):
                self.gather(after, phase)

    def refill(self, u: Unit, phase: Phase) -> None:
        """``u`` released its slot: start the gathers of the next unit that takes that slot and
        of the unit after next if its slot is free (its own slot: grad_op, no_shard, a small
        unit), never evicting weights a sooner unit waits for."""
        after = self._step(self._step(u, phase), phase)
        if after is not None and after.slot is not u.slot:
            s = after.slot
            if s.owner is after or (not s.busy and s.owner is None):
                self.gather(after, phase)
        # The slot's next user: usually the unit after next; further when a small unit with a
        # slot of its own comes between (last block, norm, head: the head's gather overlaps the
        # last block) or when the first two units share a slot.
        slot_next = self.order.slot_next[phase]
        nxt = slot_next.get(id(u))
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = slot_next.get(id(nxt))
        if nxt is not None:
            s = nxt.slot
            if s.owner is nxt or (not s.busy and s.owner in (None, u)):
                self.gather(nxt, phase)
        for big in self.order.early[phase].get(id(u), []):
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
            else:  # in the wire dtype when weights travel quantized
                p = self.comm.gather_weights(out, f, phase.value, u.name)
            s.gathering(p)

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
            self.order = Order(rec)
            self.reducer.plan_tail(rec[::-1], self.root)
        else:
            log.warning(
                "layershard: units did not run once each in the first forward; prefetching in "
                "registration order (correct, but with less overlap)"
            )
