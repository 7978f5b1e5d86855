"""What a checkpoint records, and the checks that need no data: ``collect`` gathers what a save
writes (tensors, the model's description, the optimizer's state and param groups, the RNG
states) in one walk; the rest reads it back: the RNG states, and the validation of a manifest and
DCP metadata against a model."""

from __future__ import annotations

import dataclasses
import json
import math
import random
import sys
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.metadata import (
    Metadata,
    TensorStorageMetadata,
)

from layershard.checkpoint import boxes
from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
)
from layershard.checkpoint.safe_read import SafeFileSystemReader
from layershard.checkpoint.shards import (
    buffers,
    dtype_name,
    jsonable,
    params,
    sharded,
)

# ---- what a save writes ------------------------------------------------------------------------


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
        return jsonable(dataclasses.asdict(cfg), "the model config")
    if hasattr(cfg, "to_dict"):
        return jsonable(cfg.to_dict(), "the model config")
    return None


@dataclasses.dataclass
class Collected:
    """What a save writes, gathered in one walk of the model and the optimizer: the tensors by
    DCP key (views of the live state; ``Chunked`` where each rank holds a slice) and the
    manifest's parts that describe them."""

    tensors: dict[str, Any]
    model: dict  # class, kind, config, params and buffers (shapes, dtypes)
    optimizer: dict | None  # class, param groups, the kinds of every parameter's state
    rng_keys: list[str]  # this rank's RNG entries ("torch", "py", "cuda")


def collect(model, optimizer: torch.optim.Optimizer | None, rank: int) -> Collected:
    """Everything a save of ``model`` (and ``optimizer``) writes on this rank, ``rank`` of the
    ranks that save (its RNG states' key)."""
    tensors: dict[str, Any] = {}
    described, index = {}, {}
    for f, slot, p in params(model):
        tensors[f"model/{slot.name}"] = sharded(model, f, slot, p.detach(), save=True)
        described[slot.name] = {
            "shape": list(slot.whole_shape),
            "dtype": dtype_name(f.dtype),  # fp32, or a frozen parameter's own (build._by_dtype)
            "requires_grad": slot.requires_grad,
            "aliases": [u.name for u in slot.uses[1:]],
        }
        index[id(p)] = (f, slot, p)
    bufs = {}
    for key, b in buffers(model):
        tensors[f"model/{key}"] = b.detach()
        bufs[key] = {"shape": list(b.shape), "dtype": dtype_name(b.dtype)}
    module = model.module
    desc = {
        "class": f"{type(module).__module__}.{type(module).__qualname__}",
        "kind": model_kind(module),
        "config": model_config(module),
        "params": described,
        "buffers": bufs,
    }
    optim = None if optimizer is None else _optimizer(model, optimizer, index, tensors)
    rng = rng_state(rank)
    tensors.update(rng)
    return Collected(tensors, desc, optim, sorted(k.split("/", 2)[2] for k in rng))


# ---- optimizer ---------------------------------------------------------------------------------


def optimizer_groups(model, optimizer, index: dict | None = None) -> list[list[tuple]]:
    """The optimizer's groups as lists of ``(flat, slot, param)`` (``index``: those by
    ``id(param)``, when the caller has them)."""
    by_id = index if index is not None else {id(p): (f, s, p) for f, s, p in params(model)}
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


def hyper_to_json(key: str, value):
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise CheckpointError(
                f"optimizer hyperparameter {key!r} is a tensor with {value.numel()} elements"
            )
        return {"__tensor__": value.item()}
    if isinstance(value, tuple):
        return [hyper_to_json(key, v) for v in value]
    return jsonable(value, f"optimizer hyperparameter {key!r}")


def hyper_from_json(value, current):
    if isinstance(value, dict) and "__tensor__" in value:
        if isinstance(current, torch.Tensor):
            current.fill_(value["__tensor__"])
            return current
        return torch.tensor(value["__tensor__"])
    if isinstance(value, list) and isinstance(current, tuple):
        return tuple(hyper_from_json(v, c) for v, c in zip(value, current))
    return value


def _optimizer(model, optimizer, index: dict, tensors: dict[str, Any]) -> dict:
    """The optimizer's part of the manifest; its state tensors go into ``tensors``."""
    kinds = {}
    groups = optimizer_groups(model, optimizer, index)
    for items in groups:
        for f, slot, p in items:
            k_of = {}
            for k, v in optimizer.state.get(p, {}).items():
                key = f"optim/{slot.name}/{k}"
                if isinstance(v, torch.Tensor) and v.dim() == 0:
                    k_of[k] = {"kind": "scalar", "dtype": dtype_name(v.dtype)}
                    tensors[key] = v.detach()
                elif isinstance(v, torch.Tensor) and v.shape == p.shape:
                    k_of[k] = {"kind": "sharded", "dtype": dtype_name(v.dtype)}
                    tensors[key] = sharded(model, f, slot, v.detach(), save=True)
                elif isinstance(v, torch.Tensor):
                    raise CheckpointError(
                        f"optimizer state {k!r} of {slot.name} has shape {tuple(v.shape)}: only "
                        "per-element state (like Adam's moments) and 0-d state can be saved sharded"
                    )
                else:
                    k_of[k] = {"kind": "value", "value": jsonable(v, f"optimizer state {k!r}")}
            if k_of:
                kinds[slot.name] = k_of
    return {
        "class": f"{type(optimizer).__module__}.{type(optimizer).__qualname__}",
        "param_groups": [
            {"params": [slot.name for _, slot, _ in items]}
            | {k: hyper_to_json(k, v) for k, v in g.items() if k != "params"}
            for items, g in zip(groups, optimizer.param_groups)
        ],
        "state": kinds,
    }


