"""What the planner's compute and memory models need from a GPU, measured on one (issue 36).

    python benchmarks/plan/accuracy/gpu_probe.py --out DIR [--parts gemm,attn,block,engine]

Writes one JSON file per part into DIR (each part also runs alone, and a part that fails is
recorded as an error, not a crash):

- ``gemm.json``: bf16 matmul TFLOP/s on a grid m, n, k in {256 ... 16384} (the roofline's
  constants are fitted to it) and on the GEMMs of the published runs' models (fwd X W^T, dgrad
  dY W, wgrad dY^T X) at 4096 and 16384 tokens (the fit is checked on them);
- ``attn.json``: causal SDPA (flash) forward and forward + backward by sequence length, head
  dims 64 and 128;
- ``block.json``: one layershard Llama block and one GPT-style block (LayerNorm, GELU MLP, fused
  QKV, biases: MPT's layout) forward + backward, to size the time outside GEMMs and attention;
- ``engine.json``: layershard's engine as rank 0 of a world of 8 on torch's fake process group
  (collectives complete without moving data): step time without communication, and
  ``max_memory_allocated`` / ``max_memory_reserved`` against the plan's peak.

CUDA events time every kernel sequence: the median of ``reps`` after ``warm`` warm-up runs.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
import traceback
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel


def timed(fn, reps: int = 7, warm: int = 2) -> float:
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    out = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) / 1e3)
    return statistics.median(out)


# (name, d, L, heads, kv heads, ffn, vocab, mlp) of the published runs' models
MODELS = [
    ("mpt-125m", 768, 12, 12, 12, 3072, 50368, "gelu"),
    ("mpt-350m", 1024, 24, 16, 16, 4096, 50368, "gelu"),
    ("mpt-760m", 1536, 24, 12, 12, 6144, 50368, "gelu"),
    ("mpt-1b", 2048, 24, 16, 16, 8192, 50368, "gelu"),
    ("mpt-3b", 2560, 32, 20, 20, 10240, 50368, "gelu"),
    ("mpt-7b", 4096, 32, 32, 32, 16384, 50368, "gelu"),
    ("mpt-13b", 5120, 40, 40, 40, 20480, 50368, "gelu"),
    ("mpt-30b", 7168, 48, 64, 64, 28672, 50368, "gelu"),
    ("mpt-70b", 8192, 80, 64, 64, 32768, 50368, "gelu"),
    ("llama2-7b", 4096, 32, 32, 32, 11008, 32000, "swiglu"),
    ("llama2-13b", 5120, 40, 40, 40, 13824, 32000, "swiglu"),
    ("llama2-34b", 8192, 48, 64, 8, 22016, 32000, "swiglu"),
    ("llama2-70b", 8192, 80, 64, 8, 28672, 32000, "swiglu"),
    ("llama3-8b", 4096, 32, 32, 8, 14336, 128256, "swiglu"),
]


def linears(d: int, h: int, kv: int, f: int, v: int, mlp: str) -> list[tuple[str, int, int]]:
    """(name, out, in) of one block's linears and the head."""
    hd = d // h
    if mlp == "gelu":
        return [("qkv", 3 * d, d), ("o", d, d), ("up", f, d), ("down", d, f), ("head", v, d)]
    return [("q", h * hd, d), ("kv", kv * hd, d), ("o", d, h * hd), ("up", f, d),
            ("down", d, f), ("head", v, d)]  # fmt: skip


