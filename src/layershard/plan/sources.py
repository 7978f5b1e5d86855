"""Where the planner's default efficiencies come from.

An efficiency is the fraction of a vendor peak that a real run achieves: ``compute`` of the dense
bf16 FLOP/s, ``nvlink`` / ``network`` of the per-GPU link bandwidth as a ring collective sees it
(nccl-tests' *bus bandwidth*), ``pcie`` of the host <-> device bandwidth, ``host`` of the node's
DRAM bandwidth as the CPU optimizer step under CPU offload streams it.

Every default below is listed in ``PROVENANCE`` with its source, the figure taken from it, how
that figure maps to the parameter, and a status:

- ``published``: a number printed in the source, used as is;
- ``derived``: computed from published numbers (the computation is given, and for the A100
  network efficiency it is reproduced by ``yafsdp_fit`` from the published step times);
- ``assumed``: no measurement we could point to; a stated guess, to be replaced by
  ``layershard plan --calibrate`` on the user's own runs.

docs/plan.md ("Where the efficiencies come from") is the long form of this table.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak (see the module docstring)."""

    compute: float = 0.5
    nvlink: float = 0.8
    network: float = 0.8
    pcie: float = 0.8
    host: float = 0.5

    def scaled(self, compute: float = 1.0, comm: float = 1.0) -> Efficiency:
        """Compute scaled by ``compute``, both collective links by ``comm`` (calibration)."""
        return Efficiency(
            self.compute * compute, self.nvlink * comm, self.network * comm, self.pcie, self.host
        )


@dataclass(frozen=True)
class Source:
    gpu: str
    parameter: str
    value: float
    status: str  # published | derived | assumed
    source: str
    figure: str
    mapping: str


# YaFSDP README (github.com/yandex/YaFSDP), its benchmark table: A100 80GB, batch 1 sequence per
# GPU, Hugging Face Llama with FlashAttention-2, ZeRO-3 with bf16 gathers and fp32
# reduce-scatters, step seconds as published (the rows whose architecture is a layershard
# preset). (model, GPUs, seq, checkpointed layers, YaFSDP step s)
YAFSDP_A100 = [
    ("llama-7b", 64, 2048, 0, 0.81),
    ("llama-7b", 64, 4096, 0, 1.16),
    ("llama-7b", 64, 8192, 0, 2.23),
    ("llama-7b", 128, 2048, 0, 0.87),
    ("llama-7b", 128, 4096, 0, 1.19),
    ("llama-7b", 128, 8192, 0, 2.25),
    ("llama-13b", 128, 2048, 0, 1.55),
    ("llama-13b", 128, 4096, 0, 2.06),
    ("llama-70b", 256, 2048, 10, 6.97),
    ("llama-70b", 256, 4096, 50, 11.07),
]

# The A100 network efficiency, fitted by ``yafsdp_fit`` (calibrate.py) to the rows above with
# compute 0.57 and NVLink 0.77 held at their A100 defaults. Rounded; the test suite re-derives it.
A100_NETWORK_FROM_YAFSDP = 0.34

A100 = Efficiency(compute=0.57, nvlink=0.77, network=A100_NETWORK_FROM_YAFSDP, pcie=0.8, host=0.5)
H100 = Efficiency(compute=0.43, nvlink=0.80, network=0.80, pcie=0.8, host=0.5)
H200 = H100

DEFAULT_EFFICIENCY = {"a100": A100, "h100": H100, "h200": H200}

