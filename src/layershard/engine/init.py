"""Filling the shards at ``shard()`` time, and materializing a model built on the meta device.

A model on ``meta`` is materialized and initialized on the CPU, one unit at a time, and each rank
keeps its slice of every parameter. Every rank draws the same random numbers (the whole model's
init, from the CPU generator whatever the shards' device), so a meta-built model is the same at any
world size and on CPU or GPU for one seed.

Which function initializes which module, and in what order:

- Hugging Face models (``transformers.PreTrainedModel``, with the default ``param_init_fn`` or the
  model's own ``_init_weights``): HF's contract, ``PreTrainedModel.initialize_weights``. Children
  first, then every parent, parameterless ones included (GPT-2's attention rescales its ``c_proj``
  by depth, T5's attention and FFN modules scale their ``Linear`` children); each module goes to the
  ``_initialize_weights`` of the nearest ``PreTrainedModel`` at or above it (T5's encoder and
  decoder stacks are models of their own). Tied weights are initialized as HF's eager construction
  does, untied then tied: the tie's source (``all_tied_weights_keys``) keeps its init, and the other
  names of the tensor get a meta stand-in whose writes are dropped, as the copies they stand for
  are dropped by eager's ``tie_weights()`` (this is what keeps an embedding's padding row zero when
  the LM head shares it).
- Any other ``param_init_fn``: called as ``model.apply(param_init_fn)`` would, children first, on
  every module whose subtree holds a meta tensor.
- Otherwise each module that owns meta tensors runs its own ``reset_parameters()``, in
  ``model.modules()`` order: a model whose modules draw their random numbers only there (such as
  ``layershard.models.LlamaForCausalLM``) comes out bitwise equal to eager construction.

Tensor and expert parallelism (a model parallelized on meta: ``DTensor`` parameters over meta
local tensors; an expert layer split over EP ranks, each parameter holding this rank's experts):
while its module's init runs, such a parameter is a plain tensor of its whole shape (the global
shape; all experts), so every init above sees ordinary tensors and draws the random numbers of
the same model without TP or EP; ``_store`` keeps this rank's part of it (``_part``: its TP part,
a slice of the CPU tensor, or its experts) and its slice of that. The model then equals the model
built without TP or EP and parallelized afterwards, bit for bit, whichever init it took.

Memory: a block is materialized while its subtree is initialized, its slices are stored and its
full tensors (whole: not TP parts, all experts) dropped before the next block starts. Every tensor
outside the blocks (embeddings, LM head, final norms, positional tables, parameters owned above the
blocks, tied parameters) stays materialized from its module's init to the end, because any
ancestor, down to the root, may still write to it (T5's root re-initializes ``shared``). At any
moment a rank holds, besides its shards: the full tensors of the units outside the blocks
initialized so far, plus those of one block; meta stand-ins for tied names cost nothing. (A unit
outside the blocks is whatever find_units makes it: T5's whole decoder when the encoder's blocks
are the ``layers``.) Module buffers are materialized whole and stay (they are not sharded).

An init that touches a block already stored (a parent above the blocks rescaling a block's weight)
raises instead of writing into a meta tensor, and so does a tensor that no init wrote to at all
(it would hold uninitialized memory; a partial write is not detected). The model gets its meta
tensors back on any error.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import sys
import weakref
from collections.abc import Callable
from typing import Any, cast

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from layershard.engine import dtensor
from layershard.engine.flat import FlatParam, ParamSlot
from layershard.engine.param_kind import expert_part
from layershard.engine.units import UnitSpec

log = logging.getLogger(__name__)


@torch.no_grad()
def fill_shards(
    model: nn.Module,
    specs: list[UnitSpec],
    slot_of: dict[int, tuple[FlatParam, ParamSlot]],
    device: torch.device,
    param_init_fn: Callable[[nn.Module], None] | None,
) -> None:
    """Copy this rank's slice of every parameter of ``model`` into its flat shard.

    Parameters on the meta device (DTensors of meta tensors too) are materialized and
    initialized first, unit by unit (see the module docstring); their modules get the original
    meta parameters back. Module buffers on meta are materialized on the CPU, initialized and left
    in the modules. ``device`` is where the shards live; the values are computed on the CPU
    regardless and copied slice by slice.
    """
    del device  # the shards already live there; init always runs on the CPU (see above)
    if any(t.is_meta for m in model.modules() for t in _own_tensors(m)):
        _Materializer(model, specs, slot_of, param_init_fn).run()
    for spec in specs:
        for p, _ in spec.params:
            if not p.is_meta:
                f, slot = slot_of[id(p)]
                f.copy_from_full(slot, dtensor.local(p))  # a DTensor: its local shard


def _whole_shape(p: torch.Tensor) -> torch.Size:
    """The shape an init sees for parameter ``p``: the whole tensor that this rank holds a part
    of (a DTensor's global shape; all experts of an expert-parallel layer), as without TP or EP."""
    part = expert_part(p)
    return p.shape if part is None else part.whole  # (a DTensor's shape is the global one)


def _part(p: torch.Tensor, whole: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``whole``, the initialized ``_whole_shape`` tensor of ``p``: its TP
    part (a slice on the CPU), or its experts (a contiguous range of the flattened whole)."""
    tp = dtensor.info(p)
    if tp is not None:
        return dtensor.local_of_full(tp, whole)
    part = expert_part(p)
    return whole if part is None else part.local_part(whole, p.shape)


def _hf_pretrained_class():
    tf = sys.modules.get("transformers")  # never import it: a model of its own imported it
    return getattr(tf, "PreTrainedModel", None) if tf is not None else None


class _InitWatch(TorchDispatchMode):
    """Sees every op an init function runs, for two checks.

    - Any op on a meta tensor other than a tied name's stand-in (or a view or ``.data`` of one):
      the tensors of the modules being initialized are all materialized, so such an op reads or
      writes a tensor that is not (a block already stored), and would be lost silently.
    - Which materialized tensors are written (an argument the op's schema marks mutable, whose
      storage is one of ours): a tensor that nothing wrote holds uninitialized memory.
    """

    def __init__(self, m: _Materializer):
        super().__init__()
        self.m = m
        # what an op touched on meta: the model's tensors by name (a `.data` alias has none of its
        # own, only the op that made it does), and the ops
        self.touched: set[str] = set()
        self.touched_ops: set[str] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        m = self.m
        metas = [
            t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_meta
        ]
        for i, arg in enumerate(func._schema.arguments):
            if arg.alias_info is None or not arg.alias_info.is_write:
                continue
            value = args[i] if i < len(args) else kwargs.get(arg.name)
            for t in tree_leaves(value):
                if isinstance(t, torch.Tensor) and not t.is_meta:
                    ptr = t.untyped_storage().data_ptr()
                    if ptr in m.watched:
                        m.written.add(ptr)
        out = func(*args, **kwargs)
        if metas:
            if all(m.is_standin(t) for t in metas):  # derived from stand-ins: dropped too
                for t in tree_leaves(out):
                    if isinstance(t, torch.Tensor) and t.is_meta:
                        m.standins[id(t)] = weakref.ref(t)
            else:
                self.touched |= {m.meta_names[id(t)] for t in metas if id(t) in m.meta_names}
                self.touched_ops.add(str(func))
        return out


class _Materializer:
    def __init__(
        self,
        model: nn.Module,
        specs: list[UnitSpec],
        slot_of: dict[int, tuple[FlatParam, ParamSlot]],
        param_init_fn: Callable[[nn.Module], None] | None,
    ):
        self.model, self.specs, self.slot_of = model, specs, slot_of
        pretrained = _hf_pretrained_class()
        self.hf_model = pretrained is not None and isinstance(model, pretrained)
        own_init = getattr(model, "_init_weights", None)
        self.hf = self.hf_model and (param_init_fn is None or param_init_fn == own_init)
        self.pretrained = pretrained
        is_custom = getattr(model, "is_custom_code", None)  # transformers >= 5
        self.custom_code = bool(is_custom()) if callable(is_custom) else False
        self.param_init_fn = param_init_fn
        self.post_order = self.hf or param_init_fn is not None
        self.names = {id(m): n for n, m in model.named_modules()}
        # names of the meta originals, for errors (a stored block's tensors are meta again)
        self.meta_names = {id(p): uses[0].name for s in specs for p, uses in s.params}
        self.blocks = {id(m): s for s in specs if s.is_block for m in s.modules}
        self.values: dict[int, nn.Parameter] = {}  # id(meta original) -> materialized tensor
        self.buffers: list[tuple[str, torch.Tensor]] = []
        # Storages (data_ptr) of the materialized tensors, and those an init wrote to.
        self.watched: set[int] = set()
        self.written: set[int] = set()
        self.standins: dict[int, weakref.ref] = {}
        self.visited: set[int] = set()
        self.live = self.peak = 0
        # Modules whose subtree holds a meta tensor: the only ones an init function runs on.
        self.needs: set[int] = set()
        modules = dict(model.named_modules())
        for name, m in modules.items():
            if any(t.is_meta for t in _own_tensors(m)):
                parts = name.split(".") if name else []
                for i in range(len(parts) + 1):
                    self.needs.add(id(modules[".".join(parts[:i])]))

    # -- the walk --

    def run(self) -> None:
        # On any error the model gets its meta tensors back, so that shard() can be called again
        # (with a param_init_fn, say) on the same model.
        before: list[tuple[dict[str, Any], str, torch.Tensor | None]] = [
            (tensors, n, t)
            for m in self.model.modules()
            for tensors in (m._parameters, m._buffers)
            for n, t in tensors.items()
            if t is not None and t.is_meta
        ]
        try:
            with contextlib.ExitStack() as stack:
                if self.hf_model:
                    self._untie()
                if self.hf:
                    stack.enter_context(self._hf_context())
                self._walk(self.model, self.model)
                for spec in self.specs:
                    if not spec.is_block:
                        self._store(spec)
            for name, b in self.buffers:
                if not self._written(b):
                    raise ValueError(self._unwritten_message(name))
        except BaseException:
            for tensors, n, t in before:
                tensors[n] = t
            raise
        log.debug(
            "meta init: peak %d bytes of full parameters materialized",
            self.peak,
            extra={"peak_bytes": self.peak},
        )

    def _walk(self, mod: nn.Module, owner: nn.Module) -> None:
        if id(mod) in self.visited or id(mod) not in self.needs:
            return
        self.visited.add(id(mod))
        if not self.post_order:
            self._init(mod, owner)
        for child in mod.children():
            # smart_apply's dispatch: a sub-model brings its own init
            is_model = self.hf and isinstance(child, self.pretrained)
            self._walk(child, child if is_model else owner)
        if self.post_order:
            self._init(mod, owner)
        spec = self.blocks.get(id(mod))
        if spec is not None and all(
            id(m) in self.visited or id(m) not in self.needs for m in spec.modules
        ):  # a unit of several blocks: once the last of them is initialized
            self._store(spec)  # only an ancestor could touch it now, and _InitWatch raises

    def _init(self, mod: nn.Module, owner: nn.Module) -> None:
        owns_meta = self._materialize(mod)
        name = self.names.get(id(mod)) or "<root>"
        param_init_fn = self.param_init_fn
        fn: Callable[[], object]
        if self.hf:
            fn = _hf_init(owner, mod, self.custom_code)
        elif param_init_fn is not None:
            fn = lambda: param_init_fn(mod)  # noqa: E731
        elif not owns_meta:
            return
        elif callable(reset := getattr(mod, "reset_parameters", None)):
            fn = reset
        else:
            raise ValueError(
                f"shard(): module {name} ({type(mod).__name__}) is on the meta device and has no "
                "reset_parameters(); pass param_init_fn= to shard()"
            )
        with _InitWatch(self) as guard:
            fn()
        if guard.touched_ops:
            what = ", ".join(sorted(guard.touched)[:3]) or f"a tensor ({min(guard.touched_ops)})"
            raise ValueError(
                f"shard(): initializing {name} ({type(mod).__name__}) touched "
                f"{what} on the meta device: meta init stores each "
                "block as soon as its own subtree is initialized, so an init above the blocks must "
                "not write into a block; initialize it from the block's own modules"
            )

    def _materialize(self, mod: nn.Module) -> bool:
        """Give ``mod``'s own meta tensors CPU storage; True if it had any."""
        found = False
        for n, p in mod._parameters.items():
            if p is None or not p.is_meta or self.is_standin(p):
                continue
            found = True
            t = self.values.get(id(p))
            if t is None:
                t = nn.Parameter(self._empty(p, _whole_shape(p)), requires_grad=p.requires_grad)
                self.values[id(p)] = t
                self.live += t.numel() * t.element_size()
                self.peak = max(self.peak, self.live)
            mod._parameters[n] = t
        for n, b in mod._buffers.items():
            if b is not None and b.is_meta:
                found = True
                buf = mod._buffers[n] = self._empty(b)
                self.buffers.append((_join(self.names.get(id(mod), ""), n), buf))
        return found

    def _empty(self, t: torch.Tensor, shape: torch.Size | None = None) -> torch.Tensor:
        """A CPU tensor like meta tensor ``t`` (of ``shape`` if given), watched for writes."""
        out = torch.empty(t.shape if shape is None else shape, dtype=t.dtype, device="cpu")
        if out.numel() > 0:
            ptr = out.untyped_storage().data_ptr()
            self.watched.add(ptr)
            self.written.discard(ptr)  # the address of a freed tensor may come back
        return out

    def _written(self, t: torch.Tensor) -> bool:
        ptr = t.untyped_storage().data_ptr()
        # not watched: an init replaced the storage (`p.data = tensor`), which is a write too
        return t.numel() == 0 or ptr in self.written or ptr not in self.watched

    def _store(self, spec: UnitSpec) -> None:
        """Copy this rank's slices of a finished unit and give its modules the meta originals."""
        for p, uses in spec.params:
            for use in uses:  # drops the materialized copy and any stand-in
                use.module._parameters[use.attr] = p
            t = self.values.pop(id(p), None)
            if t is None:
                if p.is_meta:
                    raise ValueError(
                        f"shard(): {uses[0].name} is on the meta device and no init reached it"
                    )
                continue  # a real tensor: copied with the others by fill_shards
            if not self._written(t):
                raise ValueError(self._unwritten_message(uses[0].name))
            self.watched.discard(t.untyped_storage().data_ptr())
            f, slot = self.slot_of[id(p)]
            f.copy_from_full(slot, _part(p, t))
            self.live -= t.numel() * t.element_size()

    def _unwritten_message(self, name: str) -> str:
        how = "HF's _init_weights" if self.hf else "param_init_fn" if self.param_init_fn else ""
        how = how or "its module's reset_parameters()"
        return (
            f"shard(): {name} was on the meta device and {how} did not write to it: "
            "it would start as uninitialized memory. Pass a param_init_fn= that initializes it"
        )

    # -- Hugging Face specifics --

    def _untie(self) -> None:
        """Give every name of a tied meta tensor but its source a meta stand-in (see the module
        docstring); `_store` puts the tensor back under every name."""
        # {target name: source name}; without it (transformers 4) the first name is the source
        targets = getattr(self.model, "all_tied_weights_keys", None)
        for spec in self.specs:
            for p, uses in spec.params:
                if len(uses) < 2 or not p.is_meta:
                    continue
                sources = uses[:1]
                if targets is not None:
                    sources = [u for u in uses if u.name not in targets] or sources
                for use in uses:
                    if not any(use is s for s in sources):
                        standin = nn.Parameter(torch.empty_like(p), requires_grad=p.requires_grad)
                        self.standins[id(standin)] = weakref.ref(standin)
                        use.module._parameters[use.attr] = standin

    def is_standin(self, t: torch.Tensor) -> bool:
        ref = self.standins.get(id(t))
        return ref is not None and ref() is t

    def _hf_context(self) -> contextlib.AbstractContextManager:
        # A module flagged _is_hf_initialized is skipped by _initialize_weights; on a module whose
        # tensors are on meta the flag is stale (HF's init run on a meta model, as under
        # accelerate's init_empty_weights(), flags every module and writes nothing).
        for m in self.model.modules():
            if id(m) in self.needs:
                m.__dict__.pop("_is_hf_initialized", None)
        guard = sys.modules.get("transformers.initialization")  # transformers >= 5
        guard = getattr(guard, "guard_torch_init_functions", None)
        return guard() if guard is not None else contextlib.nullcontext()


def _hf_init(owner: nn.Module, mod: nn.Module, custom_code: bool) -> Callable[[], None]:
    init = cast(Callable[..., None], owner._initialize_weights)  # a method, not a submodule
    if "is_custom_code" in inspect.signature(init).parameters:  # transformers >= 5
        return lambda: init(mod, custom_code)
    return lambda: init(mod)


def _own_tensors(m: nn.Module):
    yield from (p for p in m._parameters.values() if p is not None)
    yield from (b for b in m._buffers.values() if b is not None)


def _join(prefix: str, name: str) -> str:
    return f"{prefix}.{name}" if prefix else name
