"""The step's one device-to-host read and the weights' finiteness check of ``Trainer``
(trainer.py), apart to keep that file within the size limit."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from layershard.engine.waits import waiting
from layershard.train.loop.report import memory_mib


class StatsMixin:
    """Needs ``model``, ``opt``, ``device`` and ``world``."""

    model: Any
    opt: torch.optim.Optimizer
    device: torch.device
    world: int

    @waiting("all-reduce of the step's loss and gradient norm")
    def _read_stats(
        self,
        loss_sum: torch.Tensor,
        total: torch.Tensor,
        grad_norm: torch.Tensor,
        with_memory: bool,
        busy_s: float,
    ) -> tuple[float, float, float, tuple[list[float], list[float]] | None]:
        """The step's one device-to-host read: global loss sum and target count, gradient norm
        (the same on every rank), and with ``with_memory`` each rank's MiB and busy seconds."""
        distributed = dist.is_initialized() and self.world > 1
        tail = torch.stack([total[0], grad_norm.detach().double().reshape(())])
        if with_memory:
            mib = memory_mib(self.model, self.opt, self.device)
            extra = torch.tensor([mib, busy_s], dtype=torch.float64, device=self.device)
            mine = torch.cat([loss_sum.reshape(1), extra])
            parts = [torch.empty_like(mine) for _ in range(self.world)] if distributed else [mine]
            if distributed:
                dist.all_gather(parts, mine)
            values = torch.cat([torch.stack(parts).flatten(), tail]).tolist()
            per_rank = values[: 3 * self.world]
            return (
                sum(per_rank[0::3]), values[-2], values[-1], (per_rank[1::3], per_rank[2::3])
            )  # fmt: skip
        if distributed:
            dist.all_reduce(loss_sum)
        loss, n, norm = torch.cat([loss_sum.reshape(1), tail]).tolist()
        return loss, n, norm, None

    def _weights_finite(self) -> bool:
        """Are this model's weights finite on every rank? (One flag, all-reduced.)"""
        floats = [f.shard for f in self.model.flat_params if not f.packed]  # 4-bit: bytes
        ok = torch.tensor([float(all(bool(torch.isfinite(t).all()) for t in floats))])
        ok = ok.to(self.device)
        if dist.is_initialized() and self.world > 1:
            with waiting("all-reduce of the weights' finiteness"):
                dist.all_reduce(ok, op=dist.ReduceOp.MIN)
        return bool(ok.item())
