"""Communication per step by strategy, group and link, and the FLOPs of each unit (the step's
time from them is ``plan/steptime.py``).

Strategies (as ``layershard.engine.strategy`` resolves them on N ranks, G per node): a unit is split over
its *shard group* and replicated over its *replicate group*; groups are consecutive ranks (shard,
hpZ) or every K-th rank (replicate), as torch's ``DeviceMesh`` / ``new_subgroups`` build them.

    strategy            per micro-batch, per unit                      groups (size, stride)
    full                AG fwd, AG bwd, RS                             shard (N, 1)
    full, hpZ K         AG fwd over N, AG bwd over K, RS over N        shard (N, 1), hpz (K, 1)
    grad_op             AG fwd, RS (weights stay gathered)             shard (N, 1)
    hybrid K            AG fwd, AG bwd, RS over K; AR of the slice     shard (K, 1),
                        across the N/K groups                          replicate (N/K, K)
    no_shard            AR of the whole unit                           replicate (N, 1)

AG bwd skips the root unit (gathered all step), the last two units of the forward (still
gathered) and an untied embedding (its backward needs the token ids, not the table). Reductions
(RS, and AR after it) happen in every micro-batch, or only in the last one under ``no_sync()``.
Gathers move the compute dtype, reductions the reduce dtype; every unit's buffer is padded to a
multiple of the shard group (``Unit.padded_numel``).

Links. A ring over a group of m ranks sends ``(N-1)/N`` of the buffer per rank (``2 (m-1)/m``
for an all-reduce). If the group lies in one node, all of it crosses NVLink. Otherwise, with p of
its ranks per node, NCCL runs p rings, one per NIC, each leaving a node once, so per GPU

    network bytes = sent / p        NVLink bytes = sent * (p - 1) / p

(hybrid's all-reduce across groups has p = G / K: with K = G every GPU talks to its peers in
other nodes through its own NIC and nothing crosses NVLink). A collective takes
``max(nvlink / (intra_bw * eff.nvlink), network / (inter_bw * eff.network)) + latency``
(NCCL's ring/tree latency, ``plan/network.py``).

CPU offload (``offload=ls.CPUOffload()``): the fp32 shards live in host memory, so every gather
from them first copies the shard to the device in the compute dtype (``S_u c`` bytes over PCIe;
hpZ's backward gathers read the device-resident 1/K and copy nothing), and every reduction
copies the reduced chunk (``S_u r`` bytes) back; both ride on the communication stream (the
engine issues them there, before the all-gather and after the reduce-scatter). The optimizer
steps on the CPU: its bytes stream through the node's DRAM, shared by the node's ranks.

``no_shard`` in a compute dtype other than fp32 (or offloaded) casts/copies each unit into its
gather buffer at every forward on the *compute* stream (no collective to hide it behind):
``numel_u (4 + c)`` bytes through HBM (or ``numel_u c`` over PCIe when offloaded).

Compute (FLOPs per micro-batch of T = b s tokens; PaLM's convention, Chowdhery et al. 2022,
App. B: attention counted without the causal halving):

    block forward     2 P_mm T + 4 s h hd T      (P_mm = block matmul weights)
    LM head forward   2 V d T
    backward          2 x forward;  a checkpointed block also recomputes its forward, and
                      the chunked loss (``loss_chunks``) the LM head's
    model FLOPs       6 (L P_mm + V d) T + 12 L s h hd T     (no recompute: used for MFU)

Model FLOPs are what published MFU counts; a stage's compute *time* comes from its GEMMs,
attention and element-wise work (``plan/kernels.py``), or from its FLOPs at ``eff.compute`` of
peak where that is given.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from layershard.engine.gather_slots import assign_gather_slots, gathered_into_backward
from layershard.plan.hardware import Cluster
from layershard.plan.memory import dtype_bytes, strategy_name
from layershard.plan.model import ModelShape, Unit, block_groups, units

# Bytes the optimizer step streams per shard element (fp32 states): read p, g and each state,
# write p and each state.
OPTIMIZER_STEP_BYTES = {"adamw": 28, "adamw-fused": 28, "adam": 28, "sgd": 20, "sgd-nomomentum": 12}


# --- strategies resolved on a cluster ----------------------------------------------------------


@dataclass(frozen=True)
class Layout:
    """A strategy on N ranks: the groups its collectives run on (as ``strategy.resolve``)."""

    strategy: str  # full | grad_op | no_shard | hybrid
    world: int
    shard: int  # ranks a unit is split over
    hpz: int = 1  # full with reshard_after_forward=K: backward gathers over K ranks (K > 1)
    offload: bool = False

    @property
    def replicas(self) -> int:
        return self.world // self.shard

    @property
    def keep_gathered(self) -> bool:
        return self.strategy in ("grad_op", "no_shard")

    def describe(self) -> str:
        s = {
            "full": "full",
            "grad_op": "grad_op",
            "no_shard": "no_shard",
            "hybrid": f"hybrid, shard {self.shard} x replicate {self.replicas}",
        }[self.strategy]
        if self.hpz > 1:
            s += f", hpZ over {self.hpz}"
        return s + (", offload" if self.offload else "")


def resolve_layout(
    strategy: str,
    world: int,
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    gpus_per_node: int | None = None,
    offload: bool = False,
) -> Layout:
    """The groups of ``ls.shard(strategy=..., shard_size=..., reshard_after_forward=...)`` on
    ``world`` ranks; hybrid's ``shard_size`` defaults to the ranks of a node, as the engine's
    does (``LOCAL_WORLD_SIZE``)."""
    name = strategy_name(strategy)
    n = int(world)
    # the engine refuses these combinations (strategy.resolve): so does the plan
    if shard_size is not None and name != "hybrid":
        raise ValueError(f"shard_size applies to strategy='hybrid', not {name!r}")
    if reshard_after_forward is not True and name != "full":
        raise ValueError(f"reshard_after_forward applies to strategy='full', not {name!r}")
    if name == "full" and reshard_after_forward is False:
        name = "grad_op"
    if name == "hybrid":
        k = int(shard_size or min(n, gpus_per_node or n))
        if k < 1 or n % k:
            raise ValueError(f"shard_size={k} must divide the world size {n}")
        return Layout("hybrid", n, k, offload=offload)
    if name == "no_shard":
        return Layout("no_shard", n, 1, offload=offload)
    hpz = 1
    if name == "full" and reshard_after_forward not in (True, False):
        k = int(reshard_after_forward)
        if k < 1 or n % k:
            raise ValueError(f"reshard_after_forward={k} must divide the world size {n}")
        if k == 1 and n > 1:
            # the engine then keeps a whole copy of every unit: grad_op does the same for less
            raise ValueError("reshard_after_forward=1 is not modelled; use strategy='grad_op'")
        hpz = k if k < n else 1
    return Layout(name, n, n, hpz, offload=offload)


# --- bytes by link -----------------------------------------------------------------------------


def ring_bytes(
    full_bytes: int,
    world_size: int,
    cluster: Cluster | None = None,
    stride: int = 1,
    factor: float = 1.0,
) -> dict[str, float]:
    """Bytes one rank sends in a ring collective over ``world_size`` ranks spaced ``stride``
    apart, by link: ``factor (m-1)/m`` of ``full_bytes`` (factor 2 for an all-reduce). On a
    ``by_node`` cluster a group of several ranks on each of M nodes sends each chunk across
    once: ``factor (M-1)/M`` of ``full_bytes`` per node, shared by its ranks."""
    m = world_size
    sent = factor * (m - 1) / m * full_bytes
    if cluster is None or cluster.nodes == 1:
        return {"nvlink": sent, "network": 0.0}
    g = cluster.local
    per_node = max(1, min(m, g // stride)) if stride <= g else 1
    if per_node >= m:  # the whole group in one node
        return {"nvlink": sent, "network": 0.0}
    nvlink = sent * (per_node - 1) / per_node
    if cluster.by_node and per_node > 1:
        nodes = m // per_node
        return {"nvlink": nvlink, "network": factor * (nodes - 1) / nodes * full_bytes / per_node}
    return {"nvlink": nvlink, "network": sent / per_node}


def a2a_bytes(
    full_bytes: int, world_size: int, cluster: Cluster | None = None, stride: int = 1
) -> dict[str, float]:
    """Bytes one rank sends in an all-to-all of ``full_bytes`` (its send buffer, a 1/m part
    to each of the m ranks) by link: (m - 1)/m of it leaves the rank, the parts for the p - 1
    other ranks of its node over NVLink, the m - p others over the network."""
    m = world_size
    if cluster is None or cluster.nodes == 1:
        return {"nvlink": (m - 1) / m * full_bytes, "network": 0.0}
    g = cluster.local
    p = min(m, max(1, g // stride)) if stride <= g else 1
    return {"nvlink": (p - 1) / m * full_bytes, "network": (m - p) / m * full_bytes}


@dataclass(frozen=True)
class Transfer:
    """One collective or host copy. ``nbytes`` is the full buffer for collectives (as
    ``comm_stats()`` counts them) and the bytes copied for ``h2d`` / ``d2h``."""

    op: str  # all_gather | reduce_scatter | all_reduce | all_to_all | send_recv | h2d | d2h
    phase: str  # forward | backward
    group: str  # shard | hpz | replicate | pcie; tp | ep | efsdp (plan/parallel.py); cp
    size: int  # ranks in the group (1 for a copy)
    stride: int
    nbytes: int

    @property
    def kind(self) -> str:
        """The row of the plan's communication table it is tallied under (a TP group's
        all-reduces and the experts' collectives apart: plan/parallel.py)."""
        if self.group == "tp":
            return "tp_" + self.op
        if self.group == "cp":  # context parallelism's (plan/context.py)
            return "cp_ring" if self.op == "send_recv" else "cp_" + self.op
        kind = self.op
        if self.op == "all_gather":
            kind = "all_gather_fwd" if self.phase == "forward" else "all_gather_bwd"
        return "expert_" + kind if self.group == "efsdp" else kind


