"""A whole plan (memory + time for one setting) and the search for the fastest setting that fits.

Fitting means the per-GPU peak (model states on the device + activations + logits, see
``memory.peak_bytes``), with the allocator's fragmentation on top of it and the CUDA context and
NCCL's buffers beside it (``sources.FRAGMENTATION``, ``sources.CONTEXT_BYTES``: explicit,
sourced margins), ``<= (1 - headroom) * GPU memory`` (``--headroom``, default 0), and, under CPU
offload, the node's offloaded states (params, grads, optimizer state and ``no_sync``
accumulators of its ranks, plus their gradient staging buffers) ``<= 90%`` of the host memory
(``HOST_HEADROOM``: the OS and the processes' own memory).

The suggestion keeps the global batch (``micro_batch * grad_accum * gpus`` sequences) fixed and
searches, for every strategy (``full``, ``grad_op``, ``no_shard``; on several nodes also
``hybrid`` with shard groups of 1, 2, 4, ... nodes and ``full`` with ``reshard_after_forward`` =
a node), each with and without CPU offload: for the requested micro-batch and each of its
divisors (grad_accum scaled up to match) the fewest checkpointed layers that fit (fewer is
always faster). The fastest of all those wins; within 0.5% of it (below what the model can
resolve) the one with the lowest peak. If nothing fits, it reports the smallest GPU count that
fits with micro-batch 1 and every layer checkpointed (``full``, with or without offload), or that
none does. With TP/EP meshes (``plan/parallel.py``) it also compares ``full`` at each
(tp, ep) the plan models with the other settings (not with 8-bit gathers), the micro-batch per
TP group scaled by tp to keep the global batch.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any

from layershard.plan.context import check_cp, cp_options, predict_cp_activations
from layershard.plan.hardware import GPU, Cluster
from layershard.plan.memory import (
    STATE_KEYS,
    dtype_bytes,
    optimizer_step_temporaries,
    peak_bytes,
    predict_activations,
    predict_memory,
    released_between_passes,
    unit_grad_bytes,
)
from layershard.plan.model import ModelShape, units
from layershard.plan.network import Links
from layershard.plan.sources import CONTEXT_BYTES, FRAGMENTATION
from layershard.plan.steptime import TimePlan, predict_time
from layershard.plan.timing import resolve_layout

DEFAULT_HEADROOM = 0.0  # the margins are explicit: sources.CONTEXT_BYTES, FRAGMENTATION
# Keys of memory_report() that CPU offload keeps in host memory (the engine's ``host`` device).
HOST_KEYS = ("params", "grads", "optimizer", "no_sync")
HOST_HEADROOM = 0.10
TIE = 0.005  # relative step-time difference below which the lower peak wins


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
    shard_size: int | None = None  # hybrid: ranks per shard group (default: a node)
    reshard_after_forward: bool | int = True  # full: an int K is hpZ over K ranks
    offload: bool = False  # ls.CPUOffload()
    loss_chunks: int = 0  # the chunked loss (layershard.loss) in K chunks; 0: the plain loss
    loss: str = "fp32"  # fp32: layershard's loss; fused: a fused cross-entropy (flash-attn's)
    gather_dtype: str | None = None  # weights over the all-gather: fp8, int8 (None: param_dtype)
    tp: int = 1  # tensor-parallel size (plan/parallel.py); micro_batch is then per TP group
    ep: int = 1  # expert-parallel size
    cp: int = 1  # context-parallel size (plan/context.py); micro_batch is then per CP group
    cp_mode: str = "ring"  # ring | all_to_all
    blocks_per_unit: int = 1  # K consecutive blocks one unit (ls.shard(blocks_per_unit=K))

    def step_kwargs(self) -> dict[str, Any]:
        """The options of one training step, as ``predict_time`` takes them (keywords)."""
        return {
            "micro_batch": self.micro_batch, "seq_len": self.seq_len,
            "checkpoint_layers": self.checkpoint_layers, "grad_accum": self.grad_accum,
            "param_dtype": self.param_dtype, "reduce_dtype": self.reduce_dtype,
            "gather_dtype": self.gather_dtype, "no_sync": self.no_sync,
            "optimizer": self.optimizer, "loss_chunks": self.loss_chunks, "loss": self.loss,
            "cp": self.cp, "cp_mode": self.cp_mode, "blocks_per_unit": self.blocks_per_unit,
            **self.strategy_kwargs(),
        }  # fmt: skip

    def strategy_kwargs(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "shard_size": self.shard_size,
            "reshard_after_forward": self.reshard_after_forward,
            "offload": self.offload,
        }


@dataclass
class Plan:
    shape: ModelShape
    gpu: GPU
    cluster: Cluster
    settings: Settings
    memory: dict[str, int]  # engine keys + activations + logits + unit_grads + peak (+ host)
    time: TimePlan
    headroom: float
    fragmentation: float = FRAGMENTATION
    context_bytes: int = CONTEXT_BYTES

    @property
    def budget(self) -> int:
        """Bytes of tensors the GPU can hold: its memory less the headroom, the CUDA context and
        NCCL's buffers, and the allocator's fragmentation (``sources.FRAGMENTATION``)."""
        usable = self.gpu.memory_bytes * (1 - self.headroom) - self.context_bytes
        return int(usable / (1 + self.fragmentation))

    def peak_inputs(self) -> tuple[dict[str, int], dict[str, int], int, int, int]:
        """``peak_parts``' arguments for this plan: the model states on the GPU (host-resident
        ones at 0 under offload, ``total`` theirs), the activations, a unit's gradients, the
        gather bytes given back at the loss and the optimizer step's temporaries."""
        mem = self.memory
        states = {k: (0 if self.settings.offload and k in HOST_KEYS else mem[k])
                  for k in STATE_KEYS}  # fmt: skip
        states["total"] = mem["device_states"]
        keys = ("activations", "logits", "loss_head_grad", "recompute", "cp_inflight")
        act: dict[str, int] = {k: mem[k] for k in keys if k in mem}
        extra = (mem["unit_grads"], mem["released_at_loss"], mem["optimizer_temporaries"])
        return (states, act, *extra)

    @property
    def device_bytes(self) -> int:
        """What the GPU holds at the peak: the tensors, fragmentation and the context."""
        return int(self.memory["peak"] * (1 + self.fragmentation)) + self.context_bytes

    @property
    def host_budget(self) -> int:
        return int(self.gpu.host_memory_bytes * (1 - max(self.headroom, HOST_HEADROOM)))

    @property
    def fits_device(self) -> bool:
        return self.memory["peak"] <= self.budget

    @property
    def fits_host(self) -> bool:
        return self.memory["host_per_node"] <= self.host_budget

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    @property
    def strategy_label(self) -> str:
        label = self.time.layout.describe() if self.time.layout else self.settings.strategy
        mesh, s = self.mesh, self.settings
        label += f", cp {s.cp} {s.cp_mode}" if s.cp > 1 else ""
        label += f", {s.blocks_per_unit} blocks per unit" if s.blocks_per_unit > 1 else ""
        return label if mesh is None else f"{label}, {mesh.describe(self.shape.moe)}"

    @property
    def mesh(self) -> Any:
        """The ``parallel.Mesh`` of a TP/EP row, None for a 1-D one."""
        if self.settings.tp == 1 and self.settings.ep == 1:
            return None
        from layershard.plan.parallel import Mesh

        return Mesh(self.cluster.gpus, self.settings.tp, self.settings.ep)

    def to_dict(self) -> dict[str, Any]:
        t = self.time
        return {
            "model": asdict(self.shape) | {"params": self.shape.total_params},
            "gpu": asdict(self.gpu),
            "cluster": {**asdict(self.cluster), "nodes": self.cluster.nodes},
            "settings": {
                k: v
                for k, v in asdict(self.settings).items()  # cp: CP rows only
                if self.settings.cp > 1 or k not in ("cp", "cp_mode")
            },  # fmt: skip
            "strategy": self.strategy_label,
            "mesh": None
            if self.mesh is None
            else {
                "tp": self.mesh.tp,
                "ep": self.mesh.ep,
                "dp_shard": self.mesh.dp_shard,
                "efsdp": self.mesh.efsdp,
            },  # fmt: skip
            "memory_bytes": self.memory,
            "budget_bytes": self.budget,
            "host_budget_bytes_per_node": self.host_budget,
            "headroom": self.headroom,
            "fragmentation": self.fragmentation,
            "context_bytes": self.context_bytes,
            "device_bytes": self.device_bytes,
            "fits": self.fits,
            "comm_bytes_per_step": t.comm_bytes,
            "comm_groups": t.comm_groups,
            "time": {
                "step_s": t.step_s,
                "forward_s": t.forward_s,
                "backward_s": t.backward_s,
                "optimizer_s": t.optimizer_s,
                "compute_s": t.compute_s,
                "copy_s": t.copy_s,
                "comm_s": t.comm_s,
                "exposed_comm_s": t.exposed_comm_s,
                "model_flops_per_gpu": t.model_flops,
                "hardware_flops_per_gpu": t.hardware_flops,
                "mfu": t.mfu,
                "tokens_per_s_per_gpu": t.tokens_per_s_per_gpu,
                "compute_by_kind": t.compute_by_kind,
                "contention_s": t.contention_s,
                "exposed_by_link": t.exposed_by_link,
                "assumptions": t.assumptions,
            },
        } | ({"context": t.context} if t.context else {})


