"""Tensor parallelism under layershard (engine/dtensor.py, issue 32): the built-in Llama's blocks
parallelized by torch (``parallelize_module``, ``parallelize_llama``) over a TP mesh, layershard
sharding each unit's local TP shards over the data-parallel group (the ranks with the same TP
coordinate, ``data_parallel(mesh)``). At 2 ranks TP 2 alone (dp_shard 1), at 4 ranks TP 2 x
dp_shard 2 (and HSDP 2 x TP 2), against one process on the same global batch: each step's loss and
clipped gradient norm, every gradient after the first backward, the weights after the optimizer
steps (AdamW, clipped), ``full_state_dict`` (the reference's names and whole shapes), the
data-parallel group's collectives and the bytes each rank holds; strategies full, grad_op,
no_shard, hybrid (checkpointed); a transformers Llama by its own ``base_model_tp_plan``; bf16
compute; no_sync; frozen TP weights under CPU offload; vocabulary-parallel embedding and head
(units larger than a block); ``load_full_state_dict``; what is refused (checkpoints:
test_tp_checkpoint.py); and negative controls the
checks catch (a parameter replicated over TP counted once per TP rank in the norm; the DTensor not
re-wrapped at bind)."""

from __future__ import annotations

import functools
import logging

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks
from _parity import (
    EPS,
    LOSS_RTOL,
    LR,
    SPREAD_FACTOR,
    TINY,
    TP_ORDERS,
    batches,
    clone,
    grad_error,
    lm_loss,
    local,
    relative_bound,
    relative_distance,
    tiny_llama,
    train_in_orders,
)
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

import layershard as ls
from layershard.engine import dtensor
from layershard.meshes import data_parallel
from layershard.models import hf_tp
from layershard.models.hf_tp import parallelize_hf
from layershard.models.llama_tp import parallelize_llama

TP = 2
STEPS = 4
RTOL = 1e-5  # the issue's tolerance: transformers' TP x FSDP2 lands within 6.4e-7 in fp32
CLIP = 0.5  # below the tiny Llama's gradient norm (~0.8): every step clips
# The weights after AdamW steps: _parity.TP_ORDERS (why, and what was measured).

checks2 = RankChecks(world_size=2, suffix="_tp2")
checks4 = RankChecks(world_size=4, suffix="_tp2_dp2", slow=True)


