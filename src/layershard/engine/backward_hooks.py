"""What tells the schedule that a unit's backward begins, ends, or will run at all.

- ``BindUnit``: the autograd Function whose outputs are a unit's gathered weights. Autograd calls
  its backward once, with every weight gradient of the unit, after the unit's whole backward: that
  is the unit's post-backward.
- ``output_tensors``: the tensors of a unit's output, whatever holds them; a hook on each begins
  the unit's backward when the first gradient arrives.
- ``WeightView``: what a unit's forward saved of its weights, through the saved-tensor hooks that
  also begin its backward (``Schedule`` installs them around the forward).
- ``Use``, ``UseLog`` and ``Reached``: one forward run of a unit, the runs a backward may still
  reach, and the autograd nodes whose execution means that a run's backward is in the pass in
  progress (the ranks agree on these, see ``backward_pass.py``).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.autograd.graph import saved_tensors_hooks

from layershard.engine import dtensor
from layershard.engine.float8 import SavedFloat8

if TYPE_CHECKING:
    from layershard.engine.units import Unit


class BindUnit(torch.autograd.Function):
    """Forward: the unit's gathered weights as graph tensors. Backward: the unit's post-backward
    (``owner.post_backward(unit, use, grads)``)."""

    @staticmethod
    def forward(ctx, owner: Any, unit: Unit, use: int | None, anchor: torch.Tensor, *views):
        ctx.owner, ctx.unit, ctx.use = owner, unit, use
        outs = tuple(v.view_as(v) for v in views)
        frozen = [o for o, s in zip(outs, unit.param_slots) if not s.requires_grad]
        if frozen:
            ctx.mark_non_differentiable(*frozen)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        ctx.owner.post_backward(ctx.unit, ctx.use, grads)
        return (None, None, None, None) + (None,) * len(grads)


class Reached(torch.autograd.Function):
    """Identity; its node marks a path into a frozen unit (see ``mark_inputs``)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor) -> torch.Tensor:
        return g


_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device)


def output_tensors(out: Any, limit: int = 4096) -> list[torch.Tensor]:
    """The tensors in a unit's output, whatever holds them: containers, dataclasses, and objects
    of any class with a ``__dict__`` or ``__slots__`` (a small class holding tensors), each
    object once, at most ``limit`` objects. A tensor hidden where no walk finds it (a closure)
    is still covered by the saved-tensor hooks."""
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


class WeightView:
    """What a unit's forward saved of its gathered weights: where in the unit's buffer, not the
    tensor, so that its backward reads them wherever they are gathered then. ``index``: which of
    the unit's parameter views it is (most ops save the weight itself), -1 for another view of
    the buffer (a transpose), rebuilt from its strides. One is made per weight an op saves, in
    every forward: a plain class, not a dataclass (half the cost)."""

    __slots__ = ("offset", "shape", "stride", "index")

    def __init__(self, offset: int, shape: torch.Size, stride: tuple[int, ...], index: int):
        self.offset, self.shape, self.stride, self.index = offset, shape, stride, index

    def of(self, views: list[torch.Tensor] | None, buffer: torch.Tensor) -> torch.Tensor:
        """The saved weight in this backward's ``buffer``, whose parameter views are ``views``
        (None: make it)."""
        if self.index >= 0 and views is not None:
            return views[self.index]
        return buffer.as_strided(self.shape, self.stride, self.offset)


class SavedDTensor:
    """A ``DTensor`` over a view of a unit's gathered weights that its forward saved (a
    tensor-parallel weight, engine/dtensor.py): the view as a ``WeightView``, and what wraps
    it again (``TPInfo``)."""

    __slots__ = ("view", "spec")

    def __init__(self, view: WeightView, spec: dtensor.TPInfo):
        self.view, self.spec = view, spec


@dataclass
class Use:
    """One forward run of a unit before its backward. ``nodes``: autograd nodes whose execution
    means the use's backward runs (its weights' ``BindUnit`` node; the Python nodes that produced
    its outputs, such as a reentrant checkpoint's; ``Reached`` nodes on a frozen unit's
    inputs), as weak references: a graph that is gone will not run."""

    unit: Unit
    nodes: list[weakref.ref] = field(default_factory=list)

    def note(self, node: Any) -> None:
        if node is not None:
            self.nodes.append(weakref.ref(node))

    def alive(self) -> bool:
        """Does a node of its graph still exist (a backward may still reach it)?"""
        return any(r() is not None for r in self.nodes)

    def reached(self) -> bool:
        """Will the backward pass in progress run this use's backward? (Called inside it.)"""
        if not self.nodes:
            # Nothing recorded: a forward under no_grad inside a grad forward (checkpointed
            # from outside the unit's hooks), whose backward is a recompute the engine cannot
            # see coming; or a frozen unit whose inputs need no gradient. Count it as reached,
            # as every rank does.
            return True
        alive = [n for n in (r() for r in self.nodes) if n is not None]
        return any(torch._C._will_engine_execute_node(n) for n in alive)


