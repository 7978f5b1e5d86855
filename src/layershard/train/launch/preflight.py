"""Everything before the ranks start, in one process: resolve the config and check it, take the
run folder's lock, prepare the tokenizer and the tokenized data, write the run folder the ranks
read (``prepare``); and put the folder back as it was when the ranks refuse the run before
training (``undo_writes``)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import torch

from layershard.checkpoint import publish as pub
from layershard.checkpoint.errors import CheckpointError
from layershard.train import identity
from layershard.train import status as st
from layershard.train.config import (
    ConfigError,
    LaunchOptions,
    TrainConfig,
    check_launch,
    check_world,
    dump_yaml,
    grad_accum_for,
    load_yaml,
    read_recorded,
    resolve,
    resolved_strategy,
    resume_layers,
)
from layershard.train.data.prepare import bpe_texts, corpus_hash, prepare_splits
from layershard.train.data.sources import find_files
from layershard.train.data.tokenizer import load_tokenizer, train_or_load_bpe
from layershard.train.launch import ft as ft_launch
from layershard.train.launch.checks import check_prepared
from layershard.train.launch.nodes import (
    elastic,
    elastic_batch,
    nproc,
    settings,
    world_size,
)
from layershard.train.loop.sinks import missing as missing_reporters
from layershard.train.modeling import check_model, check_seq_len, model_spec
from layershard.train.parallel import data_world


class AlreadyFinished(Exception):
    """``--resume`` of a run that has done all its steps: nothing to do (exit 0)."""


def latest_checkpoint(run_dir: Path) -> Path | None:
    """The checkpoint ``checkpoints/latest`` names, else the complete one of the highest step."""
    folder = run_dir / "checkpoints"
    if not folder.is_dir():
        return None
    if (folder / pub.LATEST).is_file():
        try:
            return pub.resolve(folder)
        except CheckpointError:
            pass  # a `latest` naming nothing: the checkpoints themselves decide
    done = pub.sibling_checkpoints(folder)
    return done[-1][2] if done else None


def _check_launch_options(opts: LaunchOptions) -> None:
    check_launch(dataclasses.asdict(opts))  # the schema in config.py


def _unusable(ckpt: Path) -> str:
    """Why ``ckpt`` cannot be resumed from, by the checks that read no tensor data (manifest,
    file sizes, DCP metadata); '' if it passes them. The ranks check the SHA-256 when loading."""
    from layershard.checkpoint.info import checkpoint_info

    info = checkpoint_info(ckpt, verify=False)
    return "" if info["ok"] else str(info["error"])


def _choose_resume(run_dir: Path, opts: LaunchOptions) -> Path:
    assert opts.resume, "called only with --resume"
    if opts.resume != "latest":
        chosen = Path(opts.resume)
        if not chosen.is_dir():
            raise ConfigError(f"--resume: no checkpoint at {chosen}; run without --resume")
        why = _unusable(chosen)
        if why:
            raise ConfigError(f"--resume: {chosen} cannot be resumed from: {why}")
        return chosen
    latest = latest_checkpoint(run_dir)
    if latest is None:
        raise ConfigError(f"--resume: no checkpoint at {run_dir}/checkpoints; run without --resume")
    chosen = latest
    why = _unusable(chosen)
    if not why:
        return chosen
    older = [
        d
        for _, _, d in reversed(pub.sibling_checkpoints(run_dir / "checkpoints"))
        if d.name < chosen.name and not _unusable(d)
    ]
    if not opts.resume_fallback:
        hint = (
            f"pass --resume-fallback to resume from the newest intact one ({older[0].name})"
            if older
            else "no older intact checkpoint exists; start again with --overwrite"
        )
        raise ConfigError(f"--resume: the latest checkpoint is unusable: {why}; {hint}")
    if not older:
        raise ConfigError(
            f"--resume-fallback: no intact checkpoint in {run_dir}/checkpoints ({why})"
        )
    print(
        f"layershard train: note: {chosen.name} is unusable ({why}); resuming from {older[0].name}",
        file=sys.stderr,
        flush=True,
    )
    return older[0]


def _launch_id(run_dir: Path, opts: LaunchOptions) -> str:
    """An id for this launch's records in the run folder. Every node's launcher writes
    launch.json, so on many nodes they must agree: the id comes from what they share."""
    if opts.nnodes == "1" and not opts.rdzv_endpoint:
        return uuid.uuid4().hex[:12]
    shared = f"{run_dir.absolute()}|{opts.rdzv_endpoint}|{opts.rdzv_id}|{opts.nnodes}"
    return "n" + hashlib.sha256(shared.encode()).hexdigest()[:11]


def _finished(run_dir: Path, cfg: TrainConfig) -> str:
    """A message when the run in ``run_dir`` has already done ``cfg.steps`` steps, else ''."""
    summary = st.read_json(run_dir / "summary.json")
    if summary is None or not isinstance(summary.get("steps"), int):
        return ""
    if summary["steps"] < cfg.steps:
        return ""
    return (
        f"run {run_dir} is already finished ({summary['steps']} of {cfg.steps} steps): nothing "
        f"to do. Its results are in {run_dir}/ (final/, summary.json); to train further, "
        f"resume with a larger --steps (e.g. --steps {cfg.steps * 2})"
    )


def _cores_warning(cfg: TrainConfig, kind: str, spec: Any, opts: LaunchOptions) -> None:
    """On CPU, more ranks than cores still runs, slowly; say so with the memory each rank needs."""
    n, cores = nproc(opts), os.cpu_count() or 1
    if torch.cuda.is_available() or n <= cores:
        return
    from layershard.train.modeling import count_params

    params = count_params(kind, spec)
    world = world_size(opts) or n
    state_mib = params * 16 / world / 2**20  # fp32 weights, gradients, two AdamW moments
    try:
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") / n / 2**20
        free = f", {avail:,.0f} MiB of free memory per rank"
    except (ValueError, OSError):
        free = ""
    print(
        f"layershard train: warning: {n} ranks on {cores} CPU cores: the ranks will share the "
        f"cores and run slower than {cores} would; each rank needs ~{state_mib:,.0f} MiB of "
        f"model state (16 bytes per parameter / {world} ranks) plus activations{free}",
        file=sys.stderr,
        flush=True,
    )


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
    """Resolve and check everything; write the run folder only once all checks passed. Node 0
    takes the run folder's lock (``opts.lock``, released by the caller) before the data work, so
    that no other launch starts on, resumes or deletes the folder meanwhile; a refusal after
    that releases it and leaves the folder as it was."""
    cfg, run_dir, base = _resolved(cli_layer, opts)
    resume_from = _check_folder(cfg, run_dir, base, opts)
    if opts.node_rank == 0 and not opts.dry_run:
        _lock(run_dir, opts)
    try:
        tok, files, chash, manifest = _prepare_data(cfg, run_dir, opts)
        if opts.nnodes != "1" or opts.rdzv_endpoint:  # the nodes compare these at the rendezvous
            opts.node_settings = settings(
                cfg, opts, chash, resume_from.name if resume_from is not None else None
            )
        if opts.dry_run or opts.node_rank != 0:
            # One node writes the run folder's files: node 0, whose agent hosts (or first
            # joins) the rendezvous, so that no rank of any node starts before they are
            # written. The other nodes prepared the same tokenizer and data (from the cache
            # node 0 filled when the cache is shared).
            opts.launch_id = opts.launch_id or _launch_id(run_dir, opts)
            return cfg, run_dir, manifest
        if not opts.resume and opts.overwrite:
            _clear_for_overwrite(run_dir)
            opts.replaced = _before_writes(run_dir)
        st.clear_run_state(run_dir)
        _write_run_folder(cfg, run_dir, opts, tok, files, chash, manifest, resume_from)
    except BaseException:
        _unlock(run_dir, opts)
        raise
    return cfg, run_dir, manifest


def _resolved(cli_layer: dict[str, Any], opts: LaunchOptions) -> tuple[TrainConfig, Path, dict]:
    """The run's config from the recorded one (``--resume``), the YAML and the flags, checked
    with everything that needs no data: the world, the model, the parallel splits."""
    _check_launch_options(opts)
    yaml_layer = load_yaml(opts.config) if opts.config else {}
    run_dir = _run_dir_for([yaml_layer, cli_layer], bool(opts.resume))
    run_dir = ft_launch.group_run_dir(run_dir, [yaml_layer, cli_layer], opts)  # RUN/group-<G>
    base: dict[str, Any] = {}
    if opts.resume:
        recorded = run_dir / "config.yaml"
        if not recorded.is_file():
            raise ConfigError(f"--resume: {run_dir} has no config.yaml; is it a run folder?")
        base = read_recorded(recorded)
        for note in resume_layers(base, yaml_layer, cli_layer):
            print(f"layershard train: note: {note}", file=sys.stderr, flush=True)
    cfg = resolve(base, yaml_layer, cli_layer)
    ft_launch.check(cfg, opts)  # --ft-replicas: what it cannot do yet
    cfg.run_dir = str(run_dir)
    identity.absolute_paths(cfg)

    world = world_size(opts)
    if elastic(opts):
        elastic_batch(cfg, opts)
    if world:
        grad_accum_for(cfg, world)  # the global batch divides
    check_world(cfg, world, nproc(opts))
    kind, spec, max_len = model_spec(cfg, None)
    check_seq_len(cfg, max_len)
    check_model(cfg, kind, spec)
    _cores_warning(cfg, kind, spec, opts)
    absent = missing_reporters(cfg.report_to)
    if absent:
        raise ConfigError(absent)
    return cfg, run_dir, base


def _check_folder(
    cfg: TrainConfig, run_dir: Path, base: dict[str, Any], opts: LaunchOptions
) -> Path | None:
    """The run folder fits the command: ``--resume`` continues the same run from an intact
    checkpoint (returned), a new run needs an empty folder or ``--overwrite`` of a run folder.
    Reads only."""
    if opts.resume:
        identity.check_resume(run_dir, base, cfg, opts.allow_data_change)  # model, corpus, state
        finished = _finished(run_dir, cfg)
        if finished:
            raise AlreadyFinished(finished)
        resume_from = _choose_resume(run_dir, opts)
        print(identity.resume_note(run_dir, resume_from, opts.resume != "latest"), flush=True)
        return resume_from
    if run_dir.exists() and not run_dir.is_dir():
        raise ConfigError(f"run folder {run_dir} is a file; choose another --run-dir / --name")
    if run_dir.is_dir() and any(run_dir.iterdir()) and opts.node_rank == 0:
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
    return None


def _lock(run_dir: Path, opts: LaunchOptions) -> None:
    """Take the run folder's lock (creating the folder): a live run on it is refused here, and
    none can start, resume or ``--overwrite`` it until this launch ends. ``opts.replaced``
    records the folder as it was, for ``_unlock`` and ``undo_writes``."""
    opts.launch_id = _launch_id(run_dir, opts)
    opts.replaced = _before_writes(run_dir)
    try:
        opts.lock = st.acquire_lock(run_dir, opts.launch_id)
    except OSError as e:
        _unlock(run_dir, opts)
        raise ConfigError(
            f"run folder {run_dir} cannot be created: {e.strerror or e}; choose another "
            "--run-dir / --name (a writable folder)"
        ) from None


def _unlock(run_dir: Path, opts: LaunchOptions) -> None:
    """After a refusal under the lock: release it and remove what taking it created."""
    st.release_lock(opts.lock)
    opts.lock = None
    before = opts.replaced
    if not before:
        return
    if before.get(".") is None:
        shutil.rmtree(run_dir, ignore_errors=True)
    elif before.get(st.STATE_DIR) is None:
        shutil.rmtree(st.state_dir(run_dir), ignore_errors=True)


def _clear_for_overwrite(run_dir: Path) -> None:
    """``--overwrite``: empty the run folder, all but the lock this launch holds."""
    for entry in run_dir.iterdir():
        if entry.name == st.STATE_DIR and entry.is_dir():
            for inner in entry.iterdir():
                if inner.name != st.LOCK:
                    shutil.rmtree(inner) if inner.is_dir() else inner.unlink()
        elif entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()


def _prepare_data(
    cfg: TrainConfig, run_dir: Path, opts: LaunchOptions
) -> tuple[Any, list[Path], str, dict[str, Any]]:
    """The corpus found, the tokenizer (the run's own on ``--resume``) and the tokenized
    splits, checked: something to train on, enough tokens for one step."""
    notes: list[str] = []
    files = find_files(cfg, notes)
    for note in notes:
        print(f"layershard train: note: {note}", file=sys.stderr, flush=True)
    chash = corpus_hash(files, cfg)
    tok = (identity.run_tokenizer(run_dir) if opts.resume else None) or _tokenizer(
        cfg, files, chash
    )
    if cfg.task == "sft" and tok.eos_id is None:
        raise ConfigError("--task sft needs a tokenizer with an end-of-text token")
    manifest = prepare_splits(files, cfg, tok, chash)
    check_prepared(cfg, tok.vocab_size, manifest)
    n_train = manifest["train"]["n_tokens"]
    if n_train == 0:
        raise ConfigError(
            "the corpus is empty: the training split has no tokens; add data or lower "
            "--val-fraction"
        )
    world = world_size(opts)
    if world:  # the data is split over the data-parallel ranks (a TP or CP group reads one batch)
        need = cfg.seq_len * cfg.micro_batch * grad_accum_for(cfg, world) * data_world(cfg, world)
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
    else:
        _val_share_warning(cfg, manifest)
    return tok, files, chash, manifest


def _write_run_folder(
    cfg: TrainConfig,
    run_dir: Path,
    opts: LaunchOptions,
    tok: Any,
    files: list[Path],
    chash: str,
    manifest: dict[str, Any],
    resume_from: Path | None,
) -> None:
    """Node 0 writes what the ranks read: tokenizer.json, config.yaml (with what was resolved
    for this launch) and launch.json (the data, the checkpoint to resume)."""
    world = world_size(opts)
    ga = grad_accum_for(cfg, world) if world else None
    tok.save(run_dir / "tokenizer.json")
    resolved = {
        "world_size": world,
        "grad_accum": ga,
        **resolved_strategy(cfg, world, nproc(opts)),
        "tokens_per_step": (
            cfg.seq_len * cfg.micro_batch * ga * data_world(cfg, world) if world and ga else None
        ),
        "vocab_size": tok.vocab_size,
        "corpus_files": len(files),
        "corpus_hash": chash[:16],
        "train_tokens": manifest["train"]["n_tokens"],
        "val_tokens": manifest["val"]["n_tokens"],
        "documents": manifest["docs"],
    }
    dump_yaml(cfg, run_dir / "config.yaml", extra=resolved)
    launch = {
        "launch_id": opts.launch_id,
        "data": manifest,
        "resume": str(resume_from) if resume_from else None,
        "resume_fallback": opts.resume_fallback,
        "stop_at_step": opts.stop_at_step,
        "ft": ft_launch.launch_record(opts),
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=1))


def _val_share_warning(cfg: TrainConfig, manifest: dict[str, Any]) -> None:
    """Say so when the held-out share of the tokens is far from --val-fraction (a corpus of a
    few large JSONL records or rows, which are never cut)."""
    val, train = manifest["val"]["n_tokens"], manifest["train"]["n_tokens"]
    share = val / max(1, val + train)
    if cfg.val_fraction > 0 and abs(share - cfg.val_fraction) > 0.5 * cfg.val_fraction:
        print(
            f"layershard train: warning: validation holds {share:.1%} of the tokens, asked "
            f"{cfg.val_fraction:.1%} (--val-fraction): the corpus has too few documents for it "
            "(records and rows are never cut; text files are)",
            file=sys.stderr,
            flush=True,
        )


# What node 0 writes in the run folder before the ranks start (besides the lock).
_WRITTEN = (".", st.STATE_DIR, "config.yaml", "launch.json", "tokenizer.json")


def _before_writes(run_dir: Path) -> dict[str, bytes | None]:
    """Node 0's run-folder entries as they are before this launch writes them: None for one
    that does not exist, b"" for a folder that does, a file's bytes."""
    out: dict[str, bytes | None] = {}
    for name in _WRITTEN:
        p = run_dir / name
        out[name] = None if not p.exists() else (b"" if p.is_dir() else p.read_bytes())
    return out


def refused_before_training(run_dir: Path, opts: LaunchOptions, code: int) -> bool:
    """Did the ranks refuse the run (exit 2: a problem the user can fix) before any of them
    began a step? Then nothing was trained and the launch is undone (``undo_writes``)."""
    ranks = st.rank_statuses(run_dir, opts.launch_id)
    return code == 2 and bool(ranks) and all(r.get("step") is None for r in ranks.values())


def undo_writes(run_dir: Path, opts: LaunchOptions) -> None:
    """When the nodes refused to start, or the ranks refused the run before training: put node
    0's run folder back as it was before this launch, so that the same commands, corrected,
    start as if nothing happened (a fresh run needs no --overwrite and leaves no folder, a
    resumed one keeps its config.yaml)."""
    before = opts.replaced
    if before.get(".") is None:  # this launch made the folder (under its lock): all of it goes
        shutil.rmtree(run_dir, ignore_errors=True)
        return
    for name in _WRITTEN[1:]:
        p, old = run_dir / name, before.get(name)
        if old is None:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        elif not p.is_dir():
            p.write_bytes(old)


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

    t0 = time.perf_counter()
    tok, trained = train_or_load_bpe(lambda: bpe_texts(files, cfg), chash, cfg.vocab_size)
    if trained:
        print(
            f"trained a {tok.vocab_size}-token BPE on the corpus in "
            f"{time.perf_counter() - t0:.1f}s (cached at {tok.path})",
            flush=True,
        )
    return tok
