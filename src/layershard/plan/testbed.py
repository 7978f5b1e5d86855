"""``layershard plan --testbed RESULTS``: the planner's step time for every row of a bench run on
the testbed (``layershard bench --nodes N --link ...``), against the measured one.

The testbed is a small cluster whose GPUs are this CPU's ranks, so the same time model applies
(``steptime.py``) with the machine's numbers in place of a GPU's, all read from the bench's
``results.json`` and its runs:

- **compute**: this CPU's fp32 matmul FLOP/s (``settings.link.cpu_flops``, measured by the bench
  with every core), divided among the ranks that share the cores, at one efficiency for every
  FLOP. That efficiency is the one number fitted: on the DDP row, whose all-reduces the planner
  models as ``no_shard``'s, so that every other row is a prediction. Without a DDP row it stays
  at ``--compute-eff`` (default 0.5).
- **network**: the link's rate, shared by a node's ranks, at 0.95 of it (TCP/IP headers: 1448
  payload bytes per 1514-byte frame); one one-way delay per collective that crosses nodes.
- **within a node**: gloo over loopback at ``LOOPBACK_GBS``, no latency.
- **optimizer**: AdamW's bytes at ``MEMORY_GBS`` per rank.

Each bench implementation maps to the settings the planner knows: ``layershard`` is ``full``;
``-bf16r`` a bf16 reduction; ``-fp8``/``-int8`` gathers in 8 bits, their bytes and the CPU time
of their quantize and dequantize (``wire_cost``: the engine's own functions, timed on one thread
when predicting, so on the machine that predicts: run it where the bench ran); ``-hybrid`` sharded within a node; ``-hpz`` hpZ over a node; ``-grad_op``, ``-no_shard``
themselves; ``-bK`` K blocks per unit (fewer, larger collectives); FSDP2 and FSDP1
the same bytes as ``full``; DDP ``no_shard``.
"""

from __future__ import annotations

import functools
import json
import math
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch

from layershard.plan.calibrate import _golden
from layershard.plan.hardware import GPU, Cluster, TiB
from layershard.plan.model import ModelShape
from layershard.plan.sources import Efficiency
from layershard.plan.steptime import predict_time

LOOPBACK_GBS = 1.0  # gloo between two ranks of a node, GB/s each way (engine/collectives.py)
MEMORY_GBS = 10.0  # an optimizer step's bytes per second per rank on this CPU
TCP_EFF = 1448 / 1514  # payload per Ethernet frame of a TCP segment with timestamps


@functools.cache
def wire_cost(gather_dtype: str, numel: int = 1 << 21) -> tuple[float, float]:
    """Seconds per element to quantize an fp32 shard to ``gather_dtype`` (fp8, int8) and to
    dequantize gathered bytes back to fp32, by the engine's functions (engine/wire_dtype.py),
    on one thread as a bench rank computes: the fastest of 5 runs of ``numel`` elements."""
    from layershard.engine import wire_dtype as wd

    x = torch.randn(numel)
    out = torch.empty(numel)
    if gather_dtype == "fp8":
        q = torch.empty(numel, dtype=torch.uint8)
        quant, dequant = (
            partial(wd.quantize_fp8, x, 1.0, q),
            partial(wd.dequantize_fp8, q, 1.0, out),
        )
    else:
        q = torch.empty(wd.chunk_bytes(torch.int8, numel), dtype=torch.uint8)
        quant, dequant = partial(wd.quantize_int8, x, q), partial(wd.dequantize_int8, q, numel, out)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        best = []
        for f in (quant, dequant):
            times = []
            for _ in range(5):
                t0 = time.perf_counter()
                f()
                times.append(time.perf_counter() - t0)
            best.append(min(times) / numel)
    finally:
        torch.set_num_threads(threads)
    return best[0], best[1]


class TestbedError(ValueError):
    """A bench output this cannot predict; the message says why."""


@dataclass(frozen=True)
class Row:
    impl: str
    world: int
    measured_s: float
    predicted_s: float
    settings: dict[str, Any]
    exposed_network_s: float
    compute_s: float
    network_bytes: float  # what one rank sends across nodes per step, as the planner counts it
    measured_bytes: float | None  # the bench's count of the same (its ring estimate)

    @property
    def ratio(self) -> float:
        return self.predicted_s / self.measured_s


def _settings_of(impl: str, nproc: int) -> dict[str, Any] | None:
    """``predict_time``'s keywords for a bench implementation (module docstring)."""
    if impl == "ddp":
        return {"strategy": "no_shard"}
    if impl in ("fsdp2", "fsdp1"):
        return {"strategy": "full"}
    if not impl.startswith("layershard"):
        return None
    kw: dict[str, Any] = {"strategy": "full", "by_node": True}  # engine/gloo_routes.py
    for part in impl.split("-")[1:]:
        if part == "bf16r":
            kw["reduce_dtype"] = "bf16"
        elif part in ("fp8", "int8"):
            kw["gather_dtype"] = part
        elif part == "hybrid":
            kw.update(strategy="hybrid", shard_size=nproc)
        elif part == "hpz":
            kw["reshard_after_forward"] = nproc
        elif part in ("grad_op", "no_shard"):
            kw["strategy"] = part
        elif part[:1] == "b" and part[1:].isdigit():  # -bK: K blocks per unit
            kw["blocks_per_unit"] = int(part[1:])
        else:
            return None
    return kw


