"""``python -m layershard.testbed.guard OWNER_PID TAG``: once process OWNER_PID is gone, delete the
namespaces named ``TAG-...`` and kill what runs in them (the testbed's promise that a killed run
leaves nothing behind: netns.py). Started in a session of its own, so that a signal to the
owner's process group does not reach it."""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

from layershard.testbed.netns import _alive, _delete_namespace, _run, testbed_namespaces


def main() -> None:
    owner, tag = int(sys.argv[1]), sys.argv[2]
    while _alive(owner):
        time.sleep(0.25)
    for name in testbed_namespaces():
        if name.startswith(f"{tag}-"):
            _delete_namespace(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if dev.startswith(tag):
            _run(["ip", "link", "del", dev], check=False)
    (Path(tempfile.gettempdir()) / f"{tag}-relay.log").unlink(missing_ok=True)


if __name__ == "__main__":
    main()
