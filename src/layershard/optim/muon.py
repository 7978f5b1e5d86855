"""Muon on sharded weights: every matrix orthogonalized whole, each by one owner rank.

Muon replaces the (Nesterov) momentum of a 2-D weight by an approximately orthogonal matrix of
the same shape (Newton-Schulz iterations in bf16). That is a function of the whole matrix, while
a sharded model hands the optimizer flat 1-D slices: orthogonalizing a slice is a different,
wrong update. ``Muon`` here gives the update of ``torch.optim.Muon`` on the unsharded model:

    per 2-D weight W (every rank, on its slice; momentum stays sharded like AdamW's moments):
        buf  <- lerp(buf, g, 1 - momentum)                       elementwise
        u    <- lerp(g, buf, momentum)  (nesterov; else buf)     elementwise
    to_owner:   all_to_all_single of bf16(u): each slice goes to W's owner (the only rank that
                ever holds W whole); the owner's own slice does not travel
    owner:      O <- NewtonSchulz(u) on the whole matrix (torch's own function, bf16)
    from_owner: all_to_all_single of O: each rank gets its slice back (bf16)
    every rank: W <- W * (1 - lr * wd) - adjusted_lr * O       on its slice

Why bf16 on the wire and still exact: torch's Newton-Schulz starts with ``G.bfloat16()``, an
elementwise rounding, so rounding each slice before sending gives the owner the same bf16 matrix;
its result is bf16, which ``param.add_`` widens exactly. Two collectives per step in all, each
moving every matrix once (minus the part its owner already holds), in 2 bytes per element.

Tensor parallelism (a model from ``ls.parallelize(tp=...)``): a rank's slice is of its TP part
of the matrix, and the owner's assembled matrix is that part. The owners of a matrix in every TP
coordinate are the same shard rank (the same local shapes give the same assignment), so they form
the matrix's TP group: they all-gather their parts in bf16 (``DTensor.full_tensor``), each
orthogonalizes the whole matrix, as torch's Muon does on the unsharded model, and keeps its part.
The learning-rate adjustment and the work split use the whole matrix's shape.

Owners are chosen once, from the shapes: greedy longest-processing-time over the Newton-Schulz
FLOPs of each matrix, so that every rank orthogonalizes about 1/N of the work. Ownership runs
within the shard group (``hybrid``: each replica group repeats the same computation on the same
inputs; ``no_shard``: a group of one, every rank orthogonalizes everything, as DDP would).

``mode="all_gather"`` is the simple alternative, kept for comparison (``layershard bench
--optimizer muon``): every rank all-gathers every matrix's update and orthogonalizes all of them.
It gives the same result, bit for bit.

Everything else (embeddings, LM head, norms, biases) is stepped by ``torch.optim.AdamW`` itself;
its state lives in this optimizer's ``state``, so checkpoints save and reshard both like AdamW's.
"""

from __future__ import annotations

import heapq
import math
from collections import Counter
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.profiler import record_function

from layershard.engine.dtensor import TPInfo, full_tensor, local_of_full, split_over_tp, tp_of
from layershard.sharded import ShardedModule

_torch_adjust_lr: Callable[[float, str | None, torch.Size], float] | None
_torch_zeropower: (
    Callable[[torch.Tensor, tuple[float, float, float], int, float], torch.Tensor] | None
)
try:  # torch >= 2.9: use torch's own functions so that the arithmetic is the same
    from torch.optim._muon import _adjust_lr as _torch_adjust_lr
    from torch.optim._muon import _zeropower_via_newtonschulz as _torch_zeropower
except ImportError:  # pragma: no cover - older torch (the project supports >= 2.6)
    _torch_adjust_lr = _torch_zeropower = None

DEFAULT_NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)
MODES = ("owner", "all_gather")


