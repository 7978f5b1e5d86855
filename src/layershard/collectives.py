"""All-gather and reduce-scatter into flat tensors, across torch versions and backends.

torch 2.13 names the flat collectives ``all_gather_single`` / ``reduce_scatter_single`` and
deprecates ``all_gather_into_tensor`` / ``reduce_scatter_tensor``, which older releases (2.6-2.11)
still need. Both backends take equal-size chunks only; callers pad (see ``flat.py``).

Note: stream ordering on CUDA. Every collective is issued from one high-priority *comm stream*.
At issue time the comm stream waits for everything already queued on the compute stream, which is
exactly what a collective needs: the issue points (see ``schedule.py``) are chosen so that the work
queued before them is the work that last read or wrote the buffer being reused, and the optimizer
step that last wrote the shard being cast. The compute stream waits for a collective only through
``Pending.wait()`` (an event), never for the whole comm stream, and the CPU never blocks. Buffers
are preallocated (gradient slots are freed only after the compute stream has waited for their
reduce-scatters), so no ``record_stream`` is needed. On CPU (gloo) the collective runs on gloo's
own threads; ``Pending.wait()`` waits for its work handle.

An all-gather is *in place*: the rank's shard is cast (to the compute dtype) straight into its
own chunk of the output buffer, on the comm stream, at every gather, as FSDP2 casts at every
all-gather. So there is no compute-dtype copy of the shard to keep fresh, and a write to the fp32
shard by any means (``p.data``, ``load_*``, an optimizer) is seen by the next gather.

On gloo, the native flat all-gather and reduce-scatter are slow (not pipelined), so layershard
carries them with other torch collectives. Measured for a 144 MB buffer over loopback, 2 ranks:
all_gather_single 0.165 s, reduce_scatter_single 0.192 s, all_reduce 0.074 s; on 4 ranks 0.30 s,
0.44 s and 0.21 s. An all-gather is one async ``broadcast`` per rank of its own chunk, straight into
the output buffer (about half the time of an all_reduce-based gather under the same load, and
bitwise exact); a reduce-scatter is an in-place ``all_reduce`` of which each rank keeps its chunk.
On 2 cores that CPU time is taken from compute, so it matters. Counts in ``CommStats`` stay
logical (one all-gather). ``LAYERSHARD_GLOO_NATIVE=1`` uses the native collectives instead: the
same code path as NCCL (a scratch per gradient slot, post-processing after the wait), which is how
the CUDA path's buffer logic is tested on CPU.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.profiler import record_function

_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def force_comm() -> bool:
    """``LAYERSHARD_FORCE_COMM=1``: a one-rank group still communicates (through the same
    collectives, streams and events as N > 1) instead of copying; for testing one GPU."""
    return os.environ.get("LAYERSHARD_FORCE_COMM") == "1"


@dataclass
class CommStats:
    """Collectives issued by one sharded model, by kind and phase, with the bytes of the full
    (unsharded) buffer each one moves (a ring moves ``(N-1)/N`` of that per rank), and the
    seconds the main thread blocked waiting for them (CPU only: on CUDA waits are events)."""

    count: Counter = field(default_factory=Counter)
    nbytes: Counter = field(default_factory=Counter)
    wait_s: Counter = field(default_factory=Counter)

    def record(self, op: str, phase: str, nbytes: int) -> None:
        self.count[op, phase] += 1
        self.nbytes[op, phase] += nbytes

    def as_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, phase), n in sorted(self.count.items()):
            d = out.setdefault(op, {"count": 0, "bytes": 0})
            d["count"] += n
            d["bytes"] += self.nbytes[op, phase]
            d[phase] = d.get(phase, 0) + n
        return out

    def reset(self) -> None:
        self.count.clear()
        self.nbytes.clear()
        self.wait_s.clear()


class Pending:
    """A collective in flight. ``wait()`` makes the caller's (compute) stream wait for it, then
    runs ``post`` on CPU; on CUDA ``post`` was already queued on the comm stream."""

    def __init__(
        self,
        work=None,
        event=None,
        post: Callable[[], None] | None = None,
        timer: tuple[Counter, str] | None = None,
    ):
        self._works = work if isinstance(work, list) else [work] if work is not None else []
        self._event, self._post, self._timer = event, post, timer
        self.done = False

    def wait(self) -> None:
        if self.done:
            return
        self.done = True
        if self._works:
            t0 = time.perf_counter()
            for work in self._works:
                work.wait()
            if self._timer is not None:
                self._timer[0][self._timer[1]] += time.perf_counter() - t0
        if self._post is not None:
            self._post()
        if self._event is not None:
            torch.cuda.current_stream().wait_event(self._event)


DONE = Pending()
DONE.done = True


class Comm:
    """Issues a sharded model's collectives on its process group and counts them."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device):
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        # False: a one-rank group copies instead of communicating (unless forced, for tests)
        self.active = self.world_size > 1 or force_comm()
        self.stats = CommStats()
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.gloo_workaround = (
            dist.get_backend(group) == "gloo" and os.environ.get("LAYERSHARD_GLOO_NATIVE") != "1"
        )
        self.needs_scratch = self.active and not self.gloo_workaround
        self._src = [dist.get_global_rank(group, r) for r in range(self.world_size)]

    def _issue(self, run: Callable[[bool], object], post, phase: str) -> Pending:
        timer = (self.stats.wait_s, phase)
        if self.stream is None:  # CPU: async gloo work, post-processing at wait()
            return Pending(work=run(True), post=post, timer=timer)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            run(False)  # synchronous w.r.t. the comm stream, asynchronous for the CPU
            if post is not None:
                post()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Pending(event=event)

    def all_gather(self, out: torch.Tensor, shard: torch.Tensor, phase: str, label: str) -> Pending:
        """Concatenate every rank's ``shard`` (equal sizes) into ``out``, casting to ``out``'s
        dtype: this rank's shard is written into its own chunk of ``out``, which is then
        gathered in place (no separate input buffer)."""
        own = out[self.rank * shard.numel() : (self.rank + 1) * shard.numel()]
        if not self.active:
            own.copy_(shard)
            return DONE
        self.stats.record("all_gather", phase, out.numel() * out.element_size())
        with record_function(f"layershard::all_gather[{label}]"):
            if self.gloo_workaround:
                own.copy_(shard)
                chunks = out.split(shard.numel())
                works = [
                    dist.broadcast(c, src=src, group=self.group, async_op=True)
                    for c, src in zip(chunks, self._src)
                ]
                return Pending(work=works, timer=(self.stats.wait_s, phase))

            def run(async_op: bool):
                own.copy_(shard)  # on the comm stream: after the optimizer step that wrote it
                return _all_gather(out, own, group=self.group, async_op=async_op)

            return self._issue(run, None, phase)

    def reduce_scatter(
        self,
        inp: torch.Tensor,
        scratch: torch.Tensor | None,
        phase: str,
        label: str,
        post: Callable[[torch.Tensor], None],
    ) -> Pending:
        """Sum ``inp`` across ranks; then ``post(chunk)`` with this rank's chunk of the sum.
        ``scratch`` holds the chunk where the backend needs one (``needs_scratch``)."""
        if not self.active:
            post(inp)
            return DONE
        self.stats.record("reduce_scatter", phase, inp.numel() * inp.element_size())
        n = inp.numel() // self.world_size
        with record_function(f"layershard::reduce_scatter[{label}]"):
            if self.gloo_workaround:
                chunk = inp[self.rank * n : (self.rank + 1) * n]
                run = lambda a: dist.all_reduce(inp, group=self.group, async_op=a)  # noqa: E731
            else:
                chunk = scratch[:n]
                run = lambda a: _reduce_scatter(chunk, inp, group=self.group, async_op=a)  # noqa: E731
            return self._issue(run, lambda: post(chunk), phase)

    def all_reduce(self, t: torch.Tensor, op, phase: str) -> None:
        self.stats.record("all_reduce", phase, t.numel() * t.element_size())
        dist.all_reduce(t, op=op, group=self.group)

    def broadcast(self, t: torch.Tensor, phase: str) -> None:
        self.stats.record("broadcast", phase, t.numel() * t.element_size())
        dist.broadcast(t, src=dist.get_global_rank(self.group, 0), group=self.group)
