"""Where layershard's step time goes vs DDP: wall time inside engine functions + torch.profiler ops."""

import collections
import functools
import os
import sys
import time

import torch
import torch.distributed as dist

import layershard as ls
from layershard.models import LlamaForCausalLM, build_config

impl = sys.argv[1]
torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", 1)))
ls.init_distributed(backend="gloo")
rank, world = dist.get_rank(), dist.get_world_size()
torch.manual_seed(0)
model = LlamaForCausalLM(build_config("small", vocab_size=8192))
acc = collections.Counter()
cnt = collections.Counter()


def timed(obj, name, label):
    f = getattr(obj, name)

    @functools.wraps(f)
    def w(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            acc[label] += time.perf_counter() - t
            cnt[label] += 1

    setattr(obj, name, w)


if impl == "layershard":
    import layershard.engine.collectives as C
    import layershard.engine.schedule as S

    model = ls.shard(model)
    timed(C.Pending, "wait", "Pending.wait")
    timed(S.Schedule, "reduce", "Schedule.reduce (copy grads + issue RS)")
    timed(S.Schedule, "_issue_gather", "Schedule._issue_gather (issue AG)")
    timed(S.Schedule, "end_backward", "Schedule.end_backward (wait RS)")
    timed(S.Schedule, "pre_forward", "Schedule.pre_forward")
    timed(S.Schedule, "pre_backward", "Schedule.pre_backward")
    timed(S.Schedule, "root_pre_forward", "Schedule.root_pre_forward")
else:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = DDP(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
g = torch.Generator().manual_seed(1)
B = 8 // world


def step():
    x = torch.randint(0, 8192, (8, 512), generator=g)[rank * B : (rank + 1) * B]
    t = {}
    dist.barrier()
    t0 = time.perf_counter()
    loss = model(x, labels=x).loss
    t1 = time.perf_counter()
    loss.backward()
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad()
    t3 = time.perf_counter()
    dist.barrier()
    t4 = time.perf_counter()
    return dict(fwd=t1 - t0, bwd=t2 - t1, opt=t3 - t2, barrier=t4 - t3, total=t4 - t0)


for _ in range(2):
    step()
acc.clear()
cnt.clear()
phases = collections.Counter()
N = 3
for _ in range(N):
    for k, v in step().items():
        phases[k] += v / N
from torch.profiler import ProfilerActivity, profile

with profile(activities=[ProfilerActivity.CPU]) as prof:
    step()
if rank == 0:
    print(
        f"== {impl} world {world}: per-step phases (s):",
        {k: round(v, 3) for k, v in phases.items()},
    )
    for k, v in acc.most_common():
        print(f"   {k:<45} {v / N:.3f} s/step  ({cnt[k] // N} calls)")
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
dist.destroy_process_group()
