"""``ls.hf.Trainer`` and ``ls.hf.sharded(TrainerClass)``: a ``transformers.Trainer`` (or any
subclass: trl's ``SFTTrainer``, ``DPOTrainer``, ...) that trains through ``ls.hf.Accelerator``.

The constructor and every argument stay Trainer's; ``layershard=ls.hf.ShardingPlugin(...)`` is
the one addition. Trainer's own loop does the rest: it builds the optimizer from the unsharded
model (weight-decay groups by name), ``prepare()`` shards the model and points the optimizer at
the slices of the same names, accumulation runs micro-batches under ``accelerator.no_sync``, and
``accelerator.clip_grad_norm_`` clips by the norm over all ranks. What changes is where a sharded
model's state goes:

- ``save_model()`` gathers the full weights and writes them with the model's ``save_pretrained``
  (HF safetensors + config; only the adapters of a PEFT model). Collective: every rank calls it.
- A checkpoint (``save_steps``) holds, besides that, ``layershard/``: the model's slices and the
  optimizer state in layershard's sharded format (each rank writes its own), loadable at any world
  size; ``resume_from_checkpoint`` reads the model and optimizer from it after ``prepare()``.
- ``load_best_model_at_end`` reads the best checkpoint's ``layershard/`` into the sharded model.

With ``ShardingPlugin(cp=N)`` (context parallelism) the ``N`` ranks of a CP group read the same
batches (``ls.hf.Accelerator``'s data loaders split over ``world / N``), and ``compute_loss``
hands the model this rank's part of each (``context_batch``). The loss stays Trainer's: its
``num_items_in_batch``, counted on every rank of a group and summed over the world, is divided
by ``get_cp_size()`` (``N``), and each rank's loss is multiplied by the world size as under DDP,
so the gradient the engine averages over the world is the single process's mean over the
global batch's targets (docs/context-parallel.md, "Trainer"). TRL's SFTTrainer takes the same
parts through its own ``compute_loss`` (``_context_loss_owners``).
"""

from __future__ import annotations

import functools
import inspect
import os
import sys
import warnings
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import transformers
from transformers.trainer import SCHEDULER_NAME

import layershard as ls
from layershard.engine.agreement import agreed
from layershard.engine.four_bit import is_packed
from layershard.hf.accelerator import (
    _ATTR,
    Accelerator,
    inner_optimizer,
    refuse_wrapped,
    sharded_of,
)
from layershard.hf.plugin import ShardingPlugin
from layershard.parallel.context import ContextParallel, context_batch
from layershard.parallel.context.layout import IGNORE_INDEX
from layershard.sharded import ShardedModule

# Inside checkpoint-N/: a layershard checkpoints folder (``step_<N>/`` and ``latest``, as
# `layershard train` writes them): model slices and optimizer state, any world size.
CHECKPOINT_DIR = "layershard"

# Trainer's `optim` values whose update is elementwise, so that stepping 1-D slices is stepping
# the model. Factored (Adafactor), low-rank (GaLore, APOLLO), fused-into-backward (LOMO) and
# blockwise-quantized (8-bit, 4-bit) optimizers see a parameter's shape or blocks, not a slice.
SUPPORTED_OPTIM = frozenset(
    {
        "adamw_torch",
        "adamw_torch_fused",
        "sgd",
        "adagrad",
        "rmsprop",
        "schedule_free_adamw",
        "schedule_free_sgd",
        "schedule_free_radam",
    }
)


# Type checkers see the mixin as a Trainer (its super() calls go to one); at runtime it is a
# plain mixin, put first in the bases of any Trainer subclass.
if TYPE_CHECKING:
    _TrainerBase = transformers.Trainer
else:
    _TrainerBase = object