PROVENANCE: list[Source] = [
    Source(
        "a100", "compute", 0.57, "published",
        "IBM/Meta, PyTorch blog 2024, 'Maximizing training throughput using PyTorch FSDP'",
        "a Llama-2-7B-style model trained with FSDP on 128 A100 80GB at 3,700 tokens/s/GPU, "
        "57% MFU",
        "MFU of a run whose communication is hidden (FSDP within and across nodes, near-linear "
        "scaling to 512 GPUs reported) = the fraction of peak its compute reaches",
    ),
    Source(
        "a100", "nvlink", 0.77, "assumed",
        "nccl-tests all_reduce_perf bus bandwidth on DGX A100 (8 GPUs, NVSwitch), as commonly "
        "reported; no primary publication checked",
        "about 230 GB/s bus bandwidth for large messages (uncertain)",
        "bus bandwidth / 300 GB/s per direction: a ring collective's per-GPU bytes "
        "((N-1)/N of the buffer) divided by the bus bandwidth is its time",
    ),
    Source(
        "a100", "network", A100_NETWORK_FROM_YAFSDP, "derived",
        "YaFSDP README benchmark table (A100 80GB, 64-256 GPUs)",
        "10 measured step times of Llama 2 7B/13B/70B at 2k-8k tokens (YAFSDP_A100)",
        "least-squares fit (log step time) of the network efficiency with compute 0.57 and "
        "NVLink 0.77 fixed (calibrate.yafsdp_fit); absorbs whatever the model leaves out on "
        "that cluster (unknown network, contention, stragglers)",
    ),
    Source(
        "a100", "pcie", 0.8, "assumed",
        "CUDA bandwidthTest with pinned memory on PCIe Gen4 x16, as commonly reported",
        "about 25 GB/s of 32 GB/s per direction (uncertain)",
        "measured / nominal per-direction bandwidth",
    ),
    Source(
        "h100", "compute", 0.43, "published",
        "Llama Team, Meta, 'The Llama 3 Herd of Models', arXiv 2407.21783, Table 4",
        "405B pre-training on 8,192 H100 (700 W): 430 TFLOP/s per GPU, 43% BF16 MFU (38-41% "
        "on 16,384 GPUs)",
        "MFU taken as compute efficiency; it bounds it from below (the MFU also pays pipeline "
        "bubbles and exposed tensor-parallel communication, which a data-parallel run has not)",
    ),
    Source(
        "h100", "compute (cross-check)", 0.34, "derived",
        "torchtitan performance table (H100 96GB at 500 W, Llama 3.1 8B, 8 GPUs, FSDP2, eager "
        "bf16): 5,762 tokens/s/GPU; torchtitan states 33-39% MFU without Float8",
        "5,762 x 57.9 GFLOP/token (6 x 7.50e9 matmul params + 12 L s d at s = 8192) / 989e12 "
        "= 0.34",
        "not used as the default: power-capped 500 W parts run below the 989 TFLOP/s peak",
    ),
    Source(
        "h100", "nvlink", 0.80, "assumed",
        "nccl-tests on DGX H100 (NVLink 4, without NVLink SHARP), as commonly reported; no "
        "primary publication checked",
        "about 360 GB/s all_reduce bus bandwidth for large messages (uncertain)",
        "bus bandwidth / 450 GB/s per direction",
    ),
    Source(
        "h100", "network", 0.80, "assumed",
        "no published measurement constrains it: torchtitan's 8B runs lose 2.7% from 8 to 128 "
        "GPUs (5,762 -> 5,605 tokens/s/GPU), which the model hides at any efficiency above ~0.1",
        "-",
        "bus bandwidth / (50 GB/s per GPU); calibrate on a multi-node run (nccl-tests "
        "all_gather_perf across nodes, or layershard plan --calibrate)",
    ),
    Source(
        "h100", "pcie", 0.8, "assumed",
        "by analogy with PCIe Gen4 (bandwidthTest about 80% of nominal)",
        "-",
        "measured / 64 GB/s per direction",
    ),
    Source(
        "h200", "all", 0.0, "derived",
        "the H100 values: same SMs, clocks, NVLink 4, PCIe Gen5 and NICs (datasheets); no "
        "published bf16 data-parallel MFU on H200 was found (torchtitan's H200 figure, 10,938 "
        "tokens/s/GPU for 8B, is Float8 + compile and not comparable to the bf16 peak)",
        "-",
        "the faster HBM3e helps the memory-bound optimizer step, which the model takes from "
        "the HBM bandwidth directly",
    ),
    Source(
        "all", "host", 0.5, "assumed",
        "no measurement of torch's CPU AdamW on DGX hosts at hand",
        "-",
        "fraction of the node's DRAM bandwidth (shared by its GPUs' ranks) that the CPU "
        "optimizer step streams its 28 bytes per parameter (AdamW) at",
    ),
]  # fmt: skip
