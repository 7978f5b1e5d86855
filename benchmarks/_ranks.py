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
    """``--shape NAME``: the model, overrides, sequence length, per-rank batch and loss of that
    ``layershard bench`` shape (sets ``args.model``, ``args.overrides``, ``args.seq_len``,
    ``args.batch``, ``args.loss``)."""
    args.overrides = {}
    if getattr(args, "shape", None) is None:
        return
    from layershard.bench.cli import SHAPES

    shape = SHAPES[args.shape]
    args.model, args.seq_len = shape["model"], shape["seq_len"]
    args.batch = shape.get("micro_batch") or shape["global_batch"] // args.nproc
    args.overrides = {k: int(v) for k, v in (o.split("=") for o in shape["overrides"])}
    args.loss = shape.get("loss", "inside")


def leave_rank() -> None:
    """End a spawned rank as the project's workers do (DEVELOPERS.md, gloo): a barrier, then
    ``os._exit`` past gloo's static destructors."""
    import torch.distributed as dist

    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def add_model_args(p) -> None:
    """The model options the scripts share; ``--shape`` sets them all (``apply_shape``)."""
    p.add_argument("--model", default="small")
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=4, help="sequences per rank")
    p.add_argument(
        "--shape", choices=["small", "comm", "vocab", "deep"], help="a `layershard bench` shape"
    )
    p.add_argument("--loss", choices=["inside", "outside"], default="inside")
