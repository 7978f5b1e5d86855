"""``checkpoint_info``: what a checkpoint (or a run's checkpoints folder) holds, and whether it is
intact. Used by ``layershard checkpoint info``; needs no process group."""

from __future__ import annotations

import os
from pathlib import Path

from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import CheckpointError


def checkpoint_info(path: str | os.PathLike, verify: bool = True) -> dict:
    """``{"path", "ok", "error", "step", "world_size", "params", "numel", "optimizer", "files",
    "bytes", "created_unix", "layershard_version", "checkpoints" (siblings), "latest",
    "latest_error" (when ``latest`` names no complete checkpoint), "leftovers" (folders of
    interrupted saves)}``. Never raises for a bad checkpoint: ``ok`` is
    False and ``error`` says why."""
    from layershard.checkpoint.manifest import total_numel
    from layershard.checkpoint.validate import open_checkpoint

    p = Path(path)
    out: dict = {"path": str(p), "ok": False, "error": None}
    parent = (
        p
        if p.is_dir() and (p / pub.LATEST).is_file() and not (p / pub.MANIFEST).exists()
        else p.parent
    )
    if (parent / pub.LATEST).is_file():
        out["latest"] = (parent / pub.LATEST).read_text().strip()
        try:
            pub.resolve(parent)
        except CheckpointError as e:  # `--resume` then takes the newest complete checkpoint
            out["latest_error"] = str(e)
    out["checkpoints"] = [
        {"name": d.name, "step": s}
        for s, _, d in (pub.sibling_checkpoints(parent) if parent.is_dir() else [])
    ]
    out["leftovers"] = [d.name for d in pub.leftovers(parent)]
    try:
        folder = pub.resolve(p)
        out["path"] = str(folder)
        # The validation load_checkpoint and export run, then the summary from what it checked.
        folder, m, _ = open_checkpoint(folder, digest=verify)
        out.update(
            step=m.get("step"),
            world_size=m.get("world_size"),
            created_unix=m.get("created_unix"),
            layershard_version=m.get("layershard_version"),
            torch_version=m.get("torch_version"),
            model_class=m["model"].get("class"),
            model_kind=m["model"].get("kind"),
            params=len(m["model"]["params"]),
            numel=total_numel(m),
            optimizer=(m.get("optimizer") or {}).get("class"),
            extra=m.get("extra"),
            files=len(m["files"]),
            bytes=sum(r["bytes"] for r in m["files"].values()),
            write_seconds=m.get("write_seconds"),
        )
        out["ok"] = True
        out["verified"] = "sha256" if verify else "sizes"
    except CheckpointError as e:
        out["error"] = str(e)
    except OSError as e:
        out["error"] = f"{p}: cannot be read ({e})"
    return out
