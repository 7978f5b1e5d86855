"""The process groups layershard makes (layershard/groups.py), at world size 4: the NCCL path's
gloo control group, made here on gloo (``LAYERSHARD_FORCE_CONTROL_GROUP=1``); groups made by a
subgroup's ranks alone; and every group going when its model goes.

Live groups are counted in torch's registry of this process's groups,
``torch.distributed.distributed_c10d._world.pg_map`` (one entry per group this rank is a member
of, the default group included; ``destroy_process_group`` removes it). Private, but the only
place that sees a group nobody holds a handle to any more."""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import time
from unittest import mock

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from _dist import RankChecks, shared_tmp
from _parity import (
    LR,
    batches,
    max_diff,
    param_bound,
    reference_losses,
    train_in_orders,
    train_losses,
    train_step,
)
from _parity import tiny_llama as _tiny
from torch.distributed.distributed_c10d import _world

import layershard as ls
from layershard.engine import gloo_routes
from layershard.groups import Groups

checks = RankChecks(world_size=4)
STEPS = 3
INT8 = ls.MixedPrecision(torch.float32, torch.float32, gather_dtype=torch.int8)


@contextlib.contextmanager
def _like_nccl():
    """shard() makes its control group as under NCCL (a gloo group of the model's ranks)."""
    os.environ["LAYERSHARD_FORCE_CONTROL_GROUP"] = "1"
    try:
        yield
    finally:
        del os.environ["LAYERSHARD_FORCE_CONTROL_GROUP"]


def _live() -> int:
    gc.collect()
    return len(_world.pg_map)


def _live_once_settled(start: int, timeout: float = 30.0) -> int:
    """Live groups once they are back to ``start`` or ``timeout`` seconds passed. An asynchronous
    save's group is destroyed by the save's own thread after the model goes, not by the finalizer
    (groups.py, ``Groups.close``: it must never wait), so it may still be live for a moment after
    ``del model``: counting at once raced with that thread (seen under
    ``ATEN_CPU_CAPABILITY=default``, one rank of four)."""
    deadline = time.monotonic() + timeout
    while (live := _live()) != start and time.monotonic() < deadline:
        time.sleep(0.05)
    return live


def _step(model, opt, batch, rank: int, world: int) -> None:
    train_step(model, batch, rank, world, opt, group=model.process_group)


