"""Aggregate the per-run JSON files of ``layershard bench`` into one report: a table, a JSON
document and a PNG chart. Ratios are against layershard at the same world size, in the same
invocation (runs interleaved, so the machine's drift affects every implementation alike)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from layershard.bench import impl_order

MiB = 1024 * 1024


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    if not xs:
        return float("nan")
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def _median(xs):
    xs = [x for x in xs if x is not None]
    return statistics.median(xs) if xs else None


def aggregate(files: list[Path], settings: dict | None = None) -> dict:
    runs = [json.loads(Path(f).read_text()) for f in files]
    for f, r in zip(files, runs):
        r.setdefault("repeat", int(Path(f).stem.rsplit("-r", 1)[-1]))
    out: dict = {"settings": settings or {}, "world_sizes": {}}
    for n in sorted({r["world_size"] for r in runs}):
        at_n = [r for r in runs if r["world_size"] == n]
        ls_runs = {r["repeat"]: r for r in at_n if r["impl"] == "layershard" and "error" not in r}
        impls = {}
        for impl in sorted({r["impl"] for r in at_n}, key=impl_order):
            impls[impl] = _summarize(impl, [r for r in at_n if r["impl"] == impl], ls_runs, n)
        ls = impls.get("layershard", {})
        for s in impls.values():
            s["time_vs_layershard"] = _ratio(s.get("step_time_median"), ls.get("step_time_median"))
            s["peak_vs_layershard"] = _ratio(s.get("peak_bytes"), ls.get("peak_bytes"))
        loads = [x for r in at_n for x in r.get("loadavg_1min") or [] if x is not None]
        out["world_sizes"][str(n)] = {
            "impls": impls,
            "targets": _targets(impls),
            "loadavg_1min": [min(loads), max(loads)] if loads else None,
        }
    return out


def _ratio(a, b):
    return a / b if a is not None and b else None


def _mfu(run: dict, step_s: float, world: int) -> float | None:
    """Model FLOPs utilization: the step's training FLOPs over its time and the GPUs' bf16 peak
    (from the planner's table, by device name); None on CPU or an unknown GPU."""
    from layershard.plan.hardware import GPUS

    flops, name = run.get("model_flops_per_step"), (run.get("device_name") or "").lower()
    gpu = next((g for key, g in GPUS.items() if key.split("-")[0] in name), None)
    if flops is None or gpu is None:
        return None
    return flops / step_s / (world * gpu.peak_flops)


def _summarize(impl: str, runs: list[dict], ls_runs: dict, n: int) -> dict:
    ok = [r for r in runs if "error" not in r]
    s: dict = {"runs": len(runs), "failed": len(runs) - len(ok)}
    if len(ok) < len(runs):
        s["errors"] = [r["error"][-1500:] for r in runs if "error" in r]
    if not ok:
        return s
    first = ok[0]
    times = [t for r in ok for t in r["step_times"]]
    med = statistics.median(times)
    s.update(
        step_time_median=med,
        step_time_min=min(times),
        step_time_max=max(times),
        step_time_p25=_quantile(times, 0.25),
        step_time_p75=_quantile(times, 0.75),
        step_time_repeat_medians=[statistics.median(r["step_times"]) for r in ok],
        timed_steps=len(times),
        tokens_per_s=first["tokens_per_step"] / med,
        mfu=_mfu(first, med, n),
        precision=first["precision"],
        threads_per_rank=first["threads_per_rank"],
        params=first["model"]["params"],
        model=first["model"],
    )
    if all("link_bytes_sent" in r for r in ok):  # the testbed: counted on the busiest link
        s["link_bytes_per_step"] = _median(
            [max(r["link_bytes_sent"]) / r["link_steps"] for r in ok]
        )
    # Peak memory per rank: the largest rank, median over repeats.
    if first["device"] == "cuda":
        s["max_memory_allocated"] = _median(
            [max(p["memory"]["max_memory_allocated"] for p in r["per_rank"]) for r in ok]
        )
        s["max_memory_reserved"] = _median(
            [max(p["memory"]["max_memory_reserved"] for p in r["per_rank"]) for r in ok]
        )
    peaks = [
        max(p["memory"]["memtracker_peak"] for p in r["per_rank"])
        for r in ok
        if all("memtracker_peak" in p["memory"] for p in r["per_rank"])
    ]
    s["memtracker_peak"] = _median(peaks)
    if not peaks:
        s["memtracker_peak_na"] = next(
            (p["mem_error"] for r in ok for p in r["per_rank"] if p.get("mem_error")), "n/a"
        )
    else:
        s["memtracker_breakdown"] = first["per_rank"][0]["memory"].get("memtracker_breakdown")
    s["peak_bytes"] = s.get("max_memory_allocated") or s["memtracker_peak"]
    # Model state: params + grads + optimizer + module buffers (unique storages), largest rank.
    ranks = first["per_rank"]
    biggest = max(ranks, key=lambda p: p["model_state"].get("model_state", 0))["model_state"]
    s["model_state"] = {k: v for k, v in biggest.items() if k != "layershard_memory_report"}
    if "layershard_memory_report" in biggest:
        s["layershard_memory_report"] = biggest["layershard_memory_report"]
    P, buffers = first["model"]["params"], first["model"]["buffer_bytes"]
    minimum = 16 * P / n + buffers
    s["model_state_minimum"] = minimum
    s["model_state_vs_minimum"] = biggest.get("model_state", 0) / minimum
    # Collectives per step, as the c10d dispatcher saw them.
    s["comm_per_step"] = first.get("comm_per_step") or {}
    s["comm_error"] = first.get("comm_error")
    s["collectives_per_step"] = sum(d["count"] for d in s["comm_per_step"].values())
    s["bytes_sent_per_step"] = sum(d["sent_bytes_ring"] for d in s["comm_per_step"].values())
    if first.get("layershard_comm_stats"):
        s["layershard_comm_stats"] = first["layershard_comm_stats"]
    # Loss curves: against layershard's run of the same repeat (same data, same init).
    diffs = []
    for r in ok:
        ref = ls_runs.get(r["repeat"])
        if ref is not None and len(ref["losses"]) == len(r["losses"]):
            diffs.append(max(abs(a - b) for a, b in zip(r["losses"], ref["losses"])))
    s["loss_max_abs_diff_vs_layershard"] = max(diffs) if diffs else None
    s["loss_first"], s["loss_last"] = first["losses"][0], first["losses"][-1]
    s["notes"] = first.get("notes") or {}
    if first.get("opt_step_times"):  # --optimizer muon: the optimizer step alone
        ot = [t for r in ok for t in r["opt_step_times"]]
        s.update(
            opt_step_median=statistics.median(ot),
            opt_step_p25=_quantile(ot, 0.25),
            opt_step_p75=_quantile(ot, 0.75),
            opt_step_min=min(ot),
            opt_step_max=max(ot),
            opt_step_repeat_medians=[statistics.median(r["opt_step_times"]) for r in ok],
        )
        comm = [p.get("optimizer_comm") or {} for p in first["per_rank"]]
        s["opt_bytes_sent_max_rank"] = max(sum(d["sent"] for d in c.values()) for c in comm)
        s["opt_bytes_received_max_rank"] = max(sum(d["received"] for d in c.values()) for c in comm)
        s["opt_collectives"] = sum(d["count"] for d in comm[0].values())
    return s


def _targets(impls: dict) -> dict:
    """The targets of issue 5, evaluated (None when an input is missing)."""
    ls = impls.get("layershard", {})
    t = ls.get("step_time_median")
    fsdp = [impls[i].get("step_time_median") for i in ("fsdp1", "fsdp2") if i in impls]
    fsdp = [x for x in fsdp if x is not None]
    ddp = impls.get("ddp", {}).get("step_time_median")
    out = {}
    if t is not None and fsdp:
        out["time_le_0.95x_faster_fsdp"] = {
            "ratio": t / min(fsdp),
            "limit": 0.95,
            "met": t <= 0.95 * min(fsdp),
        }
    if t is not None and ddp:
        out["time_le_1.03x_ddp"] = {"ratio": t / ddp, "limit": 1.03, "met": t <= 1.03 * ddp}
    p2 = impls.get("fsdp2", {}).get("peak_bytes")
    if ls.get("peak_bytes") and p2:
        out["peak_le_fsdp2"] = {
            "ratio": ls["peak_bytes"] / p2,
            "limit": 1.0,
            "met": ls["peak_bytes"] <= p2,
        }
    if "model_state_vs_minimum" in ls:
        r = ls["model_state_vs_minimum"]
        out["model_state_within_5pct_of_minimum"] = {"ratio": r, "limit": 1.05, "met": r <= 1.05}
    return out


# ---- presentation ----------------------------------------------------------------------------------


def _f(x, fmt: str, na: str = "n/a") -> str:
    return na if x is None else format(x, fmt)


def format_table(results: dict) -> str:
    st = results.get("settings", {})
    lines = []
    if st:
        lines.append(
            f"model {st.get('model')}, {st.get('device')}, {st.get('precision')}, seq {st.get('seq_len')}, "
            f"global batch {st.get('global_batch')}, {st.get('warmup')} warm-up + {st.get('steps')} "
            f"timed steps x {st.get('repeats')} repeats, {st.get('cores')} cores"
        )
    link = st.get("link")
    if link:  # the testbed's (layershard bench --nodes N --link ...)
        from layershard.testbed.links import Link

        fields = {k: link[k] for k in ("rate_bps", "delay_s", "jitter_s", "loss", "name")}
        lines.append(f"{st.get('nodes')} nodes on the testbed, link {Link(**fields).describe()}")
    w = max([11] + [len(i) + 1 for ws in results["world_sizes"].values() for i in ws["impls"]])
    hdr = (
        f"{'impl':<{w}}{'step s':>8}{'p25-p75':>14}{'min-max':>14}{'tok/s':>8}{'MFU':>6}{'x ls':>7}"
        f"{'peak MiB':>10}{'x ls':>7}{'state MiB':>10}{'/min':>6}{'other MiB':>10}"
        f"{'colls':>7}{'MiB sent':>9}{'loss diff':>11}"
    )
    for n, ws in results["world_sizes"].items():
        lines.append("")
        load = ws.get("loadavg_1min")
        load_s = (  # (no load recorded when every run failed)
            f" (machine load, 1-min average, during the runs: {load[0]:.1f}-{load[1]:.1f})"
            if load
            else ""
        )
        lines.append(f"world size {n}" + load_s)
        lines.append(hdr)
        lines.append("-" * len(hdr))
        for impl, s in ws["impls"].items():
            if "step_time_median" not in s:
                lines.append(f"{impl:<{w}} FAILED ({s.get('failed')} of {s.get('runs')} runs)")
                continue
            ms = s["model_state"]
            peak = s.get("peak_bytes")
            lines.append(
                f"{impl:<{w}}{s['step_time_median']:>8.3f}"
                f"{s['step_time_p25']:>7.3f}-{s['step_time_p75']:<6.3f}"
                f"{s['step_time_min']:>7.3f}-{s['step_time_max']:<6.3f}"
                f"{s['tokens_per_s']:>8.0f}{_f(s.get('mfu') and 100 * s['mfu'], '.1f'):>6}"
                f"{_f(s['time_vs_layershard'], '.3f'):>7}"
                f"{_f(peak and peak / MiB, '.1f'):>10}{_f(s['peak_vs_layershard'], '.3f'):>7}"
                f"{ms.get('model_state', 0) / MiB:>10.1f}{s['model_state_vs_minimum']:>6.2f}"
                f"{ms.get('other_resident', 0) / MiB:>10.1f}"
                f"{s['collectives_per_step']:>7}{s['bytes_sent_per_step'] / MiB:>9.1f}"
                f"{_f(s['loss_max_abs_diff_vs_layershard'], '.2e'):>11}"
            )
            cp = s["notes"].get("cp")
            if cp:  # a CP row (bench/context.py): its size and mode
                lines.append(f"{'':<{w}}cp {cp}, {s['notes']['cp_mode']}: each sequence over "
                             f"{cp} consecutive ranks, which share their batch")  # fmt: skip
            if s.get("failed"):
                lines.append(f"{'':<{w}}({s['failed']} of {s['runs']} runs failed)")
            if s.get("memtracker_peak_na"):
                lines.append(f"{'':<{w}}peak n/a: {s['memtracker_peak_na']}")
        timed = {k: s for k, s in ws["impls"].items() if "opt_step_median" in s}
        if timed:
            lines.append("")
            lines.append(
                f"{'optimizer step':<{w}}{'median s':>9}{'p25-p75':>14}{'min-max':>14}"
                f"{'x ls':>7}{'colls':>6}{'MiB sent':>9}{'MiB recv':>9}{'NS GFLOP':>9}"
            )
            base = timed.get("layershard", {}).get("opt_step_median")
            for impl, s in timed.items():
                flops = s["notes"].get("muon", {}).get("ns_flops_busiest_rank")
                lines.append(
                    f"{impl:<{w}}{s['opt_step_median']:>9.3f}"
                    f"{s['opt_step_p25']:>7.3f}-{s['opt_step_p75']:<6.3f}"
                    f"{s['opt_step_min']:>7.3f}-{s['opt_step_max']:<6.3f}"
                    f"{_f(_ratio(s['opt_step_median'], base), '.3f'):>7}"
                    f"{s['opt_collectives']:>6}"
                    f"{s['opt_bytes_sent_max_rank'] / MiB:>9.2f}"
                    f"{s['opt_bytes_received_max_rank'] / MiB:>9.2f}"
                    f"{_f(flops and flops / 1e9, '.1f'):>9}"
                )
        for name, t in ws["targets"].items():
            lines.append(
                f"  target {name}: {t['ratio']:.3f} (limit {t['limit']}) -> "
                f"{'met' if t['met'] else 'MISSED'}"
            )
    lines.append("")
    lines.append(
        "step s: median over all timed steps of all repeats (slowest rank, barrier to barrier); "
        "MFU: model FLOPs / (step s x GPUs x bf16 peak), GPUs only; x ls: this / layershard;\npeak: per rank (CUDA max_memory_allocated; CPU MemTracker, "
        "own untimed step); state: params+grads+optimizer+module buffers\n(unique storages, "
        "after optimizer.step), /min: over 16*P/N + buffers; other: every other tensor storage "
        "Python sees between steps\n(engine working buffers); colls/MiB sent: c10d collectives "
        "of one step and the bytes one rank sends (ring estimate);\nloss diff: max |loss - "
        "layershard's| over all steps of the same repeat."
    )
    if any(
        "opt_step_median" in s
        for ws in results["world_sizes"].values()
        for s in ws["impls"].values()
    ):
        lines.append(
            "optimizer step: opt.step() alone (barrier before and after, slowest rank); colls, "
            "MiB sent/recv: the optimizer's own collectives and payload per step on the busiest "
            "rank;\nNS GFLOP: Newton-Schulz work per step on the busiest rank (from the shapes)."
        )
    return "\n".join(lines)


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = list(results["world_sizes"])
    fig, axes = plt.subplots(
        len(sizes), 3, figsize=(13, 3.4 * len(sizes)), squeeze=False, constrained_layout=True
    )
    colors = {"layershard": "#d62728", "fsdp2": "#1f77b4", "fsdp1": "#17becf", "ddp": "#7f7f7f"}
    st = results.get("settings", {})
    for row, n in zip(axes, sizes):
        impls = {
            k: v for k, v in results["world_sizes"][n]["impls"].items() if "step_time_median" in v
        }
        names = list(impls)
        x = range(len(names))
        c = [colors.get(k, "#999999") for k in names]
        med = [impls[k]["step_time_median"] for k in names]
        lo = [impls[k]["step_time_median"] - impls[k]["step_time_p25"] for k in names]
        hi = [impls[k]["step_time_p75"] - impls[k]["step_time_median"] for k in names]
        row[0].bar(x, med, color=c, yerr=[lo, hi], capsize=4)
        row[0].set_title(f"step time (median, IQR), world size {n}")
        row[0].set_ylabel("s")
        peak = [(impls[k].get("peak_bytes") or 0) / MiB for k in names]
        row[1].bar(x, peak, color=c)
        row[1].set_title("peak memory per rank")
        row[1].set_ylabel("MiB")
        state = [impls[k]["model_state"].get("model_state", 0) / MiB for k in names]
        other = [impls[k]["model_state"].get("other_resident", 0) / MiB for k in names]
        row[2].bar(x, state, color=c, label="params+grads+optim+buffers")
        row[2].bar(x, other, bottom=state, color=c, alpha=0.35, hatch="//", label="other resident")
        minimum = next(iter(impls.values()))["model_state_minimum"] / MiB if impls else 0
        row[2].axhline(minimum, color="k", lw=0.8, ls="--", label="16P/N + buffers")
        row[2].set_title("model state per rank")
        row[2].set_ylabel("MiB")
        row[2].legend(fontsize=7)
        for ax in row:
            ax.set_xticks(list(x))
            ax.set_xticklabels(names)
    fig.suptitle(
        f"layershard bench: {st.get('model', '')} on {st.get('device', '')} "
        f"({st.get('precision', '')}, seq {st.get('seq_len', '')}, batch {st.get('global_batch', '')})"
    )
    fig.savefig(path, dpi=110)
    plt.close(fig)


def link_rows(base: Path) -> list[dict]:
    """One row per (shape, link, world size, implementation) of a ``--link`` bench under
    ``base``: the link's rate and delay, the median step time and the bytes sent per step."""
    rows = []
    for path in sorted(base.glob("*/**/results.json")):
        results = json.loads(path.read_text())
        st = results.get("settings", {})
        link = st.get("link") or {}
        for world, at in results.get("world_sizes", {}).items():
            for impl, s in at["impls"].items():
                if s.get("step_time_median") is None:
                    continue
                rows.append({
                    "shape": st.get("shape"), "link": link.get("name"),
                    "rate_bps": link.get("rate_bps"), "delay_s": link.get("delay_s"),
                    "nodes": st.get("nodes"), "world": int(world), "impl": impl,
                    "step_s": s["step_time_median"], "sent_per_step": s.get("bytes_sent_per_step"),
                    "time_vs_layershard": s.get("time_vs_layershard"),
                })  # fmt: skip
    return rows


def plot_links(base: Path) -> None:
    """``base/links.png`` (one panel per shape: step time against the link's rate, one line per
    implementation, each point labelled with the MB that implementation sends per step) and
    ``base/links.json`` (the rows), for the runs of ``layershard bench --nodes N --link ...``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = link_rows(base)
    (base / "links.json").write_text(json.dumps(rows, indent=1))
    shapes = sorted({r["shape"] or "model" for r in rows})
    if not rows or not any(r["rate_bps"] for r in rows):
        return
    fig, axes = plt.subplots(1, len(shapes), figsize=(6 * len(shapes), 4.5), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        mine = [r for r in rows if (r["shape"] or "model") == shape and r["rate_bps"]]
        for impl in sorted({r["impl"] for r in mine}, key=impl_order):
            pts = sorted((r["rate_bps"], r["step_s"], r["sent_per_step"]) for r in mine
                         if r["impl"] == impl)  # fmt: skip
            ax.plot([p[0] / 1e6 for p in pts], [p[1] for p in pts], marker="o", label=impl)
            for x, y, sent in pts:
                if sent:
                    ax.annotate(f"{sent / 1e6:.0f} MB", (x / 1e6, y), fontsize=7,
                                textcoords="offset points", xytext=(3, 3))  # fmt: skip
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("link rate (Mbit/s, per node and direction)")
        ax.set_ylabel("step time (s, median)")
        ax.set_title(f"{shape}: step time against the link (MB sent per rank and step)")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(base / "links.png", dpi=120)
    plt.close(fig)