class ShardedTrainerMixin(_TrainerBase):
    """Put first in the bases of a ``transformers.Trainer`` subclass (``ls.hf.sharded`` does)."""

    def __init__(self, *args: Any, layershard: ShardingPlugin | None = None, **kwargs: Any):
        self._ls_plugin = layershard
        model = kwargs["model"] if "model" in kwargs else (args[0] if args else None)
        if isinstance(model, ShardedModule):  # sharded by the user (e.g. built on meta)
            if layershard is not None:
                raise ValueError(
                    "ls.hf.Trainer: the model is already sharded (ls.shard); drop layershard=... "
                    "or pass the unsharded model"
                )
            object.__setattr__(model.module, _ATTR, model)
            if "model" in kwargs:
                kwargs["model"] = model.module
            else:
                args = (model.module, *args[1:])
        super().__init__(*args, **kwargs)
        _fp32_adapters(self.model)
        optim = getattr(self.args.optim, "value", self.args.optim)
        if (
            self.optimizer is None
            and getattr(self, "optimizer_cls_and_kwargs", None) is None
            and optim not in SUPPORTED_OPTIM
        ):
            raise ValueError(
                f"ls.hf.Trainer: optim={optim!r} is not supported on sharded parameters "
                f"(each rank steps 1-D slices); use one of {sorted(SUPPORTED_OPTIM)}, or pass "
                "optimizers=(...) with an elementwise optimizer"
            )

    # -- the accelerator ---------------------------------------------------------------------------

    def _build_accelerator_args(self, **kwargs: Any) -> dict[str, Any]:
        built = super()._build_accelerator_args(**kwargs)
        self._ls_accelerator_args = built
        return built

    def create_accelerator_and_postprocess(self) -> None:
        self._ls_check_args()
        super().create_accelerator_and_postprocess()
        # Trainer has no hook for the accelerator's class: build ours from the same arguments
        # (accelerate's state is a singleton; the second construction reuses it).
        self.accelerator = Accelerator(
            **self._ls_accelerator_args, layershard=self._ls_plugin or ShardingPlugin()
        )
        gather = self.accelerator.gather_for_metrics
        if "use_gather_object" in inspect.signature(gather).parameters:
            gather = functools.partial(gather, use_gather_object=self.args.eval_use_gather_object)
        self.gather_function = gather

    def _ls_check_args(self) -> None:
        a = self.args
        if a.fsdp:
            raise ValueError(
                "ls.hf.Trainer: TrainingArguments(fsdp=...) asks for torch FSDP; layershard shards "
                "the model instead, so remove fsdp (and fsdp_config)"
            )
        if a.deepspeed:
            raise ValueError(
                "ls.hf.Trainer: TrainingArguments(deepspeed=...) asks for DeepSpeed; layershard "
                "shards the model instead, so remove deepspeed"
            )
        if self.model is not None and not isinstance(self.model, ShardedModule):
            refuse_wrapped(self.model)
        plugin = self._ls_plugin
        if plugin is not None and plugin.activation_checkpointing and a.activation_checkpointing:
            raise ValueError(
                "ls.hf.Trainer: gradient_checkpointing=True (the model's own checkpointing of every "
                f"layer) and ShardingPlugin(activation_checkpointing={plugin.activation_checkpointing}) "
                "would recompute twice; set only one"
            )
        if a.save_only_model and a.load_best_model_at_end:
            raise ValueError(
                "ls.hf.Trainer: save_only_model=True with load_best_model_at_end=True is not "
                "supported (as with FSDP): the best model is read from the sharded checkpoint"
            )
        if a.auto_find_batch_size:
            raise ValueError(
                "ls.hf.Trainer: auto_find_batch_size is not supported; set "
                "per_device_train_batch_size (a sharded model is not re-wrapped per attempt)"
            )
        if plugin is not None and plugin.cp > 1:
            self._ls_check_context_args()
        if a.fp16_full_eval or a.bf16_full_eval:
            raise ValueError(
                "ls.hf.Trainer: fp16_full_eval/bf16_full_eval cast the model, which a sharded model "
                "cannot do; evaluation computes in the training dtype (bf16=True / fp16=True)"
            )

    def _ls_check_context_args(self) -> None:
        """What ShardingPlugin(cp=N) does not run, refused before any model is touched."""
        a, cp = self.args, self._ls_cp()
        if a.label_smoothing_factor:
            raise ValueError(
                f"ls.hf.Trainer: label_smoothing_factor with ShardingPlugin(cp={cp}) is not "
                "supported: it shifts whole-sequence labels, which each rank no longer holds"
            )
        # whose compute_loss runs: the first class in the MRO, the mixin aside, that defines one
        owner = next(
            k
            for k in type(self).__mro__
            if k is not ShardedTrainerMixin and "compute_loss" in vars(k)
        )
        if owner not in _context_loss_owners():
            raise ValueError(
                f"ls.hf.Trainer: ShardingPlugin(cp={cp}) runs transformers.Trainer's or TRL's "
                f"SFTTrainer's compute_loss on each rank's part of the sequences; "
                f"{type(self).__name__} overrides it, which is not supported yet"
            )
        if a.n_gpu > 1:  # Trainer's DataParallel, which layershard never runs (one device a rank)
            raise ValueError(f"ls.hf.Trainer: ShardingPlugin(cp={cp}) needs one device per rank")

    def _move_model_to_device(self, model: Any, device: Any) -> None:
        # ls.shard places the slices (ShardingPlugin(device=...)): the whole model never moves.
        return None

    # -- context parallelism ---------------------------------------------------------------------

    def _ls_cp(self) -> int:
        return self._ls_plugin.cp if self._ls_plugin is not None else 1

    def get_cp_size(self) -> int:
        """``ShardingPlugin(cp=N)``'s N: Trainer divides ``num_items_in_batch`` by it (every rank
        of a CP group counts the group's whole batch) and the world by it for the total batch."""
        return self._ls_cp() if self._ls_cp() > 1 else super().get_cp_size()

    def compute_loss(
        self,
        model: Any,
        inputs: dict[str, Any],
        return_outputs: bool = False,
        num_items_in_batch: Any = None,
    ) -> Any:
        """Trainer's; under ``ShardingPlugin(cp=N)`` on this rank's part of the batch
        (``context_batch``: its tokens, global positions, labels shifted over the whole
        sequence, ``use_cache=False``)."""
        if self._ls_cp() > 1:
            if self.compute_loss_func is not None:
                raise ValueError(
                    f"ls.hf.Trainer: compute_loss_func with ShardingPlugin(cp={self._ls_cp()}) is "
                    "not supported: it reads whole-sequence labels, which each rank no longer holds"
                )
            inputs = _context_inputs(_context_of(model), inputs)
        return super().compute_loss(
            model, inputs, return_outputs=return_outputs, num_items_in_batch=num_items_in_batch
        )

    def evaluate(self, *args: Any, **kwargs: Any) -> Any:
        cp = self._ls_cp()
        if cp > 1 and (self.compute_metrics or self.preprocess_logits_for_metrics):
            raise ValueError(
                f"ls.hf.Trainer: compute_metrics with ShardingPlugin(cp={cp}) is not supported: "
                "a CP group's logits are split over its ranks; evaluation under cp gives the loss"
            )
        return super().evaluate(*args, **kwargs)

    def prediction_step(
        self,
        model: Any,
        inputs: dict[str, Any],
        prediction_loss_only: bool,
        ignore_keys: list[str] | None = None,
    ) -> Any:
        """Trainer's; under ``ShardingPlugin(cp=N)`` the loss only (``compute_loss`` on this
        rank's part of the batch).

        Note: evaluation under CP is the loss alone. Each rank's loss is ``cp`` times its share
        of its group's batch (``ContextParallel.loss_divisor``), so the mean of the losses that
        ``evaluation_loop`` gathers from every rank, ``batch_size`` copies each, is the mean
        over the data-parallel batches of each batch's loss, as without CP. The logits are split
        over the group's ranks: they are not returned (``compute_metrics`` is refused)."""
        if self._ls_cp() > 1:
            prediction_loss_only = True
        return super().prediction_step(model, inputs, prediction_loss_only, ignore_keys)

    def predict(self, *args: Any, **kwargs: Any) -> Any:
        if self._ls_cp() > 1:
            # predictions are logits, which a CP group holds split by chunk over its ranks
            raise ValueError(
                f"ls.hf.Trainer: predict() under ShardingPlugin(cp={self._ls_cp()}) is not "
                "supported (its logits are split over the CP ranks); evaluate() gives the loss, "
                "or predict with the saved model (save_model) without cp"
            )
        return super().predict(*args, **kwargs)

    # -- saving ----------------------------------------------------------------------------------

    def _ls_sharded(self) -> ShardedModule | None:
        return sharded_of(self.model_wrapped) or sharded_of(self.model)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Hugging Face weights + config (adapters for PEFT) into ``output_dir``, as
        ``Trainer.save_model``. Collective once the model is sharded: call it on every rank."""
        sharded = self._ls_sharded()
        if sharded is None:  # never prepared: the whole model is still on every rank
            return super().save_model(output_dir, _internal_call)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        state_dict = self.accelerator.get_state_dict(sharded)  # collective; {} but on rank 0
        with agreed():  # rank 0 writes: its failure is every rank's
            self._save(output_dir, state_dict=state_dict)
        if self.args.push_to_hub and not _internal_call:
            self.push_to_hub(commit_message="Model save", revision=self.args.hub_revision)
        self.accelerator.wait_for_everyone()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        sharded = self._ls_sharded()
        if sharded is None:
            return super()._save_optimizer_and_scheduler(output_dir)
        step = self.state.global_step
        ls.save_checkpoint(
            Path(output_dir) / CHECKPOINT_DIR / f"step_{step:06d}",
            sharded,
            inner_optimizer(self.optimizer),
            step=step,
        )
        with agreed():  # rank 0 alone writes the scheduler: its failure is every rank's
            if self.args.should_save and self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)  # torch's "save the optimizer"
                    state = self.lr_scheduler.state_dict()
                    torch.save(state, os.path.join(output_dir, SCHEDULER_NAME))

    # -- loading ---------------------------------------------------------------------------------

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if (Path(resume_from_checkpoint) / CHECKPOINT_DIR).is_dir():
            return  # read with the optimizer, after prepare(): _load_optimizer_and_scheduler
        sharded = sharded_of(model if model is not None else self.model)
        if sharded is None:  # save_only_model checkpoint, model not yet sharded: Trainer's way
            return super()._load_from_checkpoint(resume_from_checkpoint, model)
        if _is_peft(sharded.module):
            raise ValueError(
                f"ls.hf.Trainer: {resume_from_checkpoint} has no layershard/ folder (save_only_model) "
                "and the PEFT model is already sharded; resume before evaluating, or save with "
                "save_only_model=False"
            )
        ls.load_hf(sharded, resume_from_checkpoint)

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        sharded = self._ls_sharded()
        if (
            checkpoint is None
            or sharded is None
            or not (Path(checkpoint) / CHECKPOINT_DIR).is_dir()
        ):
            return super()._load_optimizer_and_scheduler(checkpoint)
        # Trainer restores each rank's RNG itself (rng_state_<rank>.pth)
        folder = Path(checkpoint) / CHECKPOINT_DIR
        ls.load_checkpoint(folder, sharded, inner_optimizer(self.optimizer), restore_rng=False)
        scheduler = Path(checkpoint) / SCHEDULER_NAME
        with agreed():  # each rank reads the file: one that cannot fails every rank
            if scheduler.is_file() and self.lr_scheduler is not None:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", UserWarning)
                    self.lr_scheduler.load_state_dict(torch.load(scheduler, weights_only=True))

    def _load_best_model(self) -> None:
        sharded, best = self._ls_sharded(), self.state.best_model_checkpoint
        if sharded is None or best is None or not (Path(best) / CHECKPOINT_DIR).is_dir():
            return super()._load_best_model()
        ls.load_checkpoint(Path(best) / CHECKPOINT_DIR, sharded, restore_rng=False)


def _context_loss_owners() -> tuple[type, ...]:
    """The classes whose ``compute_loss`` takes a CP rank's part of a batch: transformers'
    Trainer's (``labels`` and ``shift_labels``, ``num_items_in_batch`` over cp), and TRL's
    SFTTrainer's, whose fused LM head scores pre-shifted ``shift_labels`` without shifting
    them (``trl.trainer.utils.add_fused_lm_head``) and divides by the same
    ``num_items_in_batch``. Its other trainers (DPO, GRPO, KTO...) compute per-sequence
    log-probabilities, which a CP rank holds only part of."""
    trl = sys.modules.get("trl")
    sft = getattr(trl, "SFTTrainer", None) if trl is not None else None
    return (transformers.Trainer,) if sft is None else (transformers.Trainer, sft)


def _context_of(model: Any) -> ContextParallel:
    """The ``ContextParallel`` that ``ls.parallelize(cp=...)`` gave the (prepared) model."""
    sharded = sharded_of(model)
    inner = sharded.module if sharded is not None else model
    ctx = getattr(inner, "context_parallel", None)
    if ctx is None:  # a PEFT model, e.g.: the attribute is on the model it wraps
        base = getattr(inner, "get_base_model", None)
        ctx = getattr(base(), "context_parallel", None) if callable(base) else None
    if not isinstance(ctx, ContextParallel) or not ctx.transformers:
        raise ValueError(
            "ls.hf.Trainer: ShardingPlugin(cp>1) trains a transformers causal LM parallelized "
            f"with cp; {type(inner).__name__} has no transformers context parallelism"
        )
    return ctx


# Per-token inputs compute_loss knows how to split; any other (b, t) tensor (flash-attention
# sequence lengths, seq_idx, token types) would reach the model whole, so it is refused.
_CONTEXT_KEYS = ("input_ids", "labels", "position_ids", "attention_mask")


def _context_inputs(ctx: ContextParallel, inputs: dict[str, Any]) -> dict[str, Any]:
    """``inputs`` (a collated batch of whole sequences, the same on every rank of the CP
    group) as this rank's ``context_batch``; other, non-tensor keywords pass through."""
    rest = {k: v for k, v in inputs.items() if k not in _CONTEXT_KEYS}
    extra = sorted(k for k, v in rest.items() if torch.is_tensor(v))
    if extra or "input_ids" not in inputs:
        raise ValueError(
            f"ls.hf.Trainer: under ShardingPlugin(cp={ctx.size}) a batch holds input_ids, labels "
            f"and optionally position_ids and a right-padding attention_mask; got {sorted(inputs)}"
        )
    ids, labels, pos = inputs["input_ids"], inputs.get("labels"), inputs.get("position_ids")
    mask = inputs.get("attention_mask")
    if mask is not None:
        _check_right_padding(mask, labels, ctx.size)
    ids, labels, pos = _pad_to(2 * ctx.size, ids, labels, pos)
    part = context_batch(ctx, ids, labels, pos)
    # Trainer's own num_items_in_batch (when it counts one) replaces the micro-batch's count
    # that context_batch sets (super().compute_loss adds it after these keywords)
    return {**rest, **{k: part[k] for k in part}}


