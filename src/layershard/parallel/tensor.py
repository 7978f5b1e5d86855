"""Tensor parallelism under layershard: a model whose blocks torch parallelized
(``torch.distributed.tensor.parallel.parallelize_module``, parameters ``DTensor`` over a TP mesh)
sharded by layershard over its data-parallel group (the ranks with the same TP coordinate).

What the engine does with a ``DTensor`` parameter, and where:

- its *local* shard (``to_local()``) is what goes into the unit's flat buffer: ``ParamSlot.shape``
  is the local shape and ``ParamSlot.tp`` (a ``TPInfo``) keeps the mesh, the placements and the
  global shape and stride (``build._make_flats``, ``init.fill_shards``). Every member of a
  data-parallel group has the same TP coordinate, hence the same local shapes: its flat layout is
  the same on every member, as the engine needs;
- before the unit runs, each gathered local view is wrapped again (``DTensor.from_local``, no
  communication: ``wrap``) so that the TP modules' hooks and DTensor ops see the parameter they
  were given (``Unit.bind``). ``from_local``'s backward hands the engine the gradient of the local
  view, redistributed to the parameter's placements when it came back in another one: what the
  reducer reduces is a plain local tensor, as for any parameter;
- the gradient norm (``grad_norm``): the squares of a TP-sharded parameter's local gradient are
  summed over the TP group too; a parameter replicated over TP is counted once, not once per TP
  rank;
- a DTensor weight that a unit's forward saves for its backward is kept as its place in the
  unit's buffer, as a plain weight view is (``split_dtensor``; ``backward.SavedDTensor``);
- ``full_state_dict`` assembles the whole tensor over the TP group (``full_tensor``), and
  ``load_full_state_dict`` keeps each rank's part of it (``local_of_full``).

``data_parallel(mesh)``: ``ls.shard`` options from a mesh of named dims. ``llama_tp_plan`` /
``parallelize_llama``: the Megatron plan for the built-in Llama's blocks; ``hf_tp_plan`` /
``parallelize_hf``: a transformers model's own ``base_model_tp_plan`` as torch's styles.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import (
    DTensor,
    Placement,
    Replicate,
    Shard,
    distribute_module,
    distribute_tensor,
)
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)


@dataclass(frozen=True)
class TPInfo:
    """What re-wraps a parameter's local shard as the ``DTensor`` it was: its mesh, placements
    and global shape and stride."""

    mesh: DeviceMesh
    placements: tuple[Placement, ...]
    shape: torch.Size
    stride: tuple[int, ...]

    @property
    def sharded(self) -> bool:
        """Does each TP rank hold a different part (else every rank holds it whole)?"""
        return any(isinstance(p, Shard) for p in self.placements)

    @property
    def group(self) -> dist.ProcessGroup:
        """The TP group (a 1-D mesh)."""
        return self.mesh.get_group()


def info(p: torch.Tensor) -> TPInfo | None:
    """A ``DTensor`` parameter's ``TPInfo``; None for a plain tensor."""
    if not isinstance(p, DTensor):
        return None
    if p.device_mesh.ndim != 1:
        raise ValueError(
            "shard(): a DTensor parameter over a mesh of more than one dimension; layershard is "
            "the data-parallel axis: pass parameters distributed over the TP mesh only "
            "(mesh['tp']) and the data-parallel group as ls.shard(process_group=...)"
        )
    return TPInfo(p.device_mesh, tuple(p.placements), p.shape, tuple(p.stride()))


def split_dtensor(t: torch.Tensor) -> tuple[torch.Tensor, TPInfo] | None:
    """A ``DTensor``'s local tensor (no autograd) and what wraps it again; None for another
    tensor. The saved-tensor hooks (engine/backward.py) save a DTensor over a unit's gathered
    weights as where in the unit's buffer, as they save a plain weight view."""
    if not isinstance(t, DTensor):
        return None
    spec = TPInfo(t.device_mesh, tuple(t.placements), t.shape, tuple(t.stride()))
    return cast(DTensor, t.detach()).to_local(), spec  # detached: no autograd node, an alias


def local(p: torch.Tensor) -> torch.Tensor:
    """What a parameter contributes to its unit's flat buffer: a ``DTensor``'s local shard."""
    return p.to_local() if isinstance(p, DTensor) else p


def local_shape(p: torch.Tensor) -> torch.Size:
    return local(p).shape


def wrap(tp: TPInfo, t: torch.Tensor) -> DTensor:
    """``t`` (the local shard, e.g. a view of a gathered buffer) as the parameter's ``DTensor``;
    no communication. Differentiable: the gradient of ``t`` is the local part of the DTensor's
    gradient in the parameter's placements."""
    return DTensor.from_local(
        t, tp.mesh, tp.placements, run_check=False, shape=tp.shape, stride=tp.stride
    )


