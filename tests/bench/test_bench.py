"""`layershard bench` end to end at tiny size on 2 CPU ranks: runs, writes its JSON and PNG, and
every implementation (layershard's strategies, torch's, the plain model) trains the same model to
the same losses (fp32). No timing assertions."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

RUN = ["layershard", "layershard-no_shard", "fsdp2", "ddp", "plain"]


@pytest.mark.slow
def test_bench_tiny_end_to_end(tmp_path):
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "layershard.cli", "bench", "--model", "tiny", "--nproc", "2",
        "--steps", "2", "--warmup", "1", "--repeats", "1", "--seq-len", "32",
        "--global-batch", "4", "--out", str(out), "--timeout", "240",
        "--strategy", "full", "no_shard", "--impl", "fsdp2", "ddp", "plain",
    ]  # fmt: skip
    env = dict(os.environ, LAYERSHARD_TIMEOUT_S="120")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "world size 2" in p.stdout and "layershard" in p.stdout

    assert (out / "bench.png").stat().st_size > 1000
    res = json.loads((out / "results.json").read_text())
    impls = res["world_sizes"]["2"]["impls"]
    assert set(impls) == set(RUN)
    for name, s in impls.items():
        assert s["failed"] == 0, (name, s.get("errors"))
        assert s["timed_steps"] == 2 and s["step_time_median"] > 0 and s["tokens_per_s"] > 0
        if name != "plain":  # (each rank trains its own copy on its own batches)
            assert s["loss_max_abs_diff_vs_layershard"] < 1e-4, name
        assert s["memtracker_peak"] > 0, (name, s.get("memtracker_peak_na"))
        if name != "plain":  # the plain model communicates nothing
            assert s["collectives_per_step"] > 0 and s["bytes_sent_per_step"] > 0, name
        ms = s["model_state"]
        assert ms["params"] > 0 and ms["grads"] > 0 and ms["optimizer"] > 0, name
    # The sharded implementations hold 1/2 of the model state; DDP all of it.
    for name in ("layershard", "fsdp2"):
        assert impls[name]["model_state_vs_minimum"] < 1.05, name
    for name in ("ddp", "layershard-no_shard", "plain"):  # replicated
        assert impls[name]["model_state_vs_minimum"] > 1.9, name
    assert impls["layershard"]["layershard_comm_stats"]["all_gather"]["count"] > 0
    assert res["world_sizes"]["2"]["targets"]  # evaluated (met or not is for real runs)
    runs = sorted(p.name for p in (out / "runs").glob("*.json"))
    assert runs == sorted(f"{i}-n2-r0.json" for i in RUN)
    run = json.loads((out / "runs" / "layershard-n2-r0.json").read_text())
    walls = run["step_walls"]  # warm-up and timed steps: start, backward, optimizer, end
    assert len(walls) == 3 and all(a[-1] <= b[0] for a, b in zip(walls, walls[1:]))
    assert all(w == sorted(w) and w[0] < w[-1] for w in walls)
    slowest = run["warmup_times"] + run["step_times"]  # each step's slowest rank, timed
    assert all(abs((w[-1] - w[0]) - t) < 0.25 * t for w, t in zip(walls, slowest))


def test_vocab_shape_embedding_and_head_are_each_larger_than_a_block():
    """The `vocab` shape (issue 25): a vocabulary of at least 32k over a few blocks, so that the
    embedding and the LM head, not a block, are the largest units. Built through the worker's own
    build_model (the overrides as `layershard bench --shape vocab` passes them), on the meta
    device; the long benchmark itself is not run here."""
    import argparse

    import torch

    from layershard.bench.cli import SHAPES
    from layershard.bench.worker import build_model
    from layershard.plan import ModelShape, units

    spec = SHAPES["vocab"]
    args = argparse.Namespace(
        seed=0, hf_config=None, model=spec["model"], vocab_size=8192,  # the CLI's default
        model_override=list(spec["overrides"]), seq_len=spec["seq_len"],
    )  # fmt: skip
    with torch.device("meta"):
        model, desc = build_model(args)
    assert desc["vocab_size"] >= 32000 and desc["n_layers"] <= 4
    sizes = {u.name: u.numel for u in units(ModelShape.from_config(model.config))}
    block = sizes["layers.0"]
    assert sizes["embed"] > block and sizes["lm_head"] > block, sizes
    assert desc["params"] == sum(sizes.values())


def test_deep_shape_computes_the_loss_outside_the_model():
    """The `deep` shape (issue 31): 16 small blocks, the logits returned and the cross-entropy
    computed by the loop, which must be the loss the model computes itself (``labels=``) on the
    same tokens, so that the two kinds of shape measure the same training."""
    import argparse

    import torch

    from layershard.bench.cli import SHAPES
    from layershard.bench.worker import build_model, compute_loss

    spec = SHAPES["deep"]
    assert spec["loss"] == "outside"
    args = argparse.Namespace(
        seed=0, hf_config=None, model=spec["model"], vocab_size=8192,
        model_override=[*spec["overrides"], "n_layers=2"], seq_len=spec["seq_len"],
    )  # fmt: skip
    model, desc = build_model(args)
    assert (desc["vocab_size"], desc["dim"], desc["ffn_dim"]) == (4096, 256, 704)
    x = torch.randint(0, 4096, (2, 16), generator=torch.Generator().manual_seed(0))
    inside, outside = compute_loss(model, x, "inside"), compute_loss(model, x, "outside")
    torch.testing.assert_close(outside, inside, rtol=1e-6, atol=0)


def test_logits_shape_is_issue_34s_user_model():
    """The `logits` shape (issue 34): logits returned, the loss outside, vocab 16384 over 3
    blocks of d 768 with the embedding and the head each ~1.8x a block."""
    import argparse

    import torch

    from layershard.bench.cli import SHAPES
    from layershard.bench.worker import build_model
    from layershard.plan import ModelShape, units

    spec = SHAPES["logits"]
    assert spec["loss"] == "outside" and spec["seq_len"] == 128 and spec["micro_batch"] == 2
    args = argparse.Namespace(
        seed=0, hf_config=None, model=spec["model"], vocab_size=8192,
        model_override=list(spec["overrides"]), seq_len=spec["seq_len"],
    )  # fmt: skip
    with torch.device("meta"):
        model, desc = build_model(args)
    assert (desc["vocab_size"], desc["dim"], desc["n_layers"]) == (16384, 768, 3)
    sizes = {u.name: u.numel for u in units(ModelShape.from_config(model.config))}
    ratio = sizes["lm_head"] / sizes["layers.0"]
    assert 1.7 <= ratio <= 1.9 and sizes["embed"] == sizes["lm_head"], sizes


def test_wire_options_are_layershard_runs():
    """`--gather-dtype fp8 int8 --reduce-dtype fp32 bf16` names one layershard run per option
    beside the exact one, each a known implementation of the worker."""
    from layershard.bench import IMPLS, WIRE_IMPL, wire_impl

    names = [wire_impl(g, r) for g in (None, "fp8", "int8") for r in ("fp32", "bf16")]
    assert names == [
        None,
        "layershard-bf16r",
        "layershard-fp8",
        "layershard-fp8-bf16r",
        "layershard-int8",
        "layershard-int8-bf16r",
    ]
    assert all(n in IMPLS and n in WIRE_IMPL for n in names if n)


def test_blocks_per_unit_rows_are_layershard_runs(capsys, monkeypatch):
    """`--blocks-per-unit K` names a layershard run per K and strategy ("layershard-b2",
    "layershard-grad_op-b4"), which the worker takes and shards with blocks_per_unit=K; they sort
    after the run they group; K < 2 and a -bK of another implementation are refused."""
    from layershard.bench import impl_order, known_impl, split_blocks
    from layershard.bench.worker import wrap

    assert split_blocks("layershard-grad_op-b4") == ("layershard-grad_op", 4)
    assert split_blocks("layershard") == ("layershard", 1)
    assert split_blocks("layershard-bf16r") == ("layershard-bf16r", 1)
    for bad in ("fsdp2-b2", "layershard-fp8-b2", "nonsense"):
        with pytest.raises(ValueError):
            known_impl(bad)
    names = ["ddp", "layershard-b2", "layershard-grad_op", "layershard", "layershard-grad_op-b2"]
    assert sorted(names, key=impl_order) == [
        "layershard", "layershard-b2", "layershard-grad_op", "layershard-grad_op-b2", "ddp",
    ]  # fmt: skip
    from layershard.cli import main

    assert main(["bench", "--blocks-per-unit", "1", "--out", "unused"]) == 2
    assert "--blocks-per-unit takes K >= 2" in capsys.readouterr().err
    import torch

    import layershard as ls

    given = {}
    monkeypatch.setattr(ls, "shard", lambda model, **kw: given.update(kw) or model)
    _, _, notes = wrap(
        "layershard-grad_op-b2", torch.nn.Linear(2, 2), torch.device("cpu"), False, 2
    )
    assert given["blocks_per_unit"] == 2 and given["strategy"] == "grad_op"
    assert notes["blocks_per_unit"] == 2


@pytest.mark.slow
def test_bench_tensor_parallel(tmp_path):
    """`--tp 2`: layershard-tp (ls.parallelize(model, tp=2), both ranks on the same batches)
    trains the same model to the same losses as 1-D layershard on the same global batch."""
    out = tmp_path / "bench"
    cmd = [
        sys.executable, "-m", "layershard.cli", "bench", "--model", "tiny", "--nproc", "2",
        "--steps", "2", "--warmup", "1", "--repeats", "1", "--seq-len", "32",
        "--global-batch", "4", "--out", str(out), "--timeout", "240", "--no-mem",
        "--tp", "2", "--impl", "layershard-tp",
    ]  # fmt: skip
    env = dict(os.environ, LAYERSHARD_TIMEOUT_S="120")
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    impls = json.loads((out / "results.json").read_text())["world_sizes"]["2"]["impls"]
    assert set(impls) == {"layershard", "layershard-tp"}
    tp = impls["layershard-tp"]
    assert tp["failed"] == 0, tp.get("errors")
    assert tp["loss_max_abs_diff_vs_layershard"] < 1e-4
    assert tp["collectives_per_step"] > 0 and tp["tokens_per_s"] > 0


def test_only_runs_the_named_rows_without_the_plain_layershard_row(tmp_path, monkeypatch):
    """`--only`: the --impl rows alone (a slow link: an hour per row), in the alternating order;
    without it the plain layershard row is added first, as the x-columns' reference."""
    from layershard.bench import cli as bench_cli
    from layershard.cli import main

    launched = []

    def launch(args, impl, n, device, path):
        launched.append(impl)
        return 1, "not run (test)"

    monkeypatch.setattr(bench_cli, "_launch", launch)
    common = "bench --shape comm --nproc 2 --impl fsdp1 ddp --repeats 2".split()
    assert main([*common, "--only", "--out", str(tmp_path / "a")]) == 0
    assert launched == ["fsdp1", "ddp", "ddp", "fsdp1"]
    launched.clear()
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    assert launched == ["layershard", "fsdp1", "ddp", "ddp", "fsdp1", "layershard"]
