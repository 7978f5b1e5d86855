"""Communication bytes per step by link, and a compute-plus-communication step-time model.

Collectives (ring algorithm, as NCCL runs them). For a collective over a full buffer of B bytes
(a unit's padded numel times the dtype size) each of the N ranks sends ``(N-1)/N * B`` for an
all-gather or reduce-scatter (twice that for an all-reduce). On M > 1 nodes with G GPUs each,
NCCL runs G rings, one per NIC, each carrying B/G; every ring leaves a node once, through one
GPU's NIC, so per GPU

    network bytes = (N-1)/N * B / G          NVLink bytes = (N-1)/N * B * (G-1)/G

and a collective takes ``max(nvlink / (intra_bw * eff), network / (inter_bw * eff)) + latency``
(eff = achievable fraction of link bandwidth, default 0.8, about what nccl-tests reach). On one
node everything goes over NVLink. The link with the larger of the two times is the bottleneck.

Compute (FLOPs per micro-batch of T = b s tokens; PaLM's convention, Chowdhery et al. 2022,
App. B: attention counted without the causal halving):

    block forward     2 P_mm T + 4 s h hd T      (P_mm = block matmul weights)
    LM head forward   2 V d T
    backward          2 x forward;  a checkpointed block also recomputes its forward
    model FLOPs       6 (L P_mm + V d) T + 12 L s h hd T     (no recompute: used for MFU)

A stage's compute time is FLOPs / (peak * compute_eff) (compute_eff = the fraction of dense peak
that large bf16 matmuls reach, default 0.6).

Overlap (one communication stream, one unit of prefetch, as layershard's schedule):

    forward   = t(AG root) + t(AG first unit) + sum_i max(C_fwd[i], t(AG[i+1]))
    backward  = sum_i max(C_bwd[i], t(AG_bwd[i-1]) + t(RS[i+1])) + t(RS first unit) + t(RS root)
    step      = grad_accum * (forward + backward) + optimizer
    optimizer = (7 * 4 + c) bytes per shard element / HBM bandwidth (AdamW reads p, g, m, v,
                writes p, m, v and the compute-dtype shard copy)
    MFU       = model FLOPs per step / (step * peak)

AG_bwd is 0 for the last two units in forward order (still gathered when backward starts) and
for an untied embedding (its backward needs no weights).
Gradient-accumulation micro-batches each reduce-scatter (layershard accumulates in the fp32
shard) unless ``no_sync`` (then only the last one does); ``grad_op`` (ZeRO-2) gathers once per
step; ``no_shard`` (DDP) all-reduces once per step.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from layershard.plan.hardware import GPU, Cluster
from layershard.plan.memory import dtype_bytes, strategy_name
from layershard.plan.model import ModelShape, units

DEFAULT_COMPUTE_EFF = 0.6
DEFAULT_COMM_EFF = 0.8
DEFAULT_LATENCY_S = 20e-6


def ring_bytes(
    full_bytes: int, world_size: int, cluster: Cluster | None = None
) -> dict[str, float]:
    """Bytes one rank sends in a ring all-gather or reduce-scatter of ``full_bytes``, by link."""
    n = world_size
    sent = (n - 1) / n * full_bytes
    if cluster is None or cluster.nodes == 1:
        return {"nvlink": sent, "network": 0.0}
    g = cluster.local
    return {"nvlink": sent * (g - 1) / g, "network": sent / g}


@dataclass
class Stage:
    name: str
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    ag_fwd: int = 0  # full-buffer bytes gathered before the forward
    ag_bwd: int = 0  # ... before the backward
    rs: int = 0  # full-buffer bytes reduce-scattered after the backward


@dataclass
class TimePlan:
    stages: list[Stage]
    comm_bytes: dict[str, dict[str, float]]  # collective -> link -> bytes per step per GPU
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float
    compute_s: float  # pure compute time per step (incl. recompute)
    comm_s: float  # pure communication time per step (sum of collective times)
    exposed_comm_s: float  # step time not covered by compute
    model_flops: float  # per GPU per step
    hardware_flops: float
    mfu: float
    tokens_per_s_per_gpu: float
    assumptions: dict[str, Any] = field(default_factory=dict)


def block_fwd_flops(shape: ModelShape, tokens: int, seq_len: int) -> float:
    return 2 * shape.block_matmul_params * tokens + 4 * seq_len * shape.n_heads * shape.hd * tokens


def model_flops(shape: ModelShape, tokens: int, seq_len: int) -> float:
    """Training FLOPs of ``tokens`` tokens without recompute: 6 N T + 12 L s h hd T."""
    n = shape.n_layers * shape.block_matmul_params + shape.head_params
    return 6 * n * tokens + 12 * shape.n_layers * seq_len * shape.n_heads * shape.hd * tokens


def build_stages(
    shape: ModelShape,
    world_size: int,
    micro_batch: int,
    seq_len: int,
    checkpoint_layers: int,
    param_bytes: int,
    reduce_bytes: int,
    strategy: str = "full",
) -> tuple[list[Stage], int, int]:
    """Stages in forward order, plus the root unit's gather and reduce bytes (full buffers)."""
    n = world_size
    tokens = micro_batch * seq_len
    k = max(0, min(checkpoint_layers, shape.n_layers))
    bf = block_fwd_flops(shape, tokens, seq_len)
    head = 2 * shape.head_params * tokens
    stages = [Stage("embed")]
    for i in range(shape.n_layers):
        stages.append(Stage(f"layers.{i}", bf, 2 * bf + (bf if i < k else 0.0)))
    stages += [Stage("norm"), Stage("lm_head", head, 2 * head)]
    by_name = {s.name: s for s in stages}
    root_ag = root_rs = 0
    sharded: list[Stage] = []
    for u in units(shape):
        full = u.padded_numel(n)
        if u.persistent:
            root_ag, root_rs = full * param_bytes, full * reduce_bytes
            continue
        s = by_name[u.name]
        s.ag_fwd = full * param_bytes
        s.ag_bwd = full * param_bytes if u.needs_weights_in_backward else 0
        s.rs = full * reduce_bytes
        sharded.append(s)
    for s in sharded[-2:]:  # still gathered when backward starts
        s.ag_bwd = 0
    if strategy != "full":  # grad_op / no_shard: weights stay gathered, no backward gather
        for s in stages:
            s.ag_bwd = 0
    return stages, root_ag, root_rs


