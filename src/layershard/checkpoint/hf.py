"""Hugging Face interop: sharded safetensors out (``export_hf``), slices in (``load_hf``).

Export gathers one flat group (a unit's parameters) at a time; rank 0 writes them into
``model-0000i-of-0000N.safetensors`` files of at most ``max_shard_size`` bytes with
``model.safetensors.index.json`` and ``config.json``: no rank ever holds the whole model. Our
Llama's names map to HF ``LlamaForCausalLM``'s (both use the ``rotate_half`` RoPE layout, so q/k
need no permutation); a transformers model keeps its names. A tied parameter is written once,
under its first name (``lm_head.weight`` is absent when tied, as in ``save_pretrained``).

``load_hf`` opens the files with ``safetensors.safe_open`` and reads, per parameter, only the slice
the rank holds, as a few N-D boxes of the whole tensor (``get_slice``; checkpoint/boxes.py: also an
expert-parallel rank's experts, a tensor-parallel rank's shard): a 70B model loads without being
materialized on any rank. The model can come from the meta device (``ls.shard(meta_model)``). A
tensor-parallel model exports and loads over every rank: its export writes, byte for byte, what a
1-D model with the same weights writes.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import uuid
from pathlib import Path

import torch
import torch.distributed as dist

from layershard.checkpoint import boxes
from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from layershard.checkpoint.manifest import check_tensor, model_config, model_kind, stored
from layershard.checkpoint.safe_read import dcp_load
from layershard.checkpoint.shards import buffers, dtype_from_name, params
from layershard.checkpoint.validate import open_checkpoint
from layershard.engine import dtensor
from layershard.engine.agreement import agreed
from layershard.engine.waits import waiting

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
_ST_FLOAT = {"F64", "F32", "F16", "BF16", "F8_E4M3", "F8_E5M2"}
_IGNORED_HF_KEYS = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def parse_size(size: int | str) -> int:
    """``2_000_000_000``, ``"2GB"``, ``"500MB"``, ``"1GiB"`` -> bytes."""
    if isinstance(size, int):
        return size
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]?i?B)?\s*", str(size), re.IGNORECASE)
    if not m:
        raise ValueError(f"max_shard_size={size!r}: use bytes or e.g. '2GB', '500MB'")
    unit = (m.group(2) or "B").upper()
    mult = {
        "B": 1,
        "KB": 10**3,
        "MB": 10**6,
        "GB": 10**9,
        "TB": 10**12,
        "KIB": 2**10,
        "MIB": 2**20,
        "GIB": 2**30,
        "TIB": 2**40,
    }
    return int(float(m.group(1)) * mult[unit])


# ---- names and config ----------------------------------------------------------------------------


def _namer(kind: str):
    if kind == "layershard-llama":
        from layershard.models.llama import to_hf_name

        return to_hf_name
    return lambda name: name


def _hf_config_dict(kind: str, config: dict | None, dtype: torch.dtype) -> dict | None:
    dtype_name = str(dtype).removeprefix("torch.")
    if kind == "layershard-llama":
        from layershard.models.llama import LlamaConfig, hf_llama_config

        assert config is not None, "a layershard Llama always records its (dataclass) config"
        cfg = hf_llama_config(LlamaConfig(**config))
        cfg.architectures = [type(cfg).__name__.removesuffix("Config") + "ForCausalLM"]
        d = json.loads(cfg.to_json_string(use_diff=False))
    elif config is not None:
        d = dict(config)
    else:
        return None
    d["torch_dtype"] = dtype_name
    d["dtype"] = dtype_name
    return d


class ShardedSafetensorsWriter:
    """Collects named tensors into safetensors files of at most ``max_bytes`` (a tensor larger
    than that gets a file of its own), then names them ``model-0000i-of-0000N`` and writes the
    index. Files appear under temporary names until ``close()``."""

    def __init__(self, out_dir: Path, max_bytes: int):
        self.out_dir, self.max_bytes = out_dir, max_bytes
        self.tag = uuid.uuid4().hex[:8]
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.files: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, t: torch.Tensor) -> None:
        n = t.numel() * t.element_size()
        if self.pending and self.pending_bytes + n > self.max_bytes:
            self.flush()
        self.pending[name] = t.contiguous()
        self.pending_bytes += n
        self.total += n

    def flush(self) -> None:
        from safetensors import SafetensorError
        from safetensors.torch import save_file

        if not self.pending:
            return
        path = self.out_dir / f".part-{self.tag}-{len(self.files):05d}.safetensors"
        try:
            save_file(self.pending, str(path), metadata={"format": "pt"})
        except SafetensorError as e:  # the OS's error (a full disk, a file-size limit) inside
            path.unlink(missing_ok=True)
            raise OSError(
                f"writing a safetensors file failed ({e}); free disk space or raise the "
                "file-size limit (ulimit -f), then export again"
            ) from None
        self.files.append((path, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[str]:
        self.flush()
        n = len(self.files)
        weight_map = {}
        names = []
        for i, (path, keys) in enumerate(self.files):
            name = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(path, self.out_dir / name)
            names.append(name)
            for k in keys:
                weight_map[k] = name
        index = {
            "metadata": {"total_size": self.total},
            "weight_map": dict(sorted(weight_map.items())),
        }
        pub.write_atomic(self.out_dir / INDEX, json.dumps(index, indent=2))
        return names


def _ours(name: str) -> bool:
    """Files an export writes (and replaces); everything else in the folder is the user's."""
    return name in (INDEX, SINGLE, "config.json") or bool(
        re.fullmatch(r"model-\d+-of-\d+\.safetensors", name)
    )


