"""The resolved configuration of a training run: defaults < YAML file < command-line flags.

Every field of ``TrainConfig`` is a YAML key and a ``--flag`` (underscores become dashes). The
run folder records the resolved config as ``config.yaml``; a resumed run starts from it.
"""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import asdict, field, fields
from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import BeforeValidator, ConfigDict, Field, StrictBool, StrictStr, ValidationError
from pydantic import model_validator as _model_validator
from pydantic.dataclasses import dataclass

from layershard.engine.strategy import check_options as check_strategy_options
from layershard.train.config_checks import check_compile, check_ft_launch, check_plan
from layershard.train.loop.sinks import Reporters
from layershard.train.parallel import check_parallel, check_replica, group_size
from layershard.train.parallel import check_world as check_parallel_world
from layershard.validation import (
    Int,
    NonNegativeInt,
    Number,
    PositiveInt,
    one_line,
    unknown_key,
)


class ConfigError(ValueError):
    """A problem the user can fix; reported as one line, exit code 2."""


def _as_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value  # `data: corpus/` means one path


Paths = Annotated[list[StrictStr], BeforeValidator(_as_list)]
Rate = Annotated[Number, Field(ge=0, description="a finite number >= 0")]
Beta = Annotated[Number, Field(ge=0, lt=1, description="in [0, 1)")]
Ranks = Annotated[PositiveInt | None, Field(description="a number of ranks >= 1")]


