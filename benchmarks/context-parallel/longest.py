"""The longest sequence of the `small` preset that one training step fits in a rank's memory,
at cp 1, 2 and 4 (issue 49): per-rank peak memory measured with torch's MemTracker over one
forward and backward after a first step (parameters, gradients, optimizer state, gather
buffers, activations, temporaries) at a few sequence lengths, the line through the two longest
(attention is flash attention, whose memory is linear in the sequence; `miss` says how far the
line is from the shorter points), and the length where the line meets the budget (default 24 GiB, this machine's memory, per rank: each rank as a GPU of its own).

Variants: `plain` (no activation checkpointing, the model's own loss) and `ckpt` (every block
checkpointed, the chunked loss in 8 chunks). One global sequence per step (batch 1), split over
the cp ranks of one CP group (world = cp).

    python benchmarks/context-parallel/longest.py --cp 1 2 4 --seq 1024 2048 4096 \
        --out benchmarks/context-parallel/longest.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from _ranks import init_gloo_rank, leave_rank  # noqa: E402

GIB = 1 << 30


def _step_peak(cp: int, seq: int, variant: str) -> tuple[int, int]:
    """MemTracker's peak total (bytes) on this rank over one training step's forward and
    backward, and over its optimizer step."""
    import layershard as ls
    from layershard.bench.measure import mem_tracker
    from layershard.models import LlamaForCausalLM, build_config
    from layershard.parallel.context import context_batch

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config("small", max_seq_len=seq))
    ckpt = {"activation_checkpointing": 8} if variant == "ckpt" else {}
    model = ls.parallelize(model, cp=cp, **ckpt) if cp > 1 else ls.shard(model, **ckpt)
    if variant == "ckpt":
        ls.chunked_loss(model, 8)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    ids = torch.randint(0, 8192, (1, seq), generator=torch.Generator().manual_seed(1))
    batch = context_batch(model, ids, labels=ids)
    # a first step outside the tracker allocates the AdamW state and the gradient storage, so
    # that the tracked step's peak is the steady state's: all of it plus the activations
    model(**batch).loss.backward()
    opt.step()
    opt.zero_grad()
    peaks = []
    for part in ("forward_backward", "optimizer"):  # the optimizer's peak does not grow with seq
        tracker = mem_tracker()
        tracker.track_external(model, opt)
        with tracker:
            if part == "forward_backward":
                model(**batch).loss.backward()
            else:
                opt.step()
                opt.zero_grad()
        peak = tracker.get_tracker_snapshot("peak")
        peaks.append(int(sum(d.get("Total", 0) for d in peak.values())))
    return peaks[0], peaks[1]


def _rank(rank: int, world: int, port: int, seqs: list[int], variants: list[str], out: str):
    init_gloo_rank(rank, world, port)
    import torch.distributed as dist

    rows = []
    for variant in variants:
        for seq in seqs:
            t0 = time.perf_counter()
            peak = torch.tensor([float(b) for b in _step_peak(world, seq, variant)])
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)  # the largest rank's
            rows.append({"cp": world, "variant": variant, "seq": seq,
                         "peak_bytes": int(peak[0]), "optimizer_peak_bytes": int(peak[1]),
                         "seconds": round(time.perf_counter() - t0, 1)})  # fmt: skip
            if rank == 0:
                print(rows[-1], flush=True)
    if rank == 0:
        Path(out).write_text(json.dumps(rows))
    leave_rank()


def _fit(rows: list[dict]) -> tuple[float, float, float]:
    """The line through the two longest sequences' peaks, ``peak = a + b seq`` (the marginal
    bytes per token where the sequence is long; at the shortest lengths the peak can sit
    elsewhere in the step), and how far it misses the other points (relative)."""
    rows = sorted(rows, key=lambda r: r["seq"])
    (x0, y0), (x1, y1) = ((r["seq"], r["peak_bytes"]) for r in rows[-2:])
    b = (y1 - y0) / (x1 - x0)
    a = y1 - b * x1
    miss = max((abs(a + b * r["seq"] - r["peak_bytes"]) / r["peak_bytes"] for r in rows[:-2]),
               default=0.0)  # fmt: skip
    return a, b, miss


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--seq", type=int, nargs="+", default=[1024, 2048, 4096])
    p.add_argument("--variants", nargs="+", default=["plain", "ckpt"])
    p.add_argument("--budget-gib", type=float, default=24.0)
    p.add_argument("--out", default="longest.json")
    p.add_argument("--refit", action="store_true",
                   help="recompute the table from the measurements already in --out")  # fmt: skip
    args = p.parse_args()
    rows: list[dict] = []
    if args.refit:
        rows = json.loads(Path(args.out).read_text())["measured"]
        args.cp = sorted({r["cp"] for r in rows})
        args.variants = sorted({r["variant"] for r in rows}, reverse=True)
    for i, cp in enumerate([] if args.refit else args.cp):
        part = f"{args.out}.cp{cp}"
        mp.spawn(_rank, args=(cp, 29650 + i, args.seq, args.variants, part), nprocs=cp)
        rows += json.loads(Path(part).read_text())
        os.remove(part)
    table = []
    for variant in args.variants:
        base = None
        for cp in args.cp:
            a, b, resid = _fit([r for r in rows if r["cp"] == cp and r["variant"] == variant])
            opt_peak = max(r["optimizer_peak_bytes"] for r in rows if r["cp"] == cp)
            assert opt_peak < args.budget_gib * GIB, "the optimizer step alone does not fit"
            longest = int((args.budget_gib * GIB - a) / b) // (2 * cp) * (2 * cp)
            base = base or longest
            table.append({"variant": variant, "cp": cp, "fixed_gib": round(a / GIB, 3),
                          "optimizer_peak_gib": round(opt_peak / GIB, 3),
                          "kib_per_token": round(b / 1024, 2), "line_miss": round(resid, 4),
                          "longest_seq": longest, "x_cp1": round(longest / base, 2)})  # fmt: skip
    result = {"budget_gib_per_rank": args.budget_gib, "measured": rows, "fit": table,
              "torch": torch.__version__}  # fmt: skip
    Path(args.out).write_text(json.dumps(result, indent=1) + "\n")
    print(f"{'variant':8} {'cp':>3} {'fixed GiB':>10} {'KiB/token':>10} {'miss':>7} "
          f"{'longest seq':>12} {'x cp1':>6}")  # fmt: skip
    for r in table:
        print(f"{r['variant']:8} {r['cp']:>3} {r['fixed_gib']:>10} {r['kib_per_token']:>10} "
              f"{r['line_miss']:>7} {r['longest_seq']:>12} {r['x_cp1']:>6}")  # fmt: skip


if __name__ == "__main__":
    main()
