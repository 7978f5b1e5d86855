"""layershard and DDP in one process, steps alternating (host speed drift hits both alike):
per-step wall and main-thread CPU ratios layershard / DDP on the deep shape."""

import argparse
import copy
import json
import os
import statistics
import sys
import time

import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(_ROOT, "benchmarks"))
sys.path.insert(0, os.path.join(_ROOT, "tests"))


def worker(rank, world, port, a):
    from _ranks import init_gloo_rank, leave_rank

    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    import layershard as ls

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
    from torch.nn.parallel import DistributedDataParallel as DDP

    impls = {"layershard": ls.shard(copy.deepcopy(base)), "ddp": DDP(copy.deepcopy(base))}
    opts = {k: torch.optim.AdamW(m.parameters(), lr=1e-4) for k, m in impls.items()}
    g = torch.Generator().manual_seed(1)
    rec = {k: {"wall": [], "cpu": []} for k in impls}
    order = list(impls)
    for step in range(a.warmup + a.steps):
        x = torch.randint(0, 4096, (a.batch, a.seq), generator=g)
        for name in order if step % 2 == 0 else order[::-1]:
            model, opt = impls[name], opts[name]
            dist.barrier()
            t0, c0 = time.perf_counter(), time.thread_time()
            logits = model(x).logits
            loss = F.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1)
            )
            loss.backward()
            opt.step()
            opt.zero_grad()
            t1, c1 = time.perf_counter(), time.thread_time()
            if step >= a.warmup:
                rec[name]["wall"].append(t1 - t0)
                rec[name]["cpu"].append(c1 - c0)
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
    a = p.parse_args()
    from _dist import free_port

    mp.spawn(worker, args=(a.nproc, free_port(), a), nprocs=a.nproc, join=True)