@dataclass(config=ConfigDict(extra="forbid", validate_assignment=False))
class TrainConfig:
    """The schema of a run: every field is a YAML key and a ``--flag``; its type and ``Field``
    constraints, and the checks in ``_check`` below, are all the validation there is."""

    # --- model --------------------------------------------------------------------------------
    model: StrictStr = "tiny"  # a layershard.models preset (an architecture, not weights)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {dim: 256}
    hf_config: StrictStr | None = None  # a transformers config.json (or its folder): random init
    init_from: StrictStr | None = None  # a folder with HF config.json + *.safetensors: fine-tuning
    # QLoRA: --init-from's model loaded in 4 bits (NF4, double quant), LoRA on every linear
    qlora: StrictBool = False
    lora_rank: PositiveInt = 16  # with qlora: r of every adapter (alpha = 2 r)
    tokenizer: StrictStr | None = None  # tokenizer.json or a folder with one; None: train a BPE
    vocab_size: PositiveInt = 4096  # size of the BPE trained when no tokenizer is given
    # --- data ---------------------------------------------------------------------------------
    task: Literal["pretrain", "sft"] = "pretrain"
    data: Paths = field(default_factory=list)  # files/folders; empty: Python's stdlib
    text_key: StrictStr = "text"  # the field holding text in JSONL / datasets records
    val_fraction: Annotated[Number, Field(ge=0, lt=1, description="in [0, 1)")] = 0.05
    max_files: PositiveInt | None = None  # use only the first N files (sorted): quick experiments
    sft_packing: Literal["pack", "pad"] = "pack"
    # --- batch --------------------------------------------------------------------------------
    seq_len: PositiveInt = 256
    micro_batch: PositiveInt = 8  # sequences per rank per forward/backward
    grad_accum: PositiveInt | None = None  # micro-batches per step; from batch_tokens if unset
    batch_tokens: PositiveInt | None = None  # global tokens per optimizer step
    # --- optimization -------------------------------------------------------------------------
    optimizer: Literal["adamw", "muon"] = "adamw"  # muon: ls.optim.Muon for 2-D block weights
    steps: PositiveInt = 150
    lr: Rate = 3e-3
    min_lr_ratio: Annotated[Number, Field(ge=0, le=1, description="in [0, 1]")] = 0.1
    warmup_steps: NonNegativeInt = 20
    weight_decay: Rate = 0.1
    no_decay: Paths = field(default_factory=lambda: ["*norm*", "*bias", "*embed*"])
    beta1: Beta = 0.9
    beta2: Beta = 0.95
    grad_clip: Rate = 1.0  # 0 disables clipping (the norm is still logged)
    # --- execution: ls.shard's options ----------------------------------------------------------
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"  # auto: bf16 on GPU, fp32 on CPU
    # fp16: ls.GradScaler's initial loss scale (halved at each overflow, doubled after 2000 steps)
    loss_scale: Annotated[Number, Field(gt=0, description="a number > 0")] = 65536.0  # fp16 only
    # the wire: weights over the all-gather (exact: the compute dtype), gradients' reduce dtype
    gather_dtype: Literal["exact", "fp8", "int8"] = "exact"
    reduce_dtype: Literal["fp32", "bf16"] = "fp32"
    strategy: Literal["full", "grad_op", "no_shard", "hybrid"] = "full"
    shard_size: Ranks = None  # hybrid: ranks per shard group (default: the ranks of a node)
    # expert parallelism: each MoE layer's experts split over ep ranks (ls.parallelize)
    ep: PositiveInt = 1
    # tensor parallelism: each block's weights split over tp ranks (ls.parallelize)
    tp: PositiveInt = 1
    # context parallelism: each sequence split over cp ranks (ls.parallelize; built-in presets)
    cp: PositiveInt = 1
    cp_mode: Literal["ring", "all_to_all"] = "ring"  # the attention over the cp ranks
    reshard_after_forward: Annotated[
        StrictBool | PositiveInt,
        Field(description="true, false or a number of ranks K >= 1 (hpZ)"),
    ] = True
    offload: StrictBool = False  # ls.CPUOffload(): shards and optimizer state in CPU memory
    compile: Annotated[
        StrictBool | dict[str, Any],
        Field(description="true, false or a mapping of torch.compile options"),
    ] = False
    activation_checkpointing: NonNegativeInt = 0  # number of blocks to recompute in backward
    blocks_per_unit: PositiveInt = 1  # K consecutive blocks gathered and reduced as one unit
    loss_chunks: NonNegativeInt = 0  # the chunked loss (ls.chunked_loss) in K chunks; 0: off
    seed: Int = 0
    # --- evaluation, checkpoints, output ------------------------------------------------------
    eval_interval: NonNegativeInt = 50  # steps; 0: only at the start and the end
    eval_sequences: NonNegativeInt = 64  # validation sequences per evaluation
    checkpoint_interval: NonNegativeInt = 0  # steps; 0: only the final checkpoint
    async_checkpoint: StrictBool = False  # periodic checkpoints in the background (DCP)
    max_bad_steps: PositiveInt = 3  # non-finite steps (loss or gradient norm) in a row
    log_interval: PositiveInt = 1
    report_to: Reporters = field(default_factory=lambda: ["tensorboard"])  # loop/sinks.py
    run_dir: StrictStr | None = None  # default runs/<name or timestamp>
    name: StrictStr | None = None
    sample_tokens: NonNegativeInt = 120  # tokens generated from sample_prompt at the end
    sample_prompt: StrictStr = "def "
    # what `layershard plan --write-config` predicted for these settings (recorded, compared)
    plan: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @_model_validator(mode="after")
    def _check(self) -> TrainConfig:
        """Rules that relate several keys (a ``ValueError`` becomes the one-line error)."""
        for key in ("data", "no_decay"):
            if any(not p.strip() for p in getattr(self, key)):
                raise ValueError(
                    f"{key} has an empty entry ({getattr(self, key)!r}); name files or folders "
                    "(an empty path would mean the current folder)"
                )
        for key in ("hf_config", "init_from", "tokenizer", "run_dir", "name", "text_key"):
            if getattr(self, key) is not None and not getattr(self, key).strip():
                raise ValueError(f"{key} is empty; leave it out or give a value")
        if self.name is not None and (
            self.name in (".", "..") or "/" in self.name or os.sep in self.name
        ):
            raise ValueError(
                f"name {self.name!r} must be a folder name (no '/', not '..'): the run goes to "
                "runs/<name>; for a run folder elsewhere use --run-dir"
            )
        _check_run_folder(self.run_dir, self.name)
        for key in ("model_overrides", "compile", "plan"):
            where = _non_finite(getattr(self, key))
            if where is not None:
                raise ValueError(f"{key}: {where[0]} must be a finite number, got {where[1]!r}")
        try:
            check_strategy_options(self.strategy, None, self.shard_size, self.reshard_after_forward)
        except ValueError as e:
            raise ValueError(f"strategy options: {_flags(str(e))}{_fix(str(e))}") from None
        check_parallel(self)  # --tp / --ep / --cp (train/parallel.py)
        if self.precision != "fp16" and self.loss_scale != _DEFAULT_LOSS_SCALE:
            raise ValueError(
                f"loss_scale {self.loss_scale:g} is fp16's initial loss scale, but this run "
                f"computes in {self.precision} (no loss scaling); leave out --loss-scale, or "
                "pass --precision fp16"
            )
        if isinstance(self.compile, dict):
            check_compile(self.compile)
        if self.plan is not None:
            check_plan(self.plan)
        if self.precision == "fp16" and self.optimizer == "muon":
            raise ValueError("precision fp16 (loss scaling) is not supported with optimizer muon")
        if self.qlora and not self.init_from:
            raise ValueError(
                "--qlora needs --init-from: the Hugging Face model folder to load in 4 bits"
            )
        if self.qlora and self.optimizer == "muon":
            raise ValueError(
                "--qlora is not supported with --optimizer muon yet (the adapters train with AdamW)"
            )
        if self.hf_config and self.init_from:
            raise ValueError(
                "--hf-config and --init-from both choose the model; pass one "
                "(--init-from already reads the config.json next to the weights)"
            )
        if self.vocab_size < 260 and not self.tokenizer:
            raise ValueError(
                f"vocab_size={self.vocab_size} is too small for a byte-level BPE (256 bytes + "
                "special tokens); use at least 260"
            )
        return self


