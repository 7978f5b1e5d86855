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
import contextlib
import errno
import logging
import os
import shutil
import time
import warnings
import weakref
from pathlib import Path
from typing import Any, NoReturn

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.staging import AsyncStager

from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import (
    CheckpointError,
)
from layershard.checkpoint.manifest import describe_model, optimizer_state, rng_state
from layershard.checkpoint.shards import (
    Shard1D,
    broadcast_from_rank0,
    buffers,
    group_of,
    jsonable,
    params,
    sharded_1d,
)
from layershard.engine.agreement import agreed
from layershard.engine.waits import waiting

log = logging.getLogger("layershard")

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
        self.tmp = Path(broadcast_from_rank0(self.group, str(tmp)))

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
    group, rank, world = group_of(model)
    final = Path(path).absolute()
    if keep_last is not None and keep_last < 1:
        raise ValueError(f"save_checkpoint(keep_last={keep_last}): must be at least 1")
    if step is not None and not isinstance(step, int):
        raise TypeError(f"save_checkpoint(step={step!r}): must be an int")
    extra = jsonable(extra, "save_checkpoint(extra=...)")
    run_config = jsonable(run_config, "save_checkpoint(run_config=...)")
    wait_for_pending_save(model)

    # Every part that can fail on one rank only runs under an agreement, so no rank hangs.
    state: dict[str, Any] = {}
    optim_info = None
    with agreed(group):
        for f, slot, p in params(model):
            state[f"model/{slot.name}"] = sharded_1d(
                model, p.detach(), slot.numel, f.param_ranges(slot), save=True
            )
        for key, b in buffers(model):
            state[f"model/{key}"] = b.detach()
        if optimizer is not None:
            tensors, optim_info = optimizer_state(model, optimizer)
            state.update(tensors)
        state.update(rng_state(rank))
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
        "rng": {"world_size": world, "keys": sorted(k.split("/", 2)[2] for k in rng_state(0))},
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