def make_plan(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float = DEFAULT_HEADROOM,
    compute_eff: float | None = None,
    comm_eff: float | None = None,
    latency_s: float | None = None,
    eff: Any = None,
    links: Links | None = None,
    fragmentation: float = FRAGMENTATION,
) -> Plan:
    s = settings
    mesh = None
    check_cp(shape, cluster, s)
    if s.blocks_per_unit < 1 or (s.blocks_per_unit > 1 and (s.tp, s.ep, s.cp) != (1, 1, 1)):
        raise ValueError(
            f"--blocks-per-unit {s.blocks_per_unit}: the plan models K >= 1 blocks per unit "
            "without --tp/--ep/--cp only; drop one of them"
        )
    if s.tp != 1 or s.ep != 1:  # a TP/EP row (plan/parallel.py)
        from layershard.plan.parallel import Mesh, mesh_parts

        mesh = Mesh(cluster.gpus, s.tp, s.ep)
        layout, mem, act, unit_grads, released = mesh_parts(shape, mesh, s)
    else:
        layout = resolve_layout(
            s.strategy, cluster.gpus, s.shard_size, s.reshard_after_forward,
            cluster.gpus_per_node, s.offload,
        )  # fmt: skip
        mem = predict_memory(
            shape, cluster.gpus, s.param_dtype, s.reduce_dtype, s.optimizer, layout.strategy,
            s.no_sync, shard_size=layout.shard if layout.strategy == "hybrid" else None,
            reshard_after_forward=layout.hpz if layout.hpz > 1 else True, offload=s.offload,
            blocks_per_unit=s.blocks_per_unit,
        )  # fmt: skip
        act = predict_cp_activations(shape, s) if s.cp > 1 else predict_activations(
            shape, s.micro_batch, s.seq_len, s.checkpoint_layers, s.param_dtype,
            loss_chunks=s.loss_chunks, loss=s.loss,
        )  # fmt: skip
        unit_grads = unit_grad_bytes(shape, layout.shard, s.param_dtype, s.blocks_per_unit)
        released = released_between_passes(
            shape, cluster.gpus, s.param_dtype, layout.strategy,
            shard_size=layout.shard if layout.strategy == "hybrid" else None,
            blocks_per_unit=s.blocks_per_unit,
        )  # fmt: skip
    host = sum(mem.get(k, 0) for k in HOST_KEYS) if s.offload else 0
    device = dict(mem)
    if s.offload:
        for k in HOST_KEYS:
            if k in device:
                device[k] = 0
        device["total"] = sum(v for k, v in device.items() if k != "total")
    step_temps = 0 if s.offload else optimizer_step_temporaries(s.optimizer, device)
    peak = peak_bytes(device, act, unit_grads, released, step_temps)
    mem = dict(mem)
    mem["model_states"] = mem.pop("total")
    mem["device_states"] = device["total"]
    mem["host_states"] = host
    # two pinned staging buffers per rank, each the largest shard in the reduce dtype
    biggest = max(u.shard_numel(layout.shard) for u in units(shape, s.blocks_per_unit))
    staging = 2 * dtype_bytes(s.reduce_dtype) * biggest if s.offload else 0
    mem["host_per_node"] = (host + staging) * cluster.local
    mem.update(act)
    mem["unit_grads"] = unit_grads
    mem["released_at_loss"] = released
    mem["optimizer_temporaries"] = step_temps
    mem["peak"] = peak
    t = predict_time(
        shape, gpu, cluster, **s.step_kwargs(), compute_eff=compute_eff, comm_eff=comm_eff,
        latency_s=latency_s, eff=eff, links=links, mesh=mesh,
    )  # fmt: skip
    return Plan(shape, gpu, cluster, s, mem, t, headroom, fragmentation)


