"""`layershard train` drives the engine's options: each strategy, hpZ with CPU offload, expert
parallelism (the built-in MoE with --ep 2), tensor parallelism (--tp 2: one TP group, its
checkpoint and export written), both (the MoE at --tp 2 --ep 2), and fp16
(with ls.GradScaler) train 20 steps through the CLI on 2 gloo ranks, and each run's losses equal
those of the same run written against the Python API (`ls.shard` with the options spelled out
here, the same data order and recipe). A checkpoint of one strategy resumes under another; the
TensorBoard event files hold the numbers of metrics.jsonl; `layershard plan --write-config`
gives a YAML that `layershard train --config` runs as written.

All CLI runs are made once (a module fixture, ~1 launch each) and the API references of all of
them in one 2-rank spawn.
"""

from __future__ import annotations

import contextlib
import json
import math
from pathlib import Path

import pytest
import torch
import yaml
from _dist import run_ranks
from _train import train_main

from layershard.cli import main as layershard_main
from layershard.train.loop.report import read_metrics

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

STEPS = 20
# A 2-layer, 64-wide Llama on 40 corpus files (as tests/train/test_train_cli.py), evaluated twice.
TINY = [
    "--nproc-per-node", "2", "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512",
    "--seq-len", "64", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "3",
    "--eval-interval", "10", "--eval-sequences", "16", "--sample-tokens", "4",
    "--steps", str(STEPS),
]  # fmt: skip
SMALL = ["--model-override", "dim=64", "--model-override", "n_layers=2",
         "--model-override", "ffn_dim=128"]  # fmt: skip

MOE = ("n_experts=4", "moe_ffn_dim=64", "n_heads=4")  # the moe preset, small
# name -> (CLI flags, the same run's ls.shard options and precision, spelled out by hand)
RUNS: dict[str, tuple[list[str], dict, str]] = {
    "grad_op": (["--strategy", "grad_op"], {"strategy": "grad_op"}, "fp32"),
    "no_shard": (["--strategy", "no_shard"], {"strategy": "no_shard"}, "fp32"),
    "hybrid": (
        ["--strategy", "hybrid", "--shard-size", "1"],
        {"strategy": "hybrid", "shard_size": 1},
        "fp32",
    ),
    "hpz_offload": (
        ["--reshard-after-forward", "1", "--offload"],
        {"strategy": "full", "reshard_after_forward": 1, "offload": "cpu"},
        "fp32",
    ),
    # the built-in MoE (4 experts, top-2), each layer's experts split over the 2 ranks
    "ep": (
        ["--model", "moe", "--ep", "2", *(f"--model-override={o}" for o in MOE)],
        {"strategy": "full", "ep": 2},
        "fp32",
    ),
    # the Llama's blocks split over the 2 ranks (TP 2 x dp_shard 1): both read the same batches;
    # stopped at step 10 on an asynchronous checkpoint and resumed from it (RESUMED)
    "tp": (
        ["--tp", "2", "--async-checkpoint", "--checkpoint-interval", "5"],
        {"strategy": "full", "tp": 2},
        "fp32",
    ),
    # the built-in MoE's attention over TP 2 and its experts over EP 2 (the same 2 ranks)
    "tp_ep": (
        ["--model", "moe", "--tp", "2", "--ep", "2", *(f"--model-override={o}" for o in MOE)],
        {"strategy": "full", "tp": 2, "ep": 2},
        "fp32",
    ),
    # a first loss scale of 2**20 overflows in the first steps here: the scaler skips some
    "fp16": (["--precision", "fp16", "--loss-scale", "1048576"], {"strategy": "full"}, "fp16"),
}

RESUMED = ("tp",)  # runs stopped at step 10 and resumed: their losses are the API's all the same

