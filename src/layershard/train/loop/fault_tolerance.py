"""``layershard train --ft-replicas N``: the loop of one rank of one replica group
(train/launch/ft.py launches it), ``FTTrainer``.

Each step: ``ft.zero_grad()`` (torchft's quorum), the group's part of the step's global batch at
the data position every group shares (the global batch's windows are split over the N groups'
ranks: group g's rank r reads the part of data rank ``g * ranks + r``), the backward (the
gradients reduce-scattered within the group), the slices averaged across the quorum's groups,
the norm and the clipping on the average, and the optimizer steps only if torchft commits the
step. A step that does not commit still uses up its batch (the data position advances) and is
recorded: a ``not_committed`` record in metrics.jsonl, with the tokens it cost this group, and
the counts and every event (a quorum that lost or gained groups, this group's recovery from a
peer) in summary.json's ``fault_tolerance``.

The step counter is torchft's (steps committed by the job); a group restarted by its launcher
(``--max-restarts``) reads no checkpoint: it heals from a peer (weights, optimizer state with
its learning rate, step, data position) and appends to its metrics.jsonl.
"""

from __future__ import annotations

import os
import socket
import time
from pathlib import Path
from typing import Any

import torch

import layershard as ls
from layershard.train.config import grad_accum_for
from layershard.train.data.batches import BatchLoader, TokenSplit
from layershard.train.loop.faults import StopRequest, attempt
from layershard.train.loop.report import read_metrics
from layershard.train.loop.trainer import Trainer
from layershard.train.parallel import data_rank
from layershard.train.status import RankStatus

# Seconds a group sleeps after each step it took without every group (tests only: the restarted
# group then rejoins before the survivors finish a short run).
_THROTTLE_S = float(os.environ.get("LAYERSHARD_FT_THROTTLE_S", "0") or 0)


class FTTrainer(Trainer):
    def __init__(
        self,
        run_dir: Path,
        rank: int,
        world: int,
        device: torch.device,
        stop: StopRequest | None = None,
        status: RankStatus | None = None,
    ) -> None:
        super().__init__(run_dir, rank, world, device, stop=stop, status=status)
        spec = self.launch["ft"]
        self.replicas, self.group = int(spec["replicas"]), int(spec["group"])
        cfg = self.cfg
        # the global batch: every group's ranks together (evaluation stays within the group:
        # each group evaluates the whole validation split over its own ranks)
        self.ga = grad_accum_for(cfg, world * self.replicas)
        dp_rank, dp_world = data_rank(cfg, rank, world)
        self.loader = BatchLoader(
            TokenSplit.from_dict(self.launch["data"]["train"]),
            cfg.seq_len,
            cfg.micro_batch,
            self.ga,
            self.group * dp_world + dp_rank,
            dp_world * self.replicas,
            cfg.seed,
        )
        self.steps_per_epoch = self.loader.n_windows // self.loader.global_batch
        timeout = float(spec.get("timeout_s", 60.0))
        self.ft = ls.ft.FaultTolerant(
            self.model,
            self.opt,
            replica_id=f"group{self.group}",
            lighthouse=spec["lighthouse"],
            init_sync=False,  # every group builds the same weights from --seed
            timeout=timeout,
            quorum_timeout=timeout,
            connect_timeout=timeout,
            hostname=os.environ.get("LAYERSHARD_FT_HOSTNAME") or socket.gethostname(),
        )
        self.committed = True
        self.lost_steps = 0
        self.lost_tokens = 0
        self._log = None

    def tokens_per_step(self) -> int:
        """This group's tokens in one step (its part of the global batch)."""
        return self.cfg.seq_len * self.cfg.micro_batch * self.ga * self.dp_world

    # --- the step ---------------------------------------------------------------------------

    def _seek(self, position: int) -> None:
        """The loader at the step ``position`` of the shared data order."""
        self.loader.epoch = position // self.steps_per_epoch
        self.loader.cursor = (position % self.steps_per_epoch) * self.loader.global_batch

    def train_step(self, with_memory: bool = False) -> dict[str, Any]:
        self.ft.zero_grad()  # this step's quorum, asynchronously
        position = self.ft.data_position
        self._seek(position)
        events = len(self.ft.state.events)
        stats = super().train_step(with_memory)
        self.step = self.ft.step_count  # a healed group takes its peer's
        stats["committed"] = self.committed
        stats["participants"] = self.ft.state.participants
        log = self._log or (lambda record: None)
        for event in self.ft.state.events[events:]:
            if event.kind != "not_committed":
                log({"step": self.step, "ft_event": event.kind, **_event(event)})
        if not self.committed:
            self.lost_steps += 1
            self.lost_tokens += self.tokens_per_step()
            error = [e for e in self.ft.state.events[events:] if e.kind == "not_committed"]
            log({"step": self.step, "not_committed": True, "data_position": position,
                 "participants": self.ft.state.participants,
                 "tokens_lost": self.tokens_per_step(),
                 "error": error[0].detail if error else ""})  # fmt: skip
        if self.ft.state.participants < self.replicas and _THROTTLE_S:
            time.sleep(_THROTTLE_S)  # tests: a survivor alone waits for its peer's restart
        return stats

    def _before_clip(self) -> None:
        self.ft.all_reduce_gradients()  # the average over the quorum's groups

    def _apply(self, finite: bool) -> bool:
        if finite:  # steps the optimizer only if torchft commits (clipped already)
            self.committed = self.ft.step()
            return True
        # non-finite: every group sees the same averaged norm; agree with torchft, skip
        self.ft.manager.should_commit()
        self.ft.state.data_position += 1
        self.committed = False
        return False

    def _steps(self, log, bar, stop_at: int, val_loss: float | None):
        self._log = log
        return super()._steps(log, bar, stop_at, val_loss)

    # --- the run ----------------------------------------------------------------------------

    def resume(self) -> dict | None:
        if attempt() > 0:
            # restarted by its launcher: no checkpoint read, it heals from a peer at its first
            # step; the metrics so far are kept (the last logged step is the "resumed" one)
            path = self.run_dir / "metrics.jsonl"
            records = read_metrics(path) if path.is_file() else []
            self.step = max([int(r.get("step", 0)) for r in records], default=0)
            return {"step": self.step, "healed": True}
        meta = super().resume()
        if meta is not None:  # --resume: the job's step and data position from the checkpoint
            position = self.loader.epoch * self.steps_per_epoch
            position += self.loader.cursor // self.loader.global_batch
            self.ft.manager.load_state_dict({"step": self.step, "batches_committed": 0})
            self.ft.state.data_position = position
        return meta

    def run(self) -> int:
        try:
            return super().run()
        finally:
            self.ft.shutdown(wait=False)

    def summary_extra(self) -> dict[str, Any]:
        report = self.ft.report()
        return {
            "fault_tolerance": {
                "replicas": self.replicas,
                "group": self.group,
                "committed": report["committed"],
                "not_committed": report["not_committed"],
                "steps_lost": self.lost_steps,
                "tokens_lost": self.lost_tokens,
                "data_position": report["data_position"],
                "events": report["events"],
            }
        }


def _event(event: Any) -> dict[str, Any]:
    d = event.as_dict()
    d.pop("kind", None)
    return {f"ft_{k}": v for k, v in d.items()}