def _non_finite(value: Any, path: str = "") -> tuple[str, float] | None:
    """The first ``.inf`` / ``.nan`` inside a YAML mapping (its dotted key), or None."""
    if isinstance(value, float) and not math.isfinite(value):
        return path or "value", value
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for k, v in items:
        found = _non_finite(v, f"{path}.{k}" if path else str(k))
        if found is not None:
            return found
    return None


_DEFAULT_LOSS_SCALE = 65536.0


def _fix(engine_message: str) -> str:
    """What to do about a strategy option that does not apply to the strategy."""
    if "shard_size=...) applies" in engine_message:
        return "; leave out --shard-size, or use --strategy hybrid"
    if "reshard_after_forward=...) applies" in engine_message:
        return "; leave out --reshard-after-forward, or use --strategy full"
    return ""


def _flags(engine_message: str) -> str:
    """The engine's wording of a strategy rule, in the words of the command line."""
    return (
        engine_message.replace("shard(strategy='hybrid', shard_size=", "hybrid with shard_size ")
        .replace("shard(strategy=", "strategy ")
        .replace("shard(shard_size=...)", "shard_size")
        .replace("shard(reshard_after_forward=...)", "reshard_after_forward")
        .replace("shard(reshard_after_forward=", "reshard_after_forward ")
        .replace("):", ":")
    )


def _check_run_folder(run_dir: str | None, name: str | None) -> None:
    """The run folder (or the first of its parents that exists) must be a folder."""
    folder = Path(run_dir) if run_dir else Path("runs") / (name or "<timestamp>")
    for p in [folder, *folder.parents]:
        if p.exists() or p.is_symlink():
            if not p.is_dir():
                raise ValueError(
                    f"run folder {folder}: {p} is a file, not a folder; choose another "
                    "--run-dir / --name"
                )
            return


