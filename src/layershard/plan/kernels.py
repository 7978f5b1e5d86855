"""Compute time from the shapes: each GEMM, the attention kernel and the element-wise work.

**GEMMs** (m x k times k x n, 2 m n k FLOPs) follow a roofline with tile and wave
quantization: the output is cut into tiles (128 x 256, else 128 x 128 or 64 x 128, each a
little slower, ``small_tile``), the tiles run in waves of one tile per SM (``sms``), a tile
costs ``k + k0`` steps of its inner loop (``k0``: its prologue and epilogue), and a small grid
may split k (split-K) at the cost of writing and summing the partial products; the fastest of
these, bounded below by reading and writing the operands at the HBM bandwidth, plus a fixed
``launch`` per GEMM:

    t = waves x 2 Tm Tn (k / split + k0) / (peak / sms x emax x tile_eff) + launch

``emax``, ``k0``, ``launch`` and ``small_tile`` are fitted to bf16 matmuls timed on an H100
(``benchmarks/plan/accuracy/h100/gemm.json``: 343 shapes m, n, k in 256..16384 and the 450
GEMMs of the published runs' models; median error 3% on the latter). An A100 uses its own SM
count and its maximum achievable matmul rate relative to the H100's (``sources.KERNELS``).

**Attention** (FlashAttention-2 through ``F.scaled_dot_product_attention``, causal): forward
``2 s h hd`` FLOPs per token (the causal half of ``4 s h hd``), backward 2.5 x that
(FlashAttention's count: it recomputes the scores), at a fraction of peak that grows with the
sequence, ``e(s) = e_inf s / (s + s_half)`` (measured on an H100, ``attn.json``).

**Element-wise** work (norms, RoPE, activations, residual adds, the loss's softmax) moves
``bytes_per_token`` through HBM at ``hbm_eff`` of its bandwidth, but never takes less than a
floor per block (``ew_floor``), the host's time to launch that block's small kernels in eager
PyTorch: measured on an H100 as a block's time minus its GEMMs and attention
(``block.json``; 0.85 ms forward and 2.25 ms backward for a Llama block of ours, 0.1 / 0.25 ms
for a GPT block with fused LayerNorm and GELU).

Model FLOPs (what published MFU counts: ``6 N T + 12 L s h hd T``) stay as ``timing.model_flops``;
what is computed here is the time of the hardware work, recompute included.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from layershard.plan.model import ModelShape


@dataclass(frozen=True)
class KernelModel:
    """A GPU generation's kernel constants (values and sources: ``sources.KERNELS``)."""

    sms: int
    emax: float  # large-tile GEMM asymptote, fraction of the dense peak
    k0: float  # a tile's fixed cost, in inner-loop steps
    launch_s: float  # per GEMM
    small_tile: float  # 128 x 128 tiles' rate relative to 128 x 256 (64 x 128: its square)
    attn_fwd: tuple[float, float]  # (e_inf, s_half), head dim 128
    attn_fwd_bwd: tuple[float, float]
    attn_hd64: float  # rate of head dim 64 relative to 128
    hbm_eff: float  # element-wise kernels' fraction of the HBM bandwidth


def gemm_time(m: int, n: int, k: int, peak_flops: float, hbm_bps: float, km: KernelModel,
              elem_bytes: int = 2) -> float:  # fmt: skip
    """Seconds for one (m x k) @ (k x n) product (module docstring)."""
    if m <= 0 or n <= 0 or k <= 0:
        return 0.0
    per_sm = peak_flops / km.sms * km.emax
    floor = elem_bytes * (m * k + k * n + m * n) / hbm_bps
    best = math.inf
    for tm, tn, eff in ((128, 256, 1.0), (128, 128, km.small_tile), (64, 128, km.small_tile**2)):
        tiles = math.ceil(m / tm) * math.ceil(n / tn)
        for split in (1, 2, 4, 8):
            if split > 1 and tiles * split > 2 * km.sms:
                break
            waves = math.ceil(tiles * split / km.sms)
            t = waves * 2 * tm * tn * (math.ceil(k / split) + km.k0) / (per_sm * eff)
            if split > 1:  # the fp32 partial products, written and summed
                t += 4 * m * n * split / hbm_bps
            best = min(best, max(t, floor))
    return best + km.launch_s


def attention_time(tokens: int, seq: int, heads: int, hd: int, peak_flops: float,
                   km: KernelModel) -> tuple[float, float]:  # fmt: skip
    """(forward, backward) seconds of causal flash attention over ``tokens`` tokens in
    sequences of ``seq``."""
    f = 2.0 * seq * heads * hd * tokens  # causal forward FLOPs
    scale = 1.0 if hd >= 128 else km.attn_hd64
    ef = km.attn_fwd[0] * scale * seq / (seq + km.attn_fwd[1])
    efb = km.attn_fwd_bwd[0] * scale * seq / (seq + km.attn_fwd_bwd[1])
    fwd = f / (peak_flops * ef)
    both = 3.5 * f / (peak_flops * efb)
    return fwd, max(both - fwd, 1.5 * fwd)


