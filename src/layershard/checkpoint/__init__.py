"""Checkpoints: sharded and resumable at any world size (DCP), crash-safe, exportable to HF.

    ls.save_checkpoint("runs/x/checkpoints/step_000100", model, opt, step=100, extra={...})
    meta = ls.load_checkpoint("runs/x/checkpoints", model, opt)   # follows `latest`
    ls.export_hf(model, "out/hf")                                 # safetensors shards + config
    ls.load_hf(model, "path/to/hf")                               # each rank reads its slices

See docs/checkpoint.md for the layout on disk and the guarantees.
"""

from layershard.checkpoint.errors import (
    CheckpointCorruptError,
    CheckpointError,
    CheckpointMismatchError,
    CheckpointNotFoundError,
)
from layershard.checkpoint.hf import export_checkpoint, export_hf, load_hf
from layershard.checkpoint.info import checkpoint_info
from layershard.checkpoint.load import load_checkpoint
from layershard.checkpoint.save import AsyncCheckpoint, save_checkpoint

__all__ = [
    "AsyncCheckpoint",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointNotFoundError",
    "checkpoint_info",
    "export_checkpoint",
    "export_hf",
    "load_checkpoint",
    "load_hf",
    "save_checkpoint",
]
