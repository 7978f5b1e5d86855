"""One validation of a checkpoint folder, run by everything that reads one: ``load_checkpoint``
(and so ``--resume``), ``checkpoint export`` and ``checkpoint info``. It needs no model and reads
no tensor data:

- the manifest's structure and JSON types (a wrong type is a one-line error, never a traceback);
- every file the manifest lists: a plain name in the folder, a regular file (not a symbolic link),
  of the recorded size (and, with ``digest``, SHA-256);
- DCP's metadata: every storage path it names is one of those files, so nothing outside the
  folder is read and every byte read is covered by a recorded hash; every chunk fits in the
  bytes stored for it (a tensor declared as 2 TB cannot be backed by a file of 200 KB);
- every tensor the manifest lists (parameters, buffers, optimizer state) in the metadata with its
  shape and dtype, its chunks covering it.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import Metadata, TensorStorageMetadata

from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from layershard.checkpoint.safe_read import read_dcp_metadata
from layershard.checkpoint.shards import dtype_from_name

_FROZEN_16 = ("bfloat16", "float16")  # what a frozen parameter may be stored as besides fp32


class _Bad(Exception):
    """A manifest field of the wrong type or value (``where``: its JSON path)."""


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _need(cond: bool, where: str, what: str) -> None:
    if not cond:
        raise _Bad(f"{where} must be {what}")


def _shape(v: Any, where: str) -> None:
    _need(isinstance(v, list) and all(_is_int(s) and s >= 0 for s in v), where,
          "a list of integers >= 0")  # fmt: skip


def _tensors(v: Any, where: str) -> None:
    _need(isinstance(v, dict), where, "an object")
    for name, rec in v.items():
        _need(isinstance(rec, dict), f"{where}.{name}", "an object")
        _shape(rec.get("shape"), f"{where}.{name}.shape")
        _need(isinstance(rec.get("dtype"), str), f"{where}.{name}.dtype", "a string")


def _structure(m: dict) -> None:
    files: Any = m.get("files")
    _need(isinstance(files, dict) and bool(files), "files", "a non-empty object")
    for name, rec in files.items():
        _need(
            name not in ("", ".", "..") and "/" not in name and "\\" not in name,
            f"files.{name}",
            "a file name in the checkpoint folder (no path)",
        )
        _need(isinstance(rec, dict), f"files.{name}", "an object")
        _need(_is_int(rec.get("bytes")) and rec["bytes"] >= 0, f"files.{name}.bytes",
              "an integer >= 0")  # fmt: skip
        _need(isinstance(rec.get("sha256"), str), f"files.{name}.sha256", "a string")
    _need(".metadata" in files, "files", "an object listing .metadata")
    for key in ("step",):
        _need(m.get(key) is None or _is_int(m[key]), key, "an integer or null")
    _need(_is_int(m.get("world_size")) and m["world_size"] >= 1, "world_size", "an integer >= 1")
    model: Any = m.get("model")
    _need(isinstance(model, dict), "model", "an object")
    _need(isinstance(model.get("kind"), str), "model.kind", "a string")
    _need(model.get("config") is None or isinstance(model["config"], dict), "model.config",
          "an object or null")  # fmt: skip
    _tensors(model.get("params"), "model.params")
    _tensors(model.get("buffers"), "model.buffers")
    for name, rec in model["params"].items():
        # fp32 masters; a frozen parameter may keep a 16-bit dtype (engine/build.py _by_dtype)
        kept = ("float32",) if rec.get("requires_grad", True) else ("float32", *_FROZEN_16)
        _need(
            rec["dtype"] in kept, f"model.params.{name}.dtype", " or ".join(f'"{d}"' for d in kept)
        )
    opt: Any = m.get("optimizer")
    if opt is not None:
        _need(isinstance(opt, dict), "optimizer", "an object or null")
        _need(isinstance(opt.get("class"), str), "optimizer.class", "a string")
        groups: Any = opt.get("param_groups")
        _need(isinstance(groups, list), "optimizer.param_groups", "a list")
        for i, g in enumerate(groups):
            where = f"optimizer.param_groups[{i}]"
            _need(isinstance(g, dict), where, "an object")
            p = g.get("params")
            _need(isinstance(p, list) and all(isinstance(x, str) for x in p), f"{where}.params",
                  "a list of parameter names")  # fmt: skip
        state: Any = opt.get("state")
        _need(isinstance(state, dict), "optimizer.state", "an object")
        for name, kinds in state.items():
            _need(name in model["params"], f"optimizer.state.{name}", "a parameter's state")
            _need(isinstance(kinds, dict), f"optimizer.state.{name}", "an object")
            for k, rec in kinds.items():
                where = f"optimizer.state.{name}.{k}"
                _need(isinstance(rec, dict), where, "an object")
                _need(rec.get("kind") in ("value", "scalar", "sharded"), f"{where}.kind",
                      '"value", "scalar" or "sharded"')  # fmt: skip
                if rec["kind"] != "value":
                    _need(isinstance(rec.get("dtype"), str), f"{where}.dtype", "a string")
    rng: Any = m.get("rng")
    _need(isinstance(rng, dict), "rng", "an object")
    keys: Any = rng.get("keys")
    _need(isinstance(keys, list) and all(isinstance(k, str) for k in keys), "rng.keys",
          "a list of strings")  # fmt: skip


def check_manifest(folder: Path, manifest: dict) -> None:
    """The manifest's structure and types; raises ``CheckpointCorruptError`` naming the field."""
    try:
        _structure(manifest)
    except _Bad as e:
        raise CheckpointCorruptError(f"{folder / pub.MANIFEST}: malformed manifest: {e}") from None


