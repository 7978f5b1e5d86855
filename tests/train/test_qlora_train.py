"""`layershard train --qlora --init-from FOLDER`: the model loaded in 4 bits with LoRA on every
linear, trained on the built-in pipeline at 2 ranks; the run's final/ is a PEFT adapter."""

from __future__ import annotations

import json

import pytest
from _train import TINY, refused_one_line, train_main

# End-to-end launches of whole runs: outside the fast tier.
pytestmark = pytest.mark.slow

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _metric(run, key: str) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r[key] for r in rows if key in r]


def test_train_qlora_from_a_model_folder(tmp_path, qlora_base):
    import peft
    import transformers

    # qlora_base (tests/conftest.py): a model folder with its tokenizer.json, as --init-from
    # reads; one step of a 2-layer, 64-wide transformers Llama, shared with the bf16 test
    run, resumed = tmp_path / "qlora", tmp_path / "resumed"
    args = ["--steps", "6", "--eval-interval", "0", "--lr", "1e-2", "--checkpoint-interval", "3",
            "--init-from", str(qlora_base), "--qlora", *TINY]  # fmt: skip
    assert train_main(["--run-dir", str(run), *args]) == 0
    val = _metric(run, "val_loss")
    assert val[-1] < val[0]  # the adapters learned
    # stopped after step 3's checkpoint and resumed: steps 4-6 as the uninterrupted run's (the
    # base read again in 4 bits from --init-from, the adapters and AdamW from the checkpoint)
    assert train_main(["--run-dir", str(resumed), *args, "--stop-at-step", "3"]) == 0
    assert train_main(["--run-dir", str(resumed), *args, "--resume"]) == 0
    assert _metric(resumed, "loss") == _metric(run, "loss")
    files = sorted(p.name for p in (run / "final").iterdir())
    assert "adapter_model.safetensors" in files and not any(f.startswith("model") for f in files)
    four_bit = transformers.AutoModelForCausalLM.from_pretrained(
        str(qlora_base), device_map="cpu",
        quantization_config=transformers.BitsAndBytesConfig(load_in_4bit=True),
    )  # fmt: skip
    loaded = peft.PeftModel.from_pretrained(four_bit, str(run / "final"))
    assert sum("lora_B" in n and p.abs().sum() > 0 for n, p in loaded.named_parameters()) == 14


def test_train_qlora_needs_init_from(capsys, tmp_path):
    err = refused_one_line(capsys, tmp_path, "--qlora")
    assert "--init-from" in err