def _tp_model(base, world: int, hybrid: bool = False, parallelize=parallelize_llama, **options):
    """``base`` parallelized over TP (consecutive ranks) and sharded over the data-parallel
    group: (dp_shard, tp), or with ``hybrid`` (dp_replicate, dp_shard 1, tp) and HSDP over the
    (replicate, shard) mesh. Returns the model, the data-parallel group, rank and size."""
    if hybrid:
        names = ("dp_replicate", "dp_shard", "tp")
        mesh = init_device_mesh("cpu", (world // TP, 1, TP), mesh_dim_names=names)
    else:
        mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    model = parallelize(clone(base), mesh["tp"])
    model = ls.shard(model, mesh=mesh, **options)  # the data-parallel dims: data_parallel(mesh)
    assert (model.sharding.name == "hybrid") == hybrid
    dp_group = model.process_group
    return model, dp_group, dist.get_rank(dp_group), dist.get_world_size(dp_group)


def full_grads(model, dp_group) -> dict[str, torch.Tensor]:
    """Every trainable parameter's whole gradient (gathered over DP, then assembled over TP)."""
    out = {}
    for f in model.flat_params:
        if not f.requires_grad:
            continue
        assert f.grad is not None
        parts = [torch.empty_like(f.grad) for _ in range(dist.get_world_size(dp_group))]
        dist.all_gather(parts, f.grad, group=dp_group)
        for slot, g in zip(f.slots, f.views(torch.cat(parts))):
            tp = dtensor.tp_of(slot)
            out[slot.name] = g if tp is None else dtensor.full_tensor(tp, g)
    return out


def _rel(a: float, b: float) -> float:
    return abs(a - b) / abs(b)


def hf_llama(tied: bool = False):
    """A tiny transformers Llama (untied unless ``tied``), the built-in tiny Llama's shape."""
    import transformers

    torch.manual_seed(3)
    cfg = transformers.LlamaConfig(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16,
        tie_word_embeddings=tied,
    )  # fmt: skip
    return transformers.LlamaForCausalLM(cfg)


def hf_qwen3():
    """A tiny transformers Qwen3 (untied): its plan's q/k norms are
    ``replicated_with_grad_allreduce`` (``hf_tp.ReplicatedOverHeads``); their weights moved off
    one so that their gradients are not all alike."""
    import transformers

    torch.manual_seed(3)
    cfg = transformers.Qwen3Config(
        vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=16,
        tie_word_embeddings=False,
    )  # fmt: skip
    model = transformers.Qwen3ForCausalLM(cfg)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("q_norm.weight", "k_norm.weight")):
                p.add_(0.1 * torch.randn_like(p))
    return model


MODELS = {  # base model, its TP, the first block's q projection and an untouched parameter
    "ours": (tiny_llama, parallelize_llama, "layers.0.attn.wq", "layers.0.attn_norm.weight"),
    "hf": (hf_llama, parallelize_hf, "model.layers.0.self_attn.q_proj",
           "model.layers.0.input_layernorm.weight"),
    "qwen3": (hf_qwen3, parallelize_hf, "model.layers.0.self_attn.q_proj",
              "model.layers.0.input_layernorm.weight"),
}  # fmt: skip


# Qwen3 trains with SGD in these checks, not AdamW: under ATEN_CPU_CAPABILITY=default its weights
# after 4 AdamW steps land 1.3e-4 from the reference (relative to their movement; spread over every
# weight, not its q/k norms) while the other orders' spread gives 1.9e-5, and the first gradients
# agree within RTOL: AdamW's near-eps elements amplify TP's unsampled order of the sums more on
# this model. SGD carries gradient differences as they are, which is what the norms' all-reduce
# (the point of the check) needs to be held to.
SGD_KINDS = {"qwen3"}


def _optimizer(kind: str, params):
    params = [p for p in params if p.requires_grad]
    return (
        torch.optim.SGD(params, lr=0.5) if kind in SGD_KINDS else torch.optim.AdamW(params, lr=LR)
    )


@functools.cache
def _orders(world: int, kind: str = "ours"):
    """The reference trained in the other legitimate orders of the DP sums (once per spawn)."""
    return train_in_orders(
        MODELS[kind][0](), batches(STEPS), world, clip=(CLIP, 2.0),
        optimizers=lambda m: [_optimizer(kind, m.parameters())],
    )  # fmt: skip


def _parity(rank: int, world: int, strategy: str, kind: str = "ours", **options) -> None:
    make, parallelize, q_proj, plain = MODELS[kind]
    base = make()
    reference = clone(base)
    hybrid = strategy == "hybrid"  # data_parallel(mesh) chooses it
    if not hybrid:
        options["strategy"] = strategy
    model, dp_group, dp_rank, dp = _tp_model(base, world, hybrid, parallelize, **options)
    replicas = dp if hybrid or strategy == "no_shard" else 1  # replicas hold the same slices
    # the blocks' projections are DTensors over TP; bound views are DTensors again in forward
    names = {s.name: s for f in model.flat_params for s in f.slots}
    wq = names[f"{q_proj}.weight"]
    tp = dtensor.tp_of(wq)
    assert tp is not None and wq.shape == (16, 32) and tp.shape == (32, 32)
    assert dtensor.tp_of(names[plain]) is None
    seen = []
    hook = model.module.get_submodule(q_proj).register_forward_pre_hook(
        lambda m, args: seen.append(type(m.weight))
    )

    # Before training: full_state_dict is the reference's, names, shapes and values, exactly.
    full = model.full_state_dict()
    if rank == 0:
        assert list(full) == list(reference.state_dict())
        for k, v in reference.state_dict().items():
            assert full[k].shape == v.shape and torch.equal(full[k], v), k
    else:
        assert full == {}

    # Bytes held: each rank 1/(dp x tp) of the TP-sharded weights, 1/dp of the replicated ones.
    held = {s.name: p.numel() for f in model.flat_params for s, p in zip(f.slots, f.shard_params)}
    counts = torch.tensor([held[k] for k in sorted(held)])
    dist.all_reduce(counts)
    for k, n in zip(sorted(held), counts.tolist()):
        expect = reference.get_parameter(k).numel() * (1 if dtensor.split_over_tp(names[k]) else TP)
        expect *= replicas
        assert n == expect, (k, n, expect)

    opt = _optimizer(kind, model.parameters())
    ref_opt = _optimizer(kind, reference.parameters())
    for step, batch in enumerate(batches(STEPS)):
        model.comm_stats(reset=True)
        loss = lm_loss(model, local(batch, dp_rank, dp))
        loss.backward()
        if strategy == "full":
            _check_collectives(model, model.comm_stats())
        ref_loss = lm_loss(reference, batch)
        ref_loss.backward()
        ours = loss.detach().clone()
        dist.all_reduce(ours, group=dp_group)
        assert _rel(ours.item() / dp, ref_loss.item()) <= LOSS_RTOL, (step, ours, ref_loss)
        if step == 0:
            grads = full_grads(model, dp_group)
            ref_grads = {k: p.grad for k, p in reference.named_parameters()}
            assert set(grads) == set(ref_grads)
            err = grad_error(grads, ref_grads)
            assert err <= RTOL, f"first gradient {err:.2e} from the reference's (relative)"
        norm = model.clip_grad_norm_(CLIP).item()
        ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), CLIP).item()
        # After AdamW steps the norms drift as the weights do, by TP's order of the sums that
        # the other orders do not sample (_parity.TP_ORDERS): bounded by the other orders'
        # spread at this step scaled alike, at least RTOL (measured 2026-11-27, the worst step
        # under ATEN_CPU_CAPABILITY default and avx2: the Llamas <= 1.4e-6, Qwen3 with SGD
        # 6.9e-8; Qwen3 with AdamW reached 1.85e-5 under default: SGD_KINDS).
        spread = max(_rel(r.norms[step], ref_norm) for r in _orders(world, kind))
        bound = max(RTOL, TP_ORDERS * SPREAD_FACTOR * spread) if step else RTOL
        if rank == 0 and step:
            print(
                f"{kind} {strategy} step {step}: norm {_rel(norm, ref_norm):.2e}, bound {bound:.2e}"
            )
        assert _rel(norm, ref_norm) <= bound, (step, norm, ref_norm, bound)
        opt.step()
        opt.zero_grad()
        ref_opt.step()
        ref_opt.zero_grad()
    hook.remove()
    assert seen and all(t is DTensor for t in seen), seen

    full = model.full_state_dict()
    if rank == 0:
        assert list(full) == list(reference.state_dict())
        assert all(full[k].shape == v.shape for k, v in reference.state_dict().items())
        d = relative_distance(full, reference, base)
        bound = relative_bound(reference, base, *_orders(world, kind))
        print(f"world {world} {kind} {strategy}: weights {d:.2e}, in-run spread bound {bound:.2e}")
        assert d <= max(2 * RTOL, TP_ORDERS * bound), (
            f"weights {d:.2e} from the reference's (relative to the distance they moved)"
        )


