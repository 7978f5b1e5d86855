"""`layershard train --qlora --precision bf16`: the base loaded in 4 bits with its embedding, head
and norms in bf16 (train/loop/qlora.py: the compute dtype, stored so by ls.shard), trained and
resumed at 2 ranks; the losses of the resumed run are the uninterrupted run's, bitwise."""

from __future__ import annotations

import json
import math

import pytest
from _train import TINY, train_main

# End-to-end launches of whole runs (bf16 matmuls are slow on this CPU): outside the fast tier.
pytestmark = pytest.mark.slow

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")


def _losses(run) -> list[float]:
    rows = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


def test_train_qlora_bf16_resumes(tmp_path, qlora_base):
    # qlora_base (tests/conftest.py): one step of a 2-layer, 64-wide transformers Llama
    args = ["--steps", "4", "--eval-interval", "0", "--lr", "1e-2", "--checkpoint-interval", "2",
            "--init-from", str(qlora_base), "--qlora", "--precision", "bf16", *TINY]  # fmt: skip
    run, resumed = tmp_path / "run", tmp_path / "resumed"
    assert train_main(["--run-dir", str(run), *args]) == 0
    losses = _losses(run)
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses)
    assert train_main(["--run-dir", str(resumed), *args, "--stop-at-step", "2"]) == 0
    assert train_main(["--run-dir", str(resumed), *args, "--resume"]) == 0
    assert _losses(resumed) == losses
