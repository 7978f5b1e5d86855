"""A mixture of experts trained with expert parallelism: each MoE layer's experts split over
``--ep`` ranks (tokens exchanged by all-to-all), everything sharded by layershard.

    # 4 CPU ranks: experts split over 2, sharded over the other 2 (efsdp 2)
    torchrun --nproc-per-node 4 examples/expert_parallel.py --ep 2

    # HSDP on top: 2 replicas of (dp_shard 2), experts split over 2 within each
    torchrun --nproc-per-node 4 examples/expert_parallel.py --ep 2 --dp-replicate 2

    # tensor parallelism too: attention over TP 2 (a TP pair shares its micro-batches and sends
    # half of the tokens each to the experts), experts over EP 2, both sharded over the rest
    torchrun --nproc-per-node 4 examples/expert_parallel.py --ep 2 --tp 2

The model is the built-in ``moe`` preset made small; the data are learnable sequences (an affine
recurrence mod the vocabulary from a random start), so the loss falls within a few dozen steps.
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import layershard as ls
from layershard.models import LlamaForCausalLM, build_config


def sequences(n: int, vocab: int, seq: int, gen: torch.Generator) -> torch.Tensor:
    start = torch.randint(0, vocab, (n, 1), generator=gen)
    step = torch.randint(1, 8, (n, 1), generator=gen)
    return (start + step * torch.arange(seq)) % vocab


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int, default=2, help="ranks each layer's experts are split over")
    p.add_argument("--dp-replicate", type=int, default=1, help="replicas (HSDP)")
    p.add_argument("--tp", type=int, default=1, help="ranks each attention is split over")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--micro-batch", type=int, default=4, help="sequences per rank")
    args = p.parse_args()

    rank, world = ls.init_distributed()
    torch.manual_seed(0)  # every rank builds the same model; parallelize keeps its share
    cfg = build_config("moe", dim=128, n_layers=4, n_heads=4, moe_ffn_dim=128, vocab_size=512)
    model = ls.parallelize(
        LlamaForCausalLM(cfg), ep=args.ep, tp=args.tp, dp_replicate=args.dp_replicate
    )
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # each data-parallel rank its own micro-batches; the tp ranks of a TP group the same ones
    gen = torch.Generator().manual_seed(1 + rank // args.tp)
    for step in range(1, args.steps + 1):
        x = sequences(args.micro_batch, cfg.vocab_size, 64, gen)
        loss = model(x, labels=x).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
        if step % 10 == 0 or step == 1:
            mean = loss.detach().clone()
            dist.all_reduce(mean)
            if rank == 0:
                print(f"step {step:3d}  loss {mean.item() / world:.3f}")
    experts = [f for f in model.flat_params if f.over == "expert"]
    if rank == 0:
        s = model.sharding
        print(
            f"{world} ranks: TP {args.tp}; dense units sharded over {s.shard_size}, "
            f"replicated {s.replicas}x; "
            f"each layer's {cfg.n_experts} experts split over ep {s.ep_size}, each share "
            f"sharded over efsdp {s.expert_size}: this rank holds {sum(f.shard_numel for f in experts):,} "
            "expert weights"
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
