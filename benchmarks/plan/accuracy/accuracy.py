"""The planner against the published runs of plan/records.py, before and after issue 36.

    python benchmarks/plan/accuracy/accuracy.py dump runs.json          # this tree's records
    PYTHONPATH=/tmp/old/src python benchmarks/plan/accuracy/accuracy.py old runs.json before.json
    python benchmarks/plan/accuracy/accuracy.py new runs.json after.json
    python benchmarks/plan/accuracy/accuracy.py report before.json after.json > report.md

``old`` plans each run with the planner of an older tree (``git worktree add --detach
/tmp/old <commit>``) as a user of it would: its only model family is layershard's Llama, so an
MPT block (12 d^2 matmul weights, GELU MLP) becomes a Llama block of ffn_dim 8d/3 (the same
matmul FLOPs), tied as MPT is; Hugging Face Llamas are its Llama; the network rate of the run's
cluster is passed as ``--inter-bw``; the fused loss and selective checkpointing it cannot
express. ``new`` uses this tree's planner with its defaults (plan/accuracy.py).
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import asdict

GIB = 2**30


def dump(path: str) -> None:
    from layershard.plan.network import get_cluster
    from layershard.plan.records import published_runs

    out = []
    for r in published_runs():
        d = asdict(r)
        d["shape"] = asdict(r.shape)
        d["held_out"] = r.held_out
        d["label"] = r.label
        d["inter_gbs"] = get_cluster(r.cluster).inter_gbs
        out.append(d)
    with open(path, "w") as f:
        json.dump(out, f, indent=0)


def old(runs_path: str, out_path: str) -> None:
    from layershard.plan import Cluster, ModelShape, Settings, get_gpu, make_plan

    rows = []
    for d in json.load(open(runs_path)):
        sh = d["shape"]
        ffn = round(8 * sh["dim"] / 3) if sh["family"] == "gpt" else sh["ffn_dim"]
        shape = ModelShape(
            vocab_size=sh["vocab_size"], dim=sh["dim"], n_layers=sh["n_layers"],
            n_heads=sh["n_heads"], n_kv_heads=sh["n_kv_heads"], ffn_dim=ffn,
            max_seq_len=sh["max_seq_len"], tie_embeddings=sh["tie_embeddings"], name=sh["name"],
        )  # fmt: skip
        name = "h100" if d["gpu"] == "h100-96g" else d["gpu"]
        gpu = get_gpu(name, memory_gb=96 if d["gpu"] == "h100-96g" else None,
                      inter_bw=d["inter_gbs"])  # fmt: skip
        s = Settings(micro_batch=d["micro_batch"], seq_len=d["seq"],
                     checkpoint_layers=d["checkpoint_layers"], grad_accum=d["grad_accum"],
                     reduce_dtype=d["reduce_dtype"], strategy=d["strategy"],
                     shard_size=d["shard_size"])  # fmt: skip
        p = make_plan(shape, gpu, Cluster(d["gpus"], min(8, d["gpus"])), s)
        rows.append(_row(d, p.time.tokens_per_s_per_gpu, p.fits, p.memory["peak"], None))
    json.dump(rows, open(out_path, "w"), indent=0)


def new(runs_path: str, out_path: str) -> None:
    from layershard.plan.accuracy import compare
    from layershard.plan.records import published_runs

    by_label = {d["label"]: d for d in json.load(open(runs_path))}
    rows = []
    for r in compare(published_runs()):
        d = by_label[r.run.label]
        rows.append(_row(d, r.plan.time.tokens_per_s_per_gpu, r.fits, r.plan.memory["peak"],
                         r.plan.device_bytes))  # fmt: skip
    json.dump(rows, open(out_path, "w"), indent=0)


def _row(d: dict, tps: float, fits: bool, peak: int, device: int | None) -> dict:
    return {"label": d["label"], "source": d["source"], "held_out": d["held_out"],
            "published": d["tokens_per_s_per_gpu"], "predicted": tps, "fits": fits,
            "peak_gib": peak / GIB, "device_gib": None if device is None else device / GIB,
            "published_peak_gib": d["peak_gib"], "not_modelled": d["not_modelled"]}  # fmt: skip


def _stats(rows: list[dict]) -> str:
    ratios = [r["predicted"] / r["published"] for r in rows]
    n = len(rows)
    w15 = sum(abs(x - 1) <= 0.15 for x in ratios)
    w25 = sum(abs(x - 1) <= 0.25 for x in ratios)
    dnf = sum(not r["fits"] for r in rows)
    return (f"{n} | {w15} ({w15 / n:.0%}) | {w25} ({w25 / n:.0%}) | "
            f"{statistics.median(ratios):.3f} | {min(ratios):.2f}-{max(ratios):.2f} | {dnf}")  # fmt: skip


def report(before_path: str, after_path: str) -> None:
    before, after = json.load(open(before_path)), json.load(open(after_path))
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(after):
        groups.setdefault(r["source"], []).append(i)
    head = ("| runs | n | within 15% | within 25% | median pred/pub | range | does not fit |\n"
            "|---|--:|--:|--:|--:|--:|--:|")  # fmt: skip
    for name, rows in (("before", before), ("after", after)):
        print(f"\n### {name}\n\n{head}")
        for src, idx in groups.items():
            tag = " (held out)" if rows[idx[0]]["held_out"] else " (fit set)"
            print(f"| {src}{tag} | {_stats([rows[i] for i in idx])} |")
        held = [r for r in rows if r["held_out"]]
        print(f"| all held out | {_stats(held)} |")
        print(f"| all | {_stats(rows)} |")
    print("\n### after: runs outside +-15% or said not to fit\n")
    print("| run | published tok/s/GPU | predicted | ratio | fits | not modelled |")
    print("|---|--:|--:|--:|---|---|")
    for r in after:
        ratio = r["predicted"] / r["published"]
        if abs(ratio - 1) > 0.15 or not r["fits"]:
            nm = "; ".join(r["not_modelled"]) or "-"
            print(
                f"| {r['label']} | {r['published']:.0f} | {r['predicted']:.0f} | "
                f"{ratio:.3f} | {'yes' if r['fits'] else 'NO'} | {nm} |"
            )
    print("\n### memory where a peak is published\n")
    print("| run | published GiB | before: plan peak | after: plan peak | after: on the GPU |")
    print("|---|--:|--:|--:|--:|")
    for b, a in zip(before, after):
        if a["published_peak_gib"]:
            print(
                f"| {a['label']} | {a['published_peak_gib']} | {b['peak_gib']:.1f} | "
                f"{a['peak_gib']:.1f} | {a['device_gib']:.1f} |"
            )


if __name__ == "__main__":
    cmd, *args = sys.argv[1:]
    {"dump": dump, "old": old, "new": new, "report": report}[cmd](*args)
