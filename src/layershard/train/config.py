"""The resolved configuration of a training run: defaults < YAML file < command-line flags.

Every field of ``TrainConfig`` is a YAML key and a ``--flag`` (underscores become dashes). The
run folder records the resolved config as ``config.yaml``; a resumed run starts from it.
"""

from __future__ import annotations

import difflib
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import yaml


class ConfigError(ValueError):
    """A problem the user can fix; reported as one line, exit code 2."""


@dataclass
class TrainConfig:
    # --- model --------------------------------------------------------------------------------
    model: str = "tiny"  # a layershard.models preset (an architecture, not weights)
    model_overrides: dict[str, Any] = field(default_factory=dict)  # e.g. {dim: 256}
    hf_config: str | None = None  # a transformers config.json (or its folder): random init
    init_from: str | None = None  # a folder with HF config.json + *.safetensors: fine-tuning
    tokenizer: str | None = None  # tokenizer.json or a folder with one; None: train a BPE
    vocab_size: int = 4096  # size of the BPE trained when no tokenizer is given
    # --- data ---------------------------------------------------------------------------------
    task: str = "pretrain"  # pretrain | sft
    data: list[str] = field(default_factory=list)  # files/folders; empty: Python's stdlib
    text_key: str = "text"  # the field holding text in JSONL / datasets records
    val_fraction: float = 0.05  # share of files (or records) held out for validation
    max_files: int | None = None  # use only the first N files (sorted): quick experiments
    sft_packing: str = "pack"  # pack | pad
    # --- batch --------------------------------------------------------------------------------
    seq_len: int = 256
    micro_batch: int = 8  # sequences per rank per forward/backward
    grad_accum: int | None = None  # micro-batches per step; derived from batch_tokens if unset
    batch_tokens: int | None = None  # global tokens per optimizer step
    # --- optimization -------------------------------------------------------------------------
    optimizer: str = "adamw"  # adamw | muon (ls.optim.Muon: Muon for 2-D block weights)
    steps: int = 150
    lr: float = 3e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    weight_decay: float = 0.1
    no_decay: list[str] = field(default_factory=lambda: ["*norm*", "*bias", "*embed*"])
    beta1: float = 0.9
    beta2: float = 0.95
    grad_clip: float = 1.0  # 0 disables clipping (the norm is still logged)
    # --- execution ----------------------------------------------------------------------------
    precision: str = "auto"  # auto (bf16 on GPU, fp32 on CPU) | fp32 | bf16
    activation_checkpointing: int = 0  # number of blocks to recompute in backward
    loss_chunks: int = 0  # the chunked loss (ls.chunked_loss) in K chunks; 0: the plain loss
    seed: int = 0
    # --- evaluation, checkpoints, output ------------------------------------------------------
    eval_interval: int = 50  # steps; 0 disables periodic evaluation (start and end remain)
    eval_sequences: int = 64  # validation sequences per evaluation (whole global batches)
    checkpoint_interval: int = 0  # steps; 0: only the final checkpoint
    async_checkpoint: bool = False  # write periodic checkpoints in the background (DCP async_save)
    max_bad_steps: int = 3  # non-finite steps (loss or gradient norm) in a row before stopping
    log_interval: int = 1
    run_dir: str | None = None  # default runs/<name or timestamp>
    name: str | None = None
    sample_tokens: int = 120  # tokens generated from sample_prompt at the end
    sample_prompt: str = "def "

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


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
)

CHOICES = {
    "task": ("pretrain", "sft"),
    "sft_packing": ("pack", "pad"),
    "precision": ("auto", "fp32", "bf16"),
    "optimizer": ("adamw", "muon"),
}


def config_keys() -> list[str]:
    return [f.name for f in fields(TrainConfig)]


def _unknown_key_error(key: str, where: str) -> ConfigError:
    keys = config_keys()
    close = difflib.get_close_matches(key, keys, n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return ConfigError(
        f"unknown config key '{key}' in {where}; {hint}valid keys: {', '.join(keys)}"
    )


def load_yaml(path: str | Path) -> dict[str, Any]:
    """Read a run YAML; keys may use dashes or underscores. Unknown keys are an error."""
    p = Path(path)
    if not p.is_file():
        raise ConfigError(f"config file {p} does not exist; check the --config path")
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"config file {p} is not valid YAML ({e}); fix the syntax") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"config file {p} must hold a mapping of key: value")
    out = {}
    valid = set(config_keys())
    for key, value in raw.items():
        k = str(key).replace("-", "_")
        if k not in valid:
            raise _unknown_key_error(str(key), str(p))
        out[k] = value
    return out


def resolve(*layers: dict[str, Any]) -> TrainConfig:
    """Merge override layers (later wins) over the defaults and check types and choices."""
    merged: dict[str, Any] = {}
    for layer in layers:
        merged.update(layer)
    types = {f.name: f for f in fields(TrainConfig)}
    for k in merged:
        if k not in types:
            raise _unknown_key_error(k, "the overrides")
    cfg = TrainConfig(**merged)
    _coerce(cfg)
    validate(cfg)
    return cfg


