"""Many nodes on one machine: two `layershard train` launchers, one per simulated node, meeting at a
rendezvous on 127.0.0.1 and sharing one run folder (and here one cache), as nodes share a file
system. One rank per node, so that two nodes cost what one node of two ranks does.

Every launch is bounded in time (`_wait`): a hang fails the test, it never stalls CI. Faults are
injected by tests/faults_site/sitecustomize.py (see there): a node SIGKILLs its launcher, agent
and rank after a step; a `kill -9` of `layershard train`; an elastic node waits at a step until a
new node has joined. Each run is compared with one uninterrupted run of one node and two ranks.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from test_train_faults import SITE, TINY, final_weights, losses, processes_using, train_main

from layershard.train import status as st
from layershard.train.loop.report import read_metrics

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

# The same model, data and global batch as test_train_faults' reference (8 steps, checkpoints
# every 2), one rank per node; --batch-tokens keeps the global batch at every world size.
ONE = list(TINY)
ONE[ONE.index("--nproc-per-node") + 1] = "1"
COMMON = ["--checkpoint-interval", "2", "--batch-tokens", "512"]
WAIT_S = 240  # any launch here ends in well under this, even on a busy 2-core machine

# Loss tolerance where the world size changes within a run: the same windows of the global batch
# summed in another order (2 micro-batches on 1 rank against 1 on each of 2), as
# test_train_faults' micro-batch split (rel 1e-5, on the same model and steps).
LOSS_REL = 1e-5


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _env(cache: str, node: int, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("LS_TEST_")}
    env.update(LAYERSHARD_CACHE=cache, LS_TEST_NODE=str(node), **extra)
    env["PYTHONPATH"] = os.pathsep.join([str(SITE), os.environ.get("PYTHONPATH", "")])
    return env


class Node:
    """One simulated node: `layershard train ... --node-rank K`, output in files."""

    def __init__(self, tmp: Path, k: int, argv: list[str], env: dict[str, str], tag: str = ""):
        self.k, self.log = k, tmp / f"node{k}{tag}"
        cmd = [sys.executable, "-m", "layershard", "train", *argv, "--node-rank", str(k)]
        self.out, self.err = open(f"{self.log}.out", "w"), open(f"{self.log}.err", "w")  # noqa: SIM115
        self.proc = subprocess.Popen(cmd, env=env, stdout=self.out, stderr=self.err, text=True)

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            pytest.fail(
                f"node {self.k} did not finish in {timeout:.0f} s:\n{self.stderr()[-3000:]}"
            )
        finally:
            self.out.flush()
            self.err.flush()

    def stdout(self) -> str:
        return Path(f"{self.log}.out").read_text()

    def stderr(self) -> str:
        return Path(f"{self.log}.err").read_text()

    def last_line(self) -> str:
        lines = [x for x in self.stderr().strip().splitlines() if not x.startswith("train:")]
        return lines[-1] if lines else ""


def _nodes(tmp, run, cache, nnodes, extra=(), env=None, only=(0, 1), tag=""):
    port = _free_port()
    argv = [*ONE, *COMMON, "--run-dir", str(run), "--nnodes", nnodes,
            "--rdzv-endpoint", f"127.0.0.1:{port}", *extra]  # fmt: skip
    return [Node(tmp, k, argv, _env(cache, k, **(env or {})), tag) for k in only], argv


@pytest.fixture
def no_leftovers(tmp_path):
    """Whatever a test leaves running under its folder is killed (and fails the test)."""
    yield
    left = processes_using(tmp_path)
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            except OSError:
                continue
            if str(tmp_path) in cmd and int(d.name) != os.getpid():
                os.kill(int(d.name), signal.SIGKILL)
    assert not left, left


def nodes_cache_dir(tmp_path_factory) -> str:
    return str(tmp_path_factory.getbasetemp() / "ls-cache-nodes")


def one_node_run(tmp_path_factory) -> Path:
    """One node, two ranks, uninterrupted (made once a session: tests/conftest.py)."""
    run = tmp_path_factory.mktemp("ref") / "run"
    os.environ["LAYERSHARD_CACHE"] = nodes_cache_dir(tmp_path_factory)
    try:
        assert train_main([*TINY, *COMMON, "--run-dir", str(run)]) == 0
    finally:
        del os.environ["LAYERSHARD_CACHE"]
    return run


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return nodes_cache_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(nodes_reference) -> Path:
    """One node, two ranks, uninterrupted: the run this module's and tests/testbed's runs end
    like, made once for both (only read)."""
    return nodes_reference


def _val(run: Path) -> float:
    return [r["val_loss"] for r in read_metrics(run / "metrics.jsonl") if "val_loss" in r][-1]


def _same_weights(run: Path, reference: Path) -> None:
    a, b = final_weights(run), final_weights(reference)
    assert a.keys() == b.keys() and a
    for k in a:
        assert torch.equal(a[k], b[k]), k


def test_two_nodes_equal_one_node_prepare_once_and_write_each_file_once(
    tmp_path, reference, no_leftovers
):
    """2 nodes x 1 rank (static rendezvous) against 1 node x 2 ranks: the same ranks, so the
    same weights, bit for bit. The two launchers share a fresh cache: one trains the BPE and
    tokenizes, the other waits and reuses it. Each file of the run folder is written by the
    processes of one node only (every open for writing and rename, recorded by an audit hook)."""
    run, writes = tmp_path / "run", tmp_path / "writes.log"
    cache = str(tmp_path / "fresh-cache")
    nodes, _ = _nodes(tmp_path, run, cache, "2", env={"LS_TEST_WRITES": str(writes)})
    codes = [n.wait() for n in nodes]
    assert codes == [0, 0], [n.stderr()[-2000:] for n in nodes]
    out = [n.stdout() + n.stderr() for n in nodes]
    assert sum(o.count("trained a 512-token BPE") for o in out) == 1, out
    assert sum(len(re.findall(r"^tokenized ", o, re.M)) for o in out) == 1, out
    assert "on 2 ranks" in nodes[0].stdout()
    _same_weights(run, reference)
    assert losses(run) == losses(reference)
    assert _val(run) == _val(reference)

    by_file: dict[str, set[str]] = {}
    for line in writes.read_text().splitlines():
        node, _, path = line.split(" ", 2)
        if path.startswith(str(run) + os.sep) or path == str(run):
            by_file.setdefault(path, set()).add(node)
    shared = {p: n for p, n in by_file.items() if len(n) > 1}
    assert not shared, shared
    assert by_file[str(run / "config.yaml")] == {"0"}
    assert by_file[str(run / "launch.json")] == {"0"}
    # (tokenizer.json and the safetensors of final/ are written by Rust code, unseen by the hook)
    assert {"0", "1"} <= set().union(*by_file.values())  # each node's rank wrote its shards


def test_a_dead_node_is_named_then_resume_on_every_node_ends_like_uninterrupted(
    tmp_path, reference, cache, no_leftovers
):
    """Node 1 (its launcher, agent and rank) is SIGKILLed after step 3. Node 0 exits 1 within
    the collective timeout with one line naming the lost node and leaves no process; the same
    command with --resume on both nodes ends with the reference's weights, bit for bit."""
    run = tmp_path / "run"
    fault = {"LS_TEST_FAULT": "kill_node@3:1", "LAYERSHARD_TIMEOUT_S": "30"}
    nodes, argv = _nodes(tmp_path, run, cache, "2", env=fault)
    t0 = time.monotonic()
    assert nodes[1].wait() == -signal.SIGKILL
    assert nodes[0].wait(timeout=30 + 60) == 1, nodes[0].stderr()[-3000:]
    print(f"node 0 ended {time.monotonic() - t0:.1f} s after the launch (timeout 30 s)")
    assert nodes[0].last_line() == (
        "layershard train: error: node 1 (" + socket.gethostname() + ", rank 1) was lost at "
        "step 3 (the node died, or its launcher was killed); this node's ranks were stopped. "
        "Resume from step_000002: the same command with --resume, on every node"
    ), nodes[0].stderr()[-2000:]
    assert not processes_using(run)
    assert st.held_by(run) == ""

    again, _ = _nodes(tmp_path, run, cache, "2", extra=["--resume"], tag="-resume")
    assert [n.wait() for n in again] == [0, 0], [n.stderr()[-2000:] for n in again]
    assert "resumed at step 2" in again[0].stdout()
    _same_weights(run, reference)
    assert losses(run) == losses(reference)


