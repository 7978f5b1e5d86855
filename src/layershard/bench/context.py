"""``layershard bench --cp N --cp-mode ring|all_to_all``: layershard with context parallelism
(``ls.parallelize(model, cp=N, cp_mode=...)``, docs/context-parallel.md) beside the other rows.

A CP row runs the built-in Llama with each sequence split over ``N`` consecutive ranks: the
``N`` ranks of a CP group read the same sequences (their group's share of the global batch, as
a TP group's ranks do) and each feeds the model its part of them (``context_batch``: its two
chunks of every sequence, their global positions, the labels shifted over the whole sequence).
The global batch is the other rows', so every row trains on the same tokens; each rank's loss
is its share of its group's mean (``ContextParallel.loss_divisor``), so the mean over the ranks
that the report compares is the batch's loss, as for the other rows.

Refused in one line before any run: ``N < 2``, ``N`` not dividing a world size, a sequence not
divisible by ``2 N``, ``all_to_all`` with heads not divisible by ``N``, a mixture of experts,
``--hf-config`` (the bench's CP rows run the built-in Llama), ``--tp`` / ``--ep``, and the loss
computed outside the model (``--loss outside``, the ``deep`` and ``logits`` shapes): the CP rows
need the model's own loss over the shifted labels.
"""

from __future__ import annotations

import argparse
from typing import Any

from torch import nn

from layershard.bench import CP_IMPLS

MODES = ("ring", "all_to_all")


def add_arguments(group: Any) -> None:
    group.add_argument(
        "--cp", type=int, default=None, metavar="N",
        help="context parallelism over N consecutive ranks (the built-in Llama): also runs "
        "layershard-cp-<mode> (ls.parallelize(model, cp=N) and context_batch; a CP group's "
        "ranks share each batch, the global batch kept)",
    )  # fmt: skip
    group.add_argument(
        "--cp-mode", nargs="+", default=["ring"], choices=MODES,
        help="the CP rows' attention: ring (default), all_to_all, or both (a row each)",
    )  # fmt: skip


def impls(args: argparse.Namespace) -> list[str]:
    """The CP rows ``--cp`` adds, one per ``--cp-mode``."""
    if not args.cp:
        return []
    return [name for name, mode in CP_IMPLS.items() if mode in args.cp_mode]


def default_shapes(
    args: argparse.Namespace, shapes: dict[str, dict], names: list[str]
) -> list[str]:
    """The bench's default shapes, with ``--cp`` only those whose loss the model computes."""
    if not args.cp:
        return names
    return [n for n in names if shapes[n].get("loss", "inside") == "inside"]


def refuses(args: argparse.Namespace, chosen: list[str]) -> str | None:
    """Why ``--cp`` (or a CP row in ``chosen``) cannot run with these options, or None."""
    cp = args.cp
    if not cp:
        if set(chosen) & set(CP_IMPLS):
            return "the layershard-cp-* implementations need --cp N"
        return None
    if cp < 2:
        return f"--cp {cp}: context parallelism needs N >= 2 ranks per sequence"
    if args.tp or args.ep:
        return "--cp does not combine with --tp or --ep (layershard runs cp with data parallelism)"
    if args.hf_config:
        return "--cp runs the built-in Llama: use --model or --shape, not --hf-config"
    if args.loss != "inside":
        return (
            "--cp needs the model's own loss (over the labels shifted before the split): "
            "--loss inside, and not the deep or logits shapes"
        )
    bad = [n * args.nodes for n in args.nproc if (n * args.nodes) % cp]
    if bad:
        return f"--cp {cp} does not divide the world size {bad[0]}"
    if args.seq_len % (2 * cp):
        return f"--seq-len {args.seq_len} must be divisible by 2 x cp = {2 * cp}"
    from layershard.models import PRESETS, build_config

    if args.model not in PRESETS:
        return None  # run_shape refuses an unknown preset in its own words
    over: dict[str, Any] = {}
    for item in args.model_override:
        key, _, value = item.partition("=")
        over[key] = int(value) if value.lstrip("-").isdigit() else float(value)
    cfg = build_config(args.model, **over)
    if cfg.n_experts:
        return f"--cp: {args.model} is a mixture of experts, which cp does not run yet"
    if "all_to_all" in args.cp_mode and cfg.n_heads % cp:
        return f"--cp-mode all_to_all: n_heads={cfg.n_heads} must be divisible by --cp {cp}"
    return None


def wrap(impl: str, model: nn.Module, device: Any, bf16: bool, cp: int) -> nn.Module:
    """``ls.parallelize(model, cp=cp, cp_mode=...)`` in the mode the row's name says."""
    import torch

    import layershard as ls

    mp = ls.MixedPrecision(torch.bfloat16, torch.float32) if bf16 else None
    return ls.parallelize(model, cp=cp, cp_mode=CP_IMPLS[impl], mixed_precision=mp, device=device)


def loss(model: nn.Module, x: Any) -> Any:
    """The loss of the whole sequences ``x`` (the same on every rank of the CP group) from this
    rank's part of them."""
    from layershard.parallel.context import context_batch

    return model(**context_batch(model, x, labels=x)).loss
