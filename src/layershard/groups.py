"""Every process group layershard makes is made here, and here each one's life ends.

A sharded model may need groups besides the one it runs on: a gloo *control* group for the small
agreements of an NCCL model (``Comm.control``), a gloo group for its asynchronous checkpoint
saves (checkpoint/save.py), its strategy's hpZ or hybrid groups (engine/strategy.py), and on
gloo the *lanes* and *routes by node* of the groups it gathers over (engine/gloo_routes.py). Each
model has one ``Groups`` (``model.sharding.groups``), and every group is made by ``Groups.make``.

Who calls, in which order:

- Every rank of the model's group calls ``make`` at the same point of its program (shard(), the
  first asynchronous save), as for any collective, in the same order.
- A model over every rank of the world: each rank makes every group of a partition, also those
  it is not a member of. torch names these groups by a count each rank keeps (``new_group``), so
  a rank that skipped one would look for the next group under another name.
- A model over a subgroup (``shard(process_group=...)`` called by that group's ranks only): only
  its ranks call, each making its own group (``new_group(use_local_synchronization=True)``); the
  other ranks may do anything meanwhile. torch names such a group after its ranks and the number
  of groups alive in the process, so the ranks first collect garbage (a dead model's groups go
  now, not whenever each rank finds it) and check that this number agrees: a mismatch raises
  instead of leaving each rank waiting for peers under another name. (A plain ``new_group``
  called by some ranks only hangs: two pairs of a 4-rank world, each making its own group, got
  the same name; torch 2.13.) hpZ and hybrid groups are made over the default group only
  (strategy.py refuses others): an NCCL group is split from the default group's communicator,
  which every rank of it must join.
- A tensor-parallel model over a data-parallel subgroup checkpoints over every rank of the world
  (``tensor.checkpoint_group``): the group of its asynchronous saves spans the world, made as a
  subgroup's are, by every rank, which agree on the count over the world first.

When a group goes:

- A gloo group made over the whole world is destroyed when the ``Sharding`` that holds it is
  garbage (``weakref.finalize``; the model's engine holds it, and with it every hook shard()
  installed): nothing can issue a collective on the group any more. Destroying an idle gloo group
  is local (tried: one rank destroying while its peers were busy elsewhere, 3 x 5 times, 4 ranks).
  Not at interpreter exit, where peers may still be mid-collective.
- A group made by a subgroup's ranks alone is kept for the process and reused by the next model
  over the same ranks. Destroyed, the next group of those ranks would get its name (the count is
  back where it was), and gloo's rendezvous would read the dead group's addresses from the store:
  with torch 2.13, destroying and re-making one such group failed in 2 of 3 runs ("Connection
  reset by peer", or a send timeout).
- An NCCL group (hpZ, hybrid) is kept and reused too: destroying one waits until every member
  destroys it (``ncclCommFinalize``), and garbage is not found at the same point on every rank.

Groups that no one model owns: the meshes of an N-D run (``device_mesh``: ``ls.parallelize``,
``ShardingPlugin``'s data mesh) and the data-parallel groups of a TP mesh (``process_wide``:
``meshes.data_parallel``) are made here too, by every rank of the world in the same order, once
per process and layout, and kept: a second ``ls.parallelize`` of the same layout reuses them
instead of making (and leaking) another set, as torch's own ``init_device_mesh`` would. They end
with the default group (``destroy_process_group()``), which ends every group.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import os
import weakref
from collections.abc import Callable

import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from layershard.distributed import default_timeout

# LAYERSHARD_FORCE_CONTROL_GROUP=1: make the control group on gloo too (as under NCCL), so that
# tests walk the NCCL path's group creation on CPU.
FORCE_CONTROL = "LAYERSHARD_FORCE_CONTROL_GROUP"

Partition = list[list[int]]  # groups of global ranks, together every rank of the model once

# Groups kept for the process, by (purpose, backend, partition): this rank's group of it.
_KEPT: dict[tuple, dist.ProcessGroup | None] = {}
# Meshes kept for the process, by (default group, device type, shape, dim names).
_MESHES: dict[tuple, DeviceMesh] = {}


def blocks(ranks: list[int], size: int) -> Partition:
    """``ranks`` in consecutive blocks of ``size`` (a node's ranks: hpZ, hybrid's shard groups)."""
    return [ranks[i : i + size] for i in range(0, len(ranks), size)]


def strided(ranks: list[int], size: int) -> Partition:
    """The ranks at the same place of every block of ``size`` (hybrid's replicate groups)."""
    return [ranks[i::size] for i in range(size)]


class Groups:
    """The groups made for one model over ``parent`` (see the module docstring)."""

    def __init__(self, parent: dist.ProcessGroup) -> None:
        self.parent = parent
        self.ranks: list[int] = dist.get_process_group_ranks(parent)
        self.whole_world = len(self.ranks) == dist.get_world_size()
        self._made: dict[str, dist.ProcessGroup | None] = {}  # by purpose
        self._owned: list[tuple[dist.ProcessGroup, Callable | None]] = []  # ended by close

    def owned_by(self, owner: object) -> None:
        """Destroy this model's own groups when ``owner`` is garbage."""
        weakref.finalize(owner, self.close).atexit = False

    def control(self) -> dist.ProcessGroup:
        """Where the small agreements run, on CPU tensors: on gloo the model's own group; under
        another backend (NCCL) a gloo group of the same ranks, so that no agreement waits for the
        GPU. Collective at shard()."""
        native = dist.get_backend(self.parent) == "gloo" and os.environ.get(FORCE_CONTROL) != "1"
        if native or len(self.ranks) == 1:
            return self.parent
        group = self.make("control", [self.ranks], "gloo")
        assert group is not None  # this rank is one of self.ranks
        return group

    def get(self, purpose: str) -> dist.ProcessGroup | None:
        """The group made for ``purpose``, or None if none was."""
        return self._made.get(purpose)

    def make(
        self,
        purpose: str,
        partition: Partition,
        backend: str | None = None,
        closer: Callable[[dist.ProcessGroup, Callable[[], None]], None] | None = None,
    ) -> dist.ProcessGroup | None:
        """This rank's group of ``partition`` (None if it is in none), made once per model and
        ``purpose``. When the model goes, ``closer(group, destroy)`` (if given) runs instead of
        destroying the group at once: it ends the group's use and calls ``destroy()`` once nothing
        uses it, later and from another thread if need be. Collective over the model's ranks
        (the rules above)."""
        if purpose in self._made:
            return self._made[purpose]
        backend = backend or dist.get_backend(self.parent)
        kept = not self.whole_world or backend != "gloo"
        key = (purpose, backend, tuple(tuple(ranks) for ranks in partition))
        if kept and key in _KEPT:
            group = _KEPT[key]
        else:
            group = self._new(partition, backend)
            if kept:
                _KEPT[key] = group
            elif group is not None:
                self._owned.append((group, closer))
        self._made[purpose] = group
        return group

    def lanes(
        self, purpose: str, group: dist.ProcessGroup, partition: Partition | None = None
    ) -> list[dist.ProcessGroup]:
        """``group``'s size of groups of its ranks, one per member (``engine/gloo_routes.py``:
        on gloo, what rank r sends goes on lane r, so that no TCP connection carries data both
        ways at once). Every group of the partition ``group`` belongs to is made: ``partition``
        if the caller has read it (``partition_of``), else read here. Collective at shard()."""
        ranks = dist.get_process_group_ranks(group)
        partition = partition if partition is not None else self.partition_of(ranks)
        out = [self.make(f"{purpose}-lane{i}", partition) for i in range(len(ranks))]
        assert all(g is not None for g in out)  # this rank is in its own group's lanes
        return out  # type: ignore[return-value]

    def partition_of(self, ranks: list[int]) -> Partition:
        """The partition that this rank's group ``ranks`` belongs to: every rank's group, read
        from every rank of the model (sorted, so the same list on each). Collective."""
        everyone: list = [None] * len(self.ranks)
        dist.all_gather_object(everyone, ranks, group=self.parent)
        return [list(r) for r in sorted({tuple(r) for r in everyone})]

    def _new(self, partition: Partition, backend: str) -> dist.ProcessGroup | None:
        me = dist.get_rank()
        if self.whole_world:
            mine = None
            for ranks in partition:  # every rank, every group, in order
                group = dist.new_group(ranks, backend=backend, timeout=default_timeout())
                if me in ranks:
                    mine = group
            return mine
        members = {r for ranks in partition for r in ranks}
        if members <= set(self.ranks):
            self._check_names(self.parent)
        else:  # a TP model's checkpoint group: every rank of the world makes it (see above)
            assert len(members) == dist.get_world_size(), "beyond the model's ranks: the world"
            self._check_names(dist.group.WORLD)
        for ranks in partition:  # this rank's group only
            if me in ranks:
                return dist.new_group(
                    ranks,
                    backend=backend,
                    timeout=default_timeout(),
                    use_local_synchronization=True,
                )
        return None

    def _check_names(self, group: dist.ProcessGroup | None) -> None:
        """The ranks of ``group`` agree on the number torch names their next group by (see
        above)."""
        gc.collect()
        names = getattr(getattr(c10d, "_world", None), "pg_names", None)
        if names is None:  # a torch that keeps no such registry: nothing to compare
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else self.ranks
        counts: list = [None] * len(ranks)
        dist.all_gather_object(counts, len(names), group=group)
        if len(set(counts)) > 1:
            held = ", ".join(f"rank {r}: {n}" for r, n in zip(ranks, counts))
            raise RuntimeError(
                f"layershard: the ranks of this process group hold different numbers of process "
                f"groups ({held}); torch names a group made by some ranks only after that number, "
                "so they would wait for each other forever. Make the same groups, in the same "
                "order, on every rank of the group"
            )

    def close(self) -> None:
        """End the groups made for this model alone, the last made first.

        Note: this runs wherever the garbage collector finds the model dead, which is any thread
        that allocates: the training thread, or DCP's thread writing this model's own
        asynchronous save. It must never wait (a closer that waited for that save hung every
        rank), so a group still in use is destroyed by its user when done (``closer``)."""
        while self._owned:
            group, closer = self._owned.pop()
            if closer is None:
                _destroy(group)
            else:
                with contextlib.suppress(Exception):
                    closer(group, functools.partial(_destroy, group))


def _destroy(group: dist.ProcessGroup) -> None:
    with contextlib.suppress(Exception):  # e.g. every group was destroyed already
        if dist.is_initialized():
            dist.destroy_process_group(group)


def process_wide(
    purpose: str, partition: Partition, backend: str | None = None
) -> dist.ProcessGroup | None:
    """This rank's group of ``partition`` (None if it is in none), a partition of the whole
    world made once per process and ``purpose`` and kept (the module docstring). Collective over
    the world: every rank makes every group of it, in order, the first time."""
    backend = backend or dist.get_backend()
    key = (id(c10d._get_default_group()), purpose, backend, tuple(map(tuple, partition)))
    if key not in _KEPT:
        world = dist.group.WORLD
        assert world is not None, "process_wide(): no default process group"
        _KEPT[key] = Groups(world)._new(partition, backend)
    return _KEPT[key]


def device_mesh(device_type: str, shape: tuple[int, ...], names: tuple[str, ...]) -> DeviceMesh:
    """torch's ``init_device_mesh(device_type, shape, mesh_dim_names=names)`` over the world,
    made once per process and layout and kept (the module docstring). Collective over the world
    the first time."""
    key = (id(c10d._get_default_group()), device_type, tuple(shape), tuple(names))
    if key not in _MESHES:
        _MESHES[key] = init_device_mesh(device_type, tuple(shape), mesh_dim_names=tuple(names))
    return _MESHES[key]
