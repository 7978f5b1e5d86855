"""What each thread is blocked on, said by the code that blocks.

A rank stalled in a collective is reported by the watchdog of ``layershard train`` as "waiting in
the all-gather of unit layers.3 (backward)". The words come from here: every place where the
engine, the checkpoint code or the training loop blocks on other ranks wraps the wait in
``waiting("...")``; another thread reads the innermost label (and the outermost, for context)
of any thread with ``describe(thread_id)``, or of the whole process with ``innermost()``: on a
GPU autograd runs the backward hooks (and their waits) on its device thread while the training
thread waits inside ``backward()``, so what a rank waits for is the label set last by any
thread. Nothing is inferred from function names.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from collections.abc import Iterator

_labels: dict[int, list[tuple[int, str]]] = {}  # thread id -> (order set, label), outermost first
_order = itertools.count()  # next() is atomic under the GIL


@contextlib.contextmanager
def waiting(what: str) -> Iterator[None]:
    """Label the wait; a collective that times out inside it is raised again (same type)
    naming what this rank waited in, so a call made on some ranks only reads as that, not
    as a bare gloo/NCCL timeout."""
    stack = _labels.setdefault(threading.get_ident(), [])
    stack.append((next(_order), what))
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
    return _text(stack[-1], stack[0]) if stack else None


def innermost() -> tuple[int, str] | None:
    """What this process waits for, from the labels of every thread taken as one stack in the
    order they were set: the id of the thread holding the newest label, and ``"<newest>"`` or
    ``"<newest> during <oldest>"``; None when no thread waits."""
    labels = [(entry, ident) for ident, stack in _labels.copy().items() for entry in list(stack)]
    if not labels:
        return None
    (inner, ident), (outer, _) = max(labels), min(labels)
    return ident, _text(inner, outer)


def _text(inner: tuple[int, str], outer: tuple[int, str]) -> str:
    return inner[1] if inner[1] == outer[1] else f"{inner[1]} during {outer[1]}"
