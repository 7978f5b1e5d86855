"""Summarize benchmarks/qlora runs: per implementation, the median step time of each run, the
pooled median over every run's steps, and the largest peak RSS of any rank; then ls / fsdp."""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    runs = [json.loads(line) for line in open(path)]
    pooled: dict[str, list[float]] = {}
    peak: dict[str, list[float]] = {}
    for r in runs:
        med = statistics.median(r["step_s"])
        print(
            f"{r['impl']:5s} median step {med:.3f} s  peak RSS per rank "
            f"{', '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} MiB  load {r['load'][0]:.2f}"
        )
        pooled.setdefault(r["impl"], []).extend(r["step_s"])
        peak.setdefault(r["impl"], []).append(max(r["peak_rss_mib"]))
    for impl, steps in pooled.items():
        print(
            f"{impl:5s} pooled median {statistics.median(steps):.3f} s over {len(steps)} steps, "
            f"peak RSS (max over runs and ranks) {max(peak[impl]):.0f} MiB"
        )
    if {"ls", "fsdp"} <= set(pooled):
        t = statistics.median(pooled["ls"]) / statistics.median(pooled["fsdp"])
        m = max(peak["ls"]) / max(peak["fsdp"])
        print(f"ls / fsdp: time {t:.3f}x, peak memory {m:.3f}x")


if __name__ == "__main__":
    main(sys.argv[1])
