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
reduce-scatters; a quantized gather's byte buffer is held by its ``Pending`` until then), so no
``record_stream`` is needed. On CPU (gloo) the collective runs on gloo's
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
bitwise exact). A reduce-scatter is an ``all_to_all_single`` (rank r receives chunk r of every
rank's buffer, into the gradient slot's receive scratch) and a local sum of the N chunks, in rank
order, into the first of them in fp32 (the buffer is only read: it may be autograd's gradient),
into the rank's own chunk of the (by then sent) buffer in 16-bit dtypes. It sends (N-1)/N of the
buffer where an all_reduce sends twice that (16.8 MB, 2 ranks: 7.2 against 11.5 ms; 4 ranks:
13.3 against 28.2 ms). On 2 cores that CPU time is taken from compute, so it matters. Counts in
``CommStats`` stay logical (one all-gather, one reduce-scatter). ``LAYERSHARD_GLOO_NATIVE=1`` uses
the native collectives instead: the same code path as NCCL (a shard-sized scratch per gradient
slot), which is how the CUDA path's buffer logic is tested on CPU.

On gloo, a group that spans nodes routes its bytes by lanes, or by node when each node has
several of its ranks: engine/gloo_routes.py.

16-bit reductions (``reduce_dtype=bf16``/fp16) take the all-to-all on every backend, NCCL too: the
chunks travel in 16 bits and the receiving rank sums them in fp32 and rounds once, where NCCL's
native bf16 reduce-scatter rounds its running sum at every hop of its ring. The same bytes cross
the links; the price is memory, a whole unit in the 16-bit dtype as receive scratch per gradient
slot instead of a shard (with the 16-bit gradient buffer, less than an fp32 reduction holds).
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial

import torch
import torch.distributed as dist
from torch.profiler import record_function

from layershard.engine.gloo_routes import GlooRoutes
from layershard.engine.waits import waiting
from layershard.engine.wire_dtype import WireGather

# torch 2.13's names for the flat collectives; torch 2.11 (the GPU image's) has only the
# deprecated ``*_tensor`` ones. Everything in layershard calls these two.
all_gather_single = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_single = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def profiled(label: str) -> contextlib.AbstractContextManager:
    """A profiler range named ``label`` while a profiler records, else nothing: an idle
    ``record_function`` still costs ~20 us, paid per unit and pass."""
    if torch.autograd.profiler._is_profiler_enabled:
        return record_function(label)
    return contextlib.nullcontext()


def force_comm() -> bool:
    """``LAYERSHARD_FORCE_COMM=1``: a one-rank group still communicates (through the same
    collectives, streams and events as N > 1) instead of copying; for testing one GPU."""
    return os.environ.get("LAYERSHARD_FORCE_COMM") == "1"


@dataclass
class CommStats:
    """Collectives issued by one sharded model, by kind and phase, with the bytes of the full
    buffer each one moves (a ring moves ``(N-1)/N`` of that per rank), the group each ran on
    (``shard``, ``replicate``, ``hpz``, ``all``), and the seconds the main thread blocked waiting
    for them (CPU only: on CUDA waits are events)."""

    count: Counter[tuple[str, str]] = field(default_factory=Counter)
    nbytes: Counter[tuple[str, str]] = field(default_factory=Counter)
    groups: Counter[tuple[str, str]] = field(default_factory=Counter)
    wait_s: dict[str, float] = field(default_factory=dict)

    def record(self, op: str, phase: str, nbytes: int, group: str = "shard") -> None:
        self.count[op, phase] += 1
        self.nbytes[op, phase] += nbytes
        self.groups[op, group] += 1

    def as_dict(self) -> dict[str, dict[str, int]]:
        out: dict[str, dict[str, int]] = {}
        for (op, phase), n in sorted(self.count.items()):
            d = out.setdefault(op, {"count": 0, "bytes": 0})
            d["count"] += n
            d["bytes"] += self.nbytes[op, phase]
            d[phase] = d.get(phase, 0) + n
        return out

    def by_group(self) -> dict[str, dict[str, int]]:
        """``{op: {group: count}}``."""
        out: dict[str, dict[str, int]] = {}
        for (op, group), n in sorted(self.groups.items()):
            out.setdefault(op, {})[group] = n
        return out

    def reset(self) -> None:
        self.count.clear()
        self.nbytes.clear()
        self.groups.clear()
        self.wait_s.clear()


class Pending:
    """A collective in flight. ``wait()`` makes the caller's (compute) stream wait for it, then
    runs ``post`` on CPU; on CUDA ``post`` was already queued on the comm stream. ``host_post``
    runs on the CPU after the collective (and ``post``) finished: on CUDA after synchronizing
    with its event (CPU offload: the gradient's copy to host memory)."""

    def __init__(
        self,
        work=None,
        event=None,
        post: Callable[[], None] | None = None,
        timer: tuple[dict[str, float], str] | None = None,
        host_post: Callable[[], object] | None = None,
        host_sync: bool = False,
        what: str = "collective",
        keep: object = None,
    ):
        self.what = what  # for a stall report: "all-gather of unit layers.3 (backward)"
        # a buffer allocated for this collective alone (a quantized gather's bytes): on CUDA held
        # until the compute stream has waited for the collective, so that the allocator hands
        # its memory to nothing the comm stream may still be reading (no record_stream)
        self._keep = keep
        self._works = work if isinstance(work, list) else [work] if work is not None else []
        self._event, self._post, self._timer = event, post, timer
        self._host_post, self._host_sync = host_post, host_sync
        self.done = False

    def finished(self) -> bool:
        """The collective is over (nothing blocks), whether or not ``wait()`` ran."""
        if self.done:
            return True
        if self._event is not None and not self._event.query():
            return False
        return all(w.is_completed() for w in self._works)

    def wait(self) -> None:
        """Wait once; ``done`` only after everything finished, so a wait that raised (a
        timeout) raises again rather than letting a later wait read an unfinished buffer."""
        if self.done:
            return
        if self._works:
            t0 = time.perf_counter()
            with waiting(self.what):
                for work in self._works:
                    work.wait()
            if self._timer is not None:
                waits, phase = self._timer
                waits[phase] = waits.get(phase, 0.0) + time.perf_counter() - t0
        if self._post is not None:
            self._post()
        if self._event is not None:
            if self._host_sync or self._host_post is not None:
                self._event.synchronize()  # the CPU reads or writes what it touched
            torch.cuda.current_stream().wait_event(self._event)
        if self._host_post is not None:
            self._host_post()
        self.done = True
        self._works, self._post, self._host_post = [], None, None  # let buffers go
        self._keep = None


def _sum_into_first(rows: tuple[torch.Tensor, ...]) -> None:
    """``rows[0] += rows[1] + ...``, left to right: the chunks of every rank, summed in the
    scratch that received them (the reduced buffer is only read: it may be autograd's own
    gradient, see Reducer). In fp32, bitwise ``torch.sum(rows, dim=0)`` (but the sign of a zero
    sum); 16-bit dtypes would round after each add, so they sum into the buffer's own chunk."""
    for r in rows[1:]:
        rows[0].add_(r)


DONE = Pending()
DONE.done = True


def _nothing() -> Pending:
    return DONE


class _TwoStage(Pending):
    """Two collectives in turn on gloo: a reduction over the shard group, then over the replicas
    (``hybrid``, ``no_shard``), or a gather or a reduction by node (engine/gloo_routes.py). The
    second may start only when the first is done, so it is issued by ``Comm.advance`` (a
    reduction's: at the next reduction, or by node at the next unit's backward) or at this one's
    wait, in issue order on every rank, which keeps the ranks' collective order equal."""

    def __init__(self, first: Pending, second: Callable[[], Pending]):
        super().__init__()
        self.first, self.second = first, second
        self.issued: Pending | None = None

    def start_second(self) -> None:
        if self.issued is None:
            self.first.wait()
            self.issued = self.second()

    def finished(self) -> bool:
        return self.done or (self.issued is not None and self.issued.finished())

    def wait(self) -> None:
        if self.done:
            return
        self.start_second()
        assert self.issued is not None
        self.issued.wait()
        self.done = True
        self.first, self.second = DONE, _nothing  # the closures hold the gradient slot


def _copy_in(own: torch.Tensor, src: torch.Tensor) -> None:
    """``own.copy_(src)`` with the cast on ``own``'s device: from (pinned) host memory the fp32
    shard travels as it is, asynchronously, then is cast there (a cross-device copy that also
    casts would cast on the host into unpinned memory first, and block)."""
    if src.device != own.device and src.dtype != own.dtype:
        src = src.to(own.device, non_blocking=True)
    own.copy_(src, non_blocking=True)


class Comm:
    """Issues a sharded model's collectives and counts them. ``group`` is the shard group (the
    ranks a unit is split over; None: this rank alone); ``replicate`` the group its slices are
    replicated over; ``hpz`` the group backward re-gathers within (``reshard_after_forward=K``);
    ``full`` every rank of the model (state loading, buffer broadcast); ``expert`` the group an
    expert-parallel layer's experts are split over (the ranks holding the same experts)."""

    def __init__(self, sharding, full_group: dist.ProcessGroup, device: torch.device):
        self.sharding = sharding
        self.group = sharding.shard_group
        self.replicate = sharding.replicate_group
        self.hpz = sharding.hpz_group
        self.expert = sharding.expert_group
        self.full = full_group
        self.device = device
        self.rank, self.world_size = sharding.shard_rank, sharding.shard_size
        # False: a one-rank group copies instead of communicating (unless forced, for tests)
        self.active = self.group is not None and (self.world_size > 1 or force_comm())
        # each group's (group, this rank, size), asked for at every gather and reduction
        self._members = {
            name: (None, 0, 1) if g is None else (g, dist.get_rank(g), dist.get_world_size(g))
            for name, g in (
                ("shard", self.group), ("hpz", self.hpz), ("replicate", self.replicate),
                ("expert", self.expert),
            )
        }  # fmt: skip
        self.stats = CommStats()
        self.stream = torch.cuda.Stream(device, priority=-1) if device.type == "cuda" else None
        self.backend = dist.get_backend(full_group)
        self.gloo_workaround = (
            self.backend == "gloo" and os.environ.get("LAYERSHARD_GLOO_NATIVE") != "1"
        )
        self.routes = GlooRoutes(sharding, self._members) if self.gloo_workaround else None
        self.host_sync = False  # CPU offload: waits also synchronize the CPU (see Pending)
        self._two_stage: list[_TwoStage] = []
        # Small agreements between ranks (which units a backward reaches) run on the CPU: on
        # gloo the model's own group; under NCCL a gloo group of the same ranks, made at
        # shard() (collective), so that no agreement waits for the GPU (layershard/groups.py).
        self.control = sharding.groups.control()
        self.control_size = dist.get_world_size(full_group)
        self.wire: WireGather | None = None  # when weights travel quantized (engine/wire_dtype.py)

    def scratch_numel(
        self, numel: int, shard_numel: int, over: str = "shard", dtype: torch.dtype = torch.float32
    ) -> int:
        """Elements of the scratch a reduce-scatter of a ``numel`` buffer in ``dtype`` over group
        ``over`` needs (``shard_numel`` per rank): the received chunks of every rank (an
        all-to-all: gloo, and 16-bit reductions everywhere), the reduced chunk (native fp32
        reduce-scatter), or none (a one-rank group copies)."""
        if not self.communicates(over):
            return 0
        return numel if self.by_all_to_all(dtype) else shard_numel

    def by_all_to_all(self, dtype: torch.dtype) -> bool:
        """Is a reduction in ``dtype`` an all-to-all and a local sum? Always on gloo (faster
        than its native reduce-scatter), and for 16-bit dtypes on every backend: a native
        16-bit reduce-scatter (NCCL's ring) rounds the running sum at every hop, where the
        issue's contract is one rounding of the fp32 sum (see ``reduce_scatter``)."""
        return self.gloo_workaround or dtype != torch.float32

    def members(self, over: str) -> tuple[dist.ProcessGroup | None, int, int]:
        return self._members[over]

    @property
    def lanes(self) -> list[dist.ProcessGroup]:
        """Every group made to route this model's gathers on gloo (engine/gloo_routes.py)."""
        return self.routes.all() if self.routes is not None else []

    def _gloo_gather(
        self, out: torch.Tensor, n: int, over: str, phase: str, what: str, post=None
    ) -> Pending:
        """Gloo's all-gather of ``out`` (``n`` elements per rank, this rank's chunk in place),
        in one stage or two (by node), then ``post()``."""
        assert self.routes is not None
        group = self._members[over][0]
        timer = (self.stats.wait_s, phase)
        first, second = self.routes.broadcasts(out, n, over, group)
        if second is None:
            return Pending(work=first, post=post, timer=timer, what=what)
        then = lambda: Pending(work=second(), post=post, timer=timer, what=what)  # noqa: E731
        return _TwoStage(Pending(work=first, timer=timer, what=what), then)

    def _exchange(self, recv: torch.Tensor, inp: torch.Tensor, over: str, async_op: bool):
        """A reduce-scatter's exchange: row r of ``recv`` gets this rank's chunk of rank r's
        ``inp`` (an all-to-all; on gloo, by lanes where the group has them)."""
        group, rank, _ = self._members[over]
        if self.routes is None:
            return dist.all_to_all_single(recv, inp, group=group, async_op=async_op)
        return self.routes.exchange(recv, inp, over, group, rank, async_op)

    def communicates(self, over: str) -> bool:
        """Does group ``over`` move data (not a group of one; forced for tests)?"""
        group, _, world = self.members(over)
        return group is not None and (world > 1 or force_comm())

    def _issue(
        self,
        run: Callable[[bool], object],
        post,
        phase: str,
        host_post=None,
        what: str = "",
        keep: object = None,
    ) -> Pending:
        timer = (self.stats.wait_s, phase)
        if self.stream is None:  # CPU: async gloo work, post-processing at wait()
            return Pending(work=run(True), post=post, timer=timer, host_post=host_post, what=what)
        self.stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(self.stream):
            run(False)  # synchronous w.r.t. the comm stream, asynchronous for the CPU
            if post is not None:
                post()
            event = torch.cuda.Event()
            event.record(self.stream)
        return Pending(
            event=event, host_post=host_post, host_sync=self.host_sync, what=what, keep=keep
        )

    def _copied_locally(self, host_post: Callable[[], object] | None = None) -> Pending:
        """No collective, but a copy between host and device memory was queued on the current
        stream (CPU offload on one rank): on CUDA the CPU must wait for it before it reads the
        copy's result (``host_post``) or writes what it reads (the optimizer steps the host
        shards), as after a collective. On CPU the copy is done."""
        if self.stream is None:
            if host_post is not None:
                host_post()
            return DONE
        event = torch.cuda.Event()
        event.record()
        return Pending(event=event, host_post=host_post, host_sync=True)

    def all_gather(
        self, out: torch.Tensor, src: torch.Tensor, phase: str, label: str, over: str = "shard"
    ) -> Pending:
        """Concatenate the ``src`` of every rank of group ``over`` (equal sizes) into ``out``,
        casting to ``out``'s dtype: this rank's ``src`` is written into its own chunk of ``out``,
        which is then gathered in place (no separate input buffer)."""
        group, rank, world = self.members(over)
        what = f"all-gather of unit {label} ({phase})"
        n = src.numel()
        own = out[rank * n : (rank + 1) * n]
        if group is None or not (world > 1 or force_comm()):
            if own.data_ptr() != src.data_ptr():  # no_shard in fp32: the buffer is the shard
                _copy_in(own, src)
                if src.device != own.device:  # from host memory (CPU offload)
                    return self._copied_locally()
            return DONE
        self.stats.record("all_gather", phase, out.numel() * out.element_size(), over)
        with profiled(f"layershard::all_gather[{label}]"):
            if self.gloo_workaround:
                own.copy_(src)
                return self._gloo_gather(out, n, over, phase, what)

            def run(async_op: bool):
                # on the comm stream: after the optimizer step that wrote the shard
                _copy_in(own, src)
                return all_gather_single(out, own, group=group, async_op=async_op)

            return self._issue(run, None, phase, what=what)

    def gather_weights(
        self, out: torch.Tensor, flat, phase: str, label: str, src: torch.Tensor | None = None
    ) -> Pending:
        """A unit's gather of flat parameter ``flat`` over the shard group into ``out``: in the
        wire dtype when one is set and the group communicates, else ``all_gather`` of ``src``
        (default: the rank's slice)."""
        if self.wire is not None and src is None and self.quantizable(flat):
            return self.wire.gather(self, flat, out, phase, label)
        return self.all_gather(out, flat.shard if src is None else src, phase, label, flat.over)

    def quantizable(self, flat) -> bool:
        """Would ``flat``'s unit gathers travel in a wire dtype? fp32 masters over a group that
        communicates would; 4-bit bytes and frozen weights kept in 16 bits go as they are."""
        plain = flat.packed or flat.dtype != torch.float32
        return not plain and self.communicates(flat.over)

    def all_gather_packed(
        self,
        out: torch.Tensor,
        chunk: int,
        pack: Callable[[torch.Tensor], None],
        unpack: Callable[[torch.Tensor], None],
        phase: str,
        label: str,
        over: str = "shard",
    ) -> Pending:
        """A quantized all-gather (engine/wire_dtype.py): ``pack(own)`` writes this rank's ``chunk``
        bytes, the ranks gather them into a byte buffer that lives until the wait, and
        ``unpack(wire)`` dequantizes every rank's bytes into ``out`` (the gather slot). Only
        called when group ``over`` communicates; the bytes counted are the wire's."""
        group, rank, world = self.members(over)
        assert group is not None and (world > 1 or force_comm())
        what = f"all-gather of unit {label} ({phase}, quantized)"
        wire = torch.empty(world * chunk, dtype=torch.uint8, device=out.device)  # Pending keeps it
        own = wire[rank * chunk : (rank + 1) * chunk]
        self.stats.record("all_gather", phase, wire.numel(), over)
        with profiled(f"layershard::all_gather[{label}]"):
            if self.gloo_workaround:
                pack(own)
                return self._gloo_gather(wire, chunk, over, phase, what, lambda: unpack(wire))

            def run(async_op: bool):
                pack(own)  # on the comm stream: after the optimizer step that wrote the shard
                return all_gather_single(wire, own, group=group, async_op=async_op)

            return self._issue(run, lambda: unpack(wire), phase, what=what, keep=wire)

    def reduce_scatter(
        self,
        inp: torch.Tensor,
        scratch: torch.Tensor | None,
        phase: str,
        label: str,
        post: Callable[[torch.Tensor], object],
        host_post: Callable[[], object] | None = None,
        over: str = "shard",
    ) -> Pending:
        """Sum ``inp`` across group ``over`` (the shard group, or the expert group) and then
        this rank's chunk across the replicas; then ``post(chunk)`` with the chunk of the sum
        (on the comm stream on CUDA), then ``host_post()`` on the CPU. ``scratch``
        (``scratch_numel`` elements) is where the chunk is reduced into or the other ranks'
        chunks are received."""
        group, rank, world = self.members(over)
        n = inp.numel() // world
        what = f"reduce-scatter of unit {label} ({phase})"
        first: Callable[[bool], object] | None = None
        combine: Callable[[], object] | None = None  # after ``first``, before ``second``
        second: Callable[[bool], object] | None = None  # across the nodes, or the replicas
        settle: Callable[[], object] | None = None  # after ``second``, before ``post``
        route = self.routes.nodes.get(over) if self.routes is not None else None
        if not self.communicates(over):
            chunk = inp
        else:
            self.stats.record("reduce_scatter", phase, inp.numel() * inp.element_size(), over)
            assert scratch is not None, "the reduce-scatter needs its gradient slot's scratch"
            if route is not None and inp.dtype == torch.float32 and self.replicate is None:
                first, combine, second, settle, chunk = route.reduce_scatter(
                    scratch[: inp.numel()], inp
                )
            elif self.by_all_to_all(inp.dtype):  # all-to-all, then this rank sums what it got
                recv = scratch[: inp.numel()]
                first = partial(self._exchange, recv, inp, over)
                if inp.dtype == torch.float32:  # into the first received chunk: inp is read only
                    rows = recv.split(n)
                    chunk = rows[0]
                    combine = partial(_sum_into_first, rows)
                else:  # 16-bit: summed in fp32, rounded once, into the buffer's own chunk
                    chunk = inp[rank * n : (rank + 1) * n]
                    combine = partial(torch.sum, recv.view(world, n), dim=0, out=chunk)
            else:
                chunk = scratch[:n]
                first = lambda a: reduce_scatter_single(chunk, inp, group=group, async_op=a)  # noqa: E731
        if self.replicate is not None:
            self.stats.record(
                "all_reduce", phase, chunk.numel() * chunk.element_size(), "replicate"
            )
            second = lambda a: dist.all_reduce(chunk, group=self.replicate, async_op=a)  # noqa: E731

        def finish() -> None:  # after the one collective
            if combine is not None:
                combine()
            post(chunk)

        with profiled(f"layershard::reduce_scatter[{label}]"):
            if first is None and second is None:
                post(chunk)
                if host_post is not None:
                    return self._copied_locally(host_post)
                return DONE
            if first is None or second is None:  # one collective
                only = first or second
                assert only is not None
                return self._issue(only, finish, phase, host_post, what)
            if self.stream is not None:  # both in order on the comm stream

                def run(async_op: bool) -> None:
                    first(False)
                    if combine is not None:
                        combine()
                    second(False)

                return self._issue(run, lambda: post(chunk), phase, host_post, what)
            # gloo, two stages (the replicas' all-reduce, or by node): see _TwoStage

            def last() -> None:
                if settle is not None:
                    settle()
                post(chunk)

            self.advance()
            p = _TwoStage(
                self._issue(first, combine, phase, what=what),
                lambda: self._issue(second, last, phase, host_post, what),
            )
            self._two_stage.append(p)
            return p

    def advance(self, routed_only: bool = False) -> None:
        """Start the second stage of every two-stage reduction issued so far, in order (with
        ``routed_only``, only if they are routed by node: at a unit's backward, so that the
        last reduction's partial sums go on the link without waiting for the next one)."""
        if routed_only and not (self.routes is not None and self.routes.nodes):
            return
        for p in self._two_stage:
            p.start_second()
        self._two_stage = []

    def finish(self) -> None:
        """Wait for every two-stage reduction (end of backward): the list no longer holds them,
        or the gradient slots their closures read (a slot outlived its backward)."""
        two_stage, self._two_stage = self._two_stage, []
        for p in two_stage:
            p.wait()

    def all_reduce(self, t: torch.Tensor, op, phase: str, what: str = "") -> torch.Tensor:
        """All-reduce ``t`` over the shard group (a quantity every shard holds a part of, such as
        a gradient norm; replicas hold the same parts). Returns the result (``t`` itself unless
        ``t`` had to travel to the comm device)."""
        if self.group is None:
            return t
        self.stats.record("all_reduce", phase, t.numel() * t.element_size())
        moved = t.to(self.device) if self.backend == "nccl" and t.device != self.device else t
        with waiting(what or f"all-reduce ({phase})"):
            dist.all_reduce(moved, op=op, group=self.group)
        return moved.to(t.device) if moved is not t else t

    def broadcast(self, t: torch.Tensor, phase: str) -> None:
        """From the model's first rank to all of its ranks (replicas included)."""
        self.stats.record("broadcast", phase, t.numel() * t.element_size(), "all")
        with waiting(f"broadcast from rank 0 ({phase})"):
            dist.broadcast(t, src=dist.get_global_rank(self.full, 0), group=self.full)