def _check_collectives(model, stats: dict) -> None:
    """The data-parallel group's collectives of a step, as without TP (test_parity.py): one
    all-gather per unit in forward and one per unit in backward but the three still gathered or
    not needed (head, final norm, embedding), one reduce-scatter per unit, of the local TP
    shards' bytes; the agreement's all-reduce. A one-rank group issues none. (The TP group's
    collectives are torch's: DTensor's.)"""
    if not model._schedule.comm.active:
        assert stats == {}, stats
        return
    n, padded = len(model.units), sum(f.padded_numel for f in model.flat_params)
    gathers = stats["all_gather"]
    assert (gathers["count"], gathers["forward"], gathers["backward"]) == (2 * n - 3, n, n - 3)
    assert stats["reduce_scatter"] == {"count": n, "bytes": 4 * padded, "backward": n}
    assert stats["all_reduce"] == {"count": 1, "bytes": 24 * n, "backward": 1}
    assert set(stats) == {"all_gather", "reduce_scatter", "all_reduce"}, stats


def _full(rank: int, world: int) -> None:
    """strategy full (ZeRO-3) over the DP group, fp32: matches one process."""
    _parity(rank, world, "full")


def _grad_op(rank: int, world: int) -> None:
    """strategy grad_op (ZeRO-2) over the DP group, fp32: matches one process."""
    _parity(rank, world, "grad_op")


def _hybrid(rank: int, world: int) -> None:
    """HSDP x TP: (dp_replicate 2, dp_shard 1, tp 2), strategy hybrid over the dp dims' mesh,
    every block checkpointed (recomputed in backward)."""
    _parity(rank, world, "hybrid", activation_checkpointing=3)


def _hf(rank: int, world: int) -> None:
    """A transformers Llama parallelized by its own base_model_tp_plan (torch's
    parallelize_module, ``parallelize_hf``), strategy full: matches one process."""
    _parity(rank, world, "full", "hf")


def _qwen3(rank: int, world: int) -> None:
    """A transformers Qwen3 by its own plan, whose q/k norms are replicated over TP with their
    gradients all-reduced (transformers' ``replicated_with_grad_allreduce``, here
    ``hf_tp.ReplicatedOverHeads``): matches one process, those norms' gradients included."""
    _parity(rank, world, "full", "qwen3")


