"""layershard for Hugging Face workflows: ``transformers.Trainer``, trl trainers and
``accelerate`` loops sharded by ``ls.shard``, on the released libraries (``pip install
layershard[hf]``).

    import layershard as ls
    trainer = ls.hf.Trainer(model=model, args=TrainingArguments(...), ...)       # was Trainer
    trainer = ls.hf.sharded(trl.SFTTrainer)(model=model, args=SFTConfig(...))     # any subclass
    accelerator = ls.hf.Accelerator(layershard=ls.hf.ShardingPlugin(...))        # own loops
    ls.hf.save_adapter(model, dir); ls.hf.export_merged(model, dir)               # QLoRA / LoRA

See docs/hf.md.
"""

try:
    import accelerate  # noqa: F401
    import transformers  # noqa: F401
except ImportError as e:  # pragma: no cover - depends on the install
    raise ImportError(
        f"layershard.hf needs transformers and accelerate ({e}); pip install 'layershard[hf]'"
    ) from e

from layershard.hf.accelerator import Accelerator, sharded_of
from layershard.hf.plugin import ShardingPlugin
from layershard.hf.qlora import export_merged, save_adapter
from layershard.hf.trainer import SUPPORTED_OPTIM, Trainer, sharded

__all__ = [
    "SUPPORTED_OPTIM",
    "Accelerator",
    "ShardingPlugin",
    "Trainer",
    "export_merged",
    "save_adapter",
    "sharded",
    "sharded_of",
]
