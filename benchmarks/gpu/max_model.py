"""The biggest model that fits on one GPU as one rank of a larger world: layershard vs FSDP2.

    python benchmarks/gpu/max_model.py --impl layershard fsdp2 --preset llama-7b --world 8

One rank of ``--world`` runs on torch's fake process group (collectives complete at once without
moving data), so the GPU holds exactly what that rank would: its shards, gradient slices and
AdamW state, the gather buffers, and the activations of one micro-batch. The number of layers
is found by bisection; every trial runs in a fresh process (an out-of-memory error leaves the
allocator fragmented) and does two full steps (forward, backward, AdamW), bf16 compute. Prints
one JSON line per implementation: the largest layer count that fit, its parameter count, and the
peak memory of the largest trial that fit.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def trial(impl: str, preset: str, layers: int, world: int, seq: int, micro: int) -> dict:
    import torch
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    import layershard as ls
    from layershard.models import LlamaForCausalLM, build_config

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    torch.cuda.set_device(0)
    cfg = build_config(preset, n_layers=layers, max_seq_len=max(seq, 16))
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    n_params = sum(p.numel() for p in model.parameters())
    if impl == "layershard":
        model = ls.shard(model, mixed_precision=ls.MixedPrecision(torch.bfloat16), device="cuda")
    else:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        mesh = init_device_mesh("cuda", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        for block in model.layers:
            fully_shard(block, mesh=mesh, mp_policy=mp)
        fully_shard([model.norm, model.lm_head], mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        model.to_empty(device="cuda")
        with torch.no_grad():
            for m in model.modules():
                if hasattr(m, "reset_parameters"):
                    m.reset_parameters()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randint(0, cfg.vocab_size, (micro, seq), device="cuda")
    torch.cuda.reset_peak_memory_stats()
    for _ in range(2):
        model(x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"params": n_params, "peak_bytes": torch.cuda.max_memory_allocated()}


def fits(impl, preset, layers, world, seq, micro) -> dict | None:
    cmd = [sys.executable, __file__, "--trial", str(layers), "--impl", impl, "--preset", preset,
           "--world", str(world), "--seq", str(seq), "--micro-batch", str(micro)]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if r.returncode == 0:
        return json.loads(r.stdout.strip().splitlines()[-1])
    if "out of memory" not in (r.stderr + r.stdout).lower():
        raise RuntimeError(f"{impl} with {layers} layers failed:\n{r.stderr[-3000:]}")
    return None


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--impl", nargs="+", default=["layershard", "fsdp2"])
    p.add_argument("--preset", default="llama-7b", help="block dimensions; layers are varied")
    p.add_argument("--world", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--micro-batch", type=int, default=1)
    p.add_argument("--max-layers", type=int, default=512)
    p.add_argument("--trial", type=int, default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.trial is not None:
        print(json.dumps(trial(a.impl[0], a.preset, a.trial, a.world, a.seq, a.micro_batch)))
        return
    for impl in a.impl:
        t0 = time.perf_counter()
        lo, hi, best = 0, a.max_layers + 1, None  # lo fits (0: nothing yet), hi does not
        while hi - lo > 1:
            mid = (lo + hi) // 2
            r = fits(impl, a.preset, mid, a.world, a.seq, a.micro_batch)
            if r is None:
                hi = mid
            else:
                lo, best = mid, r
        out = {"impl": impl, "preset": a.preset, "world": a.world, "seq": a.seq,
               "micro_batch": a.micro_batch, "max_layers": lo, **(best or {}),
               "seconds": round(time.perf_counter() - t0, 1)}  # fmt: skip
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