# Options that shape one invocation but are not part of the run (never recorded).
LAUNCH_KEYS = (
    "config",
    "overwrite",
    "resume",
    "stop_after_steps",
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "rdzv_endpoint",
    "rdzv_id",
    "rdzv_backend",
    "max_restarts",
    "resume_fallback",
    "timeout",
    "rdzv_timeout",
    "ft_replicas",
    "ft_group",
    "ft_lighthouse",
)

# The longest process-group timeout: torch keeps it as a timedelta in milliseconds.
MAX_TIMEOUT_S = 7 * 24 * 3600.0


@dataclass(config=ConfigDict(extra="ignore"))
class LaunchSchema:
    """The launch options of ``layershard train`` (flags only, never recorded)."""

    config: StrictStr | None = None
    resume: StrictStr | None = None
    resume_fallback: StrictBool = False
    allow_data_change: StrictBool = False
    stop_at_step: PositiveInt | None = None
    nproc_per_node: PositiveInt | None = None
    nnodes: Annotated[StrictStr, Field(description="N or MIN:MAX nodes, each at least 1")] = "1"
    node_rank: NonNegativeInt = 0
    max_restarts: NonNegativeInt = 0
    timeout: Annotated[
        Number | None,
        Field(
            gt=0,
            le=MAX_TIMEOUT_S,
            description=f"a number of seconds > 0 (at most {MAX_TIMEOUT_S:.0f})",
        ),
    ] = None
    rdzv_timeout: Annotated[
        Number | None,
        Field(
            gt=0,
            le=MAX_TIMEOUT_S,
            description=f"a number of seconds > 0 (at most {MAX_TIMEOUT_S:.0f})",
        ),
    ] = None
    ft_replicas: PositiveInt | None = None  # replica groups (train/launch/ft.py)
    ft_group: NonNegativeInt | None = None
    ft_lighthouse: StrictStr | None = None

    @_model_validator(mode="after")
    def _check(self) -> LaunchSchema:
        parts = self.nnodes.split(":")
        try:
            counts = [int(x) for x in parts]
        except ValueError:
            counts = []
        if not 1 <= len(counts) <= 2 or min(counts) < 1 or counts[0] > counts[-1]:
            raise ValueError(
                f"--nnodes must be a number of nodes >= 1 or MIN:MAX (1 <= MIN <= MAX), got "
                f"{self.nnodes!r}"
            )
        if self.node_rank >= counts[-1]:
            raise ValueError(
                f"--node-rank {self.node_rank} must be below --nnodes {self.nnodes}: number the "
                f"nodes 0..{counts[-1] - 1}; node 0 is the one at --rdzv-endpoint"
            )
        if self.resume_fallback and not self.resume:
            raise ValueError("--resume-fallback goes with --resume")
        if self.allow_data_change and not self.resume:
            raise ValueError("--allow-data-change goes with --resume")
        if self.config is not None and not self.config.strip():
            raise ValueError("--config is empty; name a YAML file")
        check_ft_launch(self.ft_replicas, self.ft_group, self.ft_lighthouse)
        return self


@dataclasses.dataclass
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
    rdzv_conf: str | None = None
    max_restarts: int = 0
    resume_fallback: bool = False
    allow_data_change: bool = False  # --resume on a changed corpus (train/identity.py)
    timeout: float | None = None
    rdzv_timeout: float | None = (
        None  # seconds the nodes wait for each other (train/launch/nodes.py)
    )
    dry_run: bool = False
    ft_replicas: int | None = None  # fault tolerance across replica groups (train/launch/ft.py)
    ft_group: int | None = None
    ft_lighthouse: str | None = None
    notes: list[str] = field(default_factory=list)
    # set by prepare(): this launch's id (in launch.json and every rank's status) and its lock
    launch_id: str = ""
    lock: Path | None = None
    # set by prepare() on many nodes: the settings the nodes compare (train/launch/rendezvous.py), and
    # node 0's run-folder files as they were before this launch wrote them (restored when the
    # nodes refuse to start: see launch.undo_writes)
    node_settings: dict[str, Any] | None = None
    replaced: dict[str, bytes | None] = field(default_factory=dict)
    agent_report: Path | None = None  # set by launch(): the agent's refusal, if any


