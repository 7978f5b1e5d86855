"""A whole plan (memory + time for one setting) and the search for the cheapest setting that fits.

Fitting means ``model states + activations + logits <= (1 - headroom) * GPU memory``; the headroom
(default 10%) covers the CUDA context, NCCL buffers, allocator fragmentation and transient
tensors the model does not count (activation gradients, optimizer-step temporaries).

The suggestion keeps the global batch (``micro_batch * grad_accum * gpus`` sequences) fixed:
for the requested micro-batch and each of its divisors (grad_accum scaled up to match) it takes
the fewest checkpointed layers that fit, then picks among those the one with the lowest predicted
step time (ties: the larger micro-batch). If nothing fits, it reports the smallest GPU count that fits with
micro-batch 1 and every layer checkpointed, or that none does.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from typing import Any

from layershard.plan.hardware import GPU, Cluster
from layershard.plan.memory import (
    peak_bytes,
    predict_activations,
    predict_memory,
    unit_grad_bytes,
)
from layershard.plan.model import ModelShape
from layershard.plan.timing import (
    DEFAULT_COMM_EFF,
    DEFAULT_COMPUTE_EFF,
    DEFAULT_LATENCY_S,
    TimePlan,
    predict_time,
)

DEFAULT_HEADROOM = 0.10


@dataclass(frozen=True)
class Settings:
    micro_batch: int
    seq_len: int
    checkpoint_layers: int = 0
    grad_accum: int = 1
    param_dtype: str = "bf16"
    reduce_dtype: str = "fp32"
    optimizer: str = "adamw"
    strategy: str = "full"
    no_sync: bool = False  # accumulate micro-batches unsharded, reduce once per step


@dataclass
class Plan:
    shape: ModelShape
    gpu: GPU
    cluster: Cluster
    settings: Settings
    memory: dict[str, int]  # engine keys + activations + logits + unit_grads + peak
    time: TimePlan
    headroom: float

    @property
    def budget(self) -> int:
        return int(self.gpu.memory_bytes * (1 - self.headroom))

    @property
    def fits(self) -> bool:
        return self.memory["peak"] <= self.budget

    def to_dict(self) -> dict[str, Any]:
        t = self.time
        return {
            "model": asdict(self.shape) | {"params": self.shape.total_params},
            "gpu": asdict(self.gpu),
            "cluster": {**asdict(self.cluster), "nodes": self.cluster.nodes},
            "settings": asdict(self.settings),
            "memory_bytes": self.memory,
            "budget_bytes": self.budget,
            "headroom": self.headroom,
            "fits": self.fits,
            "comm_bytes_per_step": t.comm_bytes,
            "time": {
                "step_s": t.step_s,
                "forward_s": t.forward_s,
                "backward_s": t.backward_s,
                "optimizer_s": t.optimizer_s,
                "compute_s": t.compute_s,
                "comm_s": t.comm_s,
                "exposed_comm_s": t.exposed_comm_s,
                "model_flops_per_gpu": t.model_flops,
                "hardware_flops_per_gpu": t.hardware_flops,
                "mfu": t.mfu,
                "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
                "assumptions": t.assumptions,
            },
        }


def make_plan(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float = DEFAULT_HEADROOM,
    compute_eff: float = DEFAULT_COMPUTE_EFF,
    comm_eff: float = DEFAULT_COMM_EFF,
    latency_s: float = DEFAULT_LATENCY_S,
) -> Plan:
    s = settings
    mem = predict_memory(
        shape, cluster.gpus, s.param_dtype, s.reduce_dtype, s.optimizer, s.strategy, s.no_sync
    )
    act = predict_activations(shape, s.micro_batch, s.seq_len, s.checkpoint_layers, s.param_dtype)
    unit_grads = unit_grad_bytes(shape, cluster.gpus, s.param_dtype)
    peak = peak_bytes(mem, act, unit_grads)
    mem = dict(mem)
    mem["model_states"] = mem.pop("total")
    mem.update(act)
    mem["unit_grads"] = unit_grads
    mem["peak"] = peak
    t = predict_time(
        shape,
        gpu,
        cluster,
        s.micro_batch,
        s.seq_len,
        s.checkpoint_layers,
        s.grad_accum,
        s.param_dtype,
        s.reduce_dtype,
        s.strategy,
        s.no_sync,
        compute_eff,
        comm_eff,
        latency_s,
    )
    return Plan(shape, gpu, cluster, s, mem, t, headroom)


@dataclass
class Suggestion:
    plan: Plan | None  # the cheapest fitting plan, None if nothing fits on this many GPUs
    gpus_needed: int | None  # when nothing fits: the smallest GPU count that would
    message: str


def min_checkpoint_layers(
    shape: ModelShape, gpu: GPU, cluster: Cluster, settings: Settings, headroom: float, **kw: Any
) -> Plan | None:
    """The plan with the fewest checkpointed layers that fits, or None. Memory grows
    monotonically with fewer checkpointed layers, so a binary search suffices."""
    L = shape.n_layers

    def at(k: int) -> Plan:
        return make_plan(
            shape, gpu, cluster, replace(settings, checkpoint_layers=k), headroom, **kw
        )

    if not at(L).fits:
        return None
    lo, hi = 0, L  # hi fits
    while lo < hi:
        mid = (lo + hi) // 2
        if at(mid).fits:
            hi = mid
        else:
            lo = mid + 1
    return at(lo)


def suggest(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float = DEFAULT_HEADROOM,
    max_gpus: int = 1 << 16,
    **kw: Any,
) -> Suggestion:
    candidates: list[Plan] = []
    req = settings.micro_batch
    for mb in [m for m in range(req, 0, -1) if req % m == 0]:
        ga = settings.grad_accum * (req // mb)  # same sequences per optimizer step
        p = min_checkpoint_layers(
            shape, gpu, cluster, replace(settings, micro_batch=mb, grad_accum=ga), headroom, **kw
        )
        if p is not None:
            candidates.append(p)
            if p.settings.checkpoint_layers == 0:
                break  # a smaller micro-batch would only repeat the same work in more steps
    if candidates:
        best = min(candidates, key=lambda p: (p.time.step_s, -p.settings.micro_batch))
        s = best.settings
        msg = (
            f"fits: micro-batch {s.micro_batch}, grad-accum {s.grad_accum}, "
            f"{s.checkpoint_layers}/{shape.n_layers} layers checkpointed "
            f"(peak {best.memory['peak'] / 2**30:.1f} GiB of {best.budget / 2**30:.1f} GiB usable)"
        )
        return Suggestion(best, None, msg)

    # Nothing fits here: more GPUs shrink the sharded states (not buffers or activations).
    tight = replace(settings, micro_batch=1, checkpoint_layers=shape.n_layers)
    g = cluster.gpus_per_node
    n = max(cluster.gpus * 2, g)
    while n <= max_gpus:
        c = Cluster(n, g) if n >= g else Cluster(n, n)
        if make_plan(shape, gpu, c, tight, headroom, **kw).fits:
            # refine downwards to a multiple of the node size
            lo = max(cluster.gpus + 1, g)
            step = g
            lo = -(-lo // step) * step
            for m in range(lo, n + 1, step):
                if make_plan(shape, gpu, Cluster(m, g), tight, headroom, **kw).fits:
                    n = m
                    break
            return Suggestion(
                None,
                n,
                f"does not fit on {cluster.gpus} GPUs even with micro-batch 1 and every layer "
                f"checkpointed; {n} GPUs ({n // g} nodes of {g}) would fit",
            )
        n *= 2
    return Suggestion(
        None,
        None,
        f"does not fit at any GPU count up to {max_gpus}: the unsharded part (gather buffers, "
        "activations of one micro-batch) alone exceeds the GPU memory",
    )
