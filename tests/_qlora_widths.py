"""A QLoRA model at a real model's widths with a few layers, built without ever holding a layer
in 16 bits whole: the skeleton on the meta device, each block linear drawn in bf16 and quantized
by bitsandbytes (NF4, double quantization, on the CPU) one at a time, the embedding, LM head and
norms in ``frozen`` dtype, PEFT LoRA on every block linear. Sharded on the fake process group
(tests/_qlora_budget.py), its bytes per rank by kind are what a rank of ``world`` holds: the
planner's per-layer and fixed terms (plan/qlora.py ``qlora_terms``) are checked against them
(tests/plan/test_plan_qlora_widths.py, benchmarks/qlora/widths.py)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from layershard.plan.model import ModelShape


def shape_of(config: str, layers: int) -> ModelShape:
    """The shape of ``config`` (a folder of benchmarks/qlora/configs) with ``layers`` blocks."""
    from dataclasses import replace

    return replace(ModelShape.from_hf_config(config), n_layers=layers)


def build(shape: ModelShape, lora_rank: int = 16, frozen=torch.bfloat16, seed: int = 0) -> Any:
    import bitsandbytes as bnb
    import peft
    import transformers as T
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = T.LlamaConfig(
        vocab_size=shape.vocab_size, hidden_size=shape.dim, intermediate_size=shape.ffn_dim,
        num_hidden_layers=shape.n_layers, num_attention_heads=shape.n_heads,
        num_key_value_heads=shape.n_kv_heads, max_position_embeddings=shape.max_seq_len,
        tie_word_embeddings=False,
    )  # fmt: skip
    with torch.device("meta"):
        model = T.LlamaForCausalLM(cfg).to(frozen)
    g = torch.Generator().manual_seed(seed)

    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, lin in list(parent.named_children()):
                if not isinstance(lin, nn.Linear):
                    continue
                q = bnb.nn.Linear4bit(
                    lin.in_features, lin.out_features, bias=False, compute_dtype=frozen,
                    compress_statistics=True, quant_type="nf4", device="meta",
                )  # fmt: skip
                # drawn in fp32 (bitsandbytes quantizes fp32 ~6x faster than bf16 on CPU),
                # the state then says bf16, as for a model loaded in bf16: the same bytes
                w = torch.randn(lin.out_features, lin.in_features, generator=g) * 0.02
                q.weight = bnb.nn.Params4bit(
                    w, requires_grad=False, compress_statistics=True, quant_type="nf4", module=q
                ).to("cpu")  # quantized here; the draw is freed
                q.weight.quant_state.dtype = frozen
                del w
                setattr(parent, name, q)
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            norm.weight = nn.Parameter(torch.ones(shape.dim, dtype=frozen), requires_grad=False)
    model.model.norm.weight = nn.Parameter(torch.ones(shape.dim, dtype=frozen))
    # only their bytes are read: zeros (drawing 2 x V x d values took most of the build)
    for m in (model.model.embed_tokens, model.lm_head):
        m.weight = nn.Parameter(torch.zeros(shape.vocab_size, shape.dim, dtype=frozen))
    model.model.rotary_emb = LlamaRotaryEmbedding(cfg)
    assert not any(t.is_meta for t in [*model.parameters(), *model.buffers()])
    torch.manual_seed(seed + 1)
    lora = peft.LoraConfig(
        r=lora_rank, lora_alpha=2 * lora_rank, target_modules="all-linear", lora_dropout=0.0
    )
    return peft.get_peft_model(model, lora)


def unit_bytes(sm, opt=None) -> dict[str, dict[str, int]]:
    """Bytes by kind per unit kind: ``block`` (the mean over the blocks, which are equal) and
    ``fixed`` (every other unit, with the quantization state of every block, which stays whole
    per rank and is reported per block as ``quant_state``), and the gather slots."""
    from _qlora_budget import bytes_by_kind, quant_state_tensors

    def nbytes(ts) -> int:
        return sum(t.untyped_storage().nbytes() for t in ts if t.numel())

    blocks: list[dict[str, int]] = []
    fixed: dict[str, int] = {}
    for u in sm.units:
        packed = [f for f in u.flats if f.packed]
        frozen = [f for f in u.flats if not f.packed and not f.requires_grad]
        train = [f for f in u.flats if f.requires_grad]
        qs = {id(s.kind.quant_state): s.kind.quant_state for f in packed for s in f.slots}
        row = {
            "packed_base": nbytes(f.shard for f in packed),
            "quant_state": nbytes(t for s in qs.values() for t in quant_state_tensors(s)),
            "frozen_other": nbytes(f.shard for f in frozen),
            "adapters": nbytes(f.shard for f in train),
            "adapter_grads": nbytes(f.grad for f in train if f.grad is not None),
            "optimizer": nbytes(
                v
                for f in train
                for p in f.shard_params
                if opt is not None and p in opt.state
                for v in opt.state[p].values()
                if isinstance(v, torch.Tensor) and v.dim()
            ),  # fmt: skip
        }
        if u.is_block:
            blocks.append(row)
        else:
            for k, v in row.items():
                fixed[k] = fixed.get(k, 0) + v
    block = {k: sum(b[k] for b in blocks) // len(blocks) for k in blocks[0]}
    whole = bytes_by_kind(sm, opt)
    fixed["gather_slots"] = whole["gather_slots"]
    return {"block": block, "fixed": fixed, "whole": whole, "n_blocks": {"n": len(blocks)}}
