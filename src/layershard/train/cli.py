"""``layershard train``: flags (every config key, plus launch options) and the entry point."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import yaml

from layershard.plan.calibrate import against_plan
from layershard.train import status as st
from layershard.train.config import (
    ConfigError,
    LaunchOptions,
    TrainConfig,
    check_launch,
    field_infos,
)
from layershard.train.launch import ft as ft_launch
from layershard.train.launch.launcher import DEFAULT_TIMEOUT_S, launch, outcome
from layershard.train.launch.nodes import DEFAULT_RDZV_TIMEOUT_S
from layershard.train.launch.preflight import (
    AlreadyFinished,
    prepare,
    refused_before_training,
    undo_writes,
)
from layershard.train.launch.rendezvous import read_report
from layershard.train.loop.sinks import record_failure

_HELP = {
    "model": "model preset: tiny, small, llama-1b, llama-7b, llama-13b, llama-70b, moe (architectures)",
    "hf_config": "train any transformers causal LM from its config.json (file or folder), random init",
    "init_from": "fine-tune: a folder with HF config.json, *.safetensors and tokenizer.json",
    "qlora": "with --init-from: load the model in 4 bits (NF4, double quant; needs bitsandbytes) "
    "and train LoRA adapters on every linear; the run's final/ holds the adapter (PEFT format)",
    "lora_rank": "with --qlora: the rank r of every adapter (alpha = 2 r)",
    "tokenizer": "tokenizer.json (or a folder with one); default: a BPE trained on the corpus",
    "vocab_size": "vocabulary of the BPE trained on the corpus",
    "task": "pretrain (next-token on text) or sft (prompt/response or messages JSONL)",
    "data": "text files, JSONL, folders or `datasets` folders; default: Python's stdlib sources",
    "text_key": "JSONL / datasets field holding the text",
    "val_fraction": "share of documents held out for validation",
    "max_files": "use only the first N corpus files (sorted)",
    "sft_packing": "pack examples into full sequences, or pad one example per sequence",
    "seq_len": "tokens per sequence",
    "micro_batch": "sequences per rank per forward/backward",
    "grad_accum": "micro-batches per optimizer step (derived from --batch-tokens if unset)",
    "batch_tokens": "global tokens per optimizer step",
    "steps": "optimizer steps",
    "lr": "peak learning rate",
    "min_lr_ratio": "cosine decays to lr * this",
    "warmup_steps": "linear warmup steps",
    "weight_decay": "AdamW weight decay (not on --no-decay parameters)",
    "no_decay": "name patterns without weight decay",
    "optimizer": "adamw, or muon (ls.optim.Muon for the blocks' 2-D weights, AdamW for the rest)",
    "beta1": "AdamW beta1",
    "beta2": "AdamW beta2",
    "grad_clip": "clip the global gradient norm (0: off)",
    "precision": "auto (bf16 on GPU, fp32 on CPU), fp32, bf16 or fp16 (with ls.GradScaler)",
    "loss_scale": "fp16: the initial loss scale (halved at each overflow)",
    "gather_dtype": "dtype weights travel in over the all-gather: exact (the compute dtype), fp8 "
    "(e4m3, a scale per parameter) or int8 (a scale per 256 weights); masters stay fp32",
    "reduce_dtype": "dtype gradients are reduced in: fp32, or bf16 (sent in bf16, summed in fp32 "
    "on CPU/gloo)",
    "strategy": "ls.shard strategy: full (ZeRO-3), grad_op (ZeRO-2), no_shard (DDP-like), hybrid",
    "shard_size": "hybrid: ranks per shard group (default: the ranks of a node)",
    "ep": "expert parallelism (a MoE model, e.g. --model moe): each layer's experts split over "
    "ep ranks, tokens exchanged by all-to-all; experts sharded over the world / ep ranks that "
    "hold the same ones (ls.parallelize)",
    "tp": "tensor parallelism (the built-in Llama, or an --hf-config model with a "
    "base_model_tp_plan): each block's weights split over tp ranks that share a batch, sharded "
    "over the world / tp others (ls.parallelize)",
    "cp": "context parallelism (the built-in presets, for long --seq-len): each sequence split "
    "over cp ranks that share a batch, the weights sharded over every rank (ls.parallelize)",
    "cp_mode": "with --cp: ring (keys and values passed around the cp ranks; any head count) or "
    "all_to_all (Ulysses: heads exchanged for the sequence; n_heads divisible by cp)",
    "reshard_after_forward": "full: true, false (= grad_op) or K: keep each unit sharded over K "
    "ranks between forward and backward (hpZ)",
    "offload": "ls.CPUOffload(): shards, gradients and optimizer state in CPU memory",
    "compile": "torch.compile each block's forward (YAML: a mapping of torch.compile options)",
    "activation_checkpointing": "number of blocks recomputed in backward",
    "blocks_per_unit": "K consecutive blocks per unit: one all-gather and one reduce-scatter for "
    "K blocks (many small blocks over a high-latency link)",
    "loss_chunks": "compute the loss in K chunks, never holding the full fp32 logits (0: off)",
    "seed": "seed of the init and the data order",
    "eval_interval": "validate every N steps (0: only at start and end)",
    "eval_sequences": "validation sequences per evaluation",
    "checkpoint_interval": "checkpoint every N steps (0: only the final one)",
    "async_checkpoint": "write periodic checkpoints in the background (DCP async_save)",
    "max_bad_steps": "stop after this many non-finite steps in a row (each one is skipped)",
    "log_interval": "log metrics every N steps",
    "report_to": "where metrics also go: tensorboard, wandb, mlflow (comma-separated), or none; "
    "WANDB_* and MLFLOW_* variables say where (docs/train.md, Watching a run)",
    "run_dir": "run folder (default runs/<name or timestamp>)",
    "name": "run name: the run folder becomes runs/<name>",
    "sample_tokens": "tokens sampled from the trained model at the end",
    "sample_prompt": "prompt of that sample",
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.ArgumentDefaultsHelpFormatter
    parser.epilog = (
        "Every flag is also a key of --config YAML (dashes or underscores); flags win. "
        "With no flags: a small Llama on Python's stdlib sources, 2 CPU ranks, ~2 minutes."
    )
    defaults = TrainConfig()
    run = parser.add_argument_group("run")
    run.add_argument("--config", metavar="YAML", default=argparse.SUPPRESS, help="run config file")
    run.add_argument("--overwrite", action="store_true", default=argparse.SUPPRESS,
                     help="replace an existing, non-empty run folder")  # fmt: skip
    run.add_argument("--resume", nargs="?", const="latest", metavar="CHECKPOINT",
                     default=argparse.SUPPRESS,
                     help="continue the run in --run-dir from its latest (or the given) checkpoint")  # fmt: skip
    run.add_argument("--resume-fallback", action="store_true", default=argparse.SUPPRESS,
                     help="with --resume: if the latest checkpoint is corrupt, resume from the "
                     "newest intact one (named on the terminal)")  # fmt: skip
    run.add_argument("--allow-data-change", action="store_true", default=argparse.SUPPRESS,
                     help="with --resume: continue on a corpus that changed since the run's last "
                     "launch (with the run's own tokenizer); refused without it")  # fmt: skip
    run.add_argument("--stop-at-step", type=int, default=argparse.SUPPRESS, metavar="N",
                     help="checkpoint and stop at step N (the schedule still plans --steps)")  # fmt: skip
    run.add_argument("--dry-run", action="store_true", default=argparse.SUPPRESS,
                     help="check the config and prepare the data, print the config, do not train")  # fmt: skip
    run.add_argument("--model-override", action="append", metavar="KEY=VALUE",
                     default=argparse.SUPPRESS,
                     help="change a preset field, e.g. --model-override dim=256 (repeatable)")  # fmt: skip

    cfg_group = parser.add_argument_group("training (also YAML keys)")
    schema = field_infos(TrainConfig)
    for f in fields(TrainConfig):
        if f.name in ("model_overrides", "plan"):  # YAML only
            continue
        flag = "--" + f.name.replace("_", "-")
        default = getattr(defaults, f.name)
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": _HELP.get(f.name, "")}
        if default not in (None, [], {}):
            kwargs["help"] += f" (default: {default})"
        # argparse only splits words and reads numbers; the schema checks every value
        annotation = repr(schema[f.name].annotation)
        if f.name == "reshard_after_forward":
            kwargs["type"], kwargs["metavar"] = _bool_or_int, "true|false|K"
        elif annotation == "<class 'bool'>" or f.name == "compile":
            kwargs["action"] = argparse.BooleanOptionalAction
        elif f.name == "report_to":
            kwargs["metavar"] = "NAME,..."
        elif f.name in ("data", "no_decay"):
            kwargs["nargs"] = "*" if f.name == "no_decay" else "+"
            kwargs["metavar"] = "PATH" if f.name == "data" else "PATTERN"
        elif annotation.startswith("typing.Literal"):  # words ("int8" is not a number)
            pass
        elif "int" in annotation:
            kwargs["type"] = int
        elif "float" in annotation:
            kwargs["type"] = float
        cfg_group.add_argument(flag, **kwargs)

    dist = parser.add_argument_group("launch (passed to torchrun)")
    dist.add_argument("--nproc-per-node", type=int, default=argparse.SUPPRESS,
                      help="ranks on this machine (default: one per GPU, else 2)")  # fmt: skip
    dist.add_argument("--nnodes", default=argparse.SUPPRESS, help="number of machines (default 1)")
    dist.add_argument("--node-rank", type=int, default=argparse.SUPPRESS,
                      help="this machine's rank, 0..nnodes-1 (default 0)")  # fmt: skip
    dist.add_argument("--rdzv-endpoint", default=argparse.SUPPRESS, metavar="HOST:PORT",
                      help="node 0's address and a free port, identical on every node")  # fmt: skip
    dist.add_argument("--rdzv-backend", default=argparse.SUPPRESS,
                      help="torchrun rendezvous backend (default static: rank 0 on node 0)")  # fmt: skip
    dist.add_argument("--rdzv-id", default=argparse.SUPPRESS, help="torchrun rendezvous id")
    dist.add_argument("--rdzv-conf", default=argparse.SUPPRESS, metavar="KEY=VALUE,...",
                      help="torchrun rendezvous options, e.g. last_call_timeout=5 "
                      "(docs/train.md, Many nodes)")  # fmt: skip
    dist.add_argument("--rdzv-timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                      help="how long the nodes wait for each other at the rendezvous: node 0 "
                      "for the others to join, the others to reach node 0 (default "
                      f"{DEFAULT_RDZV_TIMEOUT_S:.0f})")  # fmt: skip
    dist.add_argument("--max-restarts", type=int, default=argparse.SUPPRESS,
                      help="torchrun restarts after a failure, each from the latest checkpoint "
                      "(default 0)")  # fmt: skip
    dist.add_argument("--timeout", type=float, default=argparse.SUPPRESS, metavar="SECONDS",
                      help="a rank waiting this long in one collective fails the job (default "
                      f"{DEFAULT_TIMEOUT_S:.0f}; LAYERSHARD_TIMEOUT_S)")  # fmt: skip

    ft = parser.add_argument_group(
        "fault tolerance across replica groups (torchft; docs/fault-tolerance.md)"
    )
    ft.add_argument("--ft-replicas", type=int, default=argparse.SUPPRESS, metavar="N",
                    help="N replica groups, one per launcher, each sharding the model over its own "
                    "ranks (full/grad_op); a group that fails costs a step, not a restart")  # fmt: skip
    ft.add_argument("--ft-group", type=int, default=argparse.SUPPRESS, metavar="G",
                    help="with --ft-replicas: this launcher's group, 0..N-1; its run folder is "
                    "RUN/group-G")  # fmt: skip
    ft.add_argument("--ft-lighthouse", default=argparse.SUPPRESS, metavar="HOST:PORT",
                    help="torchft's Lighthouse (default: TORCHFT_LIGHTHOUSE, else group 0 starts "
                    "one on its host, port 29510)")  # fmt: skip


def _bool_or_int(value: str) -> bool | int:
    low = value.lower()
    if low in ("true", "false"):
        return low == "true"
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected true, false or a number, got {value!r}"
        ) from None


def _split_args(args: argparse.Namespace) -> tuple[dict[str, Any], LaunchOptions]:
    given = vars(args)
    keys = {f.name for f in fields(TrainConfig)}
    cli_layer = {k: v for k, v in given.items() if k in keys}
    if "model_override" in given:
        overrides = {}
        for item in given["model_override"]:
            key, sep, value = item.partition("=")
            if not sep or not key.strip() or not value.strip():
                raise ConfigError(f"--model-override {item}: expected KEY=VALUE, e.g. dim=256")
            try:
                overrides[key.strip()] = yaml.safe_load(value)
            except yaml.YAMLError:
                raise ConfigError(
                    f"--model-override {item}: {value!r} is not a value (a number, true/false or "
                    "a string), e.g. dim=256"
                ) from None
        cli_layer["model_overrides"] = overrides
    launch_given = {f.name: given[f.name] for f in fields(LaunchOptions) if f.name in given}
    if "nnodes" in launch_given:
        launch_given["nnodes"] = str(launch_given["nnodes"])
    check_launch(launch_given)
    opts = LaunchOptions(**launch_given)
    return cli_layer, opts


def run(args: argparse.Namespace) -> int:
    t0 = time.perf_counter()
    opts = None
    try:
        cli_layer, opts = _split_args(args)
        cfg, run_dir, manifest = prepare(cli_layer, opts)
    except ConfigError as e:
        print(f"layershard train: error: {e}", file=sys.stderr)
        return 2
    except AlreadyFinished as e:
        print(f"layershard train: {e}")
        return 0
    except KeyboardInterrupt:
        st.release_lock(opts.lock if opts else None)
        print("layershard train: interrupted before training started", file=sys.stderr)
        return 130
    if opts.dry_run:
        print(yaml.safe_dump(cfg.to_dict(), sort_keys=False), end="")
        print(f"# train tokens: {manifest['train']['n_tokens']}, val tokens: "
              f"{manifest['val']['n_tokens']}")  # fmt: skip
        return 0
    lighthouse = None
    try:
        print(f"run folder: {run_dir}", flush=True)
        lighthouse = ft_launch.start_lighthouse(opts)
        rc, signalled = launch(run_dir, opts)
        code, message = outcome(Path(run_dir), opts, rc, signalled)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
        st.release_lock(opts.lock)
        refused = read_report(opts.agent_report)
        if opts.agent_report is not None:
            opts.agent_report.unlink(missing_ok=True)
    first_round = refused is not None and refused.get("first_round")  # no rank started
    if opts.node_rank == 0 and (first_round or refused_before_training(Path(run_dir), opts, code)):
        undo_writes(Path(run_dir), opts)  # nothing trained: the run folder as it was before
    elif opts.node_rank == 0 and code != 0:
        _report_failure(Path(run_dir), cfg.report_to, message)
    if code != 0:
        label = "error: " if code not in (st.EXIT_STOPPED,) else ""
        print(f"layershard train: {label}{message}", file=sys.stderr, flush=True)
        return code
    if opts.node_rank == 0:
        try:
            _done(Path(run_dir), t0)
        except (OSError, ValueError, KeyError, TypeError, ArithmeticError) as e:
            # The run is over and its files are written: the closing line must not fail it.
            print(
                f"layershard train: warning: the run finished, but its summary could not be "
                f"printed ({type(e).__name__}: {e}); its results are in {run_dir}/",
                file=sys.stderr,
            )
    return 0


def _report_failure(run_dir: Path, report_to: Sequence[str], message: str) -> None:
    """The line that ends a run that did not finish, to its W&B / MLflow runs too."""
    try:
        record_failure(run_dir, report_to, message)
    except Exception as e:  # noqa: BLE001 - the run's own outcome must still be said
        print(
            f"layershard train: warning: could not record the failure in {report_to} "
            f"({type(e).__name__}: {e})",
            file=sys.stderr,
        )


def _done(run_dir: Path, t0: float) -> None:
    """The closing lines of a run that finished: time, losses, speed, and the plan's prediction."""
    summary_path = run_dir / "summary.json"
    if summary_path.is_file():
        s = json.loads(summary_path.read_text())
        wall = time.perf_counter() - t0
        s["wall_time_s"] = wall
        summary_path.write_text(json.dumps(s, indent=1))
        start, end = s.get("val_loss_start"), s.get("val_loss_end")
        val = f"validation loss {start:.3f} -> {end:.3f}, " if start and end else ""
        tps = f"{s['tokens_per_s']:,.0f} tokens/s" if s.get("tokens_per_s") else "no new steps"
        print(
            f"done in {wall:.0f}s: {val}{tps} over {s['steps']} steps"
            f" on {s['world_size']} ranks. Run folder: {run_dir}/ (config.yaml, metrics.jsonl, "
            "loss.png, "
            + ("checkpoints/, final/, " if (run_dir / "final").is_dir() else "")
            + "sample.txt)"
        )
        versus = against_plan(s)
        if versus:
            print(f"{versus} (summary.json)")
