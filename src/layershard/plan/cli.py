"""``layershard plan``: predict per-GPU memory, communication and step time for a run, choose the
strategy, checkpointing and micro-batch, and calibrate the model on measured runs."""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import replace
from pathlib import Path
from typing import Annotated, Any

from pydantic import ConfigDict, Field, StrictBool, ValidationError
from pydantic.dataclasses import dataclass

from layershard.plan.calibrate import CalibrationError, read_runs
from layershard.plan.calibrate import fit as fit_runs
from layershard.plan.calibrate import render as render_fit
from layershard.plan.context import add_arguments as add_cp_arguments
from layershard.plan.context import cp_settings, train_fields
from layershard.plan.explain import explain
from layershard.plan.hardware import GPU, GPUS, Cluster, get_gpu
from layershard.plan.memory import OPTIMIZER_BYTES, STRATEGIES
from layershard.plan.model import ModelShape, load_model
from layershard.plan.network import CLUSTERS, get_cluster
from layershard.plan.parallel import mesh_candidates, train_flags, train_refuses
from layershard.plan.planner import DEFAULT_HEADROOM, Plan, Settings, Suggestion, make_plan, suggest
from layershard.plan.qlora import QLoRASettings
from layershard.plan.qlora import render as render_qlora
from layershard.plan.qlora import to_dict as qlora_dict
from layershard.plan.render import render, render_suggestion
from layershard.plan.sources import FRAGMENTATION
from layershard.validation import NonNegativeInt, Number, PositiveInt, PositiveNumber, one_line

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
    cp: PositiveInt | None = None
    loss_chunks: NonNegativeInt = 0
    lora_rank: PositiveInt = 16
    reshard_after_forward: Annotated[
        StrictBool | PositiveInt,
        Field(description="true, false or a number of ranks K >= 1 (hpZ)"),
    ] = True
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
    return _check_outputs(args)


def _check_outputs(args: argparse.Namespace) -> str:
    """A file ``--json`` / ``--write-config`` cannot write, as one line (checked before the
    plan, which would otherwise print and then fail), or ''."""
    for option, path in (("--json", args.json), ("--write-config", args.write_config)):
        if path is None:
            continue
        p = Path(path)
        if p.is_dir():
            return f"{option} {p} is a folder; name a file in it"
        if not p.parent.is_dir():
            return (
                f"{option} {p}: the folder {p.parent} does not exist; create it or choose "
                "another path"
            )
    return ""


def checkpoint_layers(value: str, n_layers: int) -> int:
    """``--checkpoint-layers K|all`` as a number of blocks; ``ValueError`` (one line) if not."""
    if str(value).lower() == "all":
        return n_layers
    try:
        k = int(value)
    except ValueError:
        k = -1
    if not 0 <= k <= n_layers:
        raise ValueError(
            f"--checkpoint-layers must be a number of blocks 0..{n_layers} or all, got {value!r}"
        )
    return k


def _ras(value: str) -> bool | int:
    low = value.lower()
    if low in ("true", "1"):
        return True
    if low == "false":
        return False
    try:
        return int(value)  # PlanInput checks its range
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"true, false or a number of ranks K (hpZ), got {value!r}"
        ) from None


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
    r.add_argument("--blocks-per-unit", type=int, default=1, metavar="K", help="blocks a unit")
    r.add_argument("--tp", type=int, help="tensor-parallel size (default: the suggestion tries "
                   "1, 2, 4, 8 within a node); --micro-batch is then per TP group")  # fmt: skip
    r.add_argument("--ep", type=int, help="expert-parallel size (default: the suggestion tries "
                   "the divisors of the experts up to the GPUs)")  # fmt: skip
    add_cp_arguments(r)
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


def _error(message: str) -> int:
    """``layershard plan``'s one-line refusal (exit 2)."""
    print(f"layershard plan: error: {message}", file=sys.stderr)
    return 2


def _defaults() -> dict[str, Any]:
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    return vars(parser.parse_args([]))


# What --qlora's plan reads: memory of one data-parallel layout, every block checkpointed.
# Any other option given with it would be dropped without a word.
_QLORA_READS = {
    "model", "hf_config", "gpus", "gpus_per_node", "gpu", "gpu_memory", "seq_len", "micro_batch",
    "grad_accum", "param_dtype", "offload", "qlora", "lora_rank", "no_double_quant",
    "frozen_dtype", "json", "write_config", "no_suggest", "testbed",
}  # fmt: skip


def _qlora_unused(args: argparse.Namespace) -> list[str]:
    """The options given with --qlora that its plan does not use, as flags."""
    unused = []
    for name, default in _defaults().items():
        value = getattr(args, name)
        if name == "checkpoint_layers":  # every block is checkpointed: "all" says so
            given = str(value).lower() not in ("0", "all")
        else:
            given = name not in _QLORA_READS and value != default
        if given:
            unused.append("--" + name.replace("_", "-"))
    return unused