# What the CLI reaches against its Python-API twin. Both run the same engine with the same
# options, data and recipe; measured: 0.0 (bitwise equal losses) for every run, fp16 included.
LOSS_TOL = 1e-6
# A checkpoint of `full` resumed under `grad_op` against an uninterrupted `grad_op` run: the two
# strategies reduce the same gradients over the same group; measured 0.0 (bitwise) on gloo.
RESUME_TOL = 1e-6


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("strategies")
    out: dict[str, Path] = {}
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))
        mp.setenv("LAYERSHARD_PEAK_TFLOPS", "1")  # a known peak: MFU is logged
        for name, (flags, _, _) in RUNS.items():
            out[name] = root / name
            argv = [*TINY, *SMALL, *flags, "--run-dir", str(out[name])]
            if name in RESUMED:
                assert train_main([*argv, "--stop-at-step", "10"]) == 0, name
                argv.append("--resume")
            assert train_main(argv) == 0, name
        # `full`, stopped at step 10, resumed under another strategy
        out["full"] = root / "full"
        argv = [*TINY, *SMALL, "--run-dir", str(out["full"])]
        assert train_main([*argv, "--stop-at-step", "10"]) == 0
        assert train_main([*argv, "--resume", "--strategy", "grad_op"]) == 0
        # plan -> write-config -> train
        plan_yaml = root / "plan.yaml"
        assert (
            layershard_main(
                [
                    "plan",
                    "--model",
                    "tiny",
                    "--gpus",
                    "2",
                    "--gpus-per-node",
                    "2",
                    "--seq-len",
                    "64",
                    "--micro-batch",
                    "4",
                    "--grad-accum",
                    "2",
                    "--param-dtype",
                    "fp32",
                    "--write-config",
                    str(plan_yaml),
                ]
            )  # fmt: skip
            == 0
        )
        out["plan"] = root / "planned"
        data = TINY[2:8] + ["--steps", str(STEPS), "--eval-interval", "10", "--sample-tokens", "4"]
        assert train_main(["--config", str(plan_yaml), *data, "--run-dir", str(out["plan"])]) == 0
        out["plan_yaml"] = plan_yaml
        # the API references, all in one spawn
        cases = [(name, str(out[name]), RUNS[name][1], RUNS[name][2]) for name in RUNS]
        cases.append(("full", str(out["full"]), {"strategy": "full"}, "fp32"))
        planned = yaml.safe_load(plan_yaml.read_text())
        kw = {k: planned[k] for k in ("strategy", "shard_size", "reshard_after_forward")
              if k in planned}  # fmt: skip
        if planned.get("offload"):
            kw["offload"] = "cpu"
        cases.append(("plan", str(out["plan"]), kw, planned["precision"]))
        run_ranks(_api_runs, 2, cases, str(root / "api.json"))
        out["api"] = root / "api.json"
    return out


def _api_runs(rank: int, world: int, cases: list, out_path: str) -> None:
    """Each run again through the Python API: ls.shard with the given options, AdamW, the run's
    data order (BatchLoader over the run's token file), warmup/cosine schedule, clipping."""
    import torch.distributed as dist

    import layershard as ls
    from layershard.train.config import read_run_config
    from layershard.train.data.batches import BatchLoader, TokenSplit
    from layershard.train.data.tokenizer import load_tokenizer
    from layershard.train.loop.optimizer import lr_at, param_groups
    from layershard.train.modeling import build_model, model_spec

    results = {}
    for name, run_dir, options, precision in cases:
        run = Path(run_dir)
        cfg = read_run_config(run / "config.yaml")
        data = json.loads((run / "launch.json").read_text())["data"]
        vocab = load_tokenizer(run / "tokenizer.json").vocab_size
        kind, spec, _ = model_spec(cfg, vocab)
        kwargs = dict(options)
        if kwargs.pop("offload", None):
            kwargs["offload"] = ls.CPUOffload()
        if precision == "fp16":
            kwargs["mixed_precision"] = ls.MixedPrecision(param_dtype=torch.float16)
        ep, tp = kwargs.pop("ep", 1), kwargs.pop("tp", 1)
        if ep > 1 or tp > 1:  # experts split over ep ranks / blocks over tp ranks, then sharded
            model = ls.parallelize(build_model(kind, spec, cfg), ep=ep, tp=tp, **kwargs)
        else:
            model = ls.shard(build_model(kind, spec, cfg), **kwargs)
        opt = torch.optim.AdamW(
            param_groups(model.named_parameters(), cfg), lr=cfg.lr,
            betas=(cfg.beta1, cfg.beta2), eps=1e-8,
        )  # fmt: skip
        scaler = ls.GradScaler(init_scale=cfg.loss_scale) if precision == "fp16" else None
        ga = cfg.grad_accum or 1
        loader = BatchLoader(  # a TP group's ranks read the same batches
            TokenSplit.from_dict(data["train"]), cfg.seq_len, cfg.micro_batch, ga, rank // tp,
            world // tp, cfg.seed,
        )  # fmt: skip
        losses = []
        for step in range(cfg.steps):
            for g in opt.param_groups:
                g["lr"] = lr_at(step, cfg)
            total = torch.zeros((), dtype=torch.float64)
            micro = loader.next_step()
            for i, (x, y) in enumerate(micro):
                sync = i == len(micro) - 1
                with contextlib.nullcontext() if sync else model.no_sync():
                    loss = model(x, labels=y).loss
                    scaled = loss / ga
                    (scaler.scale(scaled) if scaler else scaled).backward()
                total += loss.detach().double()
            if scaler:
                scaler.unscale_(opt)
            model.clip_grad_norm_(cfg.grad_clip)
            if scaler:
                scaler.step(opt)
                scaler.update()
            else:
                opt.step()
            opt.zero_grad(set_to_none=True)
            dist.all_reduce(total)
            losses.append(float(total) / (ga * world))
        results[name] = losses
    if rank == 0:
        Path(out_path).write_text(json.dumps(results))


