"""Sharding strategies: over which ranks a unit's weights, gradients and optimizer state are split,
across which they are replicated, and whether weights stay gathered from forward to backward.

Every strategy is the same engine with different groups (N ranks in all):

    strategy    shard over      replicate over    weights between forward and backward
    full        all N           -                 resharded (backward re-gathers)
    full, K     all N           -                 kept sharded over K ranks (backward gathers
                                                  within those K: ZeRO++ hpZ, FSDP2's int)
    grad_op     all N           -                 kept gathered (no backward all-gather)
    hybrid      K (a node)      N / K groups      resharded; backward re-gathers within the node
    no_shard    1 (itself)      all N             kept (DDP: one all-reduce per unit)

A unit's gradients are reduce-scattered over the shard group, then the slices are all-reduced over
the replicate group; the optimizer steps on the slice a rank holds (replicated ranks step the same
slice with the same gradients, so they stay equal). The hpZ and hybrid groups are made by
``layershard.groups`` (consecutive blocks of K ranks, and every K-th rank for hybrid's replicas, as
torch's ``DeviceMesh`` lays them out), which also says when they go; a 2-D ``mesh`` passed in is
the caller's.

Past one dimension (issue 32) the groups come from meshes with named dimensions, laid out as
transformers' ``DistributedConfig`` lays them out: a dense mesh ``(dp_replicate, dp_shard, tp)``
and an expert mesh ``(dp_replicate, efsdp, ep)`` over the same ranks, ``efsdp * ep = dp_shard *
tp``. Dense units are sharded over ``dp_shard`` (the ranks with the same tensor-parallel
coordinate: their local shapes agree), the experts of an expert-parallel layer over ``efsdp``
(the ranks holding the same experts); both replicate over ``dp_replicate``. Every gradient is
divided by the whole data-parallel size ``dp_replicate * dp_shard``: an expert's gradient on its
rank already sums the contributions of its EP group's tokens (the all-to-all's backward brought
them home, parallel/expert.py), and the reduction over ``efsdp`` sums the rest.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from layershard.distributed import local_world_size
from layershard.groups import Groups, blocks, strided

STRATEGIES = {
    "full": "ZeRO-3: parameters, gradients and optimizer state sharded over all ranks",
    "grad_op": "ZeRO-2: weights stay gathered from a unit's forward to its backward",
    "no_shard": "DDP-like: everything replicated, one all-reduce per unit's gradients",
    "hybrid": "HSDP: sharded within groups of shard_size ranks, replicated across groups",
}


@dataclass(frozen=True)
class CPUOffload:
    """``ls.shard(..., offload=ls.CPUOffload())``: fp32 shards, gradient slices and optimizer
    state live in CPU memory (pinned where CUDA, for asynchronous copies) and the optimizer steps
    there; gathered weights and gradient buffers stay on the device. Costs a host-to-device copy
    of every shard per gather and a device-to-host copy of every reduced gradient chunk."""

    pin_memory: bool = True


@dataclass(frozen=True)
class Sharding:
    """The resolved strategy of one sharded model."""

    name: str
    shard_group: dist.ProcessGroup | None  # None: a group of one (this rank alone)
    replicate_group: dist.ProcessGroup | None  # None: no replicas
    keep_gathered: bool  # grad_op, no_shard: no re-gather in backward
    groups: Groups = field(compare=False, repr=False)  # every group made for this model
    hpz_group: dist.ProcessGroup | None = None  # full with reshard_after_forward=K
    # expert parallelism: the ranks holding the same experts (efsdp) and those splitting a
    # layer's experts (ep); None: a group of one
    expert_group: dist.ProcessGroup | None = None
    ep_group: dist.ProcessGroup | None = None

    @property
    def shard_size(self) -> int:
        return 1 if self.shard_group is None else dist.get_world_size(self.shard_group)

    @property
    def shard_rank(self) -> int:
        return 0 if self.shard_group is None else dist.get_rank(self.shard_group)

    @property
    def replicas(self) -> int:
        return 1 if self.replicate_group is None else dist.get_world_size(self.replicate_group)

    @property
    def replica_index(self) -> int:
        return 0 if self.replicate_group is None else dist.get_rank(self.replicate_group)

    @property
    def expert_size(self) -> int:
        return 1 if self.expert_group is None else dist.get_world_size(self.expert_group)

    @property
    def expert_rank(self) -> int:
        return 0 if self.expert_group is None else dist.get_rank(self.expert_group)

    @property
    def ep_size(self) -> int:
        return 1 if self.ep_group is None else dist.get_world_size(self.ep_group)

    @property
    def hpz_size(self) -> int:
        return 1 if self.hpz_group is None else dist.get_world_size(self.hpz_group)

    # The questions the engine and the checkpoints ask of a strategy (a new strategy answers
    # these; nothing else branches on its name).

    @property
    def gathers_in_backward(self) -> bool:
        """Are weights gathered again for backward (resharded after forward)?"""
        return not self.keep_gathered

    @property
    def backward_gather_group(self) -> str:
        """The group a backward gather runs over: ``"hpz"`` (within the K ranks that kept a
        1/K copy after forward) or ``"shard"``."""
        return "hpz" if self.hpz_group is not None else "shard"

    @property
    def writes_slices(self) -> bool:
        """Does this rank write its slices into a checkpoint? Replicas hold the same slices:
        only the first of them writes (a save deduplicates them), and every replica loads."""
        return self.replica_index == 0

    def shard_ranks(self) -> list[int]:
        """Global ranks of this rank's shard group, by shard index."""
        if self.shard_group is None:
            return [dist.get_rank()]
        return dist.get_process_group_ranks(self.shard_group)


