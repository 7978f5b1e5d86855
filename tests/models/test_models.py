"""The reference Llama: shapes, loss, tying, the meta-device init contract, presets, HF parity."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from layershard.models import (
    PRESETS,
    LlamaForCausalLM,
    build_config,
    from_hf_name,
    hf_llama_config,
    to_hf_name,
)


def _tiny(**overrides):
    base = dict(vocab_size=97, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64)
    base.update(overrides)
    return build_config("tiny", **base)


def test_shapes_and_loss_matches_manual_cross_entropy():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny())
    ids = torch.randint(0, 97, (3, 16))
    labels = ids.clone()
    labels[0, :5] = -100  # ignored positions must not count in the mean
    out = model(ids, labels=labels)
    assert out.logits.shape == (3, 16, 97)
    manual = F.cross_entropy(
        out.logits[:, :-1].reshape(-1, 97).float(), labels[:, 1:].reshape(-1), ignore_index=-100
    )
    n = (labels[:, 1:] != -100).sum()
    by_hand = (
        -torch.log_softmax(out.logits[:, :-1].float(), -1)
        .gather(-1, labels[:, 1:].clamp(min=0).unsqueeze(-1))
        .squeeze(-1)[labels[:, 1:] != -100]
        .sum()
        / n
    )
    torch.testing.assert_close(out.loss, manual)
    torch.testing.assert_close(out.loss, by_hand)
    assert model(ids).loss is None


def test_tied_embeddings_share_one_parameter():
    model = LlamaForCausalLM(_tiny(tie_embeddings=True))
    assert model.lm_head.weight is model.embed.weight
    names = [n for n, _ in model.named_parameters()]
    assert "embed.weight" in names and "lm_head.weight" not in names
    untied = LlamaForCausalLM(_tiny())
    assert untied.num_params() == model.num_params() + 97 * 32


@pytest.mark.parametrize("tied", [False, True])
def test_meta_build_then_reset_parameters_matches_eager(tied):
    cfg = _tiny(tie_embeddings=tied)
    torch.manual_seed(1234)
    eager = LlamaForCausalLM(cfg)
    with torch.device("meta"):
        meta = LlamaForCausalLM(cfg)
    meta.to_empty(device="cpu")
    if tied:  # Module.to_empty unties shared parameters; whoever materializes must re-tie
        meta.lm_head.weight = meta.embed.weight
    torch.manual_seed(1234)
    for m in meta.modules():
        if hasattr(m, "reset_parameters"):
            m.reset_parameters()
    for (n1, p1), (n2, p2) in zip(eager.state_dict().items(), meta.state_dict().items()):
        assert n1 == n2
        assert torch.equal(p1, p2), n1
    # non-persistent RoPE tables are rebuilt too
    assert torch.equal(eager.rotary.cos, meta.rotary.cos)
    assert "rotary.cos" not in eager.state_dict()


def test_bf16_weights_compute_in_bf16_and_loss_in_fp32():
    model = LlamaForCausalLM(_tiny()).to(torch.bfloat16)
    ids = torch.randint(0, 97, (2, 8))
    out = model(ids, labels=ids)
    assert out.logits.dtype == torch.bfloat16
    assert out.loss.dtype == torch.float32


def test_generate_length_and_context_crop():
    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny(max_seq_len=8)).eval()
    ids = torch.randint(0, 97, (2, 5))
    out = model.generate(ids, max_new_tokens=6, temperature=0.8, top_k=10)
    assert out.shape == (2, 11)
    assert torch.equal(out[:, :5], ids)
    greedy = model.generate(ids, max_new_tokens=3, temperature=0)
    assert torch.equal(greedy, model.generate(ids, max_new_tokens=3, temperature=0))


def test_presets_param_counts_are_plausible():
    counts = {}
    for name in PRESETS:
        with torch.device("meta"):
            counts[name] = LlamaForCausalLM(build_config(name)).num_params()
    assert abs(counts["llama-7b"] - 6.74e9) / 6.74e9 < 0.02
    assert abs(counts["llama-13b"] - 13.0e9) / 13.0e9 < 0.02
    assert abs(counts["llama-70b"] - 69.0e9) / 69.0e9 < 0.02
    assert abs(counts["llama-1b"] - 1.24e9) / 1.24e9 < 0.02
    assert 30e6 < counts["small"] < 40e6
    assert counts["tiny"] < 5e6


def test_build_config_errors_name_the_valid_choices():
    with pytest.raises(ValueError, match="valid names: tiny, small"):
        build_config("huge")
    with pytest.raises(ValueError, match="unknown LlamaConfig field"):
        build_config("tiny", depth=3)
    assert build_config("tiny", vocab_size=500).vocab_size == 500


@pytest.mark.parametrize("tied", [False, True])
def test_matches_transformers_llama(tied):
    transformers = pytest.importorskip("transformers")
    cfg = _tiny(tie_embeddings=tied)
    torch.manual_seed(0)
    ours = LlamaForCausalLM(cfg).eval()
    hf_cfg = hf_llama_config(cfg)
    hf_cfg._attn_implementation = "sdpa"
    hf = transformers.LlamaForCausalLM(hf_cfg).eval()
    sd = {to_hf_name(k): v for k, v in ours.state_dict().items()}
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    assert not unexpected
    assert set(missing) <= ({"lm_head.weight"} if tied else set())
    assert all(from_hf_name(to_hf_name(k)) == k for k in ours.state_dict())
    ids = torch.randint(0, 97, (2, 12))
    with torch.no_grad():
        ref = hf(ids, labels=ids)
        got = ours(ids, labels=ids)
    torch.testing.assert_close(got.logits, ref.logits, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(got.loss, ref.loss, atol=1e-5, rtol=1e-5)
