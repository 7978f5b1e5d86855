"""``shard()`` and ``ShardedModule``: a model split into units, each rank holding 1/N of it.

Reading order for the data path: ``shard()`` (below) -> units.py (what a unit is) -> flat.py (how
a unit's parameters are stored and sliced) -> schedule.py (gather before compute, reduce after
backward) -> buffers.py / collectives.py (where the bytes go).
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from functools import partial

import torch
import torch.distributed as dist
import torch.utils.checkpoint
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.optim.optimizer import register_optimizer_step_pre_hook

from layershard import full_state, meshes
from layershard.distributed import default_device
from layershard.engine import dtensor, options
from layershard.engine.agreement import agreed
from layershard.engine.buffers import nbytes
from layershard.engine.build import build_schedule, make_storage
from layershard.engine.flat import FlatParam
from layershard.engine.four_bit import (
    check_quantized,
    disable_cpu_repacking,
    is_packed,
    release,
)
from layershard.engine.init import fill_shards
from layershard.engine.model_checks import (
    check_dtypes,
    check_experts,
    check_same_layout,
    check_shared_modules,
    layout,
)
from layershard.engine.precision import FULL_PRECISION, MixedPrecision
from layershard.engine.schedule import Schedule
from layershard.engine.strategy import CPUOffload, Sharding
from layershard.engine.strategy import resolve as resolve_strategy
from layershard.engine.units import Unit, find_units
from layershard.engine.waits import waiting

CLIP = "all-reduce of the gradient norm"
_sharded_models: weakref.WeakSet[nn.Module] = weakref.WeakSet()  # their hooks are installed
# original parameters that shard() emptied, by id (tensors compare elementwise: no WeakSet)
_sharded_away: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()


def shard(
    model: nn.Module,
    *,
    layers: Iterable[nn.Module | str | Sequence[nn.Module | str]] | None = None,
    blocks_per_unit: int = 1,
    mixed_precision: MixedPrecision | None = None,
    strategy: str = "full",
    activation_checkpointing: int = 0,
    process_group: dist.ProcessGroup | None = None,
    device: torch.device | str | None = None,
    param_init_fn: Callable[[nn.Module], None] | None = None,
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
    offload: CPUOffload | None = None,
    compile: bool | dict = False,
) -> ShardedModule:
    """Shard ``model`` across the ranks of ``process_group`` (default: all ranks). Every option
    is a keyword argument.

    Args:
        layers: the repeated blocks (modules or their names). ``None`` finds them: the children
            of the longest ``nn.ModuleList`` of same-class modules. Every other module that owns
            parameters (embeddings, final norm, head) becomes an extra unit. An entry that is a
            list of blocks the model calls one after another makes them one unit.
        blocks_per_unit: K consecutive blocks (of ``layers``) per unit: one collective for K
            small blocks over a high-latency link; gather buffers of K blocks.
        mixed_precision: compute and reduce dtypes; ``None`` means fp32 throughout.
        strategy: ``"full"`` (ZeRO-3), ``"grad_op"`` (ZeRO-2), ``"no_shard"`` (DDP-like) or
            ``"hybrid"`` (HSDP: sharded within groups of ``shard_size`` ranks, default the ranks
            of a node, replicated across groups; or pass a 2-D ``mesh`` (replicate, shard)).
            A mesh with named dims ``(dp_shard, tp)`` or ``(dp_replicate, dp_shard, tp)``, of a
            model parallelized over ``mesh["tp"]``: layershard is its data-parallel axis
            (``layershard.meshes.data_parallel``).
        process_group: the ranks to shard over (default: every rank). A model over some ranks
            only is sharded by those ranks alone.
        shard_size: for ``"hybrid"``: the ranks that hold one replica (default: a node's, from
            torchrun's ``LOCAL_WORLD_SIZE``).
        mesh: a DeviceMesh with named dimensions ``dp_shard`` (and optionally
            ``dp_replicate``, ``tp``): units are sharded over ``dp_shard``, replicated over
            ``dp_replicate``; ``tp`` is the model's own (its DTensors).
        expert_mesh: for a model whose experts were split by expert parallelism
            (``ls.parallelize(model, ep=...)``), the mesh ``(dp_replicate, efsdp, ep)``: experts
            are sharded over ``efsdp``. ``ls.parallelize`` builds both meshes.
        reshard_after_forward: for ``"full"``: ``True``; ``False`` is ``"grad_op"``; an int K
            keeps each unit sharded over K ranks (a node) from its forward to its backward, so
            the backward gather stays within them (ZeRO++ hpZ, FSDP2's int).
        activation_checkpointing: recompute the first K blocks (modules, not units) in backward.
        device: where compute lives; default: this rank's GPU under NCCL, else CPU.
        offload: ``ls.CPUOffload()``: fp32 shards, gradient slices and optimizer state in CPU
            memory (pinned where CUDA), the optimizer stepping there; gathered weights on
            ``device``.
        compile: ``torch.compile`` each block's forward (not the hooks); a dict is passed to
            ``torch.compile`` as keyword arguments.
        param_init_fn: for a model on the meta device, called as ``param_init_fn(module)``
            children first, as ``model.apply`` does (default: a HF transformers model's own init
            contract, else each module's ``reset_parameters()``); see the docs' "How it works".

    Build the optimizer *after* this call, from the returned module's ``parameters()``.
    """
    options.check(
        "shard()", strategy=strategy, shard_size=shard_size, mixed_precision=mixed_precision,
        reshard_after_forward=reshard_after_forward, offload=offload, compile=compile,
        activation_checkpointing=activation_checkpointing, blocks_per_unit=blocks_per_unit,
    )  # fmt: skip
    if isinstance(model, ShardedModule) or model in _sharded_models:
        raise ValueError("shard(): this model is already sharded")
    inner = next((n for n, m in model.named_modules() if isinstance(m, ShardedModule)), None)
    if inner is not None:
        raise ValueError(
            f"shard(): the model contains a sharded module ({inner or '<root>'}); shard the "
            "whole model once (pass layers=... to choose the units) instead of nesting shard()"
        )
    if not dist.is_initialized():
        raise RuntimeError("shard(): call ls.init_distributed() first (it works without torchrun)")
    if expert_mesh is None:  # a TP x DP mesh: its data-parallel group (engine/dtensor.py)
        process_group, strategy, mesh = meshes.from_mesh(mesh, process_group, strategy)
    group = process_group or dist.group.WORLD
    assert group is not None
    precision = mixed_precision or FULL_PRECISION
    device = torch.device(device) if device is not None else default_device(group)
    _check_devices(model)
    sharding = resolve_strategy(
        strategy, group, shard_size, reshard_after_forward, mesh, expert_mesh
    )
    host = torch.device("cpu") if offload is not None else device

    specs = find_units(model, layers, blocks_per_unit)
    if not specs:
        raise ValueError("shard(): the model has no parameters to shard")
    n_blocks = sum(len(s.modules) for s in specs if s.is_block)
    if not 0 <= activation_checkpointing <= n_blocks:
        raise ValueError(
            f"shard(activation_checkpointing={activation_checkpointing}): must be between 0 and "
            f"the number of blocks ({n_blocks})"
        )
    with agreed(group):  # a check that fails on one rank alone fails on every rank
        check_experts(specs, sharding)
        check_shared_modules(model, specs)
        check_quantized(specs)  # first: an 8-bit or 4-bit weight's own message, not its dtype's
        check_dtypes(specs)
        if expert_mesh is None:  # else the meshes give every group (engine/strategy.py)
            dtensor.check_groups((p for spec in specs for p, _ in spec.params), group)
    disable_cpu_repacking(model)
    shard_options = dict(
        strategy=strategy, shard_size=shard_size, reshard_after_forward=reshard_after_forward,
        mesh=mesh is not None, expert_mesh=expert_mesh is not None,
        offload=offload is not None, compile=bool(compile),
        param_dtype=precision.param_dtype, reduce_dtype=precision.reduce_dtype,
        gather_dtype=precision.gather_dtype, activation_checkpointing=activation_checkpointing,
    )  # fmt: skip
    check_same_layout(group, layout(specs, shard_options))  # other models on other ranks: say so
    state_keys = list(model.state_dict(keep_vars=True).items())
    hf_init = getattr(model, "_init_weights", None)
    if param_init_fn is None and callable(hf_init):
        param_init_fn = hf_init  # how HF transformers initializes its modules

    # 1. Flat storage: one trainable and/or one frozen FlatParam per unit; fill this rank's slice.
    pin = offload is not None and device.type == "cuda" and offload.pin_memory
    storage = make_storage(specs, sharding, precision, host, offload is not None, pin)
    slot_of = storage.slot_of
    fill_shards(model, specs, slot_of, host, param_init_fn)

    # 2. The original parameters leave the modules; weights become attributes set per forward.
    originals = [p for spec in specs for p, _ in spec.params]
    for p in originals:
        f, sl = slot_of[id(p)]
        for use in sl.uses:
            use.module._parameters.pop(use.attr, None)
        if not p.is_meta:  # (a meta DTensor takes no plain tensor as .data, and holds nothing)
            release(p)  # free the full copy
        _sharded_away[id(p)] = p
    model.to(device)  # module buffers only: parameters are no longer registered
    for fl in storage.flats:
        for f in fl:
            # The slices are registered again under the original names so that code reading
            # `module.parameters()` (HF's `model.device`, parameter counts) keeps working; inside
            # forward `module.weight` resolves to the instance attribute set by the schedule first.
            for sl, p in zip(f.slots, f.shard_params):
                for use in sl.uses:
                    use.module._parameters[use.attr] = p

    # 3. Preallocated buffers, units, the schedule and its hooks.
    schedule = build_schedule(
        specs, storage, sharding, precision, group, device, offload is not None
    )
    comm, units = schedule.comm, schedule.units
    schedule.install(model)
    _sharded_models.add(model)

    blocks = [(u, m) for u in units if u.is_block for m in u.modules]
    if compile:
        compile_options = compile if isinstance(compile, dict) else {}
        for _, m in blocks:  # the block's computation only: the unit's hooks stay outside
            m.forward = torch.compile(m.forward, **compile_options)
    for u, m in blocks[:activation_checkpointing]:
        m.forward = partial(schedule.checkpoint_forward, u, m.forward)

    if dist.get_world_size(group) > 1:
        for b in _unique(t for _, t in model.named_buffers()):  # every rank starts equal
            comm.broadcast(b, "init")
    comm.stats.reset()
    _install_optimizer_guard()
    return ShardedModule(model, schedule, state_keys, slot_of)


def _is_quant_state_key(key: str, packed_keys: set[str]) -> bool:
    """A key a bitsandbytes 4-bit layer adds to its ``state_dict()`` beside its weight
    (``<weight>.absmax``, ``<weight>.quant_map``, ``<weight>.quant_state.bitsandbytes__nf4``...):
    its quantization state, kept whole on every rank (``engine/four_bit.py``)."""
    return any(key[:i] in packed_keys for i, c in enumerate(key) if c == ".")


def _check_devices(model: nn.Module) -> None:
    devices = {p.device for p in model.parameters()}
    if len(devices) > 1:
        names = ", ".join(sorted(str(d) for d in devices))
        raise ValueError(
            f"shard(): the model's parameters are on several devices ({names}); move the model "
            "to one device (or build it on 'meta') before shard(), and pass device= for the shards"
        )


def _unique(tensors: Iterable[torch.Tensor]) -> Iterator[torch.Tensor]:
    seen = set()
    for t in tensors:
        if id(t) not in seen:
            seen.add(id(t))
            yield t


# ---- optimizer guard -----------------------------------------------------------------------------

# optimizer -> how many of its parameters were checked (param groups can be added later)
_checked_optimizers: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_guard_handle = None


def _optimizer_guard(optimizer, args, kwargs) -> None:
    params = [p for group in optimizer.param_groups for p in group["params"]]
    checked = _checked_optimizers.get(optimizer, 0)
    if checked == len(params):
        return
    for p in params[checked:] if checked < len(params) else params:
        if _sharded_away.get(id(p)) is p:
            raise RuntimeError(
                "This optimizer holds parameters of a model that ls.shard() has since sharded: "
                "it was built before shard() and would update nothing. Build it after: "
                "model = ls.shard(model); opt = torch.optim.AdamW(model.parameters(), ...)"
            )
    _checked_optimizers[optimizer] = len(params)


def _install_optimizer_guard() -> None:
    global _guard_handle
    if _guard_handle is None:
        _guard_handle = register_optimizer_step_pre_hook(_optimizer_guard)


# ---- the module users hold -----------------------------------------------------------------------


class ShardedModule(nn.Module):
    """What ``shard()`` returns. Calls, attributes and methods go to the wrapped model
    (``model.config``, ``model.generate(...)``); ``parameters()`` are this rank's fp32 slices."""

    _schedule: Schedule  # assigned in __init__

    def __init__(self, module: nn.Module, schedule: Schedule, state_keys, slot_of):
        super().__init__()
        self.module = module
        object.__setattr__(self, "_schedule", schedule)
        object.__setattr__(self, "_slot_of", slot_of)  # id(original param) -> (flat, slot)
        # state_dict() order of the unsharded model: key -> ("param", flat, slot) | ("buffer", ...)
        entries = []
        packed_keys = {k for k, v in state_keys if is_packed(v)}  # 4-bit weights' keys
        for key, value in state_keys:
            if id(value) in slot_of:
                entries.append((key, "param", slot_of[id(value)]))
            elif _is_quant_state_key(key, packed_keys):  # read-only, whole on every rank
                entries.append((key, "quant_state", value.detach()))
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
        """The units in forward order, the root unit (tied parameters) first when there is
        one: what ``describe()`` lists."""
        return self._schedule.all_units()

    @property
    def flat_params(self) -> list[FlatParam]:
        """Every unit's flat groups (this rank's slices of them), in ``units`` order: what
        checkpoints and exporters read."""
        return [f for u in self.units for f in u.flats]

    @property
    def process_group(self) -> dist.ProcessGroup:
        """Every rank of the model (``shard(process_group=...)``, default: all ranks)."""
        return self._schedule.comm.full

    @property
    def sharding(self) -> Sharding:
        """The strategy's groups: ``shard_group`` (the ranks a unit is split over),
        ``replicate_group``, ``shard_rank`` / ``shard_size``, ``replica_index`` / ``replicas``."""
        return self._schedule.comm.sharding

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
        """Raises: a sharded model has no meaningful local state dict. Use ``full_state_dict()``
        or ``ls.save_checkpoint``."""
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

    @property
    def collective_device(self) -> torch.device | None:
        """Where tensors must be for this model's collectives: its GPU under NCCL (CPU offload
        keeps shards on the host), None when any device will do (gloo)."""
        comm = self._schedule.comm
        return comm.device if comm.backend == "nccl" else None

    def all_gather_into(self, out: torch.Tensor, src: torch.Tensor, label: str = "user") -> None:
        """Concatenate every shard-group rank's ``src`` (equal sizes) into ``out``, as the engine
        does (counted in ``comm_stats()`` under the phase "optimizer"). Collective."""
        self._schedule.comm.all_gather(out, src, "optimizer", label).wait()

    def quiesce(self) -> None:
        """Wait for every collective in flight that reads the shards (on CUDA a gather casts
        them on the comm stream). Call before writing shards by other means than the optimizer
        (``load_*`` call it)."""
        self._schedule.quiesce()

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
        grads = [
            p.grad
            for f in self.flat_params
            for p in f.shard_params
            if p.grad is not None and p.grad.numel() > 0
        ]
        device = self.flat_params[0].shard.device
        norm_type = float(norm_type)
        tp_group = dtensor.tp_group(s.kind for f in self.flat_params for s in f.slots)
        if tp_group is not None:  # TP x DP: sharded parts summed over TP too (engine/dtensor.py)
            terms = [
                (s, p.grad)
                for f in self.flat_params
                for s, p in zip(f.slots, f.shard_params)
                if p.grad is not None and p.grad.numel() > 0
            ]
            reduce = partial(self._schedule.comm.all_reduce, phase="clip", what=CLIP)
            total = dtensor.grad_norm(terms, norm_type, reduce, tp_group, device)
            coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
            if grads:
                torch._foreach_mul_(grads, coef)
            return total
        norms = list(torch._foreach_norm(grads, norm_type)) if grads else []
        local = torch.stack(norms) if norms else torch.zeros(1, device=device)
        comm = self._schedule.comm  # over the shard group: replicas hold the same slices
        if math.isinf(norm_type):
            total = comm.all_reduce(local.max().reshape(1), dist.ReduceOp.MAX, "clip", CLIP)
        else:
            total = comm.all_reduce(
                local.pow(norm_type).sum().reshape(1), dist.ReduceOp.SUM, "clip", CLIP
            )
            total = total.pow(1.0 / norm_type)
        total = total[0]
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if grads:
            torch._foreach_mul_(grads, coef)
        return total

    # -- state --

    def persistent_buffers(self) -> Iterator[tuple[str, torch.Tensor]]:
        """The wrapped model's persistent buffers under their ``state_dict()`` keys (replicated:
        every rank holds them whole)."""
        for key, kind, ref in self._entries:
            if kind == "buffer":
                yield key, getattr(ref[0], ref[1])

    @torch.no_grad()
    def gather_flat(self, f: FlatParam, dtype: torch.dtype | None = None) -> torch.Tensor:
        """``f`` whole (``padded_numel`` elements, in ``dtype``: by default the dtype it is
        stored in, fp32 or a frozen parameter's own) on every rank. Collective: every rank calls
        it for the same flat parameter. ``f.views(...)`` splits it by parameter."""
        # on the device collectives run on (NCCL: not the host, where CPU offload keeps shards)
        if f.packed or dtype is None:  # 4-bit bytes travel as they are (four_bit.py)
            dtype = f.dtype
        out = torch.empty(f.padded_numel, dtype=dtype, device=self._schedule.comm.device)
        self._schedule.comm.all_gather(out, f.shard, "state_dict", "gather_flat", f.over).wait()
        return out

    def whole_views(self, f: FlatParam, buf: torch.Tensor) -> list[torch.Tensor]:
        """Each parameter of ``f`` whole, from ``buf`` (``gather_flat(f)``): views of it, but
        an expert-parallel layer's experts, gathered over the EP group (collective: every rank
        calls it for the same flat)."""
        return [full_state.whole(self, s, v) for s, v in zip(f.slots, f.views(buf))]

    @torch.no_grad()
    @waiting("full_state_dict")
    def full_state_dict(
        self, rank0_only: bool = True, cpu: bool = True, packed: bool = True
    ) -> dict[str, torch.Tensor]:
        """The unsharded fp32 weights and persistent buffers under the original names, in the
        order of the wrapped model's ``state_dict()``. Collective; gathers one unit at a time.
        With ``rank0_only`` other ranks get ``{}``. 4-bit weights come as their packed bytes
        with their quantization state, as bitsandbytes' own ``state_dict()``; ``packed=False``
        leaves them out (an adapter save: the base is never gathered)."""
        return full_state.full_state_dict(self, rank0_only, cpu, packed)

    @contextlib.contextmanager
    def full_weights(self, writeback: bool = False) -> Iterator[nn.Module]:
        """Read (or, with ``writeback=True``, edit) the full weights, like FSDP's
        ``summon_full_params``. Collective: every rank enters and leaves together.

        Inside the context every weight attribute of the wrapped model (``model.lm_head.weight``)
        is the whole fp32 tensor, on every rank (tied parameters stay one tensor). On leaving,
        with ``writeback`` each rank copies its slice of every weight back into its shard (edits
        made in place, e.g. under ``torch.no_grad()``); without it, edits are discarded. Costs
        the whole model in fp32 on every rank while open; no forward may run inside. Yields the
        wrapped model."""
        s = self._schedule
        if s.full_weights_open:
            raise RuntimeError("model.full_weights(): already open (contexts do not nest)")
        if s.in_backward():
            raise RuntimeError("model.full_weights(): not available during backward")
        full = []
        s.quiesce()  # nothing in flight reads a shard while it may be written back
        for u in self.units:
            tensors = [v for f in u.flats for v in f.views(self.gather_flat(f))]
            full.append((u, tensors))
            u.bind(tensors)
        s.full_weights_open = True
        try:
            yield self.module
        finally:
            s.full_weights_open = False
            for u, tensors in full:
                u.unbind()
                if writeback:
                    it = iter(tensors)
                    for f in u.flats:
                        for slot in f.slots:
                            f.copy_from_full(slot, next(it))

    @torch.no_grad()
    @waiting("load_full_state_dict")
    def load_full_state_dict(
        self, state_dict: dict[str, torch.Tensor] | None, strict: bool = True
    ) -> None:
        """Load unsharded weights (e.g. from ``full_state_dict()`` or a HF model). Collective.
        Either every rank passes the dict, or rank 0 does and the others pass ``None``. With
        ``strict=False`` parameters and buffers missing from the dict keep their values and
        unexpected keys are ignored, as in torch. Every rank agrees on an error before any
        collective that moves data, so a bad dict raises everywhere instead of hanging."""
        full_state.load_full_state_dict(self, state_dict, strict)

    # -- observability --

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """Collectives issued since the last reset: ``{op: {"count", "bytes", <phase>: count}}``
        for op in all_gather, reduce_scatter, all_reduce, broadcast; phases forward, backward,
        clip, state_dict, init. Bytes are those of the full (unsharded) buffer."""
        out = self._schedule.comm.stats.as_dict()
        if reset:
            self._schedule.comm.stats.reset()
        return out

    def comm_wait_s(self) -> float:
        """Seconds the main thread has blocked on this model's collectives (CPU; on CUDA waits
        are stream events, not counted), until ``comm_stats(reset=True)``."""
        return sum(self._schedule.comm.stats.wait_s.values())

    def memory_report(self, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
        """Bytes this rank holds, by category (unique storages; includes optimizer state when an
        optimizer is given). ``grad_buffers`` and ``reduce_scratch`` are what the gradient slots
        take during backward (each slot's unsharded gradients and its reduce-scatter scratch, the
        latter only where the backend needs one): they are freed between backwards.
        ``large_gather`` and ``large_grad``: the storage of units larger than a block, held by
        one such unit at a time while it runs (docs/engine.md)."""
        s = self._schedule
        flats = self.flat_params
        shards = {f.shard.untyped_storage().data_ptr() for f in flats}
        report = {
            "params": sum(nbytes(f.shard) for f in flats),
            "grads": sum(nbytes(f.grad) for f in flats),
            **s.buffer_bytes(shards),
            "module_buffers": sum(
                {
                    b.untyped_storage().data_ptr(): nbytes(b)
                    for _, b in self.module.named_buffers()
                }.values()
            ),
            "no_sync": sum(nbytes(f.acc) for f in flats),
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
        slot_ids: dict[int, int] = {}
        rows = [f"{'unit':<32} {'params':>7} {'numel':>12} {'padded':>12} {'slot':>5}  trainable"]
        for u in self.units:
            sid = slot_ids.setdefault(id(u.slot), len(slot_ids))
            numel = sum(f.numel for f in u.flats)
            rows.append(
                f"{u.name:<32} {len(u.param_slots):>7} {numel:>12,} {u.gather_numel:>12,} {sid:>5}  "
                f"{bool(u.trainables)}"
            )
        rows.append(
            f"world size {s.world_size}, compute {s.precision.param_dtype}, reduce {s.precision.reduce_dtype}"
            + (f", gather {s.precision.gather_dtype}" if s.precision.gather_dtype else "")
        )
        return "\n".join(rows)
