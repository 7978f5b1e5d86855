"""Tensor parallel x sharded data parallel: torch parallelizes the built-in Llama's blocks over a
TP mesh (``parallelize_module``, DTensor parameters), layershard shards every unit's local TP
shards over the data-parallel group (the ranks with the same TP coordinate).

    # 4 CPU ranks: TP 2 x dp_shard 2 (gloo)
    torchrun --nproc-per-node 4 examples/tensor_parallel.py
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

import layershard as ls
from layershard.models import LlamaConfig, LlamaForCausalLM
from layershard.models.llama_tp import parallelize_llama

TP = 2

rank, world = ls.init_distributed(backend="gloo")
mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
torch.manual_seed(0)  # every rank builds the same model
cfg = LlamaConfig(
    vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=32
)
model = parallelize_llama(LlamaForCausalLM(cfg), mesh["tp"])  # q/k/v, w1/w3 colwise; wo, w2 rowwise
model = ls.shard(model, mesh=mesh)  # layershard: the data-parallel axis (the dp_shard group)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)

dp_rank = mesh["dp_shard"].get_local_rank()
data = torch.Generator().manual_seed(1 + dp_rank)  # the ranks of one TP group: the same batch
for step in range(3):
    x = torch.randint(0, cfg.vocab_size, (4, 32), generator=data)
    loss = model(x, labels=x).loss
    loss.backward()
    norm = model.clip_grad_norm_(1.0)  # the whole gradient's norm, TP and DP
    opt.step()
    opt.zero_grad()
    if rank == 0:
        print(f"step {step}: loss {loss.item():.4f}, grad norm {norm.item():.4f}")

full = model.full_state_dict()  # whole (unsharded over TP and DP) tensors, on rank 0
if rank == 0:
    print({k: tuple(v.shape) for k, v in full.items() if k.startswith("layers.0.attn")})
dist.barrier()
dist.destroy_process_group()