class UseLog:
    """The uses a backward may reach: one ``Use`` per unit run in a forward that records a graph,
    by use number. Kept while its graph may still run: at each such forward the log forgets the
    uses whose nodes are all gone, and those with no node from earlier forwards (nothing tells
    whether their graph lives; every rank counts them alike, so forgetting them changes no
    agreement). So an evaluation loop that keeps gradients on holds one forward's records, not
    one per forward."""

    def __init__(self) -> None:
        self._uses: dict[int, Use] = {}

    def new_forward(self) -> None:
        self._uses = {k: u for k, u in self._uses.items() if u.alive()}

    def add(self, use: int, unit: Unit) -> Use:
        record = self._uses[use] = Use(unit)
        return record

    def get(self, use: int | None) -> Use | None:
        return None if use is None else self._uses.get(use)

    def __iter__(self):
        return iter(list(self._uses.values()))

    def __len__(self) -> int:
        return len(self._uses)


def mark_inputs(record: Use, args: tuple, kwargs: dict):
    """A frozen unit has no ``BindUnit`` node that tells whether a backward reaches it: pass its
    input tensors that require grad through an identity node instead, which the backward
    executes exactly when it reaches the unit (its gradients flow to its inputs). Returns the
    new ``(args, kwargs)``, or None when no input requires grad."""
    marked = False

    def mark(x):
        nonlocal marked
        if isinstance(x, torch.Tensor) and x.requires_grad:
            y = Reached.apply(x)
            record.note(y.grad_fn)
            marked = True
            return y
        return x

    new_args = tuple(mark(a) for a in args)
    new_kwargs = {k: mark(v) for k, v in kwargs.items()}
    return (new_args, new_kwargs) if marked else None


def weight_saving_hooks(
    weights: torch.Tensor,
    keys: dict[tuple, int],
    begin: Callable[[], None],
    backward_weights: Callable[[], tuple[list[torch.Tensor] | None, torch.Tensor]],
) -> saved_tensors_hooks | None:
    """Saved-tensor hooks for a unit's forward (trigger 2 in ``Schedule``'s note on what begins
    a unit's backward): a view of the unit's gathered ``weights`` is saved as a ``WeightView``
    (``keys``: its parameter views, ``flat.view_keys``) and read back from ``backward_weights()``,
    the parameter views and buffer of this backward; every unpack first calls ``begin()``.
    Composes with the hooks already active (``save_on_cpu``, say). None when the caller disabled
    saved-tensor hooks (functorch transforms): the other triggers remain."""
    if not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        return None
    outer = torch._C._autograd._top_saved_tensors_default_hooks(False)
    outer_pack, outer_unpack = outer if outer is not None else (None, None)
    # A view of the weights is a tensor whose data lies in their buffer (no other live tensor's
    # does), of their dtype: an address comparison, cheaper than asking for each tensor's
    # storage (every tensor the unit's forward saves comes here).
    lo, size, dtype = weights.data_ptr(), weights.element_size(), weights.dtype
    hi = lo + weights.numel() * size

    def pack(t: torch.Tensor):
        p = t.data_ptr()
        if lo <= p < hi and t.dtype == dtype:
            key = ((p - lo) // size, t.shape, t.stride())
            return WeightView(*key, keys.get(key, -1))
        if type(t) is not torch.Tensor and (f8 := SavedFloat8.of(t, lo, hi)) is not None:
            return f8  # a Float8Linear's weight over the gathered bytes (engine/float8.py)
        # a DTensor (a subclass: no data of its own) is a weight's when its local tensor is a
        # view of them
        if type(t) is not torch.Tensor and (split := dtensor.split_dtensor(t)) is not None:
            inner, spec = split
            q = inner.data_ptr()
            if lo <= q < hi and inner.dtype == dtype:
                key = ((q - lo) // size, inner.shape, inner.stride())
                return SavedDTensor(WeightView(*key, keys.get(key, -1)), spec)
        # Never ``t`` itself: when ``t`` is an output of the op that saves it, its grad_fn is
        # that op's node, which would then hold itself through this object, and a graph no
        # backward runs (or one kept with retain_graph) would never be freed. Autograd puts
        # the grad_fn back on what unpack returns.
        return t.detach() if outer_pack is None else outer_pack(t)

    def unpack(x):
        begin()
        if type(x) is WeightView:
            return x.of(*backward_weights())
        if type(x) is SavedDTensor:
            return dtensor.wrap(x.spec, x.view.of(*backward_weights()))
        if type(x) is SavedFloat8:
            return x.of_buffer(backward_weights()[1])
        return x if outer_unpack is None else outer_unpack(x)

    return saved_tensors_hooks(pack, unpack)
