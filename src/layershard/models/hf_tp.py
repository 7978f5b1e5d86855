"""Tensor parallelism for transformers models: a config's own ``base_model_tp_plan`` as torch's
``parallelize_module`` styles (Llama's, Mistral's and Qwen3's)."""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard, distribute_module
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from layershard.models.splits import check_tp


class ReplicatedOverHeads(ParallelStyle):
    """transformers' ``replicated_with_grad_allreduce`` (Qwen3's q/k norms): a norm over each
    head's features that every TP rank runs on its own heads. Its parameters become
    ``Replicate()`` DTensors and its input (``(..., heads, head_dim)``, this rank's heads) a
    DTensor split over the heads dim, so DTensor's rules make the weight's gradient a partial sum
    over the TP ranks' heads, redistributed (all-reduced over TP) to the weight's placement when
    the engine's re-wrapped view (``engine/dtensor.py``'s ``wrap``) hands it back: the all-reduce transformers' hook
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
    plan = hf_tp_plan(config, experts)
    check_tp(base, plan, tp)
    parallelize_module(base, tp_mesh, plan)
    return model
