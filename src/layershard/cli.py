"""The `layershard` command. Each subcommand lives in its own package and registers itself
through two functions: ``add_arguments(parser)`` and ``run(args) -> int``."""

from __future__ import annotations

import argparse
import importlib
import sys

from layershard import __version__

# name -> (module, one-line help). Modules are imported lazily so `layershard --help` is fast.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": (
        "layershard.train.cli",
        "pre-train or fine-tune a causal LM on local ranks or many nodes",
    ),
    "checkpoint": ("layershard.checkpoint.cli", "inspect or export layershard checkpoints"),
    "bench": ("layershard.bench.cli", "benchmark layershard against torch FSDP2, FSDP1 and DDP"),
    "plan": ("layershard.plan.cli", "predict per-GPU memory and step time for a run"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="layershard",
        description="Layer-sharded data parallel training (ZeRO-3) for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"layershard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        try:
            importlib.import_module(module).add_arguments(p)
        except ModuleNotFoundError as e:
            if e.name is None or not module.startswith(e.name):
                raise
            p.set_defaults(_missing=True)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    if getattr(args, "_missing", False):
        print(f"layershard {args.command}: not available in this build", file=sys.stderr)
        return 2
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
