"""Checkpoints under faults: DCP's public protocol instead of ShardedTensor (old checkpoints still
load), same-name saves that stay atomic whatever the crash point, a full disk, asynchronous saves."""

from __future__ import annotations

import errno
import os
import re
import shutil
import warnings
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import layershard as ls
from layershard.checkpoint import CheckpointError, checkpoint_info, safe_read
from layershard.checkpoint import manifest as ckmanifest
from layershard.checkpoint import publish as pub
from layershard.checkpoint import save as cksave
from layershard.models import LlamaConfig, LlamaForCausalLM

SRC = Path(__file__).parents[2] / "src" / "layershard"
# Saved by layershard 0.1.0 through torch.distributed._shard.ShardedTensor (world size 2, AdamW
# after one step), with the full parameters it held (expected_params.pt).
FIXTURE = Path(__file__).parents[1] / "fixtures" / "ckpt_shardedtensor_ws2"
FIXTURE_CFG = dict(
    vocab_size=16, dim=8, n_layers=2, n_heads=2, n_kv_heads=1, ffn_dim=16, max_seq_len=8
)
TINY = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _model(cfg=TINY, seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg))


def _step(model, opt, rank: int, seed: int = 1) -> None:
    x = torch.randint(0, 16, (2, 8), generator=torch.Generator().manual_seed(seed + rank))
    model(x, labels=x).loss.backward()
    opt.step()
    opt.zero_grad()


def _old_sharded_1d(model, f, slot, local, save):
    """The code path layershard 0.1.0 saved with: a ShardedTensor from local shards."""
    numel, ranges = slot.whole_shape.numel(), f.param_ranges(slot)
    from torch.distributed._shard.metadata import ShardMetadata
    from torch.distributed._shard.sharded_tensor import Shard, ShardedTensor
    from torch.distributed._shard.sharded_tensor.metadata import (
        ShardedTensorMetadata,
    )
    from torch.distributed._shard.sharded_tensor.metadata import (
        TensorProperties as STProperties,
    )

    if numel == 0:
        return local
    rank = dist.get_rank()
    granks = dist.get_process_group_ranks(dist.group.WORLD)
    mds, mine = [], None
    for r, (a, b) in enumerate(ranges):
        if b > a:
            md = ShardMetadata(
                shard_offsets=[a], shard_sizes=[b - a], placement=f"rank:{granks[r]}/cpu"
            )
            mds.append(md)
            mine = md if r == rank else mine
    meta = ShardedTensorMetadata(
        shards_metadata=mds,
        size=torch.Size([numel]),
        tensor_properties=STProperties(dtype=local.dtype),
    )
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        return ShardedTensor._init_from_local_shards_and_global_metadata(
            [Shard(local, mine)] if mine is not None else [], meta, process_group=dist.group.WORLD
        )


def _optim_full(model, opt) -> dict[str, torch.Tensor]:
    sd = {}
    for f in model.flat_params:
        for slot, p in zip(f.slots, f.shard_params):
            for k, v in opt.state.get(p, {}).items():
                if v.dim():
                    parts = [None] * dist.get_world_size()
                    dist.all_gather_object(parts, v.clone())
                    sd[f"{slot.name}/{k}"] = torch.cat(parts)
                else:
                    sd[f"{slot.name}/{k}"] = v.clone()
    return sd


