"""What `layershard train`'s watchdog says about a rank that waits in another thread than the
main one. On a GPU autograd runs the backward hooks (the engine's backward all-gathers and
reduce-scatters, each wrapped in ``waiting(...)``) on its device thread, while the training
thread waits inside ``loss.backward()``: the label is set on the device thread."""

from __future__ import annotations

import contextlib
import json
import threading

import torch.distributed as dist

from layershard.engine.waits import waiting
from layershard.train.loop.faults import Watchdog


def _watch_while(hold: list[str], device_label: str) -> tuple[str, str]:
    """Run a watchdog (stall after 0.2 s) while the main thread holds the labels ``hold`` and
    waits, as in ``loss.backward()``, for a "device thread" blocked inside
    ``waiting(device_label)``; return its first stall report and its heartbeat's position."""
    store = dist.HashStore()
    entered, release, reported = threading.Event(), threading.Event(), threading.Event()
    reports: list[str] = []

    def device_thread() -> None:
        with waiting(device_label):
            entered.set()
            release.wait(60)

    def report(text: str) -> None:
        reports.append(text)
        reported.set()

    dog = Watchdog(store, rank=0, world=1, stall_s=0.2, progress=lambda: (7, 42), report=report)
    device = threading.Thread(target=device_thread, name="autograd-device", daemon=True)
    with contextlib.ExitStack() as held:
        for label in hold:
            held.enter_context(waiting(label))
        device.start()
        held.callback(device.join, 60)
        held.callback(release.set)
        assert entered.wait(60)
        dog.start()
        held.callback(dog.stop)
        assert reported.wait(60), "the watchdog never reported the stall"
        heartbeat = json.loads(store.get("hb/0"))
    return reports[0], heartbeat["where"]


def test_a_wait_in_autograds_device_thread_is_reported_with_its_label():
    label = "all-gather of unit layers.3 (backward)"
    first, where = _watch_while([], label)
    assert f"at step 7, collective #42: waiting in the {label}" in first, first
    assert where.startswith(label), where


def test_the_innermost_label_of_any_thread_is_reported_with_the_outermost():
    """The training thread's own label came first (outer), the device thread's later (inner)."""
    outer, inner = "checkpoint save", "all-reduce of the gradient norm"
    first, where = _watch_while([outer], inner)
    assert f"waiting in the {inner} during {outer}" in first, first
    assert where.startswith(f"{inner} during {outer}"), where
