"""The on-disk cache (trained tokenizers, tokenized corpora) and how concurrent launches share it.

Several launchers may prepare the same corpus at once: the nodes of one job on a shared file
system, or two runs started together. Each cache entry is built by exactly one of them, under an
exclusive lock, in a temporary folder that is renamed into place when complete; the others wait
for the lock and then find the finished entry. A half-written entry never has the final name.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def cache_dir() -> Path:
    """``$LAYERSHARD_CACHE``, default ``~/.cache/layershard`` (absolute)."""
    root = os.environ.get("LAYERSHARD_CACHE") or Path.home() / ".cache" / "layershard"
    return Path(os.path.abspath(root))


def whoami() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


@contextmanager
def exclusive(lock_path: Path, what: str) -> Iterator[None]:
    """Hold an exclusive lock on ``lock_path`` for the block; if another process holds it, say
    who (once, on stderr) and wait. POSIX record locks (``lockf``) are released by the kernel when
    their process dies, and work across the nodes of an NFS mount, which ``flock`` may not."""
    lock_path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(lock_path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 200, 0).decode(errors="replace").strip() or "another process"
            print(
                f"waiting for {holder}, which is {what} ({lock_path})", file=sys.stderr, flush=True
            )
            fcntl.lockf(fd, fcntl.LOCK_EX)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{whoami()} since {time.strftime('%H:%M:%S')}".encode(), 0)
        yield
    finally:
        os.close(fd)  # releases the lock; the file stays (removing it would race with waiters)


def scratch_dir(final: Path) -> Path:
    """A fresh temporary folder beside ``final`` (same file system, so the rename is atomic),
    named so that ``remove_stale_scratch`` finds it if this process dies."""
    tmp = final.with_name(f".{final.name}.tmp-{socket.gethostname()}-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    return tmp


def remove_stale_scratch(final: Path) -> None:
    """Remove the temporary folders of earlier attempts at ``final``. Call only while holding
    its lock: then no other process is writing one."""
    for stale in final.parent.glob(f".{final.name}.tmp-*"):
        shutil.rmtree(stale, ignore_errors=True)


def publish(tmp: Path, final: Path) -> None:
    """Move a completed entry into place in one rename (``final`` must not exist)."""
    for f in tmp.iterdir():  # the data reaches the disk before the name does
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    os.rename(tmp, final)
