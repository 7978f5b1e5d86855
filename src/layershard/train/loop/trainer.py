"""The training loop of one rank: ``Trainer`` (a rank's lifecycle around it: rank.py).

The launcher has already resolved the config, trained/loaded the tokenizer and tokenized the data;
it left ``config.yaml``, ``tokenizer.json`` and ``launch.json`` in the run folder, which is all a
rank reads. Rank 0 writes the metrics, plot, sample and HF export; checkpoints are collective.
"""

from __future__ import annotations

import contextlib
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
import yaml

import layershard as ls
from layershard.checkpoint import CheckpointCorruptError, CheckpointError
from layershard.checkpoint import publish as pub
from layershard.engine.agreement import rank0_decides
from layershard.engine.waits import waiting
from layershard.train import status as st
from layershard.train.config import ConfigError, grad_accum_for, read_run_config
from layershard.train.data.batches import (
    BatchLoader,
    TokenSplit,
    count_targets,
    eval_windows,
    read_windows,
)
from layershard.train.data.tokenizer import TextTokenizer, load_tokenizer
from layershard.train.loop.context import model_inputs
from layershard.train.loop.faults import StopRequest, attempt
from layershard.train.loop.optimizer import lr_at, param_groups
from layershard.train.loop.qlora import build_qlora, save_adapter
from layershard.train.loop.report import (
    MetricsLog,
    finish_eta,
    first_val_loss,
    measured,
    plot_losses,
    sample,
    straggler,
)
from layershard.train.loop.sinks import open_sinks
from layershard.train.loop.stats import StatsMixin
from layershard.train.modeling import (
    build_model,
    check_seq_len,
    flops_per_token,
    model_spec,
    peak_flops,
    shard_options,
    starts_on_meta,
)
from layershard.train.parallel import data_rank, shard_model


class StopRun(Exception):
    """The ranks agreed to stop before the last step: ``reason`` is "signal" or "non-finite"."""

    def __init__(self, reason: str, message: str, **info: Any) -> None:
        super().__init__(message)
        self.reason, self.info = reason, info


