"""`layershard plan --qlora` for fine-tuning on small budgets (issue 52): the model-state terms
by layer, the memory levers (chunked loss, checkpointed inputs on host, CPUOffload) and the
largest sequence that fits, for Llama-3-70B on 2 x 24 GB and Llama-3.1-8B on 1 x 16 GB."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest

from layershard.cli import main
from layershard.plan.memory import chunked_logits_bytes
from layershard.plan.model import ModelShape
from layershard.plan.qlora import (
    LEVERS,
    SEQ_STEP,
    STATE_KINDS,
    QLoRASettings,
    largest_seq,
    levers,
    qlora_memory,
    qlora_terms,
    usable,
)

CONFIGS = Path(__file__).resolve().parents[2] / "benchmarks/qlora/configs"
GIB = 1 << 30


def _shape(name: str) -> ModelShape:
    return ModelShape.from_hf_config(str(CONFIGS / name))


def test_totals_are_the_layer_terms_times_the_depth_plus_the_fixed_ones():
    shape = _shape("llama3-70b")
    s = QLoRASettings(world=2, seq_len=2048)
    t, m = qlora_terms(shape, s), qlora_memory(shape, s)
    for kind in STATE_KINDS:
        assert m[kind] == int(80 * t["layer"][kind] + t["fixed"].get(kind, 0)), kind
    # bf16 frozen embedding and head: 2 bytes x 2 x 128256 x 8192 / 2 ranks (+ 81 norms)
    assert t["fixed"]["frozen_other"] == 2 * (2 * 128256 * 8192 + 8192) / 2
    fp32 = qlora_terms(shape, replace(s, frozen_dtype="fp32"))
    assert fp32["fixed"]["frozen_other"] == 2 * t["fixed"]["frozen_other"]


def test_each_lever_changes_its_own_terms():
    shape, s = _shape("llama3-70b"), QLoRASettings(world=2, seq_len=2048)
    m = qlora_memory(shape, s)
    chunked = qlora_memory(shape, replace(s, loss_chunks=8))
    assert chunked["logits"] == chunked_logits_bytes(shape, 2048, 8, "bf16") < m["logits"] / 10
    host = qlora_memory(shape, replace(s, offload_activations=True))
    # the inputs go to host; the one being recomputed comes back
    assert host["host"] == m["checkpointed_inputs"] == 80 * 2048 * 8192 * 2
    assert host["peak"] == m["peak"] - m["checkpointed_inputs"] + 2048 * 8192 * 2
    off = qlora_memory(shape, replace(s, offload=True))
    assert off["host"] == sum(m[k] for k in
                              ("packed_base", "frozen_other", "adapters", "adapter_grads",
                               "optimizer"))  # fmt: skip
    assert off["peak"] == m["peak"] - off["host"]


@pytest.mark.parametrize(
    "config, world, gib, expected",
    [
        # Llama-3-70B on 2 x 24 GB: its model states alone (20.5 GiB) exceed what a 24 GiB
        # card leaves (20.4): only CPUOffload fits it, then at its whole context
        ("llama3-70b", 2, 24, [0, 0, 0, 8192]),
        ("llama3.1-70b", 2, 24, [0, 0, 0, 31744]),
        # Llama-3.1-8B on one 16 GB card: 2816 as it is, 11008 with the chunked loss
        ("llama3.1-8b", 1, 16, [2816, 11008, 19968, 39424]),
    ],
)
def test_largest_sequence_per_lever(config, world, gib, expected):
    shape = _shape(config)
    s = QLoRASettings(world=world, seq_len=2048)
    rows = levers(shape, s, gib * GIB)
    assert [r["largest_seq"] for r in rows] == expected
    budget = usable(gib * GIB)
    changes: dict = {}
    for row, (_, change) in zip(rows, LEVERS):
        changes |= change
        t = replace(s, **changes)
        seq = row["largest_seq"]
        assert largest_seq(shape, t, gib * GIB) == seq
        if seq:  # it fits, and one step longer does not (or the model's context ends)
            assert qlora_memory(shape, replace(t, seq_len=seq))["peak"] <= budget
        if seq + SEQ_STEP <= shape.max_seq_len:
            assert qlora_memory(shape, replace(t, seq_len=seq + SEQ_STEP))["peak"] > budget


def test_plan_prints_the_levers(capsys):
    args = ["plan", "--qlora", "--hf-config", str(CONFIGS / "llama3.1-8b"), "--gpus", "1",
            "--gpu-memory", "16", "--seq-len", "2048"]  # fmt: skip
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "largest sequence that fits: 2816" in out
    assert "+ chunked loss (8 chunks)" in out and "11008" in out
    assert "embedding, head, norms (bf16) / N" in out
