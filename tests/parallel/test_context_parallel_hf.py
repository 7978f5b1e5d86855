"""Context parallelism for transformers models: Llama, Qwen3 (q/k norms) and Mistral (a sliding
window as long as the sequence) parallelized with ``ls.parallelize(hf_model, cp=2, cp_mode=...)``,
their attention through transformers' ``AttentionInterface`` (``models/hf_context.py``), against
one process on the same global batch.

Every rank trains the reference itself: the stock model (``attn_implementation="sdpa"``, which
masks packed documents from their restarting position ids), the whole batch, the keywords of
``context_batch`` without CP (the whole labels, ``num_items_in_batch`` the batch's target count);
then the CP model on its part (its two chunks of each sequence, global ``position_ids``,
``shift_labels`` and ``labels`` shifted over the whole sequence, ``num_items_in_batch`` the count
over cp). Compared, as the built-in model's tests compare them: each step's loss (mean over the
ranks), the whole first gradient, the weights after the AdamW steps. Both modes, each model,
plain and packed sequences, checkpointed layers and grad_op in some; then the loss
normalization's negative control and the one-line refusals.
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks
from _parity import (
    LOSS_RTOL,
    TP_ORDERS,
    clone,
    full_grads,
    grad_error,
    relative,
    relative_bound,
    relative_distance,
    train_beside,
    train_in_orders,
)
from torch import nn

import layershard as ls
from layershard.models import hf_context
from layershard.parallel.context import context_batch

transformers = pytest.importorskip("transformers")

SEQ, BATCH, STEPS = 32, 4, 3
VOCAB = 96
# Packed rows of three documents each, crossing cp 2's chunk boundaries (8 tokens) or ending on
# them, as the built-in model's tests pack them.
DOCS = [[5, 11, 16], [3, 20, 9], [16, 8, 8], [2, 27, 3]]

# Tolerances: those of the built-in model's tests (test_context_parallel_model.py, why there),
# for the same reason: CP computes the one-process math in another order of its fp32 sums
# (softmaxes merged by log-sum-exp, dk / dv summed over the ring's steps or after the
# all-to-all, the weights' gradients as the sum of the cp ranks'), and the reference here is
# transformers' SDPA attention, another kernel with its own order. Measured 2026-11-29, torch
# 2.13, transformers 5.24, every case here, ATEN_CPU_CAPABILITY avx512 (this machine) / avx2 /
# default:
# - a step's loss against the reference's: at most 1.05e-7 / 2.09e-7 / 2.08e-7 (a few ulp);
#   held to _parity.LOSS_RTOL (1e-5);
# - the first gradient (grad_error): at most 8.5e-7 / 7.5e-7 / 8.7e-7; held to GRAD_RTOL, 1e-5
#   as in the built-in model's and the TP tests;
# - the weights after STEPS AdamW steps, relative_distance: at most 0.83 / 1.28 / 0.94 x the
#   in-run spread bound (relative_bound of _orders), held to max(2 GRAD_RTOL, TP_ORDERS x the
#   bound) as the built-in tests hold theirs. The bound samples transformers' eager attention
#   too: without it (the data-parallel orders only) Qwen3's packed ring run measured 4.9 x it
#   under `default`, over TP_ORDERS, AdamW amplifying last-bit differences of near-zero
#   gradients in an order of the attention's sums that those orders never vary.
# A wrong divisor, position or target misses by far more (_loss_normalization: the gradient
# without the cp factor off by 0.5; the forward's keyword checks refuse local positions and
# labels shifted per rank).
GRAD_RTOL = 1e-5


def hf_config(kind: str, **overrides):
    """A tiny config of ``kind`` (hidden 64, 4 heads, 2 kv heads, 2 layers): Llama, Qwen3 (its
    q/k norms over each head), Mistral (its sliding window the sequence's length: what runs)."""
    common = dict(
        vocab_size=VOCAB, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=2, intermediate_size=128, max_position_embeddings=2 * SEQ,
    )  # fmt: skip
    extra = {"qwen3": {"head_dim": 16}, "mistral": {"sliding_window": SEQ}}.get(kind, {})
    cls = {"llama": "LlamaConfig", "qwen3": "Qwen3Config", "mistral": "MistralConfig"}[kind]
    return getattr(transformers, cls)(**{**common, **extra, **overrides})


def hf_model(kind: str, seed: int = 0, **overrides) -> nn.Module:
    torch.manual_seed(seed)  # every rank builds the same model
    return transformers.AutoModelForCausalLM.from_config(
        hf_config(kind, **overrides), attn_implementation="sdpa"
    )


def _rows(packed: bool) -> torch.Tensor:
    if not packed:
        return torch.arange(SEQ).expand(BATCH, SEQ)
    return torch.stack([torch.cat([torch.arange(n) for n in row]) for row in DOCS])


def _batches(packed: bool, seed: int = 1) -> list[torch.Tensor]:
    """STEPS global batches (BATCH, 3, SEQ): ids, labels (each document's first masked when
    packed) and position ids, stacked so that ``train_in_orders`` splits them by rows."""
    g = torch.Generator().manual_seed(seed)
    pos = _rows(packed)
    out = []
    for _ in range(STEPS):
        ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=g)
        labels = ids.masked_fill(pos == 0, -100) if packed else ids
        out.append(torch.stack([ids, labels, pos], dim=1))
    return out


