"""The training loop that runs on every rank (started by torchrun through ``layershard train``).

The launcher has already resolved the config, trained/loaded the tokenizer and tokenized the data;
it left ``config.yaml``, ``tokenizer.json`` and ``launch.json`` in the run folder, which is all a
rank reads. Rank 0 writes the metrics, plot, sample and HF export; checkpoints are collective.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import math
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch import nn

import layershard as ls
from layershard.models import LlamaForCausalLM
from layershard.train.config import ConfigError, TrainConfig, grad_accum_for, read_run_config
from layershard.train.data import BatchLoader, TokenSplit, eval_windows, read_windows
from layershard.train.modeling import build_model, check_seq_len, model_spec
from layershard.train.report import MetricsLog, plot_losses
from layershard.train.tokenizer import TextTokenizer, load_tokenizer


def param_groups(named_params, cfg: TrainConfig) -> list[dict[str, Any]]:
    """Weight decay by parameter NAME (sharded parameters are 1-D, so ndim says nothing):
    names matching ``cfg.no_decay`` (norms, biases, embeddings by default) get none."""
    decay, no_decay = [], []
    for name, p in named_params:
        if not p.requires_grad:
            continue
        skip = any(fnmatch.fnmatchcase(name, pat) for pat in cfg.no_decay)
        (no_decay if skip else decay).append(p)
    groups = [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def lr_at(step: int, cfg: TrainConfig) -> float:
    """Linear warmup to ``lr`` then cosine decay to ``lr * min_lr_ratio`` (step is 0-based)."""
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = min(1.0, (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps))
    cosine = 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.lr * (cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * cosine)


def _all_reduce(values: list[float], device: torch.device) -> list[float]:
    t = torch.tensor(values, dtype=torch.float64, device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(t)
    return t.tolist()


def _memory_per_rank(model: nn.Module, optimizer, device: torch.device) -> list[float]:
    """MiB per rank: peak CUDA allocation on GPU; on CPU the engine's memory report (parameter
    shards, gradients, buffers and optimizer state)."""
    if device.type == "cuda":
        mine = torch.cuda.max_memory_allocated(device)
    else:
        mine = model.memory_report(optimizer)["total"]
    t = torch.tensor([float(mine) / 2**20], device=device)
    if dist.is_initialized() and dist.get_world_size() > 1:
        out = [torch.zeros_like(t) for _ in range(dist.get_world_size())]
        dist.all_gather(out, t)
        return [float(x) for x in out]
    return [float(t)]


class Trainer:
    def __init__(self, run_dir: Path, rank: int, world: int, device: torch.device) -> None:
        self.run_dir, self.rank, self.world, self.device = run_dir, rank, world, device
        self.cfg = read_run_config(run_dir / "config.yaml")
        self.launch = json.loads((run_dir / "launch.json").read_text())
        self.tok: TextTokenizer = load_tokenizer(run_dir / "tokenizer.json")
        cfg = self.cfg
        self.ga = grad_accum_for(cfg, world)
        self.kind, self.spec, max_len = model_spec(cfg, self.tok.vocab_size)
        check_seq_len(cfg, max_len)
        self.max_len = max_len
        on_gpu = device.type == "cuda"
        precision = cfg.precision if cfg.precision != "auto" else ("bf16" if on_gpu else "fp32")
        self.precision = precision
        # Presets of 1B+ parameters start on the meta device: shard() materializes only each
        # rank's slice (the init contract of layershard.models makes that equal to eager init).
        meta = self.kind == "preset" and _preset_params(self.spec) >= 1e9
        model = build_model(self.kind, self.spec, cfg, meta=meta)
        self.n_params = sum(p.numel() for p in model.parameters())
        bf16 = ls.MixedPrecision(param_dtype=torch.bfloat16) if precision == "bf16" else None
        self.model = ls.shard(
            model,
            mixed_precision=bf16,
            activation_checkpointing=cfg.activation_checkpointing,
            device=device if device.type != "cpu" else None,
        )
        if cfg.init_from:  # read after sharding: each rank reads only its slices
            ls.load_hf(self.model, cfg.init_from)
        self.opt = torch.optim.AdamW(
            param_groups(self.model.named_parameters(), cfg),
            lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2),
            eps=1e-8,
        )
        data = self.launch["data"]
        self.loader = BatchLoader(
            TokenSplit.from_dict(data["train"]),
            cfg.seq_len,
            cfg.micro_batch,
            self.ga,
            rank,
            world,
            cfg.seed,
        )
        self.val = TokenSplit.from_dict(data["val"])
        self.val_tokens, self.val_mask = self.val.open() if self.val.n_tokens else (None, None)
        self.val_idx = eval_windows(
            self.val, cfg.seq_len, cfg.eval_sequences, world * cfg.micro_batch
        )
        self.step = 0

    # --- pieces ---------------------------------------------------------------------------

    def evaluate(self) -> float | None:
        if not len(self.val_idx):
            return None
        mb = self.cfg.micro_batch
        mine = self.val_idx.reshape(-1, self.world, mb)[:, self.rank]  # same count on every rank
        loss_sum, n_sum = 0.0, 0
        self.model.eval()
        with torch.no_grad():
            for windows in mine:
                x, y = read_windows(self.val_tokens, self.val_mask, windows, self.cfg.seq_len)
                n = int((y[:, 1:] != -100).sum())
                out = self.model(x.to(self.device), labels=y.to(self.device))
                if n:
                    loss_sum += float(out.loss) * n
                    n_sum += n
        self.model.train()
        loss_sum, n_sum = _all_reduce([loss_sum, n_sum], self.device)
        return loss_sum / n_sum if n_sum else None

    def train_step(self) -> dict[str, float]:
        cfg = self.cfg
        lr = lr_at(self.step, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        micro = self.loader.next_step()
        counts = [int((y[:, 1:] != -100).sum()) for _, y in micro]
        (total,) = _all_reduce([sum(counts)], self.device)
        loss_sum = 0.0
        for i, (x, y) in enumerate(micro):
            # Gradients are summed over micro-batches and averaged over ranks by the engine, so
            # weighting each micro-batch mean by its share of the step's target tokens gives
            # the exact mean over the global batch even when masks make the counts differ.
            sync = i == len(micro) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                out = self.model(x.to(self.device), labels=y.to(self.device))
                if counts[i]:
                    weight = counts[i] * self.world / total
                    (out.loss * weight).backward()
                    loss_sum += float(out.loss.detach()) * counts[i]
                else:  # nothing to learn here, but every rank must run the same backward
                    (out.logits.sum() * 0.0).backward()
        # grad_clip 0: an infinite bound clips nothing but still returns the norm (for the log)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        grad_norm = float(self.model.clip_grad_norm_(max_norm))
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        (loss_sum,) = _all_reduce([loss_sum], self.device)
        return {"loss": loss_sum / max(total, 1), "lr": lr, "grad_norm": grad_norm}

    def checkpoint(self) -> Path:
        ckpt = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        if ckpt.exists():  # already written (e.g. stop-at and final at the same step)
            return ckpt
        extra = {"loader": self.loader.state_dict(), "config": self.cfg.to_dict()}
        ls.save_checkpoint(
            ckpt, self.model, self.opt, step=self.step, extra=extra, run_config=extra["config"]
        )
        return ckpt

    def export(self, folder: Path) -> None:
        """The trained model as an HF folder (config.json, safetensors, tokenizer.json) that
        ``--init-from`` and ``transformers`` load. Collective."""
        ls.export_hf(self.model, folder, dtype=torch.float32)  # streams unit by unit
        if self.rank == 0:
            if self.kind == "hf":
                # transformers' own writer keeps model_type, which AutoConfig needs
                self.spec.save_pretrained(str(folder))
            shutil.copy(self.run_dir / "tokenizer.json", folder / "tokenizer.json")

    def sample(self) -> str:
        """Generate from ``sample_prompt`` on every rank (forward passes are collective); rank
        0's choice of each token is broadcast so that all ranks continue identically."""
        cfg = self.cfg
        gen = torch.Generator().manual_seed(cfg.seed)
        ids = torch.tensor([self.tok.encode(cfg.sample_prompt) or [self.tok.eos_id or 0]])
        self.model.eval()
        with torch.no_grad():
            for _ in range(cfg.sample_tokens):
                context = ids[:, -min(self.max_len, cfg.seq_len) :].to(self.device)
                logits = self.model(context).logits[0, -1].float().cpu() / 0.8
                kth = torch.topk(logits, min(40, logits.numel())).values[-1]
                probs = torch.softmax(logits.masked_fill(logits < kth, -math.inf), dim=-1)
                nxt = torch.multinomial(probs, 1, generator=gen).to(self.device)
                if dist.is_initialized() and self.world > 1:
                    dist.broadcast(nxt, src=0)
                ids = torch.cat([ids, nxt.cpu().view(1, 1)], dim=1)
                if self.tok.eos_id is not None and int(nxt) == self.tok.eos_id:
                    break
        self.model.train()
        return self.tok.decode(ids[0].tolist())

    # --- the run --------------------------------------------------------------------------

    def run(self) -> int:
        cfg, rank = self.cfg, self.rank
        t_start = time.perf_counter()
        resume = self.launch.get("resume")
        if resume:
            meta = ls.load_checkpoint(resume, self.model, optimizer=self.opt)
            self.step = int(meta["step"])
            self.loader.load_state_dict(meta["extra"]["loader"])
        metrics = (
            MetricsLog(self.run_dir / "metrics.jsonl", self.step if resume else None)
            if rank == 0
            else None
        )
        log = metrics.write if metrics else (lambda record: None)
        if rank == 0:
            print(
                f"layershard train: {self.n_params / 1e6:.2f}M parameters, {self.world} ranks, "
                f"{self.precision}, {self.ga} micro-batch(es) of {cfg.micro_batch}x{cfg.seq_len}"
                f" per rank per step, {cfg.steps} steps",
                flush=True,
            )
        val_start = None
        if self.step == 0:
            val_start = self.evaluate()
            if val_start is not None:
                log({"step": 0, "val_loss": val_start})
        stop_at = self.launch.get("stop_at_step") or cfg.steps
        tokens_per_step = cfg.seq_len * cfg.micro_batch * self.ga * self.world
        bar = None
        if rank == 0:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True,
                file=sys.stderr, mininterval=0.5,
            )  # fmt: skip
        train_time, cpu_time, steps_run, val_loss = 0.0, 0.0, 0, val_start
        while self.step < min(cfg.steps, stop_at):
            t0, c0 = time.perf_counter(), time.process_time()
            stats = self.train_step()
            dt = time.perf_counter() - t0
            train_time += dt
            cpu_time += time.process_time() - c0
            steps_run += 1
            if self.step % cfg.log_interval == 0 or self.step == cfg.steps:
                mem = _memory_per_rank(self.model, self.opt, self.device)
                record = {"step": self.step, **stats, "step_time_s": dt,
                          "tokens_per_s": tokens_per_step / dt, "tokens": self.step * tokens_per_step,
                          "mem_mib": mem}  # fmt: skip
                log(record)
                if bar is not None:
                    bar.set_postfix_str(
                        f"loss {stats['loss']:.3f} | {tokens_per_step / dt:,.0f} tok/s | "
                        f"{dt * 1000:.0f} ms/step | mem/rank "
                        + "/".join(f"{m:.0f}" for m in mem)
                        + " MiB"
                        + (f" | val {val_loss:.3f}" if val_loss is not None else ""),
                        refresh=False,
                    )
            if bar is not None:
                bar.update(1)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
                val_loss = self.evaluate()
                if val_loss is not None:
                    log({"step": self.step, "val_loss": val_loss})
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                self.checkpoint()
        if bar is not None:
            bar.close()
        if self.step < cfg.steps:  # stopped early on purpose: leave a checkpoint to resume
            ckpt = self.checkpoint()
            if rank == 0:
                print(f"stopped at step {self.step}; resume with --resume ({ckpt})", flush=True)
            if metrics:
                metrics.close()
            return 0
        val_end = self.evaluate()
        if val_end is not None:
            log({"step": self.step, "val_loss": val_end})
        self.checkpoint()
        self.export(self.run_dir / "final")
        text = self.sample()
        if rank == 0:
            metrics.close()
            plot_losses(
                self.run_dir / "metrics.jsonl",
                self.run_dir / "loss.png",
                title=f"{cfg.model if self.kind == 'preset' else 'HF model'}, {self.world} ranks",
            )
            (self.run_dir / "sample.txt").write_text(text)
            summary = {
                "steps": self.step,
                "world_size": self.world,
                "params": self.n_params,
                "tokens_per_step": tokens_per_step,
                "train_time_s": train_time,
                "tokens_per_s": tokens_per_step * steps_run / train_time if train_time else None,
                "worker_time_s": time.perf_counter() - t_start,
                # rank 0's CPU seconds per step: close to the step time on an idle machine, and
                # unaffected by other processes competing for the cores
                "cpu_s_per_step": cpu_time / steps_run if steps_run else None,
                "val_loss_start": val_start if val_start is not None else _first_val(self.run_dir),
                "val_loss_end": val_end,
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            print(f"--- sample (prompt {cfg.sample_prompt!r}) ---\n{text}\n---", flush=True)
        return 0


def _preset_params(spec: Any) -> int:
    with torch.device("meta"):
        return sum(p.numel() for p in LlamaForCausalLM(spec).parameters())


def _first_val(run_dir: Path) -> float | None:
    from layershard.train.report import read_metrics

    vals = [r["val_loss"] for r in read_metrics(run_dir / "metrics.jsonl") if "val_loss" in r]
    return vals[0] if vals else None


def main(run_dir: str) -> int:
    from layershard.distributed import default_device, init_distributed

    rank, world = init_distributed()
    device = default_device()
    np.seterr(all="ignore")
    try:
        return Trainer(Path(run_dir), rank, world, device).run()
    except ConfigError as e:
        if rank == 0:
            print(f"layershard train: error: {e}", file=sys.stderr, flush=True)
        return 2
    finally:
        if dist.is_initialized():
            # Leave together: a rank that tears its group down while a peer still works (rank 0
            # writing the plot) can abort inside gloo and take the whole job down with it.
            with contextlib.suppress(Exception):
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    code = main(sys.argv[1])
    # Everything is written and the process group is gone: skip the interpreter's teardown, in
    # which gloo's static destructors have aborted a finished rank ("terminate called without an
    # active exception") and so failed a run that had succeeded.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(int(code or 0))
