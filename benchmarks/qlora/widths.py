"""The QLoRA planner against the bytes a rank holds, at a real model's widths (issue 52).

A Llama at CONFIG's true widths (hidden, FFN, heads, kv heads, vocabulary) with LAYERS blocks is
built block linear by block linear, each quantized by bitsandbytes (NF4, double quantization) on
the CPU, with PEFT LoRA r=16 on every block linear and the embedding, head and norms in bf16
(tests/_qlora_widths.py); ``ls.shard`` shards it at WORLD ranks on torch's fake process group
(this process is rank 0: its storage is what a rank of WORLD holds; tests/_qlora_budget.py),
bf16 compute, every block checkpointed. Two training steps of SEQ tokens run (their values are
meaningless: the fake group exchanges nothing; their bytes are exact), and then:

- the bytes per rank by kind, per block (every block holds the same) and outside the blocks,
  read from the flat groups, the quantization states, the gradients and AdamW's state, against
  ``plan.qlora.qlora_terms`` (the planner's per-layer and fixed terms);
- the full-depth totals the planner gives (layers x per-layer + fixed) against the same sum of
  the measured terms: linear in the depth, as every block is the same;
- MemTracker's peak of the second step (every tensor) against the planner's peak at SEQ.

One JSON line per run is appended to OUT::

    python benchmarks/qlora/widths.py CONFIG LAYERS WORLD SEQ OUT
    python benchmarks/qlora/widths.py --summary OUT     # a table of every run in OUT
    python benchmarks/qlora/widths.py benchmarks/qlora/configs/llama3-70b 2 2 16 \
        benchmarks/qlora/widths/runs.jsonl
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from _qlora_budget import fake_world, step_peak  # noqa: E402
from _qlora_widths import build, shape_of, unit_bytes  # noqa: E402

import layershard as ls  # noqa: E402
from layershard.plan.model import ModelShape  # noqa: E402
from layershard.plan.qlora import (  # noqa: E402
    STATE_KINDS,
    QLoRASettings,
    qlora_memory,
    qlora_terms,
)


def compare(measured: dict, shape: ModelShape, world: int, seq: int) -> dict:
    """The planner's terms beside the measured ones, and their ratios."""
    s = QLoRASettings(world=world, seq_len=seq)
    terms = qlora_terms(shape, s)
    out: dict = {"layer": {}, "fixed": {}}
    for where in ("layer", "fixed"):
        got = measured["block" if where == "layer" else "fixed"]
        for kind, plan in terms[where].items():
            if kind in got and (got[kind] or plan):
                out[where][kind] = {"measured": got[kind], "planned": int(plan),
                                    "ratio": got[kind] / plan if plan else None}  # fmt: skip
    return out


def main(argv: list[str]) -> None:
    config, layers, world, seq, out = argv[0], int(argv[1]), int(argv[2]), int(argv[3]), argv[4]
    t0 = time.time()
    shape = shape_of(config, layers)
    model = build(shape)
    built = time.time() - t0
    with fake_world(world):
        sm = ls.shard(
            model,
            mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16),
            activation_checkpointing=layers,
        )
        opt = torch.optim.AdamW(sm.parameters(), lr=1e-4)
        x = torch.randint(0, shape.vocab_size, (1, seq), generator=torch.Generator().manual_seed(0))

        def step() -> None:
            out = sm(input_ids=x, labels=x)  # held through backward, as the plan assumes
            out.loss.backward()
            opt.step()
            opt.zero_grad()

        step()
        peak = step_peak(sm, opt, step)
        measured = unit_bytes(sm, opt)
    planned = qlora_memory(shape, QLoRASettings(world=world, seq_len=seq))
    full = ModelShape.from_hf_config(config)
    terms = compare(measured, shape, world, seq)
    depth = full.n_layers
    # the full-depth model states: per layer x depth + fixed, measured and planned
    states = STATE_KINDS  # the model-state kinds plan/qlora.py sums
    total_measured = sum(depth * measured["block"][k] + measured["fixed"].get(k, 0) for k in states)
    full_plan = qlora_memory(full, QLoRASettings(world=world, seq_len=seq))
    row = {
        "config": Path(config).name, "layers": layers, "world": world, "seq": seq,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "build_s": round(built, 1), "total_s": round(time.time() - t0, 1),
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "terms": terms,
        "full_depth": {"layers": depth, "measured_states": int(total_measured),
                       "planned_states": full_plan["model_states"],
                       "ratio": total_measured / full_plan["model_states"]},
        "step_peak": {"measured": peak, "planned": planned["peak"],
                      "ratio": peak / planned["peak"]},
        "measured": measured,
    }  # fmt: skip
    with open(out, "a") as f:
        f.write(json.dumps(row) + "\n")
    worst = max(abs(v["ratio"] - 1) for t in terms.values() for v in t.values() if v["ratio"])
    print(json.dumps({k: row[k] for k in ("config", "layers", "full_depth", "step_peak")}))
    print(f"worst term: {worst:.4%} off the plan")


def summary(path: str) -> str:
    """Every run of ``path``: each term measured / planned, the full-depth totals, the peak."""
    lines = []
    for line in Path(path).read_text().splitlines():
        r = json.loads(line)
        lines.append(
            f"{r['config']}: {r['layers']} blocks at world {r['world']}, seq {r['seq']} "
            f"({r['date']}, {r['total_s']:.0f} s, peak RSS {r['peak_rss_bytes'] / 2**30:.2f} GiB)"
        )
        for where, terms in r["terms"].items():
            for kind, t in terms.items():
                lines.append(
                    f"  {where:5s} {kind:14s} measured {t['measured']:>14,d}  planned "
                    f"{t['planned']:>14,d}  ratio {t['ratio']:.6f}"
                )
        d, p = r["full_depth"], r["step_peak"]
        lines.append(
            f"  model states at {d['layers']} blocks: measured terms {d['measured_states']:,d}, "
            f"planned {d['planned_states']:,d} ({d['planned_states'] / 2**30:.2f} GiB), "
            f"ratio {d['ratio']:.6f}"
        )
        lines.append(
            f"  step peak (MemTracker) {p['measured']:,d}, planned {p['planned']:,d}, "
            f"ratio {p['ratio']:.4f}"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if sys.argv[1] == "--summary":
        print(summary(sys.argv[2]))
    else:
        main(sys.argv[1:])
