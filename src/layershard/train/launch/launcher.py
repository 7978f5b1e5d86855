"""Start the ranks with torch's own elastic launcher (``python -m torch.distributed.run``), which
also covers multi-node runs, once ``preflight.prepare`` has written the run folder; pass the
user's signals on to them, and say in one line how they ended (``outcome``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

from layershard.train import status as st
from layershard.train.config import (
    LaunchOptions,
)
from layershard.train.launch import rendezvous as rdzv
from layershard.train.launch.nodes import (
    elastic,
    loopback,
    lost_nodes,
    nproc,
    partitioned,
    rdzv_backend,
    rdzv_timeout_conf,
    world_size,
)
from layershard.train.launch.preflight import latest_checkpoint

# The process-group timeout `layershard train` gives its ranks unless told otherwise: a rank that
# waits longer than this in one collective fails the job. Long enough for the slowest legitimate
# wait between two collectives (a rank hashing its share of a checkpoint, rank 0 writing a 2 GB
# safetensors file of an HF export), short enough that a hung job ends in minutes. A rank that
# waits a fifth of it (at most a minute) first says where it waits (train/loop/faults.py).
DEFAULT_TIMEOUT_S = 300.0


def torchrun_command(run_dir: Path, opts: LaunchOptions) -> list[str]:
    """torchrun (``torch.distributed.run``) through ``layershard.train.launch.agent``, which runs
    torchrun's own ``run()`` and records what it says about failed ranks."""
    cmd = [sys.executable, "-m", "layershard.train.launch.agent", str(run_dir)]
    if opts.nnodes == "1" and not opts.rdzv_endpoint:
        cmd += ["--standalone"]  # a free local port; nothing to configure
    else:
        cmd += ["--nnodes", opts.nnodes, "--node-rank", str(opts.node_rank)]
        if opts.rdzv_endpoint:
            cmd += ["--rdzv-endpoint", opts.rdzv_endpoint]
        backend = rdzv_backend(opts)
        if backend:
            cmd += ["--rdzv-backend", backend]
        if opts.rdzv_id:
            cmd += ["--rdzv-id", opts.rdzv_id]
        conf = [c for c in (opts.rdzv_conf or "").split(",") if c]
        conf += rdzv_timeout_conf(opts, backend, conf)
        if backend == "c10d" and loopback(opts.rdzv_endpoint):
            # Nodes simulated on one machine all match the endpoint's host, so by default the
            # first launcher to bind would host c10d's rendezvous store, and the job would end
            # with that node. Here, as across machines, node 0 (at the endpoint) hosts it.
            conf.insert(0, f"is_host={int(opts.node_rank == 0)}")
        if conf:
            cmd += ["--rdzv-conf", ",".join(conf)]
    cmd += [
        "--nproc-per-node", str(nproc(opts)),
        "--max-restarts", str(opts.max_restarts),
        "-m", "layershard.train.loop.rank", str(run_dir),
    ]  # fmt: skip
    return cmd


