"""`layershard train` end to end on 2 CPU ranks through torchrun, at a tiny size.

Each test is one or more real launches (torchrun + 2 gloo ranks, ~5-15 s each here).
"""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from layershard.train import cli as train_cli
from layershard.train.loop.report import read_metrics

# A small slice of the default corpus and a very small model: quick, and still learns.
TINY = [
    "--nproc-per-node", "2", "--max-files", "40", "--val-fraction", "0.2", "--vocab-size", "512",
    "--seq-len", "64", "--micro-batch", "4", "--lr", "3e-3", "--warmup-steps", "3",
    "--model-override", "dim=64", "--model-override", "n_layers=2",
    "--model-override", "ffn_dim=128", "--eval-sequences", "16", "--sample-tokens", "8",
]  # fmt: skip


def train_main(argv: list[str]) -> int:
    """`layershard train ARGV` in-process (only the train subcommand's parser)."""
    parser = argparse.ArgumentParser(prog="layershard train")
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    # one tokenizer/token cache for the module: the first test trains, the others reuse it
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))


def train(*argv: str) -> None:
    assert train_main([*TINY, *argv]) == 0


def losses(run, key="loss"):
    return {r["step"]: r[key] for r in read_metrics(run / "metrics.jsonl") if key in r}


def test_default_run_learns_and_fills_the_run_folder(tmp_path, capfd):
    run = tmp_path / "run"
    train("--run-dir", str(run), "--steps", "30", "--eval-interval", "10")
    out = capfd.readouterr().out
    assert "done in" in out and "--- sample" in out
    for name in ("config.yaml", "metrics.jsonl", "loss.png", "sample.txt", "tokenizer.json",
                 "summary.json", "final/config.json", "final/tokenizer.json"):  # fmt: skip
        assert (run / name).is_file(), name
    assert list((run / "checkpoints").glob("step_000030"))
    assert list((run / "final").glob("*.safetensors"))
    val = losses(run, "val_loss")
    assert sorted(val) == [0, 10, 20, 30]
    assert val[30] < val[0] - 0.5, val
    train_loss = losses(run)
    assert sum(train_loss[s] for s in range(26, 31)) < sum(train_loss[s] for s in range(1, 6)) - 2.5
    summary = json.loads((run / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["tokens_per_s"] > 0
    # The exported model is a transformers Llama that reproduces the trained model's loss.
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(run / "final")).eval()
    from layershard.train.data.batches import TokenSplit, read_windows

    launch = json.loads((run / "launch.json").read_text())
    val_split = TokenSplit.from_dict(launch["data"]["val"])
    tokens, _ = val_split.open()
    x, y = read_windows(tokens, None, torch.arange(2).numpy(), 64)
    with torch.no_grad():
        assert float(hf(x, labels=y).loss) < val[0] - 0.5


@pytest.mark.slow
def test_sft_trains_on_chat_jsonl(tmp_path):
    data = tmp_path / "chat.jsonl"
    rows = []
    for i in range(120):
        a, b = i % 10, (i * 7) % 10
        rows.append({"prompt": f"What is {a} plus {b}?", "response": f"{a} plus {b} is {a + b}."})
        rows.append({"messages": [{"role": "user", "content": f"Say {a} twice."},
                                  {"role": "assistant", "content": f"{a} {a}"}]})  # fmt: skip
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    # (padding instead of packing is covered by test_train_units: same loader, other layout)
    run = tmp_path / "sft"
    train("--run-dir", str(run), "--task", "sft", "--data", str(data), "--max-files", "1",
          "--steps", "8", "--eval-interval", "0")  # fmt: skip
    train_loss = losses(run)
    assert all(v == v for v in train_loss.values())  # finite
    assert train_loss[8] < train_loss[1]


@pytest.mark.slow
def test_hf_config_trains(tmp_path):
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(
        vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    cfg.save_pretrained(str(tmp_path / "hf"))
    run = tmp_path / "run"
    train("--run-dir", str(run), "--hf-config", str(tmp_path / "hf"), "--steps", "6",
          "--eval-interval", "0")  # fmt: skip
    val = losses(run, "val_loss")
    assert val[6] < val[0]
    # fine-tuning from the exported weights starts where that run ended
    ft = tmp_path / "ft"
    train("--run-dir", str(ft), "--init-from", str(run / "final"), "--steps", "2",
          "--eval-interval", "0")  # fmt: skip
    assert losses(ft, "val_loss")[0] == pytest.approx(val[6], rel=1e-4)
