"""Saving sharded, resumable checkpoints on ``torch.distributed.checkpoint`` (DCP).

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
import errno
import logging
import os
import shutil
import time
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.staging import AsyncStager

from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import CheckpointError
from layershard.checkpoint.manifest import Collected, collect
from layershard.checkpoint.phases import Phases
from layershard.checkpoint.shards import Chunked, jsonable
from layershard.engine import dtensor
from layershard.engine.waits import waiting

log = logging.getLogger("layershard")

# The phases of a save, as its errors name them (checkpoint/phases.py).
COLLECT, STAGE, CREATE = "collecting the state for", "staging", "creating the folder for"
WRITE, DIGEST, PUBLISH = "writing", "hashing", "publishing"

# Per-tensor overhead of DCP's files (a zip record per tensor), for the free-space estimate.
_FILE_OVERHEAD = 4096


def _nbytes(state: dict[str, Any]) -> int:
    """Bytes this rank writes for ``state`` (its local slices), with DCP's per-tensor overhead."""
    total = 0
    for v in state.values():
        if isinstance(v, Chunked):
            locals_ = [t for _, t in v.chunks]
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


class _Save:
    """One checkpoint save, phase by phase, in the order every rank runs it (save_checkpoint).
    Its phases run on the model's group, those after the write on ``late_group`` (an asynchronous
    save's background thread, over a group that thread alone uses). Any failure removes the
    temporary folder and leaves the previous checkpoint and ``latest`` as they were."""

    def __init__(self, final: Path, keep_last: int | None, group, late_group):
        self.final, self.keep_last = final, keep_last
        self.phases = Phases(group, self._fail)
        self.late = Phases(late_group, self._fail)
        self.tmp: Path | None = None
        self.need = 0
        self.t0 = time.perf_counter()

    def _fail(self, phase: str, exc: BaseException) -> NoReturn:
        """Every rank has failed ``phase``: remove the temporary folder, raise one error."""
        if self.phases.rank == 0 and self.tmp is not None:
            shutil.rmtree(self.tmp, ignore_errors=True)
        if _is_disk_full(exc):
            raise _no_space(self.final.parent, self.need) from None
        if isinstance(exc, CheckpointError) or phase == COLLECT:  # COLLECT: the caller's input
            raise exc
        unchanged = (
            "" if phase == PUBLISH else "; the previous checkpoint and `latest` are unchanged"
        )
        raise CheckpointError(
            f"save_checkpoint: {phase} {self.final} failed ({type(exc).__name__}: {exc}){unchanged}"
        ) from exc

    def create(self, nbytes: list[int]) -> None:
        """Rank 0 checks the destination and the space every rank needs, creates the folder."""
        self.need = sum(nbytes) + (1 << 20)  # + metadata
        self.t0 = time.perf_counter()
        self.tmp = self.phases.rank0(CREATE, self._make_tmp)

    def _make_tmp(self) -> Path:
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

    def finish(self, manifest: dict) -> Path:
        """Each rank hashes a share of the files, then rank 0 writes the manifest and publishes."""
        t_write = time.perf_counter() - self.t0
        parts = self.late.gather(DIGEST, self._digest)
        self.late.rank0(PUBLISH, lambda: self._publish(manifest, parts, t_write))
        log.info("layershard: saved %s in %.2f s", self.final, time.perf_counter() - self.t0)
        return self.final

    def _digest(self) -> dict[str, dict[str, Any]]:
        assert self.tmp is not None, "create() made the folder first"
        names = pub.data_files(self.tmp)
        digests = {}
        for name in names[self.late.rank :: self.late.world]:
            size, sha = pub.file_digest(self.tmp / name)
            digests[name] = {"bytes": size, "sha256": sha}
        return digests

    def _publish(self, manifest: dict, parts: list[dict], t_write: float) -> None:
        assert self.tmp is not None, "create() made the folder first"
        files = {k: v for part in parts for k, v in part.items()}
        manifest = dict(manifest)
        manifest["files"] = dict(sorted(files.items()))
        manifest["total_bytes"] = sum(v["bytes"] for v in files.values())
        manifest["write_seconds"] = round(t_write, 3)
        pub.write_atomic(self.tmp / pub.MANIFEST, pub.dumps(manifest))
        pub.publish(self.tmp, self.final, self.keep_last)


