"""Expert parallelism for the built-in mixture of experts: each rank of an expert-parallel (EP)
group holds ``n_experts / ep`` of a layer's experts, and tokens travel to their experts' ranks and
back by two all-to-alls (as torchtitan, Megatron-Core and transformers' ``AllToAllEP`` do).

One MoE layer's forward on an EP rank, with ``L = n_experts / ep`` local experts (rank ``j`` owns
experts ``j L .. (j + 1) L - 1``):

1. its tokens' top-k choices, one row per (token, choice), sorted by expert, so that the rows for
   each rank are contiguous: ``send[p]`` rows go to rank ``p``;
2. the counts are exchanged (an all-to-all of ``ep`` integers), then the rows and their expert ids
   (all-to-all with uneven splits; the rows' with autograd, whose backward is the reverse
   all-to-all of their gradients);
3. each local expert runs on the rows it received;
4. the outputs travel back by the reverse all-to-all and are weighted and summed per token, as
   without expert parallelism.

What this gives a sharded model: a rank's expert gradients sum the contributions of its EP
group's tokens (the all-to-all's backward brought them back). Data parallelism over the ranks that
hold the same experts then sums the rest; the divisor is still the whole data-parallel world (each
rank's loss is the mean over its own tokens).

With tensor parallelism too (``ExpertGroup.tp``), the ranks of a TP group hold the same tokens
(the activations between TP layers are replicated): each TP rank sends only its share of them
(``tensor_split`` over the TP group) through the four steps, and the MoE output is gathered back
whole over the TP group, as transformers' ``AllToAllEP`` does. Every token then reaches its
experts once, so the expert gradients and the divisor stay as above.

Note: the gradient arriving at a replicated activation is whole (and the same) on every TP rank:
torch's TP styles all-reduce it, as DDP-free replicated math needs. So the gather's backward keeps
this rank's share of it (not a reduce-scatter, which would add the TP ranks' identical copies),
and the share's backward gathers the shares' gradients back into a whole one (``_TPShare``).
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed._functional_collectives import all_to_all_single_autograd

from layershard.engine.collectives import all_gather_single
from layershard.engine.param_kind import EXPERT_ATTR, ExpertPart


class ExpertGroup:
    """Where a layer's experts live: ``group`` (the EP group), this rank's place in it, and the
    experts it owns (``first`` .. ``first + local - 1`` of ``n_experts``)."""

    def __init__(
        self, group: dist.ProcessGroup, n_experts: int, tp: dist.ProcessGroup | None = None
    ) -> None:
        self.group = group
        # the TP group whose ranks hold the same tokens (None: no TP)
        self.tp = tp if tp is not None and dist.get_world_size(tp) > 1 else None
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        if n_experts % self.size:
            raise ValueError(
                f"expert parallelism over {self.size} ranks needs a number of experts divisible "
                f"by it (got {n_experts}); choose ep among the divisors of {n_experts}"
            )
        self.n_experts = n_experts
        self.local = n_experts // self.size
        self.first = self.rank * self.local


def _shares(rows: int, group: dist.ProcessGroup) -> tuple[list[int], int]:
    """Each TP rank's number of rows (``tensor_split``'s) and where this rank's share starts."""
    n, extra = divmod(rows, dist.get_world_size(group))  # tensor_split's: the first ones +1
    sizes = [n + (i < extra) for i in range(dist.get_world_size(group))]
    return sizes, sum(sizes[: dist.get_rank(group)])


def _gather_shares(share: torch.Tensor, sizes: list[int], group: dist.ProcessGroup) -> torch.Tensor:
    """Every TP rank's share (``sizes`` rows each, in rank order) concatenated, on every rank: one
    flat all-gather of shares padded to the largest."""
    most = max(sizes)
    padded = share.new_zeros((most, *share.shape[1:]))
    padded[: share.shape[0]] = share
    out = share.new_empty((len(sizes) * most, *share.shape[1:]))
    all_gather_single(out, padded, group=group)
    return torch.cat([out[i * most : i * most + n] for i, n in enumerate(sizes)])


