"""What each thread is blocked on, said by the code that blocks.

A rank stalled in a collective is reported by the watchdog of ``layershard train`` as "waiting in
the all-gather of unit layers.3 (backward)". The words come from here: every place where the
engine, the checkpoint code or the training loop blocks on other ranks wraps the wait in
``waiting("...")``; another thread reads the innermost label (and the outermost, for context)
of any thread with ``describe(thread_id)``. Nothing is inferred from function names.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

_labels: dict[int, list[str]] = {}  # thread id -> labels, outermost first


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    stack = _labels.setdefault(threading.get_ident(), [])
    stack.append(what)
    try:
        yield
    finally:
        stack.pop()


def describe(thread_id: int) -> str | None:
    """``"<innermost>"``, or ``"<innermost> during <outermost>"``; None when not waiting."""
    stack = list(_labels.get(thread_id, ()))  # a copy: the owner may push or pop meanwhile
    if not stack:
        return None
    inner, outer = stack[-1], stack[0]
    return inner if inner == outer else f"{inner} during {outer}"
