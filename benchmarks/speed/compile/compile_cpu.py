"""What ``ls.shard(..., compile=True)`` changes in step time on CPU (issue 12): 2 gloo ranks, the
same model, data and seed, eager blocks against ``torch.compile``d blocks (inductor).

    python benchmarks/speed/compile/compile_cpu.py --model small --steps 6 --warmup 2

Warm-up steps absorb compilation and are reported separately. Prints one JSON line per rank and
mode: per-step wall time (median of the timed steps), the first step (compilation included) and the
final loss, which must agree between modes to float tolerance.
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

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "..", "tests"))
sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))  # benchmarks/_ranks.py


def worker(rank: int, world: int, port: int, args) -> None:
    from _ranks import init_gloo_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    compile_opts: bool | dict = {"backend": args.backend} if args.compile else False
    torch.manual_seed(0)
    model = ls.shard(
        LlamaForCausalLM(build_config(args.model, vocab_size=8192)), compile=compile_opts
    )
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    g = torch.Generator().manual_seed(1 + rank)
    walls, loss = [], 0.0
    for _ in range(args.warmup + args.steps):
        x = torch.randint(0, 8192, (args.batch, args.seq_len), generator=g)
        dist.barrier()
        t0 = time.perf_counter()
        out = model(x, labels=x).loss
        out.backward()
        opt.step()
        opt.zero_grad()
        loss = out.item()
        dist.barrier()
        walls.append(time.perf_counter() - t0)
    print(json.dumps({
        "rank": rank, "mode": f"compile-{args.backend}" if args.compile else "eager",
        "model": args.model, "first_step_s": round(walls[0], 3),
        "step_s": round(statistics.median(walls[args.warmup:]), 4),
        "final_loss": loss, "load": os.getloadavg()[0],
    }), flush=True)  # fmt: skip
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--compile", action="store_true")
    p.add_argument("--backend", default="inductor")
    a = p.parse_args()
    from _dist import free_port

    mp.spawn(worker, args=(2, free_port(), a), nprocs=2, join=True)


if __name__ == "__main__":
    main()
