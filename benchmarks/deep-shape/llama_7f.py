"""A readable Llama-style causal language model.

RMSNorm, rotary position embeddings (RoPE), a SwiGLU MLP and grouped-query attention through
``F.scaled_dot_product_attention``. Parameter names and the RoPE convention (``rotate_half``)
match Hugging Face's ``LlamaForCausalLM`` up to a renaming (see ``HF_NAME_MAP``), so HF weights
load by name.

Init contract: every module that owns parameters initializes them in its own
``reset_parameters()``, which its ``__init__`` calls, and nothing else draws random numbers.
Building the model on the meta device, moving it with ``to_empty`` and calling
``reset_parameters()`` module by module in ``model.modules()`` order therefore reproduces the
eager initialization bitwise from the same seed.
"""

from __future__ import annotations

import math
import re
from dataclasses import asdict, dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # transformers is optional; imported lazily in hf_llama_config()
    import transformers


@dataclass
class LlamaConfig:
    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} must be divisible by n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(
                f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}"
            )

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


# Architectures, not weights. The Llama presets follow the published configs; RoPE scaling of
# Llama 3.x is not modelled, and max_seq_len is kept modest so the RoPE cache stays small.
PRESETS: dict[str, LlamaConfig] = {
    # Fast on 2 CPU cores: ~2.9M parameters with an 8192 vocab, ~1.8M with 4096.
    "tiny": LlamaConfig(
        vocab_size=8192, dim=128, n_layers=4, n_heads=4, n_kv_heads=2, ffn_dim=384, max_seq_len=512
    ),
    # ~36M parameters with an 8192 vocab.
    "small": LlamaConfig(
        vocab_size=8192, dim=512, n_layers=8, n_heads=8, n_kv_heads=8, ffn_dim=1536,
        max_seq_len=1024,
    ),
    # Llama 3.2 1B.
    "llama-1b": LlamaConfig(
        vocab_size=128256, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim=8192,
        max_seq_len=8192, rope_theta=500000.0, norm_eps=1e-5, tie_embeddings=True,
    ),
    # Llama 2 7B / 13B / 70B.
    "llama-7b": LlamaConfig(
        vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=32, ffn_dim=11008,
        max_seq_len=4096,
    ),
    "llama-13b": LlamaConfig(
        vocab_size=32000, dim=5120, n_layers=40, n_heads=40, n_kv_heads=40, ffn_dim=13824,
        max_seq_len=4096,
    ),
    "llama-70b": LlamaConfig(
        vocab_size=32000, dim=8192, n_layers=80, n_heads=64, n_kv_heads=8, ffn_dim=28672,
        max_seq_len=4096,
    ),
}  # fmt: skip


def build_config(name: str, **overrides: Any) -> LlamaConfig:
    """A copy of preset ``name`` with ``overrides`` applied (e.g. ``vocab_size=...``)."""
    if name not in PRESETS:
        raise ValueError(f"unknown model preset {name!r}; valid names: {', '.join(PRESETS)}")
    valid = {f.name for f in fields(LlamaConfig)}
    unknown = sorted(set(overrides) - valid)
    if unknown:
        raise ValueError(
            f"unknown LlamaConfig field(s) {', '.join(unknown)}; valid: {', '.join(sorted(valid))}"
        )
    return replace(PRESETS[name], **overrides)


# --- layers with a GPT-style init ------------------------------------------------------------


class Linear(nn.Linear):
    """Bias-free Linear initialized N(0, std) instead of PyTorch's kaiming-uniform default."""

    def __init__(self, in_features: int, out_features: int, std: float = 0.02) -> None:
        self.std = std  # set before nn.Linear.__init__, which calls reset_parameters()
        super().__init__(in_features, out_features, bias=False)

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=self.std)


class Embedding(nn.Embedding):
    """Embedding initialized N(0, 0.02) (PyTorch's default N(0, 1) is far too large for tying)."""

    def reset_parameters(self) -> None:
        nn.init.normal_(self.weight, mean=0.0, std=0.02)


class LMHead(Linear):
    """The output projection. When tied, its weight is the embedding's, which the embedding
    initializes, so its own reset_parameters must not draw random numbers or overwrite it."""

    def __init__(self, dim: int, vocab_size: int, tied: bool) -> None:
        self.tied = tied
        super().__init__(dim, vocab_size)

    def reset_parameters(self) -> None:
        if not self.tied:
            super().reset_parameters()


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability, then return to the activation dtype.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return xf.to(x.dtype) * self.weight