@dataclass
class Stage:
    name: str
    fwd_flops: float = 0.0
    bwd_flops: float = 0.0
    gather_fwd: list[Transfer] = field(default_factory=list)  # before the forward (comm stream)
    gather_bwd: list[Transfer] = field(default_factory=list)  # before the backward
    reduce: list[Transfer] = field(default_factory=list)  # after the backward
    local_copy: int = 0  # bytes through HBM on the compute stream per forward (no_shard casts)
    local_h2d: int = 0  # bytes over PCIe on the compute stream per forward (no_shard offload)
    local_d2h: int = 0  # ... per backward (offload on one rank: nothing to reduce, a copy)
    own_slot: bool = False  # a small unit out of the alternation (gather_slots.py)
    # elements quantized (the rank's shard) and dequantized (the gathered buffer) on the compute
    # stream per forward and per backward, when weights travel in fp8/int8
    wire_fwd: tuple[int, int] = (0, 0)
    wire_bwd: tuple[int, int] = (0, 0)
    # collectives the compute waits for (TP's all-reduces, EP's all-to-alls: plan/parallel.py)
    blocking_fwd: list[Transfer] = field(default_factory=list)
    blocking_bwd: list[Transfer] = field(default_factory=list)


@dataclass(frozen=True)
class Wire:
    """What a step's transfers carry per element: the compute dtype's bytes ``c`` (gathered
    weights, activations), the reduction's ``r``, and the dtype weights travel in over the
    all-gathers (``gather_dtype``: fp8 or int8; None: the compute dtype). One object through
    every function that builds a step's transfers."""

    c: int = 2
    r: int = 4
    gather_dtype: str | None = None

    @staticmethod
    def of(param_dtype: Any, reduce_dtype: Any, gather_dtype: str | None = None) -> Wire:
        """From the dtypes as ``Settings`` or torch name them (``"bf16"``, ``torch.float32``)."""
        if gather_dtype not in (None, "fp8", "int8"):
            raise ValueError(f"gather dtype {gather_dtype!r}: fp8, int8 or None")
        return Wire(dtype_bytes(param_dtype), dtype_bytes(reduce_dtype), gather_dtype)

    def gathered_bytes(self, padded: int, shard: int, k: int) -> int:
        """Bytes of one all-gather of a flat buffer (``padded`` elements, ``shard`` per rank over
        ``k`` ranks): the compute dtype's ``c`` per element, or the wire dtype's
        (engine/wire_dtype.py): fp8 one byte, int8 one byte and a 4-byte scale per 256 of each
        rank's slice."""
        if self.gather_dtype == "fp8":
            return padded
        if self.gather_dtype == "int8":
            return k * (shard + 4 * -(-shard // 256))
        return padded * self.c


def _unit_transfers(
    u: Unit, layout: Layout, w: Wire, regather: bool
) -> tuple[list[Transfer], list[Transfer], list[Transfer], tuple[int, int, int]]:
    """A unit's gather (forward), gather (backward) and reduction transfers per micro-batch
    (reductions: when this micro-batch reduces), and its compute-stream copies (HBM bytes per
    forward, PCIe bytes per forward and per backward). ``w.gather_dtype``: weights over the shard
    group's all-gathers in fp8/int8 (hpZ's backward gathers its kept compute-dtype copy)."""
    n, k = layout.world, layout.shard
    c, r = w.c, w.r
    padded, shard = u.padded_numel(k), u.shard_numel(k)
    wire = w.gathered_bytes(padded, shard, k)
    off = layout.offload
    fwd: list[Transfer] = []
    bwd: list[Transfer] = []
    red: list[Transfer] = []
    local_copy = local_h2d = local_d2h = 0
    if k > 1:
        if off:
            fwd.append(Transfer("h2d", "forward", "pcie", 1, 1, shard * c))
        fwd.append(Transfer("all_gather", "forward", "shard", k, 1, wire))
        if regather and not layout.keep_gathered:
            if layout.hpz > 1:  # from the device-resident 1/K, within the K ranks
                bwd.append(Transfer("all_gather", "backward", "hpz", layout.hpz, 1, padded * c))
            else:
                if off:
                    bwd.append(Transfer("h2d", "backward", "pcie", 1, 1, shard * c))
                bwd.append(Transfer("all_gather", "backward", "shard", k, 1, wire))
        red.append(Transfer("reduce_scatter", "backward", "shard", k, 1, padded * r))
    elif off:  # one rank per shard: the "gather" is a copy on the compute stream
        local_h2d = padded * c
    elif c != 4:  # the fp32 shard cast into the gather buffer (fp32 computes in place)
        local_copy = padded * (4 + c)
    if layout.replicas > 1:
        red.append(Transfer("all_reduce", "backward", "replicate", layout.replicas, k, shard * r))
    if off and n > 1:
        red.append(Transfer("d2h", "backward", "pcie", 1, 1, shard * r))
    elif off:  # nothing to reduce: the engine copies the gradient at once, on the compute stream
        local_d2h = shard * r
    return fwd, bwd, red, (local_copy, local_h2d, local_d2h)


def block_fwd_flops(shape: ModelShape, tokens: int, seq_len: int) -> float:
    return 2 * shape.block_matmul_params * tokens + 4 * seq_len * shape.n_heads * shape.hd * tokens


def model_flops(shape: ModelShape, tokens: int, seq_len: int) -> float:
    """Training FLOPs of ``tokens`` tokens without recompute: 6 N T + 12 L s h hd T."""
    n = shape.n_layers * shape.block_matmul_params + shape.head_params
    return 6 * n * tokens + 12 * shape.n_layers * seq_len * shape.n_heads * shape.hd * tokens


def build_stages(
    shape: ModelShape,
    layout: Layout,
    micro_batch: int,
    seq_len: int,
    checkpoint_layers: int,
    wire: Wire,
    loss_chunks: int = 0,
    cp: int = 1,
    blocks_per_unit: int = 1,
) -> tuple[list[Stage], Stage | None]:
    """Stages in forward order, and the root unit's (gathered at the start of the forward,
    kept all step, reduced at the end of the backward; no compute of its own). The chunked
    loss (``loss_chunks``) computes the logits again in the head's backward. ``cp``: each rank
    computes ``seq_len / cp`` tokens of each sequence, over the whole sequence's keys.
    ``blocks_per_unit`` K: a stage per K blocks (one unit), computing theirs."""
    tokens = micro_batch * seq_len // cp
    k = max(0, min(checkpoint_layers, shape.n_layers))
    bf = block_fwd_flops(shape, tokens, seq_len)
    head = 2 * shape.head_params * tokens
    stages = [Stage("embed")] + ([Stage("pos")] if shape.pos_params else [])
    for name, group in block_groups(shape.n_layers, blocks_per_unit):
        recompute = bf * sum(j < k for j in group)
        stages.append(Stage(name, bf * len(group), 2 * bf * len(group) + recompute))
    stages += [Stage("norm"), Stage("lm_head", head, 2 * head + (head if loss_chunks else 0.0))]
    by_name = {s.name: s for s in stages}
    us = units(shape, blocks_per_unit)
    sharded = [u for u in us if not u.persistent]
    # Still gathered when backward starts (buffers.py, "between the passes"); the others are
    # gathered again.
    lookup = bool(sharded) and not sharded[0].needs_weights_in_backward
    blocks = [u.kind == "block" for u in sharded]
    which = assign_gather_slots([u.padded_numel(layout.shard) for u in sharded], lookup, blocks)
    resident = {u.name for u, kept in zip(sharded, gathered_into_backward(which)) if kept}
    if not layout.keep_gathered:
        for u, k in zip(sharded, which):
            by_name[u.name].own_slot = k >= 2
    root = None
    for u in us:
        regather = u.needs_weights_in_backward and not u.persistent and u.name not in resident
        fwd, bwd, red, local = _unit_transfers(u, layout, wire, regather)
        s = Stage("<root>") if u.persistent else by_name[u.name]
        s.gather_fwd, s.gather_bwd, s.reduce = fwd, bwd, red
        s.local_copy, s.local_h2d, s.local_d2h = local
        if wire.gather_dtype is not None and layout.shard > 1:
            quantized = (u.shard_numel(layout.shard), u.padded_numel(layout.shard))
            s.wire_fwd = quantized
            if any(t.group == "shard" and t.op == "all_gather" for t in bwd):
                s.wire_bwd = quantized
        if u.persistent:
            root = s
    return stages, root


def step_transfers(
    stages: list[Stage],
    root: Stage | None,
    grad_accum: int,
    no_sync: bool,
    world_size: int = 1,
    gathers_in_backward: bool = True,
) -> list[Transfer]:
    """Every transfer of one optimizer step, in issue order per micro-batch."""
    everything = ([root] if root else []) + stages
    n_trainable = sum(1 for s in everything if s.reduce)
    out: list[Transfer] = []
    for j in range(grad_accum):
        reduce_now = not no_sync or j == grad_accum - 1
        if world_size > 1 and (reduce_now or gathers_in_backward):
            # The ranks' agreement on the units this backward reaches: three int64 flags per
            # trainable unit over every rank, at the start of each backward that communicates
            # (Schedule._plan_backward, docs/engine.md)
            out.append(Transfer("all_reduce", "backward", "all", world_size, 1, 24 * n_trainable))
        for s in everything:
            out += s.gather_fwd
        for s in reversed(everything):
            out += s.gather_bwd
            if reduce_now:
                out += s.reduce
    return out


def _aggregate(transfers: Iterable[Transfer]) -> dict[str, dict[str, int]]:
    """``comm_stats()``'s format: ``{op: {"count", "bytes", <phase>: count}}``, collectives only."""
    out: dict[str, dict[str, int]] = {}
    for t in transfers:
        if t.group == "pcie":
            continue
        d = out.setdefault(t.op, {"count": 0, "bytes": 0})
        d["count"] += 1
        d["bytes"] += t.nbytes
        d[t.phase] = d.get(t.phase, 0) + 1
    return {op: out[op] for op in sorted(out)}


def _step_transfers_for(
    config: Any,
    world_size: int,
    wire: Wire,
    grad_accum: int,
    no_sync: bool,
    strategy: str,
    shard_size: int | None,
    reshard_after_forward: bool | int,
    offload: bool,
    gpus_per_node: int | None,
    blocks_per_unit: int = 1,
) -> list[Transfer]:
    shape = ModelShape.from_config(config)
    layout = resolve_layout(
        strategy, world_size, shard_size, reshard_after_forward, gpus_per_node, offload
    )
    stages, root = build_stages(shape, layout, 1, 1, 0, wire, blocks_per_unit=blocks_per_unit)
    return step_transfers(stages, root, grad_accum, no_sync, world_size, not layout.keep_gathered)


def collectives_per_step(
    config: Any,
    world_size: int,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    grad_accum: int = 1,
    no_sync: bool = False,
    strategy: str = "full",
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    gather_dtype: str | None = None,
    blocks_per_unit: int = 1,
) -> dict[str, dict[str, int]]:
    """The collectives of one optimizer step, in the format of ``ShardedModule.comm_stats()``:
    count, full-buffer bytes (before the (N-1)/N ring factor) and count per phase (without
    ``clip_grad_norm_``'s scalar all-reduce, and with fp8 gathers without the scales'
    all-reduce per forward). See the module docstring for each strategy."""
    wire = Wire.of(param_dtype, reduce_dtype, gather_dtype)
    ts = _step_transfers_for(
        config, world_size, wire, grad_accum, no_sync, strategy, shard_size,
        reshard_after_forward, offload, None, blocks_per_unit,
    )  # fmt: skip
    return _aggregate(ts)


def collectives_by_group(
    config: Any,
    world_size: int,
    grad_accum: int = 1,
    no_sync: bool = False,
    strategy: str = "full",
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
) -> dict[str, dict[str, int]]:
    """``{op: {group: count}}`` per step, as the engine's ``CommStats.by_group()``."""
    ts = _step_transfers_for(
        config, world_size, Wire.of("bf16", "fp32"), grad_accum, no_sync, strategy, shard_size,
        reshard_after_forward, False, None,
    )  # fmt: skip
    out: dict[str, dict[str, int]] = {}
    for t in ts:
        g = out.setdefault(t.op, {})
        g[t.group] = g.get(t.group, 0) + 1
    return {op: out[op] for op in sorted(out)}


def transfers_by_link(
    config: Any,
    cluster: Cluster,
    param_dtype: Any = "bf16",
    reduce_dtype: Any = "fp32",
    grad_accum: int = 1,
    no_sync: bool = False,
    strategy: str = "full",
    shard_size: int | None = None,
    reshard_after_forward: bool | int = True,
    offload: bool = False,
    gather_dtype: str | None = None,
) -> dict[tuple[str, str, int], dict[str, float]]:
    """Bytes one GPU sends per step, by (kind, group, group size) and link (nvlink, network,
    pcie): which links each strategy's collectives cross on ``cluster``."""
    wire = Wire.of(param_dtype, reduce_dtype, gather_dtype)
    ts = _step_transfers_for(
        config, cluster.gpus, wire, grad_accum, no_sync, strategy, shard_size,
        reshard_after_forward, offload, cluster.gpus_per_node,
    )  # fmt: skip
    out: dict[tuple[str, str, int], dict[str, float]] = {}
    for t in ts:
        row = out.setdefault(
            (t.kind, t.group, t.size), {"nvlink": 0.0, "network": 0.0, "pcie": 0.0}
        )
        for link, b in _links(t, cluster).items():
            row[link] += b
    return out


def _links(t: Transfer, cluster: Cluster) -> dict[str, float]:
    if t.group == "pcie":
        return {"pcie": float(t.nbytes)}
    if t.group == "cp" and _straddles(t.size, cluster):
        return _cp_links(t)
    if t.op == "send_recv":  # a ring's hop to the next rank: all of it leaves the rank
        if cluster.nodes > 1 and t.size > cluster.local:  # a group of whole nodes: its slowest
            return {"nvlink": 0.0, "network": float(t.nbytes)}  # hop crosses the network
        return {"nvlink": float(t.nbytes), "network": 0.0}
    if t.op == "all_to_all":
        return a2a_bytes(t.nbytes, t.size, cluster, t.stride)
    factor = 2.0 if t.op == "all_reduce" else 1.0
    return ring_bytes(t.nbytes, t.size, cluster, t.stride, factor)


def _straddles(size: int, cluster: Cluster) -> bool:
    """Whether some CP groups of ``size`` consecutive ranks span two nodes without being whole
    nodes (``local % size`` or ``size % local`` not 0): the plan times every group as its
    slowest, whose hops and exchanges then cross the network."""
    g = cluster.local
    return cluster.nodes > 1 and (g % size != 0 if size <= g else size % g != 0)


def _cp_links(t: Transfer) -> dict[str, float]:
    """A straddling CP group's transfer, all over the network (its slowest rank's)."""
    sent = t.nbytes * ((t.size - 1) / t.size if t.op == "all_to_all" else 1.0)
    return {"nvlink": 0.0, "network": float(sent)}
