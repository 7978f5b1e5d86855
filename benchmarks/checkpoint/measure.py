"""How long training stands still for a checkpoint: synchronous against asynchronous saves.

    torchrun --standalone --nproc-per-node 2 benchmarks/checkpoint/measure.py OUT_DIR

Each rank builds the `small` preset (35.7M parameters), sharded, with AdamW state (one step), then
alternates synchronous and asynchronous saves of the same state (--repeats of each). For every
save it records, between barriers, the stall (until save_checkpoint returns), the time until the
checkpoint is published (async: until wait() returns), and for async saves the time of one
training step run while the checkpoint is written in the background, against the same step with
nothing in the background. Rank 0 writes OUT_DIR/results.json and prints a table.
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import layershard as ls
from layershard.models import LlamaForCausalLM, build_config


def main(out: Path, repeats: int = 3) -> None:
    rank, world = ls.init_distributed()
    torch.manual_seed(0)
    model = ls.shard(LlamaForCausalLM(build_config("small")))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, 8192, (1, 128), generator=torch.Generator().manual_seed(rank))

    def step() -> float:
        dist.barrier()
        t0 = time.perf_counter()
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad()
        return time.perf_counter() - t0

    step()
    root = out / "ckpts"
    rows = []
    for i in range(repeats):
        for kind in ("sync", "async"):
            dist.barrier()
            t0 = time.perf_counter()
            res = ls.save_checkpoint(
                root / f"{kind}_{i}", model, opt, step=i, async_save=kind == "async"
            )
            stall = time.perf_counter() - t0
            row = {"kind": kind, "repeat": i, "stall_s": stall}
            if kind == "async":
                row["step_during_write_s"] = step()
                res.wait()
            dist.barrier()
            row["published_s"] = time.perf_counter() - t0
            row["step_alone_s"] = step()
            rows.append(row)
            if rank == 0:
                shutil.rmtree(root / f"{kind}_{i}", ignore_errors=True)
    gathered = [None] * world
    dist.all_gather_object(gathered, rows)
    if rank == 0:
        load = os.getloadavg()
        result = {
            "machine": f"{os.cpu_count()} CPU cores, torch {torch.__version__}, gloo",
            "load_avg_1_5_15": load,
            "world_size": world,
            "params": sum(p.numel() for p in LlamaForCausalLM(build_config("small")).parameters()),
            "rows_by_rank": gathered,
        }
        (out / "results.json").write_text(json.dumps(result, indent=1))
        print(f"load average {load[0]:.2f} {load[1]:.2f} {load[2]:.2f}; rank 0's numbers, s")
        for kind in ("sync", "async"):
            mine = [r for r in rows if r["kind"] == kind]
            stalls = [r["stall_s"] for r in mine]
            pub = [r["published_s"] for r in mine]
            line = (
                f"{kind:5s} stall {statistics.median(stalls):.3f} ({min(stalls):.3f}-"
                f"{max(stalls):.3f})  published after {statistics.median(pub):.2f} "
                f"({min(pub):.2f}-{max(pub):.2f})"
            )
            if kind == "async":
                during = [r["step_during_write_s"] for r in mine]
                alone = [r["step_alone_s"] for r in mine]
                line += (
                    f"  step while writing {statistics.median(during):.2f} "
                    f"({min(during):.2f}-{max(during):.2f}) vs alone "
                    f"{statistics.median(alone):.2f} ({min(alone):.2f}-{max(alone):.2f})"
                )
            print(line)
    dist.barrier()
    dist.destroy_process_group()
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    target = Path(sys.argv[1])
    target.mkdir(parents=True, exist_ok=True)
    main(target, int(sys.argv[2]) if len(sys.argv) > 2 else 3)
