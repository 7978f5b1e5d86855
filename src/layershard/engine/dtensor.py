"""The engine's adapter for ``DTensor`` parameters: a model whose blocks torch parallelized
(``torch.distributed.tensor.parallel.parallelize_module``, parameters ``DTensor`` over a TP mesh)
sharded by layershard over its data-parallel group (the ranks with the same TP coordinate).

What the engine does with a ``DTensor`` parameter, and where:

- its *local* shard (``to_local()``) is what goes into the unit's flat buffer: ``ParamSlot.shape``
  is the local shape and ``ParamSlot.tp`` (a ``TPInfo``) keeps the mesh, the placements and the
  global shape and stride (``build._make_flats``, ``init.fill_shards``). Every member of a
  data-parallel group has the same TP coordinate, hence the same local shapes: its flat layout is
  the same on every member, as the engine needs;
- before the unit runs, each gathered local view is wrapped again (``DTensor.from_local``, no
  communication: ``wrap``) so that the TP modules' hooks and DTensor ops see the parameter they
  were given (``Unit.bind``). ``from_local``'s backward hands the engine the gradient of the local
  view, redistributed to the parameter's placements when it came back in another one: what the
  reducer reduces is a plain local tensor, as for any parameter;
- the gradient norm (``grad_norm``): the squares of a TP-sharded parameter's local gradient are
  summed over the TP group too; a parameter replicated over TP is counted once, not once per TP
  rank;
- a DTensor weight that a unit's forward saves for its backward is kept as its place in the
  unit's buffer, as a plain weight view is (``split_dtensor``; ``backward.SavedDTensor``);
- ``full_state_dict`` assembles the whole tensor over the TP group (``full_tensor``), and
  ``load_full_state_dict`` keeps each rank's part of it (``local_of_full``).

The plans that parallelize a model live beside the models (``models/llama_tp.py``,
``models/hf_tp.py``); the meshes and the data-parallel group of a TP mesh in ``meshes.py``.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Placement, Replicate, Shard, distribute_tensor

from layershard.engine.param_kind import ParamKind


@dataclass(frozen=True)
class TPInfo(ParamKind):
    """What re-wraps a parameter's local shard as the ``DTensor`` it was: its mesh, placements
    and global shape and stride. As a ``ParamKind``: the flat storage holds the local shard,
    the module computes with the ``DTensor`` over it, checkpoints hold the global tensor."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """Does each TP rank hold a different part (else every rank holds it whole)?"""
        return any(isinstance(p, Shard) for p in self.placements)

    @property
    def group(self) -> dist.ProcessGroup:
        """The TP group (a 1-D mesh)."""
        return self.mesh.get_group()

    @property
    def split_over_tp(self) -> bool:
        return self.sharded

    def whole_shape(self, shape: torch.Size) -> torch.Size:
        return self.shape

    def part_offsets(self, whole: tuple[int, ...]) -> list[int]:
        """Where this rank's shard starts along its placement's dim (torch's ``Shard``:
        ``ceil(n / tp)`` rows per rank, the last ones fewer)."""
        at = [0] * len(whole)
        (placement,) = self.placements  # a 1-D TP mesh (``info`` refuses others)
        if isinstance(placement, Shard):
            d = placement.dim % len(whole)
            step = -(-whole[d] // self.mesh.size())
            at[d] = min(step * dist.get_rank(self.group), whole[d])
        elif not isinstance(placement, Replicate):
            raise NotImplementedError(
                f"a DTensor parameter placed {placement}; only Shard and Replicate parameters "
                "are supported"
            )
        return at

    def contiguous(self, whole: torch.Size) -> bool:
        (placement,) = self.placements
        if not isinstance(placement, Shard):
            return True
        d = placement.dim % len(whole)
        return math.prod(whole[:d]) == 1

    def local_part(self, whole: torch.Tensor, shape: torch.Size) -> torch.Tensor:
        return local_of_full(self, whole)

    def gather_whole(self, part: torch.Tensor, sharding: Any) -> torch.Tensor:
        return full_tensor(self, part)

    def bind(self, t: torch.Tensor) -> torch.Tensor:
        return wrap(self, t)  # the module-level name: a test replaces it (a negative control)


def info(p: torch.Tensor) -> TPInfo | None:
    """A ``DTensor`` parameter's ``TPInfo``; None for a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    if p.device_mesh.ndim != 1:
        raise ValueError(
            "shard(): a DTensor parameter over a mesh of more than one dimension; layershard is "
            "the data-parallel axis: pass parameters distributed over the TP mesh only "
            "(mesh['tp']) and the data-parallel group as ls.shard(process_group=...)"
        )
    return TPInfo(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def split_dtensor(t: torch.Tensor) -> tuple[torch.Tensor, TPInfo] | None:
    """A ``DTensor``'s local tensor (no autograd) and what wraps it again; None for another
    tensor. The saved-tensor hooks (engine/backward_hooks.py) save a DTensor over a unit's gathered
    weights as where in the unit's buffer, as they save a plain weight view."""
    if not isinstance(t, DTensor):
        return None
    spec = TPInfo(t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()))
    return cast(DTensor, t.detach()).to_local(), spec  # detached: no autograd node, an alias


def local(p: torch.Tensor) -> torch.Tensor:
    """What a parameter contributes to its unit's flat buffer: a ``DTensor``'s local shard."""
    return p.to_local() if isinstance(p, DTensor) else p


def local_shape(p: torch.Tensor) -> torch.Size:
    return local(p).shape


