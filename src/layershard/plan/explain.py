"""``layershard plan --explain``: one step taken apart, in terms a profiler trace shows.

Time: compute by kind (GEMMs, attention, element-wise kernels, the loss, recompute of
checkpointed blocks), the compute lost to collectives running beside it, compute-stream copies,
exposed communication by link (NVLink, network, PCIe, and NCCL's latency), the optimizer step:
their sum is the step. Memory: what the GPU holds at the peak by kind (the model-state keys of
``memory_report()``, activations, logits, a unit's gradients), their sum the planned peak; then
the allocator's fragmentation and the CUDA context, their sum what the GPU must have.

``NOT_MODELLED``: what the plan cannot express; a run that uses it is planned without it.
"""

from __future__ import annotations

from layershard.plan.memory import peak_parts
from layershard.plan.planner import Plan

KIND_LABELS = {
    "gemm": "GEMMs (matmuls, forward and backward)",
    "attention": "attention (flash, causal)",
    "elementwise": "element-wise (norms, activations, RoPE, adds)",
    "loss": "loss (softmax over the vocabulary)",
    "recompute": "recompute (checkpointed forwards; not model FLOPs)",
    "flops": "all FLOPs at the given efficiency",
}
LINK_LABELS = {
    "nvlink": "NVLink (bandwidth)",
    "network": "network (bandwidth)",
    "pcie": "PCIe (offload copies)",
    "latency": "latency (NCCL ring/tree steps)",
}
NOT_MODELLED = (
    "pipeline parallelism; context parallelism but for --cp's rows (plan/context.py); TP's "
    "sequence parallelism (TP rows: plan/parallel.py)",
    "an unbalanced router (EP rows route every expert the same share of the tokens)",
    "fp8 matmuls, and the quantize/dequantize work of 8-bit gathers (their bytes are "
    "modelled); fp32 compute (planned at the bf16 kernel rates)",
    "torch.compile (its effect on compute enters through --calibrate)",
    "selective (per-op) activation checkpointing: only whole blocks are checkpointed",
    "NVLink SHARP / in-network reductions; NIC contention between a node's GPUs",
    "power and clock limits below the datasheet peak; stragglers",
    "the CPU work of offload beyond the optimizer step",
)

GIB = 2**30


def explain(plan: Plan) -> str:
    t, mem = plan.time, plan.memory
    lines = ["Step, taken apart (seconds; the lines add up to the step)"]
    rows: list[tuple[str, float]] = []
    comp = sum(t.compute_by_kind.values())
    lines.append(f"  {'compute':52s}{comp:10.4f}")
    for kind, v in sorted(t.compute_by_kind.items(), key=lambda kv: -kv[1]):
        lines.append(f"    {KIND_LABELS.get(kind, kind):50s}{v:10.4f}")
    rows.append(("compute", comp))
    for label, v in (
        ("compute slowed by collectives beside it", t.contention_s),
        ("copies on the compute stream", t.copy_s),
    ):
        if v:
            lines.append(f"  {label:52s}{v:10.4f}")
            rows.append((label, v))
    exposed = sum(t.exposed_by_link.values())
    lines.append(f"  {'exposed communication':52s}{exposed:10.4f}")
    for link, v in t.exposed_by_link.items():
        if v:
            lines.append(f"    {LINK_LABELS[link]:50s}{v:10.4f}")
    lines.append(f"  {'optimizer step':52s}{t.optimizer_s:10.4f}")
    total = comp + t.contention_s + t.copy_s + exposed + t.optimizer_s
    lines.append(f"  {'= step':52s}{total:10.4f}   (planned {t.step_s:.4f})")
    lines.append(
        f"  model FLOPs {t.model_flops / 1e12:.1f} TFLOP, hardware FLOPs "
        f"{t.hardware_flops / 1e12:.1f} TFLOP per GPU; MFU {t.mfu:.1%}, "
        f"HFU {t.hardware_flops / (t.step_s * plan.gpu.peak_flops):.1%}"
    )
    where, parts = peak_parts(*plan.peak_inputs())
    lines += ["", f"Memory at the peak, {where} (GiB; the lines add up to the peak)"]
    for label, v in parts.items():
        lines.append(f"  {label:52s}{v / GIB:10.2f}")
    lines.append(f"  {'= peak (tensors)':52s}{sum(parts.values()) / GIB:10.2f}")
    frag = int(mem["peak"] * plan.fragmentation)
    lines.append(
        f"  {f'+ allocator fragmentation ({plan.fragmentation:.0%})':52s}{frag / GIB:10.2f}"
    )
    lines.append(f"  {'+ CUDA context and NCCL buffers':52s}{plan.context_bytes / GIB:10.2f}")
    lines.append(
        f"  {'= on the GPU':52s}{plan.device_bytes / GIB:10.2f}   of "
        f"{plan.gpu.memory_bytes * (1 - plan.headroom) / GIB:.2f} "
        f"({'fits' if plan.fits_device else 'DOES NOT FIT'})"
    )
    lines += ["", "Not modelled (planned without them):"]
    lines += [f"  - {x}" for x in NOT_MODELLED]
    return "\n".join(lines)
