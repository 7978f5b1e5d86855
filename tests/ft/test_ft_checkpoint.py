"""Scheduled checkpoints under ls.ft: one group writes an ``ls.save_checkpoint`` from its own
world (2 ranks), with the data position and torchft's step in ``extra``; it loads at another
layout (1 rank, no torchft) to the same full weights, optimizer state and position."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _worker, _harness
from _dist import run_ranks  # noqa: E402
from _harness import FTRun  # noqa: E402

STEPS = 3


def _load_one_rank(rank: int, world: int, ckpt: str, out: str) -> None:
    from _parity import LR, tiny_llama

    import layershard as ls

    model = ls.shard(tiny_llama(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    info = ls.load_checkpoint(ckpt, model, opt)
    steps = {int(s["step"].item()) for s in opt.state.values()}
    torch.save({"full": model.full_state_dict(), "info": info, "opt_steps": steps}, out)


@pytest.mark.slow
def test_checkpoint_of_one_group_loads_at_another_layout(tmp_path):
    ckpt = tmp_path / "ckpt"
    with FTRun(tmp_path, 2, 2, STEPS, save_dir=str(ckpt)) as run:
        outs = run.run()
    run_ranks(_load_one_rank, 1, str(ckpt), str(tmp_path / "loaded"))
    loaded = torch.load(tmp_path / "loaded", weights_only=False)
    for g in (0, 1):  # every group holds the weights the checkpoint has
        full = outs[(g, 0)]["full"]
        assert full.keys() == loaded["full"].keys()
        assert all(torch.equal(full[k], loaded["full"][k]) for k in full), g
    info = loaded["info"]
    assert info["step"] == STEPS and info["world_size"] == 2
    assert info["extra"]["data_position"] == STEPS
    assert info["extra"]["torchft"]["step"] == STEPS
    assert loaded["opt_steps"] == {STEPS}  # AdamW's state came with it
