"""The types of the options ``ls.shard``, ``ls.parallelize`` and ``ls.hf.ShardingPlugin`` take,
checked where they enter, before any process group or model is touched: the command line's
types and one-line messages (``layershard.validation``), ``TypeError`` for a value of the wrong
type, ``ValueError`` for one out of range. What relates several options (``shard_size`` must
divide the world...) stays with the code that knows it (``strategy.check_options``, ``meshes``).
"""

from __future__ import annotations

import operator
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, Field, InstanceOf, StrictBool, ValidationError
from pydantic_core import ErrorDetails

from layershard.engine.precision import MixedPrecision
from layershard.engine.strategy import STRATEGIES, CPUOffload
from layershard.validation import NonNegativeInt, PositiveInt, one_line


def _index(value: Any) -> Any:
    # numpy's and torch's integers are integers to Python (operator.index); bools are not
    if isinstance(value, (bool, int)) or not hasattr(type(value), "__index__"):
        return value
    try:
        return operator.index(value)
    except TypeError:  # a float tensor: refused as "not an integer" by the type that follows
        return value


Ranks = Annotated[PositiveInt, BeforeValidator(_index)]
Blocks = Annotated[NonNegativeInt, BeforeValidator(_index)]


class _Options(BaseModel):
    tp: Ranks = 1
    ep: Ranks = 1
    dp_replicate: Ranks = 1
    cp: Ranks = 1
    # parallel/context/state.py's MODES (that layer is above this one)
    cp_mode: Literal["ring", "all_to_all"] = "ring"
    shard_size: Ranks | None = None
    strategy: Literal[tuple(STRATEGIES)] = "full"  # type: ignore[valid-type]
    reshard_after_forward: Annotated[
        StrictBool | Ranks, Field(description="True, False or a number of ranks K >= 1")
    ] = True
    activation_checkpointing: Blocks = 0
    blocks_per_unit: Ranks = 1
    mixed_precision: Annotated[
        InstanceOf[MixedPrecision] | None, Field(description="an ls.MixedPrecision(...) or None")
    ] = None
    offload: Annotated[
        InstanceOf[CPUOffload] | None, Field(description="an ls.CPUOffload(...) or None")
    ] = None
    compile: Annotated[
        StrictBool | dict[str, Any],
        Field(description="True, False or a dict of torch.compile options"),
    ] = False


_TYPE_KINDS = {"int_type", "int_from_float", "bool_type", "string_type", "dict_type"}
_TYPE_KINDS |= {"is_instance_of", "value_error"}  # value_error: a bool or inf for an integer


def _wrong_type(error: ErrorDetails) -> bool:
    if error["type"] == "literal_error":
        return not isinstance(error.get("input"), str)
    return error["type"] in _TYPE_KINDS


def check(where: str, **given: Any) -> None:
    """Raise, in one line (``"<where>: tp must be at least 1, got 0"``), for the first of
    ``given`` whose value its option cannot take; other keywords are not looked at."""
    known = {k: v for k, v in given.items() if k in _Options.model_fields}
    try:
        _Options.model_validate(known)
    except ValidationError as e:
        errors = e.errors()
        name = errors[0]["loc"][:1]
        wrong_type = all(_wrong_type(x) for x in errors if x["loc"][:1] == name)
        kind = TypeError if wrong_type else ValueError
        raise kind(f"{where}: {one_line(e, _Options.model_fields, known)}") from None
