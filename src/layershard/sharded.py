"""``shard()`` and ``ShardedModule``: a model split into units, each rank holding 1/N of it.

Reading order for the data path: ``shard()`` (below) -> units.py (what a unit is) -> flat.py (how
a unit's parameters are stored and sliced) -> schedule.py (gather before compute, reduce after
backward) -> buffers.py / collectives.py (where the bytes go).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator
from functools import partial

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.optim.optimizer import register_optimizer_step_pre_hook

from layershard.buffers import GatherSlot, GradSlot, ReduceScratch, nbytes
from layershard.collectives import Comm
from layershard.distributed import default_device
from layershard.flat import FlatParam, ParamSlot
from layershard.init import fill_shards
from layershard.precision import FULL_PRECISION, MixedPrecision
from layershard.schedule import Schedule, Unit
from layershard.units import UnitSpec, backward_needs_weights, find_units

STRATEGIES = {"full": "ZeRO-3: parameters, gradients and optimizer state sharded"}
PLANNED_STRATEGIES = ("grad_op", "no_shard", "hybrid")


def shard(
    model: nn.Module,
    layers: Iterable[nn.Module | str] | None = None,
    mixed_precision: MixedPrecision | None = None,
    strategy: str = "full",
    activation_checkpointing: int = 0,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
) -> ShardedModule:
    """Shard ``model`` across the ranks of ``process_group`` (default: all ranks).

    Args:
        layers: the repeated blocks (modules or their names). ``None`` finds them: the children
            of the longest ``nn.ModuleList`` of same-class modules. Every other module that owns
            parameters (embeddings, final norm, head) becomes an extra unit.
        mixed_precision: compute and reduce dtypes; ``None`` means fp32 throughout.
        strategy: ``"full"`` (ZeRO-3). Other strategies are not available yet.
        activation_checkpointing: recompute the first K blocks in backward.
        device: where shards and compute live; default: this rank's GPU under NCCL, else CPU.
        param_init_fn: for a model on the meta device, called as ``param_init_fn(module)``
            children first, as ``model.apply`` does (default: a HF transformers model's own init
            contract, else each module's ``reset_parameters()``); see ``layershard/init.py``.

    Build the optimizer *after* this call, from the returned module's ``parameters()``.
    """
    if strategy not in STRATEGIES:
        if strategy in PLANNED_STRATEGIES:
            raise NotImplementedError(
                f"shard(strategy={strategy!r}) is not supported yet; use strategy='full' (ZeRO-3)"
            )
        raise ValueError(f"shard(strategy={strategy!r}): unknown strategy; use 'full' (ZeRO-3)")
    if isinstance(model, ShardedModule):
        raise ValueError("shard(): this model is already sharded")
    if not dist.is_initialized():
        raise RuntimeError("shard(): call ls.init_distributed() first (it works without torchrun)")
    group = process_group or dist.group.WORLD
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    precision = mixed_precision or FULL_PRECISION
    device = torch.device(device) if device is not None else default_device(group)
    _check_devices(model)

    specs = find_units(model, layers)
    if not specs:
        raise ValueError("shard(): the model has no parameters to shard")
    n_blocks = sum(s.is_block for s in specs)
    if not 0 <= activation_checkpointing <= n_blocks:
        raise ValueError(
            f"shard(activation_checkpointing={activation_checkpointing}): must be between 0 and "
            f"the number of blocks ({n_blocks})"
        )
    state_keys = list(model.state_dict(keep_vars=True).items())
    if param_init_fn is None and callable(getattr(model, "_init_weights", None)):
        param_init_fn = model._init_weights  # how HF transformers initializes its modules

    # 1. Flat storage: one trainable and/or one frozen FlatParam per unit; fill this rank's slice.
    flats_of = [_make_flats(s, world, rank, device) for s in specs]
    slot_of = {
        id(p): (f, sl)
        for s, fl in zip(specs, flats_of)
        for f in fl
        for sl, p in zip(f.slots, f._originals)
    }
    fill_shards(model, specs, flats_of, slot_of, device, param_init_fn)

    # 2. The original parameters leave the modules; weights become attributes set per forward.
    for fl in flats_of:
        for f in fl:
            for sl, p in zip(f.slots, f._originals):
                for use in sl.uses:
                    use.module._parameters.pop(use.attr, None)
                p.data = torch.empty(0, dtype=p.dtype, device=p.device)  # free the full copy
                p._layershard_sharded_away = True
            del f._originals
    model.to(device)  # module buffers only: parameters are no longer registered
    for fl in flats_of:
        for f in fl:
            # The slices are registered again under the original names so that code reading
            # `module.parameters()` (HF's `model.device`, parameter counts) keeps working; inside
            # forward `module.weight` resolves to the instance attribute set by the schedule first.
            for sl, p in zip(f.slots, f.shard_params):
                for use in sl.uses:
                    use.module._parameters[use.attr] = p

    # 3. Preallocated buffers, units, hooks.
    comm = Comm(group, device)
    root_spec = specs[0] if specs[0].module is None else None
    others = [(s, fl) for s, fl in zip(specs, flats_of) if s is not root_spec]
    # Each slot is sized for the units that take turns in it (i % 2), not for the largest unit.
    unit_numel = [sum(f.padded_numel for f in fl) for _, fl in others]
    slot_numel = [max(unit_numel[k::2], default=0) for k in range(2)]
    trainable = [f for fl in flats_of for f in fl if f.requires_grad]
    grad_numel = max((f.padded_numel for f in trainable), default=0)
    shard_numel = max((f.shard_numel for f in trainable), default=0)
    cdtype, rdtype = precision.param_dtype, precision.reduce_dtype
    slots = [GatherSlot(n, cdtype, device) for n in slot_numel] if others else []
    grad_slots = [GradSlot(grad_numel, rdtype, device) for _ in range(2 if trainable else 0)]
    scratch = ReduceScratch(shard_numel, rdtype, device) if trainable else None
    units = [
        Unit(s.name, s.module, s.is_block, fl, slots[i % 2], device, backward_needs_weights(s))
        for i, (s, fl) in enumerate(others)
    ]
    root = None
    if root_spec is not None:
        root_flats = flats_of[0]
        root_slot = GatherSlot(sum(f.padded_numel for f in root_flats), cdtype, device)
        root = Unit("<root>", None, False, root_flats, root_slot, device)
    schedule = Schedule(root, units, grad_slots, scratch, comm, precision)
    for u in schedule.all_units():  # weights are attributes from now on (values valid in forward)
        u.bind(u.full_views)
    schedule.install(model)

    blocks = [u for u in units if u.is_block]
    for u in blocks[:activation_checkpointing]:
        u.module.forward = partial(_checkpointed, u.module.forward)

    for b in _unique(t for _, t in model.named_buffers()):  # every rank starts equal
        if world > 1:
            comm.broadcast(b, "init")
    comm.stats.reset()
    _install_optimizer_guard()
    return ShardedModule(model, schedule, state_keys, slot_of)


def _checkpointed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


def _check_devices(model: nn.Module) -> None:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"shard(): the model's parameters are on several devices ({names}); move the model "
            "to one device (or build it on 'meta') before shard(), and pass device= for the shards"
        )


def _make_flats(spec: UnitSpec, world: int, rank: int, device: torch.device) -> list[FlatParam]:
    flats = []
    for requires_grad in (True, False):
        group = [(p, uses) for p, uses in spec.params if p.requires_grad == requires_grad]
        if not group:
            continue
        slots, offset = [], 0
        for p, uses in group:
            slots.append(ParamSlot(uses, p.shape, offset, requires_grad))
            offset += p.numel()
        f = FlatParam(slots, requires_grad, world, rank, device)
        f._originals = [p for p, _ in group]
        flats.append(f)
    return flats


def _unique(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    seen = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


# ---- optimizer guard -----------------------------------------------------------------------------

_checked_optimizers: weakref.WeakSet = weakref.WeakSet()
_guard_handle = None


def _optimizer_guard(optimizer, args, kwargs) -> None:
    if optimizer in _checked_optimizers:
        return
    for group in optimizer.param_groups:
        for p in group["params"]:
            if getattr(p, "_layershard_sharded_away", False):
                raise RuntimeError(
                    "This optimizer holds parameters of a model that ls.shard() has since sharded: "
                    "it was built before shard() and would update nothing. Build it after: "
                    "model = ls.shard(model); opt = torch.optim.AdamW(model.parameters(), ...)"
                )
    _checked_optimizers.add(optimizer)


def _install_optimizer_guard() -> None:
    global _guard_handle
    if _guard_handle is None:
        _guard_handle = register_optimizer_step_pre_hook(_optimizer_guard)


# ---- the module users hold -----------------------------------------------------------------------


class ShardedModule(nn.Module):
    """What ``shard()`` returns. Calls, attributes and methods go to the wrapped model
    (``model.config``, ``model.generate(...)``); ``parameters()`` are this rank's fp32 slices."""

    def __init__(self, module: nn.Module, schedule: Schedule, state_keys, slot_of):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_schedule", schedule)
        object.__setattr__(self, "_slot_of", slot_of)  # id(original param) -> (flat, slot)
        # state_dict() order of the unsharded model: key -> ("param", flat, slot) | ("buffer", ...)
        entries = []
        for key, value in state_keys:
            if id(value) in slot_of:
                entries.append((key, "param", slot_of[id(value)]))
            else:
                path, _, buf = key.rpartition(".")
                entries.append((key, "buffer", (module.get_submodule(path), buf)))
        object.__setattr__(self, "_entries", entries)

    # -- behaving like the wrapped model --

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name == "module":
                raise
            return getattr(self.module, name)

    @property
    def units(self) -> list[Unit]:
        return self._schedule.all_units()

    @property
    def flat_params(self) -> list[FlatParam]:
        return [f for u in self.units for f in u.flats]

    @property
    def process_group(self) -> dist.ProcessGroup:
        return self._schedule.comm.group

    def named_parameters(
        self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True
    ):
        """This rank's slices, under the parameters' original names (1-D views into the flat fp32
        shard; a slice can be empty when the parameter lies wholly on other ranks)."""
        for u in self.units:
            for f in u.flats:
                for slot, p in zip(f.slots, f.shard_params):
                    yield (f"{prefix}.{slot.name}" if prefix else slot.name), p

    def named_buffers(self, prefix: str = "", recurse: bool = True, remove_duplicate: bool = True):
        return self.module.named_buffers(prefix, recurse, remove_duplicate)

    def state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "ShardedModule.state_dict() is not available: each rank holds only slices. Use "
            "model.full_state_dict() for the unsharded weights (rank 0), or "
            "ls.save_checkpoint(path, model, optimizer) for a resumable sharded checkpoint."
        )

    def load_state_dict(self, *args, **kwargs):
        raise RuntimeError(
            "ShardedModule.load_state_dict() is not available: use model.load_full_state_dict(sd) "
            "for unsharded weights, or ls.load_checkpoint(path, model, optimizer)."
        )

    def _apply(self, fn, recurse=True):
        raise RuntimeError(
            "A sharded model cannot be moved or cast (.to/.cuda/.half): choose device= and "
            "mixed_precision= in ls.shard(...) instead."
        )

    def __repr__(self) -> str:
        return f"ShardedModule(units={len(self.units)}, world_size={self._schedule.world_size},\n  {self.module!r})"

    # -- training --

    @contextlib.contextmanager
    def no_sync(self):
        """Accumulate gradients locally (unsharded, fp32) without communication; the next backward
        outside the context reduces them together with its own. Costs one unsharded gradient copy
        of the model per rank while in use, like torch FSDP's ``no_sync``."""
        previous, self._schedule.no_sync = self._schedule.no_sync, True
        try:
            yield
        finally:
            self._schedule.no_sync = previous

    @torch.no_grad()
    def clip_grad_norm_(self, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradient slices by the norm of the whole (unsharded) gradient; returns that
        norm, the same on every rank, as ``torch.nn.utils.clip_grad_norm_`` would."""
        grads = [p.grad for f in self.flat_params if f.requires_grad for p in f.shard_params]
        grads = [g for g in grads if g is not None and g.numel() > 0]
        device = self.flat_params[0].shard.device
        norm_type = float(norm_type)
        norms = torch._foreach_norm(grads, norm_type) if grads else []
        local = torch.stack(norms) if norms else torch.zeros(1, device=device)
        if math.isinf(norm_type):
            total = local.max().reshape(1)
            self._schedule.comm.all_reduce(total, dist.ReduceOp.MAX, "clip")
        else:
            total = local.pow(norm_type).sum().reshape(1)
            self._schedule.comm.all_reduce(total, dist.ReduceOp.SUM, "clip")
            total = total.pow(1.0 / norm_type)
        total = total[0]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    # -- state --

    @torch.no_grad()
    def full_state_dict(self, rank0_only: bool = True, cpu: bool = True) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights and persistent buffers under the original names, in the
        order of the wrapped model's ``state_dict()``. Collective; gathers one unit at a time.
        With ``rank0_only`` other ranks get ``{}``."""
        comm, world = self._schedule.comm, self._schedule.world_size
        keep = not rank0_only or dist.get_rank(comm.group) == 0
        full: dict[int, torch.Tensor] = {}
        for f in self.flat_params:
            buf = torch.empty(f.padded_numel, dtype=torch.float32, device=f.shard.device)
            if world == 1:
                buf.copy_(f.shard)
            else:
                comm.all_gather(buf, f.shard, "state_dict").wait()
            if keep:
                for slot in f.slots:
                    t = buf[slot.offset : slot.offset + slot.numel].view(slot.shape)
                    full[id(slot)] = t.to("cpu") if cpu else t.clone()
        if not keep:
            return {}
        out = {}
        for key, kind, ref in self._entries:
            if kind == "param":
                out[key] = full[id(ref[1])]
            else:
                b = getattr(ref[0], ref[1])
                out[key] = b.detach().to("cpu") if cpu else b.detach().clone()
        return out

    @torch.no_grad()
    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor] | None, strict: bool = True
    ) -> None:
        """Load unsharded weights (e.g. from ``full_state_dict()`` or a HF model). Collective.
        Either every rank passes the dict, or rank 0 does and the others pass ``None``."""
        comm, world = self._schedule.comm, self._schedule.world_size
        rank = dist.get_rank(comm.group)
        device = self.flat_params[0].shard.device  # NCCL reduces device tensors only
        has = torch.tensor([0 if state_dict is None else 1], dtype=torch.int64, device=device)
        if world > 1:
            dist.all_reduce(has, group=comm.group)
        everyone = int(has) == world
        if int(has) == 0 or (not everyone and rank == 0 and state_dict is None):
            raise ValueError("load_full_state_dict(): rank 0 must pass a state dict")
        error = ""
        if state_dict is not None:
            error = self._validate(state_dict, strict)
        flag = torch.tensor([1 if error else 0], dtype=torch.int64, device=device)
        if world > 1:
            dist.all_reduce(flag, group=comm.group)
        if int(flag):
            raise ValueError(
                error or "load_full_state_dict(): another rank rejected the state dict"
            )
        by_slot = {}
        if state_dict is not None:
            for key, kind, ref in self._entries:
                if kind == "param" and key in state_dict and id(ref[1]) not in by_slot:
                    by_slot[id(ref[1])] = state_dict[key]
        for f in self.flat_params:
            if everyone:
                for slot in f.slots:
                    f.copy_from_full(slot, by_slot[id(slot)].to(f.shard.device, torch.float32))
            else:
                buf = torch.zeros(f.padded_numel, dtype=torch.float32, device=f.shard.device)
                if rank == 0:
                    for slot in f.slots:
                        buf[slot.offset : slot.offset + slot.numel].copy_(
                            by_slot[id(slot)].reshape(-1)
                        )
                comm.broadcast(buf, "state_dict")
                f.shard.copy_(buf[f.shard_start : f.shard_start + f.shard_numel])
        for key, kind, ref in self._entries:
            if kind == "buffer":
                b = getattr(ref[0], ref[1])
                if state_dict is not None and key in state_dict:
                    b.copy_(state_dict[key])
                if not everyone and world > 1:
                    comm.broadcast(b, "state_dict")

    def _validate(self, sd: dict, strict: bool) -> str:
        expected = {key: ref for key, _, ref in self._entries}
        missing = [k for k in expected if k not in sd]
        unexpected = [k for k in sd if k not in expected]
        if strict and (missing or unexpected):
            return (
                f"load_full_state_dict(): missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
                f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; is this a "
                "state dict of the same model?"
            )
        for key, kind, ref in self._entries:
            if key not in sd:
                continue
            shape = ref[1].shape if kind == "param" else getattr(ref[0], ref[1]).shape
            if tuple(sd[key].shape) != tuple(shape):
                return (
                    f"load_full_state_dict(): {key} has shape {tuple(sd[key].shape)}, "
                    f"the model expects {tuple(shape)}"
                )
        return ""

    # -- observability --

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Collectives issued since the last reset: ``{op: {"count", "bytes", <phase>: count}}``
        for op in all_gather, reduce_scatter, all_reduce, broadcast; phases forward, backward,
        clip, state_dict, init. Bytes are those of the full (unsharded) buffer."""
        out = self._schedule.comm.stats.as_dict()
        if reset:
            self._schedule.comm.stats.reset()
        return out

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds, by category (unique storages; includes optimizer state when an
        optimizer is given). ``grad_buffers`` is what the gradient slots take during backward:
        they are freed between backwards."""
        s = self._schedule
        flats = self.flat_params
        report = {
            "params": sum(nbytes(f.shard) for f in flats),
            "grads": sum(nbytes(f.grad) for f in flats),
            "params_lowp": sum(nbytes(c) for c, _ in s._lowp.values()),
            "gather_buffers": sum(nbytes(t) for t in _unique(u.slot.data for u in self.units)),
            "grad_buffers": sum(g.capacity for g in s.grad_slots),
            "reduce_scratch": nbytes(s.scratch.data) if s.scratch is not None else 0,
            "module_buffers": sum(
                {
                    b.untyped_storage().data_ptr(): nbytes(b)
                    for _, b in self.module.named_buffers()
                }.values()
            ),
            "no_sync": sum(nbytes(getattr(f, "acc", None)) for f in flats),
        }
        if optimizer is not None:
            storages = {}
            for st in optimizer.state.values():
                for v in st.values():
                    if isinstance(v, torch.Tensor):
                        storages[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
            report["optimizer"] = sum(storages.values())
        report["total"] = sum(report.values())
        return report

    def describe(self) -> str:
        """A table of the units: what is gathered together, how big, which buffer slot."""
        s = self._schedule
        slot_ids = {}
        rows = [f"{'unit':<32} {'params':>7} {'numel':>12} {'padded':>12} {'slot':>5}  trainable"]
        for u in self.units:
            sid = slot_ids.setdefault(id(u.slot), len(slot_ids))
            numel = sum(f.numel for f in u.flats)
            rows.append(
                f"{u.name:<32} {len(u.param_slots):>7} {numel:>12,} {u.gather_numel:>12,} {sid:>5}  "
                f"{u.trainable is not None}"
            )
        rows.append(
            f"world size {s.world_size}, compute {s.precision.param_dtype}, reduce {s.precision.reduce_dtype}"
        )
        return "\n".join(rows)