@torch.no_grad()
def full_tensor(tp: TPInfo, t: torch.Tensor) -> torch.Tensor:
    """The whole parameter from this rank's local shard ``t``. Collective over the TP group."""
    return wrap(tp, t).full_tensor()


@torch.no_grad()
def local_of_full(tp: TPInfo, full: torch.Tensor) -> torch.Tensor:
    """This rank's local shard of the whole parameter ``full``: a view of it where it lies (no
    communication, and no copy of the whole tensor to the mesh's device, which
    ``distribute_tensor`` makes: meta init slices whole CPU tensors of a CUDA mesh's model)."""
    (placement,) = tp.placements  # a 1-D TP mesh (``info`` refuses others)
    if type(placement) is Replicate:
        return full
    if type(placement) is not Shard:  # _StridedShard...
        return distribute_tensor(full, tp.mesh, tp.placements, src_data_rank=None).to_local()
    # torch's Shard splits as torch.chunk does: ceil(n / size) each, the last ones fewer or none
    d, size = placement.dim % full.ndim, tp.mesh.size()
    n = full.shape[d]
    step = -(-n // size)
    start = min(step * dist.get_rank(tp.group), n)
    return full.narrow(d, start, min(step, n - start))


def check_groups(params: Iterable[torch.Tensor], group: dist.ProcessGroup) -> None:
    """Refuse DTensor parameters whose TP mesh shares a rank other than this one with the
    data-parallel ``group``: the members of a data-parallel group must hold the same part of each
    parameter (the same TP coordinate), or the gathered flat buffer would mix different parts."""
    group_of = tp_group(info(p) for p in params)
    if group_of is None:
        return
    both = set(dist.get_process_group_ranks(group_of)) & set(dist.get_process_group_ranks(group))
    if len(both) > 1:
        raise ValueError(
            f"shard(): ranks {sorted(both)} are in the TP mesh of the DTensor parameters and in "
            "the data-parallel process_group; pass the group of the ranks with this rank's TP "
            "coordinate (ls.shard(model, **layershard.parallel.tensor.data_parallel(mesh)))"
        )


def checkpoint_group(model, what: str) -> dist.ProcessGroup | None:
    """The group a checkpoint or an export of ``model`` runs over: its process group, or every
    rank (the default group) for a tensor-parallel model: each TP coordinate's data-parallel
    group holds other parts of the same parameters, which one DCP save or load must see
    together. A tensor-parallel model over part of the world is refused in one line."""
    group = tp_group(s.tp for f in model.flat_params for s in f.slots)
    if group is None:
        return model.process_group
    dp = dist.get_world_size(model.process_group)
    if dp == dist.get_world_size():  # sharded from meshes over every rank (TP x EP)
        return model.process_group
    if dp * dist.get_world_size(group) != dist.get_world_size():
        raise NotImplementedError(
            f"{what}: a tensor-parallel model over part of the world is not supported; shard it "
            "over every rank (its data-parallel x TP mesh the whole world), or use "
            "model.full_state_dict() and load_full_state_dict()"
        )
    return dist.group.WORLD


def tp_group(infos: Iterable[TPInfo | None]) -> dist.ProcessGroup | None:
    """The TP group of a model's ``DTensor`` parameters (None: it has none). One TP mesh only."""
    ranks = dist.get_process_group_ranks
    groups = {tuple(ranks(t.group)): t.group for t in infos if t is not None}
    if len(groups) > 1:
        raise ValueError("shard(): DTensor parameters over more than one TP mesh")
    return next(iter(groups.values()), None)


def split_over_tp(slot) -> bool:
    """Does each TP rank hold a different part of the parameter of ``slot`` (a ``ParamSlot``;
    its gradient's squares summed over the TP group), or every TP rank the same (counted once)?
    Split: a TP-sharded DTensor's, and experts split by expert parallelism (with TP, the ranks of
    a replica hold different experts or different shards of them)."""
    return slot.expert is not None or (slot.tp is not None and slot.tp.sharded)


def grad_norm(
    terms: list[tuple[Any, torch.Tensor]],
    norm_type: float,
    reduce_dp: Callable[[torch.Tensor, Any], torch.Tensor],
    group: dist.ProcessGroup,
    device: torch.device,
) -> torch.Tensor:
    """The norm of the whole gradient of a TP x DP model, from ``(ParamSlot, gradient slice)`` of
    this rank's slices. ``reduce_dp`` reduces over the data-parallel (shard) group; then the
    TP-sharded parameters' part is reduced over the TP ``group``, and the part replicated over TP
    (the same on every TP rank) is counted once. Collective over both groups."""
    inf = math.isinf(norm_type)

    def part(grads: list[torch.Tensor]) -> torch.Tensor:
        if not grads:
            return torch.zeros((), device=device)
        norms = torch.stack(list(torch._foreach_norm(grads, norm_type)))
        return norms.max() if inf else norms.pow(norm_type).sum()

    sharded = [g for slot, g in terms if split_over_tp(slot)]
    whole = [g for slot, g in terms if not split_over_tp(slot)]
    op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
    both = reduce_dp(torch.stack([part(sharded), part(whole)]), op)
    over_tp = both[:1].clone()
    dist.all_reduce(over_tp, op=op, group=group)
    total = torch.maximum(over_tp[0], both[1]) if inf else over_tp[0] + both[1]
    return total if inf else total.pow(1.0 / norm_type)


def data_parallel(mesh: DeviceMesh) -> dict[str, Any]:
    """``ls.shard`` options that make layershard the data-parallel axis of ``mesh``, a
    ``DeviceMesh`` with named dims ``("dp_shard", "tp")`` or ``("dp_replicate", "dp_shard",
    "tp")`` (transformers' and torchtitan's names): ``process_group``, the ranks with this rank's
    TP coordinate, and with ``dp_replicate`` > 1 ``strategy="hybrid"`` over the (replicate,
    shard) mesh. Use: ``ls.shard(model, **data_parallel(mesh))`` after parallelizing the model
    over ``mesh["tp"]``. Collective (makes one group per TP coordinate with more than one
    data-parallel dim)."""
    names = tuple(mesh.mesh_dim_names or ())
    if names not in (("dp_shard", "tp"), ("dp_replicate", "dp_shard", "tp")):
        raise ValueError(
            f"data_parallel(mesh): dims {names} given; ('dp_shard', 'tp') or "
            "('dp_replicate', 'dp_shard', 'tp') expected"
        )
    if len(names) == 2 or mesh["dp_replicate"].size() == 1:
        return {"process_group": mesh["dp_shard"].get_group()}
    dp_mesh = mesh["dp_replicate", "dp_shard"]
    ranks = mesh.mesh.reshape(-1, mesh["tp"].size())  # a column per TP coordinate
    mine = None
    for column in ranks.t().tolist():  # every rank makes every group, in the same order
        group = dist.new_group(column)
        if dist.get_rank() in column:
            mine = group
    assert mine is not None, "data_parallel(mesh): this rank is not in the mesh"
    return {"process_group": mine, "strategy": "hybrid", "mesh": dp_mesh}


def from_mesh(
    mesh: DeviceMesh | None, process_group: dist.ProcessGroup | None, strategy: str
) -> tuple[dist.ProcessGroup | None, str, DeviceMesh | None]:
    """``shard(mesh=...)`` with a ``tp`` dim (``data_parallel``'s names): the data-parallel group,
    the strategy (``hybrid`` when ``dp_replicate`` > 1) and the (replicate, shard) mesh it gives;
    any other mesh (HSDP's 2-D one) passes through unchanged."""
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return process_group, strategy, mesh
    if process_group is not None:
        raise ValueError(
            "shard(mesh=...): a mesh with a 'tp' dim gives the data-parallel group itself; "
            "pass no process_group"
        )
    options = data_parallel(mesh)
    if "strategy" in options:
        if strategy not in ("full", "hybrid"):
            raise ValueError(
                f"shard(mesh=...): dp_replicate > 1 is HSDP (strategy='hybrid'), not {strategy!r}"
            )
        strategy = "hybrid"
    return options["process_group"], strategy, options.get("mesh")


# ---- the built-in Llama ----------------------------------------------------------------------


def llama_tp_plan() -> dict[str, ParallelStyle]:
    """``parallelize_module`` plan for one built-in Llama block (``models/llama.py``'s
    ``Block``): attention q/k/v and the MLP's gate (w1) and up (w3) projections column-wise, the
    attention output (wo) and the MLP's down projection (w2) row-wise. Norms stay replicated;
    activations between the sub-blocks are whole (replicated) on every TP rank. A
    mixture-of-experts block takes the attention part only: its router stays replicated and its
    experts are split by expert parallelism (``ls.parallelize(tp=, ep=)``) or replicated."""
    return {
        "attn.wq": ColwiseParallel(),
        "attn.wk": ColwiseParallel(),
        "attn.wv": ColwiseParallel(),
        "attn.wo": RowwiseParallel(),
        "mlp.w1": ColwiseParallel(),
        "mlp.w3": ColwiseParallel(),
        "mlp.w2": RowwiseParallel(),
    }


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply ``llama_tp_plan`` to every block of a built-in Llama (``LlamaForCausalLM``) over the
    1-D ``tp_mesh``, and give each attention its local head counts (the column-parallel q/k/v
    produce ``heads / tp`` heads per rank). The embedding, final norm and head stay replicated.
    Returns ``model``."""
    tp = tp_mesh.size()
    for block in model.layers:  # type: ignore[union-attr]
        attn = block.attn
        if attn.n_heads % tp or attn.n_kv_heads % tp:
            raise ValueError(
                f"parallelize_llama: n_heads={attn.n_heads} and n_kv_heads={attn.n_kv_heads} "
                f"must be divisible by the TP size {tp}"
            )
        plan = llama_tp_plan()
        if not hasattr(block.mlp, "w1"):  # a MoE block: its experts go to EP (or stay whole)
            plan = {name: style for name, style in plan.items() if name.startswith("attn.")}
        parallelize_module(block, tp_mesh, plan)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    return model


# ---- Hugging Face models ---------------------------------------------------------------------


class ReplicatedOverHeads(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce`` (Qwen3's q/k norms): a norm over each
    head's features that every TP rank runs on its own heads. Its parameters become
    ``Replicate()`` DTensors and its input (``(..., heads, head_dim)``, this rank's heads) a
    DTensor split over the heads dim, so DTensor's rules make the weight's gradient a partial sum
    over the TP ranks' heads, redistributed (all-reduced over TP) to the weight's placement when
    the engine's re-wrapped view (``wrap``) hands it back: the all-reduce transformers' hook
    does. The output goes on as this rank's plain local tensor, as the column-wise projection's
    did."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def heads_in(_module, inputs, mesh):
            x = inputs[0]
            return (DTensor.from_local(x, mesh, [Shard(x.ndim - 2)], run_check=False), *inputs[1:])

        def local_out(_module, output, _mesh):
            return output.to_local()

        # no partition_fn: distribute_module replicates every parameter over the mesh
        return distribute_module(module, device_mesh, input_fn=heads_in, output_fn=local_out)


_HF_STYLES: dict[str, Callable[[], ParallelStyle]] = {
    "colwise": ColwiseParallel,
    "rowwise": RowwiseParallel,
    "replicated_with_grad_allreduce": ReplicatedOverHeads,
}


def hf_tp_plan(config, experts: bool = True) -> dict[str, ParallelStyle]:
    """A transformers config's ``base_model_tp_plan`` (``{"layers.*.self_attn.q_proj":
    "colwise", ...}``) as a ``parallelize_module`` plan for the model's ``base_model``: the
    column- and row-wise styles (Llama's, Mistral's) and Qwen3's ``replicated_with_grad_allreduce``
    norms (``ReplicatedOverHeads``); any other style (a ``gather``, transformers' packed
    experts') is refused in one line. ``experts=False``: without the routed experts' entries
    (``*.mlp.experts*``: expert parallelism splits them instead), which leaves Mixtral's plan
    column- and row-wise."""
    plan = getattr(config, "base_model_tp_plan", None) or {}
    if not experts:
        plan = {k: v for k, v in plan.items() if ".experts" not in k}
    if not plan:
        raise ValueError("hf_tp_plan: the config has no base_model_tp_plan")
    odd = sorted({style for style in plan.values() if style not in _HF_STYLES})
    if odd:
        raise NotImplementedError(
            f"hf_tp_plan: the styles {odd} of {type(config).__name__}'s base_model_tp_plan are "
            f"not supported (only {', '.join(map(repr, _HF_STYLES))}); pass your own "
            "parallelize_module plan"
        )
    return {name: _HF_STYLES[style]() for name, style in plan.items()}


def parallelize_hf(model: nn.Module, tp_mesh: DeviceMesh, experts: bool = True) -> nn.Module:
    """Apply the model's own ``base_model_tp_plan`` (``hf_tp_plan``; ``experts=False``: but its
    routed experts', which expert parallelism splits) to a transformers model's ``base_model``
    over the 1-D ``tp_mesh`` with torch's ``parallelize_module`` (transformers' attention
    reshapes to ``-1`` heads, so each rank runs its local heads). Returns ``model``."""
    config = model.config
    tp = tp_mesh.size()
    for key in ("num_attention_heads", "num_key_value_heads"):
        n = getattr(config, key, None)
        if n is not None and n % tp:
            raise ValueError(f"parallelize_hf: {key}={n} must be divisible by the TP size {tp}")
    base = model.base_model
    assert isinstance(base, nn.Module), "parallelize_hf: a transformers model was expected"
    parallelize_module(base, tp_mesh, hf_tp_plan(config, experts))
    return model
