"""Deterministic faults for the end-to-end tests of `layershard train` (tests/train/test_train_faults.py).

Put on PYTHONPATH, Python imports this module at start-up in every process of a test launch; it
acts only in a rank (torchrun sets RANK and TORCHELASTIC_RESTART_COUNT) and only when
LS_TEST_FAULT is set, as comma-separated ACTION@STEP:RANK[:ATTEMPT] (attempt: torchrun's restart
count, 0 by default):

    kill@3:1      rank 1 sends itself SIGKILL right after its step 3 (first attempt only)
    term_cli@3:0  rank 0 sends SIGTERM to `layershard train` (its grandparent) after step 3
    int_cli@3:0   the same with SIGINT (Ctrl-C)
    kill_cli@3:0  the same with SIGKILL (`kill -9` of `layershard train`)
    kill_node@3:1 rank 1 SIGKILLs `layershard train`, the agent and itself: its node dies
                  (one rank per node)
    hold@5:0:1    rank 0 waits after step 5 (up to 120 s) until it receives a stop signal (as
                  torchrun sends when a node joins an elastic job)
    mark@3:0      rank 0 creates the file LS_TEST_MARK after step 3, then waits (up to 120 s)
                  until LS_TEST_MARK.go exists (the test changes the world meanwhile: a link
                  goes down)

With LS_TEST_FAULT_BY_NODE=1 the RANK field names a node (the launcher's --node-rank) instead:
under an elastic rendezvous torchrun numbers the ranks in an order of its own.

LS_TEST_WRITES=FILE (tests/train/test_multinode.py): every process appends to FILE one line per file
it opens for writing or renames into place: its node (LS_TEST_NODE), pid and the path.
"""

import os
import signal


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as fh:
        return int(fh.read().rsplit(")", 1)[1].split()[1])


def _patch(loop, faults: list[tuple[str, int, int, int]]) -> None:
    original = loop.Trainer.train_step

    def train_step(self, *args, **kwargs):
        out = original(self, *args, **kwargs)
        for action, step, _, _ in faults:
            if self.step != step:
                continue
            if action == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            if action == "mark":
                import time

                mark = os.environ["LS_TEST_MARK"]
                open(mark, "w").close()
                for _ in range(1200):
                    if os.path.exists(mark + ".go"):
                        break
                    time.sleep(0.1)
                continue
            if action == "hold":
                import time

                for _ in range(1200):
                    if self.stop.signum is not None:
                        break
                    time.sleep(0.1)
                continue
            cli = _parent(os.getppid())  # rank -> torchrun (the agent) -> layershard train
            if action == "kill_node":
                for pid in (cli, os.getppid(), os.getpid()):
                    os.kill(pid, signal.SIGKILL)
            sig = {"term_cli": signal.SIGTERM, "int_cli": signal.SIGINT, "kill_cli": signal.SIGKILL}
            os.kill(cli, sig[action])
        return out

    loop.Trainer.train_step = train_step


def _install(faults: list[tuple[str, int, int, int]]) -> None:
    """Patch layershard.train.loop.trainer when it is imported (the rank's `-m layershard.train.loop.rank`
    imports it as a module to run it); importing it here would upset runpy."""
    import importlib.abc
    import importlib.machinery
    import sys

    class Finder(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path, target=None):
            if name != "layershard.train.loop.trainer":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            real_exec = spec.loader.exec_module

            def exec_module(module):
                real_exec(module)
                _patch(module, faults)

            spec.loader.exec_module = exec_module
            return spec

    sys.meta_path.insert(0, Finder())


def _record_writes(log: str) -> None:
    import sys

    node = os.environ.get("LS_TEST_NODE", "?")

    def hook(event, args):
        if event == "open" and isinstance(args[0], str | bytes):
            mode, flags = args[1] or "", args[2] or 0
            if not any(c in mode for c in "wax+") and not flags & (os.O_WRONLY | os.O_RDWR):
                return
            path = args[0]
        elif event in ("os.rename", "os.replace"):
            path = args[1]
        else:
            return
        path = os.fsdecode(path)
        if path != log:
            with open(log, "a") as fh:  # an open of the log itself: skipped above
                fh.write(f"{node} {os.getpid()} {os.path.abspath(path)}\n")

    sys.addaudithook(hook)


if os.environ.get("LS_TEST_WRITES"):
    _record_writes(os.environ["LS_TEST_WRITES"])

_spec = os.environ.get("LS_TEST_FAULT")
if _spec and "RANK" in os.environ and "TORCHELASTIC_RESTART_COUNT" in os.environ:
    _mine = []
    _who = "LAYERSHARD_NODE" if os.environ.get("LS_TEST_FAULT_BY_NODE") else "RANK"
    for _one in _spec.split(","):
        _action, _, _where = _one.partition("@")
        _step, _rank, *_attempt = (int(x) for x in _where.split(":"))
        if int(os.environ[_who]) == _rank and int(os.environ["TORCHELASTIC_RESTART_COUNT"]) == (
            _attempt[0] if _attempt else 0
        ):
            _mine.append((_action, _step, _rank, _attempt[0] if _attempt else 0))
    if _mine:
        _install(_mine)
