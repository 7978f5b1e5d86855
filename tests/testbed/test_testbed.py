"""The testbed (layershard/testbed/): nodes as network namespaces joined by shaped links.

Its setup and teardown, also after ``kill -9`` of its owner; a 2-node `layershard train` over a
shaped link against the same run on one node (bit for bit); and a link that goes down mid-run:
every rank says which peer it lost, and ``--resume`` continues exactly once the link is back.
Skipped, with the one line the testbed gives, where it cannot run (not root, no ``ip``/``tc``, no
network namespaces, a delay with neither netem nor nftables).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from test_multinode import COMMON, ONE, _same_weights, _val, cache, reference  # noqa: F401
from test_train_faults import SITE, losses

from layershard.testbed import links, netns

WHY = netns.unavailable(links.Link(1e6, 1e-3))
needs_testbed = pytest.mark.skipif(WHY is not None, reason=WHY or "")
ROOT = Path(__file__).resolve().parents[2]
WAIT_S = 240  # any launch here ends well under this


def test_links_parse_and_presets() -> None:
    link = links.parse("200mbit,1ms")
    assert (link.rate_bps, link.delay_s, link.jitter_s, link.loss) == (200e6, 1e-3, 0.0, 0.0)
    link = links.parse("1gbit,100us,20us,1%")
    assert (link.rate_bps, link.loss) == (1e9, 0.01)
    assert (link.delay_s, link.jitter_s) == pytest.approx((1e-4, 2e-5))
    assert links.parse("inf,5ms").rate_bps is None
    # a preset keeps bytes per FLOP: a CPU computing 1/1000 of an H100 gets 1/1000 of its link,
    # and waits 1000 times as long per message
    ib = links.preset("h100-ib400", cpu_flops=989e9)
    assert ib.rate_bps == pytest.approx(400e6) and ib.delay_s == pytest.approx(5e-3)
    assert links.parse("a100-ib200", cpu_flops=312e9).rate_bps == pytest.approx(200e6)
    for bad, says in (("fast", "a number with a unit"), ("1mbit,2", "a number with a unit"),
                      ("1mbit,1ms,2ms", "larger than the delay"), ("1mbit,1ms,0ms,5", "percent"),
                      ("h100-ib800", "unknown link preset")):  # fmt: skip
        with pytest.raises(ValueError, match=says):
            links.parse(bad, cpu_flops=1e11)


_SERVER = """
import socket
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", 5555)); s.listen(1); print("listening", flush=True)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    d = c.recv(1 << 16)
    if not d:
        break
    if d == b"p":
        c.sendall(b"p")
    elif d.endswith(b"E"):
        c.sendall(b"ok")