def _zeropower_fallback(
    grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int, eps: float
) -> torch.Tensor:
    # A copy of torch 2.13's _zeropower_via_newtonschulz, for torch releases without it.
    a, b, c = ns_coefficients
    x = grad.bfloat16()
    if grad.size(0) > grad.size(1):
        x = x.T
    x.div_(x.norm().clamp(min=eps))
    for _ in range(ns_steps):
        gram = x @ x.T
        gram_update = torch.addmm(gram, gram, gram, beta=b, alpha=c)
        x = torch.addmm(x, gram_update, x, beta=a)
    if grad.size(0) > grad.size(1):
        x = x.T
    return x


def _adjust_lr_fallback(lr: float, adjust_lr_fn: str | None, shape: torch.Size) -> float:
    a, b = shape[:2]
    if adjust_lr_fn is None or adjust_lr_fn == "original":
        return lr * math.sqrt(max(1, a / b))
    if adjust_lr_fn == "match_rms_adamw":
        return lr * 0.2 * math.sqrt(max(a, b))
    return lr


_zeropower = _torch_zeropower or _zeropower_fallback
_adjust_lr = _torch_adjust_lr or _adjust_lr_fallback


def newton_schulz_flops(shape: tuple[int, ...] | torch.Size, ns_steps: int = 5) -> int:
    """FLOPs of ``ns_steps`` quintic Newton-Schulz iterations on a matrix of ``shape``: on the
    wide orientation (m <= n) each costs X X^T (2 m^2 n), b A + c A A (2 m^3) and B X (2 m^2 n)."""
    m, n = sorted((int(shape[0]), int(shape[1])))
    return ns_steps * (4 * m * m * n + 2 * m**3)


def assign_owners(costs: list[float], world_size: int) -> list[int]:
    """An owner rank per matrix: the most expensive first, each to the least loaded rank so far
    (ties: the lower rank). Deterministic from the costs alone, so every rank computes the same
    assignment without communicating; the largest load is at most 4/3 of the best possible."""
    owners = [0] * len(costs)
    loads = [(0.0, r) for r in range(world_size)]
    for i in sorted(range(len(costs)), key=lambda i: (-costs[i], i)):
        load, r = heapq.heappop(loads)
        owners[i] = r
        heapq.heappush(loads, (load + costs[i], r))
    return owners


@dataclass
class _Matrix:
    """One 2-D weight stepped by Muon: this rank's slice ``param`` and where every shard rank's
    slice lies in the flattened matrix (of this rank's TP part, under tensor parallelism)."""

    name: str
    param: nn.Parameter
    shape: torch.Size  # what the shard ranks' slices assemble into: the (TP-local) matrix
    ranges: list[tuple[int, int]]  # per shard rank: [a, b) of the flattened matrix
    owner: int
    tp: TPInfo | None = None  # split over TP: the whole matrix is gathered over its TP group

    @property
    def whole(self) -> torch.Size:
        """The matrix's shape in the unsharded model (lr adjustment, cost)."""
        return self.tp.shape if self.tp is not None else self.shape

    def part(self, rank: int) -> int:
        a, b = self.ranges[rank]
        return b - a


