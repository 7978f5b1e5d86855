"""Activation memory of the built-in Llama: exact against the math it replaced (a copy of it is
below), at most transformers' LlamaForCausalLM (sdpa) per token and block, and equal to what
`layershard plan` charges. Bytes are deterministic, so they are asserted exactly.

Two measurements, both torch's (see layershard.plan.measure): saved-tensor accounting
(`saved_tensors_hooks`, unique storages: exactly what autograd keeps, per module) and MemTracker
(live storages, whatever keeps them: checkpoint inputs, the logits the caller holds)."""

from __future__ import annotations

from functools import partial

import pytest
import torch
import torch.nn.functional as F
import torch.utils.checkpoint
from torch.nn.attention import SDPBackend, sdpa_kernel

from layershard.models import LlamaForCausalLM, RMSNorm, build_config, hf_llama_config
from layershard.models.llama import _native_gqa, _probe_cpu_flash_gqa, apply_rope, causal_attention
from layershard.plan import ModelShape, layer_activation_bytes_per_token, predict_activations
from layershard.plan.measure import LiveMemory, saved_bytes_by_module

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _cfg(**kw):
    base = dict(vocab_size=512, dim=64, n_layers=3, n_heads=4, n_kv_heads=2, ffn_dim=160)
    return build_config("tiny", **{**base, **kw, "max_seq_len": 64})


def _repeats_kv(dtype) -> bool:
    """Whether the model repeats k and v on this CPU in ``dtype`` (``llama._native_gqa``)."""
    q, kv = torch.zeros(1, 2, 1, 8, dtype=dtype), torch.zeros(1, 1, 1, 8, dtype=dtype)
    return not _native_gqa(q, kv, kv)