def _check_right_padding(mask: torch.Tensor, labels: torch.Tensor | None, cp: int) -> None:
    """The attention under CP takes no mask. Right padding needs none: causal attention never
    lets a real token see the padding after it, so only padded labels must be ignored. Other
    masks (left padding, holes) would change what real tokens attend to: refused."""
    m = mask.bool()
    right = bool((m[:, 1:] <= m[:, :-1]).all())
    if not right or (labels is not None and bool((labels[~m] != IGNORE_INDEX).any())):
        raise ValueError(
            f"ls.hf.Trainer: under ShardingPlugin(cp={cp}) only right padding with labels -100 "
            "is supported (the attention takes no mask); pack (DataCollatorWithFlattening) or "
            "right-pad with labels -100"
        )


def _pad_to(
    multiple: int, ids: torch.Tensor, labels: torch.Tensor | None, pos: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Right-pad the sequences to a multiple of ``2 cp`` (the layout's chunks): padding after
    every real token is never attended to (causal), its labels are ignored and its positions
    continue the last ones, so the loss and gradients are the unpadded batch's. Packed rows of
    ``DataCollatorWithFlattening`` have any length; the padded tokens join the last document."""
    t = ids.shape[-1]
    n = -t % multiple
    if n == 0:
        return ids, labels, pos
    b = ids.shape[0]
    ids = torch.cat([ids, ids.new_zeros(b, n)], dim=1)
    if labels is not None:
        labels = torch.cat([labels, labels.new_full((b, n), IGNORE_INDEX)], dim=1)
    if pos is not None:
        pos = pos.expand(b, t)
        after = pos[:, -1:] + 1 + torch.arange(n, device=pos.device, dtype=pos.dtype)
        pos = torch.cat([pos, after], dim=1)
    return ids, labels, pos


def _fp32_adapters(model: Any) -> None:
    """trl's QLoRA recipe casts the trainable adapters of a 4-bit model to bf16 (the QLoRA paper's
    choice on one GPU); layershard keeps fp32 master weights (shard() refuses a trainable bf16
    one; frozen ones keep their dtype) and computes in the dtype
    ``ShardingPlugin(mixed_precision=...)`` or ``bf16=True`` picks. So the adapters go back to
    fp32, each bf16 value exactly, once, with a warning."""
    if model is None or isinstance(model, ShardedModule):
        return
    if not any(is_packed(p) for p in model.parameters()):
        return
    cast = [
        p
        for p in model.parameters()
        if p.requires_grad and p.dtype in (torch.bfloat16, torch.float16)
    ]
    if cast:
        warnings.warn(
            f"ls.hf: {len(cast)} trainable parameters of this 4-bit model are "
            f"{str(cast[0].dtype).removeprefix('torch.')} (trl casts QLoRA adapters); layershard "
            "trains fp32 master weights, so they are fp32 again (bf16=True computes in bf16)",
            stacklevel=3,
        )
        for p in cast:
            p.data = p.data.float()


def _is_peft(model: Any) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


class Trainer(ShardedTrainerMixin, transformers.Trainer):
    """``transformers.Trainer`` sharded by layershard: same constructor and arguments, plus
    ``layershard=ls.hf.ShardingPlugin(...)``. Launch with ``torchrun`` or ``accelerate launch``
    as for DDP (on CPU: ``TrainingArguments(use_cpu=True)``)."""


@functools.cache
def sharded(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass, e.g. ``trl.SFTTrainer``) training
    through layershard: ``ls.hf.sharded(trl.SFTTrainer)(model=..., args=SFTConfig(...), ...)``."""
    if not (isinstance(trainer_cls, type) and issubclass(trainer_cls, transformers.Trainer)):
        raise TypeError(f"ls.hf.sharded(): {trainer_cls!r} is not a transformers.Trainer subclass")
    if issubclass(trainer_cls, ShardedTrainerMixin):
        return trainer_cls
    if trainer_cls is transformers.Trainer:
        return Trainer
    return type(
        trainer_cls.__name__,
        (ShardedTrainerMixin, trainer_cls),
        {"__module__": trainer_cls.__module__, "__doc__": trainer_cls.__doc__},
    )
