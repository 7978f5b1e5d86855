"""``ls.hf.Accelerator``: an ``accelerate.Accelerator`` whose ``prepare()`` shards models with
``ls.shard`` instead of wrapping them in DDP or FSDP.

The run stays what accelerate calls MULTI_CPU / MULTI_GPU (no FSDP or DeepSpeed plugin), so every
branch of accelerate, transformers and trl takes its plain data-parallel path; the methods below
are the ones where that path would be wrong for a model whose ranks each hold 1/N of it.

What a prepared model is: the ``ShardedModule`` that ``ls.shard`` returns. Its wrapped module (the
user's model object, sharded in place: same module tree and parameter names, hooks installed)
keeps working on its own, which is what Trainer holds as ``self.model``; ``sharded_of(module)``
finds the ``ShardedModule`` again.
"""

from __future__ import annotations

import contextlib
import os
import re
import weakref
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import accelerate
import torch
import torch.distributed as dist
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType, DynamoBackend
from torch import nn

import layershard as ls
from layershard.engine.agreement import agreed
from layershard.full_state import agreed_by_model
from layershard.hf.fused_head import bridge_fused_lm_head
from layershard.hf.plugin import ShardingPlugin
from layershard.sharded import ShardedModule

_ATTR = "_layershard_sharded"  # on the wrapped module: its ShardedModule
STATE_PREFIX = "layershard_model"  # save_state(): <dir>/layershard_model_<i>/step_<n>/, latest


def sharded_of(model: Any) -> ShardedModule | None:
    """The ``ShardedModule`` of ``model`` (itself, or the module it wraps), else None."""
    if isinstance(model, ShardedModule):
        return model
    if isinstance(model, nn.Module):
        return model.__dict__.get(_ATTR)
    return None


def inner_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    while isinstance(optimizer, AcceleratedOptimizer):
        optimizer = optimizer.optimizer
    return optimizer


