"""Where a step's time goes, layershard next to DDP, on ``--nproc`` gloo ranks: forward (with the
loss), backward, optimizer step, the main thread's CPU time and minor page faults per step
(medians over the timed steps), and with ``--waits`` every collective wait by the unit it is for
and the function that waited (a wait a phase counter does not see: a reduction waiting for an
earlier one's buffer). The measurement behind ``benchmarks/memory/spare-storage/``.

    python benchmarks/engine/step_phases.py --shape vocab --impl layershard ddp --rounds 3
    PYTHONPATH=/path/to/old/src python benchmarks/engine/step_phases.py ...   # another engine

Impls alternate within each round, each in a fresh spawn; one JSON line per impl and round (rank
0's figures, the load average, the engine's source path).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time
import traceback

import torch
import torch.multiprocessing as mp

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))  # benchmarks/_ranks.py


def worker(rank: int, world: int, port: int, impl: str, args) -> None:
    from _ranks import init_gloo_rank, leave_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls
    from layershard.bench.worker import compute_loss
    from layershard.engine import collectives
    from layershard.models import LlamaForCausalLM, build_config

    waits: dict[str, float] = {}
    if args.waits:
        wait = collectives.Pending.wait

        def timed(self) -> None:
            if self.done:
                return
            caller = traceback.extract_stack(limit=4)[0].name  # who waited (past the slot's wait)
            t0 = time.perf_counter()
            wait(self)
            key = f"{self.what} @ {caller}"
            waits[key] = waits.get(key, 0.0) + time.perf_counter() - t0

        collectives.Pending.wait = timed
    torch.manual_seed(0)
    over = dict(args.overrides)
    vocab = over.pop("vocab_size", 8192)
    base = LlamaForCausalLM(build_config(args.model, vocab_size=vocab, **over))
    if impl == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        model = DDP(base)
    else:
        model = ls.shard(base)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    rec: dict[str, list[float]] = {k: [] for k in ("fwd", "bwd", "opt", "step", "cpu", "minflt")}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
        dist.barrier()
        if step == args.warmup:
            waits.clear()
        f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        t0, c0 = time.perf_counter(), time.thread_time()
        loss = compute_loss(model, x, args.loss)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        t3 = time.perf_counter()
        if step >= args.warmup:
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0
            for k, v in (("fwd", t1 - t0), ("bwd", t2 - t1), ("opt", t3 - t2), ("step", t3 - t0),
                         ("cpu", time.thread_time() - c0), ("minflt", faults)):  # fmt: skip
                rec[k].append(v)
    if rank == 0:
        out = {"impl": impl, **{k: round(statistics.median(v), 4) for k, v in rec.items()}}
        out["load"] = round(os.getloadavg()[0], 2)
        out["engine"] = os.path.dirname(ls.__file__)
        if args.waits:
            per_step = {k: round(v / args.steps, 4) for k, v in waits.items()}
            out["waits_s"] = dict(sorted(per_step.items(), key=lambda kv: -kv[1]))
        print(json.dumps(out), flush=True)
    leave_rank()


def main() -> None:
    from _ranks import add_model_args, apply_shape

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument(
        "--impl", nargs="+", default=["layershard", "ddp"], choices=["layershard", "ddp"]
    )
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--waits", action="store_true", help="every collective wait, by unit and caller")
    a = p.parse_args()
    from _dist import free_port

    apply_shape(a)
    for _ in range(a.rounds):
        for impl in a.impl:
            mp.spawn(worker, args=(a.nproc, free_port(), impl, a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
