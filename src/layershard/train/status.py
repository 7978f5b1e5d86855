"""What a run folder records about the processes working on it, in ``<run>/.layershard/``:

- ``lock``: the ``layershard train`` process that holds the folder (pid, host, start time), so a
  second run on the same folder refuses to start while the first is alive;
- ``rank-NNNNN.json``: each rank's pid, host, attempt (torchrun restart), step and, when it
  failed, its error; the launcher reads them to name the rank and the step of a failure;
- ``failures.json``: what torchrun saw of the ranks that failed (exit code or signal);
- ``stop.json``: why the ranks stopped on purpose (a signal, non-finite steps) and where.

Small JSON files written whole (write + rename), so a reader never sees half of one.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from pathlib import Path
from typing import Any

from layershard.train.config import ConfigError

# Set by `layershard train` for its ranks: its --node-rank, recorded in each rank's status.
NODE_ENV = "LAYERSHARD_NODE"
STATE_DIR = ".layershard"
LOCK = "lock"
STOP = "stop.json"
FAILURES = "failures.json"

# Exit code of `layershard train` when the run stopped on request (SIGTERM, SIGINT, ...) after
# saving a checkpoint: 75 is EX_TEMPFAIL ("try again later"), and `--resume` continues it.
EXIT_STOPPED = 75


def state_dir(run_dir: Path) -> Path:
    return Path(run_dir) / STATE_DIR


def write_json(path: Path, data: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.{os.getpid()}"
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def read_json(path: Path) -> dict[str, Any] | None:
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


# ---- process identity ----------------------------------------------------------------------------


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (Linux), which tells a live process from a later one that
    reuses its pid."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]  # field 22, counted after the command name


def me() -> dict[str, Any]:
    pid = os.getpid()
    return {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid)}


def alive(record: dict[str, Any]) -> bool | None:
    """Is the process of ``record`` (from ``me()``) running? None: it runs on another host."""
    if record.get("host") != socket.gethostname():
        return None
    pid = record.get("pid")
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # exists, owned by someone else
        return True
    if _zombie(pid):  # exited; its parent (init, in a container maybe never) has not reaped it
        return False
    start = record.get("start")
    return start is None or _start_time(pid) in (None, start)


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (OSError, IndexError):
        return False


# ---- the lock --------------------------------------------------------------------------------------


def _holders(run_dir: Path, lock: dict[str, Any]) -> list[dict[str, Any]]:
    """The lock holder and the processes it started (the torchrun agent, this host's ranks)."""
    procs = [lock, *lock.get("children", [])]
    for f in state_dir(run_dir).glob("rank-*.json"):
        r = read_json(f)
        if r and r.get("launch_id") == lock.get("launch_id") and "exit" not in r:
            procs.append(r)
    return procs


def acquire_lock(run_dir: Path, launch_id: str) -> Path:
    """Take ``<run>/.layershard/lock`` for this process, or raise ConfigError naming the holder.
    A lock whose processes are all gone (killed, crashed, rebooted) is taken over."""
    path = state_dir(run_dir) / LOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    record = {**me(), "launch_id": launch_id, "started_unix": time.time(), "children": []}
    for _ in range(2):
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            held = read_json(path)
            check = held_by(run_dir)
            if check:
                raise ConfigError(check) from None
            if held is not None:  # the holder is gone: its lock is stale
                print(
                    f"layershard train: note: taking over the lock of a run that is no longer "
                    f"running (pid {held.get('pid')} on {held.get('host')})",
                    flush=True,
                )
            path.unlink(missing_ok=True)
            continue
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps(record))
        return path
    raise ConfigError(f"could not lock {run_dir}: another run is starting on it; try again")


def held_by(run_dir: Path) -> str:
    """'' when no live process holds the run folder, else the one-line error that says who."""
    path = state_dir(run_dir) / LOCK
    lock = read_json(path) if path.is_file() else None
    if lock is None:
        return ""
    states = [alive(p) for p in _holders(run_dir, lock)]
    if not any(s is not False for s in states):
        return ""
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lock.get("started_unix", 0)))
    where = f"pid {lock.get('pid')} on {lock.get('host')}, started {since}"
    if states[0] is None:  # another machine: its processes cannot be checked from here
        return (
            f"run folder {run_dir} is locked by a run on another machine ({where}); if that run is "
            f"no longer running, delete {path} and start again"
        )
    return (
        f"run folder {run_dir} is in use by another layershard train ({where}); wait for it to "
        "finish or stop it (Ctrl-C / kill -TERM, it saves a checkpoint), or use another --run-dir"
    )


def add_child(lock_path: Path, pid: int) -> None:
    lock = read_json(lock_path) or {}
    lock.setdefault("children", []).append(
        {"pid": pid, "host": socket.gethostname(), "start": _start_time(pid)}
    )
    write_json(lock_path, lock)


def release_lock(lock_path: Path | None) -> None:
    if lock_path is None:
        return
    lock = read_json(lock_path)
    if lock is not None and lock.get("pid") == os.getpid():
        lock_path.unlink(missing_ok=True)


# ---- ranks ------------------------------------------------------------------------------------------


def _address() -> str | None:
    """The address this rank reaches the others from (its interface towards MASTER_ADDR, found
    without sending anything); None outside torchrun."""
    master = os.environ.get("MASTER_ADDR")
    if not master:
        return None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master, 1))
            return s.getsockname()[0]
    except OSError:
        return None


class RankStatus:
    """One rank's ``rank-NNNNN.json``: rewritten when the step changes and when the rank exits."""

    def __init__(self, run_dir: Path, rank: int, launch_id: str | None, attempt: int) -> None:
        self.path = state_dir(run_dir) / f"rank-{rank:05d}.json"
        self.data: dict[str, Any] = {
            **me(),
            "rank": rank,
            "node": int(os.environ[NODE_ENV]) if os.environ.get(NODE_ENV) else None,
            "addr": _address(),
            "launch_id": launch_id,
            "attempt": attempt,
            "step": None,
            "started_unix": time.time(),
        }
        self._write()

    def _write(self) -> None:
        try:
            write_json(self.path, self.data)
        except OSError:  # bookkeeping must never fail a training run
            pass

    def step(self, step: int) -> None:
        if self.data["step"] != step:
            self.data["step"] = step
            self._write()

    def exit(self, code: int, error: str | None = None, peer_lost: bool = False) -> None:
        self.data.update(exit=code, error=error, peer_lost=peer_lost, ended_unix=time.time())
        self._write()


def rank_statuses(run_dir: Path, launch_id: str) -> dict[int, dict[str, Any]]:
    """The newest attempt's status of every rank of the launch ``launch_id``."""
    out: dict[int, dict[str, Any]] = {}
    for f in state_dir(run_dir).glob("rank-*.json"):
        r = read_json(f)
        if r and r.get("launch_id") == launch_id and isinstance(r.get("rank"), int):
            out[r["rank"]] = r
    if out:
        last = max(r.get("attempt", 0) for r in out.values())
        out = {k: v for k, v in out.items() if v.get("attempt", 0) == last}
    return out


def clear_run_state(run_dir: Path) -> None:
    """Forget the previous launch's stop record, failures and rank files (not the lock)."""
    d = state_dir(run_dir)
    for name in (STOP, FAILURES):
        (d / name).unlink(missing_ok=True)
    for f in d.glob("rank-*.json"):
        f.unlink(missing_ok=True)
