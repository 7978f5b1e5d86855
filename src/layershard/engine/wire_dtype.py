"""The wire format of a quantized all-gather (``MixedPrecision(gather_dtype=...)``).

Each rank quantizes its fp32 slice into one byte per element at every gather (as the exact path
casts it at every gather: a write to the shard by any means is seen by the next gather), the
ranks all-gather those bytes, and each rank dequantizes the result into the compute-dtype gather
slot. Masters, gradients and optimizer state never see the wire dtype; only the weights a unit's
forward and its backward re-gather compute with do.

Two formats:

- ``torch.float8_e4m3fn``, one scale per parameter (tensorwise, as torchao's float8 FSDP2 path).
  The scale is ``2**ceil(log2(amax / 448))``: a power of two, so dividing by it and multiplying
  back are exact and the only error is e4m3's rounding (3 mantissa bits): per element at most
  ``2**-4`` of the value for a normal e4m3 number, and ``2**-10 * scale`` below e4m3's smallest
  normal (``2**-6 * scale``). The amax of every parameter, over every rank's part, comes from one
  all-reduce (MAX) for all units at the start of each forward (``Scales.refresh``), like torchao's
  precomputed dynamic scale after the optimizer step. Every rank holds every scale, so only the
  bytes travel.
- ``torch.int8``, one fp32 scale ``amax / 127`` per block of ``BLOCK`` elements of each rank's
  slice (ZeRO++ qwZ). Error per element at most half a step, ``amax_block / 254``. The block
  scales travel behind the bytes in the same chunk (``BLOCK = 256``: 1/64 more bytes).

A rank's chunk of the gathered bytes, ``shard_numel`` int8/fp8 values, then for int8 its
``ceil(shard_numel / BLOCK)`` scales::

    | rank 0: q ......... | s0 s1 .. | rank 1: q ......... | s0 s1 .. | ...
"""

from __future__ import annotations

import os

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
INT8_MAX = 127.0
BLOCK = 256  # elements per int8 scale (ZeRO++ uses 256 to 2048; smaller blocks: smaller error)
GATHER_DTYPES = (FP8, torch.int8)


