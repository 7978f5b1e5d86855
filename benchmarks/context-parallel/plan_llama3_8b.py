"""`layershard plan`'s rows for Llama-3-8B at 128K-1M tokens a sequence on 8, 16 and 32 H100
(one CP group over every GPU: cp = GPUs, one sequence a step), beside Arctic Long Sequence
Training's published maxima (Bekman et al. 2025, arXiv:2506.13996: Llama-8B at 500K tokens on 1
H100, 3.7M on one 8 x H100 node, 15M on 4 nodes), and the longest sequence the plan fits in
each layout: every block checkpointed, the chunked loss, ring and all-to-all, the optimizer on
the GPU or offloaded to the CPU (ls.CPUOffload).

    python benchmarks/context-parallel/plan_llama3_8b.py > benchmarks/context-parallel/plan-llama3-8b.txt

Modelled, not measured: the plan's formulas (plan/context.py), which assume flash kernels for
the ring's blocks.
"""

from __future__ import annotations

from pathlib import Path

from layershard.plan import Cluster, ModelShape, Settings, get_gpu, make_plan

CONFIG = Path(__file__).resolve().parents[1] / "chunked-loss" / "llama-3-8b"
ALST = {1: "500K", 8: "3.7M", 32: "15M"}  # published maxima, Llama-8B, H100
K = 1024


def plan(shape, gpus: int, seq: int, mode: str, offload: bool):
    s = Settings(1, seq, checkpoint_layers=shape.n_layers, loss_chunks=64, cp=gpus,
                 cp_mode=mode, offload=offload)  # fmt: skip
    return make_plan(shape, get_gpu("h100"), Cluster(gpus, 8), s)


def longest(shape, gpus: int, mode: str, offload: bool) -> int:
    """The longest sequence (a multiple of 2 cp x 1024) whose plan fits."""
    step = 2 * gpus * K
    lo, hi = 0, 64 * K * K // step  # up to 64M tokens
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if plan(shape, gpus, mid * step, mode, offload).fits:
            lo = mid
        else:
            hi = mid - 1
    return lo * step


def main() -> None:
    shape = ModelShape.from_hf_config(CONFIG)
    print("Llama-3-8B, H100 80 GB, cp = GPUs (one sequence over all of them), every block "
          "checkpointed, chunked loss (64 chunks)\n")  # fmt: skip
    print(f"{'GPUs':>4} {'mode':10} {'offload':7} " + " ".join(
        f"{f'{s // K}K peak/step':>18}" for s in (128 * K, 256 * K, 512 * K, 1024 * K)
    ) + f" {'longest':>9} {'ALST':>6}")  # fmt: skip
    for gpus in (8, 16, 32):
        for mode in ("ring", "all_to_all"):
            for offload in (False, True):
                cells = []
                for seq in (128 * K, 256 * K, 512 * K, 1024 * K):
                    p = plan(shape, gpus, seq, mode, offload)
                    peak = p.memory["peak"] / 2**30
                    mark = "" if p.fits else "!"
                    cells.append(f"{peak:7.1f}G{mark:1} {p.time.step_s:7.1f}s")
                best = longest(shape, gpus, mode, offload)
                print(f"{gpus:>4} {mode:10} {str(offload):7} " + " ".join(f"{c:>18}" for c in cells)
                      + f" {best / K / K:8.2f}M {ALST.get(gpus, '-'):>6}")  # fmt: skip
    print("\n! = does not fit (peak over the usable memory). Step time: the plan's, one sequence.")


if __name__ == "__main__":
    main()
