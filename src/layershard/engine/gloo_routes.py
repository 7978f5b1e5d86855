"""How a gathered group's bytes travel on gloo between nodes: lanes, and routes by node.

Note: gloo's lanes. Gloo joins two ranks of a group by one TCP connection, and a connection that
carries large messages both ways at once moves them one way at a time: over a link shaped to 128
Mbit/s (the testbed, benchmarks/links/), a 16 MB gather by broadcasts on one group took 1.08 s,
twice its bytes' time, and the all-to-all reduce-scatter as long. So each gathered group has
``lanes``: as many groups of the same ranks as it has members (``Groups.lanes``, made at shard()),
and what rank r sends goes on lane r only: its chunk's broadcast, and the reduce-scatter as one
``scatter`` from each rank on its own lane (rank r receives chunk r of every rank's buffer, as from
the all-to-all). Each connection then carries data one way, and the same gather took 0.55 s, the
link's rate. Every rank issues the lanes' collectives in the same order, so each lane's sequence
agrees across ranks. Lanes are made only for groups that span nodes (torchrun's
``LOCAL_WORLD_SIZE``): over loopback, where gloo's time is the cores' copying, not a link, the
extra groups' threads cost time on 2 cores (the comm shape, 2 ranks: 2.2 s a step against 1.7 s).
Groups of more than ``MAX_LANES`` ranks keep one connection per pair (lanes would grow as the
square of the group), and so does a model over a subgroup of the world.
``LAYERSHARD_GLOO_LANES=1`` makes lanes for every group (tests), ``0`` for none.

Note: routes by node, and the order of the sums. A group of M > 1 nodes with L > 1 ranks on each
(group rank ``m * L + l``: node m, local index l, torchrun's layout) would send each chunk across
the link once per rank of the other node by the flat broadcasts (2 nodes x 2 ranks: 275 MiB a step
per node against gloo's ring's 230, benchmarks/links/ ``fsdp-2x2``). Its ``NodeRoute`` moves each
chunk across once, as NCCL's topology-aware rings do on GPUs:

- all-gather: across the nodes first, each rank's chunk to the ranks of its local index on the
  other nodes (one broadcast per node, on lanes), then within each node, every chunk from the
  local rank that now holds it (loopback);
- reduce-scatter: within each node first (local rank l receives from each rank of its node the
  chunks bound for local index l of every node, an all-to-all per node, and sums them in local
  order: the node's partial sums), then across the nodes, each partial to its rank (a scatter per
  node, on lanes), summed in node order.

Each rank's chunk of a gradient is then sum over nodes m of (sum over l of rank (m, l)'s), in that
order: bit for bit ``hybrid``'s (a reduce-scatter within the node, then an all-reduce across the
nodes), and, with one node or one rank per node, the flat exchange's rank order. Between layouts
(2 nodes x 2 ranks against 1 x 4) the sums differ by rounding, as two orders of a sum do. Only
fp32 reductions take it: a 16-bit reduction sends the raw 16-bit chunks so that the receiver rounds
the fp32 sum once, and partial sums would have to travel in fp32 (twice the bytes) or round twice.
Each stage waits for the one before: the second is issued when the first is waited for (the
gather's at its wait; the reduction's at the next unit's backward start, ``Comm.advance`` from
the schedule, which at 2 x 2 took `full`'s step from 13.7 s to 13.1 s against waiting for the next
reduction), the same point of the program on every rank. ``LAYERSHARD_GLOO_NODES=0`` keeps the
flat routes (benchmarks).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from layershard.distributed import local_world_size

MAX_LANES = 8  # the largest group given lanes on gloo (see the module docstring)

Works = list  # gloo work handles


@dataclass
class NodeRoute:
    """A group's route by node (module docstring): ``nodes`` x ``per_node`` ranks; this rank is
    local index ``local`` of node ``node``; ``within`` its node's ranks, ``across`` the ranks of
    its local index on every node (one lane per node: lane m carries what node m's rank sends;
    one group for all beyond ``MAX_LANES`` nodes)."""

    nodes: int
    per_node: int
    node: int
    local: int
    within: dist.ProcessGroup
    across: list[dist.ProcessGroup]

    def _across_root(self, m: int) -> int:
        return dist.get_global_rank(self.across[m], m)

    def _within_root(self, l: int) -> int:  # noqa: E741
        return dist.get_global_rank(self.within, l)

    def gather(self, out: torch.Tensor, n: int) -> tuple[Works, Callable[[], Works]]:
        """The all-gather of ``out`` (``n`` elements per rank, this rank's own chunk in place):
        the works of its first stage (across) and what issues its second (within)."""
        chunks = out.view(self.nodes, self.per_node, n)
        first = [
            dist.broadcast(chunks[m, self.local], src=self._across_root(m),
                           group=self.across[m], async_op=True)
            for m in range(self.nodes)
        ]  # fmt: skip

        def second() -> Works:
            return [
                dist.broadcast(chunks[m, l], src=self._within_root(l), group=self.within,
                               async_op=True)
                for m in range(self.nodes) for l in range(self.per_node)  # noqa: E741
            ]  # fmt: skip

        return first, second

    def reduce_scatter(
        self, recv: torch.Tensor, inp: torch.Tensor
    ) -> tuple[Callable[[bool], Works], Callable[[], None], Callable[[bool], Works],
               Callable[[], None], torch.Tensor]:  # fmt: skip
        """The reduce-scatter of fp32 ``inp`` through ``recv`` (as many elements): the first
        stage's issue (within), the node's partial sums, the second stage's issue (across), the
        sum over the nodes, and the row of ``recv`` that then holds this rank's reduced chunk.
        ``recv`` as (node, local index, n): after the first stage row (m, l) is local rank l's
        chunk bound for node m; its partial sums go to rows (m, 0), and node m's partial for this
        rank comes into row (m, 1) (L > 1; this node's own is copied there by its scatter)."""
        nodes, per_node = self.nodes, self.per_node
        rows = recv.view(nodes, per_node, -1)
        sent = inp.view(nodes, per_node, -1)

        def within(async_op: bool) -> Works:
            return [
                dist.all_to_all_single(rows[m], sent[m], group=self.within, async_op=async_op)
                for m in range(nodes)
            ]

        def partials() -> None:
            for m in range(nodes):
                for l in range(1, per_node):  # noqa: E741
                    rows[m, 0].add_(rows[m, l])

        def across(async_op: bool) -> Works:
            mine = list(rows[:, 0].unbind())
            return [
                dist.scatter(rows[m, 1], mine if m == self.node else None,
                             src=self._across_root(m), group=self.across[m], async_op=async_op)
                for m in range(nodes)
            ]  # fmt: skip

        def total() -> None:
            for m in range(1, nodes):
                rows[0, 1].add_(rows[m, 1])

        return within, partials, across, total, rows[0, 1]


class GlooRoutes:
    """The lanes and node routes of one model's gathered groups (module docstring), by group
    name (``shard``, ``hpz``, ``expert``). Made at shard(): collective over the model's ranks."""

    def __init__(self, sharding, members: dict[str, tuple[dist.ProcessGroup | None, int, int]]):
        self.lanes: dict[str, list[dist.ProcessGroup]] = {}
        self.nodes: dict[str, NodeRoute] = {}
        lanes_env = os.environ.get("LAYERSHARD_GLOO_LANES", "auto")
        by_node = os.environ.get("LAYERSHARD_GLOO_NODES", "1") != "0"
        if not sharding.groups.whole_world:  # a subgroup's other ranks would not make them
            return
        per_node = local_world_size(dist.get_world_size())
        for name in ("shard", "hpz", "expert"):
            g, _, size = members[name]
            if g is None or size < 2:
                continue
            ranks = dist.get_process_group_ranks(g)
            spans = len({r // per_node for r in ranks}) > 1  # every group of its partition alike
            partition = sharding.groups.partition_of(ranks) if by_node and spans else None
            route = self._route(sharding.groups, name, partition, ranks, per_node)
            if route is not None:
                self.nodes[name] = route
            elif lanes_env != "0" and size <= MAX_LANES and (lanes_env == "1" or spans):
                self.lanes[name] = sharding.groups.lanes(name, g, partition)

    @staticmethod
    def _route(
        groups, name: str, partition: list[list[int]] | None, ranks: list[int], per_node: int
    ) -> NodeRoute | None:
        """``ranks``' route by node, or None where every group of its ``partition`` (read from
        every rank, so the answer is the same on each) is not M > 1 nodes of L > 1 ranks each,
        in node order. None without a partition (not routed by node)."""
        if partition is None:
            return None

        def shape(group: list[int]) -> tuple[int, int] | None:
            counts = Counter(r // per_node for r in group)
            nodes, size = len(counts), len(group)
            in_order = [r // per_node for r in group] == sorted(r // per_node for r in group)
            if nodes < 2 or size == nodes or not in_order or len(set(counts.values())) > 1:
                return None
            return nodes, size // nodes

        shapes = [shape(g) for g in partition]
        if any(s is None for s in shapes) or len(set(shapes)) > 1:
            return None
        nodes, local = shapes[0]  # type: ignore[misc]
        within_p = [g[i : i + local] for g in partition for i in range(0, len(g), local)]
        across_p = [g[i::local] for g in partition for i in range(local)]
        within = groups.make(f"{name}-node", within_p)
        if nodes <= MAX_LANES:
            across = [groups.make(f"{name}-across{m}", across_p) for m in range(nodes)]
        else:  # one group for every node's sends (lanes would grow as the square of the nodes)
            across = [groups.make(f"{name}-across", across_p)] * nodes
        me = ranks.index(dist.get_rank())
        assert within is not None and all(a is not None for a in across)
        return NodeRoute(nodes, local, me // local, me % local, within, across)

    def all(self) -> list[dist.ProcessGroup]:
        """Every group made here."""
        out = [g for lanes in self.lanes.values() for g in lanes]
        for route in self.nodes.values():
            out += [route.within, *route.across]
        return out

    def broadcasts(
        self, out: torch.Tensor, n: int, over: str, group
    ) -> tuple[Works, Callable[[], Works] | None]:
        """Gloo's all-gather of ``out`` (``n`` elements per rank) over group ``over``: the works
        of its first stage and what issues its second (None: one stage). One broadcast per
        rank of its chunk, on its lane when the group has lanes; by node when it has a route."""
        route = self.nodes.get(over)
        if route is not None:
            return route.gather(out, n)
        lanes = self.lanes.get(over)
        return [
            dist.broadcast(c, src=dist.get_global_rank(group, r),
                           group=lanes[r] if lanes else group, async_op=True)
            for r, c in enumerate(out.split(n))
        ], None  # fmt: skip

    def exchange(self, recv: torch.Tensor, inp: torch.Tensor, over: str, group, rank: int,
                 async_op: bool):  # fmt: skip
        """A flat reduce-scatter's exchange: row r of ``recv`` gets this rank's chunk of rank
        r's ``inp``; an all-to-all, or with lanes one scatter from each rank on its own."""
        lanes = self.lanes.get(over)
        if not lanes:
            return dist.all_to_all_single(recv, inp, group=group, async_op=async_op)
        n = inp.numel() // len(lanes)
        chunks = list(inp.split(n))  # the root's: chunk r to rank r
        return [
            dist.scatter(row, chunks if r == rank else None, src=dist.get_global_rank(group, r),
                         group=lane, async_op=async_op)
            for r, (row, lane) in enumerate(zip(recv.split(n), lanes))
        ]  # fmt: skip