def gemm_rate(m: int, n: int, k: int, kind: str = "nt") -> float:
    """TFLOP/s of an (m x k) @ (k x n) bf16 product; ``kind``: nt = X W^T (fwd), nn = dY W
    (dgrad), tn = dY^T X (wgrad)."""
    dev, dt = "cuda", torch.bfloat16
    if kind == "nt":
        a, b = torch.randn(m, k, device=dev, dtype=dt), torch.randn(n, k, device=dev, dtype=dt)
        fn = lambda: a @ b.t()  # noqa: E731
    elif kind == "nn":
        a, b = torch.randn(m, k, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        fn = lambda: a @ b  # noqa: E731
    else:
        a, b = torch.randn(k, m, device=dev, dtype=dt), torch.randn(k, n, device=dev, dtype=dt)
        fn = lambda: a.t() @ b  # noqa: E731
    flops = 2 * m * n * k
    reps = 3 if flops > 4e12 else 7
    t = timed(fn, reps=reps, warm=2)
    return flops / t / 1e12


def part_gemm(budget_s: float) -> dict:
    t0 = time.perf_counter()
    sizes = [256, 512, 1024, 2048, 4096, 8192, 16384]
    grid = []
    for m in sizes:
        for n in sizes:
            for k in sizes:
                grid.append({"m": m, "n": n, "k": k, "tflops": gemm_rate(m, n, k)})
    model = []
    for name, d, _L, h, kv, f, v, mlp in MODELS:
        for tokens in (4096, 16384):
            for lin, n_out, k_in in linears(d, h, kv, f, v, mlp):
                for kind, (m, n, k) in (
                    ("fwd", (tokens, n_out, k_in)),
                    ("dgrad", (tokens, k_in, n_out)),
                    ("wgrad", (n_out, k_in, tokens)),
                ):
                    if time.perf_counter() - t0 > budget_s:
                        break
                    orient = {"fwd": "nt", "dgrad": "nn", "wgrad": "tn"}[kind]
                    model.append({"model": name, "linear": lin, "pass": kind, "m": m, "n": n,
                                  "k": k, "tflops": gemm_rate(m, n, k, orient)})  # fmt: skip
    return {"grid": grid, "model": model, "seconds": time.perf_counter() - t0}


def part_attn() -> dict:
    rows = []
    for hd, h in ((128, 32), (64, 32), (128, 40), (128, 64)):
        for s in (512, 1024, 2048, 4096, 8192, 16384, 32768):
            b = max(1, 32768 // s)
            q, k, v = (torch.randn(b, h, s, hd, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))  # fmt: skip
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):

                def fwd_only(q=q, k=k, v=v):
                    return F.scaled_dot_product_attention(q, k, v, is_causal=True)

                fwd = timed(fwd_only)
                g = torch.randn_like(fwd_only())

                def fb(q=q, k=k, v=v, g=g):
                    out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    torch.autograd.grad(out, (q, k, v), g)

                both = timed(fb)
            causal_fwd_flops = 4 * b * h * s * s * hd / 2
            rows.append({"hd": hd, "heads": h, "seq": s, "batch": b, "fwd_s": fwd,
                         "fwd_bwd_s": both, "causal_fwd_flops": causal_fwd_flops})  # fmt: skip
    return {"rows": rows}


class GPTBlock(nn.Module):
    """MPT's block as llm-foundry's benchmark configs build it: LayerNorm with bias, fused QKV
    with bias, SDPA, out proj, LayerNorm, d -> 4d GELU -> d, biases."""

    def __init__(self, d: int, h: int) -> None:
        super().__init__()
        self.h = h
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.qkv, self.o = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.up, self.down = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.h, d // self.h).unbind(2)
        a = F.scaled_dot_product_attention(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True
        )
        x = x + self.o(a.transpose(1, 2).reshape(b, s, d))
        return x + self.down(F.gelu(self.up(self.ln2(x)), approximate="tanh"))


def part_block() -> dict:
    from layershard.models import Block, LlamaConfig, Rotary

    rows = []
    shapes = [  # (family, d, h, kv, f, seq, batch)
        ("llama", 2048, 16, 16, 5504, 2048, 4),
        ("llama", 4096, 32, 32, 11008, 2048, 2),
        ("llama", 4096, 32, 8, 14336, 8192, 1),
        ("llama", 5120, 40, 40, 13824, 4096, 1),
        ("gpt", 1024, 16, 16, 4096, 2048, 8),
        ("gpt", 2048, 16, 16, 8192, 2048, 4),
        ("gpt", 4096, 32, 32, 16384, 2048, 2),
        ("gpt", 7168, 64, 64, 28672, 2048, 2),
    ]
    for fam, d, h, kv, f, s, b in shapes:
        if fam == "llama":
            cfg = LlamaConfig(vocab_size=256, dim=d, n_layers=1, n_heads=h, n_kv_heads=kv,
                              ffn_dim=f, max_seq_len=s)  # fmt: skip
            blk = Block(cfg).cuda().to(torch.bfloat16)
            rot = Rotary(cfg.head_dim, s, cfg.rope_theta).cuda()
            cos, sin = rot(s, torch.bfloat16)
            run = lambda x, blk=blk, cos=cos, sin=sin: blk(x, cos, sin)  # noqa: E731
        else:
            blk = GPTBlock(d, h).cuda().to(torch.bfloat16)
            run = blk
        x = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        g = torch.randn(b, s, d, device="cuda", dtype=torch.bfloat16)
        fwd = timed(lambda run=run, x=x: run(x))

        def fb(run=run, x=x, g=g):
            y = run(x)
            y.backward(g)

        both = timed(fb)
        rows.append({"family": fam, "d": d, "heads": h, "kv": kv, "ffn": f, "seq": s,
                     "batch": b, "fwd_s": fwd, "fwd_bwd_s": both})  # fmt: skip
        torch.cuda.empty_cache()
    return {"rows": rows}


def engine_trial(preset: str, world: int, seq: int, micro: int, ckpt: int, layers: int) -> dict:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
        # The engine's control group is gloo, which a FakeStore cannot back: make every group
        # on the fake backend (its collectives complete at once, as the data ones do).
        new_group = dist.new_group

        def fake_group(*args, **kw):
            kw.pop("backend", None)
            return new_group(*args, **kw)

        dist.new_group = fake_group
    free0, total = torch.cuda.mem_get_info()
    cfg = build_config(preset, n_layers=layers, max_seq_len=max(seq, 16))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    model = ls.shard(model, mixed_precision=ls.MixedPrecision(torch.bfloat16), device="cuda",
                     activation_checkpointing=ckpt)  # fmt: skip
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")

    def step():
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(2):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = timed(step, reps=3, warm=0)
    out = {
        "preset": preset, "world": world, "seq": seq, "micro_batch": micro, "ckpt": ckpt,
        "layers": layers, "step_s": t, "max_allocated": torch.cuda.max_memory_allocated(),
        "max_reserved": torch.cuda.max_memory_reserved(), "free_before": free0, "total": total,
        "memory_report": {k: int(v) for k, v in model.memory_report(opt).items()},
    }  # fmt: skip
    return out


def part_engine() -> dict:
    rows = []
    trials = [  # preset, world, seq, micro, ckpt, layers
        ("llama-7b", 8, 2048, 1, 0, 32),
        ("llama-7b", 8, 2048, 4, 0, 32),
        ("llama-7b", 8, 4096, 2, 32, 32),
        ("llama-7b", 8, 2048, 2, 16, 32),
        ("llama-1b", 8, 2048, 8, 0, 16),
        ("llama-1b", 8, 8192, 2, 16, 16),
    ]
    for tr in trials:
        try:
            rows.append(engine_trial(*tr))
        except Exception as e:  # noqa: BLE001 - recorded, the next trial runs
            rows.append({"trial": list(tr), "error": repr(e)[:2000],
                         "trace": traceback.format_exc()[-3000:]})  # fmt: skip
            torch.cuda.empty_cache()
    return {"rows": rows}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", default="gpu-probe")
    p.add_argument("--parts", default="gemm,attn,block,engine")
    p.add_argument("--gemm-budget-s", type=float, default=150)
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    torch.backends.cuda.matmul.allow_tf32 = False
    info = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count}  # fmt: skip
    (out / "device.json").write_text(json.dumps(info, indent=1))
    for part in a.parts.split(","):
        t0 = time.perf_counter()
        try:
            if part == "gemm":
                res = part_gemm(a.gemm_budget_s)
            elif part == "attn":
                res = part_attn()
            elif part == "block":
                res = part_block()
            else:
                res = part_engine()
        except Exception as e:  # noqa: BLE001 - one part failing leaves the others
            res = {"error": repr(e)[:2000], "trace": traceback.format_exc()[-3000:]}
        res["part_seconds"] = time.perf_counter() - t0
        (out / f"{part}.json").write_text(json.dumps(res, indent=1))
        print(part, f"{res['part_seconds']:.1f}s", "error" if "error" in res else "ok", flush=True)
        torch.cuda.empty_cache()
    _ = math


if __name__ == "__main__":
    main()