def _old_format(rank: int, world: int, root: str) -> None:
    root = Path(root)
    # 1. The committed checkpoint written by the old code loads, bit for bit.
    model = ls.shard(_model(FIXTURE_CFG, seed=5))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    meta = ls.load_checkpoint(FIXTURE, model, opt)
    assert meta["step"] == 1 and "ShardedTensor" in meta["extra"]["note"]
    expected = torch.load(FIXTURE / "expected_params.pt", weights_only=True)
    for k, v in model.full_state_dict(rank0_only=False).items():
        assert torch.equal(v, expected[k]), k
    assert all(opt.state[p]["step"] == 1 for p in model.parameters() if p.numel())
    _step(model, opt, rank, seed=7)  # and trains on

    # 2. The same state saved by the old code and by the DCP protocol: identical DCP metadata
    #    (chunks, sizes, properties) and each loads into the other's place.
    torch.manual_seed(0)
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank)
    original = ckmanifest.sharded
    ckmanifest.sharded = _old_sharded_1d  # parameters, optimizer state (manifest.collect)
    try:
        ls.save_checkpoint(root / "old", model, opt, step=1)
    finally:
        ckmanifest.sharded = original
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ls.save_checkpoint(root / "new", model, opt, step=1)
    assert not [w for w in caught if issubclass(w.category, FutureWarning)], caught
    md_old, md_new = (safe_read.read_dcp_metadata(root / n) for n in ("old", "new"))
    assert md_old.state_dict_metadata == md_new.state_dict_metadata
    assert set(md_old.storage_data) == set(md_new.storage_data)
    params, optim = model.full_state_dict(rank0_only=False), _optim_full(model, opt)
    for name in ("old", "new"):
        fresh = ls.shard(_model(seed=11))
        fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ls.load_checkpoint(root / name, fresh, fresh_opt)
        assert not [w for w in caught if issubclass(w.category, FutureWarning)], caught
        for k, v in fresh.full_state_dict(rank0_only=False).items():
            assert torch.equal(v, params[k]), (name, k)
        got = _optim_full(fresh, fresh_opt)
        assert got.keys() == optim.keys()
        for k in optim:
            assert torch.equal(got[k], optim[k]), (name, k)


def test_dcp_protocol_replaces_shardedtensor_and_old_checkpoints_load(tmp_path):
    run_ranks(_old_format, 2, str(tmp_path))
    # the old checkpoint also reshards: loaded in one process
    ls.init_distributed(backend="gloo")
    model = ls.shard(_model(FIXTURE_CFG, seed=5))
    ls.load_checkpoint(FIXTURE / "step_000001", model, torch.optim.AdamW(model.parameters()))
    expected = torch.load(FIXTURE / "expected_params.pt", weights_only=True)
    for k, v in model.full_state_dict().items():
        assert torch.equal(v, expected[k]), k
    # no deprecated ShardedTensor anywhere in layershard
    imports = re.compile(r"^\s*(from|import)\s+torch\.distributed\._shard", re.M)
    users = [p for p in SRC.rglob("*.py") if imports.search(p.read_text())]
    assert not users, users


# ---- same-name saves: atomic at every crash point ----------------------------------------------


class _Crash(BaseException):
    """The process dies here: nothing after this point runs (not even ``except Exception``)."""


def _params_of(model) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.full_state_dict().items()}


