"""The planner against published runs (``plan/records.py``): predicted over published tokens/s
per GPU, whether it would say "does not fit", and the memory error where a peak is printed.

    from layershard.plan.accuracy import compare, summary
    rows = compare()            # every recorded run
    summary(rows, held_out=True)

``fit_defaults`` re-derives the fitted defaults of ``sources.py`` (per GPU generation the
factors on the kernel model's compute and attention, and the contention) from the fit set (the
runs whose source is not in ``records.HELD_OUT``); it never sees a held-out run.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from layershard.plan.hardware import Cluster, get_gpu
from layershard.plan.network import get_cluster
from layershard.plan.planner import Plan, Settings, make_plan
from layershard.plan.records import Run, published_runs
from layershard.plan.sources import Efficiency

GIB = 2**30


@dataclass
class Row:
    run: Run
    plan: Plan

    @property
    def ratio(self) -> float:
        """Predicted over published tokens/s per GPU."""
        return self.plan.time.tokens_per_s_per_gpu / self.run.tokens_per_s_per_gpu

    @property
    def fits(self) -> bool:
        return self.plan.fits

    @property
    def memory_error(self) -> float | None:
        """Predicted peak (tensors + context + fragmentation, what the GPU holds) over the
        published one, minus 1."""
        if self.run.peak_gib is None:
            return None
        return self.plan.device_bytes / (self.run.peak_gib * GIB) - 1


def settings_of(run: Run) -> Settings:
    return Settings(
        micro_batch=run.micro_batch, seq_len=run.seq, checkpoint_layers=run.checkpoint_layers,
        grad_accum=run.grad_accum, reduce_dtype=run.reduce_dtype, strategy=run.strategy,
        shard_size=run.shard_size, loss=run.loss, optimizer=run.optimizer,
    )  # fmt: skip


def plan_run(run: Run, eff: Efficiency | None = None) -> Plan:
    gpu = get_gpu(run.gpu)
    links = get_cluster(run.cluster)
    gpu = replace(gpu, intra_bw_gbs=links.intra_gbs, inter_bw_gbs=links.inter_gbs)
    cluster = Cluster(run.gpus, min(8, run.gpus))
    return make_plan(run.shape, gpu, cluster, settings_of(run), eff=eff, links=links)


def compare(runs: Iterable[Run] | None = None, eff_for: Any = None) -> list[Row]:
    """A row per run; ``eff_for(gpu_name)`` may override the GPUs' default efficiencies."""
    out = []
    for run in published_runs() if runs is None else runs:
        eff = eff_for(run.gpu) if eff_for else None
        out.append(Row(run, plan_run(run, eff)))
    return out


def summary(rows: Sequence[Row]) -> dict[str, Any]:
    """Share within +-15% and +-25% of published tokens/s/GPU, the median ratio, runs said not
    to fit, and the memory errors."""
    ratios = [r.ratio for r in rows]
    mem = [e for e in (r.memory_error for r in rows) if e is not None]
    n = len(rows)
    return {
        "runs": n,
        "within_15": sum(abs(x - 1) <= 0.15 for x in ratios),
        "within_25": sum(abs(x - 1) <= 0.25 for x in ratios),
        "median_ratio": statistics.median(ratios) if ratios else math.nan,
        "min_ratio": min(ratios, default=math.nan),
        "max_ratio": max(ratios, default=math.nan),
        "does_not_fit": sum(not r.fits for r in rows),
        "memory_errors": mem,
    }


FITTED = ("compute_scale", "attention_scale")  # per GPU generation (h100, a100)


def fit_defaults(iters: int = 30, start: dict[str, float] | None = None) -> dict[str, float]:
    """Re-derive the fitted defaults of ``sources.FITTED``: per GPU generation the factor on
    the kernel model's compute and on its attention, and the contention, by Levenberg-Marquardt
    on the log of predicted over published tokens/s of the fit set (no held-out run)."""
    fit_set = [r for r in published_runs() if not r.held_out]
    names = [f"{k}:{g}" for g in ("h100", "a100") for k in FITTED] + ["contention"]
    start = start or {}
    # log factors; the contention as log(1 + c)
    x = [
        math.log1p(start[n]) if n == "contention" else math.log(start[n]) if n in start else 0.0
        for n in names
    ]

    def resid(v: Sequence[float]) -> list[float]:
        p = dict(zip(names, v))

        def eff_for(gpu_name: str) -> Efficiency:
            gpu = get_gpu(gpu_name)
            g = gpu.kernels or "h100"
            return replace(gpu.eff, compute_scale=math.exp(p[f"compute_scale:{g}"]),
                           attention_scale=math.exp(p[f"attention_scale:{g}"]),
                           contention=math.expm1(max(0.0, p["contention"])))  # fmt: skip

        return [math.log(row.ratio) for row in compare(fit_set, eff_for)]

    lam, h = 1e-2, 1e-4
    r0 = resid(x)
    cost = sum(v * v for v in r0)
    for _ in range(iters):
        cols = []
        for j in range(len(x)):
            xp = list(x)
            xp[j] += h
            cols.append([(a - b) / h for a, b in zip(resid(xp), r0)])
        n = len(x)
        jtj = [[sum(a * b for a, b in zip(cols[i], cols[j])) for j in range(n)] for i in range(n)]
        jtr = [sum(a * b for a, b in zip(cols[i], r0)) for i in range(n)]
        improved = False
        while lam < 1e8:
            m = [[jtj[i][j] + (lam * jtj[i][i] + 1e-12 if i == j else 0) for j in range(n)]
                 for i in range(n)]  # fmt: skip
            dx = _solve(m, [-v for v in jtr])
            xn = [a + b for a, b in zip(x, dx)]
            rn = resid(xn)
            cn = sum(v * v for v in rn)
            if cn < cost:
                x, r0, cost, lam, improved = xn, rn, cn, lam / 10, True
                break
            lam *= 10
        if not improved or max(abs(d) for d in dx) < 1e-5:
            break
    out = {k: math.exp(v) for k, v in zip(names, x) if k != "contention"}
    out["contention"] = math.expm1(max(0.0, x[-1]))
    out["rms_log_error"] = math.sqrt(cost / len(r0))
    return out


def _solve(a: list[list[float]], b: list[float]) -> list[float]:
    """Gaussian elimination with partial pivoting (a few unknowns)."""
    n = len(b)
    m = [row[:] + [b[i]] for i, row in enumerate(a)]
    for c in range(n):
        p = max(range(c, n), key=lambda r: abs(m[r][c]))
        m[c], m[p] = m[p], m[c]
        for r in range(c + 1, n):
            f = m[r][c] / m[c][c]
            for k in range(c, n + 1):
                m[r][k] -= f * m[c][k]
    x = [0.0] * n
    for r in reversed(range(n)):
        x[r] = (m[r][n] - sum(m[r][k] * x[k] for k in range(r + 1, n))) / m[r][r]
    return x