def refuse_wrapped(model: nn.Module) -> None:
    """A model that another data-parallel wrapper already owns cannot be sharded as well."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP1

    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel)):
        kind = type(model).__name__
    elif isinstance(model, FSDP1) or any(
        isinstance(m, (FSDP1, FSDPModule)) for m in model.modules()
    ):
        kind = "FSDP"
    else:
        return
    raise ValueError(
        f"layershard: the model is already wrapped in {kind}; pass the plain model (layershard "
        "shards it in place of DDP/FSDP)"
    )


class Accelerator(accelerate.Accelerator):
    """``accelerate.Accelerator(..., layershard=ls.hf.ShardingPlugin(...))``.

    ``prepare()`` shards each model with ``ls.shard`` and points the optimizers at its slices (by
    parameter name, so optimizers built before ``prepare`` keep their groups). ``accumulate()`` /
    ``no_sync()`` use the sharded model's ``no_sync``; ``clip_grad_norm_`` clips by the norm of the
    whole gradient over all ranks; ``get_state_dict`` gathers the full weights (rank 0; collective);
    ``save_model`` writes Hugging Face safetensors + config (adapters only for a PEFT model);
    ``save_state`` / ``load_state`` keep each sharded model with its optimizer in layershard's
    sharded checkpoint format (``ls.save_checkpoint``), loadable at another world size.
    """

    # accelerate's own lists (declared for type checkers)
    _models: list
    _optimizers: list

    def __init__(self, *args: Any, layershard: ShardingPlugin | None = None, **kwargs: Any):
        _refuse_other_backends(kwargs)
        super().__init__(*args, **kwargs)
        if self.distributed_type not in (
            DistributedType.NO,
            DistributedType.MULTI_CPU,
            DistributedType.MULTI_GPU,
        ):
            raise ValueError(
                f"ls.hf.Accelerator: distributed type {self.distributed_type} is not supported; "
                "layershard runs plain torchrun / accelerate launch jobs (CPU or GPU)"
            )
        if self.state.dynamo_plugin.backend != DynamoBackend.NO:
            raise ValueError(
                "ls.hf.Accelerator: torch.compile through accelerate compiles the whole model; with "
                "layershard use ShardingPlugin(compile=True) (each block, outside the hooks)"
            )
        # before any process group: a plugin that contradicts accelerate is refused first
        self.layershard = (layershard or ShardingPlugin()).with_amp(self.mixed_precision)
        ls.init_distributed()  # a one-process group when accelerate started none
        if dist.get_world_size() > 1 and self.distributed_type == DistributedType.NO:
            raise ValueError(
                f"ls.hf.Accelerator: the job has {dist.get_world_size()} ranks but accelerate runs "
                "each as a single process; on CPU pass TrainingArguments(use_cpu=True) or "
                "Accelerator(cpu=True)"
            )
        # under tp or cp: the data loaders give a TP / CP group's ranks the same batches
        # (plugin.data_mesh)
        self._ls_data_mesh = self.layershard.data_mesh()
        if self.mixed_precision == "fp16":  # every rank must skip the same steps
            self.scaler = ls.GradScaler(process_group=self.layershard.process_group)
        # id(original parameter) -> (weak reference to it, its slice): remaps optimizers
        self._ls_slices: dict[int, tuple[weakref.ref, nn.Parameter]] = {}
        # Every model this accelerator prepared: Trainer's free_memory() empties accelerate's list
        # between train() calls, while the optimizer still steps the same sharded model.
        self._ls_models: list[weakref.ref[ShardedModule]] = []

    # -- prepare ---------------------------------------------------------------------------------

    def _prepare_device_mesh(self):
        """accelerate's data loaders split batches by this mesh: with ``ShardingPlugin(tp=N)``
        or ``(cp=N)`` over the ``world / N`` data-parallel ranks (a TP or CP group computes one
        batch together)."""
        if self._ls_data_mesh is not None:
            return self._ls_data_mesh
        return super()._prepare_device_mesh()

    def prepare(self, *args: Any, device_placement: list[bool] | None = None):
        result = super().prepare(*args, device_placement=device_placement)
        for obj in result if isinstance(result, tuple) else (result,):
            if isinstance(obj, torch.optim.Optimizer):
                self._point_at_slices(obj)
        return result

    def prepare_model(
        self, model: nn.Module, device_placement: bool | None = None, evaluation_mode: bool = False
    ):
        """Shard ``model`` (once; later calls return the same ``ShardedModule``). Evaluation mode
        shards too, as accelerate's FSDP does: a model evaluated before training is then not
        held whole by every rank, and training it later needs no second preparation."""
        sharded = sharded_of(model)
        if sharded is None:
            refuse_wrapped(model)
            names = list(model.named_parameters(remove_duplicate=False))
            sharded = self.layershard.shard(model)
            slices = dict(sharded.named_parameters())
            for name, p in names:
                if name in slices and id(p) not in self._ls_slices:
                    self._ls_slices[id(p)] = (weakref.ref(p), slices[name])
        # Also for a model the user sharded with ls.shard: found again from its module, kept in
        # step in generate, trl's fused head gathered (each idempotent).
        object.__setattr__(sharded.module, _ATTR, sharded)
        _sync_generation(sharded.module)
        bridge_fused_lm_head(sharded.module)
        if sharded not in self._models:
            self._models.append(sharded)
        if all(r() is not sharded for r in self._ls_models):
            self._ls_models.append(weakref.ref(sharded))
        return sharded

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement=None):
        prepared = super().prepare_optimizer(optimizer, device_placement=device_placement)
        self._point_at_slices(prepared)
        return prepared

    def _point_at_slices(self, optimizer: torch.optim.Optimizer) -> None:
        """Replace, in place, every parameter of a model this accelerator sharded by its slice
        (same name, same group: weight-decay groups built by name before prepare survive)."""
        opt = inner_optimizer(optimizer)
        for group in opt.param_groups:
            for i, p in enumerate(group["params"]):
                entry = self._ls_slices.get(id(p))
                old = None if entry is None else entry[0]()
                if entry is None or old is None or old is not p:
                    continue
                if opt.state.get(old):
                    raise ValueError(
                        "ls.hf.Accelerator: the optimizer already holds state for the unsharded "
                        "model; load optimizer state after prepare() (load_state), not before"
                    )
                group["params"][i] = entry[1]

    # -- training --------------------------------------------------------------------------------

    @contextlib.contextmanager
    def no_sync(self, model: nn.Module) -> Iterator[None]:
        sharded = sharded_of(model)
        if sharded is None:
            with super().no_sync(model):
                yield
            return
        with sharded.no_sync():
            yield

    def clip_grad_norm_(self, parameters: Iterable[torch.Tensor], max_norm: float, norm_type=2):
        """Clip by the norm of the whole gradient of a sharded model (collective: every rank calls
        it, as Trainer does at every optimizer step); returns that norm, equal on every rank."""
        params = list(parameters)
        ids = {id(p) for p in params}
        for sharded in self._sharded_models():
            mine = {id(p) for p in sharded.parameters()}
            if ids == mine:
                self.unscale_gradients()
                return sharded.clip_grad_norm_(max_norm, norm_type)
            if ids & mine:
                raise ValueError(
                    "ls.hf.Accelerator.clip_grad_norm_: pass model.parameters() of the whole "
                    "sharded model; its gradient norm is computed over every rank's slices"
                )
        return super().clip_grad_norm_(params, max_norm, norm_type)

    def _sharded_models(self) -> list[ShardedModule]:
        return [m for m in (r() for r in self._ls_models) if m is not None]

    # -- weights out -----------------------------------------------------------------------------

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True):
        if isinstance(model, ShardedModule):
            model = model.module
        return super().unwrap_model(model, keep_fp32_wrapper, keep_torch_compile)

    def get_state_dict(self, model, unwrap: bool = True):
        """For a sharded model: the full fp32 weights under the wrapped model's ``state_dict()``
        keys on the main process, ``{}`` elsewhere. Collective: call it on every rank."""
        sharded = sharded_of(model)
        if sharded is None:
            return super().get_state_dict(model, unwrap=unwrap)
        return full_state_dict(sharded)

    def save_model(
        self,
        model: nn.Module,
        save_directory: str | os.PathLike,
        max_shard_size: int | str = "10GB",
        safe_serialization: bool = True,
    ) -> None:
        """A sharded Hugging Face model is written with its own ``save_pretrained`` (weights in
        safetensors, ``config.json``; a PEFT model writes its adapters only), loadable with
        ``from_pretrained``. Collective: call it on every rank."""
        sharded = sharded_of(model)
        if sharded is None:
            return super().save_model(model, save_directory, max_shard_size, safe_serialization)
        inner: Any = sharded.module
        if not hasattr(inner, "save_pretrained"):
            # accelerate's: our get_state_dict (the gather) first, then the main process writes
            with agreed():
                super().save_model(inner, save_directory, max_shard_size, safe_serialization)
            return None
        state_dict = self.get_state_dict(sharded)
        with agreed():  # the main process writes: its failure is every rank's
            if self.is_main_process:
                kwargs: dict[str, Any] = {"safe_serialization": safe_serialization}
                if not _is_peft(inner):
                    kwargs["max_shard_size"] = max_shard_size
                inner.save_pretrained(save_directory, state_dict=state_dict, **kwargs)
        return None

    # -- checkpoints -----------------------------------------------------------------------------

    def save_state(
        self, output_dir: str | None = None, safe_serialization: bool = True, **kwargs: Any
    ):
        """Accelerate's files for everything else (schedulers, samplers, scaler, RNG, registered
        objects), and for each sharded model a ``layershard_model_<i>/`` sharded checkpoint
        with its optimizer (``ls.save_checkpoint``: each rank writes its slices). Collective."""
        pairs, others, other_opts = self._split_state()
        # accelerate writes files on the main process alone (schedulers, registered objects):
        # agreed before the sharded saves (its barrier, under automatic_checkpoint_naming,
        # precedes its writes)
        with self._only(others, other_opts), agreed():
            location = super().save_state(output_dir, safe_serialization, **kwargs)
        for i, (sharded, opt) in enumerate(pairs):
            path = Path(location) / f"{STATE_PREFIX}_{i}" / f"step_{self.step:06d}"
            ls.save_checkpoint(path, sharded, opt, step=self.step, keep_last=1)
        return location

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None, **kwargs):
        """Undo ``save_state``, at this or another world size (RNG states of ranks that did not
        exist when saving are left as they are, as accelerate does)."""
        pairs, others, other_opts = self._split_state()
        # each rank reads accelerate's files (no collective in it): a folder one rank cannot
        # see fails before the sharded loads
        with self._only(others, other_opts), agreed():
            input_dir = self._resolve_load_dir(input_dir)
            super().load_state(input_dir, load_kwargs, **kwargs)
        for i, (sharded, opt) in enumerate(pairs):
            path = Path(input_dir) / f"{STATE_PREFIX}_{i}"
            meta = ls.load_checkpoint(path, sharded, opt, restore_rng=False)
            if meta["step"] is not None:
                self.step = meta["step"]

    def _split_state(self):
        """(sharded model, its optimizer or None) pairs; the other models; the other optimizers."""
        pairs, others, taken = [], [], set()
        for model in self._models:
            sharded = sharded_of(model)
            if sharded is None:
                others.append(model)
                continue
            mine = {id(p) for p in sharded.parameters()}
            opts = [
                o
                for o in self._optimizers
                if any(id(p) in mine for g in o.param_groups for p in g["params"])
            ]
            if len(opts) > 1:
                raise ValueError(
                    "ls.hf.Accelerator.save_state: a sharded model is stepped by several "
                    "optimizers; use one optimizer (with parameter groups) per model"
                )
            for o in opts:
                if any(id(p) not in mine for g in o.param_groups for p in g["params"]):
                    raise ValueError(
                        "ls.hf.Accelerator.save_state: an optimizer steps parameters of a sharded "
                        "model and of another model; use one optimizer per model"
                    )
                taken.add(id(o))
            pairs.append((sharded, inner_optimizer(opts[0]) if opts else None))
        return pairs, others, [o for o in self._optimizers if id(o) not in taken]

    @contextlib.contextmanager
    def _only(self, models: list, optimizers: list) -> Iterator[None]:
        """Let accelerate's own save/load see only what it can save: the sharded models and their
        optimizers go through layershard's checkpoints instead."""
        saved: tuple[list, list] = (self._models, self._optimizers)
        self._models, self._optimizers = models, optimizers
        try:
            yield
        finally:
            self._models, self._optimizers = saved

    def _resolve_load_dir(self, input_dir: str | None) -> str:
        # The folder accelerate's load_state would pick (it does not return it).
        if input_dir is not None:
            return os.path.expanduser(input_dir)
        if not self.project_configuration.automatic_checkpoint_naming:
            raise ValueError("No input_dir provided and automatic checkpoint naming is disabled.")
        root = os.path.join(self.project_dir, "checkpoints")
        folders = [os.path.join(root, f) for f in os.listdir(root)]
        folders.sort(key=lambda f: int(re.findall(r"[\/]?([0-9]+)(?=[^\/]*$)", f)[0]))
        return folders[-1]