@pytest.mark.parametrize("can_exchange", [True, False], ids=["exchange", "two-renames"])
def test_same_name_save_is_atomic_at_every_crash_point(tmp_path, monkeypatch, can_exchange):
    """Saving over ``ck/last`` and dying at each file-system step of the publication leaves
    ``ck`` loadable as either the old or the new checkpoint, never a missing folder."""
    ls.init_distributed(backend="gloo")
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    steps, active = {"n": 0, "crash_at": 0}, [False]
    real_exchange = getattr(pub, "exchange", None)

    def fs_step(fn):
        def wrapper(*args, **kwargs):
            if active[0]:
                steps["n"] += 1
                if steps["n"] == steps["crash_at"]:
                    raise _Crash
            return fn(*args, **kwargs)

        return wrapper

    monkeypatch.setattr(
        pub,
        "exchange",
        fs_step(real_exchange if can_exchange else lambda a, b: False),
        raising=False,
    )
    monkeypatch.setattr(os, "rename", fs_step(os.rename))
    monkeypatch.setattr(pub, "write_atomic", fs_step(pub.write_atomic))
    monkeypatch.setattr(shutil, "rmtree", fs_step(shutil.rmtree))
    real_publish = pub.publish

    def publish(*args, **kwargs):
        active[0] = True
        try:
            return real_publish(*args, **kwargs)
        finally:
            active[0] = False

    monkeypatch.setattr(pub, "publish", publish)

    crash_at, outcomes = 1, set()
    while True:
        root = tmp_path / f"crash{crash_at}"
        ls.save_checkpoint(root / "last", model, opt, step=1)
        old = _params_of(model)
        _step(model, opt, 0)
        new = _params_of(model)
        steps.update(n=0, crash_at=crash_at)
        try:
            ls.save_checkpoint(root / "last", model, opt, step=2)
            crashed = False
        except _Crash:
            crashed = True
        if can_exchange:  # `latest` never names a missing folder
            assert (root / (root / "latest").read_text().strip()).is_dir(), crash_at
        found = pub.resolve(root)
        assert (found / pub.MANIFEST).is_file()
        fresh = ls.shard(_model(seed=3))
        meta = ls.load_checkpoint(root, fresh, torch.optim.AdamW(fresh.parameters()))
        got = _params_of(fresh)
        expected = {1: old, 2: new}[meta["step"]]
        assert all(torch.equal(got[k], expected[k]) for k in got), (crash_at, meta["step"])
        outcomes.add(meta["step"])
        if not crashed:
            assert meta["step"] == 2 and not pub.leftovers(root)
            break
        crash_at += 1
    assert outcomes == {1, 2} and crash_at >= 4, (outcomes, crash_at)


# ---- a full disk; asynchronous saves -------------------------------------------------------------


def _disk_full_and_async(rank: int, world: int, root: str) -> None:
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    ck = root / "ck"
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank)
    ls.save_checkpoint(ck / "step_1", model, opt, step=1)
    at_1 = _params_of(model)
    _step(model, opt, rank, seed=2)

    def unchanged() -> None:
        dist.barrier()
        assert sorted(p.name for p in ck.iterdir()) == ["latest", "step_1"], list(ck.iterdir())
        assert (ck / "latest").read_text().strip() == "step_1"

    no_space = r"no space left on .*/ck: needed ~[\d,]+ bytes"
    # 1. Rank 1's disk fills up while DCP writes (after part of a file is out).
    original = dcp.FileSystemWriter.write_data

    def write_then_fill(self, plan, planner):
        if rank == 1:
            (Path(self.path) / "__1_0.distcp").write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_then_fill
    try:
        with pytest.raises(CheckpointError, match=no_space):
            ls.save_checkpoint(ck / "step_2", model, opt, step=2)
        unchanged()
        # the same through DCP's asynchronous save: the error comes from wait()
        handle = ls.save_checkpoint(ck / "step_2", model, opt, step=2, async_save=True)
        with pytest.raises(CheckpointError, match=no_space):
            handle.wait()
        unchanged()
    finally:
        dcp.FileSystemWriter.write_data = original

    # 2. Too little space to begin with: refused before anything is written.
    real_usage = shutil.disk_usage
    shutil.disk_usage = lambda p: real_usage(p)._replace(free=1000)
    try:
        with pytest.raises(CheckpointError, match=no_space + ", 1,000 free"):
            ls.save_checkpoint(ck / "step_2", model, opt, step=2)
    finally:
        shutil.disk_usage = real_usage
    unchanged()

    # 3. The disk fills up at the manifest (rank 0, after every rank wrote).
    real_write = pub.write_atomic

    def manifest_fills(path, text):
        raise OSError(errno.ENOSPC, "No space left on device", str(path))

    pub.write_atomic = manifest_fills
    try:
        with pytest.raises(CheckpointError, match=no_space):
            ls.save_checkpoint(ck / "step_2", model, opt, step=2)
    finally:
        pub.write_atomic = real_write
    unchanged()
    fresh = ls.shard(_model(seed=4))
    assert ls.load_checkpoint(ck, fresh)["step"] == 1
    got = _params_of(fresh)
    assert all(torch.equal(got[k], at_1[k]) for k in got)

    # 4. An asynchronous save holds the state of the moment it was called, while training goes on,
    #    and is published exactly like a synchronous one.
    at_2, optim_2 = _params_of(model), _optim_full(model, opt)
    handle = ls.save_checkpoint(ck / "step_2", model, opt, step=2, keep_last=1, async_save=True)
    assert isinstance(handle, cksave.AsyncCheckpoint) and handle.path == (ck / "step_2").absolute()
    for s in range(3):  # the parameters and optimizer state change under the background write
        _step(model, opt, rank, seed=10 + s)
    assert handle.wait() == (ck / "step_2").absolute()
    assert (ck / "latest").read_text().strip() == "step_2" and not (ck / "step_1").exists()
    fresh = ls.shard(_model(seed=4))
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-3)
    assert ls.load_checkpoint(ck, fresh, fresh_opt)["step"] == 2
    got, got_optim = _params_of(fresh), _optim_full(fresh, fresh_opt)
    assert all(torch.equal(got[k], at_2[k]) for k in got)
    assert all(torch.equal(got_optim[k], optim_2[k]) for k in got_optim)
    # a second asynchronous save reuses the staging buffers; a synchronous one waits for it
    at_5 = _params_of(model)
    ls.save_checkpoint(ck / "step_5", model, opt, step=5, async_save=True)
    _step(model, opt, rank, seed=20)
    ls.save_checkpoint(ck / "step_6", model, opt, step=6)
    assert ls.load_checkpoint(ck / "step_5", fresh)["step"] == 5
    got = _params_of(fresh)
    assert all(torch.equal(got[k], at_5[k]) for k in got)
    info = checkpoint_info(ck)
    assert info["ok"] and info["step"] == 6 and not info["leftovers"]


