"""One schema validates `layershard train`'s config and launch options and `layershard plan`'s
sizes (layershard/validation.py, train/config.py): property-based cases (hypothesis) for the
schema itself, then every bad input of issue 26 section 4 through the commands: exit code 2, one
line, before anything is written or launched, no run folder left behind."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import yaml
from _train import TINY, refused_one_line, train_main
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from layershard.cli import main as layershard_main
from layershard.train.config import (
    MAX_TIMEOUT_S,
    ConfigError,
    TrainConfig,
    check_launch,
    config_keys,
    field_infos,
    resolve,
)

FIELDS = field_infos(TrainConfig)


def _kind(name: str) -> str:
    text = repr(FIELDS[name].annotation)
    if text == "<class 'int'>":
        return "int"
    if text == "<class 'float'>":
        return "float"
    return "other"


INTS = [n for n in FIELDS if _kind(n) == "int"]
FLOATS = [n for n in FIELDS if _kind(n) == "float"]
CHECKED = settings(
    max_examples=60, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow]
)

# any YAML-like value: what a config file can hold
yaml_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3)
    ),
    max_leaves=6,
)


def _refused(**values) -> str:
    with pytest.raises(ConfigError) as e:
        resolve(values)
    message = str(e.value)
    assert "\n" not in message and message, message
    return message


@CHECKED
@given(key=st.sampled_from(config_keys()), value=yaml_values)
def test_any_value_for_any_key_is_accepted_or_refused_in_one_line(key, value):
    try:
        cfg = resolve({key: value})
    except ConfigError as e:
        assert "\n" not in str(e) and str(e)
        return
    # accepted: it survives the run folder's round trip (config.yaml) unchanged
    assert resolve(yaml.safe_load(yaml.safe_dump(cfg.to_dict()))) == cfg


@CHECKED
@given(key=st.sampled_from(INTS + FLOATS), value=st.sampled_from([math.inf, -math.inf, math.nan]))
def test_non_finite_numbers_are_refused_naming_the_key(key, value):
    assert _refused(**{key: value}).startswith(f"{key} must be ")


@CHECKED
@given(key=st.sampled_from(INTS), value=st.integers(min_value=-(10**6), max_value=10**6))
def test_integers_are_accepted_exactly_within_their_bounds(key, value):
    bound = next((m.ge for m in FIELDS[key].metadata if hasattr(m, "ge")), None)
    low = max(bound, 260) if key == "vocab_size" else bound  # a BPE needs 256 bytes + specials
    if low is None or value >= low:
        assert getattr(resolve({key: value}), key) == value
    else:  # (vocab_size below 260 names the BPE's own floor)
        assert _refused(**{key: value}).startswith(key)


@CHECKED
@given(key=st.sampled_from(INTS), value=st.floats(allow_nan=False) | st.booleans() | st.text())
def test_integers_refuse_other_types(key, value):
    assert _refused(**{key: value}).startswith(f"{key} must be an integer")


@CHECKED
@given(key=st.sampled_from(FLOATS), value=st.booleans() | st.lists(st.integers(), max_size=2))
def test_numbers_refuse_other_types(key, value):
    assert _refused(**{key: value}).startswith(f"{key} must be a number")


@CHECKED
@given(nnodes=st.integers(-3, 64), node_rank=st.integers(0, 70))
def test_node_rank_is_accepted_iff_below_nnodes(nnodes, node_rank):
    given_ = {"nnodes": str(nnodes), "node_rank": node_rank}
    if 1 <= nnodes and node_rank < nnodes:
        check_launch(given_)
    else:
        with pytest.raises(ConfigError, match="^--(nnodes|node-rank) "):
            check_launch(given_)


@CHECKED
@given(timeout=st.floats())
def test_timeout_is_accepted_iff_a_finite_positive_number_of_seconds(timeout):
    if math.isfinite(timeout) and 0 < timeout <= MAX_TIMEOUT_S:
        check_launch({"timeout": timeout})
    else:
        with pytest.raises(ConfigError, match="^--timeout must be a number of seconds"):
            check_launch({"timeout": timeout})


@CHECKED
@given(name=st.text(min_size=1, max_size=12))
def test_a_run_name_never_leaves_runs(name):
    try:
        cfg = resolve({"name": name})
    except ConfigError:
        return
    folder = (Path("runs") / str(cfg.name)).resolve()
    assert folder.parent == Path("runs").resolve()


# --- every bad input of issue 26 section 4, through the commands ------------------------------


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))


def test_yaml_inf_and_nan_are_refused(tmp_path, capsys):
    y = tmp_path / "run.yaml"
    for text, expected in (
        ("steps: .inf\n", "steps must be an integer, got inf"),
        ("eval_interval: .nan\n", "eval_interval must be an integer, got nan"),
        ("warmup_steps: -.inf\n", "warmup_steps must be an integer, got -inf"),
        ("model_overrides: {norm_eps: .nan}\n", "norm_eps must be a finite number"),
    ):
        y.write_text(text)
        assert expected in refused_one_line(capsys, tmp_path, *TINY, "--config", str(y)), text


def test_timeout_inf_is_refused(tmp_path, capsys):
    err = refused_one_line(capsys, tmp_path, *TINY, "--timeout", "inf")
    assert "--timeout must be a number of seconds" in err and "got inf" in err


def test_empty_data_path_is_refused(tmp_path, capsys):
    assert "data has an empty entry" in refused_one_line(capsys, tmp_path, *TINY, "--data", "")


def test_run_name_outside_runs_is_refused(tmp_path, capsys, monkeypatch):
    work = tmp_path / "a" / "b"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    assert train_main([*TINY, "--name", "../../x"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "name '../../x' must be a folder name" in err, err
    assert not (tmp_path / "x").exists() and not (work / "runs").exists()


def test_run_folder_under_a_regular_file_is_refused(tmp_path, capsys):
    blocker = tmp_path / "notes.txt"
    blocker.write_text("a file")
    assert train_main([*TINY, "--run-dir", str(blocker / "run")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"{blocker} is a file, not a folder" in err, err
    assert blocker.read_text() == "a file"


def test_node_rank_and_nnodes_are_refused(tmp_path, capsys):
    err = refused_one_line(capsys, tmp_path, *TINY, "--nnodes", "2", "--node-rank", "2")
    assert "--node-rank 2 must be below --nnodes 2" in err
    assert "--nnodes must be a number of nodes >= 1" in refused_one_line(
        capsys, tmp_path, *TINY, "--nnodes", "0"
    )


def test_model_vocabulary_smaller_than_the_tokenizers_is_refused(tmp_path, capsys):
    err = refused_one_line(capsys, tmp_path, *TINY, "--model-override", "vocab_size=300")
    assert "the model's vocabulary (300 tokens) is smaller than the tokenizer's (512)" in err


def test_sft_with_every_prompt_longer_than_seq_len_is_refused(tmp_path, capsys):
    chat = tmp_path / "chat.jsonl"
    words = " ".join(f"word{i}" for i in range(200))  # ~400+ tokens of prompt, seq_len 64
    rows = [{"prompt": f"{i} {words}", "response": f"answer {i}"} for i in range(40)]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    err = refused_one_line(
        capsys, tmp_path, *TINY, "--task", "sft", "--data", str(chat), "--sft-packing", "pad"
    )
    assert "--task sft: no response token falls within the first 64 tokens" in err


@pytest.mark.parametrize(
    "flags, expected",
    [
        (["--micro-batch", "0"], "--micro-batch must be at least 1, got 0"),
        (["--seq-len", "-5"], "--seq-len must be at least 1, got -5"),
        (["--grad-accum", "0"], "--grad-accum must be at least 1, got 0"),
        (["--gpu-memory", "0"], "--gpu-memory must be greater than 0, got 0.0"),
        (["--tflops", "-1"], "--tflops must be greater than 0, got -1.0"),
        (["--inter-bw", "0"], "--inter-bw must be greater than 0"),
        (["--compute-eff", "0"], "--compute-eff must be in (0, 1], got 0.0"),
        (["--headroom", "1.5"], "--headroom must be in [0, 1), got 1.5"),
        (["--latency-us", "-1"], "--latency-us must be a number of microseconds >= 0"),
    ],
)
def test_plan_refuses_zero_and_negative_sizes(capsys, flags, expected):
    assert layershard_main(["plan", "--model", "tiny", "--gpus", "2", *flags]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"layershard plan: error: {expected}" or ("\n" not in err and expected in err), (
        err
    )


def test_export_refuses_a_zero_shard_size(tmp_path, capsys):
    out = tmp_path / "out"
    rc = layershard_main(
        ["checkpoint", "export", str(tmp_path / "ckpt"), str(out), "--max-shard-size", "0"]
    )
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "\n" not in err and "--max-shard-size must be at least 1 byte" in err, err
    assert not out.exists()


# ---- issue 35 §3-4: options checked where they are given; a hostile config.yaml --------------


def test_an_unknown_compile_backend_is_refused_before_launch(tmp_path, capsys):
    """`compile: {backend: no_such_backend}` passed the checks; both ranks then failed with
    tracebacks and left a run folder that needed --overwrite. The backend (and torch.compile's
    own option names) are now checked with the config, before anything starts."""
    message = _refused(compile={"backend": "no_such_backend"})
    assert message.startswith("compile: backend 'no_such_backend' is not a torch.compile "
                              "backend; use one of "), message  # fmt: skip
    assert "aot_eager" in message
    assert "unknown torch.compile option 'bakend'" in _refused(compile={"bakend": "eager"})
    assert resolve({"compile": {"backend": "aot_eager", "dynamic": False}}).compile
    y = tmp_path / "run.yaml"
    y.write_text("compile: {backend: no_such_backend}\n")
    err = refused_one_line(capsys, tmp_path, *TINY, "--config", str(y), "--dry-run")
    assert "compile: backend 'no_such_backend' is not a torch.compile backend" in err


def test_a_loss_scale_without_fp16_is_refused(tmp_path, capsys):
    """`--loss-scale 1024` without fp16 was accepted and recorded, and did nothing."""
    err = refused_one_line(capsys, tmp_path, *TINY, "--loss-scale", "1024", "--dry-run")
    assert "loss_scale 1024 is fp16's initial loss scale, but this run computes in auto" in err
    assert "leave out --loss-scale, or pass --precision fp16" in err
    assert resolve({"precision": "fp16", "loss_scale": 1024}).loss_scale == 1024


def test_a_plan_record_is_validated_on_read_and_never_fails_a_finished_run(tmp_path, capsys):
    """A `plan --write-config` file whose predicted step_s was edited to 0 trained to the end,
    then crashed with ZeroDivisionError (exit 1). The plan: block is now checked with the
    config, and the closing comparison leaves out a record it cannot use."""
    from layershard.plan.calibrate import against_plan

    summary = {"step_time_s_median": 0.2, "mem_mib_max": 5.0, "mem_kind": "peak"}
    for bad in (0, -1.0, math.nan, "1", True):  # a summary.json written before the check
        assert against_plan({**summary, "plan": {"step_s": bad, "peak_bytes": 0}}) == ""
    assert against_plan({**summary, "plan": {"step_s": 0.1, "peak_bytes": 0}}) == (
        "plan predicted 0.1 s/step, measured 0.2 s (2x)"
    )
    y = tmp_path / "run.yaml"
    y.write_text("plan: {gpus: 2, gpu: H100, step_s: 0, peak_bytes: 1000}\n")
    err = refused_one_line(capsys, tmp_path, *TINY, "--config", str(y), "--dry-run")
    assert "plan: step_s must be a number greater than 0, got 0" in err
    assert "write it again, or remove the block" in err
    assert _refused(plan={"step_s": "fast"}).startswith("plan: step_s must be a number")
    assert resolve({"plan": {"step_s": 0.5, "gpus": 2, "gpu": "H100"}}).plan


def test_a_python_tagged_config_yaml_on_resume_is_one_line_and_never_run(tmp_path, capsys):
    """A run folder's config.yaml with a python tag: --resume printed a traceback (nothing ran).
    Now one line, exit 2, and the tag's command is never run."""
    run, marker = tmp_path / "run", tmp_path / "ran"
    run.mkdir()
    (run / "config.yaml").write_text(f"!!python/object/apply:os.system ['touch {marker}']\n")
    before = sorted(p.name for p in run.iterdir())
    assert train_main(["--resume", "--run-dir", str(run), *TINY]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("layershard train: error: "), err
    assert (
        f"{run / 'config.yaml'} is not a run config layershard wrote: it is not plain YAML" in err
    )
    assert not marker.exists()
    assert sorted(p.name for p in run.iterdir()) == before
    (run / "config.yaml").write_text("- a list\n- not a mapping\n")
    assert train_main(["--resume", "--run-dir", str(run), *TINY]) == 2
    assert "must hold a mapping" in capsys.readouterr().err
