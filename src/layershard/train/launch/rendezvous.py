"""The rendezvous of a multi-node ``layershard train``, as torchrun's agent meets it: the nodes
compare the settings they were started with, and a rendezvous that cannot be made is said in one
line (docs/train.md, Many nodes).

- **The nodes agree.** Each node's launcher resolves its own command line (``nodes.settings``:
  model, data, engine options, seed, steps, ...), but only node 0 writes the run folder that
  every rank reads: a node started with other settings would have its own silently dropped. At
  every rendezvous each node publishes its settings in the rendezvous store and reads every
  other node's; if any differ, every node refuses (exit 2) with the same line naming the keys,
  before any rank starts.
- **A rendezvous that fails** (node 0 unreachable, the other nodes never coming, the port taken)
  printed torch's retries with ~30 lines of C++ frames and ended as "the training ranks failed"
  though no rank had started. What the rendezvous prints is held back while it runs: replayed
  when it succeeds, replaced by one line naming the endpoint when it fails.

What the agent has to say reaches ``layershard train`` as a small JSON file (``REPORT_ENV``):
the exit code and the line; ``launch.outcome`` prints it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sys
import tempfile
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

SETTINGS_ENV = "LAYERSHARD_NODE_SETTINGS"  # this node's settings (JSON), from the launcher
REPORT_ENV = "LAYERSHARD_AGENT_REPORT"  # where the agent writes {"code", "message"}
_KEY = "layershard/settings"
_SHOWN = 4  # differing keys named in full


class Refused(Exception):
    """The rendezvous was not made, or the nodes disagree: nothing started. ``code`` is the
    exit code (2: the settings, a problem of the command lines; 1: the rendezvous itself)."""

    def __init__(self, code: int, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.first_round = True  # no rank of this node started in this launch


def report(refused: Refused) -> None:
    """Hand the refusal to ``layershard train`` (if it asked for it)."""
    path = os.environ.get(REPORT_ENV)
    if path:
        d = {"code": refused.code, "message": str(refused), "first_round": refused.first_round}
        Path(path).write_text(json.dumps(d))


def read_report(path: Path | None) -> dict[str, Any] | None:
    """The agent's refusal ({"code", "message", "first_round"}), or None."""
    try:
        d = json.loads(path.read_text()) if path is not None else None
    except (OSError, ValueError):
        return None
    if not isinstance(d, dict) or not isinstance(d.get("code"), int):
        return None
    return d


def differences(nodes: list[dict[str, Any]]) -> str:
    """'' if every node has the same settings, else the keys that differ with each node's value:
    ``seq_len (node 0: 64, node 1: 32)``. ``nodes``: each node's ``{"node", "settings"}``."""
    keys: list[str] = []
    for n in nodes:
        keys += [k for k in n["settings"] if k not in keys]
    parts = []
    for k in keys:
        values = [n["settings"].get(k) for n in nodes]
        if all(v == values[0] for v in values):
            continue
        shown = ", ".join(
            f"node {n['node']}: {'unset' if v is None else repr(v)}" for n, v in zip(nodes, values)
        )
        parts.append(f"{k} ({shown})")
    if not parts:
        return ""
    more = f", and {len(parts) - _SHOWN} more" if len(parts) > _SHOWN else ""
    return "; ".join(parts[:_SHOWN]) + more


def launch_seen(run_dir: Path) -> str | None:
    """The launch id in ``run_dir/launch.json`` as this node sees it (None: no such file)."""
    try:
        return json.loads((run_dir / "launch.json").read_text()).get("launch_id")
    except (OSError, ValueError, AttributeError):
        return None


def unseen_run_folder(nodes: list[dict[str, Any]]) -> str:
    """'' if every node sees the launch.json the first node (node 0) wrote, else the line that
    says which do not. Only node 0 writes the run folder; a node that reads another (another
    --run-dir, or the same path on a disk of its own) would fail in its ranks."""
    first = nodes[0]
    blind = [n["node"] for n in nodes[1:] if n.get("launch") != first.get("launch")]
    if not blind:
        return ""
    who = ", ".join(map(str, blind))
    return (
        f"node{'s' if len(blind) > 1 else ''} {who} cannot see the run folder node "
        f"{first['node']} wrote ({first.get('run_dir')}/launch.json): every node must see the "
        "same run folder, at the same path, on storage they share (NFS, Lustre, ...); pass that "
        "--run-dir on every node"
    )


