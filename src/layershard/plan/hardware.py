"""GPU types the planner knows, with vendor numbers and default efficiencies, and the cluster shape.

Peak numbers (vendor datasheets; dense, i.e. without 2:4 sparsity):
- H100 SXM5 80GB (NVIDIA H100 Tensor Core GPU datasheet): 989 TFLOP/s BF16 dense
  (1,979 with sparsity), HBM3 3.35 TB/s, NVLink 4 900 GB/s bidirectional = 450 GB/s per
  direction, PCIe Gen5 x16 128 GB/s bidirectional = 64 GB/s per direction. DGX H100 / HGX H100
  nodes: 8x ConnectX-7 NDR 400 Gb/s, one per GPU = 50 GB/s per GPU; two Xeon Platinum 8480C
  (8 DDR5-4800 channels each: 2 x 307 GB/s) and 2 TB of host memory (DGX H100 datasheet).
- H200 SXM 141GB (NVIDIA H200 datasheet): same compute, NVLink and PCIe as H100, HBM3e 4.8 TB/s;
  DGX H200 has the same CPUs, host memory and 400 Gb/s NDR per GPU as DGX H100.
- A100 SXM4 80GB / 40GB (NVIDIA A100 datasheet): 312 TFLOP/s BF16 dense, NVLink 3 600 GB/s
  bidirectional = 300 GB/s per direction, PCIe Gen4 x16 64 GB/s bidirectional = 32 per direction,
  HBM2e 2.04 TB/s (80GB) / HBM2 1.56 TB/s (40GB). DGX A100: 8x HDR 200 Gb/s = 25 GB/s per GPU;
  two AMD EPYC 7742 (8 DDR4-3200 channels each: 2 x 205 GB/s); 2 TB of host memory (DGX A100
  640GB) or 1 TB (DGX A100 320GB, the 40GB GPUs).
Memory is the framebuffer size ``nvidia-smi`` reports (81559 MiB for H100 80GB, 143771 MiB for
H200, 81920 / 40960 MiB for A100); the CUDA context and allocator fragmentation come out of the
planner's headroom fraction.

- H100 96GB (torchtitan's Grand Teton hosts): HBM2e 2.4 TB/s, 500 W; planned at the SXM part's
  989 TFLOP/s, which it does not reach (its peak is not published).

What a GPU reaches of those peaks is not a vendor number: ``kernels`` names its generation's
kernel model (``sources.KERNELS``: SM count, GEMM and attention rates, fitted to timings on an
H100), and ``Efficiency`` holds the links' fractions and the factors fitted on published runs,
each with its source in ``layershard.plan.sources`` and docs/plan.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from layershard.plan.sources import DEFAULT_EFFICIENCY, Efficiency

MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40


@dataclass(frozen=True)
class GPU:
    name: str
    memory_bytes: int
    bf16_tflops: float  # dense peak
    intra_bw_gbs: float  # intra-node (NVLink) GB/s per GPU per direction
    inter_bw_gbs: float  # inter-node (NIC) GB/s per GPU per direction
    hbm_bw_gbs: float  # for the memory-bound optimizer step
    pcie_gbs: float = 64.0  # host <-> device GB/s per GPU per direction (CPU offload)
    host_bw_gbs: float = 614.0  # host DRAM GB/s per node (the CPU optimizer step under offload)
    host_memory_bytes: int = 2 * TiB  # per node (CPU offload keeps the shards there)
    eff: Efficiency = field(default_factory=Efficiency)
    kernels: str | None = None  # a key of sources.KERNELS: its kernel model; None: flat FLOPs
    # seconds per element to quantize a shard to the wire dtype and to dequantize a gathered
    # buffer, on the compute stream (gather_dtype); 0: not modelled (a GPU's kernels), measured
    # on the testbed's CPU (plan/testbed.py)
    wire_s_per_elem: tuple[float, float] = (0.0, 0.0)

    @property
    def peak_flops(self) -> float:
        return self.bf16_tflops * 1e12


GPUS: dict[str, GPU] = {
    "h100": GPU("h100", 81559 * MiB, 989.0, 450.0, 50.0, 3350.0, 64.0, 614.0, 2 * TiB,
                DEFAULT_EFFICIENCY["h100"], "h100"),
    "h200": GPU("h200", 143771 * MiB, 989.0, 450.0, 50.0, 4800.0, 64.0, 614.0, 2 * TiB,
                DEFAULT_EFFICIENCY["h200"], "h100"),
    "a100-80g": GPU("a100-80g", 81920 * MiB, 312.0, 300.0, 25.0, 2039.0, 32.0, 410.0, 2 * TiB,
                    DEFAULT_EFFICIENCY["a100"], "a100"),
    "a100-40g": GPU("a100-40g", 40960 * MiB, 312.0, 300.0, 25.0, 1555.0, 32.0, 410.0, 1 * TiB,
                    DEFAULT_EFFICIENCY["a100"], "a100"),
    # torchtitan's H100 (Grand Teton): 96 GB HBM2e at 2.4 TB/s, 500 W; planned at the SXM
    # part's 989 TFLOP/s, which it does not reach (its peak is unknown: torchtitan's note)
    "h100-96g": GPU("h100-96g", 98304 * MiB, 989.0, 450.0, 50.0, 2400.0, 64.0, 614.0, 2 * TiB,
                    DEFAULT_EFFICIENCY["h100"], "h100"),
}  # fmt: skip


def get_gpu(
    name: str,
    memory_gb: float | None = None,
    tflops: float | None = None,
    intra_bw: float | None = None,
    inter_bw: float | None = None,
    pcie_bw: float | None = None,
    host_memory_gb: float | None = None,
    eff: Efficiency | None = None,
) -> GPU:
    """A GPU from the table with optional overrides (memory in GiB, bandwidths in GB/s, host
    memory in GiB per node, efficiencies)."""
    key = name.lower()
    if key not in GPUS:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(GPUS)}")
    gpu = GPUS[key]
    if memory_gb is not None:
        gpu = replace(gpu, memory_bytes=int(memory_gb * GiB))
    if tflops is not None:
        gpu = replace(gpu, bf16_tflops=float(tflops))
    if intra_bw is not None:
        gpu = replace(gpu, intra_bw_gbs=float(intra_bw))
    if inter_bw is not None:
        gpu = replace(gpu, inter_bw_gbs=float(inter_bw))
    if pcie_bw is not None:
        gpu = replace(gpu, pcie_gbs=float(pcie_bw))
    if host_memory_gb is not None:
        gpu = replace(gpu, host_memory_bytes=int(host_memory_gb * GiB))
    if eff is not None:
        gpu = replace(gpu, eff=eff)
    return gpu


@dataclass(frozen=True)
class Cluster:
    gpus: int
    gpus_per_node: int
    # a group spanning nodes sends each chunk across the network once (layershard on gloo,
    # engine/gloo_routes.py) instead of a ring through every GPU's NIC (NCCL's)
    by_node: bool = False

    def __post_init__(self) -> None:
        if self.gpus < 1 or self.gpus_per_node < 1:
            raise ValueError("--gpus and --gpus-per-node must be >= 1")
        if self.gpus > self.gpus_per_node and self.gpus % self.gpus_per_node:
            raise ValueError(
                f"--gpus {self.gpus} is not a multiple of --gpus-per-node {self.gpus_per_node}; "
                "plan whole nodes (or fewer GPUs than a node)"
            )

    @property
    def local(self) -> int:
        """GPUs per node actually used."""
        return min(self.gpus, self.gpus_per_node)

    @property
    def nodes(self) -> int:
        return -(-self.gpus // self.gpus_per_node)