@dataclass
class Ranked:
    """The best setting of one strategy, or why it has none."""

    label: str
    plan: Plan | None  # None: does not fit
    reason: str  # what costs it time against the winner, or why it does not fit


@dataclass
class Suggestion:
    plan: Plan | None  # the fastest fitting setting, or None
    gpus_needed: int | None  # when nothing fits: the smallest GPU count that would
    message: str
    ranking: list[Ranked] = field(default_factory=list)
    why: str = ""


def min_checkpoint_layers(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float = DEFAULT_HEADROOM,
    **kw: Any,
) -> Plan | None:
    """The plan with the fewest checkpointed layers that fits (memory falls as k grows), or
    None if even every layer checkpointed does not fit."""
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


def strategy_candidates(cluster: Cluster, settings: Settings) -> list[dict[str, Any]]:
    """The strategy settings the suggestion compares (see the module docstring)."""
    base: list[dict[str, Any]] = [
        {"strategy": "full"},
        {"strategy": "grad_op"},
        {"strategy": "no_shard"},
    ]
    n, g = cluster.gpus, cluster.local
    if cluster.nodes > 1:
        base.append({"strategy": "full", "reshard_after_forward": g})
        k = g
        while k < n:
            if n % k == 0:
                base.append({"strategy": "hybrid", "shard_size": k})
            k *= 2
    out = []
    for b in base:
        for off in (False, True):
            out.append(
                {"strategy": "full", "shard_size": None, "reshard_after_forward": True, **b}
                | {"offload": off}
            )
    return out


