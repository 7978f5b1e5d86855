"""Where a step on the testbed leaves its link idle: each node's link sampled through a bench run.

    python benchmarks/links/link_timeline.py --out DIR -- --shape comm --nodes 2 --nproc 2 \
        --link a100-ib200 --cpu-flops 145 --impl layershard --steps 2 --warmup 1 --repeats 1 \
        --no-mem --timeout 2400

Runs ``layershard bench ARGS --out DIR`` and, while it runs, reads each node's ``eth0`` counter
every ``--every`` seconds (a sampler inside each of the namespaces the bench makes). The bench's
workers record when each step, its backward and its optimizer step began (``step_walls``, rank
0's clock, the samplers' clock too). For every timed step of every run it prints how long the step
was, how long its bytes take on the link alone (the counter's bytes at the link's rate), and the
rest, the time the busiest node's link was not sending at its rate, split by phase: forward,
backward, optimizer step. Writes ``timeline.json`` (that table) and
``timeline.png`` (each timed step's send rate, the phases marked) beside each ``results.json``
under DIR; the samples in ``DIR/link-n<k>.txt.gz`` (``--replot`` analyses them again).
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import subprocess
import sys
import time
from pathlib import Path

SAMPLER = """
import sys, time
path, every = "/sys/class/net/eth0/statistics/tx_bytes", float(sys.argv[1])
while True:
    try:  # the link may not be made yet, or be gone already
        with open(path) as f:
            print(f"{time.time():.4f} {f.read().strip()}", flush=True)
    except OSError:
        pass
    time.sleep(every)
