"""``layershard plan --calibrate RUN_DIR``: fit the efficiencies to step times a user measured.

A measurement is one step time with everything the model needs to predict it: the model shape,
the ranks, the strategy, micro-batch, grad-accum, sequence length, checkpointed layers and
dtypes. Two kinds of folders are read:

- ``layershard train`` run folders: ``config.yaml`` (the resolved config; its ``_resolved``
  block holds the world size, grad-accum and tokenizer vocabulary), ``metrics.jsonl`` (one
  ``step_time_s`` per logged step; the median after the first 20% (at most 10) of logged steps,
  which pay for allocator warm-up, is the measurement) and ``summary.json`` (the parameter
  count, checked against the planner's reconstruction of the model). The loop micro-batches
  under ``no_sync()``, so ``no_sync`` is set when grad-accum > 1.
- ``layershard bench`` output: ``results.json``; each layershard implementation at each world
  size is one measurement (its median step time; one micro-batch of global_batch / N sequences
  per rank). The vocabulary is not recorded there; it is solved from the recorded parameter
  count.

What is fitted (in log step time, least squares, so every run weighs the same whatever its
length): a factor on the compute efficiency always; a factor on the collective efficiencies
(NVLink and network alike) only when the measurements can separate the two: at least two
measurements with communication, whose predicted times depend on communication at the fitted
point, and not in the same proportion as on compute (else the communication efficiency keeps its
default and the output says why). PCIe, host and latency are never fitted. If the measured step
is shorter than the predicted communication alone, no compute efficiency can explain it; then
the communication factor is fitted instead.
"""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from layershard.plan.hardware import GPU, Cluster
from layershard.plan.model import ModelShape
from layershard.plan.planner import Settings
from layershard.plan.sources import YAFSDP_A100, Efficiency
from layershard.plan.steptime import predict_time


class CalibrationError(ValueError):
    """A run folder the calibration cannot use; the message says why."""


@dataclass(frozen=True)
class Measurement:
    label: str
    shape: ModelShape
    cluster: Cluster
    settings: Settings
    step_s: float
    detail: str = ""
    predicted: str = ""  # a train run made from `plan --write-config`: its plan against it


# --- reading run folders -----------------------------------------------------------------------


def _round_up(n: int, multiple: int = 64) -> int:
    return (n + multiple - 1) // multiple * multiple


