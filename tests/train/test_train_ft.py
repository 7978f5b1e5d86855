"""`layershard train --ft-replicas N --ft-group G`: fault tolerance across replica groups in the
training command (train/launch/ft.py, train/loop/fault_tolerance.py, docs/fault-tolerance.md).

Fast: the one-line refusals before launch. Slow, 2 groups x 1 rank, each group its own
`python -m layershard train` process, a Lighthouse in the test process (every process killed in
teardown):

- no failure: each step's loss (the mean of the two groups' losses, each over its half of the
  global batch) and gradient norm (the global one, after the cross-group average) equal a plain
  2-rank run of the same global batch within _parity.LOSS_RTOL, and so do the validation losses;
  every step committed with both groups (measured 2026-11-29: the losses and validation
  losses bitwise equal, the gradient norms within 2.7e-7 relative);
- group 1's rank killed (SIGKILL) mid-run: the survivor records the step(s) that did not commit
  (metrics.jsonl and summary.json, with the tokens lost), trains alone, its launcher
  (`--max-restarts 1`) starts group 1 again, which heals from group 0 (no checkpoint read) and
  trains with it again; both end at the same step with bitwise equal weights.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from _parity import LOSS_RTOL
from _train import refused_one_line, train_main

from layershard.train.launch import ft as ft_launch
from layershard.train.loop.report import read_metrics

SMALL = [
    "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512", "--seq-len", "64",
    "--micro-batch", "4", "--model-override", "dim=64", "--model-override", "n_layers=2",
    "--model-override", "ffn_dim=128", "--report-to", "none", "--sample-tokens", "8",
]  # fmt: skip
FT = ["--ft-replicas", "2", "--ft-group", "0", "--ft-lighthouse", "127.0.0.1:29510"]


# --- fast: refusals --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--strategy", "hybrid"], "--strategy hybrid"),
        (["--strategy", "no_shard"], "--strategy no_shard"),
        (["--tp", "2", "--nproc-per-node", "2"], "--tp 2"),
        (["--cp", "2", "--nproc-per-node", "2"], "--cp 2"),
        (["--precision", "fp16"], "--precision fp16"),
        (["--qlora", "--init-from", "nowhere"], "--qlora"),
        (["--optimizer", "muon"], "--optimizer muon"),
        (["--nnodes", "1:2"], "elastic --nnodes"),
    ],
)
def test_refuses_what_it_cannot_do(capsys, tmp_path, argv, words):
    err = refused_one_line(capsys, tmp_path, *SMALL, *FT, *argv)
    assert words in err and "--ft-replicas 2" in err, err


@pytest.mark.parametrize(
    "argv, words",
    [
        (["--ft-replicas", "2", "--ft-group", "2"], "--ft-group 2 must be below --ft-replicas 2"),
        (["--ft-replicas", "2"], "needs --ft-group"),
        (["--ft-group", "1"], "--ft-group goes with --ft-replicas"),
        (["--ft-lighthouse", "h:1"], "--ft-lighthouse goes with --ft-replicas"),
        (["--ft-replicas", "2", "--ft-group", "1", "--ft-lighthouse", "nohost"], "HOST:PORT"),
        (["--ft-replicas", "2", "--ft-group", "1"], "--ft-group 1 needs the Lighthouse"),
        (["--ft-replicas", "0", "--ft-group", "0"], "--ft-replicas must be at least 1"),
    ],
)
def test_refuses_bad_ft_flags(capsys, tmp_path, monkeypatch, argv, words):
    monkeypatch.delenv("TORCHFT_LIGHTHOUSE", raising=False)
    err = refused_one_line(capsys, tmp_path, *SMALL, *argv)
    assert words in err, err


def test_refuses_without_torchft(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(ft_launch, "has_torchft", lambda: False)
    err = refused_one_line(capsys, tmp_path, *SMALL, *FT)
    assert "needs torchft" in err and "pip install 'layershard[ft]'" in err, err


def test_refuses_without_a_named_run_folder(capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert train_main([*SMALL, *FT]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--ft-replicas needs --run-dir" in err, err
    assert not (tmp_path / "runs").exists()


def test_group_run_folder(tmp_path):
    """Each group's run folder is RUN/group-<G> (the dry run resolves it, writes nothing)."""
    from layershard.train.config import LaunchOptions

    opts = LaunchOptions(ft_replicas=2, ft_group=1)
    run = tmp_path / "run"
    assert ft_launch.group_run_dir(run, [{"run_dir": str(run)}], opts) == run / "group-1"
    rec = ft_launch.launch_record(LaunchOptions(ft_replicas=3, ft_group=2, ft_lighthouse="h:7"))
    assert rec is not None and (rec["replicas"], rec["group"], rec["lighthouse"]) == (
        3,
        2,
        "http://h:7",
    )


