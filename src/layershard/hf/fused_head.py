"""trl's fused LM head on a sharded model.

trl's trainers (SFT, DPO, KTO, GRPO, RLOO) replace the model's ``forward`` on the instance
(``trl.trainer.utils.add_fused_lm_head``): with ``fused_lm_head=True`` it runs the backbone, then
reads ``get_output_embeddings().weight`` directly and feeds it to a chunked log-prob kernel that
saves it for backward. The LM head's own ``forward`` never runs, so layershard's hooks never
gather it: the kernel would read the rank's 1-D slice.

The bridge makes that read a forward of the head: for the duration of a fused call,
``get_output_embeddings()`` returns a stand-in whose ``weight`` / ``bias`` come out of one call
of the real head module, with its ``forward`` swapped for "return your weights". The unit's hooks
then gather and bind the head as for any forward, the kernel's gradient for the weight flows back
through the unit's own backward (so it is reduce-scattered), and the tensors the kernel saved stay
valid until its backward: the head is the last unit of the forward, so nothing refills its buffer
before backward reaches it (the same reason a plain ``nn.Linear`` head is not re-gathered).
A tied head (in layershard's root unit, gathered for the whole step) needs no gather; the same
call returns its bound full weight.

The public API has no "keep this unit gathered through backward" (FSDP2's tail unit with
``reshard_after_forward=False``); with it, this module would reduce to a ``shard()`` option.
"""

from __future__ import annotations

import inspect
import types
from typing import Any

import torch
from torch import nn


def bridge_fused_lm_head(model: nn.Module) -> None:
    """Wrap trl's fused ``forward`` on every submodule of ``model`` that has one (the base model
    under PEFT); a no-op for models trl did not patch. Idempotent."""
    for m in model.modules():
        fused = m.__dict__.get("forward")
        if fused is None or m.__dict__.get(_MARK):
            continue
        try:
            params = inspect.signature(fused, follow_wrapped=False).parameters
        except (TypeError, ValueError):
            continue
        if "fused_lm_head" not in params or not hasattr(m, "get_output_embeddings"):
            continue
        m.forward = types.MethodType(_bridged(fused), m)
        object.__setattr__(m, _MARK, True)


_MARK = "_layershard_fused_head_bridge"  # on a module whose forward is bridged


def _bridged(fused):
    def forward(self: Any, *args: Any, fused_lm_head: bool = False, **kwargs: Any):
        if not fused_lm_head:
            return fused(*args, **kwargs)
        stand_in = _HeadWeights(self.get_output_embeddings())
        self.get_output_embeddings = lambda: stand_in  # this instance, this call only
        try:
            return fused(*args, fused_lm_head=True, **kwargs)
        finally:
            del self.get_output_embeddings

    return forward


class _HeadWeights:
    """What the fused kernel reads in place of the head: its gathered ``weight`` and ``bias``,
    produced by one forward of the head module (on first access, then kept for this call)."""

    def __init__(self, head: nn.Module):
        self._head = head
        self._gathered: tuple[torch.Tensor, torch.Tensor | None] | None = None

    def _get(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        if self._gathered is None:
            head = self._head
            head.forward = _own_weights.__get__(head)
            try:
                self._gathered = head(torch.empty(0))
            finally:
                del head.forward
        return self._gathered

    @property
    def weight(self) -> torch.Tensor:
        return self._get()[0]

    @property
    def bias(self) -> torch.Tensor | None:
        return self._get()[1]


def _own_weights(self: Any, _unused: torch.Tensor):
    # Views, not the bound tensors themselves: new autograd nodes whose gradient marks the start
    # of the head's backward (layershard's pre-backward hook sits on a unit's outputs).
    bias = getattr(self, "bias", None)
    return self.weight.view_as(self.weight), None if bias is None else bias.view_as(bias)