def test_kill_9_of_layershard_train_stops_agent_and_ranks(tmp_path, reference, cache, no_leftovers):
    """`kill -9` of `layershard train` after step 3 (issue 26): torchrun's agent gets SIGTERM
    from the kernel (parent-death signal) and stops the ranks as on a scheduler's SIGTERM: they
    agree on a step, checkpoint and exit; no process is left, the run folder is free, and
    --resume ends with the reference's weights. On the old code the agent and ranks trained on
    headless to the end (final/ written), holding the run folder meanwhile."""
    run = tmp_path / "run"
    cmd = [sys.executable, "-m", "layershard", "train", *TINY, *COMMON, "--run-dir", str(run)]
    env = _env(cache, 0, LS_TEST_FAULT="kill_cli@3:0")
    assert subprocess.run(cmd, env=env, capture_output=True, timeout=WAIT_S).returncode == (
        -signal.SIGKILL
    )
    deadline = time.monotonic() + 90  # the agent waits up to 30 s for its ranks, then kills them
    while processes_using(run) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not processes_using(run)
    assert st.held_by(run) == ""
    stop = st.read_json(run / ".layershard" / "stop.json")
    assert stop is not None and stop["signal"] == "SIGTERM" and stop["step"] in (4, 5), stop
    assert not (run / "final").exists()

    os.environ["LAYERSHARD_CACHE"] = cache
    try:
        assert train_main(["--resume", "--run-dir", str(run), "--nproc-per-node", "2"]) == 0
    finally:
        del os.environ["LAYERSHARD_CACHE"]
    _same_weights(run, reference)
    assert losses(run) == losses(reference)


