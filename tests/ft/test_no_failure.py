"""No failure: 2 replica groups x 2 ranks on torchft (ls.ft) train exactly as plain ``hybrid``
(4 ranks, shard_size=2) at the same global batch: every step's loss on every rank and the final
slices and optimizer state bit for bit.

Why bitwise holds (src/layershard/ft/replicas.py): hybrid scales the gradient summed over all 4
ranks by 1/4; ls.ft scales each group's sum by 1/2 (exact: a power of two), sums the two groups'
slices through torchft (a sum of two fp32 numbers, which does not depend on their order) and
scales by 1/2 (exact). The forward and the group's own collectives are hybrid's."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _worker, _harness
from _dist import run_ranks  # noqa: E402
from _harness import FTRun  # noqa: E402
from _worker import data, digest  # noqa: E402

GROUPS, RANKS, STEPS = 2, 2, 5


def _hybrid(
    rank: int, world: int, steps: int, out: str, shard_size: int = RANKS, kind: str = "llama"
) -> None:
    from _parity import LR, lm_loss, local
    from _worker import build_model

    import layershard as ls

    model = ls.shard(build_model(kind), strategy="hybrid", shard_size=shard_size)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for position in range(steps):
        opt.zero_grad()
        loss = lm_loss(model, local(data(position), rank, world))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    torch.save(
        {
            "losses": losses,
            "slices": [f.shard.clone() for f in model.flat_params],
            "digest": digest(model, opt),
        },
        f"{out}.{rank}",
    )


@pytest.fixture(scope="module")
def hybrid(tmp_path_factory):
    """``hybrid(world, shard_size, kind)``: where the hybrid run of that layout and model wrote
    its ranks' results (``PREFIX.RANK``), run once a module: the transformers Llama's serves
    both its ls.ft loops (the plain one and accelerate's)."""
    made: dict[tuple[int, int, str], Path] = {}

    def get(world: int, shard_size: int, kind: str) -> Path:
        if (world, shard_size, kind) not in made:
            prefix = tmp_path_factory.mktemp("hybrid") / "hybrid"
            run_ranks(_hybrid, world, STEPS, str(prefix), shard_size, kind)
            made[(world, shard_size, kind)] = prefix
        return made[(world, shard_size, kind)]

    return get


def _compare(tmp_path, hybrid, groups: int, ranks: int, **cfg) -> None:
    kind = {"accelerate": "hf"}.get(cfg.get("model", "llama"), cfg.get("model", "llama"))
    reference = hybrid(groups * ranks, ranks, kind)
    with FTRun(tmp_path, groups, ranks, STEPS, deadline_s=120, min_replicas=groups, **cfg) as run:
        outs = run.run()
    for (g, r), out in outs.items():
        ref = torch.load(f"{reference}.{g * ranks + r}", weights_only=False)
        recs = out["records"]
        assert [x["committed"] for x in recs] == [True] * STEPS, recs
        assert [x["participants"] for x in recs] == [groups] * STEPS, recs
        assert [x["loss"] for x in recs] == ref["losses"], (g, r)
        assert all(torch.equal(a, b) for a, b in zip(out["slices"], ref["slices"])), (g, r)
        assert recs[-1]["digest"] == ref["digest"], (g, r)  # slices and AdamW state, bytewise
        assert out["report"]["events"] == [] and out["report"]["step"] == STEPS


def test_two_groups_equal_hybrid(tmp_path, hybrid):
    _compare(tmp_path, hybrid, GROUPS, RANKS)


@pytest.mark.slow
def test_three_groups_of_one_equal_hybrid(tmp_path, hybrid):
    """3 groups x 1 rank against hybrid over 3 ranks (shard_size=1: a replicate group of 3).
    A sum of three depends on its order; here torchft's gloo group all-reduces each flat group's
    slice alone (``bucket_mb=0``: buffers of hybrid's sizes, which gloo splits and sums as it
    does hybrid's) over the groups in hybrid's rank order, and the results are bitwise."""
    _compare(tmp_path, hybrid, 3, 1, bucket_mb=0)


@pytest.mark.slow
def test_transformers_model_equals_hybrid(tmp_path, hybrid):
    """A transformers ``LlamaForCausalLM`` through ls.ft, 2 groups x 1 rank, against hybrid over
    2 ranks (``shard_size=1``): the same loop as the built-in model's, bit for bit."""
    _compare(tmp_path, hybrid, 2, 1, model="hf")


@pytest.mark.slow
def test_accelerate_loop_equals_hybrid(tmp_path, hybrid):
    """``ls.hf.Accelerator().prepare(model, optimizer)``, then ls.ft on what it returns, and
    ``accelerator.backward``: 2 groups x 1 rank of a transformers Llama, bit for bit hybrid's."""
    _compare(tmp_path, hybrid, 2, 1, model="accelerate")


def test_buckets():
    """The cross-group all-reduce's buckets: consecutive flat groups up to the cap; a group
    larger than the cap alone; ``bucket_mb=0``: one bucket per flat group."""
    from layershard.ft.replicas import _buckets

    mb = 2**20 // 4  # fp32 elements in 1 MB
    assert _buckets([mb // 2, mb // 2, mb // 2], 1.0) == [(0, 2), (2, 3)]
    assert _buckets([3 * mb, 10, 10], 1.0) == [(0, 1), (1, 3)]
    assert _buckets([10, 10, 10], 0) == [(0, 1), (1, 2), (2, 3)]
    assert _buckets([], 25.0) == []
