"""What a link between two "nodes" of the testbed is: a rate, a one-way delay, jitter and loss, and
the presets named by the clusters they emulate.

A preset keeps the ratio that decides whether a step waits for the network: bytes a link moves
per FLOP a GPU computes. A cluster's inter-node bandwidth per GPU, divided by that GPU's dense
bf16 FLOP/s, multiplied by the FLOP/s this CPU measures for the model's matmuls, is the rate of
the emulated link; its latency is stretched by the same factor (a CPU step is that many times
longer than a GPU step, so a microsecond there is a millisecond here). So a 400 Gb/s InfiniBand
H100 cluster on a CPU that computes 1/5000 of an H100 becomes an 80 Mb/s link with a few ms of
delay, and what a step waits for keeps its share of the step.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass

# name -> (inter-node bandwidth per GPU in bit/s, dense bf16 FLOP/s of the GPU, latency in s per
# message between nodes: the NIC, a switch hop and NCCL's per-message software cost)
CLUSTERS: dict[str, tuple[float, float, float]] = {
    "h100-ib400": (400e9, 989e12, 5e-6),  # H100 SXM, one 400 Gb/s NDR port per GPU
    "h100-roce100": (100e9, 989e12, 10e-6),  # H100 over 100 Gb/s RoCE per GPU
    "h100-eth25": (25e9, 989e12, 30e-6),  # H100 over 25 Gb/s Ethernet per GPU (TCP)
    "a100-ib200": (200e9, 312e12, 5e-6),  # A100 SXM, one 200 Gb/s HDR port per GPU
}

_UNITS = {"": 1.0, "k": 1e3, "m": 1e6, "g": 1e9}
_TIMES = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class Link:
    """One direction-symmetric link between a node and the switch: ``rate_bps`` bits per second
    (None: not limited), ``delay_s`` one-way, ``jitter_s`` (uniform, +-), ``loss`` (a fraction of
    packets dropped). ``name``: the preset or the text it was parsed from."""

    rate_bps: float | None
    delay_s: float = 0.0
    jitter_s: float = 0.0
    loss: float = 0.0
    name: str = ""

    def describe(self) -> str:
        rate = "unlimited" if self.rate_bps is None else f"{self.rate_bps / 1e6:.3g} Mbit/s"
        parts = [rate, f"{self.delay_s * 1e3:.3g} ms"]
        if self.jitter_s:
            parts.append(f"+-{self.jitter_s * 1e3:.3g} ms")
        if self.loss:
            parts.append(f"{self.loss:.2%} loss")
        return f"{self.name}: " + ", ".join(parts) if self.name else ", ".join(parts)

    def as_dict(self) -> dict:
        return {
            "name": self.name, "rate_bps": self.rate_bps, "delay_s": self.delay_s,
            "jitter_s": self.jitter_s, "loss": self.loss,
        }  # fmt: skip


def preset(name: str, cpu_flops: float) -> Link:
    """The link of cluster ``name`` (``CLUSTERS``) scaled to a CPU computing ``cpu_flops``."""
    if name not in CLUSTERS:
        raise ValueError(f"unknown link preset {name!r}; presets: {', '.join(CLUSTERS)}")
    bandwidth, gpu_flops, latency = CLUSTERS[name]
    scale = cpu_flops / gpu_flops
    return Link(bandwidth * scale, latency / scale, name=name)


def _quantity(text: str, units: dict[str, float], what: str) -> float:
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:e-?[0-9]+)?)\s*([a-z]*)\s*", text.lower())
    if m is None or m.group(2) not in units:
        raise ValueError(f"{what} {text!r}: a number with a unit ({', '.join(u for u in units)})")
    return float(m.group(1)) * units[m.group(2)]


def parse(text: str, cpu_flops: float | None = None) -> Link:
    """A preset name (scaled to ``cpu_flops``, measured if None), or ``RATE[,DELAY[,JITTER[,
    LOSS%]]]``: ``200mbit,1ms``, ``1gbit,100us,20us,1%``. A rate of ``0`` or ``inf`` means not
    limited. Raises ``ValueError`` saying what is wrong."""
    if text in CLUSTERS:
        return preset(text, cpu_flops if cpu_flops is not None else matmul_flops())
    fields = [f.strip() for f in text.split(",")]
    if re.fullmatch(r"[a-z]+\d*-[a-z]+\d*", text):  # shaped like a preset's name
        raise ValueError(f"unknown link preset {text!r}; presets: {', '.join(CLUSTERS)}")
    if not 1 <= len(fields) <= 4:
        raise ValueError(f"--link {text!r}: a preset ({', '.join(CLUSTERS)}) or RATE[,DELAY]")
    rate_text = fields[0].lower().removesuffix("bit").removesuffix("bps")
    rate: float | None = None
    if rate_text not in ("0", "inf", "none"):
        rate = _quantity(rate_text, _UNITS, "link rate")
    delay = _quantity(fields[1], _TIMES, "link delay") if len(fields) > 1 else 0.0
    jitter = _quantity(fields[2], _TIMES, "link jitter") if len(fields) > 2 else 0.0
    loss = 0.0
    if len(fields) > 3:
        if not fields[3].endswith("%"):
            raise ValueError(f"link loss {fields[3]!r}: a percentage, e.g. 1%")
        loss = float(fields[3][:-1]) / 100
        if not 0 <= loss < 1:
            raise ValueError(f"link loss {fields[3]!r}: between 0% and 100%")
    if jitter > delay:
        raise ValueError(f"link jitter {fields[2]} is larger than the delay {fields[1]}")
    return Link(rate, delay, jitter, loss, name=text)


def matmul_flops(dim: int = 512, tokens: int = 2048, repeats: int = 9) -> float:
    """FLOP/s this CPU reaches on an fp32 matmul of a block's shape (``tokens x dim`` by ``dim x
    4 dim``), the median of ``repeats``: the compute a preset scales against."""
    import torch

    a, b = torch.randn(tokens, dim), torch.randn(dim, 4 * dim)
    torch.mm(a, b)  # warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch.mm(a, b)
        times.append(time.perf_counter() - t0)
    return 2 * tokens * dim * 4 * dim / sorted(times)[len(times) // 2]
