"""Reading a checkpoint without trusting it: DCP's ``.metadata`` through an unpickler that
admits only DCP's own metadata classes, and DCP's reader refusing pickled entries."""

from __future__ import annotations

import pickle
import warnings
from pathlib import Path
from typing import Any

import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    Metadata,
)

from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
)

_DCP_METADATA = ".metadata"


# ---- reading DCP metadata without unpickling arbitrary objects ----------------------------------


def _safe_globals() -> dict[tuple[str, str], Any]:
    """The exact ``(module, name)`` pairs a DCP ``.metadata`` pickle may name, mapped to the objects
    themselves. Nothing is imported or looked up by name at load time: a dotted name such as
    ``os.system`` under an allowed module (pickle protocol 4 resolves those attribute by
    attribute) is simply not a key."""
    import collections
    import pathlib

    import torch.distributed.checkpoint.filesystem as dcp_fs
    import torch.distributed.checkpoint.metadata as dcp_md
    import torch.serialization

    allowed = {
        ("torch", "Size"): torch.Size,
        ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
        ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): dcp_fs._StorageInfo,
        ("collections", "OrderedDict"): collections.OrderedDict,
    }
    for name in (
        "Metadata",
        "MetadataIndex",
        "StorageMeta",
        "TensorStorageMetadata",
        "TensorProperties",
        "ChunkStorageMetadata",
        "BytesStorageMetadata",
        "_MEM_FORMAT_ENCODING",
    ):
        allowed["torch.distributed.checkpoint.metadata", name] = getattr(dcp_md, name)
    for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
        allowed["pathlib", name] = getattr(pathlib, name)
    for name, value in vars(torch).items():  # torch.float32, torch.channels_last, ...
        if isinstance(value, (torch.dtype, torch.memory_format)):
            allowed["torch", name] = value
    return allowed


class _MetadataUnpickler(pickle.Unpickler):
    """Loads DCP metadata and nothing else: ``find_class`` answers from a fixed table of exact
    ``(module, name)`` pairs and never imports a module or resolves an attribute path."""

    _allowed: dict[tuple[str, str], Any] | None = None

    def find_class(self, module: str, name: str):
        if _MetadataUnpickler._allowed is None:
            _MetadataUnpickler._allowed = _safe_globals()
        obj = _MetadataUnpickler._allowed.get((module, name))
        if obj is None:
            raise pickle.UnpicklingError(
                f"refusing to load {module}.{name}: not part of DCP metadata"
            )
        return obj


def read_dcp_metadata(folder: Path) -> Metadata:
    path = folder / _DCP_METADATA
    if not path.is_file():
        raise CheckpointCorruptError(f"{path}: missing (DCP metadata)")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except pickle.UnpicklingError as e:
        raise CheckpointCorruptError(
            f"{path}: untrusted DCP metadata, not loaded ({e}); the file names an object that DCP "
            "metadata never holds, as a file crafted to run code would. Nothing from it was "
            "executed; do not use this checkpoint"
        ) from None
    except Exception as e:
        raise CheckpointCorruptError(
            f"{path}: corrupt DCP metadata ({type(e).__name__}: {e})"
        ) from None
    if not isinstance(md, Metadata):
        raise CheckpointCorruptError(f"{path}: not DCP metadata ({type(md).__name__})")
    return md


class SafeFileSystemReader(dcp.FileSystemReader):
    """DCP's reader, with the metadata read by the restricted unpickler above, and no pickled
    objects: DCP loads a "bytes" entry with ``torch.load(weights_only=False)``, which runs any
    code the file holds. layershard saves tensors only, so a plan that asks for bytes comes from
    crafted metadata and is refused before any file is opened."""

    def read_data(self, plan: Any, planner: Any) -> Any:
        from torch.distributed.checkpoint.planner import LoadItemType

        for item in plan.items:
            if item.type == LoadItemType.BYTE_IO:
                raise CheckpointCorruptError(
                    f"{self.path}: the DCP metadata stores {item.dest_index.fqn} as pickled bytes; "
                    "layershard checkpoints hold tensors only, so it was not written by layershard "
                    "and is not loaded (nothing from it was executed)"
                )
        return super().read_data(plan, planner)

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        md = read_dcp_metadata(Path(self.path))
        storage_meta = getattr(md, "storage_meta", None)
        if storage_meta is None:
            from torch.distributed.checkpoint.metadata import StorageMeta

            storage_meta = md.storage_meta = StorageMeta()
        storage_meta.load_id = self.load_id
        return md


def dcp_load(state: dict, folder: Path, **kwargs: Any) -> None:
    """``dcp.load`` through the safe reader. DCP gathers every rank's failure into one
    ``CheckpointException``, a ``BaseException`` that ``except Exception`` misses; it becomes one
    ``CheckpointCorruptError`` naming the first failure."""

    try:
        with warnings.catch_warnings():
            # "assuming the intent is to load in a single process" (no_dist=True): yes
            warnings.simplefilter("ignore", UserWarning)
            dcp.load(state, storage_reader=SafeFileSystemReader(folder), **kwargs)
    except CheckpointException as e:
        rank, (exc, _) = next(iter(e.failures.items()))
        if isinstance(exc, CheckpointError):
            raise type(exc)(str(exc)) from None
        raise CheckpointCorruptError(
            f"{folder}: reading the checkpoint failed on rank {rank}: {type(exc).__name__}: {exc}"
        ) from None
    except (OSError, RuntimeError, ValueError) as e:
        raise CheckpointCorruptError(f"{folder}: reading the checkpoint failed: {e}") from e