# --- slow: whole runs ------------------------------------------------------------------------


@contextlib.contextmanager
def _groups(tmp_path: Path, min_replicas: int, argv: list[str], env: dict[str, str]):
    """A Lighthouse here and one `python -m layershard train` per group; yields the processes
    and a port; kills everything at the end."""
    from layershard.ft import lighthouse_server

    lighthouse = lighthouse_server(
        min_replicas=min_replicas, join_timeout_ms=5000, heartbeat_timeout_ms=2000,
        quorum_tick_ms=20,
    )  # fmt: skip
    address = lighthouse.address().removeprefix("http://").split(":")[-1]
    procs: list[subprocess.Popen] = []
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "LAYERSHARD_FT_HOSTNAME": "127.0.0.1",
                "PYTHONUNBUFFERED": "1", **env}  # fmt: skip
    try:
        for g in range(2):
            cmd = [sys.executable, "-m", "layershard", "train", *argv, "--run-dir",
                   str(tmp_path / "run"), "--ft-replicas", "2", "--ft-group", str(g),
                   "--ft-lighthouse", f"127.0.0.1:{address}"]  # fmt: skip
            log = open(tmp_path / f"group-{g}.log", "w")
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT,
                                          env=full_env, start_new_session=True))  # fmt: skip
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=10)
        lighthouse.shutdown()


def _wait(tmp_path: Path, procs: list[subprocess.Popen], deadline_s: float) -> None:
    deadline = time.monotonic() + deadline_s
    while any(p.poll() is None for p in procs):
        if time.monotonic() > deadline:
            raise TimeoutError(_logs(tmp_path))
        time.sleep(0.1)
    assert all(p.returncode == 0 for p in procs), _logs(tmp_path)


def _logs(tmp_path: Path) -> str:
    return "\n".join(
        f"--- {f.name}\n{f.read_text()[-4000:]}" for f in sorted(tmp_path.glob("*.log"))
    )


def _steps(run: Path) -> list[dict]:
    return [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]


def _close(a: float, b: float, rtol: float = LOSS_RTOL) -> bool:
    return abs(a - b) <= rtol * abs(b)


def _hf_model(tmp_path: Path) -> list[str]:
    """A transformers Llama's config of SMALL's widths, as --hf-config, in place of SMALL's
    --model-override flags."""
    import transformers

    transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    ).save_pretrained(str(tmp_path / "hf"))  # fmt: skip
    small = [
        a for i, a in enumerate(SMALL) if "--model-override" not in SMALL[max(i - 1, 0) : i + 1]
    ]
    return [*small, "--hf-config", str(tmp_path / "hf")]


@pytest.mark.slow
@pytest.mark.parametrize("model", ["built-in", "transformers"])
def test_two_groups_equal_one_run_of_the_global_batch(tmp_path, model):
    steps = 6
    small = SMALL if model == "built-in" else _hf_model(tmp_path)
    argv = [*small, "--nproc-per-node", "1", "--steps", str(steps), "--eval-interval", "3"]
    with _groups(tmp_path, 2, argv, {}) as procs:  # min_replicas 2: every step has both
        _wait(tmp_path, procs, 120)
    ref_dir = tmp_path / "ref"
    ref_argv = [*small, "--nproc-per-node", "2", "--steps", str(steps), "--eval-interval", "3"]
    assert train_main(["--run-dir", str(ref_dir), *ref_argv]) == 0
    g0, g1 = (tmp_path / "run" / f"group-{g}" for g in range(2))
    ref = _steps(ref_dir)
    a, b = _steps(g0), _steps(g1)
    assert [r["step"] for r in a] == [r["step"] for r in b] == list(range(1, steps + 1))
    for x, y, r in zip(a, b, ref):
        assert x["committed"] and y["committed"] and x["participants"] == y["participants"] == 2
        assert _close((x["loss"] + y["loss"]) / 2, r["loss"]), (x, y, r)
        assert x["loss"] != y["loss"]  # each group its own half of the batch
        assert _close(x["grad_norm"], r["grad_norm"]) and x["grad_norm"] == y["grad_norm"]
        assert x["lr"] == y["lr"] == r["lr"]
    vals = [[r["val_loss"] for r in read_metrics(d / "metrics.jsonl") if "val_loss" in r]
            for d in (g0, g1, ref_dir)]  # fmt: skip
    assert len(vals[2]) == 3 and vals[0] == vals[1]
    assert all(_close(v, w) for v, w in zip(vals[0], vals[2])), vals
    s0, sref = (json.loads((d / "summary.json").read_text()) for d in (g0, ref_dir))
    ft = s0["fault_tolerance"]
    assert (ft["committed"], ft["not_committed"], ft["tokens_lost"]) == (steps, 0, 0)
    assert 2 * s0["tokens_per_step"] == sref["tokens_per_step"]
    assert (g0 / "checkpoints" / f"step_{steps:06d}").is_dir()


