"""What a benchmark run measures besides time: unique storage bytes, every live tensor, the peak
(torch's MemTracker) and the collectives a step issues (a dispatch mode), with the bytes a ring
sends for each."""

from __future__ import annotations

import gc
from collections import Counter

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


class StorageCounter:
    """Bytes of unique storages, by category (first category to claim a storage wins)."""

    def __init__(self):
        self.seen: set[int] = set()
        self.by_cat: Counter = Counter()

    def add(self, cat: str, t) -> None:
        if t is None or not isinstance(t, torch.Tensor):
            return
        st = _local(t).untyped_storage()
        n, ptr = st.nbytes(), st.data_ptr()
        if n == 0 or ptr in self.seen:
            return
        self.seen.add(ptr)
        self.by_cat[cat] += n


def live_tensors() -> list[torch.Tensor]:
    """Every tensor the garbage collector knows about (local shards of DTensors)."""
    import warnings

    from torch.distributed.tensor import DTensor

    out = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for o in gc.get_objects():
            try:
                if isinstance(o, DTensor):
                    out.append(o.to_local())
                elif type(o) in (torch.Tensor, nn.Parameter) and not o.is_meta:
                    out.append(o)
            except Exception:  # noqa: BLE001 - exotic objects during a gc walk
                continue
    return out


def mem_tracker():
    """torch's MemTracker without its per-parameter gradient hooks: those only label gradients
    (the totals do not depend on them) and cannot be installed on FSDP1's parameter views."""
    from torch.distributed._tools.mem_tracker import MemTracker

    class _Tracker(MemTracker):
        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            return super()._track_module_params_and_buffers(module, install_grad_hooks=False)

    return _Tracker()


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class CountCollectives(TorchDispatchMode):
    """Counts c10d collectives by op and the bytes of their largest (full) buffer argument."""

    NAMES = {
        "_allgather_base_": "all_gather",
        "allgather_": "all_gather",
        "allgather_into_tensor_coalesced_": "all_gather",
        "_reduce_scatter_base_": "reduce_scatter",
        "reduce_scatter_": "reduce_scatter",
        "reduce_scatter_tensor_coalesced_": "reduce_scatter",
        "allreduce_": "all_reduce",
        "allreduce_coalesced_": "all_reduce",
        "broadcast_": "broadcast",
        "alltoall_base_": "all_to_all",
        "scatter_": "scatter",
        "barrier": "barrier",
        "send": "send",  # a point-to-point hop (ring attention): counted once, at its sender
    }
    # not transfers of their own: a hop's receive (its send is counted), and the functional
    # collectives' plumbing (all_to_all_single's wait and autograd wrapper)
    SKIP = frozenset(
        {"barrier", "recv_", "recv_any_source_", "wait_tensor", "_wrap_tensor_autograd"}
    )

    def __init__(self):
        super().__init__()
        self.count: Counter = Counter()
        self.bytes: Counter = Counter()
        self.raw: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        ns = func.namespace
        if ns in ("c10d", "_c10d_functional", "c10d_functional"):
            name = self.NAMES.get(func._opname, func._opname)
            self.raw[str(func)] += 1
            if name == "scatter":  # its output: a rank's chunk (the root also passes them all)
                self.count[name] += 1
                self.bytes[name] += _nbytes(args[0])
            elif name not in self.SKIP:
                self.count[name] += 1
                self.bytes[name] += max((_nbytes(a) for a in args), default=0)
        return func(*args, **kwargs)


def ring_bytes_sent(op: str, nbytes: int, world: int) -> float:
    """Bytes one rank sends for a collective on a ``nbytes`` buffer with a ring algorithm. The
    engine's gloo collectives (a broadcast or a scatter from each rank, ``nbytes`` summing to the
    buffer over the group) send the same on average; a point-to-point ``send`` sends all of it.
    An all-to-all over a subgroup (a CP group's) is counted as over the world."""
    if world <= 1:
        return 0.0
    f = (world - 1) / world
    by_op = {"all_reduce": 2 * f * nbytes, "broadcast": f * nbytes, "send": float(nbytes)}
    return by_op.get(op, f * nbytes)


def model_state_bytes(model: nn.Module, opt: torch.optim.Optimizer, layershard: bool) -> dict:
    """params + grads + optimizer state + module buffers, counted by unique storage; then every
    other tensor storage Python can see (the implementation's persistent working buffers); with
    ``layershard``, the sharded model's own ``memory_report``."""
    c = StorageCounter()
    params = list(model.parameters())
    for p in params:
        c.add("params", p)
    for p in params:
        c.add("grads", p.grad)
    for st in opt.state.values():
        for v in st.values():
            c.add("optimizer", v)
    for b in model.buffers():
        c.add("module_buffers", b)
    out = dict(c.by_cat)
    out["model_state"] = sum(c.by_cat.values())
    for t in live_tensors():
        c.add("other", t)
    out["other_resident"] = c.by_cat.get("other", 0)
    if layershard:  # its own account too
        import layershard as ls

        assert isinstance(model, ls.ShardedModule)
        out["layershard_memory_report"] = model.memory_report(opt)
    return out
