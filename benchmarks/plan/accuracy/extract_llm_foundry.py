"""Extract llm-foundry's MPT benchmark rows (bf16 tables) for plan/records.py.

    python benchmarks/plan/accuracy/extract_llm_foundry.py MIRROR_GIT_DIR > rows.txt

Reads scripts/train/benchmarking/README.md at commit 4952183 (the file's last change) and prints
one tuple per bf16 row: (table, model, seq, gpus, gpu, mfu %, micro-batch, grad-accum,
tokens/s/GPU, mp mode, sharding, activation checkpointing, params).
"""

from __future__ import annotations

import subprocess
import sys

COMMIT = "495218376"
PATH = "scripts/train/benchmarking/README.md"


def main() -> None:
    text = subprocess.run(
        ["git", "--git-dir", sys.argv[1], "show", f"{COMMIT}:{PATH}"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    table = ""
    for line in text.splitlines():
        if line.startswith("## "):
            table = line[3:].strip()
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if not line.startswith("|  ") or cells[0] in ("Model", "---") or "FP8" in table:
            continue
        # Two layouts: with and without the "Model TFLOP" column (the A100 40GB table)
        off = 0 if len(cells) == 20 else -1
        row = (
            {"H100 80GB BF16 (Large Scale, >= 128 GPUs)": "h100-large", "H100 80GB BF16": "h100",
             "A100 80GB with 1600 Gbps node-node interconnect (RoCE)": "a100-80g",
             "A100 40GB with 1600 Gbps node-node interconnect (RoCE)": "a100-40g"}[table],
            cells[0], int(cells[1]), int(cells[2]), cells[3], float(cells[4]),
            int(cells[7 + off]), int(cells[8 + off]), int(cells[12 + off]), cells[15 + off],
            cells[16 + off], cells[17 + off] == "True", int(cells[19 + off]),
        )  # fmt: skip
        print(f"    {row!r},")


if __name__ == "__main__":
    main()
