"""One failure, two ways, on the same run: today's checkpoint restart against `--ft-replicas`.

The run: `layershard train` on the built-in corpus, a small Llama (the suite's SMALL settings,
tests/train/test_train_ft.py), 2 ranks in all, ``--steps`` steps, a checkpoint every
``--checkpoint-interval``, ``--max-restarts 1``, one thread per rank. Four cases, each in fresh
processes, ``--repeats`` times, alternating:

- ``plain``: one launcher, 2 ranks (``full`` over both), no failure;
- ``plain-kill``: the same; rank 1 is SIGKILLed as step ``--kill-step`` is logged. torchrun
  restarts both ranks, which resume from the last checkpoint and redo the steps since;
- ``ft``: 2 replica groups x 1 rank (`--ft-replicas 2`, one launcher each), a torchft
  Lighthouse in this process (torchft's 5 s heartbeat timeout), no failure;
- ``ft-kill``: the same; group 1's rank SIGKILLed as step ``--kill-step`` is logged. Group 0
  goes on alone; group 1's launcher starts it again and it heals from group 0.

A case's time is the wall time from the launch to the last launcher's exit; the time a
failure costs is its case's time minus the same case without a failure (medians over the
repeats). Also recorded: steps thrown away and trained by one group (ft), steps redone (plain).

Run from the repository root with the venv active::

    python benchmarks/fault-tolerance/restart.py --repeats 3 --out benchmarks/fault-tolerance/restart.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

COMMON = [
    "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512", "--micro-batch", "4",
    "--report-to", "none", "--sample-tokens", "8", "--eval-interval", "0", "--max-restarts", "1",
]  # fmt: skip


def model_args(dim: int, layers: int, seq_len: int) -> list[str]:
    return ["--seq-len", str(seq_len), "--model-override", f"dim={dim}", "--model-override",
            f"n_layers={layers}", "--model-override", f"ffn_dim={2 * dim}"]  # fmt: skip


def _records(run: Path) -> list[dict]:
    path = run / "metrics.jsonl"
    if not path.is_file():
        return []
    out = []
    for line in path.read_text().splitlines():
        with contextlib.suppress(json.JSONDecodeError):  # a line being written
            out.append(json.loads(line))
    return out


def _kill_at(run: Path, rank_file: str, step: int, procs, deadline_s: float = 300):
    """SIGKILL the rank of ``run`` whose status is ``rank_file`` once ``step`` is logged; when,
    and the newest checkpoint's step then."""
    deadline = time.monotonic() + deadline_s
    while True:
        if time.monotonic() > deadline or any(p.poll() not in (None, 0) for p in procs):
            raise RuntimeError(f"no step {step} in {run}")
        if any(r.get("step", 0) >= step and "loss" in r for r in _records(run)):
            break
        time.sleep(0.01)
    status = json.loads((run / ".layershard" / rank_file).read_text())
    os.kill(status["pid"], signal.SIGKILL)
    when = time.time()
    saved = [int(d.name.split("_")[1]) for d in (run / "checkpoints").glob("step_*")]
    logged = max(r["step"] for r in _records(run) if "loss" in r)
    return when, logged, max(saved, default=0)


def run_case(case: str, args, tmp: Path) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "LAYERSHARD_FT_HOSTNAME": "127.0.0.1"}
    argv = [*COMMON, *model_args(args.dim, args.layers, args.seq_len), "--steps", str(args.steps), "--checkpoint-interval",
            str(args.checkpoint_interval), "--seed", "0"]  # fmt: skip
    run = tmp / case
    lighthouse = None
    t0 = time.time()
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        if case.startswith("plain"):
            cmd = [sys.executable, "-m", "layershard", "train", *argv, "--nproc-per-node", "2",
                   "--run-dir", str(run)]  # fmt: skip
            logs.append(open(tmp / f"{case}.log", "w"))
            procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT,
                                          env=env, start_new_session=True))  # fmt: skip
            watch, rank_file = run, "rank-00001.json"
        else:
            from layershard.ft import lighthouse_server

            lighthouse = lighthouse_server(min_replicas=1, join_timeout_ms=5000)
            port = lighthouse.address().rsplit(":", 1)[1]
            for g in range(2):
                cmd = [sys.executable, "-m", "layershard", "train", *argv, "--nproc-per-node",
                       "1", "--run-dir", str(run), "--ft-replicas", "2", "--ft-group", str(g),
                       "--ft-lighthouse", f"127.0.0.1:{port}"]  # fmt: skip
                logs.append(open(tmp / f"{case}-{g}.log", "w"))
                procs.append(subprocess.Popen(cmd, stdout=logs[-1], stderr=subprocess.STDOUT,
                                              env=env, start_new_session=True))  # fmt: skip
            watch, rank_file = run / "group-1", "rank-00000.json"
        killed = logged = saved = None
        if case.endswith("-kill"):
            when, logged, saved = _kill_at(watch, rank_file, args.kill_step, procs)
            killed = when - t0
        for p in procs:
            p.wait(timeout=600)
        wall = time.time() - t0
        if any(p.returncode != 0 for p in procs):
            raise RuntimeError(f"{case} failed: see {tmp}")
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for f in logs:
            f.close()
        if lighthouse is not None:
            lighthouse.shutdown()
    out = {"case": case, "wall_s": wall, "killed_at_s": killed, "killed_after_step": logged}
    steps_s = [r["step_time_s"] for r in _records(run if case.startswith("plain") else run / "group-0")
               if "step_time_s" in r]  # fmt: skip
    out["median_step_s"] = statistics.median(steps_s) if steps_s else None
    if case.startswith("plain"):
        # the newest checkpoint when the rank died: the restart resumes there and trains the
        # steps after it again, the one in flight included
        out["checkpoint_step"] = saved
        out["steps_redone"] = None if logged is None else logged - saved + 1
    else:
        summary = json.loads((run / "group-0" / "summary.json").read_text())
        ft = summary["fault_tolerance"]
        recs = [r for r in _records(run / "group-0") if "loss" in r]
        out.update(
            steps_thrown_away=ft["not_committed"],
            steps_alone=sum(r.get("participants") == 1 for r in recs),
            tokens_lost=ft["tokens_lost"],
            tokens_per_step=summary["tokens_per_step"],
        )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--checkpoint-interval", type=int, default=20)
    ap.add_argument("--kill-step", type=int, default=30)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    cases = ["plain", "plain-kill", "ft", "ft-kill"]
    results = []
    for i in range(args.repeats):
        order = cases if i % 2 == 0 else cases[::-1]
        for case in order:
            with tempfile.TemporaryDirectory(prefix="ls-restart-") as tmp:
                load = os.getloadavg()[0]
                res = run_case(case, args, Path(tmp))
                res.update(repeat=i, load_1min_before=load)
                print(json.dumps(res), flush=True)
                results.append(res)
    med = {c: statistics.median(r["wall_s"] for r in results if r["case"] == c) for c in cases}
    summary = {
        "median_wall_s": med,
        "lost_s": {"plain": med["plain-kill"] - med["plain"], "ft": med["ft-kill"] - med["ft"]},
    }
    print(json.dumps(summary, indent=1))
    keys = ("steps", "checkpoint_interval", "kill_step", "dim", "layers", "seq_len")
    settings = {k: getattr(args, k) for k in keys}
    args.out.write_text(
        json.dumps({"settings": settings, "runs": results, "summary": summary}, indent=1) + "\n"
    )


if __name__ == "__main__":
    main()