def _link_or_copy(src: str, dst: str) -> None:
    try:
        os.link(src, dst)  # the same bytes, no copy (the old folder is deleted after the swap)
    except OSError:
        shutil.copy2(src, dst)


class _Staging:
    """An export's output folder, written in a temporary sibling and swapped in only when
    complete: a failed export leaves what ``out`` held untouched (and nothing else behind). The
    user's files in ``out`` that an export does not write (a tokenizer, a README) are kept."""

    def __init__(self, out: Path):
        if out.exists() and not out.is_dir():
            raise CheckpointError(
                f"{out}: exists and is not a folder; choose another output folder"
            )
        self.out = out
        try:
            out.parent.mkdir(parents=True, exist_ok=True)
            self.tmp = out.parent / f".{out.name}{pub.TMP_MARK}{uuid.uuid4().hex[:10]}"
            self.tmp.mkdir()
        except OSError as e:
            raise CheckpointError(f"cannot write to {out}: {e}") from None

    def commit(self) -> None:
        out, tmp = self.out, self.tmp
        if out.is_dir():
            for p in out.iterdir():
                if _ours(p.name) or (tmp / p.name).exists():
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.copytree(p, tmp / p.name, symlinks=True, copy_function=_link_or_copy)
                elif p.is_symlink():
                    os.symlink(os.readlink(p), tmp / p.name)
                else:
                    _link_or_copy(str(p), str(tmp / p.name))
            pub.fsync_dir(tmp)
            if pub.exchange(tmp, out):  # one atomic step: `out` is the new folder now
                old = tmp
            else:
                old = out.parent / f".{out.name}{pub.TRASH_MARK}{uuid.uuid4().hex[:8]}"
                os.rename(out, old)
                os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        pub.fsync_dir(out.parent)

    def discard(self) -> None:
        shutil.rmtree(self.tmp, ignore_errors=True)


# ---- export from a live sharded model ------------------------------------------------------------


@torch.no_grad()
@waiting("HF export")
def export_hf(
    model,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = "2GB",
) -> Path | None:
    """Write the sharded model as Hugging Face safetensors shards + index + ``config.json`` into
    ``out_dir`` (rank 0 writes; collective). Streams one flat group at a time. Loadable by
    ``transformers.AutoModelForCausalLM.from_pretrained(out_dir)`` for our Llama and for
    transformers models. Returns ``out_dir`` on rank 0, None elsewhere."""
    everyone = dtensor.checkpoint_group(model, "export_hf()")  # every rank of a TP model
    if any(f.packed for f in model.flat_params):  # every rank sees the same flats
        raise ValueError(
            "export_hf: this model has 4-bit (bitsandbytes) weights; ls.hf.export_merged writes "
            "it dequantized with its LoRA adapters merged, ls.hf.save_adapter the adapters alone"
        )
    group = everyone  # one rank writes; every failure is every rank's
    rank = dist.get_rank(group)
    out = Path(out_dir)
    module = model.module
    kind = model_kind(module)
    rename = _namer(kind)
    cap = parse_size(max_shard_size)

    writer: ShardedSafetensorsWriter | None = None
    staging: _Staging | None = None
    with agreed(group):
        if rank == 0:
            try:
                staging = _Staging(out)
            except CheckpointError as e:
                raise CheckpointError(f"export_hf: {e}") from None
            writer = ShardedSafetensorsWriter(staging.tmp, cap)

    err: Exception | None = None  # rank 0's, kept until every unit is gathered
    for f in model.flat_params:
        buf = model.gather_flat(f)  # over its group (each replica holds the same)
        whole = model.whole_views(f, buf)  # experts, TP shards: over the EP, TP group too
        if rank == 0 and err is None:
            assert writer is not None  # rank 0 created it, or agreed raised
            try:
                for slot, t in zip(f.slots, whole):
                    writer.add(rename(slot.name), t.to("cpu", dtype, copy=True))
            except Exception as e:  # noqa: BLE001 - raised on every rank below
                err = e
        del buf
    with agreed(group):
        if rank == 0:
            assert writer is not None and staging is not None  # rank 0 made them, or agreed raised
            try:
                if err is not None:
                    raise err
                for key, b in buffers(model):
                    writer.add(rename(key), b.detach().to("cpu", copy=True))
                writer.close()
                cfg = _hf_config_dict(kind, model_config(module), dtype)
                if cfg is not None:
                    text = json.dumps(cfg, indent=2, sort_keys=True)
                    pub.write_atomic(staging.tmp / "config.json", text)
                staging.commit()
            except Exception as e:  # noqa: BLE001
                staging.discard()  # `out` keeps what it held
                if isinstance(e, CheckpointError):
                    raise
                raise CheckpointError(f"export_hf: writing {out} failed: {e}") from e
    return out if rank == 0 else None


