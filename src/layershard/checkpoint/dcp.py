"""Sharded, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP).

Every rank writes only its own slices, in parallel; a checkpoint saved at world size N loads at
any world size M because each entry records which part of the whole tensor every rank held, and
DCP reads, per rank, the overlap of the saved chunks with the slice the rank holds now.

Keys (one per original parameter, under its original name, whatever the unit layout):

    model/<name>             fp32, 1-D: the flattened parameter; each rank writes [a, b) of it
    model/<buffer>           persistent module buffers (replicated; written once)
    optim/<name>/<state>     per-element optimizer state (AdamW's exp_avg, exp_avg_sq): sharded
                             like the parameter; 0-d state (step): replicated
    rng/<rank>/torch|cuda|py the RNG states of every rank (uint8; "py" is JSON for random/numpy)

``layershard.json`` (the manifest) holds everything else as JSON: step, world size, the model's
config, names/shapes/dtypes, optimizer class and param groups, extra (e.g. the data loader's
position), the run config, and the size and SHA-256 of every file. Nothing is ever unpickled from
disk: tensors are read with ``torch.load(weights_only=True)`` (DCP), DCP's ``.metadata`` through
an unpickler that admits only DCP's own metadata classes, everything else is JSON.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import errno
import json
import logging
import math
import os
import pickle
import random
import shutil
import sys
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType
from torch.distributed.checkpoint.staging import AsyncStager

from layershard.agreement import agreed
from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from layershard.waits import waiting

log = logging.getLogger("layershard")

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
    from torch.distributed.checkpoint.api import CheckpointException

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


# ---- shards as DCP-native sharded tensors -------------------------------------------------------


class Shard1D(torch.Tensor):
    """A 1-D tensor of ``numel`` elements of which this rank holds ``[lo, hi)`` as ``local`` (a view
    into the flat parameter or the optimizer state: DCP reads into it in place).

    It speaks DCP's public checkpoint protocol (``__create_write_items__``, ``__create_chunk_list__``,
    ``__get_tensor_shard__``, as DTensor does), so DCP saves and reshards uneven 1-D slices without
    the deprecated ShardedTensor (``torch.distributed``'s ``_shard`` package). The chunks on disk are the ones
    ShardedTensor wrote (offset ``lo``, size ``hi - lo``, nothing for an empty slice), so checkpoints
    of either kind load with the other. A tensor subclass only because DCP looks shards up through
    ``isinstance(obj, torch.Tensor)``; it carries no data of its own and refuses every operation.
    """

    _local: torch.Tensor
    _lo: int

    @staticmethod
    def __new__(cls, local: torch.Tensor, numel: int, lo: int) -> Shard1D:
        if local.dim() != 1 or not 0 <= lo <= lo + local.numel() <= numel:
            raise ValueError(
                f"Shard1D: a 1-D slice [{lo}, {lo + local.numel()}) of a tensor of {numel} "
                "elements was expected"
            )
        t = torch.Tensor._make_wrapper_subclass(
            cls, (numel,), dtype=local.dtype, device=local.device, requires_grad=False
        )
        t._local, t._lo = local, lo
        return t

    # torch's own idiom (nn.Parameter's too); its stubs type the attribute as a method
    __torch_function__ = torch._C._disabled_torch_function_impl  # type: ignore[assignment]

    # the stubs declare Tensor.__torch_dispatch__ as the disabled implementation's function
    # rather than the classmethod protocol every subclass implements (DTensor ignores it too)
    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # type: ignore[override]
        raise RuntimeError(
            f"Shard1D only describes a checkpoint shard to DCP; {func} is not supported on it "
            "(use its local slice)"
        )

    # the default repr would dispatch; Tensor's takes a tensor_contents= that this one ignores
    def __repr__(self) -> str:  # type: ignore[override]
        return f"Shard1D(numel={self.shape[0]}, local=[{self._lo}, {self._hi}), {self.dtype})"

    @property
    def _hi(self) -> int:
        return self._lo + self._local.numel()

    def _chunk(self) -> ChunkStorageMetadata:
        return ChunkStorageMetadata(
            offsets=torch.Size([self._lo]), sizes=torch.Size([self._local.numel()])
        )

    def __create_write_items__(self, fqn: str, obj: Any) -> list[WriteItem]:
        if self._local.numel() == 0:  # this rank holds none of it: another rank writes it all
            return []
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size([self._lo])),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=self._chunk(),
                    # the properties ShardedTensor recorded: only the dtype is not a default
                    properties=TensorProperties(dtype=self.dtype),
                    size=self.shape,
                ),
            )
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [self._chunk()] if self._local.numel() else []

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        if index.offset is not None and tuple(index.offset) != (self._lo,):
            raise ValueError(
                f"{index.fqn}: this rank holds the slice at offset {self._lo}, not {tuple(index.offset)}"
            )
        return self._local


def slot_ranges(f, slot) -> list[tuple[int, int]]:
    """For every rank of ``f``'s layout, the part [a, b) of the flattened parameter it holds."""
    out = []
    for r in range(f.world_size):
        s = r * f.shard_numel
        lo = min(max(slot.offset, s), s + f.shard_numel)
        hi = max(min(slot.offset + slot.numel, s + f.shard_numel), lo)
        out.append((lo - slot.offset, hi - slot.offset))
    return out


def _sharded_1d(model, local: torch.Tensor, numel: int, ranges, save: bool) -> torch.Tensor:
    """``local`` (this rank's part ``ranges[shard rank]`` of a 1-D tensor of ``numel`` elements)
    as DCP should see it. The layout comes from the flat parameter, not from a collective. The
    ranks that hold a replica of another rank's slice (``hybrid``, ``no_shard``) write nothing:
    every chunk is saved once, and loads into every replica."""
    if numel == 0:
        return local
    if save and model.sharding.replica_index > 0:
        return Shard1D(local[:0], numel, 0)
    lo, hi = ranges[model.sharding.shard_rank]
    if local.numel() != hi - lo:
        raise CheckpointError(
            f"internal: a local slice of {local.numel()} elements for the range [{lo}, {hi})"
        )
    # an empty slice lies wholly before or after the parameter: its position does not matter
    return Shard1D(local, numel, lo if hi > lo else 0)


def _group(model):
    group = model.process_group
    return group, dist.get_rank(group), dist.get_world_size(group)


def _params(model):
    """``(flat, slot, shard_param)`` for every parameter, in unit order."""
    for f in model.flat_params:
        for slot, p in zip(f.slots, f.shard_params):
            yield f, slot, p


def _buffers(model):
    return model.persistent_buffers()


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def dtype_from_name(name: Any, where: str) -> torch.dtype:
    """The ``torch.dtype`` a manifest names ("float32"); anything else (a manifest is user input:
    ``getattr(torch, "load")`` is a function) is a corrupt manifest."""
    dtype = getattr(torch, name, None) if isinstance(name, str) and name.isidentifier() else None
    if not isinstance(dtype, torch.dtype):
        raise CheckpointCorruptError(f"{where}: {name!r} is not a torch dtype (corrupt manifest)")
    return dtype


def _broadcast(group, obj):
    if dist.get_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group_src=0, group=group)
    return box[0]