def _qlora_train_refuses(args: argparse.Namespace) -> str:
    """Why ``layershard train --qlora`` could not run these settings (--write-config), or ''."""
    if not args.hf_config:
        return (
            "--write-config with --qlora needs --hf-config MODEL_FOLDER: layershard train "
            "--qlora loads a Hugging Face model folder (--init-from), not a preset"
        )
    if args.no_double_quant:
        return (
            "--write-config: layershard train quantizes with double quantization; drop "
            "--no-double-quant"
        )
    if args.frozen_dtype not in (None, args.param_dtype or "bf16"):
        return (
            "--write-config: layershard train --qlora loads the unquantized weights in the "
            "compute dtype (--param-dtype); drop --frozen-dtype"
        )
    return ""


def _qlora(args: argparse.Namespace, shape: ModelShape, gpu: GPU, cluster: Cluster) -> int:
    unused = _qlora_unused(args)
    if unused:
        return _error(
            "--qlora plans data-parallel QLoRA with every block checkpointed and does not use "
            f"{', '.join(unused)}; drop {'it' if len(unused) == 1 else 'them'}"
        )
    why = _qlora_train_refuses(args) if args.write_config else ""
    if why:
        return _error(why)
    seq = args.seq_len or min(4096, shape.max_seq_len)
    if args.write_config and seq > shape.max_seq_len:
        return _error(_seq_len_refused(seq, shape))
    settings = QLoRASettings(
        world=args.gpus,
        lora_rank=args.lora_rank,
        double_quant=not args.no_double_quant,
        compute_dtype=args.param_dtype or "bf16",
        seq_len=seq,
        micro_batch=args.micro_batch,
        offload=args.offload,
        frozen_dtype=args.frozen_dtype,  # None: the compute dtype, as train loads them
    )
    print(render_qlora(shape, settings, gpu.name, gpu.memory_bytes))
    out = qlora_dict(shape, settings, gpu.name, gpu.memory_bytes)
    if args.json:
        Path(args.json).write_text(json.dumps({"qlora": out}, indent=2) + "\n")
    if args.write_config:
        if not out["fits"]:
            return _error("--write-config: these settings do not fit; no config written")
        _write(args.write_config, qlora_yaml(out, args, cluster))
    return 0


def qlora_yaml(out: dict, args: argparse.Namespace, cluster: Cluster) -> str:
    """A QLoRA plan (``qlora.to_dict``) as a ``layershard train --qlora`` YAML: the model
    folder ``--hf-config`` names as ``init_from``, the predictions under ``plan:``."""
    import yaml

    s, m = out["settings"], out["memory_bytes"]
    folder = Path(args.hf_config)
    cfg = {
        "init_from": str(folder if folder.is_dir() else folder.parent),
        "qlora": True,
        "lora_rank": s["lora_rank"],
        "seq_len": s["seq_len"],
        "micro_batch": s["micro_batch"],
        "grad_accum": args.grad_accum,
        "precision": s["compute_dtype"],
        "activation_checkpointing": out["model"]["n_layers"],  # every block, as planned
        "offload": s["offload"],
        "plan": {
            "gpus": cluster.gpus,
            "gpus_per_node": cluster.local,
            "gpu": out["gpu"],
            "peak_bytes": m["peak"],
            "model_states_bytes": m["model_states"],
        },
    }
    return _run_comment(cluster, out["gpu"]) + yaml.safe_dump(cfg, sort_keys=False)


def _run_comment(cl: Cluster, gpu: str) -> str:
    nodes = f" --nnodes {cl.nodes}" if cl.nodes > 1 else ""
    return (
        f"# layershard plan's settings for {cl.gpus} x {gpu}; run with:\n"
        f"#   layershard train --config THIS_FILE --nproc-per-node {cl.local}{nodes}\n"
    )


def _write(path: str, text: str) -> None:
    Path(path).write_text(text)
    print(f"\nwrote {path}: layershard train --config {path}")


def _seq_len_refused(seq: int, shape: ModelShape) -> str:
    return (
        f"--write-config: layershard train refuses --seq-len {seq} beyond {shape.name}'s "
        f"max_seq_len {shape.max_seq_len}; lower --seq-len"
    )


def _load_model(args: argparse.Namespace) -> ModelShape:
    """The model ``--model`` or ``--hf-config`` names; ``ValueError`` naming the option."""
    try:
        return load_model(args.model, args.hf_config)
    except ValueError as e:
        raise ValueError(f"--hf-config {e}" if args.hf_config else f"--model: {e}") from None


