"""`layershard train` pieces without launching ranks: tokenizer cache, data sharding and resume
position, SFT loss masks, the schedule, weight-decay groups and one-line config errors."""

from __future__ import annotations

import argparse
import json
import math

import numpy as np
import pytest
import torch

from layershard.train import cli as train_cli
from layershard.train.config import ConfigError, TrainConfig, grad_accum_for, load_yaml, resolve
from layershard.train.data import sft
from layershard.train.data.batches import BatchLoader, TokenSplit, find_files, is_val, read_windows
from layershard.train.data.tokenizer import bpe_cache_path, train_or_load_bpe
from layershard.train.loop.optimizer import lr_at, param_groups

TEXTS = [
    "def add(a, b):\n    return a + b\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x, self.y = x, y\n",
    "import os\nprint(os.getcwd())\n",
] * 20


def train_main(argv: list[str]) -> int:
    """`layershard train ARGV` in-process (only the train subcommand's parser)."""
    parser = argparse.ArgumentParser(prog="layershard train")
    train_cli.add_arguments(parser)
    return train_cli.run(parser.parse_args(argv))


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_tokenizer_is_trained_once_and_cached(cache):
    calls = []

    def texts():
        calls.append(1)
        return iter(TEXTS)

    tok, trained = train_or_load_bpe(texts, "abc123", 300)
    assert trained and len(calls) == 1
    assert bpe_cache_path("abc123", 300).is_file()
    assert str(bpe_cache_path("abc123", 300)).startswith(str(cache))
    again, trained = train_or_load_bpe(texts, "abc123", 300)
    assert not trained and len(calls) == 1  # the corpus is not read again
    text = "def add(a, b):\n    return a + b\n"
    assert again.encode(text) == tok.encode(text)
    assert tok.decode(tok.encode(text)) == text  # byte-level: lossless
    assert tok.eos_id is not None and tok.chat_tokens
    # another vocabulary size or another corpus is another tokenizer
    _, trained = train_or_load_bpe(texts, "abc123", 320)
    assert trained
    _, trained = train_or_load_bpe(texts, "def456", 300)
    assert trained


def _split(tmp_path, n_tokens, mask=None) -> TokenSplit:
    path = tmp_path / "t.bin"
    np.arange(n_tokens, dtype=np.uint16).tofile(path)
    mpath = None
    if mask is not None:
        mpath = tmp_path / "t.mask"
        np.asarray(mask, dtype=np.uint8).tofile(mpath)
    return TokenSplit(path, mpath, "uint16", n_tokens)


