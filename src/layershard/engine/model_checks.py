"""What ``shard()`` refuses before it builds anything, each in one line naming the cause:

- a module with parameters shared by two units (the same ``nn.Module`` object under two blocks):
  its parameters can live in one unit's flat storage only, so the other unit would run it with
  the rank's 1-D slice (a shape error in forward). Shared *parameters* are fine: they go to the
  root unit (tied embeddings);
- a trainable floating-point parameter that is not fp32: layershard keeps fp32 master weights
  (the flat storage, the gradients and the optimizer state are fp32), so a bf16 one would be
  converted silently, doubling its memory and changing the dtype its module computes in. FSDP2
  refuses a unit whose parameters have different dtypes; here the recipe is the one FSDP2
  documents for bf16 training: fp32 parameters and ``mixed_precision=MixedPrecision(bf16)``.
  A *frozen* one (a model loaded in bf16, its embedding, head and norms frozen under QLoRA) has
  no master, gradient or optimizer state: it is kept sharded in its own dtype in a flat group of
  its own (``build._by_dtype``) and cast into the gather slot's (compute) dtype by the gather.
  4-bit weights are stored as their packed bytes (``four_bit.py``, which says what it refuses);
- experts split for expert parallelism (parallel/expert.py) without the expert mesh that says
  which ranks hold the same experts, or split over a different number of ranks than its ``ep``;
- ranks that disagree on the model or the options: every rank hashes its unit layout (units,
  parameter names, shapes, dtypes, ``requires_grad``, and the options that decide the
  collectives) and the ranks compare the hashes (one small all-gather); on a mismatch they
  exchange the layouts and name the first difference, instead of hanging in the first
  collective until the process group's timeout.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from layershard.engine.four_bit import is_packed
from layershard.engine.param_kind import expert_part
from layershard.engine.units import UnitSpec


def _unit_of(name: str, specs: list[UnitSpec]) -> str:
    return next((s.name for s in specs if s.owns(name)), "<root>")  # units do not nest


def check_experts(specs: list[UnitSpec], sharding) -> None:
    for s in specs:
        for p, uses in s.params:
            part = expert_part(p)
            if part is None:
                continue
            if sharding.expert_group is None and sharding.ep_group is None:
                raise ValueError(
                    f"shard(): {uses[0].name} holds some experts only (expert parallelism) but "
                    "no expert_mesh was given; use ls.parallelize(model, ep=...), or pass "
                    "expert_mesh= (dims 'efsdp', 'ep') with the mesh the experts were split over"
                )
            if part.whole[0] != p.shape[0] * sharding.ep_size:
                raise ValueError(
                    f"shard(): {uses[0].name} holds {p.shape[0]} of {part.whole[0]} "
                    f"experts, but the expert mesh's ep is {sharding.ep_size}: split the "
                    "experts over the expert mesh's 'ep' dimension"
                )


def check_shared_modules(model: nn.Module, specs: list[UnitSpec]) -> None:
    """Refuse a module with parameters that two units reach under different names."""
    unit_roots = {id(m) for s in specs for m in s.modules}
    names: dict[int, list[str]] = {}
    modules: dict[int, nn.Module] = {}
    for name, m in model.named_modules(remove_duplicate=False):
        names.setdefault(id(m), []).append(name)
        modules[id(m)] = m
    for key, aliases in names.items():
        if len(aliases) < 2 or key in unit_roots:  # a unit called under two names is one unit
            continue
        if next(modules[key].parameters(), None) is None:  # buffers only: not sharded
            continue
        units = sorted({_unit_of(n, specs) for n in aliases})
        if len(units) > 1:
            raise ValueError(
                f"shard(): module {aliases[0]} is also {aliases[1]}: one module with parameters "
                f"shared by units {units[0]} and {units[1]}; a unit's parameters live in its own "
                "storage only. Give each block its own module and tie the parameters instead "
                f"({aliases[1]}.weight = {aliases[0]}.weight: tied parameters are supported), or "
                "pass layers= so that both uses fall in one unit"
            )


def check_dtypes(specs: list[UnitSpec]) -> None:
    """Refuse trainable floating-point parameters that are not fp32 (see the module
    docstring); frozen ones are kept in their dtype."""
    for s in specs:
        for p, uses in s.params:
            if is_packed(p):  # 4-bit bytes, whatever dtype carries them (four_bit.py)
                continue
            if p.requires_grad and p.is_floating_point() and p.dtype != torch.float32:
                dtype = str(p.dtype).removeprefix("torch.")
                raise ValueError(
                    f"shard(): trainable parameter {uses[0].name} is {dtype}; layershard keeps "
                    "fp32 master weights for what it trains (frozen parameters may stay "
                    f"{dtype}). Make the trainable parameters fp32 (e.g. "
                    "peft's autocast_adapter_dtype, or .float() on them) and pass mixed_precision="
                    "ls.MixedPrecision(param_dtype=torch.bfloat16) to compute in bf16"
                )


def layout(specs: list[UnitSpec], options: dict[str, Any]) -> list[Any]:
    """This rank's unit layout: what every rank must agree on for the collectives to match."""
    out: list[Any] = [["options", sorted((k, str(v)) for k, v in options.items())]]
    for s in specs:
        params = [
            [uses[0].name, list(p.shape), str(p.dtype), p.requires_grad] for p, uses in s.params
        ]
        out.append([s.name, s.is_block, params])
    return out


def _first_difference(a: list[Any], b: list[Any]) -> str:
    if a[0] != b[0]:
        ka, kb = dict(a[0][1]), dict(b[0][1])
        k = next(k for k in sorted({*ka, *kb}) if ka.get(k) != kb.get(k))
        return f"shard option {k}: {ka.get(k)} on rank 0, {kb.get(k)} there"
    ua, ub = a[1:], b[1:]
    for i, (x, y) in enumerate(zip(ua, ub)):
        if x[0] != y[0]:
            return f"unit {i} is {x[0]} on rank 0, {y[0]} there"
        for p, q in zip(x[2], y[2]):
            if p != q:
                return (
                    f"in unit {x[0]}, rank 0 has {p[0]} {tuple(p[1])} {p[2]}, there "
                    f"{q[0]} {tuple(q[1])} {q[2]}" + ("" if p[3] == q[3] else " (requires_grad)")
                )
        if len(x[2]) != len(y[2]):
            return f"unit {x[0]} has {len(x[2])} parameters on rank 0, {len(y[2])} there"
    return f"{len(ua)} units on rank 0, {len(ub)} there"


def check_same_layout(group: dist.ProcessGroup, mine: list[Any]) -> None:
    """Collective: raise on every rank, naming the first difference, when the ranks' layouts
    differ. Costs one all-gather of a 16-byte hash per rank (and the layouts on a mismatch)."""
    world = dist.get_world_size(group)
    if world == 1:
        return
    digest = hashlib.sha256(json.dumps(mine).encode()).hexdigest()[:16]
    hashes: list[Any] = [None] * world
    dist.all_gather_object(hashes, digest, group=group)
    if len(set(hashes)) == 1:
        return
    layouts: list[Any] = [None] * world
    dist.all_gather_object(layouts, mine, group=group)
    ranks = dist.get_process_group_ranks(group)
    other = next(i for i, h in enumerate(hashes) if h != hashes[0])
    diff = _first_difference(layouts[0], layouts[other]).replace("there", f"on rank {ranks[other]}")
    raise ValueError(
        f"shard(): the ranks shard different models or with different options ({diff}); every "
        "rank must build the same model and call shard() with the same arguments"
    )
