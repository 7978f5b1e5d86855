"""Unsharded weights in and out of a sharded model. ``full_state_dict``: every flat gathered in
turn, each parameter whole (an expert-parallel layer's experts over the EP group, a
tensor-parallel one over the TP group: ``whole``). ``load_full_state_dict``: every rank agrees on
the dict's validity before any data moves, then each rank copies its slice of each parameter
(from its own copy of the dict, or from rank 0's by broadcast)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.distributed as dist

from layershard.engine import dtensor
from layershard.engine.agreement import agreed
from layershard.engine.waits import waiting


def load_full_state_dict(
    model, state_dict: dict[str, torch.Tensor] | None, strict: bool = True
) -> None:
    """``ShardedModule.load_full_state_dict`` (its docstring says what and how)."""
    comm, group = model._schedule.comm, model.process_group
    world = dist.get_world_size(group)  # every rank of the model, replicas included
    device = comm.device  # NCCL reduces device tensors only (CPU offload: shards on host)
    model._schedule.quiesce()  # no gather still in flight reads a shard this overwrites
    has = [state_dict is not None]
    if world > 1:
        has = [False] * world
        with waiting("agreement on which ranks pass a state dict"):
            dist.all_gather_object(has, state_dict is not None, group=group)
    tp_group = dtensor.tp_group(s.kind for f in model.flat_params for s in f.slots)
    if tp_group is not None:  # each TP coordinate's group loads alone: all or none of them
        flag = torch.tensor([int(has[0])], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=tp_group)
        if not flag.item():
            raise ValueError(
                "load_full_state_dict(): a tensor-parallel model: rank 0 of the data-parallel "
                "group of every TP coordinate must pass the state dict (or every rank does)"
            )
    if not has[0]:  # every rank sees rank 0's flag: every rank raises
        raise ValueError(
            "load_full_state_dict(): rank 0 must pass a state dict (the other ranks may "
            "pass the same dict or None)"
        )
    everyone = all(has)
    with agreed(group):  # every rank learns every rank's verdict before any data moves
        error = _validate(model, state_dict, strict) if state_dict is not None else ""
        if error:
            raise ValueError(error)
    present = None if state_dict is None else [k for k, _, _ in model._entries if k in state_dict]
    if not everyone and world > 1:  # which keys rank 0 has: the others copy only those
        box = [present]
        dist.broadcast_object_list(box, src=dist.get_global_rank(group, 0), group=group)
        present = box[0]
    keys = set(present or [])
    by_slot: dict[int, str] = {}
    for key, kind, ref in model._entries:
        if kind == "param" and key in keys and id(ref[1]) not in by_slot:
            by_slot[id(ref[1])] = key
    for f in model.flat_params:
        loaded = [slot for slot in f.slots if id(slot) in by_slot]
        if not loaded:
            continue
        if everyone:
            assert state_dict is not None
            for slot in loaded:
                value = slot.part_of(state_dict[by_slot[id(slot)]])  # this rank's part
                # fp32, a frozen parameter's own dtype, or 4-bit bytes as they are
                dtype = value.dtype if slot.kind.packed else f.dtype
                f.copy_from_full(slot, value.to(f.shard.device, dtype))
            continue
        if f.over == "expert":  # each EP rank takes another part: every expert travels
            for slot in loaded:
                whole = torch.zeros(slot.whole_shape, device=device)
                if state_dict is not None:  # rank 0
                    whole.copy_(state_dict[by_slot[id(slot)]])
                comm.broadcast(whole, "state_dict")
                f.copy_from_full(slot, slot.part_of(whole))
            continue
        buf = torch.zeros(f.padded_numel, dtype=f.dtype, device=device)
        if state_dict is not None:  # rank 0
            for slot, view in zip(f.slots, f.views(buf)):
                if id(slot) in by_slot:
                    view.copy_(slot.part_of(state_dict[by_slot[id(slot)]]))
        comm.broadcast(buf, "state_dict")
        for slot, view in zip(f.slots, f.views(buf)):
            if id(slot) in by_slot:
                f.copy_from_full(slot, view)
    for key, b in model.persistent_buffers():
        if key not in keys:
            continue
        if state_dict is not None:
            b.copy_(state_dict[key])
        if not everyone and world > 1:
            comm.broadcast(b, "state_dict")


def _validate(model, sd: dict, strict: bool) -> str:
    expected = {key: ref for key, _, ref in model._entries}
    missing = [k for k in expected if k not in sd]
    unexpected = [k for k in sd if k not in expected]
    if strict and (missing or unexpected):
        return (
            f"load_full_state_dict(): missing keys {missing[:5]}{'...' if len(missing) > 5 else ''}, "
            f"unexpected keys {unexpected[:5]}{'...' if len(unexpected) > 5 else ''}; is this a "
            "state dict of the same model? (strict=False loads the keys present)"
        )
    for key, kind, ref in model._entries:
        if key not in sd:
            continue
        if not isinstance(sd[key], torch.Tensor):  # its shape may match, its copy would fail
            what = f"{type(sd[key]).__module__}.{type(sd[key]).__qualname__}"
            return (
                f"load_full_state_dict(): {key} is a {what.removeprefix('builtins.')}, not a "
                "torch.Tensor; pass tensors (torch.from_numpy(...))"
            )
        if kind == "quant_state":
            if not torch.equal(sd[key].to(ref.device), ref):
                return (
                    f"load_full_state_dict(): {key} is part of a 4-bit weight's quantization "
                    "state, which is fixed when the model is quantized and differs here; "
                    "load the 4-bit base with from_pretrained before ls.shard()"
                )
            continue
        if kind == "param":
            slot = ref[1]
            shape = slot.kind.state_shape(slot.shape)
        else:
            shape = getattr(ref[0], ref[1]).shape
        if tuple(sd[key].shape) != tuple(shape):
            return (
                f"load_full_state_dict(): {key} has shape {tuple(sd[key].shape)}, "
                f"the model expects {tuple(shape)}"
            )
    return ""


def whole(model, slot, part: torch.Tensor) -> torch.Tensor:
    """A parameter's whole from this rank's ``part``: an expert-parallel layer's (every EP
    rank's experts, along dim 0; collective over the EP group), a tensor-parallel one's (over the
    TP group), any other as it is (``ParamKind.gather_whole``)."""
    return slot.kind.gather_whole(part, model.sharding)


def keeps_full_state(model) -> bool:
    """Does this rank keep ``full_state_dict(rank0_only=True)``? Rank 0 of the model's group
    and, for a tensor-parallel model, of its TP group (one TP coordinate keeps the whole
    tensors): one rank in all, the one that writes what the others gathered with it."""
    tp_group = dtensor.tp_group(s.kind for f in model.flat_params for s in f.slots)
    first = dist.get_rank(model.process_group) == 0
    return first and (tp_group is None or dist.get_rank(tp_group) == 0)


@contextlib.contextmanager
def agreed_by_model(model) -> Iterator[None]:
    """``agreed`` over every rank that gathers ``model``'s weights with this one: its group
    and, for a tensor-parallel model, its TP group. Nested, so that a failure spreads over the
    TP group, then over the data-parallel group of each of its ranks: every rank of the mesh.
    Collective."""
    tp_group = dtensor.tp_group(s.kind for f in model.flat_params for s in f.slots)
    with agreed(model.process_group):
        if tp_group is None:
            yield
        else:
            with agreed(tp_group):
                yield


def keep_copy(t: torch.Tensor, cpu: bool) -> torch.Tensor:
    """What the rank that keeps the full state holds of a gathered tensor: the step that fails
    on that rank alone (it holds the whole model: out of memory)."""
    return t.to("cpu") if cpu else t.clone()


def full_state_dict(model, rank0_only: bool, cpu: bool, packed: bool) -> dict[str, torch.Tensor]:
    """``ShardedModule.full_state_dict`` (its docstring says what)."""
    keep = not rank0_only or keeps_full_state(model)
    full: dict[int, torch.Tensor] = {}
    error: Exception | None = None  # kept until every flat is gathered: the others gather on
    for f in model.flat_params:
        if f.packed and not packed:
            continue
        views = model.whole_views(f, model.gather_flat(f))
        if keep and error is None:
            try:
                for slot, t in zip(f.slots, views):
                    full[id(slot)] = keep_copy(t, cpu)
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                error, full = e, {}
    with agreed_by_model(model):
        if error is not None:
            raise error
        return _assemble(model, full, cpu, packed) if keep else {}


def _assemble(model, full: dict[int, torch.Tensor], cpu: bool, packed: bool) -> dict:
    """The state dict in the wrapped model's ``state_dict()`` order: the gathered parameters
    (``full``, by slot), quantization states and persistent buffers (copies)."""
    out = {}
    for key, kind, ref in model._entries:
        if kind == "param":
            if id(ref[1]) in full:
                out[key] = full[id(ref[1])]
        elif kind == "quant_state":
            if packed:
                out[key] = ref.to("cpu", copy=True) if cpu else ref.clone()
        else:
            b = getattr(ref[0], ref[1])
            # a copy, also on CPU: the live buffer changes as training goes on
            out[key] = b.detach().to("cpu", copy=True) if cpu else b.detach().clone()
    return out
