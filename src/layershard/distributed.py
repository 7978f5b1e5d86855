"""Process groups from torchrun's environment: backend choice, device choice, timeouts."""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT = timedelta(seconds=float(os.environ.get("LAYERSHARD_TIMEOUT_S", "600")))


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def init_distributed(
    backend: str | None = None, timeout: timedelta = DEFAULT_TIMEOUT
) -> tuple[int, int]:
    """Join the job described by torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, ...),
    or start a one-process group when there is none. Idempotent; returns ``(rank, world_size)``.

    On CUDA each process uses the GPU named by LOCAL_RANK. A timeout is always set: a rank that
    never joins a collective makes the others fail with an error instead of hanging forever.
    """
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    backend = backend or default_backend()
    if backend == "nccl":
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
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
        dist.init_process_group(backend, timeout=timeout)
    else:
        # A single process: a real one-rank group keeps every code path identical.
        dist.init_process_group(
            backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
        )
    return dist.get_rank(), dist.get_world_size()


def default_device(process_group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a rank computes on: its CUDA device under NCCL, else the CPU."""
    if dist.is_initialized() and dist.get_backend(process_group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
