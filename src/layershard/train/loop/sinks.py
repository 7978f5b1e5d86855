"""Where a run's metrics go besides ``metrics.jsonl`` (``--report-to``, YAML ``report_to``):
TensorBoard event files in the run folder, a Weights & Biases run, an MLflow run. Each gets the
same records (the numbers of ``metrics.jsonl``), the run's config at the start, the summary at
the end, and the line that explains a run that did not finish (``record_failure``, called by
``layershard train`` itself, which knows how the ranks ended).

A run folder keeps its W&B and MLflow runs across ``--resume``: their ids are recorded in
``reporting.json`` when the run starts and reused by every later launch, so a resumed run
continues the same W&B / MLflow run. Where they go is theirs to say: ``WANDB_PROJECT``,
``WANDB_MODE=offline`` (nothing leaves the machine; ``wandb sync`` later), ``WANDB_DIR``;
``MLFLOW_TRACKING_URI`` and ``MLFLOW_EXPERIMENT_NAME`` (default experiment ``layershard``).

Steps logged by the part of a run that a resume discards (after its checkpoint) stay in W&B and
MLflow, which keep what they received; the resumed part logs those steps again (TensorBoard's
events are purged, ``metrics.jsonl`` rewritten).
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Annotated, Any, Literal, Protocol

from pydantic import BeforeValidator, Field


def _as_reporters(value: Any) -> Any:
    """``--report-to tensorboard,wandb`` (or a YAML list); ``none``: metrics.jsonl only."""
    if isinstance(value, str):
        value = [v.strip() for v in value.split(",") if v.strip()]
    return [] if value == ["none"] else value


# the config's report_to (train/config.py)
Reporters = Annotated[
    list[Literal["tensorboard", "wandb", "mlflow"]],
    BeforeValidator(_as_reporters),
    Field(description="a comma-separated list of tensorboard, wandb and mlflow, or none"),
]
IDS = "reporting.json"  # the run folder's W&B and MLflow run ids
PROJECT = "layershard"  # the W&B project and MLflow experiment unless their variables say

# metrics.jsonl key -> tag (mem_mib, a list per rank, is written per rank and as max)
TAGS = {
    "loss": "train/loss",
    "lr": "train/lr",
    "grad_norm": "train/grad_norm",
    "tokens_per_s": "train/tokens_per_s",
    "step_time_s": "train/step_time_s",
    "mfu": "train/mfu",
    "skipped_steps": "train/skipped_steps",
    "loss_scale": "train/loss_scale",
    "val_loss": "val/loss",
}


def missing(report_to: Sequence[str]) -> str:
    """'' if every reporter of ``report_to`` but TensorBoard can be imported, else the one line
    naming the extra to install (TensorBoard, on by default, is noted at run time instead)."""
    for name in report_to:
        if name != "tensorboard" and importlib.util.find_spec(name) is None:
            return (
                f"--report-to {name}: the {name} package is not installed; pip install "
                f"'layershard[{name}]', or drop {name} from --report-to"
            )
    return ""


def scalars(record: dict[str, Any]) -> dict[str, float]:
    """A metrics record's numbers under their tags; memory per rank and its maximum."""
    out = {
        tag: float(record[key])
        for key, tag in TAGS.items()
        if isinstance(record.get(key), int | float) and not isinstance(record[key], bool)
    }
    mem = record.get("mem_mib")
    if isinstance(mem, list) and mem:
        out.update({f"memory/rank{r}_mib": float(m) for r, m in enumerate(mem)})
        out["memory/max_mib"] = float(max(mem))
    return out


class Sink(Protocol):
    def log(self, step: int, values: dict[str, float]) -> None: ...

    def finish(self, summary: dict[str, Any] | None) -> None: ...


