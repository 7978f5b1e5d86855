"""`layershard train` guards that need no launch: launch options and models refused before
anything starts, non-finite steps, host syncs per step, stop requests, stall reports, the default
timeout."""

from __future__ import annotations

import json
import math
import os
import re
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from _dist import run_ranks
from _train import TINY, refused_one_line, train_main

import layershard as ls
from layershard.train import status as st
from layershard.train.launch import nodes
from layershard.train.launch.launcher import DEFAULT_TIMEOUT_S, LaunchOptions, rank_env
from layershard.train.launch.preflight import prepare
from layershard.train.loop.faults import StopRequest
from layershard.train.loop.report import read_metrics


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))


def test_launch_options_and_models_are_refused_before_launch(tmp_path, capsys):
    transformers = pytest.importorskip("transformers")

    def refused(*argv):
        return refused_one_line(capsys, tmp_path, *TINY, *argv)

    assert "activation_checkpointing=3 is more than the model's 2 blocks; use 0 to 2" in refused(
        "--activation-checkpointing", "3"
    )
    assert "--nproc-per-node must be at least 1, got 0" in refused("--nproc-per-node", "0")
    assert "--nproc-per-node must be at least 1, got -2" in refused("--nproc-per-node=-2")
    assert "--max-restarts must be at least 0" in refused("--max-restarts=-1")
    assert "--timeout must be a number of seconds > 0" in refused("--timeout", "0")
    assert "is not a value" in refused("--model-override", "dim=[1,")
    assert "expected KEY=VALUE" in refused("--model-override", "=5")
    assert "expected KEY=VALUE" in refused("--model-override", "dim=")
    bert = tmp_path / "bert"
    transformers.BertConfig(
        vocab_size=512, hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
        intermediate_size=64, max_position_embeddings=128,
    ).save_pretrained(bert)  # fmt: skip
    assert "bert attends to later tokens (bidirectional attention)" in refused(
        "--hf-config", str(bert)
    )
    t5 = tmp_path / "t5"
    transformers.T5Config(vocab_size=512, d_model=32, num_layers=1).save_pretrained(t5)
    assert "model_type 't5' is not a causal language model" in refused("--hf-config", str(t5))
    # a decoder-only config passes the causal check
    llama = tmp_path / "llama"
    transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    ).save_pretrained(llama)  # fmt: skip
    assert train_main([*TINY, "--hf-config", str(llama), "--dry-run"]) == 0
    capsys.readouterr()
    # --init-from a folder without weights
    (llama / "tokenizer.json").write_text("{}")
    (llama / "pytorch_model.bin").write_bytes(b"pickle")
    err = refused("--init-from", str(llama))
    assert f"--init-from {llama} has no *.safetensors weights (it has pytorch_model.bin" in err


def test_parallel_splits_that_cannot_work_are_refused_before_launch(tmp_path, capsys):
    """--ep / --tp that the ranks would refuse (or fail on in the first step) say so in one line
    before any rank starts, and leave no run folder."""

    def refused(*argv):
        return refused_one_line(capsys, tmp_path, *TINY, *argv)

    moe = ["--model", "moe", "--model-override", "n_heads=4", "--model-override", "n_kv_heads=2"]
    assert "--ep 2: the model has no expert layers to split" in refused("--ep", "2")
    assert "--ep 2 must divide every expert layer's number of experts (got 3)" in refused(
        *moe, "--model-override", "n_experts=3", "--model-override", "top_k=1", "--ep", "2"
    )
    assert "ep 2 is not supported with --optimizer muon yet" in refused(
        *moe, "--ep", "2", "--optimizer", "muon"
    )
    assert (
        "--tp 2 must divide the output features (column-wise split) of layers.0.mlp.w1: 129"
        in refused("--tp", "2", "--model-override", "ffn_dim=129")
    )