def _efficiency(args: argparse.Namespace, gpu: GPU) -> Any:
    """The GPU's efficiencies with the ``--*-eff`` overrides."""
    eff = gpu.eff
    if args.compute_eff is not None:
        eff = replace(eff, compute=args.compute_eff)
    if args.comm_eff is not None:
        eff = replace(eff, nvlink=args.comm_eff, network=args.comm_eff)
    if args.network_eff is not None:
        eff = replace(eff, network=args.network_eff)
    if args.pcie_eff is not None:
        eff = replace(eff, pcie=args.pcie_eff)
    return eff


def _settings(args: argparse.Namespace, shape: ModelShape) -> Settings:
    """The run's settings from the flags; ``ValueError`` (one line) for a bad one."""
    k = checkpoint_layers(args.checkpoint_layers, shape.n_layers)
    seq = args.seq_len or min(4096, shape.max_seq_len)
    if seq > shape.max_seq_len and args.write_config:
        raise ValueError(_seq_len_refused(seq, shape))
    if seq > shape.max_seq_len:
        print(
            f"layershard plan: note: --seq-len {seq} exceeds the model's max_seq_len "
            f"{shape.max_seq_len} (the RoPE tables are sized by max_seq_len)",
            file=sys.stderr,
        )
    return Settings(
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
        blocks_per_unit=args.blocks_per_unit,
        **cp_settings(args),
    )


def run(args: argparse.Namespace) -> int:
    if args.testbed:
        from layershard.plan.testbed import main as testbed_main

        return testbed_main(args.testbed, args.compute_eff)
    bad = check_input(args)
    if bad:
        return _error(bad)
    try:
        shape = _load_model(args)
        links = get_cluster(args.cluster) if args.cluster else None
        gpu = get_gpu(
            args.gpu, args.gpu_memory, args.tflops,
            args.intra_bw or (links.intra_gbs if links else None),
            args.inter_bw or (links.inter_gbs if links else None), args.pcie_bw,
            args.host_memory,
        )  # fmt: skip
        cluster = Cluster(args.gpus, args.gpus_per_node)
    except ValueError as e:
        return _error(str(e))
    if args.qlora:
        return _qlora(args, shape, gpu, cluster)
    try:
        settings = _settings(args, shape)
    except ValueError as e:
        return _error(str(e))
    eff = _efficiency(args, gpu)
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
        return _error(str(e))
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
    chosen = plan
    if not args.no_suggest:
        sug = suggest(
            shape, gpu, cluster, settings, args.headroom, keep_strategy=args.keep_strategy,
            meshes=None if settings.cp > 1 else mesh_candidates(shape, cluster, args.tp, args.ep),
            eff=eff, **kw,
        )  # fmt: skip
        print()
        print(render_suggestion(sug, settings))
        out["suggestion"] = suggestion_dict(sug)
        chosen = sug.plan or plan
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    if args.write_config:
        return _write_config(chosen, args)
    return 0


def suggestion_dict(sug: Suggestion) -> dict[str, Any]:
    return {
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


def _write_config(chosen: Plan, args: argparse.Namespace) -> int:
    """``--write-config``: the chosen plan (the suggestion's, else the given settings') as a
    train config; refused in one line when it does not fit or train would not run it (the
    search compares only TP sizes train runs: ``parallel.mesh_candidates``)."""
    if not chosen.fits:
        return _error(
            "--write-config: these settings do not fit and no setting that fits was found; no "
            "config written"
        )
    try:
        text = train_yaml(chosen, args)
    except ValueError as e:
        return _error(f"--write-config: {e}")
    _write(args.write_config, text)
    return 0


def train_yaml(plan: Plan, args: argparse.Namespace) -> str:
    """The plan's settings as a ``layershard train`` YAML, with the predictions recorded under
    ``plan:`` (the run folder puts them next to the measured step time and memory). Raises
    ``ValueError`` (one line) for settings train refuses."""
    import yaml

    s, cl = plan.settings, plan.cluster
    why = train_refuses(s, plan.shape)
    if why:
        raise ValueError(f"layershard train refuses {train_flags(s)}: {why}")
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
    if s.cp > 1:  # context parallelism (ls.parallelize); micro_batch is per CP group
        cfg.update(train_fields(s, args.hf_config))
    if s.reduce_dtype != "fp32":
        cfg["reduce_dtype"] = s.reduce_dtype
    if s.gather_dtype is not None:
        cfg["gather_dtype"] = s.gather_dtype
    if s.strategy == "hybrid" and s.shard_size:
        cfg["shard_size"] = s.shard_size
    if s.strategy == "full" and s.reshard_after_forward is not True:
        cfg["reshard_after_forward"] = s.reshard_after_forward
    if s.blocks_per_unit > 1:
        cfg["blocks_per_unit"] = s.blocks_per_unit
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
    return _run_comment(cl, plan.gpu.name) + yaml.safe_dump(cfg, sort_keys=False)


def out_settings(plan: Plan) -> dict:
    d = plan.to_dict()
    return {"settings": d["settings"], "peak_bytes": plan.memory["peak"], "time": d["time"]}
