"""Ten failures at random over 200 steps (the issue's soak): 3 replica groups x 1 rank, each
failure a SIGKILL of a random group's rank before its forward, after it, or inside the
cross-group all-reduce; its launcher (the harness) starts the group again each time and it heals
from a peer. No checkpoint is written or read anywhere in the run.

Checked: every failure fired and every group came back; each cost the survivors at most one
thrown-away step; no survivor waited longer than torchft's timeout between two steps; at the end
every group's slices and AdamW state are bitwise the same; the run is what its committed steps
say (a one-process replay of them, each step the participating groups' gradients at its data
position, gives the same validation loss, which a group back with stale or initial weights
would not). Its final validation loss against the run-to-run spread of uninterrupted runs is
printed, not asserted: how many batches the failures cost is how fast a group comes back, a
matter of the machine's load (below).

The spread: the same 200 steps, uninterrupted, in one process, for 8 seeds (the model's init
and the data order both varied, as two launches of a job differ). At LR 1e-3 the chain data
(tests/ft/_worker.py) is mid-curve at step 200 (validation loss 4.5 -> 1.1, falling ~0.01 a
step), so a run that lost many batches lands above it.

Measured 2026-11-29 (three runs of this test): the run 1.142; the 8 seeds 1.096-1.149 (seed 0,
the run's own init and data, 1.109). Varying the data order alone (5 orders, init fixed) gives
1.105-1.124, which the run misses by 0.018: the failures left 23 of the 200 steps with two
groups' batches instead of three and threw 4 batches away, and the replay of exactly those steps
reproduces the run's 1.142 (within 3e-8), so that difference is the data lost, not a fault of
the recovery. On 2026-11-30, on a loaded machine (the groups slower to come back), the run lost
more: 1.156 in CI and 1.198 beside two benchmarks, above the seeds' max, the replay equal to the
run each time. (The test asserted "between their min and max" until then.)"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))  # _worker, _harness
from _dist import run_ranks  # noqa: E402
from _harness import FTRun  # noqa: E402
from _worker import GLOBAL_BATCH, data, validation_loss  # noqa: E402

GROUPS, STEPS, FAILURES, LR, SEEDS = 3, 200, 10, 1e-3, 8
# torchft's collective timeout; its quorum timeout (a restarted group's first quorum waits for
# the others' next step, on 2 loaded cores several seconds); the survivors' sleep per step
# while a group is down (so that it rejoins within a few steps)
TIMEOUT_S, QUORUM_TIMEOUT_S, THROTTLE_S = 5, 30, 1.0


def _references(rank: int, world: int, plan: list[tuple[int, list[int]]], out: str) -> None:
    """One process: the replay of the run's committed steps ``(position, groups)``, then the
    uninterrupted runs of every seed (the 3 groups' rows of each global batch, their mean loss:
    the groups' average gradient)."""
    from _parity import lm_loss, local, tiny_llama

    model = tiny_llama(0)
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    params = list(model.parameters())
    for position, groups in plan:
        total: list[torch.Tensor] = []
        for g in groups:
            opt.zero_grad()
            lm_loss(model, local(data(position, "chain"), g, GROUPS)).backward()
            grads = [p.grad.clone() for p in params]
            total = grads if not total else [a + b for a, b in zip(total, grads)]
        for p, t in zip(params, total):
            p.grad = t / len(groups)
        opt.step()
    replay = validation_loss(model, "chain")

    rows = GROUPS * (GLOBAL_BATCH // GROUPS)
    seeds = []
    for seed in range(SEEDS):
        model = tiny_llama(seed)
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        for position in range(STEPS):
            opt.zero_grad()
            lm_loss(model, data(position, "chain", 1000 + 10**5 * seed)[:rows]).backward()
            opt.step()
        seeds.append(validation_loss(model, "chain"))
    torch.save({"replay": replay, "seeds": seeds}, out)


def _committed_plan(journal: Path, last: int) -> list[tuple[int, list[int]]]:
    """From every start's journal: each committed step's data position and the groups that
    took part in it (keyed by the step counter after it; a healing group's record, which
    carries its own stale counter and position and sent zeros, is not one of them)."""
    steps: dict[int, list[dict]] = {}
    for path in journal.parent.glob(f"{journal.name}.*.jsonl"):
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            if rec["committed"] and rec["participating"]:
                steps.setdefault(rec["after"], []).append(rec)
    plan = []
    for after in sorted(steps):
        recs = steps[after]
        (position,) = {r["position"] for r in recs}  # every group read the same batch
        groups = sorted(r["group"] for r in recs)
        assert {r["participants"] for r in recs} == {len(groups)}, recs
        plan.append((position, groups))
    assert sorted(steps) == list(range(1, last + 1)), sorted(steps)
    return plan


@pytest.mark.slow
def test_ten_random_failures_over_200_steps(tmp_path):
    rng = random.Random(20261129)
    schedule = [
        (rng.randrange(GROUPS), 0, step, rng.choice(["forward", "backward", "reduce"]))
        for step in sorted(rng.sample(range(5, 150), FAILURES))
    ]
    journal = tmp_path / "journal"
    with FTRun(
        tmp_path, GROUPS, 1, steps=STEPS, schedule=schedule, throttle_s=THROTTLE_S,
        ft_timeout_s=TIMEOUT_S, quorum_timeout_s=QUORUM_TIMEOUT_S, deadline_s=600,
        journal=str(journal), data="chain", lr=LR, validate=True,
    ) as run:  # fmt: skip
        outs = run.run()
    assert sum(run.deaths.values()) == FAILURES, (run.deaths, schedule)

    final = [outs[(g, 0)] for g in range(GROUPS)]
    for out in final[1:]:  # every group ends with the same state, bit for bit
        assert all(torch.equal(a, b) for a, b in zip(out["slices"], final[0]["slices"]))
        assert out["records"][-1]["digest"] == final[0]["records"][-1]["digest"]
        assert out["report"]["step"] == final[0]["report"]["step"] >= STEPS
    for g in range(GROUPS):  # every start's steps, from the survivors' side of each failure
        recs = run.journal(g, 0)
        assert sum(not x["committed"] for x in recs) <= FAILURES, recs
        gaps = [b["wall"] - a["wall"] for a, b in zip(recs, recs[1:]) if b["step"] >= a["step"]]
        assert max(gaps) < TIMEOUT_S + THROTTLE_S + 2.0, max(gaps)  # no hang past the timeout

    plan = _committed_plan(journal, final[0]["report"]["step"])
    run_ranks(_references, 1, plan, str(tmp_path / "references"))
    ref = torch.load(tmp_path / "references", weights_only=False)
    got = final[0]["validation_loss"]
    # the replay sums the groups in another order than gloo's ring: 200 steps of fp32 rounding
    assert abs(got - ref["replay"]) < 1e-5, (got, ref["replay"])
    # What the failures cost, recorded, not asserted: the batches they threw away or trained
    # with fewer groups depend on how fast a group comes back, which is the machine's load
    # (the replay above is what says the recovery lost nothing else).
    seeds, fewer = ref["seeds"], sum(len(g) < GROUPS for _, g in plan)
    print(f"soak: loss {got:.4f}, uninterrupted {seeds[0]:.4f}, seeds {min(seeds):.4f}-"
          f"{max(seeds):.4f}; {fewer} of {len(plan)} steps with fewer groups")  # fmt: skip