def _jsonable(value, what: str):
    try:
        return json.loads(json.dumps(value))
    except (TypeError, ValueError) as e:
        raise TypeError(
            f"{what} must be JSON-serializable (dicts, lists, numbers, strings): {e}"
        ) from None


# ---- model description --------------------------------------------------------------------------


def model_kind(module: torch.nn.Module) -> str:
    from layershard.models.llama import LlamaForCausalLM

    if isinstance(module, LlamaForCausalLM):
        return "layershard-llama"
    transformers = sys.modules.get("transformers")
    if transformers is not None and isinstance(module, transformers.PreTrainedModel):
        return "hf"
    return "module"


def model_config(module: torch.nn.Module) -> dict | None:
    cfg = getattr(module, "config", None)
    if cfg is None:
        return None
    if hasattr(cfg, "to_json_string"):  # transformers (its configs may be dataclasses too)
        d = json.loads(cfg.to_json_string(use_diff=False))
        if not d.get("architectures"):
            d["architectures"] = [type(module).__name__]
        return d
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        return _jsonable(dataclasses.asdict(cfg), "the model config")
    if hasattr(cfg, "to_dict"):
        return _jsonable(cfg.to_dict(), "the model config")
    return None


def describe_model(model) -> dict:
    module = model.module
    return {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "kind": model_kind(module),
        "config": model_config(module),
        "params": {
            slot.name: {
                "shape": list(slot.shape),
                "dtype": "float32",
                "requires_grad": slot.requires_grad,
                "aliases": [u.name for u in slot.uses[1:]],
            }
            for _, slot, _ in _params(model)
        },
        "buffers": {
            key: {"shape": list(b.shape), "dtype": _dtype_name(b.dtype)}
            for key, b in _buffers(model)
        },
    }


# ---- optimizer ---------------------------------------------------------------------------------