"""
BIN_S = 0.05  # the plot's rate, averaged over 50 ms (tbf sends in bursts)


def _namespaces(pid: int, nodes: int, proc: subprocess.Popen, wait_s: float = 300) -> list[str]:
    from layershard.testbed import netns

    want = [f"{netns.PREFIX}{pid}-n{k}" for k in range(nodes)]
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and proc.poll() is None:
        if set(want) <= set(netns.testbed_namespaces()):
            return want
        time.sleep(0.05)
    raise SystemExit(f"the bench's namespaces {want} did not appear")


def _read(path: Path) -> list[tuple[float, int]]:
    text = gzip.decompress(path.read_bytes()).decode() if path.suffix == ".gz" else path.read_text()
    out = []
    for line in text.splitlines():
        t, _, b = line.partition(" ")
        if b:
            out.append((float(t), int(b)))
    return out


def _at(samples: list[tuple[float, int]], t: float) -> float:
    """The counter at time ``t``, linear between samples."""
    i = bisect.bisect_right(samples, t, key=lambda s: s[0])
    if i == 0 or i == len(samples):
        return float(samples[0][1] if i == 0 else samples[-1][1])
    (t0, b0), (t1, b1) = samples[i - 1], samples[i]
    return b0 + (b1 - b0) * (t - t0) / max(t1 - t0, 1e-9)


def idle_in(samples: list[tuple[float, int]], a: float, b: float, rate: float) -> float:
    """The link's unused time in [a, b]: its length less the time its bytes take at ``rate``
    (bytes/s). Over a step's phases it adds up to the step less its bytes' time on the link."""
    return (b - a) - (_at(samples, b) - _at(samples, a)) / rate


def analyse(out: Path, samples: list[list[tuple[float, int]]]) -> list[dict]:
    res = json.loads((out / "results.json").read_text())
    link = res["settings"]["link"]
    rate = link["rate_bps"] / 8
    rows = []
    for run in sorted((out / "runs").glob("*.json")):
        d = json.loads(run.read_text())
        walls = d.get("step_walls") or []
        for i, w in enumerate(walls[d["warmup"] :]):
            start, bwd, opt, end = w
            sent = [_at(s, end) - _at(s, start) for s in samples]
            node = max(range(len(samples)), key=lambda k: sent[k])
            s = samples[node]
            phases = {"forward": (start, bwd), "backward": (bwd, opt), "optimizer": (opt, end)}
            rows.append({
                "run": run.stem, "step": i, "node": node, "step_s": end - start,
                "link_s": sent[node] / rate, "mib": sent[node] / 2**20,
                "phase_s": {k: b - a for k, (a, b) in phases.items()},
                "idle_s": {k: idle_in(s, a, b, rate) for k, (a, b) in phases.items()},
            })  # fmt: skip
    return rows


def render(rows: list[dict]) -> str:
    head = (f"{'run':<28}{'step':>5}{'step s':>8}{'link s':>8}{'MiB':>8}  "
            "link unused s: forward / backward / optimizer (of its s)")  # fmt: skip
    lines = [head]
    for r in rows:
        parts = " / ".join(f"{r['idle_s'][k]:.2f} ({r['phase_s'][k]:.2f})" for k in r["idle_s"])
        lines.append(f"{r['run']:<28}{r['step']:>5}{r['step_s']:>8.2f}{r['link_s']:>8.2f}"
                     f"{r['mib']:>8.1f}  {parts}")  # fmt: skip
    return "\n".join(lines)


def plot(out: Path, rows: list[dict], samples: list[list[tuple[float, int]]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    runs = {}
    for run in sorted((out / "runs").glob("*.json")):
        d = json.loads(run.read_text())
        runs[run.stem] = d["step_walls"][d["warmup"] :]
    res = json.loads((out / "results.json").read_text())
    rate = res["settings"]["link"]["rate_bps"] / 8
    fig, axes = plt.subplots(len(rows), 1, figsize=(10, 2.2 * len(rows)), squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        start, bwd, opt, end = runs[r["run"]][r["step"]]
        s = samples[r["node"]]
        edges = [start - 0.2 + BIN_S * i for i in range(int((end - start + 0.4) / BIN_S) + 1)]
        ts = [(a + b) / 2 - start for a, b in zip(edges, edges[1:])]
        used = [(_at(s, b) - _at(s, a)) / (rate * BIN_S) for a, b in zip(edges, edges[1:])]
        ax.plot(ts, used, lw=0.8)
        for t, label in ((start, "forward"), (bwd, "backward"), (opt, "optimizer"), (end, "")):
            ax.axvline(t - start, color="k", ls="--", lw=0.8)
            ax.text(t - start, 1.05, label, fontsize=7)
        ax.set_ylim(0, 1.2)
        ax.set_ylabel("x link rate", fontsize=8)
        ax.set_title(f"{r['run']} step {r['step']}: {r['step_s']:.2f} s, link alone "
                     f"{r['link_s']:.2f} s (node {r['node']})", fontsize=9)  # fmt: skip
    axes[-1, 0].set_xlabel("seconds into the step")
    fig.tight_layout()
    fig.savefig(out / "timeline.png", dpi=110)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the bench's --out folder")
    ap.add_argument("--every", type=float, default=0.01, help="seconds between samples")
    ap.add_argument("bench", nargs=argparse.REMAINDER, help="-- then layershard bench's arguments")
    ap.add_argument("--replot", action="store_true", help="analyse DIR's recorded samples again")
    args = ap.parse_args()
    out = Path(args.out)
    if args.replot:
        samples = [_read(log) for log in sorted(out.glob("link-n*.txt.gz"))]
        _report(out, samples)
        return 0
    bench = [a for a in args.bench if a != "--"]
    nodes = int(bench[bench.index("--nodes") + 1])
    cmd = [sys.executable, "-m", "layershard.cli", "bench", *bench, "--out", str(out)]
    proc = subprocess.Popen(cmd)
    namespaces = _namespaces(proc.pid, nodes, proc)
    out.mkdir(parents=True, exist_ok=True)
    logs = [out / f"link-n{k}.txt" for k in range(nodes)]
    samplers = [
        subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-c", SAMPLER,
                          str(args.every)], stdout=open(log, "w"))  # noqa: SIM115
        for ns, log in zip(namespaces, logs)
    ]  # fmt: skip
    rc = proc.wait()
    for s in samplers:
        s.kill()
        s.wait()
    samples = [_read(log) for log in logs]
    for log in logs:  # kept, compressed (--replot reads them)
        Path(f"{log}.gz").write_bytes(gzip.compress(log.read_bytes()))
        log.unlink()
    _report(out, samples)
    return rc


def _report(out: Path, samples: list[list[tuple[float, int]]]) -> None:
    for found in sorted(out.rglob("results.json")):  # one folder per link and shape
        folder = found.parent
        rows = analyse(folder, samples)
        print(f"{folder}\n{render(rows)}")
        (folder / "timeline.json").write_text(json.dumps({"rows": rows}, indent=1))
        plot(folder, rows, samples)


if __name__ == "__main__":
    sys.exit(main())