def _qwen3_norm_control(rank: int, world: int) -> None:
    """Negative control: the q/k norms' input not marked as split over the heads (so their
    weight's gradient stays this rank's partial sum, not all-reduced over TP) is caught by the
    first-gradient check; the style itself is within RTOL."""
    base, batch = hf_qwen3(), batches(1, vocab=96)[0]
    reference = clone(base)
    lm_loss(reference, batch).backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    errors = []
    for heads_split in (False, True):
        apply = hf_tp.ReplicatedOverHeads._apply
        if not heads_split:  # the input replicated: DTensor sees no sum over other ranks' heads
            hf_tp.ReplicatedOverHeads._apply = lambda self, module, mesh: hf_tp.distribute_module(
                module,
                mesh,
                input_fn=lambda m, x, mesh: (DTensor.from_local(x[0], mesh, [Replicate()]),),
                output_fn=lambda m, o, _: o.to_local(),
            )
        try:
            model, dp_group, dp_rank, dp = _tp_model(base, world, parallelize=parallelize_hf)
        finally:
            hf_tp.ReplicatedOverHeads._apply = apply
        lm_loss(model, local(batch, dp_rank, dp)).backward()
        grads = full_grads(model, dp_group)
        norms = [k for k in grads if k.endswith("norm.weight") and "_norm" in k]
        assert len(norms) == 4, norms  # q_norm, k_norm of 2 blocks
        errors.append(grad_error({k: grads[k] for k in norms}, {k: ref_grads[k] for k in norms}))
    assert errors[0] > 0.1 and errors[1] <= RTOL, errors


def _no_shard(rank: int, world: int) -> None:
    """strategy no_shard (DDP-like) over the DP group, fp32: matches one process."""
    _parity(rank, world, "no_shard")


def _round_trip(rank: int, world: int) -> None:
    """load_full_state_dict (the dp group's rank 0 passes the whole tensors; each rank keeps its
    TP part of its slices) into a differently initialized TP model: full_state_dict and the
    outputs are the original's, exactly; full_weights binds the whole DTensors. A dict on global
    rank 0 alone (the other TP coordinate's group has none) raises on every rank."""
    model, dp_group, dp_rank, dp = _tp_model(tiny_llama(), world)
    full = model.full_state_dict(rank0_only=False)
    other, *_ = _tp_model(tiny_llama(seed=7), world)
    with pytest.raises(ValueError, match="of every TP coordinate"):  # on every rank
        other.load_full_state_dict(full if rank == 0 else None)
    other.load_full_state_dict(full if dp_rank == 0 else None)
    again = other.full_state_dict(rank0_only=False)
    assert list(again) == list(full) and all(torch.equal(again[k], full[k]) for k in full)
    x = local(batches(1, seed=9)[0], dp_rank, dp)
    with torch.no_grad():
        torch.testing.assert_close(other(x).logits, model(x).logits, rtol=0, atol=0)
    with model.full_weights() as m:
        w = m.layers[0].attn.wq.weight
        assert isinstance(w, DTensor) and w.shape == (32, 32)
        torch.testing.assert_close(w.full_tensor(), full["layers.0.attn.wq.weight"])


def _large_head(rank: int, world: int) -> None:
    """TP-sharded units larger than a block (a vocabulary of 1024, the embedding row-parallel
    and the LM head column-parallel over it: 32k elements against ~9k for a block) are gathered
    into storage of their own, handed on after their forward (buffers.py, "Units larger than a
    block"): the head's backward must read the weights it saved from this backward's gather, not
    hold the forward's storage; gradients and the norm as the reference's."""
    base = tiny_llama(vocab_size=1024)
    batch = batches(1, vocab=1024)[0]
    reference = clone(base)
    lm_loss(reference, batch).backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    dp_group = mesh["dp_shard"].get_group()
    model = parallelize_llama(clone(base), mesh["tp"])
    vocab = {  # vocabulary-parallel embedding and head
        "embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Replicate()),
        "lm_head": ColwiseParallel(output_layouts=Replicate()),
    }
    parallelize_module(model, mesh["tp"], vocab)
    model = ls.shard(model, process_group=dp_group)
    for name in vocab:
        unit = next(u for u in model.units if u.name == name)
        assert unit.slot.transient and dtensor.tp_of(unit.param_slots[0]) is not None
    dp, dp_rank = dist.get_world_size(dp_group), dist.get_rank(dp_group)
    held = []  # DTensors over a unit's gathered weights that reach the outer hooks

    def pack(t):
        if isinstance(t, DTensor):
            inner = t.detach().to_local().untyped_storage().data_ptr()
            slots = [u.slot.alias for u in model.units if u.slot.alias is not None]
            if any(inner == a.untyped_storage().data_ptr() for a in slots):
                held.append(t)
        return t

    with saved_tensors_hooks(pack, lambda t: t):
        loss = lm_loss(model, local(batch, dp_rank, dp))
    # the engine saves them as places in the unit's buffer (backward_hooks.py, WeightView), so that
    # a unit's storage is not held from its forward to its backward
    assert not held, f"{len(held)} DTensor weights saved as tensors"
    loss.backward()
    err = grad_error(full_grads(model, dp_group), ref_grads)
    assert err <= RTOL, f"first gradient {err:.2e} from the reference's (relative)"
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    assert _rel(model.clip_grad_norm_(1e9).item(), ref_norm) <= RTOL


