"""What a rank does when something goes wrong around it: a stop request (SIGTERM from a scheduler,
Ctrl-C), a collective that does not complete (a peer frozen, dead or on another code path).

Both talk through torchrun's key-value store (a TCP connection of its own, not the process
group), so they work while the process group is busy or stuck:

- ``StopRequest``: a signal sets a flag; at the end of a step the rank proposes to stop after the
  next step, and every rank reads the one proposal that won, so all of them stop after the same
  step and can save a checkpoint together.
- ``Watchdog``: a thread that publishes this rank's heartbeat and position (step, collectives
  issued) and, when the rank has made no progress for a while, says where it waits (which
  collective, which unit, from the labels its threads set and their Python stacks) and which
  ranks are not there yet.
"""

from __future__ import annotations

import ctypes
import json
import os
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from layershard.distributed import default_timeout
from layershard.engine import waits
from layershard.train.status import signal_name

STOP_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGUSR1")

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def die_with_parent(sig: int, parent: int) -> None:
    """Have the kernel send ``sig`` to this process when ``parent`` (its parent) exits, however
    it exits, SIGKILL included: `layershard train` -> torchrun's agent -> the ranks, so that no
    agent or rank trains on headless, holding the run folder, after its launcher is gone.

    Linux's PR_SET_PDEATHSIG; elsewhere a thread that polls the parent's pid once a second.
    A parent that died before this call is caught too: the process has been re-parented."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    else:

        def watch() -> None:
            while os.getppid() == parent:
                time.sleep(1.0)
            os.kill(os.getpid(), sig)

        threading.Thread(target=watch, name="layershard-parent-watch", daemon=True).start()
    if os.getppid() != parent:  # already gone before the kernel was told
        os.kill(os.getpid(), sig)


# Set by layershard.train.launch.agent for its ranks: the rendezvous round they start in (1, 2, ...).
ROUND_ENV = "LAYERSHARD_RDZV_ROUND"


def attempt() -> int:
    """Which start of the ranks this is in this launch (0: the first), the same on every rank of
    every node: the rendezvous round under a dynamic rendezvous (agent.Rounds says why torchrun's
    per-agent restart count is not), else torchrun's restart count (one agent, or static)."""
    rnd = os.environ.get(ROUND_ENV)
    if rnd:
        return int(rnd) - 1
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def _prefix() -> str:
    # The agent's store outlives a restart of the workers: keys are per launch and per attempt.
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "run")
    return f"layershard/{run_id}/{attempt()}/"


