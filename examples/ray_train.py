"""A plain ``ls.shard`` training loop run by Ray Train: a ``TorchTrainer`` starts one worker per
rank, makes their process group (gloo on CPU workers, NCCL on GPU workers) and calls the loop on
each; ``ls.init_distributed()`` joins that group as it is.

    pip install 'layershard[ray]'

    # a local Ray (started on the spot), 2 CPU workers, the tiny Llama
    python examples/ray_train.py

    # a running Ray cluster (RAY_ADDRESS, or `ray start` on this node), 16 GPU workers
    RAY_ADDRESS=auto python examples/ray_train.py --nproc 16 --gpu --model small \\
        --run-dir /shared/ray-runs --steps 1000

Each step's loss goes to Ray (``ray.train.report``) and the final weights are a Ray checkpoint
holding a Hugging Face folder (``ls.export_hf``). The data are learnable sequences (an affine
recurrence mod the vocabulary), drawn per step as one global batch that every rank cuts its own
rows from, so the run is the same at any number of workers.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import layershard as ls
from layershard.distributed import default_device, default_timeout
from layershard.models import LlamaForCausalLM, build_config

DEFAULTS: dict[str, Any] = {
    "model": "tiny",
    "model_overrides": {"vocab_size": 256},
    "steps": 30,
    "lr": 3e-3,
    "global_batch": 16,  # sequences per step, over all workers (a multiple of their number)
    "seq_len": 64,
    "seed": 0,
    "grad_clip": 1.0,
}


def build_model(config: dict[str, Any]) -> LlamaForCausalLM:
    torch.manual_seed(config["seed"])  # the same initial weights on every worker
    return LlamaForCausalLM(build_config(config["model"], **config["model_overrides"]))


def global_batch(config: dict[str, Any], step: int) -> torch.Tensor:
    """Step ``step``'s sequences, the same on every worker: a random start and stride per row."""
    vocab = config["model_overrides"].get("vocab_size") or build_config(config["model"]).vocab_size
    g = torch.Generator().manual_seed(config["seed"] * 100_003 + step)
    n = config["global_batch"]
    start = torch.randint(0, vocab, (n, 1), generator=g)
    stride = torch.randint(1, 8, (n, 1), generator=g)
    return (start + stride * torch.arange(config["seq_len"])) % vocab


def train(
    config: dict[str, Any], report: Callable[[dict[str, Any]], None] | None = None
) -> tuple[ls.ShardedModule, list[float]]:
    """The training loop of one worker (or one torchrun rank, or one process): the sharded model
    and the loss of every step, averaged over the workers (equal on all of them)."""
    import torch.distributed as dist

    rank, world = ls.init_distributed()  # Ray's group when Ray made one; torchrun's; or 1 rank
    if config["global_batch"] % world:
        raise ValueError(f"global_batch {config['global_batch']} is not a multiple of {world}")
    device = default_device()  # this worker's GPU under NCCL, else the CPU
    model = ls.shard(build_model(config))
    opt = torch.optim.AdamW(model.parameters(), lr=config["lr"])  # this worker's slices
    rows = config["global_batch"] // world
    losses = []
    for step in range(config["steps"]):
        x = global_batch(config, step)[rank * rows : (rank + 1) * rows].to(device)
        loss = model(x, labels=x).loss
        loss.backward()  # gradients reduce-scattered and averaged over the workers
        norm = model.clip_grad_norm_(config["grad_clip"])
        opt.step()
        opt.zero_grad()
        mean = loss.detach().float()
        dist.all_reduce(mean)  # every worker's rows weigh the same: the global batch's loss
        losses.append(mean.item() / world)
        if report is not None:
            report({"step": step + 1, "loss": losses[-1], "grad_norm": norm.item()})
    return model, losses


def train_loop_per_worker(config: dict[str, Any]) -> None:
    """What every Ray worker runs: the loop, each step reported to Ray, then the final weights
    as a Ray checkpoint (a Hugging Face folder written by worker 0)."""
    import ray.train

    config = {**DEFAULTS, **config}
    model, losses = train(config, report=lambda metrics: ray.train.report(metrics))
    rank = ray.train.get_context().get_world_rank()
    with tempfile.TemporaryDirectory() as tmp:
        ls.export_hf(model, Path(tmp) / "model", dtype=torch.float32)  # collective; worker 0 writes
        checkpoint = ray.train.Checkpoint.from_directory(tmp) if rank == 0 else None
        # every worker reports as often as the others (a barrier in Ray); worker 0's metrics and
        # checkpoint become the result's
        ray.train.report({"step": config["steps"], "losses": losses}, checkpoint=checkpoint)


def build_trainer(
    args: argparse.Namespace, train_fn: Callable[[dict[str, Any]], None] = train_loop_per_worker
):
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    overrides = dict(DEFAULTS["model_overrides"])
    for item in args.model_override:
        key, _, value = item.partition("=")
        overrides[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    config = {
        **DEFAULTS,
        "model": args.model,
        "model_overrides": overrides,
        "steps": args.steps,
        "lr": args.lr,
        "global_batch": args.global_batch,
        "seq_len": args.seq_len,
        "seed": args.seed,
    }
    return TorchTrainer(
        train_fn,
        train_loop_config=config,
        scaling_config=ScalingConfig(num_workers=args.nproc, use_gpu=args.gpu),
        # Ray makes the process group, so its timeout is Ray's (default 1800 s): give it
        # layershard's (--timeout, else LAYERSHARD_TIMEOUT_S, else 600 s), after which a
        # collective that a worker never joins fails the run instead of hanging it.
        torch_config=TorchConfig(timeout_s=int(args.timeout or default_timeout().total_seconds())),
        run_config=RunConfig(storage_path=_storage(args.run_dir), name=args.name),
    )


def _storage(run_dir: str) -> str:
    """Ray wants an absolute path or a URI (s3://, gs://...)."""
    return run_dir if "://" in run_dir else str(Path(run_dir).resolve())


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="Ray Train workers, one rank each")
    p.add_argument("--gpu", action="store_true", help="one GPU per worker (NCCL), else CPU (gloo)")
    p.add_argument("--model", default=DEFAULTS["model"], help="layershard.models preset")
    p.add_argument("--model-override", action="append", default=[], metavar="KEY=VALUE",
                   help="change a preset field, e.g. --model-override dim=256 (repeatable)")  # fmt: skip
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--global-batch", type=int, default=DEFAULTS["global_batch"],
                   help="sequences per step over all workers")  # fmt: skip
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--seed", type=int, default=DEFAULTS["seed"])
    p.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                   help="the process group's timeout (default LAYERSHARD_TIMEOUT_S, else 600)")  # fmt: skip
    p.add_argument("--run-dir", default="runs/ray",
                   help="Ray's storage_path: on storage every node sees (NFS, s3://...)")  # fmt: skip
    p.add_argument("--name", default=None, help="the run's folder in --run-dir (default: Ray's)")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    result = build_trainer(args).fit()
    losses = result.metrics["losses"]
    print(
        f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps on {args.nproc} workers"
    )
    model = os.path.join(result.checkpoint.path, "model")
    print(f"final weights (Hugging Face folder): {model}")


if __name__ == "__main__":
    main()
