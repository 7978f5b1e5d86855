#!/bin/bash
# Alternating fresh launches of the EP bench worker (README.md here), from the repository root.
# usage: bench.sh ROUNDS OUTDIR NEW_SRC OLD_SRC [all|pair]
#   all (default): T = transformers-ep, N = layershard-ep from NEW_SRC, O = layershard-ep from
#     OLD_SRC, in a rotating order (T N O, N O T, O T N); pair: N and O only, alternating which
#     goes first. NEW_SRC / OLD_SRC: the src/ folders of two trees (git worktree add --detach).
rounds=$1; outdir=$2; new=$3; old=$4; mode=${5:-all}; mkdir -p "$outdir"
for r in $(seq 1 "$rounds"); do
  if [ "$mode" = pair ]; then
    if [ $((r % 2)) = 1 ]; then order="O N"; else order="N O"; fi
  else
    case $((r % 3)) in 1) order="T N O";; 2) order="N O T";; 0) order="O T N";; esac
  fi
  for v in $order; do
    case $v in T) src=$new; impl=transformers-ep;; N) src=$new; impl=layershard-ep;; O) src=$old; impl=layershard-ep;; esac
    out=$outdir/$v-$r.json
    load=$(cut -d' ' -f1 /proc/loadavg); t0=$(date -u +%H:%M:%S)
    PYTHONPATH=$src OMP_NUM_THREADS=1 LAYERSHARD_BENCH_WATCHDOG_S=1800 PYTHONWARNINGS=ignore::FutureWarning \
      timeout 900 python -m torch.distributed.run --standalone --nproc-per-node=4 -m layershard.bench.worker \
      --impl $impl --seq-len 256 --global-batch 8 --steps 5 --warmup 2 --seed 0 --lr 1e-4 --optimizer adamw \
      --loss inside --ep 2 --hf-config benchmarks/moe/qwen3-moe-like --threads 1 --out "$out" > "$out.log" 2>&1
    python -c "
import json,statistics as s;d=json.load(open('$out'))
pk=[round(p['memory'].get('memtracker_peak',0)/2**20,1) for p in d['per_rank']]
print('$v', $r, '$t0', 'load $load', round(s.median(d['step_times']),3), pk, max(pk), flush=True)"
  done
done