def _param_names(model, optimizer) -> list[list[tuple[Any, Any, torch.Tensor]]]:
    """The optimizer's groups as lists of ``(flat, slot, param)``."""
    by_id = {id(p): (f, slot, p) for f, slot, p in _params(model)}
    groups = []
    for i, g in enumerate(optimizer.param_groups):
        items = []
        for p in g["params"]:
            if id(p) not in by_id:
                raise CheckpointError(
                    f"optimizer param group {i} holds a tensor of shape {tuple(p.shape)} that is not "
                    "a parameter of this sharded model; build the optimizer from model.parameters()"
                )
            items.append(by_id[id(p)])
        groups.append(items)
    return groups


def _hyper_to_json(key: str, value):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(
                f"optimizer hyperparameter {key!r} is a tensor with {value.numel()} elements"
            )
        return {"__tensor__": value.item()}
    if isinstance(value, tuple):
        return [_hyper_to_json(key, v) for v in value]
    return _jsonable(value, f"optimizer hyperparameter {key!r}")


def _hyper_from_json(value, current):
    if isinstance(value, dict) and "__tensor__" in value:
        if isinstance(current, torch.Tensor):
            current.fill_(value["__tensor__"])
            return current
        return torch.tensor(value["__tensor__"])
    if isinstance(value, list) and isinstance(current, tuple):
        return tuple(_hyper_from_json(v, c) for v, c in zip(value, current))
    return value


def _optim_save(model, optimizer):
    tensors, kinds = {}, {}
    groups = _param_names(model, optimizer)
    for items in groups:
        for f, slot, p in items:
            st = optimizer.state.get(p, {})
            k_of = {}
            for k, v in st.items():
                key = f"optim/{slot.name}/{k}"
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    k_of[k] = {"kind": "scalar", "dtype": _dtype_name(v.dtype)}
                    tensors[key] = v.detach()
                elif isinstance(v, torch.Tensor) and v.shape == p.shape:
                    k_of[k] = {"kind": "sharded", "dtype": _dtype_name(v.dtype)}
                    tensors[key] = _sharded_1d(
                        model, v.detach(), slot.numel, slot_ranges(f, slot), save=True
                    )
                elif isinstance(v, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {k!r} of {slot.name} has shape {tuple(v.shape)}: only "
                        "per-element state (like Adam's moments) and 0-d state can be saved sharded"
                    )
                else:
                    k_of[k] = {"kind": "value", "value": _jsonable(v, f"optimizer state {k!r}")}
            if k_of:
                kinds[slot.name] = k_of
    info = {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": [
            {"params": [slot.name for _, slot, _ in items]}
            | {k: _hyper_to_json(k, v) for k, v in g.items() if k != "params"}
            for items, g in zip(groups, optimizer.param_groups)
        ],
        "state": kinds,
    }
    return tensors, info


# ---- RNG ---------------------------------------------------------------------------------------


