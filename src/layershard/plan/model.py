"""The model as the planner sees it: a Llama shape, its parameter counts, and layershard's units.

Parameter counts follow ``layershard.models.llama`` exactly (bias-free linears, RMSNorm weights,
SwiGLU MLP, grouped-query attention, optional tied embedding/LM head):

    per block:  attn_norm d  +  wq d*h*hd  +  wk, wv d*kv*hd each  +  wo h*hd*d
                +  mlp_norm d  +  w1, w3 d*f each  +  w2 f*d
    extras:     embedding V*d,  final norm d,  LM head V*d (absent when tied)

Units mirror ``layershard.engine.units.find_units``: one per block, one per top-level module outside the
blocks that owns parameters (embedding, final norm, LM head), and a *root unit* holding tied
parameters (the shared embedding/LM-head weight), which stays gathered for the whole step.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from layershard.engine.flat import layout


@dataclass(frozen=True)
class ModelShape:
    """The few numbers of a Llama-style model that memory and time depend on."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int = 4096
    tie_embeddings: bool = False
    head_dim: int | None = None  # dim // n_heads unless the config says otherwise
    name: str = "custom"
    # "llama": layershard's built-in Llama; "hf-llama": transformers' Llama-style blocks (same
    # parameters, more activations); "gpt": MPT-style GPT blocks (LayerNorm and linears with
    # biases, fused QKV, a GELU MLP of ffn_dim, learned positions of max_seq_len rows)
    family: str = "llama"
    # a mixture of experts (layershard's built-in `moe`, models/moe.py): every block's MLP is
    # n_experts SwiGLU experts of moe_ffn_dim, top_k of them per token, and a router
    n_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0
    # expert parallelism (plan/parallel.py): the experts are units of their own, so a block's
    # unit holds its attention, norms and router only
    experts_apart: bool = False
    # the config.json an --hf-config shape was read from: train's TP check reads it with
    # transformers (its TP plan is the architecture's, not in the file's numbers)
    hf_config: str | None = None

    @property
    def moe(self) -> bool:
        return self.n_experts > 0

    @property
    def gpt(self) -> bool:
        return self.family == "gpt"

    @property
    def hd(self) -> int:
        return self.head_dim if self.head_dim is not None else self.dim // self.n_heads

    # --- parameter counts ---------------------------------------------------------------------
    @property
    def block_params(self) -> int:
        return sum(self.block_param_numels)

    @property
    def block_param_numels(self) -> tuple[int, ...]:
        """A block's parameters in registration order (attn_norm, wq, wk, wv, wo, mlp_norm, w1,
        w2, w3; with experts the router, the experts' gate_up and down): the order of its flat
        layout."""
        d, f, hd = self.dim, self.ffn_dim, self.hd
        q, kv = d * self.n_heads * hd, d * self.n_kv_heads * hd
        if self.moe:
            e, fe = self.n_experts, self.moe_ffn_dim
            if self.experts_apart:
                return (d, q, kv, kv, q, d, e * d)
            return (d, q, kv, kv, q, d, e * d, e * 2 * fe * d, e * d * fe)
        if self.gpt:  # norm_1 (w, b), Wqkv (w, b), out_proj (w, b), norm_2, up, down
            qkv = (self.n_heads + 2 * self.n_kv_heads) * hd
            return (d, d, q + 2 * kv, qkv, q, d, d, d, d * f, f, f * d, d)
        return (d, q, kv, kv, q, d, d * f, f * d, d * f)

    @property
    def block_matmul_params(self) -> int:
        """Block parameters that are matmul weights (not norms, not biases) a token goes
        through: with experts, the router and its top_k experts only."""
        d, hd = self.dim, self.hd
        attn = d * (self.n_heads + 2 * self.n_kv_heads) * hd + self.n_heads * hd * d
        if self.moe:
            return attn + self.n_experts * d + self.top_k * 3 * d * self.moe_ffn_dim
        return attn + (2 if self.gpt else 3) * d * self.ffn_dim

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.dim

    @property
    def head_params(self) -> int:
        """LM head weight as a matmul (also when it is tied to the embedding)."""
        return self.vocab_size * self.dim

    @property
    def total_params(self) -> int:
        """Unique parameters (a tied weight counts once), as ``LlamaForCausalLM.num_params()``."""
        n = self.n_layers * self.block_params + self.embedding_params + self.final_norm_params
        n += self.pos_params
        return n + (0 if self.tie_embeddings else self.head_params)

    @property
    def final_norm_params(self) -> int:
        return 2 * self.dim if self.gpt else self.dim

    @property
    def pos_params(self) -> int:
        """Learned position embeddings (GPT family: one row per position)."""
        return self.max_seq_len * self.dim if self.gpt else 0

    @property
    def n_param_tensors(self) -> int:
        """Parameter tensors: 9 per block (2 norms, wq wk wv wo, w1 w2 w3), embed, norm, head
        (GPT family: 12 per block, positions, a norm with its bias)."""
        if self.gpt:
            return 12 * self.n_layers + 4 + (0 if self.tie_embeddings else 1)
        return 9 * self.n_layers + 2 + (0 if self.tie_embeddings else 1)

    @property
    def rope_buffer_numel(self) -> int:
        """Rotary's fp32 ``cos`` and ``sin`` tables, each (max_seq_len, head_dim); none for
        the GPT family (learned positions are parameters)."""
        return 0 if self.gpt else 2 * self.max_seq_len * self.hd

    @classmethod
    def from_config(cls, cfg: Any, name: str = "custom") -> ModelShape:
        """From a ``layershard.models.LlamaConfig`` (or anything with its attribute names)."""
        if isinstance(cfg, ModelShape):
            return cfg
        return cls(
            vocab_size=int(cfg.vocab_size),
            dim=int(cfg.dim),
            n_layers=int(cfg.n_layers),
            n_heads=int(cfg.n_heads),
            n_kv_heads=int(cfg.n_kv_heads),
            ffn_dim=int(cfg.ffn_dim),
            max_seq_len=int(cfg.max_seq_len),
            tie_embeddings=bool(cfg.tie_embeddings),
            head_dim=getattr(cfg, "head_dim", None),
            name=name,
            n_experts=int(getattr(cfg, "n_experts", 0)),
            top_k=int(getattr(cfg, "top_k", 0)) if getattr(cfg, "n_experts", 0) else 0,
            moe_ffn_dim=int(getattr(cfg, "moe_ffn_dim", 0)),
        )

    @classmethod
    def from_preset(cls, name: str) -> ModelShape:
        from layershard.models import build_config

        return cls.from_config(build_config(name), name=name)

    @classmethod
    def from_hf_config(cls, path: str | Path) -> ModelShape:
        """From a Hugging Face ``config.json`` (or a directory holding one); no transformers.
        Raises ``ValueError`` naming the file and what is wrong with it."""
        p = _config_file(Path(path))
        raw = _read_object(p)
        raw = raw.get("text_config", raw)  # multimodal wrappers keep the LM under text_config
        if not isinstance(raw, dict):
            raise ValueError(f"{p}: text_config must be an object, got {raw!r}")
        missing = [
            k
            for k in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
            if k not in raw
        ]
        if missing:
            raise ValueError(f"{p}: not a Llama-style config, missing {', '.join(missing)}")
        dim = _positive(raw, "hidden_size", p)
        heads = _positive(raw, "num_attention_heads", p)
        kv = _positive(raw, "num_key_value_heads", p, heads)
        if heads % kv:
            raise ValueError(
                f"{p}: num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}"
            )
        experts = _hf_experts(raw, p)
        return cls(
            vocab_size=_positive(raw, "vocab_size", p),
            dim=dim,
            n_layers=_positive(raw, "num_hidden_layers", p),
            n_heads=heads,
            n_kv_heads=kv,
            ffn_dim=0 if experts else _positive(raw, "intermediate_size", p, 4 * dim),
            max_seq_len=_positive(raw, "max_position_embeddings", p, 4096),
            tie_embeddings=_flag(raw, "tie_word_embeddings", p),
            head_dim=_positive(raw, "head_dim", p, None),
            name=str(raw.get("_name_or_path") or p.parent.name or "hf-config"),
            n_experts=experts.get("n_experts", 0),
            top_k=experts.get("top_k", 0),
            moe_ffn_dim=experts.get("moe_ffn_dim", 0),
            hf_config=str(p),
        )


