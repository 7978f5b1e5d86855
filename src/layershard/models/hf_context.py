"""Context parallelism for transformers models: their attention routed through transformers'
``AttentionInterface`` to the ring or all-to-all attention of ``parallel/context``, with no copy
of the model's code.

``ls.parallelize(hf_model, cp=N, cp_mode=...)`` calls ``attach``, which

- registers ``context_attention`` in transformers' ``AttentionInterface`` as ``"layershard_cp"``
  and selects it (``model.set_attn_implementation``): every attention module then calls it with
  its q, k and v after its own projections, norms (Qwen3's q/k norms) and RoPE;
- gives each attention module (a module whose class name contains ``Attention``, the test
  transformers itself applies to find the modules that call the interface) the model's
  ``ContextParallel``, where ``context_attention`` finds the group and the mode: state held by
  the model, no global;
- checks each forward's keywords (a forward pre-hook): what a forward without
  ``context_batch``'s keywords would compute silently wrong is refused in one line.

What the forward is given (``parallel/context/batch.py``): ``position_ids``, the tokens' global
positions, from which transformers' rotary embedding computes RoPE; ``labels`` and
``shift_labels``, the labels shifted over the whole sequence (``ForCausalLMLoss`` takes
``shift_labels`` as they are, and the model computes a loss only when ``labels`` is given);
``num_items_in_batch``, the loss's divisor (batch.py's Note); for packed sequences
``document_ids``, which transformers passes down with the forward's other extra keywords to the
attention function of every layer, so that a checkpointed layer's recompute sees its own.

Refused, in one line: at ``attach``, a model whose attention does not go through the interface
(transformers' own ``_supports_attention_backend`` and ``_can_set_attn_implementation``), layers
that are not attention (``layer_types``: linear attention, state-space layers mix tokens
outside the attention), attention logit softcapping, and experts (their load-balancing loss is
not split with the sequence, as for the built-in MoE); at the forward, a sliding window shorter
than the sequence, attention dropout, a padding ``attention_mask``, attention sinks, and a
non-causal attention module.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
from torch import nn

from layershard.parallel.context import ContextParallel, positions
from layershard.parallel.expert import is_hf_experts

ATTENTION = "layershard_cp"
# the attention-shaping keywords of other models' attention calls, which this one cannot honour:
# Gemma 2's logit softcapping, gpt-oss's attention sinks
_REFUSED = {"softcap": "attention logit softcapping", "s_aux": "attention sinks"}
_LAYER_TYPES = {"full_attention", "sliding_attention"}


def context_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention function under context parallelism: ``query`` (batch, heads,
    local_seq, head_dim) and ``key``, ``value`` (batch, kv_heads, ...) of this rank's tokens in
    the load-balanced layout, RoPE applied with their global positions; returns this rank's rows
    of causal attention over the whole sequence, (batch, local_seq, heads, head_dim) as
    transformers expects, and no attention weights. ``kwargs``: the forward's extra keywords,
    ``document_ids`` (packed sequences) and ``sliding_window`` read."""
    ctx: ContextParallel | None = getattr(module, "context_parallel", None)
    name = type(module).__name__
    if ctx is None:
        raise ValueError(
            f"{name} calls layershard's context-parallel attention but has no ContextParallel: "
            "select attn_implementation='layershard_cp' through ls.parallelize(model, cp=...) only"
        )
    _check_attention(module, name, query.shape[2] * ctx.size, attention_mask, dropout, kwargs)
    out = ctx.attention(query, key, value, kwargs.get("document_ids"), scale=scaling)
    return out.transpose(1, 2).contiguous(), None


def _check_attention(
    module: nn.Module,
    name: str,
    seq: int,
    attention_mask: torch.Tensor | None,
    dropout: float,
    kwargs: dict[str, Any],
) -> None:
    """Refuse, in one line, what the ring and all-to-all attentions do not compute."""
    where = f"context parallelism ({name})"
    window = kwargs.get("sliding_window")
    # a window of w keys (transformers': key > query - w) at least as long as the sequence masks
    # nothing that causality does not: exact, so Mistral's default 4096 runs shorter sequences
    if window is not None and window < seq:
        raise ValueError(
            f"{where}: sliding-window attention (window {window} < sequence {seq}) is not "
            "supported; use sequences no longer than the window or sliding_window=None"
        )
    if attention_mask is not None:  # a 4-D mask a model made or was given: the forward's check
        raise ValueError(
            f"{where}: an attention mask is not supported; pack sequences (position_ids to "
            "context_batch) or right-pad them with labels -100"
        )
    if dropout:
        raise ValueError(f"{where}: attention dropout ({dropout}) is not supported; set it to 0")
    for key, what in _REFUSED.items():
        if kwargs.get(key) is not None:
            raise ValueError(f"{where}: {what} ({key}=) is not supported")
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{where}: non-causal attention is not supported (causal LMs only)")