def collectives_per_step(
    config: Any,
    world_size: int,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    grad_accum: int = 1,
    no_sync: bool = False,
) -> dict[str, dict[str, int]]:
    """The ``full`` strategy's collectives per optimizer step, in the format of
    ``ShardedModule.comm_stats()``: count, full-buffer bytes (before the (N-1)/N ring factor)
    and count per phase. Per micro-batch: an all-gather of every unit in forward (the root unit
    included), of every non-root unit in backward but the last two and an untied embedding, and
    one reduce-scatter per unit (only in the last micro-batch under ``no_sync``)."""
    shape = ModelShape.from_config(config)
    n = int(world_size)
    if n == 1:
        return {}
    c, r = dtype_bytes(param_dtype), dtype_bytes(reduce_dtype)
    us = units(shape)
    sharded = [u for u in us if not u.persistent]
    regathered = [u for u in sharded[:-2] if u.needs_weights_in_backward]
    n_fwd, n_bwd = len(us), len(regathered)
    fwd_bytes = sum(u.padded_numel(n) for u in us) * c
    bwd_bytes = sum(u.padded_numel(n) for u in regathered) * c
    n_rs = len(us) * (1 if no_sync else grad_accum)
    gathers = {
        "count": grad_accum * (n_fwd + n_bwd),
        "bytes": grad_accum * (fwd_bytes + bwd_bytes),
        "forward": grad_accum * n_fwd,
    }
    if n_bwd:  # comm_stats() lists only the phases that issued something
        gathers["backward"] = grad_accum * n_bwd
    return {
        "all_gather": gathers,
        "reduce_scatter": {
            "count": n_rs,
            "bytes": n_rs // len(us) * sum(u.padded_numel(n) for u in us) * r,
            "backward": n_rs,
        },
    }