def _best_for(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float,
    **kw: Any,
) -> Plan | None:
    """The fastest fitting (micro-batch, grad-accum, checkpointed layers) for one strategy."""
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
    return _pick(candidates)


def _pick(plans: list[Plan]) -> Plan | None:
    if not plans:
        return None
    fastest = min(p.time.step_s for p in plans)
    close = [p for p in plans if p.time.step_s <= fastest * (1 + TIE)]
    return min(close, key=lambda p: (p.memory["peak"], p.time.step_s, -p.settings.micro_batch))


GiB = 2**30


def _why_slower(p: Plan, best: Plan) -> str:
    """The component of ``p``'s step that grew most against ``best``'s."""
    a, b = p.time, best.time
    recompute = (a.hardware_flops - a.model_flops) / max(a.hardware_flops, 1) * a.compute_s
    recompute_b = (b.hardware_flops - b.model_flops) / max(b.hardware_flops, 1) * b.compute_s
    parts = {
        "exposed communication": a.exposed_comm_s - b.exposed_comm_s,
        "compute slowed by collectives beside it": a.contention_s - b.contention_s,
        "recompute": recompute - recompute_b,
        "optimizer step": a.optimizer_s - b.optimizer_s,
        "compute-stream copies": a.copy_s - b.copy_s,
        "compute": (a.compute_s - recompute) - (b.compute_s - recompute_b),
    }
    name, delta = max(parts.items(), key=lambda kv: kv[1])
    if a.step_s <= b.step_s * (1 + TIE):
        return (
            f"as fast ({a.step_s - b.step_s:+.3f} s, within {TIE:.1%}) with a higher peak "
            f"({p.memory['peak'] / GiB:.1f} GiB)"
        )
    detail = ""
    if name == "exposed communication":
        net = sum(v["network"] for v in a.comm_bytes.values())
        net_b = sum(v["network"] for v in b.comm_bytes.values())
        if net > net_b:
            detail = f"; {net / 1e9:.1f} GB/step over the network vs {net_b / 1e9:.1f}"
    elif name == "recompute":
        detail = f" of {p.settings.checkpoint_layers}/{p.shape.n_layers} checkpointed layers"
    elif name == "optimizer step":
        detail = " (on the CPU)" if p.settings.offload else ""
    return f"+{delta:.3f} s {name}{detail}"


