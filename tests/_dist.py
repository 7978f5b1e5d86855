"""Run a test function on N local gloo ranks (127.0.0.1), each a fresh spawned process.

Checks run inside the ranks and raise on failure; the exception and its traceback reach pytest
through ``torch.multiprocessing.spawn``. Spawning costs ~1 s per rank here, so put several checks
into one function rather than one spawn per assertion.
"""

from __future__ import annotations

import faulthandler
import os
import socket
import sys

import torch
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world_size: int, port: int, fn, args) -> None:
    faulthandler.enable(all_threads=True)  # a native abort still shows the Python stacks
    os.environ.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        LAYERSHARD_TIMEOUT_S="120",
    )
    torch.set_num_threads(1)
    import torch.distributed as dist

    import layershard as ls

    ls.init_distributed(backend="gloo")
    fn(rank, world_size, *args)
    # Every rank's last collective must be complete before any rank closes its sockets: gloo
    # aborts a peer whose connection closes with data in flight ("terminate called ...").
    dist.barrier()
    dist.destroy_process_group()
    # Skip the interpreter's teardown: static destructors of gloo's threads have aborted a rank
    # ("terminate called without an active exception") after every check had passed. Failures
    # above raise before this line and reach pytest as usual.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(fn, world_size: int, *args) -> None:
    """Call ``fn(rank, world_size, *args)`` on ``world_size`` gloo ranks; re-raise any failure."""
    mp.spawn(_entry, args=(world_size, free_port(), fn, args), nprocs=world_size, join=True)
