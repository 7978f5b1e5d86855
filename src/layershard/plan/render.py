"""What ``layershard plan`` prints: a plan's memory by kind, its traffic and step time
(``render``), and the suggestion with the ranking of the strategies that fit
(``render_suggestion``)."""

from __future__ import annotations

from layershard.plan.context import render_lines as context_lines
from layershard.plan.parallel import train_flags, train_refuses
from layershard.plan.planner import Plan, Settings, Suggestion

GIB = 2**30

_LABELS = {
    "params": "params (fp32 master shards)",
    "grads": "grads (fp32 shards)",
    "optimizer": "optimizer state",
    "gather_buffers": "gather_buffers",
    "grad_buffers": "grad_buffers",
    "reduce_scratch": "reduce_scratch",
    "large_gather": "large_gather (units > a block)",
    "large_grad": "large_grad (units > a block)",
    "module_buffers": "module_buffers (RoPE tables)",
    "no_sync": "no_sync accumulators",
}
_HOST = ("params", "grads", "optimizer", "no_sync")


def _count(n: int) -> str:
    """A parameter count as people say it: 6.74B, 125.03M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def _gib(x: float) -> str:
    return f"{x / GIB:10.2f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:10.2f}"


def render(plan: Plan) -> str:
    sh, g, cl, s, mem, t = plan.shape, plan.gpu, plan.cluster, plan.settings, plan.memory, plan.time
    a = t.assumptions
    ffn = (
        f"{sh.n_experts} experts of ffn {sh.moe_ffn_dim}, top-{sh.top_k}" if sh.moe
        else f"ffn={sh.ffn_dim}"
    )  # fmt: skip
    lines = [
        f"layershard plan: {sh.name} ({_count(sh.total_params)} params, {sh.n_layers} layers, "
        f"d={sh.dim}, {ffn}, heads={sh.n_heads}/{sh.n_kv_heads} kv, "
        f"vocab={sh.vocab_size}, tied={'yes' if sh.tie_embeddings else 'no'})",
        f"  on {cl.gpus} x {g.name} ({cl.nodes} node(s) x {cl.local}; {g.memory_bytes / GIB:.1f} "
        f"GiB, {g.bf16_tflops:g} TFLOP/s bf16, NVLink {g.intra_bw_gbs:g} GB/s, "
        f"network {g.inter_bw_gbs:g} GB/s, PCIe {g.pcie_gbs:g} GB/s per GPU)",
        f"  seq {s.seq_len}, micro-batch {s.micro_batch}, grad-accum {s.grad_accum}, "
        f"{s.param_dtype} params, {s.reduce_dtype} reduce, "
        + (f"{s.gather_dtype} gathers, " if s.gather_dtype else "")
        + f"{s.optimizer}, "
        f"{s.checkpoint_layers}/{sh.n_layers} layers checkpointed",
        f"  strategy: {plan.strategy_label}",
        "",
        f"{'Memory per GPU':40s}{'GiB':>10s}",
    ]
    for key, label in _LABELS.items():
        where = "   (host)" if s.offload and key in _HOST else ""
        lines.append(f"  {label:38s}{_gib(mem[key])}{where}")
    lines += [
        f"  {'= model states (memory_report total)':38s}{_gib(mem['model_states'])}",
        f"  {'activations (saved for backward)':38s}{_gib(mem['activations'])}",
        f"  {_logits_label(s.loss_chunks):38s}{_gib(mem['logits'])}",
    ]
    if "cp_inflight" in mem:
        lines.append(f"  {'in-flight attention buffers (cp)':38s}{_gib(mem['cp_inflight'])}")
    if "loss_head_grad" in mem:
        lines.append(
            f"  {'head weight grad (in the chunked loss)':38s}{_gib(mem['loss_head_grad'])}"
        )
    lines += [
        f"  {'gather buffers given back at the loss':38s}{_gib(-mem['released_at_loss'])}",
        f"  {'one unit unsharded grads (backward)':38s}{_gib(mem['unit_grads'])}",
        f"  {'= peak on the GPU (max of fwd, bwd)':38s}{_gib(mem['peak'])}",
        f"  {'usable for tensors (after the margins)':38s}{_gib(plan.budget)}"
        f"   {'fits' if plan.fits_device else 'DOES NOT FIT'}",
    ]
    if s.offload:
        lines.append(
            f"  {'host memory per node (offloaded)':38s}{_gib(mem['host_per_node'])}   of "
            f"{plan.host_budget / GIB:.0f} usable, {'fits' if plan.fits_host else 'DOES NOT FIT'}"
        )
    lines += [
        "",
        f"{'Communication per GPU per step':28s}{'group':>22s}{'NVLink GB':>10s}"
        f"{'network GB':>12s}{'PCIe GB':>10s}",
    ]
    tot = {"nvlink": 0.0, "network": 0.0, "pcie": 0.0}
    for kind, links in t.comm_bytes.items():
        lines.append(
            f"  {kind:26s}{t.comm_groups.get(kind, '')[:22]:>22s}{_gb(links['nvlink'])}  "
            f"{_gb(links['network'])}{_gb(links['pcie'])}"
        )
        for k in tot:
            tot[k] += links[k]
    lines.append(
        f"  {'total':26s}{'':22s}{_gb(tot['nvlink'])}  {_gb(tot['network'])}{_gb(tot['pcie'])}"
    )
    lines += [
        "",
        f"{'Time per step':40s}{'s':>10s}",
        f"  {'compute (incl. recompute)':38s}{t.compute_s:10.3f}",
    ]
    if t.copy_s:
        lines.append(f"  {'copies on the compute stream':38s}{t.copy_s:10.3f}")
    lines += [
        f"  {'communication (if not overlapped)':38s}{t.comm_s:10.3f}",
        f"  {'forward / backward / optimizer':38s}{t.forward_s:10.3f} / {t.backward_s:.3f} / "
        f"{t.optimizer_s:.3f}{' (CPU)' if s.offload else ''}",
        f"  {'= step (overlapped)':38s}{t.step_s:10.3f}",
        f"  {'exposed communication':38s}{t.exposed_comm_s:10.3f}",
        f"  {'MFU':38s}{t.mfu * 100:9.1f}%",
        f"  {'tokens/s per GPU':38s}{t.tokens_per_s_per_gpu:10.0f}",
        *(["", *context_lines(plan)] if t.context else []),
        "",
        f"Efficiencies ({g.name}): compute {a['compute_model']}{_at(a['compute_eff'])}, "
        f"NVLink {a['nvlink_eff']:.3g}, network {a['network_eff']:.3g}, PCIe {a['pcie_eff']:.3g}, "
        f"host {a['host_eff']:.3g}; latency: "
        + (
            a["latency_model"]
            if a["latency_s"] is None
            else f"{a['latency_s'] * 1e6:g} us per collective"
        )
        + (f"; cluster {a['cluster']}" if a.get("cluster") else "")
        + " (sources: plan/sources.py, docs/plan.md)",
        "Model: each GEMM by (m, n, k) on a tile/wave roofline, flash attention by sequence length, "
        "element-wise bytes (plan/kernels.py);",
        "  collectives: ring bytes per link at the links' bandwidth + NCCL's ring/tree latency "
        "(plan/network.py);",
        "  step: the engine's schedule, each unit's compute against its neighbours' transfers "
        "(plan/steptime.py); MFU = model FLOPs / (step x peak); --explain takes it apart.",
    ]
    return "\n".join(lines)


def _at(eff: float | None) -> str:
    return "" if eff is None else f" at {eff:.3g} of peak"


def _logits_label(chunks: int) -> str:
    return f"logits + loss ({chunks} chunks)" if chunks else "logits + loss"


def render_suggestion(sug: Suggestion, requested: Settings) -> str:
    lines = [f"Suggestion: {sug.message}"]
    if sug.plan is not None:
        sp = sug.plan
        s = sp.settings
        flags = [f"--tp {s.tp} --ep {s.ep}"] if sp.mesh is not None else []
        if s.cp > 1 or requested.cp > 1:  # a CP row, or the row without it that won
            flags.append(f"--cp {s.cp}" + (f" --cp-mode {s.cp_mode}" if s.cp > 1 else ""))
        flags.append(f"--strategy {s.strategy}")
        if s.shard_size:
            flags.append(f"--shard-size {s.shard_size}")
        if s.reshard_after_forward is not True:
            flags.append(f"--reshard-after-forward {s.reshard_after_forward}")
        if s.offload:
            flags.append("--offload")
        if s.loss_chunks:
            flags.append(f"--loss-chunks {s.loss_chunks}")
        flags += [
            f"--micro-batch {s.micro_batch}",
            f"--grad-accum {s.grad_accum}",
            f"--checkpoint-layers {s.checkpoint_layers}",
        ]
        lines.append(
            f"  predicted step {sp.time.step_s:.3f} s, MFU {sp.time.mfu * 100:.1f}%"
            + ("" if s == requested else f" (flags: {' '.join(flags)})")
        )
        if sp.mesh is not None:
            why = train_refuses(s, sp.shape)
            lines.append(
                f"  layershard train refuses this row: {why}" if why
                else f"  layershard train: {train_flags(s)}"
            )  # fmt: skip
        lines.append(f"  why: {sug.why}")
    if len(sug.ranking) > 1:
        lines += [
            "",
            f"  {'strategy (its fastest setting that fits)':46s}{'step s':>8s}{'x best':>8s}"
            f"{'peak GiB':>9s}{'mb x ga':>8s}{'ckpt':>6s}  against the best",
        ]
        best = sug.plan.time.step_s if sug.plan else None
        for r in sug.ranking:
            if r.plan is None:
                lines.append(f"  {r.label[:46]:46s}  {r.reason}")
                continue
            p = r.plan
            ratio = f"{p.time.step_s / best:7.2f}x" if best else ""
            lines.append(
                f"  {r.label[:46]:46s}{p.time.step_s:8.3f}{ratio:>8s}{p.memory['peak'] / GIB:9.1f}"
                f"{f'{p.settings.micro_batch}x{p.settings.grad_accum}':>8s}"
                f"{p.settings.checkpoint_layers:6d}  {r.reason}"
            )
    return "\n".join(lines)