# ---- offline export from a checkpoint folder (no process group, no GPU) -------------------------


@torch.no_grad()
def export_checkpoint(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: torch.dtype = torch.bfloat16,
    max_shard_size: int | str = "2GB",
    verify: bool = True,
) -> Path:
    """Convert a layershard checkpoint into HF safetensors (+ config) in one process, without a
    process group or GPU, reading at most ``max_shard_size`` of parameters at a time."""

    # the validation load_checkpoint and `checkpoint info` run; with `verify` it hashes every
    # file DCP reads below (check_storage: DCP reads only files the manifest lists and hashes)
    folder, manifest, md = open_checkpoint(path, digest=verify)
    info = manifest["model"]
    kind = info["kind"]
    rename = _namer(kind)
    cap = parse_size(max_shard_size)
    try:
        cfg = _hf_config_dict(kind, info.get("config"), dtype)
    except (TypeError, ValueError, KeyError, AttributeError) as e:
        raise CheckpointCorruptError(
            f"{folder / pub.MANIFEST}: model.config does not describe a {kind} model ({e})"
        ) from None
    staging = _Staging(Path(out_dir))
    try:
        _export_tensors(
            folder, info, md, ShardedSafetensorsWriter(staging.tmp, cap), rename, dtype, cap
        )
        if cfg is not None:
            text = json.dumps(cfg, indent=2, sort_keys=True)
            pub.write_atomic(staging.tmp / "config.json", text)
        staging.commit()
    except BaseException:
        staging.discard()  # the output folder keeps what it held
        raise
    return Path(out_dir)


def _export_tensors(folder: Path, info: dict, md, writer, rename, dtype: torch.dtype, cap: int):
    entries = [(name, rec["shape"], rec["dtype"]) for name, rec in info["params"].items()]
    entries += [(key, rec["shape"], rec["dtype"]) for key, rec in info["buffers"].items()]
    batch: list[tuple[str, list[int], str]] = []

    def run(batch):
        sd = {}
        for name, shape, dt in batch:
            key, is_param = f"model/{name}", name in info["params"]
            size = stored(md, key, shape) if is_param else list(shape)  # 1-D or N-D
            msg = check_tensor(md, key, size, dt, folder, is_param)
            if msg:
                raise CheckpointCorruptError(msg)
            sd[key] = torch.empty(size, dtype=dtype_from_name(dt, f"{folder}: {name}"))
        dcp_load(sd, folder, no_dist=True)
        for name, shape, _ in batch:
            t = sd[f"model/{name}"].view(shape)
            writer.add(rename(name), t.to(dtype) if t.is_floating_point() else t)

    size = 0
    for e in entries:
        n = 4 * math.prod(e[1])
        if batch and size + n > cap:
            run(batch)
            batch, size = [], 0
        batch.append(e)
        size += n
    if batch:
        run(batch)
    writer.close()


# ---- load_hf ------------------------------------------------------------------------------------


def _weight_map(src: Path) -> dict[str, str]:
    from safetensors import safe_open

    if (src / INDEX).is_file():
        try:
            index = json.loads((src / INDEX).read_text())
            return dict(index["weight_map"])
        except (ValueError, KeyError, TypeError) as e:
            raise CheckpointCorruptError(f"{src / INDEX}: corrupt index ({e})") from None
    files = [src / SINGLE] if (src / SINGLE).is_file() else sorted(src.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"{src}: no *.safetensors files (nor {INDEX})")
    out = {}
    for p in files:
        try:
            with safe_open(str(p), "pt") as fh:
                for k in fh.keys():
                    out[k] = p.name
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{p}: not a readable safetensors file ({e})") from None
    return out


