"""Do the peers' context parallelism run on CPU (issue 49's "against accelerate's CP or
transformers' where they run on CPU")? Two tries on 2 gloo ranks, each printing what happened:

1. torch's own CP (``torch.distributed.tensor.experimental.context_parallel``), which
   accelerate's ``ParallelismConfig(cp_size=...)`` and transformers' Trainer use: a tiny
   transformers Llama (SDPA attention) run inside the context with its inputs split.
2. accelerate's ``Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))``.

    torchrun --nproc-per-node 2 benchmarks/context-parallel/peers_on_cpu.py

Recorded (2026-11-29, torch 2.13.0, accelerate 1.15.0, transformers 5.24): README.md here.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def _tiny():
    import transformers

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=96, hidden_size=64, num_attention_heads=4,
                                   num_key_value_heads=2, num_hidden_layers=2,
                                   intermediate_size=128)  # fmt: skip
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa")


def torch_cp(rank: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("cp",))
    model = _tiny()
    ids = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(1))
    pos = torch.arange(64)[None]
    try:
        with torch.no_grad(), context_parallel(mesh, buffers=[ids, pos], buffer_seq_dims=[1, 1]):
            model(input_ids=ids, position_ids=pos)
    except Exception as e:  # what a user would see
        return f"{type(e).__name__}: {e}"
    return "ran"


def accelerate_cp(rank: int) -> str:
    from accelerate import Accelerator, ParallelismConfig

    try:
        Accelerator(cpu=True, parallelism_config=ParallelismConfig(cp_size=2))
    except Exception as e:
        return f"{type(e).__name__}: {e}"
    return "made"


def main() -> None:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    for name, fn in (("torch context_parallel", torch_cp), ("accelerate cp_size=2", accelerate_cp)):
        result = fn(rank)
        if rank == 0:
            print(f"{name}: {result}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
