"""Run test code on N local gloo ranks (127.0.0.1), each a fresh spawned process.

Two ways in:

- ``run_ranks(fn, world_size, *args)``: one function, its exception and traceback reach pytest
  through ``torch.multiprocessing.spawn``.
- ``RankChecks``: named checks that share one spawn (spawning costs ~1 s per rank here), each its
  own pytest test, as torch's FSDP tests name one behaviour per test. A failing check names what
  broke and does not hide the checks after it::

      checks = RankChecks(world_size=2)

      @checks.check
      def alignment(rank: int, world: int) -> None:
          ...

      checks.collect(globals())  # test_alignment, ... for pytest

  The first of a group's tests to run spawns the ranks once for every check of the group that the
  session selected; each rank runs them in order and records a verdict per check. When the ranks
  disagree about a check (one raised, another passed: it may be waiting in a collective that will
  never come), the checks after it are not run and say so.
"""

from __future__ import annotations

import faulthandler
import json
import os
import socket
import sys
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

TIMEOUT_S = "120"  # every collective of a test fails after this instead of hanging

# Ranks are forked from a server that imported torch and layershard once, instead of each
# importing them anew (~1.6 s of CPU a rank, a few hundred ranks a suite). A forked rank takes the
# test process's environment and import path of the moment it starts (``_in_test_env``), as a
# spawned one would; what torch reads at import time was read in the server, which the test
# process started with its own environment (ATEN_CPU_CAPABILITY, ONEDNN_MAX_CPU_ISA included).
START_METHOD = os.environ.get("LAYERSHARD_TEST_START_METHOD", "forkserver")  # or "spawn"
mp.set_forkserver_preload(["torch", "torch.distributed", "layershard"])


def _in_test_env(rank: int, env: dict[str, str], path: list[str], fn, args) -> None:
    os.environ.clear()
    os.environ.update(env)
    sys.path[:] = path
    fn(rank, *args)


def start_ranks(fn, nprocs: int, args: tuple) -> None:
    """``fn(rank, *args)`` on ``nprocs`` new processes, as ``torch.multiprocessing.spawn`` runs
    it (a rank's exception is raised here), started from the fork server."""
    mp.start_processes(
        _in_test_env, args=(dict(os.environ), list(sys.path), fn, args), nprocs=nprocs,
        join=True, start_method=START_METHOD,
    )  # fmt: skip


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _setup(rank: int, world_size: int, port: int) -> None:
    faulthandler.enable(all_threads=True)  # a native abort still shows the Python stacks
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LAYERSHARD_TIMEOUT_S=os.environ.get("LAYERSHARD_TEST_TIMEOUT_S", TIMEOUT_S),
    )
    torch.set_num_threads(1)
    import layershard as ls

    ls.init_distributed(backend="gloo")


def _teardown() -> None:
    import torch.distributed as dist

    # Every rank's last collective must be complete before any rank closes its sockets: gloo
    # aborts a peer whose connection closes with data in flight ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown: static destructors of gloo's threads have aborted a rank
    # ("terminate called without an active exception") after every check had passed. Failures
    # above raise before this line and reach pytest as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    _setup(rank, world_size, port)
    fn(rank, world_size, *args)
    _teardown()


