"""The meshes of an N-D run and what layershard takes from them.

The meshes are laid out as transformers' ``DistributedConfig`` lays them out (so a rank's
coordinates mean the same under either library): a dense mesh ``(dp_replicate, dp_shard, tp)``
and an expert mesh ``(dp_replicate, efsdp, ep)`` over the same ranks, row-major, with
``efsdp = dp_shard * tp / ep``. A layer's EP group is thus ``ep`` consecutive ranks, and the
ranks holding the same experts (efsdp) are every ``ep``-th rank within a replica.

Context parallelism (``ls.parallelize(cp=...)``, ep 1) splits each sequence over ``cp`` ranks
laid out as torchtitan's ``(dp_replicate, dp_shard, cp, tp)`` mesh lays them out
(``context_group``): with tp 1 ``cp`` *consecutive* ranks, with TP the ranks ``tp`` apart in a
block of ``cp x tp`` (TP innermost): the group's all-to-alls or ring hops, one per layer and as
large as the activations, stay within a node where the weights' gathers span the nodes. The
weights are sharded over every rank of a replica with this rank's TP coordinate, ``dp_shard x
cp`` (torchtitan's ``dp_shard_cp``): the dense mesh's ``dp_shard`` dim is that product, so the
cp ranks share the weight shards and weight memory falls with cp too. Rank ``r`` trains
data-parallel micro-batch ``r // (cp x tp)`` of ``world // (cp x tp)``.

``mesh_sizes`` is the arithmetic (the planner and ``ShardingPlugin`` share it), ``make_meshes``
builds both meshes, ``data_parallel`` / ``from_mesh`` turn a TP mesh into ``ls.shard``'s
data-parallel group, ``context_group`` makes the CP groups. Every group and mesh is made
through ``layershard.groups``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from layershard.distributed import default_device, local_world_size
from layershard.groups import device_mesh, process_wide

DENSE_DIMS = ("dp_replicate", "dp_shard", "tp")
EXPERT_DIMS = ("dp_replicate", "efsdp", "ep")


def mesh_sizes(world: int, tp: int = 1, ep: int = 1, dp_replicate: int = 1) -> dict[str, int]:
    """Every dimension's size for ``world`` ranks, or ``ValueError`` saying what to change."""
    for name, n in (("tp", tp), ("ep", ep), ("dp_replicate", dp_replicate)):
        if n < 1:
            raise ValueError(f"parallelize({name}={n}): must be at least 1")
    if world % (tp * dp_replicate):
        raise ValueError(
            f"parallelize(tp={tp}, dp_replicate={dp_replicate}): their product must divide the "
            f"world size {world}"
        )
    dp_shard = world // (tp * dp_replicate)
    if (dp_shard * tp) % ep:
        raise ValueError(
            f"parallelize(ep={ep}): must divide dp_shard x tp = {dp_shard * tp} (the ranks of a "
            "replica), so that efsdp = dp_shard x tp / ep is whole"
        )
    efsdp = dp_shard * tp // ep
    return dict(dp_replicate=dp_replicate, dp_shard=dp_shard, tp=tp, efsdp=efsdp, ep=ep)


def make_meshes(
    tp: int = 1, ep: int = 1, dp_replicate: int = 1, device_type: str | None = None
) -> tuple[DeviceMesh, DeviceMesh]:
    """The dense and the expert mesh over every rank (collective; made once per process and
    layout: ``groups.device_mesh``)."""
    world = dist.get_world_size()
    n = mesh_sizes(world, tp, ep, dp_replicate)
    kind = device_type or default_device(dist.group.WORLD).type
    dense = device_mesh(kind, (n["dp_replicate"], n["dp_shard"], tp), DENSE_DIMS)
    expert = device_mesh(kind, (n["dp_replicate"], n["efsdp"], ep), EXPERT_DIMS)
    return dense, expert


