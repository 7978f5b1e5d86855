"""Everything before the ranks start, in one process: resolve the config, check it, prepare the
run folder, the tokenizer and the tokenized data; then start the ranks with torch's own elastic
launcher (``python -m torch.distributed.run``), which also covers multi-node runs."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

from layershard.train.config import (
    ConfigError,
    TrainConfig,
    dump_yaml,
    grad_accum_for,
    load_yaml,
    resolve,
)
from layershard.train.data import corpus_hash, find_files, iter_documents, prepare_splits, val_names
from layershard.train.modeling import check_seq_len, model_spec
from layershard.train.tokenizer import load_tokenizer, train_or_load_bpe


@dataclass
class LaunchOptions:
    """One invocation's options that are not part of the run's recorded config."""

    config: str | None = None
    overwrite: bool = False
    resume: str | None = None  # "latest" or a checkpoint folder
    stop_at_step: int | None = None
    nproc_per_node: int | None = None
    nnodes: str = "1"
    node_rank: int = 0
    rdzv_endpoint: str | None = None
    rdzv_backend: str | None = None
    rdzv_id: str | None = None
    max_restarts: int = 0
    dry_run: bool = False
    notes: list[str] = field(default_factory=list)


def default_nproc() -> int:
    # One rank per GPU; on CPU two ranks (the smallest real data-parallel job).
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def world_size(opts: LaunchOptions) -> int | None:
    """Total ranks when it is fixed (an elastic ``--nnodes MIN:MAX`` leaves it open)."""
    try:
        return int(opts.nnodes) * (opts.nproc_per_node or default_nproc())
    except ValueError:
        return None


def latest_checkpoint(run_dir: Path) -> Path | None:
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return None
    done = sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith("step_") and "." not in p.name
    )
    return done[-1] if done else None


def _run_dir_for(layers: list[dict[str, Any]], resume: bool) -> Path:
    run_dir = name = None
    for layer in layers:
        run_dir = layer.get("run_dir", run_dir)
        name = layer.get("name", name)
    if run_dir:
        return Path(run_dir)
    if name:
        return Path("runs") / str(name)
    if resume:
        raise ConfigError("--resume needs the run to continue: pass --run-dir (or --name)")
    return Path("runs") / time.strftime("%Y%m%d-%H%M%S")


def prepare(cli_layer: dict[str, Any], opts: LaunchOptions) -> tuple[TrainConfig, Path, dict]:
    """Resolve and check everything; write the run folder only once all checks passed."""
    yaml_layer = load_yaml(opts.config) if opts.config else {}
    run_dir = _run_dir_for([yaml_layer, cli_layer], bool(opts.resume))
    base: dict[str, Any] = {}
    if opts.resume:
        recorded = run_dir / "config.yaml"
        if not recorded.is_file():
            raise ConfigError(f"--resume: {run_dir} has no config.yaml; is it a run folder?")
        base = yaml.safe_load(recorded.read_text()) or {}
        base.pop("_resolved", None)
    cfg = resolve(base, yaml_layer, cli_layer)
    cfg.run_dir = str(run_dir)

    world = world_size(opts)
    ga = grad_accum_for(cfg, world) if world else None
    kind, spec, max_len = model_spec(cfg, None)
    check_seq_len(cfg, max_len)

    resume_from = None
    if opts.resume:
        resume_from = Path(opts.resume) if opts.resume != "latest" else latest_checkpoint(run_dir)
        if resume_from is None or not resume_from.is_dir():
            where = opts.resume if opts.resume != "latest" else f"{run_dir}/checkpoints"
            raise ConfigError(f"--resume: no checkpoint at {where}; run without --resume")
    elif run_dir.exists() and any(run_dir.iterdir()) and opts.node_rank == 0:
        if not opts.overwrite:
            raise ConfigError(
                f"run folder {run_dir} already exists and is not empty; pass --overwrite to "
                "replace it, --resume to continue it, or choose another --run-dir / --name"
            )
        if not (run_dir / "config.yaml").is_file():  # --overwrite deletes the folder: be sure
            raise ConfigError(
                f"--overwrite: {run_dir} is not empty and is not a run folder (no config.yaml); "
                "refusing to delete it; choose another --run-dir"
            )

    files = find_files(cfg)
    chash = corpus_hash(files, cfg)
    tok = _tokenizer(cfg, files, chash)
    if cfg.task == "sft" and tok.eos_id is None:
        raise ConfigError("--task sft needs a tokenizer with an end-of-text token")
    manifest = prepare_splits(files, cfg, tok, chash)
    n_train = manifest["train"]["n_tokens"]
    if n_train == 0:
        raise ConfigError(
            "the corpus is empty: the training split has no tokens; add data or lower "
            "--val-fraction"
        )
    if world and ga:
        need = cfg.seq_len * cfg.micro_batch * ga * world
        if n_train < need:
            raise ConfigError(
                f"the training split has {n_train} tokens but one step needs {need}; add data "
                "or lower --seq-len / --micro-batch / --batch-tokens"
            )
    if manifest["val"]["n_tokens"] < cfg.seq_len:
        print(
            f"warning: the validation split has {manifest['val']['n_tokens']} tokens, less than "
            "one sequence: no validation loss (raise --val-fraction or add data)",
            file=sys.stderr,
        )
    if opts.dry_run:
        return cfg, run_dir, manifest

    if not opts.resume and run_dir.exists() and opts.overwrite and opts.node_rank == 0:
        shutil.rmtree(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    tok.save(run_dir / "tokenizer.json")
    resolved = {
        "world_size": world,
        "grad_accum": ga,
        "tokens_per_step": cfg.seq_len * cfg.micro_batch * ga * world if world and ga else None,
        "vocab_size": tok.vocab_size,
        "corpus_files": len(files),
        "corpus_hash": chash[:16],
        "train_tokens": n_train,
        "val_tokens": manifest["val"]["n_tokens"],
        "documents": manifest["docs"],
    }
    dump_yaml(cfg, run_dir / "config.yaml", extra=resolved)
    launch = {
        "data": manifest,
        "resume": str(resume_from) if resume_from else None,
        "stop_at_step": opts.stop_at_step,
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=1))
    return cfg, run_dir, manifest


def _tokenizer(cfg: TrainConfig, files: list[Path], chash: str):
    if cfg.tokenizer:
        return load_tokenizer(cfg.tokenizer)
    if cfg.init_from:
        if not (Path(cfg.init_from) / "tokenizer.json").is_file():
            raise ConfigError(
                f"--init-from {cfg.init_from} has no tokenizer.json; pass the model's tokenizer "
                "with --tokenizer"
            )
        return load_tokenizer(cfg.init_from)

    def train_texts():
        held_out = val_names(files, cfg)
        for name, doc in iter_documents(files, cfg):
            if name in held_out:
                continue
            if isinstance(doc, str):
                yield doc
            else:  # an SFT record: learn the vocabulary of every message
                msgs = doc.get("messages") or [
                    {"content": doc.get("prompt", "")},
                    {"content": doc.get("response", "")},
                ]
                yield "\n".join(str(m.get("content", "")) for m in msgs if isinstance(m, dict))

    t0 = time.perf_counter()
    tok, trained = train_or_load_bpe(train_texts, chash, cfg.vocab_size)
    if trained:
        print(
            f"trained a {tok.vocab_size}-token BPE on the corpus in "
            f"{time.perf_counter() - t0:.1f}s (cached at {tok.path})",
            flush=True,
        )
    return tok


def torchrun_command(run_dir: Path, opts: LaunchOptions) -> list[str]:
    cmd = [sys.executable, "-m", "torch.distributed.run"]
    if opts.nnodes == "1" and not opts.rdzv_endpoint:
        cmd += ["--standalone"]  # a free local port; nothing to configure
    else:
        cmd += ["--nnodes", opts.nnodes, "--node-rank", str(opts.node_rank)]
        if opts.rdzv_endpoint:
            cmd += ["--rdzv-endpoint", opts.rdzv_endpoint]
        if opts.rdzv_backend:
            cmd += ["--rdzv-backend", opts.rdzv_backend]
        if opts.rdzv_id:
            cmd += ["--rdzv-id", opts.rdzv_id]
    cmd += [
        "--nproc-per-node", str(opts.nproc_per_node or default_nproc()),
        "--max-restarts", str(opts.max_restarts),
        "-m", "layershard.train.loop", str(run_dir),
    ]  # fmt: skip
    return cmd


def launch(run_dir: Path, opts: LaunchOptions) -> int:
    nproc = opts.nproc_per_node or default_nproc()
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        # Ranks share the cores: one compute thread per core each, no oversubscription.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // nproc))
    env.setdefault("OMP_NUM_THREADS", "1")
    return subprocess.call(torchrun_command(run_dir, opts), env=env)