def suggest(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    settings: Settings,
    headroom: float = DEFAULT_HEADROOM,
    max_gpus: int = 1 << 16,
    keep_strategy: bool = False,
    meshes: list[tuple[int, int]] | None = None,
    **kw: Any,
) -> Suggestion:
    """The fastest setting that fits: strategy (unless ``keep_strategy``), CPU offload,
    micro-batch and activation checkpointing (see the module docstring); with ``meshes``, also
    ``full`` at each (tp, ep) of them (``plan/parallel.py``), the micro-batch per TP group
    scaled to keep the global batch (only those when ``settings`` has a TP or EP size)."""
    options: list[dict[str, Any]] = []
    if settings.tp == 1 and settings.ep == 1:
        options = (
            [settings.strategy_kwargs()]
            if keep_strategy
            else strategy_candidates(cluster, settings)
        )
    for tp, ep in meshes or []:
        if (tp, ep) != (1, 1) or not options:
            mb = settings.micro_batch * tp // settings.tp
            row: dict[str, Any] = {"strategy": "full", "shard_size": None, "reshard_after_forward": True,
                   "offload": False, "tp": tp, "ep": ep, "micro_batch": max(1, mb)}  # fmt: skip
            if _modelled(shape, cluster, replace(settings, **row)):
                options.append(row)
    ranking: list[Ranked] = []
    if settings.cp > 1:  # CP rows, and the others at the same global batch (plan/context.py)
        options, apart = cp_options(cluster, settings, options, keep_strategy, shape)
        ranking += [Ranked(label, None, reason) for label, reason in apart]
    for opt in options:
        s = replace(settings, **opt)
        p = _best_for(shape, gpu, cluster, s, headroom, **kw)
        tight = make_plan(
            shape, gpu, cluster,
            replace(s, micro_batch=1, checkpoint_layers=shape.n_layers), headroom, **kw,
        )  # fmt: skip
        label = tight.strategy_label
        if p is not None:
            ranking.append(Ranked(label, p, ""))
            continue
        if not tight.fits_device:
            reason = (
                f"does not fit: {tight.memory['peak'] / GiB:.1f} GiB peak > "
                f"{tight.budget / GiB:.1f} GiB even at micro-batch 1, all layers checkpointed"
            )
        else:
            reason = (
                f"does not fit: {tight.memory['host_per_node'] / GiB:.0f} GiB of host memory per "
                f"node > {tight.host_budget / GiB:.0f} GiB"
            )
        ranking.append(Ranked(label, None, reason))

    fitting = [r.plan for r in ranking if r.plan is not None]
    best = _pick(fitting)
    if best is not None:
        for r in ranking:
            if r.plan is not None:
                r.reason = "fastest" if r.plan is best else _why_slower(r.plan, best)
        ranking.sort(key=lambda r: (r.plan is None, r.plan.time.step_s if r.plan else 0.0))
        s = best.settings
        msg = (
            f"{best.strategy_label}: micro-batch {s.micro_batch}, grad-accum {s.grad_accum}, "
            f"{s.checkpoint_layers}/{shape.n_layers} layers checkpointed "
            f"(peak {best.memory['peak'] / GiB:.1f} GiB of {best.budget / GiB:.1f} GiB usable)"
        )
        return Suggestion(best, None, msg, ranking, _why(best, ranking))

    # Nothing fits here: more GPUs shrink the sharded states (not buffers or activations).
    tightest = replace(settings, micro_batch=1, checkpoint_layers=shape.n_layers)
    options = [{"strategy": "full", "offload": False}, {"strategy": "full", "offload": True}]
    found: list[tuple[int, str]] = []
    for opt in options if not keep_strategy else [settings.strategy_kwargs()]:
        n = _gpus_needed(shape, gpu, cluster, replace(tightest, **opt), headroom, max_gpus, **kw)
        if n is not None:
            found.append((n, "with CPU offload" if opt.get("offload") else ""))
    if found:
        n, how = min(found)
        g = cluster.gpus_per_node
        return Suggestion(
            None,
            n,
            f"does not fit on {cluster.gpus} GPUs with any strategy, even with micro-batch 1 "
            f"and every layer checkpointed; {n} GPUs ({n // g} nodes of {g}) would fit"
            + (f" ({how})" if how else ""),
            ranking,
        )
    return Suggestion(
        None,
        None,
        f"does not fit at any GPU count up to {max_gpus}: the unsharded part (gather buffers, "
        "activations of one micro-batch) alone exceeds the GPU memory",
        ranking,
    )