def check_options(
    strategy: str,
    world: int | None,
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    mesh: bool = False,
    local_world: int | None = None,
) -> None:
    """The rules of ``shard()``'s strategy options, without any process group, so that a launcher
    can refuse a bad combination before ranks start (``layershard train``). ``world=None`` checks
    only what does not depend on the world size. Raises ``ValueError``."""
    if strategy not in STRATEGIES:
        raise ValueError(
            f"shard(strategy={strategy!r}): unknown strategy; use one of {', '.join(STRATEGIES)}"
        )
    if shard_size is not None and strategy != "hybrid":
        raise ValueError(f"shard(shard_size=...) applies to strategy='hybrid', not {strategy!r}")
    if reshard_after_forward is not True and strategy != "full":
        raise ValueError(
            f"shard(reshard_after_forward=...) applies to strategy='full' (grad_op never "
            f"reshards after forward), not {strategy!r}"
        )
    if mesh and strategy != "hybrid":
        raise ValueError("shard(mesh=...) applies to strategy='hybrid'")
    if world is None:
        return
    if strategy == "full" and reshard_after_forward not in (True, False):
        k = int(reshard_after_forward)
        if k < 1 or world % k:
            raise ValueError(
                f"shard(reshard_after_forward={k}): must divide the world size {world}"
            )
    if strategy == "hybrid" and not mesh:
        k = shard_size if shard_size is not None else (local_world or local_world_size(world))
        if k < 1 or world % k:
            raise ValueError(
                f"shard(strategy='hybrid', shard_size={k}): must divide the world size {world}"
            )


def named(mesh: DeviceMesh | None) -> bool:
    """A mesh with named dimensions (issue 32's ``dp_shard``...), not hybrid's plain 2-D one."""
    return mesh is not None and "dp_shard" in (mesh.mesh_dim_names or ())


def resolve(
    strategy: str,
    group: dist.ProcessGroup,
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    mesh: DeviceMesh | None = None,
    expert_mesh: DeviceMesh | None = None,
) -> Sharding:
    """Build the groups of ``strategy`` over ``group`` (collective: every rank calls it). The
    groups made here live as long as the returned ``Sharding`` (``layershard.groups``)."""
    if named(mesh) or expert_mesh is not None:
        return from_meshes(strategy, group, mesh, expert_mesh, shard_size, reshard_after_forward)
    world = dist.get_world_size(group)
    check_options(strategy, world, shard_size, reshard_after_forward, mesh is not None)
    groups = Groups(group)
    sharding = _resolve(strategy, group, groups, world, shard_size, reshard_after_forward, mesh)
    groups.owned_by(sharding)
    return sharding


