"""`layershard train` refuses bad input before anything starts: one line that says what to do,
exit code 2, no run folder. Config values, YAML types, model overrides, HF configs, tokenizers,
data files and records."""

from __future__ import annotations

import json

import pytest
from _train import TINY, refused_one_line


@pytest.fixture(autouse=True)
def cache(tmp_path_factory, monkeypatch):
    monkeypatch.setenv("LAYERSHARD_CACHE", str(tmp_path_factory.getbasetemp() / "ls-cache"))


def test_bad_numbers_and_config_values_are_refused(tmp_path, capsys):
    def refused(*argv):
        return refused_one_line(capsys, tmp_path, *TINY, *argv)

    assert "lr must be a finite number >= 0, got -0.001" in refused("--lr=-1e-3")
    assert "lr must be a finite number >= 0, got nan" in refused("--lr", "nan")
    assert "lr must be a finite number >= 0, got inf" in refused("--lr", "inf")
    assert "beta2 must be in [0, 1), got 1.0" in refused("--beta2", "1")
    assert "beta1 must be in [0, 1), got -0.1" in refused("--beta1=-0.1")
    assert "activation_checkpointing must be at least 0" in refused("--activation-checkpointing=-1")
    assert "max_bad_steps must be at least 1" in refused("--max-bad-steps", "0")
    assert "dim must be a positive integer" in refused("--model-override", "dim=abc")
    assert "n_heads must be a positive integer" in refused("--model-override=n_heads=-4")
    # YAML values of the wrong type name the key
    y = tmp_path / "bad.yaml"
    for text, expected in (
        ("data: 5\n", "data must be a list of strings, got 5"),
        ("precision: [bf16]\n", "precision must be a string, got ['bf16']"),
        ("async_checkpoint: 'yes'\n", "async_checkpoint must be true or false, got 'yes'"),
        ("val_fraction: lots\n", "val_fraction must be a number, got 'lots'"),
        ("steps: 1.5\n", "steps must be an integer, got 1.5"),
        ("model_overrides: [1]\n", "model_overrides must be a mapping"),
        ("hf_config: 3\n", "hf_config must be a string, got 3"),
    ):
        y.write_text(text)
        assert expected in refused_one_line(capsys, tmp_path, "--config", str(y)), text


def test_bad_hf_configs_and_tokenizers_are_refused(tmp_path, capsys):
    pytest.importorskip("transformers")

    def refused(*argv):
        return refused_one_line(capsys, tmp_path, *TINY, *argv)

    novocab = tmp_path / "novocab.json"
    novocab.write_text(json.dumps({"model_type": "llama", "vocab_size": 0}))
    assert "the config has no vocabulary (vocab_size=0)" in refused("--hf-config", str(novocab))
    novocab.write_text(json.dumps({"model_type": "llama", "vocab_size": None}))
    err = refused("--hf-config", str(novocab))
    assert f"{novocab}: not a config transformers can read" in err and "vocab_size" in err
    # a garbage tokenizer names the file
    garbage = tmp_path / "tok" / "tokenizer.json"
    garbage.parent.mkdir()
    garbage.write_text('{"version": "1.0", "model": 42}')
    err = refused("--tokenizer", str(garbage))
    assert f"{garbage} is not a tokenizer.json that the tokenizers library can read" in err
    garbage.write_bytes(b"\x89PNG\r\n\x1a\n")
    assert f"{garbage} is not a tokenizer.json" in refused("--tokenizer", str(garbage))


def test_bad_data_is_refused_naming_the_file_and_line(tmp_path, capsys):
    def refused(*argv):
        return refused_one_line(capsys, tmp_path, *TINY, *argv)

    binary = tmp_path / "blob.txt"
    binary.write_bytes(b"text\x00\x01\x02")
    assert f"{binary} is a binary file (a NUL byte at offset 4)" in refused("--data", str(binary))
    latin = tmp_path / "latin.txt"
    latin.write_bytes("ok\nalso ok\ncaf\u00e9\n".encode("latin-1"))
    assert f"{latin}:3 is not UTF-8 (byte 0xe9 at offset 14)" in refused("--data", str(latin))
    jsonl = tmp_path / "docs.jsonl"
    jsonl.write_bytes(b'{"text": "a"}\n{"text": "b"}\n{"text": "\xe9"}\n')
    assert f"{jsonl}:3 is not UTF-8" in refused("--data", str(jsonl))
    jsonl.write_text('{"text": "a"}\n{"text": null}\n')
    assert f"{jsonl}:2: 'text' is null; fix or remove the record" in refused("--data", str(jsonl))
    jsonl.write_text('{"text": "a"}\n\n{"text": 7}\n')
    assert f"{jsonl}:3: 'text' is a int, not a string" in refused("--data", str(jsonl))
    chat = tmp_path / "chat.jsonl"
    rows = [{"prompt": "q", "response": "a"}] * 3 + [{"prompt": "q", "response": None}]
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    sft = ("--task", "sft", "--data", str(chat))
    assert f"{chat}:4: 'response' is null, not a string" in refused(*sft)
    rows[3] = {
        "messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": None}]
    }
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert f"{chat}:4: the content of message 2 is null, not a string" in refused(*sft)
    rows[1] = {"question": "q"}
    chat.write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert f"{chat}:2: an SFT record needs 'prompt' and 'response'" in refused(*sft)
