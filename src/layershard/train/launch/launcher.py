"""Everything before the ranks start, in one process: resolve the config, check it, prepare the
run folder, the tokenizer and the tokenized data; then start the ranks with torch's own elastic
launcher (``python -m torch.distributed.run``), which also covers multi-node runs."""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
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
from layershard.train.launch import rendezvous as rdzv
from layershard.train.launch.checks import check_prepared
from layershard.train.launch.nodes import (
    elastic,
    elastic_batch,
    loopback,
    lost_nodes,
    nproc,
    partitioned,
    rdzv_backend,
    rdzv_timeout_conf,
    settings,
    world_size,
)
from layershard.train.modeling import check_model, check_seq_len, model_spec

# The process-group timeout `layershard train` gives its ranks unless told otherwise: a rank that
# waits longer than this in one collective fails the job. Long enough for the slowest legitimate
# wait between two collectives (a rank hashing its share of a checkpoint, rank 0 writing a 2 GB
# safetensors file of an HF export), short enough that a hung job ends in minutes. A rank that
# waits a fifth of it (at most a minute) first says where it waits (train/loop/faults.py).
DEFAULT_TIMEOUT_S = 300.0


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
    """Resolve and check everything; write the run folder only once all checks passed, under its
    lock (``opts.lock``, released by the caller)."""
    _check_launch_options(opts)
    yaml_layer = load_yaml(opts.config) if opts.config else {}
    run_dir = _run_dir_for([yaml_layer, cli_layer], bool(opts.resume))
    base: dict[str, Any] = {}
    if opts.resume:
        recorded = run_dir / "config.yaml"
        if not recorded.is_file():
            raise ConfigError(f"--resume: {run_dir} has no config.yaml; is it a run folder?")
        base = read_recorded(recorded)
        for note in resume_layers(base, yaml_layer, cli_layer):
            print(f"layershard train: note: {note}", file=sys.stderr, flush=True)
    cfg = resolve(base, yaml_layer, cli_layer)
    cfg.run_dir = str(run_dir)
    identity.absolute_paths(cfg)

    world = world_size(opts)
    if elastic(opts):
        elastic_batch(cfg, opts)
    ga = grad_accum_for(cfg, world) if world else None
    check_world(cfg, world, nproc(opts))
    kind, spec, max_len = model_spec(cfg, None)
    check_seq_len(cfg, max_len)
    check_model(cfg, kind, spec)
    _cores_warning(cfg, kind, spec, opts)

    resume_from = None
    if opts.resume:
        identity.check_resume(run_dir, base, cfg, opts.allow_data_change)  # model, corpus
        finished = _finished(run_dir, cfg)
        if finished:
            raise AlreadyFinished(finished)
        resume_from = _choose_resume(run_dir, opts)
        print(identity.resume_note(run_dir, resume_from, opts.resume != "latest"), flush=True)
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
    if opts.node_rank == 0 and not opts.dry_run:
        busy = st.held_by(run_dir)  # before the data work: say it now, not in a minute
        if busy:
            raise ConfigError(busy)

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
    else:
        _val_share_warning(cfg, manifest)
    if opts.nnodes != "1" or opts.rdzv_endpoint:  # the nodes compare these at the rendezvous
        opts.node_settings = settings(
            cfg, opts, chash, resume_from.name if resume_from is not None else None
        )
    if opts.dry_run:
        return cfg, run_dir, manifest

    opts.launch_id = _launch_id(run_dir, opts)
    if opts.node_rank == 0:
        busy = st.held_by(run_dir)
        if busy:
            raise ConfigError(busy)
        if not opts.resume and run_dir.exists() and opts.overwrite:
            shutil.rmtree(run_dir)
        if opts.node_settings is not None:
            opts.replaced = _before_writes(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        opts.lock = st.acquire_lock(run_dir, opts.launch_id)
        st.clear_run_state(run_dir)
    if opts.node_rank != 0:
        # One node writes the run folder's files: node 0, whose agent hosts (or first joins)
        # the rendezvous, so that no rank of any node starts before they are written. The
        # other nodes prepared the same tokenizer and data (from the cache node 0 filled when
        # the cache is shared).
        return cfg, run_dir, manifest
    run_dir.mkdir(parents=True, exist_ok=True)
    tok.save(run_dir / "tokenizer.json")
    resolved = {
        "world_size": world,
        "grad_accum": ga,
        **resolved_strategy(cfg, world, nproc(opts)),
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
        "launch_id": opts.launch_id,
        "data": manifest,
        "resume": str(resume_from) if resume_from else None,
        "resume_fallback": opts.resume_fallback,
        "stop_at_step": opts.stop_at_step,
    }
    (run_dir / "launch.json").write_text(json.dumps(launch, indent=1))
    return cfg, run_dir, manifest


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


def undo_writes(run_dir: Path, opts: LaunchOptions) -> None:
    """When the nodes refused to start (nothing trained): put node 0's run folder back as it was
    before this launch, so that the same commands, corrected, start as if nothing happened (a
    fresh run needs no --overwrite, a resumed one keeps its config.yaml)."""
    before = opts.replaced
    for name in _WRITTEN[1:]:
        p, old = run_dir / name, before.get(name)
        if old is None:
            if p.is_dir():
                shutil.rmtree(p, ignore_errors=True)
            else:
                p.unlink(missing_ok=True)
        elif not p.is_dir():
            p.write_bytes(old)
    if before.get(".") is None:
        with contextlib.suppress(OSError):
            run_dir.rmdir()  # only if this launch made it and left nothing else in it


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


def torchrun_command(run_dir: Path, opts: LaunchOptions) -> list[str]:
    """torchrun (``torch.distributed.run``) through ``layershard.train.launch.agent``, which runs
    torchrun's own ``run()`` and records what it says about failed ranks."""
    cmd = [sys.executable, "-m", "layershard.train.launch.agent", str(run_dir)]
    if opts.nnodes == "1" and not opts.rdzv_endpoint:
        cmd += ["--standalone"]  # a free local port; nothing to configure
    else:
        cmd += ["--nnodes", opts.nnodes, "--node-rank", str(opts.node_rank)]
        if opts.rdzv_endpoint:
            cmd += ["--rdzv-endpoint", opts.rdzv_endpoint]
        backend = rdzv_backend(opts)
        if backend:
            cmd += ["--rdzv-backend", backend]
        if opts.rdzv_id:
            cmd += ["--rdzv-id", opts.rdzv_id]
        conf = [c for c in (opts.rdzv_conf or "").split(",") if c]
        conf += rdzv_timeout_conf(opts, backend, conf)
        if backend == "c10d" and loopback(opts.rdzv_endpoint):
            # Nodes simulated on one machine all match the endpoint's host, so by default the
            # first launcher to bind would host c10d's rendezvous store, and the job would end
            # with that node. Here, as across machines, node 0 (at the endpoint) hosts it.
            conf.insert(0, f"is_host={int(opts.node_rank == 0)}")
        if conf:
            cmd += ["--rdzv-conf", ",".join(conf)]
    cmd += [
        "--nproc-per-node", str(nproc(opts)),
        "--max-restarts", str(opts.max_restarts),
        "-m", "layershard.train.loop.rank", str(run_dir),
    ]  # fmt: skip
    return cmd


def rank_env(opts: LaunchOptions) -> dict[str, str]:
    env = dict(os.environ)
    n = nproc(opts)
    if "OMP_NUM_THREADS" not in env and not torch.cuda.is_available():
        # Ranks share the cores: one compute thread per core each, no oversubscription.
        env["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // n))
    env.setdefault("OMP_NUM_THREADS", "1")
    if opts.timeout is not None:
        env["LAYERSHARD_TIMEOUT_S"] = str(opts.timeout)
    env.setdefault("LAYERSHARD_TIMEOUT_S", str(DEFAULT_TIMEOUT_S))
    env["LAYERSHARD_TRAIN_CLI"] = "1"  # the ranks leave the final one-line message to us
    env["LAYERSHARD_LAUNCHER_PID"] = str(os.getpid())  # the agent dies with us (agent.py)
    env[st.NODE_ENV] = str(opts.node_rank)  # in each rank's status: which node lost a rank
    env.pop(rdzv.SETTINGS_ENV, None)
    env.pop(rdzv.REPORT_ENV, None)
    if opts.node_settings is not None:  # compared with the other nodes' at the rendezvous
        env[rdzv.SETTINGS_ENV] = json.dumps(opts.node_settings)
    if opts.agent_report is not None:
        env[rdzv.REPORT_ENV] = str(opts.agent_report)
    return env


def _local_ranks(run_dir: Path, launch_id: str) -> list[int]:
    return [
        r["pid"]
        for r in st.rank_statuses(run_dir, launch_id).values()
        if "exit" not in r and st.alive(r)
    ]


def launch(run_dir: Path, opts: LaunchOptions) -> tuple[int, str | None]:
    """Start torchrun and wait for it. Returns (its exit code, the first stop signal received).

    torchrun and its ranks run in sessions of their own, so a terminal's Ctrl-C reaches only this
    process, which passes the first SIGINT / SIGTERM / SIGHUP to this machine's ranks: they agree
    on a step, save a checkpoint and exit (0, so that torchrun does not restart them). A second
    one kills torchrun and the ranks at once."""
    received: list[int] = []
    proc: subprocess.Popen | None = None

    def on_signal(signum: int, frame: Any) -> None:
        received.append(signum)
        if proc is None:
            return
        if len(received) == 1:
            ranks = _local_ranks(run_dir, opts.launch_id)
            for pid in ranks or [proc.pid]:  # before the ranks run: torchrun stops them
                with _quiet():
                    os.kill(pid, signum)
            os.write(
                2,
                f"layershard train: {st.signal_name(signum)}: the ranks stop after the current "
                "step and save a checkpoint (send it again to stop at once, losing the step)\n".encode(),
            )
            return
        for pid in [proc.pid, *_local_ranks(run_dir, opts.launch_id)]:
            with _quiet():
                os.killpg(pid, signal.SIGKILL)  # each is the leader of its own session

    handled = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    previous = {sig: signal.signal(sig, on_signal) for sig in handled}
    if opts.node_settings is not None:  # what the agent says when no rank starts (rendezvous.py)
        fd, name = tempfile.mkstemp(prefix="layershard-agent-", suffix=".json")
        os.close(fd)
        opts.agent_report = Path(name)
    try:
        proc = subprocess.Popen(
            torchrun_command(run_dir, opts), env=rank_env(opts), start_new_session=True
        )
        if opts.lock is not None:
            st.add_child(opts.lock, proc.pid)
        rc = proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return rc, (st.signal_name(received[0]) if received else None)


class _quiet:
    """Ignore a process that is already gone."""

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind, value, tb) -> bool:
        return kind is not None and issubclass(kind, ProcessLookupError | PermissionError)


def outcome(run_dir: Path, opts: LaunchOptions, rc: int, signalled: str | None) -> tuple[int, str]:
    """The exit code of `layershard train` and the one line that explains a run that did not
    finish: a stop on request, non-finite steps, or which rank failed, how, and at which step."""
    refused = rdzv.read_report(opts.agent_report)
    if refused is not None:  # the nodes disagree, or never met
        return refused["code"], refused["message"]
    state = st.state_dir(run_dir)
    stop = st.read_json(state / st.STOP)
    ranks = st.rank_statuses(run_dir, opts.launch_id)
    last = max((s.get("attempt", 0) for s in ranks.values()), default=0)
    # An elastic job's ranks also stop on purpose when nodes join (torchrun's SIGTERM), and go
    # on in the next round: only a stop in the last round ended the run.
    if (
        stop is not None
        and stop.get("launch_id") == opts.launch_id
        and stop.get("attempt", 0) == last
    ):
        if stop.get("reason") == "signal":
            return st.EXIT_STOPPED, (
                f"stopped by {stop.get('signal')} at step {stop.get('step')}; checkpoint saved "
                f"({stop.get('checkpoint')}). Continue with: layershard train --resume --run-dir "
                f"{run_dir}"
            )
        return 1, str(stop.get("message"))
    if rc == 0:
        return 0, ""
    fails = st.read_json(state / st.FAILURES) or {}
    if fails.get("launch_id") != opts.launch_id:
        fails = {}
    failures = fails.get("failures", {})
    resume = _resume_hint(run_dir)
    for _, s in sorted(ranks.items()):
        if s.get("exit") == 2:  # a problem the user can fix, agreed by the ranks
            return 2, str(s.get("error"))
    cut = partitioned(run_dir, ranks, opts)  # every rank alive and waiting: the network failed
    if cut:
        return 1, f"{cut}{_resume_hint(run_dir, opts)}"
    for r, s in sorted(ranks.items()):
        if s.get("exit") not in (None, 0) and not s.get("peer_lost"):
            first = str(s.get("error") or "").splitlines()[0] if s.get("error") else "an error"
            return 1, f"rank {r} failed at step {s.get('step')}: {first}{resume}"
    lost = lost_nodes(ranks, opts)
    if lost:
        return 1, f"{lost}; this node's ranks were stopped{_resume_hint(run_dir, opts)}"
    silent = [r for r, s in sorted(ranks.items()) if "exit" not in s]
    silent += [int(r) for r in sorted(failures, key=int) if int(r) not in ranks]
    for r in silent:
        s, f = ranks.get(r, {}), failures.get(str(r), {})
        if f.get("signal"):
            how = f"was killed by {f['signal']}"
            if f["signal"] == "SIGKILL":
                how += " (out of memory? `dmesg` shows the kernel's OOM kills)"
        elif f.get("exitcode") is not None:
            how = f"exited with code {f['exitcode']}"
        else:
            how = "died without an error message"
        where = f" (pid {s['pid']} on {s.get('host')})" if s.get("pid") else ""
        step = f" at step {s['step']}" if s.get("step") is not None else " before training"
        return 1, f"rank {r}{where} {how}{step}; the other ranks were stopped{resume}"
    if signalled:
        return st.EXIT_STOPPED, f"stopped by {signalled} before training started"
    return rc or 1, f"the training ranks failed (exit code {rc}); the first error above names it"


def _resume_hint(run_dir: Path, opts: LaunchOptions | None = None) -> str:
    latest = latest_checkpoint(run_dir)
    if latest is None:
        return ""
    if opts is not None and (elastic(opts) or world_size(opts) != nproc(opts)):
        return f". Resume from {latest.name}: the same command with --resume, on every node"
    return f". Resume from {latest.name} with: layershard train --resume --run-dir {run_dir}"
