"""Checkpoints and HF files of a tensor-parallel model (issue 32; checkpoint/boxes.py): saved at one
layout, loaded at another, bit for bit. At 4 ranks TP 2 x dp_shard 2, 1-D over 4 ranks and HSDP x
TP (dp_replicate 2, dp_shard 1, tp 2); at 2 ranks TP 2 alone and 1-D over 2; from 4 ranks to 2. The built-in Llama's
TP plan has row-parallel weights (attn.wo, mlp.w2: ``Shard(1)``, a rank's part not contiguous in
the flattened weight), stored N-D, and column-parallel ones (``Shard(0)``), stored 1-D as before.

Negative controls, done by hand once (2026-11-26, the 2-rank check): with ``boxes.part_offsets``
placing every TP rank's shard at the origin (``at[d] = 0``), the save fails in DCP's global plan
check ("invalid fill tensor-volume: 2048 chunks-volume: 1024": the TP ranks' chunks coincide);
with the row-parallel shards' offsets swapped between the two TP ranks (rank r at the other
rank's columns: the chunks still tile the weight, so the save succeeds), the first bitwise check
fails: "TP -> 1-D: ['layers.0.attn.wo.weight', 'layers.0.mlp.w2.weight', ...] differ"."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.distributed as dist
from _dist import RankChecks, run_ranks, shared_tmp
from _parity import LOSS_RTOL, LR, batches, global_mean, lm_loss, local, tiny_llama, train_step
from test_tensor_parallel import _tp_model

import layershard as ls
from layershard.checkpoint import boxes, checkpoint_info, export_checkpoint
from layershard.checkpoint.safe_read import read_dcp_metadata

checks4 = RankChecks(world_size=4, suffix="_tp_ckpt4")
checks2 = RankChecks(world_size=2, suffix="_tp_ckpt2")
KEYS = ("exp_avg", "exp_avg_sq")


def _dp(model) -> tuple[int, int]:
    group = model.process_group
    return dist.get_rank(group), dist.get_world_size(group)


def _step(model, opt, batch) -> float:
    """One training step on this rank's part of ``batch``; the global mean loss before it."""
    return train_step(model, batch, *_dp(model), opt)


def _next(model, opt, data) -> tuple[float, float]:
    """What follows a resume: the loss of the third step, and the loss after it (forward)."""
    first = _step(model, opt, data[2])
    with torch.no_grad():
        after = global_mean(lm_loss(model, local(data[3], *_dp(model))))
    return first, after


@torch.no_grad()
def _whole(model, opt) -> dict[str, torch.Tensor]:
    """The whole weights and the whole AdamW state (``<name>/exp_avg``...) on every rank: each
    state is copied into the flat shard in turn and assembled like the weights (gathered over
    the data-parallel group, over TP by ``whole_views``)."""
    out = model.full_state_dict(rank0_only=False)
    for key in KEYS:
        for f in model.flat_params:
            kept = f.shard.clone()
            for p in f.shard_params:
                if key in opt.state.get(p, {}):
                    p.copy_(opt.state[p][key])
            try:
                views = model.whole_views(f, model.gather_flat(f))
                out.update({f"{s.name}/{key}": v.clone() for s, v in zip(f.slots, views)})
            finally:
                f.shard.copy_(kept)
    steps = {float(st["step"]) for st in opt.state.values()}
    out["step"] = torch.tensor(sorted(steps))
    return out


def _same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    differ = [k for k in want if not torch.equal(got[k], want[k])]
    assert not differ, f"{what}: {differ[:4]} differ"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


