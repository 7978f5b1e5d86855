"""Finding the units of a model.

A unit is what is gathered and reduced as one: each repeated block (by default the children of the
longest ``nn.ModuleList`` of same-class modules, e.g. a Llama's decoder layers), plus one extra unit
per top-level module outside the blocks that owns parameters (embeddings, final norm, LM head).
Several consecutive blocks may make one unit (``layers=[[b0, b1], ...]`` or ``blocks_per_unit``):
one collective for all of them, where a unit per block would pay each collective's latency.
Parameters reachable from two units (tied embeddings) or owned directly by a module above the blocks
go to the *root unit*, which stays gathered from the model's forward to the end of its backward.
Every parameter belongs to exactly one unit.

``find_units`` describes them (``UnitSpec``); ``Unit`` is a unit at run time: its flat groups,
its gather slot, and its weight attributes bound to gathered buffers or to the rank's slices.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.profiler import record_function

from layershard.engine.buffers import GatherSlot
from layershard.engine.flat import FlatParam, ParamSlot, ParamUse, view_keys


@dataclass
class UnitSpec:
    name: str
    # its modules in the order they run (one, or several consecutive blocks): the first one's
    # forward gathers the unit, the last one's ends its forward; none for the root unit
    modules: list[nn.Module]
    is_block: bool
    params: list[tuple[nn.Parameter, list[ParamUse]]] = field(default_factory=list)
    module_names: list[str] = field(default_factory=list)

    @property
    def module(self) -> nn.Module | None:
        """The module whose forward gathers the unit (None: the root unit)."""
        return self.modules[0] if self.modules else None

    def owns(self, module_name: str) -> bool:
        """Is ``module_name`` one of the unit's modules or inside one?"""
        return any(module_name == n or module_name.startswith(n + ".") for n in self.module_names)


def backward_needs_weights(spec: UnitSpec) -> bool:
    """False when every use of the unit's parameters is a plain ``nn.Embedding`` lookup.

    An embedding's backward scatters the output gradient into rows of the weight's gradient: it
    needs the indices, never the weight, so such a unit is not re-gathered for its backward (one
    all-gather of a V x d table less per step). Anything else, including subclasses that override
    ``forward`` or embeddings that renormalize (``max_norm``), is assumed to need its weights.
    """
    for _, uses in spec.params:
        for use in uses:
            m = use.module
            plain = isinstance(m, nn.Embedding) and type(m).forward is nn.Embedding.forward
            if not (plain and use.attr == "weight" and m.max_norm is None and not m.sparse):
                return True
    return False


