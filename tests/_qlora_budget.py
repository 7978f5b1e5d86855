"""Per-rank bytes of a sharded (Q)LoRA model by kind, at a world size this machine does not have:
one process on torch's fake process group (``dist.init_process_group("fake")``: every collective
returns at once, nothing is exchanged), where this rank's storage is what ``ls.shard`` allocates
for rank 0 of ``world``. The bytes are exact (unique storages, CPU); the values computed on them
are not (a gather leaves the other ranks' slices as they were), so only bytes are read."""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator
from unittest import mock

import torch
import torch.distributed as dist


def in_own_process(test: Callable[[], None]) -> Callable[[], None]:
    """Run ``test`` (a test without arguments) in a process of its own when this one holds a
    process group: the fake process group must be the default group, which an earlier test of
    this pytest process may hold (``ls.init_distributed`` keeps a world of 1 for the process).
    The process comes from the tests' fork server (tests/_dist.py); a failure is raised here."""

    @functools.wraps(test)
    def run() -> None:
        if not dist.is_initialized():
            return test()
        from _dist import start_ranks

        start_ranks(_call, 1, (test.__module__, test.__name__))

    return run


def _call(rank: int, module: str, name: str) -> None:
    import importlib

    getattr(importlib.import_module(module), name)()


@contextlib.contextmanager
def fake_world(world: int) -> Iterator[None]:
    """Rank 0 of ``world`` on the fake process group (the control group is the model's own:
    the fake backend cannot make the gloo one ``Groups.control`` makes under other backends)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from layershard.groups import Groups

    assert not dist.is_initialized(), "run the test in_own_process: this process has a group"
    dist.init_process_group("fake", rank=0, world_size=world, store=FakeStore())
    try:
        with mock.patch.object(Groups, "control", lambda self: self.parent):
            yield
    finally:
        dist.destroy_process_group()


def _unique(tensors) -> int:
    seen: dict[int, int] = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            st = t.untyped_storage()
            seen[st.data_ptr()] = st.nbytes()
    return sum(seen.values())


def quant_state_tensors(state) -> list[torch.Tensor]:
    """The tensors of a bitsandbytes ``QuantState`` (absmax, code, and the nested state's)."""
    out = [state.absmax, state.code]
    if getattr(state, "state2", None) is not None:
        out += [state.offset, state.state2.absmax, state.state2.code]
    return [t for t in out if isinstance(t, torch.Tensor)]


def bytes_by_kind(model, opt: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """This rank's bytes of a sharded model by kind: the packed 4-bit base's slices, its
    quantization state (whole), the other frozen slices (by dtype), the trainable fp32 slices,
    their gradients, the optimizer's state, and the gather slots ``memory_report`` counts."""
    flats = model.flat_params
    packed = [f for f in flats if f.packed]
    frozen = [f for f in flats if not f.packed and not f.requires_grad]
    train = [f for f in flats if f.requires_grad]
    states = {id(s.kind.quant_state): s.kind.quant_state for f in packed for s in f.slots}
    report = model.memory_report(opt)
    out = {
        "packed_base": _unique(f.shard for f in packed),
        "quant_state": _unique(t for s in states.values() for t in quant_state_tensors(s)),
        "frozen_other": _unique(f.shard for f in frozen),
        "adapters": _unique(f.shard for f in train),
        "adapter_grads": _unique(f.grad for f in train),
        "optimizer": report.get("optimizer", 0),
        "gather_slots": report["gather_buffers"],
    }
    for dtype in {f.shard.dtype for f in frozen}:
        name = str(dtype).removeprefix("torch.")
        out[f"frozen_{name}"] = _unique(f.shard for f in frozen if f.shard.dtype == dtype)
    return out


def step_peak(model, opt, step) -> int:
    """MemTracker's peak (every tensor, bytes) over one ``step()``, with every tensor alive
    before it counted (the model, the optimizer state). Without per-parameter gradient hooks:
    MemTracker registers one on every parameter a module holds, which a frozen one refuses."""
    import gc

    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, False)

    gc.collect()
    tracker = Tracker()
    tracker.track_external(model, opt)
    with tracker:
        step()
    return int(next(iter(tracker.get_tracker_snapshot("peak").values()))["Total"])