def _losses(run: Path, key: str = "loss") -> dict[int, float]:
    return {r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r}


@pytest.mark.parametrize("name", [*RUNS, "full", "plan"])
def test_cli_run_equals_the_python_api_run(runs, name):
    api = json.loads(runs["api"].read_text())[name]
    cli = _losses(runs[name])
    steps = range(1, 11) if name == "full" else range(1, STEPS + 1)  # full: its first part
    worst = max(abs(cli[s] - api[s - 1]) for s in steps)
    assert worst <= LOSS_TOL, (name, worst)
    assert cli[STEPS] < cli[1] - 0.3, cli  # and it learned


def test_resolved_settings_are_recorded(runs):
    cfg = yaml.safe_load((runs["hybrid"] / "config.yaml").read_text())
    assert cfg["strategy"] == "hybrid" and cfg["shard_size"] == 1
    assert cfg["_resolved"]["strategy"] == "hybrid" and cfg["_resolved"]["shard_size"] == 1
    assert yaml.safe_load((runs["tp"] / "config.yaml").read_text())["tp"] == 2
    # a tensor-parallel run checkpoints and exports as any other (checkpoint/boxes.py), and
    # resumes (test_cli_run_equals_the_python_api_run) from an asynchronous checkpoint
    assert (runs["tp"] / "final" / "config.json").exists()
    saves = {r["checkpoint"]: r["async"] for r in read_metrics(runs["tp"] / "metrics.jsonl")
             if "checkpoint" in r}  # fmt: skip
    assert saves["step_000010"] and (runs["tp"] / "checkpoints" / "step_000010").is_dir(), saves
    cfg = yaml.safe_load((runs["hpz_offload"] / "config.yaml").read_text())
    assert cfg["reshard_after_forward"] == 1 and cfg["offload"] is True
    fp16 = read_metrics(runs["fp16"] / "metrics.jsonl")
    steps = [r for r in fp16 if "loss" in r]
    assert all("loss_scale" in r and "skipped_steps" in r for r in steps)
    # a step the scaler skipped is counted (every rank agrees on it through the scaler)
    skipped = sum(1 for r in steps if r.get("skipped"))
    assert skipped >= 1 and steps[-1]["skipped_steps"] == skipped
    scales = [r["loss_scale"] for r in steps]
    assert scales[0] == 2**20 and min(scales) < 2**20  # each overflow halved the scale
    assert json.loads((runs["fp16"] / "summary.json").read_text())["skipped_steps"] == skipped
    assert all(r["mfu"] > 0 for r in steps)  # LAYERSHARD_PEAK_TFLOPS gave a peak