class Rotary(nn.Module):
    """cos/sin tables for RoPE as fp32, non-persistent buffers: they are derived data, so they stay
    out of checkpoints, and reset_parameters() recomputes them after a meta-device build."""

    cos: torch.Tensor  # buffers (registered in __init__)
    sin: torch.Tensor

    def __init__(self, head_dim: int, max_seq_len: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.max_seq_len, self.theta = head_dim, max_seq_len, theta
        self.register_buffer("cos", torch.empty(max_seq_len, head_dim), persistent=False)
        self.register_buffer("sin", torch.empty(max_seq_len, head_dim), persistent=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        device = self.cos.device
        inv_freq = 1.0 / (
            self.theta
            ** (
                torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
                / self.head_dim
            )
        )
        t = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # HF's rotate_half layout
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(self, seq_len: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by position."""
    return x * cos + _rotate_half(x) * sin


# --- the transformer -------------------------------------------------------------------------


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual projections
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, std=out_std)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.n_kv_heads != self.n_heads:  # grouped-query: each kv head serves n_rep q heads
            n_rep = self.n_heads // self.n_kv_heads
            k = k.repeat_interleave(n_rep, dim=1)
            v = v.repeat_interleave(n_rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = Linear(cfg.dim, cfg.ffn_dim)
        self.w2 = Linear(cfg.ffn_dim, cfg.dim, std=0.02 / math.sqrt(2 * cfg.n_layers))
        self.w3 = Linear(cfg.dim, cfg.ffn_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


@dataclass
class CausalLMOutput:
    logits: torch.Tensor
    loss: torch.Tensor | None = None


class LlamaForCausalLM(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, tied=cfg.tie_embeddings)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(
        self, input_ids: torch.Tensor, labels: torch.Tensor | None = None
    ) -> CausalLMOutput:
        t = input_ids.shape[1]
        if t > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(input_ids)
        # Compute follows the weights' dtype: bf16 weights give bf16 activations and RoPE tables.
        cos, sin = self.rotary(t, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if labels is not None:
            loss = causal_lm_loss(logits, labels)
        return CausalLMOutput(logits=logits, loss=loss)

    def num_params(self, non_embedding: bool = False) -> int:
        """Unique parameters (a tied weight counts once); optionally without the embedding."""
        n = sum(p.numel() for p in self.parameters())
        if non_embedding:
            n -= self.embed.weight.numel()
        return n

    @torch.no_grad()
    def generate(
        self,
        input_ids: torch.Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
    ) -> torch.Tensor:
        """Sample ``max_new_tokens`` tokens after ``input_ids`` (batch, seq); no KV cache, the
        whole (cropped) context is re-run for every token. ``temperature=0`` is greedy."""
        ids = input_ids
        for _ in range(max_new_tokens):
            context = ids[:, -self.config.max_seq_len :]
            logits = self(context).logits[:, -1, :].float()
            if temperature <= 0:
                next_id = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                next_id = torch.multinomial(torch.softmax(logits, dim=-1), num_samples=1)
            ids = torch.cat([ids, next_id], dim=1)
        return ids


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross-entropy in fp32: logits at position i predict labels at i + 1;
    labels equal to -100 are ignored (the HF convention)."""
    shift_logits = logits[:, :-1].float()
    shift_labels = labels[:, 1:]
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        shift_labels.reshape(-1),
        ignore_index=-100,
    )


# --- Hugging Face interop --------------------------------------------------------------------

# Our parameter names -> HF LlamaForCausalLM's; "{i}" stands for the layer index.
HF_NAMES: dict[str, str] = {
    "embed.weight": "model.embed_tokens.weight",
    "layers.{i}.attn_norm.weight": "model.layers.{i}.input_layernorm.weight",
    "layers.{i}.mlp_norm.weight": "model.layers.{i}.post_attention_layernorm.weight",
    "layers.{i}.attn.wq.weight": "model.layers.{i}.self_attn.q_proj.weight",
    "layers.{i}.attn.wk.weight": "model.layers.{i}.self_attn.k_proj.weight",
    "layers.{i}.attn.wv.weight": "model.layers.{i}.self_attn.v_proj.weight",
    "layers.{i}.attn.wo.weight": "model.layers.{i}.self_attn.o_proj.weight",
    "layers.{i}.mlp.w1.weight": "model.layers.{i}.mlp.gate_proj.weight",
    "layers.{i}.mlp.w3.weight": "model.layers.{i}.mlp.up_proj.weight",
    "layers.{i}.mlp.w2.weight": "model.layers.{i}.mlp.down_proj.weight",
    "norm.weight": "model.norm.weight",
    "lm_head.weight": "lm_head.weight",
}


def _rename(name: str, table: dict[str, str]) -> str:
    layer = re.search(r"\.(\d+)\.", name)
    key = name.replace(f".{layer.group(1)}.", ".{i}.", 1) if layer else name
    if key not in table:
        raise KeyError(f"no counterpart for parameter name {name!r}")
    return table[key].replace("{i}", layer.group(1)) if layer else table[key]


def to_hf_name(name: str) -> str:
    """Our parameter name -> the HF LlamaForCausalLM name."""
    return _rename(name, HF_NAMES)


def from_hf_name(name: str) -> str:
    """An HF LlamaForCausalLM parameter name -> ours."""
    return _rename(name, {hf: ours for ours, hf in HF_NAMES.items()})


def hf_llama_config(cfg: LlamaConfig) -> transformers.LlamaConfig:
    """The equivalent ``transformers.LlamaConfig`` (same shapes, RoPE, eps and tying)."""
    import transformers

    return transformers.LlamaConfig(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        intermediate_size=cfg.ffn_dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        # transformers 5 declares no rope_theta (it takes it through **kwargs into
        # rope_parameters); 4.x declares it, hence unused-ignore too
        rope_theta=cfg.rope_theta,  # type: ignore[call-arg, unused-ignore]
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        attention_bias=False,
        mlp_bias=False,
        hidden_act="silu",
    )