"""

_CLIENT = """
import socket, sys, time
s = socket.create_connection((sys.argv[1], 5555)); s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtt = []
for _ in range(5):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtt.append(time.perf_counter() - t)
n = 1_500_000
t = time.perf_counter(); s.sendall(b"x" * (n - 1) + b"E"); s.recv(2)
print(min(rtt), n * 8 / (time.perf_counter() - t))
"""


@needs_testbed
def test_a_testbed_shapes_its_links_and_leaves_nothing() -> None:
    """40 Mbit/s with 5 ms each way: no round trip shorter than 10 ms, no transfer faster than
    the rate (TCP's headers are on top); loopback inside a node unshaped; nothing of it remains
    after the exit."""
    link = links.parse("40mbit,5ms")
    with netns.Testbed(2, link) as tb:
        server = tb.popen(1, [sys.executable, "-c", _SERVER], stdout=subprocess.PIPE, text=True)
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"
        out = subprocess.run(tb.command(0, [sys.executable, "-c", _CLIENT, tb.ip(1)]),
                             capture_output=True, text=True, timeout=60)  # fmt: skip
        assert out.returncode == 0, out.stderr
        rtt, bits_per_s = map(float, out.stdout.split())
        assert rtt >= 2 * link.delay_s, rtt
        assert bits_per_s <= 1.05 * link.rate_bps, bits_per_s
        server.kill()
        tag = tb.tag
    assert not [n for n in netns.testbed_namespaces() if n.startswith(tag)]
    assert tag not in subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout


_OWNER = """
import os, sys, time
from layershard.testbed import links, netns
tb = netns.Testbed(2, links.parse("10mbit,2ms")); tb.start()
print(tb.tag, tb._guard.pid, flush=True)
time.sleep(120)
"""


def _owner() -> tuple[subprocess.Popen, str, int]:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"),
                                                      os.environ.get("PYTHONPATH", "")]))  # fmt: skip
    p = subprocess.Popen([sys.executable, "-c", _OWNER], stdout=subprocess.PIPE, text=True, env=env)
    assert p.stdout is not None
    tag, guard = p.stdout.readline().split()
    return p, tag, int(guard)


def _left(tag: str, within: float) -> list[str]:
    deadline = time.monotonic() + within
    while (left := [n for n in netns.testbed_namespaces() if n.startswith(f"{tag}-")]) and (
        time.monotonic() < deadline
    ):
        time.sleep(0.1)
    return left


@needs_testbed
def test_a_killed_owner_leaves_nothing_and_a_new_testbed_finds_none() -> None:
    """``kill -9`` of the process that made a testbed: its guard removes the namespaces, the
    links and the relay. With the guard killed too, the next testbed removes them first."""
    owner, tag, _ = _owner()
    assert len(netns.testbed_namespaces()) >= 3
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert _left(tag, within=15) == []
    owner, tag, guard = _owner()
    os.kill(guard, signal.SIGKILL)
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    assert len(_left(tag, within=1)) == 3  # nobody cleaned up
    with netns.Testbed(1, links.parse("10mbit")):
        # the dead owner's are gone (a live owner's, another run's, are not this one's to remove)
        assert not [n for n in netns.testbed_namespaces() if n.startswith(f"{tag}-")]
    assert not [n for n in netns.testbed_namespaces() if n.startswith(f"{tag}-")]


def _node_env(cache_dir: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_TEST_")}
    env.update(LAYERSHARD_CACHE=cache_dir, **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), str(ROOT / "src"), env.get("PYTHONPATH", "")])
    return env


def _train_on(tb, run: Path, cache_dir: str, extra=(), env=None, log: Path | None = None):
    """`layershard train` on every node of ``tb``: one rank each, the rendezvous on node 0."""
    argv = [*ONE, *COMMON, "--run-dir", str(run), "--nnodes", str(tb.nodes),
            "--rdzv-endpoint", f"{tb.ip(0)}:29400", *extra]  # fmt: skip
    procs = []
    for k in range(tb.nodes):
        out = open(f"{log or run}.node{k}", "w")  # noqa: SIM115 - closed with the process
        cmd = [sys.executable, "-m", "layershard", "train", *argv, "--node-rank", str(k)]
        procs.append(tb.popen(k, cmd, env=_node_env(cache_dir, **(env or {})), stdout=out,
                              stderr=subprocess.STDOUT, text=True))  # fmt: skip
        procs[-1].log = out.name  # what _wait shows of a node that did not finish
    return procs


def _wait(procs, timeout: float = WAIT_S) -> list[int]:
    deadline = time.monotonic() + timeout
    codes = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(1.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            tails = [Path(q.log).read_text()[-1500:] for q in procs if hasattr(q, "log")]
            pytest.fail(f"a node did not finish in {timeout:.0f} s; their output ends: {tails}")
    return codes


@needs_testbed
@pytest.mark.slow
@pytest.mark.parametrize("link", ["100mbit,2ms", "100mbit,2ms,0ms,1%"], ids=["clean", "lossy"])
def test_two_nodes_over_a_shaped_link_train_as_one_node(tmp_path, reference, cache, link) -> None:  # noqa: F811
    """2 nodes x 1 rank over 100 Mbit/s links with 2 ms each way, and with 1% of the packets
    lost too: the final weights, losses and validation of 1 node x 2 ranks, bit for bit (the same
    ranks, slower wires; TCP resends what is lost). The time each took is printed."""
    run = tmp_path / "run"
    with netns.Testbed(2, links.parse(link)) as tb:
        t0 = time.monotonic()
        procs = _train_on(tb, run, cache)
        codes = _wait(procs)
        print(f"2 nodes over {link}: {time.monotonic() - t0:.1f} s")
    logs = [Path(f"{run}.node{k}").read_text() for k in range(2)]
    assert codes == [0, 0], [log[-3000:] for log in logs]
    _same_weights(run, reference)
    assert losses(run) == losses(reference)
    assert _val(run) == _val(reference)


@needs_testbed
@pytest.mark.slow
def test_link_down_names_the_lost_peer_then_resume_continues_exactly(
    tmp_path,
    reference,  # noqa: F811
    cache,  # noqa: F811
) -> None:
    """Node 1's link goes down after step 3 (both ends, nothing passes). Each node's launcher
    ends within the collective timeout and says in one line which peer it lost; with the link
    back, ``--resume`` on both nodes ends with the uninterrupted run's weights, bit for bit."""
    run, mark = tmp_path / "run", tmp_path / "mark"
    fault = {"LS_TEST_FAULT": "mark@3:0", "LS_TEST_MARK": str(mark), "LAYERSHARD_TIMEOUT_S": "20"}
    with netns.Testbed(2, links.parse("100mbit,1ms")) as tb:
        procs = _train_on(tb, run, cache, env=fault, log=tmp_path / "first")
        deadline = time.monotonic() + WAIT_S
        while not mark.exists():
            assert time.monotonic() < deadline, "step 3 never came"
            assert all(p.poll() is None for p in procs), "a node ended before step 3"
            time.sleep(0.1)
        tb.set_link(1, up=False)
        t0 = time.monotonic()
        Path(f"{mark}.go").touch()
        codes = _wait(procs)
        took = time.monotonic() - t0
        logs = [Path(f"{tmp_path / 'first'}.node{k}").read_text() for k in range(2)]
        assert all(c != 0 for c in codes), (codes, [log[-2000:] for log in logs])
        print(f"the nodes ended {took:.1f} s after the link went down (timeout 20 s)")
        for k, log in enumerate(logs):  # one line, naming the other node and its address
            last = [ln for ln in log.strip().splitlines() if not ln.startswith("train:")][-1]
            print(f"node {k}: {last}")
            lost = rf"node {k} lost contact with node {1 - k} \(.*{re.escape(tb.ip(1 - k))}"
            assert re.search(lost, last), (k, last)
            assert "network between the nodes failed" in last and "--resume" in last, last
        tb.set_link(1, up=True)
        procs = _train_on(tb, run, cache, extra=["--resume"], log=tmp_path / "resumed")
        codes = _wait(procs)
        logs = [Path(f"{tmp_path / 'resumed'}.node{k}").read_text() for k in range(2)]
        assert codes == [0, 0], [log[-3000:] for log in logs]
    _same_weights(run, reference)