def check(model: nn.Module, where: str) -> int:
    """Refuse, in one line, a transformers ``model`` that context parallelism cannot run (the
    module doc); returns its number of attention heads."""
    cls: Any = type(model)  # a PreTrainedModel's class (transformers is optional: untyped here)
    config: Any = model.config
    if not (
        getattr(cls, "_supports_attention_backend", False) and cls._can_set_attn_implementation()
    ):
        raise ValueError(
            f"{where}: {cls.__name__}'s attention does not go through transformers' "
            "AttentionInterface (_supports_attention_backend), which context parallelism needs"
        )
    others = sorted(set(getattr(config, "layer_types", None) or ()) - _LAYER_TYPES)
    if others:
        raise ValueError(
            f"{where}: layers of type {', '.join(others)} mix tokens outside the attention, "
            "which context parallelism does not split; attention layers only"
        )
    if getattr(config, "attn_logit_softcapping", None):
        raise ValueError(f"{where}: attention logit softcapping is not supported")
    if any(is_hf_experts(m) for m in model.modules()):
        raise ValueError(
            f"{where}: a mixture of experts is not supported with context parallelism yet (its "
            "load-balancing loss is not split with the sequence)"
        )
    return int(config.num_attention_heads)


def attach(model: nn.Module, context: ContextParallel) -> None:
    """Run ``model``'s attention under ``context`` (the module doc); ``check`` first."""
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION, context_attention)  # a dict entry: idempotent
    hf: Any = model  # a PreTrainedModel
    hf.set_attn_implementation(ATTENTION)
    if hf.config._attn_implementation != ATTENTION:  # transformers warns, does not raise
        raise ValueError(
            f"parallelize(cp={context.size}): {type(model).__name__} kept attn_implementation "
            f"{hf.config._attn_implementation!r}; its attention cannot be replaced"
        )
    hf.context_parallel = context
    for m in model.modules():
        if "Attention" in type(m).__name__:
            holder: Any = m
            holder.context_parallel = context
    model.register_forward_pre_hook(_InputCheck(model, context), with_kwargs=True)


class _InputCheck:
    """A forward pre-hook that refuses, in one line, the keywords that would make a
    context-parallel forward silently wrong: an ``attention_mask`` (transformers gives none to
    an attention function it has no mask maker for: the padding would be ignored), no
    ``position_ids`` (RoPE would take ``0 .. seq / cp - 1`` on every rank), ``labels`` without
    ``shift_labels`` (shifted within the rank's part, each chunk's last target lost) or without
    ``num_items_in_batch`` (each rank's own mean: the cp factor missing), and positions that
    restart (packed documents) without ``document_ids``."""

    def __init__(self, model: nn.Module, context: ContextParallel) -> None:
        self.signature = inspect.signature(model.forward)
        extra = [p.name for p in self.signature.parameters.values() if p.kind == p.VAR_KEYWORD]
        self.extra = extra[0] if extra else None  # transformers' **kwargs
        self.context = context

    def __call__(self, _module: nn.Module, args: tuple, kwargs: dict) -> None:
        given = dict(self.signature.bind_partial(*args, **kwargs).arguments)
        if self.extra is not None:
            given.update(given.pop(self.extra, None) or {})
        pos, loss_keys = given.get("position_ids"), ("shift_labels", "num_items_in_batch")
        partial_loss = given.get("labels") is not None and any(
            given.get(k) is None for k in loss_keys
        )
        if given.get("attention_mask") is not None:  # transformers drops it for this attention
            raise ValueError(
                "under context parallelism a transformers model takes no attention_mask: pack "
                "sequences (position_ids to context_batch) or right-pad them with labels -100"
            )
        if pos is None or partial_loss:
            raise ValueError(
                "under context parallelism a transformers model takes this rank's position_ids, "
                "and with labels shift_labels and num_items_in_batch: model(**context_batch("
                "model, input_ids, labels)) (layershard.parallel.context)"
            )
        if given.get("document_ids") is None:
            cp, seq = self.context.size, pos.shape[-1]
            if not bool((pos == positions(seq * cp, cp, self.context.rank, pos.device)).all()):
                raise ValueError(
                    "under context parallelism position_ids that restart (packed sequences) "
                    "need document_ids: pass the whole sequences' position_ids to context_batch"
                )
