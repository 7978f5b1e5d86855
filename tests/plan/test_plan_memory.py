"""The planner's peak memory against torch's MemTracker on CPU (issue 36): layershard's built-in
Llama (dense, and with experts at world size 1) and three transformers architectures built from
configs (Llama, Qwen2: the `hf-llama` family; GPT-2 with the fused tanh GELU: the `gpt` family),
bf16 compute, with and without activation checkpointing, at world sizes 1, 2 and 4 (gloo ranks,
one spawn per world size).

MemTracker follows every tensor a training step creates (parameters, optimizer state,
activations, temporaries); its peak over a steady-state step (forward, backward, AdamW) is
compared, on every rank, with the plan's peak (``peak_bytes``: the largest of the loss, the
backward and the optimizer step). The step holds the model's output through backward
(``out = model(...); out.loss.backward()``), as the plan assumes: a loop that drops it frees the
bf16 logits before the loss's backward (c V bytes a token less; 11% of this model's peak with
every block checkpointed). The tolerance is 10% (issue 36's target); what the plan leaves out is
small at these sizes: the gather buffers allocated before the step (MemTracker does not see
them; their bytes are in the plan), a few scalars, small temporaries in backward."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import pytest
import torch
from _dist import run_ranks

from layershard.plan import ModelShape, predict_memory
from layershard.plan.memory import (
    peak_bytes,
    predict_activations,
    released_between_passes,
    unit_grad_bytes,
)

V, D, L, H, KV, F, S, B = 512, 64, 3, 4, 2, 160, 64, 8
ARCHS = ("layershard-llama", "layershard-moe", "hf-llama", "hf-qwen2", "hf-gpt2")
# at world sizes 2 and 4 one architecture of each family (a spawn costs ~1 s a rank and each
# configuration a few more)
ARCHS_MULTI = ("layershard-llama", "hf-llama", "hf-gpt2")
WORLDS = (1, 2, 4)
TOLERANCE = 0.10
# Every sharded model of a rank lives until the rank exits (os._exit: no finalizers): one freed
# by the garbage collector destroys its groups collectively, at a moment that differs between
# the ranks, and a rank then waited minutes here for the others
_KEEP: list = []


def _build(arch: str) -> tuple[torch.nn.Module, ModelShape]:
    torch.manual_seed(0)
    if arch in ("layershard-llama", "layershard-moe"):
        from layershard.models import LlamaForCausalLM, build_config

        moe = dict(n_experts=4, top_k=2, moe_ffn_dim=F // 2) if arch == "layershard-moe" else {}
        cfg = build_config("tiny", vocab_size=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=KV,
                           ffn_dim=F, max_seq_len=S, **moe)  # fmt: skip
        return LlamaForCausalLM(cfg), ModelShape.from_config(cfg)
    import transformers

    if arch in ("hf-llama", "hf-qwen2"):
        conf = transformers.LlamaConfig if arch == "hf-llama" else transformers.Qwen2Config
        cls = transformers.LlamaForCausalLM if arch == "hf-llama" else transformers.Qwen2ForCausalLM
        c = conf(vocab_size=V, hidden_size=D, intermediate_size=F, num_hidden_layers=L,
                 num_attention_heads=H, num_key_value_heads=KV, max_position_embeddings=S,
                 tie_word_embeddings=False)  # fmt: skip
        c._attn_implementation = "sdpa"
        shape = ModelShape(vocab_size=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=KV, ffn_dim=F,
                           max_seq_len=S, family="hf-llama")  # fmt: skip
        return cls(c), shape
    c = transformers.GPT2Config(vocab_size=V, n_positions=S, n_embd=D, n_layer=L, n_head=H,
                                activation_function="gelu_pytorch_tanh", resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0,
                                eos_token_id=0)  # fmt: skip
    c._attn_implementation = "sdpa"
    shape = ModelShape(vocab_size=V, dim=D, n_layers=L, n_heads=H, n_kv_heads=H, ffn_dim=4 * D,
                       max_seq_len=S, tie_embeddings=True, family="gpt")  # fmt: skip
    return transformers.GPT2LMHeadModel(c), shape


def _measure(rank: int, world: int, out_dir: str) -> None:
    """Every arch and checkpointing on this rank: MemTracker's peak of the second step."""
    from torch.distributed._tools.mem_tracker import MemTracker

    import layershard as ls

    results = []
    for arch in ARCHS if world == 1 else ARCHS_MULTI:
        for ckpt in (0, L):
            model, shape = _build(arch)
            assert sum(p.numel() for p in model.parameters()) == shape.total_params or (
                arch == "hf-qwen2"  # + the q, k, v biases, which the family does not count
            )
            sm = ls.shard(model, mixed_precision=ls.MixedPrecision(torch.bfloat16, torch.float32),
                          activation_checkpointing=ckpt)  # fmt: skip
            opt = torch.optim.AdamW(sm.parameters(), lr=1e-4)
            g = torch.Generator().manual_seed(rank)
            x = torch.randint(0, V, (B, S), generator=g)

            def step(sm=sm, opt=opt, x=x) -> None:
                out = sm(x, labels=x)  # held through backward, as the plan assumes
                out.loss.backward()
                opt.step()
                opt.zero_grad(set_to_none=True)

            step()  # the optimizer state exists from here on
            tracker = MemTracker()
            tracker.track_external(sm, opt)
            with tracker:
                step()
            snap = tracker.get_tracker_snapshot("peak")
            peak = int(next(iter(snap.values()))["Total"])
            results.append({"arch": arch, "ckpt": ckpt, "rank": rank, "peak": peak})
            _KEEP.append((sm, opt))
    Path(out_dir, f"rank{rank}.json").write_text(json.dumps(results))


@pytest.fixture(scope="module")
def measured() -> dict[tuple[str, int, int, int], int]:
    out: dict[tuple[str, int, int, int], int] = {}
    for world in WORLDS:
        with tempfile.TemporaryDirectory() as tmp:
            run_ranks(_measure, world, tmp)
            for rank in range(world):
                for r in json.loads(Path(tmp, f"rank{rank}.json").read_text()):
                    out[(r["arch"], r["ckpt"], world, r["rank"])] = r["peak"]
    return out


def _planned(shape: ModelShape, ckpt: int, world: int, rank: int) -> int:
    mem = predict_memory(shape, world, "bf16", "fp32", "adamw", rank=rank, backend="gloo")
    act = predict_activations(shape, B, S, ckpt, "bf16")
    grads = unit_grad_bytes(shape, world, "bf16")
    return peak_bytes(mem, act, grads, released_between_passes(shape, world, "bf16"))


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("LAYERSHARD_SKIP_SLOW") == "1", reason="spawns 7 ranks")
@pytest.mark.parametrize("ckpt", [0, L], ids=["no-ckpt", "ckpt-all"])
@pytest.mark.parametrize("arch", ARCHS)
def test_peak_within_10_percent_of_memtracker(measured, arch, ckpt):
    _, shape = _build(arch)
    for world in WORLDS if arch in ARCHS_MULTI else (1,):
        for rank in range(world):
            got = measured[(arch, ckpt, world, rank)]
            plan = _planned(shape, ckpt, world, rank)
            assert abs(got / plan - 1) <= TOLERANCE, (arch, ckpt, world, rank, got, plan)
