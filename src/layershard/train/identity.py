"""A run keeps its identity across ``--resume``: its model, its corpus and its tokenizer.

A checkpoint's token ids mean what the run's tokenizer says, and its weights fit the run's model.
So before any rank starts, a resumed run is compared with what the run folder recorded:

- the model (the preset's or HF config after overrides, the tokenizer settings): a change is
  refused in one line, and since the refusal comes before anything is written, the run's
  ``config.yaml`` keeps the model it had and a plain ``--resume`` works next time;
- the corpus: the absolute path and fingerprint of every source file the last launch trained on
  (``launch.json``'s ``data.sources``, see ``fingerprint.corpus_change``) against what ``--data``
  gives now; a file edited, gone or added, or a relative path that resolves elsewhere from
  another folder, is refused unless ``--allow-data-change``, which continues on the new data;
- the tokenizer: a resumed run always tokenizes with the run's own ``tokenizer.json``, never a
  new BPE trained on changed data.

Paths are recorded absolute (``config.yaml``), so a resume from another folder reads the same
files.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path
from typing import Any

from layershard.train.config import ConfigError, TrainConfig, resolve
from layershard.train.data.tokenizer import TextTokenizer, load_tokenizer

# Keys that choose the model or the meaning of its token ids.
_MODEL_KEYS = ("model", "model_overrides", "hf_config", "init_from", "tokenizer", "vocab_size")
_PATH_KEYS = ("hf_config", "init_from", "tokenizer")


def _abs(p: str) -> str:
    return os.path.abspath(os.path.expanduser(p)) if p else p


def absolute_paths(cfg: TrainConfig) -> None:
    """Record every path of the config absolute: a resume from another folder reads the same
    files (a relative ``--data`` would otherwise resolve against wherever it runs)."""
    cfg.data = [_abs(d) for d in cfg.data]
    for key in _PATH_KEYS:
        v = getattr(cfg, key)
        if isinstance(v, str):
            setattr(cfg, key, _abs(v))


def _model_description(cfg: TrainConfig) -> dict[str, Any]:
    from layershard.train.modeling import model_spec

    kind, spec, _ = model_spec(cfg, None)
    if dataclasses.is_dataclass(spec) and not isinstance(spec, type):
        fields = dataclasses.asdict(spec)
    else:  # a transformers config
        fields = spec.to_dict()
        for noise in ("transformers_version", "_name_or_path", "name_or_path"):
            fields.pop(noise, None)
    return {"kind": kind, **fields, **{f"--{k.replace('_', '-')}": getattr(cfg, k)
                                       for k in ("tokenizer", "vocab_size")}}  # fmt: skip


def _model_change(was: TrainConfig, now: TrainConfig) -> str:
    """'' if ``now`` builds the model ``was`` built (with the same tokenizer settings), else the
    differences, e.g. ``n_layers 4 -> 2``."""
    if all(getattr(was, k) == getattr(now, k) for k in _MODEL_KEYS):
        return ""
    a, b = _model_description(was), _model_description(now)
    diff = [f"{k} {a.get(k)!r} -> {b.get(k)!r}" for k in {**a, **b} if a.get(k) != b.get(k)]
    return ", ".join(diff[:6]) + (f", ... ({len(diff)} in all)" if len(diff) > 6 else "")


def _state_change(was: TrainConfig, now: TrainConfig) -> str:
    """'' if ``now`` trains the state ``was`` checkpointed (the same trainable parameters and
    optimizer), else what differs, e.g. ``--optimizer muon instead of the run's adamw``."""
    if was.qlora != now.qlora:
        return (
            "--qlora trains LoRA adapters on a 4-bit base, the run trained every weight"
            if now.qlora
            else "--no-qlora trains every weight, the run trained --qlora adapters"
        )
    if now.qlora and was.lora_rank != now.lora_rank:
        return f"--lora-rank {now.lora_rank} instead of the run's {was.lora_rank}"
    if was.optimizer != now.optimizer:
        return f"--optimizer {now.optimizer} instead of the run's {was.optimizer}"
    return ""


def _recorded_sources(run_dir: Path) -> list[dict[str, Any]] | None:
    """The corpus the run's last launch trained on (absolute paths and fingerprints)."""
    try:
        launch = json.loads((run_dir / "launch.json").read_text())
        sources = launch["data"]["sources"]
    except (OSError, ValueError, KeyError, TypeError):
        return None
    ok = isinstance(sources, list) and all(isinstance(s, dict) and "path" in s for s in sources)
    return sources if ok else None


def check_resume(
    run_dir: Path, recorded: dict[str, Any], cfg: TrainConfig, allow_data_change: bool
) -> None:
    """Before launch: refuse a resumed run whose model or corpus is not the run's (one line);
    with ``allow_data_change`` a changed corpus is said in one line and accepted."""
    from layershard.train.data import fingerprint
    from layershard.train.data.sources import find_files

    try:
        was = resolve(recorded)
    except ConfigError as e:
        raise ConfigError(
            f"--resume: {run_dir}/config.yaml is not a valid run config: {e}"
        ) from None
    absolute_paths(was)
    change = _model_change(was, cfg)
    if change:
        raise ConfigError(
            f"--resume: the model differs from the run's ({change}); a run keeps its model and "
            "tokenizer: resume without the change (config.yaml is unchanged), or start a new run "
            "from its weights (--init-from an export: layershard checkpoint export "
            f"{run_dir}/checkpoints OUT)"
        )
    change = _state_change(was, cfg)
    if change:
        raise ConfigError(
            f"--resume: {change}, but the checkpoints hold the run's state; resume without the "
            "change (config.yaml is unchanged), or start a new run from its weights (--init-from "
            f"an export: layershard checkpoint export {run_dir}/checkpoints OUT)"
        )
    sources = _recorded_sources(run_dir)
    if sources is None:
        return  # a run folder of an older layershard: nothing recorded to compare with
    moved = fingerprint.corpus_change(sources, find_files(cfg))
    if moved is None:
        return
    if not allow_data_change:
        raise ConfigError(
            f"--resume: the corpus changed since the run's last launch: {moved}; resume on the "
            "same data (the run records absolute paths, so leave out --data), or pass "
            "--allow-data-change to continue on the new data with the run's own tokenizer"
        )
    print(
        f"layershard train: note: --allow-data-change: the corpus changed ({moved}); continuing "
        "on the new data with the run's own tokenizer",
        file=sys.stderr,
        flush=True,
    )


def run_tokenizer(run_dir: Path) -> TextTokenizer | None:
    """The tokenizer a resumed run must keep: its own ``tokenizer.json`` (None if absent)."""
    path = run_dir / "tokenizer.json"
    return load_tokenizer(path) if path.is_file() else None


def resume_note(run_dir: Path, chosen: Path, named_by_user: bool) -> str:
    """One line naming the checkpoint a ``--resume`` uses, and why when ``latest`` named
    another one (a deleted or incomplete checkpoint)."""
    from layershard.checkpoint import publish as pub

    if named_by_user:
        return f"layershard train: resuming from {chosen}"
    latest = run_dir / "checkpoints" / pub.LATEST
    named = latest.read_text().strip() if latest.is_file() else ""
    why = ""
    if named and named != chosen.name:
        target = latest.parent / named
        state = "does not exist" if not target.exists() else "is not a complete checkpoint"
        why = f" (checkpoints/latest names {named}, which {state}; took the newest complete one)"
    elif not named:
        why = " (no checkpoints/latest; took the newest complete one)"
    return f"layershard train: resuming from {chosen}{why}"
