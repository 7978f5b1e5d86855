#!/usr/bin/env bash
# The low-load A/B of README.md: the engine before issue 22 (a checkout of 7f0e46c) against this
# tree, comm shape, 2 gloo ranks, layershard and FSDP2 in each run, alternating old/new.
#   git worktree add --detach /tmp/old 7f0e46c && OLD=/tmp/old/src benchmarks/engine/engine-ab/run.sh
set -u
here=$(cd "$(dirname "$0")" && pwd)
new=$(cd "$here/../../.." && pwd)/src
old=${OLD:?set OLD to the src folder of the old tree}
py=${PYTHON:-python}
for r in 1 2 3; do
  for side in old new; do
    src=$old; [ "$side" = new ] && src=$new
    echo "round $r $side $(date -u +%FT%TZ) $(uptime)" >> "$here/uptime.txt"
    PYTHONPATH=$src $py -m layershard bench --shape comm --nproc 2 \
      --impl layershard fsdp2 --repeats 1 --out "$here/$side-$r" > "$here/$side-$r.txt" 2>&1
  done
done
echo "end $(date -u +%FT%TZ) $(uptime)" >> "$here/uptime.txt"