def test_checkpoint_of_one_strategy_resumes_under_another(runs):
    cfg = yaml.safe_load((runs["full"] / "config.yaml").read_text())
    assert cfg["strategy"] == "grad_op"  # the override was kept; the rest as recorded
    assert cfg["micro_batch"] == 4 and cfg["model_overrides"]["dim"] == 64
    resumed, straight = _losses(runs["full"]), _losses(runs["grad_op"])
    assert sorted(resumed) == list(range(1, STEPS + 1))
    worst = max(abs(resumed[s] - straight[s]) for s in range(1, STEPS + 1))
    assert worst <= RESUME_TOL, worst
    val_a, val_b = _losses(runs["full"], "val_loss"), _losses(runs["grad_op"], "val_loss")
    assert abs(val_a[STEPS] - val_b[STEPS]) <= RESUME_TOL


def test_tensorboard_events_hold_the_metrics(runs):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for name in ("full", "fp16"):  # a resumed run (its events purged at the resume) and fp16
        run = runs[name]
        acc = EventAccumulator(str(run / "tensorboard"))
        acc.Reload()
        records = read_metrics(run / "metrics.jsonl")
        for key, tag in (("loss", "train/loss"), ("lr", "train/lr"),
                         ("grad_norm", "train/grad_norm"), ("tokens_per_s", "train/tokens_per_s"),
                         ("mfu", "train/mfu"), ("skipped_steps", "train/skipped_steps"),
                         ("val_loss", "val/loss")):  # fmt: skip
            want = [(r["step"], r[key]) for r in records if key in r]
            got = [(e.step, e.value) for e in acc.Scalars(tag)]
            assert [s for s, _ in got] == [s for s, _ in want], (name, tag)
            for (_, a), (_, b) in zip(got, want):
                assert math.isclose(a, b, rel_tol=1e-6, abs_tol=1e-12), (name, tag, a, b)
        mem = [(r["step"], max(r["mem_mib"])) for r in records if "mem_mib" in r]
        got = [(e.step, e.value) for e in acc.Scalars("memory/max_mib")]
        assert [s for s, _ in got] == [s for s, _ in mem]
        assert all(math.isclose(a, b, rel_tol=1e-6) for (_, a), (_, b) in zip(got, mem))