def _rng_save(rank: int) -> dict[str, torch.Tensor]:
    out = {f"rng/{rank}/torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        out[f"rng/{rank}/cuda"] = torch.cuda.get_rng_state()
    version, state, gauss = random.getstate()
    py: dict[str, Any] = {"python": [version, list(state), gauss]}
    np = sys.modules.get("numpy")
    if np is not None:
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        py["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    out[f"rng/{rank}/py"] = torch.frombuffer(bytearray(json.dumps(py).encode()), dtype=torch.uint8)
    return out


def _rng_restore(tensors: dict[str, torch.Tensor], rank: int) -> None:
    torch.set_rng_state(tensors[f"rng/{rank}/torch"])
    if f"rng/{rank}/cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors[f"rng/{rank}/cuda"])
    py = json.loads(bytes(tensors[f"rng/{rank}/py"].tolist()).decode())
    version, state, gauss = py["python"]
    random.setstate((version, tuple(state), gauss))
    np = sys.modules.get("numpy")
    if np is not None and "numpy" in py:
        kind, keys, pos, has_gauss, cached = py["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))


def _rng_entries(folder: Path, manifest: dict, rank: int) -> dict[str, torch.Tensor]:
    """Empty tensors for this rank's RNG states, as the DCP metadata declares them."""
    out: dict[str, torch.Tensor] = {}
    rng_md: Metadata | None = None
    for k in manifest["rng"]["keys"]:
        key = f"rng/{rank}/{k}"
        if k == "cuda" and not torch.cuda.is_available():
            continue
        rng_md = rng_md or SafeFileSystemReader(folder).read_metadata()
        item = rng_md.state_dict_metadata.get(key)
        if not isinstance(item, TensorStorageMetadata):
            raise CheckpointCorruptError(f"{folder}: {key} is missing from the DCP metadata")
        out[key] = torch.empty(item.size, dtype=item.properties.dtype)
    return out


def _reseed(step: int | None, rank: int) -> int:
    seed = (0x6C73 + 1_000_003 * (step or 0) + 7919 * rank) % (2**63)
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (2**32))
    return seed


# ---- save --------------------------------------------------------------------------------------


# Per-tensor overhead of DCP's files (a zip record per tensor), for the free-space estimate.
_FILE_OVERHEAD = 4096


def _nbytes(state: dict[str, Any]) -> int:
    """Bytes this rank writes for ``state`` (its local slices), with DCP's per-tensor overhead."""
    total = 0
    for v in state.values():
        if isinstance(v, Shard1D):
            locals_ = [v._local]
        elif hasattr(v, "local_shards"):  # another DCP-sharded type (tests save the old format)
            locals_ = [s.tensor for s in v.local_shards()]
        else:
            locals_ = [v]
        total += sum(t.numel() * t.element_size() + _FILE_OVERHEAD for t in locals_)
    return total


def _is_disk_full(exc: BaseException | None) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if "No space left on device" in str(exc) or "Disk quota exceeded" in str(exc):
            return True
        failures = getattr(exc, "failures", None)  # DCP's CheckpointException: every rank's error
        if isinstance(failures, dict):
            if any(_is_disk_full(f[0] if isinstance(f, tuple) else f) for f in failures.values()):
                return True
        exc = exc.__cause__ or exc.__context__
    return False


def _no_space(parent: Path, need: int) -> CheckpointError:
    try:
        free = f", {shutil.disk_usage(parent).free:,} free"
    except OSError:
        free = ""
    return CheckpointError(
        f"no space left on {parent}: needed ~{need:,} bytes{free}; free some space (or save "
        "elsewhere); the previous checkpoint and `latest` are unchanged"
    )


def _sum_over_ranks(group, value: int) -> int:
    if dist.get_world_size(group) == 1:
        return value
    parts = [0] * dist.get_world_size(group)
    dist.all_gather_object(parts, value, group=group)
    return sum(parts)


class _Save:
    """One checkpoint save, in the order every rank runs it: collect the state (views), check the
    space and create the temporary folder, write (here or in the background), then finalize:
    hash, manifest, publish. Any failure removes the temporary folder and leaves the previous
    checkpoint and ``latest`` as they were."""

    def __init__(self, final: Path, model, group, keep_last: int | None, manifest: dict):
        self.final, self.model, self.group = final, model, group
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)
        self.keep_last, self.manifest = keep_last, manifest
        self.tmp: Path | None = None
        self.need = 0
        self.t0 = time.perf_counter()

    def prepare(self, state: dict[str, Any]) -> None:
        """Collective: free space, then the temporary folder (rank 0), agreed by every rank."""
        self.need = _sum_over_ranks(self.group, _nbytes(state)) + (1 << 20)  # + metadata
        tmp = None
        with agreed(self.group):
            if self.rank == 0:
                tmp = self._make_tmp()
        self.tmp = Path(_broadcast(self.group, str(tmp)))

    def _make_tmp(self) -> Path:
        """Rank 0: check the destination and the free space, create the temporary folder."""
        final = self.final
        try:
            if (
                final.exists()
                and not (final / pub.MANIFEST).is_file()
                and (not final.is_dir() or any(final.iterdir()))
            ):
                raise CheckpointError(
                    f"save_checkpoint: {final} exists and is not a layershard checkpoint; "
                    "refusing to replace it"
                )
            final.parent.mkdir(parents=True, exist_ok=True)
            if shutil.disk_usage(final.parent).free < self.need:
                raise _no_space(final.parent, self.need)
            tmp = pub.tmp_name(final)
            tmp.mkdir()
            return tmp
        except OSError as e:
            raise (
                _no_space(final.parent, self.need)
                if _is_disk_full(e)
                else CheckpointError(f"save_checkpoint: cannot create {final.parent}: {e}")
            ) from None

    def write(self, state: dict[str, Any]) -> None:
        """Collective (on ``self.group``): DCP writes every rank's slices into the folder."""
        assert self.tmp is not None, "prepare() creates the folder first"
        try:
            dcp.save(
                state,
                storage_writer=dcp.FileSystemWriter(self.tmp, sync_files=True),
                process_group=self.group,
            )
        except (Exception, CheckpointException) as e:  # the same on every rank (DCP agrees)
            self.fail(e)

    def fail(self, exc: BaseException) -> NoReturn:
        """Every rank has failed the same step: remove the temporary folder, raise one error."""
        if self.rank == 0 and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if isinstance(exc, CheckpointError) and not _is_disk_full(exc):
            raise exc
        if _is_disk_full(exc):
            raise _no_space(self.final.parent, self.need) from None
        raise CheckpointError(
            f"save_checkpoint: writing {self.final} failed ({type(exc).__name__}: {exc}); the "
            "previous checkpoint and `latest` are unchanged"
        ) from exc

    def finalize(self) -> Path:
        """Collective: hash a share of the files each, then rank 0 writes the manifest and
        publishes. Every failure is agreed on, so no rank waits for another."""
        group, rank, world, tmp = self.group, self.rank, self.world, self.tmp
        assert tmp is not None, "prepare() creates the folder first"
        t_write = time.perf_counter() - self.t0
        digests: dict[str, dict[str, Any]] = {}
        try:
            with agreed(group):
                try:
                    names = pub.data_files(tmp)
                    for name in names[rank::world]:
                        size, sha = pub.file_digest(tmp / name)
                        digests[name] = {"bytes": size, "sha256": sha}
                except OSError as e:
                    raise CheckpointError(f"save_checkpoint: cannot read back {tmp}: {e}") from None
        except CheckpointError as e:
            self.fail(e)
        parts: list[dict[str, Any]] = [digests]
        if world > 1:
            gathered: list[Any] = [None] * world
            dist.all_gather_object(gathered, digests, group=group)
            parts = gathered

        with agreed(group):
            if rank == 0:
                self._publish(tmp, parts, t_write)
        log.info("layershard: saved %s in %.2f s", self.final, time.perf_counter() - self.t0)
        return self.final

    def _publish(self, tmp: Path, parts: list[dict[str, Any]], t_write: float) -> None:
        """Rank 0: write the manifest and publish; on failure nothing of this save stays."""
        try:
            files = {k: v for part in parts for k, v in sorted(part.items())}
            manifest = dict(self.manifest)
            manifest["files"] = dict(sorted(files.items()))
            manifest["total_bytes"] = sum(v["bytes"] for v in files.values())
            manifest["write_seconds"] = round(t_write, 3)
            pub.write_atomic(tmp / pub.MANIFEST, pub.dumps(manifest))
            pub.publish(tmp, self.final, self.keep_last)
        except Exception as e:  # noqa: BLE001
            if tmp.exists():  # not published: nothing of this save stays behind
                shutil.rmtree(tmp, ignore_errors=True)
            raise (
                _no_space(self.final.parent, self.need)
                if _is_disk_full(e)
                else CheckpointError(f"save_checkpoint: publishing {self.final} failed: {e}")
            ) from None


class AsyncCheckpoint:
    """A checkpoint being written in the background by :func:`save_checkpoint` with
    ``async_save=True``. The state was copied when the call returned; ``wait()`` returns the
    published folder or raises the save's error. Until then the folder is a ``*.tmp-*`` one that
    is never loaded, exactly as for a synchronous save."""

    def __init__(self, path: Path, future: concurrent.futures.Future, stall_s: float):
        self.path, self._future = path, future
        self.stall_s = stall_s  # seconds the caller was blocked (staging, the previous save)
        self.observed = False  # wait() has returned or raised

    def done(self) -> bool:
        return self._future.done()

    def wait(self, timeout: float | None = None) -> Path:
        try:
            return self._future.result(timeout)
        finally:
            self.observed = self._future.done()


# One background save at a time per model: its staging buffers, its thread, the gloo group.
_ASYNC: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _AsyncState:
    def __init__(self, group):
        # DCP's background collectives must not interleave with the training thread's on the same
        # process group (and NCCL groups have no CPU backend, which async_save needs): a gloo group
        # of the same ranks. new_group() is collective on the default group.
        self.group = dist.new_group(dist.get_process_group_ranks(group), backend="gloo")
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "layershard-ckpt")
        self.buffers: dict[str, torch.Tensor] = {}
        self.pending: AsyncCheckpoint | None = None

    @staticmethod
    def close(group, executor: concurrent.futures.ThreadPoolExecutor) -> None:
        """When the model is gone: finish the last save, then destroy the group (its sockets
        and threads). Every rank drops its model, so every rank destroys its end."""
        executor.shutdown(wait=True)
        if dist.is_initialized():
            with contextlib.suppress(Exception):  # the default group may already be gone
                dist.destroy_process_group(group)


