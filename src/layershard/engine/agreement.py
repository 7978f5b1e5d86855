"""One rank's failure raises on every rank.

Collectives hang when one rank leaves the program order: a rank that raises while the others
wait in the next collective leaves them stuck until the process-group timeout, with an error
that names the timeout instead of the cause. Every block of code that can fail on one rank
alone (a file one rank reads, a check of one rank's own state) and precedes a collective runs
under ``agreed(group)``: the ranks share their verdicts (one small ``all_gather_object``) and,
if any rank failed, every rank raises, the failing one its own exception and the others an
exception of the same type naming the rank it came from.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Callable, Iterator
from typing import TypeVar

import torch.distributed as dist

from layershard.engine.waits import waiting

T = TypeVar("T")


class RankError(RuntimeError):
    """Another rank failed with an exception that cannot be rebuilt here."""


def _describe(error: BaseException) -> tuple[str, str, str]:
    cls = type(error)
    return cls.__module__, cls.__qualname__, str(error)


def _rebuild(module: str, qualname: str, message: str, rank: int) -> BaseException:
    """An exception of the failing rank's type (looked up among modules this process already
    imported, never imported by name) carrying its message and rank."""
    text = f"{message} (on rank {rank})"
    cls: object = sys.modules.get(module)
    for part in qualname.split("."):
        cls = getattr(cls, part, None)
    if isinstance(cls, type) and issubclass(cls, Exception):
        try:
            return cls(text)
        except Exception:  # noqa: BLE001 - a constructor that wants other arguments
            pass
    return RankError(f"{qualname}: {text}")


@contextlib.contextmanager
def agreed(group: dist.ProcessGroup | None = None) -> Iterator[None]:
    """Run the block, then agree with every rank of ``group`` on whether it failed anywhere.

    Collective: every rank enters and leaves it at the same point of the program. Any exception
    of the block counts (``torch.distributed.checkpoint``'s ``CheckpointException`` too, which
    is a ``BaseException``); ``KeyboardInterrupt`` and ``SystemExit`` pass through at once.
    """
    error: BaseException | None = None
    try:
        yield
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - every failure is shared with the other ranks
        error = e
    world = dist.get_world_size(group) if dist.is_initialized() else 1
    verdicts: list = [None if error is None else _describe(error)]
    if world > 1:
        verdicts = [None] * world
        mine = None if error is None else _describe(error)
        with waiting("agreement of the ranks on a step that can fail on one of them"):
            dist.all_gather_object(verdicts, mine, group=group)
    if error is not None:
        raise error
    for rank, verdict in enumerate(verdicts):
        if verdict is not None:
            module, qualname, message = verdict
            raise _rebuild(module, qualname, message, rank)


def rank0_decides(decide: Callable[[], T], group: dist.ProcessGroup | None = None) -> T:
    """Rank 0's answer to ``decide()``, on every rank (what it sees of a shared file system, say,
    which a network file system may show other ranks differently or later). Collective."""
    value: T | None = None
    with agreed(group):
        if not dist.is_initialized() or dist.get_rank(group) == 0:
            value = decide()
    if dist.is_initialized() and dist.get_world_size(group) > 1:
        box = [value]
        dist.broadcast_object_list(box, group_src=0, group=group)
        value = box[0]
    return value  # type: ignore[return-value]
