"""Where every constant of the planner comes from (issue 36).

Four kinds, each listed in ``PROVENANCE`` with its source, the figure taken from it, how it maps
and a status (``published``: printed in the source; ``derived``: computed or fitted from
published numbers or from our measurements, the computation in the repository and re-run by the
tests; ``assumed``: no measurement we could point to):

- the kernel model (``KERNELS``, ``plan/kernels.py``): GEMM, attention and HBM constants per GPU
  generation, fitted to timings on an H100 (``benchmarks/plan/accuracy/h100/``) or scaled from
  published maximum achievable matmul rates; the element-wise floors per block;
- factors fitted on published runs (``FITTED_SCALES``, ``CONTENTION``): only on the fit set of
  ``plan/records.py`` (llm-foundry's H100 8-64 GPU and A100 80GB tables), never on a held-out
  run (``accuracy.fit_defaults`` re-derives them);
- the links: NVLink and network efficiencies (nccl-tests as commonly reported), NCCL's latency
  model (``plan/network.py``; the named clusters there carry their own sources);
- memory margins: the CUDA context and NCCL's buffers, and the allocator's fragmentation.

docs/plan.md ("Where the constants come from") is the long form of this table.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from layershard.plan.kernels import KernelModel


@dataclass(frozen=True)
class Efficiency:
    """Achievable fractions of peak (see the module docstring). ``compute``: a fraction of the
    dense peak for every FLOP, or None for the kernel model (``plan/kernels.py``), whose rates
    ``compute_scale`` multiplies (calibration). ``contention``: how much compute slows while a
    collective runs beside it (``plan/steptime.py``)."""

    compute: float | None = 0.5
    nvlink: float = 0.8
    network: float = 0.8
    pcie: float = 0.8
    host: float = 0.5
    compute_scale: float = 1.0
    contention: float = 0.0
    attention_scale: float = 1.0  # the kernel model's attention rates, multiplied

    def scaled(self, compute: float = 1.0, comm: float = 1.0) -> Efficiency:
        """Compute scaled by ``compute``, both collective links by ``comm`` (calibration)."""
        if self.compute is None:
            c = replace(self, compute_scale=self.compute_scale * compute)
        else:
            c = replace(self, compute=self.compute * compute)
        return replace(c, nvlink=self.nvlink * comm, network=self.network * comm)

    @property
    def compute_label(self) -> str:
        if self.compute is None:
            return "kernel model" + (
                f" x {self.compute_scale:.3g}" if self.compute_scale != 1 else ""
            )
        return f"{self.compute:.3g} of peak"


@dataclass(frozen=True)
class Source:
    gpu: str
    parameter: str
    value: float | None
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

# Before issue 36 the A100 network efficiency was fitted to the rows above (0.34, with compute
# at 0.57 of peak); ``calibrate.yafsdp_fit`` still re-derives it. YaFSDP's rows are now held out
# of every fit (plan/records.py) and the default network efficiency is nccl-tests' (below).
A100_NETWORK_FROM_YAFSDP = 0.34

# --- the kernel model (plan/kernels.py) --------------------------------------------------------
# H100: fitted (benchmarks/plan/accuracy/fit_kernels.py) to bf16 matmuls timed on an H100 SXM
# 80GB (torch 2.11, CUDA 13; benchmarks/plan/accuracy/h100/gemm.json: 343 grid shapes with at
# least 2 GFLOP and the 450 GEMMs of the published runs' models) and causal flash-attention
# timings (attn.json, head dims 64 and 128, 512-32768 tokens). A100: its 108 SMs; emax scaled by
# the maximum achievable matmul rates of the two (stas00/ml-engineering, compute/accelerator
# README, MAMF table: A100 SXM 267.9 TFLOP/s = 85.9% of peak, H100 SXM 792.1 = 80.1%); the tile
# constants as measured on the H100 (assumed); attention from FlashAttention-2's paper
# (arXiv 2307.08691: forward and backward reach 50-73% of the A100's peak; 0.60 / 0.70 at long
# sequences assumed, the H100's s_half).
KERNELS: dict[str, KernelModel] = {
    "h100": KernelModel(sms=132, emax=0.7474, k0=135.1, launch_s=21.4e-6, small_tile=0.984,
                        attn_fwd=(0.357, 391.0), attn_fwd_bwd=(0.337, 811.0), attn_hd64=0.896,
                        hbm_eff=0.90),
    "a100": KernelModel(sms=108, emax=0.7474 * 0.859 / 0.801, k0=135.1, launch_s=21.4e-6,
                        small_tile=0.984, attn_fwd=(0.70, 391.0), attn_fwd_bwd=(0.60, 811.0),
                        attn_hd64=0.896, hbm_eff=0.90),
}  # fmt: skip

# A block's element-wise floor (forward, backward seconds): the host's time to launch its small
# kernels in eager PyTorch, measured on the H100 machine as a block's time minus its GEMMs and
# attention (benchmarks/plan/accuracy/h100/block.json, means over the shapes there): layershard's
# Llama block 0.84 / 2.25 ms (4 shapes, d 2048-5120); a GPT block with fused LayerNorm and GELU
# (MPT's layout) 0.12 / 0.28 ms (its d = 1024 shape; larger ones are GPU-bound). transformers'
# Llama block is taken to launch as many kernels as ours (assumed).
ELEMENTWISE_FLOOR_S = {"llama": (0.84e-3, 2.25e-3), "gpt": (0.12e-3, 0.28e-3)}


def elementwise_floors(family: str) -> tuple[float, float]:
    return ELEMENTWISE_FLOOR_S["gpt" if family == "gpt" else "llama"]


# Fitted to the fit set of plan/records.py (llm-foundry's H100 8-64 GPU and A100 80GB bf16
# tables, 113 MPT runs) by ``accuracy.fit_defaults`` (Levenberg-Marquardt on log predicted /
# published tokens/s; rms log error 0.064); held-out runs never enter. Per GPU generation: the
# kernel model's compute rates and its attention rates, multiplied (what those runs' software
# reached against this machine's torch 2.11 / CUDA 13 kernels); and how much compute slows while
# a collective runs beside it (NCCL's kernels take SMs and HBM bandwidth; FSDP1's waits).
FITTED_SCALES = {"h100": (0.8779, 0.5649), "a100": (0.9633, 0.5401)}  # (compute, attention)
CONTENTION = 0.4854

# nccl-tests bus bandwidth over nominal, as commonly reported (uncertain): NVLink 3 ~230 of 300
# GB/s, NVLink 4 ~360 of 450; InfiniBand / RoCE across nodes ~0.8 of the NICs' line rate.
NVLINK_EFF = {"a100": 0.77, "h100": 0.80}
NETWORK_EFF = 0.80

A100 = Efficiency(compute=None, nvlink=NVLINK_EFF["a100"], network=NETWORK_EFF, pcie=0.8,
                  host=0.5, compute_scale=FITTED_SCALES["a100"][0],
                  attention_scale=FITTED_SCALES["a100"][1], contention=CONTENTION)  # fmt: skip
H100 = Efficiency(compute=None, nvlink=NVLINK_EFF["h100"], network=NETWORK_EFF, pcie=0.8,
                  host=0.5, compute_scale=FITTED_SCALES["h100"][0],
                  attention_scale=FITTED_SCALES["h100"][1], contention=CONTENTION)  # fmt: skip
H200 = H100

DEFAULT_EFFICIENCY = {"a100": A100, "h100": H100, "h200": H200}

# Memory the planner adds to its per-GPU peak (bytes it predicts tensor by tensor): the CUDA
# context and NCCL's buffers, and the caching allocator's fragmentation, as a fraction of the
# peak. Measured with layershard's engine on the H100 machine (benchmarks/plan/accuracy/h100/
# engine.json): free memory after CUDA initialisation 84.47 of 85.02 GB (0.55 GB context);
# max_memory_reserved / max_memory_allocated 1.21 and 1.18 in the first two runs of a process
# (llama-7b as rank 0 of 8, micro-batch 1 and 4); NCCL's buffers (not on the fake process
# group there) assumed 0.45 GiB.
CONTEXT_BYTES = 1 << 30
FRAGMENTATION = 0.13

_FIT_SET = (
    "the fit set of plan/records.py: llm-foundry's H100 (8-64 GPUs) and A100 80GB bf16 "
    "tables, 113 MPT runs; re-derived by accuracy.fit_defaults"
)
_H100_PROBE = (
    "measured on an H100 SXM 80GB (torch 2.11, CUDA 13), benchmarks/plan/accuracy/gpu_probe.py"
)

PROVENANCE: list[Source] = [
    # --- compute: the kernel model --------------------------------------------------------
    Source("h100", "kernels.emax", KERNELS["h100"].emax, "derived", _H100_PROBE,
           "h100/gemm.json: 287 grid shapes of at least 2 GFLOP and 450 GEMMs of the published "
           "runs' models; the largest products reach 796 TFLOP/s (0.80 of peak)",
           "least squares in log rate of kernels.gemm_time (emax, k0, launch_s, small_tile "
           "jointly; benchmarks/plan/accuracy/fit_kernels.py); median error 3% on the models' "
           "GEMMs"),
    Source("h100", "kernels.k0", KERNELS["h100"].k0, "derived", _H100_PROBE, "as emax", "as emax"),
    Source("h100", "kernels.launch_s", KERNELS["h100"].launch_s, "derived", _H100_PROBE,
           "as emax", "a fixed cost per GEMM; the small shapes set it"),
    Source("h100", "kernels.small_tile", KERNELS["h100"].small_tile, "derived", _H100_PROBE,
           "as emax", "as emax"),
    Source("h100", "kernels.attn_fwd", KERNELS["h100"].attn_fwd[0], "derived", _H100_PROBE,
           "h100/attn.json: causal SDPA (flash) forward, head dim 128, 512-32768 tokens: "
           "192-356 TFLOP/s counting the causal half",
           "e_inf of e(s) = e_inf s / (s + s_half), s_half 391, least squares in log rate"),
    Source("h100", "kernels.attn_fwd_bwd", KERNELS["h100"].attn_fwd_bwd[0], "derived",
           _H100_PROBE, "h100/attn.json: forward + backward (2.5 x forward FLOPs), head dim "
           "128: 127-325 TFLOP/s", "e_inf, s_half 811, as attn_fwd"),
    Source("h100", "kernels.attn_hd64", KERNELS["h100"].attn_hd64, "derived", _H100_PROBE,
           "h100/attn.json, head dim 64: e_inf 0.302 forward + backward",
           "rate at head dim 64 over head dim 128"),
    Source("h100", "kernels.hbm_eff", KERNELS["h100"].hbm_eff, "published",
           "/work/.library/device/KINDS.md (this workplace's H100 machine, 2026-11-13)",
           "a device-to-device copy moved about 3.0 TB/s counting bytes read and written, of "
           "3.35 TB/s", "element-wise kernels stream at this fraction of the HBM bandwidth"),
    Source("a100", "kernels.emax", KERNELS["a100"].emax, "derived",
           "stas00/ml-engineering, compute/accelerator/README.md, MAMF table",
           "A100 SXM 267.9 TFLOP/s = 85.9% of peak; H100 SXM 792.1 = 80.1%",
           "the H100's fitted emax x 85.9 / 80.1"),
    Source("a100", "kernels.k0", KERNELS["a100"].k0, "assumed", "the H100's (h100/gemm.json)",
           "-", "no A100 GEMM table at hand"),
    Source("a100", "kernels.launch_s", KERNELS["a100"].launch_s, "assumed", "the H100's", "-",
           "-"),
    Source("a100", "kernels.small_tile", KERNELS["a100"].small_tile, "assumed", "the H100's",
           "-", "-"),
    Source("a100", "kernels.attn_fwd", KERNELS["a100"].attn_fwd[0], "assumed",
           "Dao, 'FlashAttention-2', arXiv 2307.08691, abstract: 50-73% of the A100's peak",
           "0.70 forward at long sequences (the upper end)", "s_half: the H100's"),
    Source("a100", "kernels.attn_fwd_bwd", KERNELS["a100"].attn_fwd_bwd[0], "assumed",
           "as attn_fwd", "0.60 forward + backward", "s_half: the H100's"),
    Source("a100", "kernels.attn_hd64", KERNELS["a100"].attn_hd64, "assumed", "the H100's",
           "-", "-"),
    Source("a100", "kernels.hbm_eff", KERNELS["a100"].hbm_eff, "assumed", "the H100's", "-",
           "-"),
    Source("llama", "elementwise floor", ELEMENTWISE_FLOOR_S["llama"][0], "derived",
           _H100_PROBE, "h100/block.json: 4 Llama blocks (d 2048-5120): forward 0.76-0.96 ms, "
           "backward 2.06-2.39 ms beyond their GEMMs and attention",
           "the means, forward (backward 2.25 ms): the host's kernel launches"),
    Source("gpt", "elementwise floor", ELEMENTWISE_FLOOR_S["gpt"][0], "derived", _H100_PROBE,
           "h100/block.json: a GPT block of d 1024: 0.12 ms forward, 0.28 ms backward beyond "
           "its GEMMs and attention", "forward (backward 0.28 ms)"),
    # --- fitted on published runs ------------------------------------------------------------
    Source("h100", "compute_scale", DEFAULT_EFFICIENCY["h100"].compute_scale, "derived",
           _FIT_SET, "rms log error over the fit set in docs/plan.md",
           "the kernel model's compute rates, multiplied: what those runs' software reached"),
    Source("a100", "compute_scale", DEFAULT_EFFICIENCY["a100"].compute_scale, "derived",
           _FIT_SET, "as h100", "as h100"),
    Source("h100", "attention_scale", DEFAULT_EFFICIENCY["h100"].attention_scale, "derived",
           _FIT_SET, "as compute_scale", "the attention rates, multiplied"),
    Source("a100", "attention_scale", DEFAULT_EFFICIENCY["a100"].attention_scale, "derived",
           _FIT_SET, "as compute_scale", "as h100"),
    Source("all", "contention", CONTENTION, "derived", _FIT_SET, "as compute_scale",
           "compute slowdown while a collective runs beside it"),
    Source("all", "fragmentation", FRAGMENTATION, "derived", _FIT_SET,
           "the largest allocator margin under which every fit-set run fits (their planned peaks "
           "reach 72.4 GiB of 79.6); layershard's own max_memory_reserved / "
           "max_memory_allocated on the H100 was 1.18-1.21 (h100/engine.json)",
           "a fraction of the planned peak, added to it"),
    Source("all", "context", CONTEXT_BYTES / 2**30, "derived", _H100_PROBE,
           "h100/engine.json: 0.55 GB in use after CUDA initialisation; NCCL's buffers (not on "
           "the fake process group there) assumed 0.45 GiB", "GiB beside the tensors"),
    # --- links ------------------------------------------------------------------------------
    Source("a100", "nvlink", NVLINK_EFF["a100"], "assumed",
           "nccl-tests all_reduce_perf bus bandwidth on DGX A100, as commonly reported; no "
           "primary publication checked", "about 230 GB/s of 300 (uncertain)",
           "bus bandwidth / nominal per direction"),
    Source("h100", "nvlink", NVLINK_EFF["h100"], "assumed",
           "nccl-tests on DGX H100 (NVLink 4, no SHARP), as commonly reported",
           "about 360 GB/s of 450 (uncertain)", "bus bandwidth / nominal per direction"),
    Source("all", "network", NETWORK_EFF, "assumed",
           "nccl-tests across nodes on InfiniBand / RoCE, as commonly reported",
           "about 0.8 of the NICs' line rate (uncertain)",
           "bus bandwidth / nominal; a cluster preset (network.CLUSTERS) gives its own"),
    Source("all", "nccl latency", 8.4, "published",
           "NVIDIA/nccl src/graph/tuning.cc (baseLat, hwLat; Simple protocol)",
           "ring: 8.4 us + a step of 5.7 us (NVLink) or 6.6 us (network) per rank; tree: "
           "28 us per NVLink hop, 50 us per network hop",
           "network.collective_latency_s: NCCL's own latency model"),
    Source("all", "pcie", 0.8, "assumed",
           "CUDA bandwidthTest with pinned memory, as commonly reported",
           "about 25 of 32 GB/s on PCIe Gen4 (uncertain)", "measured / nominal per direction"),
    Source("all", "host", 0.5, "assumed", "no measurement of torch's CPU AdamW on DGX hosts",
           "-", "fraction of the node's DRAM bandwidth the CPU optimizer step streams at"),
    Source("h200", "all", None, "derived",
           "the H100's: same SMs, clocks, NVLink 4, PCIe Gen5 and NICs (datasheets)", "-",
           "the faster HBM3e enters through the HBM bandwidth"),
]  # fmt: skip
