"""What ``shard()`` assembles, once the units are found: each unit's flat storage (this rank's
slices), its gather slot, the gradient slots, the collectives, and the schedule over them."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from layershard.engine import dtensor
from layershard.engine.buffers import GatherSlot, GradSlot, Spare
from layershard.engine.collectives import Comm
from layershard.engine.flat import FlatParam, ParamSlot, layout
from layershard.engine.float8 import Float8Weight
from layershard.engine.four_bit import Packed, is_packed
from layershard.engine.gather_slots import (
    OWN,
    TURNS,
    assign_gather_slots,
    slot_limit,
    slot_numels,
)
from layershard.engine.param_kind import PLAIN, ParamKind, expert_part
from layershard.engine.precision import MixedPrecision
from layershard.engine.reducer import Reducer
from layershard.engine.schedule import Schedule
from layershard.engine.strategy import Sharding
from layershard.engine.units import Unit, UnitSpec, backward_needs_weights
from layershard.engine.wire_dtype import FP8, WireGather


@dataclass
class Storage:
    """Every unit's flat groups (trainable first, then frozen), in ``specs`` order; the one
    buffer each unit's shards are views of when unsharded fp32 computes on them (no_shard); and
    where each original parameter went (``id(param) -> (flat, slot)``)."""

    flats: list[list[FlatParam]]
    buffers: list[torch.Tensor | None]
    slot_of: dict[int, tuple[FlatParam, ParamSlot]]


def make_storage(
    specs: list[UnitSpec],
    sharding: Sharding,
    precision: MixedPrecision,
    host: torch.device,
    offload: bool,
    pin: bool,
) -> Storage:
    """Zeroed flat storage for every unit (``host``: where the fp32 shards live). Unsharded fp32
    compute (no_shard) computes on the shards themselves: a unit's flats are then views of one
    buffer, which is also its gather slot (no copy, no second copy in memory)."""
    world, rank = sharding.shard_size, sharding.shard_rank
    in_place = world == 1 and precision.param_dtype == torch.float32 and not offload
    in_place = in_place and sharding.expert_size == 1
    experts = (sharding.expert_size, sharding.expert_rank)
    storage = Storage([], [], {})
    for spec in specs:
        flats, buffer, placed = _make_flats(
            spec, (world, rank), experts, host, in_place, precision.param_dtype
        )
        if pin:
            for f in flats:
                f.pin()
        storage.slot_of.update((id(p), (f, sl)) for p, f, sl in placed)
        storage.flats.append(flats)
        storage.buffers.append(buffer)
    return storage


def build_schedule(
    specs: list[UnitSpec],
    storage: Storage,
    sharding: Sharding,
    precision: MixedPrecision,
    group: dist.ProcessGroup,
    device: torch.device,
    offload: bool,
) -> Schedule:
    """The units, their slots (preallocated), the gradient slots, the collectives and the
    schedule (hooks not yet installed)."""
    comm = Comm(sharding, group, device)
    comm.host_sync = offload
    if precision.gather_dtype is not None:
        flats = [f for fl in storage.flats for f in fl if comm.quantizable(f)]
        comm.wire = WireGather(precision.gather_dtype, flats)
        # fp8 bytes to torchao's Float8Linear as they are gathered (float8.py); not where the
        # backward re-gathers the forward's dequantized weights (reshard_after_forward=K)
        if precision.gather_dtype == FP8 and sharding.hpz_group is None:
            for f in flats:
                for slot in f.slots:
                    slot.kind = Float8Weight.of(slot) or slot.kind
    host = storage.flats[0][0].shard.device if storage.flats else device
    root_spec = specs[0] if specs[0].module is None else None
    others = [
        (s, fl, buf)
        for s, fl, buf in zip(specs, storage.flats, storage.buffers)
        if s is not root_spec
    ]
    cdtype, rdtype = precision.param_dtype, precision.reduce_dtype
    unit_numel = [sum(f.padded_numel for f in fl) for _, fl, _ in others]
    blocks = [spec.is_block for spec, _, _ in others]
    # Units larger than every block size no shared buffer (see buffers.py)
    limit = slot_limit(unit_numel, blocks)
    spare = Spare()  # what units larger than a block give back, for the next (buffers.py)
    if sharding.keep_gathered:  # weights stay gathered until the backward: a slot per unit
        slots = [GatherSlot(n, cdtype, device, buf) for n, (_, _, buf) in zip(unit_numel, others)]
    else:  # two slots taken in turn, one of its own per small unit, storage of its own per
        # unit larger than a block (see buffers.py)
        lookup = bool(others) and not backward_needs_weights(others[0][0])
        which = assign_gather_slots(unit_numel, first_is_lookup=lookup, blocks=blocks)
        pool = {
            k: GatherSlot(n, cdtype, device, in_turns=k in TURNS)
            for k, n in slot_numels(which, unit_numel).items()
        }
        slots = [
            GatherSlot(n, cdtype, device, transient=True, spare=spare) if k == OWN else pool[k]
            for k, n in zip(which, unit_numel)
        ]
    trainable = [f for fl in storage.flats for f in fl if f.requires_grad]
    host_dev = host if offload else None
    shared = [f for f in trainable if f.padded_numel <= limit]
    large = [f for f in trainable if f.padded_numel > limit]
    grad_numel = max((f.padded_numel for f in shared), default=0)
    shard_numel = max((f.shard_numel for f in shared), default=0)
    scratch = max(
        (comm.scratch_numel(f.padded_numel, f.shard_numel, f.over, rdtype) for f in shared),
        default=0,
    )
    grad_slots = [
        GradSlot(grad_numel, rdtype, device, shard_numel, scratch, host_dev)
        for _ in range(2 if shared else 0)
    ]
    own = None
    if large:  # one gradient buffer at a time, of the size of the unit being reduced
        big = max(large, key=lambda f: f.padded_numel)
        big_scratch = max(
            comm.scratch_numel(f.padded_numel, f.shard_numel, f.over, rdtype) for f in large
        )
        own = GradSlot(
            big.padded_numel, rdtype, device, big.shard_numel, big_scratch, host_dev, True, spare
        )
    units = [
        Unit(s.name, s.modules, s.is_block, fl, slot, device, backward_needs_weights(s))
        for (s, fl, _), slot in zip(others, slots)
    ]
    for u in units:
        if u.slot.transient and any(f.packed for f in u.flats):
            raise ValueError(
                f"shard(): unit {u.name} holds 4-bit weights and is larger than every block, so "
                "its gathered weights would live in storage of its own, freed after its forward; "
                "its 4-bit matmuls read them again in backward (four_bit.py). Pass layers= so "
                "that it is a block, or keep that module unquantized (llm_int8_skip_modules)"
            )
    if sharding.hpz_group is not None:
        k = sharding.hpz_size
        for u in units:
            if u.gather_in_backward:
                u.secondary = [
                    torch.empty(f.padded_numel // k, dtype=cdtype, device=device) for f in u.flats
                ]
    root = None
    if root_spec is not None:
        root_flats, root_buffer = storage.flats[0], storage.buffers[0]
        numel = sum(f.padded_numel for f in root_flats)
        root_slot = GatherSlot(numel, cdtype, device, root_buffer)
        root = Unit("<root>", [], False, root_flats, root_slot, device)
    reducer = Reducer(grad_slots, comm, offload, own)
    return Schedule(root, units, reducer, comm, precision, spare)


# A unit's flat groups, in this order: (trainable, 4-bit, experts)
_GROUPS = (
    (True, False, False), (True, False, True), (False, False, False), (False, False, True),
    (False, True, False),
)  # fmt: skip


def _by_dtype(members: list, fp32_only: bool) -> list[tuple[torch.dtype, list]]:
    """``members`` split into flat groups by the dtype their shards keep: fp32 (masters, and
    4-bit bytes, which ``_make_flats`` carries in the gather dtype), but a frozen floating-point
    parameter of another dtype (a model loaded in bf16, its embedding, head and norms frozen
    under QLoRA) keeps its own: a group per dtype, fp32 first, none copied to fp32."""
    by: dict[torch.dtype, list] = {}
    for p, uses in members:
        own = p.dtype if not fp32_only and p.is_floating_point() else torch.float32
        by.setdefault(own, []).append((p, uses))
    return sorted(by.items(), key=lambda kv: (kv[0] != torch.float32, str(kv[0])))


def _make_flats(
    spec: UnitSpec,
    shard: tuple[int, int],
    experts: tuple[int, int],
    device: torch.device,
    in_place: bool,
    carrier: torch.dtype,
) -> tuple[list[FlatParam], torch.Tensor | None, list[tuple[nn.Parameter, FlatParam, ParamSlot]]]:
    """The unit's flat groups (trainable first, then frozen, then frozen 4-bit weights as bytes in
    the ``carrier`` dtype, four_bit.py; experts of an expert-parallel layer in groups of their
    own, split over the ``experts`` (size, rank) group instead of the ``shard`` one); with
    ``in_place``, the one zeroed buffer whose consecutive views their shards are; and where each
    original parameter went."""
    groups = []
    for requires_grad, packed, expert in _GROUPS:
        members = [
            (p, uses)
            for p, uses in spec.params
            if p.requires_grad == requires_grad
            and is_packed(p) == packed
            and (expert_part(p) is not None) == expert
        ]
        for kept, group in _by_dtype(members, packed or requires_grad):
            world = experts[0] if expert else shard[0]
            how = [Packed.of(p, device) if packed else None for p, _ in group]
            numels = [
                dtensor.local_shape(p).numel() if k is None else k.carrier_numel(carrier)
                for (p, _), k in zip(group, how)
            ]
            offsets, _, shard_numel = layout(numels, world)
            groups.append((requires_grad, expert, group, offsets, shard_numel, how, numels, kept))
    buffer = None
    # fp32 compute: the carrier is fp32 too; a frozen group kept in another dtype cannot be a
    # view of the fp32 buffer its slot computes on, so that unit gathers (casts) into a slot
    if in_place and all(g[7] == torch.float32 for g in groups):
        buffer = torch.zeros(sum(g[4] * shard[0] for g in groups), device=device)
    flats, placed, start = [], [], 0
    for requires_grad, expert, group, offsets, shard_numel, how, numels, kept in groups:
        slots = [
            ParamSlot(
                uses,
                dtensor.local_shape(p) if k is None else torch.Size([n]),
                offset,
                requires_grad,
                kind_of(p, k, uses[0].name),
            )  # fmt: skip
            for (p, uses), offset, k, n in zip(group, offsets, how, numels)
        ]
        storage = None if buffer is None else buffer[start : start + shard_numel]
        dtype = carrier if how[0] is not None else kept
        world, rank = experts if expert else shard
        over = "expert" if expert else "shard"
        f = FlatParam(
            slots, requires_grad, world, rank, device, storage=storage, dtype=dtype, over=over
        )
        start += shard_numel * world
        placed += [(p, f, sl) for (p, _), sl in zip(group, slots)]
        flats.append(f)
    return flats, buffer, placed


def kind_of(p: nn.Parameter, packed: Packed | None, name: str) -> ParamKind:
    """What kind of parameter ``p`` is (param_kind.py): its 4-bit bytes (``packed``), some
    experts of a larger one, a DTensor's local shard, or plain. One kind per parameter."""
    kinds = [k for k in (packed, expert_part(p), dtensor.info(p)) if k is not None]
    if len(kinds) > 1:
        what = " and ".join(type(k).__name__ for k in kinds)
        raise ValueError(
            f"shard(): {name} is {what} at once, which layershard does not support; keep 4-bit "
            "weights, expert-parallel experts and tensor-parallel DTensors apart"
        )
    return kinds[0] if kinds else PLAIN
