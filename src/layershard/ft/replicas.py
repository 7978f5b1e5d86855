"""``FaultTolerant``: a sharded model's replica dimension made fault tolerant by torchft.

What layershard does and what torchft does, per step:

    zero_grad()   torchft   Manager.start_quorum(): this step's quorum from the Lighthouse (in a
                            thread under ``use_async_quorum``), the cross-group process group
                            reconfigured when the quorum changed, and a group that is behind
                            receives a healthy peer's state (its checkpoint transport)
    backward      layershard  every unit's gradients reduce-scattered within the group: each rank
                            holds its fp32 gradient slice, averaged over the group's ranks
    step()        layershard  the slices, in buckets, through Manager.allreduce (SUM over the
                            groups of the quorum; a group that is healing adds zeros), then
                            scaled by 1 / participants; optional clipping (model.clip_grad_norm_)
                  torchft   Manager.should_commit(): every rank of the group agrees; False when a
                            collective failed or too few groups took part
                  layershard  the optimizer steps only on commit; the data position advances

Rank r of every group holds the same slices (the same ``shard()`` layout), so the cross-group
all-reduce is per slice, as hybrid's replicate dimension is (engine/strategy.py): torchft's
process group over the groups' rank r is the replicate group, rebuilt at each quorum change.

Numerics: hybrid multiplies the fully summed chunk by 1/(K R) (K ranks a group, R groups); here
the group's reduction multiplies by 1/K and the cross-group sum by 1/R. When K is a power of
two, 1/K is exact and both round the same product: the gradients, and so the losses and
weights, are bitwise hybrid's (tests/ft/test_no_failure.py). Otherwise they differ in the last
bit, as another legitimate order of the sums does. Over three groups or more the sum's order is
gloo's, which follows the buffer: ``bucket_mb=0`` (one all-reduce per flat group, as hybrid's)
keeps it hybrid's; larger buckets move the last bits.

What a healing group receives (``state_dict``): this rank's slice of every flat group, the
optimizer's state, the data position and whatever ``register_state`` added; torchft adds its step
counter. Rank r of the healing group fetches from rank r of a healthy one.
"""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp
from torchft import Manager, ProcessGroupGloo, ProcessGroupNCCL
from torchft.coordination import LighthouseServer

from layershard.sharded import ShardedModule

STATE_KEY = "layershard"  # the key of layershard's state among the Manager's state dict functions


def lighthouse_server(
    min_replicas: int = 1,
    bind: str = "127.0.0.1:0",
    join_timeout_ms: int = 60_000,
    heartbeat_timeout_ms: int = 5_000,
    quorum_tick_ms: int = 100,
) -> LighthouseServer:
    """torchft's Lighthouse in this process (``.address()``, ``.shutdown()``); for a job, run
    ``torchft_lighthouse --min_replicas N`` on a host every group reaches. Defaults are
    torchft's, but ``bind`` (this host only)."""
    return LighthouseServer(
        bind=bind,
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )


@dataclass
class Event:
    """Something the run's report keeps: a quorum that lost or gained groups, a step that did
    not commit (its data is lost), this group's recovery from a peer."""

    kind: str  # "quorum", "not_committed", "recovered"
    step: int  # torchft's step counter when it happened
    participants: int  # groups in the step's quorum
    data_position: int
    seconds: float = 0.0  # "recovered": the time from the quorum's start to the state loaded
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


@dataclass
class FTState:
    """The fault-tolerant loop's own state, besides torchft's step counter."""

    data_position: int = 0  # batches this group has read (each step reads one, committed or not)
    committed: int = 0  # steps this group committed
    not_committed: int = 0  # steps it attempted and threw away
    participants: int = 0  # groups in the last quorum
    events: list[Event] = field(default_factory=list)