def _flat(d: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _numbers(summary: dict[str, Any]) -> dict[str, float]:
    flat = _flat(summary)
    return {
        k: float(v)
        for k, v in flat.items()
        if isinstance(v, int | float) and not isinstance(v, bool)
    }


def run_ids(run_dir: Path, resumed: bool) -> dict[str, str]:
    """The run's W&B / MLflow ids: recorded ones on resume, none for a fresh run."""
    path = run_dir / IDS
    if resumed and path.is_file():
        try:
            ids = json.loads(path.read_text())
            return {k: v for k, v in ids.items() if isinstance(v, str)}
        except ValueError:
            pass
    return {}


def _save_ids(run_dir: Path, ids: dict[str, str]) -> None:
    (run_dir / IDS).write_text(json.dumps(ids, indent=1))


class TensorBoardSink:
    def __init__(self, writer: Any) -> None:
        self.writer = writer

    def log(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        self.writer.close()


def _tensorboard(folder: Path, resume_step: int | None) -> TensorBoardSink | None:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        print(
            "layershard train: note: tensorboard is not installed, so metrics go to "
            "metrics.jsonl only (pip install 'layershard[tensorboard]')",
            file=sys.stderr,
            flush=True,
        )
        return None
    if resume_step is None and folder.exists():
        shutil.rmtree(folder)  # a fresh run: no events of an earlier one
    # purge_step: events logged after the checkpoint by the interrupted part are dropped
    purge = resume_step + 1 if resume_step is not None else None
    return TensorBoardSink(SummaryWriter(log_dir=str(folder), purge_step=purge))


class WandbSink:
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> None:
        import wandb

        ids.setdefault("wandb", uuid.uuid4().hex[:12])
        self.run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            name=run_dir.name,
            id=ids["wandb"],
            resume="allow",  # the same run when the run folder is resumed
            config=config,
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
        )
        # our step, not W&B's own counter, on the x axis: a resume logs its steps again
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log({"step": step, **values})

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            self.run.summary.update(_numbers(summary))
        self.run.finish()


class MlflowSink:
    def __init__(self, run_dir: Path, config: dict[str, Any], ids: dict[str, str]) -> None:
        import mlflow

        self.mlflow = mlflow
        if "mlflow" in ids:
            mlflow.start_run(run_id=ids["mlflow"])
        else:
            mlflow.set_experiment(os.environ.get("MLFLOW_EXPERIMENT_NAME", PROJECT))
            run = mlflow.start_run(run_name=run_dir.name)
            ids["mlflow"] = run.info.run_id
            params = {k: str(v)[:500] for k, v in _flat(config).items()}
            mlflow.log_params(params)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.mlflow.log_metrics(values, step=step)

    def finish(self, summary: dict[str, Any] | None) -> None:
        if summary:
            self.mlflow.log_metrics({f"summary/{k}": v for k, v in _numbers(summary).items()})
        self.mlflow.end_run("FINISHED" if summary else "KILLED")


def open_sinks(
    run_dir: Path, report_to: Sequence[str], config: dict[str, Any], resume_step: int | None
) -> list[Sink]:
    """Rank 0's sinks for this launch, in ``report_to``'s order, given the run's ``config``
    (config.yaml as recorded); new W&B / MLflow run ids are recorded in the run folder before
    the first record goes out."""
    ids = run_ids(run_dir, resume_step is not None)
    # config.yaml's keys, and what the launch resolved (world size, grad_accum...) beside them
    config = {k: v for k, v in config.items() if k != "_resolved"} | config.get("_resolved", {})
    sinks: list[Sink] = []
    for name in report_to:
        if name == "tensorboard":
            tb = _tensorboard(run_dir / "tensorboard", resume_step)
            if tb is not None:
                sinks.append(tb)
        elif name == "wandb":
            sinks.append(WandbSink(run_dir, config, ids))
        elif name == "mlflow":
            sinks.append(MlflowSink(run_dir, config, ids))
    if ids:
        _save_ids(run_dir, ids)
    return sinks


def record_failure(run_dir: Path, report_to: Sequence[str], message: str) -> None:
    """Tell the run's W&B / MLflow runs how it ended when it did not finish (a failed rank, a
    stop on request, non-finite steps): the launcher's one line, as the run's ``failure``."""
    ids = run_ids(run_dir, resumed=True)
    if "wandb" in report_to and "wandb" in ids:
        import wandb

        run = wandb.init(
            project=os.environ.get("WANDB_PROJECT", PROJECT),
            id=ids["wandb"],
            resume="allow",
            dir=os.environ.get("WANDB_DIR", str(run_dir)),
        )
        run.summary["failure"] = message
        run.finish(exit_code=1)
    if "mlflow" in report_to and "mlflow" in ids:
        from mlflow.tracking import MlflowClient

        client = MlflowClient()
        client.set_tag(ids["mlflow"], "failure", message[:5000])
        client.set_terminated(ids["mlflow"], "FAILED")