def test_overwrite_during_another_launchs_data_preparation_is_refused(
    tmp_path, capsys, monkeypatch
):
    """A launch holds the run folder from before its data work (minutes on a large corpus): an
    --overwrite meanwhile is refused and deletes nothing (it used to pass, the first launch had
    not locked yet, and delete the folder under it)."""
    import layershard.train.launch.preflight as preflight
    from layershard.train import cli as train_cli

    run = tmp_path / "run"
    assert train_main([*TINY, "--run-dir", str(run), "--dry-run"]) == 0
    run.mkdir()
    (run / "config.yaml").write_text("model: tiny\n")  # a run folder --overwrite may replace
    (run / "metrics.jsonl").write_text("{}\n")
    refusals = []
    real = preflight.prepare_splits

    def while_preparing(*args, **kwargs):
        if not refusals:  # the second launch comes while the first prepares its data
            refusals.append(train_main([*TINY, "--run-dir", str(run), "--overwrite"]))
        return real(*args, **kwargs)

    monkeypatch.setattr(preflight, "prepare_splits", while_preparing)
    monkeypatch.setattr(train_cli, "launch", lambda run_dir, opts: (0, None))  # no ranks
    assert train_main([*TINY, "--run-dir", str(run), "--overwrite"]) == 0
    assert refusals == [2]
    err = capsys.readouterr().err
    assert f"run folder {run} is in use by another layershard train (pid {os.getpid()}" in err
    assert not (run / "metrics.jsonl").exists()  # the first launch's --overwrite, not the second's
    assert (run / "launch.json").is_file() and not (run / ".layershard" / "lock").exists()


