"""Collectives per training step and bytes held per rank, for the Llama model of the parity tests.

    torchrun --nproc-per-node 2 benchmarks/engine/engine_counts.py [--preset small] [--steps 3]

Prints (rank 0) one JSON line: comm_stats() of the last step, memory_report(optimizer) after it,
and the analytic model-state minimum 16 * P / N for comparison.
"""

from __future__ import annotations

import argparse
import json

import torch

import layershard as ls
from layershard.models import LlamaConfig, LlamaForCausalLM, build_config

TEST_MODEL = dict(
    vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16
)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument(
        "--preset", default=None, help="a layershard.models preset instead of the test model"
    )
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--seq", type=int, default=16)
    args = parser.parse_args()
    rank, world = ls.init_distributed()
    torch.manual_seed(0)
    cfg = build_config(args.preset, vocab_size=8192) if args.preset else LlamaConfig(**TEST_MODEL)
    model = ls.shard(LlamaForCausalLM(cfg))
    n_params = sum(f.numel for f in model.flat_params)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for _ in range(args.steps):
        model.comm_stats(reset=True)
        x = torch.randint(0, cfg.vocab_size, (2, args.seq))
        model(x, labels=x).loss.backward()
        stats = model.comm_stats()
        opt.step()
        opt.zero_grad()
    report = model.memory_report(opt)
    if rank == 0:
        state = report["params"] + report["grads"] + report["optimizer"]
        print(json.dumps({
            "world_size": world, "units": len(model.units), "parameters": n_params,
            "comm_per_step": stats, "memory_report": report,
            "model_state_bytes": state, "analytic_16P_over_N": 16 * n_params / world,
        }))  # fmt: skip


if __name__ == "__main__":
    main()
