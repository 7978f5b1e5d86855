"""Bad input gets a clear error that says what to do (single process, world size 1)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from _parity import clone, tiny_llama
from torch import nn

import layershard as ls


@pytest.fixture(scope="module", autouse=True)
def _group():
    ls.init_distributed(backend="gloo")
    assert ls.init_distributed() == (0, 1)  # idempotent


def test_optimizer_built_before_shard():
    model = tiny_llama()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sharded = ls.shard(model)
    sharded(
        torch.zeros(1, 4, dtype=torch.long), labels=torch.zeros(1, 4, dtype=torch.long)
    ).loss.backward()
    with pytest.raises(RuntimeError, match="built before shard"):
        opt.step()
    good = torch.optim.AdamW(sharded.parameters(), lr=1e-3)
    good.step()  # the right order works


def test_layers_not_inside_model():
    model, other = tiny_llama(), tiny_llama()
    with pytest.raises(ValueError, match="not a submodule of the model"):
        ls.shard(model, layers=other.layers)
    with pytest.raises(ValueError, match="not a submodule name"):
        ls.shard(model, layers=["blocks.0"])
    with pytest.raises(ValueError, match="nested"):
        ls.shard(model, layers=[model.layers[0], model.layers[0].attn])


def test_strategy_arguments():
    with pytest.raises(ValueError, match="strategy must be one of 'full', 'grad_op', 'no_shard'"):
        ls.shard(tiny_llama(), strategy="zero4")
    with pytest.raises(ValueError, match="shard_size=...\\) applies to strategy='hybrid'"):
        ls.shard(tiny_llama(), strategy="full", shard_size=2)
    with pytest.raises(ValueError, match="reshard_after_forward=...\\) applies to strategy='full'"):
        ls.shard(tiny_llama(), strategy="no_shard", reshard_after_forward=2)
    with pytest.raises(ValueError, match="shard_size=3\\): must divide the world size 1"):
        ls.shard(tiny_llama(), strategy="hybrid", shard_size=3)


def test_parameters_on_mixed_devices():
    model = tiny_llama()
    model.lm_head.weight = nn.Parameter(torch.empty(model.lm_head.weight.shape, device="meta"))
    with pytest.raises(ValueError, match="several devices"):
        ls.shard(model)


def test_meta_module_without_init():
    class Bare(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.empty(3, 3))

        def forward(self, x):
            return x @ self.w

    with torch.device("meta"):
        model = nn.Sequential(Bare(), Bare())
    with pytest.raises(ValueError, match="no reset_parameters.*param_init_fn"):
        ls.shard(model)
    sharded = ls.shard(
        model, param_init_fn=lambda m: nn.init.eye_(m.w) if isinstance(m, Bare) else None
    )
    torch.testing.assert_close(sharded(torch.ones(2, 3)), torch.ones(2, 3))


def test_other_misuse():
    model = ls.shard(tiny_llama())
    with pytest.raises(ValueError, match="already sharded"):
        ls.shard(model)
    with pytest.raises(RuntimeError, match="full_state_dict"):
        model.state_dict()
    with pytest.raises(RuntimeError, match="device= and mixed_precision="):
        model.to(torch.float16)
    with pytest.raises(ValueError, match="between 0 and the number of blocks"):
        ls.shard(tiny_llama(), activation_checkpointing=9)
    sd = model.full_state_dict()
    bad = dict(sd, **{"norm.weight": torch.ones(5)})
    with pytest.raises(ValueError, match=r"norm.weight has shape \(5,\)"):
        model.load_full_state_dict(bad)
    missing = {k: v for k, v in sd.items() if k != "lm_head.weight"}
    with pytest.raises(ValueError, match="missing keys.*lm_head.weight"):
        model.load_full_state_dict(missing)


def test_attributes_and_parameters_stay_reachable():
    base = tiny_llama()
    model = ls.shard(clone(base))
    assert model.config == base.config and isinstance(model.layers, nn.ModuleList)
    names = [n for n, _ in model.named_parameters()]
    assert names == [n for n, _ in base.named_parameters()]
    assert all(p.dim() == 1 for p in model.parameters())  # slices of the flat fp32 shard
    assert "unit" in model.describe()


def test_shard_before_init_distributed():
    code = "import torch, layershard as ls; ls.shard(torch.nn.Linear(2, 2))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode != 0 and "call ls.init_distributed() first" in out.stderr
