"""Causal attention through torch's SDPA with grouped-query heads handled where the kernel
takes them exactly (``native_gqa``), and repeated where it does not: the one place the built-in
Llama (``models/llama.py``) and all-to-all context parallelism (``context/all_to_all.py``) pick
how k and v reach the kernel, so that both save the same bytes for backward."""

from __future__ import annotations

import functools
import warnings

import torch
import torch.nn.functional as F


def causal_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Causal SDPA of q (batch, heads, seq, head_dim) over k, v with ``heads / n_rep`` heads
    each (grouped-query attention: kv head j serves q heads j n_rep ... (j + 1) n_rep - 1).

    When the kernel SDPA picks handles the groups itself (``enable_gqa``) as exactly as the
    repeated heads, k and v are passed as they are, so autograd saves them with their own heads,
    not n_rep copies. Otherwise they are repeated first, as HF's ``repeat_kv`` does: for a kernel
    without grouped heads (memory-efficient attention, which fp32 gets on CUDA; CPU flash
    attention in older torch releases) ``enable_gqa`` would send SDPA to its math fallback, which
    keeps the whole seq x seq attention matrix; and CPU flash attention in a 16-bit dtype adds a
    kv head's gradient over its q heads less exactly than repeating does (see ``native_gqa``)."""
    n_rep = q.shape[1] // k.shape[1]
    if n_rep > 1:
        if native_gqa(q, k, v):
            return F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=scale, enable_gqa=True
            )
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale)


def native_gqa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether SDPA runs these grouped-query inputs in a fused kernel, exactly: flash attention
    (the only one before cuDNN that takes grouped heads, and the first in SDPA's order when it
    can run). CUDA flash attention (FlashAttention-2's flash_api) writes each q head's k/v
    gradient and sums them per kv head, as repeat_interleave's backward does (read in the
    source; not run on a GPU here). CPU flash attention's grouped k/v gradients in bf16 were
    measured 1.2-1.4x farther from fp64 than the repeated heads' (seq 256-512, head_dim 64-128;
    benchmarks/memory/activations/gqa_accuracy.txt) and moved a 10-step bf16 training run
    (tests/engine/test_features.py) twice as far from its reference: on CPU it is used in fp32 and fp64
    only, where it matches the repeated heads to fp32 rounding."""
    if q.device.type == "cuda":
        from torch.backends.cuda import SDPAParams, can_use_flash_attention

        # checks the flag sdpa_kernel() sets, dtype, head_dim, GPU and the inputs' strides
        return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, True, True))
    if q.device.type == "cpu":
        # CPU has flash and math only; under torch.compile the flag is not readable (assumed on)
        enabled = torch.compiler.is_compiling() or torch.backends.cuda.flash_sdp_enabled()
        exact = q.dtype in (torch.float32, torch.float64)
        return exact and enabled and cpu_flash_has_gqa()
    return False


@torch.compiler.assume_constant_result
def cpu_flash_has_gqa() -> bool:
    return probe_cpu_flash_gqa()


@functools.cache
def probe_cpu_flash_gqa() -> bool:
    """CPU flash attention takes grouped heads only in newer torch releases (pytorch#157893,
    2025; torch 2.13 here); in older ones ``enable_gqa`` sends SDPA to the math kernel. Ask the
    kernel once, on a tiny input, rather than keep a version table."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q, kv = torch.zeros(1, 2, 1, 8), torch.zeros(1, 1, 1, 8)
    try:
        with warnings.catch_warnings():  # "Flash attention kernel not used because: ..."
            warnings.simplefilter("ignore")
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    except RuntimeError:
        return False
    return True