def check_launch(options: dict[str, Any]) -> None:
    """Validate ``layershard train``'s launch options (a dict of the flags given)."""
    given = {k: v for k, v in options.items() if k in _FIELDS_LAUNCH}
    try:
        LaunchSchema(**given)
    except ValidationError as e:
        raise ConfigError(one_line(e, field_infos(LaunchSchema), given, prefix="--")) from None


def config_keys() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def field_infos(cls: Any) -> dict[str, Any]:
    return dict(cls.__pydantic_fields__)


_FIELDS_LAUNCH = {f.name for f in dataclasses.fields(LaunchSchema)}


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run YAML; keys may use dashes or underscores. Unknown keys are an error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; check the --config path")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(
            f"config file {p} is not valid YAML ({' '.join(str(e).split())}); fix the syntax"
        ) from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p} must hold a mapping of key: value")
    out = {}
    valid = config_keys()
    for key, value in raw.items():
        k = str(key).replace("-", "_")
        if k not in valid:
            raise ConfigError(unknown_key(str(key), valid, str(p)))
        out[k] = value
    return out


def resolve(*layers: dict[str, Any]) -> TrainConfig:
    """Merge override layers (later wins) over the defaults and validate against the schema."""
    merged: dict[str, Any] = {}
    for layer in layers:
        overrides = merged.get("model_overrides")
        merged.update(layer)
        if isinstance(overrides, dict) and isinstance(layer.get("model_overrides"), dict):
            # --model-override dim=256 changes one field of the file's (or the run's) overrides
            merged["model_overrides"] = {**overrides, **layer["model_overrides"]}
    try:
        return TrainConfig(**merged)
    except ValidationError as e:
        raise ConfigError(one_line(e, field_infos(TrainConfig), merged)) from None


def check_world(cfg: TrainConfig, world: int | None, local_world: int | None) -> None:
    """The strategy's rules that need the world size (``shard()``'s own checks)."""
    try:
        check_strategy_options(
            cfg.strategy, world, cfg.shard_size, cfg.reshard_after_forward, local_world=local_world
        )
    except ValueError as e:
        raise ConfigError(
            f"strategy options: {_flags(str(e))}; change --nproc-per-node / --nnodes or the "
            "strategy options"
        ) from None
    if world is not None:
        try:
            check_parallel_world(cfg, world)  # tp, ep and cp divide it
            check_replica(cfg, world, local_world)
        except ValueError as e:
            raise ConfigError(str(e)) from None