def wrap(tp: TPInfo, t: torch.Tensor) -> DTensor:
    """``t`` (the local shard, e.g. a view of a gathered buffer) as the parameter's ``DTensor``;
    no communication. Differentiable: the gradient of ``t`` is the local part of the DTensor's
    gradient in the parameter's placements."""
    return DTensor.from_local(
        t, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride
    )


@torch.no_grad()
def full_tensor(tp: TPInfo, t: torch.Tensor) -> torch.Tensor:
    """The whole parameter from this rank's local shard ``t``. Collective over the TP group."""
    return wrap(tp, t).full_tensor()


@torch.no_grad()
def local_of_full(tp: TPInfo, full: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of the whole parameter ``full``: a view of it where it lies (no
    communication, and no copy of the whole tensor to the mesh's device, which
    ``distribute_tensor`` makes: meta init slices whole CPU tensors of a CUDA mesh's model)."""
    (placement,) = tp.placements  # a 1-D TP mesh (``info`` refuses others)
    if type(placement) is Replicate:
        return full
    if type(placement) is not Shard:  # _StridedShard...
        return distribute_tensor(full, tp.mesh, tp.placements, src_data_rank=None).to_local()
    # torch's Shard splits as torch.chunk does: ceil(n / size) each, the last ones fewer or none
    d, size = placement.dim % full.ndim, tp.mesh.size()
    n = full.shape[d]
    step = -(-n // size)
    start = min(step * dist.get_rank(tp.group), n)
    return full.narrow(d, start, min(step, n - start))


def check_groups(params: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Refuse DTensor parameters whose TP mesh shares a rank other than this one with the
    data-parallel ``group``: the members of a data-parallel group must hold the same part of each
    parameter (the same TP coordinate), or the gathered flat buffer would mix different parts."""
    group_of = tp_group(info(p) for p in params)
    if group_of is None:
        return
    both = set(dist.get_process_group_ranks(group_of)) & set(dist.get_process_group_ranks(group))
    if len(both) > 1:
        raise ValueError(
            f"shard(): ranks {sorted(both)} are in the TP mesh of the DTensor parameters and in "
            "the data-parallel process_group; pass the group of the ranks with this rank's TP "
            "coordinate (ls.shard(model, **layershard.meshes.data_parallel(mesh)))"
        )


def checkpoint_group(model, what: str) -> dist.ProcessGroup | None:
    """The group a checkpoint or an export of ``model`` runs over: its process group, or every
    rank (the default group) for a tensor-parallel model: each TP coordinate's data-parallel
    group holds other parts of the same parameters, which one DCP save or load must see
    together. A tensor-parallel model over part of the world is refused in one line."""
    group = tp_group(s.kind for f in model.flat_params for s in f.slots)
    if group is None:
        return model.process_group
    dp = dist.get_world_size(model.process_group)
    if dp == dist.get_world_size():  # sharded from meshes over every rank (TP x EP)
        return model.process_group
    if dp * dist.get_world_size(group) != dist.get_world_size():
        raise NotImplementedError(
            f"{what}: a tensor-parallel model over part of the world is not supported; shard it "
            "over every rank (its data-parallel x TP mesh the whole world), or use "
            "model.full_state_dict() and load_full_state_dict()"
        )
    return dist.group.WORLD


def tp_of(slot: Any) -> TPInfo | None:
    """The ``TPInfo`` of a ``ParamSlot`` holding a DTensor's local shard; None for another."""
    return slot.kind if isinstance(slot.kind, TPInfo) else None


def tp_group(kinds: Iterable[Any]) -> dist.ProcessGroup | None:
    """The TP group of a model's ``DTensor`` parameters (None: it has none), from its slots'
    ``kind``s (or ``TPInfo | None``s). One TP mesh only."""
    ranks = dist.get_process_group_ranks
    groups = {tuple(ranks(t.group)): t.group for t in kinds if isinstance(t, TPInfo)}
    if len(groups) > 1:
        raise ValueError("shard(): DTensor parameters over more than one TP mesh")
    return next(iter(groups.values()), None)


def split_over_tp(slot) -> bool:
    """Does each TP rank hold a different part of the parameter of ``slot`` (a ``ParamSlot``;
    its gradient's squares summed over the TP group), or every TP rank the same (counted once)?
    Split: a TP-sharded DTensor's, and experts split by expert parallelism (with TP, the ranks of
    a replica hold different experts or different shards of them): ``ParamKind.split_over_tp``."""
    return slot.kind.split_over_tp


def grad_norm(
    terms: list[tuple[Any, torch.Tensor]],
    norm_type: float,
    reduce_dp: Callable[[torch.Tensor, Any], torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """The norm of the whole gradient of a TP x DP model, from ``(ParamSlot, gradient slice)`` of
    this rank's slices. ``reduce_dp`` reduces over the data-parallel (shard) group; then the
    TP-sharded parameters' part is reduced over the TP ``group``, and the part replicated over TP
    (the same on every TP rank) is counted once. Collective over both groups."""
    inf = math.isinf(norm_type)

    def part(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        norms = torch.stack(list(torch._foreach_norm(grads, norm_type)))
        return norms.max() if inf else norms.pow(norm_type).sum()

    sharded = [g for slot, g in terms if split_over_tp(slot)]
    whole = [g for slot, g in terms if not split_over_tp(slot)]
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    both = reduce_dp(torch.stack([part(sharded), part(whole)]), op)
    over_tp = both[:1].clone()
    dist.all_reduce(over_tp, op=op, group=group)
    total = torch.maximum(over_tp[0], both[1]) if inf else over_tp[0] + both[1]
    return total if inf else total.pow(1.0 / norm_type)
