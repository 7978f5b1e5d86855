"""Train a tiny Llama whose embedding and head are larger than a block (vocab 512, d 32) with the
engine on PYTHONPATH, 2 gloo ranks, and save the final full state dict and the losses; run it
with two engines and compare the files bitwise:

    PYTHONPATH=/tmp/old/src python benchmarks/memory/large-units/bitwise.py /tmp/old.pt
    PYTHONPATH=src python benchmarks/memory/large-units/bitwise.py /tmp/new.pt
    python benchmarks/memory/large-units/bitwise.py --compare /tmp/old.pt /tmp/new.pt
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

CASES = [  # (tied, strategy kwargs, chunked-loss chunks)
    (tied, kw, chunks)
    for tied in (False, True)
    for kw in ({}, {"strategy": "grad_op"}, {"strategy": "no_shard"})
    for chunks in (0, 4)
]


def _rank(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    import layershard as ls
    from layershard.models import LlamaConfig, LlamaForCausalLM

    results = {}
    for tied, kw, chunks in CASES:
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=512, dim=32, n_layers=3, n_heads=4, n_kv_heads=2,
                          ffn_dim=64, max_seq_len=16, tie_embeddings=tied)  # fmt: skip
        model = LlamaForCausalLM(cfg)
        if chunks:
            ls.chunked_loss(model, chunks)
        model = ls.shard(model, **kw)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(5):
            x = torch.randint(0, 512, (8, 16), generator=g)[rank * 4 : (rank + 1) * 4]
            loss = model(input_ids=x, labels=x).loss
            loss.backward()
            model.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        key = f"tied={tied} {kw} chunks={chunks}"
        results[key] = {"losses": torch.stack(losses), **model.full_state_dict()}
    if rank == 0:
        torch.save(results, out)
    dist.barrier()
    dist.destroy_process_group()


def main() -> None:
    if sys.argv[1] == "--compare":
        a, b = torch.load(sys.argv[2]), torch.load(sys.argv[3])
        same = 0
        for key in a:
            diff = [k for k in a[key] if not torch.equal(a[key][k], b[key][k])]
            print(f"{key}: {'bitwise equal' if not diff else 'DIFFERENT: ' + ', '.join(diff)}")
            same += not diff
        print(f"{same}/{len(a)} cases bitwise equal")
        return
    mp.spawn(_rank, args=(2, 29571, sys.argv[1]), nprocs=2)


if __name__ == "__main__":
    main()