def test_ranks_get_disjoint_shares_that_cover_the_epoch(tmp_path):
    seq, mb, ga, world = 4, 2, 3, 2
    split = _split(tmp_path, 48 * seq + 3)  # 48 windows; the 3 tail tokens are never used
    loaders = [BatchLoader(split, seq, mb, ga, r, world, seed=7) for r in range(world)]
    seen = [[], []]
    for _ in range(48 // (mb * ga * world)):  # one epoch
        for r, loader in enumerate(loaders):
            batches = loader.next_step()
            assert len(batches) == ga and batches[0][0].shape == (mb, seq)
            for x, y in batches:
                assert torch.equal(x, y)  # pre-training: labels are the inputs
                seen[r] += (x[:, 0] // seq).tolist()
    assert not set(seen[0]) & set(seen[1])
    assert sorted(seen[0] + seen[1]) == list(range(48))
    assert seen[0] != sorted(seen[0])  # shuffled
    # The same global batches whatever the number of ranks.
    single = BatchLoader(split, seq, mb, ga * world, 0, 1, seed=7)
    step = {int(v) for x, _ in single.next_step() for v in x[:, 0] // seq}
    fresh = [BatchLoader(split, seq, mb, ga, r, world, seed=7) for r in range(world)]
    two = {int(v) for ld in fresh for x, _ in ld.next_step() for v in x[:, 0] // seq}
    assert step == two


def test_loader_state_resumes_exactly(tmp_path):
    split = _split(tmp_path, 40 * 8)
    a = BatchLoader(split, 8, 2, 1, 1, 2, seed=3)
    for _ in range(13):  # past an epoch boundary (10 steps per epoch)
        a.next_step()
    state = json.loads(json.dumps(a.state_dict()))  # survives a checkpoint's JSON
    b = BatchLoader(split, 8, 2, 1, 1, 2, seed=3)
    b.load_state_dict(state)
    for _ in range(10):
        (xa, _), (xb, _) = a.next_step()[0], b.next_step()[0]
        assert torch.equal(xa, xb)
    with pytest.raises(ConfigError, match="same --seed"):
        BatchLoader(split, 8, 2, 1, 1, 2, seed=4).load_state_dict(state)


def test_too_little_data_for_one_step_is_an_error(tmp_path):
    with pytest.raises(ConfigError, match="add data or lower --seq-len"):
        BatchLoader(_split(tmp_path, 30), 8, 2, 1, 0, 2, seed=0)


def test_sft_masks_prompt_tokens(cache):
    tok, _ = train_or_load_bpe(lambda: iter(TEXTS), "sft", 300)
    rec = {"prompt": "What is 2+2?", "response": "4, of course."}
    ids, mask = sft.encode_example(rec, tok)
    assert len(ids) == len(mask)
    trained = [i for i, m in zip(ids, mask) if m]
    assert tok.decode(trained) == "4, of course." + "<|endoftext|>"
    context = tok.decode([i for i, m in zip(ids, mask) if not m])
    assert "What is 2+2?" in context and "4" not in context
    # messages: every assistant turn is trained, system and user turns are not
    msgs = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello"},
        {"role": "user", "content": "Bye"},
        {"role": "assistant", "content": "Ciao"},
    ]}  # fmt: skip
    ids, mask = sft.encode_example(msgs, tok)
    eos = "<|endoftext|>"
    assert tok.decode([i for i, m in zip(ids, mask) if m]) == f"Hello{eos}Ciao{eos}"
    # the labels the model sees: -100 exactly where the mask is 0, in packing and padding
    pid, pmask = sft.pad_or_truncate(ids, mask, 64, tok.pad_id)
    assert len(pid) == 64 and sum(pmask) == sum(mask)
    x, y = read_windows(np.asarray(pid), np.asarray(pmask, dtype=np.uint8), np.array([0]), 64)
    assert torch.equal(y[0] != -100, torch.tensor(pmask, dtype=torch.bool))
    assert torch.equal(y[0][y[0] != -100], x[0][y[0] != -100])
    with pytest.raises(ConfigError, match="prompt"):
        sft.encode_example({"question": "?"}, tok)


def test_lr_schedule_and_decay_groups_by_name():
    cfg = TrainConfig(lr=1.0, warmup_steps=10, steps=110, min_lr_ratio=0.1)
    assert lr_at(0, cfg) == pytest.approx(0.1)
    assert lr_at(9, cfg) == pytest.approx(1.0)
    assert lr_at(60, cfg) == pytest.approx(0.55)
    assert lr_at(110, cfg) == pytest.approx(0.1)
    # sharded parameters are 1-D views, so decay is decided by name only
    named = [(n, torch.nn.Parameter(torch.zeros(4))) for n in (
        "embed.weight", "layers.0.attn_norm.weight", "layers.0.attn.wq.weight",
        "norm.weight", "lm_head.weight", "model.layers.0.mlp.down_proj.bias",
    )]  # fmt: skip
    decay, no_decay = param_groups(named, TrainConfig(weight_decay=0.1))
    assert decay["weight_decay"] == 0.1 and no_decay["weight_decay"] == 0.0
    assert [p is q for p, q in zip(decay["params"], (named[2][1], named[4][1]))] == [True, True]
    assert len(no_decay["params"]) == 4


def test_config_layers_and_errors(tmp_path):
    y = tmp_path / "run.yaml"
    y.write_text("lr: 1e-3\nseq-len: 128\ndata: corpus.txt\n")
    cfg = resolve(load_yaml(y), {"lr": 5e-4})
    assert cfg.lr == 5e-4 and cfg.seq_len == 128 and cfg.data == ["corpus.txt"]
    y.write_text("lrr: 1e-3\n")
    with pytest.raises(ConfigError, match="unknown config key 'lrr'.*did you mean 'lr'"):
        load_yaml(y)
    with pytest.raises(ConfigError, match="precision must be one of"):
        resolve({"precision": "fp8"})
    with pytest.raises(ConfigError, match="not a multiple of seq_len"):
        grad_accum_for(resolve({"batch_tokens": 1000, "seq_len": 64, "micro_batch": 2}), 2)
    assert grad_accum_for(resolve({"batch_tokens": 1024, "seq_len": 64, "micro_batch": 2}), 2) == 4
    # --tp: a TP group's ranks share their batch, so 4 ranks at tp 2 are 2 data-parallel ones
    tp2 = resolve({"batch_tokens": 1024, "seq_len": 64, "micro_batch": 2, "tp": 2})
    assert grad_accum_for(tp2, 4) == 4
    assert resolve({"tp": 2, "ep": 2}).ep == 2  # TP x EP (a MoE's attention and experts)
    assert is_val("a.py", 0.5) == is_val("a.py", 0.5)
    assert math.isclose(sum(is_val(f"{i}", 0.2) for i in range(2000)) / 2000, 0.2, abs_tol=0.04)
    with pytest.raises(ConfigError, match="does not exist"):
        find_files(resolve({"data": [str(tmp_path / "missing.txt")]}))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="corpus is empty"):
        find_files(resolve({"data": [str(tmp_path / "empty")]}))


def _cli_error(capsys, *argv) -> str:
    assert train_main([*argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0, err  # one line
    return err


def test_cli_errors_are_one_line_and_touch_nothing(tmp_path, capsys, cache):
    run = tmp_path / "run"
    err = _cli_error(capsys, "--run-dir", str(run), "--data", str(tmp_path / "nope.txt"))
    assert "does not exist" in err and not run.exists()
    err = _cli_error(capsys, "--run-dir", str(run), "--seq-len", "100000")
    assert "exceeds the model's maximum sequence length 512" in err and "--seq-len" in err
    err = _cli_error(
        capsys, "--run-dir", str(run), "--batch-tokens", "9000", "--nproc-per-node", "2"
    )
    assert "256*8*2" in err and "--batch-tokens 8192" in err  # names the fix
    y = tmp_path / "bad.yaml"
    y.write_text("stepz: 3\n")
    assert "did you mean 'steps'" in _cli_error(capsys, "--config", str(y))
    run.mkdir()
    (run / "metrics.jsonl").write_text("precious\n")
    err = _cli_error(capsys, "--run-dir", str(run))
    assert "--overwrite" in err and (run / "metrics.jsonl").read_text() == "precious\n"
    err = _cli_error(capsys, "--run-dir", str(run), "--overwrite")
    assert "not a run folder" in err and (run / "metrics.jsonl").read_text() == "precious\n"
    err = _cli_error(capsys, "--run-dir", str(tmp_path / "fresh"), "--resume")
    assert "config.yaml" in err
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "blank.txt").write_text("")
    err = _cli_error(capsys, "--run-dir", str(tmp_path / "r2"), "--data", str(empty))
    assert "corpus is empty" in err and not (tmp_path / "r2").exists()


@pytest.mark.parametrize("packing", ["pack", "pad"])
def test_sft_pipeline_labels_only_responses(tmp_path, cache, packing):
    from layershard.train.data.prepare import prepare_splits

    data = tmp_path / "chat.jsonl"
    rows = [{"prompt": f"Q{i}: add {i} and 1", "response": f"A{i}: {i + 1}"} for i in range(40)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = resolve({"task": "sft", "data": [str(data)], "seq_len": 32, "sft_packing": packing,
                   "val_fraction": 0.1})  # fmt: skip
    tok, _ = train_or_load_bpe(lambda: iter(TEXTS + [json.dumps(r) for r in rows]), "p", 300)
    manifest = prepare_splits([data], cfg, tok, "sft-corpus")
    split = TokenSplit.from_dict(manifest["train"])
    tokens, mask = split.open()
    n_windows = split.n_tokens // 32
    if packing == "pad":  # one example per window, padded
        assert split.n_tokens == 32 * manifest["docs"]["train"]
    x, y = read_windows(tokens, mask, np.arange(n_windows), 32)
    eos = "<|endoftext|>"
    trained = tok.decode(x[y != -100].tolist())
    answers = [a for a in trained.split(eos) if a]
    # (the last one may be cut where the stream's last whole window ends)
    assert answers and all(a.startswith("A") for a in answers)
    assert all(":" in a for a in answers[:-1])
    assert "Q" not in trained and "add" not in trained  # no prompt token is a target


def test_hf_config_asking_for_custom_code_is_refused(tmp_path, capsys, cache):
    """Security: a model folder whose config maps to its own Python (``auto_map``) is refused
    with one line, and its code never runs (transformers would prompt to run it)."""
    from layershard.models.hf import load_hf_config

    marker = tmp_path / "pwned"
    folder = tmp_path / "model"
    folder.mkdir()
    cfg = {
        "model_type": "evil",
        "auto_map": {
            "AutoConfig": "configuration_evil.EvilConfig",
            "AutoModelForCausalLM": "modeling_evil.EvilForCausalLM",
        },
        "vocab_size": 100,
    }
    (folder / "config.json").write_text(json.dumps(cfg))
    for mod in ("configuration_evil", "modeling_evil"):
        (folder / f"{mod}.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for path in (folder, folder / "config.json"):
        with pytest.raises(ValueError, match="asks for custom model code.*does not run code"):
            load_hf_config(path)
    err = _cli_error(capsys, "--run-dir", str(tmp_path / "run"), "--hf-config", str(folder))
    assert "custom model code" in err and not (tmp_path / "run").exists()
    assert not marker.exists()
