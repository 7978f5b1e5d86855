"""What is alive at each rank's MemTracker peak of a bench run (issue 32). From the repository
root, with the bench worker's own arguments:

    PYTHONPATH=src python -m torch.distributed.run --standalone --nproc-per-node=4 \\
        benchmarks/moe/peak-bounds/live_at_peak.py --impl layershard-ep --seq-len 256 \\
        --global-batch 8 --steps 5 --warmup 2 --optimizer adamw --loss inside --ep 2 \\
        --hf-config benchmarks/moe/qwen3-moe-like --threads 1 --out /tmp/x.json

Each rank writes ``/tmp/peak_rank<r>.txt`` (the step's peak) and ``/tmp/bwpeak_rank<r>.txt``
(the highest point in backward): every live storage of 256 KiB or more, its kind, and where it
was made (the last layershard/transformers frames and the module). ``LIVE_AT_PEAK_TIMING=late``
makes no collective look finished before its wait (buffers freed as late as they can be);
``early`` makes every one finished when first asked (as early as they can be). A real run's
memory lies between the two, so a peak both give is the peak of every run.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch.distributed as dist

import layershard.bench.measure as measure
import layershard.bench.worker as worker
import layershard.engine.collectives as collectives


def _where() -> str:
    frames = traceback.extract_stack()[:-3]
    keep = [
        f"{os.path.basename(f.filename)}:{f.name}:{f.lineno}"
        for f in frames
        if ("layershard" in f.filename or "transformers" in f.filename)
        and "bench" not in f.filename
    ]
    return " < ".join(reversed(keep[-4:]))


def tracker():
    mt = measure.mem_tracker()
    made: dict[int, tuple[str, list]] = {}  # id(storage) -> where it was first seen
    track, update = mt._track, mt._update_peak_stats
    bw_peak = [0]

    def _track(reftype, t):
        st = t.untyped_storage()
        if st not in mt._WINFO:
            made[id(st)] = (_where(), list(mt._mod_tracker.parents)[-1:])
        return track(reftype, t)

    def dump(total: int, path: str) -> None:
        live = []
        for st, (winfo, _) in list(mt._WINFO.items()):
            if winfo.mem_consumed >= 256 * 1024:
                where, module = made.get(id(st), ("(before the step)", []))
                live.append((winfo.mem_consumed, str(winfo.reftype).split(".")[-1], module, where))
        live.sort(key=lambda x: -x[0])
        with open(path, "w") as fh:
            fh.write(f"PEAK {total / 2**20:.2f} MiB at {_where()}\n")
            for n, kind, module, where in live:
                fh.write(f"  {n / 2**20:8.2f} {kind:6s} {module} {where}\n")

    def _update(peak_state):
        before = sum(mt._peak_mem.values())
        update(peak_state)
        now = sum(s["Total"] for s in mt._curr_mem_snap.values())
        rank = dist.get_rank()
        if mt._mod_tracker.is_bw and now > bw_peak[0] + 2**16:
            bw_peak[0] = now
            dump(now, f"/tmp/bwpeak_rank{rank}.txt")
        if sum(mt._peak_mem.values()) > before + 2**16:
            dump(sum(mt._peak_mem.values()), f"/tmp/peak_rank{rank}.txt")

    mt._track, mt._update_peak_stats = _track, _update
    return mt


def main() -> int:
    timing = os.environ.get("LIVE_AT_PEAK_TIMING")
    if timing == "late":
        collectives.Pending.finished = lambda self: self.done
    elif timing == "early":
        wait = collectives.Pending.wait

        def finished(self) -> bool:
            wait(self)
            return True

        collectives.Pending.finished = finished
    worker.mem_tracker = tracker
    return worker.main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
