"""Crash-safe publication of a checkpoint folder, the ``latest`` pointer, keep-last-K, integrity.

A save writes everything into ``<name>.tmp-<id>`` next to the final folder. Only after every rank
has written its files and the manifest (``layershard.json``, with the size and SHA-256 of every
file) is in place does rank 0 rename the folder to ``<name>`` (atomic on POSIX file systems) and
then update ``latest`` in the parent folder (write-temp + ``os.replace``). A crash at any point
leaves the previous checkpoint and ``latest`` untouched; the ``*.tmp-*`` folder it leaves is never
loaded and ``layershard checkpoint info`` reports it.

Saving again under the same name swaps the complete new folder and the old one in one step
(Linux ``renameat2(RENAME_EXCHANGE)``), so ``latest`` never names a missing folder. Where the file
system cannot exchange (NFS, macOS), the old folder is first renamed aside; a crash between that
rename and the next leaves ``latest`` naming a missing folder, and ``resolve()`` then takes the
complete new folder (``<name>.tmp-*``, manifest written) or else the old one (``<name>.trash-*``).
"""

from __future__ import annotations

import ctypes
import errno
import hashlib
import json
import logging
import os
import shutil
import sys
import uuid
from pathlib import Path
from typing import Any

from layershard.checkpoint.errors import CheckpointCorruptError, CheckpointNotFoundError

log = logging.getLogger("layershard")

MANIFEST = "layershard.json"
LATEST = "latest"
FORMAT = "layershard-checkpoint"
FORMAT_VERSION = 1
TMP_MARK = ".tmp-"
TRASH_MARK = ".trash-"


def tmp_name(final: Path) -> Path:
    return final.parent / f"{final.name}{TMP_MARK}{uuid.uuid4().hex[:10]}"


def fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:  # e.g. a platform without directory fds
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def write_atomic(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` so that readers see the old or the new content, never a part."""
    tmp = path.parent / f".{path.name}{TMP_MARK}{uuid.uuid4().hex[:8]}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def file_digest(path: Path, block: int = 8 << 20) -> tuple[int, str]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while chunk := f.read(block):
            h.update(chunk)
            size += len(chunk)
    return size, h.hexdigest()


def data_files(folder: Path) -> list[str]:
    """The DCP files of a checkpoint folder (everything but the manifest), sorted."""
    return sorted(
        p.name
        for p in folder.iterdir()
        if p.is_file() and p.name != MANIFEST and TMP_MARK not in p.name
    )


def verify_files(
    folder: Path, manifest: dict, names: list[str] | None = None, digest: bool = True
) -> str:
    """Check ``names`` (default: all files in the manifest) against the recorded size and SHA-256.
    Returns an error message, or "" when they match."""
    files = manifest.get("files")
    if not isinstance(files, dict) or not files:
        return f"{folder / MANIFEST}: no file list; the manifest is corrupt"
    for name in files if names is None else names:
        rec = files[name]
        p = folder / name
        if not p.is_file():
            return f"{p}: missing (the checkpoint lists it, {rec['bytes']} bytes)"
        size = p.stat().st_size
        if size != rec["bytes"]:
            what = "truncated" if size < rec["bytes"] else "larger than recorded"
            return f"{p}: {what} ({size} bytes, the manifest records {rec['bytes']})"
        if digest and file_digest(p)[1] != rec["sha256"]:
            return f"{p}: corrupt (SHA-256 differs from the one recorded at save time)"
    return ""


def read_manifest(folder: Path) -> dict:
    path = folder / MANIFEST
    if not path.is_file():
        raise CheckpointNotFoundError(
            f"{folder}: not a complete layershard checkpoint (no {MANIFEST}); "
            + (
                "it is the leftover of an interrupted save"
                if TMP_MARK in folder.name
                else "was the save interrupted, or is this another format?"
            )
        )
    try:
        with open(path) as f:
            manifest = json.load(f)
    except (ValueError, UnicodeDecodeError) as e:
        raise CheckpointCorruptError(f"{path}: corrupt manifest ({e})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointCorruptError(f"{path}: not a layershard checkpoint manifest")
    if manifest.get("format_version", 0) > FORMAT_VERSION:
        raise CheckpointCorruptError(
            f"{path}: format version {manifest['format_version']} is newer than this layershard "
            f"reads ({FORMAT_VERSION}); upgrade layershard"
        )
    return manifest


def resolve(path: str | os.PathLike) -> Path:
    """A checkpoint folder from ``path``: the folder itself, a ``latest`` file, or a folder with a
    ``latest`` file (a run's checkpoints folder)."""
    p = Path(path)
    if p.is_file() and p.name == LATEST:
        return _follow(p)
    if p.is_dir() and not (p / MANIFEST).exists() and (p / LATEST).is_file():
        return _follow(p / LATEST)
    if not p.exists():
        found = _interrupted_swap(p)
        if found is not None:
            return found
        raise CheckpointNotFoundError(f"{p}: no such checkpoint")
    return p


def _follow(latest: Path) -> Path:
    name = latest.read_text().strip()
    if not name or "/" in name or name in (".", ".."):
        raise CheckpointCorruptError(f"{latest}: does not name a checkpoint folder ({name!r})")
    target = latest.parent / name
    if not target.is_dir():
        found = _interrupted_swap(target)
        if found is not None:
            return found
        raise CheckpointNotFoundError(f"{latest} points to {name!r}, which does not exist")
    return target


def _interrupted_swap(final: Path) -> Path | None:
    """A same-name save that crashed between its two renames (no exchange available) leaves no
    ``final`` but a complete new ``final.tmp-*`` (its manifest is written before any rename) and
    the old ``final.trash-*``. The new one wins; either is a complete checkpoint."""
    if not final.parent.is_dir():
        return None
    for mark in (TMP_MARK, TRASH_MARK):
        done = [
            d
            for d in final.parent.glob(f"{final.name}{mark}*")
            if d.is_dir() and (d / MANIFEST).is_file()
        ]
        if done:
            chosen = max(done, key=lambda d: (d / MANIFEST).stat().st_mtime)
            log.warning(
                "layershard: %s is missing (a save of that name was interrupted); using %s",
                final,
                chosen.name,
            )
            return chosen
    return None


def exchange(a: Path, b: Path) -> bool:
    """Swap two folders in one atomic step (Linux ``renameat2(RENAME_EXCHANGE)``). False where the
    platform or the file system cannot (then nothing happened)."""
    if sys.platform != "linux":
        return False
    fn = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if fn is None:  # glibc older than 2.28
        return False
    at_fdcwd, rename_exchange = -100, 2
    if fn(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(err, os.strerror(err), str(b))


def publish(tmp: Path, final: Path, keep_last: int | None) -> None:
    """Rank 0, after every rank has written and the manifest is in ``tmp``: make it visible."""
    fsync_dir(tmp)
    old = None
    if final.exists():  # replacing a checkpoint of the same name
        if exchange(tmp, final):  # `final` is the new checkpoint now, `tmp` the old one
            old = tmp
        else:  # see the module docstring: resolve() covers a crash between these two renames
            old = final.parent / f"{final.name}{TRASH_MARK}{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
    else:
        os.rename(tmp, final)
    fsync_dir(final.parent)
    write_atomic(final.parent / LATEST, final.name + "\n")
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    for mark in (TMP_MARK, TRASH_MARK):  # leftovers of crashed saves of this name
        for stale in final.parent.glob(f"{final.name}{mark}*"):
            if stale.is_dir():
                shutil.rmtree(stale, ignore_errors=True)
    if keep_last is not None:
        prune(final.parent, keep_last, keep=final.name)


def sibling_checkpoints(parent: Path) -> list[tuple[int, float, Path]]:
    """Complete checkpoints in ``parent`` as ``(step, mtime, path)``, oldest first."""
    out = []
    for d in parent.iterdir():
        if not d.is_dir() or TMP_MARK in d.name or TRASH_MARK in d.name:
            continue
        try:
            m = read_manifest(d)
        except Exception:
            continue
        step = m.get("step")
        out.append((step if isinstance(step, int) else -1, (d / MANIFEST).stat().st_mtime, d))
    return sorted(out, key=lambda t: (t[0], t[1]))


def prune(parent: Path, keep_last: int, keep: str) -> list[Path]:
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be at least 1")
    ckpts = [d for _, _, d in sibling_checkpoints(parent)]
    doomed = [d for d in ckpts[: max(0, len(ckpts) - keep_last)] if d.name != keep]
    for d in doomed:
        trash = parent / f"{d.name}{TRASH_MARK}{uuid.uuid4().hex[:8]}"
        os.rename(d, trash)  # atomic: never a half-deleted checkpoint that looks complete
        shutil.rmtree(trash, ignore_errors=True)
    return doomed


def leftovers(parent: Path) -> list[Path]:
    """Folders of interrupted saves (or deletions) in ``parent``."""
    if not parent.is_dir():
        return []
    return sorted(
        d for d in parent.iterdir() if d.is_dir() and (TMP_MARK in d.name or TRASH_MARK in d.name)
    )


def dumps(obj: Any) -> str:
    return json.dumps(obj, indent=1, sort_keys=False)