def _train_and_compare(model, group: dist.ProcessGroup) -> None:
    """STEPS steps over ``group`` on the global batches; the weights against the single-process
    reference, within the spread of its legitimate summation orders (_parity.py)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    data = batches(STEPS)
    train_losses(model, data, rank, world, opt, group=group)
    reference = _tiny()
    reference_losses(reference, data, torch.optim.AdamW(reference.parameters(), lr=LR))
    bound = param_bound(reference, *train_in_orders(_tiny(), data, world))
    diff, where = max_diff(model.full_state_dict(rank0_only=False), reference)
    assert diff <= bound, (diff, bound, where)


@checks.check
def control_group_is_made_as_under_nccl(rank: int, world: int) -> None:
    """Under NCCL shard() makes a gloo group of the model's ranks for the agreements, which was
    never destroyed. Made here on gloo: it is its own group of the model's ranks, the
    agreements run on it, and it goes when the model goes."""
    start = _live()
    with _like_nccl():
        model = ls.shard(_tiny())
    control = model._schedule.comm.control
    assert control is not model.process_group, "no control group of its own was made"
    assert dist.get_process_group_ranks(control) == list(range(world))
    lanes = len(model._schedule.comm.lanes)  # gloo's, one per rank (engine/collectives.py)
    assert dist.get_backend(control) == "gloo" and _live() == start + 1 + lanes
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt, batches(1)[0], rank, world)  # its backward agrees on the control group
    del model, opt, control
    assert _live() == start, "the control group outlived its model"


@checks.check
def groups_go_with_their_model(rank: int, world: int) -> None:
    """hpZ's groups, hybrid's, the control group and the asynchronous save's group: after a step
    and a save, deleting the model leaves as many live groups as before it was made (hpZ's,
    from ``new_subgroups``, and hybrid's, from ``init_device_mesh``, were never destroyed)."""
    cases = {
        "hpz": {"reshard_after_forward": 2},
        "hybrid": {"strategy": "hybrid", "shard_size": 2},
        "control": {},
    }
    start = _live()
    for name, opts in cases.items():
        with _like_nccl() if name == "control" else contextlib.nullcontext():
            model = ls.shard(_tiny(), **opts)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        _step(model, opt, batches(1)[0], rank, world)
        ls.save_checkpoint(shared_tmp() / name, model, opt, async_save=True).wait()
        assert _live() > start + 1, name  # its own groups, the save's
        del model, opt
        live = _live_once_settled(start)
        assert live == start, f"{name}: {live - start} groups outlived their model"


@checks.check
def model_dropped_while_its_save_runs(rank: int, world: int) -> None:
    """A model deleted while its asynchronous save is in flight, found garbage inside DCP's
    writing thread (a collection runs in whichever thread allocates): the save completes and
    loads, then the save's group goes. The model's finalizer used to wait, in that thread, for the
    save that thread was writing: every rank hung (found by a planner benchmark, 184 s)."""
    start = _live()
    model = ls.shard(_tiny())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    _step(model, opt, batches(1)[0], rank, world)
    saved = model.full_state_dict()
    holder, returned = [model, opt], threading.Event()
    del model, opt
    write_data = dcp.FileSystemWriter.write_data

    def drop_then_write(self, plan, planner):
        assert returned.wait(60)
        holder.clear()  # the model's last references die in DCP's thread
        gc.collect()
        return write_data(self, plan, planner)

    with mock.patch.object(dcp.FileSystemWriter, "write_data", drop_then_write):
        handle = ls.save_checkpoint(shared_tmp() / "dropped", *holder, async_save=True)
        returned.set()
        folder = handle.wait(timeout=60)
    again = ls.shard(_tiny())
    ls.load_checkpoint(folder, again)
    loaded = again.full_state_dict()
    assert loaded.keys() == saved.keys()
    assert all(torch.equal(loaded[k], saved[k]) for k in saved), "the checkpoint differs"
    del again
    live = _live_once_settled(start)
    assert live == start, f"{live - start} groups outlived their model"


@checks.check
def subgroup_shards_alone(rank: int, world: int) -> None:
    """shard(process_group=...) called by that group's ranks only: ranks 0-1 shard one model
    over their pair while ranks 2-3 shard, save (asynchronously), delete and shard again over
    theirs, each making the NCCL path's groups by themselves. Both train as one process would;
    the second model of 2-3 reuses the groups of the first (a group made by some ranks only is
    kept: re-made, it would take the dead one's name); and the world can still make groups
    together afterwards (their names did not drift apart)."""
    pair = [0, 1] if rank < 2 else [2, 3]
    group = dist.new_group(pair, use_local_synchronization=True)
    with _like_nccl():
        if rank >= 2:
            first = ls.shard(_tiny(), process_group=group)
            first_control = first._schedule.comm.control
            assert first_control is not group
            first_opt = torch.optim.AdamW(first.parameters(), lr=LR)
            _step(first, first_opt, batches(1)[0], dist.get_rank(group), 2)
            ls.save_checkpoint(shared_tmp() / "first", first, async_save=True).wait()
            kept = _live()
            del first, first_opt
            assert _live() == kept, "a group made by some ranks alone was destroyed"
        model = ls.shard(_tiny(), process_group=group)
        control = model._schedule.comm.control
        assert control is not group and dist.get_process_group_ranks(control) == pair
        if rank >= 2:
            assert control is first_control and _live() == kept
    _train_and_compare(model, group)
    if rank >= 2:
        ls.save_checkpoint(shared_tmp() / "second", model, async_save=True).wait()
        assert _live() == kept
    dist.barrier()
    with _like_nccl():  # every rank of the world together, as before
        everyone = ls.shard(_tiny())
    opt = torch.optim.AdamW(everyone.parameters(), lr=LR)
    _step(everyone, opt, batches(1)[0], rank, world)


@checks.check
def gloo_lanes_change_no_bit(rank: int, world: int) -> None:
    """On gloo each rank sends on a group of its own (engine/collectives.py, lanes; made here on
    one machine by ``LAYERSHARD_GLOO_LANES=1``, by default only for groups that span nodes): one
    lane per rank of the group gathered over (full: the world; hpZ: its groups of 2 as well), and
    training
    is bitwise the same as on one group (``LAYERSHARD_GLOO_LANES=0``): the chunks are the same
    and each rank sums them in rank order either way. The losses of three steps, and the
    weights after them."""
    # Ranks on nodes of their own (LOCAL_WORLD_SIZE=1): the group spans nodes, one rank each, so
    # it gets lanes and no route by node; what it is part of is read from every rank once.
    read = mock.patch.object(Groups, "partition_of", autospec=True, side_effect=Groups.partition_of)
    with mock.patch.dict(os.environ, {"LOCAL_WORLD_SIZE": "1"}), read as reads:
        model = ls.shard(_tiny())
    assert len(model._schedule.comm.lanes) == world and not model._schedule.comm.routes.nodes
    assert reads.call_count == 1, reads.call_args_list
    del model
    results = {}
    for lanes, opts in [(on, o) for on in ("1", "0") for o in ({}, {"reshard_after_forward": 2})]:
        with mock.patch.dict(os.environ, {"LAYERSHARD_GLOO_LANES": lanes}):
            model = ls.shard(_tiny(), **opts)
        made = len(model._schedule.comm.lanes)
        assert made == (0 if lanes == "0" else world + (2 if opts else 0)), (lanes, opts, made)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = train_losses(model, batches(STEPS), rank, world, opt)
        results[lanes, bool(opts)] = (losses, model.full_state_dict(rank0_only=False))
        del model, opt
    for hpz in (False, True):
        (a, sa), (b, sb) = results["1", hpz], results["0", hpz]
        assert a == b, (hpz, a, b)
        assert all(torch.equal(sa[k], sb[k]) for k in sa), hpz


@checks.check
def routes_by_node_sum_as_hybrid(rank: int, world: int) -> None:
    """Two "nodes" of 2 ranks on one machine (``LOCAL_WORLD_SIZE=2``): ``full`` over the 4 ranks
    routes its gathers and reduce-scatters by node (engine/gloo_routes.py: a group within each
    node, and one across the nodes per node). The gathers move the same chunks (the first step's
    loss equals the flat routes', exact and with int8 gathers), and each gradient is the sum over
    the nodes of the sum within each, in order, which is ``hybrid``'s order: three steps of
    ``full`` by node are bit for bit ``hybrid``'s (losses and weights), as are hpZ's (its
    reductions are ``full``'s, its backward gathers within a node), and within the spread of
    the legitimate summation orders of the single-process reference, as the flat routes are."""
    runs = {}
    for name, env, opts in [
        ("node", "1", {}),
        ("flat", "0", {}),
        ("hybrid", "1", {"strategy": "hybrid"}),
        ("node-hpz", "1", {"reshard_after_forward": 2}),
        ("node-one-across", "1", {}),  # as beyond MAX_LANES nodes: one group across
        ("node-int8", "1", {"mixed_precision": INT8}),
        ("flat-int8", "0", {"mixed_precision": INT8}),
    ]:
        two_nodes = {"LOCAL_WORLD_SIZE": "2", "LAYERSHARD_GLOO_NODES": env}
        lanes = 1 if name == "node-one-across" else gloo_routes.MAX_LANES
        with (
            mock.patch.dict(os.environ, two_nodes),
            mock.patch.object(gloo_routes, "MAX_LANES", lanes),
        ):
            model = ls.shard(_tiny(), **opts)
        routes = model._schedule.comm.routes
        if name.startswith("node"):
            route = routes.nodes["shard"]
            assert (route.nodes, route.per_node) == (2, 2), route
            assert (route.node, route.local) == divmod(rank, 2), route
            made = {id(g) for g in model._schedule.comm.lanes}
            assert len(made) == (2 if name == "node-one-across" else 3)  # within; across
        else:
            assert not routes.nodes, name
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = train_losses(model, batches(STEPS), rank, world, opt)
        runs[name] = (losses, model.full_state_dict(rank0_only=False))
        del model, opt
    node, s_node = runs["node"]
    for other in ("hybrid", "node-hpz", "node-one-across"):
        losses, state = runs[other]
        assert node == losses, (other, node, losses)
        assert all(torch.equal(s_node[k], state[k]) for k in s_node), other
    assert runs["node"][0][0] == runs["flat"][0][0]
    assert runs["node-int8"][0][0] == runs["flat-int8"][0][0]
    reference = _tiny()
    opt = torch.optim.AdamW(reference.parameters(), lr=LR)
    reference_losses(reference, batches(STEPS), opt)
    bound = param_bound(reference, *train_in_orders(_tiny(), batches(STEPS), world))
    for name in ("node", "flat"):
        assert max_diff(runs[name][1], reference)[0] <= bound, name


@checks.check
def groups_get_the_layershard_timeout(rank: int, world: int) -> None:
    """A subgroup (hybrid's, TP's, the control group) waits as long as the default group, not
    torch's default for new groups (30 minutes on gloo): a hung collective on it fails in the
    same time. (Read from the gloo backend's options: private, the only place it is kept.)"""
    model = ls.shard(_tiny(), strategy="hybrid", shard_size=2)
    expected = float(os.environ["LAYERSHARD_TIMEOUT_S"])
    groups = (model.sharding.shard_group, model.sharding.replicate_group)
    assert all(g is not None and g is not dist.group.WORLD for g in groups)
    for group in groups:
        backend = group._get_backend(torch.device("cpu"))
        assert backend.options._timeout.total_seconds() == expected, backend.options._timeout


# Routes beyond 2 x 2: six ranks as 2 nodes of 3 and as 3 nodes of 2 (slow tier: 6 ranks).
checks6 = RankChecks(world_size=6, suffix="_at_6_ranks", slow=True)


def routes_by_node_beyond_2x2(rank: int, world: int) -> None:
    """``full`` routed by node over 2 nodes x 3 ranks and 3 nodes x 2 (``LOCAL_WORLD_SIZE`` 3,
    2). The route's shape on every rank; the first step's loss equal to the flat routes' (the
    gathers move the same chunks); 3 AdamW steps within the spread of the single-process
    reference's legitimate summation orders; and over 2 nodes, bit for bit ``hybrid``'s (its
    all-reduce across 2 nodes is one addition, the same as the route's node sum; across 3 nodes
    gloo's all-reduce adds in an order of its own, so only the bound holds there)."""
    data = batches(STEPS, batch=12)
    reference = _tiny()
    reference_losses(reference, data, torch.optim.AdamW(reference.parameters(), lr=LR))
    bound = param_bound(reference, *train_in_orders(_tiny(), data, world))
    for per_node in (3, 2):
        runs = {}
        for name, env, opts in [
            ("node", "1", {}),
            ("flat", "0", {}),
            ("hybrid", "1", {"strategy": "hybrid"}),
        ]:
            layout = {"LOCAL_WORLD_SIZE": str(per_node), "LAYERSHARD_GLOO_NODES": env}
            with mock.patch.dict(os.environ, layout):
                model = ls.shard(_tiny(), **opts)
            if name == "node":
                route = model._schedule.comm.routes.nodes["shard"]
                assert (route.nodes, route.per_node) == (world // per_node, per_node), route
                assert (route.node, route.local) == divmod(rank, per_node), route
            opt = torch.optim.AdamW(model.parameters(), lr=LR)
            losses = train_losses(model, data, rank, world, opt)
            runs[name] = (losses, model.full_state_dict(rank0_only=False))
            del model, opt
        (node, s_node), (flat, _), (hybrid, s_hybrid) = runs["node"], runs["flat"], runs["hybrid"]
        assert node[0] == flat[0], (per_node, node[0], flat[0])
        diff, where = max_diff(s_node, reference)
        assert diff <= bound, (per_node, diff, bound, where)
        if world // per_node == 2:
            assert node == hybrid, (node, hybrid)
            assert all(torch.equal(s_node[k], s_hybrid[k]) for k in s_node)


checks6.check(routes_by_node_beyond_2x2)
checks.collect(globals())
checks6.collect(globals())
