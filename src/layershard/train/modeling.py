"""Choosing and building the model: a layershard preset, any transformers config (random
init), or local HF safetensors weights (fine-tuning, read by ``layershard.load_hf``)."""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

import layershard as ls
from layershard.loss import chunked_loss
from layershard.models import PRESETS, LlamaConfig, LlamaForCausalLM, build_config
from layershard.models.hf import load_hf_config
from layershard.train.config import ConfigError, TrainConfig
from layershard.train.parallel import (
    check_cp_model,
    check_cp_routing,
    check_split_shapes,
    check_tp_model,
)


def round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _hf_config(path: str) -> Any:
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    # transformers' own warnings about a broken config would come before our one line
    hf_logging.set_verbosity_error()
    try:
        return load_hf_config(path)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    except Exception as e:  # noqa: BLE001 - e.g. huggingface_hub's strict field validation
        first = " ".join(str(e).split())[:200]
        raise ConfigError(f"{path}: not a config transformers can read ({first})") from None
    finally:
        hf_logging.set_verbosity(verbosity)


def model_spec(cfg: TrainConfig, vocab_size: int | None) -> tuple[str, Any, int]:
    """(kind, config, max sequence length) where kind is 'preset' or 'hf'. ``vocab_size`` is the
    tokenizer's (None when not known yet); a preset's vocabulary follows the tokenizer."""
    where = cfg.hf_config or cfg.init_from
    if where:
        hf = _hf_config(where)
        vocab = getattr(hf, "vocab_size", None)
        if isinstance(vocab, bool) or not isinstance(vocab, int) or vocab < 1:
            raise ConfigError(
                f"{where}: the config has no vocabulary (vocab_size={vocab!r}); a causal language "
                "model needs one: set vocab_size in config.json"
            )
        if vocab_size is not None and hf.vocab_size < vocab_size and not cfg.init_from:
            hf.vocab_size = round_up(vocab_size)  # random init: room for every token
        _check_vocab(hf.vocab_size, vocab_size, where)
        max_len = getattr(hf, "max_position_embeddings", None) or getattr(hf, "n_positions", 0)
        return "hf", hf, int(max_len or 1 << 30)
    overrides = dict(cfg.model_overrides)
    fields_ = {f.name: f.type for f in dataclasses.fields(LlamaConfig)}
    for key, value in overrides.items():
        want = fields_.get(key)
        ok = {
            "int": isinstance(value, int) and not isinstance(value, bool) and value > 0,
            "float": isinstance(value, int | float)
            and not isinstance(value, bool)
            and math.isfinite(value),
            "bool": isinstance(value, bool),
        }.get(str(want), True)  # unknown keys: build_config names the valid ones
        if not ok:
            kind = {
                "int": "a positive integer",
                "float": "a finite number",
                "bool": "true or false",
            }
            raise ConfigError(
                f"--model-override {key}={value!r}: {key} must be {kind[str(want)]}, e.g. "
                f"--model-override {key}={getattr(build_config(cfg.model), key, 1)}"
                if cfg.model in PRESETS
                else f"--model-override {key}={value!r}: {key} must be {kind[str(want)]}"
            )
    if vocab_size is not None:
        overrides.setdefault("vocab_size", round_up(vocab_size))
    try:
        lc = build_config(cfg.model, **overrides)
    except (ValueError, TypeError) as e:
        raise ConfigError(f"--model {cfg.model}: {e}") from e
    _check_vocab(lc.vocab_size, vocab_size, f"--model {cfg.model}")
    return "preset", lc, lc.max_seq_len


def _check_vocab(model_vocab: int, tokenizer_vocab: int | None, where: str) -> None:
    """Every token id must have a row in the embedding: a smaller model vocabulary would fail
    in the ranks' first forward (an index error), after the run folder is written."""
    if tokenizer_vocab is not None and model_vocab < tokenizer_vocab:
        raise ConfigError(
            f"{where}: the model's vocabulary ({model_vocab} tokens) is smaller than the "
            f"tokenizer's ({tokenizer_vocab}); raise vocab_size (at least {tokenizer_vocab}) or "
            "use the model's own tokenizer"
        )


def n_layers(kind: str, spec: Any) -> int | None:
    if kind == "preset":
        return spec.n_layers
    for name in ("num_hidden_layers", "n_layer", "num_layers"):
        value = getattr(spec, name, None)
        if isinstance(value, int):
            return value
    return None