# ---- RNG ---------------------------------------------------------------------------------------


def rng_state(rank: int) -> dict[str, torch.Tensor]:
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


def restore_rng_state(tensors: dict[str, torch.Tensor], rank: int) -> None:
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


def rng_entries(folder: Path, manifest: dict, rank: int) -> dict[str, torch.Tensor]:
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


def reseed(step: int | None, rank: int) -> int:
    seed = (0x6C73 + 1_000_003 * (step or 0) + 7919 * rank) % (2**63)
    torch.manual_seed(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(seed % (2**32))
    return seed


# ---- load --------------------------------------------------------------------------------------


def check_tensor(
    md: Metadata, key: str, shape: list[int], dtype: str, where: Path, sharded: bool
) -> str:
    item = md.state_dict_metadata.get(key)
    if item is None:
        return f"{where}: the manifest lists {key} but the DCP metadata has no such entry (corrupt)"
    if not isinstance(item, TensorStorageMetadata):
        return f"{key}: stored as {type(item).__name__}, not a tensor"
    if list(item.size) != shape:
        return f"{key}: stored with shape {list(item.size)}, expected {shape}"
    stored = dtype_name(item.properties.dtype)
    if stored != dtype:
        return f"{key}: stored as {stored}, expected {dtype} (wrong dtype)"
    if sharded and len(shape) > 1:  # stored N-D (boxes.stored_size): covered exactly once
        why = boxes.covers(item.chunks, shape)
        if why:
            return f"{where}: {key}: {why} (corrupt metadata)"
    elif sharded and shape:  # the saved chunks must cover the whole tensor exactly once
        pos = 0
        for c in sorted(item.chunks, key=lambda c: c.offsets[0]):
            if c.offsets[0] != pos:
                return f"{where}: {key} has a gap or overlap at element {pos} (corrupt metadata)"
            pos += c.sizes[0]
        if pos != shape[0]:
            return f"{where}: {key} covers {pos} of {shape[0]} elements (corrupt metadata)"
    return ""


def stored(md: Metadata, key: str, whole: list[int]) -> list[int]:
    """The size a checkpoint stores a parameter of shape ``whole`` (or its per-element optimizer
    state) with: 1-D, or its N-D shape (``boxes.stored_size``: a row-parallel weight saved from a
    tensor-parallel layout). Anything else is expected 1-D: ``check_tensor`` names the mismatch."""
    size = list(getattr(md.state_dict_metadata.get(key), "size", None) or [])
    return size if len(whole) > 1 and size == list(whole) else [math.prod(whole)]


def names_diff(what: str, ours: list[str], theirs: list[str]) -> str:
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


def validate(model, optimizer, folder: Path, manifest: dict, md: Metadata, strict: bool) -> None:
    """Every check that needs no data: names, shapes, dtypes, coverage. Raises on the first error."""
    saved = manifest["model"]
    ours = {slot.name: (f, slot) for f, slot, _ in params(model)}
    if strict or any(n not in saved["params"] for n in ours):
        msg = names_diff("the model's parameters", list(ours), list(saved["params"]))
        if msg:
            raise CheckpointMismatchError(msg)
    for name, (f, slot) in ours.items():
        rec = saved["params"][name]
        if list(rec["shape"]) != list(slot.whole_shape):
            raise CheckpointMismatchError(
                f"model/{name}: the checkpoint has shape {tuple(rec['shape'])}, the model {tuple(slot.whole_shape)}"
            )
        key = f"model/{name}"
        if rec["dtype"] != dtype_name(f.dtype):
            raise CheckpointMismatchError(
                f"{key}: the checkpoint holds it as {rec['dtype']}, the model as "
                f"{dtype_name(f.dtype)}; load the model with the dtype it was saved with"
            )
        msg = check_tensor(
            md, key, stored(md, key, rec["shape"]), rec["dtype"], folder, sharded=True
        )
        if msg:
            raise CheckpointMismatchError(msg) if "expected" in msg else CheckpointCorruptError(msg)
    bufs = dict(buffers(model))
    msg = names_diff("the model's buffers", list(bufs), list(saved["buffers"]))
    if msg and strict:
        raise CheckpointMismatchError(msg)
    for key, b in bufs.items():
        if key in saved["buffers"]:
            msg = check_tensor(
                md, f"model/{key}", list(b.shape), dtype_name(b.dtype), folder, sharded=False
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
    groups = optimizer_groups(model, optimizer)
    if len(groups) != len(info["param_groups"]):
        raise CheckpointMismatchError(
            f"the optimizer has {len(groups)} param groups, the checkpoint's had {len(info['param_groups'])}"
        )
    for i, (items, g) in enumerate(zip(groups, info["param_groups"])):
        msg = names_diff(
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
            key = f"optim/{name}/{k}"
            shape = stored(md, key, list(slot.whole_shape)) if rec["kind"] == "sharded" else []
            msg = check_tensor(md, key, shape, rec["dtype"], folder, rec["kind"] == "sharded")
            if msg:
                raise CheckpointCorruptError(msg)


def total_numel(manifest: dict) -> int:
    return sum(math.prod(p["shape"]) for p in manifest["model"]["params"].values())
