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
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch import nn
from torch.autograd.function import BackwardCFunction
from torch.autograd.graph import saved_tensors_hooks
from torch.profiler import record_function

from layershard.buffers import GatherSlot, GradSlot
from layershard.collectives import Comm, Pending
from layershard.flat import FlatParam, ParamSlot
from layershard.precision import MixedPrecision
from layershard.waits import waiting

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
        self.private_views: list[torch.Tensor] | None = None  # see Schedule._gather_private
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
    def forward(ctx, schedule: Schedule, unit: Unit, use: int | None, anchor: torch.Tensor, *views):
        ctx.schedule, ctx.unit, ctx.use = schedule, unit, use
        outs = tuple(v.view_as(v) for v in views)
        frozen = [o for o, s in zip(outs, unit.param_slots) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.schedule.post_backward(ctx.unit, ctx.use, grads)
        return (None, None, None, None) + (None,) * len(grads)


class _Reached(torch.autograd.Function):
    """Identity; its node marks a path into a frozen unit (see ``Schedule._mark_inputs``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def _tensors(out, limit: int = 4096) -> list[torch.Tensor]:
    """The tensors in a unit's output, whatever holds them: containers, dataclasses, and objects
    of any class with a ``__dict__`` or ``__slots__`` (a small class holding tensors), each
    object once, at most ``limit`` objects. A tensor hidden where no walk finds it (a closure)
    is still covered: see ``Schedule._saved_tensor_hooks``."""
    found: list[torch.Tensor] = []
    seen: set[int] = set()
    stack = [out]
    while stack and len(seen) < limit:
        o = stack.pop()
        if isinstance(o, _ATOMS) or id(o) in seen:
            continue
        seen.add(id(o))
        if isinstance(o, torch.Tensor):
            found.append(o)
        elif isinstance(o, nn.Module):
            continue  # a module's weights are not its output
        elif isinstance(o, dict):
            stack.extend(o.values())
        elif isinstance(o, (tuple, list, set, frozenset)):
            stack.extend(o)
        else:
            fields = getattr(o, "__dict__", None)
            if isinstance(fields, dict):
                stack.extend(fields.values())
            for cls in type(o).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    stack.append(getattr(o, name, None))
    return found


def _dirty(u: Unit) -> bool:
    return u.trainable is not None and u.trainable.acc_dirty


@dataclass(frozen=True)
class _WeightView:
    """What a unit's forward saved of its gathered weights: where, not the tensor (see
    ``Schedule._push_saved_tensor_hooks``)."""

    offset: int
    shape: torch.Size
    stride: tuple[int, ...]


@dataclass
class _Use:
    """One forward run of a unit before its backward. ``nodes``: autograd nodes whose execution
    means the use's backward runs (its weights' ``_BindUnit`` node; the Python nodes that
    produced its outputs, such as a reentrant checkpoint's), as weak references."""

    unit: Unit
    nodes: list[weakref.ref] = field(default_factory=list)

    def reached(self) -> bool:
        """Will the backward pass in progress run this use's post-backward? (Called in it.)"""
        if not self.nodes:
            # Nothing recorded: a forward under no_grad inside a grad forward (checkpointed
            # from outside the unit's hooks), whose backward is a recompute the engine cannot
            # see coming. Count it as reached, as every rank does.
            return True
        alive = [n for n in (r() for r in self.nodes) if n is not None]  # gone: not reached
        return any(torch._C._will_engine_execute_node(n) for n in alive)


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
        self.full_weights_open = False  # inside ShardedModule.full_weights(): no forward
        self._n_reduced = 0  # reduce-scatters issued this backward: picks the next gradient slot
        self._callback_queued = False
        # A unit may run more than once before one backward (shared weights, or two forwards
        # before one backward): each run is a "use", numbered in forward order. Its weights are
        # gathered again for each use's backward, and its gradients reduced once per use.
        self._uses = 0
        self._use_of: dict[int, int] = {}  # id(unit) -> its current use (pre- to post-forward)
        self._forward_uses: dict[int, _Use] = {}  # uses since the last backward (grad forwards)
        self._bw_uses: set[int] = set()  # uses whose backward began (this backward)
        self._bw_units: set[int] = set()  # ids of units with a use whose backward began
        self._reduced: dict[int, Pending] = {}  # id(flat) -> its last reduction this backward
        # This backward's plan (see _plan_backward): units reduced at its end, in unit order, on
        # every rank (reached on some ranks only, or left in the no_sync accumulator), and the
        # units some ranks reach and others do not, whose weights are gathered at its start
        # into a buffer of their own: id(unit) -> (buffer, its gathers in flight).
        self._deferred: list[Unit] = []
        self._deferred_ids: set[int] = set()
        self._private: dict[int, tuple[torch.Tensor, list[Pending]]] = {}
        self._unreached: set[int] = set()
        self._hooks: list[tuple[Unit, saved_tensors_hooks]] = []  # pushed at pre-forward
        self._grad_forward = False  # the model's forward in progress records autograd graphs

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

    _in_backward = in_backward

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
        # A new forward: weights may have changed since the last one, and a forward or backward
        # that raised may have left state behind.
        self._pop_saved_tensor_hooks()
        self._free_grad_slots()
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
        if not self._in_backward() and not torch.is_grad_enabled():
            if self.root is not None:
                self.root.unbind()
            # No gather may still read a shard once forward returns: the caller may write the
            # shards next (a load, an edit). On CUDA this is a stream wait.
            self.quiesce()
        if not self._in_backward():
            self.phase = Phase.IDLE

    def quiesce(self) -> None:
        """Wait for every collective in flight that reads or writes a shard or a buffer. Every
        writer of shards (loads, ``full_weights(writeback=True)``) calls it first: on CUDA a
        gather's cast of the shard is queued on the comm stream and may not have run yet."""
        for u in self.all_units():
            u.slot.wait()
        for gs in self.grad_slots:
            gs.wait()

    def pre_forward(self, u: Unit, args: tuple = (), kwargs: dict | None = None):
        if self._in_backward():  # a recompute of a checkpoint that calls the module itself
            self._enter_backward()
            self._bw_units.add(id(u))
            self._ensure_for_backward(u)
            self._bind(u, None)
            return
        if self._recorded is not None:
            self._recorded.append(u)
        self._uses += 1
        use = self._use_of[id(u)] = self._uses
        grad = torch.is_grad_enabled()
        if self._grad_forward:  # a backward may follow (a no-grad unit inside: a checkpoint's)
            self._forward_uses[use] = _Use(u)
        u.open_span("forward")
        self.ensure(u, Phase.FORWARD)
        self._bind(u, use)
        self.gather_next(u, self._next, Phase.FORWARD)
        if grad and u.gather_in_backward:
            self._push_saved_tensor_hooks(u, use)
        if grad and u.trainable is None and use in self._forward_uses:
            return self._mark_inputs(self._forward_uses[use], args, kwargs or {})
        return None

    @staticmethod
    def _mark_inputs(record: _Use, args: tuple, kwargs: dict):
        """A frozen unit has no ``_BindUnit`` node that tells whether a backward reaches it:
        pass the input tensors that require grad through an identity node instead, which the
        backward executes exactly when it reaches the unit (its gradients flow to its inputs)."""
        marked = False

        def mark(x):
            nonlocal marked
            if isinstance(x, torch.Tensor) and x.requires_grad:
                y = _Reached.apply(x)
                record.nodes.append(weakref.ref(y.grad_fn))
                marked = True
                return y
            return x

        new_args = tuple(mark(a) for a in args)
        new_kwargs = {k: mark(v) for k, v in kwargs.items()}
        return (new_args, new_kwargs) if marked else None

    def post_forward(self, u: Unit, out):
        use: int | None = None  # a checkpoint's recompute: part of a use already in backward
        if not self._in_backward():
            self._pop_saved_tensor_hooks(u)
            use = self._use_of.get(id(u))
        u.unbind()
        if use is not None:
            u.close_span()
            if u.secondary is not None:  # also under no_grad: a reentrant checkpoint's forward
                self._keep_secondary(u)
            self.release(u)
            self.refill(u, self._next, Phase.FORWARD)
        if torch.is_grad_enabled():
            record = self._forward_uses.get(use) if use is not None else None
            for t in _tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda g, u=u, use=use: self.begin_backward_use(u, use))
                    if record is not None and isinstance(t.grad_fn, BackwardCFunction):
                        record.nodes.append(weakref.ref(t.grad_fn))  # a checkpoint's, say
        return None

    # Note: what starts a unit's backward. Its weights must be in its slot before any of its
    # backward ops reads them, whatever its forward returned. Three triggers, whichever fires
    # first (``begin_backward_use`` runs once per use and backward):
    #   1. the gradient of any tensor in its output (``_tensors`` walks containers and objects);
    #   2. the first tensor its forward saved for backward being unpacked (``saved_tensors_hooks``
    #      around the forward): every weight a backward op reads is such a tensor, so this one
    #      fires before the first read even when no output tensor was found;
    #   3. a checkpoint's recompute of its forward (``checkpoint_forward`` and ``pre_forward``).
    # post_backward checks that it happened: a miss raises instead of computing with the weights
    # of whichever unit took the slot since.

    def _push_saved_tensor_hooks(self, u: Unit, use: int) -> None:
        if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
            return  # disabled by the caller (functorch transforms): triggers 1 and 3 remain
        outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
        outer_pack, outer_unpack = outer if outer is not None else (None, None)
        slot_storage = u.slot.alias.untyped_storage().data_ptr()

        def pack(t: torch.Tensor):
            if t.untyped_storage().data_ptr() == slot_storage:  # a view of the unit's weights
                return _WeightView(int(t.storage_offset()), t.shape, t.stride())
            return t if outer_pack is None else outer_pack(t)

        def unpack(x):
            if self._in_backward() and use not in self._bw_uses:
                self.begin_backward_use(u, use)
            if isinstance(x, _WeightView):
                return self._backward_weights(u).as_strided(x.shape, x.stride, x.offset)
            return x if outer_unpack is None else outer_unpack(x)

        hooks = saved_tensors_hooks(pack, unpack)
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
            if self._in_backward():
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
            # grad, so that a reentrant recompute's graph ends in a _BindUnit (post-backward).
            with torch.enable_grad():
                self._bind(u, use)
        if id(u) not in self._private:  # a divergent unit's events issue no collective
            self.gather_next(u, self._prev, Phase.BACKWARD)

    pre_backward = begin_backward_use  # the name the engine's docs and profiles use

    def _ensure_for_backward(self, u: Unit) -> None:
        if id(u) in self._private:  # gathered at the start of backward, on every rank
            for p in self._private[id(u)][1]:
                p.wait()
        else:
            self.ensure(u, Phase.BACKWARD)

    def _backward_weights(self, u: Unit) -> torch.Tensor:
        """The buffer holding ``u``'s gathered weights in this backward (laid out as in its
        slot): its slot, or its own buffer when only some ranks reach it."""
        private = self._private.get(id(u))
        return u.slot.alias if private is None else private[0]

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
            self.reduce(u, grads)

    def _enter_backward(self) -> None:
        self.phase = Phase.BACKWARD
        if not self._callback_queued:
            self._callback_queued = True
            self._plan_backward()
            torch.autograd.Variable._execution_engine.queue_callback(self.end_backward)

    # Note: every rank issues the same collectives in the same order. A unit's backward gather
    # and reduction are collectives, issued from its backward's hooks, which run on the ranks
    # whose loss depends on the unit: not always every rank (an auxiliary head in one rank's
    # loss). So at the start of each synchronized backward the ranks agree, with one small
    # all-reduce, on how many uses of each unit every rank's backward will reach (autograd
    # knows which nodes the pass in progress will execute). Units reached as often everywhere
    # are gathered and reduced by their hooks, as always. For the others ("divergent"), every
    # rank gathers the weights right away, in unit order, into a buffer of their own (the
    # unpack hook points the weights their forward saved at it), their hooks issue no
    # collective and touch no slot, and their gradients accumulate and are reduced at the end
    # of backward, in unit order, with zeros from the ranks that did not reach them. Gradients
    # a no_sync backward left in the accumulator of a unit this backward does not reach go the
    # same way. So every collective is issued either by an event every rank sees, or at the
    # start or end of backward.

    def _plan_backward(self) -> None:
        self._deferred, self._deferred_ids, self._private, self._unreached = [], set(), {}, set()
        gathers = not self.comm.sharding.keep_gathered
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
            [[reached[id(u)], -reached[id(u)], int(_dirty(u))] for u in units],
            dtype=torch.int64,
        ).reshape(-1, 3)
        if self.comm.control_size > 1 and units:
            self.comm.stats.record("all_reduce", "backward", flags.numel() * 8, "all")
            with waiting("agreement on the units this backward reaches"):
                dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.comm.control)
        for u, (most, least, dirty) in zip(units, flags.tolist()):
            divergent = most != -least
            if (
                u.trainable is not None
                and not self.no_sync
                and (divergent or (most == 0 and dirty))
            ):
                self._deferred.append(u)
                self._deferred_ids.add(id(u))
            if divergent and u.gather_in_backward and gathers and u is not self.root:
                self._gather_private(u)
            if most == 0:  # no rank's backward reaches it: nothing to prefetch for it
                self._unreached.add(id(u))

    def _gather_private(self, u: Unit) -> None:
        """All-gather ``u``'s weights for its backward into a buffer of its own (every rank)."""
        buf = torch.empty(u.gather_numel, dtype=u.slot.data.dtype, device=u.slot.data.device)
        pending = []
        for i, (f, off) in enumerate(zip(u.flats, u.flat_offsets)):
            out = buf[off : off + f.padded_numel]
            if u.secondary is not None:  # within the K ranks of reshard_after_forward=K
                pending.append(
                    self.comm.all_gather(out, u.secondary[i], "backward", u.name, over="hpz")
                )
            else:
                pending.append(self.comm.all_gather(out, f.shard, "backward", u.name))
        self._private[id(u)] = (buf, pending)
        u.private_views = [
            v
            for f, o in zip(u.flats, u.flat_offsets)
            for v in f.views(buf.data[o : o + f.padded_numel])
        ]

    def end_backward(self) -> None:
        """Nothing is in flight once backward returns: the optimizer, ``clip_grad_norm_`` and a
        checkpoint see the final gradient slices and no gather still reads a shard."""
        deferred, self._deferred, self._deferred_ids = self._deferred, [], set()
        self._unreached = set()
        for u in deferred:  # every rank, in unit order (see _plan_backward)
            self._reduce_now(u, [])
        for _, pending in self._private.values():
            for p in pending:
                p.wait()
        for u in self.all_units():
            u.private_views = None
        self._private = {}
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
        self._forward_uses.clear()

    # ---- gather ----------------------------------------------------------------------------------

    def _bind(self, u: Unit, use: int | None) -> None:
        full_views = u.private_views if u.private_views is not None else u.full_views
        if torch.is_grad_enabled() and u.trainable is not None:
            views = _BindUnit.apply(self, u, use, u.anchor, *full_views)
            record = self._forward_uses.get(use) if use is not None else None
            if record is not None and views and views[0].grad_fn is not None:
                record.nodes.append(weakref.ref(views[0].grad_fn))
            u.bind(views)
        else:
            u.bind(full_views)

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
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = step.get(id(nxt))
        return nxt

    def _slot_user(self, u: Unit) -> bool:
        """Does ``u``'s backward take its gather slot? (Not an embedding, nor a divergent unit.)"""
        return u.gather_in_backward and id(u) not in self._private and id(u) not in self._unreached

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
        while nxt is not None and phase is Phase.BACKWARD and not self._slot_user(nxt):
            nxt = self._slot_next[phase].get(id(nxt))
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
        """``u``'s backward ended with ``grads`` (one per parameter, None where it got none):
        reduce them now, or add them to the fp32 accumulator (``no_sync``, or a unit this
        backward reduces at its end)."""
        f = u.trainable
        if f is None:
            return
        pairs = [  # (flat offset, numel, gradient) of the trainable slots, which come first
            (s.offset, s.numel, g.reshape(-1))
            for s, g in zip(f.slots, grads[: len(f.slots)])
            if g is not None
        ]
        deferred = self.no_sync or id(u) in self._deferred_ids
        if deferred or f.acc_dirty:
            acc = self._accumulator(f)
            if pairs:
                torch._foreach_add_([acc[o : o + n] for o, n, _ in pairs], [g for *_, g in pairs])
            f.acc_dirty = True
            if deferred:
                return
            pairs = []  # the accumulator holds them (and what no_sync backwards left)
        self._reduce_now(u, pairs)

    def _reduce_now(self, u: Unit, pairs: list[tuple[int, int, torch.Tensor]]) -> None:
        """Reduce ``pairs``, or the accumulator when it holds something (a deferred unit that
        this rank did not reach: zeros, as every rank takes part)."""
        f = u.trainable
        assert f is not None
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

    def _free_grad_slots(self) -> None:
        """Wait for every reduce-scatter, then free the gradient slots until the next backward."""
        self.comm.finish()
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
