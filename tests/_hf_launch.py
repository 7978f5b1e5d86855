"""Runs tests/_hf_script.py under torchrun once per pytest session and hands each test its
section of the results. Two launches in all (4 ranks, then 2 ranks, which resumes the 4-rank
run's checkpoint): importing transformers and trl costs each rank ~6 s of CPU, so the tests share
them instead of launching per test. Every launch has a timeout."""

from __future__ import annotations

import atexit
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = Path(__file__).with_name("_hf_script.py")
WORLD = {"save4": 4, "main": 2}
TIMEOUT_S = {"save4": 240, "main": 420}


@functools.cache
def _out() -> Path:
    out = Path(tempfile.mkdtemp(prefix="layershard-hf-"))
    atexit.register(shutil.rmtree, out, ignore_errors=True)
    return out


@functools.cache
def results(job: str) -> dict:
    """``job``'s results (``main`` first runs ``save4``, whose checkpoint it resumes)."""
    if job == "main":
        results("save4")
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false")
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "src"), env.get("PYTHONPATH", "")])
    env.pop("ACCELERATE_USE_FSDP", None)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmd += [f"--nproc-per-node={WORLD[job]}", str(SCRIPT), job, str(_out())]
    # A session of its own: on timeout the launcher and every rank it started are killed.
    proc = subprocess.Popen(
        cmd, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S[job])
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the agent; its ranks follow (die_with_launcher)
        try:
            output, _ = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:  # a rank still holds the pipe: report without it
            output = ""
        pytest.fail(f"{job}: torchrun timed out after {TIMEOUT_S[job]} s\n{output[-6000:]}")
    path = _out() / f"{job}.json"
    if proc.returncode != 0 or not path.is_file():
        pytest.fail(f"{job}: torchrun exited {proc.returncode}\n{output[-6000:]}")
    return json.loads(path.read_text())


def section(job: str, name: str) -> dict:
    res = results(job)[name]
    if "error" in res:
        pytest.fail(f"{job}/{name} raised on rank 0:\n{res['error']}")
    return res
