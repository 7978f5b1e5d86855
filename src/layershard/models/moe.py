"""Mixture-of-experts feed-forward: a top-k router over routed SwiGLU experts, and the
Switch-Transformer load-balancing loss.

The math and the parameter layout are Hugging Face's Mixtral (transformers 5): the router is a
bias-free linear map to one logit per expert, softmax in fp32, the top-k probabilities
renormalized to sum to one; each expert's gate and up projections are one ``[2 * ffn, dim]``
matrix (gate first), its down projection ``[dim, ffn]``, and the experts of a layer are stacked
into 3-D parameters (``experts.gate_up_proj``, ``experts.down_proj``). The stacking is also what
expert parallelism splits (dimension 0). ``tests/models/test_moe.py`` checks logits and loss against
``MixtralForCausalLM`` with the same weights.

The load-balancing loss pools every layer's routing, as HF's ``load_balancing_loss_func``: with
``f_e`` the share of top-k choices that went to expert ``e`` and ``P_e`` its mean router
probability, both over all layers and tokens, ``aux = E * sum_e f_e * P_e`` (1 when perfectly
balanced and top-1; ``top_k`` when balanced at top-k). Each MoE block returns its routing
statistics with its output (``Routing``), so that the loss is computed from tensors that left
the block through its output, as every other gradient path does.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from layershard.parallel.expert import (
    ExpertGroup,
    expert_parallel_forward,
    keep_local_experts,
    swiglu_experts,
)


@dataclass
class Routing:
    """One MoE layer's routing, summed over its tokens: the top-k choices per expert (no
    gradient), the router probabilities per expert (with gradient) and the number of tokens."""

    choices: torch.Tensor  # [E] float32
    probs: torch.Tensor  # [E] float32
    tokens: int

    def __add__(self, other: Routing) -> Routing:
        return Routing(
            self.choices + other.choices, self.probs + other.probs, self.tokens + other.tokens
        )


def balance_loss(routing: Routing, group: dist.ProcessGroup | None = None) -> torch.Tensor:
    """``E * sum_e f_e * P_e`` over the pooled routing of all layers (see the module docstring).

    ``group``: context parallelism's group, whose ranks hold parts of the same sequences. The
    choices and the token count are then the group's (an all-reduce; no gradient flows
    through them), and ``P_e`` this rank's share of the group's, times the group's size: the
    convention of the LM loss under CP (``ContextParallel.loss_divisor``), whose mean over the
    ranks is the whole sequences' loss and whose gradients, averaged by the engine over every
    rank, are the whole sequences' too."""
    n_experts, choices = routing.choices.numel(), routing.choices
    tokens: int | torch.Tensor = routing.tokens
    scale = 1
    if group is not None:
        stats = torch.cat([choices, choices.new_tensor([tokens])])
        dist.all_reduce(stats, group=group)
        choices, tokens, scale = stats[:-1], stats[-1], dist.get_world_size(group)
    return scale * n_experts * torch.sum((choices / tokens) * (routing.probs / tokens))


class Router(nn.Module):
    def __init__(self, dim: int, n_experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.weight = nn.Parameter(torch.empty(n_experts, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x: [tokens, dim] -> (probabilities [tokens, E] fp32, top-k weights, top-k indices)."""
        probs = torch.softmax(F.linear(x, self.weight).float(), dim=-1)
        top, index = torch.topk(probs, self.top_k, dim=-1)
        return probs, top / top.sum(dim=-1, keepdim=True), index


class Experts(nn.Module):
    """``n_experts`` SwiGLU feed-forwards stacked into two 3-D parameters."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, n_layers: int) -> None:
        super().__init__()
        self.n_layers, self.n_experts = n_layers, n_experts
        self.gate_up_proj = nn.Parameter(torch.empty(n_experts, 2 * ffn_dim, dim))
        self.down_proj = nn.Parameter(torch.empty(n_experts, dim, ffn_dim))
        self.ep: ExpertGroup | None = None  # expert parallelism: see split_experts
        self.reset_parameters()

    def split_experts(self, eg: ExpertGroup) -> None:
        """Keep only this rank's experts of ``eg`` (parallel/expert.py); tokens then reach them
        by all-to-all."""
        keep_local_experts(self, eg)
        self.ep = eg

    def reset_parameters(self) -> None:
        nn.init.normal_(self.gate_up_proj, mean=0.0, std=0.02)
        nn.init.normal_(self.down_proj, mean=0.0, std=0.02 / math.sqrt(2 * self.n_layers))

    def forward(self, x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x: [tokens, dim]; each token through its top-k experts, weighted and summed. Experts
        no token chose are skipped (their weights get a zero gradient)."""
        if self.ep is not None:
            compute = swiglu_experts(self.gate_up_proj, self.down_proj)
            return expert_parallel_forward(x, index, weights, self.ep, compute)
        out = torch.zeros_like(x)
        for e in index.unique().tolist():
            token, slot = torch.where(index == e)
            gate, up = F.linear(x[token], self.gate_up_proj[e]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[e])
            out.index_add_(0, token, (y * weights[token, slot, None]).to(out.dtype))
        return out


class MoE(nn.Module):
    """The routed feed-forward of a block: returns its output and its ``Routing``."""

    def __init__(self, dim: int, ffn_dim: int, n_experts: int, top_k: int, n_layers: int) -> None:
        super().__init__()
        self.gate = Router(dim, n_experts, top_k)
        self.experts = Experts(dim, ffn_dim, n_experts, n_layers)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, Routing]:
        flat = x.reshape(-1, x.shape[-1])
        probs, weights, index = self.gate(flat)
        out = self.experts(flat, index, weights).reshape(x.shape)
        choices = torch.bincount(index.flatten(), minlength=probs.shape[-1]).float()
        return out, Routing(choices, probs.sum(dim=0), flat.shape[0])
