"""How long backward waits for its gathers, on 2 (``--nproc``) gloo ranks: the measurement behind issuing the
gather into a freed buffer before the freed unit's reduce-scatter (issue 10, item 10).

    python benchmarks/engine/backward_order.py --model small --steps 6
    PYTHONPATH=/path/to/old/src python benchmarks/engine/backward_order.py ...   # another engine

Each rank times every ``Schedule.ensure`` call (the main thread blocked until the unit's weights
are there) in backward and in forward, the whole step, and the CPU time of its main thread and of
its other threads (gloo's). Prints one JSON line per rank: the engine's source
path, per-step wall time and backward gather wait (medians over the timed steps).
``--shape comm`` takes the model, sequence length and per-rank batch of that ``layershard bench``
shape; ``--per-unit`` adds the median wait of each unit in each phase (``forward/layers.0``...).
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
    from _ranks import init_gloo_rank, leave_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls

    try:
        from layershard.engine import buffers
        from layershard.engine import schedule as sched
    except ImportError:  # an engine from before the engine/ package (A/B runs)
        from layershard import buffers  # type: ignore[no-redef]
        from layershard import schedule as sched  # type: ignore[no-redef]
    from layershard.models import LlamaForCausalLM, build_config

    waited = [0.0, 0.0]  # backward, forward
    per_unit: dict[str, float] = {}
    ensure = sched.Schedule.ensure

    def timed(self, u, phase):
        t0 = time.perf_counter()
        ensure(self, u, phase)
        dt = time.perf_counter() - t0
        waited[0 if phase is sched.Phase.BACKWARD else 1] += dt
        key = f"{phase.value}/{u.name}"
        per_unit[key] = per_unit.get(key, 0.0) + dt

    sched.Schedule.ensure = timed

    def timed_call(name, fn):
        def wrapper(*a, **k):
            t0 = time.perf_counter()
            r = fn(*a, **k)
            per_unit[name] = per_unit.get(name, 0.0) + time.perf_counter() - t0
            return r

        return wrapper

    # Other places the main thread may block on communication (reported with --per-unit).
    sched.Schedule.end_backward = timed_call("end_backward", sched.Schedule.end_backward)
    buffers.GradSlot.acquire = timed_call("grad_slot_acquire", buffers.GradSlot.acquire)
    buffers.GatherSlot.take = timed_call("gather_slot_take", buffers.GatherSlot.take)
    torch.manual_seed(0)
    over = dict(args.overrides)
    vocab = over.pop("vocab_size", 8192)
    model = ls.shard(LlamaForCausalLM(build_config(args.model, vocab_size=vocab, **over)))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1)
    walls, waits, fwaits, main_cpu, other_cpu = [], [], [], [], []
    units: dict[str, list[float]] = {}
    for step in range(args.warmup + args.steps):
        x = torch.randint(0, vocab, (args.batch, args.seq_len), generator=g)
        dist.barrier()
        waited[0] = waited[1] = 0.0
        per_unit.clear()
        t0, c0, p0 = time.perf_counter(), time.thread_time(), time.process_time()
        model(x, labels=x).loss.backward()
        t1 = time.perf_counter()
        opt.step()
        opt.zero_grad()
        per_unit["optimizer"] = time.perf_counter() - t1
        if step >= args.warmup:
            walls.append(time.perf_counter() - t0)
            waits.append(waited[0])
            fwaits.append(waited[1])
            for k, v in per_unit.items():
                units.setdefault(k, []).append(v)
            main = time.thread_time() - c0
            main_cpu.append(main)
            other_cpu.append(time.process_time() - p0 - main)  # gloo's threads
    print(json.dumps({
        "rank": rank, "engine": os.path.dirname(ls.__file__), "model": args.model,
        "step_s": round(statistics.median(walls), 4),
        "backward_gather_wait_s": round(statistics.median(waits), 4),
        "forward_gather_wait_s": round(statistics.median(fwaits), 4),
        "main_thread_cpu_s": round(statistics.median(main_cpu), 4),
        "other_threads_cpu_s": round(statistics.median(other_cpu), 4),
        "load": os.getloadavg()[0],
        **({"per_unit_wait_s": {k: round(statistics.median(v), 4) for k, v in units.items()}}
           if args.per_unit else {}),
    }), flush=True)  # fmt: skip
    leave_rank()


def main() -> None:
    from _ranks import add_model_args, apply_shape

    p = argparse.ArgumentParser()
    add_model_args(p)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--per-unit", action="store_true", help="median wait per unit and phase")
    a = p.parse_args()
    from _dist import free_port

    apply_shape(a)

    mp.spawn(worker, args=(a.nproc, free_port(), a), nprocs=a.nproc, join=True)


if __name__ == "__main__":
    main()