class _TPShare(torch.autograd.Function):
    """This TP rank's share of replicated rows; the backward gathers the shares' gradients."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group: dist.ProcessGroup) -> torch.Tensor:
        ctx.sizes, start = _shares(x.shape[0], group)
        ctx.group = group
        return x[start : start + ctx.sizes[dist.get_rank(group)]]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return _gather_shares(grad.contiguous(), ctx.sizes, ctx.group), None


class _TPWhole(torch.autograd.Function):
    """The TP ranks' shares of ``rows`` rows gathered whole; the backward keeps this rank's share
    (module Note)."""

    @staticmethod
    def forward(ctx, share: torch.Tensor, rows: int, group: dist.ProcessGroup) -> torch.Tensor:
        sizes, ctx.start = _shares(rows, group)
        ctx.n = share.shape[0]
        return _gather_shares(share.contiguous(), sizes, group)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad[ctx.start : ctx.start + ctx.n], None, None


def _exchange_counts(send: torch.Tensor, eg: ExpertGroup) -> list[int]:
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send, group=eg.group)
    return recv.tolist()


Compute = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def swiglu_experts(gate_up: torch.Tensor, down: torch.Tensor) -> Compute:
    """Step 3 for stacked SwiGLU experts, ``gate_up`` [local, 2 f, dim] and ``down`` [local,
    dim, f]: each local expert on its rows, one matmul pair per expert."""

    def compute(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        y = torch.zeros(rows.shape[0], down.shape[1], dtype=rows.dtype, device=rows.device)
        for e in local.unique().tolist():
            (at,) = torch.where(local == e)
            g, u = F.linear(rows[at], gate_up[e]).chunk(2, dim=-1)
            y = y.index_add(0, at, F.linear(F.silu(g) * u, down[e]))
        return y

    return compute


def expert_parallel_forward(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, eg: ExpertGroup, compute: Compute
) -> torch.Tensor:
    """The MoE output for this rank's tokens ``x`` [tokens, dim], routed by ``index`` and
    ``weights`` [tokens, top_k]; ``compute(rows, local_ids)`` runs the local experts on the rows
    received, each row's expert given by its local id (the module docstring's four steps). With
    ``eg.tp``, ``x``, ``index`` and ``weights`` are the same on every TP rank: each sends its share
    of the tokens, and the output is gathered whole."""
    if eg.tp is None:
        return _dispatch(x, index, weights, eg, compute)
    sizes, start = _shares(x.shape[0], eg.tp)
    mine = slice(start, start + sizes[dist.get_rank(eg.tp)])
    share = _dispatch(
        _TPShare.apply(x, eg.tp), index[mine], _TPShare.apply(weights, eg.tp), eg, compute
    )
    return _TPWhole.apply(share, x.shape[0], eg.tp)


def _dispatch(
    x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, eg: ExpertGroup, compute: Compute
) -> torch.Tensor:
    tokens, top_k = index.shape
    expert = index.flatten()
    order = torch.argsort(expert, stable=True)
    token = order // top_k  # each sorted row's token
    owner = expert[order] // eg.local
    send = torch.bincount(owner, minlength=eg.size)
    recv = _exchange_counts(send, eg)
    send_sizes = send.tolist()
    rows = all_to_all_single_autograd(x[token], recv, send_sizes, eg.group)
    ids = torch.empty(sum(recv), dtype=expert.dtype, device=expert.device)
    dist.all_to_all_single(ids, expert[order].contiguous(), recv, send_sizes, group=eg.group)
    y = compute(rows, ids - eg.first)
    back = all_to_all_single_autograd(y, send_sizes, recv, eg.group)
    w = weights.flatten()[order, None]
    out = torch.zeros_like(x)
    return out.index_add(0, token, (back * w).to(x.dtype))


def keep_local_experts(module: nn.Module, eg: ExpertGroup) -> None:
    """Replace ``module``'s stacked expert parameters (``gate_up_proj`` [E, 2 f, d],
    ``down_proj`` [E, d, f]) by this rank's ``eg.local`` experts, each marked with where it sits
    in the whole (checkpoints and full state dicts hold the whole)."""
    keep = slice(eg.first, eg.first + eg.local)
    with torch.no_grad():
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(module, name)
            part = nn.Parameter(whole[keep].clone(), requires_grad=whole.requires_grad)
            setattr(part, EXPERT_ATTR, ExpertPart(whole.shape, eg.first * whole[0].numel()))
            setattr(module, name, part)


def _hf_forward(own: Callable, eg: ExpertGroup, hidden_states, top_k_index, top_k_weights):
    def compute(rows: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
        # the experts' own forward (transformers' grouped_mm kernel dispatch), top-1 with unit
        # weights on the rows received: the routing weights are applied on the sender's side
        ones = torch.ones(rows.shape[0], 1, dtype=rows.dtype, device=rows.device)
        return own(rows, local[:, None], ones)

    return expert_parallel_forward(hidden_states, top_k_index, top_k_weights, eg, compute)


def is_hf_experts(module: nn.Module) -> bool:
    """transformers' stacked experts (Qwen3-MoE's ``Qwen3MoeExperts``, Mixtral's
    ``MixtralExperts``: ``forward(hidden_states, top_k_index, top_k_weights)`` over 3-D
    ``gate_up_proj`` and ``down_proj``, gated by ``act_fn``)."""
    gate_up, down = getattr(module, "gate_up_proj", None), getattr(module, "down_proj", None)
    return (
        isinstance(gate_up, nn.Parameter) and isinstance(down, nn.Parameter)
        and gate_up.dim() == 3 and down.dim() == 3 and hasattr(module, "act_fn")
        and type(module).__name__.endswith("Experts")
    )  # fmt: skip


def split_hf_experts(
    module: nn.Module, group: dist.ProcessGroup, tp: dist.ProcessGroup | None = None
) -> None:
    """Expert parallelism over the EP ``group`` for transformers' stacked experts
    (``is_hf_experts``): this rank's experts only, and a forward that sends tokens to their
    experts' ranks (an instance ``forward``, ahead of transformers' kernel dispatch, which knows
    nothing of the group)."""
    eg = ExpertGroup(group, int(getattr(module, "gate_up_proj").shape[0]), tp)  # noqa: B009
    keep_local_experts(module, eg)
    own = module.forward  # bound before it is replaced: the experts' own forward
    setattr(module, "num_experts", eg.local)  # noqa: B010 - its own forward's expert count
    module.forward = partial(_hf_forward, own, eg)