def _resolve(strategy, group, groups, world, shard_size, reshard_after_forward, mesh) -> Sharding:
    if strategy == "full":
        hpz = None
        if reshard_after_forward is not True and reshard_after_forward is not False:
            k = int(reshard_after_forward)
            if k < world:
                if group is not dist.group.WORLD:
                    raise ValueError("shard(reshard_after_forward=K) needs the default group")
                hpz = groups.make("hpz", blocks(groups.ranks, k))
        elif reshard_after_forward is False:
            return Sharding("grad_op", group, None, True, groups)
        return Sharding("full", group, None, False, groups, hpz_group=hpz)
    if strategy == "grad_op":
        return Sharding("grad_op", group, None, True, groups)
    if strategy == "no_shard":
        return Sharding("no_shard", None, group if world > 1 else None, True, groups)
    # hybrid
    if mesh is not None:
        if mesh.ndim != 2:
            raise ValueError("shard(mesh=...): a 2-D DeviceMesh (replicate, shard)")
        shard_group, replicate_group = mesh.get_group(1), mesh.get_group(0)
    else:
        k = shard_size if shard_size is not None else local_world_size(world)
        if group is not dist.group.WORLD:
            raise ValueError("shard(strategy='hybrid') builds its groups over the default group")
        shard_group = groups.make("shard", blocks(groups.ranks, k))
        replicate_group = groups.make("replicate", strided(groups.ranks, k))
        assert shard_group is not None and replicate_group is not None  # every rank is in one
    shard = shard_group if dist.get_world_size(shard_group) > 1 else None
    replicate = replicate_group if dist.get_world_size(replicate_group) > 1 else None
    return Sharding("hybrid", shard, replicate, False, groups)


def _dim(mesh: DeviceMesh, name: str) -> dist.ProcessGroup | None:
    """The group of this rank along dimension ``name``; None when absent or of size one."""
    if name not in (mesh.mesh_dim_names or ()) or mesh[name].size() == 1:
        return None
    return mesh[name].get_group()


def _size(mesh: DeviceMesh, name: str) -> int:
    return mesh[name].size() if name in (mesh.mesh_dim_names or ()) else 1


def from_meshes(
    strategy: str,
    group: dist.ProcessGroup,
    mesh: DeviceMesh | None,
    expert_mesh: DeviceMesh | None,
    shard_size: int | None,
    reshard_after_forward: bool | int,
) -> Sharding:
    """The groups of a dense mesh ``(dp_replicate, dp_shard, tp)`` and an expert mesh
    ``(dp_replicate, efsdp, ep)`` (module docstring); the meshes are the caller's."""
    if strategy not in ("full", "grad_op", "hybrid"):
        raise ValueError(
            f"shard(strategy={strategy!r}) with a mesh: use 'full' or 'grad_op' (dp_replicate > 1 "
            "in the mesh makes it hybrid)"
        )
    if shard_size is not None or reshard_after_forward not in (True, False):
        raise ValueError(
            "shard(mesh=...): the mesh gives the groups; shard_size= and reshard_after_forward=K "
            "do not apply (use dp_replicate in the mesh for HSDP)"
        )
    if mesh is None or not named(mesh):
        raise ValueError(
            "shard(expert_mesh=...) needs mesh= too: a DeviceMesh with named dimensions "
            "including 'dp_shard' (ls.parallelize builds both)"
        )
    world = dist.get_world_size(group)
    if mesh.size() != world:
        raise ValueError(
            f"shard(mesh=...): the mesh has {mesh.size()} ranks, the process group {world}"
        )
    groups = Groups(group)
    keep = strategy == "grad_op" or reshard_after_forward is False
    replicate = _dim(mesh, "dp_replicate")
    expert = ep = None
    if expert_mesh is not None:
        names = expert_mesh.mesh_dim_names or ()
        if "ep" not in names or "efsdp" not in names or expert_mesh.size() != world:
            raise ValueError(
                "shard(expert_mesh=...): a DeviceMesh over the same ranks with dimensions "
                "('dp_replicate',) 'efsdp', 'ep' (as transformers' DistributedConfig lays them out)"
            )
        dense = _size(mesh, "dp_shard") * _size(mesh, "tp")
        if _size(expert_mesh, "efsdp") * _size(expert_mesh, "ep") != dense:
            raise ValueError(
                f"shard(expert_mesh=...): efsdp x ep ({_size(expert_mesh, 'efsdp')} x "
                f"{_size(expert_mesh, 'ep')}) must equal dp_shard x tp ({dense})"
            )
        if _size(expert_mesh, "dp_replicate") != _size(mesh, "dp_replicate"):
            raise ValueError("shard(expert_mesh=...): its dp_replicate must equal the mesh's")
        expert, ep = _dim(expert_mesh, "efsdp"), _dim(expert_mesh, "ep")
    name = "hybrid" if replicate is not None else ("grad_op" if keep else "full")
    sharding = Sharding(
        name, _dim(mesh, "dp_shard"), replicate, keep, groups, expert_group=expert, ep_group=ep
    )
    groups.owned_by(sharding)
    return sharding