def test_elastic_a_node_leaves_then_joins_and_the_loss_curve_continues(
    tmp_path, reference, cache, no_leftovers
):
    """`--nnodes 1:2`: node 1 dies after step 3; node 0 restarts from the step-2 checkpoint
    alone, at world size 1 with 2 micro-batches per step (the same global batch), and holds
    after step 5 until node 1 comes back; then both continue from the checkpoint that the join's
    stop saves, at world size 2, to the end. No restart waits on a rank that is gone, and every
    step's loss is the uninterrupted run's within LOSS_REL."""
    run = tmp_path / "run"
    fault = {
        "LS_TEST_FAULT": "kill_node@3:1,hold@5:0:1",
        "LS_TEST_FAULT_BY_NODE": "1",
        "LAYERSHARD_TIMEOUT_S": "30",
    }
    elastic = ["--max-restarts", "3",
               "--rdzv-conf", "last_call_timeout=1"]  # fmt: skip
    nodes, argv = _nodes(tmp_path, run, cache, "1:2", extra=elastic, env=fault)
    assert nodes[1].wait() == -signal.SIGKILL
    deadline = time.monotonic() + 120
    while "resumed at step 2" not in nodes[0].stdout() and time.monotonic() < deadline:
        assert nodes[0].proc.poll() is None, nodes[0].stderr()[-3000:]
        time.sleep(0.5)
    joined = Node(tmp_path, 1, [*argv], _env(cache, 1), "-joined")
    assert nodes[0].wait() == 0, nodes[0].stderr()[-3000:]
    assert joined.wait() == 0, joined.stderr()[-3000:]

    # the first line of each round, from its rank 0 (on either node)
    printed = "".join(n.stdout() for n in (*nodes, joined))
    starts = sorted(re.findall(r"(\d) ranks, fp32, (\d) micro-batch\(es\).*?(?:resumed at step (\d+))?$",
                               printed, re.M))  # fmt: skip
    assert starts in (
        [("1", "2", "2"), ("2", "1", ""), ("2", "1", "6")],
        [("1", "2", "2"), ("2", "1", ""), ("2", "1", "5")],
    ), starts
    a, b = losses(reference), losses(run)
    assert sorted(b) == list(range(1, 9))
    for step in range(1, 9):
        assert b[step] == pytest.approx(a[step], rel=LOSS_REL), (step, a, b)
    assert _val(run) == pytest.approx(_val(reference), rel=LOSS_REL)
    assert not processes_using(run)


