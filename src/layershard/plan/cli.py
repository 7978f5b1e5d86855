"""``layershard plan``: predict per-GPU memory, communication and step time for a run, choose the
strategy, checkpointing and micro-batch, and calibrate the model on measured runs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, ValidationError
from pydantic.dataclasses import dataclass

from layershard.plan.calibrate import CalibrationError, read_runs
from layershard.plan.calibrate import fit as fit_runs
from layershard.plan.calibrate import render as render_fit
from layershard.plan.explain import explain
from layershard.plan.hardware import GPU, GPUS, Cluster, get_gpu
from layershard.plan.memory import OPTIMIZER_BYTES, STRATEGIES
from layershard.plan.model import ModelShape, load_model
from layershard.plan.network import CLUSTERS, get_cluster
from layershard.plan.parallel import mesh_candidates, train_flags, train_refuses
from layershard.plan.planner import DEFAULT_HEADROOM, Plan, Settings, Suggestion, make_plan, suggest
from layershard.plan.qlora import QLoRASettings
from layershard.plan.qlora import render as render_qlora
from layershard.plan.sources import FRAGMENTATION
from layershard.validation import NonNegativeInt, Number, PositiveInt, PositiveNumber, one_line

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


Efficiency = Annotated[Number | None, Field(gt=0, le=1, description="in (0, 1]")]


@dataclass(config=ConfigDict(extra="ignore"))
class PlanInput:
    """What ``layershard plan`` accepts: every size and rate positive (the schema; argparse only
    reads the numbers)."""

    gpus: PositiveInt = 8
    gpus_per_node: PositiveInt = 8
    seq_len: PositiveInt | None = None
    micro_batch: PositiveInt = 1
    grad_accum: PositiveInt = 1
    shard_size: PositiveInt | None = None
    tp: PositiveInt | None = None
    ep: PositiveInt | None = None
    loss_chunks: NonNegativeInt = 0
    gpu_memory: PositiveNumber | None = None
    tflops: PositiveNumber | None = None
    intra_bw: PositiveNumber | None = None
    inter_bw: PositiveNumber | None = None
    pcie_bw: PositiveNumber | None = None
    host_memory: PositiveNumber | None = None
    headroom: Annotated[Number, Field(ge=0, lt=1, description="in [0, 1)")] = DEFAULT_HEADROOM
    compute_eff: Efficiency = None
    comm_eff: Efficiency = None
    network_eff: Efficiency = None
    pcie_eff: Efficiency = None
    latency_us: Annotated[
        Number | None, Field(ge=0, description="a number of microseconds >= 0")
    ] = None
    fragmentation: Annotated[Number | None, Field(ge=0, lt=1, description="in [0, 1)")] = None


def check_input(args: argparse.Namespace) -> str:
    """The first bad value of ``args`` as one line, or ''."""
    given = {k: v for k, v in vars(args).items() if k in PlanInput.__dataclass_fields__}
    try:
        PlanInput(**given)
    except ValidationError as e:
        return one_line(e, dict(PlanInput.__pydantic_fields__), given, prefix="--")  # type: ignore[attr-defined]  # pydantic dataclass
    return ""


def _ras(value: str) -> bool | int:
    low = value.lower()
    if low in ("true", "1"):
        return True
    if low == "false":
        return False
    return int(value)


def _count(n: int) -> str:
    """A parameter count as people say it: 6.74B, 125.03M."""
    return f"{n / 1e9:.2f}B" if n >= 1e9 else f"{n / 1e6:.2f}M"


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-7b", help="a layershard model preset")
    src.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json or its dir")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=8, help="total GPUs (data-parallel world size)")
    c.add_argument("--gpus-per-node", type=int, default=8, help="GPUs per node (NVLink within)")
    c.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    c.add_argument("--gpu-memory", type=float, metavar="GIB", help="override GPU memory (GiB)")
    c.add_argument("--tflops", type=float, help="override dense bf16 TFLOP/s")
    c.add_argument("--intra-bw", type=float, metavar="GB/S", help="override NVLink GB/s per GPU")
    c.add_argument("--inter-bw", type=float, metavar="GB/S", help="override network GB/s per GPU")
    c.add_argument("--pcie-bw", type=float, metavar="GB/S", help="override PCIe GB/s per GPU")
    c.add_argument("--host-memory", type=float, metavar="GIB", help="host memory per node (GiB)")
    c.add_argument("--cluster", choices=sorted(CLUSTERS),
                   help="a named cluster: its NVLink and network bandwidth per GPU and their "
                   "efficiencies (plan/network.py); --intra-bw / --inter-bw override it")  # fmt: skip
    r = p.add_argument_group("run")
    r.add_argument("--seq-len", type=int, help="tokens per sequence (default: min(4096, model's))")
    r.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    r.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    r.add_argument("--param-dtype", default=None, choices=["bf16", "fp16", "fp32"],
                   help="compute dtype (default bf16)")  # fmt: skip
    r.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    r.add_argument("--gather-dtype", default=None, choices=["fp8", "int8"],
                   help="weights over the all-gather in fp8 (e4m3) or int8 blocks: their bytes "
                   "(default: the compute dtype)")  # fmt: skip
    r.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES))
    r.add_argument("--strategy", default="full", choices=STRATEGIES,
                   help="shard(strategy=...): full (ZeRO-3), grad_op (ZeRO-2), no_shard (DDP-like), "
                   "hybrid (HSDP)")  # fmt: skip
    r.add_argument("--shard-size", type=int, help="hybrid: ranks per shard group (default: a node)")
    r.add_argument("--reshard-after-forward", type=_ras, default=True, metavar="true|false|K",
                   help="full: K keeps each unit sharded over K ranks for backward (hpZ)")  # fmt: skip
    r.add_argument("--offload", action="store_true", help="ls.CPUOffload(): states in CPU memory")
    r.add_argument("--tp", type=int, help="tensor-parallel size (default: the suggestion tries "
                   "1, 2, 4, 8 within a node); --micro-batch is then per TP group")  # fmt: skip
    r.add_argument("--ep", type=int, help="expert-parallel size (default: the suggestion tries "
                   "the divisors of the experts up to the GPUs)")  # fmt: skip
    r.add_argument(
        "--no-sync",
        action="store_true",
        help="accumulate micro-batches under no_sync() (unsharded accumulators, one reduce/step)",
    )
    r.add_argument("--loss", default="fp32", choices=["fp32", "fused"],
                   help="fp32: layershard's loss (fp32 log-softmax); fused: a fused "
                   "cross-entropy that keeps the logits and their gradient in the compute dtype")  # fmt: skip
    r.add_argument("--loss-chunks", type=int, default=0, metavar="K",
                   help="the chunked loss (ls.chunked_loss) in K chunks: no full fp32 logits "
                   "(default 0: the plain loss)")  # fmt: skip
    r.add_argument(
        "--checkpoint-layers",
        default="0",
        metavar="K|all",
        help="number of blocks with activation checkpointing (default 0)",
    )
    q = p.add_argument_group("QLoRA (a 4-bit base with LoRA adapters: plan/qlora.py)")
    q.add_argument("--qlora", action="store_true", help="memory per GPU for QLoRA fine-tuning")
    q.add_argument("--lora-rank", type=int, default=16, help="LoRA r on every block linear")
    q.add_argument("--no-double-quant", action="store_true", help="absmax in fp32 (4 B / 64)")
    q.add_argument("--frozen-dtype", choices=["fp32", "bf16", "fp16"], default=None,
                   help="the dtype the embedding, head and norms are loaded in (ls.shard keeps "
                   "frozen weights so; default: the compute dtype)")  # fmt: skip
    a = p.add_argument_group("model assumptions (defaults: per GPU type, see docs/plan.md)")
    a.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="memory kept free")
    a.add_argument("--compute-eff", type=float, help="achieved / peak FLOP/s")
    a.add_argument("--comm-eff", type=float, help="achieved / peak bus bandwidth, both links")
    a.add_argument("--network-eff", type=float, help="achieved / peak network bandwidth")
    a.add_argument("--pcie-eff", type=float, help="achieved / peak PCIe bandwidth")
    a.add_argument(
        "--latency-us",
        type=float,
        default=None,
        help="a flat latency per collective (default: NCCL's ring/tree model)",
    )
    a.add_argument("--fragmentation", type=float, default=None,
                   help=f"allocator fragmentation, a fraction of the peak (default "
                   f"{FRAGMENTATION}; plan/sources.py)")  # fmt: skip
    k = p.add_argument_group("calibration")
    k.add_argument("--calibrate", nargs="+", metavar="RUN_DIR",
                   help="fit the efficiencies to measured runs (layershard train run folders, "
                   "layershard bench output) on this --gpu, then plan with them")  # fmt: skip
    k.add_argument("--testbed", nargs="+", metavar="BENCH_DIR",
                   help="predict every row of a `layershard bench --nodes N --link ...` output "
                   "(its model, ranks, link and CPU rate) and print it against the measured step "
                   "(plan/testbed.py)")  # fmt: skip
    k.add_argument("--fit", default="auto", choices=["auto", "compute"],
                   help="auto: compute, plus communication when the runs separate them")  # fmt: skip
    p.add_argument("--explain", action="store_true",
                   help="the step taken apart: compute by kind, exposed communication by link, "
                   "memory by kind, each adding up to the total")  # fmt: skip
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.add_argument("--write-config", metavar="YAML",
                   help="write the chosen settings (the suggestion, else the given ones) as a "
                   "`layershard train --config` file, with this plan's predictions")  # fmt: skip
    p.add_argument("--no-suggest", action="store_true", help="skip the search for settings")
    p.add_argument("--keep-strategy", action="store_true",
                   help="suggest checkpointing and micro-batch only, for the given strategy")  # fmt: skip


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
            why = train_refuses(s, sp.shape.moe)
            note = f" ({why}: issue 32)" if why else ""
            lines.append(f"  layershard train{note}: {train_flags(s)}")
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


def _qlora(args: argparse.Namespace, shape: ModelShape, gpu: GPU) -> int:
    if args.lora_rank < 1:
        print("layershard plan: --lora-rank must be >= 1", file=sys.stderr)
        return 2
    settings = QLoRASettings(
        world=args.gpus,
        lora_rank=args.lora_rank,
        double_quant=not args.no_double_quant,
        compute_dtype=args.param_dtype or "bf16",
        seq_len=args.seq_len or min(4096, shape.max_seq_len),
        micro_batch=args.micro_batch,
        offload=args.offload,
        frozen_dtype=args.frozen_dtype,
    )
    print(render_qlora(shape, settings, gpu.name, gpu.memory_bytes))
    return 0


def run(args: argparse.Namespace) -> int:
    if args.testbed:
        from layershard.plan.testbed import main as testbed_main

        return testbed_main(args.testbed, args.compute_eff)
    bad = check_input(args)
    if bad:
        print(f"layershard plan: error: {bad}", file=sys.stderr)
        return 2
    try:
        shape = load_model(args.model, args.hf_config)
        links = get_cluster(args.cluster) if args.cluster else None
        gpu = get_gpu(
            args.gpu, args.gpu_memory, args.tflops,
            args.intra_bw or (links.intra_gbs if links else None),
            args.inter_bw or (links.inter_gbs if links else None), args.pcie_bw,
            args.host_memory,
        )  # fmt: skip
        cluster = Cluster(args.gpus, args.gpus_per_node)
    except (ValueError, OSError) as e:
        print(f"layershard plan: {e}", file=sys.stderr)
        return 2
    if args.qlora:
        return _qlora(args, shape, gpu)
    eff = gpu.eff
    if args.compute_eff is not None:
        eff = replace(eff, compute=args.compute_eff)
    if args.comm_eff is not None:
        eff = replace(eff, nvlink=args.comm_eff, network=args.comm_eff)
    if args.network_eff is not None:
        eff = replace(eff, network=args.network_eff)
    if args.pcie_eff is not None:
        eff = replace(eff, pcie=args.pcie_eff)
    ck = args.checkpoint_layers
    k = shape.n_layers if str(ck).lower() == "all" else int(ck)
    if args.loss_chunks < 0:
        print("layershard plan: --loss-chunks must be >= 0 (0: the plain loss)", file=sys.stderr)
        return 2
    if not 0 <= k <= shape.n_layers:
        print(f"layershard plan: --checkpoint-layers must be 0..{shape.n_layers}", file=sys.stderr)
        return 2
    seq = args.seq_len or min(4096, shape.max_seq_len)
    if seq > shape.max_seq_len:
        print(
            f"layershard plan: note: --seq-len {seq} exceeds the model's max_seq_len "
            f"{shape.max_seq_len} (the RoPE tables are sized by max_seq_len)",
            file=sys.stderr,
        )
    settings = Settings(
        micro_batch=args.micro_batch,
        seq_len=seq,
        checkpoint_layers=k,
        grad_accum=args.grad_accum,
        param_dtype=args.param_dtype or "bf16",
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        strategy=args.strategy,
        no_sync=args.no_sync,
        shard_size=args.shard_size,
        reshard_after_forward=args.reshard_after_forward,
        offload=args.offload,
        loss_chunks=args.loss_chunks,
        loss=args.loss,
        gather_dtype=args.gather_dtype,
        tp=args.tp or 1,
        ep=args.ep or 1,
    )
    kw: dict[str, Any] = {
        "latency_s": None if args.latency_us is None else args.latency_us * 1e-6,
        "links": links,
    }
    if args.fragmentation is not None:
        kw["fragmentation"] = args.fragmentation
    out: dict = {}
    try:
        if args.calibrate:
            ms = read_runs(args.calibrate, args.gpus_per_node, args.param_dtype or "bf16")
            f = fit_runs(ms, gpu, eff, kw["latency_s"], args.fit)
            print(render_fit(f))
            print()
            before = make_plan(shape, gpu, cluster, settings, args.headroom, eff=eff, **kw)
            eff = f.after
            out["calibration"] = f.as_dict()
        plan = make_plan(shape, gpu, cluster, settings, args.headroom, eff=eff, **kw)
    except (ValueError, OSError, CalibrationError) as e:
        print(f"layershard plan: {e}", file=sys.stderr)
        return 2
    print(render(plan))
    if args.explain:
        print()
        print(explain(plan))
    out.update(plan.to_dict())
    if args.calibrate:
        ratio = plan.time.step_s / before.time.step_s
        moved = f"{(ratio - 1) * 100:+.1f}%" if 0.5 < ratio < 2 else f"{ratio:.3g}x"
        print(
            f"\nCalibrated: this plan's step {before.time.step_s:.4g} s with the default "
            f"efficiencies -> {plan.time.step_s:.4g} s calibrated ({moved})"
        )
    if not args.no_suggest:
        sug = suggest(
            shape, gpu, cluster, settings, args.headroom, keep_strategy=args.keep_strategy,
            meshes=mesh_candidates(shape, cluster, args.tp, args.ep), eff=eff, **kw,
        )  # fmt: skip
        print()
        print(render_suggestion(sug, settings))
        out["suggestion"] = {
            "message": sug.message,
            "why": sug.why,
            "settings": None if sug.plan is None else out_settings(sug.plan),
            "gpus_needed": sug.gpus_needed,
            "ranking": [
                {
                    "strategy": r.label,
                    "fits": r.plan is not None,
                    "step_s": r.plan.time.step_s if r.plan else None,
                    "reason": r.reason,
                }
                for r in sug.ranking
            ],
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.write_config:
        chosen = plan if args.no_suggest or sug.plan is None else sug.plan
        if not (args.no_suggest or args.tp) and train_refuses(chosen.settings, chosen.shape.moe):
            # searched: the fastest row train runs (given --tp, a row it cannot is refused)
            runs = (r.plan for r in sug.ranking if r.plan is not None and r.plan.fits)
            chosen = next((p for p in runs if not train_refuses(p.settings, p.shape.moe)), chosen)
        if not chosen.fits:
            print(
                "layershard plan: error: --write-config: these settings do not fit and no "
                "setting that fits was found; no config written",
                file=sys.stderr,
            )
            return 2
        try:
            text = train_yaml(chosen, args)
        except ValueError as e:
            print(f"layershard plan: error: --write-config: {e}", file=sys.stderr)
            return 2
        Path(args.write_config).write_text(text)
        print(f"\nwrote {args.write_config}: layershard train --config {args.write_config}")
    return 0


def train_yaml(plan: Plan, args: argparse.Namespace) -> str:
    """The plan's settings as a ``layershard train`` YAML, with the predictions recorded under
    ``plan:`` (the run folder puts them next to the measured step time and memory)."""
    import yaml

    s, cl = plan.settings, plan.cluster
    why = train_refuses(s, plan.shape.moe)
    if why:
        raise ValueError(f"layershard {why} (the plan's: {train_flags(s)})")
    if s.reduce_dtype not in ("fp32", "bf16"):
        raise ValueError(
            f"layershard train reduces gradients in fp32 or bf16, not {s.reduce_dtype}"
        )
    if s.optimizer not in ("adamw", "muon"):
        raise ValueError(f"layershard train has no optimizer {s.optimizer!r} (adamw, muon)")
    cfg: dict[str, Any] = (
        {"hf_config": str(args.hf_config)} if args.hf_config else {"model": args.model}
    )
    cfg.update(
        seq_len=s.seq_len,
        micro_batch=s.micro_batch,
        grad_accum=s.grad_accum,
        precision=s.param_dtype,
        optimizer=s.optimizer,
        strategy=s.strategy,
        activation_checkpointing=s.checkpoint_layers,
        offload=s.offload,
        loss_chunks=s.loss_chunks,
    )
    if s.tp > 1:  # tensor parallelism (ls.parallelize); micro_batch is per TP group
        cfg["tp"] = s.tp
    if s.ep > 1:  # expert parallelism (ls.parallelize)
        cfg["ep"] = s.ep
    if s.reduce_dtype != "fp32":
        cfg["reduce_dtype"] = s.reduce_dtype
    if s.gather_dtype is not None:
        cfg["gather_dtype"] = s.gather_dtype
    if s.strategy == "hybrid" and s.shard_size:
        cfg["shard_size"] = s.shard_size
    if s.strategy == "full" and s.reshard_after_forward is not True:
        cfg["reshard_after_forward"] = s.reshard_after_forward
    cfg["plan"] = {
        "gpus": cl.gpus,
        "gpus_per_node": cl.local,
        "gpu": plan.gpu.name,
        "step_s": plan.time.step_s,
        "peak_bytes": int(plan.memory["peak"]),
        "model_states_bytes": int(plan.memory["model_states"]),
        "tokens_per_s_per_gpu": plan.time.tokens_per_s_per_gpu,
        "mfu": plan.time.mfu,
    }
    nodes = f" --nnodes {cl.nodes}" if cl.nodes > 1 else ""
    head = (
        f"# layershard plan's settings for {cl.gpus} x {plan.gpu.name}; run with:\n"
        f"#   layershard train --config THIS_FILE --nproc-per-node {cl.local}{nodes}\n"
    )
    return head + yaml.safe_dump(cfg, sort_keys=False)


def out_settings(plan: Plan) -> dict:
    d = plan.to_dict()
    return {"settings": d["settings"], "peak_bytes": plan.memory["peak"], "time": d["time"]}