def find_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of the longest ``nn.ModuleList`` whose children all share one class."""
    best: list[nn.Module] = []
    for mod in model.modules():
        if isinstance(mod, nn.ModuleList) and len(mod) > len(best):
            classes = {type(m) for m in mod}
            if len(classes) == 1:
                best = list(mod)
    return best


def _resolve_layers(model: nn.Module, layers, blocks_per_unit: int = 1) -> list[list[nn.Module]]:
    """The blocks as units: a list of modules per unit (one module, or several that run one
    after another)."""
    if layers is None:
        layers = find_blocks(model)
    if isinstance(layers, nn.Module) and not isinstance(layers, nn.ModuleList):
        layers = [layers]
    names = dict((id(m), n) for n, m in model.named_modules())

    def resolve(layer, where: str) -> nn.Module:
        if isinstance(layer, str):
            try:
                layer = model.get_submodule(layer)
            except AttributeError:
                raise ValueError(
                    f"shard(layers=...): {layer!r} is not a submodule name of the model; "
                    "pass module objects or names from model.named_modules()"
                ) from None
        if not isinstance(layer, nn.Module) or id(layer) not in names or layer is model:
            raise ValueError(
                f"shard(layers=...): {where} ({type(layer).__name__}) is not a submodule of "
                "the model passed to shard(); pass modules of that model (e.g. model.layers)"
            )
        return layer

    groups: list[list[nn.Module]] = []
    for i, entry in enumerate(layers):
        # a list, or a ModuleList that is not the model's own (a slice: model.layers[:2])
        group = isinstance(entry, (list, tuple)) or (
            isinstance(entry, nn.ModuleList) and id(entry) not in names
        )
        if group:
            if not entry:
                raise ValueError(f"shard(layers=...): layers[{i}] is an empty group")
            groups.append([resolve(x, f"layers[{i}][{j}]") for j, x in enumerate(entry)])
        else:
            groups.append([resolve(entry, f"layers[{i}]")])
    if blocks_per_unit > 1 and any(len(g) > 1 for g in groups):
        raise ValueError("shard(): pass blocks_per_unit= or groups of blocks in layers=, not both")
    if blocks_per_unit > 1:  # consecutive blocks merged, blocks_per_unit at a time
        groups = [
            [m for g in groups[i : i + blocks_per_unit] for m in g]
            for i in range(0, len(groups), blocks_per_unit)
        ]
    block_names = [names[id(m)] for g in groups for m in g]
    if len(set(block_names)) < len(block_names):
        twice = next(n for n in block_names if block_names.count(n) > 1)
        raise ValueError(f"shard(layers=...): {twice!r} is given twice; a module is in one unit")
    for a in block_names:
        for b in block_names:
            if a != b and b.startswith(a + "."):
                raise ValueError(
                    f"shard(layers=...): {b!r} is nested inside {a!r}; units must not nest"
                )
    return groups


def find_units(
    model: nn.Module, layers: Iterable | None = None, blocks_per_unit: int = 1
) -> list[UnitSpec]:
    """Units in registration order: the root unit first (if any), then blocks and extra units.
    A unit of several blocks is named for its modules joined by ``+``."""
    groups = _resolve_layers(model, layers, blocks_per_unit)
    named = list(model.named_modules())
    name_of = {id(m): n for n, m in named}
    # each block module's name -> its unit's key, the name of the unit's first module
    unit_key = {name_of[id(m)]: name_of[id(g[0])] for g in groups for m in g}
    block_names = set(unit_key)

    def inside_block(name: str) -> str | None:
        for b in block_names:
            if name == b or name.startswith(b + "."):
                return b
        return None

    def is_ancestor(name: str) -> bool:  # strictly above some block
        return name == "" or any(b.startswith(name + ".") for b in block_names)

    # Each module is owned by a unit root: a block, an extra unit, or the root ("").
    owner_of: dict[str, str] = {}
    extra_roots: list[str] = []
    for name, _ in named:
        b = inside_block(name)
        if b is not None:
            owner_of[name] = unit_key[b]
        elif is_ancestor(name):
            owner_of[name] = ""
        else:
            parent = name.rpartition(".")[0]
            if owner_of.get(parent, "") == "" and is_ancestor(parent):
                extra_roots.append(name)
                owner_of[name] = name
            else:
                owner_of[name] = owner_of[parent]

    # Where is each parameter used? (identity, so tied parameters are found)
    uses: dict[int, list[ParamUse]] = {}
    param_of: dict[int, nn.Parameter] = {}
    for mod_name, mod in named:
        for attr, p in mod._parameters.items():
            if p is None:
                continue
            full = f"{mod_name}.{attr}" if mod_name else attr
            uses.setdefault(id(p), []).append(ParamUse(full, mod, attr))
            param_of[id(p)] = p

    modules = dict(named)
    specs: dict[str, UnitSpec] = {"": UnitSpec("<root>", [], False)}
    by_key = {name_of[id(g[0])]: g for g in groups}
    for name, _ in named:
        if name in by_key:  # units of blocks in the order of their first module
            g = by_key[name]
            member_names = [name_of[id(m)] for m in g]
            specs[name] = UnitSpec("+".join(member_names), g, True, [], member_names)
        elif name in extra_roots:
            specs[name] = UnitSpec(name, [modules[name]], False, [], [name])
    for pid, us in uses.items():
        unit_names = {owner_of[u.name.rpartition(".")[0]] for u in us}
        home = unit_names.pop() if len(unit_names) == 1 else ""  # tied across units -> root
        specs[home].params.append((param_of[pid], us))
    return [s for s in specs.values() if s.params]


class Unit:
    """A unit's flat groups (trainable first, then frozen) and its places in the slots."""

    def __init__(
        self,
        name: str,
        modules: list[nn.Module],
        is_block: bool,
        flats: list[FlatParam],
        slot: GatherSlot,
        device: torch.device,
        gather_in_backward: bool = True,
    ):
        self.name, self.modules, self.is_block = name, modules, is_block
        self.flats, self.slot = flats, slot
        self.gather_in_backward = gather_in_backward  # False: an embedding (see units.py)
        # its trainable flat groups: one, and a second of experts in an expert-parallel layer
        self.trainables = [f for f in flats if f.requires_grad]
        self.param_slots: list[ParamSlot] = [s for f in flats for s in f.slots]
        self.flat_offsets, off = [], 0
        for f in flats:
            self.flat_offsets.append(off)
            off += f.padded_numel
        self.gather_numel = off
        # each parameter view's place in the gathered buffer (the saved-tensor hooks' keys)
        self.view_keys = view_keys(
            [
                (o + s.offset, torch.Size(s.shape))
                for f, o in zip(flats, self.flat_offsets)
                for s in f.slots
            ]
        )
        self._views: tuple[int, list[torch.Tensor]] | None = None  # see full_views
        self.anchor = torch.empty(0, device=device, requires_grad=True)
        # reshard_after_forward=K: per flat, this rank's 1/K of the gathered weights, kept from
        # the forward to the backward, which gathers within the K ranks (see strategy.py)
        self.secondary: list[torch.Tensor] | None = None
        self.bound = False
        self.span: record_function | None = None  # profiler label of the compute in progress

    @property
    def module(self) -> nn.Module | None:
        """The module whose forward gathers the unit (None: the root unit); the forward of the
        last of ``modules`` ends the unit's (the same module but for several blocks)."""
        return self.modules[0] if self.modules else None

    @property
    def acc_dirty(self) -> bool:
        """Its gradients wait in the fp32 accumulator (``no_sync``), not yet reduced."""
        return any(f.acc_dirty for f in self.trainables)

    @property
    def full_views(self) -> list[torch.Tensor]:
        """Full-size views of the gathered weights in the slot (see buffers.py for why
        ``alias``); kept for a preallocated slot, made at each bind for a transient one (kept
        views would keep its freed storage alive)."""
        s = self.slot
        if self._views is not None and self._views[0] == s.generation:
            return self._views[1]
        assert s.alias is not None, f"{self.name}: its storage is not allocated"
        views = [
            v
            for f, o in zip(self.flats, self.flat_offsets)
            for v in f.views(s.alias[o : o + f.padded_numel])
        ]
        if not s.transient:
            self._views = (s.generation, views)
        return views

    def __repr__(self) -> str:
        return f"Unit({self.name})"

    def trainable_grads(self, grads: tuple) -> list[tuple[FlatParam, tuple]]:
        """``grads`` (one per parameter, in ``param_slots`` order) split by trainable flat
        group (whose slots come first)."""
        out, start = [], 0
        for f in self.trainables:
            out.append((f, grads[start : start + len(f.slots)]))
            start += len(f.slots)
        return out

    def check_requires_grad(self) -> None:
        """``shard()`` split the unit into trainable and frozen shards; a flag changed since
        then would be ignored (a frozen slice still trained, or an unfrozen one never)."""
        for f in self.flats:
            for slot, p in zip(f.slots, f.shard_params):
                if p.requires_grad != f.requires_grad:
                    raise RuntimeError(
                        f"layershard: {slot.name}.requires_grad changed to {p.requires_grad} "
                        "after shard(): freeze or unfreeze parameters before ls.shard(), which "
                        "splits each unit into trainable and frozen shards (to change it "
                        "later, shard the model again)"
                    )

    def bind(self, tensors: list[torch.Tensor] | tuple[torch.Tensor, ...]) -> None:
        """Make the modules' weight attributes resolve to ``tensors`` (plain tensors, which
        shadow the registered slices while bound)."""
        for slot, t in zip(self.param_slots, tensors):
            t = slot.kind.bind(t)  # 4-bit bytes with their state, a DTensor, fp8 bytes...
            for use in slot.uses:
                use.module.__dict__[use.attr] = t
        self.bound = True

    def unbind(self) -> None:
        """Weight attributes resolve to the registered 1-D slices again."""
        if self.bound:
            for slot in self.param_slots:
                for use in slot.uses:
                    use.module.__dict__.pop(use.attr, None)
            self.bound = False

    def open_span(self, what: str) -> None:
        if torch.autograd.profiler._is_profiler_enabled:
            self.close_span()
            self.span = record_function(f"layershard::{what}[{self.name}]")
            self.span.__enter__()

    def close_span(self) -> None:
        if self.span is not None:
            span, self.span = self.span, None
            span.__exit__(None, None, None)
