"""One rank of one replica group of a fault-tolerant run (tests/ft): ``python _worker.py JSON``.

It shards the tiny Llama over its group's ranks (its own torch.distributed world on
``master_port``), trains through ``ls.ft.FaultTolerant`` until torchft's step counter reaches
``steps`` with every group in the last quorum, and saves its records (one per step attempt), its
report and its final state (slices, optimizer state) to ``out``. ``kill``: ``[step, where]``, it
SIGKILLs itself at that step, ``where`` in ``forward`` (before the forward), ``backward`` (after
the forward, before the backward), ``reduce`` (inside the cross-group all-reduce: its peers have
issued theirs); ``hang``: it SIGSTOPs itself after the forward instead (the harness
kills and restarts it later); ``recv`` (any step): as torchft's checkpoint transport starts to
receive a peer's state. ``kills``: ``[[step, where], ...]``, failures spread over the run: the
first not yet fired (a marker in ``fired``) fires at the first step from ``step`` on whose
previous step had every group in the quorum (one group down at a time, so a healthy peer
always holds the state). ``journal``: each step's record is also appended to ``JOURNAL.G.R.jsonl`` (kept across
restarts). ``ready``: a folder where it marks itself built and waits for every rank
of every group (the first start only: all groups in the first quorum). ``save_dir``: group 0
saves an ``ls.save_checkpoint`` there at the end, and every rank 0 keeps its full weights."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import signal
import sys
import time
from pathlib import Path

import torch

import layershard as ls

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: _parity
from _parity import LR, lm_loss, local, tiny_hf_llama, tiny_llama  # noqa: E402

GLOBAL_BATCH, SEQ, VOCAB = 8, 16, 96


def data(position: int, stream: str = "random", seed: int = 1000) -> torch.Tensor:
    """The global batch at ``position`` (every group reads its ranks' parts of it). ``stream``
    ``"random"``: uniform tokens (nothing to learn; the bitwise tests); ``"chain"``: each token
    follows from the one before through a fixed permutation, 9 times in 10, so that a model
    learns (the loss falls from ln 96 = 4.6 towards 0.5) and a validation loss says how far
    training got."""
    g = torch.Generator().manual_seed(seed + position)
    tokens = torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=g)
    if stream == "chain":
        follow = torch.randperm(VOCAB, generator=torch.Generator().manual_seed(7))
        keep = torch.rand(GLOBAL_BATCH, SEQ, generator=g) < 0.9
        for t in range(1, SEQ):
            tokens[:, t] = torch.where(keep[:, t], follow[tokens[:, t - 1]], tokens[:, t])
    return tokens


def validation_loss(model, stream: str) -> float:
    """The mean loss over 4 held-out global batches (positions no run trains on)."""
    with torch.no_grad():
        losses = [lm_loss(model, data(10**6 + i, stream)).item() for i in range(4)]
    return sum(losses) / len(losses)


def build_model(kind: str = "llama"):
    """The model every group builds (the same seed): the tiny built-in Llama, or (``"hf"``) a
    tiny transformers Llama."""
    if kind == "hf":
        return tiny_hf_llama(vocab_size=VOCAB, intermediate_size=48)
    return tiny_llama(0)


def digest(model, opt) -> str:
    """A hash of this rank's slices and optimizer state: equal digests, bitwise equal states."""
    h = hashlib.sha1()
    for f in model.flat_params:
        h.update(f.shard.numpy().tobytes())
    for st in opt.state.values():
        for k in sorted(st):
            h.update(st[k].detach().reshape(-1).numpy().tobytes())
    return h.hexdigest()


def main(cfg: dict) -> None:
    g, r, k, groups = cfg["group"], cfg["rank"], cfg["ranks"], cfg["groups"]
    os.environ.update(
        RANK=str(r), WORLD_SIZE=str(k), LOCAL_RANK=str(r), LOCAL_WORLD_SIZE=str(k),
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(cfg["master_port"]),
        LAYERSHARD_TIMEOUT_S=str(cfg.get("timeout_s", 30)),
    )  # fmt: skip
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    ls.init_distributed(backend="gloo")
    backward = torch.Tensor.backward
    if cfg.get("model") == "accelerate":  # the loop of docs/fault-tolerance.md, ls.hf's way
        accelerator = ls.hf.Accelerator(cpu=True)
        net = build_model("hf")
        model, opt = accelerator.prepare(net, torch.optim.AdamW(net.parameters(), lr=LR))
        backward = accelerator.backward
    else:
        model = ls.shard(build_model(cfg.get("model", "llama")))
        opt = torch.optim.AdamW(model.parameters(), lr=cfg.get("lr", LR))
    ft = ls.ft.FaultTolerant(
        model, opt, replica_id=f"group{g}", lighthouse=cfg["lighthouse"],
        min_replicas=cfg.get("min_replicas", 1), init_sync=cfg.get("init_sync", False),
        use_async_quorum=cfg.get("async_quorum", True), timeout=cfg.get("ft_timeout_s", 10),
        quorum_timeout=cfg.get("quorum_timeout_s", cfg.get("ft_timeout_s", 10)), connect_timeout=10, hostname="127.0.0.1",
        bucket_mb=cfg.get("bucket_mb", 25.0),
        **({"quorum_retries": cfg["quorum_retries"]} if "quorum_retries" in cfg else {}),
    )  # fmt: skip
    if cfg.get("ready"):
        ready = Path(cfg["ready"])
        (ready / f"{g}.{r}").touch()
        while len(list(ready.iterdir())) < groups * k:
            time.sleep(0.05)
    stream = cfg.get("data", "random")
    kill = cfg.get("kill")
    if kill and kill[1] == "recv":  # die as the state from a peer starts to arrive
        ft.manager._checkpoint_transport.recv_checkpoint = _die
    records = []
    deadline = time.monotonic() + cfg.get("deadline_s", 120)
    while ft.step_count < cfg["steps"] or ft.state.participants < groups:
        if time.monotonic() > deadline:
            raise TimeoutError(f"group {g} rank {r}: not done by the deadline: {records[-3:]}")
        if cfg.get("kills"):
            kill = _scheduled(cfg, ft, groups)
        if kill and kill[0] == ft.step_count and kill[1] == "forward":
            os.kill(os.getpid(), signal.SIGKILL)
        ft.zero_grad()
        position = ft.data_position
        loss = lm_loss(model, local(data(position, stream), g * k + r, groups * k))
        if kill and kill[0] == ft.step_count and kill[1] in ("backward", "hang"):
            # The step's quorum is asked for on torchft's thread; on a loaded machine the forward
            # can end before that request reaches the Lighthouse, and the quorum then forms
            # without this group (the survivors lose nothing: seen once in CI). Join it first.
            ft.manager.wait_quorum()
            os.kill(os.getpid(), signal.SIGKILL if kill[1] == "backward" else signal.SIGSTOP)
        backward(loss)
        if kill and kill[0] == ft.step_count and kill[1] == "reduce":
            _kill_after_first_bucket(ft)
        rec = {
            "wall": time.time(),
            "step": ft.step_count,
            "position": position,
            "loss": loss.item(),
            "participants": ft.manager.num_participants(),
            "participating": ft.manager.is_participating(),
        }
        rec["committed"] = ft.step()
        rec["after"] = ft.step_count
        rec["digest"] = digest(model, opt)
        records.append(rec)
        if cfg.get("journal"):  # every start's steps, for a replay of the whole run
            with open(f"{cfg['journal']}.{g}.{r}.jsonl", "a") as f:
                f.write(json.dumps({**rec, "group": g}) + "\n")
        if ft.state.participants < groups and cfg.get("throttle_s"):
            time.sleep(cfg["throttle_s"])  # a survivor alone: let the restarted group catch up
    if cfg.get("save_dir") and g == 0:  # a scheduled checkpoint, written by one group
        ls.save_checkpoint(
            cfg["save_dir"], model, opt, step=ft.step_count,
            extra={"data_position": ft.data_position, "torchft": ft.manager.state_dict()},
        )  # fmt: skip
    full = model.full_state_dict() if cfg.get("save_dir") else {}
    out = {
        "full": full,
        "records": records,
        "report": ft.report(),
        "slices": [f.shard.clone() for f in model.flat_params],
        "optim": opt.state_dict(),
        "validation_loss": validation_loss(model, stream) if cfg.get("validate") else None,
    }
    torch.save(out, cfg["out"])
    import torch.distributed as dist

    dist.barrier()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)  # gloo's and torchft's threads: no interpreter teardown (tests/_dist.py)


def _scheduled(cfg: dict, ft, groups: int) -> list | None:
    """This rank's next failure from ``kills``, as ``[step, where]``, when it is due now (its
    marker written first: a restarted rank does not fire it again); None otherwise."""
    fired = Path(cfg["fired"])
    for i, (step, where) in enumerate(cfg.get("kills", [])):
        marker = fired / f"{cfg['group']}.{cfg['rank']}.{i}"
        if marker.exists():
            continue
        if ft.step_count >= step and ft.state.participants == groups:
            marker.touch()
            return [ft.step_count, where]
        return None
    return None


def _die(*args, **kwargs) -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def _kill_after_first_bucket(ft) -> None:
    """SIGKILL this process where it would issue its first cross-group all-reduce, half a
    second late: its peers have issued theirs and wait inside the collective for data that never
    comes. (Issuing first and dying right after raced: a bucket small enough went through before
    the kill, the peers' step committed, seen once on a loaded machine.)"""

    def die_instead(*args, **kwargs):
        time.sleep(0.5)
        os.kill(os.getpid(), signal.SIGKILL)

    ft.manager.allreduce = die_instead


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