def rank_env(opts: LaunchOptions) -> dict[str, str]:
    env = dict(os.environ)
    n = nproc(opts)
    if "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        # Ranks share the cores: one compute thread per core each, no oversubscription.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    env.setdefault("OMP_NUM_THREADS", "1")
    if opts.timeout is not None:
        env["LAYERSHARD_TIMEOUT_S"] = str(opts.timeout)
    env.setdefault("LAYERSHARD_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    env["LAYERSHARD_TRAIN_CLI"] = "1"  # the ranks leave the final one-line message to us
    env["LAYERSHARD_LAUNCHER_PID"] = str(os.getpid())  # the agent dies with us (agent.py)
    env[st.NODE_ENV] = str(opts.node_rank)  # in each rank's status: which node lost a rank
    env.pop(rdzv.SETTINGS_ENV, None)
    env.pop(rdzv.REPORT_ENV, None)
    if opts.node_settings is not None:  # compared with the other nodes' at the rendezvous
        env[rdzv.SETTINGS_ENV] = json.dumps(opts.node_settings)
    if opts.agent_report is not None:
        env[rdzv.REPORT_ENV] = str(opts.agent_report)
    return env


def _local_ranks(run_dir: Path, launch_id: str) -> list[int]:
    return [
        r["pid"]
        for r in st.rank_statuses(run_dir, launch_id).values()
        if "exit" not in r and st.alive(r)
    ]


def launch(run_dir: Path, opts: LaunchOptions) -> tuple[int, str | None]:
    """Start torchrun and wait for it. Returns (its exit code, the first stop signal received).

    torchrun and its ranks run in sessions of their own, so a terminal's Ctrl-C reaches only this
    process, which passes the first SIGINT / SIGTERM / SIGHUP to this machine's ranks: they agree
    on a step, save a checkpoint and exit (0, so that torchrun does not restart them). A second
    one kills torchrun and the ranks at once."""
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if proc is None:
            return
        if len(received) == 1:
            ranks = _local_ranks(run_dir, opts.launch_id)
            for pid in ranks or [proc.pid]:  # before the ranks run: torchrun stops them
                with _quiet():
                    os.kill(pid, signum)
            os.write(
                2,
                f"layershard train: {st.signal_name(signum)}: the ranks stop after the current "
                "step and save a checkpoint (send it again to stop at once, losing the step)\n".encode(),
            )
            return
        for pid in [proc.pid, *_local_ranks(run_dir, opts.launch_id)]:
            with _quiet():
                os.killpg(pid, signal.SIGKILL)  # each is the leader of its own session

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    if opts.node_settings is not None:  # what the agent says when no rank starts (rendezvous.py)
        fd, name = tempfile.mkstemp(prefix="layershard-agent-", suffix=".json")
        os.close(fd)
        opts.agent_report = Path(name)
    try:
        proc = subprocess.Popen(
            torchrun_command(run_dir, opts), env=rank_env(opts), start_new_session=True
        )
        if opts.lock is not None:
            st.add_child(opts.lock, proc.pid)
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, (st.signal_name(received[0]) if received else None)


class _quiet:
    """Ignore a process that is already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError | PermissionError)


def outcome(run_dir: Path, opts: LaunchOptions, rc: int, signalled: str | None) -> tuple[int, str]:
    """The exit code of `layershard train` and the one line that explains a run that did not
    finish: a stop on request, non-finite steps, or which rank failed, how, and at which step."""
    refused = rdzv.read_report(opts.agent_report)
    if refused is not None:  # the nodes disagree, or never met
        return refused["code"], refused["message"]
    state = st.state_dir(run_dir)
    stop = st.read_json(state / st.STOP)
    ranks = st.rank_statuses(run_dir, opts.launch_id)
    last = max((s.get("attempt", 0) for s in ranks.values()), default=0)
    # An elastic job's ranks also stop on purpose when nodes join (torchrun's SIGTERM), and go
    # on in the next round: only a stop in the last round ended the run.
    if (
        stop is not None
        and stop.get("launch_id") == opts.launch_id
        and stop.get("attempt", 0) == last
    ):
        if stop.get("reason") == "signal":
            return st.EXIT_STOPPED, (
                f"stopped by {stop.get('signal')} at step {stop.get('step')}; checkpoint saved "
                f"({stop.get('checkpoint')}). Continue with: layershard train --resume --run-dir "
                f"{run_dir}"
            )
        return 1, str(stop.get("message"))
    if rc == 0:
        return 0, ""
    fails = st.read_json(state / st.FAILURES) or {}
    if fails.get("launch_id") != opts.launch_id:
        fails = {}
    failures = fails.get("failures", {})
    resume = _resume_hint(run_dir)
    for _, s in sorted(ranks.items()):
        if s.get("exit") == 2:  # a problem the user can fix, agreed by the ranks
            return 2, str(s.get("error"))
    cut = partitioned(run_dir, ranks, opts)  # every rank alive and waiting: the network failed
    if cut:
        return 1, f"{cut}{_resume_hint(run_dir, opts)}"
    for r, s in sorted(ranks.items()):
        if s.get("exit") not in (None, 0) and not s.get("peer_lost"):
            first = str(s.get("error") or "").splitlines()[0] if s.get("error") else "an error"
            return 1, f"rank {r} failed at step {s.get('step')}: {first}{resume}"
    lost = lost_nodes(ranks, opts)
    if lost:
        return 1, f"{lost}; this node's ranks were stopped{_resume_hint(run_dir, opts)}"
    silent = [r for r, s in sorted(ranks.items()) if "exit" not in s]
    silent += [int(r) for r in sorted(failures, key=int) if int(r) not in ranks]
    for r in silent:
        s, f = ranks.get(r, {}), failures.get(str(r), {})
        if f.get("signal"):
            how = f"was killed by {f['signal']}"
            if f["signal"] == "SIGKILL":
                how += " (out of memory? `dmesg` shows the kernel's OOM kills)"
        elif f.get("exitcode") is not None:
            how = f"exited with code {f['exitcode']}"
        else:
            how = "died without an error message"
        where = f" (pid {s['pid']} on {s.get('host')})" if s.get("pid") else ""
        step = f" at step {s['step']}" if s.get("step") is not None else " before training"
        return 1, f"rank {r}{where} {how}{step}; the other ranks were stopped{resume}"
    if signalled:
        return st.EXIT_STOPPED, f"stopped by {signalled} before training started"
    return rc or 1, f"the training ranks failed (exit code {rc}); the first error above names it"


def _resume_hint(run_dir: Path, opts: LaunchOptions | None = None) -> str:
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return ""
    if opts is not None and (elastic(opts) or world_size(opts) != nproc(opts)):
        return f". Resume from {latest.name}: the same command with --resume, on every node"
    return f". Resume from {latest.name} with: layershard train --resume --run-dir {run_dir}"