def run_ranks(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure."""
    start_ranks(_entry, world_size, (world_size, free_port(), fn, args))


# ---- named checks in one spawn ---------------------------------------------------------------------


def shared_tmp(name: str = "") -> Path:
    """A folder every rank of the running check sees (the check's own, empty at its start)."""
    root = Path(os.environ["LAYERSHARD_TEST_TMP"])
    path = root / name if name else root
    path.mkdir(parents=True, exist_ok=True)
    return path


def _run_checks(
    rank: int, world: int, port: int, module: str, names: list[str], out: str, tmp: str
) -> None:
    _setup(rank, world, port)
    import importlib

    import torch.distributed as dist

    checks = importlib.import_module(module)
    verdicts: dict[str, str | None] = {}
    for i, name in enumerate(names):
        os.environ["LAYERSHARD_TEST_TMP"] = str(Path(tmp) / name)
        try:
            getattr(checks, f"_rank_check_{name}")(rank, world)
            verdicts[name] = None
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:  # noqa: BLE001 - pytest.fail's exception is a BaseException
            verdicts[name] = traceback.format_exc()
        Path(f"{out}.{rank}").write_text(json.dumps(verdicts))
        failed = [None] * world
        try:
            dist.all_gather_object(failed, verdicts[name] is not None)
        except Exception:  # noqa: BLE001 - the ranks are out of step: nothing after can run
            failed = [True, False]
        if any(failed) and not all(failed):
            for later in names[i + 1 :]:
                verdicts[later] = f"not run: the ranks disagreed about the check {name!r}"
            Path(f"{out}.{rank}").write_text(json.dumps(verdicts))
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)  # a peer may be stuck in a collective: no barrier
    _teardown()


class RankChecks:
    """Named checks on ``world_size`` gloo ranks, run in one spawn, each a pytest test.
    ``slow=True``: every check of the group is outside the fast tier (``pytest.mark.slow``)."""

    def __init__(self, world_size: int, suffix: str = "", slow: bool = False) -> None:
        self.world_size, self.suffix, self.slow = world_size, suffix, slow
        self.names: list[str] = []
        self.docs: dict[str, str] = {}
        self._verdicts: dict[str, list[str | None]] | None = None
        self._module: str | None = None

    def check(
        self, fn: Callable[[int, int], None], name: str | None = None, doc: str | None = None
    ) -> Callable[[int, int], None]:
        """Register ``fn`` (module level) as the check ``name`` (default: its own name)."""
        name = name or fn.__name__.lstrip("_")
        self.names.append(name)
        self.docs[name] = doc or fn.__doc__ or ""
        func = getattr(fn, "func", fn)  # a functools.partial: the function it calls
        self._module = func.__module__
        sys.modules[func.__module__].__dict__[f"_rank_check_{name}"] = fn  # found by name in a rank
        return fn

    def collect(self, namespace: dict) -> None:
        """Add ``test_<name><suffix>`` to the test module for every check."""
        for name in self.names:
            namespace[f"test_{name}{self.suffix}"] = self._test(name)

    def _test(self, name: str):
        def test(request) -> None:
            verdicts = self._results(request)
            errors = [
                f"rank {r}: {v}" for r, v in enumerate(verdicts.get(name, [None])) if v is not None
            ]
            if name not in verdicts:
                errors = ["not run (the ranks ended before it)"]
            if errors:
                raise AssertionError(f"check {name!r} failed\n" + "\n".join(errors))

        test.__name__ = f"test_{name}{self.suffix}"
        test.__doc__ = self.docs[name]
        return pytest.mark.slow(test) if self.slow else test

    def _results(self, request) -> dict[str, list[str | None]]:
        if self._verdicts is None:
            selected = {item.name for item in request.session.items}
            names = [n for n in self.names if f"test_{n}{self.suffix}" in selected]
            self._verdicts = self._spawn(names)
        return self._verdicts

    def _spawn(self, names: list[str]) -> dict[str, list[str | None]]:
        assert self._module is not None
        with tempfile.TemporaryDirectory() as tmp:
            out = str(Path(tmp) / "verdicts")
            crash = None
            try:
                start_ranks(
                    _run_checks,
                    self.world_size,
                    (self.world_size, free_port(), self._module, names, out, tmp),
                )
            except Exception as e:  # noqa: BLE001 - a rank died: its checks say so
                crash = f"a rank died: {e}"
            per_rank = []
            for r in range(self.world_size):
                path = Path(f"{out}.{r}")
                per_rank.append(json.loads(path.read_text()) if path.exists() else {})
        verdicts: dict[str, list[str | None]] = {}
        for name in names:
            if all(name in v for v in per_rank):
                verdicts[name] = [v[name] for v in per_rank]
            elif crash is not None and any(name in v for v in per_rank):
                verdicts[name] = [v.get(name, crash) for v in per_rank]
            elif crash is not None and not verdicts.get(name):
                verdicts[name] = [crash]
                break
        return verdicts


def die_with_launcher() -> None:
    """Exit when torchrun's agent is gone. It starts each rank in a session of its own, so the
    test's timeout, which kills the agent's process group, does not reach the ranks: a rank
    left waiting in a collective would live on, holding the test's output pipe open (pytest
    then waited for it forever)."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1)
        os._exit(3)

    threading.Thread(target=watch, daemon=True, name="die-with-launcher").start()


def listing(path: Path) -> list[str]:
    """The files in ``path``, which rank 0 alone may have just written (a stock Trainer's or
    accelerate's ``save_model`` returns at once on the other ranks): after every rank is here."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
    return sorted(os.listdir(path))