def test_disk_full_and_async_saves(tmp_path):
    run_ranks(_disk_full_and_async, 2, str(tmp_path))


# ---- every rank-local phase of a save is agreed -----------------------------------------------


def _staging_fails_on_one_rank(rank: int, world: int, root: str) -> None:
    """Copying the state into host memory (an asynchronous save's staging) fails on rank 1 only.
    It ran outside the ranks' agreement: rank 1 raised and left its temporary folder, rank 0
    returned a handle whose background write waited for rank 1 in DCP's collectives until the
    timeout. Now the call itself raises the same error on every rank, nothing is left behind,
    and the ranks are still in step (the next asynchronous save succeeds)."""
    root = Path(root)
    ck = root / "ck"
    model = ls.shard(_model())
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    _step(model, opt, rank)
    ls.save_checkpoint(ck / "step_1", model, opt, step=1)
    at_1 = _params_of(model)
    _step(model, opt, rank, seed=2)

    real_stage = cksave._stage

    def stage(*args, **kwargs):
        if rank == 1:
            raise RuntimeError("injected: cannot pin host memory")
        return real_stage(*args, **kwargs)

    cksave._stage = stage
    try:
        with pytest.raises(CheckpointError, match=r"staging .*ck/step_2 failed \(RuntimeError: "
                           r"injected: cannot pin host memory"):  # fmt: skip
            ls.save_checkpoint(ck / "step_2", model, opt, step=2, async_save=True)
    finally:
        cksave._stage = real_stage
    dist.barrier()
    assert not list(ck.glob("*.tmp-*")), list(ck.iterdir())
    assert (ck / "latest").read_text().strip() == "step_1"
    fresh = ls.shard(_model(seed=4))
    assert ls.load_checkpoint(ck, fresh)["step"] == 1
    got = _params_of(fresh)
    assert all(torch.equal(got[k], at_1[k]) for k in got)

    at_2 = _params_of(model)
    assert ls.save_checkpoint(ck / "step_2", model, opt, step=2, async_save=True).wait()
    assert ls.load_checkpoint(ck, fresh)["step"] == 2
    got = _params_of(fresh)
    assert all(torch.equal(got[k], at_2[k]) for k in got)


def test_staging_failure_on_one_rank_fails_every_rank(tmp_path):
    run_ranks(_staging_fails_on_one_rank, 2, str(tmp_path))
