"""A chunked causal-LM loss: the LM head and the cross-entropy in one autograd Function that never
holds the whole ``(tokens, vocab)`` logits or their gradient.

The plain loss keeps, per token, the logits (compute dtype), their fp32 log-softmax and, at the
start of its backward, two fp32 gradients of the same size: ``(c + 12) V`` bytes a token, the
largest item of a step's memory for a 128k vocabulary. ``chunked_causal_lm_loss`` computes the
logits ``K`` chunks of tokens at a time: in forward each chunk's log-sum-exp (fp32) and target
logit, in backward each chunk's logits again, its softmax gradient, and that chunk's share of
the gradients of the hidden states and of the weight. At most one chunk of logits exists at a
time; what stays for backward is 16 bytes a token (targets, log-sum-exp, mask).

Under ``ls.shard`` the LM head is a unit: its weight is gathered when the head module's forward
starts and released when it ends, so the whole loss runs inside one call of the head module
(one gather), and the Function saves the weight with ``save_for_backward`` (the engine gathers
it again for the backward through autograd's saved-tensor hooks). ``chunked_loss(model, K)``
installs it on layershard's ``LlamaForCausalLM`` and on transformers causal LMs.
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


class _ChunkedLinearCrossEntropy(torch.autograd.Function):
    """``sum_t w_t CE(F.linear(hidden_t, weight, bias), target_t) / denom`` over the tokens t
    (rows of ``hidden``): ``w`` is 1 for a target to learn, 0 for an ignored one (its target is
    any valid index), ``denom`` the number of targets (the mean) or the caller's count.

    Forward goes ``ceil(tokens / chunks)`` tokens at a time: each chunk's logits whole, in fp32,
    their log-sum-exp and target logit, as the plain loss computes them row by row. Backward
    goes ``ceil(vocab / chunks)`` vocabulary rows at a time: every token's logits for those rows
    again, the softmax gradient (fp32, cast to the compute dtype as the plain loss's cast back
    does), those rows' weight gradient in one matmul over all tokens (the plain loss's own
    reduction, so no rounding is added), and their share of the hidden-state gradient, summed
    over the chunks in fp32 (a tokens x d buffer) and cast once at the end. Chunking the
    tokens in backward instead would add the (vocab x d) weight gradient up over the chunks in
    the compute dtype: in bf16 that was 1.6x (8 chunks) to 2.1x (16) farther from fp64 than
    the plain loss's gradient; this way the weight gradient is the plain loss's."""

    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        bias: torch.Tensor | None,
        targets: torch.Tensor,
        w: torch.Tensor,
        denom: torch.Tensor,
        chunks: int,
    ) -> torch.Tensor:
        n = hidden.shape[0]
        rows = -(-n // chunks)
        lse = torch.empty(n, dtype=torch.float32, device=hidden.device)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        for s in range(0, n, rows):
            e = min(s + rows, n)
            x = F.linear(hidden[s:e], weight, bias).float()  # the chunk's logits, in fp32
            picked = x.gather(1, targets[s:e, None]).squeeze(1)
            m = x.amax(1, keepdim=True)
            sums = x.sub_(m).exp_().sum(1)  # in place: the chunk's only vocab-sized buffer
            del x
            torch.add(m.squeeze(1), sums.log_(), out=lse[s:e])
            total += (w[s:e] * (lse[s:e] - picked)).sum()
        ctx.save_for_backward(hidden, weight, bias, targets, w, lse, denom)
        ctx.chunks = chunks
        return total / denom

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, weight, bias, targets, w, lse, denom = ctx.saved_tensors
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        vocab = weight.shape[0]
        cols = -(-vocab // ctx.chunks)
        grad_h = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
        grad_w = torch.empty(weight.shape, dtype=weight.dtype, device=weight.device)
        grad_b = torch.empty(bias.shape, dtype=bias.dtype, device=bias.device) if need_b else None
        # d loss / d logit = (softmax - one-hot) * w * grad / denom; denom is 0 only for a mean
        # over no target: nan loss, zero gradients (as F.cross_entropy's)
        row_scale = w * (grad_loss / torch.where(denom == 0, 1.0, denom))
        for v0 in range(0, vocab, cols):
            v1 = min(v0 + cols, vocab)
            local = targets - v0  # the targets among these vocabulary rows, as columns
            minus_one = ((local >= 0) & (local < v1 - v0)).float().neg_()
            local.clamp_(0, v1 - v0 - 1)
            part = None if bias is None else bias[v0:v1]
            p = F.linear(hidden, weight[v0:v1], part).float()
            p.sub_(lse[:, None]).exp_()  # softmax over the whole vocabulary, these columns
            p.scatter_add_(1, local[:, None], minus_one[:, None])
            del local, minus_one
            p.mul_(row_scale[:, None])
            if grad_b is not None:
                grad_b[v0:v1] = p.sum(0)
            g = p.to(weight.dtype)  # what the plain loss's cast of the logits hands back
            del p
            if need_w:
                torch.mm(g.t(), hidden, out=grad_w[v0:v1])
            if need_h:
                if g.dtype == torch.float32:
                    grad_h.addmm_(g, weight[v0:v1])
                else:
                    grad_h += torch.mm(g, weight[v0:v1])
            del g
        return (
            grad_h.to(hidden.dtype) if need_h else None,
            grad_w if need_w else None,
            grad_b,
            None,
            None,
            None,
            None,
        )


def chunked_causal_lm_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor | None,
    chunks: int,
    *,
    bias: torch.Tensor | None = None,
    ignore_index: int = IGNORE_INDEX,
    num_items_in_batch: torch.Tensor | int | None = None,
    shift_labels: torch.Tensor | None = None,
) -> torch.Tensor:
    """The mean next-token cross-entropy of the logits ``F.linear(hidden, weight, bias)``
    against ``labels``, computed ``chunks`` chunks of tokens at a time (see the module's doc).

    The same loss as ``layershard.models.causal_lm_loss`` and transformers' ``ForCausalLMLoss``:
    the logits at position i predict ``labels[:, i + 1]``; ``ignore_index`` targets are left
    out of the mean; the logits are cast to fp32 before the log-softmax. ``shift_labels``
    (already shifted; ``labels`` is then only needed to be not None) and ``num_items_in_batch``
    (divide the sum by it instead of the number of targets, for gradient accumulation) as
    transformers passes them. With no target at all the loss is nan, as ``F.cross_entropy``'s
    mean is, and its gradients are zero.

    ``hidden``: (batch, seq, d) or (tokens, d) in the compute dtype; ``weight``: (vocab, d).
    Gradients of ``weight`` add up over the chunks in the weight's dtype (in 16-bit dtypes that
    is one rounding per chunk where the plain loss's single matmul rounds once)."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if shift_labels is None:
        if labels is None:
            raise ValueError("chunked_causal_lm_loss needs labels (or shift_labels)")
        # each row's last position predicts nothing (HF's ForCausalLMLoss pads the same way)
        shift_labels = F.pad(labels[..., 1:], (0, 1), value=ignore_index)
    d = hidden.shape[-1]
    flat = hidden.reshape(-1, d)
    targets = shift_labels.reshape(-1).to(flat.device)
    if targets.numel() != flat.shape[0]:
        raise ValueError(
            f"labels give {targets.numel()} targets for {flat.shape[0]} positions of hidden "
            f"states {tuple(hidden.shape)}; pass labels of the input's shape (and no "
            "logits_to_keep)"
        )
    valid = targets != ignore_index
    w = valid.float()
    targets = targets.masked_fill(~valid, 0)  # any index in range: its row is weighted 0
    if num_items_in_batch is None:
        denom = w.sum()
    else:
        denom = torch.as_tensor(num_items_in_batch, device=flat.device).float()
    loss = _ChunkedLinearCrossEntropy.apply(flat, weight, bias, targets, w, denom, chunks)
    assert isinstance(loss, torch.Tensor)
    return loss


# --- installing it on a model ----------------------------------------------------------------


class ChunkedLossModel:
    """A model whose own forward computes the chunked loss when its ``loss_chunks`` is set
    (layershard's ``LlamaForCausalLM``, whose LM head calls ``chunked_causal_lm_loss``):
    ``chunked_loss`` only sets that attribute. The model depends on this module, not the
    other way round."""

    loss_chunks: int  # 0: the plain loss


def chunked_loss(model: nn.Module, chunks: int = 8) -> nn.Module:
    """Make ``model(input_ids, labels=labels).loss`` the chunked loss (``chunks`` chunks of the
    batch's tokens; 0 restores the plain loss) and return ``model``, changed in place.

    ``model``: layershard's ``LlamaForCausalLM`` or a transformers causal LM (``...ForCausalLM``,
    whose ``labels=`` path computes ``ForCausalLMLoss``), before or after ``ls.shard`` (a
    ``ShardedModule`` is changed through the model it wraps). The loss equals the plain one to
    fp32 rounding, gradients included. With labels the output's ``logits`` are ``None`` (they
    are never materialized); without labels (generation, evaluation of logits) the model
    returns its logits as before.

    transformers models that change the logits between the LM head and the loss (Gemma-2's
    ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's ``logits_scaling``, ...)
    are refused: here if their config says so, else at the first forward that touches them."""
    if isinstance(chunks, bool) or not isinstance(chunks, int) or chunks < 0:
        raise ValueError(f"chunked_loss: chunks must be an integer >= 0 (0: off), got {chunks!r}")
    inner = _unwrap(model)
    if isinstance(inner, ChunkedLossModel):
        inner.loss_chunks = chunks
        return model
    if _is_hf_causal_lm(inner):
        current = inner.__dict__.get("_layershard_chunked_loss")
        if current is not None:
            current.remove()
        if chunks:
            _HFChunkedLoss(inner, chunks)
        return model
    raise TypeError(
        f"chunked_loss: {type(inner).__name__} is neither layershard.models.LlamaForCausalLM "
        "nor a transformers causal LM (a ...ForCausalLM with an LM head); compute the loss "
        "with layershard.loss.chunked_causal_lm_loss(hidden, head.weight, labels, chunks) "
        "inside the head module's forward instead"
    )


def _unwrap(model: nn.Module) -> nn.Module:
    from layershard.sharded import ShardedModule

    return model.module if isinstance(model, ShardedModule) else model


def _is_hf_causal_lm(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel) and callable(
        getattr(model, "get_output_embeddings", None)
    )


# transformers configs whose causal LM transforms its logits before the loss (checked in
# transformers 5.x's modeling files): attribute -> the value meaning "no transform"
_LOGIT_TRANSFORMS = {
    "final_logit_softcapping": None,  # Gemma 2/3/3n/4, VaultGemma, NanoChat, Beam
    "logits_soft_cap": None,  # RecurrentGemma
    "output_logit_soft_cap": None,  # xLSTM
    "logit_scale": None,  # Cohere, Cohere 2
    "logits_scaling": None,  # Granite and its MoE variants (divides, even by 1.0)
}


class _HFChunkedLoss:
    """The chunked loss on a transformers causal LM, without touching transformers' code.

    transformers' forward runs ``logits = self.lm_head(hidden)`` and then
    ``self.loss_function(logits=logits, labels=labels, ...)``. Three instance-level changes:

    - a forward pre-hook on the model reads the call's ``labels`` (and ``shift_labels``,
      ``num_items_in_batch``, ``ignore_index``) for the head;
    - the head's ``forward`` (an instance attribute; the class is untouched) computes the
      chunked loss from its input when the call has labels, and returns ``_LossOnly`` in place
      of logits, otherwise the logits as before;
    - ``model.loss_function`` (transformers' own override point) returns that loss, and a
      forward hook leaves ``logits`` out of the output (None).
    """

    def __init__(self, model: nn.Module, chunks: int) -> None:
        name = type(model).__name__
        head = model.get_output_embeddings()  # type: ignore[operator]
        if not isinstance(head, nn.Linear):
            raise TypeError(
                f"chunked_loss: {name}'s output embedding is {type(head).__name__}, not an "
                "nn.Linear LM head; the chunked loss cannot compute it"
            )
        cfg = getattr(model, "config", None)
        for key, off in _LOGIT_TRANSFORMS.items():
            if getattr(cfg, key, off) != off or (key == "logit_scale" and hasattr(model, key)):
                raise ValueError(
                    f"chunked_loss: {name} transforms its logits before the loss ({key}="
                    f"{getattr(cfg, key, None)!r}), which the chunked loss does not compute; "
                    "train it without loss chunks"
                )
        loss_type = getattr(model, "loss_type", None)
        custom = "_loss_function" in model.__dict__
        if custom or loss_type not in (None, "ForCausalLM"):
            raise ValueError(
                f"chunked_loss: {name} computes {'a custom loss_function' if custom else loss_type}"
                ", not transformers' ForCausalLMLoss; the chunked loss replaces only that"
            )
        self.model, self.head, self.chunks = model, head, chunks
        self.name = name
        self.pending: dict[str, Any] | None = None
        params = list(inspect.signature(model.forward).parameters)
        self.labels_pos = params.index("labels") if "labels" in params else None
        # instance attributes: the classes (and every other instance) keep their own
        head.forward = self._head_forward  # type: ignore[method-assign, assignment]
        model.loss_function = self._loss_function  # type: ignore[assignment]  # HF setter
        self.handles = [
            model.register_forward_pre_hook(self._pre, with_kwargs=True),
            model.register_forward_hook(self._drop_logits),
            model.register_forward_hook(self._clear, always_call=True),
        ]
        model.__dict__["_layershard_chunked_loss"] = self

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        del self.head.forward
        del self.model.__dict__["_loss_function"]
        del self.model.__dict__["_layershard_chunked_loss"]

    def _pre(self, _m: nn.Module, args: tuple, kwargs: dict) -> None:
        labels = kwargs.get("labels")
        if labels is None and self.labels_pos is not None and len(args) > self.labels_pos:
            labels = args[self.labels_pos]
        self.pending = None
        if labels is not None:
            self.pending = {
                "labels": labels,
                "shift_labels": kwargs.get("shift_labels"),
                "num_items_in_batch": kwargs.get("num_items_in_batch"),
                "ignore_index": kwargs.get("ignore_index", IGNORE_INDEX),
            }

    def _clear(self, *_: Any) -> None:
        self.pending = None

    def _head_forward(self, hidden: torch.Tensor) -> Any:
        pending, self.pending = self.pending, None
        if pending is None:
            return nn.Linear.forward(self.head, hidden)
        loss = chunked_causal_lm_loss(
            hidden, self.head.weight, pending["labels"], self.chunks, bias=self.head.bias,
            ignore_index=pending["ignore_index"], shift_labels=pending["shift_labels"],
            num_items_in_batch=pending["num_items_in_batch"],
        )  # fmt: skip
        return _LossOnly(loss, self.name)

    def _loss_function(self, logits: Any = None, *_: Any, **__: Any) -> torch.Tensor:
        if not isinstance(logits, _LossOnly):
            raise RuntimeError(
                f"chunked_loss: {self.name}'s loss got logits that did not come from its LM "
                "head's chunked forward; this model is not supported by the chunked loss"
            )
        return logits.loss

    def _drop_logits(self, _m: nn.Module, _args: tuple, out: Any) -> Any:
        if isinstance(out, tuple):
            return tuple(v for v in out if not isinstance(v, _LossOnly))
        logits = getattr(out, "logits", None)
        if isinstance(logits, _LossOnly):
            return type(out)(**{k: v for k, v in out.items() if not isinstance(v, _LossOnly)})
        return None


class _LossOnly:
    """What the LM head returns in place of logits under the chunked loss: the loss, for the
    model's ``loss_function``. Anything else done with it (a model scaling or capping its
    logits before the loss, or computing the loss its own way) raises, naming the model."""

    def __init__(self, loss: torch.Tensor, model: str) -> None:
        self.loss = loss  # also how the engine finds the head's output tensor (post-forward)
        self.model = model

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # copy, pickle and friends probe optional dunders
            raise AttributeError(name)
        raise AttributeError(_refusal(self.model, f".{name}"))

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        model = next((a.model for a in args if isinstance(a, _LossOnly)), "the model")
        raise TypeError(_refusal(model, f"torch.{getattr(func, '__name__', func)}"))


def _refusal(model: str, what: str) -> str:
    return (
        f"chunked_loss: {model} uses its logits before the loss ({what}), but under the chunked "
        "loss they are never materialized; this model is not supported by it: train it "
        "without loss chunks"
    )


def _refuse_op(op: str) -> Any:
    def method(self: _LossOnly, *_: Any) -> Any:
        raise TypeError(_refusal(self.model, op))

    return method


for _op in ("add", "sub", "mul", "truediv", "floordiv", "pow", "matmul", "mod"):
    setattr(_LossOnly, f"__{_op}__", _refuse_op(f"__{_op}__"))
    setattr(_LossOnly, f"__r{_op}__", _refuse_op(f"__r{_op}__"))
for _op in ("getitem", "neg", "abs", "iter", "len"):
    setattr(_LossOnly, f"__{_op}__", _refuse_op(f"__{_op}__"))
