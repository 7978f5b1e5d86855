#!/usr/bin/env bash
# The GPU measurements of the GPU issue, in parts that each finish well under 10 minutes on one
# H100/H200. Results go to $OUT (the device tool's output folder) or ./gpu-results.
#
#   bash benchmarks/gpu/run.sh suite     # pytest -m gpu, figures as JSON (LAYERSHARD_GPU_REPORT)
#   bash benchmarks/gpu/run.sh bench     # layershard bench --nproc 1: llama-1b, bf16, seq 2048
#   bash benchmarks/gpu/run.sh train     # layershard train --model small, and its plan
#   bash benchmarks/gpu/run.sh maxmodel  # the biggest model that fits: layershard vs FSDP2
#
# Copy $OUT's contents to benchmarks/gpu/<part>-<device>/ (as suite-h100/) and the figures into
# benchmarks/gpu/README.md and the README.
set -euo pipefail
cd "$(dirname "$0")/../.."
out="${OUT:-gpu-results}"
mkdir -p "$out"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/device.csv" || true
python -c "import torch; print(torch.__version__, torch.version.cuda)" > "$out/torch.txt"
case "${1:-suite}" in
  suite)
    LAYERSHARD_GPU_REPORT="$out/suite" python -m pytest -m gpu tests/test_gpu.py -q -rA \
      2>&1 | tee "$out/suite.log"
    ;;
  bench)
    layershard bench --model llama-1b --nproc 1 --seq-len 2048 --global-batch 4 \
      --precision bf16 --impl fsdp2 fsdp1 ddp plain --repeats 2 --steps 5 --warmup 2 \
      --no-mem --out "$out/bench-llama-1b" 2>&1 | tee "$out/bench.log"
    ;;
  train)
    layershard train --model small --steps 300 --run-dir "$out/train-small" --overwrite \
      2>&1 | tail -n 40 | tee "$out/train.log"
    layershard plan --model small --gpus 1 --gpu "$(python -c "import torch; n=torch.cuda.get_device_name().lower(); print('h200' if 'h200' in n else 'h100' if 'h100' in n else 'a100-80g')")" \
      --seq-len 256 --micro-batch 8 2>&1 | tee "$out/plan-small.txt"
    ;;
  maxmodel)
    python benchmarks/gpu/max_model.py --impl layershard fsdp2 --preset llama-7b --world 8 \
      --seq 2048 --max-layers 256 2>&1 | tee "$out/max_model.jsonl"
    ;;
  *)
    echo "usage: $0 suite|bench|train|maxmodel" >&2
    exit 2
    ;;
esac
