"""examples/slurm/train.sbatch under a stand-in Slurm: what `layershard train` each node runs.

The script runs with bash as sbatch would run it on the job's first node (Slurm's batch
environment of a 2-node job), with stand-ins first on PATH that record their argv: ``scontrol``
(``show hostnames`` expands the node list; ``requeue``), ``srun`` (runs its command once per
node, with the variables Slurm gives each task: SLURM_NODEID, SLURM_PROCID, SLURMD_NODENAME...,
and exits with the highest exit code, as srun does) and ``layershard`` (exits with
$FAKE_LAYERSHARD_EXIT). No Slurm and no training: a few seconds."""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
from pathlib import Path

from layershard.train.cli import add_arguments

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "examples" / "slurm" / "train.sbatch"
HOSTS = ["gpu-17", "gpu-18"]
JOB_ID = 4242
PORT = 20000 + JOB_ID % 20000  # the script's rule: the port follows the job id

SCONTROL = r"""#!/usr/bin/env python3
import json, os, re, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "scontrol", "argv": sys.argv[1:]}) + "\n")
if sys.argv[1:3] == ["show", "hostnames"]:  # gpu-[17-18] -> gpu-17, gpu-18
    m = re.fullmatch(r"(.*)\[(\d+)-(\d+)\]", sys.argv[3])
    names = [f"{m[1]}{i}" for i in range(int(m[2]), int(m[3]) + 1)] if m else [sys.argv[3]]
    print("\n".join(names))
"""

SRUN = r"""#!/usr/bin/env python3
import json, os, subprocess, sys
args = sys.argv[1:]
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "srun", "argv": args}) + "\n")
while args[0].startswith("-"):  # srun's own options are --opt=value here
    args.pop(0)
hosts = os.environ["FAKE_HOSTS"].split()
codes = []
for node, host in enumerate(hosts):  # one task per node, as --ntasks-per-node=1 asks
    env = dict(os.environ, SLURM_NODEID=str(node), SLURM_PROCID=str(node), SLURM_LOCALID="0",
               SLURMD_NODENAME=host, SLURM_STEP_NUM_NODES=str(len(hosts)),
               SLURM_STEP_NUM_TASKS=str(len(hosts)))
    codes.append(subprocess.run(args, env=env).returncode)
sys.exit(max(codes))
"""

LAYERSHARD = r"""#!/usr/bin/env python3
import json, os, sys
with open(os.environ["FAKE_LOG"], "a") as f:
    f.write(json.dumps({"tool": "layershard", "argv": sys.argv[1:],
                        "node": os.environ["SLURM_NODEID"], "host": os.environ["SLURMD_NODENAME"]}) + "\n")
sys.exit(int(os.environ.get("FAKE_LAYERSHARD_EXIT", "0")))
"""