def _tp_collectives(rank: int, world: int) -> None:
    """layershard adds no TP collective: a step's DTensor collectives (torch's functional
    all-reduces: 2 per block forward, wo's and w2's outputs; 5 backward, the gradients of the
    inputs of q/k/v and w1/w3) are those of the same TP model without layershard."""
    from torch.distributed.tensor.debug import CommDebugMode

    def functional(mode) -> dict[str, int]:
        counts = mode.get_comm_counts()
        return {str(op): n for op, n in counts.items() if "c10d_functional" in str(op)}

    base = tiny_llama()
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    x = local(batches(1)[0], mesh["dp_shard"].get_local_rank(), world // TP)
    plain = parallelize_llama(clone(base), mesh["tp"])
    with CommDebugMode() as alone:
        lm_loss(plain, x).backward()
    model = ls.shard(parallelize_llama(clone(base), mesh["tp"]), **data_parallel(mesh))
    with CommDebugMode() as sharded:
        lm_loss(model, x).backward()
    blocks = len(base.layers)
    assert functional(alone) == {"c10d_functional.all_reduce": 7 * blocks}, functional(alone)
    assert functional(sharded) == functional(alone), (functional(sharded), functional(alone))


def _no_sync(rank: int, world: int) -> None:
    """Gradient accumulation: two micro-batches per rank, the first under no_sync; the summed
    gradient is the reference's on the global batch."""
    base = tiny_llama()
    batch = batches(1)[0]
    reference = clone(base)
    lm_loss(reference, batch).backward()
    model, dp_group, dp_rank, dp = _tp_model(base, world)
    first, second = local(batch, dp_rank, dp).chunk(2)
    with model.no_sync():
        (lm_loss(model, first) / 2).backward()
    (lm_loss(model, second) / 2).backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    err = grad_error(full_grads(model, dp_group), ref_grads)
    assert err <= RTOL, f"accumulated gradient {err:.2e} from the reference's (relative)"


def _frozen_offload(rank: int, world: int) -> None:
    """Frozen TP weights (the attention's projections: a frozen flat group of DTensor slots)
    under CPU offload: the trainable gradients are the reference's."""
    base = tiny_llama()
    for block in base.layers:
        block.attn.requires_grad_(False)
    batch = batches(1)[0]
    reference = clone(base)
    lm_loss(reference, batch).backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters() if p.requires_grad}
    model, dp_group, dp_rank, dp = _tp_model(base, world, offload=ls.CPUOffload())
    frozen = [s for f in model.flat_params if not f.requires_grad for s in f.slots]
    assert frozen and all(dtensor.tp_of(s) is not None for s in frozen)
    lm_loss(model, local(batch, dp_rank, dp)).backward()
    grads = full_grads(model, dp_group)
    assert set(grads) == set(ref_grads)
    err = grad_error(grads, ref_grads)
    assert err <= RTOL, f"first gradient {err:.2e} from the reference's (relative)"


def _refusals(rank: int, world: int) -> None:
    """What cannot work says so in one line: a data-parallel group that crosses the TP mesh (its
    gathers would mix different TP parts), a process group beside a mesh that gives it, a mesh
    without a data-parallel dim. (Checkpoints, async ones too: test_tp_checkpoint.py.)"""
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("tp",))
    with pytest.raises(ValueError, match="in the TP mesh of the DTensor parameters"):
        ls.shard(parallelize_llama(tiny_llama(), mesh), process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match="pass no process_group"):
        ls.shard(tiny_llama(), mesh=mesh, process_group=dist.group.WORLD)
    with pytest.raises(ValueError, match=r"\('dp_shard', 'tp'\) or"):
        ls.shard(tiny_llama(), mesh=mesh)  # no data-parallel dim
    # a layer the plan would split unevenly: one line naming it (was a matmul shape error later)
    odd = (
        f"tp={world} must divide the output features \\(column-wise split\\) of layers.0.mlp.w1: 63"
    )
    with pytest.raises(ValueError, match=odd):
        parallelize_llama(tiny_llama(ffn_dim=63), mesh)
    hf = hf_llama()
    for layer in hf.model.layers:
        layer.mlp.down_proj = torch.nn.Linear(63, 32, bias=False)  # a row-wise split of 63
    with pytest.raises(
        ValueError, match=r"input features \(row-wise split\) of layers.0.mlp.down_proj: 63"
    ):
        parallelize_hf(hf, mesh)