@pytest.mark.slow
def test_group_killed_restarts_and_rejoins(tmp_path):
    steps = 40
    # 4 micro-batches a step: the ranks spend most of their time inside a step (the kill
    # lands in one: the survivor's cross-group all-reduce fails and the step is thrown away)
    argv = [*SMALL, "--nproc-per-node", "1", "--steps", str(steps), "--eval-interval", "0",
            "--grad-accum", "4", "--max-restarts", "1"]  # fmt: skip
    g0, g1 = (tmp_path / "run" / f"group-{g}" for g in range(2))
    env = {"LAYERSHARD_FT_THROTTLE_S": "0.3"}  # the survivor alone: slow, so that g1 returns
    with _groups(tmp_path, 1, argv, env) as procs:
        deadline = time.monotonic() + 90
        while True:  # group 1 trained with group 0 for a few steps: kill -9 its rank
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise AssertionError(_logs(tmp_path))
            recs = _steps(g1) if (g1 / "metrics.jsonl").is_file() else []
            if sum(r["participants"] == 2 for r in recs) >= 3:
                break
            time.sleep(0.005)
        status = json.loads((g1 / ".layershard" / "rank-00000.json").read_text())
        # a step takes 50-100 ms here: 30 ms after its predecessor's record, the rank has asked
        # for the step's quorum and is in its forward or backward (killed at the very start of
        # a step, before its quorum request, it would cost the survivor nothing)
        time.sleep(0.03)
        os.kill(status["pid"], signal.SIGKILL)
        killed_at = recs[-1]["step"]
        _wait(tmp_path, procs, 100)
    a = read_metrics(g0 / "metrics.jsonl")
    lost = [r for r in a if r.get("not_committed")]
    s0, s1 = (json.loads((d / "summary.json").read_text()) for d in (g0, g1))
    ft0, ft1 = s0["fault_tolerance"], s1["fault_tolerance"]
    # the survivor: the step(s) the kill cost, each with its tokens, in metrics and summary
    assert 1 <= len(lost) <= 2 and all(r["step"] >= killed_at for r in lost), lost
    assert all(r["tokens_lost"] == s0["tokens_per_step"] for r in lost)
    assert ft0["steps_lost"] == ft0["not_committed"] == len(lost)
    assert ft0["tokens_lost"] == len(lost) * s0["tokens_per_step"]
    # it took part in every step the job committed since it started (a group that starts after
    # the other heals from it first: there is no start barrier)
    done = [r["step"] for r in _steps(g0) if r["committed"]]
    assert done == list(range(done[0], steps + 1)) and ft0["committed"] == len(done), done
    parts = [r["participants"] for r in _steps(g0)]
    alone = [i for i, n in enumerate(parts) if n == 1]
    assert alone and parts[-1] == 2 and max(alone) < len(parts) - 1, parts
    assert ft0["data_position"] == steps + len(lost)  # every attempt used up its batch
    # the restarted group healed from the survivor (no checkpoint read), then trained with it
    recovered = [r for r in read_metrics(g1 / "metrics.jsonl") if r.get("ft_event") == "recovered"]
    # (a group that starts after the other heals at its first step too: there is no barrier)
    assert recovered and recovered[-1]["step"] > killed_at, recovered
    assert any(e["kind"] == "recovered" for e in ft1["events"])
    assert s0["steps"] == s1["steps"] == steps
    w0, w1 = ((d / "final" / "model-00001-of-00001.safetensors").read_bytes() for d in (g0, g1))
    assert w0 == w1  # bitwise: the same weights in both groups at the end
    assert s0["val_loss_end"] == s1["val_loss_end"]