def _run(tmp_path: Path, *args: str, exit_code: int = 0, **slurm: str):
    """The script as sbatch runs it on node 0 of a 2-node job; returns (its exit code, output,
    the calls the stand-ins recorded)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    for name, text in {"scontrol": SCONTROL, "srun": SRUN, "layershard": LAYERSHARD}.items():
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(0o755)
    log = tmp_path / "calls.jsonl"
    log.unlink(missing_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM")}
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        FAKE_LOG=str(log),
        FAKE_HOSTS=" ".join(HOSTS),
        FAKE_LAYERSHARD_EXIT=str(exit_code),
        # Slurm's batch environment of `sbatch --nodes=2 --gpus-per-node=8` (on its first node)
        SLURM_JOB_ID=str(JOB_ID),
        SLURM_JOB_NAME="layershard",
        SLURM_SUBMIT_DIR=str(tmp_path),
        SLURM_NNODES="2",
        SLURM_JOB_NUM_NODES="2",
        SLURM_JOB_NODELIST="gpu-[17-18]",
        SLURM_NODELIST="gpu-[17-18]",
        SLURM_NODEID="0",
        SLURMD_NODENAME=HOSTS[0],
        SLURM_NTASKS_PER_NODE="1",
        SLURM_CPUS_PER_TASK="64",
        SLURM_GPUS_ON_NODE="8",
        SLURM_GPUS_PER_NODE="8",
    )
    env.update(slurm)
    env = {k: v for k, v in env.items() if v != ""}  # a "" value: the variable is unset
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args], env=env, cwd=tmp_path, capture_output=True, text=True,
        timeout=60,
    )  # fmt: skip
    calls = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return proc.returncode, proc.stdout + proc.stderr, calls


def _launches(calls: list[dict]) -> list[dict]:
    return [c for c in calls if c["tool"] == "layershard"]


def _expected(run: Path, node: int, *extra: str) -> list[str]:
    return [
        "train", "--config", "run.yaml",  # the script's own arguments first, then its flags
        "--run-dir", str(run), "--nnodes", "2", "--rdzv-endpoint", f"gpu-17:{PORT}",
        "--rdzv-id", str(JOB_ID), "--nproc-per-node", "8", *extra, "--node-rank", str(node),
    ]  # fmt: skip


def test_each_node_runs_the_same_command_but_its_rank(tmp_path) -> None:
    rc, output, calls = _run(tmp_path, "--config", "run.yaml")
    assert rc == 0, output
    run = tmp_path / "runs" / "layershard"  # $SLURM_SUBMIT_DIR/runs/$SLURM_JOB_NAME
    launches = _launches(calls)
    assert [(c["node"], c["host"]) for c in launches] == [("0", "gpu-17"), ("1", "gpu-18")]
    assert [c["argv"] for c in launches] == [_expected(run, 0), _expected(run, 1)]
    # one srun, one task per node with the job's CPUs; the endpoint's host from scontrol
    assert [c["argv"] for c in calls if c["tool"] == "scontrol"] == [
        ["show", "hostnames", "gpu-[17-18]"]
    ]
    srun = [c["argv"] for c in calls if c["tool"] == "srun"]
    assert len(srun) == 1 and srun[0][:3] == ["--ntasks-per-node=1", "--cpus-per-task=64", "bash"]


def test_the_commands_parse_with_layershard_train_s_own_parser(tmp_path) -> None:
    """A flag the script misspells fails here (argparse exits 2), as on the cluster."""
    _, _, calls = _run(tmp_path, "--config", "run.yaml")
    parser = argparse.ArgumentParser(exit_on_error=False)
    add_arguments(parser)
    for node, call in enumerate(_launches(calls)):
        args = parser.parse_args(call["argv"][1:])
        assert (args.nnodes, args.node_rank, args.rdzv_endpoint) == ("2", node, f"gpu-17:{PORT}")
        assert (args.rdzv_id, args.nproc_per_node, args.config) == (str(JOB_ID), 8, "run.yaml")


def test_a_run_stopped_by_sigterm_is_requeued_and_resumes(tmp_path) -> None:
    """Exit 75 (a checkpoint saved on SIGTERM, docs/train.md) requeues the job; the requeued job
    finds the checkpoint and passes --resume on every node."""
    rc, output, calls = _run(tmp_path, "--config", "run.yaml", exit_code=75)
    assert rc == 75, output
    assert [c["argv"] for c in calls if c["tool"] == "scontrol"][-1] == ["requeue", str(JOB_ID)]

    run = tmp_path / "runs" / "layershard"
    (run / "checkpoints").mkdir(parents=True)
    (run / "checkpoints" / "latest").write_text("step_000100\n")
    rc, output, calls = _run(tmp_path, "--config", "run.yaml", SLURM_RESTART_COUNT="1")
    assert rc == 0, output
    assert [c["argv"] for c in _launches(calls)] == [
        _expected(run, 0, "--resume"),
        _expected(run, 1, "--resume"),
    ]
    assert ["requeue", str(JOB_ID)] not in [c["argv"] for c in calls]  # done: no requeue


def test_a_failed_run_is_not_requeued(tmp_path) -> None:
    rc, output, calls = _run(tmp_path, exit_code=1)
    assert rc == 1, output
    assert [c["argv"] for c in calls if c["tool"] == "scontrol"] == [
        ["show", "hostnames", "gpu-[17-18]"]
    ]


def test_a_launch_stopped_before_its_first_checkpoint_starts_again(tmp_path) -> None:
    """A run folder without a checkpoint (stopped while preparing the data): --overwrite, as a
    new run refuses a non-empty folder."""
    run = tmp_path / "shared" / "llama"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text("model: tiny\n")
    _, _, calls = _run(tmp_path, RUN=str(run))
    assert [c["argv"][-3:] for c in _launches(calls)] == [
        ["--overwrite", "--node-rank", "0"],
        ["--overwrite", "--node-rank", "1"],
    ]
    assert all(c["argv"][1:3] == ["--run-dir", str(run)] for c in _launches(calls))


def test_without_gpus_layershard_chooses_the_ranks(tmp_path) -> None:
    _, _, calls = _run(tmp_path, SLURM_GPUS_ON_NODE="", SLURM_GPUS_PER_NODE="")
    assert [c["argv"] for c in _launches(calls)][0] == [
        "train", "--run-dir", str(tmp_path / "runs" / "layershard"), "--nnodes", "2",
        "--rdzv-endpoint", f"gpu-17:{PORT}", "--rdzv-id", str(JOB_ID), "--node-rank", "0",
    ]  # fmt: skip


def test_sbatch_directives() -> None:
    """One launcher per node; SIGTERM to the launchers (not the batch shell: no ``B:``) before
    the limit; requeueable."""
    directives = dict(
        re.match(r"#SBATCH --([\w-]+)(?:=(\S+))?", line).groups()
        for line in SCRIPT.read_text().splitlines()
        if line.startswith("#SBATCH")
    )
    assert directives["ntasks-per-node"] == "1"
    assert directives["signal"] == "TERM@300"
    assert "requeue" in directives


def test_the_docs_show_the_script_as_it_is() -> None:
    docs = (REPO / "docs" / "slurm.md").read_text()
    assert SCRIPT.read_text() in docs