def hf_loss(model, batch: torch.Tensor) -> torch.Tensor:
    """``model(**context_batch(...)).loss`` on rows of ``_batches``: this rank's part under CP,
    the whole batch for the reference."""
    ids, labels, pos = batch.unbind(1)
    return model(**context_batch(model, ids, labels, pos)).loss


@functools.cache
def _orders(kind: str, packed: bool, parts: int):
    """The reference trained in other legitimate orders of its sums (once per spawn): the
    data-parallel orders of ``train_in_orders``, with transformers' SDPA attention and with its
    eager attention (matmul, softmax, matmul: another order of the attention's sums, which the
    data-parallel orders do not sample and CP's order changes)."""
    eager = hf_model(kind)
    eager.set_attn_implementation("eager")
    return [
        *train_in_orders(hf_model(kind), _batches(packed), parts, loss=hf_loss),
        *train_in_orders(eager, _batches(packed), parts, loss=hf_loss),
    ]


def _parity(
    rank: int, world: int, kind: str, mode: str, *, packed: bool = False, chunks: int = 0,
    cp: int = 0, **options,
) -> None:  # fmt: skip
    base = hf_model(kind)
    reference = clone(base)
    cp = cp or world
    model = ls.parallelize(clone(base), cp=cp, cp_mode=mode, **options)
    if chunks:  # its loss reads shift_labels and num_items_in_batch as transformers' does
        ls.chunked_loss(model, chunks)
    ctx = model.context_parallel
    assert ctx.size == cp and ctx.mode == mode and ctx.transformers
    assert model.config._attn_implementation == "layershard_cp"
    attns = [m for m in model.modules() if type(m).__name__.endswith("Attention")]
    assert len(attns) == 2 and all(m.context_parallel is ctx for m in attns)

    worst_loss, err = train_beside(
        model, reference, _batches(packed), hf_loss, ctx.data_rank, ctx.data_size, GRAD_RTOL
    )

    full = model.full_state_dict()
    if rank == 0:
        d = relative_distance(full, reference, base)
        bound = relative_bound(reference, base, *_orders(kind, packed, ctx.data_size))
        print(
            f"{kind} cp={cp} {mode} packed={packed} chunks={chunks} {options}: loss "
            f"{worst_loss:.2e}, first grad {err:.2e}, weights {d:.2e}, in-run spread bound {bound:.2e}"
        )
        assert d <= max(2 * GRAD_RTOL, TP_ORDERS * bound), (
            f"weights {d:.2e} from the reference's (relative to the distance they moved)"
        )


# ---- the checks ----------------------------------------------------------------------------

_CASES = {
    "llama_ring_chunked_loss": ("llama", "ring", {"chunks": 4}),
    "llama_all_to_all_packed": ("llama", "all_to_all", {"packed": True}),
    # every layer checkpointed: the recompute's ring exchanges and document ids (a keyword)
    "qwen3_ring_packed_checkpointed": (
        "qwen3", "ring", {"packed": True, "strategy": "grad_op", "activation_checkpointing": 2}
    ),
    "qwen3_all_to_all": ("qwen3", "all_to_all", {}),
    "mistral_ring_packed": ("mistral", "ring", {"packed": True}),
    "mistral_all_to_all": ("mistral", "all_to_all", {"strategy": "no_shard"}),
}  # fmt: skip


