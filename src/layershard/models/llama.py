"""A readable Llama-style causal language model.

RMSNorm, rotary position embeddings (RoPE), a SwiGLU MLP and grouped-query attention through
``F.scaled_dot_product_attention``. Parameter names and the RoPE convention (``rotate_half``)
match Hugging Face's ``LlamaForCausalLM`` up to a renaming (see ``HF_NAMES``), so HF weights
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
from torch import Tensor, nn

from layershard.loss import ChunkedLossModel, chunked_causal_lm_loss
from layershard.models.moe import MoE, Routing, balance_loss
from layershard.parallel.attention import causal_attention
from layershard.parallel.attention import native_gqa as _native_gqa  # noqa: F401 (tests, plan)
from layershard.parallel.attention import probe_cpu_flash_gqa as _probe_cpu_flash_gqa  # noqa: F401
from layershard.parallel.context import ContextParallel, document_attention

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
    # Mixture of experts (models/moe.py): n_experts > 0 replaces every block's MLP by top_k of
    # n_experts SwiGLU experts of moe_ffn_dim; the load-balancing loss, times aux_loss_coef, is
    # added to the loss (as HF Mixtral's router_aux_loss_coef).
    n_experts: int = 0
    top_k: int = 2
    moe_ffn_dim: int = 0
    aux_loss_coef: float = 0.01

    def __post_init__(self) -> None:
        if self.n_experts and not (0 < self.top_k <= self.n_experts and self.moe_ffn_dim > 0):
            raise ValueError(
                f"a mixture of experts needs 0 < top_k <= n_experts and moe_ffn_dim > 0 "
                f"(got n_experts={self.n_experts}, top_k={self.top_k}, "
                f"moe_ffn_dim={self.moe_ffn_dim})"
            )
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
    # A Qwen3-MoE-like shape small enough for 2 CPU cores: 8 experts, top-2, ~37M parameters
    # (~16M active per token) with an 8192 vocab.
    "moe": LlamaConfig(
        vocab_size=8192, dim=384, n_layers=6, n_heads=6, n_kv_heads=2, ffn_dim=0,
        max_seq_len=1024, n_experts=8, top_k=2, moe_ffn_dim=512,
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

    def forward(
        self, x: Tensor, labels: Tensor | None = None, chunks: int = 0,
        num: Tensor | None = None, shifted: bool = False,
    ) -> Tensor:  # fmt: skip
        """The logits, or with ``labels`` (``shifted`` or not) and ``chunks`` the chunked loss
        (``layershard.loss``; sum / ``num`` if given) without them, in this one call: under
        ``ls.shard`` the weight is gathered once, and labels shifted here, as plan/ counts."""
        if labels is None or not chunks:
            return super().forward(x)
        return chunked_causal_lm_loss(x, self.weight, labels, chunks, num_items_in_batch=num,
                                      shift_labels=labels if shifted else None)  # fmt: skip


class _RMSNormFunction(torch.autograd.Function):
    """``(x * rsqrt(mean(x^2) + eps)).to(x.dtype) * weight`` with the normalization in fp32, op
    for op as autograd would run it, but saving only what its backward needs: ``x`` itself and
    the fp32 ``rsqrt`` (c d + 4 bytes a token, c = bytes of x's dtype). Autograd on the same
    expression saves an fp32 copy of ``x`` and the normalized ``x`` as well ((4 + c) d + 4;
    in fp32 ``x`` is its own copy). The backward recomputes the normalized ``x`` bit for bit and
    applies autograd's own formulas (``mul``, ``rsqrt``, ``mean``, ``pow`` and the casts) in
    autograd's order, so the gradients are today's up to the order in which the engine adds the
    contributions to ``x`` (fp32 rounding)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
        ctx.save_for_backward(x, weight, rstd)
        return (xf * rstd).to(x.dtype) * weight

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        x, weight, rstd = ctx.saved_tensors
        xf = x.float()
        grad_x = grad_w = None
        if ctx.needs_input_grad[1]:  # mul's backward, reduced over the broadcast dims, cast
            xn = (xf * rstd).to(x.dtype)
            grad_w = grad * xn
            lead = tuple(range(grad.dim() - weight.dim()))  # autograd's sum_to(weight.shape)
            if lead:
                grad_w = grad_w.sum(lead, keepdim=True).view(weight.shape)
            grad_w = grad_w.to(weight.dtype)
        if ctx.needs_input_grad[0]:
            g = (grad * weight).to(x.dtype).float()  # mul's backward, then the two casts'
            grad_rstd = (g * xf).sum(-1, keepdim=True)  # xf * rstd
            grad_var = -0.5 * grad_rstd * rstd.pow(3)  # rsqrt: -0.5 grad result^3
            grad_sq = grad_var.expand_as(xf) / x.shape[-1]  # mean
            grad_x = (g * rstd + grad_sq * (2.0 * xf)).to(x.dtype)  # + pow(2)'s: grad 2 x
        return grad_x, grad_w, None


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.empty(dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalize in fp32 for stability, then return to the activation dtype; the Function
        # keeps no fp32 copy of x for backward (see _RMSNormFunction).
        return _RMSNormFunction.apply(x, self.weight, self.eps)


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
        even = torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float32)
        inv_freq = 1.0 / (self.theta ** (even / self.head_dim))
        t = torch.arange(self.max_seq_len, device=device, dtype=torch.float32)
        freqs = torch.outer(t, inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)  # HF's rotate_half layout
        self.cos.copy_(emb.cos())
        self.sin.copy_(emb.sin())

    def forward(
        self, seq_len: int, dtype: torch.dtype, position_ids: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if position_ids is None:
            return self.cos[:seq_len].to(dtype), self.sin[:seq_len].to(dtype)
        pos = position_ids.unsqueeze(-2)  # each row's own positions: (batch, 1, seq, head_dim)
        return self.cos[pos].to(dtype), self.sin[pos].to(dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` of shape (batch, heads, seq, head_dim) by position."""
    return x * cos + _rotate_half(x) * sin


# --- the transformer -------------------------------------------------------------------------


class Attention(nn.Module):
    context_parallel: ContextParallel | None = None  # the model's (LlamaForCausalLM's doc)

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        out_std = 0.02 / math.sqrt(2 * cfg.n_layers)  # GPT-2: scale residual projections
        self.wq = Linear(cfg.dim, cfg.n_heads * cfg.head_dim)
        self.wk = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wv = Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim)
        self.wo = Linear(cfg.n_heads * cfg.head_dim, cfg.dim, std=out_std)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, doc_ids: Tensor | None = None) -> Tensor:
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        if self.context_parallel is not None:
            y = self.context_parallel.attention(q, k, v, doc_ids)
        elif doc_ids is not None:
            y = document_attention(q, k, v, doc_ids)
        else:
            y = causal_attention(q, k, v)
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
    """Attention and a feed-forward, each after a norm and added to the residual stream. With
    experts (``cfg.n_experts``) the feed-forward is a ``MoE`` and the block returns its output
    and its ``Routing``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.mlp: nn.Module
        if cfg.n_experts:
            self.mlp = MoE(cfg.dim, cfg.moe_ffn_dim, cfg.n_experts, cfg.top_k, cfg.n_layers)
        else:
            self.mlp = MLP(cfg)

    def forward(
        self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, doc_ids: Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, Routing]:
        x = x + self.attn(self.attn_norm(x), cos, sin, doc_ids)
        out = self.mlp(self.mlp_norm(x))
        if isinstance(out, tuple):
            return x + out[0], out[1]
        return x + out


@dataclass
class CausalLMOutput:
    logits: torch.Tensor | None  # None under the chunked loss when labels are given
    loss: torch.Tensor | None = None  # with experts: the LM loss + aux_loss_coef * aux_loss
    aux_loss: torch.Tensor | None = None  # with experts: the load-balancing loss


class LlamaForCausalLM(nn.Module, ChunkedLossModel):
    """``loss_chunks`` (0: off; set by ``layershard.chunked_loss``): with labels, the LM head
    computes the loss in that many chunks of tokens and the output's ``logits`` are None."""

    context_parallel: ContextParallel | None = None  # ls.parallelize(cp=): parallel/context

    def __init__(self, cfg: LlamaConfig, loss_chunks: int = 0) -> None:
        super().__init__()
        self.config = cfg
        self.loss_chunks = loss_chunks
        self.embed = Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layers)])
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.lm_head = LMHead(cfg.dim, cfg.vocab_size, tied=cfg.tie_embeddings)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed.weight
        self.rotary = Rotary(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)

    def forward(
        self, input_ids: Tensor, labels: Tensor | None = None, *, position_ids: Tensor | None = None,
        shift_labels: Tensor | None = None, document_ids: Tensor | None = None,
    ) -> CausalLMOutput:  # fmt: skip
        """``labels`` unshifted, or ``shift_labels`` shifted over the whole sequence; RoPE's
        ``position_ids`` (default ``0 .. seq - 1``); ``document_ids``: attend within equal ids
        (packed documents). Under context parallelism this rank's part (``context_batch``)."""
        cp, t = self.context_parallel, input_ids.shape[1]
        if cp is not None:
            cp.check_inputs(position_ids, labels)
        if t * (cp.size if cp else 1) > self.config.max_seq_len:
            raise ValueError(f"sequence length {t} exceeds max_seq_len={self.config.max_seq_len}")
        x = self.embed(input_ids)
        # Compute follows the weights' dtype: bf16 weights give bf16 activations and RoPE tables.
        cos, sin = self.rotary(t, x.dtype, position_ids)
        routing: Routing | None = None
        for layer in self.layers:
            out = layer(x, cos, sin, document_ids)
            if isinstance(out, tuple):
                x, r = out
                routing = r if routing is None else routing + r
            else:
                x = out
        x = self.norm(x)
        aux = None if routing is None else balance_loss(routing, None if cp is None else cp.group)
        logits, loss = None, None
        targets, shifted = (labels, False) if shift_labels is None else (shift_labels, True)
        num = None if cp is None or targets is None else cp.loss_divisor(targets)
        if targets is not None and self.loss_chunks:
            loss = self.lm_head(x, targets, self.loss_chunks, num, shifted)
        else:
            logits = self.lm_head(x)
            if targets is not None:
                loss = causal_lm_loss(logits, targets, num, shifted)
        if loss is not None and aux is not None:
            loss = loss + self.config.aux_loss_coef * aux
        return CausalLMOutput(logits=logits, loss=loss, aux_loss=aux)

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
            out = self(context).logits
            assert out is not None  # no labels: the logits
            logits = out[:, -1, :].float()
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


def causal_lm_loss(
    logits: Tensor, labels: Tensor, num: Tensor | None = None, shifted: bool = False
) -> Tensor:
    """Mean next-token cross-entropy in fp32: logits at position i predict labels at i + 1
    (at i if ``shifted``); labels -100 are ignored (HF's convention); with ``num`` the sum / num.

    The labels are shifted, not the logits (each row's last position gets -100, as HF's
    ``ForCausalLMLoss`` does), so cross-entropy reads the logits where they lie: fp32 logits are
    not copied (slicing off the last position and flattening would copy them when the batch has
    more than one row), and bf16 logits are copied once, by the cast to fp32, which is freed as
    soon as log-softmax has run. What stays for backward is the fp32 log-softmax."""
    targets = (labels if shifted else F.pad(labels[:, 1:], (0, 1), value=-100)).flatten()
    flat, how = logits.flatten(0, 1).float(), "mean" if num is None else "sum"
    loss = F.cross_entropy(flat, targets, ignore_index=-100, reduction=how)
    return loss if num is None else loss / num


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
    # with experts: HF MixtralForCausalLM's
    "layers.{i}.mlp.gate.weight": "model.layers.{i}.mlp.gate.weight",
    "layers.{i}.mlp.experts.gate_up_proj": "model.layers.{i}.mlp.experts.gate_up_proj",
    "layers.{i}.mlp.experts.down_proj": "model.layers.{i}.mlp.experts.down_proj",
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


def hf_llama_config(cfg: LlamaConfig) -> transformers.PretrainedConfig:
    """The equivalent ``transformers.LlamaConfig`` (same shapes, RoPE, eps and tying); with
    experts, the equivalent ``transformers.MixtralConfig`` (no sliding window, no router jitter,
    the router's logits returned so that its loss includes the load-balancing term)."""
    import transformers

    common: dict[str, Any] = dict(
        vocab_size=cfg.vocab_size,
        hidden_size=cfg.dim,
        num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads,
        num_key_value_heads=cfg.n_kv_heads,
        head_dim=cfg.head_dim,
        max_position_embeddings=cfg.max_seq_len,
        # transformers 5 declares no rope_theta (it takes it through **kwargs into
        # rope_parameters); 4.x declares it
        rope_theta=cfg.rope_theta,
        rms_norm_eps=cfg.norm_eps,
        tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu",
    )
    if cfg.n_experts:
        return transformers.MixtralConfig(
            **common,
            intermediate_size=cfg.moe_ffn_dim,
            num_local_experts=cfg.n_experts,
            num_experts_per_tok=cfg.top_k,
            router_aux_loss_coef=cfg.aux_loss_coef,
            output_router_logits=True,
            router_jitter_noise=0.0,
            sliding_window=None,
        )
    return transformers.LlamaConfig(
        **common, intermediate_size=cfg.ffn_dim, attention_bias=False, mlp_bias=False
    )