def _model(cfg, dtype, seed=0):
    """Parameters in ``dtype``, RoPE tables fp32 (as under ``ls.shard``'s mixed precision)."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg).to(dtype)
    model.rotary.float().reset_parameters()
    return model


# --- today's math (before the activation-memory change), kept as the reference ---------------


def ref_rmsnorm(x, weight, eps):
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return xf.to(x.dtype) * weight


def ref_attention(attn, x, cos, sin):
    b, t, _ = x.shape
    q = attn.wq(x).view(b, t, attn.n_heads, attn.head_dim).transpose(1, 2)
    k = attn.wk(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    v = attn.wv(x).view(b, t, attn.n_kv_heads, attn.head_dim).transpose(1, 2)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if attn.n_kv_heads != attn.n_heads:
        n_rep = attn.n_heads // attn.n_kv_heads
        k = k.repeat_interleave(n_rep, dim=1)
        v = v.repeat_interleave(n_rep, dim=1)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
    return attn.wo(y.transpose(1, 2).reshape(b, t, -1))


def ref_loss(logits, labels):
    shift_logits = logits[:, :-1].float()
    return F.cross_entropy(
        shift_logits.reshape(-1, shift_logits.shape[-1]),
        labels[:, 1:].reshape(-1),
        ignore_index=-100,
    )


def ref_forward(model, ids, labels):
    eps = model.config.norm_eps
    x = model.embed(ids)
    cos, sin = model.rotary(ids.shape[1], x.dtype)
    for layer in model.layers:
        x = x + ref_attention(layer.attn, ref_rmsnorm(x, layer.attn_norm.weight, eps), cos, sin)
        x = x + layer.mlp(ref_rmsnorm(x, layer.mlp_norm.weight, eps))
    return ref_loss(model.lm_head(ref_rmsnorm(x, model.norm.weight, eps)), labels)


def _loss_and_grads(model, loss_fn):
    model.zero_grad(set_to_none=True)
    loss = loss_fn(model)
    loss.backward()
    return loss.detach().double(), {n: p.grad.double() for n, p in model.named_parameters()}


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


# --- exactness -----------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_is_todays_math_bit_for_bit_and_saves_input_and_rsqrt_only(dtype):
    dt = DTYPES[dtype]
    torch.manual_seed(0)
    norm = RMSNorm(64).to(dt)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(64))
    x = torch.randn(3, 16, 64, dtype=dt, requires_grad=True)
    g = torch.randn(3, 16, 64, dtype=dt)
    saved = saved_bytes_by_module(norm, {"norm": norm}, lambda: norm(x))
    # x itself (c d) and the fp32 rsqrt (4) per token; autograd on the same math saved
    # (4 + c) d + 4 (an fp32 copy of x, which is x in fp32, and the normalized x)
    assert saved["norm"] == (dt.itemsize * 64 + 4) * 3 * 16
    y = norm(x)
    y_ref = ref_rmsnorm(x, norm.weight, norm.eps)
    assert torch.equal(y, y_ref)
    got = torch.autograd.grad(y, (x, norm.weight), g)
    want = torch.autograd.grad(y_ref, (x, norm.weight), g)
    # the backward applies autograd's own formulas in autograd's order: identical bits
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize("n_kv", [1, 2])
def test_grouped_attention_equals_repeated_kv(n_kv):
    torch.manual_seed(0)
    q = torch.randn(2, 4, 32, 16, requires_grad=True)
    k = torch.randn(2, n_kv, 32, 16, requires_grad=True)
    v = torch.randn(2, n_kv, 32, 16, requires_grad=True)
    g = torch.randn(2, 4, 32, 16)
    n_rep = 4 // n_kv

    def repeated(q, k, v):
        kr, vr = k.repeat_interleave(n_rep, 1), v.repeat_interleave(n_rep, 1)
        return F.scaled_dot_product_attention(q, kr, vr, is_causal=True)

    want_y = repeated(q, k, v)
    want = torch.autograd.grad(want_y, (q, k, v), g)
    for backend in (None, SDPBackend.MATH):  # SDPA's choice, then a kernel without groups
        with sdpa_kernel(backend) if backend is not None else torch.enable_grad():
            native = _native_gqa(q, k, v)
            y = causal_attention(q, k, v)
            got = torch.autograd.grad(y, (q, k, v), g)
        assert native == (backend is None and _probe_cpu_flash_gqa())
        # the same products; the grouped kernel sums a kv head's gradient over its q heads in
        # another order: fp32 rounding (measured: <= 1e-7 relative here)
        torch.testing.assert_close(y, want_y, rtol=1e-6, atol=1e-7)
        for a, b in zip(got, want):
            assert _rel(a, b) < 1e-6


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_loss_and_gradients_are_todays(dtype):
    """The whole model against today's math on random weights. fp32: within fp32 rounding, from
    the grouped attention's summation order and the order the engine adds a norm input's
    gradients (measured: loss 1.7e-7, gradients <= 3e-7 relative). bf16: identical bits (on CPU
    the model repeats k and v in 16-bit dtypes, see ``llama._native_gqa``, and the RMSNorm's
    backward is autograd's, op for op)."""
    dt = DTYPES[dtype]
    cfg = _cfg(n_layers=2)
    model = _model(cfg, dt)
    ids = torch.randint(0, cfg.vocab_size, (3, 32))
    labels = ids.clone()
    labels[0, :5] = -100
    new_loss, new = _loss_and_grads(model, lambda m: m(ids, labels=labels).loss)
    old_loss, old = _loss_and_grads(model, lambda m: ref_forward(m, ids, labels))
    assert abs(new_loss - old_loss) / old_loss < 1e-6
    if dt == torch.float32:
        assert max(_rel(new[n], old[n]) for n in old) < 1e-6
    else:
        assert all(torch.equal(new[n], old[n]) for n in old)


# --- against transformers' LlamaForCausalLM --------------------------------------------------


def _hf_model(cfg, dtype):
    transformers = pytest.importorskip("transformers")
    hf_cfg = hf_llama_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(hf_cfg).to(dtype)


def _mark(marks, name, read):
    """A hook body: record ``read()`` once under ``name``; returns None (a hook's return value
    would replace the module's inputs or the gradient)."""
    marks.setdefault(name, read())


def _per_block(model, layers, ids):
    """Bytes per token of each block, by saved-tensor accounting and, as a cross-check, by
    MemTracker (live bytes between the starts of consecutive blocks)."""
    tokens = ids.numel()
    mods = {str(i): layer for i, layer in enumerate(layers)}
    saved = saved_bytes_by_module(model, mods, lambda: model(ids, labels=ids).loss)
    starts: dict[str, int] = {}
    with LiveMemory(model, [ids]) as mem:
        hooks = [
            m.register_forward_pre_hook(lambda *_, n=n: _mark(starts, n, mem.current))
            for n, m in mods.items()
        ]
        model(ids, labels=ids).loss  # noqa: B018 (the graph is what is measured)
        for h in hooks:
            h.remove()
    # from the second block on: HF's frame keeps the embedding output, which block 0 sees
    live = [(starts[str(i + 1)] - starts[str(i)]) / tokens for i in range(1, len(layers) - 1)]
    return [saved[n] / tokens for n in mods], live


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_kv", [4, 1])
def test_bytes_per_token_per_block_at_most_transformers(dtype, n_kv):
    dt = DTYPES[dtype]
    cfg = _cfg(n_kv_heads=n_kv)
    ids = torch.randint(0, cfg.vocab_size, (2, 32))
    ours = _model(cfg, dt)
    hf = _hf_model(cfg, dt)
    ours_saved, ours_live = _per_block(ours, ours.layers, ids)
    hf_saved, hf_live = _per_block(hf, hf.model.layers, ids)
    # every block alike, and the two tools agree
    assert len(set(ours_saved)) == 1 and len(set(hf_saved)) == 1
    assert ours_live == ours_saved[1:-1] and hf_live == hf_saved[1:-1]
    # and the planner's formula is this measurement
    repeat = _repeats_kv(dt)
    shape = ModelShape.from_config(cfg)
    assert ours_saved[0] == layer_activation_bytes_per_token(shape, dt, repeat_kv=repeat)
    # the target: at most transformers' (d = 64: HF's two RMSNorms keep 8 d = 512 more)
    assert ours_saved[0] <= hf_saved[0], (ours_saved[0], hf_saved[0])


# --- the plan equals the measurement -----------------------------------------------------------


def _checkpointed(forward, *args, **kwargs):  # what ls.shard(activation_checkpointing=k) does
    return torch.utils.checkpoint.checkpoint(forward, *args, use_reentrant=False, **kwargs)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("batch", "seq", "n_kv", "ckpt"),
    [(2, 32, 4, 0), (2, 32, 4, 2), (3, 24, 1, 0), (3, 24, 1, 3)],
)
def test_plan_activations_equal_measured(dtype, batch, seq, n_kv, ckpt):
    """``predict_activations`` against MemTracker on the built-in model: what is alive when the
    LM head starts (every block's saved tensors, or a checkpointed block's input, the final
    norm's, the head's input, the RoPE tables) and the peak at the loss (reached when its
    backward starts), less that."""
    dt = DTYPES[dtype]
    cfg = _cfg(n_kv_heads=n_kv)
    model = _model(cfg, dt)
    for block in model.layers[:ckpt]:
        block.forward = partial(_checkpointed, block.forward)
    ids = torch.randint(0, cfg.vocab_size, (batch, seq))
    marks: dict[str, int] = {}
    with LiveMemory(model, [ids]) as mem:
        hook = model.lm_head.register_forward_pre_hook(lambda *_: _mark(marks, "head", mem.current))
        out = model(ids, labels=ids)
        out.logits.register_hook(lambda g: _mark(marks, "loss", mem.peak))
        out.loss.backward()
        hook.remove()
    repeat = _repeats_kv(dt)
    plan = predict_activations(cfg, batch, seq, ckpt, dt, repeat_kv=repeat)
    # one block recomputing in backward (the plan's + A when checkpointing): its saved tensors
    plain = _model(cfg, dt)
    block = {"0": plain.layers[0]}
    a = saved_bytes_by_module(plain, block, lambda: plain(ids, labels=ids).loss)["0"]
    assert plan["activations"] == marks["head"] + (a if ckpt else 0)
    # + two fp32 scalars per step, not per token (the loss and nll_loss's total weight)
    assert marks["loss"] - marks["head"] - plan["logits"] == 8
