"""Many nodes: the node count (``--nnodes N`` or elastic ``MIN:MAX``) and the world sizes it
allows, the global batch an elastic job keeps, the rendezvous options, and which node was lost
when a multi-node run failed (docs/train.md, Many nodes)."""

from __future__ import annotations

import math
import sys
import time
from pathlib import Path
from typing import Any

import torch

from layershard.train import status as st
from layershard.train.config import ConfigError, LaunchOptions, TrainConfig, grad_accum_for


def default_nproc() -> int:
    # One rank per GPU; on CPU two ranks (the smallest real data-parallel job).
    return torch.cuda.device_count() if torch.cuda.is_available() else 2


def nproc(opts: LaunchOptions) -> int:
    return opts.nproc_per_node if opts.nproc_per_node is not None else default_nproc()


def node_range(opts: LaunchOptions) -> tuple[int, int]:
    """``--nnodes N`` or ``MIN:MAX`` as (MIN, MAX); ConfigError when it is neither."""
    low, sep, high = opts.nnodes.partition(":")
    try:
        lo, hi = int(low), int(high if sep else low)
    except ValueError:
        raise ConfigError(
            f"--nnodes must be a number of nodes or MIN:MAX (elastic), got {opts.nnodes!r}"
        ) from None
    if lo < 1 or hi < lo:
        raise ConfigError(
            f"--nnodes {opts.nnodes}: need 1 <= MIN <= MAX (e.g. --nnodes 2, or --nnodes 1:4)"
        )
    return lo, hi


def world_size(opts: LaunchOptions) -> int | None:
    """Total ranks when it is fixed (an elastic ``--nnodes MIN:MAX`` leaves it open)."""
    lo, hi = node_range(opts)
    return lo * nproc(opts) if lo == hi else None


def world_sizes(opts: LaunchOptions) -> list[int]:
    """Every world size the job can have: one, or one per node count of ``MIN:MAX``."""
    lo, hi = node_range(opts)
    return [n * nproc(opts) for n in range(lo, hi + 1)]


def elastic_batch(cfg: TrainConfig, opts: LaunchOptions) -> None:
    """An elastic job keeps its global batch when nodes leave or join: gradient accumulation
    adjusts, so the batch must divide at every world size the job can have. Without
    ``batch_tokens``, the batch is the one of the largest world (grad_accum micro-batches)
    rounded up to one that divides at every size."""
    sizes = world_sizes(opts)
    if cfg.batch_tokens is None:
        cfg.batch_tokens = cfg.seq_len * cfg.micro_batch * (cfg.grad_accum or 1) * math.lcm(*sizes)
        cfg.grad_accum = None
        print(
            f"layershard train: note: elastic --nnodes {opts.nnodes}: the global batch is kept "
            f"at {cfg.batch_tokens} tokens (--batch-tokens) at every world size "
            f"({', '.join(map(str, sizes))} ranks); gradient accumulation adjusts",
            file=sys.stderr,
            flush=True,
        )
    for w in sizes:
        try:
            grad_accum_for(cfg, w)
        except ConfigError as e:
            raise ConfigError(
                f"elastic --nnodes {opts.nnodes} can run at {w} ranks, where {e}"
            ) from None


def elastic(opts: LaunchOptions) -> bool:
    """``--nnodes MIN:MAX`` with MIN < MAX: nodes may leave and join while the job runs."""
    low, _, high = opts.nnodes.partition(":")
    return bool(high) and low != high


def rdzv_backend(opts: LaunchOptions) -> str | None:
    """The user's rendezvous backend; for an elastic ``--nnodes MIN:MAX``, c10d (torchrun's
    default, static, needs a fixed number of nodes)."""
    if opts.rdzv_backend:
        return opts.rdzv_backend
    return "c10d" if elastic(opts) else None


# How long the nodes wait for each other at the rendezvous (--rdzv-timeout): node 0 for the
# others to join, the others to reach node 0. Long enough for nodes a scheduler starts minutes
# apart; torchrun's own default (600 s static, 900 s c10d) left a mistyped endpoint silent for
# ten minutes.
DEFAULT_RDZV_TIMEOUT_S = 300.0


def rdzv_timeout_conf(opts: LaunchOptions, backend: str | None, given: list[str]) -> list[str]:
    """torchrun's rendezvous options that carry ``--rdzv-timeout`` (unless ``--rdzv-conf`` sets
    them): static's ``timeout``; c10d's ``join_timeout``, and its ``read_timeout`` (how long a
    node tries to reach the store at all, torch's 60 s) when shorter."""
    seconds = math.ceil(opts.rdzv_timeout if opts.rdzv_timeout else DEFAULT_RDZV_TIMEOUT_S)
    keys = {c.partition("=")[0].strip() for c in given}
    if backend in (None, "static"):
        wanted = {"timeout": seconds}
    else:
        wanted = {"join_timeout": seconds}
        if seconds < 60:
            wanted["read_timeout"] = seconds
    return [f"{k}={v}" for k, v in wanted.items() if k not in keys]


