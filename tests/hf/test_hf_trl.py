"""trl's trainers sharded by layershard (``ls.hf.sharded(SFTTrainer)``, ``DPOTrainer``) against
the same trainers under DDP (tests/_hf_script.py ``sft``, ``dpo``; tolerances:
test_hf_trainer.py)."""

from __future__ import annotations

import pytest
from _hf_launch import section
from _parity import LOSS_RTOL
from test_hf_trainer import GRAD_NORM_RTOL, _rel


@pytest.mark.slow
def test_sft_assistant_only_loss_matches_ddp() -> None:
    """Chat data, loss on assistant tokens only (assistant_only_loss, {% generation %} template),
    through trl's fused LM head (which reads the head's weight outside its forward)."""
    res = section("main", "sft")
    ls_log, ddp_log = res["ls/assistant"]["logged"], res["ddp/assistant"]["logged"]
    assert len(ls_log) == 10
    assert _rel(ls_log, ddp_log, 1) < LOSS_RTOL
    assert _rel(ls_log, ddp_log, 2) < GRAD_NORM_RTOL
    # The mask is honoured: the loss on every token is another run
    assert _rel(res["ddp/all"]["logged"], ddp_log, 1) > 1e-2


@pytest.mark.slow
def test_sft_completion_only_loss_matches_ddp() -> None:
    """Prompt/completion pairs, loss on the completion only (completion_only_loss)."""
    res = section("main", "sft")
    ls_log, ddp_log = res["ls/completion"]["logged"], res["ddp/completion"]["logged"]
    assert _rel(ls_log, ddp_log, 1) < LOSS_RTOL
    assert _rel(ls_log, ddp_log, 2) < GRAD_NORM_RTOL
    assert _rel(res["ddp/prompt+completion"]["logged"], ddp_log, 1) > 1e-2


@pytest.mark.slow
def test_dpo_with_reference_model_matches_ddp() -> None:
    """DPOTrainer: the reference model (prepared for evaluation) is sharded as well."""
    res = section("main", "dpo")
    assert res["ls"]["ref_sharded"]
    assert _rel(res["ls"]["logged"], res["ddp"]["logged"], 1) < LOSS_RTOL
    assert _rel(res["ls"]["logged"], res["ddp"]["logged"], 2) < GRAD_NORM_RTOL
