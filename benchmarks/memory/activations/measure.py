"""Activation bytes per token per block: layershard's built-in Llama before and after issue 25's
change, side by side with transformers' LlamaForCausalLM (attn_implementation="sdpa") on the same
config, in fp32 and bf16, for several GQA ratios; and `layershard plan`'s formulas against the
whole model's live bytes.

Two of torch's tools, both deterministic on CPU (see layershard.plan.measure):
- saved-tensor accounting (saved_tensors_hooks, unique storages): exactly what autograd keeps
  for backward, attributed to the block that saved it. The primary figure.
- MemTracker (live storages): the bytes alive at the start of block i+1 less those at the start
  of block i, i.e. whatever the block leaves alive however it is kept; a cross-check, and the
  only one of the two that sees a checkpoint's inputs and the logits the caller holds.

"before" is the model with today's RMSNorm, attention and loss math before the change (the
reference copy in tests/engine/test_activation_memory.py, swapped into the same modules).

    PYTHONPATH=src python benchmarks/memory/activations/measure.py > benchmarks/memory/activations/results.txt
"""

from __future__ import annotations

import argparse
import sys
import time
from functools import partial
from pathlib import Path

import torch
import torch.utils.checkpoint
import transformers

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT / "tests"))

from test_activation_memory import ref_attention, ref_loss, ref_rmsnorm  # noqa: E402

from layershard.models import LlamaForCausalLM, build_config, hf_llama_config  # noqa: E402
from layershard.models.llama import _native_gqa, _probe_cpu_flash_gqa  # noqa: E402
from layershard.plan import (  # noqa: E402
    ModelShape,
    layer_activation_bytes_per_token,
    predict_activations,
)
from layershard.plan.measure import LiveMemory, saved_bytes_by_module  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def repeats_kv(dtype) -> bool:
    q, kv = torch.zeros(1, 2, 1, 8, dtype=dtype), torch.zeros(1, 1, 1, 8, dtype=dtype)
    return not _native_gqa(q, kv, kv)


def ours(cfg, dtype):
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.rotary.float().reset_parameters()  # fp32 tables, as under ls.shard's mixed precision
    return model


def before(cfg, dtype):
    """The same model computing with the math before the change."""
    model = ours(cfg, dtype)
    eps = cfg.norm_eps
    for layer in model.layers:
        for norm in (layer.attn_norm, layer.mlp_norm):
            norm.forward = partial(lambda n, x: ref_rmsnorm(x, n.weight, eps), norm)
        layer.attn.forward = partial(ref_attention, layer.attn)
    model.norm.forward = partial(lambda n, x: ref_rmsnorm(x, n.weight, eps), model.norm)
    forward = model.forward

    def with_old_loss(ids, labels=None):
        out = forward(ids)
        if labels is not None:
            out.loss = ref_loss(out.logits, labels)
        return out

    model.forward = with_old_loss
    return model


def hf(cfg, dtype):
    c = hf_llama_config(cfg)
    c._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(c).to(dtype)


def per_block(model, layers, ids):
    """(saved bytes per token of a middle block, MemTracker's live bytes per token of it)."""
    tokens = ids.numel()
    mods = {str(i): m for i, m in enumerate(layers)}
    saved = saved_bytes_by_module(model, mods, lambda: model(ids, labels=ids).loss)
    starts: dict[str, int] = {}

    def mark(name):
        starts.setdefault(name, mem.current())

    with LiveMemory(model, [ids]) as mem:
        hooks = [m.register_forward_pre_hook(lambda *_, n=n: mark(n)) for n, m in mods.items()]
        model(ids, labels=ids).loss  # noqa: B018
        for h in hooks:
            h.remove()
    return saved["1"] / tokens, (starts["2"] - starts["1"]) / tokens


