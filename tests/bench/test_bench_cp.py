"""`layershard bench --cp N --cp-mode ...` (bench/context.py): layershard with context
parallelism beside plain layershard at the same global batch, at tiny size on 2 CPU ranks: the
report's rows, the CP rows' losses equal to layershard's (fp32), their transfers per step equal
to the plan's formulas (plan/context.py), and the one-line refusals before any run."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

import pytest

from layershard.bench.cli import DEFAULT_SHAPES, SHAPES
from layershard.bench.context import default_shapes
from layershard.bench.measure import ring_bytes_sent
from layershard.cli import main
from layershard.plan import ModelShape
from layershard.plan.context import ContextTime

CP_ROWS = ["layershard-cp-ring", "layershard-cp-all_to_all"]


@pytest.mark.slow
def test_bench_cp_rows_train_as_layershard_does(tmp_path):
    """`--cp 2 --cp-mode ring all_to_all` on 2 ranks: one CP group holding the whole global
    batch of 4 sequences, each rank 16 of each sequence's 32 tokens, against layershard with 2
    sequences a rank. The same tokens, the same model: the losses agree to fp32 rounding (as
    test_bench.py's rows, < 1e-4; measured 9.5e-7), and the bytes each CP row moves in a step
    are the plan's, hop by hop and all-to-all by all-to-all."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "layershard.cli", "bench", "--model", "tiny", "--nproc", "2",
        "--steps", "2", "--warmup", "1", "--repeats", "1", "--seq-len", "32",
        "--global-batch", "4", "--out", str(out), "--timeout", "240", "--no-mem",
        "--cp", "2", "--cp-mode", "ring", "all_to_all", "--impl", "layershard-cp-ring",
    ]  # fmt: skip
    env = dict(os.environ, LAYERSHARD_TIMEOUT_S="120")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    for mode in ("ring", "all_to_all"):  # the report names the size and the mode
        assert f"cp 2, {mode}: each sequence over 2 consecutive ranks" in p.stdout
    res = json.loads((out / "results.json").read_text())
    assert res["settings"]["cp"] == 2 and res["settings"]["cp_mode"] == ["ring", "all_to_all"]
    impls = res["world_sizes"]["2"]["impls"]
    assert set(impls) == {"layershard", *CP_ROWS}
    shape = ModelShape.from_preset("tiny")
    for name in CP_ROWS:
        s = impls[name]
        assert s["failed"] == 0, (name, s.get("errors"))
        assert s["timed_steps"] == 2 and s["tokens_per_s"] > 0
        assert s["loss_max_abs_diff_vs_layershard"] < 1e-4, name
        assert s["notes"] == {"cp": 2, "cp_mode": name.removeprefix("layershard-cp-")}
        # the weights are sharded over both ranks, as without CP
        assert s["model_state_vs_minimum"] < 1.05
        # one micro-batch of 4 sequences of 32 tokens per CP group, fp32 (c = 4), 4 layers
        f, b = ContextTime(shape, 2, s["notes"]["cp_mode"]).layer_transfers(4, 32, 4)
        planned = shape.n_layers * sum(t.nbytes for t in f + b)
        op = "send" if name.endswith("ring") else "all_to_all_single"
        counted = s["comm_per_step"][op]
        assert counted["count"] == shape.n_layers * len(f + b)
        assert counted["bytes"] == planned, (name, counted, planned)
    # ring: a K/V hop forward, a K/V hop and 2 dK/dV hops backward, 32768 bytes each:
    # 2 (k, v) x 4 sequences x 16 tokens x 2 kv heads x 32 x 4 bytes
    assert impls["layershard-cp-ring"]["comm_per_step"]["send"]["bytes"] == 4 * 4 * 32768


def _args(**kw) -> argparse.Namespace:
    return argparse.Namespace(cp=kw.get("cp"))


def test_default_shapes_with_cp_are_those_with_the_models_loss():
    """The deep and logits shapes compute the loss from the logits, outside the model, which a
    CP rank cannot (its logits are its part of each sequence): with --cp the defaults skip them."""
    assert default_shapes(_args(), SHAPES, DEFAULT_SHAPES) == DEFAULT_SHAPES
    assert default_shapes(_args(cp=2), SHAPES, DEFAULT_SHAPES) == ["small", "comm", "vocab"]


def test_a_hop_sends_its_whole_buffer():
    assert ring_bytes_sent("send", 1000, 2) == 1000
    assert ring_bytes_sent("all_gather", 1000, 2) == 500


@pytest.mark.parametrize(
    "argv,message",
    [
        (["--cp", "3"], "--cp 3 does not divide the world size 2"),
        (["--cp", "1"], "--cp 1: context parallelism needs N >= 2"),
        (["--cp", "2", "--seq-len", "30"], "--seq-len 30 must be divisible by 2 x cp = 4"),
        (["--cp", "2", "--loss", "outside"], "--cp needs the model's own loss"),
        (["--cp", "2", "--tp", "2"], "--cp does not combine with --tp or --ep"),
        (["--impl", "layershard-cp-ring"], "the layershard-cp-* implementations need --cp N"),
        (["--cp", "4", "--nproc", "4", "--cp-mode", "all_to_all", "--model-override",
          "n_heads=2"], "n_heads=2 must be divisible by --cp 4"),
    ],
)  # fmt: skip
def test_refused_in_one_line_before_any_run(capsys, tmp_path, argv, message):
    base = ["bench", "--model", "tiny", "--nproc", "2", "--seq-len", "32", "--global-batch", "4",
            "--out", str(tmp_path / "out")]  # fmt: skip
    assert main([*base, *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and message in err, err
    assert not (tmp_path / "out").exists()


def test_moe_and_hf_config_refused(capsys, tmp_path):
    out = ["--out", str(tmp_path / "out"), "--nproc", "2", "--seq-len", "32"]
    assert main(["bench", "--model", "moe", "--cp", "2", *out]) == 2
    assert "moe is a mixture of experts" in capsys.readouterr().err
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 1,
                               "num_attention_heads": 4, "vocab_size": 256}))  # fmt: skip
    assert main(["bench", "--hf-config", str(cfg), "--cp", "2", *out]) == 2
    assert "--cp runs the built-in Llama" in capsys.readouterr().err
