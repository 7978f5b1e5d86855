"""The built-in mixture of experts (models/moe.py): the same logits and loss as HF Mixtral with
the same weights, and sharded training (it and transformers' Qwen3-MoE, 1-D: a decoder layer with
all its experts is one unit) equal to one process at 4 ranks.

Each rank computes the load-balancing loss on its own micro-batch (as DDP, FSDP and HF do), so
the reference is one process that does the same: the mean over the ranks' micro-batches of their
losses (``exact_parts`` in _parity.py), not the loss of the whole batch."""

from __future__ import annotations

import torch
from _dist import RankChecks
from _parity import (
    batches,
    check_losses,
    clone,
    global_mean,
    grad_bound,
    grads_in_orders,
    lm_loss,
    local,
    max_diff,
    param_bound,
    shard_grad_error,
    tiny_llama,
    train_in_orders,
)

import layershard as ls
from layershard.models import build_config, hf_llama_config, to_hf_name

MOE = dict(n_experts=4, top_k=2, moe_ffn_dim=32, ffn_dim=0, aux_loss_coef=0.1)
STEPS = 6


def tiny_moe(seed: int = 0):
    return tiny_llama(seed, **MOE)


def test_matches_hf_mixtral():
    """Logits, the load-balancing loss and the loss of our MoE equal MixtralForCausalLM's with
    the same weights (fp32, one process). Tolerances: the same math in another order of the
    same fp32 ops; measured differences ~1e-7 (logits of magnitude ~0.1)."""
    from transformers import MixtralForCausalLM

    ours = tiny_moe()
    hf = MixtralForCausalLM(hf_llama_config(ours.config)).eval()
    missing = hf.load_state_dict(
        {to_hf_name(k): v for k, v in ours.state_dict().items() if k != "rotary.inv_freq"},
        strict=False,
    )
    assert not missing.unexpected_keys
    assert all("rotary" in k for k in missing.missing_keys), missing.missing_keys
    x = batches(1, batch=4)[0]
    with torch.no_grad():
        mine = ours(x, labels=x)
        theirs = hf(x, labels=x)
    assert mine.logits is not None and mine.aux_loss is not None and mine.loss is not None
    torch.testing.assert_close(mine.logits, theirs.logits, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(mine.aux_loss, theirs.aux_loss, rtol=1e-5, atol=0)
    torch.testing.assert_close(mine.loss, theirs.loss, rtol=1e-5, atol=0)
    # the loss includes the balance term: a model without it differs
    assert abs(mine.loss.item() - (mine.loss - 0.1 * mine.aux_loss).item()) > 1e-3


def test_preset_shape():
    cfg = build_config("moe")
    assert cfg.n_experts == 8 and cfg.top_k == 2
    try:
        build_config("moe", top_k=9)
    except ValueError as e:
        assert "top_k <= n_experts" in str(e)
    else:
        raise AssertionError("top_k > n_experts accepted")


checks = RankChecks(world_size=4)


def matches_one_process(
    base, steps: int, rank: int, world: int, shard=ls.shard, other=None
) -> dict:
    """Shard ``base`` (1-D, or as ``shard`` does) and train ``steps`` AdamW steps on the ranks'
    micro-batches: the first step's gradients (the router's included), every step's loss and the
    final weights against one process on the same micro-batches, within the spread of the
    legitimate orders of the ranks' sum (_parity.py) and of ``other(base, data)`` (the first
    whole gradients and the final whole weights of another legitimate implementation; every rank
    calls it). Returns the full state dict (rank 0)."""
    data = batches(steps)
    other_grads, extra = [], []  # another implementation's first gradients, final weights
    if other is not None:
        grads, params = other(clone(base), data)
        other_grads, extra = [grads], [params]
    ref_grads, orders = grads_in_orders(base, data[0], world, exact_parts=True)
    runs = train_in_orders(base, data, world, exact_parts=True)  # runs[0]: rank order
    # rank order, reversed, rotated, pairs of pairs; at 2 ranks the rank order alone (two parts
    # commute): ``other`` gives the spread there
    assert len(runs) >= 3 or (world == 2 and other is not None)
    reference = clone(base)
    reference.load_state_dict(runs[0].params, strict=False)
    model = shard(clone(base))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    losses = []
    for step, batch in enumerate(data):
        loss = lm_loss(model, local(batch, rank, world))
        loss.backward()
        if step == 0:
            err, bound = (
                shard_grad_error(model, ref_grads),
                grad_bound(ref_grads, orders + other_grads),
            )
            assert err <= bound, f"first gradient {err:.2e} from the reference's > {bound:.2e}"
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
    check_losses(losses, runs)
    full = model.full_state_dict()
    if rank == 0:
        dev, where = max_diff(full, reference)
        bound = param_bound(reference, *runs[1:], *extra)
        assert dev <= bound, f"{where}: {dev:.2e} > {bound:.2e}"
    return full


@checks.check
def sharded_moe_matches_one_process(rank: int, world: int) -> None:
    """4 ranks, the built-in MoE sharded 1-D (a decoder layer with its experts is one unit)."""
    full = matches_one_process(tiny_moe(), STEPS, rank, world)
    if rank == 0:
        experts = [k for k in full if "experts" in k]
        assert experts and all(full[k].dim() == 3 for k in experts)


@checks.check
def hf_qwen3_moe_matches_one_process(rank: int, world: int) -> None:
    """transformers' Qwen3-MoE (fused 3-D experts, its own router and load-balancing loss),
    sharded 1-D."""
    full = matches_one_process(tiny_qwen3_moe(), 3, rank, world)
    if rank == 0:
        assert full["model.layers.0.mlp.experts.gate_up_proj"].shape == (4, 32, 32)


def tiny_qwen3_moe():
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    cfg = Qwen3MoeConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, moe_intermediate_size=16,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
        num_experts=4, num_experts_per_tok=2, norm_topk_prob=True, router_aux_loss_coef=0.1,
        output_router_logits=True, max_position_embeddings=32,
    )  # fmt: skip
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return Qwen3MoeForCausalLM(cfg)


checks.collect(globals())
