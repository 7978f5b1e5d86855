"""How gloo's collectives fare over a shaped link (the testbed): what the engine's lanes fix.

    python benchmarks/links/collectives.py --link 128mbit --mb 16 --repeats 7

Two nodes of one rank each; for each size, each way is timed ``--repeats`` times (median).
Gathers of the buffer: ``broadcasts`` (one async broadcast per owner, on one group: the engine's
gloo all-gather without lanes), ``broadcasts_by_source`` (each owner's on a group of its own: with
lanes, engine/collectives.py), ``all_to_all``, ``native`` (gloo's all_gather_into_tensor), and an
``all_reduce`` of the whole buffer for scale. Reduce-scatters: ``rs_all_to_all`` (an
all_to_all_single and a local sum: the engine's without lanes), ``rs_scatters_by_source`` (a
scatter from each rank on its own group: with lanes), ``rs_native`` (gloo's
reduce_scatter_tensor). A backward's pattern, a gather beside a reduce-scatter of another buffer
as large: ``gather_and_rs`` (one group), ``gather_and_rs_two_groups`` (the reduce-scatter on a
second group), ``gather_and_rs_by_source`` (lanes). A forward's: ``gathers_in_turn`` (the buffer
gathered as 8 units, each issued when the previous one is done). One JSON line per (size, way).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time


def rank_main(mb: list[float], repeats: int) -> None:
    import torch
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)

    def broadcasts(out, chunk):
        n = chunk.numel()
        out[rank * n : (rank + 1) * n].copy_(chunk)
        works = [dist.broadcast(out[r * n : (r + 1) * n], src=r, async_op=True)
                 for r in range(world)]  # fmt: skip
        for w in works:
            w.wait()

    def all_to_all(out, chunk):
        dist.all_to_all_single(out, chunk.repeat(world))

    def native(out, chunk):
        dist.all_gather_into_tensor(out, chunk)

    def all_reduce(out, chunk):
        dist.all_reduce(out)

    def rs_all_to_all(out, chunk):  # the engine's gloo reduce-scatter: receive every rank's chunk
        recv = torch.empty_like(out)
        dist.all_to_all_single(recv, out)
        torch.sum(recv.view(world, -1), dim=0, out=chunk)

    def rs_native(out, chunk):
        dist.reduce_scatter_tensor(chunk, out)

    def gather_and_rs(out, chunk):  # the backward's pattern: a gather beside a reduce-scatter
        n = chunk.numel()
        grad, recv = torch.ones_like(out), torch.empty_like(out)
        works = [dist.broadcast(out[r * n : (r + 1) * n], src=r, async_op=True)
                 for r in range(world)]  # fmt: skip
        works.append(dist.all_to_all_single(recv, grad, async_op=True))
        for w in works:
            w.wait()

    other = dist.new_group(list(range(world)))  # a second group: its own TCP connections

    def gather_and_rs_two_groups(out, chunk):  # the same, the reduce-scatter on its own group
        n = chunk.numel()
        grad, recv = torch.ones_like(out), torch.empty_like(out)
        works = [dist.broadcast(out[r * n : (r + 1) * n], src=r, async_op=True)
                 for r in range(world)]  # fmt: skip
        works.append(dist.all_to_all_single(recv, grad, async_op=True, group=other))
        for w in works:
            w.wait()

    by_source = [dist.new_group(list(range(world))) for _ in range(world)]

    def broadcasts_by_source(out, chunk):  # each owner's broadcast on a group of its own
        n = chunk.numel()
        out[rank * n : (rank + 1) * n].copy_(chunk)
        works = [dist.broadcast(out[r * n : (r + 1) * n], src=r, async_op=True,
                                group=by_source[r]) for r in range(world)]  # fmt: skip
        for w in works:
            w.wait()

    def rs_scatters_by_source(out, chunk):  # the engine's reduce-scatter with lanes
        recv, n = torch.empty_like(out), chunk.numel()
        parts = list(out.split(n))
        works = [dist.scatter(row, parts if r == rank else None, src=r, group=by_source[r],
                              async_op=True) for r, row in enumerate(recv.split(n))]  # fmt: skip
        for w in works:
            w.wait()
        torch.sum(recv.view(world, -1), dim=0, out=chunk)

    def gather_and_rs_by_source(out, chunk):  # the backward's pattern, with lanes
        grad = torch.ones_like(out)
        works = []
        n = chunk.numel()
        recv = torch.empty_like(out)
        for r in range(world):
            works.append(dist.broadcast(out[r * n : (r + 1) * n], src=r, async_op=True,
                                        group=by_source[r]))  # fmt: skip
            works.append(dist.scatter(recv[r * n : (r + 1) * n], list(grad.split(n))
                                      if r == rank else None, src=r, group=by_source[r],
                                      async_op=True))  # fmt: skip
        for w in works:
            w.wait()

    def gathers_in_turn(out, chunk):  # the forward's pattern: 8 unit gathers, one after another
        n = chunk.numel() // 8
        for k in range(8):
            part = out.view(world, -1)[:, k * n : (k + 1) * n]
            bufs = [part[r].clone() for r in range(world)]
            works = [dist.broadcast(bufs[r], src=r, async_op=True) for r in range(world)]
            for w in works:
                w.wait()

    for size in mb:
        n = int(size * 2**20 / 4 / world)
        chunk = torch.full((n,), float(rank))
        out = torch.empty(n * world)
        for name, fn in (("broadcasts", broadcasts), ("broadcasts_by_source", broadcasts_by_source),
                         ("all_to_all", all_to_all),
                         ("native", native), ("all_reduce", all_reduce),
                         ("rs_all_to_all", rs_all_to_all), ("rs_native", rs_native),
                         ("gather_and_rs", gather_and_rs),
                         ("gather_and_rs_two_groups", gather_and_rs_two_groups),
                         ("rs_scatters_by_source", rs_scatters_by_source),
                         ("gather_and_rs_by_source", gather_and_rs_by_source),
                         ("gathers_in_turn", gathers_in_turn)):  # fmt: skip
            times = []
            for _ in range(repeats + 1):
                dist.barrier()
                t0 = time.perf_counter()
                fn(out, chunk)
                times.append(time.perf_counter() - t0)
            if name in ("broadcasts", "broadcasts_by_source", "all_to_all", "native"):
                assert all(out[r * n].item() == r for r in range(world)), name
            if rank == 0:
                print(json.dumps({"mb": size, "way": name, "s": statistics.median(times[1:])}),
                      flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--link", default="128mbit,7.84ms")
    p.add_argument("--mb", type=float, nargs="+", default=[4, 16, 64])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--rank", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.rank:
        rank_main(a.mb, a.repeats)
        return
    from layershard.testbed import links, netns

    with netns.Testbed(2, links.parse(a.link)) as tb:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1",
               f"--master-addr={tb.ip(0)}", "--master-port=29500"]  # fmt: skip
        me = [os.path.abspath(__file__), "--rank", "--repeats", str(a.repeats),
              "--mb", *map(str, a.mb)]  # fmt: skip
        procs = [tb.popen(k, [*cmd, f"--node-rank={k}", *me]) for k in range(2)]
        for proc in procs:
            proc.wait()
        print(json.dumps({"link": links.parse(a.link).describe()}))


if __name__ == "__main__":
    main()
