"""Expert parallelism's token exchange (parallel/expert.py) on the built-in MoE, without sharding:
at 4 ranks, EP groups {0, 1} and {2, 3} each split a layer's 4 experts in two; the ranks holding
the same experts ({0, 2}, {1, 3}) sum their expert gradients, every rank sums the others, as data
parallelism would. Against one process on the same micro-batches (_parity.py's `exact_parts`: the
load-balancing loss is per rank): the first step's gradients within the spread of the legitimate
orders of the ranks' sum, and each step's loss.

What this pins down for the sharded EP of issue 32: the all-to-all's backward brings every token's
expert gradient home to the expert's rank, and the divisor of the expert gradients is the whole
data-parallel world (4), not the number of ranks holding an expert (2)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from _dist import RankChecks
from _parity import (
    LOSS_RTOL,
    batches,
    clone,
    global_mean,
    grad_bound,
    grad_error,
    grads_in_orders,
    lm_loss,
    local,
)
from test_moe import tiny_moe

from layershard.parallel.expert import ExpertGroup

checks = RankChecks(world_size=4)
EP = 2


def _groups(rank: int, world: int):
    """This rank's EP group (consecutive ranks) and the group of ranks with the same experts."""
    mine = None
    for start in range(0, world, EP):
        g = dist.new_group(list(range(start, start + EP)))
        if rank in range(start, start + EP):
            mine = g
    same = None
    for j in range(EP):
        g = dist.new_group(list(range(j, world, EP)))
        if rank % EP == j:
            same = g
    return mine, same


def _ep_grads(model, ep_group, same, world: int) -> dict[str, torch.Tensor]:
    """Every parameter's data-parallel gradient, expert tensors whole (gathered over EP)."""
    out = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        if "experts" in name:
            dist.all_reduce(g, group=same)
            g /= world
            parts = [torch.empty_like(g) for _ in range(EP)]
            dist.all_gather(parts, g, group=ep_group)
            g = torch.cat(parts)
        else:
            dist.all_reduce(g)
            g /= world
        out[name] = g
    return out


@checks.check
def expert_parallel_matches_one_process(rank: int, world: int) -> None:
    base = tiny_moe()
    ep_group, same = _groups(rank, world)
    batch = batches(1)[0]
    ref_grads, orders = grads_in_orders(base, batch, world, exact_parts=True)
    model = clone(base)
    for layer in model.layers:
        layer.mlp.experts.split_experts(
            ExpertGroup(ep_group, layer.mlp.experts.gate_up_proj.shape[0])
        )
    assert model.layers[0].mlp.experts.gate_up_proj.shape[0] == 4 // EP
    loss = lm_loss(model, local(batch, rank, world))
    loss.backward()
    ours = global_mean(loss)
    ref = sum(lm_loss(clone(base), local(batch, r, world)).item() for r in range(world)) / world
    assert abs(ours - ref) <= LOSS_RTOL * abs(ref), (ours, ref)
    grads = _ep_grads(model, ep_group, same, world)
    err, bound = grad_error(grads, ref_grads), grad_bound(ref_grads, orders)
    assert err <= bound, f"gradient {err:.2e} from the reference's > {bound:.2e}"
    # the negative control: expert gradients divided by the ranks holding an expert (2), not
    # by the data-parallel world (4), are off by 2x
    wrong = {k: g * (world // EP) if "experts" in k else g for k, g in grads.items()}
    assert grad_error(wrong, ref_grads) > 0.5


checks.collect(globals())