def _bf16(rank: int, world: int) -> None:
    """bf16 compute (MixedPrecision): the first step's loss and gradients as close to the fp32
    reference as layershard's bf16 without TP is (TP moves bf16 roundings around, no more)."""
    base = tiny_llama()
    batch = batches(1)[0]
    precision = ls.MixedPrecision(param_dtype=torch.bfloat16)
    reference = clone(base)
    ref_loss = lm_loss(reference, batch)
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    model, dp_group, dp_rank, dp = _tp_model(base, world, mixed_precision=precision)
    loss = lm_loss(model, local(batch, dp_rank, dp))
    loss.backward()
    ours = loss.detach().float()
    dist.all_reduce(ours, group=dp_group)
    err = grad_error(full_grads(model, dp_group), ref_grads)
    # layershard bf16 without TP (over the whole world) on the same batch
    plain = ls.shard(clone(base), mixed_precision=precision)
    plain_loss = lm_loss(plain, local(batch, rank, world))
    plain_loss.backward()
    mine = plain_loss.detach().float()
    dist.all_reduce(mine)
    plain_err = grad_error(full_grads(plain, dist.group.WORLD), ref_grads)
    loss_err = _rel(ours.item() / dp, ref_loss.item())
    plain_loss_err = _rel(mine.item() / world, ref_loss.item())
    if rank == 0:
        print(f"bf16 world {world}: grads {err:.2e} (no TP {plain_err:.2e}), loss {loss_err:.2e} "
              f"(no TP {plain_loss_err:.2e})", flush=True)  # fmt: skip
    assert err <= 2 * plain_err + EPS, (err, plain_err)
    assert loss_err <= 4 * plain_loss_err + 1e-3, (loss_err, plain_loss_err)


def _norm_control(rank: int, world: int) -> None:
    """Negative control: a parameter replicated over TP (norms, embedding, head) counted once
    per TP rank in the clip norm is caught by the norm check at RTOL."""
    base = tiny_llama()
    batch = batches(1)[0]
    reference = clone(base)
    lm_loss(reference, batch).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 1e9).item()
    model, _, dp_rank, dp = _tp_model(base, world)
    lm_loss(model, local(batch, dp_rank, dp)).backward()
    split = dtensor.split_over_tp
    try:
        dtensor.split_over_tp = lambda tp: True
        wrong = model.clip_grad_norm_(1e9).item()
    finally:
        dtensor.split_over_tp = split
    assert _rel(wrong, ref_norm) > 100 * RTOL, (wrong, ref_norm)
    assert _rel(model.clip_grad_norm_(1e9).item(), ref_norm) <= RTOL


def _rewrap_control(rank: int, world: int) -> None:
    """Negative control: without the re-wrap at bind (plain local views where the TP modules
    expect their DTensor weights), the forward fails; it is never a silent wrong number."""
    base = tiny_llama()
    model, _, dp_rank, dp = _tp_model(base, world)
    wrap = dtensor.wrap
    try:
        dtensor.wrap = lambda tp, t: t  # type: ignore[assignment]
        with pytest.raises(RuntimeError, match="DTensor"):
            lm_loss(model, local(batches(1)[0], dp_rank, dp))
    finally:
        dtensor.wrap = wrap


