"""Tokenized splits and batches: each rank's share of every step, in an order fixed by the seed.

A tokenized split is a flat token file (plus a loss mask for SFT) written once by ``prepare``;
every rank memory-maps it (no copy per rank) and reads only its own windows. Sequences are the
consecutive ``seq_len`` windows of that stream. Reading the corpus and splitting it into train
and validation documents is ``sources``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from layershard.train.config import ConfigError
from layershard.train.data.sources import find_files, is_val, stdlib_files

__all__ = [
    "BatchLoader", "TokenSplit", "eval_windows", "find_files", "is_val", "read_windows",
    "stdlib_files",
]  # fmt: skip

# --- tokenized splits ------------------------------------------------------------------------


@dataclass
class TokenSplit:
    """A tokenized split on disk: ``tokens`` (and for SFT a 0/1 ``mask``; 1 = trained on)."""

    tokens_path: Path
    mask_path: Path | None
    dtype: str
    n_tokens: int

    def open(self) -> tuple[np.ndarray, np.ndarray | None]:
        if self.n_tokens == 0:  # an empty file cannot be memory-mapped
            empty = np.empty(0, dtype=self.dtype)
            return empty, (None if self.mask_path is None else empty.astype(np.uint8))
        tokens = np.memmap(self.tokens_path, dtype=self.dtype, mode="r", shape=(self.n_tokens,))
        mask = None
        if self.mask_path is not None:
            mask = np.memmap(self.mask_path, dtype=np.uint8, mode="r", shape=(self.n_tokens,))
        return tokens, mask

    def to_dict(self) -> dict[str, Any]:
        return {
            "tokens_path": str(self.tokens_path),
            "mask_path": str(self.mask_path) if self.mask_path else None,
            "dtype": self.dtype,
            "n_tokens": self.n_tokens,
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TokenSplit:
        mask = Path(d["mask_path"]) if d.get("mask_path") else None
        return cls(Path(d["tokens_path"]), mask, d["dtype"], int(d["n_tokens"]))


# --- serving batches -------------------------------------------------------------------------


class BatchLoader:
    """Each optimizer step consumes ``micro_batch * grad_accum * world_size`` windows taken in
    the order of a seeded permutation (a new one each epoch; an incomplete last batch of an
    epoch is dropped). Rank r takes its own slice of the step's windows, and reads only those.

    The global order does not depend on the world size, and ``state_dict()`` (epoch, cursor) is
    all it takes to continue exactly where a run stopped.
    """

    def __init__(
        self,
        split: TokenSplit,
        seq_len: int,
        micro_batch: int,
        grad_accum: int,
        rank: int,
        world_size: int,
        seed: int,
    ) -> None:
        self.tokens, self.mask = split.open()
        self.seq_len, self.micro_batch, self.grad_accum = seq_len, micro_batch, grad_accum
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.n_windows = split.n_tokens // seq_len
        self.global_batch = micro_batch * grad_accum * world_size
        if self.n_windows < self.global_batch:
            raise ConfigError(
                f"the training split has {self.n_windows} sequences of {seq_len} tokens but one "
                f"step needs {self.global_batch}; add data or lower --seq-len / --micro-batch"
            )
        self.epoch, self.cursor = 0, 0
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    def _permutation(self) -> np.ndarray:
        if self._perm_epoch != self.epoch:
            rng = np.random.default_rng([self.seed, self.epoch])
            self._perm, self._perm_epoch = rng.permutation(self.n_windows), self.epoch
        return self._perm

    def step_windows(self) -> list[np.ndarray]:
        """Window indices of this rank's micro-batches for the next step (does not advance)."""
        epoch, cursor = self.epoch, self.cursor
        if cursor + self.global_batch > self.n_windows:
            epoch, cursor = epoch + 1, 0
        saved = self.epoch
        self.epoch = epoch
        perm = self._permutation()
        self.epoch = saved
        out = []
        for m in range(self.grad_accum):
            start = cursor + (m * self.world_size + self.rank) * self.micro_batch
            out.append(perm[start : start + self.micro_batch])
        return out

    def next_step(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's (input_ids, labels) micro-batches for the next step; advances."""
        windows = self.step_windows()
        if self.cursor + self.global_batch > self.n_windows:
            self.epoch, self.cursor = self.epoch + 1, 0
        self.cursor += self.global_batch
        return [self.read(w) for w in windows]

    def read(self, windows: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
        return read_windows(self.tokens, self.mask, windows, self.seq_len)

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "cursor": self.cursor, "seed": self.seed,
                "seq_len": self.seq_len, "global_batch": self.global_batch}  # fmt: skip

    def load_state_dict(self, state: dict[str, int]) -> None:
        for k in ("seed", "seq_len", "global_batch"):
            if k in state and state[k] != getattr(self, k):
                raise ConfigError(
                    f"the checkpoint's data loader has {k}={state[k]} but this run has "
                    f"{getattr(self, k)}; resume with the same --seed / --seq-len / global batch"
                )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])


def read_windows(
    tokens: np.ndarray, mask: np.ndarray | None, windows: np.ndarray, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    rows = [np.asarray(tokens[i * seq_len : (i + 1) * seq_len], dtype=np.int64) for i in windows]
    ids = torch.from_numpy(np.stack(rows))
    labels = ids.clone()
    if mask is not None:
        m = np.stack([np.asarray(mask[i * seq_len : (i + 1) * seq_len]) for i in windows])
        labels[torch.from_numpy(m) == 0] = -100
    return ids, labels


def eval_windows(split: TokenSplit, seq_len: int, n_sequences: int, per_round: int) -> np.ndarray:
    """Fixed validation windows, spread over the split; a multiple of ``per_round`` (ranks x
    micro-batch) so that every rank runs the same number of forward passes."""
    n_windows = split.n_tokens // seq_len
    if n_windows == 0 or n_sequences <= 0:
        return np.empty(0, dtype=np.int64)
    n = max(per_round, (n_sequences // per_round) * per_round)
    # Evenly spaced over the split; wraps around when the split is small.
    return (np.arange(n, dtype=np.int64) * max(1, n_windows // n)) % n_windows


def count_targets(labels: torch.Tensor) -> int:
    """Tokens a (CPU) label batch trains on; read before the batch goes to the device."""
    return int(np.count_nonzero(labels[:, 1:].numpy() != -100))
