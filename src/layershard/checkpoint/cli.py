"""``layershard checkpoint info PATH`` and ``layershard checkpoint export PATH OUT``."""

from __future__ import annotations

import argparse
import json
import sys
import time


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    info = sub.add_parser("info", help="step, world size, sizes and integrity of a checkpoint")
    info.add_argument("path", help="a checkpoint folder, a `latest` file or a folder holding one")
    info.add_argument("--quick", action="store_true", help="check file sizes only, not SHA-256")
    info.add_argument("--json", action="store_true", help="print JSON")
    exp = sub.add_parser(
        "export", help="convert a checkpoint to Hugging Face safetensors (no GPU needed)"
    )
    exp.add_argument("path", help="a checkpoint folder, a `latest` file or a folder holding one")
    exp.add_argument("out", help="output folder (safetensors shards, index, config.json)")
    exp.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    exp.add_argument("--max-shard-size", default="2GB", help="largest output file (default 2GB)")
    exp.add_argument("--no-verify", action="store_true", help="skip the SHA-256 check of the input")


def _human(n: int | None) -> str:
    if n is None:
        return "?"
    x: float = n  # an int until divided: "512 B"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if x < 1000 or unit == "TB":
            return f"{x:.1f} {unit}" if unit != "B" else f"{x} B"
        x /= 1000
    return str(x)


def run(args: argparse.Namespace) -> int:
    if args.action == "info":
        from layershard.checkpoint.info import checkpoint_info

        info = checkpoint_info(args.path, verify=not args.quick)
        if args.json:
            print(json.dumps(info, indent=1))
            return 0 if info["ok"] else 1
        print(f"checkpoint   {info['path']}")
        if "step" in info:
            print(f"step         {info['step']}")
            print(f"world size   {info['world_size']}")
            print(
                f"model        {info['model_class']} ({info['params']} tensors, {info['numel']:,} parameters)"
            )
            print(f"optimizer    {info['optimizer'] or '-'}")
            print(
                f"files        {info['files']}, {_human(info['bytes'])} ({info['bytes']:,} bytes)"
            )
            if info.get("created_unix"):
                print(
                    f"saved        {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime(info['created_unix']))} "
                    f"by layershard {info['layershard_version']}, torch {info['torch_version']}"
                )
        if info.get("latest_error"):
            done = info["checkpoints"]
            newest = (
                f"the newest complete one, {done[-1]['name']}" if done else "none: none is complete"
            )
            print(f"latest       BROKEN: {info['latest_error']} (--resume takes {newest})")
        elif info.get("latest"):
            print(f"latest       {info['latest']}")
        if info["checkpoints"]:
            print(
                "checkpoints  "
                + ", ".join(f"{c['name']} (step {c['step']})" for c in info["checkpoints"])
            )
        for d in info["leftovers"]:
            print(f"leftover     {d}  (an interrupted save; never loaded, safe to delete)")
        if info["ok"]:
            print(f"integrity    ok ({info['verified']} of every file)")
            return 0
        print(f"integrity    FAILED: {info['error']}")
        return 1

    if args.action == "export":
        import torch

        from layershard.checkpoint.errors import CheckpointError
        from layershard.checkpoint.hf import export_checkpoint, parse_size

        try:  # refused before anything is read or written
            if parse_size(args.max_shard_size) < 1:
                raise ValueError(
                    f"--max-shard-size must be at least 1 byte (e.g. 2GB), got {args.max_shard_size!r}"
                )
        except ValueError as e:
            print(f"layershard checkpoint export: error: {e}", file=sys.stderr)
            return 2
        t0 = time.perf_counter()
        try:
            out = export_checkpoint(
                args.path,
                args.out,
                getattr(torch, args.dtype),
                args.max_shard_size,
                verify=not args.no_verify,
            )
        except (CheckpointError, ValueError, OSError) as e:
            print(f"layershard checkpoint export: error: {e}", file=sys.stderr)
            return 1
        print(f"exported {args.path} -> {out} ({args.dtype}) in {time.perf_counter() - t0:.1f} s")
        return 0
    return 2
