"""Shared pieces of the parity tests: a tiny Llama, deterministic global batches, the
single-process reference and comparisons. Every rank computes the reference itself on the whole
global batch (deterministic, so identical on every rank) and trains its shard on its part."""

from __future__ import annotations

import copy

import torch
import torch.distributed as dist

from layershard.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)
GLOBAL_BATCH, SEQ, STEPS, LR = 8, 16, 10, 1e-2
LOSS_RTOL = 1e-5

# Parameter tolerance, calibrated on torch DDP (gloo, fp32, 10 AdamW steps at lr 1e-2 on this tiny
# Llama; test_parity.py measures DDP next to layershard in every run and checks it stays below too).
# Measured 2026-11-22 on CPU (torch 2.13): DDP's max |param - reference| was 7.06e-06 at world
# size 2 and 2.10e-05 at world size 4 (layershard: the same figures); Adam divides by sqrt(v) and so
# amplifies reduction-order noise. The tolerance leaves ~40% headroom over DDP's worst case.
PARAM_TOL = 3e-5


def tiny_llama(seed: int = 0, **overrides) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))


def batches(n: int, vocab: int = TINY["vocab_size"], seed: int = 1, batch: int = GLOBAL_BATCH):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (batch, SEQ), generator=g) for _ in range(n)]


def local(batch: torch.Tensor, rank: int, world: int) -> torch.Tensor:
    b = batch.shape[0] // world
    return batch[rank * b : (rank + 1) * b]


def global_mean(t: torch.Tensor) -> float:
    t = t.detach().clone().float()
    dist.all_reduce(t)
    return t.item() / dist.get_world_size()


def lm_loss(model, x: torch.Tensor) -> torch.Tensor:
    return model(x, labels=x).loss


def max_diff(full_sd: dict, reference: torch.nn.Module) -> tuple[float, str]:
    """Largest |ours - reference| over parameters, and the parameter where it occurs."""
    worst, where = 0.0, ""
    for name, p in reference.named_parameters():
        d = (full_sd[name].float() - p.detach().float()).abs().max().item()
        if d > worst:
            worst, where = d, name
    return worst, where


def clone(model):
    return copy.deepcopy(model)
