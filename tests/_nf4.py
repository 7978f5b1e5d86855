"""A small torchao-NF4 QLoRA model for the tests, built as torchtune builds one: the tiny Llama of
``_parity`` with every linear of its blocks a frozen ``NF4Tensor`` weight computed by
``linear_nf4`` and a LoRA adapter beside it (PEFT does not wrap NF4 linears). Everything but the
adapters is frozen. Deterministic: every rank builds the same bytes and the same adapters."""

from __future__ import annotations

import math

import torch
from _parity import tiny_llama
from torch import nn

BLOCK, SCALER_BLOCK = 64, 8  # torchtune's block of 64; scaler blocks that the tiny shapes divide
RANK, ALPHA = 4, 8.0
TARGETS = {"attn": ("wq", "wk", "wv", "wo"), "mlp": ("w1", "w2", "w3")}


def nf4():
    """torchao's NF4 module (0.18's path), imported here, by the test, never by layershard;
    its ``clone`` made to copy the bytes and state (``_clone``)."""
    from torchao.quantization.quantize_.workflows.nf4 import nf4_tensor

    nf4_tensor.NF4_OPS_TABLE[torch.ops.aten.clone.default] = _clone
    return nf4_tensor


def _clone(func, args, kwargs=None):
    """torchao 0.18's ``NF4Tensor`` clone (which ``deepcopy`` and ``.clone()`` run: the tests'
    reference copies the model) re-quantizes the dequantized values with the default scaler block
    of 256, which these shapes do not divide, and would not keep the bytes anyway: copy them."""
    t = args[0]
    names, meta = t.__tensor_flatten__()
    inner = {n: getattr(t, n).clone() for n in names}
    return type(t).__tensor_unflatten__(inner, meta, t.size(), t.stride())


class NF4LoRALinear(nn.Module):
    """torchtune's ``LoRALinear(quantize_base=True)``: ``linear_nf4(x, weight)`` plus
    ``alpha / r * lora_b(lora_a(x))``."""

    def __init__(self, weight: torch.Tensor, g: torch.Generator) -> None:
        super().__init__()
        out_dim, in_dim = weight.shape
        q = nf4().to_nf4(weight.detach(), block_size=BLOCK, scaler_block_size=SCALER_BLOCK)
        self.weight = nn.Parameter(q, requires_grad=False)
        self.lora_a = nn.Linear(in_dim, RANK, bias=False)
        self.lora_b = nn.Linear(RANK, out_dim, bias=False)
        with torch.no_grad():
            bound = 1 / math.sqrt(in_dim)
            self.lora_a.weight.uniform_(-bound, bound, generator=g)
            # drawn, not zero: every adapter matters from the first step
            self.lora_b.weight.normal_(0, 0.02, generator=g)
        self.scale = ALPHA / RANK

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nf4().linear_nf4(x, self.weight) + self.scale * self.lora_b(self.lora_a(x))


def nf4_llama(seed: int = 0, n_layers: int = 3) -> nn.Module:
    """The tiny Llama (3 blocks: two gather slots taken in turn, so a block's slot holds another
    block's bytes between its forward and its backward) as a QLoRA model."""
    model = tiny_llama(seed, n_layers=n_layers)
    g = torch.Generator().manual_seed(seed + 1)
    for p in model.parameters():
        p.requires_grad_(False)
    for block in model.layers:
        for part, names in TARGETS.items():
            owner = getattr(block, part)
            for name in names:
                setattr(owner, name, NF4LoRALinear(getattr(owner, name).weight, g))
    return model


def nf4_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every NF4 weight by name (the live parameters)."""
    cls = nf4().NF4Tensor
    return {n: p for n, p in model.named_parameters() if isinstance(p, cls)}