def _config_file(p: Path) -> Path:
    """``p``, or the config.json in the folder ``p``."""
    fix = "pass a transformers config.json or its folder"
    if p.is_dir():
        if not (p / "config.json").is_file():
            raise ValueError(f"{p} has no config.json; {fix}")
        return p / "config.json"
    if not p.exists():
        raise ValueError(f"{p} does not exist; {fix}")
    return p


def _read_object(p: Path) -> dict:
    """The JSON object in ``p``: a config is a mapping of its fields."""
    fix = "point --hf-config at a transformers config.json (or its folder)"
    try:
        raw = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(
            f"{p}: is not valid JSON (line {e.lineno}, column {e.colno}: {e.msg}); {fix}"
        ) from None
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"{p}: cannot be read as text ({e}); {fix}") from None
    if not isinstance(raw, dict):
        kind = {list: "list", str: "string", int: "number", float: "number", bool: "boolean"}
        raise ValueError(f"{p}: holds a JSON {kind.get(type(raw), 'null')}, not an object; {fix}")
    return raw


_REQUIRED: Any = object()


def _positive(raw: dict, key: str, p: Path, default: Any = _REQUIRED) -> Any:
    """``raw[key]`` as a positive integer; ``default`` when absent or null (transformers' own
    default then applies)."""
    value = raw.get(key)
    if value is None and default is not _REQUIRED:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{p}: {key} must be a positive integer, got {value!r}")
    return value


