"""Nodes on one machine: network namespaces joined through a router namespace by shaped links.

::

    node 0 (ns lstb<pid>-n0)          router (ns lstb<pid>-r)          node 1 (ns lstb<pid>-n1)
    lo: its local ranks               n0 --- forwards, and (delay      lo
    eth0 10.99.0.2 ---- veth ------>  n1     without netem) relays ---> eth0 10.99.1.2

Each node has its own loopback, on which its local ranks talk to each other (not shaped), and one
link to the router: a veth pair whose two ends are shaped alike (``tbf`` for the rate on each
end's egress, so each direction of a link carries at most the rate). A one-way delay, jitter and
loss are the kernel's ``netem`` on the node's end where the kernel has it. Where it does not (no
``CONFIG_NET_SCH_NETEM``), the router delays TCP instead: nftables redirects every TCP
connection that crosses it to a relay (``relay.py``) that forwards each direction's bytes after
the delay, and nftables drops the lost packets as they arrive at the router.

Note: nothing outlives its owner. Everything is named ``lstb<owner pid>-...``; a guard process
(``python -m layershard.testbed.guard``) deletes the namespaces and kills what runs in them once
the owner is gone, even after ``kill -9``; and a new testbed first removes those of owners that
are dead. Traffic never leaves the namespaces a testbed makes.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from layershard.testbed.links import Link

PREFIX = "lstb"
NET = "10.99"  # node k: 10.99.k.2, its router end 10.99.k.1 (private to the testbed's namespaces)
RELAY_PORT = 9  # the relay's port in the router namespace (discard's: nothing else uses it)
RELAY_START_S = 60.0  # how long the relay may take to start listening (a loaded machine)


class Unavailable(RuntimeError):
    """The testbed cannot run on this machine; the message says why, in one line."""


def _run(cmd: Sequence[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(list(cmd), capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)}: {(p.stderr or p.stdout).strip()}")
    return p


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@functools.cache
def _probe() -> tuple[str | None, bool, bool]:
    """(why the testbed cannot run at all or None, the kernel has netem, nft is installed)."""
    if os.name != "posix" or os.geteuid() != 0:
        return "the testbed needs root (ip netns, veth pairs, tc)", False, False
    missing = [t for t in ("ip", "tc") if shutil.which(t) is None]
    if missing:
        return (
            f"the testbed needs iproute2's {' and '.join(missing)} (apt install iproute2)",
            False,
            False,
        )
    ns = f"{PREFIX}{os.getpid()}-probe"
    made = _run(["ip", "netns", "add", ns], check=False)
    if made.returncode != 0:
        return f"network namespaces are not available here: {made.stderr.strip()}", False, False
    try:
        ok = _run(["ip", "-n", ns, "link", "add", "d0", "type", "dummy"], check=False)
        if ok.returncode != 0:  # no dummy driver: a veth pair
            _run(["ip", "-n", ns, "link", "add", "d0", "type", "veth", "peer", "name", "d1"])
        tbf = _run(["tc", "-n", ns, "qdisc", "add", "dev", "d0", "root", "tbf", "rate", "1mbit",
                    "burst", "32kb", "latency", "100ms"], check=False)  # fmt: skip
        if tbf.returncode != 0:
            return f"the kernel cannot shape a link (tc tbf: {tbf.stderr.strip()})", False, False
        _run(["tc", "-n", ns, "qdisc", "del", "dev", "d0", "root"], check=False)
        netem = _run(["tc", "-n", ns, "qdisc", "add", "dev", "d0", "root", "netem", "delay",
                      "1ms"], check=False).returncode == 0  # fmt: skip
    finally:
        _run(["ip", "netns", "del", ns], check=False)
    return None, netem, shutil.which("nft") is not None


def unavailable(link: Link | None = None) -> str | None:
    """Why a testbed with ``link`` cannot run here, in one line; None when it can."""
    why, netem, nft = _probe()
    if why is not None:
        return why
    if link is not None and (link.delay_s or link.loss) and not netem and not nft:
        return (
            "a link with delay or loss needs the kernel's netem (CONFIG_NET_SCH_NETEM), which "
            "this kernel lacks, or nftables for the testbed's relay (apt install nftables)"
        )
    return None


def cleanup_stale() -> list[str]:
    """Remove the namespaces and links of testbeds whose owner is gone; returns their names."""
    removed = []
    names = _run(["ip", "netns", "list"], check=False).stdout.split()
    for name in names:
        owner = _owner(name)
        if owner is not None and not _alive(owner):
            _delete_namespace(name)
            removed.append(name)
    for line in _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines():
        dev = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        owner = _owner(dev)
        if owner is not None and not _alive(owner):
            _run(["ip", "link", "del", dev], check=False)
            removed.append(dev)
    return removed


def _owner(name: str) -> int | None:
    if not name.startswith(PREFIX):
        return None
    digits = ""
    for ch in name[len(PREFIX) :]:
        if not ch.isdigit():
            break
        digits += ch
    return int(digits) if digits else None


def _delete_namespace(name: str) -> None:
    """Kill every process in namespace ``name``, then delete it (with its links and qdiscs)."""
    for _ in range(3):
        pids = _run(["ip", "netns", "pids", name], check=False).stdout.split()
        if not pids:
            break
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(pid), signal.SIGKILL)
        time.sleep(0.1)
    _run(["ip", "netns", "del", name], check=False)


def testbed_namespaces() -> list[str]:
    """Every testbed namespace on the machine (any owner)."""
    return [n for n in _run(["ip", "netns", "list"], check=False).stdout.split()
            if n.startswith(PREFIX)]  # fmt: skip


class Testbed:
    """``nodes`` namespaces joined by ``link`` (``links.py``). A context manager: set up on enter,
    torn down on exit, and by the guard if the owner dies first."""

    def __init__(self, nodes: int, link: Link) -> None:
        if nodes < 1:
            raise ValueError(f"a testbed needs at least one node, not {nodes}")
        self.nodes, self.link = nodes, link
        self.tag = f"{PREFIX}{os.getpid()}"
        self.router = f"{self.tag}-r"
        self.namespaces = [f"{self.tag}-n{k}" for k in range(nodes)]
        self.relayed = False  # delay by the userspace relay (no netem)
        self._relay: subprocess.Popen | None = None
        self._relay_log: Path | None = None
        self._guard: subprocess.Popen | None = None

    # ---- addresses and commands ---------------------------------------------------------------
    def ip(self, node: int) -> str:
        return f"{NET}.{node}.2"

    def env(self, node: int) -> dict[str, str]:
        """What a process in ``node`` needs to reach the others: gloo bound to the node's link,
        the master (torchrun's store) on node 0."""
        return {"GLOO_SOCKET_IFNAME": "eth0", "MASTER_ADDR": self.ip(0)}

    def command(self, node: int, cmd: Sequence[str]) -> list[str]:
        """``cmd`` run inside ``node``'s namespace."""
        return ["ip", "netns", "exec", self.namespaces[node], *cmd]

    def popen(self, node: int, cmd: Sequence[str], env: dict | None = None, **kw):
        full = {**os.environ, **(env or {}), **self.env(node)}
        return subprocess.Popen(self.command(node, cmd), env=full, **kw)

    def bytes_sent(self) -> list[int]:
        """What each node has sent over its link so far (its ``eth0``'s counter)."""
        out = []
        for ns in self.namespaces:
            info = json.loads(_run(["ip", "-j", "-s", "-n", ns, "link", "show", "eth0"]).stdout)
            out.append(int(info[0]["stats64"]["tx"]["bytes"]))
        return out

    def set_link(self, node: int, up: bool) -> None:
        """Take ``node``'s link down (both ends: nothing passes) or bring it back up."""
        state = "up" if up else "down"
        _run(["ip", "-n", self.router, "link", "set", f"n{node}", state])
        _run(["ip", "-n", self.namespaces[node], "link", "set", "eth0", state])
        if up:  # the default route goes with the link: restore it
            _run(["ip", "-n", self.namespaces[node], "route", "replace", "default", "via",
                  f"{NET}.{node}.1"])  # fmt: skip

    # ---- life -----------------------------------------------------------------------------------
    def __enter__(self) -> Testbed:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> None:
        why = unavailable(self.link)
        if why is not None:
            raise Unavailable(why)
        cleanup_stale()
        _, netem, _ = _probe()
        self.relayed = bool(self.link.delay_s or self.link.loss) and not netem
        self._guard = subprocess.Popen(
            [sys.executable, "-m", "layershard.testbed.guard", str(os.getpid()), self.tag],
            start_new_session=True, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        try:
            self._build(netem)
        except BaseException:
            self.stop()
            raise

    def _build(self, netem: bool) -> None:
        r = self.router
        _run(["ip", "netns", "add", r])
        _run(["ip", "-n", r, "link", "set", "lo", "up"])
        _run(["ip", "netns", "exec", r, "sh", "-c", "echo 1 > /proc/sys/net/ipv4/ip_forward"])
        for k, ns in enumerate(self.namespaces):
            a, b = f"{self.tag}v{k}a", f"{self.tag}v{k}b"
            _run(["ip", "netns", "add", ns])
            _run(["ip", "-n", ns, "link", "set", "lo", "up"])
            _run(["ip", "link", "add", a, "type", "veth", "peer", "name", b])
            _run(["ip", "link", "set", a, "netns", ns])
            _run(["ip", "link", "set", b, "netns", r])
            _run(["ip", "-n", ns, "link", "set", a, "name", "eth0"])
            _run(["ip", "-n", r, "link", "set", b, "name", f"n{k}"])
            _run(["ip", "-n", ns, "addr", "add", f"{self.ip(k)}/24", "dev", "eth0"])
            _run(["ip", "-n", r, "addr", "add", f"{NET}.{k}.1/24", "dev", f"n{k}"])
            _run(["ip", "-n", ns, "link", "set", "eth0", "up"])
            _run(["ip", "-n", r, "link", "set", f"n{k}", "up"])
            _run(["ip", "-n", ns, "route", "add", "default", "via", f"{NET}.{k}.1"])
            self._shape(ns, "eth0", netem and not self.relayed)
            self._shape(r, f"n{k}", False)
        if self.relayed:
            self._start_relay()

    def _shape(self, ns: str, dev: str, with_netem: bool) -> None:
        link = self.link
        tbf = []
        if link.rate_bps is not None:
            rate = max(int(link.rate_bps), 8000)
            burst = max(rate // 8 // 100, 16 * 1514)  # ~10 ms of the rate, at least 16 frames
            tbf = ["tbf", "rate", f"{rate}bit", "burst", str(burst), "latency", "1s"]
        if with_netem and (link.delay_s or link.jitter_s or link.loss):
            netem = ["netem", "limit", "100000", "delay", f"{link.delay_s * 1e6:.0f}us"]
            if link.jitter_s:
                netem += [f"{link.jitter_s * 1e6:.0f}us"]
            if link.loss:
                netem += ["loss", f"{link.loss * 100:.4f}%"]
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "handle", "1:", *netem])
            if tbf:
                _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "parent", "1:1", "handle",
                      "10:", *tbf])  # fmt: skip
        elif tbf:
            _run(["tc", "-n", ns, "qdisc", "add", "dev", dev, "root", *tbf])

    def _start_relay(self) -> None:
        link, r = self.link, self.router
        rules = [
            "table ip lstb {",
            "  chain pre {",
            "    type nat hook prerouting priority dstnat; policy accept;",
            f"    ip protocol tcp redirect to :{RELAY_PORT}",
            "  }",
        ]
        if link.loss:
            threshold = int(link.loss * 1_000_000)
            rules += [
                "  chain lossy {",
                "    type filter hook prerouting priority raw; policy accept;",
                f"    numgen random mod 1000000 < {threshold} drop",
                "  }",
            ]
        rules.append("}")
        p = subprocess.run(["ip", "netns", "exec", r, "nft", "-f", "-"], input="\n".join(rules),
                           capture_output=True, text=True)  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"nft in the testbed's router: {p.stderr.strip()}")
        log = self._relay_log = Path(tempfile.gettempdir()) / f"{self.tag}-relay.log"
        self._relay = subprocess.Popen(
            ["ip", "netns", "exec", r, sys.executable, "-m", "layershard.testbed.relay",
             "--port", str(RELAY_PORT), "--delay", str(link.delay_s),
             "--jitter", str(link.jitter_s)],
            stdout=log.open("w"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
        )  # fmt: skip
        # The relay imports layershard (and so torch): seconds on an idle machine, more than
        # ten on a loaded one, where a count of tries ran out before it listened.
        deadline = time.monotonic() + RELAY_START_S
        while time.monotonic() < deadline:  # listening?
            ss = _run(["ip", "netns", "exec", r, "ss", "-ltn"], check=False).stdout
            if f":{RELAY_PORT} " in ss:
                return
            if self._relay.poll() is not None:
                raise RuntimeError(f"the testbed's relay exited: {log.read_text()[-2000:]}")
            time.sleep(0.05)
        raise RuntimeError(
            f"the testbed's relay did not start listening in {RELAY_START_S:.0f} s ({log})"
        )

    def stop(self) -> None:
        """Kill what runs in the namespaces, delete them; end the relay and the guard."""
        if self._relay is not None and self._relay.poll() is None:
            self._relay.kill()
            self._relay.wait()
        if self._relay_log is not None:
            self._relay_log.unlink(missing_ok=True)
        for ns in [*self.namespaces, self.router]:
            _delete_namespace(ns)
        for k in range(self.nodes):  # a veth left in the root namespace by a failed setup
            _run(["ip", "link", "del", f"{self.tag}v{k}a"], check=False)
        if self._guard is not None and self._guard.poll() is None:
            self._guard.terminate()
            self._guard.wait()