def _across(rank: int, world: int, tp_model, saved_layouts) -> None:
    """Save at ``tp_model``'s layout after 2 AdamW steps; load into 1-D over ``world`` ranks
    and back into the TP layout (and into each of ``saved_layouts``, saved again, loaded into
    1-D): weights and AdamW state bit for bit; the TP model resumed from the 1-D checkpoint takes
    the next step exactly as the uninterrupted run (loss before and after it); the 1-D one
    within LOSS_RTOL (it sums in another order). HF files exported from the TP layout are,
    byte for byte, the 1-D model's; load_hf reads them into a TP model, exactly."""
    root = shared_tmp()
    data = batches(4)
    model = tp_model(tiny_llama())
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for batch in data[:2]:
        _step(model, opt, batch)
    ls.save_checkpoint(root / "tp", model, opt, step=2)
    saved = _whole(model, opt)
    pending = ls.save_checkpoint(root / "tp-async", model, opt, step=2, async_save=True)
    expect = _next(model, opt, data)  # the uninterrupted run, while the async save is written
    assert pending.wait() == root / "tp-async"
    for make in (tp_model, ls.shard):  # the async save holds what the sync one does, exactly
        again = make(tiny_llama(seed=7))
        opt_again = torch.optim.AdamW(again.parameters(), lr=LR)
        ls.load_checkpoint(root / "tp-async", again, opt_again)
        _same(_whole(again, opt_again), saved, "async save of TP -> TP and 1-D")

    md = read_dcp_metadata(root / "tp").state_dict_metadata
    wo, wq = "layers.0.attn.wo.weight", "layers.0.attn.wq.weight"
    assert list(md[f"model/{wo}"].size) == [32, 32]  # row-parallel: N-D
    assert list(md[f"optim/{wo}/exp_avg"].size) == [32, 32]
    assert list(md[f"model/{wq}"].size) == [32 * 32]  # column-parallel: 1-D, as before

    one_d = ls.shard(tiny_llama(seed=7))
    opt1 = torch.optim.AdamW(one_d.parameters(), lr=LR)
    ls.load_checkpoint(root / "tp", one_d, opt1)
    _same(_whole(one_d, opt1), saved, "TP -> 1-D")
    ls.save_checkpoint(root / "1d", one_d, opt1, step=2)
    ls.export_hf(one_d, root / "hf-1d", dtype=torch.float32)

    back = tp_model(tiny_llama(seed=7))
    opt2 = torch.optim.AdamW(back.parameters(), lr=LR)
    ls.load_checkpoint(root / "1d", back, opt2)
    _same(_whole(back, opt2), saved, "1-D -> TP")
    ls.export_hf(back, root / "hf-tp", dtype=torch.float32)
    if rank == 0:  # and the offline readers of the TP checkpoint (N-D and 1-D parameters)
        export_checkpoint(root / "tp", root / "hf-offline", dtype=torch.float32)
        info = checkpoint_info(root / "tp")
        assert info["ok"] and info["numel"] == sum(p.numel() for p in tiny_llama().parameters())
        a, b = _files(root / "hf-tp"), _files(root / "hf-1d")
        assert a.keys() == b.keys() and all(a[k] == b[k] for k in a), sorted(a)
        c = _files(root / "hf-offline")
        assert c.keys() == b.keys() and all(c[k] == b[k] for k in c), sorted(c)
    hf = tp_model(tiny_llama(seed=7))
    ls.load_hf(hf, root / "hf-1d")
    weights = {k: v for k, v in saved.items() if "/" not in k and k != "step"}
    _same(hf.full_state_dict(rank0_only=False), weights, "load_hf into TP")

    assert _next(back, opt2, data) == expect  # bit for bit the uninterrupted run
    first, _ = _next(one_d, opt1, data)
    assert abs(first - expect[0]) <= LOSS_RTOL * abs(expect[0]), (first, expect)

    for make in saved_layouts:  # another TP layout: from the TP checkpoint, saved, into 1-D
        other = make(tiny_llama(seed=7))
        opt3 = torch.optim.AdamW(other.parameters(), lr=LR)
        ls.load_checkpoint(root / "tp", other, opt3)
        _same(_whole(other, opt3), saved, "TP -> another TP layout")
        ls.save_checkpoint(root / "other", other, opt3, step=2)
        fresh = ls.shard(tiny_llama(seed=5))
        opt4 = torch.optim.AdamW(fresh.parameters(), lr=LR)
        ls.load_checkpoint(root / "other", fresh, opt4)
        _same(_whole(fresh, opt4), saved, "another TP layout -> 1-D")


