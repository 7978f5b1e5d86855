"""`layershard train` under faults, end to end: torchrun and 2 gloo ranks at a tiny size.

Faults are injected deterministically by tests/faults_site/sitecustomize.py (on PYTHONPATH, it
acts in the ranks only): a rank SIGKILLs itself after a given step, or sends SIGTERM to
`layershard train` as a scheduler would. Every interrupted run is compared with one
uninterrupted run of the same configuration: its final weights must be bitwise the same.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from layershard.train import cli as train_cli
from layershard.train import status as st
from layershard.train.loop.report import read_metrics

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

SITE = Path(__file__).parents[1] / "faults_site"
TINY = [
    "--nproc-per-node", "2", "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512",
    "--seq-len", "64", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "3",
    "--model-override", "dim=64", "--model-override", "n_layers=2",
    "--model-override", "ffn_dim=128", "--eval-sequences", "16", "--sample-tokens", "8",
    "--steps", "8", "--eval-interval", "0", "--seed", "3",
]  # fmt: skip


def train_main(argv: list[str]) -> int:
    """`layershard train ARGV` in-process (only the train subcommand's parser)."""
    parser = argparse.ArgumentParser(prog="layershard train")
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return str(tmp_path_factory.getbasetemp() / "ls-cache")


@pytest.fixture(autouse=True)
def env(cache, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", cache)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.delenv("LS_TEST_FAULT", raising=False)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, cache) -> Path:
    """The uninterrupted run every interrupted one must end like."""
    run = tmp_path_factory.mktemp("ref") / "run"
    os.environ["LAYERSHARD_CACHE"] = cache
    assert train_main([*TINY, "--run-dir", str(run), "--checkpoint-interval", "2"]) == 0
    return run


def final_weights(run: Path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted((run / "final").glob("*.safetensors")):
        out.update(load_file(f))
    return out


def assert_same_final(run: Path, reference: Path) -> None:
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def losses(run: Path) -> dict[int, float]:
    recs = [r for r in read_metrics(run / "metrics.jsonl") if "loss" in r]
    steps = [r["step"] for r in recs]
    assert len(steps) == len(set(steps)), f"a step is logged twice: {steps}"
    return {r["step"]: r["loss"] for r in recs}


def processes_using(run: Path) -> list[str]:
    """Command lines of live processes that name the run folder (ranks, torchrun, the CLI)."""
    found = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if str(run) in cmd and state != "Z":
            found.append(cmd)
    return found


def test_restart_then_sigterm_then_resume_end_like_an_uninterrupted_run(tmp_path, reference):
    """Rank 1 is SIGKILLed after step 5: torchrun (--max-restarts 1) restarts the ranks, which
    resume from the latest complete checkpoint (step 2 or 4: the asynchronous save of step 4 may
    not have been published yet), not from step 0. After step 6 of that attempt
    `layershard train` gets SIGTERM: the ranks finish the step they are in, save a checkpoint and
    exit 75, leaving no process behind. `--resume` then ends with the reference's weights and
    losses, bit for bit. Periodic checkpoints are asynchronous here."""
    run = tmp_path / "run"
    env = dict(os.environ, LS_TEST_FAULT="kill@5:1:0,term_cli@6:0:1")
    cmd = [sys.executable, "-m", "layershard", "train", *TINY, "--run-dir", str(run),
           "--checkpoint-interval", "2", "--async-checkpoint", "--max-restarts", "1"]  # fmt: skip
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    err = out.stderr.strip().splitlines()
    assert out.returncode == st.EXIT_STOPPED, out.stderr[-3000:]
    stop = st.read_json(run / ".layershard" / "stop.json")
    stopped = stop["step"]
    assert stop["signal"] == "SIGTERM" and stopped in (6, 7), stop  # the step it was in, or next
    assert err[-1] == (
        f"layershard train: stopped by SIGTERM at step {stopped}; checkpoint saved "
        f"({run.absolute()}/checkpoints/step_{stopped:06d}). Continue with: layershard train "
        f"--resume --run-dir {run}"
    ), err[-3:]
    resumed = re.findall(r"resumed at step (\d+)", out.stdout)
    assert resumed in (["2"], ["4"]), out.stdout  # the restarted ranks, from a checkpoint
    ranks = st.rank_statuses(run, stop["launch_id"])
    assert {r["attempt"] for r in ranks.values()} == {1}
    assert sorted(losses(run)) == list(range(1, stopped + 1))
    assert (run / "checkpoints" / "latest").read_text().strip() == f"step_{stopped:06d}"
    assert not processes_using(run)
    assert not (run / ".layershard" / "lock").exists()

    assert train_main(["--resume", "--run-dir", str(run), "--nproc-per-node", "2"]) == 0
    assert_same_final(run, reference)
    assert losses(run) == losses(reference)


def test_dead_rank_is_named_and_a_corrupt_checkpoint_is_not_resumed_silently(
    tmp_path, reference, capfd
):
    """A rank killed by SIGKILL is named with its signal and step (not a peer's "connection
    reset"); then the newest checkpoint is corrupted: --resume names the file and the check in
    one line, and resumes from the one before only with --resume-fallback."""
    run = tmp_path / "run"
    os.environ["LS_TEST_FAULT"] = "kill@3:1"
    assert train_main([*TINY, "--run-dir", str(run), "--checkpoint-interval", "1"]) == 1
    err = capfd.readouterr().err.strip().splitlines()
    assert err[-1].startswith("layershard train: error: rank 1 (pid "), err[-5:]
    assert "was killed by SIGKILL" in err[-1] and "at step 3" in err[-1], err[-1]
    assert "Resume from step_000002 with: layershard train --resume" in err[-1]
    assert not processes_using(run)
    del os.environ["LS_TEST_FAULT"]

    # truncated: refused before any rank starts
    data = sorted((run / "checkpoints" / "step_000002").glob("*.distcp"))[0]
    kept = data.read_bytes()
    data.write_bytes(kept[:100])
    assert train_main(["--resume", "--run-dir", str(run)]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert len(err) == 1 and f"{data}: truncated" in err[0], err
    assert "--resume-fallback to resume from the newest intact one (step_000001)" in err[0]
    # the same size, other bytes: found by the ranks' SHA-256 check, reported once, no traceback
    data.write_bytes(kept[:-8] + bytes(8))
    before = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    # (with a changed setting: the ranks' refusal puts config.yaml back as it was)
    assert train_main(["--resume", "--run-dir", str(run), "--eval-interval", "3"]) == 2
    cap = capfd.readouterr()
    assert "Traceback" not in cap.err
    assert cap.err.count("SHA-256") == 1, cap.err
    last = cap.err.strip().splitlines()[-1]
    assert f"{data}: corrupt (SHA-256 differs" in last and "--resume-fallback" in last, last
    after = {p.name: p.read_bytes() for p in run.iterdir() if p.is_file()}
    assert after == before  # nothing was resumed, nothing rewritten
    assert train_main(["--resume", "--run-dir", str(run), "--resume-fallback"]) == 0
    assert "resuming from step_000001; skipped the corrupt step_000002" in capfd.readouterr().err
    assert_same_final(run, reference)
    assert losses(run) == losses(reference)


def test_resuming_a_finished_run_touches_nothing(tmp_path, reference, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    before = {p: p.read_bytes() for p in (run / "summary.json", run / "metrics.jsonl")}
    assert train_main(["--resume", "--run-dir", str(run)]) == 0
    out = capsys.readouterr().out
    assert "is already finished (8 of 8 steps): nothing to do" in out
    assert {p: p.read_bytes() for p in before} == before
    assert json.loads((run / "launch.json").read_text()) == json.loads(
        (reference / "launch.json").read_text()
    )


def test_a_resume_that_changes_the_trained_state_is_refused_and_changes_nothing(
    tmp_path, reference, capsys
):
    """The checkpoints hold the run's optimizer state and trainable parameters: a resume with
    another optimizer, or with or without --qlora, is refused before launch, config.yaml kept."""
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()  # not finished: --resume would train
    before = (run / "config.yaml").read_bytes()
    assert train_main(["--resume", "--run-dir", str(run), "--optimizer", "muon"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err
    assert "--resume: --optimizer muon instead of the run's adamw, but the checkpoints" in err
    assert (run / "config.yaml").read_bytes() == before
    # --qlora / --lora-rank (a QLoRA run is too slow to train here: the comparison itself)
    from layershard.train.config import resolve
    from layershard.train.identity import _state_change

    full, qlora = resolve({}), resolve({"qlora": True, "init_from": "/m"})
    assert "--qlora trains LoRA adapters" in _state_change(full, qlora)
    assert "--no-qlora trains every weight" in _state_change(qlora, full)
    r8 = resolve({"qlora": True, "init_from": "/m", "lora_rank": 8})
    assert _state_change(qlora, r8) == "--lora-rank 8 instead of the run's 16"
    assert _state_change(qlora, qlora) == ""


def test_a_second_run_on_the_same_folder_refuses(tmp_path, reference, capsys):
    run = tmp_path / "run"
    shutil.copytree(reference, run)
    (run / "summary.json").unlink()  # not finished: --resume would train
    lock = st.acquire_lock(run, "other")  # held by this (live) process, as a running CLI would
    try:
        for argv in (["--resume"], ["--overwrite", *TINY]):
            assert train_main([*argv, "--run-dir", str(run)]) == 2
            err = capsys.readouterr().err.strip()
            assert err.count("\n") == 0 and f"run folder {run} is in use by another" in err
            assert f"pid {os.getpid()} on" in err, err
        assert (run / "config.yaml").is_file() and (run / "checkpoints" / "step_000008").is_dir()
    finally:
        st.release_lock(lock)
    # a lock whose holder is gone is taken over
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    st.write_json(run / ".layershard" / "lock", {**st.me(), "pid": dead.pid, "start": "1"})
    assert st.held_by(run) == ""
    path = st.acquire_lock(run, "mine")
    assert st.read_json(path)["pid"] == os.getpid()
    st.release_lock(path)
    assert not path.exists()


def test_stop_at_step_then_resume_with_micro_batches_matches(tmp_path, reference):
    """`--stop-at-step` checkpoints and stops; the resumed run continues exactly. Here each step
    is also split into 2 micro-batches of 2 (the first under no_sync): the same global batch, so
    the reference's losses to fp32 reduction-order noise."""
    run = tmp_path / "run"
    split = [a for a in TINY]
    split[split.index("--micro-batch") + 1] = "2"
    assert (
        train_main([*split, "--grad-accum", "2", "--run-dir", str(run), "--stop-at-step", "4"]) == 0
    )
    assert sorted(losses(run)) == [1, 2, 3, 4]
    assert train_main(["--resume", "--run-dir", str(run), "--nproc-per-node", "2"]) == 0
    a, b = losses(reference), losses(run)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], rel=1e-5, abs=1e-6), (step, a, b)