def agree(store: Any, rank: int, world: int, run_dir: Path | None = None) -> None:
    """Publish this node's settings (and what it sees in ``run_dir``) in the round's store,
    read every node's, and raise ``Refused`` on every node alike when they differ. The nodes
    then wait (briefly) until all have read, so that the node hosting the store does not close
    it under a slower one."""
    mine = os.environ.get(SETTINGS_ENV)
    node = os.environ.get("LAYERSHARD_NODE", str(rank))
    payload = {"node": int(node), "settings": json.loads(mine)} if mine else None
    if payload is not None and run_dir is not None:
        payload.update(run_dir=str(run_dir.absolute()), launch=launch_seen(run_dir))
    store.set(f"{_KEY}/{rank}", json.dumps(payload))
    nodes = [json.loads(store.get(f"{_KEY}/{r}")) for r in range(world)]
    if any(n is None for n in nodes):  # a node started without a launcher: nothing to compare
        return
    nodes.sort(key=lambda n: n["node"])
    diff = differences(nodes)
    if diff:
        message = (
            f"the nodes were started with different settings: {diff}; start the same command "
            "on every node (only --node-rank differs)"
        )
    else:
        message = unseen_run_folder(nodes) if run_dir is not None else ""
    if not message:
        return
    store.set(f"{_KEY}/read/{rank}", "1")
    with contextlib.suppress(Exception):
        store.wait([f"{_KEY}/read/{r}" for r in range(world)], timedelta(seconds=30))
    raise Refused(2, message)


def timeouts(params: Any) -> tuple[float | None, float | None]:
    """How long the agent tries to reach the rendezvous, and waits for the other nodes to join:
    static's ``timeout`` for both; c10d's ``read_timeout`` (torch's default 60 s) and
    ``join_timeout`` (600 s). (torch's launcher also sets ``timeout``, 900 s, which c10d
    ignores.)"""

    def seconds(key: str, default: float | None) -> float | None:
        with contextlib.suppress(TypeError, ValueError):
            return float(params.config.get(key, default))
        return default

    if params.backend == "static":
        t = seconds("timeout", None)
        return t, t
    return seconds("read_timeout", 60.0), seconds("join_timeout", 600.0)


def describe(
    e: BaseException, endpoint: str, limits: tuple[float | None, float | None], node: str
) -> str:
    """One line for a rendezvous that failed: which endpoint, what to check. ``limits``:
    ``timeouts(params)``."""
    text = " ".join(f"{type(e).__name__}: {e}".split())
    reach, join = (f" within {t:g} s" if t else "" for t in limits)
    if "address already in use" in text.lower():
        return (
            f"node {node} cannot host the rendezvous at {endpoint}: the port is in use (another "
            "job, or a launch still running); choose another port in --rdzv-endpoint, the same "
            "on every node"
        )
    joined = re.search(r"(\d+)/(\d+) clients joined", text)
    if joined or "waiting for clients" in text or "RendezvousTimeoutError" in text:
        count = f" ({joined[1]} of {joined[2]} nodes there)" if joined else ""  # itself too
        return (
            f"node {node}: the other nodes did not join the rendezvous at {endpoint}{join}"
            f"{count}; start every node with the same --nnodes and --rdzv-endpoint, or raise "
            "--rdzv-timeout"
        )
    if re.search(r"connect|timed out|timeout|refused|resolve|unreachable", text, re.I):
        return (
            f"node {node} could not reach the rendezvous at {endpoint}{reach}: start node 0, "
            f"which hosts it, with the same --rdzv-endpoint, and check that {endpoint} is "
            "reachable from this machine (or raise --rdzv-timeout)"
        )
    first = text.split(" Exception raised from ")[0][:300]
    return f"node {node}: the rendezvous at {endpoint} failed: {first}"


@contextlib.contextmanager
def said(endpoint: str, limits: tuple[float | None, float | None]) -> Iterator[None]:
    """Hold back what the block prints on stderr (torch's retries, C++ frames): replayed if it
    succeeds; a failure becomes ``Refused(1, one line)``. Signals and ``Refused`` pass."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    sys.stderr.flush()
    saved = os.dup(2)
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), 2)
    ok = False
    try:
        yield
        ok = True
    except (Refused, SignalException):
        ok = True
        raise
    except Exception as e:
        node = os.environ.get("LAYERSHARD_NODE", "?")
        raise Refused(1, describe(e, endpoint, limits, node)) from None
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)
        if ok:
            held.seek(0)
            for chunk in iter(lambda: held.read(1 << 16), b""):
                os.write(2, chunk)
        held.close()
