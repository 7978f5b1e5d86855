"""Replica groups as processes, a Lighthouse in the test process, and a launcher's restart
(what torchrun's agent does for a group whose rank died): ``FTRun``.

Each rank is ``python _worker.py JSON`` (a process of its own, so that it can be SIGKILLed and
its group started again); every process is killed at the end, whatever happened, and every wait
has a deadline."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from layershard.ft import lighthouse_server

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _dist
from _dist import free_port  # noqa: E402

WORKER = Path(__file__).resolve().parent / "_worker.py"


class FTRun:
    """``groups`` replica groups of ``ranks`` ranks each, trained to ``steps`` committed steps.
    ``kill=(group, rank, step, where)`` makes that rank SIGKILL itself; the harness then kills
    the rest of its group and starts the group again. ``kill_again=(group, rank, where)``: that
    rank of the group's second start kills itself too (``"recv"``: as it starts receiving its
    peer's state), and the group is started a third time. ``schedule``: failures spread over
    the run, ``[(group, rank, step, where), ...]`` (the worker's ``kills``), each group started
    again after each. ``lighthouse_down=(step, for_s)``: once group 0's rank 0 has taken
    ``step`` steps (its ``journal``), the Lighthouse is shut down and a new one started on its
    address ``for_s`` later (it knows nothing of the old one's quorums). Use as a context
    manager."""

    def __init__(
        self,
        tmp: Path,
        groups: int,
        ranks: int,
        steps: int,
        kill: tuple[int, int, int, str] | None = None,
        deadline_s: float = 150.0,
        heartbeat_timeout_ms: int = 2000,
        min_replicas: int = 1,
        join_timeout_ms: int = 5000,
        hang_s: float = 8.0,
        kill_again: tuple[int, int, str] | None = None,
        schedule: list[tuple[int, int, int, str]] | None = None,
        lighthouse_down: tuple[float, float] | None = None,
        **cfg,
    ) -> None:
        self.tmp, self.groups, self.ranks, self.steps = tmp, groups, ranks, steps
        self.kill, self.deadline_s, self.cfg = kill, deadline_s, cfg
        self.kill_again = kill_again
        self.schedule = schedule or []
        self.deaths: dict[int, int] = {}  # group -> planned deaths seen
        # A group that misses heartbeats for heartbeat_timeout_ms (a dead one; on a loaded
        # machine, at 1 s, also a live one now and then) is left out of the next quorum;
        # min_replicas=groups: no quorum without every group (the runs without a failure).
        self._lighthouse_args = dict(
            min_replicas=min_replicas,
            join_timeout_ms=join_timeout_ms,
            heartbeat_timeout_ms=heartbeat_timeout_ms,
            quorum_tick_ms=20,
        )
        self.lighthouse = lighthouse_server(**self._lighthouse_args)
        self.lighthouse_address = self.lighthouse.address()
        self.lighthouse_down = lighthouse_down  # (after s, for s): the Lighthouse restarted
        self.lighthouse_restarted_at: float | None = None
        self.procs: dict[tuple[int, int], subprocess.Popen] = {}
        self.starts: dict[int, int] = {}  # group -> how many times it was started
        self.failed_at: dict[int, float] = {}  # group -> when the harness saw a rank die
        self.restarted_at: dict[int, float] = {}
        self.hung_at: float | None = None
        self.hang_s = hang_s  # a hung rank (kill "hang") is killed this long after it stopped

    def __enter__(self) -> FTRun:
        return self

    def __exit__(self, *exc) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:  # pragma: no cover - a zombie we cannot reap
                pass
        self.lighthouse.shutdown()

    def out(self, g: int, r: int) -> Path:
        return self.tmp / f"out.{g}.{r}.pt"

    def _log(self, g: int, r: int) -> Path:
        return self.tmp / f"log.{g}.{r}.{self.starts[g]}"

    def start_group(self, g: int) -> None:
        first = g not in self.starts
        self.starts[g] = self.starts.get(g, 0) + 1
        port = free_port()
        ready = self.tmp / "ready"
        ready.mkdir(exist_ok=True)
        for r in range(self.ranks):
            cfg = {
                **self.cfg,
                "group": g, "rank": r, "ranks": self.ranks, "groups": self.groups,
                "steps": self.steps, "master_port": port,
                "lighthouse": self.lighthouse_address, "out": str(self.out(g, r)),
                "ready": str(ready) if first else None,
                "deadline_s": self.deadline_s,
            }  # fmt: skip
            if first and self.kill and self.kill[:2] == (g, r):
                cfg["kill"] = [self.kill[2], self.kill[3]]
            if self.starts[g] == 2 and self.kill_again and self.kill_again[:2] == (g, r):
                cfg["kill"] = [-1, self.kill_again[2]]
            if self.schedule:
                cfg["kills"] = [[s, w] for gg, rr, s, w in self.schedule if (gg, rr) == (g, r)]
                cfg["fired"] = str(self.tmp / "fired")
                (self.tmp / "fired").mkdir(exist_ok=True)
            env = {**os.environ, "PYTHONUNBUFFERED": "1"}
            with open(self._log(g, r), "w") as log:
                self.procs[(g, r)] = subprocess.Popen(
                    [sys.executable, str(WORKER), json.dumps(cfg)],
                    stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
                )  # fmt: skip

    def journal(self, g: int, r: int) -> list[dict]:
        """Rank ``r`` of group ``g``'s step records over all its starts (the ``journal`` cfg)."""
        path = Path(f"{self.cfg['journal']}.{g}.{r}.jsonl")
        return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []

    def logs(self) -> str:
        parts = []
        for path in sorted(self.tmp.glob("log.*")):
            text = path.read_text()
            parts.append(f"--- {path.name}\n{text[-3000:]}")
        return "\n".join(parts)

    def run(self) -> dict[tuple[int, int], dict]:
        """Start every group, restart the one whose rank died (once), wait for every rank to
        finish; each rank's saved output."""
        for g in range(self.groups):
            self.start_group(g)
        deadline = time.monotonic() + self.deadline_s
        while True:
            if self.lighthouse_down and self.lighthouse_restarted_at is None:
                at_step, for_s = self.lighthouse_down
                if len(self.journal(0, 0)) >= at_step:
                    self.lighthouse.shutdown()
                    del self.lighthouse  # its port is free once the server is dropped
                    gc.collect()
                    time.sleep(for_s)
                    port = self.lighthouse_address.rsplit(":", 1)[1]
                    self.lighthouse = lighthouse_server(
                        bind=f"127.0.0.1:{port}", **self._lighthouse_args
                    )
                    self.lighthouse_restarted_at = time.time()
            if time.monotonic() > deadline:
                raise TimeoutError(f"the run did not finish in {self.deadline_s} s\n{self.logs()}")
            codes = {key: p.poll() for key, p in self.procs.items()}
            if self.kill and self.kill[3] == "hang" and self.starts[self.kill[0]] == 1:
                g, r = self.kill[:2]
                if _stopped(self.procs[(g, r)].pid):  # the hang a watchdog would notice
                    self.hung_at = self.hung_at or time.monotonic()
                    if time.monotonic() - self.hung_at > self.hang_s:
                        codes[(g, r)] = -signal.SIGSTOP  # handled as its death below
            for (g, _r), rc in codes.items():
                if rc not in (None, 0):
                    planned = (
                        self.kill is not None and self.kill[0] == g and self.starts[g] == 1
                    ) or (
                        self.kill_again is not None
                        and self.kill_again[0] == g
                        and self.starts[g] == 2
                    )
                    # a scheduled failure writes its marker before it fires
                    fired = len(list((self.tmp / "fired").glob(f"{g}.*"))) if self.schedule else 0
                    planned = planned or self.deaths.get(g, 0) < fired
                    if not planned:
                        raise AssertionError(f"group {g} failed (rc {rc})\n{self.logs()}")
                    self.deaths[g] = self.deaths.get(g, 0) + 1
                    self.failed_at[g] = time.monotonic()
                    for r2 in range(self.ranks):  # the launcher takes the group down
                        p = self.procs[(g, r2)]
                        if p.poll() is None:
                            os.killpg(p.pid, signal.SIGKILL)
                            p.wait(timeout=10)
                    self.start_group(g)
                    self.restarted_at[g] = time.monotonic()
                    break
            else:
                if all(rc == 0 for rc in codes.values()):
                    break
                time.sleep(0.05)
        return {key: torch.load(self.out(*key), weights_only=False) for key in self.procs}


def _stopped(pid: int) -> bool:
    """The process is stopped (SIGSTOP): state ``T`` in ``/proc/PID/stat``."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "T"
