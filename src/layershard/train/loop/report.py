"""What a run leaves behind: metrics as JSONL and TensorBoard event files, and a loss-curve PNG
(train and validation)."""

from __future__ import annotations

import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from layershard.engine.waits import waiting

# metrics.jsonl key -> TensorBoard tag (mem_mib, a list per rank, is written per rank and as max)
TB_TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "mfu": "train/mfu",
    "skipped_steps": "train/skipped_steps",
    "loss_scale": "train/loss_scale",
    "val_loss": "val/loss",
}


class MetricsLog:
    """Append-only JSONL, one record per line, and the same numbers as TensorBoard scalars in
    ``tensorboard`` (when the tensorboard package is installed). On resume, records after the
    resumed step are dropped first: they belong to the part of the run that the checkpoint does
    not contain (TensorBoard purges them the same way)."""

    def __init__(
        self, path: Path, resume_step: int | None = None, tensorboard: Path | None = None
    ) -> None:
        self.path = path
        if resume_step is not None and path.is_file():
            keep = [r for r in read_metrics(path) if r.get("step", 0) <= resume_step]
            path.write_text("".join(json.dumps(r) + "\n" for r in keep))
        elif resume_step is None and path.exists():
            path.unlink()
        self.fh = path.open("a")
        self.tb = _summary_writer(tensorboard, resume_step) if tensorboard is not None else None

    def write(self, record: dict[str, Any]) -> None:
        self.fh.write(json.dumps(record) + "\n")
        self.fh.flush()
        if self.tb is None or "step" not in record:
            return
        step = int(record["step"])
        for key, tag in TB_TAGS.items():
            if isinstance(record.get(key), int | float) and not isinstance(record[key], bool):
                self.tb.add_scalar(tag, record[key], step)
        mem = record.get("mem_mib")
        if isinstance(mem, list) and mem:
            for r, m in enumerate(mem):
                self.tb.add_scalar(f"memory/rank{r}_mib", m, step)
            self.tb.add_scalar("memory/max_mib", max(mem), step)

    def close(self) -> None:
        if not self.fh.closed:
            self.fh.close()
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _summary_writer(folder: Path, resume_step: int | None) -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "layershard train: note: tensorboard is not installed, so metrics go to "
            "metrics.jsonl only (pip install 'layershard[tensorboard]')",
            file=sys.stderr,
            flush=True,
        )
        return None
    if resume_step is None and folder.exists():
        shutil.rmtree(folder)  # a fresh run: no events of an earlier one
    # purge_step: events logged after the checkpoint by the interrupted part are dropped
    purge = resume_step + 1 if resume_step is not None else None
    return SummaryWriter(log_dir=str(folder), purge_step=purge)


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
    """Generate from ``cfg.sample_prompt`` on every rank (forward passes are collective); rank
    0's choice of each token is broadcast so that all ranks continue identically."""
    gen = torch.Generator().manual_seed(cfg.seed)
    ids = torch.tensor([tok.encode(cfg.sample_prompt) or [tok.eos_id or 0]])
    model.eval()
    with torch.no_grad():
        for _ in range(cfg.sample_tokens):
            context = ids[:, -min(max_len, cfg.seq_len) :].to(device)
            logits = model(context).logits[0, -1].float().cpu() / 0.8
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
