"""A replica group killed (SIGKILL of one of its ranks) mid-step: the survivors throw that step
away and go on alone, the group's launcher starts it again, and it comes back with its peer's
state through torchft (no checkpoint read).

Checked against references, bit for bit:

- the survivors' weights equal a one-process replay of the committed steps (each step: the
  gradients of the groups that took part, at the shared data position, summed and scaled by
  1/participants as ls.ft does), so the steps alone and the steps after the rejoin are exactly
  what the surviving groups' data says;
- from its recovery on, the rejoined group's slices and optimizer state equal the survivors'
  after every step (a digest of both), and at the end.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _worker, _harness
from _dist import run_ranks  # noqa: E402
from _harness import FTRun  # noqa: E402
from _worker import data, digest  # noqa: E402

GROUPS = 2


def _replay(rank: int, world: int, plan: list[tuple[int, int]], out: str) -> None:
    """One process, one rank: for each committed step ``(position, n)``, groups 0..n-1's
    gradients at ``position`` (one rank each), summed in group order, times 1/n, AdamW."""
    _replay_by_group(rank, world, [[(g, p) for g in range(n)] for p, n in plan], out)


def _check_rejoin(
    outs: dict, ranks: int, kill_step: int | None, exact: bool = True, async_quorum: bool = True
) -> dict:
    """What every killed-group test checks; returns the survivors' rank-0 records.
    ``kill_step``: the step the survivors lose (None: the group died before that step's quorum,
    which then formed without it: nothing lost); ``exact=False``: the first they lose, and at
    most one more. ``async_quorum=False``: the group heals before its first step's forward and
    takes part in it."""
    for r in range(ranks):
        alive, back = outs[(0, r)], outs[(1, r)]
        recs = alive["records"]
        lost = [x["step"] for x in recs if not x["committed"]]
        expected = [] if kill_step is None else [kill_step]
        assert lost == expected if exact else lost[:1] == expected and len(lost) <= 2, recs
        alone = [x for x in recs if x["participants"] == 1]
        assert alone and recs[-1]["participants"] == GROUPS, recs
        kinds = [e["kind"] for e in back["report"]["events"]]
        assert "recovered" in kinds, back["report"]
        healed = next(e for e in back["report"]["events"] if e["kind"] == "recovered")
        by_after = {x["after"]: x for x in recs if x["committed"]}
        after = [x for x in back["records"] if x["committed"]]
        # the healing step: under an asynchronous quorum zeros, then the peer's state; under a
        # synchronous one the peer's state first, then a full part in the step
        assert after[0]["participating"] is not async_quorum
        for x in after:  # from the recovery on, every step's state equals the survivors'
            twin = by_after[x["after"]]
            assert x["digest"] == twin["digest"], (r, x["after"])
            if x["participating"]:
                assert x["position"] == twin["position"], (r, x)
        assert healed["step"] == after[0]["after"] - 1
        assert all(torch.equal(a, b) for a, b in zip(back["slices"], alive["slices"])), r
        assert back["report"]["step"] == alive["report"]["step"]
    return outs[(0, 0)]["records"]


def test_group_killed_mid_backward_rejoins(tmp_path):
    """2 groups x 1 rank; group 1's rank SIGKILLs itself after its forward of step 3."""
    kill_step = 3
    with FTRun(
        tmp_path, GROUPS, 1, steps=8, kill=(1, 0, kill_step, "backward"), throttle_s=0.8
    ) as run:
        outs = run.run()
    recs = _check_rejoin(outs, 1, kill_step)
    plan = [(x["position"], x["participants"]) for x in recs if x["committed"]]
    assert GROUPS in [n for _, n in plan][:kill_step]  # the groups trained together before
    run_ranks(_replay, 1, plan, str(tmp_path / "replay"))
    ref = torch.load(tmp_path / "replay", weights_only=False)
    survivor = outs[(0, 0)]
    assert all(torch.equal(a, b) for a, b in zip(survivor["slices"], ref["slices"]))
    assert survivor["records"][-1]["digest"] == ref["digest"]


@pytest.mark.slow
@pytest.mark.parametrize("where", ["forward", "reduce"])
def test_two_by_two_rank_killed_rejoins(tmp_path, where):
    """2 groups x 2 ranks; group 1's rank 1 SIGKILLs itself at step 2 before it starts the step
    (its group never joins that step's quorum: the survivors lose nothing), or inside the
    cross-group all-reduce (its peers waiting in it for its data: the survivors throw step 2 away); the
    launcher takes its group down and starts it again."""
    with FTRun(tmp_path, GROUPS, 2, steps=6, kill=(1, 1, 2, where), throttle_s=0.2) as run:
        outs = run.run()
    _check_rejoin(outs, 2, None if where == "forward" else 2)