def settings(cfg: TrainConfig, opts: LaunchOptions, corpus: str, resume: str | None) -> dict:
    """What every node of a job must have been started with (``rendezvous.agree``): the
    resolved config (model, data, engine options, seed, steps, ...) with mappings spelled out
    key by key (``model_overrides.n_layers``), the corpus' fingerprint, and the launch options
    that shape the job. Not the run folder's path, which may be mounted elsewhere."""
    out: dict[str, Any] = {}
    for key, value in cfg.to_dict().items():
        if key in ("run_dir", "name"):
            continue
        if isinstance(value, dict):
            out.update({f"{key}.{k}": v for k, v in value.items()})
        else:
            out[key] = value
    out.update(
        corpus=corpus[:16],
        nproc_per_node=nproc(opts),
        nnodes=opts.nnodes,
        max_restarts=opts.max_restarts,
        resume=resume,
        stop_at_step=opts.stop_at_step,
    )
    return out


def loopback(endpoint: str | None) -> bool:
    host = (endpoint or "").rpartition(":")[0] or (endpoint or "")
    return host in ("localhost", "::1", "[::1]") or host.startswith("127.")


TIMED_OUT = ("Timed out waiting", "timed out waiting in")  # gloo's, and layershard's wrapping


def timed_out(s: dict[str, Any]) -> bool:
    return s.get("exit") not in (None, 0) and any(m in str(s.get("error")) for m in TIMED_OUT)


def settled(
    run_dir: Path, opts: LaunchOptions, ranks: dict[int, dict[str, Any]], wait_s: float = 5.0
) -> dict[int, dict[str, Any]]:
    """``ranks`` read again until every rank has recorded its end or ``wait_s`` passed: the
    ranks of other nodes time out at about the same moment as this node's, and write a moment
    later."""
    deadline = time.monotonic() + wait_s
    while any("exit" not in s for s in ranks.values()) and time.monotonic() < deadline:
        time.sleep(0.2)
        ranks = st.rank_statuses(run_dir, opts.launch_id) or ranks
    return ranks


def partitioned(run_dir: Path, ranks: dict[int, dict[str, Any]], opts: LaunchOptions) -> str:
    """'' unless this node's ranks timed out in a collective and the other nodes' did too, none
    of them dead: then the nodes could not reach each other (a link down, a partition), and the
    line names the nodes this one lost, as in "node 1 (vm2, 10.0.0.2, rank 1)"."""
    if world_size(opts) == nproc(opts) and not elastic(opts):
        return ""
    if not any(timed_out(s) for s in ranks.values()):
        return ""
    ranks = settled(run_dir, opts, ranks)
    mine = {r: s for r, s in ranks.items() if s.get("node") == opts.node_rank}
    others = {r: s for r, s in ranks.items() if s.get("node") != opts.node_rank}
    if not mine or not others or not all(timed_out(s) for s in mine.values()):
        return ""
    if not all(timed_out(s) for s in others.values()):
        return ""
    by_node: dict[Any, list[int]] = {}
    for r, s in sorted(others.items()):
        by_node.setdefault(s.get("node"), []).append(r)
    parts = []
    for node, numbers in sorted(by_node.items(), key=lambda kv: str(kv[0])):
        s = others[numbers[0]]
        span = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
        where = ", ".join(str(x) for x in (s.get("host"), s.get("addr")) if x)
        parts.append(f"node {node} ({where}, rank{'s' if len(numbers) > 1 else ''} {span})")
    step = max((s.get("step") or 0) for s in ranks.values())
    return (
        f"node {opts.node_rank} lost contact with {' and '.join(parts)} after step {step}: every "
        "rank waited in the same collective until the timeout and none died, so the network "
        "between the nodes failed (a link down, a partition, a firewall)"
    )


def lost_nodes(ranks: dict[int, dict[str, Any]], opts: LaunchOptions) -> str:
    """'' on one node; else the nodes whose ranks never said why they ended, as in "node 1 (vm,
    ranks 2-3) was lost at step 14". A node that dies (its launcher, agent and ranks killed, or
    the machine gone) writes nothing: its ranks' records stay those of running ranks, while this
    node's ranks saw a peer go away."""
    if world_size(opts) == nproc(opts) and not elastic(opts):
        return ""
    by_node: dict[int, list[dict[str, Any]]] = {}
    for r, s in sorted(ranks.items()):
        node = s.get("node")
        if isinstance(node, int) and node != opts.node_rank and "exit" not in s:
            if st.alive(s) is not True:  # dead here, or on another machine and silent
                by_node.setdefault(node, []).append({**s, "rank": r})
    if not by_node or not any(s.get("peer_lost") for s in ranks.values()):
        return ""
    parts = []
    for node, gone in sorted(by_node.items()):
        numbers = [g["rank"] for g in gone]
        span = str(numbers[0]) if len(numbers) == 1 else f"{numbers[0]}-{numbers[-1]}"
        steps = [g["step"] for g in gone if g.get("step") is not None]
        when = f" at step {max(steps)}" if steps else " before training"
        host = gone[0].get("host")
        parts.append(
            f"node {node} ({host}, rank{'s' if len(numbers) > 1 else ''} {span}) was lost{when}"
        )
    return "; ".join(parts) + " (the node died, or its launcher was killed)"