class AsyncCheckpoint:
    """A checkpoint being written in the background by ``save_checkpoint()`` with
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


class _Background:
    """The asynchronous saves over one gloo group (``layershard.groups``: DCP's background
    collectives must not interleave with the training thread's on the model's own group, and NCCL
    groups have no CPU backend): their thread and the save in flight, one at a time."""

    def __init__(self, group: dist.ProcessGroup):
        self.group = group
        self.executor = concurrent.futures.ThreadPoolExecutor(1, "layershard-ckpt")
        self.pending: AsyncCheckpoint | None = None


_BACKGROUND: dict[dist.ProcessGroup, _Background] = {}
_STAGING: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> its host buffers


def _stop(group: dist.ProcessGroup, destroy: Callable[[], None]) -> None:
    """The group's model is gone: its thread finishes the save in flight, then destroys the
    group. Never waits here (``Groups.close``: this may be DCP's thread writing that save)."""
    bg = _BACKGROUND.pop(group, None)
    if bg is None:
        destroy()
        return
    bg.executor.submit(destroy)
    bg.executor.shutdown(wait=False)


def _background(model, everyone: dist.ProcessGroup | None) -> _Background:
    """``model``'s background saves over the ranks of ``everyone`` (the model's, or the whole
    world of a tensor-parallel model: ``dtensor.checkpoint_group``); the first call makes their
    group (collective over those ranks)."""
    groups = model.sharding.groups
    ranks = dist.get_process_group_ranks(everyone) if everyone is not None else groups.ranks
    group = groups.make("async-save", [ranks], "gloo", closer=_stop)
    assert group is not None  # this rank is one of the model's
    if group not in _BACKGROUND:
        _BACKGROUND[group] = _Background(group)
    return _BACKGROUND[group]


class _PreStaged(AsyncStager):
    """An ``AsyncStager`` for a state that is already a private CPU copy (see ``_stage``)."""

    _synchronize_after_execute = False  # read by should_synchronize_after_execute

    def stage(self, state_dict):
        return state_dict

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass


def _stage(state: dict[str, Any], buffers: dict[tuple[str, int], torch.Tensor]) -> dict[str, Any]:
    """A CPU copy of ``state`` that training cannot change: reused buffers, pinned on CUDA so the
    device-to-host copies are asynchronous (one synchronize at the end)."""
    out: dict[str, Any] = {}
    cuda = False
    for key, v in state.items():
        locals_ = [t for _, t in v.chunks] if isinstance(v, Chunked) else [v]
        copies = []
        for i, local in enumerate(locals_):
            buf = buffers.get((key, i))
            if buf is None or buf.shape != local.shape or buf.dtype != local.dtype:
                pin = local.device.type == "cuda"
                buf = buffers[key, i] = torch.empty(local.shape, dtype=local.dtype, pin_memory=pin)
            buf.copy_(local, non_blocking=local.device.type == "cuda")
            cuda |= local.device.type == "cuda"
            copies.append(buf)
        out[key] = v.with_locals(copies) if isinstance(v, Chunked) else copies[0]
    if cuda:
        torch.cuda.synchronize()
    return out


def _write(state: dict[str, Any], folder: Path, group) -> None:
    """DCP writes every rank's slices into ``folder`` (collective)."""
    dcp.save(
        state, storage_writer=dcp.FileSystemWriter(folder, sync_files=True), process_group=group
    )


def _write_async(state: dict[str, Any], folder: Path, group) -> concurrent.futures.Future:
    """DCP's asynchronous save of an already staged ``state``: its upload's future."""
    with warnings.catch_warnings():
        # "async_save is experimental": layershard pins the torch version it is tested with
        warnings.simplefilter("ignore", UserWarning)
        upload = dcp.async_save(
            state,
            storage_writer=dcp.FileSystemWriter(folder, sync_files=True),
            process_group=group,
            async_stager=_PreStaged(),
        )
    # _PreStaged.stage() returns the state itself, not a future: async_save returns the upload's
    assert isinstance(upload, concurrent.futures.Future)
    return upload


def wait_for_pending_save(model) -> Path | None:
    """Wait for the asynchronous save in flight over ``model``'s ranks, if any; returns its
    folder, or None when there is none or it failed (its error is raised by its own ``wait()``;
    if nobody waited for it, it is logged here rather than raised by an unrelated save)."""
    group = model.sharding.groups.get("async-save")
    bg = _BACKGROUND.get(group) if group is not None else None
    if bg is None or bg.pending is None:
        return None
    pending, bg.pending = bg.pending, None
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
    (the resolved run config) come back from ``load_checkpoint()``. With ``keep_last=K`` only the
    K newest checkpoints in the parent folder remain. Returns the checkpoint folder.

    A save that cannot fit (checked before writing) or runs out of space while writing raises
    ``CheckpointError("no space left on <folder>: needed ~N bytes ...")`` and removes what it wrote.
    A failure of any phase on any rank raises on every rank, and the save leaves nothing behind.

    ``async_save=True`` copies the state (to pinned CPU memory on CUDA) and returns an
    ``AsyncCheckpoint`` at once; ``torch.distributed.checkpoint.async_save`` writes it in a
    background thread over a gloo group of the same ranks, every rank for a tensor-parallel model
    (made by the first asynchronous save: a collective of those ranks, ``layershard.groups``),
    then the manifest and the publication follow, with the same crash safety. One save per model
    is in flight: a new save (either kind) waits for it.
    """
    t0 = time.perf_counter()
    everyone = dtensor.checkpoint_group(model, "save_checkpoint()")  # every rank of a TP model
    final = Path(path).absolute()
    wait_for_pending_save(model)
    bg = _background(model, everyone) if async_save else None
    group = everyone if bg is None else bg.group  # where DCP writes
    save = _Save(final, keep_last, everyone, group)
    ph = save.phases

    def gather_state() -> tuple[Any, Any, Collected]:
        # the arguments too: extra is often a rank's own (where its data stands), and a rank
        # that refused it alone would leave the others in the phases below
        if keep_last is not None and keep_last < 1:
            raise ValueError(f"save_checkpoint(keep_last={keep_last}): must be at least 1")
        if step is not None and not isinstance(step, int):
            raise TypeError(f"save_checkpoint(step={step!r}): must be an int")
        return (
            jsonable(extra, "save_checkpoint(extra=...)"),
            jsonable(run_config, "save_checkpoint(run_config=...)"),
            collect(model, optimizer, ph.rank),
        )

    extra, run_config, got = ph.each(COLLECT, gather_state)
    summary = ph.gather(
        COLLECT, lambda: (got.optimizer and got.optimizer["state"], _nbytes(got.tensors))
    )
    if got.optimizer is not None and any(kinds != summary[0][0] for kinds, _ in summary):
        raise CheckpointError(
            "save_checkpoint: the ranks' optimizers hold different kinds of state (has every rank "
            "stepped the same optimizer?)"
        )
    manifest = _manifest(got, step, ph.world, extra, run_config)
    state = got.tensors
    if bg is not None:
        buffers = _STAGING.setdefault(model, {})
        state = ph.each(STAGE, lambda: _stage(got.tensors, buffers))
    save.create([n for _, n in summary])
    folder = save.tmp
    assert folder is not None  # create() made it, or raised
    if bg is None:
        ph.each(WRITE, lambda: _write(state, folder, group))
        return save.finish(manifest)
    upload = ph.each(WRITE, lambda: _write_async(state, folder, group))

    def finish() -> Path:  # in the background thread
        save.late.each(WRITE, upload.result)
        return save.finish(manifest)

    handle = AsyncCheckpoint(final, bg.executor.submit(finish), time.perf_counter() - t0)
    bg.pending = handle
    return handle


def _manifest(got: Collected, step, world: int, extra, run_config) -> dict:
    """The manifest but for the files (added at publication)."""
    from layershard import __version__

    return {
        "format": pub.FORMAT,
        "format_version": pub.FORMAT_VERSION,
        "layershard_version": __version__,
        "torch_version": torch.__version__,
        "created_unix": time.time(),
        "step": step,
        "world_size": world,
        "extra": extra,
        "run_config": run_config,
        "model": got.model,
        "optimizer": got.optimizer,
        "rng": {"world_size": world, "keys": got.rng_keys},
    }
