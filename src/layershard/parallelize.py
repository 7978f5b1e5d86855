"""``ls.parallelize``: an N-D run in one call. The model's experts split over ``ep`` ranks
(``parallel/expert.py``), its blocks over ``tp`` ranks (the model's plan:
``models/llama_tp.py``, ``models/hf_tp.py``) or its sequences over ``cp`` ranks (context
parallelism: ``parallel/context/``), then layershard's sharding as the data-parallel axis
(``ls.shard(model, mesh=, expert_mesh=)``) over the meshes of ``meshes.py``.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch import nn

from layershard.engine import options
from layershard.meshes import context_group, hybrid_replicas, make_meshes
from layershard.models import hf_context
from layershard.models.llama import Attention, LlamaForCausalLM
from layershard.models.moe import Experts
from layershard.parallel.context import ContextParallel, is_transformers_model
from layershard.parallel.expert import ExpertGroup, is_hf_experts, split_hf_experts
from layershard.sharded import shard


def split_experts(
    model: nn.Module, group: dist.ProcessGroup, tp: dist.ProcessGroup | None = None
) -> int:
    """Keep on this rank its share (over the EP ``group``) of every expert layer: the built-in
    MoE's ``Experts`` and transformers' stacked experts (Qwen3-MoE, Mixtral); returns how many
    layers were split. ``tp``: the TP group whose ranks hold the same tokens (each sends its
    share: parallel/expert.py)."""
    n = 0
    for m in model.modules():
        if isinstance(m, Experts):
            m.split_experts(ExpertGroup(group, m.n_experts, tp))
        elif is_hf_experts(m):
            split_hf_experts(m, group, tp)
        else:
            continue
        n += 1
    return n


def parallelize(
    model: nn.Module,
    *,
    tp: int = 1,
    ep: int = 1,
    dp_replicate: int = 1,
    cp: int = 1,
    cp_mode: str = "ring",
    **shard_options: Any,
):
    """Shard ``model`` over every rank with tensor parallelism ``tp`` (torch's
    ``parallelize_module`` with the built-in Llama's plan or a transformers model's
    ``base_model_tp_plan``: models/llama_tp.py, models/hf_tp.py) or expert parallelism ``ep`` (its experts split
    over ``ep`` ranks, tokens exchanged by all-to-all), replicas ``dp_replicate`` (HSDP) and
    the rest data-parallel sharding; returns ``ls.shard``'s ``ShardedModule``. Every rank passes
    the same (unsplit) model. ``shard_options`` go to ``ls.shard`` (``mixed_precision=``,
    ``activation_checkpointing=``...). ``strategy="hybrid"`` is ``ls.shard``'s HSDP said the
    other way: ``shard_size`` ranks (default: a node's) hold one replica, so ``dp_replicate =
    world / shard_size`` (``layershard train --strategy hybrid`` and ``ShardingPlugin`` say it so).

    ``cp``: context parallelism, each sequence split over ``cp`` consecutive ranks (the built-in
    Llama or a transformers model; ep 1; with ``tp`` the CP groups of the ranks sharing a TP
    coordinate), attention by ``cp_mode`` ``"ring"`` or
    ``"all_to_all"``; the weights sharded over ``dp_shard x cp`` (``context_parallel``,
    docs/context-parallel.md).
    """
    options.check(
        "parallelize()", tp=tp, ep=ep, dp_replicate=dp_replicate, cp=cp, cp_mode=cp_mode,
        **shard_options,
    )  # fmt: skip
    if not dist.is_initialized():
        raise RuntimeError("parallelize(): call ls.init_distributed() first")
    dp_replicate = _replicas(shard_options, dp_replicate)
    decided = ("mesh", "expert_mesh", "process_group", "shard_size")
    for key in decided:
        if shard_options.get(key) is not None:
            raise ValueError(f"parallelize(): {key}= is decided by tp/ep/dp_replicate")
    shard_options = {k: v for k, v in shard_options.items() if k not in decided}
    if cp > 1:  # the cp ranks lie within dp_shard (meshes.py), which the mesh below shards over
        context_parallel(model, cp, cp_mode, tp=tp, ep=ep, dp_replicate=dp_replicate)
    dense, expert = make_meshes(tp, ep, dp_replicate)
    if tp > 1:  # torch's parallelize_module with the model's plan, over the TP dim
        from layershard.models.hf_tp import parallelize_hf
        from layershard.models.llama_tp import parallelize_llama

        if isinstance(model, LlamaForCausalLM):
            parallelize_llama(model, dense["tp"])
        else:  # with ep, the experts are split by EP, not by the model's TP plan
            parallelize_hf(model, dense["tp"], experts=ep == 1)
        if ep == 1:
            return shard(model, mesh=dense, **shard_options)
    if ep > 1:
        if split_experts(model, expert["ep"].get_group(), dense["tp"].get_group()) == 0:
            raise ValueError(
                f"parallelize(ep={ep}): the model has no expert layers to split (the built-in "
                "MoE's Experts, transformers' Qwen3-MoE and Mixtral experts); use ep=1 for a "
                "dense model"
            )
    return shard(model, mesh=dense, expert_mesh=expert if ep > 1 else None, **shard_options)


def context_parallel(
    model: nn.Module,
    cp: int,
    mode: str = "ring",
    *,
    tp: int = 1,
    ep: int = 1,
    dp_replicate: int = 1,
) -> ContextParallel:
    """Give ``model``, the built-in Llama or a transformers model, context parallelism over
    ``cp`` consecutive ranks (``meshes.context_group``): one ``ContextParallel`` that the model
    and each attention module hold, through which attention runs in ``mode`` and the loss is
    normalized (``parallel/context/state.py``; transformers models: ``models/hf_context.py``,
    their attention through transformers' ``AttentionInterface``). Refuses, in one line, what it
    does not do (yet): ep above 1, another kind of model, a mixture of experts (its
    load-balancing loss is not split with the sequence), heads (per TP rank) not divisible by ``cp``
    in all-to-all mode, ``cp x tp x dp_replicate`` not dividing the world, and what
    ``hf_context.check`` refuses of a transformers model. Collective over the world (the
    groups, the first time)."""
    where = f"parallelize(cp={cp})"
    hf = is_transformers_model(model)
    if hf:
        heads = hf_context.check(model, where)
    elif isinstance(model, LlamaForCausalLM):  # (its MoE's balance loss pools the CP group's)
        heads = model.config.n_heads
    else:
        raise TypeError(
            f"{where}: context parallelism runs transformers models and layershard.models."
            f"LlamaForCausalLM only, not {type(model).__name__}"
        )
    if mode == "all_to_all" and heads % (cp * tp):
        per = f"n_heads / tp = {heads // tp}" if tp > 1 and heads % tp == 0 else f"n_heads={heads}"
        raise ValueError(
            f"parallelize(cp={cp}, cp_mode='all_to_all'): {per} must be divisible by cp; use "
            "cp_mode='ring' or another cp"
        )
    group = context_group(cp, dp_replicate, tp)
    world, span = dist.get_world_size(), cp * tp  # the ranks of one micro-batch
    context = ContextParallel(
        group, mode, data_rank=dist.get_rank() // span, data_size=world // span, transformers=hf
    )
    if isinstance(model, LlamaForCausalLM):
        model.context_parallel = context
        for m in model.modules():
            if isinstance(m, Attention):
                m.context_parallel = context
    else:
        hf_context.attach(model, context)
    return context


def _replicas(options: dict[str, Any], dp_replicate: int) -> int:
    """``dp_replicate`` from ``strategy="hybrid", shard_size=K`` (removed from ``options``), or
    ``dp_replicate`` itself."""
    if options.get("strategy") != "hybrid":
        return dp_replicate
    if dp_replicate != 1:
        raise ValueError(
            "parallelize(): give dp_replicate= or strategy='hybrid' (shard_size= ranks per "
            "replica), not both"
        )
    del options["strategy"]
    return hybrid_replicas(dist.get_world_size(), options.pop("shard_size", None))