def _coerce(cfg: TrainConfig) -> None:
    """Normalize what YAML and flags give (one data path as a str, ints for floats) and refuse
    values of the wrong type, naming the key."""
    if isinstance(cfg.data, str):
        cfg.data = [cfg.data]
    if isinstance(cfg.no_decay, str):
        cfg.no_decay = [cfg.no_decay]
    for f in fields(TrainConfig):
        v = getattr(cfg, f.name)
        if f.type in ("float",):
            if isinstance(v, bool) or not isinstance(v, int | float | str):
                raise ConfigError(f"{f.name} must be a number, got {v!r}")
            try:
                setattr(cfg, f.name, float(v))
            except ValueError:
                raise ConfigError(f"{f.name} must be a number, got {v!r}") from None
        elif f.type in ("int", "int | None"):
            if v is None and f.type == "int | None":
                continue
            if isinstance(v, bool) or not isinstance(v, int | float) or int(v) != v:
                raise ConfigError(f"{f.name} must be an integer, got {v!r}")
            setattr(cfg, f.name, int(v))
        elif f.type == "bool":
            if not isinstance(v, bool):
                raise ConfigError(f"{f.name} must be true or false, got {v!r}")
        elif f.type in ("str", "str | None"):
            if v is None and f.type == "str | None":
                continue
            if not isinstance(v, str):
                raise ConfigError(f"{f.name} must be a string, got {v!r}")
        elif f.type == "list[str]":
            if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
                raise ConfigError(f"{f.name} must be a list of strings, got {v!r}")
        elif f.name == "model_overrides" and not isinstance(v, dict):
            raise ConfigError("model_overrides must be a mapping such as {dim: 256, n_layers: 6}")


def validate(cfg: TrainConfig) -> None:
    """Checks that need nothing but the config itself."""
    for name, choices in CHOICES.items():
        if getattr(cfg, name) not in choices:
            raise ConfigError(
                f"{name} must be one of {', '.join(choices)}, got {getattr(cfg, name)!r}"
            )
    positive = ("seq_len", "micro_batch", "steps", "vocab_size", "log_interval")
    for name in positive:
        if getattr(cfg, name) < 1:
            raise ConfigError(f"{name} must be at least 1, got {getattr(cfg, name)}")
    for name in ("grad_accum", "batch_tokens"):
        v = getattr(cfg, name)
        if v is not None and v < 1:
            raise ConfigError(f"{name} must be at least 1, got {v}")
    if not 0.0 <= cfg.val_fraction < 1.0:
        raise ConfigError(f"val_fraction must be in [0, 1), got {cfg.val_fraction}")
    for name in ("lr", "weight_decay", "grad_clip"):
        v = getattr(cfg, name)
        if not math.isfinite(v) or v < 0:
            raise ConfigError(f"{name} must be a finite number >= 0, got {v}")
    for name in ("beta1", "beta2"):
        v = getattr(cfg, name)
        if not 0.0 <= v < 1.0:  # also refuses nan
            raise ConfigError(f"{name} must be in [0, 1), got {v} (AdamW's betas)")
    if not 0.0 <= cfg.min_lr_ratio <= 1.0:
        raise ConfigError(f"min_lr_ratio must be in [0, 1], got {cfg.min_lr_ratio}")
    non_negative = (
        "warmup_steps",
        "activation_checkpointing",
        "loss_chunks",
        "eval_interval",
        "eval_sequences",
        "checkpoint_interval",
        "sample_tokens",
    )
    for name in non_negative:
        if getattr(cfg, name) < 0:
            raise ConfigError(f"{name} must be at least 0, got {getattr(cfg, name)}")
    if cfg.max_bad_steps < 1:
        raise ConfigError(f"max_bad_steps must be at least 1, got {cfg.max_bad_steps}")
    if cfg.max_files is not None and cfg.max_files < 1:
        raise ConfigError(f"max_files must be at least 1, got {cfg.max_files}")
    if cfg.loss_chunks and cfg.task == "sft":
        # the loop runs a micro-batch with no response token backward through its logits,
        # which the chunked loss never materializes
        raise ConfigError("loss_chunks is not supported with task sft yet; use loss_chunks 0")
    if cfg.hf_config and cfg.init_from:
        raise ConfigError(
            "--hf-config and --init-from both choose the model; pass one "
            "(--init-from already reads the config.json next to the weights)"
        )
    if cfg.vocab_size < 260 and not cfg.tokenizer:
        raise ConfigError(
            f"vocab_size={cfg.vocab_size} is too small for a byte-level BPE (256 bytes + "
            "special tokens); use at least 260"
        )


def grad_accum_for(cfg: TrainConfig, world_size: int) -> int:
    """Micro-batches per optimizer step on each rank, checking that the global batch divides."""
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


def read_run_config(path: str | Path) -> TrainConfig:
    """The config a run folder recorded (ignoring the informational ``_resolved`` block)."""
    raw = yaml.safe_load(Path(path).read_text()) or {}
    raw.pop("_resolved", None)
    return resolve(raw)
