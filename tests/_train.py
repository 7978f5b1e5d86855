"""`layershard train` in-process, for the tests of the training command."""

from __future__ import annotations

import argparse

from layershard.train import cli as train_cli

# A 2-layer, 64-wide Llama on 40 corpus files: the launch-level checks need no more.
TINY = [
    "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512", "--seq-len", "64",
    "--micro-batch", "4", "--model-override", "dim=64", "--model-override", "n_layers=2",
    "--model-override", "ffn_dim=128", "--nproc-per-node", "2",
]  # fmt: skip


def train_main(argv: list[str]) -> int:
    """`layershard train ARGV` in-process (only the train subcommand's parser)."""
    parser = argparse.ArgumentParser(prog="layershard train")
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


def refused_one_line(capsys, tmp_path, *argv: str) -> str:
    """`layershard train ARGV` fails with exit 2, one line, and writes no run folder."""
    run = tmp_path / "run"
    assert train_main(["--run-dir", str(run), *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith("layershard train: error: "), err
    assert not run.exists()
    return err