def connect_store(timeout_s: float = 30.0) -> dist.Store | None:
    """A client of the job's TCP store (torchrun's, or rank 0's), or None for a lone process."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if not addr or not port or int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    store = dist.TCPStore(addr, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
    return dist.PrefixStore(_prefix(), store)


class StopRequest:
    """Stop after a step on SIGTERM, SIGINT, SIGHUP or SIGUSR1, all ranks after the same one.

    ``should_stop(step)`` is called by every rank after every step, after the step's last
    collective has completed on this rank. A rank that completed step s cannot be more than one
    step ahead of any other: its step-s collectives needed every rank. So a proposal "stop after
    s + 1", made by a rank at the end of step s, reaches every rank before it ends step s + 1.
    """

    def __init__(
        self, store: dist.Store | None, announce: bool = True, timeout_s: float | None = None
    ) -> None:
        self.store, self.announce = store, announce
        self._ask = _Bounded(timeout_s)
        self.signum: int | None = None  # the first signal this rank received
        self.stop_at: int | None = None
        self.signal: str | None = None  # the signal of the proposal that won
        self._proposed = False
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for name in STOP_SIGNALS:
            sig = getattr(signal, name)
            self._previous[sig] = signal.signal(sig, self._handler)

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _handler(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum
            if not self.announce:
                return
            # os.write: print() is not safe inside a signal handler
            os.write(
                2,
                f"layershard train: {signal_name(signum)} received: stopping after the current "
                "step, saving a checkpoint\n".encode(),
            )

    def should_stop(self, step: int) -> bool:
        if self.store is None:
            if self.signum is not None:
                self.signal = signal_name(self.signum)
            return self.signum is not None
        store, ask = self.store, self._ask
        if self.signum is not None and not self._proposed:
            self._proposed = True
            ask(f"the stop request after step {step}", store.compare_set, "stop_signal", "",
                signal_name(self.signum))  # fmt: skip
            ask(f"the stop request after step {step}", store.compare_set, "stop_at", "",
                str(step + 1))  # fmt: skip
        if self.stop_at is None and ask(f"the stop check after step {step}", store.check,
                                        ["stop_at"]):  # fmt: skip
            self.stop_at = int(ask("the stop check", store.get, "stop_at"))
            self.signal = ask("the stop check", store.get, "stop_signal").decode()
        return self.stop_at is not None and step >= self.stop_at


class _Bounded:
    """Calls to the job's store from the training loop, each answered within the process-group
    timeout or raised as a timeout (one that names the wait, as a collective's does).

    Note: torch's TCPStore client waits for the answer of ``check`` and ``compare_set`` without a
    timeout. Over a link that went down, nothing answers and nothing resets the connection: a rank
    waited there until TCP gave up (about 15 minutes), long after its peers had timed out in their
    collective, and its node never said what happened. So each call runs on a daemon thread of
    this object's; one that does not answer in time is left there (the rank ends with os._exit).
    A later call (none in the training loop, where the timeout ends the rank) gets a fresh thread
    instead of queueing behind it."""

    def __init__(self, timeout_s: float | None) -> None:
        self.timeout_s = timeout_s
        self._jobs: queue.SimpleQueue | None = None

    def __call__(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        if self._jobs is None:
            self._jobs = queue.SimpleQueue()
            threading.Thread(
                target=self._serve, args=(self._jobs,), name="layershard-store", daemon=True
            ).start()
        done, box = threading.Event(), dict[str, Any]()
        self._jobs.put((fn, args, box, done))
        timeout = (
            self.timeout_s if self.timeout_s is not None else default_timeout().total_seconds()
        )
        with waits.waiting(what):  # the watchdog says where the rank waits
            answered = done.wait(timeout)
        if not answered:
            self._jobs = None
            addr = f"{os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
            raise RuntimeError(
                f"timed out waiting in {what}: the job's store at {addr} did not answer in "
                f"{timeout:.0f} s (its node, or the network to it, is gone)"
            )
        if "error" in box:
            raise box["error"]
        return box.get("value")

    @staticmethod
    def _serve(jobs: queue.SimpleQueue) -> None:
        while True:
            fn, args, box, done = jobs.get()
            try:
                box["value"] = fn(*args)
            except Exception as e:  # noqa: BLE001 - raised again on the caller's thread
                box["error"] = e
            done.set()


# ---- where the rank waits ------------------------------------------------------------------------


def where_rank_waits() -> str:
    """Where this rank waits, as its watchdog reports it: the newest label any thread set
    (``waits.innermost``; on a GPU the backward's waits are labelled on autograd's device thread
    while the main thread waits inside ``backward()``), with the innermost layershard frame of the
    thread holding it; with no label, the main thread's stack."""
    found = waits.innermost()
    if found is None:
        frame = main_thread_stack()
        return describe_stack(frame) if frame is not None else "?"
    ident, what = found
    return _where(what, sys._current_frames().get(ident))


def describe_stack(frame: Any, thread_id: int | None = None) -> str:
    """Where a thread blocked in layershard waits: "the all-gather of unit layers.3 (forward)",
    as the code that blocks says it (``layershard.engine.waits``), with the innermost layershard frame
    of its stack."""
    ident = thread_id if thread_id is not None else threading.main_thread().ident
    return _where(waits.describe(ident) if ident is not None else None, frame)


def _where(what: str | None, frame: Any) -> str:
    inner = frame
    while inner is not None and f"{os.sep}layershard{os.sep}" not in inner.f_code.co_filename:
        inner = inner.f_back
    if inner is None and what is None:
        return "outside layershard"
    text = what or f"{inner.f_code.co_name}"
    if inner is not None:
        at = f"{os.path.basename(inner.f_code.co_filename)}:{inner.f_lineno} {inner.f_code.co_name}"
        text += f" [{at}]"
    return text


def main_thread_stack() -> Any:
    ident = threading.main_thread().ident  # None only before the thread starts
    return sys._current_frames().get(ident) if ident is not None else None


class Watchdog(threading.Thread):
    """Publishes this rank's heartbeat every ``stall_s / 4`` s and reports a stall once the
    progress token (``progress()``: step and collectives issued) has not changed for ``stall_s``.
    The report goes to ``report`` (default: one block on stderr), then again every ``stall_s``."""

    def __init__(
        self,
        store: dist.Store,
        rank: int,
        world: int,
        stall_s: float,
        progress: Callable[[], tuple[int, int]],
        report: Callable[[str], None] | None = None,
    ) -> None:
        super().__init__(name="layershard-watchdog", daemon=True)
        self.store, self.rank, self.world = store, rank, world
        self.stall_s = stall_s
        self.interval = min(5.0, max(0.1, stall_s / 4))
        self.progress = progress
        self.report = report or (lambda text: print(text, file=sys.stderr, flush=True))
        self._stop = threading.Event()
        self._seq = 0
        self._peer_seen: dict[int, tuple[int, float]] = {}  # rank -> (heartbeat seq, when seen)

    def stop(self) -> None:
        self._stop.set()

    def run(self) -> None:
        last, since, reported_at = None, time.monotonic(), None
        while not self._stop.wait(self.interval):
            try:
                token = self.progress()
            except Exception:  # noqa: BLE001 - counters read mid-update: next round
                continue
            try:
                now = time.monotonic()
                if token != last:
                    last, since, reported_at = token, now, None
                self._heartbeat(token)
                stalled = now - since
                if stalled >= self.stall_s and (
                    reported_at is None or now - reported_at >= self.stall_s
                ):
                    reported_at = now
                    self.report(self.describe(token, stalled))
            except Exception:  # noqa: BLE001 - the store went away: the job is ending
                return

    def _heartbeat(self, token: tuple[int, int]) -> None:
        self._seq += 1
        where = where_rank_waits()
        record = {"seq": self._seq, "step": token[0], "collectives": token[1], "where": where}
        self.store.set(f"hb/{self.rank}", json.dumps(record))

    def _peers(self) -> dict[int, tuple[dict[str, Any] | None, float]]:
        now, out = time.monotonic(), {}
        for r in range(self.world):
            if r == self.rank:
                continue
            rec = None
            if self.store.check([f"hb/{r}"]):
                rec = json.loads(self.store.get(f"hb/{r}"))
            seq = rec["seq"] if rec else -1
            seen = self._peer_seen.get(r)
            if seen is None or seen[0] != seq:
                self._peer_seen[r] = seen = (seq, now)
            out[r] = (rec, now - seen[1])
        return out

    def describe(self, token: tuple[int, int], stalled: float) -> str:
        where = where_rank_waits()
        step, mine = token
        doing = f"busy {where}" if where.startswith("outside") else f"waiting in the {where}"
        lines = [
            f"layershard train: rank {self.rank}: no progress for {stalled:.0f} s, at step {step}, "
            f"collective #{mine}: {doing}"
        ]
        missing, others = [], []
        for r, (rec, quiet) in self._peers().items():
            if rec is None or quiet >= 2 * self.interval + 1:
                missing.append(
                    f"rank {r} (no heartbeat for {quiet:.0f} s: frozen, or dead)"
                    if rec is not None
                    else f"rank {r} (never reported)"
                )
            elif rec["collectives"] < mine:
                missing.append(
                    f"rank {r} (at collective #{rec['collectives']}, step {rec['step']}: "
                    f"{rec['where']})"
                )
            else:
                others.append(
                    f"rank {r} (collective #{rec['collectives']}, step {rec['step']}: {rec['where']})"
                )
        if missing:
            lines.append("  not joined: " + "; ".join(missing))
        if others:
            lines.append("  waiting with it: " + "; ".join(others))
        timeout = os.environ.get("LAYERSHARD_TIMEOUT_S")
        if timeout:
            lines.append(
                f"  the process group times out after {float(timeout):.0f} s without progress"
            )
        return "\n".join(lines)