def _flag(raw: dict, key: str, p: Path) -> bool:
    value = raw.get(key, False)
    if not isinstance(value, bool):
        raise ValueError(f"{p}: {key} must be true or false, got {value!r}")
    return value


def _hf_experts(raw: dict, p: Path) -> dict[str, int]:
    """A transformers MoE config's experts as ModelShape fields ({} for a dense one): Qwen3-MoE
    (num_experts or, as transformers 5 writes it, num_local_experts; num_experts_per_tok,
    moe_intermediate_size; every layer sparse) and Mixtral
    (num_local_experts, num_experts_per_tok, intermediate_size), planned as the built-in
    ``moe``'s blocks (routed SwiGLU experts and a router; their saved activations as ours)."""
    if raw.get("n_routed_experts"):
        raise ValueError(f"{p}: {_NO_EXPERTS}")
    key = "num_experts" if raw.get("num_experts") else "num_local_experts"  # transformers 5
    if not raw.get(key):
        return {}
    if raw.get("moe_intermediate_size"):  # Qwen3-MoE
        sparse = raw.get("decoder_sparse_step", 1) or 1
        if raw.get("mlp_only_layers") or sparse != 1:
            raise ValueError(
                f"{p}: dense layers among the MoE ones (mlp_only_layers, decoder_sparse_step="
                f"{sparse}) are not modelled: every layer must be a MoE layer"
            )
        return _experts(raw, p, key, "moe_intermediate_size")
    return _experts(raw, p, key, "intermediate_size")  # Mixtral


def _experts(raw: dict, p: Path, count: str, size: str) -> dict[str, int]:
    if not raw.get("num_experts_per_tok") or not raw.get(size):
        raise ValueError(f"{p}: a MoE config needs num_experts_per_tok and the experts' size")
    e, k = _positive(raw, count, p), _positive(raw, "num_experts_per_tok", p)
    if k > e:
        raise ValueError(f"{p}: num_experts_per_tok={k} is more than the {e} experts ({count})")
    return {"n_experts": e, "top_k": k, "moe_ffn_dim": _positive(raw, size, p)}


