"""The errors a checkpoint load or save can raise. All derive from ``CheckpointError``."""

from __future__ import annotations


class CheckpointError(RuntimeError):
    """A checkpoint could not be saved, found or loaded."""


class CheckpointNotFoundError(CheckpointError, FileNotFoundError):
    """No (complete) checkpoint at the given path; an interrupted save leaves none behind."""


class CheckpointCorruptError(CheckpointError):
    """A file of the checkpoint is truncated, corrupt or missing; the message names it."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint belongs to another model or optimizer: missing or unexpected keys, another
    shape or dtype. The message names the keys."""