def blocks(shard_numel: int) -> int:
    return -(-shard_numel // BLOCK)


def chunk_bytes(dtype: torch.dtype, shard_numel: int) -> int:
    """Bytes one rank contributes to a gather of a flat parameter with ``shard_numel`` per rank."""
    if dtype == torch.int8:
        return shard_numel + 4 * blocks(shard_numel)
    return shard_numel


def fp8_scale(amax: torch.Tensor) -> torch.Tensor:
    """Per-parameter power-of-two scales from their amax (1 where a parameter is all zero or not
    finite: a NaN weight then stays NaN on the wire, an infinite one saturates at 448, and the
    fp32 masters, which the trainer checks, keep it as it is)."""
    ok = torch.isfinite(amax) & (amax > 0)
    exp = torch.ceil(torch.log2(torch.where(ok, amax, 1.0) / FP8_MAX))
    return torch.where(ok, torch.exp2(exp), 1.0)


def quantize_fp8(x: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out`` (uint8, ``x.numel()`` bytes) <- the e4m3 bytes of ``x / scale`` (saturating)."""
    y = x.float() / scale
    out.view(FP8).copy_(y.clamp_(-FP8_MAX, FP8_MAX))


_E4M3: dict[torch.device, torch.Tensor] = {}  # every e4m3 byte's value (NaN codes: NaN)


def dequantize_fp8(q: torch.Tensor, scale: float, out: torch.Tensor) -> None:
    """``out`` (compute dtype) <- the e4m3 values of ``q`` (uint8) times ``scale``: exact in
    fp32; in bf16 the one rounding is the product's (e4m3's 4 significant bits fit bf16's 8).
    A lookup in the 256 values times the scale: on CPU, torch's fp8 -> fp32 cast is not
    vectorized (8 ns per element here; the lookup ~3.7 ns)."""
    table = _E4M3.get(q.device)
    if table is None:
        table = torch.arange(256, dtype=torch.uint8, device=q.device).view(FP8).float()
        _E4M3[q.device] = table
    values = (table * scale).to(out.dtype)
    torch.index_select(values, 0, q.to(torch.int32), out=out)


def quantize_int8(x: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (uint8, ``chunk_bytes(int8, x.numel())``) <- ``x`` as int8 in blocks of ``BLOCK``
    with one fp32 scale each, the scales after the values."""
    n = x.numel()
    nb = blocks(n)
    q, s = out[:n].view(torch.int8), out[n:].view(torch.float32)
    padded = torch.zeros(nb * BLOCK, dtype=torch.float32, device=x.device)
    padded[:n] = x
    rows = padded.view(nb, BLOCK)
    amax = rows.abs().amax(dim=1)
    scale = torch.where(amax > 0, amax / INT8_MAX, 1.0)
    s.copy_(scale)
    rows.div_(scale[:, None]).round_().clamp_(-INT8_MAX, INT8_MAX)
    q.copy_(padded[:n])


def dequantize_int8(chunk: torch.Tensor, n: int, out: torch.Tensor) -> None:
    """``out`` (``n`` elements, compute dtype) <- one rank's chunk written by ``quantize_int8``."""
    nb = blocks(n)
    q, s = chunk[:n].view(torch.int8), chunk[n : n + 4 * nb].view(torch.float32)
    full = torch.zeros(nb * BLOCK, dtype=torch.float32, device=q.device)
    full[:n] = q
    full.view(nb, BLOCK).mul_(s[:, None])
    out.copy_(full[:n])


class Scales:
    """The fp8 scales of one flat parameter's slots (one per parameter), the same on every rank:
    ``refresh`` takes the amax of each parameter's part in this rank's slice; the caller
    all-reduces them (MAX) for all flat parameters at once, then ``set``."""

    def __init__(self, flat) -> None:
        self.flat = flat
        self.set([1.0] * len(flat.slots))

    def local_amax(self) -> torch.Tensor:
        """Each parameter's amax over this rank's part of it (0 where it has none), on the
        shard's device: one tensor, no host synchronization per parameter."""
        f = self.flat
        zero = torch.zeros((), dtype=torch.float32, device=f.shard.device)
        parts = []
        for slot in f.slots:
            lo, hi = f.local_range(slot)
            part = f.shard[lo - f.shard_start : hi - f.shard_start]
            parts.append(part.abs().max().float() if hi > lo else zero)
        return torch.stack(parts)

    def set(self, scales: list[float], amax: torch.Tensor | None = None) -> None:
        self._floats = scales  # read per parameter at every gather
        if amax is not None:  # a Float8Linear's weight takes torchao's scale (float8.py)
            for slot, a in zip(self.flat.slots, amax):
                slot.kind.set_fp8_scale(a)

    def quantize(self, src: torch.Tensor, out: torch.Tensor) -> None:
        """This rank's slice ``src`` into ``out`` (uint8), each parameter's part by its scale
        (the gaps and the padding are zero)."""
        f = self.flat
        out.zero_()
        for slot, scale in zip(f.slots, self._floats):
            lo, hi = f.local_range(slot)
            if hi > lo:
                a, b = lo - f.shard_start, hi - f.shard_start
                slot.kind.quantize_fp8(src[a:b], scale, out[a:b])  # ParamKind: ours or torchao's

    def dequantize(self, q: torch.Tensor, out: torch.Tensor) -> None:
        """The gathered bytes ``q`` (``padded_numel``) into ``out`` (compute dtype)."""
        f = self.flat
        out.zero_()
        for slot, scale in zip(f.slots, self._floats):
            a, b = slot.offset, slot.offset + slot.numel
            slot.kind.dequantize_fp8(q[a:b], scale, out[a:b])  # a Float8Linear's: bytes kept


class WireGather:
    """A sharded model's quantized gathers: the format, the fp8 scales of every flat parameter,
    and the pack/unpack of one flat parameter's gather (collectives.py moves the bytes)."""

    def __init__(self, dtype: torch.dtype, flats: list) -> None:
        self.dtype = dtype
        self.scales = {id(f): Scales(f) for f in flats} if dtype == FP8 else {}
        # For tests only (LAYERSHARD_FP8_STALE_SCALES=1): keep the first forward's scales, a
        # stale amax, the failure the curve test must catch (benchmarks/wire-dtypes/).
        self.stale = os.environ.get("LAYERSHARD_FP8_STALE_SCALES") == "1"
        self._refreshed = False

    def refresh(self, comm) -> None:
        """Every parameter's fp8 scale from its amax over every rank (one all-reduce, MAX, for
        the whole model). At the start of each forward: after the optimizer step, or any other
        write to the shards."""
        if not self.scales or (self.stale and self._refreshed):
            return
        scales = list(self.scales.values())
        amax = torch.cat([s.local_amax() for s in scales])
        amax = comm.all_reduce(amax, torch.distributed.ReduceOp.MAX, "forward", "fp8 scales")
        values = fp8_scale(amax).tolist()  # one synchronization for the whole model
        start = 0
        for s in scales:
            n = len(s.flat.slots)
            s.set(values[start : start + n], amax[start : start + n])
            start += n
        self._refreshed = True

    def gather(self, comm, f, out: torch.Tensor, phase: str, label: str):
        """All-gather flat parameter ``f`` quantized, dequantized into ``out`` (a ``Pending``)."""
        n, world = f.shard_numel, f.world_size
        chunk = chunk_bytes(self.dtype, n)
        if self.dtype == FP8:
            scales = self.scales[id(f)]
            src = f.shard

            def pack(own: torch.Tensor) -> None:
                scales.quantize(src.to(own.device, non_blocking=True), own)

            def unpack(wire: torch.Tensor) -> None:
                scales.dequantize(wire, out)

        else:

            def pack(own: torch.Tensor) -> None:
                quantize_int8(f.shard.to(own.device, non_blocking=True), own)

            def unpack(wire: torch.Tensor) -> None:
                for r in range(world):
                    dequantize_int8(wire[r * chunk : (r + 1) * chunk], n, out[r * n : (r + 1) * n])

        return comm.all_gather_packed(out, chunk, pack, unpack, phase, label, f.over)
