"""`layershard plan --qlora` against the bytes a rank holds at Llama-3.1-8B's true widths (hidden
4096, FFN 14336, 32 heads, 8 kv heads, vocabulary 128256) with two blocks, quantized by
bitsandbytes and sharded at world size 2 on the fake process group (tests/_qlora_widths.py,
tests/_qlora_budget.py): the planner's per-layer and fixed terms (plan/qlora.py ``qlora_terms``)
are the measured ones. benchmarks/qlora/widths.py does the same at Llama-3-70B's widths, with the
results recorded in benchmarks/qlora/widths/."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

pytest.importorskip("bitsandbytes")
pytest.importorskip("peft")

from _qlora_budget import fake_world, in_own_process, step_peak  # noqa: E402
from _qlora_widths import build, shape_of, unit_bytes  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.plan.qlora import QLoRASettings, qlora_memory, qlora_terms  # noqa: E402

CONFIG = Path(__file__).resolve().parents[2] / "benchmarks/qlora/configs/llama3.1-8b"
WORLD, SEQ = 2, 8


@pytest.mark.slow  # quantizing 2 x 218M weights on this CPU: ~1 min; ~4 GB at its peak
@in_own_process
def test_planned_terms_are_the_measured_bytes_at_llama3_8b_widths():
    shape = shape_of(str(CONFIG), 2)  # two blocks: the two gather slots they take in turn
    model = build(shape)
    with fake_world(WORLD):
        sm = ls.shard(model, mixed_precision=ls.MixedPrecision(torch.bfloat16),
                      activation_checkpointing=2)  # fmt: skip
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-4)
        x = torch.randint(0, shape.vocab_size, (1, SEQ), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            out = sm(input_ids=x, labels=x)
            out.loss.backward()
            opt.step()
            opt.zero_grad()

        step()
        peak = step_peak(sm, opt, step)
        got = unit_bytes(sm, opt)
    s = QLoRASettings(world=WORLD, seq_len=SEQ)
    terms = qlora_terms(shape, s)
    # Exact: half a byte per 4-bit weight / N (the widths are multiples of the flat alignment),
    # r (in + out) fp32 per linear / N with its gradient and two AdamW moments, bf16 norms / N
    for kind in ("packed_base", "frozen_other", "adapters", "adapter_grads", "optimizer"):
        assert got["block"][kind] == terms["layer"][kind], kind
    assert got["fixed"]["frozen_other"] == terms["fixed"]["frozen_other"]  # embedding, head, norm
    # The quantization state: the planner's 1160 bytes per tensor for the code books and the
    # nested state's scalars are a round figure (measured 0.013% under); the gather slots: the
    # final norm's own small slot is not planned (measured 0.004% over)
    assert abs(got["block"]["quant_state"] / terms["layer"]["quant_state"] - 1) <= 1e-3
    assert abs(got["fixed"]["gather_slots"] / terms["fixed"]["gather_slots"] - 1) <= 1e-3
    # The step's peak (MemTracker, every tensor) under the planner's, which adds the gathered
    # head and the logits that the engine never holds at once: measured 0.984 at 2 blocks, seq 16
    planned = qlora_memory(shape, s)["peak"]
    assert 0.95 <= peak / planned <= 1.0, (peak, planned)