def _async_state(model, group) -> _AsyncState:
    st = _ASYNC.get(model)
    if st is None:
        st = _ASYNC[model] = _AsyncState(group)
        weakref.finalize(model, _AsyncState.close, st.group, st.executor)
    return st


class _PreStaged(AsyncStager):
    """An ``AsyncStager`` for a state that is already a private CPU copy (see ``_stage``)."""

    _synchronize_after_execute = False  # read by should_synchronize_after_execute

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _stage(state: dict[str, Any], buffers: dict[str, torch.Tensor]) -> dict[str, Any]:
    """A CPU copy of ``state`` that training cannot change: reused buffers, pinned on CUDA so the
    device-to-host copies are asynchronous (one synchronize at the end)."""
    out: dict[str, Any] = {}
    cuda = False
    for key, v in state.items():
        local = v._local if isinstance(v, Shard1D) else v
        buf = buffers.get(key)
        if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
            pin = local.device.type == "cuda"
            buf = buffers[key] = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
        buf.copy_(local, non_blocking=local.device.type == "cuda")
        cuda |= local.device.type == "cuda"
        out[key] = Shard1D(buf, v.shape[0], v._lo) if isinstance(v, Shard1D) else buf
    if cuda:
        torch.cuda.synchronize()
    return out


def wait_for_pending_save(model) -> Path | None:
    """Wait for ``model``'s asynchronous save in flight, if any; returns its folder, or None when
    there is none or it failed (its error is raised by its own ``wait()``; if nobody waited for
    it, it is logged here rather than raised by an unrelated save)."""
    st = _ASYNC.get(model)
    if st is None or st.pending is None:
        return None
    pending, st.pending = st.pending, None
    seen = pending.observed
    try:
        return pending.wait()
    except CheckpointError as e:
        if not seen:
            log.error("layershard: the asynchronous save of %s failed: %s", pending.path, e)
        return None


