"""Measuring on CPU what ``plan.memory`` predicts for activations, with two of torch's tools.

- ``saved_bytes_by_module``: saved-tensor accounting (``torch.autograd.graph.saved_tensors_hooks``).
  Every tensor autograd keeps for backward passes through the pack hook; counting the unique
  storages (a view of a saved tensor costs nothing more) while a module runs gives exactly the
  bytes that module adds to the backward's memory, attributable to one block, with no allocator
  rounding, transients or outputs mixed in. It cannot see what autograd keeps by other means: a
  non-reentrant checkpoint's own inputs, held by its closure.
- ``LiveMemory``: torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``), a dispatch
  mode that follows every tensor's storage from its creation to its release (CPU: exact bytes).
  The bytes alive when a module starts its forward are everything the forward keeps, however it
  is kept (checkpoint inputs too); its peak includes transients (the loss's gradients).

Both are deterministic: the same model and input give the same bytes on every run.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn


def saved_bytes_by_module(
    model: nn.Module, modules: dict[str, nn.Module], run: Callable[[], Any]
) -> dict[str, int]:
    """Bytes of the unique storages autograd saves while each of ``modules`` runs its forward
    during ``run()``, keyed as ``modules``, plus ``"shared"``: storages saved by more than one
    of them (e.g. RoPE tables every block multiplies by), and ``"outside"``: storages saved
    outside all of them (e.g. the final norm and the loss). Parameters and buffers of ``model``
    are not counted. ``run()``'s result is returned under no key; its graph is freed."""
    skip = {t.untyped_storage().data_ptr() for t in _tensors(model)}
    owners: dict[int, set[str]] = {}
    nbytes: dict[int, int] = {}
    keep: list[torch.UntypedStorage] = []  # no address is reused while we count
    stack: list[str] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in skip and st.nbytes() > 0:
            owners.setdefault(ptr, set()).add(stack[-1] if stack else "outside")
            nbytes[ptr] = st.nbytes()
            keep.append(st)
        return t

    def enter(name: str) -> None:
        stack.append(name)

    def leave() -> None:  # a forward hook that returns something replaces the output
        stack.pop()

    handles = []
    for name, m in modules.items():
        handles.append(m.register_forward_pre_hook(lambda _m, _a, n=name: enter(n)))
        handles.append(m.register_forward_hook(lambda _m, _a, _o: leave()))
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            run()
    finally:
        for h in handles:
            h.remove()
    out = dict.fromkeys([*modules, "shared", "outside"], 0)
    for ptr, names in owners.items():
        out[next(iter(names)) if len(names) == 1 else "shared"] += nbytes[ptr]
    return out


class LiveMemory:
    """torch's ``MemTracker`` (a dispatch mode that follows every tensor's storage from its
    creation to its release), read at points the caller chooses (e.g. from module hooks)::

        with LiveMemory(model, inputs=[ids]) as mem:
            model.lm_head.register_forward_pre_hook(lambda *_: marks.append(mem.current()))
            ...

    ``current()`` and ``peak()`` are the bytes of tensors created inside the ``with``: in
    forward (``Activation``) and in backward (``Temp``; activation gradients), not parameters or
    buffers of ``model`` (tracked apart) nor the caller's ``inputs``, which must be named: a view
    of an untracked tensor would count its storage as created inside."""

    _CATEGORIES = ("Activation", "Temp")

    def __init__(self, model: nn.Module, inputs: Iterable[torch.Tensor] = ()) -> None:
        from torch.distributed._tools.mem_tracker import MemTracker

        self._mt = MemTracker()
        self._mt.track_external(model, *inputs)

    def __enter__(self) -> LiveMemory:
        self._mt.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mt.__exit__(*exc)

    def current(self) -> int:
        return self._read("current")

    def peak(self) -> int:
        """``current()`` when MemTracker's total was largest so far: the largest ``current()``
        as long as no parameter gradient or optimizer state has been allocated (those count in
        the total, not here)."""
        return self._read("peak")

    def _read(self, kind: str) -> int:
        snap = self._mt.get_tracker_snapshot(kind)
        # keyed by an enum whose value is the category's name
        return sum(
            int(n)
            for d in snap.values()
            for k, n in d.items()
            if getattr(k, "value", None) in self._CATEGORIES
        )


def _tensors(model: nn.Module) -> Iterable[torch.Tensor]:
    yield from model.parameters()
    yield from model.buffers()
