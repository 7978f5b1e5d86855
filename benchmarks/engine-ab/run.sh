#!/usr/bin/env bash
# Issue 22's "bench within noise": the engine before the contract work (OLD, a checkout of 7f0e46c)
# against this tree, alternating, each run `layershard bench` with FSDP2 and DDP in the same
# processes' time window, so the comparison is the ratio to FSDP2/DDP of each run (load cancels
# out to first order) and the raw step times next to it.
#   OLD=/tmp/old/src ROUNDS=3 benchmarks/engine-ab/run.sh
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
new=$(cd "$here/../.." && pwd)/src
old=${OLD:?set OLD to the src folder of the old tree}
rounds=${ROUNDS:-3}
py=${PYTHON:-python}
for r in $(seq 1 "$rounds"); do
  for side in old new; do
    src=$old; [ "$side" = new ] && src=$new
    uptime >> "$here/uptime.txt"
    echo "round $r $side $(date -u +%FT%TZ)" >> "$here/uptime.txt"
    PYTHONPATH=$src $py -m layershard bench --shape small comm --nproc 2 \
      --impl layershard fsdp2 ddp --repeats 1 --out "$here/$side-$r" > "$here/$side-$r.txt" 2>&1
  done
done
uptime >> "$here/uptime.txt"
