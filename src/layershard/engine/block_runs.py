"""A unit of several blocks (``blocks_per_unit=K``, a list of blocks in ``layers=``) at run time:
gathered by its first block's forward and released after its last one's, so its blocks must run
one after another, in order, with no other unit between them, and every one of them in every
forward of the model (not called on their own). ``BlockRuns`` follows the unit
between its first and last block and refuses what would compute on weights no longer (or not
yet) gathered, in one line that says what to do.

A reentrant activation checkpoint is refused too: it recomputes each block in a backward of its
own, and the unit's post-backward (the backward of the one autograd Function whose outputs are
all its weights, docs/engine.md rule 6) would run after the first block's, with the other
blocks' gradients still to come. The non-reentrant checkpoint (``ls.shard``'s, transformers'
default) recomputes inside the one backward and is fine.
"""

from __future__ import annotations

import torch
from torch import nn

from layershard.engine.units import Unit


class BlockRuns:
    def __init__(self) -> None:
        self.open: Unit | None = None  # a unit of several blocks between its first and last
        self.next = 0  # the index of the open unit's block that must run next

    def enter(self, u: Unit, grad_forward: bool, in_model_forward: bool) -> None:
        """``u``'s forward begins (its first block's pre-forward, outside backward)."""
        if self.open is not None:
            raise RuntimeError(
                f"layershard: unit {u.name} ran before block {self.next} of unit "
                f"{self.open.name}, several blocks gathered as one, which must run one after "
                "another with nothing between; group only blocks the model calls in sequence"
            )
        if len(u.modules) == 1:
            return
        if not in_model_forward:
            raise RuntimeError(
                f"layershard: unit {u.name} is several blocks gathered as one, which run only "
                "inside the model's forward (a block was called on its own); call the model, "
                "or keep one block per unit"
            )
        inside = grad_forward and not torch.is_grad_enabled()  # a reentrant checkpoint, no_grad
        if inside or (torch.is_grad_enabled() and any(map(_hf_reentrant, u.modules))):
            raise RuntimeError(
                f"layershard: unit {u.name} is several blocks gathered as one, run without grad "
                "inside a forward that records gradients: under a reentrant activation "
                "checkpoint, which recomputes each block in a backward of its own that one "
                "unit cannot span, or in a no_grad region. Checkpoint without reentrance (HF: "
                "gradient_checkpointing_kwargs={'use_reentrant': False}; or "
                "ls.shard(activation_checkpointing=K)), or keep one block per unit"
            )
        self.open, self.next = u, 1

    def check(self, u: Unit, i: int) -> None:
        """Block ``i`` > 0 of ``u`` begins its forward (outside backward)."""
        if self.open is not u or i != self.next:
            raise RuntimeError(
                f"layershard: unit {u.name} is several blocks gathered as one, which must run "
                f"one after another in that order, but its block {i} ran "
                + (f"after block {self.next - 1}" if self.open is u else "outside the unit")
                + "; group only blocks the model calls in sequence (shard(layers=[[...], ...]) "
                "or blocks_per_unit=)"
            )
        self.next += 1

    def reset(self) -> None:
        """A new forward: what one that raised left open is over."""
        self.open = None

    def leave(self, u: Unit) -> None:
        if self.open is u:
            self.open = None

    def finish(self) -> None:
        """The model's forward returned: no unit may be left open (a block skipped)."""
        u, self.open = self.open, None
        if u is not None:
            raise RuntimeError(
                f"layershard: unit {u.name} is several blocks gathered as one, but its block "
                f"{self.next} did not run in this forward; every block of such a unit must run "
                "in every forward (no layer dropping or early exit inside a unit): keep one "
                "block per unit"
            )


def _hf_reentrant(module: nn.Module) -> bool:
    """Will transformers checkpoint ``module``'s forward with a reentrant checkpoint (its
    ``gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})``,
    which checkpoints ``forward`` inside the module's hooks)?"""
    fn = getattr(module, "_gradient_checkpointing_func", None)
    on = getattr(module, "gradient_checkpointing", False) is True and module.training
    return on and fn is not None and getattr(fn, "keywords", {}).get("use_reentrant", True)