def check_model(cfg: TrainConfig, kind: str, spec: Any) -> None:
    """Checks of the model that need its config: activation checkpointing within its blocks, a
    causal language model (HF), weights present for --init-from."""
    try:
        check_tp_model(cfg, kind, spec)
        check_cp_model(cfg, kind, spec)
        if cfg.tp > 1 or cfg.ep > 1 or (cfg.cp > 1 and kind == "hf"):
            meta = build_model(kind, spec, cfg, meta=True)
            check_split_shapes(cfg, kind, meta)
            if kind == "hf":
                check_cp_routing(cfg, meta)
    except ValueError as e:
        raise ConfigError(str(e)) from None
    layers = n_layers(kind, spec)
    if layers is not None and cfg.activation_checkpointing > layers:
        raise ConfigError(
            f"activation_checkpointing={cfg.activation_checkpointing} is more than the model's "
            f"{layers} blocks; use 0 to {layers}"
        )
    if kind != "hf":
        return
    where = cfg.hf_config or cfg.init_from
    assert where, "model_spec() gives kind 'hf' only for --hf-config or --init-from"
    check_causal_lm(spec, where)
    if cfg.loss_chunks:  # refused architectures (logits transformed before the loss) say so now
        import transformers

        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(spec, trust_remote_code=False)
        try:
            chunked_loss(model, cfg.loss_chunks)
        except (TypeError, ValueError) as e:
            raise ConfigError(f"--loss-chunks {cfg.loss_chunks}: {e}") from None
    if cfg.init_from:
        folder = Path(cfg.init_from)
        if not any(folder.glob("*.safetensors")):
            other = sorted(p.name for p in folder.glob("*.bin")) + sorted(
                p.name for p in folder.glob("*.pt")
            )
            extra = (
                f" (it has {', '.join(other[:3])}: layershard reads safetensors only, which run "
                "no code when loaded; convert them with transformers' save_pretrained)"
                if other
                else ""
            )
            raise ConfigError(
                f"--init-from {folder} has no *.safetensors weights{extra}; for a random init "
                "of that architecture use --hf-config"
            )


def check_causal_lm(hf: Any, where: str) -> None:
    """Refuse HF configs that are not causal language models: no causal-LM class in
    transformers, or attention that sees later tokens (BERT-like encoders unless is_decoder).

    The second is a behaviour, so it is tested as one: a 1-layer, 32-wide copy of the
    architecture runs on 8 tokens twice, with token 6 changed; a causal model's outputs at
    positions 0-5 cannot change. Architectures that cannot be shrunk that way skip this test."""
    import transformers
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(hf, "model_type", None)
    if model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        raise ConfigError(
            f"{where}: model_type {model_type!r} is not a causal language model (transformers "
            "has no AutoModelForCausalLM for it); layershard train trains next-token prediction"
        )
    small = copy.deepcopy(hf)
    shrink = {
        "num_hidden_layers": 1, "n_layer": 1, "num_layers": 1, "hidden_size": 32, "n_embd": 32,
        "d_model": 32, "num_attention_heads": 2, "n_head": 2, "num_key_value_heads": 2,
        "intermediate_size": 64, "n_inner": 64, "ffn_dim": 64, "head_dim": 16, "vocab_size": 64,
    }  # fmt: skip
    for name, value in shrink.items():
        if isinstance(getattr(small, name, None), int):
            setattr(small, name, value)
    for name in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(getattr(small, name, None), int) and getattr(small, name) >= 64:
            setattr(small, name, 0)
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # its advice on is_decoder comes as our one line
    try:
        torch.manual_seed(0)
        model = transformers.AutoModelForCausalLM.from_config(small).float().eval()
        ids = torch.randint(1, 64, (1, 8), generator=torch.Generator().manual_seed(0))
        changed = ids.clone()
        changed[0, 6] = ids[0, 6] % 63 + 1
        with torch.no_grad():
            a = model(input_ids=ids).logits[0, :6]
            b = model(input_ids=changed).logits[0, :6]
    except Exception:  # noqa: BLE001 - an architecture this shrinking does not fit: not tested
        return
    finally:
        hf_logging.set_verbosity(verbosity)
    if not torch.allclose(a, b, rtol=0, atol=1e-5):
        raise ConfigError(
            f"{where}: {model_type} attends to later tokens (bidirectional attention), so it "
            'cannot learn next-token prediction; set "is_decoder": true in config.json if the '
            "architecture supports it, or use a decoder-only model"
        )