def test_plan_write_config_train_round_trip(runs, capsys):
    planned = yaml.safe_load(runs["plan_yaml"].read_text())
    recorded = yaml.safe_load((runs["plan"] / "config.yaml").read_text())
    for key in ("seq_len", "micro_batch", "grad_accum", "strategy", "activation_checkpointing",
                "offload", "precision", "loss_chunks", "plan"):  # fmt: skip
        assert recorded[key] == planned[key], key
    assert recorded["_resolved"]["grad_accum"] == planned["grad_accum"]
    summary = json.loads((runs["plan"] / "summary.json").read_text())
    assert summary["plan"]["step_s"] == planned["plan"]["step_s"] > 0
    assert summary["step_time_s_median"] > 0 and summary["mem_mib_max"] > 0
    # `layershard plan --calibrate RUN_DIR` reads the prediction next to the measurement
    rc = layershard_main(
        ["plan", "--model", "tiny", "--gpus", "2", "--gpus-per-node", "2", "--seq-len", "64",
         "--micro-batch", "4", "--param-dtype", "fp32", "--no-suggest",
         "--calibrate", str(runs["plan"])]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    assert f"plan predicted {planned['plan']['step_s']:.4g} s/step" in out, out


def test_invalid_strategy_combinations_are_refused_before_launch(tmp_path, capsys, monkeypatch):
    from _train import refused_one_line

    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    cases = (
        (["--strategy", "grad_op", "--shard-size", "2"], "shard_size applies to strategy='hybrid'"),
        (["--strategy", "no_shard", "--reshard-after-forward", "2"], "reshard_after_forward applies"),
        (["--strategy", "hybrid", "--shard-size", "3"], "hybrid with shard_size 3: must divide the world size 2"),
        (["--reshard-after-forward", "4"], "reshard_after_forward 4: must divide the world size 2"),
        (["--precision", "fp16", "--optimizer", "muon"], "fp16"),
    )  # fmt: skip
    for flags, expected in cases:
        assert expected in refused_one_line(capsys, tmp_path, *TINY, *flags), flags


def test_tp_combinations_that_cannot_run_are_refused_before_launch(tmp_path, capsys, monkeypatch):
    from _train import refused_one_line

    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    cases = (
        (["--tp", "3"], "tp 3 must divide the world size 2"),
        (["--tp", "2", "--model", "moe"], "--tp 2 of a mixture of experts needs --ep too"),
        (["--tp", "2", "--model-override", "n_kv_heads=1"], "--tp 2 must divide the model's n_kv_heads=1"),
        (["--tp", "2", "--strategy", "no_shard"], "tensor parallelism runs with strategy full, grad_op or hybrid"),
        (["--tp", "2", "--strategy", "hybrid", "--shard-size", "1"], "tp 2 must divide the ranks of a replica (1"),
    )  # fmt: skip
    for flags, expected in cases:
        assert expected in refused_one_line(capsys, tmp_path, *TINY, *flags), flags


def test_without_tensorboard_metrics_go_to_jsonl_with_a_note(tmp_path, capsys, monkeypatch):
    import sys

    from layershard.train.loop.report import MetricsLog
    from layershard.train.loop.sinks import open_sinks

    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # as if not installed
    log = MetricsLog(
        tmp_path / "metrics.jsonl", sinks=open_sinks(tmp_path, ["tensorboard"], {}, None)
    )
    log.write({"step": 1, "loss": 2.5})
    log.close()
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "tensorboard is not installed" in err, err
    assert read_metrics(tmp_path / "metrics.jsonl") == [{"step": 1, "loss": 2.5}]
    assert not (tmp_path / "tensorboard").exists()


def test_a_hybrid_run_resumes_under_full(tmp_path, capfd, monkeypatch):
    """Issue 35: a `--strategy hybrid --shard-size K` run could not be resumed with `--strategy
    full`: the recorded shard_size was refused, no flag unset it, and the error named no fix,
    although checkpoints resume under another strategy. A flag that changes the strategy now
    drops what only the recorded one takes (said in a note); given again with the new strategy,
    it is refused with the fix."""
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    run = tmp_path / "run"
    argv = [*TINY[:-2], *SMALL, "--steps", "3", "--eval-interval", "0", "--run-dir", str(run)]
    hybrid = ["--strategy", "hybrid", "--shard-size", "1"]
    assert train_main([*argv, *hybrid, "--stop-at-step", "2"]) == 0
    capfd.readouterr()
    assert train_main([*argv, "--resume", "--strategy", "full"]) == 0
    out = capfd.readouterr()
    note = (
        "--strategy full: the run's shard_size 1 (of hybrid) does not apply to full and is dropped"
    )
    assert note in out.err, out.err
    assert "resumed at step 2" in out.out, out.out
    refused = train_main([*argv, "--resume", "--strategy", "grad_op", "--shard-size", "1"])
    err = capfd.readouterr().err
    assert refused == 2 and "leave out --shard-size, or use --strategy hybrid" in err, err
    recorded = yaml.safe_load((run / "config.yaml").read_text())
    assert recorded["strategy"] == "full" and recorded["shard_size"] is None
    assert sorted(r["step"] for r in read_metrics(run / "metrics.jsonl") if "loss" in r) == [
        1, 2, 3
    ]  # fmt: skip


def test_a_changed_strategy_or_precision_drops_what_it_does_not_take():
    """(Without processes) what a resume's flags drop from the recorded config, with a note;
    an option given again with the new strategy is kept, for the schema to refuse with its fix."""
    from layershard.train.config import resume_layers

    recorded = {"strategy": "full", "reshard_after_forward": 2, "precision": "fp16",
                "loss_scale": 1024.0}  # fmt: skip
    notes = resume_layers(recorded, {"strategy": "grad_op"}, {"precision": "bf16"})
    assert recorded == {"strategy": "full", "precision": "fp16"}
    assert notes == [
        "--precision bf16: the run's loss_scale 1024 (of fp16) does not apply and is dropped",
        "--strategy grad_op: the run's reshard_after_forward 2 (of full) does not apply to "
        "grad_op and is dropped",
    ]
    kept = {"strategy": "hybrid", "shard_size": 2}
    assert resume_layers(kept, {}, {"strategy": "grad_op", "shard_size": 2}) == []
    assert kept == {"strategy": "hybrid", "shard_size": 2}
    assert resume_layers(kept, {}, {"strategy": "hybrid"}) == [] and kept["shard_size"] == 2
