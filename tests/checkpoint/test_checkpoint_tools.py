"""Checkpoint tools against hostile input (issue 26 §3): ``checkpoint export`` never destroys the
folder it writes to, storage paths never leave the checkpoint folder and every file read is a
hashed one, and ``checkpoint info`` runs the validation that resume and export run (a missing
rank file, a 2 TB tensor, wrong JSON types: one line, exit 1, no traceback)."""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks

import layershard as ls
from layershard.checkpoint import CheckpointError, checkpoint_info, export_checkpoint
from layershard.checkpoint import publish as pub
from layershard.cli import main
from layershard.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)


def _model(seed: int) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**TINY))


def _save(rank: int, world: int, root: str) -> None:
    """Two runs' checkpoints (different weights), one step of AdamW each, at world size 2."""
    for name, seed in (("run_a", 0), ("run_b", 1)):
        model = ls.shard(_model(seed))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        x = torch.randint(
            0, TINY["vocab_size"], (2, 8), generator=torch.Generator().manual_seed(rank)
        )
        model(x, labels=x).loss.backward()
        opt.step()
        ls.save_checkpoint(Path(root) / name / "step_000001", model, opt, step=1)
    dist.barrier()


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ckpt_tools")
    run_ranks(_save, 2, str(root))
    return root


def _copy(saved: Path, tmp_path: Path, name: str = "ck") -> Path:
    d = tmp_path / name
    shutil.copytree(saved / "run_a" / "step_000001", d)
    return d


def _manifest(d: Path) -> dict:
    return json.loads((d / pub.MANIFEST).read_text())


def _write_manifest(d: Path, m: dict) -> None:
    (d / pub.MANIFEST).write_text(json.dumps(m))


def _retag(d: Path, name: str) -> None:
    m = _manifest(d)
    size, sha = pub.file_digest(d / name)
    m["files"][name] = {"bytes": size, "sha256": sha}
    _write_manifest(d, m)


def _rewrite_metadata(d: Path, edit) -> None:
    """Edit DCP's metadata (plain pickle of DCP's classes) and record its new hash, as an
    attacker (or a careless tool) would."""
    with open(d / ".metadata", "rb") as f:
        md = pickle.load(f)
    edit(md)
    with open(d / ".metadata", "wb") as f:
        pickle.dump(md, f)
    _retag(d, ".metadata")


def _one_line_failure(capsys, argv: list[str]) -> str:
    """Run the CLI; it must exit 1 with one line of error and no traceback."""
    assert main(argv) == 1
    cap = capsys.readouterr()
    text = cap.out + cap.err
    assert "Traceback" not in text, text
    if argv[1] == "info":
        failed = [line for line in cap.out.splitlines() if "FAILED" in line]
        assert len(failed) == 1, cap.out
        return failed[0]
    assert cap.err.count("\n") == 1, cap.err
    return cap.err


# ---- export never destroys -----------------------------------------------------------------------


def _existing_model(out: Path) -> dict[str, bytes]:
    out.mkdir()
    (out / "model-00001-of-00001.safetensors").write_bytes(b"the user's weights")
    (out / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (out / "config.json").write_text("{}")
    (out / "tokenizer.json").write_text("{}")  # not ours: kept by a successful export too
    return {p.name: p.read_bytes() for p in out.iterdir()}


def test_failed_export_leaves_the_existing_folder_intact(saved, tmp_path, monkeypatch):
    import layershard.checkpoint.hf as hf

    out = tmp_path / "hf"
    before = _existing_model(out)
    calls = []
    real = hf.dcp_load

    def fail_second(*args, **kwargs):  # dies mid-way: one batch of tensors already written
        calls.append(1)
        if len(calls) == 2:
            raise OSError("disk went away")
        return real(*args, **kwargs)

    monkeypatch.setattr(hf, "dcp_load", fail_second)
    with pytest.raises(OSError):
        export_checkpoint(saved / "run_a", out, torch.float32, max_shard_size="20KB")
    assert len(calls) == 2
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]  # no temporary folder left

    monkeypatch.setattr(hf, "dcp_load", real)
    export_checkpoint(saved / "run_a", out, torch.float32, max_shard_size="20KB")
    names = sorted(p.name for p in out.iterdir())
    assert "tokenizer.json" in names and (out / "tokenizer.json").read_text() == "{}"
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 1 and sorted(n for n in names if n.endswith(".safetensors")) == shards
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf"]


