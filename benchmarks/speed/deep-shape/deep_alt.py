"""layershard and DDP in one process, steps alternating (host speed drift hits both alike):
per-step wall and main-thread CPU ratios layershard / DDP on the deep shape, the process's CPU
(every thread: gloo's too) and the main thread's CPU by phase (forward with the loss, backward,
optimizer step; medians in ms, layershard then DDP)."""

import argparse
import copy
import json
import os
import resource
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

_ROOT = os.path.dirname(
    os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
)
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(_ROOT, "tests"))


class Blocks(torch.nn.Module):
    """Consecutive blocks run as one module: shard() takes it as one unit."""

    def __init__(self, blocks):
        super().__init__()
        self.blocks = torch.nn.ModuleList(blocks)

    def forward(self, x, cos, sin):
        for b in self.blocks:
            x = b(x, cos, sin)
        return x


def worker(rank, world, port, a):
    from _ranks import init_gloo_rank, leave_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls

    if a.no_gathers:  # timing only, wrong numbers: each rank copies its own chunk, nothing moves
        from layershard.engine import collectives

        def local_copy(self, out, src, phase, label, over="shard"):
            _, r, _ = self.members(over)
            out[r * src.numel() : (r + 1) * src.numel()].copy_(src)
            return collectives.DONE

        collectives.Comm.all_gather = local_copy

    if a.model_src:
        import importlib.util

        spec = importlib.util.spec_from_file_location("refllama", a.model_src)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["refllama"] = mod
        spec.loader.exec_module(mod)
        LlamaForCausalLM, build_config = mod.LlamaForCausalLM, mod.build_config
    else:
        from layershard.models import LlamaForCausalLM, build_config
    torch.manual_seed(0)
    cfg = build_config(
        "small",
        vocab_size=4096,
        dim=a.dim,
        n_layers=a.layers,
        n_heads=4,
        n_kv_heads=4,
        ffn_dim=a.ffn,
    )
    base = LlamaForCausalLM(cfg)
    if a.blocks_per_unit > 1:  # the same computation, in units of K consecutive blocks
        blocks, k = list(base.layers), a.blocks_per_unit
        base.layers = torch.nn.ModuleList(
            [Blocks(blocks[i : i + k]) for i in range(0, len(blocks), k)]
        )
    from torch.nn.parallel import DistributedDataParallel as DDP

    ours = ls.shard(copy.deepcopy(base), strategy=a.strategy)
    impls = {"layershard": ours, "ddp": DDP(copy.deepcopy(base))}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in impls.items()}
    g = torch.Generator().manual_seed(1)
    rec = {k: {m: [] for m in ("wall", "cpu", "proc", "fwd", "bwd", "opt")} for k in impls}

    def proc_cpu() -> float:  # user + system time of every thread of this rank
        r = resource.getrusage(resource.RUSAGE_SELF)
        return r.ru_utime + r.ru_stime

    order = list(impls)
    for step in range(a.warmup + a.steps):
        x = torch.randint(0, 4096, (a.batch, a.seq), generator=g)
        for name in order if step % 2 == 0 else order[::-1]:
            model, opt = impls[name], opts[name]
            dist.barrier()
            t0, c0, p0 = time.perf_counter(), time.thread_time(), proc_cpu()
            logits = model(x).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            cf = time.thread_time()
            loss.backward()
            cb = time.thread_time()
            opt.step()
            opt.zero_grad()
            t1, c1, p1 = time.perf_counter(), time.thread_time(), proc_cpu()
            if step >= a.warmup:
                for m, v in (("wall", t1 - t0), ("cpu", c1 - c0), ("proc", p1 - p0),
                             ("fwd", cf - c0), ("bwd", cb - cf), ("opt", c1 - cb)):  # fmt: skip
                    rec[name][m].append(v)
    if rank == 0:
        ls_w, dd_w = rec["layershard"]["wall"], rec["ddp"]["wall"]
        ratio = [x / y for x, y in zip(ls_w, dd_w)]
        out = {
            "engine": os.path.dirname(ls.__file__).split("/")[2],
            "ls": round(statistics.median(ls_w), 4),
            "ddp": round(statistics.median(dd_w), 4),
            "ratio_median": round(statistics.median(ratio), 4),
            "ratio_pooled": round(sum(ls_w) / sum(dd_w), 4),
            "cpu_ratio": round(sum(rec["layershard"]["cpu"]) / sum(rec["ddp"]["cpu"]), 4),
            "proc_cpu_ratio": round(sum(rec["layershard"]["proc"]) / sum(rec["ddp"]["proc"]), 4),
            "cpu_ms": {  # medians, [layershard, DDP]
                m: [round(1000 * statistics.median(rec[k][m]), 1) for k in impls]
                for m in ("proc", "cpu", "fwd", "bwd", "opt")
            },
            "load": round(os.getloadavg()[0], 2),
        }
        print(json.dumps(out), flush=True)
    leave_rank()


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--dim", type=int, default=256)
    p.add_argument("--ffn", type=int, default=704)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--model-src", default=None)
    p.add_argument("--strategy", default="full", help="layershard's sharding strategy")
    p.add_argument("--blocks-per-unit", type=int, default=1, help="K blocks in one unit")
    p.add_argument(
        "--no-gathers", action="store_true", help="timing only: no all-gather moves data"
    )
    a = p.parse_args()
    from _dist import free_port

    mp.spawn(worker, args=(a.nproc, free_port(), a), nprocs=a.nproc, join=True)
