"""``layershard plan``: a memory and time planner for runs that do not fit on this machine.

from layershard.plan import predict_memory
predict_memory(cfg, world_size=8, param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
# -> {"params": ..., "grads": ..., ..., "total": ...}, the keys of memory_report()
"""

from layershard.plan.calibrate import Measurement, fit, read_runs, yafsdp_fit
from layershard.plan.hardware import GPUS, Cluster, get_gpu
from layershard.plan.memory import (
    STATE_KEYS,
    bytes_per_param,
    layer_activation_bytes_per_token,
    logits_bytes_per_token,
    predict_activations,
    predict_memory,
    zero_paper_model_states,
)
from layershard.plan.model import ModelShape, Unit, units
from layershard.plan.planner import Plan, Settings, make_plan, suggest
from layershard.plan.sources import DEFAULT_EFFICIENCY, PROVENANCE, Efficiency
from layershard.plan.steptime import predict_time
from layershard.plan.timing import (
    collectives_by_group,
    collectives_per_step,
    model_flops,
    resolve_layout,
    ring_bytes,
    transfers_by_link,
)

__all__ = [
    "DEFAULT_EFFICIENCY",
    "GPUS",
    "PROVENANCE",
    "STATE_KEYS",
    "Cluster",
    "Efficiency",
    "Measurement",
    "ModelShape",
    "Plan",
    "Settings",
    "Unit",
    "bytes_per_param",
    "collectives_by_group",
    "collectives_per_step",
    "fit",
    "get_gpu",
    "layer_activation_bytes_per_token",
    "logits_bytes_per_token",
    "make_plan",
    "model_flops",
    "predict_activations",
    "predict_memory",
    "predict_time",
    "read_runs",
    "resolve_layout",
    "ring_bytes",
    "suggest",
    "transfers_by_link",
    "units",
    "yafsdp_fit",
    "zero_paper_model_states",
]