_NO_EXPERTS = (
    "layershard plan models Qwen3-MoE and Mixtral configs (routed experts of one size, every "
    "layer sparse), not DeepSeek's shared experts and dense first layers"
)


@dataclass(frozen=True)
class Unit:
    """A gather/reduce unit laid out as ``layershard.engine.flat`` lays it out: parameters of
    ``param_numels`` elements at aligned offsets, padded so that every rank's slice is equal and
    aligned."""

    name: str
    param_numels: tuple[int, ...]
    kind: str  # "block" | "extra" | "root"
    # False for an untied embedding: its backward needs the token ids, not the table (as
    # ``layershard.engine.units.backward_needs_weights``).
    needs_weights_in_backward: bool = True

    @property
    def persistent(self) -> bool:
        return self.kind == "root"

    @property
    def numel(self) -> int:
        """Parameters (without alignment gaps or padding)."""
        return sum(self.param_numels)

    def shard_numel(self, world_size: int) -> int:
        return _layout(self.param_numels, world_size)[2]

    def padded_numel(self, world_size: int) -> int:
        return self.shard_numel(world_size) * world_size

    def local_numel(self, world_size: int, rank: int) -> int:
        """Real (non-gap, non-padding) elements in ``rank``'s slice: what per-element optimizer
        state is kept for."""
        offsets, _, s = _layout(self.param_numels, world_size)
        lo, hi = rank * s, (rank + 1) * s
        return sum(max(0, min(o + n, hi) - max(o, lo)) for o, n in zip(offsets, self.param_numels))


@cache
def _layout(param_numels: tuple[int, ...], world_size: int) -> tuple:
    """``flat.layout`` (the planner asks for the same units' layouts many times)."""
    return layout(list(param_numels), world_size)


def units(shape: ModelShape, blocks_per_unit: int = 1) -> list[Unit]:
    """layershard's units in forward order (root unit first, as ``find_units`` lists it);
    ``blocks_per_unit`` K: each K consecutive blocks one unit, their parameters one flat group
    (``ls.shard(blocks_per_unit=K)``)."""
    return list(_units(shape, blocks_per_unit))


@cache
def _units(shape: ModelShape, k: int = 1) -> tuple[Unit, ...]:
    out: list[Unit] = []
    embed = (shape.embedding_params,)
    if shape.tie_embeddings:
        out.append(Unit("root (tied embed/lm_head)", embed, "root"))
    else:
        out.append(Unit("embed", embed, "extra", needs_weights_in_backward=False))
    if shape.pos_params:
        out.append(Unit("pos", (shape.pos_params,), "extra", needs_weights_in_backward=False))
    block = shape.block_param_numels
    for name, group in block_groups(shape.n_layers, k):
        out.append(Unit(name, block * len(group), "block"))
    norm = (shape.dim, shape.dim) if shape.gpt else (shape.dim,)
    out.append(Unit("norm", norm, "extra"))
    if not shape.tie_embeddings:
        out.append(Unit("lm_head", (shape.head_params,), "extra"))
    return tuple(out)


def block_groups(n_layers: int, k: int) -> list[tuple[str, range]]:
    """The blocks as units of ``k`` consecutive blocks: (unit name, block indices), named as
    ``find_units`` names them ("layers.0+layers.1")."""
    groups = [range(i, min(i + k, n_layers)) for i in range(0, n_layers, k)]
    return [("+".join(f"layers.{j}" for j in g), g) for g in groups]


def load_model(preset: str | None = None, hf_config: str | None = None) -> ModelShape:
    if hf_config:
        return ModelShape.from_hf_config(hf_config)
    return ModelShape.from_preset(preset or "llama-7b")