def test_a_run_folder_that_cannot_be_created_is_one_line(tmp_path, capsys):
    (tmp_path / "file").write_text("")
    # a file on the way; a folder the kernel refuses to create (procfs)
    for where in (tmp_path / "file" / "run", Path("/proc/layershard-test-run")):
        assert train_main([*TINY, "--run-dir", str(where)]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and err.startswith("layershard train: error: run folder"), err
        assert "choose another --run-dir" in err
    assert (tmp_path / "file").read_text() == ""


def test_more_ranks_than_cores_warns_with_the_memory_per_rank(tmp_path, capsys):
    n = (os.cpu_count() or 1) * 4
    argv = [*TINY, "--run-dir", str(tmp_path / "run"), "--dry-run", "--nproc-per-node", str(n)]
    assert train_main(argv) == 0
    err = capsys.readouterr().err
    assert re.search(
        rf"warning: {n} ranks on {os.cpu_count()} CPU cores: .* each rank needs ~[\d,]+ MiB of "
        r"model state \(16 bytes per parameter / \d+ ranks\)",
        err,
    ), err


def test_shard_refuses_a_module_that_contains_a_sharded_module():
    from layershard.models import LlamaConfig, LlamaForCausalLM

    ls.init_distributed(backend="gloo")
    cfg = LlamaConfig(vocab_size=16, dim=8, n_layers=1, n_heads=2, n_kv_heads=1, ffn_dim=16,
                      max_seq_len=8)  # fmt: skip
    inner = ls.shard(LlamaForCausalLM(cfg))
    with pytest.raises(ValueError, match="contains a sharded module"):
        ls.shard(torch.nn.Sequential(inner))
    with pytest.raises(ValueError, match="already sharded"):
        ls.shard(inner)
    with pytest.raises(ValueError, match="already sharded"):
        ls.shard(inner.module)  # the wrapped model: its hooks are installed


# ---- the training loop in this process (world size 1) -------------------------------------------


@pytest.fixture
def trainer(tmp_path):
    from layershard.train.loop.trainer import Trainer

    ls.init_distributed(backend="gloo")
    layer = {"max_files": 40, "val_fraction": 0.2, "vocab_size": 512, "seq_len": 64,
             "micro_batch": 2, "grad_accum": 4, "model_overrides": {"dim": 64, "n_layers": 2,
             "ffn_dim": 128}, "steps": 8, "checkpoint_interval": 2, "max_bad_steps": 2,
             "eval_interval": 0, "log_interval": 2, "lr": 3e-3, "warmup_steps": 2,
             "eval_sequences": 8, "run_dir": str(tmp_path / "run")}  # fmt: skip
    opts = LaunchOptions(nproc_per_node=1)
    _, run_dir, _ = prepare(layer, opts)
    st.release_lock(opts.lock)
    return Trainer(run_dir, 0, 1, torch.device("cpu"))


def test_one_host_read_per_step_whatever_the_micro_batches(trainer, monkeypatch):
    """Issue 10, 2.11: the loss stays on the device; a step reads the host once (its loss and
    gradient norm, with each rank's memory on logged steps), not once per micro-batch."""
    train_dir = str(Path(ls.__file__).parent / "train")
    reads = []

    def counting(name):
        original = getattr(torch.Tensor, name)

        def read(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            if caller.startswith(train_dir):
                reads.append(f"{name} at {caller}:{sys._getframe(1).f_lineno}")
            return original(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, name, read)

    for name in ("item", "tolist", "__float__", "__int__", "__bool__", "__index__"):
        counting(name)
    assert trainer.ga == 4
    for with_memory in (False, True):
        reads.clear()
        stats = trainer.train_step(with_memory=with_memory)
        assert len(reads) == 1, reads
        assert math.isfinite(stats["loss"]) and stats["grad_norm"] > 0
        assert ("mem_mib" in stats) == with_memory
        if with_memory:  # each rank's busy seconds, for naming a straggler (report.straggler)
            busy = stats["busy_s"]
            assert len(busy) == trainer.world and all(0 < b < 60 for b in busy), busy


def test_the_slowest_node_is_named_and_the_end_of_the_run_estimated():
    from layershard.train.loop.report import finish_eta, straggler

    # 2 nodes of 2 ranks: a node is as slow as its slowest rank
    assert straggler([1.0, 1.0, 1.0, 1.3], local_world=2) == (1, pytest.approx(1.3))
    assert straggler([1.0, 1.05, 1.0, 1.0], local_world=2) is None  # within 10%
    assert straggler([1.0, 5.0], local_world=2) is None  # one node: nothing to compare
    assert straggler([2.0, 1.0, 1.0, 1.0], local_world=1) == (0, pytest.approx(2.0))
    assert finish_eta(10.0, 0, 5) == ""
    eta = finish_eta(120.0, 4, 130)  # 30 s a step, 130 steps left: 65 minutes
    assert eta.startswith("ends ~") and eta.endswith("(in 1:05:00)"), eta


def test_non_finite_steps_are_skipped_then_stop_the_run_without_saving(trainer, capsys):
    from layershard.train.loop.trainer import StopRun

    model = trainer.model.module
    forward = model.forward
    bad_steps = {3, 5, 6}  # 1-based: step 4 in between resets the count

    def poisoned(*args, **kwargs):
        out = forward(*args, **kwargs)
        if trainer.step + 1 in bad_steps and out.loss is not None:
            out.loss = out.loss * float("nan")
        return out

    model.forward = poisoned
    snapshots = {}
    train_step = trainer.train_step

    def recording(*args, **kwargs):
        stats = train_step(*args, **kwargs)
        snapshots[trainer.step] = {
            "params": [f.shard.clone() for f in trainer.model.flat_params],
            "adam_steps": sorted(float(s["step"]) for s in trainer.opt.state.values()),
        }
        return stats

    trainer.train_step = recording
    with pytest.raises(StopRun) as stopped:
        trainer.run()
    ckpts = trainer.run_dir / "checkpoints"
    assert stopped.value.reason == "non-finite"
    assert str(stopped.value).startswith("step 6: 2 non-finite steps in a row (loss nan")
    assert f"Last good checkpoint: {ckpts.absolute()}/step_000004." in str(stopped.value)
    assert sorted(p.name for p in ckpts.iterdir()) == ["latest", "step_000002", "step_000004"]
    # a skipped step changes nothing: weights and optimizer state are those of the step before
    for a, b in zip(snapshots[2]["params"], snapshots[3]["params"]):
        assert torch.equal(a, b)
    assert snapshots[3]["adam_steps"] == snapshots[2]["adam_steps"]
    assert not all(
        torch.equal(a, b) for a, b in zip(snapshots[3]["params"], snapshots[4]["params"])
    )
    records = {r["step"]: r for r in read_metrics(trainer.run_dir / "metrics.jsonl") if "loss" in r}
    assert [s for s, r in records.items() if r.get("skipped")] == [3, 5, 6]
    assert "step 3: non-finite loss (nan) or gradient norm" in capsys.readouterr().err
    # weights that are not finite are never written, as a checkpoint or an HF export
    trainer.model.flat_params[0].shard[0] = float("inf")
    with pytest.raises(StopRun, match="the weights hold NaN or inf; the checkpoint step_000006"):
        trainer.checkpoint()
    with pytest.raises(StopRun, match="the Hugging Face export final/ was not written"):
        trainer.export(trainer.run_dir / "final")
    assert not (ckpts / "step_000006").exists() and not (trainer.run_dir / "final").exists()


# ---- stop requests, stall reports, timeouts ------------------------------------------------------


def test_stop_requests_agree_on_one_step():
    """SIGINT or SIGTERM on any rank: every rank stops after the same step."""
    store = dist.HashStore()
    a, b = StopRequest(store, announce=False), StopRequest(store, announce=False)
    before = signal.getsignal(signal.SIGINT)  # SIG_IGN in a shell's background job
    a.install()
    try:
        os.kill(os.getpid(), signal.SIGINT)  # Ctrl-C: handled, no KeyboardInterrupt
        time.sleep(0.01)
    finally:
        a.uninstall()
    assert signal.getsignal(signal.SIGINT) is before  # the handler it replaced is back
    assert not b.should_stop(3)  # b ended step 3 before a saw its signal
    assert not a.should_stop(3)  # a ends step 3 and proposes: stop after step 4
    assert b.should_stop(4) and a.should_stop(4)
    assert a.signal == b.signal == "SIGINT"
    c = StopRequest(None, announce=False)  # a single process needs no agreement
    c.install()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(0.01)
    finally:
        c.uninstall()
    assert c.should_stop(0) and c.signal == "SIGTERM"


class _Unanswered:
    """The job's store over a link that went down: asked, it never answers (torch's TCPStore
    client waits for ``check``'s answer without a timeout: a rank hung there for minutes after
    its peers had timed out, and its node never said what happened)."""

    def __init__(self) -> None:
        self.back = threading.Event()

    def check(self, keys: list[str]) -> bool:
        self.back.wait()
        return False

    def compare_set(self, key: str, expected: str, desired: str) -> bytes:
        raise KeyError(key)  # any error of the store's own is raised on the caller's thread


def test_a_store_that_does_not_answer_times_out_as_a_lost_node():
    store = _Unanswered()
    stop = StopRequest(store, announce=False, timeout_s=0.5)  # type: ignore[arg-type]
    raised: list[BaseException] = []

    def ask() -> None:
        try:
            stop.should_stop(4)
        except RuntimeError as e:
            raised.append(e)

    t0 = time.monotonic()
    asking = threading.Thread(target=ask, daemon=True)
    asking.start()
    asking.join(10.0)
    try:
        assert not asking.is_alive(), "should_stop waited past its timeout"
        assert 0.5 <= time.monotonic() - t0 < 5.0
        [e] = raised
        assert re.match(
            r"timed out waiting in the stop check after step 4: the job's store", str(e)
        )
        # what `layershard train` reads as this rank's end: a timeout, as a partition shows
        assert nodes.timed_out({"exit": 1, "error": f"{type(e).__name__}: {e}"})
        # the next call does not queue behind the one still waiting
        stop.signum = signal.SIGTERM
        with pytest.raises(KeyError):
            stop.should_stop(5)
    finally:
        store.back.set()


def test_default_timeout_reaches_the_ranks(monkeypatch):
    monkeypatch.delenv("LAYERSHARD_TIMEOUT_S", raising=False)
    assert DEFAULT_TIMEOUT_S == 300
    assert rank_env(LaunchOptions())["LAYERSHARD_TIMEOUT_S"] == "300.0"
    assert rank_env(LaunchOptions(timeout=42))["LAYERSHARD_TIMEOUT_S"] == "42"
    monkeypatch.setenv("LAYERSHARD_TIMEOUT_S", "99")
    assert rank_env(LaunchOptions())["LAYERSHARD_TIMEOUT_S"] == "99"


def _stall(rank: int, world: int, out: str) -> None:
    from layershard.models import LlamaConfig, LlamaForCausalLM
    from layershard.train.loop.faults import Watchdog, connect_store

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, dim=32, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=64,
                      max_seq_len=16)  # fmt: skip
    model = ls.shard(LlamaForCausalLM(cfg))
    pids = [None] * world
    dist.all_gather_object(pids, os.getpid())
    reports = []

    def report(text):
        reports.append(text)
        if "no heartbeat" in text:  # rank 1 is frozen: seen; let it go on
            os.kill(pids[1], signal.SIGCONT)

    def progress():
        return (0, sum(v["count"] for v in model.comm_stats().values()))

    dog = Watchdog(connect_store(), rank, world, 0.5, progress, report)
    dog.start()
    x = torch.randint(0, 96, (2, 8))
    if rank == 1:
        time.sleep(2)  # rank 1 is elsewhere: rank 0 waits in its first all-gather
    model(x)
    dist.barrier()
    if rank == 1:
        os.kill(os.getpid(), signal.SIGSTOP)  # frozen: no heartbeat either
    model(x)
    dist.barrier()
    dog.stop()
    if rank == 0:
        Path(out).write_text(json.dumps(reports))


def test_a_stalled_collective_is_reported_with_the_ranks_missing(tmp_path):
    out = tmp_path / "reports.json"
    run_ranks(_stall, 2, str(out))
    reports = json.loads(out.read_text())
    first = reports[0]
    assert re.search(
        r"rank 0: no progress for \d+ s, at step 0, collective #\d+: waiting in the all-gather "
        r"of unit \S+ \(forward\)",
        first,
    ), first
    assert re.search(r"not joined: rank 1 \(at collective #\d+, step 0: busy outside", first) or (
        "not joined: rank 1 (at collective #0" in first
    ), first
    assert "the process group times out after 120 s" in first
    assert any("not joined: rank 1 (no heartbeat for" in r for r in reports), reports


def test_the_final_line_explains_how_the_ranks_ended(tmp_path):
    """What `layershard train` says from the run folder's records: a stop on request, non-finite
    steps, a fixable error, a rank's error, a rank that died by a signal."""
    from layershard.train.launch.launcher import outcome

    run, opts = tmp_path / "run", LaunchOptions(launch_id="L1")
    state = run / ".layershard"

    def rank(r, **kw):
        st.write_json(state / f"rank-{r:05d}.json",
                      {"rank": r, "launch_id": "L1", "attempt": 0, "pid": 100 + r,
                       "host": "node0", **kw})  # fmt: skip

    rank(0, step=7, exit=0)
    rank(1, step=7, exit=0)
    assert outcome(run, opts, 0, None) == (0, "")
    st.write_json(state / st.STOP, {"launch_id": "L1", "reason": "non-finite", "message": "m"})
    assert outcome(run, opts, 0, None) == (1, "m")
    st.write_json(state / st.STOP, {"launch_id": "L1", "reason": "signal", "signal": "SIGINT",
                                    "step": 7, "checkpoint": "c"})  # fmt: skip
    code, msg = outcome(run, opts, 0, "SIGINT")
    assert code == st.EXIT_STOPPED and msg.startswith("stopped by SIGINT at step 7")
    (state / st.STOP).unlink()
    rank(0, step=7, exit=1, error="RuntimeError: Connection closed by peer", peer_lost=True)
    rank(1, step=7)  # no exit record: it died without a word
    st.write_json(state / st.FAILURES, {"launch_id": "L1", "failures": {
        "1": {"exitcode": -9, "signal": "SIGKILL", "pid": 101}}})  # fmt: skip
    code, msg = outcome(run, opts, 1, None)
    assert code == 1 and msg.startswith("rank 1 (pid 101 on node0) was killed by SIGKILL"), msg
    assert "at step 7" in msg and "Connection" not in msg
    rank(1, step=7, exit=1, error="ValueError: bad shape\nmore")
    assert outcome(run, opts, 1, None) == (1, "rank 1 failed at step 7: ValueError: bad shape")
    rank(0, step=0, exit=2, error="--resume: x: corrupt")
    assert outcome(run, opts, 1, None) == (2, "--resume: x: corrupt")
    # records of another launch are not this one's story
    assert outcome(run, LaunchOptions(launch_id="L2"), 1, None)[1].startswith("the training ranks")
