"""The phases of a checkpoint save or load, each agreed by every rank.

A save is collect -> stage (asynchronous saves) -> create the folder -> write -> digest ->
publish; a load is read -> check -> place. Every phase runs through ``Phases``: on every rank
(``each``, ``gather``) or on rank 0 alone, its result sent to the others (``rank0``), and then the
ranks agree on whether it failed anywhere (``engine/agreement.py``). If it did, every rank leaves
the phase with one error, after the same cleanup (``on_error``), and none waits in a collective
the others will never join. DCP's write and read, collectives that agree themselves, go through it
too, so that no phase can skip the agreement; it costs one small all-gather per phase.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NoReturn, TypeVar

import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from layershard.engine.agreement import agreed, rank0_decides

T = TypeVar("T")


class Phases:
    """The phases of one save or load over ``group``. ``on_error(phase, error)`` runs on every
    rank when a phase failed on any (DCP's ``CheckpointException`` included; an interrupt or
    ``SystemExit`` passes through untouched) and raises the error every rank reports."""

    def __init__(
        self,
        group: dist.ProcessGroup | None,
        on_error: Callable[[str, BaseException], NoReturn] | None = None,
    ) -> None:
        self.group, self.on_error = group, on_error
        self.rank, self.world = dist.get_rank(group), dist.get_world_size(group)

    def each(self, phase: str, fn: Callable[[], T]) -> T:
        """Every rank runs ``fn``; returns this rank's result."""

        def run() -> T:
            with agreed(self.group):
                out = fn()
            return out

        return self._guard(phase, run)

    def gather(self, phase: str, fn: Callable[[], T]) -> list[T]:
        """Every rank runs ``fn``; returns every rank's result, by rank (keep them small)."""
        mine = self.each(phase, fn)
        if self.world == 1:
            return [mine]
        out: list = [None] * self.world
        dist.all_gather_object(out, mine, group=self.group)
        return out

    def rank0(self, phase: str, fn: Callable[[], T]) -> T:
        """Rank 0 runs ``fn`` (what it sees of a shared file system); returns its result."""
        return self._guard(phase, lambda: rank0_decides(fn, self.group))

    def _guard(self, phase: str, run: Callable[[], T]) -> T:
        try:
            return run()
        except (Exception, CheckpointException) as e:
            if self.on_error is None:
                raise
            self.on_error(phase, e)
