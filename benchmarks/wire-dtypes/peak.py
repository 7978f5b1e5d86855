"""Where is the peak on the `logits` bench shape (issue 34)? From the repository root:

    PYTHONPATH=src python -m torch.distributed.run --standalone --nproc-per-node 2 \\
        benchmarks/wire-dtypes/peak.py layershard      # or fsdp2

Rank 0 prints MemTracker's peak by kind and its module-wise snapshots (the bench's tracker,
model, wrapping and loss: bench/worker.py), over the third step.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

import layershard as ls
from layershard.bench import worker as W
from layershard.bench.measure import mem_tracker

SHAPE = ["vocab_size=16384", "dim=768", "n_layers=3", "n_heads=12", "n_kv_heads=12", "ffn_dim=2048"]


def main() -> None:
    impl = sys.argv[1]
    overrides = sum([["--model-override", o] for o in SHAPE], [])
    args = W.parse_args(
        ["--impl", impl, "--model", "small", "--seq-len", "128", "--global-batch", "4"]
        + ["--loss", "outside", "--out", os.devnull, *overrides]
    )
    ls.init_distributed(backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = W.build_model(args)
    model, _, _ = W.wrap(impl, model, torch.device("cpu"), False, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 16384, (4, 128), generator=g)[rank * 2 : rank * 2 + 2] for _ in "abc"]

    def step(x: torch.Tensor) -> None:
        W.compute_loss(model, x, "outside").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(xs[0])
    step(xs[1])
    mt = mem_tracker()
    mt.track_external(model, opt)
    with mt:
        step(xs[2])
    if rank == 0:
        peak = mt.get_tracker_snapshot("peak")
        print({str(k): round(v / 2**20, 1) for k, v in next(iter(peak.values())).items()})
        mt.display_modulewise_snapshots(depth=5, units="MiB", tabulate=False)
    dist.barrier()
    os._exit(0)  # gloo's static destructors have aborted finished ranks (DEVELOPERS.md)


if __name__ == "__main__":
    main()
