"""``layershard bench``: launch the benchmark runs and write the report.

For each world size, for each repeat, every implementation runs once in fresh processes
(``python -m torch.distributed.run --standalone``); the order of implementations alternates between
repeats (A B C D, then D C B A, ...) so that slow drift of the machine cancels out. Each run writes
one JSON file under ``OUT/runs/``; ``report.py`` aggregates them into ``OUT/results.json``,
``OUT/bench.png`` and the table printed on stdout.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from layershard.bench import (
    EP_IMPLS,
    IMPLS,
    MUON_ALTERNATIVE,
    STRATEGY_IMPL,
    TP_IMPL,
    UNTIMED_STEPS,
    split_blocks,
    wire_impl,
)
from layershard.bench import context as cp_rows
from layershard.models import hf as models_hf

TORCH_IMPLS = ("fsdp2", "fsdp1", "ddp", "plain", "fsdp2-ep", "transformers-ep")

# The default bench: the `small` preset, a communication-heavier shape beside it (narrower,
# shorter sequences, fewer tokens per rank: less compute per byte communicated), and a large
# vocabulary over few wide blocks, where the embedding and the LM head are each 4x a block (as in
# Llama 3, 128k vocab: its head is 2.4x a block), so they, not the blocks, are the largest units;
# and many small blocks with the loss computed outside the model (the logits returned, the user's
# cross-entropy on them), where what each unit costs beyond its collectives is paid 16 times a step;
# and issue 34's user model: logits returned, the loss outside, embedding and head 1.8x a block
# (vocab 16384, d 768, 3 blocks), where the forward's peak is the user's loss on the logits.
SHAPES: dict[str, dict[str, Any]] = {
    "small": {"model": "small", "overrides": [], "seq_len": 512, "global_batch": 8},
    "comm": {
        "model": "small",
        "overrides": ["dim=384", "n_heads=6", "n_kv_heads=6", "ffn_dim=1152"],
        "seq_len": 256,
        "micro_batch": 4,
    },
    "vocab": {
        "model": "small",
        "overrides": [
            "vocab_size=32768", "dim=768", "n_layers=3", "n_heads=12", "n_kv_heads=4",
            "ffn_dim=2048",
        ],
        "seq_len": 256,
        "global_batch": 8,
    },
    "deep": {
        "model": "small",
        "overrides": [
            "vocab_size=4096", "dim=256", "n_layers=16", "n_heads=4", "n_kv_heads=4",
            "ffn_dim=704",
        ],
        "seq_len": 128,
        "micro_batch": 2,
        "loss": "outside",
    },
    "logits": {
        "model": "small",
        "overrides": [
            "vocab_size=16384", "dim=768", "n_layers=3", "n_heads=12", "n_kv_heads=12",
            "ffn_dim=2048",
        ],
        "seq_len": 128,
        "micro_batch": 2,
        "loss": "outside",
    },
    # the `moe` preset (8 experts, top-2): 1-D sharding gathers every expert of a layer
    "moe": {"model": "moe", "overrides": [], "seq_len": 256, "micro_batch": 2},
}  # fmt: skip
# without --shape/--model/--hf-config (moe only when asked: it is not a dense shape to compare)
DEFAULT_SHAPES = [name for name in SHAPES if name != "moe"]


def load_hf_config(path: str):
    """A transformers config from a config.json file or a model folder."""
    try:
        return models_hf.load_hf_config(path)
    except ValueError as e:
        raise SystemExit(f"layershard bench: --hf-config: {e}") from None


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def add_arguments(p: argparse.ArgumentParser) -> None:
    m = p.add_argument_group("model and data")
    src = m.add_mutually_exclusive_group()
    src.add_argument(
        "--shape", nargs="+", choices=SHAPES, default=None,
        help="named bench shapes (default, without --model/--hf-config: all but moe): "
        "small is the preset at seq 512, global batch 8; comm is d 384, seq 256, 4 sequences "
        "per rank; vocab is vocab 32768 over 3 blocks of d 768 (embedding and head 4x a "
        "block), seq 256, global batch 8; deep is 16 blocks of d 256, loss outside; logits "
        "is vocab 16384, 3 blocks of d 768, seq 128, 2 per rank, logits returned, loss outside; "
        "moe is the moe preset (8 experts, top-2), seq 256, 2 sequences per rank",
    )  # fmt: skip
    src.add_argument("--model", default=None, help="a layershard preset (tiny, small, ...)")
    src.add_argument("--hf-config", metavar="PATH", help="a Hugging Face config.json or its folder")
    m.add_argument(
        "--model-override", action="append", default=[], metavar="KEY=VALUE",
        help="a field of the preset's LlamaConfig, e.g. dim=384 (repeatable)",
    )  # fmt: skip
    m.add_argument(
        "--vocab-size", type=int, default=None, help="vocabulary (default: 8192 for presets)"
    )
    m.add_argument("--seq-len", type=int, default=512, help="tokens per sequence")
    m.add_argument("--global-batch", type=int, default=8, help="sequences per step, all ranks")
    m.add_argument(
        "--micro-batch", type=int, default=None,
        help="sequences per rank instead (the global batch then grows with the world size)",
    )  # fmt: skip
    m.add_argument(
        "--loss", choices=["inside", "outside"], default="inside",
        help="inside: the model computes it (labels=); outside: the model returns the logits and "
        "the loop computes the cross-entropy (a named shape sets its own)",
    )  # fmt: skip
    m.add_argument("--seed", type=int, default=0)
    m.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (fixed)")
    r = p.add_argument_group("runs")
    r.add_argument(
        "--nproc", type=int, nargs="+", default=[2], metavar="N", help="world sizes, e.g. 2 4"
    )
    r.add_argument(
        "--impl",
        nargs="+",
        default=None,
        choices=IMPLS,
        help="implementations to run besides layershard (ratios are against it); plain is the "
        "unsharded model on each rank, with no communication (default: fsdp2 fsdp1 ddp; with "
        f"--optimizer muon: {MUON_ALTERNATIVE})",
    )
    r.add_argument(
        "--optimizer",
        choices=["adamw", "muon"],
        default="adamw",
        help="muon: layershard steps with ls.optim.Muon and each run also times the optimizer "
        f"step alone; {MUON_ALTERNATIVE} is the all-gather-everything alternative",
    )
    r.add_argument(
        "--strategy",
        nargs="+",
        default=["full"],
        choices=list(STRATEGY_IMPL),
        help="layershard strategies to run (hybrid from 4 ranks, as 2 groups, or a group per node "
        "with --nodes; hpz: the backward gathers within a node, or within half the ranks)",
    )
    r.add_argument(
        "--blocks-per-unit", type=int, nargs="+", default=[], metavar="K",
        help="also run layershard (and each --strategy) with K consecutive blocks per unit "
        "(ls.shard(blocks_per_unit=K): one collective for K blocks), as layershard-bK",
    )  # fmt: skip
    r.add_argument(
        "--nodes", type=int, default=1, metavar="N",
        help="nodes of the testbed (network namespaces on this machine, needs root): --nproc "
        "ranks on each, the nodes joined by --link",
    )  # fmt: skip
    r.add_argument(
        "--link", nargs="+", default=None, metavar="PRESET|RATE[,DELAY]",
        help="the links between the --nodes: a cluster preset scaled to this CPU's matmul FLOP/s "
        "(h100-ib400, h100-roce100, h100-eth25, a100-ib200) or RATE[,DELAY[,JITTER[,LOSS%%]]] "
        "(200mbit,1ms); several: every run on each, and a plot of step time against rate",
    )  # fmt: skip
    r.add_argument(
        "--cpu-flops", type=float, default=None, metavar="GFLOPS",
        help="scale the --link presets by this fp32 matmul rate instead of measuring it: the "
        "same links as an earlier run's (its results.json, settings.link.cpu_flops / 1e9)",
    )  # fmt: skip
    r.add_argument(
        "--gather-dtype", nargs="+", default=[], choices=["fp8", "int8"],
        help="also run layershard with its weights gathered in these dtypes (fp8: e4m3, a "
        "scale per parameter; int8: a scale per 256), each as layershard-<dtype>",
    )  # fmt: skip
    r.add_argument(
        "--reduce-dtype", nargs="+", default=["fp32"], choices=["fp32", "bf16"],
        help="the reduce dtypes of those wire runs (bf16: sent in bf16, summed in fp32; "
        "-bf16r in the name); bf16 alone also runs layershard-bf16r. The plain layershard "
        "run stays exact",
    )  # fmt: skip
    r.add_argument(
        "--ep", type=int, default=None, metavar="N",
        help="expert parallelism over N ranks (a MoE model: --shape moe): also runs "
        "layershard-ep (ls.parallelize(model, ep=N)) and fsdp2-ep (FSDP2 with the same expert "
        "split, as transformers' DistributedConfig applies it); default impls then fsdp2-ep",
    )  # fmt: skip
    r.add_argument(
        "--tp", type=int, default=None, metavar="N",
        help="tensor parallelism over N ranks (the built-in Llama or an --hf-config model with a "
        "base_model_tp_plan): also runs layershard-tp (ls.parallelize(model, tp=N); a TP group's "
        "ranks share each batch, the global batch kept)",
    )  # fmt: skip
    cp_rows.add_arguments(r)
    r.add_argument("--steps", type=int, default=5, help="timed steps per run")
    r.add_argument("--warmup", type=int, default=2, help="untimed steps before them")
    r.add_argument("--repeats", type=int, default=3, help="runs per implementation and world size")
    r.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default=None,
        help="default: bf16 on CUDA (NCCL), fp32 on CPU (gloo)",
    )
    r.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads per rank on CPU (default: cores // ranks, at least 1)",
    )
    r.add_argument("--no-mem", action="store_true", help="skip the MemTracker peak-memory step")
    only = "run the --impl rows alone, without the plain layershard row (the x-columns' reference)"
    r.add_argument("--only", action="store_true", help=only)
    r.add_argument(
        "--timeout", type=float, default=1800, help="seconds before a run is killed (per run)"
    )
    o = p.add_argument_group("output")
    o.add_argument(
        "--out", default=None, help="directory (default: benchmarks/speed/<tag>-<device>)"
    )
    o.add_argument(
        "--report-only",
        action="store_true",
        help="do not run: aggregate the run files already in OUT/runs",
    )


def _device_kind() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def _model_tag(args) -> str:
    if args.hf_config:
        return Path(args.hf_config.rstrip("/")).stem.replace("config", "") or "hf"
    return args.model


def run(args: argparse.Namespace) -> int:
    if args.nodes < 1 or (args.nodes > 1 and not args.link) or (args.link and args.nodes < 2):
        print("layershard bench: --nodes N (2 or more) and --link go together", file=sys.stderr)
        return 2
    if args.link:
        return _run_links(args)
    return _run_shapes(args)


def _run_links(args: argparse.Namespace) -> int:
    """Every shape on each link of ``--link``, each on a testbed of ``--nodes`` namespaces; the
    reports per link (``OUT/<link>/``) and the plot across links (``links.png``)."""
    from layershard.bench import report
    from layershard.testbed import links, netns

    try:
        cpu_flops = args.cpu_flops * 1e9 if args.cpu_flops else links.matmul_flops()
        chosen = [links.parse(text, cpu_flops) for text in args.link]
    except ValueError as e:
        print(f"layershard bench: {e}", file=sys.stderr)
        return 2
    why = netns.unavailable(chosen[0])
    if why is not None:
        print(f"layershard bench: --nodes: {why}", file=sys.stderr)
        return 2
    base = args.out
    for link in chosen:
        print(f"layershard bench: {args.nodes} nodes x {args.nproc} ranks, link {link.describe()}"
              f" (this CPU: {cpu_flops / 1e9:.0f} GFLOP/s fp32 matmul)", flush=True)  # fmt: skip
        link_args = argparse.Namespace(**vars(args))
        link_args.out = str(Path(base or "benchmarks/links") / _slug(link))
        link_args.link_info = {**link.as_dict(), "cpu_flops": cpu_flops}
        bed = contextlib.nullcontext(None) if args.report_only else netns.Testbed(args.nodes, link)
        with bed as tb:
            link_args.testbed = tb
            rc = _run_shapes(link_args)
        if rc:
            return rc
    report.plot_links(Path(base or "benchmarks/links"))
    return 0


def _slug(link) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "_" for c in link.name) or "link"


def _run_shapes(args: argparse.Namespace) -> int:
    if args.model is None and args.hf_config is None:
        shapes = args.shape or cp_rows.default_shapes(args, SHAPES, DEFAULT_SHAPES)
    elif args.shape:
        print("layershard bench: --shape or --model/--hf-config, not both", file=sys.stderr)
        return 2
    else:
        shapes = [None]
    for name in shapes:
        shape_args = argparse.Namespace(**vars(args))
        if name is not None:
            spec = SHAPES[name]
            shape_args.model = spec["model"]
            shape_args.model_override = list(spec["overrides"]) + list(args.model_override)
            shape_args.seq_len = spec["seq_len"]
            shape_args.global_batch = spec.get("global_batch", args.global_batch)
            shape_args.micro_batch = spec.get("micro_batch")
            shape_args.loss = spec.get("loss", "inside")
        shape_args.tag = name or _model_tag(shape_args)
        shape_args.shape_name = name
        rc = run_shape(shape_args)
        if rc:
            return rc
    return 0


def _global_batch(args, n: int) -> int:
    return args.micro_batch * n if args.micro_batch else args.global_batch


def run_shape(args: argparse.Namespace) -> int:
    from layershard.bench import report

    device = _device_kind()
    strategies = [STRATEGY_IMPL[s] for s in args.strategy if s != "full"]
    muon = args.optimizer == "muon"
    default = ["fsdp2-ep"] if args.ep else ["fsdp2", "fsdp1", "ddp"]
    chosen = args.impl or ([MUON_ALTERNATIVE] if muon else default)
    if args.ep is None and set(chosen) & set(EP_IMPLS):
        print("layershard bench: the *-ep implementations need --ep N", file=sys.stderr)
        return 2
    if (TP_IMPL in chosen and not args.tp) or (args.tp and args.ep):
        print("layershard bench: layershard-tp needs --tp N (and no --ep)", file=sys.stderr)
        return 2
    why = cp_rows.refuses(args, chosen)
    if why:
        print(f"layershard bench: {why}", file=sys.stderr)
        return 2
    if muon and set(chosen) & set(TORCH_IMPLS):
        print(
            "layershard bench: --optimizer muon runs layershard only (torch's implementations "
            f"have no sharded Muon); use --impl {MUON_ALTERNATIVE}",
            file=sys.stderr,
        )
        return 2
    wires = [
        w
        for g in [None, *args.gather_dtype]
        for r in args.reduce_dtype
        if (w := wire_impl(g, r)) is not None
    ]
    if wires and muon:
        print("layershard bench: --gather-dtype/--reduce-dtype run with adamw", file=sys.stderr)
        return 2
    parallel = (["layershard-ep"] if args.ep else []) + ([TP_IMPL] if args.tp else [])
    parallel += cp_rows.impls(args)
    if any(k < 2 for k in args.blocks_per_unit):
        print(
            "layershard bench: --blocks-per-unit takes K >= 2 (1 is the plain run)", file=sys.stderr
        )
        return 2
    buckets = [f"{i}-b{k}" for i in ["layershard", *strategies] for k in args.blocks_per_unit]
    ours = [*(["layershard"] if not args.only else []), *parallel, *strategies, *buckets, *wires]
    impls = ours + [i for i in chosen if i not in ours]
    out = Path(args.out or f"benchmarks/speed/{args.tag}-{device}")
    if args.out and args.shape_name:  # one folder per named shape
        out = out / args.tag
    runs_dir = out / "runs"
    runs_dir.mkdir(parents=True, exist_ok=True)
    if args.hf_config:
        load_hf_config(args.hf_config)  # fail here, not in every rank
    else:
        from layershard.models import PRESETS

        if args.model not in PRESETS:
            print(
                f"layershard bench: unknown --model {args.model!r}; presets: {', '.join(PRESETS)}",
                file=sys.stderr,
            )
            return 2
    for n in args.nproc:
        w = n * args.nodes  # the world size
        if _global_batch(args, w) % w:
            print(
                f"layershard bench: --global-batch {args.global_batch} is not divisible by "
                f"{w} ranks",
                file=sys.stderr,
            )
            return 2

    if not args.report_only:
        for n in args.nproc:  # runs of other world sizes stay: they aggregate together
            w = n * args.nodes
            for f in [*runs_dir.glob(f"*-n{w}-r*.json"), *runs_dir.glob(f"*-n{w}-r*.error")]:
                f.unlink()
        if device == "cuda":
            import torch

            if max(args.nproc) > torch.cuda.device_count():
                print(
                    f"layershard bench: --nproc {max(args.nproc)} needs that many GPUs; "
                    f"{torch.cuda.device_count()} visible",
                    file=sys.stderr,
                )
                return 2
        plan = []
        for n in args.nproc:
            for r in range(args.repeats):
                order = impls if r % 2 == 0 else impls[::-1]
                # hybrid needs two groups of two or more ranks; hpZ a group smaller than all
                two = n * args.nodes >= 4 and (args.nodes == 1 or n >= 2)
                plan += [(n, r, i) for i in order
                         if split_blocks(i)[0] not in ("layershard-hybrid", "layershard-hpz")
                         or two]  # fmt: skip
        t_start = time.time()
        testbed = getattr(args, "testbed", None)  # the nodes' namespaces (--nodes), if any
        for k, (n, r, impl) in enumerate(plan):
            w = n * args.nodes
            path = runs_dir / f"{impl}-n{w}-r{r}.json"
            t0 = time.time()
            where = f"nproc={n}" + (f" x {args.nodes} nodes" if args.nodes > 1 else "")
            print(f"[{k + 1}/{len(plan)}] {impl:<10} {where} repeat={r} ...", end=" ", flush=True)
            sent0 = testbed.bytes_sent() if testbed else []
            rc, tail = _launch(args, impl, n, device, path)
            dt = time.time() - t0
            if path.exists():  # written atomically at the very end: complete even if rc != 0
                d = json.loads(path.read_text())
                st = sorted(d["step_times"])
                print(f"ok in {dt:.0f} s (median step {st[len(st) // 2]:.3f} s)", flush=True)
                if testbed:  # what crossed the links, counted by the kernel (setup included)
                    sent = [b - a for a, b in zip(sent0, testbed.bytes_sent())]
                    steps = args.warmup + args.steps + UNTIMED_STEPS
                    d["link_bytes_sent"], d["link_steps"] = sent, steps
                    path.write_text(json.dumps(d, indent=1))
                    print(f"    link: {max(sent) / steps / 2**20:.1f} MiB per step from the "
                          f"busiest node (its link's counter over the run's {steps} steps, "
                          "setup included)", flush=True)  # fmt: skip
                if rc != 0:
                    print(f"    (exit code {rc} after the results were written)", flush=True)
                    d["exit_error"] = tail[-2000:]
                    path.write_text(json.dumps(d, indent=1))
            else:
                print(f"FAILED (rc {rc}) in {dt:.0f} s", flush=True)
                path.with_suffix(".error").write_text(tail)
                path.with_suffix(".json").write_text(
                    json.dumps({"impl": impl, "world_size": w, "repeat": r, "error": tail[-4000:]})
                )
        print(f"all runs: {time.time() - t_start:.0f} s", flush=True)

    settings = _settings(args, device)
    if args.report_only and (out / "results.json").is_file():  # the load when the runs ran
        before = json.loads((out / "results.json").read_text()).get("settings", {})
        settings["load_at_start"] = before.get("load_at_start")
    results = report.aggregate(sorted(runs_dir.glob("*.json")), settings=settings)
    (out / "results.json").write_text(json.dumps(results, indent=1))
    print(report.format_table(results))
    try:
        report.plot(results, out / "bench.png")
    except Exception as e:  # noqa: BLE001 - the chart is a convenience; the JSON is the record
        print(f"layershard bench: could not draw the chart: {e}", file=sys.stderr)
    print(f"\nwrote {out / 'results.json'}, {out / 'bench.png'} and {runs_dir}/")
    return 0


def _settings(args, device: str) -> dict:
    return {
        "model": args.hf_config or args.model,
        "shape": getattr(args, "tag", None),
        "model_overrides": list(args.model_override),
        "micro_batch": args.micro_batch,
        "loss": args.loss,
        "device": device,
        "nproc": args.nproc,
        "seq_len": args.seq_len,
        "global_batch": args.global_batch,
        "steps": args.steps,
        "warmup": args.warmup,
        "optimizer": args.optimizer,
        "repeats": args.repeats,
        "precision": args.precision or ("bf16" if device == "cuda" else "fp32"),
        "cores": _cores(),
        "load_at_start": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "nodes": args.nodes,
        "link": getattr(args, "link_info", None),
        **({"cp": args.cp, "cp_mode": args.cp_mode} if args.cp else {}),
    }


def _launch(args, impl: str, n: int, device: str, path: Path) -> tuple[int, str]:
    """One run of ``impl`` on ``n`` ranks per node: under torchrun here, or, on the testbed
    (``--nodes``), one torchrun per node in that node's namespace."""
    nodes = args.nodes
    threads = args.threads or max(1, _cores() // (n * nodes))
    worker = [
        "-m", "layershard.bench.worker", "--impl", impl, "--seq-len", str(args.seq_len),
        "--global-batch", str(_global_batch(args, n * nodes)), "--steps", str(args.steps),
        "--warmup", str(args.warmup), "--seed", str(args.seed), "--lr", str(args.lr),
        "--optimizer", args.optimizer, "--loss", args.loss, "--out", str(path),
    ]  # fmt: skip
    if args.ep:
        worker += ["--ep", str(args.ep)]
    if args.tp:
        worker += ["--tp", str(args.tp)]
    if args.cp:
        worker += ["--cp", str(args.cp)]
    if args.hf_config:
        worker += ["--hf-config", args.hf_config]
    else:
        worker += ["--model", args.model, "--vocab-size", str(args.vocab_size or 8192)]
        for item in args.model_override:
            worker += ["--model-override", item]
    if args.hf_config and args.vocab_size:
        worker += ["--vocab-size", str(args.vocab_size)]
    if args.precision:
        worker += ["--precision", args.precision]
    if device == "cpu":
        worker += ["--threads", str(threads)]
    if args.no_mem:
        worker.append("--no-mem")
    env = dict(os.environ)
    if device == "cpu":
        env["OMP_NUM_THREADS"] = str(threads)
    env["LAYERSHARD_BENCH_WATCHDOG_S"] = str(int(args.timeout))
    env.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    run = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={n}"]
    testbed = getattr(args, "testbed", None)
    if testbed is None:
        cmds = [[*run, "--standalone", *worker]]
    else:
        port = str(_free_port())
        cmds = [
            testbed.command(
                k,
                [
                    *run,
                    f"--nnodes={nodes}",
                    f"--node-rank={k}",
                    f"--master-addr={testbed.ip(0)}",
                    f"--master-port={port}",
                    *worker,
                ],
            )  # fmt: skip
            for k in range(nodes)
        ]
        env.update(testbed.env(0))
    # Own sessions, killed on timeout: that is the launchers only, as torchrun starts each rank
    # in a session of its own; the ranks end themselves at ``args.timeout`` (the worker's
    # watchdog), and a testbed's are killed with its namespaces.
    procs = [
        subprocess.Popen(
            cmd,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )  # fmt: skip
        for cmd in cmds
    ]
    outputs, rc = [], 0
    deadline = time.time() + args.timeout + 60
    for p in procs:
        try:
            output, _ = p.communicate(timeout=max(1.0, deadline - time.time()))
        except subprocess.TimeoutExpired:
            for q in procs:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(q.pid, signal.SIGKILL)
            try:
                output, _ = p.communicate(timeout=60)
            except subprocess.TimeoutExpired:  # a rank outlived its watchdog and holds the pipe
                output = ""
            return 124, f"timed out after {args.timeout + 60:.0f} s\n{output[-20000:]}"
        outputs.append(output)
        rc = rc or p.returncode
    tail = "\n".join(f"--- node {k} ---\n{o[-10000:]}" if len(outputs) > 1 else o[-20000:]
                     for k, o in enumerate(outputs))  # fmt: skip
    return rc, tail


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