@torch.no_grad()
@waiting("checkpoint save")
def save_checkpoint(
    path: str | os.PathLike,
    model,
    optimizer: torch.optim.Optimizer | None = None,
    step: int | None = None,
    extra: dict | None = None,
    *,
    keep_last: int | None = None,
    run_config: dict | None = None,
    async_save: bool = False,
) -> Path | AsyncCheckpoint:
    """Save a resumable sharded checkpoint into the folder ``path``. Collective: every rank of the
    model's process group calls it with the same arguments; ``path`` must be on a file system all
    ranks share.

    Each rank writes its own slices in parallel; the folder becomes visible (atomic rename) only
    once every rank has finished and the manifest is written, then ``<parent>/latest`` names it.
    ``extra`` (JSON: e.g. the data loader's position, an LR scheduler's state) and ``run_config``
    (the resolved run config) come back from :func:`load_checkpoint`. With ``keep_last=K`` only the
    K newest checkpoints in the parent folder remain. Returns the checkpoint folder.

    A save that cannot fit (checked before writing) or runs out of space while writing raises
    ``CheckpointError("no space left on <folder>: needed ~N bytes ...")`` and removes what it wrote.

    ``async_save=True`` copies the state (to pinned CPU memory on CUDA) and returns an
    :class:`AsyncCheckpoint` at once; ``torch.distributed.checkpoint.async_save`` writes it in a
    background thread over a gloo group of the same ranks (created by the first asynchronous save:
    a collective on the default group), then the manifest and the publication follow, with the
    same crash safety. One save per model is in flight: a new save (either kind) waits for it.
    """
    from layershard import __version__

    t0 = time.perf_counter()
    group, rank, world = _group(model)
    final = Path(path).absolute()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint(keep_last={keep_last}): must be at least 1")
    if step is not None and not isinstance(step, int):
        raise TypeError(f"save_checkpoint(step={step!r}): must be an int")
    extra = _jsonable(extra, "save_checkpoint(extra=...)")
    run_config = _jsonable(run_config, "save_checkpoint(run_config=...)")
    wait_for_pending_save(model)

    # Every part that can fail on one rank only runs under an agreement, so no rank hangs.
    state: dict[str, Any] = {}
    optim_info = None
    with agreed(group):
        for f, slot, p in _params(model):
            state[f"model/{slot.name}"] = _sharded_1d(
                model, p.detach(), slot.numel, slot_ranges(f, slot), save=True
            )
        for key, b in _buffers(model):
            state[f"model/{key}"] = b.detach()
        if optimizer is not None:
            tensors, optim_info = _optim_save(model, optimizer)
            state.update(tensors)
        state.update(_rng_save(rank))
    kinds = [optim_info["state"] if optim_info else None]
    if world > 1:
        kinds = [None] * world
        dist.all_gather_object(kinds, optim_info["state"] if optim_info else None, group=group)
    if optim_info is not None and any(k != kinds[0] for k in kinds):
        raise CheckpointError(
            "save_checkpoint: the ranks' optimizers hold different kinds of state (has every rank "
            "stepped the same optimizer?)"
        )
    manifest = {
        "format": pub.FORMAT,
        "format_version": pub.FORMAT_VERSION,
        "layershard_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "step": step,
        "world_size": world,
        "extra": extra,
        "run_config": run_config,
        "model": describe_model(model),
        "optimizer": optim_info,
        "rng": {"world_size": world, "keys": sorted(k.split("/", 2)[2] for k in _rng_save(0))},
    }

    if not async_save:
        save = _Save(final, model, group, keep_last, manifest)
        save.prepare(state)
        save.write(state)
        return save.finalize()

    st = _async_state(model, group)
    save = _Save(final, model, st.group, keep_last, manifest)
    save.prepare(state)
    assert save.tmp is not None  # prepare() created it
    staged = _stage(state, st.buffers)
    try:
        with warnings.catch_warnings():
            # "async_save is experimental": layershard pins the torch version it is tested with
            warnings.simplefilter("ignore", UserWarning)
            upload = dcp.async_save(
                staged,
                storage_writer=dcp.FileSystemWriter(save.tmp, sync_files=True),
                process_group=st.group,
                async_stager=_PreStaged(),
            )
    except (Exception, CheckpointException) as e:
        save.fail(e)
    # _PreStaged.stage() returns the state itself, not a future: async_save returns the upload's
    assert isinstance(upload, concurrent.futures.Future)

    def finish() -> Path:
        try:
            upload.result()
        except (Exception, CheckpointException) as e:
            save.fail(e)
        return save.finalize()

    handle = AsyncCheckpoint(final, st.executor.submit(finish), time.perf_counter() - t0)
    st.pending = handle
    return handle