def _tp2_dp2(rank: int, world: int) -> None:
    """TP 2 x dp_shard 2 -> 1-D over 4 -> TP 2 x dp_shard 2, and HSDP x TP (dp_replicate 2,
    dp_shard 1, tp 2: replicas write nothing) saved and loaded into 1-D."""
    _across(
        rank,
        world,
        lambda m: _tp_model(m, world)[0],
        [lambda m: _tp_model(m, world, hybrid=True)[0]],
    )


def _tp2_alone(rank: int, world: int) -> None:
    """TP 2 alone (dp_shard 1) -> 1-D over 2 ranks -> TP 2."""
    _across(rank, world, lambda m: _tp_model(m, world)[0], [])


def _save_at_4(rank: int, world: int, root: str) -> None:
    model = _tp_model(tiny_llama(), world)[0]
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    for batch in batches(2):
        _step(model, opt, batch)
    ls.save_checkpoint(Path(root) / "tp4", model, opt, step=2)
    saved = _whole(model, opt)
    if rank == 0:
        torch.save(saved, Path(root) / "saved.pt")


def _load_at_2(rank: int, world: int, root: str) -> None:
    saved = torch.load(Path(root) / "saved.pt", weights_only=True)
    for make in (lambda m: _tp_model(m, world)[0], ls.shard):  # TP 2 alone, 1-D over 2
        model = make(tiny_llama(seed=7))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        meta = ls.load_checkpoint(Path(root) / "tp4", model, opt)
        assert meta["world_size"] == 4 and not meta["rng_restored"]
        _same(_whole(model, opt), saved, "TP 2 x dp_shard 2 at 4 ranks -> 2 ranks")


def test_tp_checkpoint_across_world_sizes(tmp_path):
    """Saved at TP 2 x dp_shard 2 (4 ranks), loaded at 2 ranks into TP 2 alone and into 1-D:
    weights and AdamW state bit for bit (two spawns: a TP model checkpoints over every rank of
    the world, so each world size is a launch of its own)."""
    run_ranks(_save_at_4, 4, str(tmp_path))
    run_ranks(_load_at_2, 2, str(tmp_path))


checks4.check(_tp2_dp2, "tp_dp_checkpoint_across_layouts")
checks2.check(_tp2_alone, "tp_alone_checkpoint_across_layouts")
checks4.collect(globals())
checks2.collect(globals())


def test_boxes_tile_a_range():
    """``boxes.boxes``: any range of any row-major shape, as at most ``2 * ndim - 1`` boxes, in
    order, each contiguous; ``boxes.runs``: a box as the runs of the flattening it covers."""
    import math
    import random

    rng = random.Random(0)
    for _ in range(2000):
        shape = tuple(rng.randint(1, 5) for _ in range(rng.randint(1, 4)))
        n = math.prod(shape)
        a = rng.randint(0, n)
        b = rng.randint(a, n)
        index = torch.arange(n).view(shape)
        got = []
        found = boxes.boxes(shape, a, b)
        assert len(found) <= 2 * len(shape) - 1, (shape, a, b, found)
        for box in found:
            cut = index[tuple(slice(o, o + s) for o, s in zip(*box))].reshape(-1).tolist()
            assert cut == list(range(cut[0], cut[0] + len(cut))), (shape, box)  # contiguous
            assert [i for lo, k in boxes.runs(shape, box) for i in range(lo, lo + k)] == cut
            got += cut
        assert got == list(range(a, b)), (shape, a, b)
    assert boxes.runs((4, 6), ((0, 3), (4, 3))) == [(3, 3), (9, 3), (15, 3), (21, 3)]


def test_covers_finds_gaps_and_overlaps():
    """The validation of an N-D parameter's chunks (``boxes.covers``): exact tiles pass, a
    missing or an overlapping chunk is named."""
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata as Chunk

    def chunk(o, s):
        return Chunk(offsets=torch.Size(o), sizes=torch.Size(s))

    tiles = [chunk((0, 0), (4, 3)), chunk((0, 3), (1, 3)), chunk((1, 3), (3, 3))]
    assert boxes.covers(tiles, (4, 6)) == ""
    assert "hold 18 of 24" in boxes.covers(tiles[:2] + [chunk((1, 3), (3, 1))], (4, 6))
    assert "overlap" in boxes.covers([chunk((0, 0), (2, 2)), chunk((0, 1), (2, 2))], (2, 4))