def context_group(cp: int, dp_replicate: int = 1, tp: int = 1) -> dist.ProcessGroup:
    """This rank's context-parallel group (the module doc): with ``tp`` 1, ``cp`` consecutive
    ranks; with TP, the ``cp`` ranks of a block of ``cp x tp`` consecutive ones that share this
    rank's TP coordinate (every ``tp``-th), as torchtitan's ``(..., cp, tp)`` mesh has them.
    Every group of the world is made once per process and kept (``groups.process_wide``).
    ``ValueError`` unless ``cp x tp x dp_replicate`` divides the world size. Collective over
    the world the first time."""
    world = dist.get_world_size()
    if cp < 1 or world % (cp * tp * dp_replicate):
        raise ValueError(
            f"parallelize(cp={cp}, tp={tp}, dp_replicate={dp_replicate}): cp x tp x "
            f"dp_replicate = {cp * tp * dp_replicate} must divide the world size {world}"
        )
    partition = [
        [base + c * tp + t for c in range(cp)]
        for base in range(0, world, cp * tp)
        for t in range(tp)
    ]
    group = process_wide("context_parallel", partition)
    assert group is not None  # every rank is in one group
    return group


def data_parallel(mesh: DeviceMesh) -> dict[str, Any]:
    """``ls.shard`` options that make layershard the data-parallel axis of ``mesh``, a
    ``DeviceMesh`` with named dims ``("dp_shard", "tp")`` or ``("dp_replicate", "dp_shard",
    "tp")`` (transformers' and torchtitan's names): ``process_group``, the ranks with this rank's
    TP coordinate, and with ``dp_replicate`` > 1 ``strategy="hybrid"`` over the (replicate,
    shard) mesh. Use: ``ls.shard(model, **data_parallel(mesh))`` after parallelizing the model
    over ``mesh["tp"]``. Collective (with more than one data-parallel dim, one group per TP
    coordinate, made once per process: ``groups.process_wide``)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp")):
        raise ValueError(
            f"data_parallel(mesh): dims {names} given; ('dp_shard', 'tp') or "
            "('dp_replicate', 'dp_shard', 'tp') expected"
        )
    if len(names) == 2 or mesh["dp_replicate"].size() == 1:
        return {"process_group": mesh["dp_shard"].get_group()}
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    columns = mesh.mesh.reshape(-1, mesh["tp"].size()).t().tolist()  # one per TP coordinate
    mine = process_wide("data_parallel", columns)
    assert mine is not None, "data_parallel(mesh): this rank is not in the mesh"
    return {"process_group": mine, "strategy": "hybrid", "mesh": dp_mesh}


def from_mesh(
    mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None, strategy: str
) -> tuple[dist.ProcessGroup | None, str, DeviceMesh | None]:
    """``shard(mesh=...)`` with a ``tp`` dim (``data_parallel``'s names): the data-parallel group,
    the strategy (``hybrid`` when ``dp_replicate`` > 1) and the (replicate, shard) mesh it gives;
    any other mesh (HSDP's 2-D one) passes through unchanged."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return process_group, strategy, mesh
    if process_group is not None:
        raise ValueError(
            "shard(mesh=...): a mesh with a 'tp' dim gives the data-parallel group itself; "
            "pass no process_group"
        )
    options = data_parallel(mesh)
    if "strategy" in options:
        if strategy not in ("full", "hybrid"):
            raise ValueError(
                f"shard(mesh=...): dp_replicate > 1 is HSDP (strategy='hybrid'), not {strategy!r}"
            )
        strategy = "hybrid"
    return options["process_group"], strategy, options.get("mesh")


def hybrid_replicas(world: int, shard_size: int | None) -> int:
    """How many replicas HSDP makes when ``shard_size`` ranks (default: a node's) hold one."""
    replica = shard_size or local_world_size(world)
    if replica < 1 or world % replica:
        raise ValueError(
            f"parallelize(strategy='hybrid', shard_size={replica}): must divide the world size "
            f"{world} (the ranks that hold one replica)"
        )
    return world // replica