# ---- load --------------------------------------------------------------------------------------


def _check_tensor(
    md: Metadata, key: str, shape: list[int], dtype: str, where: Path, sharded: bool
) -> str:
    item = md.state_dict_metadata.get(key)
    if item is None:
        return f"{where}: the manifest lists {key} but the DCP metadata has no such entry (corrupt)"
    if not isinstance(item, TensorStorageMetadata):
        return f"{key}: stored as {type(item).__name__}, not a tensor"
    if list(item.size) != shape:
        return f"{key}: stored with shape {list(item.size)}, expected {shape}"
    stored = _dtype_name(item.properties.dtype)
    if stored != dtype:
        return f"{key}: stored as {stored}, expected {dtype} (wrong dtype)"
    if sharded and shape:  # the saved chunks must cover the whole tensor exactly once
        pos = 0
        for c in sorted(item.chunks, key=lambda c: c.offsets[0]):
            if c.offsets[0] != pos:
                return f"{where}: {key} has a gap or overlap at element {pos} (corrupt metadata)"
            pos += c.sizes[0]
        if pos != shape[0]:
            return f"{where}: {key} covers {pos} of {shape[0]} elements (corrupt metadata)"
    return ""


def _names_diff(what: str, ours: list[str], theirs: list[str]) -> str:
    missing = [n for n in ours if n not in set(theirs)]
    unexpected = [n for n in theirs if n not in set(ours)]
    if not missing and not unexpected:
        return ""

    def show(xs):
        return ", ".join(xs[:6]) + (f", ... ({len(xs)} in all)" if len(xs) > 6 else "")

    parts = []
    if missing:
        parts.append(f"missing from the checkpoint: {show(missing)}")
    if unexpected:
        parts.append(f"in the checkpoint but not in the model: {show(unexpected)}")
    return f"{what} differ from the checkpoint's ({'; '.join(parts)}); is it a checkpoint of this model?"