def predict_time(
    config: Any,
    gpu: GPU,
    cluster: Cluster,
    micro_batch: int,
    seq_len: int,
    checkpoint_layers: int = 0,
    grad_accum: int = 1,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    strategy: str = "full",
    no_sync: bool = False,
    compute_eff: float = DEFAULT_COMPUTE_EFF,
    comm_eff: float = DEFAULT_COMM_EFF,
    latency_s: float = DEFAULT_LATENCY_S,
) -> TimePlan:
    shape = ModelShape.from_config(config)
    strategy = strategy_name(strategy)
    n = cluster.gpus
    c, r = dtype_bytes(param_dtype), dtype_bytes(reduce_dtype)
    if strategy == "no_shard":
        r = 4  # DDP all-reduces the fp32 .grad
    stages, root_ag, root_rs = build_stages(
        shape, n, micro_batch, seq_len, checkpoint_layers, c, r, strategy
    )
    flops_rate = gpu.peak_flops * compute_eff
    intra = gpu.intra_bw_gbs * 1e9 * comm_eff
    inter = gpu.inter_bw_gbs * 1e9 * comm_eff

    comm_bytes: dict[str, dict[str, float]] = {}
    comm_total = [0.0]

    def coll(kind: str, full_bytes: float, count: bool, factor: float = 1.0) -> float:
        """Time of one collective; adds its bytes to the per-step tally when ``count``."""
        if n == 1 or full_bytes == 0:
            return 0.0
        links = ring_bytes(int(full_bytes * factor), n, cluster)
        t = max(links["nvlink"] / intra, links["network"] / inter if inter else 0.0) + latency_s
        if count:
            tally = comm_bytes.setdefault(kind, {"nvlink": 0.0, "network": 0.0})
            for k, v in links.items():
                tally[k] += v
            comm_total[0] += t
        return t

    def micro_batch_time(first: bool, last: bool) -> tuple[float, float]:
        # grad_op gathers once per step; no_shard never (weights are replicated)
        gather = strategy == "full" or (strategy == "grad_op" and first)
        # DDP and no_sync() accumulate unsharded and reduce at the last micro-batch only
        reduce = (strategy != "no_shard" and not no_sync) or last
        red_kind, red_factor = (
            ("all_reduce", 2.0) if strategy == "no_shard" else ("reduce_scatter", 1.0)
        )
        ag = [coll("all_gather_fwd", s.ag_fwd, True) if gather else 0.0 for s in stages]
        agb = [coll("all_gather_bwd", s.ag_bwd, True) for s in stages]
        rs = [coll(red_kind, s.rs, True, red_factor) if reduce else 0.0 for s in stages]
        t_ag_root = coll("all_gather_fwd", root_ag, True) if gather else 0.0
        t_rs_root = coll(red_kind, root_rs, True, red_factor) if reduce else 0.0
        cf = [s.fwd_flops / flops_rate for s in stages]
        cb = [s.bwd_flops / flops_rate for s in stages]
        m = len(stages)
        fwd = t_ag_root + ag[0]
        for i in range(m):
            fwd += max(cf[i], ag[i + 1] if i + 1 < m else 0.0)
        bwd = 0.0
        for i in reversed(range(m)):
            comm = (agb[i - 1] if i > 0 else 0.0) + (rs[i + 1] if i + 1 < m else 0.0)
            bwd += max(cb[i], comm)
        bwd += rs[0] + t_rs_root
        return fwd, bwd

    fwd = bwd = 0.0
    for j in range(grad_accum):
        f, b = micro_batch_time(first=j == 0, last=j == grad_accum - 1)
        fwd, bwd = fwd + f, bwd + b

    if strategy == "no_shard":
        opt_elems = shape.total_params
    else:
        opt_elems = sum(u.shard_numel(n) for u in units(shape))
    opt = opt_elems * (7 * 4 + c) / (gpu.hbm_bw_gbs * 1e9)
    step = fwd + bwd + opt
    tokens = micro_batch * seq_len * grad_accum
    mflops = model_flops(shape, tokens, seq_len)
    hflops = grad_accum * sum(s.fwd_flops + s.bwd_flops for s in stages)
    compute = hflops / flops_rate
    return TimePlan(
        stages=stages,
        comm_bytes=comm_bytes,
        forward_s=fwd,
        backward_s=bwd,
        optimizer_s=opt,
        step_s=step,
        compute_s=compute,
        comm_s=comm_total[0],
        exposed_comm_s=max(0.0, step - compute - opt),
        model_flops=mflops,
        hardware_flops=hflops,
        mfu=mflops / (step * gpu.peak_flops) if step > 0 else 0.0,
        tokens_per_s_per_gpu=tokens / step if step > 0 else 0.0,
        assumptions={
            "compute_eff": compute_eff,
            "comm_eff": comm_eff,
            "latency_s": latency_s,
            "peak_tflops": gpu.bf16_tflops,
            "intra_bw_gbs": gpu.intra_bw_gbs,
            "inter_bw_gbs": gpu.inter_bw_gbs,
        },
    )
