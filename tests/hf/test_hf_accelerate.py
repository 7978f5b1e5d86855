"""A user's own accelerate loop: ``ls.hf.Accelerator`` against ``accelerate.Accelerator`` (DDP),
the same loop (tests/_hf_script.py ``accelerate_loop``; tolerances: test_hf_trainer.py)."""

from __future__ import annotations

import pytest
from _hf_launch import section
from _parity import LOSS_RTOL
from test_hf_trainer import GRAD_NORM_RTOL, PARAM_TOL


def _rel(a: list, b: list, col: int) -> float:
    return max(abs(x[col] - y[col]) / abs(y[col]) for x, y in zip(a, b))


@pytest.mark.slow
def test_accelerate_loop_matches_ddp() -> None:
    """accumulate() over 2 micro-batches, clip_grad_norm_, a scheduler, weight-decay groups built
    before prepare()."""
    res = section("main", "accelerate_loop")
    ls_run, ddp = res["ls"], res["ddp"]
    assert len(ls_run["losses"]) == len(ddp["losses"]) == 8
    assert _rel(ls_run["losses"], ddp["losses"], 0) < LOSS_RTOL
    assert _rel(ls_run["losses"], ddp["losses"], 1) < GRAD_NORM_RTOL
    assert res["param_diff"] < PARAM_TOL


@pytest.mark.slow
def test_accelerate_save_state_load_state_and_save_model() -> None:
    """save_state() at micro-step 8 writes the model and optimizer as a layershard sharded
    checkpoint; load_state() and replaying the remaining micro-batches ends on the same weights
    and losses; save_model() writes a folder that from_pretrained loads."""
    ls_run = section("main", "accelerate_loop")["ls"]
    assert "layershard_model_0" in ls_run["state_files"]
    assert "optimizer.bin" not in ls_run["state_files"]
    assert ls_run["replay"] == ls_run["losses"][len(ls_run["losses"]) - len(ls_run["replay"]) :]
    assert ls_run["replay_param_diff"] == 0.0
    assert {"config.json", "model.safetensors"} <= set(ls_run["model_files"])
    assert ls_run["saved_diff"] == 0.0


def test_a_plugin_computing_in_fp16_needs_fp16_for_its_loss_scaler() -> None:
    """Issue 35: `ShardingPlugin(mixed_precision=MixedPrecision(param_dtype=torch.float16))`
    with neither fp16 nor bf16 in TrainingArguments trained in float16 without a loss scaler.
    The scaler is accelerate's (fp16=True), so the plugin alone is refused in one line, before
    any model is touched (``Accelerator.__init__`` folds it in before the process group)."""
    import pytest
    import torch

    from layershard import MixedPrecision
    from layershard.hf import ShardingPlugin

    fp16 = ShardingPlugin(mixed_precision=MixedPrecision(param_dtype=torch.float16))
    for amp in ("no", None):
        with pytest.raises(ValueError) as e:
            fp16.with_amp(amp)
        assert "\n" not in str(e.value)
        assert "computes in fp16, which needs a loss scaler: also pass fp16=True" in str(e.value)
    assert fp16.with_amp("fp16") is fp16  # with TrainingArguments(fp16=True): the scaler
    bf16 = ShardingPlugin(mixed_precision=MixedPrecision(param_dtype=torch.bfloat16))
    assert bf16.with_amp("no") is bf16  # bf16 needs no scaler


def test_plugin_data_mesh_with_hybrid_replicates_tp_groups(monkeypatch) -> None:
    """``ShardingPlugin(tp=2, strategy="hybrid")``: accelerate's data loaders get the replicas
    ``ls.parallelize`` makes (a replica per ``shard_size`` ranks, by default a node's), so the
    batches are split over dp_replicate x dp_shard and a TP group's ranks share one. Before,
    the plugin passed hybrid to ``ls.parallelize``, which refused ``shard_size`` (or, without
    it, ran without replicas)."""
    import pytest

    from layershard.hf import ShardingPlugin

    assert ShardingPlugin(tp=2).mesh_shape(8) == (1, 4, 2)
    assert ShardingPlugin(tp=2, strategy="hybrid", shard_size=4).mesh_shape(8) == (2, 2, 2)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # a node of 2 ranks: one TP group per replica
    assert ShardingPlugin(tp=2, strategy="hybrid").mesh_shape(8) == (4, 1, 2)
    with pytest.raises(ValueError, match="must divide the world size 8"):
        ShardingPlugin(tp=2, strategy="hybrid", shard_size=3).mesh_shape(8)
    with pytest.raises(ValueError, match="their product must divide"):
        ShardingPlugin(tp=4, strategy="hybrid", shard_size=2).mesh_shape(8)