def test_info_says_when_latest_names_no_checkpoint(saved, tmp_path, capsys):
    """A dangling ``latest`` (its checkpoint deleted): resume falls back to the newest complete
    one, and ``info`` of that one says so instead of a bare "integrity ok"."""
    run = tmp_path / "checkpoints"
    shutil.copytree(saved / "run_a", run)
    (run / pub.LATEST).write_text("step_000999")
    assert main(["checkpoint", "info", str(run / "step_000001")]) == 0
    out = capsys.readouterr().out
    assert (
        f"latest       BROKEN: {run}/latest points to 'step_000999', which does not exist "
        "(--resume takes the newest complete one, step_000001)" in out
    ), out
    assert "integrity    ok" in out
    assert "step_000999" in checkpoint_info(run / "step_000001")["latest_error"]
    assert "latest_error" not in checkpoint_info(saved / "run_a" / "step_000001")


def test_export_over_a_file_size_limit_is_one_line_and_leaves_nothing(saved, tmp_path):
    """A write the OS refuses (here ``ulimit -f``; a full disk alike) inside safetensors: one
    line naming the cause and the fix, exit 1, no traceback, no folder or temporary left."""
    import resource
    import subprocess
    import sys

    out = tmp_path / "hf"
    limit = 16 * 1024  # bytes: less than one shard

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))

    cmd = [
        sys.executable,
        "-m",
        "layershard",
        "checkpoint",
        "export",
        str(saved / "run_a"),
        str(out),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True, preexec_fn=limited, timeout=120)
    assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.count("\n") == 1, r.stderr
    assert "File too large" in r.stderr and "raise the file-size limit (ulimit -f)" in r.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == []


def test_export_refuses_a_file_as_output(saved, tmp_path, capsys):
    out = tmp_path / "hf"
    out.write_text("not a folder")
    line = _one_line_failure(capsys, ["checkpoint", "export", str(saved / "run_a"), str(out)])
    assert "not a folder" in line
    assert out.read_text() == "not a folder"


# ---- storage paths stay inside the folder; what is read is hashed ---------------------------------


def _point_outside(saved: Path, tmp_path: Path) -> Path:
    """A checkpoint whose rank-0 file is gone and whose metadata reads it from another run."""
    d = _copy(saved, tmp_path, "victim")
    other = saved / "run_b" / "step_000001"
    rel = os.path.relpath(other / "__0_0.distcp", d)
    (d / "__0_0.distcp").unlink()
    m = _manifest(d)
    del m["files"]["__0_0.distcp"]
    _write_manifest(d, m)

    def edit(md):
        for info in md.storage_data.values():
            if info.relative_path == "__0_0.distcp":
                info.relative_path = rel

    _rewrite_metadata(d, edit)
    return d


def test_storage_path_outside_the_folder_is_refused(saved, tmp_path, capsys):
    d = _point_outside(saved, tmp_path)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "outside" in line and "__0_0.distcp" in line, line
    out = tmp_path / "hf"
    line = _one_line_failure(capsys, ["checkpoint", "export", str(d), str(out)])
    assert "outside" in line, line
    assert not out.exists()