def _modelled(shape: ModelShape, cluster: Cluster, s: Settings) -> bool:
    """Whether the plan models this mesh row with the rest of the settings (not, e.g., with
    8-bit gathers: ``parallel.check_mesh``)."""
    from layershard.plan.parallel import Mesh, check_mesh

    try:
        check_mesh(shape, Mesh(cluster.gpus, s.tp, s.ep), s)
    except ValueError:
        return False
    return s.blocks_per_unit == 1 or (s.tp, s.ep) == (1, 1)


def _gpus_needed(
    shape: ModelShape,
    gpu: GPU,
    cluster: Cluster,
    tight: Settings,
    headroom: float,
    max_gpus: int,
    **kw: Any,
) -> int | None:
    g = cluster.gpus_per_node
    n = max(cluster.gpus * 2, g)
    while n <= max_gpus:
        c = Cluster(n, g) if n >= g else Cluster(n, n)
        if n % tight.cp == 0 and make_plan(shape, gpu, c, tight, headroom, **kw).fits:
            # refine downwards to a multiple of the node size
            lo = -(-max(cluster.gpus + 1, g) // g) * g
            for m in range(lo, n + 1, g):
                c = Cluster(m, g)
                if m % tight.cp == 0 and make_plan(shape, gpu, c, tight, headroom, **kw).fits:
                    return m
            return n
        n *= 2
    return None


def _why(best: Plan, ranking: list[Ranked]) -> str:
    """One sentence on why the winner wins."""
    t = best.time
    where = "on the CPU" if best.settings.offload else "on the GPU"
    shares = {
        "compute-bound": t.compute_s,
        "communication-bound": t.exposed_comm_s,
        f"bound by the optimizer step {where}": t.optimizer_s,
        "bound by compute-stream copies": t.copy_s,
    }
    bound = max(shares, key=lambda k: shares[k])
    others = [r for r in ranking if r.plan is not None and r.plan is not best]
    misfits = [r.label for r in ranking if r.plan is None and r.reason.startswith("does not")]
    if others:
        head = f"fastest of the {len(others) + 1} strategies that fit"
    else:
        head = "the only strategy that fits"
    parts = [f"{head} ({bound} at this setting"]
    if t.exposed_comm_s > 0:
        parts[-1] += f", {t.exposed_comm_s:.3f} s of communication not hidden"
    parts[-1] += ")"
    if others:
        runner, runner_plan = min(
            ((r, r.plan) for r in others if r.plan is not None), key=lambda rp: rp[1].time.step_s
        )
        ratio = runner_plan.time.step_s / t.step_s
        parts.append(f"next: {runner.label} at {ratio:.2f}x: {runner.reason}")
    if misfits:
        parts.append(f"{len(misfits)} do not fit")
    return "; ".join(parts)