@pytest.mark.slow
def test_group_hangs_then_is_restarted(tmp_path):
    """2 groups x 1 rank; group 1's rank SIGSTOPs itself after its forward of step 3: it hangs
    instead of dying, its sockets open. The survivors' cross-group all-reduce fails at torchft's
    timeout (5 s here), they throw the step away and go on alone (the hung group stopped
    heartbeating); 8 s after it stopped, a watchdog (the harness) kills it and its launcher
    starts it again, and it heals."""
    timeout_s = 5
    with FTRun(
        tmp_path, GROUPS, 1, steps=8, kill=(1, 0, 3, "hang"), throttle_s=0.4,
        ft_timeout_s=timeout_s, hang_s=8.0,
    ) as run:  # fmt: skip
        outs = run.run()
    recs = _check_rejoin(outs, 1, 3)
    i = next(i for i, x in enumerate(recs) if not x["committed"])
    waited = recs[i + 1]["wall"] - recs[i]["wall"]  # the thrown-away step, then a step alone
    assert timeout_s - 0.5 < waited < timeout_s + 6, waited  # no hang past the timeout


@pytest.mark.slow
def test_killed_again_while_recovering(tmp_path):
    """2 groups x 1 rank; group 1 killed mid-backward at step 3, started again, and killed again
    as torchft's checkpoint transport starts to receive its peer's state; started a third time,
    it heals. The survivors lose the step of the first death and at most the step of the
    second (a quorum that counted the healing group), nothing else."""
    with FTRun(
        tmp_path, GROUPS, 1, steps=8, kill=(1, 0, 3, "backward"), kill_again=(1, 0, "recv"),
        throttle_s=0.4,
    ) as run:  # fmt: skip
        outs = run.run()
    assert run.starts[1] == 3
    _check_rejoin(outs, 1, 3, exact=False)


@pytest.mark.slow
def test_group_killed_rejoins_with_synchronous_quorum(tmp_path):
    """As test_group_killed_mid_backward_rejoins, with ``use_async_quorum=False``: the quorum
    and the recovery happen in ``ft.zero_grad()``, before the forward."""
    with FTRun(
        tmp_path, GROUPS, 1, steps=8, kill=(1, 0, 3, "backward"), throttle_s=0.8,
        async_quorum=False,
    ) as run:  # fmt: skip
        outs = run.run()
    _check_rejoin(outs, 1, 3, async_quorum=False)


def _replay_by_group(rank: int, world: int, plan: list[list[tuple[int, int]]], out: str) -> None:
    """The replay of committed steps, each given as the ``(group, position)`` of every group
    that took part, summed in that order, times 1/their number, AdamW (after a Lighthouse
    restart two groups can read different positions in one step: the one whose lone step
    failed moved on)."""
    from _parity import LR, lm_loss, local, tiny_llama

    import layershard as ls

    model = ls.shard(tiny_llama(0))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    flats = [f for f in model.flat_params if f.requires_grad]
    for step in plan:
        total: list[torch.Tensor] = []
        for g, position in step:
            opt.zero_grad()
            lm_loss(model, local(data(position), g, GROUPS)).backward()
            grads = [f.grad.clone() for f in flats]
            total = grads if not total else [a + b for a, b in zip(total, grads)]
        for f, s in zip(flats, total):
            torch.mul(s, 1.0 / len(step), out=f.grad)
        opt.step()
    torch.save(
        {"slices": [f.shard.clone() for f in model.flat_params], "digest": digest(model, opt)}, out
    )


@pytest.mark.slow
def test_lighthouse_restarts(tmp_path):
    """2 groups x 1 rank; after 30 steps the Lighthouse is shut down and a new one (no memory
    of the old one's quorums) started on its address 3 s later. Every rank asks again
    (``quorum_retries``, 20 by default in ls.ft; with torchft's own default, 0, every rank ended
    with ``TimeoutError: status: Cancelled, message: "Timeout expired"`` in three runs of
    three) and the job goes on: no group restarted, at most one step thrown away per group,
    no wait longer than the outage plus the quorum timeout, and the weights equal a one-process
    replay of the committed steps."""
    outage_s, quorum_timeout_s = 3.0, 15
    journal = tmp_path / "journal"
    with FTRun(
        tmp_path, GROUPS, 1, steps=60, lighthouse_down=(30, outage_s), journal=str(journal),
        ft_timeout_s=5, quorum_timeout_s=quorum_timeout_s, throttle_s=0.05,
    ) as run:  # fmt: skip
        outs = run.run()
    assert run.lighthouse_restarted_at is not None and run.starts == {0: 1, 1: 1}, run.starts
    steps: dict[int, list[tuple[int, int]]] = {}
    for g in range(GROUPS):
        recs = run.journal(g, 0)
        assert sum(not x["committed"] for x in recs) <= 1, recs
        gaps = [b["wall"] - a["wall"] for a, b in zip(recs, recs[1:])]
        assert max(gaps) < outage_s + quorum_timeout_s, max(gaps)
        assert any(x["wall"] > run.lighthouse_restarted_at for x in recs)  # trained on after
        for x in recs:
            if x["committed"] and x["participating"]:
                steps.setdefault(x["after"], []).append((g, x["position"]))
    last = outs[(0, 0)]["report"]["step"]
    assert sorted(steps) == list(range(1, last + 1))
    plan = [sorted(steps[k]) for k in sorted(steps)]
    run_ranks(_replay_by_group, 1, plan, str(tmp_path / "replay"))
    ref = torch.load(tmp_path / "replay", weights_only=False)
    for g in range(GROUPS):
        assert all(torch.equal(a, b) for a, b in zip(outs[(g, 0)]["slices"], ref["slices"]))
        assert outs[(g, 0)]["records"][-1]["digest"] == ref["digest"]