def whole_model(cfg, dtype, batch, seq, ckpt, repeat):
    """MemTracker on the built-in model: alive when the LM head starts, and the peak at the loss
    (when its backward starts) less that; against predict_activations."""
    model = ours(cfg, dtype)
    for block in model.layers[:ckpt]:
        block.forward = partial(
            torch.utils.checkpoint.checkpoint, block.forward, use_reentrant=False
        )
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    marks: dict[str, int] = {}

    def mark(name, read):
        marks.setdefault(name, read())

    with LiveMemory(model, [ids]) as mem:
        h = model.lm_head.register_forward_pre_hook(lambda *_: mark("head", mem.current))
        out = model(ids, labels=ids)
        out.logits.register_hook(lambda g: mark("loss", mem.peak))
        out.loss.backward()
        h.remove()
    plan = predict_activations(cfg, batch, seq, ckpt, dtype, repeat_kv=repeat)
    a = layer_activation_bytes_per_token(ModelShape.from_config(cfg), dtype, repeat) * batch * seq
    return marks["head"], marks["loss"] - marks["head"], plan, a


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--batch", type=int, default=2)
    args = p.parse_args()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}; "
          f"CPU flash attention takes grouped heads: {_probe_cpu_flash_gqa()}; the model "
          f"repeats k, v in fp32: {repeats_kv(torch.float32)}, bf16: {repeats_kv(torch.bfloat16)}")  # fmt: skip
    print(time.strftime("%Y-%m-%d %H:%M:%S"), Path("/proc/loadavg").read_text().split()[:3])
    base = dict(vocab_size=8192, dim=512, n_layers=3, n_heads=8, ffn_dim=1536, max_seq_len=1024)
    print(f"\nbytes per token per block: the `small` preset's block (d 512, 8 heads of 64, "
          f"ffn 1536), batch {args.batch}, seq {args.seq}; saved = saved-tensor accounting, "
          "live = MemTracker")  # fmt: skip
    header = (
        f"{'dtype':5} {'q/kv':>4} {'before':>7} {'after':>7} {'after live':>10} "
        f"{'HF sdpa':>8} {'HF live':>8} {'after/HF':>8} {'plan':>7}"
    )
    print(header)
    for dname, dt in DTYPES.items():
        for kv in (8, 2, 1):
            cfg = build_config("small", **base, n_kv_heads=kv)
            ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq))
            m_before = before(cfg, dt)
            b_saved, _ = per_block(m_before, m_before.layers, ids)
            m_ours = ours(cfg, dt)
            o_saved, o_live = per_block(m_ours, m_ours.layers, ids)
            m_hf = hf(cfg, dt)
            h_saved, h_live = per_block(m_hf, m_hf.model.layers, ids)
            formula = layer_activation_bytes_per_token(
                ModelShape.from_config(cfg), dt, repeats_kv(dt)
            )
            print(
                f"{dname:5} {8 // kv:>4} {b_saved:>7.0f} {o_saved:>7.0f} {o_live:>10.0f} "
                f"{h_saved:>8.0f} {h_live:>8.0f} {o_saved / h_saved:>8.3f} {formula:>7}",
                flush=True,
            )
    print("\nwhole model (3 blocks) against `layershard plan`'s predict_activations, bytes:")
    print(f"{'dtype':5} {'q/kv':>4} {'b':>2} {'seq':>4} {'ckpt':>4} {'live at head':>12} "
          f"{'+A if ckpt':>10} {'plan act.':>10} {'loss peak':>10} {'plan logits':>11}")  # fmt: skip
    for dname, dt in DTYPES.items():
        for kv, batch, seq in ((8, 2, 128), (2, 3, 96)):
            for ckpt in (0, 2):
                cfg = build_config("small", **{**base, "dim": 256, "n_heads": 8}, n_kv_heads=kv)
                head, loss, plan, a = whole_model(cfg, dt, batch, seq, ckpt, repeats_kv(dt))
                extra = a if ckpt else 0
                print(
                    f"{dname:5} {8 // kv:>4} {batch:>2} {seq:>4} {ckpt:>4} {head:>12} "
                    f"{extra:>10} {plan['activations']:>10} {loss:>10} {plan['logits']:>11}",
                    flush=True,
                )


if __name__ == "__main__":
    main()
