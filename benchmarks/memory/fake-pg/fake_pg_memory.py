"""One rank of a large world in one process: a fake process group, then memory against the plan.

    python benchmarks/memory/fake-pg/fake_pg_memory.py --model llama-7b --world 64 --seq-len 16

torch's fake process group (``FakeStore`` + backend ``"fake"``) completes every collective at once
without moving data, so one process holds exactly what rank ``--rank`` of ``--world`` holds: the
model is built on the meta device, ``shard()`` initializes it unit by unit and keeps this rank's
slices, and training steps (forward, backward, AdamW) run on them; the second is measured. The numbers computed are
garbage (no data moved); the memory is real. Printed (one JSON line): ``memory_report()`` against
``predict_memory()``, and torch's ``MemTracker`` peak of the step against the plan's peak
(``peak_bytes``: the larger of the forward's and the backward's). Runs on CPU here; on a GPU pass ``--device cuda`` to read
``max_memory_allocated`` as well.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.distributed as dist
from torch.distributed._tools.mem_tracker import MemTracker
from torch.testing._internal.distributed.fake_pg import FakeStore

import layershard as ls
from layershard.models import LlamaForCausalLM, build_config
from layershard.plan import predict_memory
from layershard.plan.memory import peak_bytes, predict_activations, unit_grad_bytes


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="llama-7b")
    p.add_argument("--world", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--seq-len", type=int, default=16)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32", help="compute dtype")
    p.add_argument("--device", default="cpu")
    a = p.parse_args()

    dist.init_process_group("fake", store=FakeStore(), rank=a.rank, world_size=a.world)
    cfg = build_config(a.model, max_seq_len=max(a.seq_len, 16))
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    device = torch.device(a.device)
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    model = ls.shard(model, mixed_precision=ls.MixedPrecision(dtype, torch.float32), device=device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    t_shard = time.perf_counter() - t0

    x = torch.randint(0, cfg.vocab_size, (a.micro_batch, a.seq_len), device=device)
    # One untracked step first: the optimizer state exists from then on (the steady state).
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    tracker = MemTracker()
    tracker.track_external(model, opt)
    t0 = time.perf_counter()
    with tracker:
        model(x, labels=x).loss.backward()
        opt.step()
    report = model.memory_report(opt)  # after the step, with the gradients
    opt.zero_grad(set_to_none=True)
    t_step = time.perf_counter() - t0
    snap = tracker.get_tracker_snapshot("peak")
    peak = int((snap.get(device) or next(iter(snap.values())))["Total"])

    pred = predict_memory(cfg, a.world, dtype, torch.float32, "adamw", rank=a.rank, backend="nccl")
    act = predict_activations(cfg, a.micro_batch, a.seq_len, 0, dtype)
    plan_peak = peak_bytes(pred, act, unit_grad_bytes(cfg, a.world, dtype))
    out = {
        "model": a.model,
        "params": n_params,
        "world": a.world,
        "rank": a.rank,
        "compute_dtype": a.dtype,
        "tokens": a.micro_batch * a.seq_len,
        "memory_report": report,
        "predict_memory": pred,
        "report_equals_prediction": report == pred,
        "memtracker_peak": peak,
        "plan_peak": plan_peak,
        "peak_over_plan": round(peak / plan_peak, 4),
        "shard_s": round(t_shard, 1),
        "step_s": round(t_step, 1),
    }
    if device.type == "cuda":
        out["max_memory_allocated"] = torch.cuda.max_memory_allocated(device)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
