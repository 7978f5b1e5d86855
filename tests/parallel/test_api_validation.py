"""The options of ``ls.parallelize``, ``ls.shard`` and ``ls.hf.ShardingPlugin`` are checked where
they enter (issue 51): a value of the wrong type or out of range is refused in one line that names
the argument, the value and what it may be, before any process group or model is touched.
Before, ``tp="2"`` reached ``"2" < 1`` in meshes.py (a TypeError naming no argument),
``reshard_after_forward="yes"`` an ``int("yes")``, ``ShardingPlugin(tp="2")`` nothing at all
until ``prepare()``."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layershard as ls

# (argument, value, error, message after "<where>: "), for every entry point
BAD = [
    ("tp", "2", TypeError, "tp must be an integer, got '2'"),
    ("tp", 0, ValueError, "tp must be at least 1, got 0"),
    ("tp", -1, ValueError, "tp must be at least 1, got -1"),
    ("tp", True, TypeError, "tp must be an integer, got True"),
    ("ep", 1.5, TypeError, "ep must be an integer, got 1.5"),
    ("ep", 0, ValueError, "ep must be at least 1, got 0"),
    (
        "strategy",
        "foo",
        ValueError,
        "strategy must be one of 'full', 'grad_op', 'no_shard' or 'hybrid', got 'foo'",
    ),
    ("strategy", None, TypeError, "strategy must be a string, got None"),
    (
        "reshard_after_forward",
        "yes",
        TypeError,
        "reshard_after_forward must be True, False or a number of ranks K >= 1, got 'yes'",
    ),
    (
        "reshard_after_forward",
        0,
        ValueError,
        "reshard_after_forward must be True, False or a number of ranks K >= 1, got 0",
    ),
    ("shard_size", 0, ValueError, "shard_size must be at least 1, got 0"),
    ("shard_size", "4", TypeError, "shard_size must be an integer, got '4'"),
    (
        "activation_checkpointing",
        -1,
        ValueError,
        "activation_checkpointing must be at least 0, got -1",
    ),
    (
        "mixed_precision",
        "bf16",
        TypeError,
        "mixed_precision must be an ls.MixedPrecision(...) or None, got 'bf16'",
    ),
    ("offload", True, TypeError, "offload must be an ls.CPUOffload(...) or None, got True"),
    (
        "compile",
        "yes",
        TypeError,
        "compile must be True, False or a dict of torch.compile options, got 'yes'",
    ),
]
SHARD_ONLY = {"tp", "ep"}  # ls.shard has no tp / ep (ls.parallelize's)


def _refused(call, error: type, message: str) -> None:
    with pytest.raises(error) as caught:
        call()
    assert str(caught.value) == message
    assert type(caught.value) is error  # not a subclass raised from deeper down


@pytest.mark.parametrize("name,value,error,message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_parallelize_refuses(name, value, error, message) -> None:
    """Checked before the process group: no ``init_distributed`` needed to see the error."""
    _refused(
        lambda: ls.parallelize(nn.Linear(2, 2), **{name: value}), error, f"parallelize(): {message}"
    )


@pytest.mark.parametrize("name,value,error,message", BAD, ids=[f"{b[0]}={b[1]!r}" for b in BAD])
def test_sharding_plugin_refuses_at_construction(name, value, error, message) -> None:
    """At ``ShardingPlugin(...)``, not at ``prepare()`` many steps later."""
    from layershard.hf import ShardingPlugin

    _refused(lambda: ShardingPlugin(**{name: value}), error, f"ShardingPlugin(): {message}")


SHARD_BAD = [b for b in BAD if b[0] not in SHARD_ONLY]


@pytest.mark.parametrize(
    "name,value,error,message", SHARD_BAD, ids=[f"{b[0]}={b[1]!r}" for b in SHARD_BAD]
)
def test_shard_refuses(name, value, error, message) -> None:
    _refused(lambda: ls.shard(nn.Linear(2, 2), **{name: value}), error, f"shard(): {message}")


def test_dp_replicate_is_checked() -> None:
    _refused(
        lambda: ls.parallelize(nn.Linear(2, 2), dp_replicate=0),
        ValueError,
        "parallelize(): dp_replicate must be at least 1, got 0",
    )


def test_valid_values_pass_the_checks(monkeypatch) -> None:
    """Values that were accepted before still are: the next error is the missing process group
    (numpy and torch integers are integers)."""
    import numpy as np

    from layershard.hf import ShardingPlugin

    # another test of this session may have made a process group of one
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: False)

    good = dict(
        strategy="full",
        reshard_after_forward=2,
        activation_checkpointing=np.int64(1),
        mixed_precision=ls.MixedPrecision(param_dtype=torch.bfloat16),
        offload=ls.CPUOffload(),
        compile={"mode": "default"},
    )
    with pytest.raises(RuntimeError, match="call ls.init_distributed"):
        ls.parallelize(nn.Linear(2, 2), tp=np.int64(2), ep=torch.tensor(1), **good)
    with pytest.raises(RuntimeError, match="call ls.init_distributed"):
        ls.shard(nn.Linear(2, 2), shard_size=None, **good)
    plugin = ShardingPlugin(
        tp=2, ep=1, strategy="hybrid", shard_size=2, reshard_after_forward=False
    )
    assert plugin.tp == 2


def test_mixed_precision_dtypes_are_named() -> None:
    """``gather_dtype`` / ``reduce_dtype`` are MixedPrecision's: refused there, by name."""
    with pytest.raises(ValueError) as e:
        ls.MixedPrecision(gather_dtype="fp4")
    assert str(e.value) == (
        "MixedPrecision.gather_dtype='fp4' is not supported; use None (the compute dtype, "
        "exact), torch.float8_e4m3fn or torch.int8"
    )
    with pytest.raises(ValueError) as e:
        ls.MixedPrecision(reduce_dtype="bf16")
    assert str(e.value) == (
        "MixedPrecision.reduce_dtype='bf16' is not supported; use torch.float32, "
        "torch.bfloat16 or torch.float16"
    )
