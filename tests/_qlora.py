"""A small QLoRA model for the tests: a HF Llama built from a config, saved, loaded back with
``BitsAndBytesConfig(load_in_4bit=True)`` (bitsandbytes quantizes on the CPU), and wrapped by
PEFT's ``get_peft_model`` as a user would. Deterministic: every rank builds the same bytes and the
same adapters."""

from __future__ import annotations

import tempfile

import torch

V, HIDDEN, FFN = 96, 64, 128  # no quantized weight has the shape of another tensor (see tests)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def save_base(path: str, seed: int = 0, layers: int = 2) -> None:
    import transformers as T

    torch.manual_seed(seed)
    cfg = T.LlamaConfig(
        vocab_size=V, hidden_size=HIDDEN, intermediate_size=FFN, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    model = T.LlamaForCausalLM(cfg)
    model.should_save_on_this_rank = lambda *_: True  # every rank writes its own folder
    model.save_pretrained(path)


def bnb_config(quant_type: str = "nf4", double_quant: bool = True, storage=torch.uint8):
    import transformers as T

    return T.BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type=quant_type,
        bnb_4bit_use_double_quant=double_quant,
        bnb_4bit_compute_dtype=torch.float32,  # this CPU has no fast bf16 matmul
        bnb_4bit_quant_storage=storage,
    )


def load_4bit(path: str, quant_type: str = "nf4", double_quant: bool = True, storage=torch.uint8):
    import transformers as T

    model = T.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=bnb_config(quant_type, double_quant, storage),
        device_map="cpu", dtype=torch.float32,
    )  # fmt: skip
    # bitsandbytes swaps in a bf16 CPU kernel (and repacks the weight in place) for an eval-mode
    # forward without grad on AVX512-BF16 CPUs: another computation than the training one. The
    # reference must compute what ls.shard computes (which always turns it off: four_bit.py).
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False
    return model


def lora_config():
    import peft

    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, lora_dropout=0.0)


def qlora_model(
    quant_type: str = "nf4", double_quant: bool = True, seed: int = 0, storage=torch.uint8
):
    """The PEFT model on a 4-bit base; lora_B drawn (not zero) so that every adapter matters
    from the first step."""
    import peft

    with tempfile.TemporaryDirectory() as d:
        save_base(d, seed)
        base = load_4bit(d, quant_type, double_quant, storage)
    torch.manual_seed(seed + 1)
    model = peft.get_peft_model(base, lora_config())
    for name, p in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(p, std=0.02)
    model.eval()  # no dropout anywhere: the reference is deterministic
    return model


def batches(steps: int, seed: int, batch: int = 8, seq: int = 12) -> list[torch.Tensor]:
    """Token batches of the QLoRA model's vocabulary."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, V, (batch, seq), generator=g) for _ in range(steps)]


def causal_loss(model, x: torch.Tensor) -> torch.Tensor:
    """The HF model's own causal-LM loss on ``x``."""
    return model(input_ids=x, labels=x).loss


def packed_weights(model) -> dict[str, torch.Tensor]:
    """Every 4-bit weight by name (the live Params4bit objects)."""
    from bitsandbytes.nn import Params4bit

    return {n: p for n, p in model.named_parameters() if isinstance(p, Params4bit)}


def check_base_untrained(model, opt) -> None:
    """A sharded QLoRA model's packed base after training (bitsandbytes or NF4): the packed flat
    groups have no gradient, their registered slices are bytes (uint8) without one, and no
    optimizer state belongs to them (the optimizer's state is the trainable parameters')."""
    packed = [f for f in model.flat_params if f.packed]
    assert packed and all(not f.requires_grad and f.grad is None for f in packed)
    packed_params = {id(p) for f in packed for p in f.shard_params}
    for f in packed:
        for p in f.shard_params:
            assert p.dtype == torch.uint8 and not p.requires_grad and p.grad is None
    for p, st in opt.state.items():
        assert id(p) not in packed_params and all(
            not isinstance(v, torch.Tensor) or v.dtype != torch.uint8 for v in st.values()
        )
    assert len(opt.state) == sum(p.requires_grad for p in model.parameters())