def _no_links(folder: Path, names) -> None:
    for name in names:
        p = folder / name
        if p.is_symlink():
            raise CheckpointCorruptError(
                f"{p}: a symbolic link (to {os.readlink(p)}); a checkpoint's files must be in its "
                "folder, not point elsewhere; copy the checkpoint with its files (cp -L)"
            )


def check_files(
    folder: Path, manifest: dict, names: list[str] | None = None, digest: bool = True
) -> None:
    """Every listed file (or ``names``) is a regular file in ``folder`` (no symbolic link, so
    nothing outside the folder), of the recorded size and, with ``digest``, SHA-256."""
    _no_links(folder, manifest["files"] if names is None else names)
    try:
        msg = pub.verify_files(folder, manifest, names, digest=digest)
    except OSError as e:
        msg = f"{folder}: {e}"
    if msg:
        raise CheckpointCorruptError(msg)


def check_storage(folder: Path, manifest: dict, md: Metadata) -> None:
    """DCP reads exactly the files the manifest hashes, inside the folder, and every chunk it
    declares fits in the bytes stored for it."""
    files = manifest["files"]
    meta = folder / ".metadata"
    chunks: dict[Any, tuple[str, int]] = {}  # storage index -> (tensor, bytes declared)
    for fqn, item in md.state_dict_metadata.items():
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointCorruptError(
                f"{meta}: {fqn} is stored as {type(item).__name__}; layershard checkpoints hold "
                "tensors only"
            )
        size = list(item.size)
        if not all(isinstance(s, int) and s >= 0 for s in size):
            raise CheckpointCorruptError(f"{meta}: {fqn} has an invalid size {size}")
        try:
            elem = torch.empty((), dtype=item.properties.dtype).element_size()
        except (TypeError, RuntimeError):
            raise CheckpointCorruptError(f"{meta}: {fqn} has no tensor dtype") from None
        for c in item.chunks:
            off, sz = list(c.offsets), list(c.sizes)
            if (
                len(off) != len(size)
                or len(sz) != len(size)
                or any(not (0 <= o and 0 <= s and o + s <= n) for o, s, n in zip(off, sz, size))
            ):
                raise CheckpointCorruptError(
                    f"{meta}: {fqn} has a chunk at {off} of {sz} outside its size {size}"
                )
            chunks[(fqn, tuple(off))] = (fqn, math.prod(sz) * elem)
    stored = set()
    for index, info in md.storage_data.items():
        rel = info.relative_path
        path = folder / str(rel)
        if (
            not isinstance(rel, str)
            or rel in ("", ".", "..")
            or "/" in rel
            or "\\" in rel
            or os.path.isabs(rel)
        ):
            raise CheckpointCorruptError(
                f"{meta}: {index.fqn} is stored in {rel!r}, outside the checkpoint folder; a "
                "checkpoint reads only its own files (refused, nothing read)"
            )
        if rel not in files:
            where = "missing" if not path.exists() else "present but not hashed"
            raise CheckpointCorruptError(
                f"{path}: the DCP metadata reads {index.fqn} from it, but the manifest does not "
                f"list it ({where}; a rank's file lost?)"
            )
        if getattr(info, "transform_descriptors", None):
            raise CheckpointCorruptError(
                f"{meta}: {index.fqn} is stored with transforms {info.transform_descriptors}; "
                "layershard never writes them"
            )
        off, length = info.offset, info.length
        if not (_is_int(off) and _is_int(length) and off >= 0 and length >= 0):
            raise CheckpointCorruptError(f"{meta}: {index.fqn} has an invalid storage range")
        if off + length > files[rel]["bytes"]:
            raise CheckpointCorruptError(
                f"{path}: {index.fqn} is stored at bytes {off}..{off + length}, beyond the file's "
                f"{files[rel]['bytes']} bytes"
            )
        key = (index.fqn, tuple(index.offset or ()))
        if key not in chunks:  # stored bytes that no tensor asks for: never read
            continue
        fqn, need = chunks[key]
        if need > length:
            raise CheckpointCorruptError(
                f"{meta}: {fqn} declares {need:,} bytes at {list(key[1])} but {rel} stores "
                f"{length:,} bytes for it (an absurd tensor size, or corrupt metadata)"
            )
        stored.add(key)
    lost = [k for k in chunks if k not in stored]
    if lost:
        raise CheckpointCorruptError(
            f"{meta}: {lost[0][0]} has a chunk at {list(lost[0][1])} with no stored data"
        )


