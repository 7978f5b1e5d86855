"""The seam between the training loop and the sharding engine.

The loop uses a small surface: ``model(x, labels=y).loss``, ``named_parameters()`` (original
names), ``no_sync()``, ``clip_grad_norm_()``, ``memory_report()``, ``full_state_dict()``.
``layershard.shard`` provides it; ``Replicated`` provides the same with plain data parallelism
(every rank holds everything, gradients all-reduced), a reference to compare the engine against.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


class Replicated(nn.Module):
    """Plain data parallel: all-reduce (average) each gradient when backward produces it, unless
    inside ``no_sync()``. Parameter names are the wrapped model's own."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module
        self._sync = True
        for p in module.parameters():
            p.register_post_accumulate_grad_hook(self._reduce)

    def _reduce(self, p: torch.Tensor) -> None:
        if self._sync and dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(p.grad, op=dist.ReduceOp.SUM)
            p.grad.div_(dist.get_world_size())

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return self.module(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.module, name)

    def named_parameters(self, *args: Any, **kwargs: Any) -> Iterator[tuple[str, nn.Parameter]]:
        return self.module.named_parameters(*args, **kwargs)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        return self.module.parameters(recurse)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        self._sync = False
        try:
            yield
        finally:
            self._sync = True

    def clip_grad_norm_(self, max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(self.module.parameters(), max_norm)

    def memory_report(self) -> dict[str, int]:
        params = sum(p.numel() * p.element_size() for p in self.module.parameters())
        grads = sum(
            p.grad.numel() * p.grad.element_size()
            for p in self.module.parameters()
            if p.grad is not None
        )
        return {"params": params, "grads": grads, "total": params + grads}

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        rank = dist.get_rank() if dist.is_initialized() else 0
        return (
            {k: v.detach().clone() for k, v in self.module.state_dict().items()}
            if rank == 0
            else {}
        )


def wrap(
    model: nn.Module,
    engine: str,
    param_dtype: torch.dtype | None,
    activation_checkpointing: int,
    device: torch.device,
) -> nn.Module:
    """Shard ``model`` with layershard (or replicate it) for training on ``device``."""
    if engine == "replicated":
        if activation_checkpointing:
            raise ValueError("--activation-checkpointing needs --engine layershard")
        if param_dtype is not None:
            model = model.to(param_dtype)
        return Replicated(model.to(device))
    import layershard as ls

    mp = ls.MixedPrecision(param_dtype=param_dtype) if param_dtype is not None else None
    return ls.shard(
        model,
        mixed_precision=mp,
        activation_checkpointing=activation_checkpointing,
        device=device if device.type != "cpu" else None,
    )


def clip_grad_norm(model: nn.Module, max_norm: float) -> float:
    """Clip when ``max_norm > 0``; always return the total gradient norm (for the log)."""
    return float(model.clip_grad_norm_(max_norm if max_norm > 0 else math.inf))


# --- checkpoints -----------------------------------------------------------------------------


def _checkpoint_api() -> tuple[Any, Any] | None:
    try:
        import layershard as ls

        return ls.save_checkpoint, ls.load_checkpoint
    except (ImportError, AttributeError):
        return None


def save_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer, step: int, extra: dict
) -> str:
    """A collective. Uses ``layershard.save_checkpoint`` when the engine is layershard and the
    checkpoint package is present; otherwise every rank writes its own shard of model and
    optimizer state (``rank{r}.pt``, resumable at the same world size). Returns the format."""
    api = _checkpoint_api() if not isinstance(model, Replicated) else None
    if api is not None:
        api[0](str(path), model, optimizer=optimizer, step=step, extra=extra,
               run_config=extra.get("config"))  # fmt: skip
        return "layershard"
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    tmp = path.with_name(path.name + ".tmp")
    if rank == 0:
        tmp.mkdir(parents=True, exist_ok=True)
    if dist.is_initialized():
        dist.barrier()
    state = {
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        "optimizer": optimizer.state_dict(),
        "step": step,
        "extra": extra,
        "world_size": world,
    }
    torch.save(state, tmp / f"rank{rank}.pt")
    if dist.is_initialized():
        dist.barrier()
    if rank == 0:  # publish atomically: a folder named step_N is always complete
        tmp.rename(path)
    if dist.is_initialized():
        dist.barrier()
    return "local"


def load_checkpoint(
    path: Path, model: nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any]:
    """Restore model and optimizer in place; returns {"step", "extra"}."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world = dist.get_world_size() if dist.is_initialized() else 1
    local = path / f"rank{rank}.pt"
    if not local.is_file() and (path / "rank0.pt").is_file():
        raise ValueError(f"checkpoint {path} was written by a different number of ranks")
    if not local.is_file():
        api = _checkpoint_api()
        if api is None:
            raise ValueError(f"{path} is not a checkpoint this build can read")
        meta = api[1](str(path), model, optimizer=optimizer)
        return {"step": meta.get("step"), "extra": meta.get("extra") or {}}
    state = torch.load(local, map_location="cpu", weights_only=False)
    if state["world_size"] != world:
        raise ValueError(
            f"checkpoint {path} was written by {state['world_size']} ranks; this run has {world}"
        )
    with torch.no_grad():
        for n, p in model.named_parameters():
            p.copy_(state["params"][n])
    optimizer.load_state_dict(state["optimizer"])
    return {"step": state["step"], "extra": state["extra"]}