def _loss_normalization(rank: int, world: int) -> None:
    """Each rank's loss is cp x (its token losses' sum / the whole batch's targets), as the
    built-in model's: ``num_items_in_batch`` is the count over cp. Negative control: the count
    itself (the share alone) gives gradients 1 / cp of the reference's."""
    base = hf_model("llama")
    batch = _batches(packed=True)[0]
    ids, labels, pos = batch.unbind(1)
    reference = clone(base)
    whole = context_batch(reference, ids, labels, pos)
    count = (labels[:, 1:] != -100).sum()
    assert whole.num_items_in_batch.item() == count.item()
    ref_loss = reference(**whole).loss
    torch.testing.assert_close(
        ref_loss, reference(ids, labels=labels, position_ids=pos, use_cache=False).loss
    )
    ref_loss.backward()
    ref_grads = {k: p.grad for k, p in reference.named_parameters()}
    model = ls.parallelize(clone(base), cp=world)
    part = context_batch(model, ids, labels, pos)
    assert part.num_items_in_batch.item() == count.item() / world
    assert torch.equal(part.labels, part.shift_labels)
    with torch.no_grad():
        loss = model(**part).loss
        logits = model(input_ids=part.input_ids, position_ids=part.position_ids,
                       document_ids=part.document_ids).logits  # fmt: skip
        total = nn.functional.cross_entropy(logits.flatten(0, 1), part.shift_labels.flatten(),
                                            reduction="sum")  # fmt: skip
    torch.testing.assert_close(loss, total / count * world, rtol=1e-6, atol=0)
    share = (total / count).clone()
    dist.all_reduce(share)
    assert relative(share.item(), ref_loss.item()) <= LOSS_RTOL
    part_count = {**{k: part[k] for k in part}, "num_items_in_batch": count.float()}
    model(**part_count).loss.backward()  # the share alone
    err = grad_error(full_grads(model), ref_grads)
    assert abs(err - (1 - 1 / world)) < 1e-3, err


def _refuses(error: type, match: str, fn, *args, **kwargs) -> None:
    with pytest.raises(error, match=match) as e:
        fn(*args, **kwargs)
    assert "\n" not in str(e.value), str(e.value)