def check_tensors(folder: Path, manifest: dict, md: Metadata) -> None:
    """Every tensor the manifest lists is in the metadata with its size and dtype, covered."""
    from layershard.checkpoint.manifest import check_tensor, stored

    model = manifest["model"]
    todo: list[tuple[str, list[int], str, bool]] = []
    for name, rec in model["params"].items():
        key = f"model/{name}"
        todo.append((key, stored(md, key, rec["shape"]), rec["dtype"], True))
    for key, rec in model["buffers"].items():
        todo.append((f"model/{key}", list(rec["shape"]), rec["dtype"], False))
    for name, kinds in ((manifest.get("optimizer") or {}).get("state") or {}).items():
        whole = model["params"][name]["shape"]
        for k, rec in kinds.items():
            if rec["kind"] != "value":
                key, sharded = f"optim/{name}/{k}", rec["kind"] == "sharded"
                shape = stored(md, key, whole) if sharded else []
                todo.append((key, shape, rec["dtype"], sharded))
    for key, shape, dtype, sharded in todo:
        dtype_from_name(dtype, f"{folder / pub.MANIFEST}: {key}")
        msg = check_tensor(md, key, shape, dtype, folder, sharded)
        if msg:  # as load's validate(): a wrong shape or dtype is a mismatch, a gap corruption
            raise CheckpointMismatchError(msg) if "expected" in msg else CheckpointCorruptError(msg)


def open_checkpoint(
    path: str | os.PathLike, digest: bool = True, sizes: bool = True
) -> tuple[Path, dict, Metadata]:
    """Resolve ``path`` and validate the checkpoint there (see the module docstring): file sizes
    with ``sizes``, SHA-256 with ``digest``. Returns ``(folder, manifest, DCP metadata)``; raises
    ``CheckpointError`` with one line."""
    folder = pub.resolve(path)
    _no_links(folder, [pub.MANIFEST])  # every file of a checkpoint, the manifest first
    manifest = pub.read_manifest(folder)
    try:
        check_manifest(folder, manifest)
        _no_links(folder, manifest["files"])  # always: a link could point anywhere
        if sizes or digest:  # sizes first: cheap, names a truncation
            check_files(folder, manifest, digest=False)
        md = read_dcp_metadata(folder)
        check_storage(folder, manifest, md)
        check_tensors(folder, manifest, md)
        if digest:
            check_files(folder, manifest)
    except CheckpointError:
        raise
    except (KeyError, TypeError, ValueError, AttributeError, OverflowError) as e:
        raise CheckpointCorruptError(
            f"{folder}: malformed checkpoint ({type(e).__name__}: {e})"
        ) from None
    return folder, manifest, md
