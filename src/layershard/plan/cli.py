"""``layershard plan``: predict per-GPU memory, communication and step time for a run."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from layershard.plan.hardware import GPUS, Cluster, get_gpu
from layershard.plan.memory import OPTIMIZER_BYTES, STRATEGIES
from layershard.plan.model import load_model
from layershard.plan.planner import DEFAULT_HEADROOM, Plan, Settings, make_plan, suggest
from layershard.plan.timing import DEFAULT_COMM_EFF, DEFAULT_COMPUTE_EFF, DEFAULT_LATENCY_S

GIB = 2**30

_LABELS = {
    "params": "params (fp32 master shards)",
    "grads": "grads (fp32 shards)",
    "optimizer": "optimizer state",
    "gather_buffers": "gather_buffers",
    "grad_buffers": "grad_buffers",
    "reduce_scratch": "reduce_scratch",
    "module_buffers": "module_buffers (RoPE tables)",
    "no_sync": "no_sync accumulators",
}


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model")
    src = m.add_mutually_exclusive_group()
    src.add_argument("--model", default="llama-7b", help="a layershard model preset")
    src.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json or its dir")
    c = p.add_argument_group("cluster")
    c.add_argument("--gpus", type=int, default=8, help="total GPUs (data-parallel world size)")
    c.add_argument("--gpus-per-node", type=int, default=8)
    c.add_argument("--gpu", default="h100", choices=sorted(GPUS))
    c.add_argument("--gpu-memory", type=float, metavar="GIB", help="override GPU memory (GiB)")
    c.add_argument("--tflops", type=float, help="override dense bf16 TFLOP/s")
    c.add_argument("--intra-bw", type=float, metavar="GB/S", help="override NVLink GB/s per GPU")
    c.add_argument("--inter-bw", type=float, metavar="GB/S", help="override network GB/s per GPU")
    r = p.add_argument_group("run")
    r.add_argument("--seq-len", type=int, help="tokens per sequence (default: min(4096, model's))")
    r.add_argument("--micro-batch", type=int, default=1, help="sequences per GPU per micro-batch")
    r.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    r.add_argument("--param-dtype", default="bf16", choices=["bf16", "fp16", "fp32"])
    r.add_argument("--reduce-dtype", default="fp32", choices=["fp32", "bf16", "fp16"])
    r.add_argument("--optimizer", default="adamw", choices=sorted(OPTIMIZER_BYTES))
    r.add_argument(
        "--strategy",
        default="full",
        choices=STRATEGIES,
        help="shard(strategy=...): full = ZeRO-3 (layershard); grad_op (ZeRO-2) and no_shard "
        "(DDP) for comparison",
    )
    r.add_argument(
        "--no-sync",
        action="store_true",
        help="accumulate micro-batches under no_sync() (unsharded accumulators, one reduce/step)",
    )
    r.add_argument(
        "--checkpoint-layers",
        default="0",
        metavar="K|all",
        help="number of blocks with activation checkpointing (default 0)",
    )
    a = p.add_argument_group("model assumptions")
    a.add_argument("--headroom", type=float, default=DEFAULT_HEADROOM, help="memory kept free")
    a.add_argument(
        "--compute-eff", type=float, default=DEFAULT_COMPUTE_EFF, help="achieved/peak FLOP/s"
    )
    a.add_argument("--comm-eff", type=float, default=DEFAULT_COMM_EFF, help="achieved/peak GB/s")
    a.add_argument(
        "--latency-us", type=float, default=DEFAULT_LATENCY_S * 1e6, help="per collective"
    )
    p.add_argument("--json", metavar="PATH", help="also write the plan as JSON")
    p.add_argument("--no-suggest", action="store_true", help="skip the search for settings")


def _gib(x: float) -> str:
    return f"{x / GIB:10.2f}"


def _gb(x: float) -> str:
    return f"{x / 1e9:10.2f}"


def render(plan: Plan) -> str:
    sh, g, cl, s, mem, t = plan.shape, plan.gpu, plan.cluster, plan.settings, plan.memory, plan.time
    lines = [
        f"layershard plan: {sh.name} ({sh.total_params / 1e9:.2f}B params, {sh.n_layers} layers, "
        f"d={sh.dim}, ffn={sh.ffn_dim}, heads={sh.n_heads}/{sh.n_kv_heads} kv, "
        f"vocab={sh.vocab_size}, tied={'yes' if sh.tie_embeddings else 'no'})",
        f"  on {cl.gpus} x {g.name} ({cl.nodes} node(s) x {cl.local}; {g.memory_bytes / GIB:.1f} "
        f"GiB, {g.bf16_tflops:g} TFLOP/s bf16, NVLink {g.intra_bw_gbs:g} GB/s, "
        f"network {g.inter_bw_gbs:g} GB/s per GPU)",
        f"  seq {s.seq_len}, micro-batch {s.micro_batch}, grad-accum {s.grad_accum}, "
        f"{s.param_dtype} params, {s.reduce_dtype} reduce, {s.optimizer}, {s.strategy}, "
        f"{s.checkpoint_layers}/{sh.n_layers} layers checkpointed",
        "",
        f"{'Memory per GPU':40s}{'GiB':>10s}",
    ]
    for key, label in _LABELS.items():
        lines.append(f"  {label:38s}{_gib(mem[key])}")
    lines += [
        f"  {'= model states (memory_report total)':38s}{_gib(mem['model_states'])}",
        f"  {'activations (saved for backward)':38s}{_gib(mem['activations'])}",
        f"  {'logits + loss':38s}{_gib(mem['logits'])}",
        f"  {'one unit unsharded grads (backward)':38s}{_gib(mem['unit_grads'])}",
        f"  {'= peak (max of forward, backward)':38s}{_gib(mem['peak'])}",
        f"  {f'usable ({1 - plan.headroom:.0%} of GPU memory)':38s}{_gib(plan.budget)}"
        f"   {'fits' if plan.fits else 'DOES NOT FIT'}",
        "",
        f"{'Communication per GPU per step':40s}{'NVLink GB':>10s}{'network GB':>12s}",
    ]
    tot = {"nvlink": 0.0, "network": 0.0}
    for kind, links in t.comm_bytes.items():
        lines.append(f"  {kind:38s}{_gb(links['nvlink'])}  {_gb(links['network'])}")
        for k in tot:
            tot[k] += links[k]
    lines.append(f"  {'total':38s}{_gb(tot['nvlink'])}  {_gb(tot['network'])}")
    a = t.assumptions
    lines += [
        "",
        f"{'Time per step':40s}{'s':>10s}",
        f"  {'compute (incl. recompute)':38s}{t.compute_s:10.3f}",
        f"  {'communication (if not overlapped)':38s}{t.comm_s:10.3f}",
        f"  {'forward / backward / optimizer':38s}{t.forward_s:10.3f} / {t.backward_s:.3f} / "
        f"{t.optimizer_s:.3f}",
        f"  {'= step (overlapped)':38s}{t.step_s:10.3f}",
        f"  {'exposed communication':38s}{t.exposed_comm_s:10.3f}",
        f"  {'MFU':38s}{t.mfu * 100:9.1f}%",
        f"  {'tokens/s per GPU':38s}{t.tokens_per_s_per_gpu:10.0f}",
        "",
        "Model: compute = FLOPs / (peak x {ce}); FLOPs = 6 (L P_block + V d) T + 12 L s d T "
        "(+ a forward per checkpointed block);".format(ce=a["compute_eff"]),
        "  collectives = ring, (N-1)/N of the buffer per GPU, over the slower of NVLink and "
        f"network (x{a['comm_eff']} of peak, +{a['latency_s'] * 1e6:g} us each);",
        "  step = sum over units of max(compute, the neighbouring units' gather/reduce) + first "
        "gather + last reduce + optimizer; MFU = model FLOPs / (step x peak).",
        "  activations per block and token = c (4d + 4 h hd + 4f) + 8d + 8 + 4h bytes (fused "
        "attention); a checkpointed block keeps c d + one block during recompute.",
    ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        shape = load_model(args.model, args.hf_config)
        gpu = get_gpu(args.gpu, args.gpu_memory, args.tflops, args.intra_bw, args.inter_bw)
        cluster = Cluster(args.gpus, args.gpus_per_node)
    except (ValueError, OSError) as e:
        print(f"layershard plan: {e}", file=sys.stderr)
        return 2
    ck = args.checkpoint_layers
    k = shape.n_layers if str(ck).lower() == "all" else int(ck)
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
        param_dtype=args.param_dtype,
        reduce_dtype=args.reduce_dtype,
        optimizer=args.optimizer,
        strategy=args.strategy,
        no_sync=args.no_sync,
    )
    kw = {
        "compute_eff": args.compute_eff,
        "comm_eff": args.comm_eff,
        "latency_s": args.latency_us * 1e-6,
    }
    plan = make_plan(shape, gpu, cluster, settings, args.headroom, **kw)
    print(render(plan))
    out = plan.to_dict()
    if not args.no_suggest:
        sug = suggest(shape, gpu, cluster, settings, args.headroom, **kw)
        print()
        print(f"Suggestion: {sug.message}")
        if sug.plan is not None and sug.plan.settings != settings:
            sp = sug.plan
            print(
                f"  predicted step {sp.time.step_s:.3f} s, MFU {sp.time.mfu * 100:.1f}% "
                f"(flags: --micro-batch {sp.settings.micro_batch} --grad-accum "
                f"{sp.settings.grad_accum} --checkpoint-layers {sp.settings.checkpoint_layers})"
            )
        out["suggestion"] = {
            "message": sug.message,
            "settings": None if sug.plan is None else out_settings(sug.plan),
            "gpus_needed": sug.gpus_needed,
        }
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0


def out_settings(plan: Plan) -> dict:
    d = plan.to_dict()
    return {"settings": d["settings"], "peak_bytes": plan.memory["peak"], "time": d["time"]}