def grad_accum_for(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank, checking that the global batch divides.
    Under ``tp`` (``cp``) the ranks of a TP (CP) group share their batch: the data is split
    ``world / tp`` (``world / cp``) ways."""
    world_size = max(1, world_size // group_size(cfg))
    per_micro = cfg.seq_len * cfg.micro_batch * world_size
    if cfg.batch_tokens is None:
        return cfg.grad_accum or 1
    if cfg.batch_tokens % per_micro:
        raise ConfigError(
            f"batch_tokens={cfg.batch_tokens} is not a multiple of seq_len*micro_batch*world_size"
            f" = {cfg.seq_len}*{cfg.micro_batch}*{world_size} = {per_micro}; "
            f"use --batch-tokens {max(1, round(cfg.batch_tokens / per_micro)) * per_micro} "
            "or change --micro-batch / the number of ranks"
        )
    ga = cfg.batch_tokens // per_micro
    if cfg.grad_accum is not None and cfg.grad_accum != ga:
        raise ConfigError(
            f"grad_accum={cfg.grad_accum} contradicts batch_tokens={cfg.batch_tokens} "
            f"(which gives {ga} on {world_size} ranks); pass only one of them"
        )
    return ga


def dump_yaml(cfg: TrainConfig, path: str | Path, extra: dict[str, Any] | None = None) -> None:
    data = cfg.to_dict()
    if extra:
        data = {**data, "_resolved": extra}
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))


def read_recorded(path: str | Path) -> dict[str, Any]:
    """The settings a run folder recorded in ``config.yaml`` (without the informational
    ``_resolved`` block), as plain YAML: a file that is not (a python tag, a syntax error, not a
    mapping) is a ``ConfigError`` in one line, and nothing in it is run."""
    p = Path(path)
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())
        raise ConfigError(
            f"{p} is not a run config layershard wrote: it is not plain YAML ({first[:200]}); "
            "restore the run's own config.yaml, or start a new run"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ConfigError(f"cannot read {p}: {e}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"{p} must hold a mapping of key: value, like the config.yaml of a run")
    raw.pop("_resolved", None)
    return raw


def resume_layers(recorded: dict[str, Any], *layers: dict[str, Any]) -> list[str]:
    """A resumed run keeps its recorded options unless a flag changes them. A flag that changes
    ``strategy`` also drops what the recorded one had and the new one does not take (hybrid's
    ``shard_size``, full's ``reshard_after_forward``), one that changes ``precision`` from
    fp16 drops its ``loss_scale``, and ``--cp 1`` drops the ``cp_mode``, unless the same flags
    give it again (then the schema says what is wrong). Changes ``recorded``; returns a note per
    key dropped."""
    given: dict[str, Any] = {}
    for layer in layers:
        given.update(layer)
    notes = []
    precision = given.get("precision")
    if precision not in (None, "fp16") and recorded.get("precision") == "fp16":
        scale = recorded.get("loss_scale", _DEFAULT_LOSS_SCALE)
        if "loss_scale" not in given and scale != _DEFAULT_LOSS_SCALE:
            recorded.pop("loss_scale")
            notes.append(f"--precision {precision}: the run's loss_scale {scale:g} (of fp16) "
                         "does not apply and is dropped")  # fmt: skip
    mode = recorded.get("cp_mode", "ring")
    if given.get("cp") == 1 and mode != "ring" and "cp_mode" not in given:  # (only with cp > 1)
        recorded.pop("cp_mode")
        notes.append(f"--cp 1: the run's cp_mode {mode} (of context parallelism) is dropped")
    new = given.get("strategy")
    if new is None or new == recorded.get("strategy", "full"):
        return notes
    dropped = []
    old = recorded.get("strategy", "full")
    if new != "hybrid" and recorded.get("shard_size") is not None and "shard_size" not in given:
        dropped.append(f"shard_size {recorded.pop('shard_size')} (of {old})")
    ras = recorded.get("reshard_after_forward", True)
    if new != "full" and ras is not True and "reshard_after_forward" not in given:
        recorded.pop("reshard_after_forward")
        dropped.append(f"reshard_after_forward {ras} (of {old})")
    return notes + [
        f"--strategy {new}: the run's {n} does not apply to {new} and is dropped" for n in dropped
    ]


def read_run_config(path: str | Path) -> TrainConfig:
    """The config a run folder recorded (ignoring the informational ``_resolved`` block)."""
    return resolve(read_recorded(path))


def resolved_strategy(cfg: TrainConfig, world: int | None, local_world: int) -> dict[str, Any]:
    """What ``ls.shard`` will do with the config's strategy options, for the run's record."""
    out: dict[str, Any] = {"strategy": cfg.strategy}
    if cfg.strategy == "hybrid":
        out["shard_size"] = cfg.shard_size or local_world
    return out