def test_symlinked_file_is_refused(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    (d / "__1_0.distcp").unlink()
    (d / "__1_0.distcp").symlink_to(saved / "run_b" / "step_000001" / "__1_0.distcp")
    _retag(d, "__1_0.distcp")
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "symbolic link" in line and "__1_0.distcp" in line, line
    _one_line_failure(capsys, ["checkpoint", "export", str(d), str(tmp_path / "hf")])


def test_symlinked_manifest_is_refused(saved, tmp_path, capsys):
    """The manifest follows the rule of every other file (issue 35): a ``layershard.json`` that
    links to a file outside the folder was read and the checkpoint reported "integrity ok"."""
    d = _copy(saved, tmp_path)
    elsewhere = tmp_path / "elsewhere.json"
    shutil.copy(d / pub.MANIFEST, elsewhere)
    (d / pub.MANIFEST).unlink()
    (d / pub.MANIFEST).symlink_to(elsewhere)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "symbolic link" in line and pub.MANIFEST in line, line
    _one_line_failure(capsys, ["checkpoint", "export", str(d), str(tmp_path / "hf")])
    assert not (tmp_path / "hf").exists()


def test_unhashed_file_is_refused(saved, tmp_path, capsys):
    """A file the metadata reads but the manifest does not list (so no hash covers it)."""
    d = _copy(saved, tmp_path)
    os.rename(d / "__1_0.distcp", d / "extra.distcp")
    m = _manifest(d)
    m["files"]["extra.distcp"] = m["files"].pop("__1_0.distcp")
    _write_manifest(d, m)
    os.rename(d / "extra.distcp", d / "__1_0.distcp")  # on disk, but no longer listed
    m = _manifest(d)
    del m["files"]["extra.distcp"]
    _write_manifest(d, m)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "__1_0.distcp" in line and "not list" in line, line


# ---- info validates what resume and export validate ------------------------------------------------


def test_missing_rank_file(saved, tmp_path, capsys):
    d = _copy(saved, tmp_path)
    (d / "__1_0.distcp").unlink()
    m = _manifest(d)
    del m["files"]["__1_0.distcp"]
    _write_manifest(d, m)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "__1_0.distcp" in line, line
    assert not checkpoint_info(d, verify=False)["ok"]  # what --resume checks before launch


def test_absurd_tensor_size(saved, tmp_path, capsys):
    """A parameter declared as 2 TB (manifest and metadata agree; hashes re-recorded)."""
    d = _copy(saved, tmp_path)
    name = "norm.weight"
    huge = 500_000_000_000  # fp32: 2 TB
    m = _manifest(d)
    m["model"]["params"][name]["shape"] = [huge]
    _write_manifest(d, m)

    def edit(md):
        item = md.state_dict_metadata[f"model/{name}"]
        item.size = torch.Size([huge])
        last = max(item.chunks, key=lambda c: c.offsets[0])
        last.sizes = torch.Size([huge - last.offsets[0]])

    _rewrite_metadata(d, edit)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert f"model/{name}" in line and "bytes" in line, line
    line = _one_line_failure(capsys, ["checkpoint", "export", str(d), str(tmp_path / "hf")])
    assert f"model/{name}" in line, line


_BAD_MANIFESTS = {
    "files_list": lambda m: m.update(files=list(m["files"])),
    "bytes_str": lambda m: m["files"][".metadata"].update(bytes="12"),
    "sha_int": lambda m: m["files"][".metadata"].update(sha256=12),
    "file_rec_null": lambda m: m["files"].update({".metadata": None}),
    "file_name_path": lambda m: m["files"].update({"../x": m["files"][".metadata"]}),
    "params_list": lambda m: m["model"].update(params=[]),
    "shape_str": lambda m: m["model"]["params"]["norm.weight"].update(shape="32"),
    "shape_negative": lambda m: m["model"]["params"]["norm.weight"].update(shape=[-32]),
    "shape_bool": lambda m: m["model"]["params"]["norm.weight"].update(shape=[True]),
    "dtype_int": lambda m: m["model"]["buffers"].update({"x": {"shape": [1], "dtype": 7}}),
    "model_null": lambda m: m.update(model=None),
    "step_str": lambda m: m.update(step="3"),
    "world_zero": lambda m: m.update(world_size=0),
    "optimizer_list": lambda m: m.update(optimizer=[]),
    "state_str": lambda m: m["optimizer"].update(state="x"),
    "groups_dict": lambda m: m["optimizer"].update(param_groups={}),
    "rng_keys_str": lambda m: m["rng"].update(keys="torch"),
}


@pytest.mark.parametrize("case", sorted(_BAD_MANIFESTS))
def test_wrong_json_types(saved, tmp_path, capsys, case):
    d = _copy(saved, tmp_path)
    m = _manifest(d)
    _BAD_MANIFESTS[case](m)
    _write_manifest(d, m)
    line = _one_line_failure(capsys, ["checkpoint", "info", str(d)])
    assert "layershard.json" in line, line
    _one_line_failure(capsys, ["checkpoint", "export", str(d), str(tmp_path / "hf")])
    assert not checkpoint_info(d, verify=False)["ok"]


def test_loader_runs_the_same_validation(saved, tmp_path):
    outside = _point_outside(saved, tmp_path)
    missing = _copy(saved, tmp_path, "missing")
    (missing / "__1_0.distcp").unlink()
    m = _manifest(missing)
    del m["files"]["__1_0.distcp"]
    _write_manifest(missing, m)
    wrong = _copy(saved, tmp_path, "wrong")
    m = _manifest(wrong)
    m["optimizer"]["state"] = "x"
    _write_manifest(wrong, m)
    from layershard.checkpoint.load import _check_on_rank0

    # what load_checkpoint's rank 0 runs (and agrees on with the others) before any data moves;
    # it refuses here before it looks at the model, so none is needed
    for folder in (outside, missing, wrong):
        with pytest.raises(CheckpointError) as caught:
            _check_on_rank0(folder, None, None, strict=True, verify=True)
        assert "\n" not in str(caught.value), str(caught.value)
