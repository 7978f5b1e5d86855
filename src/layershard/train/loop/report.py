"""What a run leaves behind: metrics as JSONL (and to the sinks of --report-to: sinks.py), a loss-curve PNG
(train and validation)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from layershard.engine.waits import waiting
from layershard.train.loop.context import next_token_logits
from layershard.train.loop.sinks import Sink, scalars


class MetricsLog:
    """Append-only JSONL, one record per line, and the same numbers to the ``sinks``
    (TensorBoard, W&B, MLflow: sinks.py). On resume, records after the resumed step are dropped
    first: they belong to the part of the run that the checkpoint does not contain (TensorBoard
    purges them the same way)."""

    def __init__(
        self, path: Path, resume_step: int | None = None, sinks: list[Sink] | None = None
    ) -> None:
        self.path = path
        if resume_step is not None and path.is_file():
            keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        elif resume_step is None and path.exists():
            path.unlink()
        self.fh = path.open("a")
        self.sinks = list(sinks or [])

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        values = scalars(record)
        if "step" in record and values:
            for sink in self.sinks:
                sink.log(int(record["step"]), values)

    def close(self, summary: dict[str, Any] | None = None) -> None:
        """Close the file and the sinks; ``summary`` (summary.json's) goes to them first."""
        if not self.fh.closed:
            self.fh.close()
        sinks, self.sinks = self.sinks, []
        for sink in sinks:
            sink.finish(summary)


STRAGGLER_RATIO = 1.1  # a node this much slower than the median node is named


def straggler(busy_s: list[float], local_world: int) -> tuple[int, float] | None:
    """(the slowest node, its busy time over the median node's) when the ranks span several
    nodes (``local_world`` consecutive ranks each) and one is ``STRAGGLER_RATIO`` slower, else
    None. A node's busy time is its slowest rank's: the one the others wait for."""
    nodes = [max(busy_s[i : i + local_world]) for i in range(0, len(busy_s), local_world)]
    if len(nodes) < 2:
        return None
    median = sorted(nodes)[(len(nodes) - 1) // 2]
    slowest = max(range(len(nodes)), key=nodes.__getitem__)
    ratio = nodes[slowest] / median if median > 0 else 1.0
    return (slowest, ratio) if ratio >= STRAGGLER_RATIO else None


def finish_eta(elapsed_s: float, steps_done: int, steps_left: int) -> str:
    """When the run ends at this launch's pace so far (steps, evaluations and checkpoints
    alike): ``ends ~14:05 (in 1:02:10)``; '' before the first step."""
    if steps_done == 0:
        return ""
    left = elapsed_s / steps_done * steps_left
    at = time.strftime("%H:%M", time.localtime(time.time() + left))
    h, rest = divmod(int(left), 3600)
    return f"ends ~{at} (in {h}:{rest // 60:02d}:{rest % 60:02d})"


def measured(
    step_times: list[float], mem_mib: float, device_type: str, plan: dict[str, Any] | None
) -> dict[str, Any]:
    """summary.json's measured step time (the median after the first 20%, at most 10, of the
    logged steps, as ``plan --calibrate`` takes it) and memory, next to what ``layershard plan``
    predicted for these settings (when the config came from ``--write-config``)."""
    times = sorted(step_times[min(10, len(step_times) // 5) :])
    out: dict[str, Any] = {
        "step_time_s_median": times[len(times) // 2] if times else None,
        "mem_mib_max": mem_mib or None,
        # on GPU the CUDA peak; on CPU memory_report()'s total (model states, no activations)
        "mem_kind": "peak" if device_type == "cuda" else "model_states",
    }
    if plan:
        out["plan"] = plan
    return out


def read_metrics(path: Path) -> list[dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_losses(metrics_path: Path, png_path: Path, title: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    records = read_metrics(metrics_path)
    train = [(r["step"], r["loss"]) for r in records if "loss" in r]
    val = [(r["step"], r["val_loss"]) for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train", lw=1, alpha=0.8)
    if val:
        ax.plot(*zip(*val), "o-", label="validation", lw=1.5)
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats/token)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png_path)
    plt.close(fig)


def first_val_loss(run_dir: Path) -> float | None:
    """The first validation loss the run's metrics recorded (a resumed run's start)."""
    vals = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    return vals[0] if vals else None


def memory_mib(model, optimizer, device: torch.device) -> float:
    """This rank's MiB: peak CUDA allocation since the end of init on GPU (a host-side counter);
    on CPU the engine's memory report (parameter shards, gradients, buffers, optimizer state)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return model.memory_report(optimizer)["total"] / 2**20


@waiting("sampling")
def sample(model: Any, tok: Any, cfg: Any, max_len: int, device: torch.device) -> str:
    """Generate from ``cfg.sample_prompt`` on every rank (forward passes are collective; under
    ``--cp`` the model's CP forward: ``next_token_logits``); rank 0's choice of each token is
    broadcast so that all ranks continue identically."""
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.tensor([tok.encode(cfg.sample_prompt) or [tok.eos_id or 0]])
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.sample_tokens):
            context = ids[:, -min(max_len, cfg.seq_len) :].to(device)
            logits = next_token_logits(model, context).float().cpu() / 0.8
            kth = torch.topk(logits, min(40, logits.numel())).values[-1]
            probs = torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
            nxt = torch.multinomial(probs, 1, generator=gen).to(device)
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.broadcast(nxt, src=0)
            ids = torch.cat([ids, nxt.cpu().view(1, 1)], dim=1)
            if tok.eos_id is not None and int(nxt) == tok.eos_id:
                break
    model.train()
    return tok.decode(ids[0].tolist())
