"""The per-rank setup the benchmark scripts share: torchrun's environment for a spawned rank, one
torch thread (ranks share the machine's cores), and the gloo process group."""

from __future__ import annotations

import os

import torch


def init_gloo_rank(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))  # fmt: skip
    torch.set_num_threads(1)
    import layershard as ls

    ls.init_distributed(backend="gloo")
