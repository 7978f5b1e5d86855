"""What `ls.shard` refuses before it builds anything (issue 26 §4), one line each, on every rank:
a module with parameters shared by two blocks (accepted before, then a shape error in forward),
a bf16 parameter (converted to fp32 silently before), and ranks that shard different models or
with different options (a hang until the process-group timeout before)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from _dist import RankChecks
from torch import nn

import layershard as ls
from layershard.models import LlamaConfig, LlamaForCausalLM

TINY = dict(vocab_size=64, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=64, max_seq_len=16)

checks = RankChecks(world_size=2)


def _model(**overrides) -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**{**TINY, **overrides}))


def _refused(model, match: str, **kwargs) -> str:
    with pytest.raises(ValueError, match=match) as caught:
        ls.shard(model, **kwargs)
    msg = str(caught.value)
    assert "\n" not in msg, msg
    return msg


def _train_step(model) -> None:
    x = torch.randint(0, TINY["vocab_size"], (2, 8))
    model(x, labels=x).loss.backward()


@checks.check
def shared_module_is_refused(rank: int, world: int) -> None:
    m = _model()
    m.layers[1].mlp = m.layers[0].mlp
    msg = _refused(m, r"module layers\.0\.mlp is also layers\.1\.mlp")
    assert "units layers.0 and layers.1" in msg and "tie the parameters" in msg, msg
    # what the message proposes works: tied parameters go to the root unit
    m = _model()
    m.layers[1].mlp.w1.weight = m.layers[0].mlp.w1.weight
    _train_step(ls.shard(m))
    # a module without parameters (buffers only) may be shared
    m = _model()
    shared = nn.Module()
    shared.register_buffer("scale", torch.ones(1))
    m.layers[0].extra = m.layers[1].extra = shared
    _train_step(ls.shard(m))


@checks.check
def bf16_parameter_is_refused(rank: int, world: int) -> None:
    m = _model()
    m.layers[0].mlp.w1.to(torch.bfloat16)
    msg = _refused(m, r"trainable parameter layers\.0\.mlp\.w1\.weight is bfloat16")
    assert "frozen parameters may stay bfloat16" in msg and "MixedPrecision" in msg, msg
    _refused(_model().to(torch.bfloat16), r"is bfloat16; layershard keeps fp32 master weights")
    # the documented recipe: fp32 parameters, bf16 compute
    _train_step(ls.shard(_model(), mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16)))


@checks.check
def different_models_on_ranks_are_named(rank: int, world: int) -> None:
    more = _model(n_layers=3 if rank == 1 else 2)
    msg = _refused(more, r"the ranks shard different models")
    assert "unit 3 is norm on rank 0, layers.2 on rank 1" in msg, msg
    wider = _model(ffn_dim=48 if rank == 1 else 64)
    msg = _refused(wider, r"the ranks shard different models")
    assert "layers.0.mlp.w1.weight (64, 32)" in msg and "(48, 32)" in msg, msg
    msg = _refused(_model(), r"shard option activation_checkpointing: 0 on rank 0, 1 on rank 1",
                   activation_checkpointing=rank)  # fmt: skip
    dist.barrier()
    _train_step(ls.shard(_model()))  # the ranks are still in step


@checks.check
def a_call_made_on_one_rank_names_what_it_waited_in(rank: int, world: int) -> None:
    """A collective API called on some ranks only: the timeout says which call and why, in
    the error type the backend raised (a bare gloo "Timed out waiting 3000ms" before)."""
    from datetime import timedelta

    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=3))
    model = ls.shard(_model(), process_group=group)
    if rank == 0:
        with pytest.raises(RuntimeError, match="timed out waiting in .*full_state_dict") as e:
            model.full_state_dict()
        assert "every rank must make the same calls" in str(e.value)
        assert "\n" not in str(e.value).split("Original error")[0]
    dist.barrier()  # rank 1 stays until rank 0's timeout has been seen


checks.collect(globals())