def _refuse_other_backends(kwargs: dict) -> None:
    given = [
        k
        for k in ("fsdp_plugin", "deepspeed_plugin", "deepspeed_plugins", "megatron_lm_plugin")
        if kwargs.get(k) is not None
    ]
    env = [
        k
        for k in ("ACCELERATE_USE_FSDP", "ACCELERATE_USE_DEEPSPEED", "ACCELERATE_USE_MEGATRON_LM")
        if os.environ.get(k, "false").lower() in ("1", "true", "yes")
    ]
    if given or env:
        what = ", ".join(given + [f"{k}=true" for k in env])
        raise ValueError(
            f"ls.hf.Accelerator: {what} asks for another sharding backend; layershard replaces "
            "FSDP/DeepSpeed, so remove it (and run `accelerate launch` without --use_fsdp / "
            "--use_deepspeed)"
        )
    pc = kwargs.get("parallelism_config")
    if pc is not None:
        raise ValueError(
            "ls.hf.Accelerator: parallelism_config (TP/CP/HSDP meshes) is not supported; "
            "use ShardingPlugin(strategy='hybrid', shard_size=...) for HSDP"
        )


def _is_peft(model: nn.Module) -> bool:
    try:
        from peft import PeftModel
    except ImportError:
        return False
    return isinstance(model, PeftModel)