def _shape(folder: Path, results: dict[str, Any]) -> ModelShape:
    """The model the bench ran: recorded with each implementation's results."""
    for entry in results.get("world_sizes", {}).values():
        for s in entry.get("impls", {}).values():
            model = s.get("model") or {}
            if model.get("source") == "preset":
                return ModelShape.from_config(SimpleNamespace(**model), name=str(model["preset"]))
    raise TestbedError(
        f"{folder}: results.json names no layershard model preset (a bench of a --hf-config, or "
        "one from before the model was recorded: run it again)"
    )


def predict_bench(path: str | Path, compute_eff: float = 0.5) -> tuple[list[Row], str]:
    """Every row of a testbed bench (a folder with ``results.json`` and ``runs/``), predicted;
    and a line on what was fitted."""
    folder = Path(path)
    if folder.name == "results.json":
        folder = folder.parent
    try:
        d = json.loads((folder / "results.json").read_text())
    except (OSError, ValueError) as e:
        raise TestbedError(f"{folder}: no readable results.json ({e})") from None
    st = d.get("settings", {})
    link = st.get("link")
    if not link or not link.get("cpu_flops"):
        raise TestbedError(
            f"{folder}: not a testbed bench (no settings.link); run layershard bench --nodes N "
            "--link ..."
        )
    shape = _shape(folder, d)
    nodes, cores = int(st["nodes"]), int(st.get("cores") or 1)
    rows: list[tuple[str, int, float, dict[str, Any]]] = []
    sent: dict[tuple[str, int], float] = {}
    for ws, entry in sorted(d.get("world_sizes", {}).items(), key=lambda kv: int(kv[0])):
        world = int(ws)
        for impl, s in entry.get("impls", {}).items():
            kw = _settings_of(impl, world // nodes)
            if kw is not None and s.get("step_time_median"):
                rows.append((impl, world, float(s["step_time_median"]), kw))
                sent[impl, world] = s.get("bytes_sent_per_step")
    if not rows:
        raise TestbedError(f"{folder}: no step time of an implementation the planner models")

    def predict(impl_kw: dict[str, Any], world: int, eff: float) -> Any:
        per_node = world // nodes
        impl_kw = dict(impl_kw)
        by_node = impl_kw.pop("by_node", False)
        wire = impl_kw.get("gather_dtype")
        gpu = GPU(
            "cpu-testbed", 1 << 40,
            # the ranks share the cores the matmul rate was measured on
            link["cpu_flops"] / max(cores, world) / 1e12,
            LOOPBACK_GBS, link["rate_bps"] / 8 / 1e9 / per_node, MEMORY_GBS,
            host_memory_bytes=TiB, eff=Efficiency(compute=eff, nvlink=1.0, network=TCP_EFF),
            wire_s_per_elem=wire_cost(wire) if wire else (0.0, 0.0),
        )  # fmt: skip
        delay = float(link.get("delay_s") or 0.0)
        return predict_time(
            shape, gpu, Cluster(world, per_node, by_node=by_node),
            micro_batch=int(st["global_batch"]) // world, seq_len=int(st["seq_len"]),
            param_dtype="fp32", optimizer=st.get("optimizer", "adamw"),
            latency_fn=lambda op, size, n: delay if n > 1 else 0.0, **impl_kw,
        )  # fmt: skip

    note = f"compute at {compute_eff:.3g} of the matmul rate (--compute-eff)"
    ddp = [r for r in rows if r[0] == "ddp"]
    if ddp:
        _, world, measured, ddp_kw = ddp[0]
        compute_eff = _golden(
            lambda x: math.log(predict(ddp_kw, world, x).step_s / measured) ** 2, 1e-3, 1.0
        )
        note = (
            f"compute at {compute_eff:.3g} of the matmul rate: fitted on the ddp row (the one "
            "number fitted; every other row is predicted)"
        )
    out = []
    for impl, world, measured, kw in rows:
        t = predict(kw, world, compute_eff)
        out.append(
            Row(impl, world, measured, t.step_s, kw, t.exposed_by_link.get("network", 0.0)
                + t.exposed_by_link.get("latency", 0.0), t.compute_s,
                sum(b.get("network", 0.0) for b in t.comm_bytes.values()), sent[impl, world])
        )  # fmt: skip
    return out, note


def render(path: str | Path, rows: list[Row], note: str) -> str:
    lines = [
        f"layershard plan --testbed {path}",
        note,
        f"{'impl':<24}{'ranks':>6}{'measured s':>12}{'predicted s':>13}{'ratio':>8}"
        f"{'compute s':>11}{'exposed net s':>15}",
    ]
    for r in rows:
        lines.append(
            f"{r.impl:<24}{r.world:>6}{r.measured_s:>12.3f}{r.predicted_s:>13.3f}{r.ratio:>8.2f}"
            f"{r.compute_s:>11.3f}{r.exposed_network_s:>15.3f}"
        )
    inside = sum(abs(r.ratio - 1) <= 0.15 for r in rows)
    lines.append(f"{inside} of {len(rows)} rows predicted within 15%")
    return "\n".join(lines)


def main(folders: list[str], compute_eff: float | None = None) -> int:
    """``layershard plan --testbed BENCH_DIR...``: each folder's rows, predicted and measured."""
    for i, folder in enumerate(folders):
        try:
            rows, note = predict_bench(folder, compute_eff or 0.5)
        except TestbedError as e:
            print(f"layershard plan: {e}", file=sys.stderr)
            return 2
        print(("\n" if i else "") + render(folder, rows, note))
    return 0
