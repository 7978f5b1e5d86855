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
    """Label the wait; a collective that times out inside it is raised again (same type)
    naming what this rank waited in, so a call made on some ranks only reads as that, not
    as a bare gloo/NCCL timeout."""
    stack = _labels.setdefault(threading.get_ident(), [])
    stack.append(what)
    try:
        yield
    except RuntimeError as e:
        if not _is_timeout(e) or getattr(e, "_layershard_named", False):
            raise
        where = describe(threading.get_ident()) or what
        msg = (
            f"timed out waiting in {where}: another rank did not reach the same collective "
            "(every rank must make the same calls on the model, in the same order; a rank "
            f"that died or lags shows the same). Original error: {e}"
        )
        try:
            named = type(e)(msg)
        except TypeError:  # an exception type that takes other arguments
            named = RuntimeError(msg)
        named._layershard_named = True  # type: ignore[attr-defined]
        raise named from e
    finally:
        stack.pop()


def _is_timeout(e: RuntimeError) -> bool:
    text = str(e).lower()
    return "timed out" in text or "timeout" in text


def describe(thread_id: int) -> str | None:
    """``"<innermost>"``, or ``"<innermost> during <outermost>"``; None when not waiting."""
    stack = list(_labels.get(thread_id, ()))  # a copy: the owner may push or pop meanwhile
    if not stack:
        return None
    inner, outer = stack[-1], stack[0]
    return inner if inner == outer else f"{inner} during {outer}"