@torch.no_grad()
@waiting("HF load")
def load_hf(model, src_dir: str | os.PathLike, strict: bool = True) -> None:
    """Initialize a sharded model from Hugging Face safetensors in ``src_dir`` (an index with
    shards, or one ``model.safetensors``). Collective; each rank reads only the rows covering its
    slices. Missing or unexpected names, shape mismatches and non-float data raise (naming the key
    and file) before anything is copied; a truncated or corrupt file raises naming the file."""
    from safetensors import safe_open

    group = dtensor.checkpoint_group(model, "load_hf()")  # every rank of a TP model
    src = Path(src_dir)
    kind = model_kind(model.module)
    rename = _namer(kind)

    handles: dict[str, object] = {}

    def handle(fname: str):
        if fname not in handles:
            p = src / fname
            if not p.is_file():
                raise CheckpointCorruptError(f"{p}: missing (listed in {INDEX})")
            try:
                handles[fname] = safe_open(str(p), "pt").__enter__()
            except Exception as e:  # noqa: BLE001
                raise CheckpointCorruptError(
                    f"{p}: not a readable safetensors file ({e})"
                ) from None
        return handles[fname]

    model.quiesce()  # no gather in flight still reads a shard this overwrites
    plan: list[tuple] = []  # (flat, slot, key, file)
    bufs: list[tuple] = []
    try:
        with agreed(group):  # any failure, of any kind, on any rank: raised on every rank
            _plan_load(model, src, strict, rename, handle, plan, bufs)
        with agreed(group):
            _read_slices(src, handle, plan, bufs)
    finally:
        _close(handles)


def _plan_load(model, src: Path, strict: bool, rename, handle, plan: list, bufs: list) -> None:
    """Which file and key each parameter and buffer comes from, checked before any copy."""
    wmap = _weight_map(src)
    used: set[str] = set()
    missing: list[str] = []
    for f, slot, _ in params(model):
        names = [rename(u.name) for u in slot.uses]
        key = next((n for n in names if n in wmap), None)
        used.update(n for n in names if n in wmap)
        if key is None:
            missing.append(names[0])
            continue
        plan.append((f, slot, key, wmap[key]))
    for key, b in buffers(model):
        k = rename(key)
        if k in wmap:
            used.add(k)
            bufs.append((b, k, wmap[k]))
        elif strict:
            missing.append(k)
    unexpected = [k for k in wmap if k not in used and not _IGNORED_HF_KEYS.search(k)]
    if missing or (strict and unexpected):
        raise CheckpointMismatchError(
            f"load_hf({src}): missing keys {missing[:6]}{'...' if len(missing) > 6 else ''}, "
            f"unexpected keys {unexpected[:6]}{'...' if len(unexpected) > 6 else ''}; "
            "are these weights of this model?"
        )
    for _f, slot, key, fname in plan:
        sl = handle(fname).get_slice(key)
        shape, dt = list(sl.get_shape()), sl.get_dtype()
        if shape != list(slot.whole_shape):
            raise CheckpointMismatchError(
                f"{src / fname}: {key} has shape {tuple(shape)}, the model expects "
                f"{tuple(slot.whole_shape)}"
            )
        if dt not in _ST_FLOAT:
            raise CheckpointMismatchError(
                f"{src / fname}: {key} has dtype {dt}, expected a floating type"
            )
    for b, key, fname in bufs:
        shape = list(handle(fname).get_slice(key).get_shape())
        if shape != list(b.shape):
            raise CheckpointMismatchError(
                f"{src / fname}: {key} has shape {tuple(shape)}, the model expects {tuple(b.shape)}"
            )


def _read_slices(src: Path, handle, plan: list, bufs: list) -> None:
    """Copy into each shard the parts of the files that cover it (this rank's part only): its
    slice of the parameter as boxes of the file's (whole) tensor (boxes.py: an expert-parallel
    rank's experts, a tensor-parallel shard)."""
    for f, slot, key, fname in plan:
        a, b = f.local_param_range(slot)
        if b <= a:
            continue
        at = slot.offset - f.shard_start  # where the parameter's slice starts in the shard
        try:
            sl = handle(fname).get_slice(key)
            for (offsets, sizes), start in boxes.pieces(slot, a, b):
                if len(slot.whole_shape) == 0:
                    part = handle(fname).get_tensor(key).reshape(-1)
                else:
                    part = sl[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))].reshape(-1)
                f.shard[at + start : at + start + part.numel()].copy_(part)
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointCorruptError(f"{src / fname}: reading {key} failed ({e})") from None
    for buf, key, fname in bufs:
        buf.copy_(handle(fname).get_tensor(key))


def _close(handles: dict) -> None:
    for h in handles.values():
        try:
            h.__exit__(None, None, None)
        except Exception:  # noqa: BLE001
            pass
    handles.clear()
