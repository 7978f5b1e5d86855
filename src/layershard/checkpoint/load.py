"""Loading a checkpoint at any world size: read, check, place. Everything is checked before
anything changes, and every phase is agreed by all the ranks (checkpoint/phases.py)."""

from __future__ import annotations

import logging
import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

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
from layershard.checkpoint.phases import Phases
from layershard.checkpoint.safe_read import dcp_load
from layershard.checkpoint.shards import buffers, dtype_from_name, params, sharded
from layershard.checkpoint.validate import check_files, open_checkpoint
from layershard.engine import dtensor
from layershard.engine.waits import waiting

log = logging.getLogger("layershard")


def _check_on_rank0(
    path, model, optimizer, strict: bool, verify: bool
) -> tuple[str, dict, dict[str, list[int]]]:
    """Rank 0: find the checkpoint, read its manifest, check everything that needs no data.
    Returns its folder, manifest and the size each parameter and optimizer state is stored with
    (1-D or N-D: ``boxes.stored_size``)."""
    try:
        # manifest, file sizes (hashes below, a share per rank), metadata, storage paths
        folder, manifest, md = open_checkpoint(path, digest=False, sizes=verify)
        validate(model, optimizer, folder, manifest, md, strict)
        sizes = {
            key: list(item.size)
            for key, item in md.state_dict_metadata.items()
            if key.startswith(("model/", "optim/")) and isinstance(item, TensorStorageMetadata)
        }
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError) as e:  # a manifest of the wrong structure
        raise CheckpointCorruptError(
            f"{path}: malformed manifest ({type(e).__name__}: {e})"
        ) from None
    return str(folder), manifest, sizes


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
    """Load a checkpoint saved by ``save_checkpoint()`` at any world size. Collective.

    ``path`` is a checkpoint folder, a ``latest`` file, or a folder holding ``latest``. Everything
    is checked before anything is changed: names, shapes and dtypes against the model (and the
    optimizer, when given), and, with ``verify``, the size and SHA-256 of every file (each rank
    checks a share). RNG states are restored when the world size is the one saved; otherwise every
    rank is re-seeded deterministically (from the step and its rank) and a warning says so.

    Returns ``{"step", "extra", "run_config", "world_size" (saved), "path", "rng_restored",
    "model_config", "layershard_version"}``.
    """
    t0 = time.perf_counter()
    ph = Phases(dtensor.checkpoint_group(model, "load_checkpoint()"))  # every rank of a TP model
    rank, world = ph.rank, ph.world
    model.quiesce()  # no gather in flight still reads a shard this overwrites
    # read: rank 0 finds the checkpoint, reads its manifest and checks what needs no data
    where, manifest, sizes = ph.rank0(
        "reading", lambda: _check_on_rank0(path, model, optimizer, strict, verify)
    )
    folder = Path(where)
    if verify:  # check: each rank hashes a share of the files
        names = sorted(manifest["files"])
        ph.each("checking", lambda: check_files(folder, manifest, names[rank::world]))
    # place: where every tensor goes, DCP's read into it, then the optimizer state and the RNG
    saved_world = manifest["world_size"]
    restore = restore_rng and saved_world == world
    state, new_state, rng = ph.each(
        "allocating", lambda: _targets(model, optimizer, folder, manifest, sizes, restore, rank)
    )
    ph.each("reading the tensors of", lambda: dcp_load(state, folder, process_group=ph.group))
    info = manifest.get("optimizer") if optimizer is not None else None
    step = manifest.get("step")
    ph.each("placing", lambda: _place(optimizer, info, new_state, rng, rank))
    if restore_rng and not rng:
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


def _targets(model, optimizer, folder: Path, manifest: dict, sizes: dict, restore: bool, rank: int):
    """What DCP reads into: the model's slices and buffers (in place), the optimizer's state
    (its current tensors where they fit, else new ones, installed by ``_place``) and this rank's
    RNG states (``restore``), each described with the size the checkpoint stores it with
    (``sizes``). Changes nothing."""
    state: dict[str, Any] = {}
    for f, slot, p in params(model):
        key = f"model/{slot.name}"
        state[key] = sharded(model, f, slot, p.detach(), save=False, size=sizes.get(key))
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
                        key = f"optim/{slot.name}/{k}"
                        state[key] = sharded(model, f, slot, t, save=False, size=sizes.get(key))
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
    rng = rng_entries(folder, manifest, rank) if restore else {}
    state.update(rng)
    return state, new_state, rng


def _place(optimizer, info: dict | None, new_state: dict, rng: dict, rank: int) -> None:
    """After DCP's read: the optimizer's state and hyperparameters, this rank's RNG states."""
    if info is not None and optimizer is not None:
        for p, st in new_state.items():
            optimizer.state[p] = st
        for g, saved in zip(optimizer.param_groups, info["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = hyper_from_json(v, g.get(k))
    if rng:
        restore_rng_state(rng, rank)
