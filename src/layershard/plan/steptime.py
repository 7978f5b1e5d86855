"""A step's time: each unit's compute from its shapes, each collective from the links, and the
engine's schedule between them.

**Compute** per unit and micro-batch (``plan/kernels.py``): a block's GEMMs, attention and
element-wise work (and its forward again in backward when checkpointed: hardware work that
model FLOPs, and so published MFU, do not count); the LM head's GEMMs and its loss. Where the
GPU has no kernel model (or ``--compute-eff`` is given) the FLOPs at ``eff.compute`` of peak.

**Communication** (``plan/network.py``): each collective's bytes over NVLink and the network
at the links' bandwidth and efficiency, plus NCCL's latency for its ring or tree (or a flat
``latency_s`` per collective when one is given); PCIe copies at ``eff.pcie``.

**Schedule** (the engine's: one communication stream, the next unit's gather issued when a
unit starts, ``engine/gather_slots.py`` for who shares a window): in each window the compute
``C`` runs beside the transfers ``A``; while a collective runs, NCCL's kernels hold SMs and
HBM bandwidth, so the compute slows by ``eff.contention`` of the overlapped time:

    window = max(C + contention x min(A, C), A)
    forward  = AG(root) + AG(first) + sum_i window(C_fwd[i], AG[i+1])
    backward = sum_i window(C_bwd[i], AG_bwd[i-1] + RS[i+1]) + RS(first) + RS(root)
    step     = sum over micro-batches (forward + backward) + optimizer

``exposed`` communication is what a window spends beyond its (slowed) compute, charged to the
link that bounded each transfer in it (NVLink, network, PCIe, or latency).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from layershard.plan.context import ContextTime
from layershard.plan.hardware import GPU, Cluster
from layershard.plan.kernels import StageCompute, block_compute, head_compute
from layershard.plan.model import ModelShape, units
from layershard.plan.network import Links, collective_latency_s
from layershard.plan.sources import KERNELS, Efficiency, elementwise_floors
from layershard.plan.timing import (
    OPTIMIZER_STEP_BYTES,
    Layout,
    Stage,
    Transfer,
    Wire,
    _links,
    build_stages,
    model_flops,
    resolve_layout,
)

LINKS = ("nvlink", "network", "pcie", "latency")
Xfer = tuple[float, dict[str, float]]  # a transfer's time and each link's share of it


@dataclass
class TimePlan:
    stages: list[Stage]
    comm_bytes: dict[str, dict[str, float]]  # kind -> link -> bytes per step per GPU
    comm_groups: dict[str, str]  # kind -> the groups it runs on, e.g. "shard 64/8 nodes"
    forward_s: float
    backward_s: float
    optimizer_s: float
    step_s: float
    compute_s: float  # compute per step, recompute included, not slowed by collectives
    copy_s: float  # compute-stream copies (no_shard's casts / offloaded copies)
    comm_s: float  # everything on the comm stream, if nothing overlapped
    exposed_comm_s: float  # step time not covered by compute, contention, copies, optimizer
    model_flops: float  # per GPU per step
    hardware_flops: float
    mfu: float
    tokens_per_s_per_gpu: float
    layout: Layout | None = None
    assumptions: dict[str, Any] = field(default_factory=dict)
    compute_by_kind: dict[str, float] = field(default_factory=dict)  # sums to compute_s
    exposed_by_link: dict[str, float] = field(default_factory=dict)  # sums to exposed_comm_s
    contention_s: float = 0.0  # compute slowed by concurrent collectives
    context: dict[str, Any] | None = None  # a CP row's (plan/context.py ContextTime.report)


def group_label(t: Transfer, cluster: Cluster) -> str:
    """E.g. ``shard 64/8 nodes``, ``shard 8/node``, ``replicate 8/8 nodes``, ``PCIe``."""
    if t.group == "pcie":
        return "PCIe"
    return f"{t.group} {t.size}/" + (
        "node" if _nodes(t, cluster) == 1 else f"{_nodes(t, cluster)} nodes"
    )


def _nodes(t: Transfer, cluster: Cluster) -> int:
    g = cluster.local
    per_node = max(1, min(t.size, g // t.stride)) if t.stride <= g else 1
    return -(-t.size // per_node)


class _Window:
    """What one window of the schedule costs, and where its exposed time goes."""

    def __init__(self, contention: float) -> None:
        self.contention = contention
        self.total = self.slowed = 0.0
        self.exposed = dict.fromkeys(LINKS, 0.0)

    def add(self, compute: float, transfers: list[Xfer], counted: bool = False) -> None:
        """``counted``: the compute is already in another window (a CP hop hides under part of
        a block's compute, plan/context.py): only its slowdown and what it exposes count."""
        a = sum(t for t, _ in transfers)
        slow = self.contention * min(a, compute)
        t = max(compute + slow, a)
        self.total += t - compute if counted else t
        self.slowed += slow
        extra = t - compute - slow
        if extra > 0 and a > 0:
            for dt, parts in transfers:
                for link, share in parts.items():
                    self.exposed[link] += extra * dt / a * share


def forward_windows(
    cf: list[float], ag: list[list[Xfer]], own_slot: list[bool]
) -> list[tuple[float, list[Xfer]]]:
    """The forward's windows after the first gather: each unit's compute against the next
    unit's gather (issued a unit earlier). A small unit in a gather slot of its own computes in
    its predecessor's window, and the next unit's gather overlaps that whole window."""
    out, i, m = [], 0, len(cf)
    while i < m:
        j = i + 1
        while j < m and own_slot[j]:
            j += 1
        out.append((sum(cf[i:j]), [x for q in ag[i + 1 : j + 1] for x in q]))
        i = j
    return out


def _compute(shape: ModelShape, stages: list[Stage], gpu: GPU, e: Efficiency, tokens: int,
             seq: int, k: int, c: int, loss: str, chunks: int) -> list[StageCompute]:  # fmt: skip
    """Each stage's compute by kind (``kernels.py``), or its FLOPs at ``eff.compute`` of peak
    where the GPU has no kernel model or the efficiency was given."""
    km = KERNELS.get(gpu.kernels) if gpu.kernels else None
    out = []
    hbm = gpu.hbm_bw_gbs * 1e9
    if km is None or e.compute is not None:
        rate = gpu.peak_flops * (e.compute if e.compute is not None else 0.5)
        for s in stages:
            out.append(StageCompute({"flops": s.fwd_flops / rate}, {"flops": s.bwd_flops / rate}))
        return out
    scale = 1.0 / e.compute_scale
    floors = elementwise_floors(shape.family)
    for s in stages:
        if s.name.startswith("layers."):  # one block, or several as one unit ("layers.0+...")
            sc = StageCompute({}, {})
            for name in s.name.split("+"):
                one = block_compute(shape, tokens, seq, gpu.peak_flops, hbm, km, floors, c,
                                    recompute=int(name.split(".")[1]) < k)  # fmt: skip
                for mine, theirs in ((sc.fwd, one.fwd), (sc.bwd, one.bwd)):
                    for kk, v in theirs.items():
                        mine[kk] = mine.get(kk, 0.0) + v
        elif s.name == "lm_head":
            sc = head_compute(shape, tokens, gpu.peak_flops, hbm, km, c, loss, chunks)
        else:  # embedding lookups, the final norm: their bytes
            sc = StageCompute({"elementwise": 2 * c * shape.dim * tokens / hbm}, {})
        att = 1.0 / e.attention_scale
        sc.fwd = {kk: v * scale * (att if kk == "attention" else 1.0) for kk, v in sc.fwd.items()}
        sc.bwd = {kk: v * scale * (att if kk == "attention" else 1.0) for kk, v in sc.bwd.items()}
        out.append(sc)
    return out


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
    compute_eff: float | None = None,
    comm_eff: float | None = None,
    latency_s: float | None = None,
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    optimizer: str = "adamw",
    eff: Efficiency | None = None,
    loss_chunks: int = 0,
    loss: str = "fp32",
    links: Links | None = None,
    gather_dtype: str | None = None,
    mesh: Any = None,
    latency_fn: Callable[[str, int, int], float] | None = None,
    cp: int = 1,
    cp_mode: str = "ring",
    blocks_per_unit: int = 1,
) -> TimePlan:
    """Step time of one optimizer step (module docstring). Efficiencies: ``eff`` (default: the
    GPU's), ``compute_eff`` (a fraction of peak for every FLOP, instead of the kernel model)
    and ``comm_eff`` (NVLink and network alike) overriding its fields. ``links``: a cluster's
    bandwidths and efficiencies (``network.CLUSTERS``) instead of the GPU's defaults.
    ``latency_s``: a flat latency per collective instead of NCCL's ring/tree model;
    ``latency_fn(op, ranks, nodes)``: one's own (the testbed's, ``plan/testbed.py``).
    ``gather_dtype``: fp8/int8 weights over the all-gathers (their bytes, and the quantize and
    dequantize time at ``gpu.wire_s_per_elem``: measured on the testbed's CPU, 0 on a GPU). ``mesh``: a ``parallel.Mesh`` (TP and EP sizes;
    ``plan/parallel.py``). ``cp``, ``cp_mode``: context parallelism, ``micro_batch`` sequences
    per CP group of ``cp`` ranks (``plan/context.py``). ``blocks_per_unit``: K blocks per unit
    (``ls.shard(blocks_per_unit=K)``), not modelled with a mesh or ``cp``."""
    if blocks_per_unit > 1 and (cp > 1 or (mesh is not None and not mesh.trivial)):
        raise ValueError("predict_time: blocks_per_unit above 1 is not modelled with tp/ep/cp")
    shape = ModelShape.from_config(config)
    full, mt = shape, None
    if mesh is not None and not mesh.trivial:
        from layershard.plan.parallel import MeshTime

        mt = MeshTime(shape, mesh)
        shape = mt.local
    e = eff or gpu.eff
    intra_gbs, inter_gbs = gpu.intra_bw_gbs, gpu.inter_bw_gbs
    if links is not None:
        e = replace(e, nvlink=links.intra_eff, network=links.inter_eff)
    if compute_eff is not None:
        e = replace(e, compute=compute_eff)
    if comm_eff is not None:
        e = replace(e, nvlink=comm_eff, network=comm_eff)
    layout = (
        mt.layout
        if mt
        else resolve_layout(
            strategy,
            cluster.gpus,
            shard_size,
            reshard_after_forward,
            cluster.gpus_per_node,
            offload,
        )
    )
    wire = Wire.of(param_dtype, reduce_dtype, gather_dtype)
    c = wire.c
    stages, root = build_stages(
        shape, layout, micro_batch, seq_len, checkpoint_layers, wire, loss_chunks, cp,
        blocks_per_unit,
    )  # fmt: skip
    ct = ContextTime(shape, cp, cp_mode) if cp > 1 else None
    if mt:
        mt.extend(stages, root, micro_batch, seq_len, checkpoint_layers, wire)
    intra = intra_gbs * 1e9 * e.nvlink
    inter = inter_gbs * 1e9 * e.network
    pcie = gpu.pcie_gbs * 1e9 * e.pcie
    hbm = gpu.hbm_bw_gbs * 1e9

    comm_bytes: dict[str, dict[str, float]] = {}
    groups: dict[str, list[str]] = {}

    def one(t: Transfer) -> Xfer:
        """A transfer's time and the share of it each link (or latency) accounts for."""
        links_ = _links(t, cluster)
        if t.group == "pcie":
            return links_["pcie"] / pcie, {"pcie": 1.0}
        nv = links_["nvlink"] / intra
        net = links_["network"] / inter if inter else 0.0
        lat = (latency_s if latency_s is not None
               else (latency_fn or collective_latency_s)(t.op, t.size, _nodes(t, cluster)))  # fmt: skip
        tot = max(nv, net) + lat
        if tot <= 0:
            return 0.0, {}
        bw = max(nv, net)
        return tot, {("network" if net >= nv else "nvlink"): bw / tot, "latency": lat / tot}

    def many(ts: list[Transfer]) -> list[Xfer]:
        return [one(t) for t in ts]

    def tally(t: Transfer, times: int) -> None:
        row = comm_bytes.setdefault(t.kind, {"nvlink": 0.0, "network": 0.0, "pcie": 0.0})
        for link, b in _links(t, cluster).items():
            row[link] += b * times
        label = group_label(t, cluster)
        if label not in groups.setdefault(t.kind, []):
            groups[t.kind].append(label)

    n_reduce = 1 if no_sync else grad_accum
    for s in ([root] if root else []) + stages:
        for ts, times in ((s.gather_fwd, grad_accum), (s.gather_bwd, grad_accum),
                          (s.reduce, n_reduce), (s.blocking_fwd, grad_accum),
                          (s.blocking_bwd, grad_accum)):  # fmt: skip
            for t in ts:
                tally(t, times)

    tokens = micro_batch * seq_len  # a CP group's: each rank computes 1 / cp of them
    k = max(0, min(checkpoint_layers, shape.n_layers))
    sc = _compute(shape, stages, gpu, e, tokens // cp, seq_len, k, c, loss, loss_chunks)
    if mt:
        mt.add_compute(sc, stages, gpu, e, tokens, k, c)
    cp_f: list[tuple[float, list[Xfer]]] = []
    cp_b: list[tuple[float, list[Xfer]]] = []
    if ct:
        for t in ct.step_transfers(micro_batch, seq_len, c, k):
            tally(t, grad_accum)
        ct.add_compute(sc, stages, gpu, tokens // cp, seq_len, k)
        cp_f, cp_b = ct.windows(one, sc, stages, micro_batch, seq_len, c, k)
    # collectives the compute waits for (TP, EP): windows with nothing to hide them behind
    block_f = [x for s in stages for x in many(s.blocking_fwd)]
    block_b = [x for s in stages for x in many(s.blocking_bwd)]
    m = len(stages)
    ag, agb, rs = ([many(s.gather_fwd) for s in stages], [many(s.gather_bwd) for s in stages],
                   [many(s.reduce) for s in stages])  # fmt: skip
    wq, wd = gpu.wire_s_per_elem  # the 8-bit gathers' (de)quantization, where modelled
    copies = [s.local_copy / hbm + s.local_h2d / pcie + s.wire_fwd[0] * wq + s.wire_fwd[1] * wd
              for s in stages]  # fmt: skip
    copies_bwd = [s.local_d2h / pcie + s.wire_bwd[0] * wq + s.wire_bwd[1] * wd for s in stages]
    cf = [x.fwd_s + cp for x, cp in zip(sc, copies)]
    cb = [x.bwd_s + cp for x, cp in zip(sc, copies_bwd)]
    root_ag = many(root.gather_fwd) if root else []
    root_rs = many(root.reduce) if root else []
    root_copy = (root.local_copy / hbm + root.local_h2d / pcie) if root else 0.0
    root_copy_bwd = root.local_d2h / pcie if root else 0.0
    own = [s.own_slot for s in stages]

    w = _Window(e.contention)
    fwd = bwd = comm = 0.0
    for j in range(grad_accum):
        reduce_now = not no_sync or j == grad_accum - 1
        red = rs if reduce_now else [[] for _ in range(m)]
        before = w.total
        w.add(root_copy, root_ag + (ag[0] if ag else []))
        for compute, transfers in forward_windows(cf, ag, own):
            w.add(compute, transfers)
        if block_f:
            w.add(0.0, block_f)
        for compute, xs in cp_f:  # CP's hops and exchanges, within the blocks' compute
            w.add(compute, xs, counted=True)
        fwd += w.total - before
        before = w.total
        for i in reversed(range(m)):
            w.add(cb[i], (agb[i - 1] if i > 0 else []) + (red[i + 1] if i + 1 < m else []))
        w.add(root_copy_bwd, (red[0] if m else []) + (root_rs if reduce_now else []))
        if block_b:
            w.add(0.0, block_b)
        for compute, xs in cp_b:
            w.add(compute, xs, counted=True)
        bwd += w.total - before
        comm += sum(t for q in [root_ag, *ag, *agb, *red, block_f, block_b] for t, _ in q)
        comm += sum(t for _, xs in cp_f + cp_b for t, _ in xs)
        comm += sum(t for t, _ in root_rs) if reduce_now else 0.0

    opt_elems = sum(u.shard_numel(layout.shard) for u in units(shape))
    opt_elems += mt.expert_shard_elems if mt else 0
    opt_bytes = opt_elems * OPTIMIZER_STEP_BYTES.get(optimizer.lower(), 28)
    if offload:
        opt = opt_bytes / (gpu.host_bw_gbs * 1e9 / cluster.local * e.host)
    else:
        opt = opt_bytes / hbm
    step = fwd + bwd + opt
    by_kind: dict[str, float] = {}
    for x in sc:
        for part in (x.fwd, x.bwd):
            for kk, v in part.items():
                by_kind[kk] = by_kind.get(kk, 0.0) + v * grad_accum
    compute = sum(by_kind.values())
    copy_s = grad_accum * (sum(copies) + sum(copies_bwd) + root_copy + root_copy_bwd)
    share = 1 / mesh.tp if mt else 1 / cp  # a TP or CP group's tokens and model FLOPs, shared
    mflops = model_flops(full, tokens * grad_accum, seq_len) * share
    hflops = grad_accum * sum(s.fwd_flops + s.bwd_flops for s in stages)
    exposed = max(0.0, step - compute - copy_s - opt - w.slowed)
    return TimePlan(
        stages=stages, comm_bytes=comm_bytes,
        comm_groups={kk: ", ".join(v) for kk, v in groups.items()},
        forward_s=fwd, backward_s=bwd, optimizer_s=opt, step_s=step, compute_s=compute,
        copy_s=copy_s, comm_s=comm, exposed_comm_s=exposed, model_flops=mflops,
        hardware_flops=hflops, mfu=mflops / (step * gpu.peak_flops) if step > 0 else 0.0,
        tokens_per_s_per_gpu=tokens * grad_accum * share / step if step > 0 else 0.0,
        layout=layout,
        assumptions={
            "compute_eff": e.compute, "compute_model": "flat" if e.compute is not None
            or not gpu.kernels else f"kernels ({gpu.kernels})", "nvlink_eff": e.nvlink,
            "network_eff": e.network, "pcie_eff": e.pcie, "host_eff": e.host,
            "contention": e.contention, "latency_s": latency_s,
            "latency_model": "flat" if latency_s is not None else "nccl ring/tree",
            "peak_tflops": gpu.bf16_tflops, "intra_bw_gbs": intra_gbs,
            "inter_bw_gbs": inter_gbs, "pcie_gbs": gpu.pcie_gbs,
            "host_bw_gbs_per_node": gpu.host_bw_gbs,
            "cluster": links.name if links is not None else None,
        },
        compute_by_kind=by_kind, exposed_by_link=dict(w.exposed), contention_s=w.slowed,
        context=ct.report(one, lambda t: _links(t, cluster), sc, stages, micro_batch, seq_len, c,
                          k, grad_accum, e.contention) if ct else None,
    )  # fmt: skip
