"""layershard: layer-sharded data parallel training (ZeRO-3) for PyTorch.

import layershard as ls
rank, world = ls.init_distributed()
model = ls.shard(model)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
"""

from layershard.distributed import init_distributed
from layershard.engine.precision import GradScaler, MixedPrecision
from layershard.engine.strategy import CPUOffload
from layershard.loss import chunked_loss
from layershard.parallelize import parallelize
from layershard.sharded import ShardedModule, shard

__version__ = "0.1.0"

__all__ = [
    "CPUOffload",
    "GradScaler",
    "MixedPrecision",
    "ShardedModule",
    "__version__",
    "chunked_loss",
    "export_hf",
    "ft",
    "hf",
    "init_distributed",
    "load_checkpoint",
    "load_hf",
    "optim",
    "parallelize",
    "save_checkpoint",
    "shard",
]


def __getattr__(name: str):
    # Checkpoint functions live in their own package; import it only when used.
    if name in ("save_checkpoint", "load_checkpoint", "export_hf", "load_hf"):
        from layershard import checkpoint

        return getattr(checkpoint, name)
    if name == "optim":  # ls.optim.Muon; imported on first use, like the checkpoint functions
        import layershard.optim

        return layershard.optim
    if name == "hf":  # ls.hf.Trainer, ls.hf.Accelerator: needs the `hf` extra, imported on use
        import layershard.hf

        return layershard.hf
    if name == "ft":  # ls.ft.FaultTolerant: needs the `ft` extra (torchft), imported on use
        import layershard.ft

        return layershard.ft
    raise AttributeError(f"module 'layershard' has no attribute {name!r}")
