"""`layershard train --report-to tensorboard,wandb,mlflow`: the same numbers as metrics.jsonl in
a W&B run (offline: nothing leaves the machine) and an MLflow run (a local file store), the run's
config at the start and its summary at the end; a resumed run continues the same W&B and MLflow
runs; a run that fails says so in both; a reporter that is not installed is refused before
launch."""

from __future__ import annotations

import importlib.util
import json
import os
import struct
from pathlib import Path

import pytest
from _train import TINY, refused_one_line, train_main

from layershard.train.loop import sinks
from layershard.train.loop.report import read_metrics

SITE = Path(__file__).parents[1] / "faults_site"


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))


def test_a_reporter_that_is_not_installed_is_refused_before_launch(tmp_path, capsys, monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        sinks.importlib.util, "find_spec", lambda name: None if name == "wandb" else real(name)
    )
    err = refused_one_line(capsys, tmp_path, *TINY, "--report-to", "tensorboard,wandb")
    assert "--report-to wandb: the wandb package is not installed; pip install " in err
    assert "'layershard[wandb]'" in err
    err = refused_one_line(capsys, tmp_path, *TINY, "--report-to", "tensorboard,comet")
    assert "report_to must be one of 'tensorboard', 'wandb' or 'mlflow'" in err, err


# ---- W&B's offline run files, read back ------------------------------------------------------


def _wandb_records(path: Path):
    """The records of a W&B run file (``run-<id>.wandb``): a LevelDB-style log of 32 KiB blocks
    whose records (checksum, length, type, data) carry ``wandb_internal_pb2.Record``s."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, pos, block, part = path.read_bytes(), 7, 32768, b""
    assert data[:4] == b":W&B", data[:8]
    while pos < len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        part = chunk if kind in (1, 2) else part + chunk
        if kind in (1, 4):  # FULL, or the LAST of FIRST/MIDDLE/LAST
            rec = pb.Record()
            rec.ParseFromString(part)
            yield rec


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


def _wandb_run(wandb_dir: Path, run_id: str) -> tuple[dict[int, float], dict, dict, int]:
    """Every offline run of ``run_id`` in ``wandb_dir`` taken together: train/loss by step, the
    config keys, the summary, and how many offline runs (launches) there were."""
    runs = sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    loss, config, summary = {}, {}, {}
    for path in runs:
        for rec in _wandb_records(path):
            kind = rec.WhichOneof("record_type")
            if kind == "history":
                items = {_key(i): json.loads(i.value_json) for i in rec.history.item}
                if "train/loss" in items:
                    loss[int(items["step"])] = items["train/loss"]
            elif kind == "run":
                config.update({_key(i): json.loads(i.value_json) for i in rec.run.config.update})
            elif kind == "summary":
                summary.update({_key(i): json.loads(i.value_json) for i in rec.summary.update})
    return loss, config, summary, len(runs)


@pytest.fixture
def reporting_env(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("mlflow")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "wandb-dir"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    (tmp_path / "wandb-dir").mkdir()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")  # MLflow 3's local store, for tests
    return tmp_path


@pytest.mark.slow
def test_wandb_and_mlflow_get_the_metrics_and_a_resume_continues_their_runs(reporting_env):
    from mlflow.tracking import MlflowClient

    tmp = reporting_env
    run = tmp / "run"
    args = [*TINY, "--run-dir", str(run), "--steps", "4", "--eval-interval", "2",
            "--report-to", "tensorboard,wandb,mlflow"]  # fmt: skip
    assert train_main([*args, "--stop-at-step", "2"]) == 0
    first = json.loads((run / sinks.IDS).read_text())
    assert train_main(["--run-dir", str(run), "--resume"]) == 0
    ids = json.loads((run / sinks.IDS).read_text())
    assert ids == first and set(ids) == {"wandb", "mlflow"}  # the same runs, continued
    losses = {r["step"]: r["loss"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r}
    assert sorted(losses) == [1, 2, 3, 4]
    summary = json.loads((run / "summary.json").read_text())

    client = MlflowClient()
    ml = client.get_run(ids["mlflow"])
    assert ml.info.status == "FINISHED"
    history = {m.step: m.value for m in client.get_metric_history(ids["mlflow"], "train/loss")}
    assert history == pytest.approx(losses, rel=1e-12)  # the same numbers, as float64
    assert ml.data.params["seq_len"] == "64" and ml.data.params["world_size"] == "2"
    assert ml.data.metrics["summary/steps"] == 4
    assert ml.data.metrics["summary/val_loss_end"] == pytest.approx(summary["val_loss_end"])

    wb_loss, wb_config, wb_summary, launches = _wandb_run(tmp / "wandb-dir", ids["wandb"])
    assert launches == 2  # one offline run per launch, one W&B run id: `wandb sync` joins them
    assert wb_loss == pytest.approx(losses, rel=1e-12)
    assert wb_config["seq_len"] == 64 and wb_config["report_to"] == [
        "tensorboard",
        "wandb",
        "mlflow",
    ]
    assert wb_summary["steps"] == 4 and wb_summary["val_loss_end"] == pytest.approx(
        summary["val_loss_end"]
    )
    assert any((run / "tensorboard").glob("events.out.tfevents*"))


@pytest.mark.slow
def test_a_failed_run_says_how_it_ended_in_wandb_and_mlflow(reporting_env, monkeypatch, capfd):
    from mlflow.tracking import MlflowClient

    tmp = reporting_env
    run = tmp / "run"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("LS_TEST_FAULT", "kill@2:1")  # rank 1 SIGKILLs itself after step 2
    args = [*TINY, "--run-dir", str(run), "--steps", "4", "--report-to", "wandb,mlflow"]
    assert train_main(args) == 1
    line = capfd.readouterr().err.strip().splitlines()[-1]
    assert "rank 1" in line and "killed by SIGKILL" in line, line
    ids = json.loads((run / sinks.IDS).read_text())
    ml = MlflowClient().get_run(ids["mlflow"])
    assert ml.info.status == "FAILED"
    assert "rank 1" in ml.data.tags["failure"] and "killed by SIGKILL" in ml.data.tags["failure"]
    _, _, wb_summary, _ = _wandb_run(tmp / "wandb-dir", ids["wandb"])
    assert line.endswith(wb_summary["failure"]), (line, wb_summary)