def _refusals(rank: int, world: int) -> None:
    """One line each: at parallelize, heads not divisible in all-to-all mode and a mixture of
    experts; at the forward, a sliding window shorter than the sequence, a padding mask,
    attention dropout, unshifted labels, a missing count or positions, packed positions without
    document ids."""
    odd = hf_model("llama", hidden_size=48, num_attention_heads=3, num_key_value_heads=1)
    _refuses(ValueError, r"cp_mode='all_to_all'\): n_heads=3 must be divisible by cp",
             ls.parallelize, odd, cp=2, cp_mode="all_to_all")  # fmt: skip
    moe = transformers.AutoModelForCausalLM.from_config(transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        num_hidden_layers=1, moe_intermediate_size=16, num_experts=4, num_experts_per_tok=2,
    ))  # fmt: skip
    _refuses(ValueError, r"cp=2\): a mixture of experts is not supported", ls.parallelize, moe,
             cp=2)  # fmt: skip
    _refuses(ValueError, r"the model has no expert layers to split", ls.parallelize,
             hf_model("llama"), cp=2, ep=2)  # fmt: skip
    _refuses(ValueError, r"cp x tp x dp_replicate = 4 must divide the world size 2",
             ls.parallelize, hf_model("llama"), cp=2, tp=2)  # fmt: skip

    x = torch.randint(0, VOCAB, (2, SEQ))
    window = ls.parallelize(hf_model("mistral", sliding_window=SEQ // 2), cp=2)
    _refuses(ValueError, r"\(MistralAttention\): sliding-window attention \(window 16 < "
             r"sequence 32\) is not supported", window, **context_batch(window, x, x))  # fmt: skip
    dropout = ls.parallelize(hf_model("qwen3", attention_dropout=0.1), cp=2)
    _refuses(ValueError, r"attention dropout \(0.1\) is not supported", dropout,
             **context_batch(dropout, x, x))  # fmt: skip
    dropout.eval()  # no dropout in eval: runs
    dropout(**context_batch(dropout, x, x))

    model = ls.parallelize(hf_model("llama"), cp=2)
    part = context_batch(model, x, x)
    # transformers gives a custom attention function no mask: refused in the forward's keywords
    _refuses(ValueError, r"a transformers model takes no attention_mask", model, **part,
             attention_mask=torch.ones_like(part.input_ids))  # fmt: skip
    attn, q = model.model.layers[0].self_attn, torch.zeros(2, 4, SEQ // 2, 16)
    _refuses(ValueError, r"\(LlamaAttention\): an attention mask is not supported",
             hf_context.context_attention, attn, q, q[:, :2], q[:, :2],
             torch.zeros(2, 1, SEQ // 2, SEQ))  # fmt: skip
    keys = r"takes this rank's position_ids, and with labels shift_labels and num_items_in_batch"
    _refuses(ValueError, keys, model, part.input_ids, labels=part.labels,
             position_ids=part.position_ids)  # fmt: skip
    _refuses(ValueError, keys, model, input_ids=part.input_ids, labels=part.labels,
             shift_labels=part.shift_labels, position_ids=part.position_ids)  # fmt: skip
    _refuses(ValueError, keys, model, input_ids=part.input_ids)
    packed = context_batch(model, x, x, _rows(True)[:2])
    assert packed.document_ids is not None
    _refuses(ValueError, r"position_ids that restart \(packed sequences\) need document_ids",
             model, input_ids=packed.input_ids, position_ids=packed.position_ids)  # fmt: skip
    model(input_ids=part.input_ids, position_ids=part.position_ids[:1])  # (1, seq): runs


checks = RankChecks(world_size=2, suffix="_cp2")  # one spawn: ~13 s on 2 shared cores
for _name, (_kind, _mode, _opts) in _CASES.items():
    _doc = f"{_kind}, cp 2, {_mode} {_opts}: one process's losses and gradients"
    checks.check(functools.partial(_parity, kind=_kind, mode=_mode, **_opts), _name, _doc)
for _fn in (_loss_normalization, _refusals):
    checks.check(_fn)
checks.collect(globals())

# 4 ranks: cp 4 (chunks of 4 tokens, documents crossing several ranks), and TP 2 x CP 2 (the
# model's own base_model_tp_plan over the TP ranks, each attending with its 2 heads and 1 kv
# head over the CP group of its TP coordinate)
_CASES4 = {
    "qwen3_ring_packed_cp4": ("qwen3", "ring", {"packed": True}),
    "llama_all_to_all_cp4_grad_op": ("llama", "all_to_all", {"strategy": "grad_op"}),
    "llama_ring_packed_tp2_cp2": ("llama", "ring", {"packed": True, "tp": 2, "cp": 2}),
    "qwen3_all_to_all_tp2_cp2": ("qwen3", "all_to_all", {"tp": 2, "cp": 2}),
}  # fmt: skip
checks4 = RankChecks(world_size=4, slow=True)
for _name, (_kind, _mode, _opts) in _CASES4.items():
    _doc = f"{_kind}, 4 ranks, {_mode} {_opts}: one process's losses and gradients"
    checks4.check(functools.partial(_parity, kind=_kind, mode=_mode, **_opts), _name, _doc)
checks4.collect(globals())


# ---- one process ---------------------------------------------------------------------------


def test_context_batch_gives_transformers_keywords() -> None:
    """Without CP a transformers model gets the whole batch with ``labels`` (the shifted labels),
    ``shift_labels`` and ``num_items_in_batch`` (the batch's target count): its loss is the
    stock ``labels=`` loss; the built-in Llama gets neither extra keyword."""
    model = hf_model("qwen3")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(4))
    labels = ids.masked_fill(ids < 10, -100)
    part = context_batch(model, ids, labels)
    assert set(part.keys()) == {
        "input_ids", "position_ids", "shift_labels", "labels", "num_items_in_batch", "use_cache"
    }  # fmt: skip
    assert part.use_cache is False  # with a cache transformers would not mask packed documents
    assert part.num_items_in_batch.item() == (labels[:, 1:] != -100).sum().item()
    with torch.no_grad():
        torch.testing.assert_close(model(**part).loss, model(ids, labels=labels).loss,
                                   rtol=4 * torch.finfo(torch.float32).eps, atol=0)  # fmt: skip
    builtin = ls.models.LlamaForCausalLM(ls.models.build_config("tiny", vocab_size=VOCAB))
    assert set(context_batch(builtin, ids, labels).keys()) == {
        "input_ids", "position_ids", "shift_labels"
    }  # fmt: skip


def test_reference_attends_within_documents() -> None:
    """The reference's semantics: transformers' SDPA masks packed documents from the restarting
    position ids, so a packed row's logits are its documents' own, each run alone."""
    model = hf_model("mistral")
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        packed = model(**context_batch(model, ids, position_ids=_rows(True))).logits
        for r, row in enumerate(DOCS):
            start = 0
            for n in row:
                alone = model(ids[r : r + 1, start : start + n]).logits[0]
                torch.testing.assert_close(packed[r, start : start + n], alone, rtol=0,
                                           atol=1e-5 * alone.abs().max().item())  # fmt: skip
                start += n


def test_models_refused_before_any_group() -> None:
    """``hf_context.check`` refuses, in one line, what CP cannot run: attention logit
    softcapping (Gemma 2), layers that are not attention, a model whose attention does not go
    through transformers' AttentionInterface; the attention function refuses a module that
    ls.parallelize did not give a ContextParallel."""

    def refused(match: str, model: nn.Module) -> None:
        _refuses(ValueError, match, hf_context.check, model, "parallelize(cp=2)")

    gemma = transformers.Gemma2Config(
        vocab_size=VOCAB, hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
        num_hidden_layers=2, intermediate_size=64, head_dim=16,
    )  # fmt: skip
    refused(r"^parallelize\(cp=2\): attention logit softcapping is not supported$",
            transformers.AutoModelForCausalLM.from_config(gemma))  # fmt: skip
    mixed = hf_model("qwen3")
    mixed.config.layer_types = ["full_attention", "linear_attention"]
    refused(r"layers of type linear_attention mix tokens outside the attention", mixed)

    class Opaque(transformers.LlamaForCausalLM):
        _supports_attention_backend = False

    refused(r"Opaque's attention does not go through transformers' AttentionInterface",
            Opaque(hf_config("llama")))  # fmt: skip
    assert hf_context.check(hf_model("qwen3"), "here") == 4
    attn = hf_model("llama").model.layers[0].self_attn
    q = torch.zeros(1, 4, 4, 16)
    _refuses(ValueError, r"LlamaAttention calls layershard's context-parallel attention but has "
             "no ContextParallel", hf_context.context_attention, attn, q, q, q, None)  # fmt: skip


def test_sharding_plugin_checks_cp() -> None:
    """``ls.hf.ShardingPlugin(cp=, cp_mode=)``: the types and ranges checked as ls.parallelize
    checks them, cp with ep refused at once (tests/hf/test_hf_context_parallel.py trains with
    cp=2); cp 1 in either mode is plain sharding, nothing passed to ls.shard."""
    plugin_cls = pytest.importorskip("layershard.hf").ShardingPlugin
    assert plugin_cls(cp=2, cp_mode="all_to_all").cp == 2
    _refuses(ValueError, r"^layershard: ShardingPlugin\(cp=2\) with ep above 1 is not "
             r"supported yet", plugin_cls, cp=2, ep=2)  # fmt: skip
    assert (
        plugin_cls(cp=2, tp=2).tp == 2
    )  # the composed mesh (tests/hf/test_hf_context_parallel.py)
    _refuses(ValueError, r"^ShardingPlugin\(\): cp must be at least 1, got 0$", plugin_cls, cp=0)
    _refuses(TypeError, r"^ShardingPlugin\(\): cp must be an integer, got '2'$", plugin_cls,
             cp="2")  # fmt: skip
    _refuses(ValueError, r"cp_mode must be one of 'ring' or 'all_to_all', got 'ulysses'",
             plugin_cls, cp_mode="ulysses")  # fmt: skip
    kwargs = plugin_cls(cp=1, cp_mode="all_to_all").shard_kwargs()
    assert "cp" not in kwargs and "cp_mode" not in kwargs and kwargs["strategy"] == "full"
