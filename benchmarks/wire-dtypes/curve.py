"""The wire dtypes' training curve (issue 34): `layershard train` on the built-in `small` model,
the bundled corpus (Python's stdlib sources), 2 ranks, 300 steps, validation loss every 50 steps,
once per option; each option's validation loss must stay within 1% (relative) of the exact run's
at every evaluation, and a deliberately broken scale (fp8 with the first step's amax kept:
LAYERSHARD_FP8_STALE_SCALES=1) must fail that. The runs named "exact, ..." are exact too and
differ from "exact" only in fp32 rounding (one rank, another CPU capability): how far two correct
runs drift apart at this batch size.

Run it from a snapshot of the tree (the runs import the code they measure):

    git worktree add --detach /tmp/wire-snap HEAD
    PYTHONPATH=/tmp/wire-snap/src python benchmarks/wire-dtypes/curve.py [--options ...]
    python benchmarks/wire-dtypes/curve.py --report-only    # table and plot from curve.json

Tokens per step are reduced from `train`'s defaults (2 sequences of 128 tokens per rank, not 8
of 256) so that the runs fit an afternoon on 2 CPU cores; the model and the 300 steps are the
issue's. Results: curve.json (every evaluation of every run, with the load average), curve.png.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TOLERANCE = 0.01  # relative, at every evaluation
COMMON = [
    "--model", "small", "--steps", "300", "--eval-interval", "50", "--seq-len", "128",
    "--micro-batch", "2", "--nproc-per-node", "2", "--sample-tokens", "0",
]  # fmt: skip
OPTIONS: dict[str, tuple[list[str], dict[str, str]]] = {
    "exact": ([], {}),
    "fp8 gather + bf16 reduce": (["--gather-dtype", "fp8", "--reduce-dtype", "bf16"], {}),
    "int8 gather + bf16 reduce": (["--gather-dtype", "int8", "--reduce-dtype", "bf16"], {}),
    "fp8 gather, stale amax (broken)": (
        ["--gather-dtype", "fp8", "--reduce-dtype", "bf16"],
        {"LAYERSHARD_FP8_STALE_SCALES": "1"},
    ),
    "bf16 reduce": (["--reduce-dtype", "bf16"], {}),
    "fp8 gather": (["--gather-dtype", "fp8"], {}),
    "int8 gather": (["--gather-dtype", "int8"], {}),
    # Exact runs that differ from "exact" only in fp32 rounding: how far apart two legitimate
    # runs drift at this batch size (the same global batch and data order on one rank; another
    # CPU capability's vector kernels).
    "exact, 1 rank": (["--nproc-per-node", "1", "--micro-batch", "4"], {}),
    "exact, ATEN_CPU_CAPABILITY=default": ([], {"ATEN_CPU_CAPABILITY": "default"}),
    "exact, rerun": ([], {}),  # is the machine the one "exact" ran on (bitwise the same curve)?
}


def key(name: str, seed: int) -> str:
    """A run's name in curve.json: the option, and the seed when it is not 0."""
    return name if seed == 0 else f"{name} @ seed {seed}"


def option_and_seed(run: str) -> tuple[str, int]:
    name, _, seed = run.partition(" @ seed ")
    return name, int(seed or 0)


def run_one(name: str, out: Path, seed: int = 0) -> dict:
    flags, env = OPTIONS[name]
    run_dir = out / key(name, seed).replace(" ", "_").replace(",", "").replace("+", "and")
    cmd = [sys.executable, "-m", "layershard", "train", *COMMON, "--seed", str(seed), *flags]
    cmd += ["--run-dir", str(run_dir), "--overwrite"]
    t0, load = time.time(), os.getloadavg()[0]
    p = subprocess.run(cmd, env={**os.environ, **env}, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"{name}: exit {p.returncode}\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    val = {m["step"]: m["val_loss"] for m in metrics if "val_loss" in m}
    return {
        "seed": seed,
        "flags": flags,
        "env": env,
        "val_loss": val,
        "seconds": time.time() - t0,
        "load_at_start": load,
        "load_at_end": os.getloadavg()[0],
    }


def verdicts(runs: dict) -> dict[str, dict]:
    """Each run against the exact run of its seed."""
    out = {}
    for name, r in runs.items():
        option, seed = option_and_seed(name)
        if option == "exact" or key("exact", seed) not in runs:
            continue
        exact = runs[key("exact", seed)]["val_loss"]
        rel = {s: abs(v - exact[s]) / exact[s] for s, v in r["val_loss"].items() if s in exact}
        out[name] = {"max_rel": max(rel.values()), "rel": rel, "ok": max(rel.values()) <= TOLERANCE}
    return out


def plot(runs: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, rel) = plt.subplots(1, 2, figsize=(12, 4.5))
    exact = runs.get("exact", {}).get("val_loss", {})
    for i, (name, r) in enumerate((n, r) for n, r in runs.items() if " @ seed " not in n):
        color = f"C{i}"  # one color per option in both panels
        # the exact runs that differ from "exact" only in rounding: dashed
        style = "--" if name.startswith("exact,") else "-"
        steps = sorted(int(s) for s in r["val_loss"])
        ax.plot(
            steps,
            [r["val_loss"][str(s)] for s in steps],
            style,
            marker="o",
            label=name,
            color=color,
        )
        if name != "exact" and exact:
            common = [s for s in steps if str(s) in exact]
            diff = [(r["val_loss"][str(s)] - exact[str(s)]) / exact[str(s)] for s in common]
            rel.plot(common, [100 * d for d in diff], style, marker="o", label=name, color=color)
    ax.set_xlabel("step")
    ax.set_ylabel("validation loss")
    ax.set_title("small, 2 ranks, bundled corpus")
    ax.legend()
    ax.grid(alpha=0.3)
    rel.axhspan(-100 * TOLERANCE, 100 * TOLERANCE, color="green", alpha=0.1, label="within 1%")
    rel.set_xlabel("step")
    rel.set_ylabel("(loss - exact) / exact, %")
    rel.set_title("against the exact run")
    lo, hi = rel.get_ylim()
    rel.set_ylim(lo, hi + 0.6 * (hi - lo))  # room for the legend above the curves
    rel.legend(fontsize=7, ncol=2, loc="upper right")
    rel.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--options", nargs="+", default=list(OPTIONS), choices=list(OPTIONS))
    p.add_argument("--runs", default="/tmp/wire-curve", help="run folders (not kept)")
    p.add_argument("--seed", type=int, default=0, help="train's --seed (the data order, init)")
    p.add_argument("--report-only", action="store_true")
    args = p.parse_args()
    record = HERE / "curve.json"
    runs = json.loads(record.read_text())["runs"] if record.exists() else {}
    if not args.report_only:
        for name in args.options:
            print(f"{name} ...", flush=True)
            r = run_one(name, Path(args.runs), args.seed)
            runs[key(name, args.seed)] = json.loads(
                json.dumps(r)
            )  # step keys as strings, as read back
            record.write_text(json.dumps({"runs": runs}, indent=1))
            print(f"  {r['seconds']:.0f} s, val {r['val_loss']}", flush=True)
    if "exact" not in runs:  # the plot and the seed-0 verdicts compare with it
        return 0
    v = verdicts(runs)
    record.write_text(json.dumps({"runs": runs, "verdicts": v, "tolerance": TOLERANCE}, indent=1))
    for name, d in v.items():
        print(f"{name:<34} max rel. diff {d['max_rel']:.4f} -> {'within' if d['ok'] else 'OUT'}")
    plot(runs, HERE / "curve.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
