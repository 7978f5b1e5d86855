"""Loading a checkpoint at any world size: everything is checked before anything changes, and
every check that can fail on one rank is agreed by all of them."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
)
from layershard.checkpoint.manifest import (
    hyper_from_json,
    optimizer_groups,
    reseed,
    restore_rng_state,
    rng_entries,
    validate,
)
from layershard.checkpoint.safe_read import dcp_load
from layershard.checkpoint.shards import (
    broadcast_from_rank0,
    buffers,
    dtype_from_name,
    group_of,
    params,
    sharded_1d,
)
from layershard.checkpoint.validate import check_files, open_checkpoint
from layershard.engine.agreement import agreed
from layershard.engine.waits import waiting

log = logging.getLogger("layershard")


def _check_on_rank0(path, model, optimizer, strict: bool, verify: bool) -> tuple[Path, dict]:
    """Rank 0: find the checkpoint, read its manifest, check everything that needs no data."""
    try:
        # manifest, file sizes (hashes below, a share per rank), metadata, storage paths
        folder, manifest, md = open_checkpoint(path, digest=False, sizes=verify)
        validate(model, optimizer, folder, manifest, md, strict)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a manifest of the wrong structure
        raise CheckpointCorruptError(
            f"{path}: malformed manifest ({type(e).__name__}: {e})"
        ) from None
    return folder, manifest


@torch.no_grad()
@waiting("checkpoint load")
def load_checkpoint(
    path: str | os.PathLike,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    *,
    strict: bool = True,
    restore_rng: bool = True,
    verify: bool = True,
) -> dict:
    """Load a checkpoint saved by :func:`save_checkpoint` at any world size. Collective.

    ``path`` is a checkpoint folder, a ``latest`` file, or a folder holding ``latest``. Everything
    is checked before anything is changed: names, shapes and dtypes against the model (and the
    optimizer, when given), and, with ``verify``, the size and SHA-256 of every file (each rank
    checks a share). RNG states are restored when the world size is the one saved; otherwise every
    rank is re-seeded deterministically (from the step and its rank) and a warning says so.

    Returns ``{"step", "extra", "run_config", "world_size" (saved), "path", "rng_restored",
    "model_config", "layershard_version"}``.
    """
    t0 = time.perf_counter()
    group, rank, world = group_of(model)

    model.quiesce()  # no gather in flight still reads a shard this overwrites
    folder, manifest = None, None
    with agreed(group):
        if rank == 0:
            folder, manifest = _check_on_rank0(path, model, optimizer, strict, verify)
    folder, manifest = broadcast_from_rank0(group, (str(folder), manifest))
    folder = Path(folder)

    if verify:
        with agreed(group):  # each rank hashes a share of the files
            names = sorted(manifest["files"])
            check_files(folder, manifest, names[rank::world])

    saved_world = manifest["world_size"]
    same_world = saved_world == world
    state: dict[str, Any] = {}
    for f, slot, p in params(model):
        state[f"model/{slot.name}"] = sharded_1d(
            model, p.detach(), slot.numel, f.param_ranges(slot), save=False
        )
    for key, b in buffers(model):
        if key in manifest["model"]["buffers"]:
            state[f"model/{key}"] = b

    new_state: dict[Any, dict] = {}
    info = manifest.get("optimizer") if optimizer is not None else None
    if info is not None and optimizer is not None:  # info is None without an optimizer
        for items, g in zip(optimizer_groups(model, optimizer), optimizer.param_groups):
            fused = bool(g.get("fused") or g.get("capturable"))
            for f, slot, p in items:
                kinds = info["state"].get(slot.name)
                if not kinds:
                    continue
                current = optimizer.state.get(p, {})
                st = new_state[p] = {}
                for k, rec in kinds.items():
                    if rec["kind"] == "value":
                        st[k] = rec["value"]
                        continue
                    dtype = dtype_from_name(rec["dtype"], f"{folder}: optim/{slot.name}/{k}")
                    old = current.get(k)
                    if rec["kind"] == "sharded":
                        t = (
                            old
                            if isinstance(old, torch.Tensor)
                            and old.shape == p.shape
                            and old.dtype == dtype
                            else torch.empty_like(p, dtype=dtype)
                        )
                        state[f"optim/{slot.name}/{k}"] = sharded_1d(
                            model, t, slot.numel, f.param_ranges(slot), save=False
                        )
                    else:
                        device = p.device if fused else torch.device("cpu")
                        t = (
                            old
                            if isinstance(old, torch.Tensor)
                            and old.dim() == 0
                            and old.dtype == dtype
                            else torch.zeros((), dtype=dtype, device=device)
                        )
                        state[f"optim/{slot.name}/{k}"] = t
                    st[k] = t

    rng: dict[str, torch.Tensor] = {}
    if restore_rng and same_world:
        with agreed(group):  # each rank checks its own entries
            rng = rng_entries(folder, manifest, rank)
        state.update(rng)

    dcp_load(state, folder, process_group=group)

    if info is not None and optimizer is not None:
        for p, st in new_state.items():
            optimizer.state[p] = st
        for g, saved in zip(optimizer.param_groups, info["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = hyper_from_json(v, g.get(k))
    step = manifest.get("step")
    if rng:
        with agreed(group):  # a corrupt state on one rank fails every rank, not that one alone
            restore_rng_state(rng, rank)
    elif restore_rng:
        seed = reseed(step, rank)
        if rank == 0:
            warnings.warn(
                f"load_checkpoint: the checkpoint was saved at world size {saved_world} and is loaded "
                f"at {world}: RNG states are not restored; every rank was re-seeded deterministically "
                f"(rank 0 with {seed})",
                stacklevel=3,
            )
    log.info("layershard: loaded %s in %.2f s", folder, time.perf_counter() - t0)
    return {
        "step": step,
        "extra": manifest.get("extra"),
        "run_config": manifest.get("run_config"),
        "world_size": saved_world,
        "path": str(folder),
        "rng_restored": bool(rng),
        "model_config": manifest["model"].get("config"),
        "layershard_version": manifest.get("layershard_version"),
    }