def _validate(model, optimizer, folder: Path, manifest: dict, md: Metadata, strict: bool) -> None:
    """Every check that needs no data: names, shapes, dtypes, coverage. Raises on the first error."""
    saved = manifest["model"]
    ours = {slot.name: (f, slot) for f, slot, _ in _params(model)}
    if strict or any(n not in saved["params"] for n in ours):
        msg = _names_diff("the model's parameters", list(ours), list(saved["params"]))
        if msg:
            raise CheckpointMismatchError(msg)
    for name, (_, slot) in ours.items():
        rec = saved["params"][name]
        if list(rec["shape"]) != list(slot.shape):
            raise CheckpointMismatchError(
                f"model/{name}: the checkpoint has shape {tuple(rec['shape'])}, the model {tuple(slot.shape)}"
            )
        msg = _check_tensor(md, f"model/{name}", [slot.numel], "float32", folder, sharded=True)
        if msg:
            raise CheckpointMismatchError(msg) if "expected" in msg else CheckpointCorruptError(msg)
    bufs = dict(_buffers(model))
    msg = _names_diff("the model's buffers", list(bufs), list(saved["buffers"]))
    if msg and strict:
        raise CheckpointMismatchError(msg)
    for key, b in bufs.items():
        if key in saved["buffers"]:
            msg = _check_tensor(
                md, f"model/{key}", list(b.shape), _dtype_name(b.dtype), folder, sharded=False
            )
            if msg:
                raise (
                    CheckpointMismatchError(msg)
                    if "expected" in msg
                    else CheckpointCorruptError(msg)
                )
    if optimizer is None:
        return
    info = manifest.get("optimizer")
    if info is None:
        raise CheckpointMismatchError(
            f"{folder}: the checkpoint has no optimizer state (saved without optimizer=)"
        )
    cls = f"{type(optimizer).__module__}.{type(optimizer).__qualname__}"
    if info["class"] != cls:
        raise CheckpointMismatchError(
            f"the checkpoint's optimizer is {info['class']}, this one is {cls}"
        )
    groups = _param_names(model, optimizer)
    if len(groups) != len(info["param_groups"]):
        raise CheckpointMismatchError(
            f"the optimizer has {len(groups)} param groups, the checkpoint's had {len(info['param_groups'])}"
        )
    for i, (items, g) in enumerate(zip(groups, info["param_groups"])):
        msg = _names_diff(
            f"the parameters of optimizer param group {i}",
            [s.name for _, s, _ in items],
            g["params"],
        )
        if msg:
            raise CheckpointMismatchError(msg)
    for name, kinds in info["state"].items():
        _, slot = ours[name]
        for k, rec in kinds.items():
            if rec["kind"] == "value":
                continue
            shape = [slot.numel] if rec["kind"] == "sharded" else []
            msg = _check_tensor(
                md, f"optim/{name}/{k}", shape, rec["dtype"], folder, rec["kind"] == "sharded"
            )
            if msg:
                raise CheckpointCorruptError(msg)


def _check_on_rank0(path, model, optimizer, strict: bool, verify: bool) -> tuple[Path, dict]:
    """Rank 0: find the checkpoint, read its manifest, check everything that needs no data."""
    try:
        folder = pub.resolve(path)
        manifest = pub.read_manifest(folder)
        if "model" not in manifest or "files" not in manifest:
            raise CheckpointCorruptError(f"{folder / pub.MANIFEST}: incomplete manifest")
        if verify:  # sizes first (cheap): a truncated file is named before anything is parsed
            msg = pub.verify_files(folder, manifest, digest=False)
            if msg:
                raise CheckpointCorruptError(msg)
        md = read_dcp_metadata(folder)
        _validate(model, optimizer, folder, manifest, md, strict)
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
    group, rank, world = _group(model)

    model.quiesce()  # no gather in flight still reads a shard this overwrites
    folder, manifest = None, None
    with agreed(group):
        if rank == 0:
            folder, manifest = _check_on_rank0(path, model, optimizer, strict, verify)
    folder, manifest = _broadcast(group, (str(folder), manifest))
    folder = Path(folder)

    if verify:
        with agreed(group):  # each rank hashes a share of the files
            names = sorted(manifest["files"])
            try:
                msg = pub.verify_files(folder, manifest, names[rank::world])
            except OSError as e:
                msg = f"{folder}: {e}"
            if msg:
                raise CheckpointCorruptError(msg)

    saved_world = manifest["world_size"]
    same_world = saved_world == world
    state: dict[str, Any] = {}
    for f, slot, p in _params(model):
        state[f"model/{slot.name}"] = _sharded_1d(
            model, p.detach(), slot.numel, slot_ranges(f, slot), save=False
        )
    for key, b in _buffers(model):
        if key in manifest["model"]["buffers"]:
            state[f"model/{key}"] = b

    new_state: dict[Any, dict] = {}
    info = manifest.get("optimizer") if optimizer is not None else None
    if info is not None and optimizer is not None:  # info is None without an optimizer
        for items, g in zip(_param_names(model, optimizer), optimizer.param_groups):
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
                        state[f"optim/{slot.name}/{k}"] = _sharded_1d(
                            model, t, slot.numel, slot_ranges(f, slot), save=False
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
            rng = _rng_entries(folder, manifest, rank)
        state.update(rng)

    dcp_load(state, folder, process_group=group)

    if info is not None and optimizer is not None:
        for p, st in new_state.items():
            optimizer.state[p] = st
        for g, saved in zip(optimizer.param_groups, info["param_groups"]):
            for k, v in saved.items():
                if k != "params":
                    g[k] = _hyper_from_json(v, g.get(k))
    step = manifest.get("step")
    if rng:
        with agreed(group):  # a corrupt state on one rank fails every rank, not that one alone
            _rng_restore(rng, rank)
    elif restore_rng:
        seed = _reseed(step, rank)
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


def total_numel(manifest: dict) -> int:
    return sum(math.prod(p["shape"]) for p in manifest["model"]["params"].values())