def count_params(kind: str, spec: Any) -> int:
    """Parameters of the model, counted on the meta device (no memory)."""
    if kind == "preset":
        with torch.device("meta"):
            return sum(p.numel() for p in LlamaForCausalLM(spec).parameters())
    import transformers

    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(spec)
    return sum(p.numel() for p in model.parameters())


def check_seq_len(cfg: TrainConfig, max_len: int) -> None:
    if cfg.seq_len > max_len:
        raise ConfigError(
            f"seq_len={cfg.seq_len} exceeds the model's maximum sequence length {max_len}; "
            f"lower --seq-len or raise it (--model-override max_seq_len={cfg.seq_len} for presets)"
        )


META_PARAMS = 1e9  # a preset this large starts on the meta device


def starts_on_meta(kind: str, spec: Any) -> bool:
    """Does ``layershard train`` build the model on the meta device? Presets of ``META_PARAMS``
    parameters or more do, with or without ``--tp``: ``shard()`` materializes one unit at a time
    and each rank keeps only its slice (its TP part's slice under ``--tp``), the weights of an
    eager build from the same seed (layershard.models' init contract)."""
    return kind == "preset" and count_params("preset", spec) >= META_PARAMS


def build_model(kind: str, spec: Any, cfg: TrainConfig, meta: bool = False) -> nn.Module:
    """The model in fp32 on the CPU (or on the meta device), initialized from ``cfg.seed``.
    ``--init-from`` weights are not read here: ``layershard.load_hf`` reads them after sharding,
    each rank only its slices."""
    torch.manual_seed(cfg.seed)  # identical init on every rank
    ctx = torch.device("meta") if meta else torch.device("cpu")
    if kind == "preset":
        with ctx:
            return LlamaForCausalLM(spec, loss_chunks=cfg.loss_chunks)
    import transformers

    with ctx:
        # (no dtype= here: it would put a torch.dtype into the config, which is not JSON)
        model = transformers.AutoModelForCausalLM.from_config(spec, trust_remote_code=False)
    return chunked_loss(model.float(), cfg.loss_chunks) if cfg.loss_chunks else model.float()


def shard_options(cfg: TrainConfig, precision: str, device: torch.device) -> dict[str, Any]:
    """``ls.shard`` keyword arguments for a run's config (the CLI and the Python API agree by
    construction: the run's options are these, and nothing else)."""
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(precision)
    gather = {"fp8": torch.float8_e4m3fn, "int8": torch.int8}.get(cfg.gather_dtype)
    reduce = torch.bfloat16 if cfg.reduce_dtype == "bf16" else torch.float32
    mp = None
    if dtype is not None or gather is not None or reduce != torch.float32:
        mp = ls.MixedPrecision(dtype or torch.float32, reduce, gather)
    return {
        "mixed_precision": mp,
        "activation_checkpointing": cfg.activation_checkpointing,
        "blocks_per_unit": cfg.blocks_per_unit,
        "device": device if device.type != "cpu" else None,
        "strategy": cfg.strategy,
        "shard_size": cfg.shard_size,
        "reshard_after_forward": cfg.reshard_after_forward,
        "offload": ls.CPUOffload() if cfg.offload else None,
        "compile": cfg.compile,
    }


def flops_per_token(kind: str, spec: Any, n_params: int, seq_len: int) -> float:
    """Training FLOPs per token: 6 per parameter plus attention's 12 * layers * seq_len * width
    (the PaLM appendix's estimate, as the planner's model FLOPs)."""
    layers = getattr(spec, "n_layers", None) or getattr(spec, "num_hidden_layers", 0) or 0
    width = getattr(spec, "dim", None) or getattr(spec, "hidden_size", 0) or 0
    return 6.0 * n_params + 12.0 * layers * seq_len * width


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak FLOP/s when known: ``LAYERSHARD_PEAK_TFLOPS``, else the
    planner's table by GPU name (H100, H200, A100); None on CPU (no MFU is logged)."""
    if os.environ.get("LAYERSHARD_PEAK_TFLOPS"):
        return float(os.environ["LAYERSHARD_PEAK_TFLOPS"]) * 1e12
    if device.type != "cuda":
        return None
    from layershard.plan.hardware import GPUS

    name = torch.cuda.get_device_name(device).lower().replace(" ", "")
    for key, gpu in GPUS.items():
        if key.split("-")[0] in name and (key.endswith("40g") == ("40gb" in name)):
            return gpu.peak_flops
    return None