class Muon(torch.optim.Optimizer):
    """Muon for the 2-D weights of a sharded model's blocks, AdamW for the rest, exactly as
    ``torch.optim.Muon`` + ``torch.optim.AdamW`` would step the unsharded model.

    Args:
        model: what ``ls.shard`` returned. Build the optimizer after ``shard()``.
        lr: Muon's learning rate (``torch.optim.Muon``'s meaning and default, as the next six).
        weight_decay: decoupled weight decay of the Muon matrices.
        momentum: the momentum of the update before orthogonalization.
        nesterov: Nesterov momentum.
        ns_coefficients: the Newton-Schulz iteration's coefficients.
        eps: added to the norm that the Newton-Schulz iteration starts from.
        ns_steps: Newton-Schulz iterations.
        adjust_lr_fn: ``None``/``"original"`` scales the lr by sqrt(max(1, rows/cols)),
            ``"match_rms_adamw"`` by 0.2 sqrt(max(rows, cols)), so that AdamW's lr and weight
            decay can be reused.
        adamw: keyword arguments of ``torch.optim.AdamW`` for the other parameters (default:
            AdamW's defaults).
        muon_params: which parameters Muon steps, by name: a collection of names or a predicate
            on the name. Default: every 2-D weight of the repeated blocks (embeddings and the LM
            head stay on AdamW, as usual). Every name chosen must be a 2-D parameter.
        adamw_groups: ``f(named_params) -> param groups`` for the AdamW part (e.g. no weight
            decay for norms), given the ``(name, parameter)`` pairs AdamW steps.
        mode: ``"owner"`` (each matrix orthogonalized once, by its owner) or ``"all_gather"``
            (every rank gathers and orthogonalizes every matrix: the simple alternative, for
            comparison).

    ``param_groups`` holds one Muon group (``algorithm="muon"``) and the AdamW groups
    (``algorithm="adamw"``); a learning-rate scheduler sets both. ``comm_stats()`` reports the
    optimizer's own collectives.
    """

    def __init__(
        self,
        model: ShardedModule,
        lr: float = 1e-3,
        weight_decay: float = 0.1,
        momentum: float = 0.95,
        nesterov: bool = True,
        ns_coefficients: tuple[float, float, float] = DEFAULT_NS_COEFFICIENTS,
        eps: float = 1e-7,
        ns_steps: int = 5,
        adjust_lr_fn: str | None = None,
        *,
        adamw: dict[str, Any] | None = None,
        muon_params: Collection[str] | Callable[[str], bool] | None = None,
        adamw_groups: Callable[[list[tuple[str, nn.Parameter]]], Iterable[dict]] | None = None,
        mode: str = "owner",
    ) -> None:
        if not hasattr(model, "flat_params") or not hasattr(model, "sharding"):
            raise TypeError(
                "ls.optim.Muon(model): pass the model ls.shard() returned (for an unsharded "
                "model use torch.optim.Muon)"
            )
        if isinstance(lr, torch.Tensor) or not 0.0 <= lr:
            raise ValueError(f"Muon: lr must be a float >= 0, got {lr!r}")
        if not 0.0 <= momentum:
            raise ValueError(f"Muon: momentum must be >= 0, got {momentum}")
        if not 0.0 <= weight_decay:
            raise ValueError(f"Muon: weight_decay must be >= 0, got {weight_decay}")
        if adjust_lr_fn not in (None, "original", "match_rms_adamw"):
            raise ValueError(
                f"Muon: adjust_lr_fn {adjust_lr_fn!r}: use None, 'original' or 'match_rms_adamw'"
            )
        if not 0 < ns_steps < 100 or len(ns_coefficients) != 3:
            raise ValueError("Muon: ns_steps must be in [1, 99] and ns_coefficients 3 numbers")
        if mode not in MODES:
            raise ValueError(f"Muon: mode {mode!r}: use one of {', '.join(MODES)}")
        self.mode = mode
        self._model = model
        sharding = model.sharding
        self._group = sharding.shard_group
        self._world, self._rank = sharding.shard_size, sharding.shard_rank
        # NCCL moves device tensors only (CPU offload keeps the shards on the host)
        self._device = model.collective_device

        named: list[tuple[str, nn.Parameter, torch.Size, bool, Any]] = []
        if sharding.ep_size > 1 or sharding.expert_size > 1:
            raise ValueError(
                "Muon: expert parallelism is not supported yet (its experts are sharded over "
                "another group than the shard group); use AdamW, or ep=1"
            )
        for u in model.units:
            for f in u.trainables:
                assert f.world_size == self._world, "a flat parameter outside the shard group"
                for slot, p in zip(f.slots, f.shard_params):
                    named.append((slot.name, p, slot.shape, u.is_block, (f, slot)))
        names = {n for n, *_ in named}
        if muon_params is not None and not callable(muon_params):
            base = sorted(s.name for u in model.units for f in u.flats if f.packed for s in f.slots)
            on_base = [n for n in muon_params if n in set(base)]
            if on_base:
                raise ValueError(
                    f"Muon(muon_params=...): {on_base[:3]} are frozen 4-bit (bitsandbytes, torchao NF4) "
                    "weights: no optimizer steps them; Muon can step the adapters (the default "
                    "takes every trainable 2-D weight of the blocks)"
                )
        if muon_params is None:
            chosen = {n for n, _, shape, is_block, _ in named if is_block and len(shape) == 2}
        elif callable(muon_params):
            chosen = {n for n, *_ in named if muon_params(n)}
        else:
            unknown = sorted(set(muon_params) - names)
            if unknown:
                raise ValueError(
                    f"Muon(muon_params=...): {unknown[:5]} are not trainable parameters of "
                    "this model (names as in model.named_parameters())"
                )
            chosen = set(muon_params)
        not_2d = sorted(n for n, _, shape, *_ in named if n in chosen and len(shape) != 2)
        if not_2d:
            raise ValueError(f"Muon steps 2-D weights only; {not_2d[:5]} are not 2-D")

        muon = [(n, p, shape, fs) for n, p, shape, _, fs in named if n in chosen]
        self._matrices = [
            _Matrix(
                n, p, shape, f.param_ranges(slot), 0, tp_of(slot) if split_over_tp(slot) else None
            )
            for n, p, shape, (f, slot) in muon
        ]
        costs = [float(newton_schulz_flops(m.whole, ns_steps)) for m in self._matrices]
        for m, owner in zip(self._matrices, assign_owners(costs, self._world)):
            m.owner = owner

        rest = [(n, p) for n, p, *_ in named if n not in chosen]
        muon_defaults = {
            "algorithm": "muon",
            "lr": lr,
            "weight_decay": weight_decay,
            "momentum": momentum,
            "nesterov": nesterov,
            "ns_coefficients": tuple(ns_coefficients),
            "eps": eps,
            "ns_steps": ns_steps,
            "adjust_lr_fn": adjust_lr_fn,
        }
        groups: list[dict] = []
        if muon:
            groups.append({"params": [p for _, p, _, _ in muon], **muon_defaults})
        self._adamw: torch.optim.AdamW | None = None
        if rest:
            ag = list(adamw_groups(rest)) if adamw_groups else [{"params": [p for _, p in rest]}]
            ag = [g for g in ag if len(g["params"])]
            # torch's AdamW fills its defaults into these very dicts, and steps them below
            self._adamw = torch.optim.AdamW(ag, **(adamw or {}))
            for g in self._adamw.param_groups:
                g["algorithm"] = "adamw"
            groups += self._adamw.param_groups
        super().__init__(groups, {})
        self.defaults = muon_defaults  # what add_param_group fills in: a Muon group
        self._stats: Counter[tuple[str, str]] = Counter()
        self._planned = True

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        # Owners and slices are planned once, at construction: a group added later would never
        # be stepped, so refuse it instead.
        if getattr(self, "_planned", False):
            raise NotImplementedError(
                "ls.optim.Muon plans its matrices when it is built: pass every parameter then "
                "(muon_params=, adamw_groups=) instead of add_param_group()"
            )
        super().add_param_group(param_group)

    # -- public ----------------------------------------------------------------------------

    def owners(self) -> dict[str, int]:
        """The shard rank that orthogonalizes each Muon matrix, by parameter name."""
        return {m.name: m.owner for m in self._matrices}

    def comm_stats(self, reset: bool = False) -> dict[str, dict[str, int]]:
        """This rank's optimizer collectives since the last reset: ``{"to_owner" | "from_owner"
        | "all_gather" | "over_tp": {"count", "sent", "received"}}``, in bytes of payload to and
        from other ranks (a rank's own part is not counted; ``over_tp``: a TP-split matrix's
        parts gathered over its TP group)."""
        out: dict[str, dict[str, int]] = {}
        for (op, key), v in sorted(self._stats.items()):
            out.setdefault(op, {"count": 0, "sent": 0, "received": 0})[key] = v
        if reset:
            self._stats.clear()
        return out

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self._muon_step()
        adamw = [g for g in self.param_groups if g.get("algorithm") == "adamw"]
        if adamw:
            assert self._adamw is not None
            # load_state_dict() replaces state and groups: step whatever they are now
            self._adamw.param_groups = adamw
            self._adamw.state = self.state
            self._adamw.step()
        return loss

    # -- Muon ------------------------------------------------------------------------------

    def _hyper(self) -> dict[int, dict]:
        return {
            id(p): g
            for g in self.param_groups
            if g.get("algorithm", "muon") == "muon"
            for p in g["params"]
        }

    def _nesterov(self, m: _Matrix, group: dict) -> torch.Tensor:
        """This rank's slice of the matrix Newton-Schulz runs on (fp32), momentum updated."""
        p = m.param
        state = self.state[p]
        if "momentum_buffer" not in state:
            state["momentum_buffer"] = torch.zeros_like(p)
        buf = state["momentum_buffer"]
        grad = p.grad
        assert grad is not None, "only matrices with a gradient are stepped"
        buf.lerp_(grad, 1 - group["momentum"])
        return grad.lerp(buf, group["momentum"]) if group["nesterov"] else buf

    def _orthogonalize(self, m: _Matrix, full: torch.Tensor, group: dict) -> torch.Tensor:
        """The update of matrix ``m`` from ``full`` (its shard ranks' slices assembled), flat:
        under TP the parts of every TP rank gathered, the whole orthogonalized, this rank's part
        kept. Collective over ``m``'s TP group (its owners, in every mode)."""
        if m.tp is not None:
            others = m.whole.numel() - full.numel()  # bf16, the other TP ranks' parts
            self._stats["over_tp", "count"] += 1
            self._stats["over_tp", "sent"] += full.numel() * 2 * (m.tp.mesh.size() - 1)
            self._stats["over_tp", "received"] += others * 2
            with record_function("layershard::muon_over_tp"):
                full = full_tensor(m.tp, full)
        with record_function("layershard::muon_newton_schulz"):
            out = _zeropower(full, group["ns_coefficients"], group["ns_steps"], group["eps"])
        if m.tp is not None:
            out = local_of_full(m.tp, out)
        return out.reshape(-1)

    def _exchange(
        self,
        out: torch.Tensor,
        inp: torch.Tensor,
        out_splits: list[int],
        in_splits: list[int],
        op: str,
    ) -> None:
        me = self._rank
        self._stats[op, "count"] += 1
        self._stats[op, "sent"] += (sum(in_splits) - in_splits[me]) * inp.element_size()
        self._stats[op, "received"] += (sum(out_splits) - out_splits[me]) * out.element_size()
        with record_function(f"layershard::muon_{op}"):
            dist.all_to_all_single(out, inp, out_splits, in_splits, group=self._group)

    def _muon_step(self) -> None:
        hyper = self._hyper()
        active = [m for m in self._matrices if m.param.grad is not None]
        if not active:
            return
        device = self._device or active[0].param.device
        if self.mode == "all_gather":
            updates = self._all_gather_updates(active, hyper, device)
        else:
            updates = self._owner_updates(active, hyper, device)
        for m, upd in zip(active, updates):
            p, g = m.param, hyper[id(m.param)]
            adjusted = _adjust_lr(g["lr"], g["adjust_lr_fn"], m.whole)
            p.mul_(1 - g["lr"] * g["weight_decay"])
            if upd.numel():
                p.add_(upd.to(p.device), alpha=-adjusted)

    def _owner_updates(
        self, active: list[_Matrix], hyper: dict[int, dict], device: torch.device
    ) -> list[torch.Tensor]:
        """Each matrix once to its owner, orthogonalized there, slices back: this rank's slice
        of every matrix's orthogonalized update, in the order of ``active``."""
        world, me = self._world, self._rank
        by_owner = [[m for m in active if m.owner == d] for d in range(world)]
        # send layout: by destination owner, then matrix order; receive layout: by source rank
        send_splits = [sum(m.part(me) for m in by_owner[d]) for d in range(world)]
        recv_splits = [sum(m.part(s) for m in by_owner[me]) for s in range(world)]
        send = torch.empty(sum(send_splits), dtype=torch.bfloat16, device=device)
        where: dict[int, tuple[int, int]] = {}  # id(matrix) -> this rank's part in `send`
        pos = 0
        for d in range(world):
            for m in by_owner[d]:
                n = m.part(me)
                send[pos : pos + n].copy_(self._nesterov(m, hyper[id(m.param)]))
                where[id(m)] = (pos, n)
                pos += n
        if world > 1:
            recv = torch.empty(sum(recv_splits), dtype=torch.bfloat16, device=device)
            self._exchange(recv, send, recv_splits, send_splits, "to_owner")
        else:
            recv = send
        # Orthogonalize the owned matrices; each result goes back where its pieces came from,
        # so `recv` becomes the reply, laid out by destination exactly as it arrived.
        starts = [sum(recv_splits[:s]) for s in range(world)]
        for m in by_owner[me]:
            pieces = []
            for s in range(world):
                n = m.part(s)
                pieces.append((s, starts[s], n))
                starts[s] += n
            full = torch.cat([recv[o : o + n] for _, o, n in pieces]).view(m.shape)
            ortho = self._orthogonalize(m, full, hyper[id(m.param)])
            for s, o, n in pieces:
                a = m.ranges[s][0]
                recv[o : o + n].copy_(ortho[a : a + n])
        if world > 1:
            back = send  # its contents have been sent: reuse it for the reply
            self._exchange(back, recv, send_splits, recv_splits, "from_owner")
        else:
            back = recv
        return [back[where[id(m)][0] : sum(where[id(m)])] for m in active]

    def _all_gather_updates(
        self, active: list[_Matrix], hyper: dict[int, dict], device: torch.device
    ) -> list[torch.Tensor]:
        """The simple alternative: every rank gathers every matrix whole and orthogonalizes
        all of them (equal chunks, padded, through the engine's all-gather)."""
        world, me = self._world, self._rank
        counts = [sum(m.part(r) for m in active) for r in range(world)]
        chunk = max(counts)
        send = torch.zeros(chunk, dtype=torch.bfloat16, device=device)
        pos = 0
        for m in active:
            n = m.part(me)
            send[pos : pos + n].copy_(self._nesterov(m, hyper[id(m.param)]))
            pos += n
        if world > 1:
            full = torch.empty(chunk * world, dtype=torch.bfloat16, device=device)
            self._stats["all_gather", "count"] += 1
            self._stats["all_gather", "sent"] += chunk * 2 * (world - 1)
            self._stats["all_gather", "received"] += chunk * 2 * (world - 1)
            with record_function("layershard::muon_all_gather"):
                self._model.all_gather_into(full, send, "muon")
        else:
            full = send
        starts = [r * chunk for r in range(world)]
        out = []
        for m in active:
            pieces = []
            for r in range(world):
                n = m.part(r)
                pieces.append(full[starts[r] : starts[r] + n])
                starts[r] += n
            ortho = self._orthogonalize(m, torch.cat(pieces).view(m.shape), hyper[id(m.param)])
            a, b = m.ranges[me]
            out.append(ortho[a:b])
        return out