def _median_step(path: Path) -> tuple[float, str]:
    times = []
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            if "step_time_s" in rec:
                times.append(float(rec["step_time_s"]))
    if not times:
        raise CalibrationError(f"{path} has no step_time_s records")
    skip = min(10, len(times) // 5)
    kept = times[skip:]
    return statistics.median(kept), f"median of {len(kept)} logged steps ({skip} skipped)"


def read_train_run(
    run_dir: Path, gpus_per_node: int, precision_auto: str = "bf16"
) -> list[Measurement]:
    import yaml

    try:
        raw = yaml.safe_load((run_dir / "config.yaml").read_text()) or {}
    except yaml.YAMLError as e:
        first = " ".join(str(e).split())[:200]
        raise CalibrationError(
            f"{run_dir}/config.yaml is not a run config layershard wrote: it is not plain YAML "
            f"({first}); calibrate from the run's own config.yaml"
        ) from None
    if not isinstance(raw, dict):
        raise CalibrationError(f"{run_dir}/config.yaml must hold a mapping of key: value")
    res = raw.pop("_resolved", {}) or {}
    world, ga, vocab = res.get("world_size"), res.get("grad_accum"), res.get("vocab_size")
    if not world or not ga:
        raise CalibrationError(f"{run_dir}/config.yaml has no _resolved world_size/grad_accum")
    hf = raw.get("hf_config") or raw.get("init_from")
    if hf:
        shape = ModelShape.from_hf_config(hf)
        if not raw.get("init_from") and vocab and shape.vocab_size < vocab:
            shape = replace(shape, vocab_size=_round_up(vocab))  # as train's random init
    else:
        from layershard.models import build_config

        overrides = dict(raw.get("model_overrides") or {})
        if vocab:
            overrides.setdefault("vocab_size", _round_up(int(vocab)))
        shape = ModelShape.from_config(build_config(raw.get("model", "tiny"), **overrides))
        shape = replace(shape, name=raw.get("model", "tiny"))
    summary = run_dir / "summary.json"
    predicted = ""
    if summary.is_file():
        recorded = json.loads(summary.read_text())
        predicted = against_plan(recorded)
        params = recorded.get("params")
        if params and params != shape.total_params:
            raise CalibrationError(
                f"{run_dir}: the run's model has {params:,} parameters but the planner rebuilt "
                f"one of {shape.total_params:,} from config.yaml"
            )
    precision = raw.get("precision", "auto")
    pd = precision_auto if precision == "auto" else precision
    ras = raw.get("reshard_after_forward", True)
    settings = Settings(
        micro_batch=int(raw.get("micro_batch", 1)),
        seq_len=int(raw.get("seq_len", 256)),
        checkpoint_layers=int(raw.get("activation_checkpointing", 0) or 0),
        grad_accum=int(ga),
        param_dtype=pd,
        reduce_dtype="fp32",
        strategy=raw.get("strategy", "full") or "full",
        no_sync=int(ga) > 1,
        shard_size=raw.get("shard_size"),
        reshard_after_forward=ras if ras is not None else True,
        offload=bool(raw.get("offload", False)),
        blocks_per_unit=int(raw.get("blocks_per_unit", 1) or 1),
    )
    step, detail = _median_step(run_dir / "metrics.jsonl")
    if precision == "auto":
        detail += f"; precision auto taken as {pd}"
    cluster = Cluster(int(world), min(int(world), gpus_per_node))
    label = f"{run_dir.name}: {_describe(shape, cluster, settings)}"
    return [Measurement(label, shape, cluster, settings, step, detail, predicted)]


def against_plan(summary: dict[str, Any]) -> str:
    """One line comparing a run's measured step time and memory with what the plan that wrote
    its config predicted (``summary.json``'s ``plan``); '' when the run had no plan."""
    plan = summary.get("plan")
    # A record that is not one `plan --write-config` writes (edited, or of another version) is
    # left out: the run is over, and nothing here may fail it (train's schema refuses it first).
    if not isinstance(plan, dict) or not _positive(plan.get("step_s")):
        return ""
    measured = summary.get("step_time_s_median")
    mem = summary.get("mem_mib_max")
    kind = summary.get("mem_kind", "peak")
    key = "peak_bytes" if kind == "peak" else "model_states_bytes"
    line = f"plan predicted {plan['step_s']:.4g} s/step"
    if _positive(measured):
        line += f", measured {measured:.4g} s ({measured / plan['step_s']:.3g}x)"
    if _positive(plan.get(key)):
        line += f"; {kind.replace('_', ' ')} predicted {plan[key] / 2**20:,.1f} MiB"
        if isinstance(mem, int | float):
            line += f", measured {mem:,.1f} MiB"
    if plan.get("gpus") and summary.get("world_size") and plan["gpus"] != summary["world_size"]:
        line += f" (the plan was for {plan['gpus']} ranks, the run had {summary['world_size']})"
    gpu = plan.get("gpu")
    return line + (f" [plan for {gpu}]" if gpu else "")


def _positive(x: Any) -> bool:
    return isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _solve_vocab(shape: ModelShape, params: int) -> ModelShape | None:
    """The vocabulary that gives ``params`` parameters (embedding and, if untied, head)."""
    rest = shape.n_layers * shape.block_params + shape.dim
    per_token = shape.dim * (1 if shape.tie_embeddings else 2)
    v, r = divmod(params - rest, per_token)
    return replace(shape, vocab_size=v) if v > 0 and r == 0 else None


def read_bench(path: Path, gpus_per_node: int) -> list[Measurement]:
    d = json.loads(path.read_text())
    st = d.get("settings", {})
    model = st.get("model", "small")
    if Path(str(model)).suffix == ".json" or Path(str(model)).is_dir():
        base = ModelShape.from_hf_config(model)
    else:
        base = ModelShape.from_preset(model)
    precision = st.get("precision", "bf16")
    out = []
    for ws, entry in sorted(d.get("world_sizes", {}).items(), key=lambda kv: int(kv[0])):
        n = int(ws)
        for impl, s in entry.get("impls", {}).items():
            strategy = _bench_strategy(impl)
            if strategy is None or s.get("step_time_median") is None:
                continue
            shape = base
            params = s.get("params")
            if params and params != shape.total_params:
                solved = _solve_vocab(shape, int(params))
                if solved is None:
                    raise CalibrationError(
                        f"{path}: {impl} has {params:,} parameters; no vocabulary of {model} "
                        "gives that"
                    )
                shape = solved
            gb = int(st.get("global_batch", n))
            settings = Settings(
                micro_batch=max(1, gb // n),
                seq_len=int(st.get("seq_len", 512)),
                param_dtype=precision,
                reduce_dtype="fp32",
                strategy=strategy,
                shard_size=s.get("shard_size") or st.get("shard_size"),
            )
            if strategy == "hybrid" and not settings.shard_size:
                continue  # the shard size is not recorded: cannot be modelled
            cluster = Cluster(n, min(n, gpus_per_node))
            label = f"{impl} @ {n}: {_describe(shape, cluster, settings)}"
            detail = f"median of {s.get('timed_steps', '?')} timed steps"
            out.append(Measurement(label, shape, cluster, settings, s["step_time_median"], detail))
    if not out:
        raise CalibrationError(f"{path}: no layershard step times in it")
    return out


def _bench_strategy(impl: str) -> str | None:
    if impl == "layershard":
        return "full"
    for sep in ("-", ":", "_", "/"):
        head, _, tail = impl.partition(sep)
        if head == "layershard" and tail in ("full", "grad_op", "no_shard", "hybrid"):
            return tail
    return None


def read_runs(
    paths: Sequence[str | Path], gpus_per_node: int, precision_auto: str = "bf16"
) -> list[Measurement]:
    """Measurements from ``layershard train`` run folders and ``bench`` output (folders or
    ``results.json`` files)."""
    out: list[Measurement] = []
    for p in map(Path, paths):
        if p.is_file() and p.name.endswith(".json"):
            out += read_bench(p, gpus_per_node)
        elif (p / "results.json").is_file():
            out += read_bench(p / "results.json", gpus_per_node)
        elif (p / "config.yaml").is_file() and (p / "metrics.jsonl").is_file():
            out += read_train_run(p, gpus_per_node, precision_auto)
        else:
            raise CalibrationError(
                f"{p}: not a layershard train run folder (config.yaml + metrics.jsonl) nor "
                "bench output (results.json)"
            )
    return out


def _describe(shape: ModelShape, cluster: Cluster, s: Settings) -> str:
    return (
        f"{shape.name}, {cluster.gpus} rank(s), {s.strategy}, {s.micro_batch}x{s.seq_len}"
        f"{f' x{s.grad_accum}' if s.grad_accum > 1 else ''}, {s.param_dtype}"
        f"{f', {s.checkpoint_layers} ckpt' if s.checkpoint_layers else ''}"
    )


# --- fitting -----------------------------------------------------------------------------------


def predict_step(
    m: Measurement, gpu: GPU, eff: Efficiency, latency_s: float | None = None
) -> float:
    s = m.settings
    kwargs = {**s.step_kwargs(), "loss_chunks": 0, "loss": "fp32", "gather_dtype": None}
    return predict_time(m.shape, gpu, m.cluster, **kwargs, latency_s=latency_s, eff=eff).step_s


# log-factor bounds: an efficiency may move by at most 1e6 either way
_LO, _HI = math.log(1e-6), math.log(1e6)


def _apply(base: Efficiency, names: Sequence[str], x: Sequence[float]) -> Efficiency:
    e = base
    for name, v in zip(names, x):
        f = math.exp(v)
        if name == "compute":
            e = e.scaled(compute=f)
        elif name == "comm":
            e = replace(e, nvlink=e.nvlink * f, network=e.network * f)
        elif name == "network":
            e = replace(e, network=e.network * f)
        else:
            raise ValueError(name)
    return e


def _residuals(
    ms: Sequence[Measurement],
    gpu: GPU,
    base: Efficiency,
    names: Sequence[str],
    latency_s: float | None,
) -> Callable[[Sequence[float]], list[float]]:
    def f(x: Sequence[float]) -> list[float]:
        e = _apply(base, names, x)
        return [math.log(predict_step(m, gpu, e, latency_s) / m.step_s) for m in ms]

    return f


def _golden(f: Callable[[float], float], lo: float, hi: float, iters: int = 45) -> float:
    """Minimum of ``f`` on [lo, hi], first bracketed on a coarse grid (the objective can be flat
    where a link or compute is fully hidden); 45 golden steps narrow the bracket ~1e9 times."""
    grid = [lo + (hi - lo) * i / 32 for i in range(33)]
    vals = [f(x) for x in grid]
    i = min(range(len(grid)), key=lambda j: (vals[j], abs(grid[j])))
    a, b = grid[max(0, i - 1)], grid[min(len(grid) - 1, i + 1)]
    g = (math.sqrt(5) - 1) / 2
    c, d = b - g * (b - a), a + g * (b - a)
    fc, fd = f(c), f(d)
    for _ in range(iters):
        if fc < fd:
            b, d, fd = d, c, fc
            c = b - g * (b - a)
            fc = f(c)
        else:
            a, c, fc = c, d, fd
            d = a + g * (b - a)
            fd = f(d)
    return (a + b) / 2


def _sse(r: Callable[[Sequence[float]], list[float]]) -> Callable[[Sequence[float]], float]:
    return lambda x: sum(v * v for v in r(x))


def _gauss_newton(
    r: Callable[[Sequence[float]], list[float]], x0: list[float], iters: int = 50
) -> list[float]:
    """Levenberg-Marquardt on two parameters with forward-difference derivatives."""
    x, lam, h = list(x0), 1e-3, 1e-5
    cost = sum(v * v for v in r(x))
    for _ in range(iters):
        r0 = r(x)
        cols = []
        for j in range(len(x)):
            xp = list(x)
            xp[j] += h
            cols.append([(a - b) / h for a, b in zip(r(xp), r0)])
        # normal equations (J^T J + lam diag) dx = -J^T r, for 2 unknowns
        a11 = sum(v * v for v in cols[0])
        a22 = sum(v * v for v in cols[1])
        a12 = sum(u * v for u, v in zip(cols[0], cols[1]))
        g1 = sum(u * v for u, v in zip(cols[0], r0))
        g2 = sum(u * v for u, v in zip(cols[1], r0))
        improved = False
        while lam < 1e12:
            m11, m22 = a11 * (1 + lam) + 1e-18, a22 * (1 + lam) + 1e-18
            det = m11 * m22 - a12 * a12
            dx = [(-g1 * m22 + g2 * a12) / det, (-g2 * m11 + g1 * a12) / det]
            xn = [min(_HI, max(_LO, xi + di)) for xi, di in zip(x, dx)]
            cn = sum(v * v for v in r(xn))
            if cn < cost:
                x, cost, lam, improved = xn, cn, max(lam / 10, 1e-9), True
                break
            lam *= 10
        if not improved or max(abs(d) for d in dx) < 1e-10:
            break
    return x


@dataclass
class Fit:
    before: Efficiency
    after: Efficiency
    fitted: list[str]
    notes: list[str] = field(default_factory=list)
    rows: list[tuple[Measurement, float, float]] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "before": self.before.__dict__,
            "after": self.after.__dict__,
            "fitted": self.fitted,
            "notes": self.notes,
            "measurements": [
                {"run": m.label, "measured_s": m.step_s, "before_s": b, "after_s": a}
                for m, b, a in self.rows
            ],
        }


def fit(
    ms: Sequence[Measurement],
    gpu: GPU,
    base: Efficiency | None = None,
    latency_s: float | None = None,
    what: str = "auto",
) -> Fit:
    """Fit efficiency factors to measured step times (see the module docstring). ``what``:
    ``auto`` (compute, plus communication when the measurements separate them), ``compute``,
    or ``network`` (the network efficiency alone: how the A100 default was derived)."""
    if not ms:
        raise CalibrationError("nothing to calibrate on")
    base = base or gpu.eff
    notes: list[str] = []
    if what == "network":
        r = _residuals(ms, gpu, base, ["network"], latency_s)
        x = _golden(lambda v: _sse(r)([v]), _LO, _HI)
        after = _apply(base, ["network"], [x])
        return _finish(ms, gpu, base, after, ["network"], notes, latency_s)

    r1 = _residuals(ms, gpu, base, ["compute"], latency_s)
    xc = _golden(lambda v: _sse(r1)([v]), _LO, _HI)
    fitted = ["compute"]
    after = _apply(base, ["compute"], [xc])
    multi = [m for m in ms if m.cluster.gpus > 1]
    worst = max(abs(v) for v in r1([xc]))
    if worst > 0.01 and len(ms) == 1 and multi:
        # no compute efficiency explains it: the predicted communication alone is longer
        rc = _residuals(ms, gpu, base, ["comm"], latency_s)
        xm = _golden(lambda v: _sse(rc)([v]), _LO, _HI)
        notes.append(
            "the measured step is shorter than the predicted communication alone: the "
            "communication efficiency was fitted instead of the compute one"
        )
        after = _apply(base, ["comm"], [xm])
        return _finish(ms, gpu, base, after, ["comm"], notes, latency_s)
    if what == "compute":
        notes.append("communication efficiency kept (--fit compute)")
        return _finish(ms, gpu, base, after, fitted, notes, latency_s)
    if not multi:
        notes.append("communication efficiency kept: every measured run has one rank")
        return _finish(ms, gpu, base, after, fitted, notes, latency_s)
    if len(ms) < 2:
        notes.append(
            "communication efficiency kept: one step time cannot separate compute from "
            "communication (add a run at another world size or micro-batch)"
        )
        return _finish(ms, gpu, base, after, fitted, notes, latency_s)
    r2 = _residuals(ms, gpu, base, ["compute", "comm"], latency_s)
    h = 1e-4
    r0 = r2([xc, 0.0])
    jc = [(a - b) / h for a, b in zip(r2([xc + h, 0.0]), r0)]
    jm = [(a - b) / h for a, b in zip(r2([xc, h]), r0)]
    nc, nm = math.sqrt(sum(v * v for v in jc)), math.sqrt(sum(v * v for v in jm))
    if nm < 1e-3 * max(nc, 1e-12):
        notes.append(
            "communication efficiency kept: communication is hidden behind compute in every "
            "measured run (the prediction does not depend on it)"
        )
        return _finish(ms, gpu, base, after, fitted, notes, latency_s)
    cos = abs(sum(a * b for a, b in zip(jc, jm))) / (nc * nm)
    if cos > 0.999:
        notes.append(
            "communication efficiency kept: the measured runs change with compute and "
            "communication in the same proportion, so the two cannot be told apart"
        )
        return _finish(ms, gpu, base, after, fitted, notes, latency_s)
    xs = _gauss_newton(r2, [xc, 0.0])
    after = _apply(base, ["compute", "comm"], xs)
    return _finish(ms, gpu, base, after, ["compute", "comm"], notes, latency_s)


def _finish(
    ms: Sequence[Measurement],
    gpu: GPU,
    before: Efficiency,
    after: Efficiency,
    fitted: list[str],
    notes: list[str],
    latency_s: float | None,
) -> Fit:
    rows = [
        (m, predict_step(m, gpu, before, latency_s), predict_step(m, gpu, after, latency_s))
        for m in ms
    ]
    worst = max(abs(a / m.step_s - 1) for m, _, a in rows)
    if worst > 0.1:
        notes.append(
            f"after the fit a run is still off by {worst:.0%}: the model does not describe these "
            "runs well (ranks sharing a device, a schedule or kernels it does not model); "
            "treat the fitted values with care"
        )
    for name, v in (
        ("compute", after.compute or 0.0),
        ("NVLink", after.nvlink),
        ("network", after.network),
    ):
        if v > 1.0:
            notes.append(
                f"fitted {name} efficiency {v:.2f} > 1: the peak given for this hardware "
                "(--gpu / --tflops / --intra-bw / --inter-bw) is below what the run achieved"
            )
    return Fit(before, after, fitted, notes, rows)


def yafsdp_fit(gpu: GPU | None = None) -> Fit:
    """The network efficiency YaFSDP's published step times (``sources.YAFSDP_A100``) imply
    under the flat model it was first derived with (every FLOP at 0.57 of the A100's peak,
    NVLink 0.77, 20 us per collective): 0.34. YaFSDP's runs are held out of every fit of
    today's defaults (plan/records.py); this reproduces the old default as a cross-check."""
    from layershard.plan.hardware import get_gpu

    gpu = gpu or get_gpu("a100-80g")
    ms = [
        Measurement(
            f"YaFSDP {model} {n} GPUs seq {seq}",
            ModelShape.from_preset(model),
            Cluster(n, 8),
            Settings(micro_batch=1, seq_len=seq, checkpoint_layers=ck),
            step,
        )
        for model, n, seq, ck, step in YAFSDP_A100
    ]
    base = replace(gpu.eff, compute=0.57, nvlink=0.77, network=1.0, contention=0.0)
    return fit(ms, gpu, base, latency_s=20e-6, what="network")


def render(f: Fit) -> str:
    lines = [
        "Calibration (log step time, least squares)",
        f"  {'run':58s}{'measured s':>11s}{'before s':>11s}{'err':>8s}{'after s':>11s}{'err':>8s}",
    ]
    for m, b, a in f.rows:
        lines.append(
            f"  {m.label[:58]:58s}{m.step_s:11.4g}{b:11.4g}{(b / m.step_s - 1) * 100:7.1f}%"
            f"{a:11.4g}{(a / m.step_s - 1) * 100:7.1f}%"
        )
        if m.predicted:
            lines.append(f"    {m.predicted}")
    moved = "; ".join(
        f"{label} {_show(f.before, k)} -> {_show(f.after, k)}"
        for k, label in (("compute", "compute"), ("nvlink", "nvlink"), ("network", "network"))
        if _show(f.before, k) != _show(f.after, k)
    )
    lines.append(f"  fitted ({', '.join(f.fitted)}): {moved or 'no change'}")
    kept = ["pcie", "host", "latency"]
    if "comm" not in f.fitted:
        kept += ["nvlink"] + ([] if "network" in f.fitted else ["network"])
    lines.append(f"  kept at their defaults: {', '.join(kept)}")
    for n in f.notes:
        lines.append(f"  note: {n}")
    return "\n".join(lines)


def _show(e: Efficiency, key: str) -> str:
    if key == "compute":
        return e.compute_label if e.compute is None else f"{e.compute:.3g}"
    return f"{getattr(e, key):.3g}"