# Element-wise bytes per token of one block's forward, in elements of the compute dtype, and
# the host's floor per block (forward, backward): sources.ELEMENTWISE
def elementwise_elems(shape: ModelShape) -> float:
    """Elements a block's element-wise kernels read and write per token in its forward
    (the backward moves twice as many): norms (read + write d each), residual adds (3 d each),
    the activation (Llama: silu and the product over f; GPT: GELU over f) and, for Llama,
    RoPE on q and k (read + write, twice)."""
    d, f = shape.dim, shape.ffn_dim
    qk = (shape.n_heads + shape.n_kv_heads) * shape.hd
    if shape.family == "gpt":
        return 4 * d + 6 * d + 2 * f
    if shape.moe:  # per routed token: its rows gathered and added back (2 d each), SwiGLU
        return 4 * d + 6 * d + 4 * qk + shape.top_k * (5 * shape.moe_ffn_dim + 4 * d)
    return 4 * d + 6 * d + 5 * f + 4 * qk


def linears(shape: ModelShape) -> list[tuple[str, int, int]]:
    """(name, out, in) of one block's linears that every token goes through, as the family's
    modules lay them out (a mixture of experts: attention and the router; see ``expert_linears``)."""
    d, h, kv, hd, f = shape.dim, shape.n_heads, shape.n_kv_heads, shape.hd, shape.ffn_dim
    if shape.family == "gpt":
        return [("qkv", (h + 2 * kv) * hd, d), ("o", d, h * hd), ("up", f, d), ("down", d, f)]
    attn = [("q", h * hd, d), ("k", kv * hd, d), ("v", kv * hd, d), ("o", d, h * hd)]
    if shape.moe:
        return [*attn, ("router", shape.n_experts, d)]
    return [*attn, ("gate", f, d), ("up", f, d), ("down", d, f)]


def expert_linears(shape: ModelShape) -> list[tuple[str, int, int]]:
    """(name, out, in) of one expert's linears (none without experts): each of the n_experts
    runs them on its share of the routed tokens, tokens x top_k / n_experts when balanced."""
    if not shape.moe:
        return []
    d, fe = shape.dim, shape.moe_ffn_dim
    return [("gate_up", 2 * fe, d), ("down", d, fe)]


@dataclass
class StageCompute:
    """One unit's compute per micro-batch, by kind (seconds): forward and backward."""

    fwd: dict[str, float]
    bwd: dict[str, float]

    @property
    def fwd_s(self) -> float:
        return sum(self.fwd.values())

    @property
    def bwd_s(self) -> float:
        return sum(self.bwd.values())


def block_compute(shape: ModelShape, tokens: int, seq: int, peak: float, hbm: float,
                  km: KernelModel, floors: tuple[float, float], c: int = 2,
                  recompute: bool = False) -> StageCompute:  # fmt: skip
    """A block's forward and backward (with its forward again when checkpointed, under
    ``recompute``) by kind: gemm, attention, elementwise, recompute."""
    g_f = sum(gemm_time(tokens, n, k, peak, hbm, km, c) for _, n, k in linears(shape))
    g_b = sum(
        gemm_time(tokens, k, n, peak, hbm, km, c) + gemm_time(n, k, tokens, peak, hbm, km, c)
        for _, n, k in linears(shape)
    )
    if (
        shape.moe and not shape.experts_apart
    ):  # each expert on its balanced share of the routed tokens
        rows = max(1, tokens * shape.top_k // shape.n_experts)
        for _, n, k in expert_linears(shape):
            g_f += shape.n_experts * gemm_time(rows, n, k, peak, hbm, km, c)
            g_b += shape.n_experts * (
                gemm_time(rows, k, n, peak, hbm, km, c) + gemm_time(n, k, rows, peak, hbm, km, c)
            )
    a_f, a_b = attention_time(tokens, seq, shape.n_heads, shape.hd, peak, km)
    ew = elementwise_elems(shape) * c * tokens / (hbm * km.hbm_eff)
    e_f, e_b = max(ew, floors[0]), max(2 * ew, floors[1])
    fwd = {"gemm": g_f, "attention": a_f, "elementwise": e_f}
    bwd = {"gemm": g_b, "attention": a_b, "elementwise": e_b}
    if recompute:
        bwd["recompute"] = g_f + a_f + e_f
    return StageCompute(fwd, bwd)


def head_compute(shape: ModelShape, tokens: int, peak: float, hbm: float, km: KernelModel,
                 c: int = 2, loss: str = "fp32", chunks: int = 0) -> StageCompute:  # fmt: skip
    """The LM head (one GEMM each way, two in backward) and its loss: the plain loss reads and
    writes the logits in fp32 about six times (cast, log-softmax, its backward, the cast back);
    the fused one twice in the compute dtype. The chunked loss computes the logits again."""
    v, d = shape.vocab_size, shape.dim
    g_f = gemm_time(tokens, v, d, peak, hbm, km, c)
    g_b = gemm_time(tokens, d, v, peak, hbm, km, c) + gemm_time(v, d, tokens, peak, hbm, km, c)
    per_tok = (2 * c * v) if loss == "fused" else (c + 4) * v * 3
    ew = per_tok * tokens / (hbm * km.hbm_eff)
    fwd = {"gemm": g_f, "loss": ew / 2}
    bwd = {"gemm": g_b, "loss": ew / 2}
    if chunks:
        bwd["recompute"] = g_f
    return StageCompute(fwd, bwd)
