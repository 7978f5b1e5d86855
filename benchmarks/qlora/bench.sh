#!/usr/bin/env bash
# Alternating repeats of benchmarks/qlora/sft_step.py at 2 ranks: fsdp (accelerate's QLoRA
# recipe) then ls, REPEATS times, each a fresh torchrun; `uptime` before each run.
#   PYTHONPATH=<a detached worktree>/src benchmarks/qlora/bench.sh OUT_DIR [REPEATS]
set -euo pipefail
out=${1:?out dir}; repeats=${2:-3}
here=$(cd "$(dirname "$0")" && pwd)
mkdir -p "$out"
[ -f "$out/base/config.json" ] || python "$here/sft_step.py" base "$out/base"
export OMP_NUM_THREADS=1
for i in $(seq "$repeats"); do
  for impl in fsdp ls; do
    echo "$(date -u +%FT%TZ) $impl repeat $i: $(uptime)" | tee -a "$out/uptime.log"
    python -m torch.distributed.run --standalone --nproc-per-node 2 "$here/sft_step.py" \
      "$impl" "$out/base" "$out/runs.jsonl" > "$out/$impl-$i.log" 2>&1
  done
done
python "$here/summarize.py" "$out/runs.jsonl"
