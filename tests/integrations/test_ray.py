"""Ray Train runs ``ls.shard``: examples/ray_train.py's loop in a ``TorchTrainer`` on a local Ray
with 2 CPU workers (Ray makes the gloo group, ``ls.init_distributed()`` joins it) trains to the
losses of the same loop on 2 torchrun-style ranks (``run_ranks``) and of plain PyTorch on one
process on the same global batches, within LOSS_RTOL (tests/_parity.py, where it is measured).

Ray is an optional extra (``pip install 'layershard[ray]'``): without it the test skips. Ray
runs in a process of its own (DRIVER, which builds the example's trainer), so its daemons, signal
handlers and logging never touch the pytest process; a timeout kills the whole session it
started."""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from _dist import run_ranks
from _parity import LOSS_RTOL, TINY

REPO = Path(__file__).resolve().parents[2]
EXAMPLES = REPO / "examples"
TIMEOUT_S = 300  # the whole test: 64 s on 2 busy cores, of which Ray's start is ~15 s
STEPS = 4  # each ray.train.report is a barrier through Ray's controller (~1 s here)

# The parity tests' tiny Llama and global batch (8 sequences of 16 tokens), at their LR.
CONFIG = {
    "model": "tiny",
    "model_overrides": dict(TINY),
    "steps": STEPS,
    "lr": 1e-2,
    "global_batch": 8,
    "seq_len": 16,
    "seed": 0,
    "grad_clip": 1.0,
}
FLAGS = [
    *(f"--model-override={k}={v}" for k, v in TINY.items()),
    *("--steps", str(STEPS), "--lr", "1e-2", "--global-batch", "8", "--seq-len", "16"),
    *("--nproc", "2", "--timeout", "120", "--name", "parity"),
]

# What a Ray worker runs: checks that the group Ray made is the one layershard trains on, as
# layershard expects it (gloo on CPU, the ranks Ray numbered, layershard's timeout, not Ray's
# 1800 s default), then the example's own loop. A failed check fails the worker, and so fit().
DRIVER = """
import json, os, sys
import torch
import torch.distributed as dist
import ray
import ray_train as example  # examples/ is on PYTHONPATH: Ray's workers import it by name too

def checked(config):
    import layershard as ls
    assert dist.is_initialized(), "Ray made no process group before calling the loop"
    group = dist.group.WORLD
    rank, world = ls.init_distributed()
    assert dist.group.WORLD is group, "init_distributed replaced Ray's group"
    assert (rank, world) == (int(os.environ["RANK"]), 2), (rank, world)
    assert dist.get_backend() == "gloo", dist.get_backend()
    timeout = group._get_backend(torch.device("cpu")).options._timeout
    assert timeout.total_seconds() == 120, f"process group timeout {timeout}, not --timeout 120"
    example.train_loop_per_worker(config)

ray.init(num_cpus=2, include_dashboard=False)
args = example.parse_args(sys.argv[2:])
result = example.build_trainer(args, train_fn=checked).fit()
with open(sys.argv[1], "w") as f:
    json.dump({"losses": result.metrics["losses"], "checkpoint": result.checkpoint.path}, f)
"""


def _example():
    spec = importlib.util.spec_from_file_location("ray_train", EXAMPLES / "ray_train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _ranks_losses(rank: int, world: int, out: str) -> None:
    """The example's loop on a torchrun-style rank (run_ranks made the gloo group)."""
    _, losses = _example().train(CONFIG)
    if rank == 0:
        Path(out).write_text(json.dumps(losses))


def _plain_torch_losses() -> list[float]:
    """The same steps on one process, unsharded: the model, batches and clipping of the loop."""
    example = _example()
    model = example.build_model(CONFIG)
    opt = torch.optim.AdamW(model.parameters(), lr=CONFIG["lr"])
    losses = []
    for step in range(STEPS):
        x = example.global_batch(CONFIG, step)
        loss = model(x, labels=x).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CONFIG["grad_clip"])
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _run_ray(tmp_path: Path) -> dict:
    driver, out = tmp_path / "driver.py", tmp_path / "result.json"
    driver.write_text(DRIVER)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([str(EXAMPLES), os.environ.get("PYTHONPATH", "")])
    )
    env.pop("RAY_ADDRESS", None)  # a local Ray, never a cluster this shell points at
    cmd = [sys.executable, str(driver), str(out), *FLAGS, "--run-dir", str(tmp_path / "ray")]
    proc = subprocess.Popen(
        cmd, env=env, cwd=tmp_path, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,
    )  # fmt: skip
    try:
        output, _ = proc.communicate(timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate(timeout=30)
        pytest.fail(f"Ray run timed out after {TIMEOUT_S} s\n{output[-6000:]}")
    if proc.returncode != 0 or not out.is_file():
        pytest.fail(f"Ray run exited {proc.returncode}\n{output[-6000:]}")
    return json.loads(out.read_text())


def _assert_close(got: list[float], want: list[float], what: str) -> None:
    assert len(got) == len(want) == STEPS, (got, want)
    rel = max(abs(a - b) / abs(b) for a, b in zip(got, want))
    assert rel <= LOSS_RTOL, f"Ray's losses {got} vs {what} {want}: relative {rel:.2e}"


@pytest.mark.slow
def test_ray_trainer_trains_like_torchrun_and_one_process(tmp_path) -> None:
    # Here, not at import: collecting the fast tier must not import Ray (seconds).
    pytest.importorskip("ray")
    pytest.importorskip("ray.train", reason="Ray Train: pip install 'layershard[ray]'")
    ray_result = _run_ray(tmp_path)
    out = tmp_path / "ranks.json"
    run_ranks(_ranks_losses, 2, str(out))
    ranks = json.loads(out.read_text())
    plain = _plain_torch_losses()

    _assert_close(ray_result["losses"], ranks, "2 torchrun-style ranks")
    _assert_close(ray_result["losses"], plain, "plain PyTorch on one process")
    assert plain[-1] < plain[0]  # it trained: the loss fell over the steps
    # The Ray checkpoint is the Hugging Face folder export_hf wrote, of this model's shapes.
    hf = json.loads((Path(ray_result["checkpoint"]) / "model" / "config.json").read_text())
    assert (hf["hidden_size"], hf["num_hidden_layers"], hf["vocab_size"]) == (32, 3, 96)
    files = sorted(p.name for p in (Path(ray_result["checkpoint"]) / "model").iterdir())
    assert files == [
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors.index.json",
    ], files
