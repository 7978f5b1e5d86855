"""Tensor parallelism for the built-in Llama (``models/llama.py``): the Megatron plan of its
blocks as torch's ``parallelize_module`` styles."""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from layershard.models.splits import check_tp


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


def block_plan(block: nn.Module) -> dict[str, ParallelStyle]:
    """``llama_tp_plan`` for this block: its attention part only for a MoE block, whose experts
    go to EP (or stay whole)."""
    plan = llama_tp_plan()
    if not hasattr(block.mlp, "w1"):
        plan = {name: style for name, style in plan.items() if name.startswith("attn.")}
    return plan


def parallelize_llama(model: nn.Module, tp_mesh: DeviceMesh) -> nn.Module:
    """Apply ``llama_tp_plan`` to every block of a built-in Llama (``LlamaForCausalLM``) over the
    1-D ``tp_mesh``, and give each attention its local head counts (the column-parallel q/k/v
    produce ``heads / tp`` heads per rank). The embedding, final norm and head stay replicated.
    Returns ``model``."""
    tp = tp_mesh.size()
    for i, block in enumerate(model.layers):  # type: ignore[arg-type]
        attn = block.attn
        if attn.n_heads % tp or attn.n_kv_heads % tp:
            raise ValueError(
                f"parallelize_llama: n_heads={attn.n_heads} and n_kv_heads={attn.n_kv_heads} "
                f"must be divisible by the TP size {tp}"
            )
        plan = block_plan(block)
        check_tp(block, plan, tp, prefix=f"layers.{i}.")
        parallelize_module(block, tp_mesh, plan)
        attn.n_heads, attn.n_kv_heads = attn.n_heads // tp, attn.n_kv_heads // tp
    return model