def _sync_generation(model: nn.Module) -> None:
    """Every rank must run the same number of forwards (each gathers weights): transformers'
    ``generate`` keeps ranks that finished in step (``synced_gpus``) for modules it knows to be
    sharded, which it reads from this flag (set by FSDP2, read also by LayerDrop models)."""
    from transformers import PreTrainedModel

    for m in model.modules():
        if isinstance(m, PreTrainedModel):
            object.__setattr__(m, "_is_fsdp_managed_module", True)


def full_state_dict(sharded: ShardedModule) -> dict[str, torch.Tensor]:
    """``sharded.full_state_dict()`` on rank 0 (``{}`` elsewhere) with every tensor its own
    storage: the engine's tensors are views of one gathered buffer per unit, which safetensors
    and ``save_pretrained`` would take for shared (tied) weights. Tied keys stay one tensor.
    Copied key by key so that a unit's buffer is freed once its last view is copied."""
    # a PEFT model saves its adapters: its 4-bit base (if any) is never gathered for that
    sd = sharded.full_state_dict(rank0_only=True, packed=not _is_peft(sharded.module))
    copies: dict[int, torch.Tensor] = {}
    out = {}
    with agreed_by_model(sharded):  # rank 0 alone copies the whole model (out of memory)
        for key in list(sd):
            t = sd.pop(key)
            if id(t) not in copies:
                copies[id(t)] = t.clone()
            out[key] = copies[id(t)]
    return out