def _same_runs(models, data) -> None:
    """Each model trained 2 AdamW steps on ``data`` (the ranks of a TP group on the same
    micro-batch: rank // TP of world / TP): the same losses and full_state_dict, bit for bit."""
    runs = []
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for batch in data:
            loss = lm_loss(model, local(batch, dist.get_rank() // TP, dist.get_world_size() // TP))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        runs.append((losses, model.full_state_dict(rank0_only=False)))
    for losses, state in runs[1:]:
        assert losses == runs[0][0]
        assert all(torch.equal(state[k], runs[0][1][k]) for k in state)


# Each behaviour once where it says most; the parity with strategy full at both sizes.
def _parallelize(rank: int, world: int) -> None:
    """``ls.parallelize(model, tp=2)`` builds the meshes, applies the built-in Llama's TP plan
    and shards over dp_shard: the same run, bit for bit, as the mesh spelled out by hand
    (``parallelize_llama`` + ``ls.shard(mesh=...)``), 2 AdamW steps; so is HSDP x TP said as
    ``dp_replicate=2`` or as ``strategy="hybrid", shard_size=2`` (2 ranks per replica, as
    ``layershard train --strategy hybrid`` and ``ShardingPlugin`` say it) against the hybrid
    mesh by hand; ep on a model without experts is refused."""
    base, data = tiny_llama(), batches(2)
    _same_runs([_tp_model(base, world)[0], ls.parallelize(clone(base), tp=TP)], data)
    hybrid = [
        _tp_model(base, world, hybrid=True)[0],
        ls.parallelize(clone(base), tp=TP, dp_replicate=2),
        ls.parallelize(clone(base), tp=TP, strategy="hybrid", shard_size=2),
    ]
    for model in hybrid:
        assert model.sharding.name == "hybrid" and model.sharding.replicas == 2
    _same_runs(hybrid, data)
    with pytest.raises(ValueError, match="must divide the world size 4"):
        ls.parallelize(clone(base), tp=TP, strategy="hybrid", shard_size=3)
    try:  # TP x EP itself: test_expert_parallel.py
        ls.parallelize(clone(base), tp=TP, ep=2)
    except ValueError as e:
        assert "no expert layers to split" in str(e)
    else:
        raise AssertionError("ep on a dense model was not refused")


# ---- a TP model built on the meta device (engine/init.py) ----


class _Peak(logging.Handler):
    """The meta init's peak of whole tensors materialized (init.py logs it)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.bytes: list[int] = []

    def emit(self, record: logging.LogRecord) -> None:
        if hasattr(record, "peak_bytes"):
            self.bytes.append(record.peak_bytes)


def _same_run(lazy, eager, world: int) -> None:
    """Two sharded TP models hold the same local shards and whole weights, bit for bit, and two
    AdamW steps give both the same losses and weights, bit for bit."""
    a, b = dict(lazy.named_parameters()), dict(eager.named_parameters())
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)
    for model in (lazy, eager):
        opt = torch.optim.AdamW(model.parameters(), lr=LR)
        losses = []
        for batch in batches(2):
            loss = lm_loss(model, local(batch, dist.get_rank(model.process_group), world // TP))
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.detach())
        model.losses = losses
    assert all(torch.equal(x, y) for x, y in zip(lazy.losses, eager.losses, strict=True))
    a, b = lazy.full_state_dict(rank0_only=False), eager.full_state_dict(rank0_only=False)
    assert list(a) == list(b) and all(torch.equal(a[k], b[k]) for k in a)


def _meta_llama(rank: int, world: int) -> None:
    """The built-in Llama built on the meta device, ``ls.parallelize(tp=2)``d there (DTensors
    of meta tensors) and sharded: ``shard()`` initializes each TP weight whole, then keeps the
    rank's TP part of it, so the model is the eager build's parallelized, bit for bit (local
    shards, full_state_dict, two AdamW steps), untied and tied (embedding and head stay
    replicated under the plan). Memory: the whole tensors of one block at a time."""
    init_log = logging.getLogger("layershard.engine.init")
    for tied in (False, True):
        eager = ls.parallelize(tiny_llama(seed=3, tie_embeddings=tied), tp=TP)
        with torch.device("meta"):  # seeds the CPU generator, draws nothing: shard() draws
            meta = tiny_llama(seed=3, tie_embeddings=tied)
        peak = _Peak()
        init_log.addHandler(peak)
        init_log.setLevel(logging.DEBUG)
        try:
            lazy = ls.parallelize(meta, tp=TP)
        finally:
            init_log.removeHandler(peak)
        wq = next(
            s for f in lazy.flat_params for s in f.slots if s.name == "layers.0.attn.wq.weight"
        )
        assert dtensor.tp_of(wq) is not None and wq.shape == (16, 32)
        _same_run(lazy, eager, world)
        sizes: dict[str, int] = {}
        for name, p in tiny_llama(tie_embeddings=tied).named_parameters():
            unit = ".".join(name.split(".")[:2]) if name.startswith("layers.") else "outside"
            sizes[unit] = sizes.get(unit, 0) + p.numel() * p.element_size()
        outside = sizes.pop("outside")
        (top,) = peak.bytes  # a block's whole tensors, not its TP parts
        assert max(sizes.values()) <= top <= outside + max(sizes.values()), (top, sizes)


def _local_of_full(rank: int, world: int) -> None:
    """``local_of_full`` (meta init, load_full_state_dict) slices the whole tensor where it lies
    as ``distribute_tensor`` splits it, uneven and empty parts included (3 rows over 4 ranks)."""
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(7 * 3, dtype=torch.float32).reshape(7, 3)
    two_d = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    for tp_mesh in (init_device_mesh("cpu", (world,)), two_d["tp"]):
        for placement in (Shard(0), Shard(1), Replicate()):
            spec = dtensor.TPInfo(tp_mesh, (placement,), full.shape, full.stride())
            want = distribute_tensor(full, tp_mesh, [placement], src_data_rank=None).to_local()
            got = dtensor.local_of_full(spec, full)
            assert got.shape == want.shape and torch.equal(got, want), (placement, got, want)


def _meta_hf(rank: int, world: int) -> None:
    """A transformers Llama with a tied embedding and head (``base_model_tp_plan`` leaves them
    replicated), built on the meta device, parallelized there by its plan and sharded with
    ``ls.shard(mesh=...)``: HF's init contract draws the same numbers as the same meta model
    sharded without TP (the whole weights, bit for bit); and it runs as that model's weights
    loaded eagerly, parallelized and sharded (local shards, two AdamW steps, bit for bit)."""
    mesh = init_device_mesh("cpu", (world // TP, TP), mesh_dim_names=("dp_shard", "tp"))
    with torch.device("meta"):
        plain_meta, tp_meta = hf_llama(tied=True), hf_llama(tied=True)
    torch.manual_seed(5)
    weights = ls.shard(plain_meta).full_state_dict(rank0_only=False)
    torch.manual_seed(5)
    lazy = ls.shard(parallelize_hf(tp_meta, mesh["tp"]), mesh=mesh)
    full = lazy.full_state_dict(rank0_only=False)
    assert list(full) == list(weights) and all(torch.equal(full[k], weights[k]) for k in full)
    assert torch.equal(full["lm_head.weight"], full["model.embed_tokens.weight"])
    eager = hf_llama(tied=True)
    eager.load_state_dict(weights)
    _same_run(lazy, ls.shard(parallelize_hf(eager, mesh["tp"]), mesh=mesh), world)


def _meta_train(rank: int, world: int) -> None:
    """``layershard train --tp 2``'s build on the meta device (train/modeling.py
    ``build_model(meta=True)``, then train/parallel.py ``shard_model``: ``ls.parallelize``) of
    a preset equals its eager build, bit for bit."""
    from layershard.train.config import resolve
    from layershard.train.modeling import build_model, model_spec, shard_options
    from layershard.train.parallel import shard_model

    cfg = resolve({"tp": TP, "model_overrides": {"dim": 64, "n_layers": 2, "max_seq_len": 16}})
    kind, spec, _ = model_spec(cfg, TINY["vocab_size"])
    options = shard_options(cfg, "fp32", torch.device("cpu"))
    lazy, eager = (
        shard_model(build_model(kind, spec, cfg, meta), cfg, options) for meta in (True, False)
    )
    _same_run(lazy, eager, world)


def test_big_presets_start_on_meta_with_tp():
    """``layershard train`` builds a 1B+ preset on the meta device with ``--tp`` too."""
    from layershard.train.config import resolve
    from layershard.train.modeling import model_spec, starts_on_meta

    for model, meta in (("tiny", False), ("llama-1b", True)):
        cfg = resolve({"tp": TP, "model": model})
        assert starts_on_meta(*model_spec(cfg, 128256)[:2]) == meta, model  # Llama 3 vocab


checks2.check(_full, "full_matches_one_process")
checks2.check(_bf16, "bf16_as_close_as_without_tp")
checks2.check(_norm_control, "replicated_counted_tp_times_is_caught")
checks2.check(_rewrap_control, "missing_rewrap_is_caught")
checks2.check(_qwen3_norm_control, "qwen3_norm_grads_not_all_reduced_are_caught")
checks2.check(_refusals, "unsupported_is_refused")
checks4.check(_full, "full_matches_one_process")
checks4.check(_parallelize, "parallelize_tp_equals_the_mesh_by_hand")
checks4.check(_meta_llama, "meta_llama_equals_eager")
checks4.check(_local_of_full, "local_of_full_as_distribute_tensor")
checks4.check(_meta_hf, "meta_hf_equals_meta_without_tp")
checks4.check(_meta_train, "meta_train_build_equals_eager")
checks4.check(_grad_op, "grad_op_matches_one_process")
checks4.check(_hf, "hf_llama_matches_one_process")
checks4.check(_qwen3, "hf_qwen3_norms_replicated_matches_one_process")
checks4.check(_no_shard, "no_shard_matches_one_process")
checks4.check(_hybrid, "hybrid_checkpointed_matches_one_process")
checks4.check(_round_trip, "full_state_dict_round_trip")
checks4.check(_tp_collectives, "tp_collectives_unchanged")
checks4.check(_no_sync, "no_sync_accumulates")
checks4.check(_frozen_offload, "frozen_tp_weights_with_offload")
checks4.check(_large_head, "tp_unit_larger_than_a_block")
checks2.collect(globals())
checks4.collect(globals())


def test_hf_plan_styles():
    """transformers' plain TP styles become torch's, Qwen3's q/k norms (replicated, gradients
    all-reduced over TP) ours; a style of transformers' own experts' hooks (``packed_colwise``:
    Qwen3-MoE's experts, which expert parallelism splits instead) is refused."""
    import transformers

    plan = hf_tp.hf_tp_plan(transformers.LlamaConfig())
    assert isinstance(plan["layers.*.self_attn.q_proj"], ColwiseParallel)
    assert isinstance(plan["layers.*.mlp.down_proj"], RowwiseParallel)
    plan = hf_tp.hf_tp_plan(transformers.Qwen3Config())
    assert isinstance(plan["layers.*.self_attn.q_norm"], hf_tp.ReplicatedOverHeads)
    with pytest.raises(NotImplementedError, match="packed_colwise"):
        hf_tp.hf_tp_plan(transformers.Qwen3MoeConfig())
    plan = hf_tp.hf_tp_plan(transformers.Qwen3MoeConfig(), experts=False)
    assert not any(".experts" in k for k in plan)
