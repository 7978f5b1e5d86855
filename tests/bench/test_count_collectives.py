"""The bench's collective counter (bench/measure.py) on the engine's gloo lanes' reduce-scatter:
a scatter from each rank. Each scatter counts the chunk a rank receives, so the N scatters of one
reduce-scatter add up to the buffer, as an all-to-all's count does (the root also passes every
chunk: counting that overstated the bytes sent by half at 2 ranks)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import RankChecks

from layershard.bench.measure import CountCollectives, ring_bytes_sent

checks = RankChecks(world_size=2)


@checks.check
def scatters_count_the_chunk_each_rank_receives(rank: int, world: int) -> None:
    buffer, chunk = torch.arange(8.0), torch.empty(4)
    counter = CountCollectives()
    with counter:
        for src in range(world):  # one scatter from each rank: the lanes' reduce-scatter
            dist.scatter(chunk, list(buffer.split(4)) if rank == src else None, src=src)
    assert counter.count["scatter"] == world
    assert counter.bytes["scatter"] == buffer.numel() * 4  # the whole buffer, once
    # what one rank sends: its buffer less its own chunk, as a ring reduce-scatter
    assert ring_bytes_sent("scatter", counter.bytes["scatter"], world) == 4 * 4


checks.collect(globals())
