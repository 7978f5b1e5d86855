"""Process groups from torchrun's environment: backend choice, device choice, timeouts."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def default_timeout() -> timedelta:
    """The timeout of every collective: ``LAYERSHARD_TIMEOUT_S`` (read when called), or 600 s."""
    return timedelta(seconds=float(os.environ.get("LAYERSHARD_TIMEOUT_S", "600")))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def local_cuda_index() -> int:
    """The GPU this rank computes on: ``LOCAL_RANK`` among the visible GPUs, or the only visible
    one (one GPU per rank, as SLURM's ``CUDA_VISIBLE_DEVICES`` gives each task, whatever its
    ``LOCAL_RANK``)."""
    n = torch.cuda.device_count()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if n == 0:
        raise RuntimeError("layershard: the NCCL backend needs a GPU, and none is visible")
    if n == 1:
        return 0
    if local < n:
        return local
    raise RuntimeError(
        f"layershard: LOCAL_RANK={local} but this process sees {n} GPUs (0..{n - 1}); make each "
        "rank see all of its node's GPUs, or exactly one (CUDA_VISIBLE_DEVICES)"
    )


def init_distributed(
    backend: str | None = None, timeout: timedelta | None = None
) -> tuple[int, int]:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...),
    or start a one-process group when there is none. Idempotent; returns ``(rank, world_size)``.

    On CUDA each process uses the GPU given by ``local_cuda_index()`` and NCCL is initialized
    eagerly on it (``device_id``). A timeout is always set: a rank that never joins a collective
    makes the others fail with an error instead of hanging forever: ``timeout``, default
    ``default_timeout()`` (``LAYERSHARD_TIMEOUT_S``, else 600 s).
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    kwargs: dict = {"timeout": timeout or default_timeout()}
    if backend == "nccl":
        index = local_cuda_index()
        torch.cuda.set_device(index)
        kwargs["device_id"] = torch.device("cuda", index)
        # Our collective buffers are preallocated and ordered by events (collectives.py), so c10d
        # need not record_stream them.
        os.environ.setdefault("TORCH_NCCL_AVOID_RECORD_STREAMS", "1")
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise RuntimeError(
                f"init_distributed: RANK/WORLD_SIZE are set but {', '.join(missing)} is not; "
                "launch with torchrun (or `layershard train`), which sets all of them."
            )
        dist.init_process_group(backend, **kwargs)
    else:
        # A single process: a real one-rank group keeps every code path identical.
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, **kwargs)
    return dist.get_rank(), dist.get_world_size()


def default_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a rank computes on: its GPU under NCCL (``local_cuda_index()``, made the
    current device, so a user's own ``init_process_group("nccl")`` without ``set_device`` works),
    else the CPU."""
    if dist.is_initialized() and dist.get_backend(process_group) == "nccl":
        index = local_cuda_index() if "LOCAL_RANK" in os.environ else torch.cuda.current_device()
        if torch.cuda.current_device() != index:
            torch.cuda.set_device(index)
        return torch.device("cuda", index)
    return torch.device("cpu")


def local_world_size(world: int) -> int:
    """Ranks per node (torchrun's LOCAL_WORLD_SIZE) when it divides ``world``; else ``world``."""
    k = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    return k if 0 < k <= world and world % k == 0 else world