def test_hybrid_shards_within_a_node_and_replicates_across_nodes(tmp_path, no_leftovers):
    """Two nodes x 2 ranks, each node's ranks started by `layershard train`'s torchrun agent
    (`layershard.train.launch.agent`, static rendezvous on 127.0.0.1): `ls.shard(strategy="hybrid")`
    with the default shard size shards within each node (its LOCAL_WORLD_SIZE ranks) and
    replicates across the nodes; gathers and reduce-scatters run on the node's group only, one
    all-reduce per reduction across nodes; 3 AdamW steps match the single-process reference
    (tests/_nodes_hybrid.py). `layershard train --strategy` itself is not wired here."""
    port, script = _free_port(), Path(__file__).parents[1] / "_nodes_hybrid.py"
    procs = []
    for k in (0, 1):
        cmd = [sys.executable, "-m", "layershard.train.launch.agent", str(tmp_path), "--nnodes", "2",
               "--node-rank", str(k), "--rdzv-endpoint", f"127.0.0.1:{port}",
               "--nproc-per-node", "2", str(script), str(tmp_path)]  # fmt: skip
        env = dict(_env("", k), OMP_NUM_THREADS="1", LAYERSHARD_TIMEOUT_S="60")
        log = open(tmp_path / f"hybrid{k}.log", "w")  # noqa: SIM115
        procs.append((subprocess.Popen(cmd, env=env, stdout=log, stderr=log), log))
    for p, log in procs:
        try:
            rc = p.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            p.kill()
            rc = None
        log.close()
        assert rc == 0, Path(log.name).read_text()[-3000:]
    done = sorted(f.read_text().strip() for f in tmp_path.glob("rank*.ok"))
    assert done == [
        "node 0 shard [0, 1] replicate [0, 2]", "node 0 shard [0, 1] replicate [1, 3]",
        "node 1 shard [2, 3] replicate [0, 2]", "node 1 shard [2, 3] replicate [1, 3]",
    ], done  # fmt: skip


# ---- without processes: the launcher's options and the agent's rounds ---------------------------


def test_node_options_are_refused_before_launch(capsys, tmp_path):
    from _train import TINY as T
    from _train import refused_one_line

    one = list(T)
    one[one.index("--nproc-per-node") + 1] = "1"
    err = refused_one_line(capsys, tmp_path, *one, "--nnodes", "0")
    assert "--nnodes must be a number of nodes >= 1 or MIN:MAX (1 <= MIN <= MAX), got '0'" in err
    err = refused_one_line(capsys, tmp_path, *one, "--nnodes", "2:x")
    assert "--nnodes must be a number of nodes >= 1 or MIN:MAX" in err
    err = refused_one_line(capsys, tmp_path, *one, "--nnodes", "2", "--node-rank", "2")
    assert "--node-rank 2 must be below --nnodes 2" in err
    err = refused_one_line(capsys, tmp_path, *one, "--nnodes", "1:3", "--batch-tokens", "512")
    assert (
        "elastic --nnodes 1:3 can run at 3 ranks, where batch_tokens=512 is not a multiple" in err
    )


def test_torchrun_command_node_0_hosts_the_rendezvous_on_loopback():
    from layershard.train.launch.launcher import LaunchOptions, torchrun_command

    def conf(**kw):
        cmd = torchrun_command(Path("run"), LaunchOptions(nproc_per_node=1, **kw))
        i = cmd.index("--rdzv-conf") if "--rdzv-conf" in cmd else None
        backend = cmd[cmd.index("--rdzv-backend") + 1] if "--rdzv-backend" in cmd else None
        return backend, (cmd[i + 1] if i else None)

    ep = "127.0.0.1:29500"
    assert conf(nnodes="1:2", node_rank=0, rdzv_endpoint=ep) == (
        "c10d",
        "is_host=1,join_timeout=300",
    )
    assert conf(nnodes="1:2", node_rank=1, rdzv_endpoint=ep, rdzv_conf="last_call_timeout=2") == (
        "c10d",
        "is_host=0,last_call_timeout=2,join_timeout=300",
    )
    # static: node 0 hosts; --rdzv-timeout is torchrun's `timeout` (static) or `join_timeout`
    # (c10d; its `read_timeout`, how long a node tries to reach the store, when shorter than 60 s)
    assert conf(nnodes="2", node_rank=1, rdzv_endpoint=ep) == (None, "timeout=300")
    assert conf(nnodes="2", node_rank=1, rdzv_endpoint=ep, rdzv_timeout=7.5) == (None, "timeout=8")
    assert conf(nnodes="1:2", node_rank=1, rdzv_endpoint="node0:29500", rdzv_timeout=5) == (
        "c10d",
        "join_timeout=5,read_timeout=5",
    )
    assert conf(nnodes="2", rdzv_endpoint=ep, rdzv_conf="timeout=9") == (None, "timeout=9")


