"""A rank of test_multinode's hybrid test, started by `layershard.train.launch.agent` (torchrun) on each of
two simulated nodes: ``ls.shard(strategy="hybrid")`` with the default shard size shards within a
node and replicates across nodes, and trains like the single-process reference."""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
from _parity import (
    LOSS_RTOL,
    batches,
    clone,
    lm_loss,
    local,
    max_diff,
    param_bound,
    tiny_llama,
    train_in_orders,
)

import layershard as ls


def main(out: str) -> None:
    rank, world = ls.init_distributed()
    node, per_node = int(os.environ["GROUP_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    base = tiny_llama()
    reference = clone(base)
    ref_opt = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    model = ls.shard(clone(base), strategy="hybrid")  # shard_size: LOCAL_WORLD_SIZE
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    s = model.sharding
    assert (s.shard_size, s.replicas) == (per_node, world // per_node), (s.shard_size, s.replicas)
    nodes: list = [None] * world
    dist.all_gather_object(nodes, node)
    assert {nodes[r] for r in s.shard_ranks()} == {node}, (nodes, s.shard_ranks())
    replicas = dist.get_process_group_ranks(s.replicate_group)
    assert sorted(nodes[r] for r in replicas) == list(range(world // per_node)), replicas
    for batch in batches(3):
        ref = lm_loss(reference, batch)
        ref.backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model.comm_stats(reset=True)
        loss = lm_loss(model, local(batch, rank, world))
        loss.backward()
        counts = model._schedule.comm.stats.by_group()
        opt.step()
        opt.zero_grad()
        # weights are gathered and gradients reduce-scattered within the node only; across
        # nodes one all-reduce of each unit's reduced slice
        assert set(counts["all_gather"]) == {"shard"}, counts
        assert set(counts["reduce_scatter"]) == {"shard"}, counts
        assert counts["all_reduce"]["replicate"] == counts["reduce_scatter"]["shard"], counts
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        assert abs(mean.item() / world - ref.item()) <= LOSS_RTOL * ref.item()
    full = model.full_state_dict()
    if rank == 0:
        dev, where = max_diff(full, reference)
        # within the spread of other legitimate orders of the sums (tests/_parity.py); measured
        # 2026-11-26, torch 2.13, max |param - ref| / bound: AVX-512+AMX 2.6e-6 / 8.9e-6, AVX2
        # 3.5e-6 / 1.9e-5, default 9.8e-6 / 6.0e-5
        bound = param_bound(reference, *train_in_orders(base, batches(3), world))
        assert dev <= bound, (dev, where, bound)
    with open(os.path.join(out, f"rank{rank}.ok"), "w") as fh:
        fh.write(f"node {node} shard {s.shard_ranks()} replicate {replicas}\n")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
    sys.stdout.flush()
    os._exit(0)  # gloo's static destructors (DEVELOPERS.md)
