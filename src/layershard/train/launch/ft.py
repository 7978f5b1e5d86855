"""``layershard train --ft-replicas N --ft-group G``: this launcher is replica group G of N, made
fault tolerant across the groups by torchft (``ls.ft.FaultTolerant``; the loop's side:
train/loop/fault_tolerance.py).

One launcher per group, each with its own ``--nnodes``/``--nproc-per-node`` ranks and its own
rendezvous; the groups meet at torchft's Lighthouse: ``--ft-lighthouse HOST:PORT``, else
``TORCHFT_LIGHTHOUSE``, else group 0's launcher starts one on port ``DEFAULT_PORT`` (torchft's)
of its host, which the other groups must then be given. Each group writes its own run folder,
``RUN/group-<G>`` under the ``--run-dir`` (or ``runs/<name>``) every group is given.
"""

from __future__ import annotations

import importlib.util
import os
import socket
import sys
from pathlib import Path
from typing import Any

from layershard.train.config import ConfigError, LaunchOptions, TrainConfig

DEFAULT_PORT = 29510  # torchft_lighthouse's
DEFAULT_TIMEOUT_S = 60.0  # torchft's timeouts (the cross-group all-reduce, the quorum)


def enabled(opts: LaunchOptions) -> bool:
    return opts.ft_replicas is not None


def lighthouse_address(opts: LaunchOptions) -> str | None:
    """The Lighthouse's address: the flag's, ``TORCHFT_LIGHTHOUSE``'s, or None (group 0 starts
    one)."""
    address = opts.ft_lighthouse or os.environ.get("TORCHFT_LIGHTHOUSE") or None
    if address and not address.startswith(("http://", "https://")):
        address = "http://" + address
    return address


def group_run_dir(run_dir: Path, layers: list[dict[str, Any]], opts: LaunchOptions) -> Path:
    """This group's run folder, ``RUN/group-<G>``; ``RUN`` must be named (a timestamp would
    differ between the groups' launchers)."""
    if not enabled(opts):
        return run_dir
    if not any(layer.get("run_dir") or layer.get("name") for layer in layers):
        raise ConfigError(
            "--ft-replicas needs --run-dir RUN (or --name), the same for every group: each group "
            "writes its run folder RUN/group-<G>"
        )
    if run_dir.name.startswith("group-"):
        return run_dir  # --resume of a group's own folder
    return run_dir / f"group-{opts.ft_group}"


def has_torchft() -> bool:
    return importlib.util.find_spec("torchft") is not None


def check(cfg: TrainConfig, opts: LaunchOptions) -> None:
    """What ``--ft-replicas`` cannot do (yet), refused in one line before anything is written."""
    if not enabled(opts):
        return
    n = opts.ft_replicas
    if not has_torchft():
        raise ConfigError(
            f"--ft-replicas {n} needs torchft, which is not installed: pip install 'layershard[ft]'"
        )
    if cfg.strategy not in ("full", "grad_op"):
        raise ConfigError(
            f"--ft-replicas {n} with --strategy {cfg.strategy}: each replica group shards the "
            "model over its own ranks (full or grad_op) and torchft is the replica dimension; "
            "use --strategy full or grad_op"
        )
    for flag, value in (("tp", cfg.tp), ("ep", cfg.ep), ("cp", cfg.cp)):
        if value > 1:
            raise ConfigError(
                f"--ft-replicas {n} with --{flag} {value} is not supported yet (each group "
                "shards the model with ls.shard only); leave out --" + flag
            )
    unsupported = {
        "--qlora": cfg.qlora,
        "--precision fp16": cfg.precision == "fp16",
        "--optimizer muon": cfg.optimizer == "muon",
        "--offload": cfg.offload,
    }
    for flag, on in unsupported.items():
        if on:
            raise ConfigError(f"--ft-replicas {n} with {flag} is not supported yet; leave it out")
    if ":" in opts.nnodes:
        raise ConfigError(
            f"--ft-replicas {n} with an elastic --nnodes {opts.nnodes}: every group keeps its "
            "ranks (a peer's slices must fit); give a number of nodes"
        )
    if lighthouse_address(opts) is None and opts.ft_group != 0:
        raise ConfigError(
            f"--ft-group {opts.ft_group} needs the Lighthouse: --ft-lighthouse HOST:PORT (group "
            f"0's host, port {DEFAULT_PORT}, or torchft_lighthouse's) or TORCHFT_LIGHTHOUSE"
        )


def launch_record(opts: LaunchOptions) -> dict[str, Any] | None:
    """What the ranks read from launch.json (``ft``)."""
    if not enabled(opts):
        return None
    address = lighthouse_address(opts) or f"http://{socket.gethostname()}:{DEFAULT_PORT}"
    return {
        "replicas": opts.ft_replicas,
        "group": opts.ft_group,
        "lighthouse": address,
        "timeout_s": min(opts.timeout or DEFAULT_TIMEOUT_S, DEFAULT_TIMEOUT_S),
    }


def start_lighthouse(opts: LaunchOptions) -> Any:
    """Group 0 without a Lighthouse address: torchft's Lighthouse in this launcher (None
    otherwise). It lives as long as this launcher; for a long job run ``torchft_lighthouse``
    apart."""
    if not enabled(opts) or opts.ft_group != 0 or lighthouse_address(opts) is not None:
        return None
    from layershard.ft import lighthouse_server

    server = lighthouse_server(bind=f"[::]:{DEFAULT_PORT}")
    print(
        f"layershard train: torchft Lighthouse at {socket.gethostname()}:{DEFAULT_PORT}; start the "
        f"other groups with --ft-lighthouse {socket.gethostname()}:{DEFAULT_PORT}",
        file=sys.stderr,
        flush=True,
    )
    return server
