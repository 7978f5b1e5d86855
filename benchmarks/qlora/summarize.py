"""Summarize benchmarks/qlora runs (runs.jsonl): per run, the median step time (slowest rank,
barrier to barrier), the median main-thread CPU per step, the peak tensor memory (MemTracker,
last step) and peak RSS per rank; per implementation the pooled medians and the largest peaks;
then ls / fsdp."""

from __future__ import annotations

import json
import statistics
import sys


def main(path: str) -> None:
    runs = [json.loads(line) for line in open(path)]
    steps: dict[str, list[float]] = {}
    cpus: dict[str, list[float]] = {}
    tensors: dict[str, list[float]] = {}
    rss: dict[str, list[float]] = {}
    for r in runs:
        impl, cpu = r["impl"], [c for rank in r["thread_cpu_s"] for c in rank]
        print(
            f"{impl:5s} step {statistics.median(r['step_s']):.3f} s, main-thread CPU "
            f"{statistics.median(cpu):.3f} s, peak tensors "
            f"{' / '.join(f'{m:.1f}' for m in r['peak_tensors_mib'])} MiB, peak RSS "
            f"{' / '.join(f'{m:.0f}' for m in r['peak_rss_mib'])} MiB, load {r['load'][0]:.2f}"
        )
        steps.setdefault(impl, []).extend(r["step_s"])
        cpus.setdefault(impl, []).extend(cpu)
        tensors.setdefault(impl, []).extend(r["peak_tensors_mib"])
        rss.setdefault(impl, []).extend(r["peak_rss_mib"])
    for impl in steps:
        print(
            f"{impl:5s} pooled: step {statistics.median(steps[impl]):.3f} s over "
            f"{len(steps[impl])} steps, main-thread CPU {statistics.median(cpus[impl]):.3f} s, "
            f"peak tensors {max(tensors[impl]):.1f} MiB, peak RSS {max(rss[impl]):.0f} MiB"
        )
    if {"ls", "fsdp"} <= set(steps):

        def ratio(d: dict[str, list[float]], f=statistics.median) -> float:
            return f(d["ls"]) / f(d["fsdp"])

        print(
            f"ls / fsdp: step time {ratio(steps):.3f}x, main-thread CPU {ratio(cpus):.3f}x, "
            f"peak tensors {ratio(tensors, max):.3f}x, peak RSS {ratio(rss, max):.3f}x"
        )


if __name__ == "__main__":
    main(sys.argv[1])