class FaultTolerant:
    """Make ``model`` (``ls.shard`` over this replica group's ranks) and ``optimizer`` fault
    tolerant across replica groups with torchft.

    Every rank of every group builds one, collectively within its group, after
    ``ls.init_distributed`` (its ``MASTER_ADDR``/``MASTER_PORT`` store is the one torchft's
    Manager uses). ``replica_id`` names the group (trailing digits: its index); ``lighthouse``
    (default: ``TORCHFT_LIGHTHOUSE``) the Lighthouse address. ``init_sync=True`` (torchft's
    default) heals every group from one at step 0; pass False when every group built the same
    weights (the same seed). ``timeout``/``quorum_timeout``/``connect_timeout`` are torchft's
    (seconds). ``bucket_mb``: the gradient slices are all-reduced in buckets of about this size
    (a flat group larger than that is all-reduced in place, without a copy). ``process_group``:
    torchft's cross-group process group (default ``ProcessGroupGloo`` on CPU,
    ``ProcessGroupNCCL`` where the slices are on CUDA). ``quorum_retries``: how often the
    group's manager asks the Lighthouse again when asking fails (torchft's default, 0, ends
    every rank when the Lighthouse restarts; with retries the job waits for it, up to
    ``quorum_timeout``: tests/ft/test_failures.py). Other keyword arguments go to
    ``torchft.Manager``.
    """

    def __init__(
        self,
        model: ShardedModule,
        optimizer: torch.optim.Optimizer,
        *,
        replica_id: str | None = None,
        lighthouse: str | None = None,
        min_replicas: int = 1,
        init_sync: bool = True,
        use_async_quorum: bool = True,
        timeout: float = 60.0,
        quorum_timeout: float = 60.0,
        connect_timeout: float = 60.0,
        hostname: str | None = None,
        bucket_mb: float = 25.0,
        process_group: Any = None,
        quorum_retries: int = 20,
        **manager_kwargs: Any,
    ) -> None:
        if not isinstance(model, ShardedModule):
            raise TypeError("FaultTolerant(model): the model ls.shard() returned")
        self.model, self.optimizer = model, optimizer
        self.state = FTState()
        self._extra: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._flats = [f for f in model.flat_params if f.requires_grad]
        device = self._flats[0].shard.device if self._flats else torch.device("cpu")
        if process_group is None:
            pg_timeout = timedelta(seconds=timeout)
            if device.type == "cuda":
                process_group = ProcessGroupNCCL(timeout=pg_timeout)
            else:
                process_group = ProcessGroupGloo(timeout=pg_timeout)
        self.buckets = _buckets([f.shard_numel for f in self._flats], bucket_mb)
        self._bucket_bufs: dict[int, torch.Tensor] = {}
        self._reduced = False  # this step's gradients are averaged across the groups
        self._quorum_t0 = 0.0
        # the last step's waits, in seconds: quorum_wait_s (for this step's quorum, at the
        # first all-reduce), issue_s, all_reduce_s (the cross-group all-reduce), should_commit_s
        self.timings: dict[str, float] = {}
        group = model.process_group
        self.manager = Manager(
            pg=process_group,
            load_state_dict=None,
            state_dict=None,
            min_replica_size=min_replicas,
            use_async_quorum=use_async_quorum,
            init_sync=init_sync,
            timeout=timedelta(seconds=timeout),
            quorum_timeout=timedelta(seconds=quorum_timeout),
            connect_timeout=timedelta(seconds=connect_timeout),
            rank=dist.get_rank(group),
            world_size=dist.get_world_size(group),
            replica_id=replica_id,
            lighthouse_addr=lighthouse,
            hostname=hostname or socket.gethostname(),
            quorum_retries=quorum_retries,
            **manager_kwargs,
        )
        self.manager.register_state_dict_fn(STATE_KEY, self.load_state_dict, self.state_dict)

    # -- the loop --

    @property
    def step_count(self) -> int:
        """Steps committed by the whole job (torchft's counter; a healed group takes its peer's)."""
        return self.manager.current_step()

    @property
    def data_position(self) -> int:
        """The batch this group reads this step (the same on every group: each reads its own
        part of it); a healed group takes its peer's."""
        return self.state.data_position

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Start this step: torchft's quorum (and, under a synchronous quorum, a recovery), then
        the optimizer's ``zero_grad``."""
        self._quorum_t0 = time.perf_counter()
        self._reduced = False
        self.manager.start_quorum()
        self.optimizer.zero_grad(set_to_none=set_to_none)

    def all_reduce_gradients(self) -> None:
        """Average this rank's gradient slices over the groups of the quorum (after backward;
        ``step`` calls it). A rank whose backward left a slice without a gradient sends zeros
        for it, as the group's own reduction does."""
        if self._reduced:
            return
        self._reduced = True
        t0 = time.perf_counter()
        n = self.manager.num_participants()  # waits for this step's quorum
        t1 = time.perf_counter()
        if n != self.state.participants and self.state.participants:
            self._record("quorum", n, f"{self.state.participants} -> {n} groups")
        self.state.participants = n
        works, filled = [], []
        for b, (lo, hi) in enumerate(self.buckets):
            flats = self._flats[lo:hi]
            grads = [_attached_grad(f) for f in flats]
            if len(grads) == 1:  # one flat group: its gradient slice itself
                buf = grads[0]
            else:
                buf = self._bucket(b, sum(g.numel() for g in grads), grads[0])
                torch._foreach_copy_(list(buf.split([g.numel() for g in grads])), grads)
            works.append(self.manager.allreduce(buf, reduce_op=ReduceOp.SUM))
            filled.append((buf, grads))
        t2 = time.perf_counter()
        for w in works:
            w.wait()  # an error is the Manager's: should_commit() says False
        self.timings.update(
            quorum_wait_s=t1 - t0, issue_s=t2 - t1, all_reduce_s=time.perf_counter() - t2
        )
        scale = 1.0 / max(n, 1)
        for buf, grads in filled:
            if len(grads) == 1:
                buf.mul_(scale)
            else:
                for g, part in zip(grads, buf.split([g.numel() for g in grads])):
                    torch.mul(part, scale, out=g)

    def step(self, max_norm: float | None = None) -> bool:
        """After backward: average the gradients across groups, clip them to ``max_norm`` (the
        global norm, as ``model.clip_grad_norm_``), and step the optimizer if torchft commits
        the step. Returns whether it committed; the data position advances either way (a step
        that did not commit loses its batch, and the report records it)."""
        self.all_reduce_gradients()
        if max_norm is not None:  # on every rank of the group (a collective), errored or not
            self.model.clip_grad_norm_(max_norm)
        t0 = time.perf_counter()
        committed = self.manager.should_commit()  # applies a pending recovery first
        self.timings["should_commit_s"] = time.perf_counter() - t0
        if committed:
            self.optimizer.step()
            self.state.committed += 1
        else:
            self.state.not_committed += 1
            error = self.manager.errored()
            self._record("not_committed", self.state.participants, str(error or "")[:500])
        self.state.data_position += 1
        return committed

    # -- recovery --

    def register_state(
        self, key: str, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None]
    ) -> None:
        """Send more state to a recovering group (a learning-rate scheduler, a sampler): it is
        read on a healthy peer and loaded on the recovering group with layershard's."""
        self._extra[key] = (state_dict, load_state_dict)

    def state_dict(self) -> dict[str, Any]:
        """What a recovering group receives from this rank (tensors are the live ones: torchft
        serves them until the step's ``should_commit``, before anything writes them)."""
        return {
            "slices": [f.shard for f in self.model.flat_params],
            "optimizer": self.optimizer.state_dict(),
            "data_position": self.state.data_position,
            "extra": {k: fns[0]() for k, fns in self._extra.items()},
        }

    @torch.no_grad()
    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Load a peer's ``state_dict`` (torchft calls it while healing)."""
        flats = self.model.flat_params
        slices = sd["slices"]
        if len(slices) != len(flats) or any(
            s.shape != f.shard.shape or s.dtype != f.shard.dtype for s, f in zip(slices, flats)
        ):
            raise ValueError(
                "ls.ft: the peer's slices do not match this rank's (every group must shard the "
                "same model over the same number of ranks)"
            )
        self.model.quiesce()  # rule 9: nothing in flight reads the shards we write
        for f, s in zip(flats, slices):
            f.shard.copy_(s)
        self.optimizer.load_state_dict(sd["optimizer"])
        self.state.data_position = int(sd["data_position"])
        for key, value in sd.get("extra", {}).items():
            if key in self._extra:
                self._extra[key][1](value)
        self._record(
            "recovered",
            self.state.participants,
            "from a peer",
            time.perf_counter() - self._quorum_t0,
        )

    def report(self) -> dict[str, Any]:
        """Counts and events for a run's report and metrics."""
        s = self.state
        return {
            "step": self.step_count,
            "data_position": s.data_position,
            "committed": s.committed,
            "not_committed": s.not_committed,
            "batches_committed": self.manager.batches_committed(),
            "events": [e.as_dict() for e in s.events],
        }

    def shutdown(self, wait: bool = True) -> None:
        """Stop torchft's servers of this rank (its checkpoint server, the group's manager)."""
        self.manager.shutdown(wait=wait)

    # -- internals --

    def _record(self, kind: str, participants: int, detail: str = "", seconds: float = 0.0):
        self.state.events.append(
            Event(kind, self.manager.current_step(), participants, self.state.data_position,
                  seconds, detail)
        )  # fmt: skip

    def _bucket(self, b: int, numel: int, like: torch.Tensor) -> torch.Tensor:
        buf = self._bucket_bufs.get(b)
        if buf is None:
            buf = self._bucket_bufs[b] = torch.empty(numel, dtype=like.dtype, device=like.device)
        return buf


def _buckets(numels: list[int], bucket_mb: float) -> list[tuple[int, int]]:
    """Consecutive runs ``[lo, hi)`` of flat groups of at most ``bucket_mb`` MB of fp32 each (a
    group larger than that is a bucket of its own)."""
    cap = max(1, math.floor(bucket_mb * 2**20 / 4))
    out: list[tuple[int, int]] = []
    lo, size = 0, 0
    for i, n in enumerate(numels):
        if i > lo and size + n > cap:
            out.append((lo, i))
            lo, size = i, 0
        size += n
    if lo < len(numels):
        out.append((lo, len(numels)))
    return out


def _attached_grad(f) -> torch.Tensor:
    """``f``'s fp32 gradient slice, attached to its parameters: zeros where this rank's
    backward gave it none (after ``zero_grad(set_to_none=True)``)."""
    if all(p.grad is not None for p in f.shard_params):
        return f.grad
    fresh = all(p.grad is None for p in f.shard_params)
    f.ensure_grad()
    if fresh:
        f.grad.zero_()
    for i, p in enumerate(f.shard_params):
        if p.grad is None:
            g = f.grad_view(i)
            g.zero_()
            p.grad = g
    return f.grad
