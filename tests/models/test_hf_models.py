"""Hugging Face architectures sharded as a new user would (``ls.shard(model)``, units found
automatically): dense, tied, mixture-of-experts, encoder-only, encoder-decoder, and PEFT LoRA
(a frozen base with trainable adapters), each against one process on the same global batch."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _parity import param_bound, train_in_orders

import layershard as ls

V, STEPS, LR = 96, 3, 1e-2


def _architectures():
    import transformers as T

    small = dict(vocab_size=V, max_position_embeddings=32)
    yield "gpt2", T.GPT2LMHeadModel(T.GPT2Config(vocab_size=V, n_embd=32, n_layer=2, n_head=4, n_positions=32)), "clm"  # fmt: skip
    yield "mixtral", T.MixtralForCausalLM(T.MixtralConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **small)), "clm"  # fmt: skip
    yield "qwen2-tied", T.Qwen2ForCausalLM(T.Qwen2Config(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True, **small)), "clm"  # fmt: skip
    yield "bert", T.BertForMaskedLM(T.BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=48, **small)), "mlm"  # fmt: skip
    yield "t5", T.T5ForConditionalGeneration(T.T5Config(vocab_size=V, d_model=32, d_kv=8, d_ff=48, num_layers=2, num_heads=4, decoder_start_token_id=0)), "s2s"  # fmt: skip
    yield "bart", T.BartForConditionalGeneration(T.BartConfig(d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4, encoder_ffn_dim=48, decoder_ffn_dim=48, **small)), "s2s"  # fmt: skip
    try:
        import peft
    except ImportError:
        return
    base = T.LlamaForCausalLM(T.LlamaConfig(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, **small))  # fmt: skip
    lora = peft.get_peft_model(
        base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])
    )
    for name, p in lora.named_parameters():
        if "lora_B" in name:  # zero at init: make the adapters matter from the first step
            torch.nn.init.normal_(p, std=0.02)
    yield "llama-lora", lora, "clm"


def _loss(model, kind: str, x: torch.Tensor) -> torch.Tensor:
    labels = x.flip(1) if kind == "s2s" else x
    return model(input_ids=x, labels=labels).loss


def _hf_architectures(rank: int, world: int) -> None:
    torch.manual_seed(0)
    seen = []
    for name, base, kind in _architectures():
        base.eval()  # no dropout: the reference is deterministic
        reference, model = copy.deepcopy(base), ls.shard(copy.deepcopy(base))
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        ref_opt = torch.optim.AdamW([p for p in reference.parameters() if p.requires_grad], lr=LR)
        g = torch.Generator().manual_seed(1)
        data = [torch.randint(1, V, (4, 16), generator=g) for _ in range(STEPS)]
        for step, x in enumerate(data):
            b = x.shape[0] // world
            loss = _loss(model, kind, x[rank * b : (rank + 1) * b])
            loss.backward()
            opt.step()
            opt.zero_grad()
            ref_loss = _loss(reference, kind, x)
            ref_loss.backward()
            ref_opt.step()
            ref_opt.zero_grad()
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            # fp32, 3 steps: measured <= 2e-7 relative for every architecture here
            assert abs(mean.item() / world - ref_loss.item()) <= 1e-5 * ref_loss.item(), (
                name,
                step,
            )
        full = model.full_state_dict()
        if rank == 0:
            sd = reference.state_dict()
            assert set(full) == set(sd), name
            worst = max((full[k] - sd[k]).abs().max().item() for k in sd)
            # within the spread of other legitimate orders of the sums (tests/_parity.py).
            # Measured 2026-11-26, torch 2.13: every architecture at <= 0.50 of its bound under
            # AVX-512+AMX, AVX2 and default (at 2 ranks layershard lands where the 2-part plan
            # does); e.g. GPT-2 2.1e-5 / 4.9e-5, 2.4e-5 / 4.9e-5, 1.6e-5 / 6.5e-5, Mixtral
            # 1.6e-5 / 3.2e-5, 2.2e-5 / 4.5e-5, 1.6e-5 / 3.2e-5
            runs = train_in_orders(
                base, data, world, loss=lambda m, x, kind=kind: _loss(m, kind, x)
            )
            bound = param_bound(reference, *runs)
            assert worst <= bound, (name, worst, bound)
        seen.append(name)
    assert len(seen) >= 6, seen


def test_hf_architectures_train_like_one_process():
    pytest.importorskip("transformers")
    run_ranks(_hf_architectures, 2)
