"""Where layershard's memory goes on a GPU, step by step (issue 36's memory check).

    python benchmarks/plan/accuracy/gpu_memtrace.py --out DIR

Rank 0 of a world of 8 on torch's fake process group (as gpu_probe.py's engine part), a
Llama-2-7B-shaped model with 4 blocks, bf16: ``torch.cuda.memory_allocated()`` at every unit's
forward start and end, at the LM head, when the loss's backward starts, and at every block's
backward (a hook on its output gradient), for micro-batch 4 x 2048 without checkpointing and
2 x 4096 with every block checkpointed; the per-block increments against the plan's
``layer_activation_bytes_per_token`` and the peak against ``peak_bytes``.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.testing._internal.distributed.fake_pg import FakeStore


def trace(seq: int, micro: int, ckpt: int, layers: int = 4) -> dict:
    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    cfg = build_config("llama-7b", n_layers=layers, max_seq_len=seq)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = ls.shard(model, mixed_precision=ls.MixedPrecision(torch.bfloat16), device="cuda",
                     activation_checkpointing=ckpt)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
    marks: list[tuple[str, int, int]] = []

    def mark(name: str) -> None:
        marks.append((name, torch.cuda.memory_allocated(), torch.cuda.max_memory_allocated()))

    hooks = []
    for name, mod in [("embed", model.embed), *[(f"layers.{i}", m) for i, m in
                      enumerate(model.layers)], ("norm", model.norm), ("lm_head", model.lm_head)]:  # fmt: skip
        hooks.append(mod.register_forward_pre_hook(lambda *_, n=name: mark(f"fwd start {n}")))
        hooks.append(mod.register_forward_hook(lambda *_, n=name: mark(f"fwd end {n}")))

    def step(record: bool) -> None:
        out = model(x, labels=x)
        if record:
            mark("loss computed")
        out.loss.backward()
        if record:
            mark("backward done")
        opt.step()
        if record:
            mark("optimizer stepped")
        opt.zero_grad(set_to_none=True)
        if record:
            mark("zero_grad")

    step(False)
    marks.clear()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    mark("step start")
    step(True)
    for h in hooks:
        h.remove()
    return {"seq": seq, "micro_batch": micro, "ckpt": ckpt, "layers": layers,
            "marks": marks, "max_allocated": torch.cuda.max_memory_allocated(),
            "memory_report": {k: int(v) for k, v in model.memory_report(opt).items()}}  # fmt: skip


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-memtrace")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=8)
    new_group = dist.new_group

    def fake_group(*args, **kw):
        kw.pop("backend", None)
        return new_group(*args, **kw)

    dist.new_group = fake_group
    rows = []
    for seq, micro, ckpt in ((2048, 4, 0), (4096, 2, 4), (4096, 2, 0)):
        try:
            rows.append(trace(seq, micro, ckpt))
        except Exception as e:  # noqa: BLE001 - recorded
            rows.append({"seq": seq, "micro_batch": micro, "ckpt": ckpt, "error": repr(e)})
        torch.cuda.empty_cache()
    (out / "memtrace.json").write_text(json.dumps(rows, indent=1))
    for r in rows:
        print(r.get("error") or [(n, round(c / 2**30, 3), round(m / 2**30, 3))
                                 for n, c, m in r["marks"]])  # fmt: skip


if __name__ == "__main__":
    main()
