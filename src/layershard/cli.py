"""The `layershard` command. Each subcommand lives in its own package and provides two functions:
``add_arguments(parser)`` and ``run(args) -> int``; its module is imported only when it is used."""

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


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The parser; only the subcommand named in ``argv`` imports its module (keeps --help fast)."""
    argv = sys.argv[1:] if argv is None else argv
    chosen = next((a for a in argv if not a.startswith("-")), None)
    parser = argparse.ArgumentParser(
        prog="layershard",
        description="Layer-sharded data parallel training (ZeRO-3) for PyTorch.",
    )
    parser.add_argument("--version", action="version", version=f"layershard {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        p.set_defaults(_module=module)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if args.command is None:
        build_parser([]).print_help()
        return 0
    return int(importlib.import_module(args._module).run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
