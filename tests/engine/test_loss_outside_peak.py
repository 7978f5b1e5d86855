"""Peak memory with the loss computed outside the model (issue 34): a model that returns logits,
the user's cross-entropy on them, AdamW, world size 2. layershard must hold no more than FSDP2 at
its peak, by torch's MemTracker over one step, as `layershard bench` measures it (the same model,
wrapping, loss and tracker: bench/worker.py).

The bench's `logits` shape (vocab 16384, 3 blocks of d 768, seq 128, 2 sequences per rank) is
this test's shape at half the width and vocabulary: the embedding and the head stay 1.8x a block,
so the buffers keep their ratios, in a quarter of the memory and time. Measured 2026-11-26 on
the engine before the fix (0fe5b6a) and after: this shape 153.5 -> 134.4 MiB against FSDP2's
149.0 (1.03x -> 0.90x; the test fails on the old engine); the logits shape 612.6 -> 542.4 MiB
against 551.8 (1.11x -> 0.98x). What was held (MemTracker.display_modulewise_snapshots): the
two block gradient slots and their scratch (108 MiB on the logits shape) until the end of
backward, under the embedding's gradient and its reduce scratch; and the head's reduce scratch,
kept as spare storage for the embedding's through the blocks' backward (48 MiB)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from _dist import run_ranks

SHAPE = ["vocab_size=8192", "dim=384", "n_layers=3", "n_heads=6", "n_kv_heads=6", "ffn_dim=1024"]


def _peak(impl: str, rank: int, world: int) -> int:
    from layershard.bench import worker as W
    from layershard.bench.measure import mem_tracker

    overrides = sum([["--model-override", o] for o in SHAPE], [])
    args = W.parse_args(
        ["--impl", impl, "--model", "small", "--seq-len", "128", "--global-batch", str(2 * world)]
        + ["--loss", "outside", "--out", os.devnull, *overrides]
    )
    model, _ = W.build_model(args)
    model, _, _ = W.wrap(impl, model, torch.device("cpu"), False, world)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    g = torch.Generator().manual_seed(1)
    xs = [torch.randint(0, 8192, (2 * world, 128), generator=g)[2 * rank : 2 * rank + 2]]
    xs = xs * 3

    def step(x: torch.Tensor) -> None:
        W.compute_loss(model, x, "outside").backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step(xs[0])  # optimizer state exists, as in every later step
    step(xs[1])
    mt = mem_tracker()
    mt.track_external(model, opt)
    with mt:
        step(xs[2])
    peak = mt.get_tracker_snapshot("peak")
    return int(next(iter(peak.values()))["Total"])


def _layershard_at_most_fsdp2(rank: int, world: int) -> None:
    ours = _peak("layershard", rank, world)
    theirs = _peak("fsdp2", rank, world)
    t = torch.tensor([ours, theirs], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    ours_max, theirs_max = t.tolist()
    assert ours_max <= theirs_max, (
        f"layershard's peak {ours_max / 2**20:.1f} MiB > FSDP2's {theirs_max / 2**20:.1f} MiB "
        f"({ours_max / theirs_max:.3f}x)"
    )
    if rank == 0:
        print(f"peak: layershard {ours_max / 2**20:.1f} MiB, FSDP2 {theirs_max / 2**20:.1f} MiB")


def test_peak_with_the_loss_outside_at_most_fsdp2() -> None:
    run_ranks(_layershard_at_most_fsdp2, 2)
