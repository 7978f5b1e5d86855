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


def apply_shape(args) -> None:
    """``--shape NAME``: the model, overrides, sequence length and per-rank batch of that
    ``layershard bench`` shape (sets ``args.model``, ``args.overrides``, ``args.seq_len``,
    ``args.batch``)."""
    args.overrides = {}
    if getattr(args, "shape", None) is None:
        return
    from layershard.bench.cli import SHAPES

    shape = SHAPES[args.shape]
    args.model, args.seq_len = shape["model"], shape["seq_len"]
    args.batch = shape.get("micro_batch") or shape["global_batch"] // args.nproc
    args.overrides = {k: int(v) for k, v in (o.split("=") for o in shape["overrides"])}
