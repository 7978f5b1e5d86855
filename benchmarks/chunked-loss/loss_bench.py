"""Peak memory and time of one loss forward + backward, plain against chunked (layershard.loss).

The LM head and the loss of a CPU-sized model with a large vocabulary (default: vocab 32768,
d 512, batch 4 x seq 512, fp32), as the built-in Llama's tail runs them: the plain loss is
``causal_lm_loss(F.linear(h, W), labels)`` with the logits held by the caller (as a model's
output holds them) until the backward is done; the chunked one is
``chunked_causal_lm_loss(h, W, labels, K)``. Gradients of h and W are computed (autograd.grad).

- memory: torch's MemTracker (layershard.plan.measure.LiveMemory), bytes of every tensor the
  step creates (h, W and the labels are the caller's), at the step's peak; next to it what
  ``layershard plan`` charges (its logits item, + the head's weight gradient when chunked).
- time: wall-clock of the forward + backward, the median (and min-max) of ``--repeats`` runs
  after one warm-up, variants interleaved; the 1-minute load average before and after.

    PYTHONPATH=src python benchmarks/chunked-loss/loss_bench.py --out benchmarks/chunked-loss
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from layershard.loss import chunked_causal_lm_loss
from layershard.models import causal_lm_loss
from layershard.plan.measure import LiveMemory
from layershard.plan.memory import chunked_logits_bytes, logits_bytes_per_token
from layershard.plan.model import ModelShape


def step(h: torch.Tensor, w: torch.Tensor, labels: torch.Tensor, chunks: int) -> None:
    if chunks:
        loss = chunked_causal_lm_loss(h, w, labels, chunks)
        torch.autograd.grad(loss, (h, w))
        return
    logits = F.linear(h, w)  # held, as a model's output holds it
    loss = causal_lm_loss(logits, labels)
    torch.autograd.grad(loss, (h, w))
    del logits


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--dim", type=int, default=512)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--chunks", type=int, nargs="+", default=[0, 4, 8, 16])
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", type=Path)
    a = p.parse_args()
    torch.manual_seed(0)
    head = nn.Linear(a.dim, a.vocab, bias=False)  # owns W, so that MemTracker tracks it apart
    nn.init.normal_(head.weight, std=0.02)
    h = torch.randn(a.batch, a.seq, a.dim, requires_grad=True)
    labels = torch.randint(0, a.vocab, (a.batch, a.seq))
    tokens = a.batch * a.seq
    shape = ModelShape(name="bench", vocab_size=a.vocab, dim=a.dim, n_layers=1, n_heads=8,
                       n_kv_heads=8, ffn_dim=4 * a.dim, max_seq_len=a.seq)  # fmt: skip

    rows: dict[int, dict] = {}
    for k in a.chunks:
        with LiveMemory(head, [h, labels]) as mem:
            step(h, head.weight, labels, k)
            peak = mem.peak()
        if k:
            plan = chunked_logits_bytes(shape, tokens, k, "fp32") + 4 * a.vocab * a.dim
        else:
            plan = logits_bytes_per_token(shape, "fp32") * tokens
        rows[k] = {"chunks": k, "peak_bytes": peak, "plan_bytes": plan, "times_s": []}

    load_before = os.getloadavg()[0]
    for k in a.chunks:  # warm-up
        step(h, head.weight, labels, k)
    for _ in range(a.repeats):
        for k in a.chunks:  # interleaved: load drifts hit every variant alike
            t0 = time.perf_counter()
            step(h, head.weight, labels, k)
            rows[k]["times_s"].append(time.perf_counter() - t0)
    load_after = os.getloadavg()[0]

    lines = [
        f"one loss forward + backward: vocab {a.vocab}, d {a.dim}, batch {a.batch} x seq "
        f"{a.seq} ({tokens} tokens), fp32, {torch.get_num_threads()} threads, torch "
        f"{torch.__version__}",
        f"load average (1 min) {load_before:.2f} before the timed runs, {load_after:.2f} after; "
        f"{a.repeats} repeats, variants interleaved",
        "",
        f"{'loss':12s}{'peak MiB':>10s}{'plan MiB':>10s}{'x plain':>9s}"
        f"{'median s':>10s}{'min-max s':>16s}{'x plain':>9s}{'peak-plan B':>13s}",
    ]
    base = rows[a.chunks[0]]
    base_t = statistics.median(base["times_s"])
    for k, r in rows.items():
        t = r["times_s"]
        r["median_s"] = statistics.median(t)
        lines.append(
            f"{'plain' if not k else f'{k} chunks':12s}{r['peak_bytes'] / 2**20:10.1f}"
            f"{r['plan_bytes'] / 2**20:10.1f}{r['peak_bytes'] / base['peak_bytes']:9.3f}"
            f"{r['median_s']:10.3f}{f'{min(t):.3f}-{max(t):.3f}':>16s}"
            f"{r['median_s'] / base_t:9.3f}{r['peak_bytes'] - r['plan_bytes']:13d}"
        )
    lines += [
        "",
        "peak: MemTracker, bytes the step creates (the gradients of h and W included); plan: "
        "layershard plan's logits item (plain), or its logits item + the head's weight "
        "gradient (chunked).",
    ]
    text = "\n".join(lines)
    print(text)
    if a.out:
        a.out.mkdir(parents=True, exist_ok=True)
        (a.out / "loss_bench.txt").write_text(text + "\n")
        meta = {"args": {k: str(v) for k, v in vars(a).items()},
                "load_before": load_before, "load_after": load_after}  # fmt: skip
        (a.out / "loss_bench.json").write_text(
            json.dumps({"meta": meta, "rows": list(rows.values())}, indent=1) + "\n"
        )


if __name__ == "__main__":
    main()