class Trainer(StatsMixin):
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        device: torch.device,
        stop: StopRequest | None = None,
        status: st.RankStatus | None = None,
    ) -> None:
        self.run_dir, self.rank, self.world, self.device = run_dir, rank, world, device
        self.stop, self.status = stop or StopRequest(None), status
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
        meta = starts_on_meta(self.kind, self.spec)
        if cfg.qlora:  # the 4-bit base read here, quantized while loading (train/loop/qlora.py)
            model = build_qlora(cfg, precision, device)
        else:
            model = build_model(self.kind, self.spec, cfg, meta=meta)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.model = shard_model(model, cfg, shard_options(cfg, precision, device))
        # fp16: gradients are scaled so that they do not underflow; a step whose gradients
        # overflowed is skipped by the scaler on every rank (its inf check is all-reduced)
        self.scaler = ls.GradScaler(init_scale=cfg.loss_scale) if precision == "fp16" else None
        self.skipped_steps = 0  # steps not applied (non-finite or overflowed), for the metrics
        self.flops_per_token = flops_per_token(self.kind, self.spec, self.n_params, cfg.seq_len)
        self.peak_flops = peak_flops(device)
        if cfg.init_from and not cfg.qlora:  # read after sharding: each rank its slices
            ls.load_hf(self.model, cfg.init_from)
        self.opt: torch.optim.Optimizer
        if cfg.optimizer == "muon":  # AdamW's lr schedule and weight decay carry over
            self.opt = ls.optim.Muon(
                self.model,
                lr=cfg.lr,
                weight_decay=cfg.weight_decay,
                adjust_lr_fn="match_rms_adamw",
                adamw=dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=1e-8),
                adamw_groups=lambda named: param_groups(named, cfg),
            )
        else:
            self.opt = torch.optim.AdamW(
                param_groups(self.model.named_parameters(), cfg),
                lr=cfg.lr,
                betas=(cfg.beta1, cfg.beta2),
                eps=1e-8,
            )
        data = self.launch["data"]
        # the ranks of a TP or CP group read the same batches (data_rank: world / tp or cp ways)
        self.dp_rank, self.dp_world = data_rank(cfg, rank, world)
        self.loader = BatchLoader(
            TokenSplit.from_dict(data["train"]),
            cfg.seq_len,
            cfg.micro_batch,
            self.ga,
            self.dp_rank,
            self.dp_world,
            cfg.seed,
        )
        self.val = TokenSplit.from_dict(data["val"])
        self.val_tokens: np.ndarray | None
        self.val_mask: np.ndarray | None
        self.val_tokens, self.val_mask = self.val.open() if self.val.n_tokens else (None, None)
        self.val_idx = eval_windows(
            self.val, cfg.seq_len, cfg.eval_sequences, self.dp_world * cfg.micro_batch
        )
        self.step = 0
        self.step_times: list[float] = []  # logged steps of this launch, for the summary
        self.peak_mem_mib = 0.0  # the largest per-rank memory logged
        # ranks per node (torchrun's), for naming the slowest node of a multi-node run
        self.local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world))
        self.bad_steps = 0  # non-finite steps in a row
        self.pending: ls.checkpoint.AsyncCheckpoint | None = None  # async save in flight
        if device.type == "cuda":  # the logged peak is training's, not init's (load_hf, ...)
            torch.cuda.reset_peak_memory_stats(device)

    # --- pieces ---------------------------------------------------------------------------

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
        if self.device.type != "cuda":
            return t
        # page-locked host memory: the copy is asynchronous and overlaps the previous kernels
        return t.pin_memory().to(self.device, non_blocking=True)

    @waiting("evaluation")
    def evaluate(self) -> float | None:
        if not len(self.val_idx):
            return None
        assert self.val_tokens is not None  # eval_windows() gives none for an empty split
        mb = self.cfg.micro_batch
        mine = self.val_idx.reshape(-1, self.dp_world, mb)[:, self.dp_rank]  # same count each
        sums = torch.zeros(2, dtype=torch.float64, device=self.device)  # loss * tokens, tokens
        self.model.eval()
        with torch.no_grad():
            for windows in mine:
                x, y = read_windows(self.val_tokens, self.val_mask, windows, self.cfg.seq_len)
                n = count_targets(y)  # (under --cp the whole sequences': loop/context.py)
                out = self.model(**model_inputs(self.model, x, y, self._to_device))
                if n:
                    sums[0] += out.loss.detach().double() * n
                    sums[1] += n
        self.model.train()
        if dist.is_initialized() and self.world > 1:
            dist.all_reduce(sums)
        loss_sum, n_sum = sums.tolist()
        return loss_sum / n_sum if n_sum else None

    def train_step(self, with_memory: bool = False) -> dict[str, Any]:
        """One optimizer step. The loss stays on the device: the step reads the host once, after
        its last collective (the step's loss and gradient norm, and on logged steps each rank's
        memory), which is what decides whether the step is applied. A non-finite loss or norm
        skips the optimizer step (the gradients are dropped), as a loss scaler does."""
        cfg = self.cfg
        t0, waited0 = time.perf_counter(), self.model.comm_wait_s()
        lr = lr_at(self.step, cfg)
        for g in self.opt.param_groups:
            g["lr"] = lr
        micro = self.loader.next_step()
        counts = [count_targets(y) for _, y in micro]
        total = torch.tensor([float(sum(counts))], dtype=torch.float64, device=self.device)
        if dist.is_initialized() and self.world > 1:
            with waiting("all-reduce of the step's target count"):
                dist.all_reduce(total)  # the global target count, still on the device
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        for i, (x, y) in enumerate(micro):
            # Gradients are summed over micro-batches and averaged over ranks by the engine, so
            # weighting each micro-batch mean by its share of the step's target tokens gives
            # the exact mean over the global batch even when masks make the counts differ
            # (and under --cp, whose losses are normalized by the whole sequences: context.py).
            sync = i == len(micro) - 1
            with contextlib.nullcontext() if sync else self.model.no_sync():
                out = self.model(**model_inputs(self.model, x, y, self._to_device))
                if counts[i]:
                    weight = (counts[i] * self.world / total[0]).to(out.loss.dtype)
                    self._backward(out.loss * weight)
                    loss_sum += out.loss.detach().double() * counts[i]
                else:  # nothing to learn here, but every rank must run the same backward
                    # (the chunked loss has no logits: its loss, nan without targets, has zero
                    # gradients: loss.py)
                    self._backward((out.loss if out.logits is None else out.logits.sum()) * 0.0)
        if self.scaler is not None:  # the norm and the clipping see the true gradients
            self.scaler.unscale_(self.opt)
        # grad_clip 0: an infinite bound clips nothing but still returns the norm (for the log)
        max_norm = cfg.grad_clip if cfg.grad_clip > 0 else math.inf
        self._before_clip()
        grad_norm = self.model.clip_grad_norm_(max_norm)
        # this rank's own work in the step: its time before the step's last collective, less
        # what it spent waiting for the others in the model's collectives (a straggler's is
        # the longest: report.straggler)
        busy = time.perf_counter() - t0 - (self.model.comm_wait_s() - waited0)
        loss, n, norm, per_rank = self._read_stats(loss_sum, total, grad_norm, with_memory, busy)
        stats: dict[str, Any] = {"loss": loss / max(n, 1), "lr": lr, "grad_norm": norm}
        if per_rank is not None:
            stats["mem_mib"], stats["busy_s"] = per_rank
        if self.scaler is not None and math.isfinite(stats["loss"]):
            # an overflow (inf/NaN gradients) is the scaler's to skip: it lowers the scale
            scale = self.scaler.get_scale()
            self.scaler.step(self.opt)
            self.scaler.update()
            self.bad_steps = 0
            stats["loss_scale"] = scale
            if self.scaler.get_scale() < scale:
                stats["skipped"] = stats["overflow"] = True
        elif self._apply(math.isfinite(stats["loss"]) and math.isfinite(norm)):
            self.bad_steps = 0
        else:  # every rank read the same numbers: every rank skips this step
            self.bad_steps += 1
            stats["skipped"] = True
            if self.scaler is not None:
                self.scaler.update()  # ends the step's unscale_ (and lowers the scale)
        if stats.get("skipped"):
            self.skipped_steps += 1
        stats["skipped_steps"] = self.skipped_steps
        self.opt.zero_grad(set_to_none=True)
        self.step += 1
        return stats

    def _before_clip(self) -> None:
        """After backward, before the norm and the clipping (ls.ft averages across groups)."""

    def _apply(self, finite: bool) -> bool:
        """Step the optimizer if the step's numbers are finite; returns whether they are."""
        if finite:
            self.opt.step()
        return finite

    def _backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def summary_extra(self) -> dict[str, Any]:
        return {}  # more of summary.json (loop/fault_tolerance.py)

    def _refuse_non_finite(self, what: str) -> None:
        if not self._weights_finite():
            raise StopRun(
                "non-finite",
                f"step {self.step}: the weights hold NaN or inf; {what} was not written. "
                f"{self._last_good()}",
                step=self.step,
            )

    def _last_good(self) -> str:
        try:
            good = pub.resolve(self.run_dir / "checkpoints")
        except CheckpointError:
            return "There is no checkpoint of this run."
        return f"Last good checkpoint: {good}."

    def wait_for_checkpoint(self) -> None:
        """Wait for the asynchronous save in flight; its error, if any, fails the run here."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.wait()

    def checkpoint(self, async_save: bool = False, log=None) -> Path | None:
        ckpt = self.run_dir / "checkpoints" / f"step_{self.step:06d}"
        self.wait_for_checkpoint()
        # Already written (stop-at and final at the same step)? Decided once: on a network file
        # system the ranks of other nodes may not see the folder yet, and would save alone.
        if rank0_decides(ckpt.exists):
            return ckpt
        self._refuse_non_finite(f"the checkpoint {ckpt.name}")
        extra: dict[str, Any] = {"loader": self.loader.state_dict(), "config": self.cfg.to_dict()}
        if self.scaler is not None:  # the loss scale and its growth tracker, as plain numbers
            extra["scaler"] = {k: v for k, v in self.scaler.state_dict().items()}
        extra["skipped_steps"] = self.skipped_steps
        t0 = time.perf_counter()
        result = ls.save_checkpoint(
            ckpt,
            self.model,
            self.opt,
            step=self.step,
            extra=extra,
            run_config=extra["config"],
            async_save=async_save,
        )
        if async_save:
            self.pending = result
        if log is not None:  # how long training stood still for this save
            log({"step": self.step, "checkpoint": ckpt.name, "async": async_save,
                 "checkpoint_stall_s": time.perf_counter() - t0})  # fmt: skip
        return ckpt

    def export(self, folder: Path) -> None:
        """The trained model as an HF folder (config.json, safetensors, tokenizer.json) that
        ``--init-from`` and ``transformers`` load. Collective."""
        self._refuse_non_finite(f"the Hugging Face export {folder.name}/")
        if self.cfg.qlora:  # the adapters (PEFT format) for the --init-from base
            save_adapter(self.model, folder)
        else:
            ls.export_hf(self.model, folder, dtype=torch.float32)  # streams unit by unit
        if self.rank == 0:
            if self.kind == "hf" and not self.cfg.qlora:
                # transformers' own writer keeps model_type, which AutoConfig needs
                self.spec.save_pretrained(str(folder))
            shutil.copy(self.run_dir / "tokenizer.json", folder / "tokenizer.json")

    # --- the run --------------------------------------------------------------------------

    def resume_candidates(self) -> list[str]:
        """Checkpoints to resume from, newest first: the launcher's choice, or after a torchrun
        restart the newest of this run (the attempt that failed may have saved some); with
        ``--resume-fallback`` the older ones follow."""
        chosen = self.launch.get("resume")
        folder = self.run_dir / "checkpoints"
        if attempt() > 0:  # a restart, or a new round of an elastic job (faults.attempt)
            from layershard.train.launch.preflight import latest_checkpoint

            latest = latest_checkpoint(self.run_dir)
            chosen = str(latest) if latest is not None else chosen
        if not chosen:
            return []
        out = [chosen]
        if self.launch.get("resume_fallback") and folder.is_dir():
            # step_NNNNNN names sort like their steps: the older ones, newest first
            older = [d for _, _, d in reversed(pub.sibling_checkpoints(folder))]
            out += [str(d) for d in older if d.name < Path(chosen).name]
        return out

    def resume(self) -> dict | None:
        candidates = self.resume_candidates()
        skipped = []
        for path in candidates:
            try:
                meta = ls.load_checkpoint(path, self.model, optimizer=self.opt)
            except CheckpointCorruptError as e:  # raised on every rank alike (agreed)
                if not self.launch.get("resume_fallback"):
                    raise ConfigError(
                        f"--resume: {e}; resume from an older checkpoint with --resume-fallback "
                        "(or name one: --resume PATH)"
                    ) from None
                skipped.append(f"{Path(path).name} ({e})")
                continue
            if skipped and self.rank == 0:
                print(
                    f"layershard train: resuming from {Path(path).name}; skipped the corrupt "
                    + ", ".join(skipped),
                    file=sys.stderr,
                    flush=True,
                )
            self.step = int(meta["step"])
            self.loader.load_state_dict(meta["extra"]["loader"])
            self.skipped_steps = int(meta["extra"].get("skipped_steps", 0))
            if self.scaler is not None and meta["extra"].get("scaler"):
                # (a checkpoint of an fp32/bf16 run resumed in fp16 starts a fresh scale)
                self.scaler.load_state_dict(meta["extra"]["scaler"])
            return meta
        if candidates:
            raise ConfigError(
                "--resume-fallback: no intact checkpoint to resume from ("
                + "; ".join(skipped)
                + ")"
            )
        return None

    def run(self) -> int:
        rank = self.rank
        t_start = time.perf_counter()
        resumed = self.resume() is not None
        metrics = None
        if rank == 0:
            resume_step = self.step if resumed else None
            recorded = yaml.safe_load((self.run_dir / "config.yaml").read_text())
            sinks = open_sinks(self.run_dir, self.cfg.report_to, recorded, resume_step)
            metrics = MetricsLog(self.run_dir / "metrics.jsonl", resume_step, sinks)
        log = metrics.write if metrics else (lambda record: None)
        try:
            return self._run(log, metrics, resumed, t_start)
        finally:
            if metrics is not None:
                metrics.close()

    def _steps(self, log, bar, stop_at: int, val_loss: float | None) -> tuple[float, float, int]:
        """The training steps, until ``stop_at``, a stop request or too many non-finite steps."""
        cfg, rank = self.cfg, self.rank
        tokens_per_step = cfg.seq_len * cfg.micro_batch * self.ga * self.dp_world
        train_time, cpu_time, steps_run = 0.0, 0.0, 0
        peak_mem, t_loop = 0.0, time.perf_counter()
        while self.step < min(cfg.steps, stop_at):
            if self.status is not None:
                self.status.step(self.step + 1)
            logged = (self.step + 1) % cfg.log_interval == 0 or self.step + 1 == cfg.steps
            t0, c0 = time.perf_counter(), time.process_time()
            stats = self.train_step(with_memory=logged)
            dt = time.perf_counter() - t0
            train_time += dt
            cpu_time += time.process_time() - c0
            steps_run += 1
            if stats.get("skipped") and not stats.get("overflow"):
                log({"step": self.step, **stats, "step_time_s": dt})
                if rank == 0:
                    print(
                        f"\nlayershard train: step {self.step}: non-finite loss "
                        f"({stats['loss']}) or gradient norm ({stats['grad_norm']}): step "
                        f"skipped ({self.bad_steps} in a row, --max-bad-steps "
                        f"{cfg.max_bad_steps})",
                        file=sys.stderr,
                        flush=True,
                    )
                if self.bad_steps >= cfg.max_bad_steps:
                    raise StopRun(
                        "non-finite",
                        f"step {self.step}: {self.bad_steps} non-finite steps in a row (loss "
                        f"{stats['loss']}, gradient norm {stats['grad_norm']}); stopped without "
                        f"saving. {self._last_good()} Lower --lr or raise --warmup-steps, then "
                        "resume from it.",
                        step=self.step,
                    )
            elif logged:
                mem = stats.pop("mem_mib")
                record = {"step": self.step, **stats, "step_time_s": dt,
                          "tokens_per_s": tokens_per_step / dt, "tokens": self.step * tokens_per_step,
                          "mem_mib": mem}  # fmt: skip
                if self.peak_flops:  # model FLOPs utilization, where the device's peak is known
                    record["mfu"] = (
                        self.flops_per_token * tokens_per_step / dt / (self.peak_flops * self.world)
                    )
                slow = straggler(stats["busy_s"], self.local_world)
                if slow is not None:
                    record["slowest_node"], record["slowest_node_ratio"] = slow
                self.step_times.append(dt)
                peak_mem = max(peak_mem, *mem)
                log(record)
                self.peak_mem_mib = max(self.peak_mem_mib, peak_mem)
                if bar is not None:
                    eta = finish_eta(time.perf_counter() - t_loop, steps_run, cfg.steps - self.step)
                    bar.set_postfix_str(
                        f"loss {stats['loss']:.3f} | {tokens_per_step / dt:,.0f} tok/s | "
                        f"{dt * 1000:.0f} ms/step | mem/rank "
                        + "/".join(f"{m:.0f}" for m in mem)
                        + " MiB"
                        + (f" | val {val_loss:.3f}" if val_loss is not None else "")
                        + (f" | node {slow[0]} slowest (+{slow[1] - 1:.0%})" if slow else "")
                        + (f" | {eta}" if eta else ""),
                        refresh=False,
                    )
            if bar is not None:
                bar.update(1)
            if cfg.eval_interval and self.step % cfg.eval_interval == 0 and self.step < cfg.steps:
                val_loss = self.evaluate()
                if val_loss is not None:
                    log({"step": self.step, "val_loss": val_loss})
            if cfg.checkpoint_interval and self.step % cfg.checkpoint_interval == 0:
                self.checkpoint(async_save=cfg.async_checkpoint, log=log)
            if self.stop.should_stop(self.step) and self.step < cfg.steps:
                ckpt = self.checkpoint(log=log)
                raise StopRun(
                    "signal",
                    f"stopped by {self.stop.signal} at step {self.step}; checkpoint {ckpt}",
                    step=self.step,
                    signal=self.stop.signal,
                    checkpoint=str(ckpt),
                )
        return train_time, cpu_time, steps_run

    def _run(self, log, metrics, resumed: bool, t_start: float) -> int:
        cfg, rank = self.cfg, self.rank
        if rank == 0:
            print(
                f"layershard train: {self.n_params / 1e6:.2f}M parameters, {self.world} ranks, "
                f"{self.precision}"
                + (f", gathers in {cfg.gather_dtype}" if cfg.gather_dtype != "exact" else "")
                + (f", reduces in {cfg.reduce_dtype}" if cfg.reduce_dtype != "fp32" else "")
                + f", {self.ga} micro-batch(es) of {cfg.micro_batch}x{cfg.seq_len}"
                + (f" (each sequence over {cfg.cp} ranks, {cfg.cp_mode})" if cfg.cp > 1 else "")
                + f" per rank per step, {cfg.steps} steps"
                + (f", resumed at step {self.step}" if resumed else ""),
                flush=True,
            )
        val_start = None
        if self.step == 0:
            val_start = self.evaluate()
            if val_start is not None:
                log({"step": 0, "val_loss": val_start})
        stop_at = self.launch.get("stop_at_step") or cfg.steps
        tokens_per_step = cfg.seq_len * cfg.micro_batch * self.ga * self.dp_world
        bar = None
        if rank == 0:
            from tqdm import tqdm

            bar = tqdm(
                total=cfg.steps, initial=self.step, desc="train", dynamic_ncols=True,
                file=sys.stderr, mininterval=0.5,
            )  # fmt: skip
        try:
            train_time, cpu_time, steps_run = self._steps(log, bar, stop_at, val_start)
        finally:
            if bar is not None:
                bar.close()
        if self.step < cfg.steps:  # stopped early on purpose: leave a checkpoint to resume
            ckpt = self.checkpoint(log=log)
            if rank == 0:
                print(f"stopped at step {self.step}; resume with --resume ({ckpt})", flush=True)
            return 0
        val_end = self.evaluate()
        if val_end is not None:
            log({"step": self.step, "val_loss": val_end})
        self.checkpoint(log=log)
        self.export(self.run_dir / "final")
        text = sample(self.model, self.tok, cfg, self.max_len, self.device)
        if rank == 0:
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
                "val_loss_start": val_start
                if val_start is not None
                else first_val_loss(self.run_dir),
                "val_loss_end": val_end,
                "skipped_steps": self.skipped_steps,
                **self.summary_extra(),
                **measured(self.step_times, self.peak_mem_mib, self.device.type, self.cfg.plan),
            }
            (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            metrics.close(summary)
            print(f"--- sample (prompt {cfg.sample_prompt!r}) ---\n{text}\n---", flush=True)
        return 0