def test_the_nodes_settings_differences_name_each_key():
    from layershard.train.launch.rendezvous import differences

    a = {"seq_len": 64, "strategy": "full", "seed": 0}
    b = {"seq_len": 32, "strategy": "full", "seed": 0, "model_overrides.n_layers": 3}
    nodes = [{"node": 0, "settings": a}, {"node": 1, "settings": b}]
    assert differences(nodes) == (
        "seq_len (node 0: 64, node 1: 32); model_overrides.n_layers (node 0: unset, node 1: 3)"
    )
    assert differences([nodes[0], {"node": 1, "settings": dict(a)}]) == ""
    many = {f"k{i}": i for i in range(6)}
    text = differences([nodes[0], {"node": 1, "settings": {**a, **many}}])
    assert text.endswith("; k3 (node 0: unset, node 1: 3), and 2 more"), text


def test_nodes_started_with_different_settings_refuse_in_one_line(tmp_path, cache, no_leftovers):
    """Issue 35: node 0 with the defaults, node 1 with `--strategy grad_op --model-override
    n_layers=3 --seq-len 32`: both exited 0, node 1's settings silently dropped (its ranks read
    node 0's config.yaml). Now every node compares its settings at the rendezvous, and both
    refuse with exit 2 and the same line naming the keys, before any rank starts; node 0 takes
    back what it wrote, so the corrected commands start as if nothing happened."""
    run = tmp_path / "run"
    port = _free_port()
    common = [*ONE, *COMMON, "--run-dir", str(run), "--nnodes", "2",
              "--rdzv-endpoint", f"127.0.0.1:{port}"]  # fmt: skip
    odd = ["--strategy", "grad_op", "--model-override", "n_layers=3", "--seq-len", "32"]
    nodes = [Node(tmp_path, 0, common, _env(cache, 0)),
             Node(tmp_path, 1, [*common, *odd], _env(cache, 1))]  # fmt: skip
    assert [n.wait() for n in nodes] == [2, 2], [n.stderr()[-2000:] for n in nodes]
    expected = (
        "layershard train: error: the nodes were started with different settings: "
        "model_overrides.n_layers (node 0: 2, node 1: 3); seq_len (node 0: 64, node 1: 32); "
        "strategy (node 0: 'full', node 1: 'grad_op'); start the same command on every node "
        "(only --node-rank differs)"
    )
    for n in nodes:
        assert n.stderr().strip().splitlines()[-1] == expected, n.stderr()[-2000:]
        assert "Traceback" not in n.stderr() and "rank" not in n.stdout().replace("node-rank", "")
    assert not run.exists()


def test_a_node_that_cannot_see_node_0s_run_folder_refuses_in_one_line(
    tmp_path, cache, no_leftovers
):
    """Node 1 started with another --run-dir (as a node with the same path on a disk of its own
    would be): its ranks died with a FileNotFoundError traceback (launch.json). Now the nodes
    compare what they see at the rendezvous and both refuse in one line before any rank
    starts; node 0 takes back what it wrote."""
    port = _free_port()
    common = [*ONE, *COMMON, "--nnodes", "2", "--rdzv-endpoint", f"127.0.0.1:{port}"]
    run, elsewhere = tmp_path / "run", tmp_path / "elsewhere"
    nodes = [Node(tmp_path, 0, [*common, "--run-dir", str(run)], _env(cache, 0)),
             Node(tmp_path, 1, [*common, "--run-dir", str(elsewhere)], _env(cache, 1))]  # fmt: skip
    assert [n.wait() for n in nodes] == [2, 2], [n.stderr()[-2000:] for n in nodes]
    expected = (
        f"layershard train: error: node 1 cannot see the run folder node 0 wrote ({run}/"
        "launch.json): every node must see the same run folder, at the same path, on storage "
        "they share (NFS, Lustre, ...); pass that --run-dir on every node"
    )
    for n in nodes:
        assert n.stderr().strip().splitlines()[-1] == expected, n.stderr()[-2000:]
        assert "Traceback" not in n.stderr()
    assert not run.exists() and not elsewhere.exists()


