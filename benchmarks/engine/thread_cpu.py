"""Per-thread CPU per step for layershard, DDP and the plain model, on N gloo ranks (CPU).

    python benchmarks/engine/thread_cpu.py --impl ls|ddp|plain [--seq-len 256 --batch 4] [--profile]
    python benchmarks/engine/thread_cpu.py --impl ls --shape comm       # a `layershard bench` shape

Each rank trains the ``small`` preset (vocab 8192) and prints one JSON line: medians over the
timed steps of the step's wall time, its main thread's CPU time, the other threads' (gloo's) CPU
time and the minor page faults (``minflt``). ``plain`` is the unsharded model with no communication
(two side-by-side processes: the compute floor). ``--profile`` prints rank 0's
``torch.profiler`` table (self CPU) of one more step. Recorded: ``benchmarks/engine/gloo-reduce-scatter/``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # benchmarks/_ranks.py


def worker(rank: int, world: int, port: int, args) -> None:
    from _ranks import init_gloo_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(args.model, vocab_size=8192, **args.overrides))
    if args.impl == "ls":
        model = ls.shard(model)
    elif args.impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)

    def step() -> None:
        x = torch.randint(0, 8192, (args.batch, args.seq_len), generator=g)
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()

    import resource

    res: dict[str, list[float]] = {k: [] for k in ("wall", "main", "other", "minflt")}
    for i in range(args.warmup + args.steps):
        dist.barrier()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        step()
        if i >= args.warmup:
            res["wall"].append(time.perf_counter() - t0)
            main = time.thread_time() - c0
            res["main"].append(main)
            res["other"].append(time.process_time() - p0 - main)
            res["minflt"].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        if rank == 0:  # (torch 2.13's profile() has no `enabled`)
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                step()
            print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
        else:
            step()
    medians = {k: round(statistics.median(v), 4) for k, v in res.items()}
    print(json.dumps({"impl": args.impl, "rank": rank, **medians, "load": os.getloadavg()[0]}),
          flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", choices=("ls", "ddp", "plain"), default="ls")
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--profile", action="store_true")
    p.add_argument("--model", default="small")
    p.add_argument("--shape", choices=["small", "comm"], help="a `layershard bench` shape")
    a = p.parse_args()
    from _dist import free_port
    from _ranks import apply_shape

    apply_shape(a)

    mp.spawn(worker, args=(a.nproc, free_port(), a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
