"""Weights over the all-gather in fp8 (e4m3, a scale per parameter) or int8 (a scale per 256
elements), and gradients reduced in bf16 with fp32 sums (issue 34; engine/wire_dtype.py).

Bounds (engine/wire_dtype.py): e4m3 with a power-of-two scale per parameter rounds each element to 3
mantissa bits, |error| <= 2**-4 |x| for a normal number and <= 2**-10 * scale below e4m3's smallest
normal; int8 blocks round to half a step, |error| <= amax_block / 254 (the issue's bound,
amax / 127, with a factor 2 to spare), plus fp32's rounding of the scale and of the product
(a few ulp, covered by the 1e-6 relative margin). They are checked on the gathered weights as a
unit's forward sees them, in fp32 compute (the dequantized values themselves; bf16 compute rounds
them once more, as it rounds exact weights)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks
from _parity import (
    batches,
    clone,
    grad_bound,
    grads_in_orders,
    lm_loss,
    local,
    shard_grad_error,
    tiny_llama,
)

import layershard as ls
from layershard.engine.wire_dtype import (
    BLOCK,
    FP8,
    chunk_bytes,
    dequantize_fp8,
    dequantize_int8,
    fp8_scale,
    quantize_fp8,
    quantize_int8,
)
from layershard.plan import collectives_per_step, predict_memory

FP32, BF16 = torch.float32, torch.bfloat16
MARGIN = 1 + 1e-6  # fp32 rounding of the int8 scale and of q * scale (a few ulp)


def realistic(model: torch.nn.Module, seed: int = 3) -> torch.nn.Module:
    """Weights shaped like trained ones rather than like an init: heavy tails (Student-t, 3
    degrees of freedom), a few outlier input features 20x larger in every matrix (as LLMs grow),
    norm gains spread around 1. No trained checkpoint lives on this machine."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() >= 2:
                t = torch.distributions.StudentT(3.0).sample(p.shape) * 0.02
                cols = torch.randint(0, p.shape[1], (max(1, p.shape[1] // 32),), generator=g)
                t[:, cols] *= 20
                p.copy_(t)
            else:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=g))
    return model


def fp8_bound(x: torch.Tensor) -> torch.Tensor:
    scale = fp8_scale(x.abs().max().reshape(1)).item()
    return torch.maximum(x.abs() * 2.0**-4, torch.full_like(x, 2.0**-10 * scale))


def int8_bound(x: torch.Tensor) -> torch.Tensor:
    """Per element of a flat slice, amax of its block of BLOCK (from the slice's start) / 254."""
    n = x.numel()
    rows = torch.zeros(-(-n // BLOCK) * BLOCK)
    rows[:n] = x
    amax = rows.view(-1, BLOCK).abs().amax(dim=1)
    return (amax / 254).repeat_interleave(BLOCK)[:n] * MARGIN


# ---- one process: the formats ------------------------------------------------------------------


def test_quantization_error_within_the_format_bound() -> None:
    """Every tensor of a realistic model, round-tripped through each format, within its bound;
    and the bound is not slack by orders of magnitude (the worst element uses > 1/4 of it)."""
    model = realistic(tiny_llama(dim=256, ffn_dim=512, vocab_size=1024))
    for name, p in model.named_parameters():
        x = p.detach().reshape(-1)
        scale = fp8_scale(x.abs().max().reshape(1)).item()
        q = torch.empty(x.numel(), dtype=torch.uint8)
        quantize_fp8(x, scale, q)
        y = torch.empty_like(x)
        dequantize_fp8(q, scale, y)
        err, bound = (y - x).abs(), fp8_bound(x)
        assert (err <= bound).all(), f"fp8 {name}: {(err / bound).max():.3f} x the bound"
        assert (err / bound).max() > 0.25, f"fp8 {name}: the bound is slack"

        packed = torch.empty(chunk_bytes(torch.int8, x.numel()), dtype=torch.uint8)
        quantize_int8(x, packed)
        z = torch.empty_like(x)
        dequantize_int8(packed, x.numel(), z)
        err, bound = (z - x).abs(), int8_bound(x)
        assert (err <= bound).all(), f"int8 {name}: {(err / bound).max():.3f} x the bound"
        assert (err / bound).max() > 0.25, f"int8 {name}: the bound is slack"


def test_scales_and_edge_values() -> None:
    # power-of-two fp8 scales put the amax in (224, 448]; zero or non-finite amax: scale 1
    amax = torch.tensor([448.0, 449.0, 1e-3, 0.0, float("inf")])
    assert fp8_scale(amax).tolist() == [1.0, 2.0, 2.0**-18, 1.0, 1.0]
    # saturating: nothing beyond e4m3's range becomes NaN; zeros stay zeros
    q = torch.empty(3, dtype=torch.uint8)
    quantize_fp8(torch.tensor([1e6, -1e6, 0.0]), 1.0, q)
    y = torch.empty(3)
    dequantize_fp8(q, 1.0, y)
    assert y.tolist() == [448.0, -448.0, 0.0]
    packed = torch.empty(chunk_bytes(torch.int8, 300), dtype=torch.uint8)
    quantize_int8(torch.zeros(300), packed)  # an all-zero block: scale 1, no division by 0
    z = torch.full((300,), 7.0)
    dequantize_int8(packed, 300, z)
    assert (z == 0).all()


def test_mixed_precision_refuses_other_gather_dtypes() -> None:
    with pytest.raises(ValueError, match="gather_dtype"):
        ls.MixedPrecision(gather_dtype=torch.float16)
    assert ls.MixedPrecision().gather_dtype is None  # the default stays exact


def test_hf_plugin_carries_the_gather_dtype() -> None:
    """``ls.hf.ShardingPlugin(mixed_precision=ls.MixedPrecision(bf16, gather_dtype=...))`` with
    TrainingArguments' bf16=True (accelerate's mixed_precision) keeps the wire dtype."""
    from layershard.hf.plugin import ShardingPlugin

    mp = ls.MixedPrecision(BF16, gather_dtype=FP8)
    for amp in ("bf16", "no"):
        plugin = ShardingPlugin(mixed_precision=mp).with_amp("bf16" if amp == "bf16" else None)
        assert plugin.shard_kwargs()["mixed_precision"].gather_dtype == FP8


# ---- two ranks: the engine ---------------------------------------------------------------------

checks = RankChecks(world_size=2)


def capture(model) -> dict[str, torch.Tensor]:
    """The weights each unit's forward computes with (what its gather produced), by name."""
    seen: dict[str, torch.Tensor] = {}
    for u in model.units:

        def hook(module, args, u=u) -> None:
            for slot in u.param_slots:
                use = slot.uses[0]
                seen[slot.name] = use.module.__dict__[use.attr].detach().clone()

        u.module.register_forward_pre_hook(hook)
    return seen


def capture_flats(model) -> dict[int, torch.Tensor]:
    """Each trainable flat parameter's gathered buffer as its unit's forward sees it."""
    seen: dict[int, torch.Tensor] = {}
    for u in model.units:

        def hook(module, args, u=u) -> None:
            for f, off in zip(u.flats, u.flat_offsets):
                seen[id(f)] = u.slot.data[off : off + f.padded_numel].float().clone()

        u.module.register_forward_pre_hook(hook)
    return seen


def _wire(gd: torch.dtype, pd: torch.dtype = FP32, rd: torch.dtype = FP32) -> ls.MixedPrecision:
    return ls.MixedPrecision(param_dtype=pd, reduce_dtype=rd, gather_dtype=gd)


@checks.check
def gathered_weights_within_the_bound(rank: int, world: int) -> None:
    """The engine's gathers, per flat parameter and rank slice, within the format's bound of the
    fp32 masters (int8 blocks start at each rank's slice)."""
    base = realistic(tiny_llama())
    batch = local(batches(1)[0], rank, world)
    for gd in (FP8, torch.int8):
        model = ls.shard(clone(base), mixed_precision=_wire(gd))
        seen = capture_flats(model)
        model(batch)
        for u in model.units:
            for f in u.flats:
                master, got = model.gather_flat(f), seen[id(f)]
                if gd == FP8:
                    bound = torch.zeros_like(master)
                    for slot in f.slots:
                        a, b = slot.offset, slot.offset + slot.numel
                        bound[a:b] = fp8_bound(master[a:b])
                else:
                    bound = torch.cat([int8_bound(c) for c in master.split(f.shard_numel)])
                err = (got - master).abs()
                assert (err <= bound).all(), f"{gd} {u.name}: {(err / bound).max():.3f} x bound"
                assert (got != master).any(), f"{gd} {u.name}: gathered exactly (not quantized?)"


def _first_grads_match(rank: int, world: int, configs: list, micro: int = 1) -> None:
    """The first step's gradients equal, within the parity bound, those of a single process
    whose weights are the dequantized ones the forward gathered: the backward's re-gather
    dequantizes to the same weights. (Had backward used the exact weights, the error would be
    ~0.25; the bound is ~1e-6.) ``micro`` micro-batches per rank, all but the last under
    ``no_sync``."""
    base = realistic(tiny_llama(), seed=5)
    data = batches(micro)
    for gd in (FP8, torch.int8):
        for label, kw in configs:
            model = ls.shard(clone(base), mixed_precision=_wire(gd), **kw)
            seen = capture(model)
            for k, batch in enumerate(data):
                if k < micro - 1:
                    with model.no_sync():
                        lm_loss(model, local(batch, rank, world)).backward()
                else:
                    lm_loss(model, local(batch, rank, world)).backward()
            dequantized = clone(base)
            with torch.no_grad():
                for name, p in dequantized.named_parameters():
                    p.copy_(seen[name])
            # micro batches of equal size: their summed gradient is micro x the mean's
            ref, orders = grads_in_orders(dequantized, torch.cat(data), world * micro)
            ref = {k: micro * v for k, v in ref.items()}
            orders = [{k: micro * v for k, v in o.items()} for o in orders]
            err, bound = shard_grad_error(model, ref), grad_bound(ref, orders)
            assert err <= bound, f"{gd} {label}: gradient {err:.2e} > bound {bound:.2e}"


@checks.check
def backward_uses_the_forwards_weights(rank: int, world: int) -> None:
    _first_grads_match(
        rank,
        world,
        [
            ("full", {}),
            ("grad_op", {"strategy": "grad_op"}),
            ("offload", {"offload": ls.CPUOffload()}),
            ("checkpointing", {"activation_checkpointing": 3}),
        ],
    )


@checks.check
def no_sync_accumulates_from_the_forwards_weights(rank: int, world: int) -> None:
    _first_grads_match(rank, world, [("no_sync", {})], micro=2)


def representable(model: torch.nn.Module, gd: torch.dtype) -> None:
    """Weights the format carries exactly: e4m3 values times 2**-12 with the amax 448 * 2**-12
    in every parameter (its scale is then 2**-12); integers k * 2**-10, |k| <= 127, with
    +-127 * 2**-10 at every 8th element, where every int8 block of a rank's slice starts
    (slices and parameters start on multiples of 8, engine/flat.py)."""
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for p in model.parameters():
            x = p.reshape(-1)
            if gd == FP8:
                v = (torch.randn(x.shape, generator=g) * 40).clamp(-448, 448)
                x.copy_(v.to(FP8).float() * 2.0**-12)
                x[::8] = 448 * 2.0**-12
            else:
                k = torch.randint(-127, 128, x.shape, generator=g).float()
                k[::8] = 127
                x.copy_(k * 2.0**-10)


@checks.check
def representable_weights_gather_exactly(rank: int, world: int) -> None:
    """A unit whose weights the format represents gathers them bit for bit (fp32 compute:
    equal to the masters; bf16 compute: the same logits as the exact bf16 gather)."""
    batch = local(batches(1)[0], rank, world)
    for gd in (FP8, torch.int8):
        base = tiny_llama()
        representable(base, gd)
        model = ls.shard(clone(base), mixed_precision=_wire(gd))
        seen = capture(model)
        model(batch)
        for name, p in base.named_parameters():
            assert torch.equal(seen[name], p.detach()), f"{gd}: {name} not gathered exactly"
        exact = ls.shard(clone(base), mixed_precision=ls.MixedPrecision(BF16))
        quant = ls.shard(clone(base), mixed_precision=_wire(gd, BF16))
        with torch.no_grad():
            assert torch.equal(quant(batch).logits, exact(batch).logits), gd


@checks.check
def four_bit_bytes_travel_as_they_are(rank: int, world: int) -> None:
    """A QLoRA base under a wire dtype: its packed 4-bit bytes are gathered as they are (a
    quantized gather would read them as floats and hand Linear4bit other codes)."""
    from _qlora import packed_weights, qlora_model
    from bitsandbytes.nn import Linear4bit

    base = qlora_model()
    originals = {n: p.data.clone() for n, p in packed_weights(base).items()}
    model = ls.shard(clone(base), mixed_precision=_wire(FP8))
    seen: dict[str, torch.Tensor] = {}
    for name, m in model.module.named_modules():
        if isinstance(m, Linear4bit):  # bitsandbytes' (PEFT's LoRA layer has the same name)
            m.register_forward_pre_hook(
                lambda mod, a, k=f"{name}.weight": seen.__setitem__(k, mod.weight.detach().clone())
            )
    x = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(rank))
    model(input_ids=x)
    assert seen.keys() == originals.keys(), sorted(set(seen) ^ set(originals))[:4]
    for k, v in originals.items():
        assert torch.equal(seen[k].view(torch.uint8), v.view(torch.uint8)), k


@checks.check
def masters_after_a_step_equal_an_fp32_wire_step(rank: int, world: int) -> None:
    """Given the same gradients, a step leaves the masters (and AdamW's state) of a quantized
    model bit for bit where an exact one's land: the wire dtype touches only the gathered
    copies. Its full state dict (what checkpoints hold) is fp32 and equal too."""
    base = realistic(tiny_llama(), seed=11)
    batch = local(batches(1)[0], rank, world)
    for gd in (FP8, torch.int8):
        quant = ls.shard(clone(base), mixed_precision=_wire(gd, BF16))
        exact = ls.shard(clone(base))
        opt_q = torch.optim.AdamW(quant.parameters(), lr=1e-2)
        opt_e = torch.optim.AdamW(exact.parameters(), lr=1e-2)
        lm_loss(quant, batch).backward()
        for fq, fe in zip(quant.flat_params, exact.flat_params):
            assert torch.equal(fq.shard, fe.shard)  # the gathers never wrote a master
            fe.ensure_grad()
            assert fq.grad is not None and fe.grad is not None
            fe.grad.copy_(fq.grad)  # the exact model's parameter gradients are views of it
        opt_q.step()
        opt_e.step()
        for fq, fe in zip(quant.flat_params, exact.flat_params):
            assert torch.equal(fq.shard, fe.shard), gd
        sd_q, sd_e = quant.full_state_dict(), exact.full_state_dict()
        for k, v in sd_e.items():
            assert sd_q[k].dtype == v.dtype and torch.equal(sd_q[k], v), (gd, k)


@checks.check
def bytes_per_step(rank: int, world: int) -> None:
    """``comm_stats()`` per step: fp8 gathers move half the bf16 bytes and a quarter of fp32's;
    int8 adds its block scales (4 bytes per 256); a bf16 reduction half of fp32's. The
    planner counts the same bytes."""
    base = tiny_llama()
    batch = local(batches(1)[0], rank, world)

    names = {FP32: "fp32", BF16: "bf16", FP8: "fp8", torch.int8: "int8", None: None}

    def step_bytes(mp: ls.MixedPrecision) -> tuple[int, int, int]:
        model = ls.shard(clone(base), mixed_precision=mp)
        lm_loss(model, batch).backward()
        model.comm_stats(reset=True)
        lm_loss(model, batch).backward()
        s = model.comm_stats()
        # the planner's bytes (layershard plan) are the engine's
        plan = collectives_per_step(
            base.config,
            world,
            names[mp.param_dtype],
            names[mp.reduce_dtype],
            gather_dtype=names[mp.gather_dtype],
        )
        for op in ("all_gather", "reduce_scatter"):
            assert s[op] == plan[op], (mp, op, s[op], plan[op])
        return s["all_gather"]["bytes"], s["reduce_scatter"]["bytes"], s["all_gather"]["count"]

    fp32, rs32, n = step_bytes(ls.MixedPrecision(FP32, FP32))
    bf16, rs16, n16 = step_bytes(ls.MixedPrecision(BF16, BF16))
    fp8, _, n8 = step_bytes(_wire(FP8, BF16, BF16))
    int8, _, _ = step_bytes(_wire(torch.int8, BF16))
    assert n == n16 == n8  # the same gathers, fewer bytes each
    assert fp8 * 2 == bf16 and fp8 * 4 == fp32, (fp8, bf16, fp32)
    # per flat parameter and gather, at most one partial block per rank: 8 bytes more
    assert bf16 < 2 * int8 <= bf16 * (1 + 4 / BLOCK) + 8 * world * n, (int8, bf16)
    assert rs16 * 2 == rs32


def _progressions(n: int, seed: int, vocab: int = 96) -> list[torch.Tensor]:
    """Batches of GLOBAL sequences x[t+1] = x[t] + k (mod vocab), k in 1..4: learnable in tens
    of steps (random tokens are not), so the weights move far from their init."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        start = torch.randint(0, vocab, (8, 1), generator=g)
        k = torch.randint(1, 5, (8, 1), generator=g)
        out.append((start + k * torch.arange(16)) % vocab)
    return out


CURVE_STEPS, CURVE_EVERY, CURVE_LR = 60, 10, 3e-3
# How far each option's validation loss may land from the exact run's (relative, at every
# evaluation). The bound, 1%, holds here for int8 blocks and a bf16 reduction (measured
# 2026-11-26: 0.10% and 0.02%). fp8 moved this 32-wide model's loss by 2.0%: with 3 mantissa
# bits a weight is off by up to 6%, and 32-term dot products average little of it out (the full
# curve, `small` at d 512, is the 1% test: benchmarks/wire-dtypes/). Its bound here is 2x what it
# measured; the stale amax moved the loss by 7.5%, ~2x past it.
CURVE_RTOL = {"int8": 0.01, "fp8": 0.04}


def _curve(base, mp, rank: int, world: int, stale: bool = False) -> list[float]:
    """Validation loss (held-out progressions) every CURVE_EVERY steps of AdamW."""
    model = ls.shard(clone(base), mixed_precision=mp)
    if stale:  # the broken scale: the first forward's amax kept (engine/wire_dtype.py)
        assert model._schedule.comm.wire is not None
        model._schedule.comm.wire.stale = True
    opt = torch.optim.AdamW(model.parameters(), lr=CURVE_LR)
    val = torch.cat(_progressions(2, seed=99))
    losses = []
    for step, batch in enumerate(_progressions(CURVE_STEPS, seed=5), start=1):
        lm_loss(model, local(batch, rank, world)).backward()
        opt.step()
        opt.zero_grad()
        if step % CURVE_EVERY == 0:
            with torch.no_grad():
                loss = lm_loss(model, local(val, rank, world)).detach()
            dist.all_reduce(loss)
            losses.append(loss.item() / world)
    return losses


@checks.check
def short_curve_within_one_percent_and_stale_amax_fails(rank: int, world: int) -> None:
    """The issue's curve test in small (benchmarks/wire-dtypes/ runs the full one: the `small`
    model, 300 steps): each option's validation loss within its bound (CURVE_RTOL) of the exact
    run's at every evaluation, and fp8 with a stale amax (the scales of the first forward kept)
    out of it: the weights grow well past their init's amax in these steps, so a stale scale
    clips them."""
    base = tiny_llama()
    exact = _curve(base, ls.MixedPrecision(FP32, FP32), rank, world)
    assert exact[-1] < 0.6 * exact[0], f"the model did not learn: {exact}"  # weights moved
    for name, gd in (("fp8", FP8), ("int8", torch.int8)):
        got = _curve(base, _wire(gd, FP32, BF16), rank, world)
        rel = max(abs(a - b) / b for a, b in zip(got, exact))
        assert rel <= CURVE_RTOL[name], f"{name} + bf16 reduce: {rel:.4f} ({got} vs {exact})"
    stale = _curve(base, _wire(FP8, FP32, BF16), rank, world, stale=True)
    rel = max(abs(a - b) / b for a, b in zip(stale, exact))
    assert rel > CURVE_RTOL["fp8"], f"a stale fp8 amax stayed within {rel:.4f}: not caught"


checks.collect(globals())


# ---- four ranks: hybrid, hpZ; bf16 reduction with fp32 sums at 2, 3 and 4 ranks -------------

checks4 = RankChecks(world_size=4, suffix="_4_ranks", slow=True)


@checks4.check
def hybrid_and_hpz_backward_uses_the_forwards_weights(rank: int, world: int) -> None:
    """hybrid quantizes the gather within its shard group; hpZ keeps the dequantized forward
    weights' 1/K and re-gathers those exactly (the backward computes with the forward's)."""
    _first_grads_match(
        rank,
        world,
        [
            ("hybrid", {"strategy": "hybrid", "shard_size": 2}),
            ("hpz", {"reshard_after_forward": 2}),
        ],
    )


@checks4.check
def bf16_reduce_sums_in_fp32(rank: int, world: int) -> None:
    """The engine's reduce-scatter of bf16 gradients (an all-to-all, then the sum) equals the
    fp32 sum of every rank's bf16 chunk, in rank order, rounded to bf16 once; a sum rounded after
    each add (bf16 accumulation) differs from it at 3 and 4 ranks, so the check tells them apart
    (two terms round once either way). Groups of 2, 3 and 4 of the ranks; on gloo's path and on
    NCCL's (``LAYERSHARD_GLOO_NATIVE=1``: there a 16-bit reduction is an all-to-all too, its
    receive scratch a whole unit, as the planner says)."""
    groups = {size: dist.new_group(list(range(size))) for size in (2, 3, 4)}  # every rank makes
    grads = {}
    for native in (False, True):
        os.environ["LAYERSHARD_GLOO_NATIVE"] = "1" if native else "0"
        try:
            for size, group in groups.items():
                if rank < size:
                    _bf16_sum_over(group, rank, size, native)
            # the engine's reductions on both paths (slots in turns, the head's own buffer)
            model = ls.shard(tiny_llama(), mixed_precision=ls.MixedPrecision(FP32, BF16))
            lm_loss(model, local(batches(1)[0], rank, world)).backward()
            grads[native] = [p.grad.clone() for p in model.parameters()]
        finally:
            del os.environ["LAYERSHARD_GLOO_NATIVE"]
    assert all(torch.equal(a, b) for a, b in zip(*grads.values(), strict=True))


def _bf16_sum_over(group, rank: int, size: int, native: bool) -> None:
    mp = ls.MixedPrecision(FP32, BF16)
    model = ls.shard(tiny_llama(), mixed_precision=mp, process_group=group)
    comm, n = model._schedule.comm, 4096 * size
    assert comm.gloo_workaround is not native
    if native:  # the engine's reduce scratch: whole units (what the planner predicts)
        cfg = model.module.config
        pred = predict_memory(cfg, size, FP32, BF16, None, backend="nccl", rank=rank)
        assert model.memory_report()["reduce_scratch"] == pred["reduce_scratch"], size
    gens = [torch.Generator().manual_seed(100 + r) for r in range(size)]
    # magnitudes spread over 2**-8..2**8: sums whose bf16 rounding depends on the order
    inputs = [
        torch.randn(n, generator=g) * torch.exp2(torch.randint(-8, 9, (n,), generator=g))
        for g in gens
    ]
    inputs = [x.to(BF16) for x in inputs]
    got: list[torch.Tensor] = []
    comm.reduce_scatter(
        inputs[rank].clone(),
        torch.empty(n, dtype=BF16),
        "backward",
        "test",
        got.append,  # the chunk of the sum (the buffer is not reused after)
    ).wait()
    mine = slice(rank * (n // size), (rank + 1) * (n // size))
    fp32_sum, bf16_sum = torch.zeros(n), inputs[0].clone()
    for x in inputs:
        fp32_sum += x.float()
    for x in inputs[1:]:
        bf16_sum += x
    expected = fp32_sum.to(BF16)[mine]
    assert torch.equal(got[0], expected), (size, (got[0] - expected).abs().max())
    if size > 2:
        assert (bf16_sum[mine] != expected).any(), size


checks4.collect(globals())
