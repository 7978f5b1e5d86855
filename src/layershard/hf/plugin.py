"""``ShardingPlugin``: every ``ls.shard`` option, carried by ``ls.hf.Accelerator`` and
``ls.hf.Trainer``, and how it meets what accelerate and ``TrainingArguments`` already say.

A setting that both sides express (compute dtype, activation checkpointing) must agree: an
unset side takes the other's value, and two different values are a one-line error before any
model is touched.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from layershard.engine import options
from layershard.engine.precision import MixedPrecision
from layershard.engine.strategy import CPUOffload

_AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class ShardingPlugin:
    """The options of ``ls.shard(model, ...)`` (see its docstring and the docs' Trainer, TRL and accelerate guide).

    ``tp=N`` (transformers' ``base_model_tp_plan`` over N ranks that share each batch: the data
    loaders are split over ``world / N``) and ``ep=N`` (a MoE's experts split over N ranks) shard
    through ``ls.parallelize``; both together split a MoE's attention over TP and its experts
    over EP; with ``strategy="hybrid"`` each ``shard_size`` ranks (default: a node's) hold one
    replica (HSDP x TP / EP). A tensor-parallel model's ``save_model`` writes whole tensors; its
    ``save_state`` (Trainer's checkpoints) is ``ls.save_checkpoint``'s, which resumes at any
    layout. ``cp=N`` (context parallelism, ``cp_mode`` "ring" or "all_to_all": a transformers
    model's sequences split over N consecutive ranks that read the same batches, the data
    loaders split over ``world / N``) is ``ls.hf.Trainer``'s: it passes each batch through
    ``context_batch`` (docs/context-parallel.md); ``ls.hf.Accelerator`` alone shards the model
    and splits the data loaders, the loop's batches are yours to split.

    ``mixed_precision=None`` follows accelerate / ``TrainingArguments``: ``bf16=True`` computes in
    bf16 (``ls.MixedPrecision(torch.bfloat16)``, fp32 reduction), ``fp16=True`` in fp16 with an
    all-reducing loss scaler; neither is fp32. A plugin that computes in fp16 needs
    ``fp16=True`` too (the loss scaler is accelerate's): without it, it is refused. ``activation_checkpointing=K`` recomputes the first
    K blocks; ``TrainingArguments(gradient_checkpointing=True)`` is the Hugging Face way to ask for
    all of them (the model's own checkpointing), and the two cannot be combined.
    """

    layers: Iterable[nn.Module | str | Sequence[nn.Module | str]] | None = None
    blocks_per_unit: int = 1
    mixed_precision: MixedPrecision | None = None
    strategy: str = "full"
    activation_checkpointing: int = 0
    process_group: dist.ProcessGroup | None = None
    device: torch.device | str | None = None
    param_init_fn: Callable[[nn.Module], None] | None = None
    shard_size: int | None = None
    reshard_after_forward: bool | int = True
    mesh: Any = None
    offload: CPUOffload | None = None
    compile: bool | dict = False
    expert_mesh: Any = None
    # expert parallelism: each MoE layer's experts split over ep ranks (ls.parallelize)
    ep: int = 1
    # tensor parallelism: the model's base_model_tp_plan over tp ranks that share a batch
    # (ls.parallelize); the data is split over the world / tp data-parallel ranks
    tp: int = 1
    # context parallelism (ls.parallelize(cp=, cp_mode=)): each sequence over cp ranks that
    # share a batch; ls.hf.Trainer splits each batch (context_batch in compute_loss)
    cp: int = 1
    cp_mode: str = "ring"

    def __post_init__(self) -> None:
        options.check("ShardingPlugin()", **{f.name: getattr(self, f.name) for f in fields(self)})
        if self.cp > 1 and self.ep > 1:
            # (a transformers mixture of experts is refused under cp: hf_context.check)
            raise ValueError(
                f"layershard: ShardingPlugin(cp={self.cp}) with ep above 1 is not supported "
                "yet; use cp with tp and data parallelism (strategy, shard_size)"
            )

    def shard_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``ls.shard(model, **kwargs)``."""
        own = ("ep", "tp", "cp", "cp_mode")  # ls.parallelize's
        return {f.name: getattr(self, f.name) for f in fields(self) if f.name not in own}

    def shard(self, model: nn.Module):
        """``ls.shard(model, ...)`` with these options, or ``ls.parallelize(model, tp=...,
        ep=...)``: transformers' TP plan applied or the experts split first."""
        from layershard.parallelize import parallelize
        from layershard.sharded import shard

        if self.ep > 1 or self.tp > 1 or self.cp > 1:
            return parallelize(
                model, tp=self.tp, ep=self.ep, cp=self.cp, cp_mode=self.cp_mode,
                **self.shard_kwargs(),
            )  # fmt: skip
        return shard(model, **self.shard_kwargs())

    def data_mesh(self) -> Any:
        """With ``tp`` > 1, a ``(dp_replicate, dp_shard, tp)`` mesh for accelerate's data loaders
        (``prepare_data_loader(torch_device_mesh=)``: the ranks of a TP group get the same
        batches, split over ``dp_replicate x dp_shard``); with ``cp`` > 1 a ``(dp_shard, cp)``
        one (a CP group's ``cp`` consecutive ranks get the same batches, split over ``world /
        cp``, rank ``r`` taking ``r // cp``: ``ContextParallel.data_rank``), with ``tp`` too a
        ``(dp_shard, cp, tp)`` one (a block of ``cp x tp`` ranks, ``r // (cp x tp)``); None
        otherwise.
        Collective."""
        if self.tp == 1 and self.cp == 1:
            return None
        from layershard.distributed import default_device
        from layershard.groups import device_mesh
        from layershard.meshes import DENSE_DIMS

        world = dist.get_world_size()
        kind = default_device(dist.group.WORLD).type
        if self.cp > 1:
            span = self.cp * self.tp  # the ranks that read one batch (meshes.context_group)
            if world % span:
                what = f"cp={self.cp}" + (f" x tp={self.tp}" if self.tp > 1 else "")
                raise ValueError(
                    f"layershard: ShardingPlugin({what}) must divide the world size {world} "
                    "(each CP group's ranks share a batch); change cp or the number of processes"
                )
            # accelerate reads only the sizes: process_index // (cp x tp) of dp_shard data ranks
            if self.tp > 1:
                shape, names = (world // span, self.cp, self.tp), ("dp_shard", "cp", "tp")
                return device_mesh(kind, shape, names)
            return device_mesh(kind, (world // self.cp, self.cp), ("dp_shard", "cp"))
        return device_mesh(kind, self.mesh_shape(world), DENSE_DIMS)

    def mesh_shape(self, world: int) -> tuple[int, int, int]:
        """``(dp_replicate, dp_shard, tp)`` at ``world`` ranks: with ``strategy="hybrid"`` a
        replica per ``shard_size`` ranks (default: a node's), as ``ls.parallelize`` makes it."""
        from layershard.meshes import hybrid_replicas, mesh_sizes

        if world % self.tp:
            raise ValueError(
                f"layershard: ShardingPlugin(tp={self.tp}) must divide the world size {world} "
                "(each TP group's ranks share a batch); change tp or the number of processes"
            )
        replicas = hybrid_replicas(world, self.shard_size) if self.strategy == "hybrid" else 1
        n = mesh_sizes(world, tp=self.tp, dp_replicate=replicas)
        return replicas, n["dp_shard"], self.tp

    def with_amp(self, mixed_precision: str | None) -> ShardingPlugin:
        """This plugin with accelerate's ``mixed_precision`` ("no", "bf16", "fp16") folded in;
        raises ``ValueError`` when the two name different compute dtypes."""
        amp = _AMP_DTYPES.get(str(mixed_precision or "no"))
        if amp is None:
            if str(mixed_precision or "no") not in ("no", "None"):
                raise ValueError(
                    f"layershard: mixed_precision={mixed_precision!r} is not supported; use "
                    "'bf16', 'fp16' or 'no' (ShardingPlugin(mixed_precision=ls.MixedPrecision(...)) "
                    "for other combinations)"
                )
            if self.mixed_precision is not None and self.mixed_precision.param_dtype == (
                torch.float16
            ):
                # fp16 without a loss scaler underflows; the scaler is accelerate's (fp16=True)
                raise ValueError(
                    "layershard: ShardingPlugin(mixed_precision=MixedPrecision(param_dtype="
                    "torch.float16)) computes in fp16, which needs a loss scaler: also pass "
                    "fp16=True to TrainingArguments (Accelerator(mixed_precision='fp16')), "
                    "which scales the loss with ls.GradScaler"
                )
            return self
        if self.mixed_precision is None:
            return replace(self, mixed_precision=MixedPrecision(param_dtype=amp))
        if self.mixed_precision.param_dtype != amp:
            raise ValueError(
                f"layershard: mixed precision {mixed_precision!r} (bf16/fp16 in TrainingArguments "
                "or accelerate) contradicts ShardingPlugin(mixed_precision=MixedPrecision("
                f"param_dtype={self.mixed_precision.param_dtype})); set only one of them"
            )
        return self
