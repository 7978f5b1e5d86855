"""A run keeps its identity across `--resume` (issue 26 §2): a changed corpus (a file edited, a
relative --data that resolves elsewhere) and a changed model are refused before launch in one
line, and a refused config is never written; `--allow-data-change` continues on the new data with
the run's own tokenizer; a `latest` naming a deleted checkpoint is said, not skipped silently.
One real 2-step run (2 gloo ranks) is made once; every other launch here stops before the ranks,
except the one that continues on changed data."""

from __future__ import annotations

import json
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import yaml
from _train import train_main

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

TINY = [
    "--nproc-per-node", "2", "--val-fraction", "0.2", "--vocab-size", "300", "--seq-len", "32",
    "--micro-batch", "2", "--model-override", "dim=32", "--model-override", "n_layers=2",
    "--model-override", "ffn_dim=64", "--eval-sequences", "4", "--sample-tokens", "4",
    "--eval-interval", "0",
]  # fmt: skip


def _corpus(folder: Path, n: int = 12, offset: int = 0) -> None:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[offset : offset + n]
    folder.mkdir()
    for f in files:
        shutil.copy(f, folder / f.name)


@pytest.fixture(scope="module")
def made(tmp_path_factory) -> Path:
    """A finished 2-step run whose --data was given as the relative path `data`."""
    root = tmp_path_factory.mktemp("identity")
    _corpus(root / "data")
    mp = pytest.MonkeyPatch()
    mp.setenv("LAYERSHARD_CACHE", str(root / "cache"))
    mp.chdir(root)
    try:
        argv = [*TINY, "--data", "data", "--steps", "2", "--checkpoint-interval", "1"]
        assert train_main([*argv, "--run-dir", "run"]) == 0
    finally:
        mp.undo()
    return root


@pytest.fixture
def root(made, tmp_path, monkeypatch) -> Path:
    """A copy of the made run (and its data) for one test, the cache shared."""
    monkeypatch.setenv("LAYERSHARD_CACHE", str(made / "cache"))
    r = tmp_path / "r"
    r.mkdir()
    shutil.copytree(made / "data", r / "data", copy_function=shutil.copy2)
    shutil.copytree(made / "run", r / "run")
    cfg = yaml.safe_load((r / "run" / "config.yaml").read_text())
    # the copy's config names the copy's data (as the made run names its own), as recorded
    data = cfg["data"][0]
    cfg["data"] = [str(r / "data") if Path(data).is_absolute() else data]
    (r / "run" / "config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    launch = json.loads((r / "run" / "launch.json").read_text())
    for s in launch["data"]["sources"]:
        s["path"] = str(r / "data" / Path(s["path"]).name)
    (r / "run" / "launch.json").write_text(json.dumps(launch))
    monkeypatch.chdir(r)
    return r


def _refused(capsys, argv: list[str]) -> str:
    assert train_main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("layershard train: error: "), err
    return err


def _files(run: Path) -> dict[str, bytes]:
    return {n: (run / n).read_bytes() for n in ("config.yaml", "launch.json", "tokenizer.json")}


def test_paths_are_recorded_absolute(made):
    cfg = yaml.safe_load((made / "run" / "config.yaml").read_text())
    assert cfg["data"] == [str(made / "data")]


def test_relative_data_that_resolves_elsewhere_is_refused(root, tmp_path, monkeypatch, capsys):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    _corpus(elsewhere / "data", offset=20)  # another `data` folder, another corpus
    monkeypatch.chdir(elsewhere)
    before = _files(root / "run")
    run = str(root / "run")
    err = _refused(capsys, ["--resume", "--run-dir", run, "--steps", "4", "--data", "data"])
    assert "corpus changed" in err and "resolves elsewhere" in err and "--allow-data-change" in err
    assert _files(root / "run") == before
    # without --data the run reads its own (absolute) corpus from any folder
    assert train_main(["--resume", "--run-dir", run, "--steps", "4", "--dry-run"]) == 0


def test_edited_file_is_refused_then_allowed_with_the_runs_tokenizer(root, capsys):
    run = root / "run"
    edited = sorted((root / "data").iterdir())[3]
    edited.write_text(edited.read_text() + "\n# one more line, in a file of the corpus\n")
    before = _files(run)
    err = _refused(capsys, ["--resume", "--run-dir", str(run), "--steps", "3"])
    assert f"{edited} changed" in err and "--allow-data-change" in err, err
    assert _files(run) == before
    assert (
        train_main(["--resume", "--run-dir", str(run), "--steps", "3", "--allow-data-change"]) == 0
    )
    out = capsys.readouterr()
    assert "continuing on the new data with the run's own tokenizer" in out.err
    assert "trained a" not in out.out  # no new BPE
    assert (run / "tokenizer.json").read_bytes() == before["tokenizer.json"]
    steps = [
        json.loads(line).get("step") for line in (run / "metrics.jsonl").read_text().splitlines()
    ]
    assert 3 in steps
    # the run now records the new corpus: a plain resume accepts it
    assert train_main(["--resume", "--run-dir", str(run), "--steps", "4", "--dry-run"]) == 0


def test_allow_data_change_needs_resume(root, capsys):
    err = _refused(capsys, ["--run-dir", str(root / "new"), "--allow-data-change", *TINY])
    assert "--allow-data-change goes with --resume" in err


def test_changed_model_is_refused_before_launch_and_never_written(root, capsys):
    run = root / "run"
    before = _files(run)
    metrics = (run / "metrics.jsonl").read_bytes()
    argv = ["--resume", "--run-dir", str(run), "--steps", "4"]
    err = _refused(capsys, [*argv, "--model-override", "n_layers=3"])
    assert "model differs" in err and "n_layers 2 -> 3" in err, err
    assert _files(run) == before and (run / "metrics.jsonl").read_bytes() == metrics
    err = _refused(capsys, [*argv, "--vocab-size", "512"])
    assert "vocab-size" in err, err
    assert train_main([*argv, "--dry-run"]) == 0  # a plain resume still works


def test_latest_naming_a_deleted_checkpoint_is_said(root, capsys):
    ckpts = root / "run" / "checkpoints"
    assert (ckpts / "latest").read_text().strip() == "step_000002"
    shutil.rmtree(ckpts / "step_000002")
    assert (
        train_main(["--resume", "--run-dir", str(root / "run"), "--steps", "4", "--dry-run"]) == 0
    )
    out = capsys.readouterr().out
    lines = [line for line in out.splitlines() if "resuming from" in line]
    assert len(lines) == 1, out
    assert (
        "step_000001" in lines[0] and "latest names step_000002, which does not exist" in lines[0]
    )


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-q"]))