def test_an_unreachable_rendezvous_is_one_line_naming_the_endpoint(tmp_path, cache, no_leftovers):
    """Issue 35: a node pointed at a rendezvous nobody hosts printed ~30 lines of C++ frames,
    ended with "the training ranks failed" though no rank started, and waited torch's 600 s.
    `--rdzv-timeout` bounds the wait; node 1 says which endpoint it could not reach, node 0
    alone says that the other nodes did not join; one line each, exit 1, nothing left behind."""
    lone = {}
    for k in (0, 1):
        port = _free_port()
        argv = [*ONE, *COMMON, "--run-dir", str(tmp_path / f"run{k}"), "--nnodes", "2",
                "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-timeout", "3"]  # fmt: skip
        lone[k] = (Node(tmp_path, k, argv, _env(cache, k)), port)
    for k, (n, port) in lone.items():
        assert n.wait(timeout=120) == 1, n.stderr()[-2000:]
        err = [x for x in n.stderr().strip().splitlines() if not x.startswith("train:")]
        assert len(err) == 1, err
        ep = f"127.0.0.1:{port}"
        if k == 1:
            assert err[0].startswith(f"layershard train: error: node 1 could not reach the "
                                     f"rendezvous at {ep} within 3 s: start node 0"), err  # fmt: skip
        else:
            assert err[0].startswith(f"layershard train: error: node 0: the other nodes did not "
                                     f"join the rendezvous at {ep} within 3 s (1 of 2 nodes "
                                     "there)"), err  # fmt: skip
        assert not (tmp_path / f"run{k}").exists()


def test_rounds_agree_across_agents_and_republish_the_ranks_store():
    """Two agents' rendezvous handlers (fakes of torch's, over one real store): both get the same
    round number, counted up each round, and the ranks' store address of the round's rank 0,
    even where a handler returns a stale one (torch 2.13's c10d handler, for a node that joins
    later or was not rank 0 before)."""
    from datetime import timedelta

    import torch.distributed as dist
    from torch.distributed.elastic.rendezvous import (
        RendezvousHandler,
        RendezvousInfo,
        RendezvousStoreInfo,
    )

    from layershard.train.launch.agent import Rounds
    from layershard.train.loop.faults import ROUND_ENV, attempt

    base = dist.HashStore()
    base.set_timeout(timedelta(seconds=5))

    class Fake(RendezvousHandler):
        def __init__(self, rank, boot):
            self.rank, self.boot, self.round = rank, boot, 0

        def next_rendezvous(self):
            self.round += 1
            store = dist.PrefixStore(f"torch.rendezvous.x.{self.round}", base)
            return RendezvousInfo(store, self.rank, 2, self.boot)

        def get_backend(self):
            return "fake"

        def is_closed(self):
            return False

        def set_closed(self):
            pass

        def num_nodes_waiting(self):
            return 0

        def get_run_id(self):
            return "x"

        def shutdown(self):
            return True

    head = Rounds(Fake(0, RendezvousStoreInfo("node0", 1234)))
    stale = Rounds(Fake(1, RendezvousStoreInfo("gone", 999)))
    try:
        for n in (1, 2):
            a, b = head.next_rendezvous(), stale.next_rendezvous()  # rank 0 first: no threads
            assert os.environ[ROUND_ENV] == str(n) and attempt() == n - 1
            for info in (a, b):
                boot = info.bootstrap_store_info
                assert (boot.master_addr, boot.master_port) == ("node0", 1234)
    finally:
        os.environ.pop(ROUND_ENV, None)
