"""Input schemas for the command line: pydantic types that say what a value must be, and the one
line that explains the first value that is not. ``layershard train`` (its config and launch
options), ``layershard plan`` and the Python API's options (``engine/options.py``: ``ls.shard``,
``ls.parallelize``, ``ShardingPlugin``) validate through these; nothing else checks types or
ranges.

A field's ``description`` is the rule in words ("a finite number >= 0"), used when a constraint
fails; type errors are phrased from the expected type.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Sequence
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, StrictInt, ValidationError
from pydantic.fields import FieldInfo


def _no_bool(value: Any) -> Any:
    # pydantic's lax float accepts True; a flag or YAML `yes` is never meant as 1.0
    if isinstance(value, bool):
        raise ValueError("bool")
    return value


def _finite(value: Any) -> Any:
    # an int field given `.inf` / `.nan` by YAML: say it is not an integer, not "overflow"
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError("non-finite")
    return value


# Finite numbers (ints accepted, bools not); integers (no bools, no 2.0, no `.inf`).
Number = Annotated[float, BeforeValidator(_no_bool), Field(allow_inf_nan=False)]
Int = Annotated[StrictInt, BeforeValidator(_finite)]
PositiveInt = Annotated[StrictInt, BeforeValidator(_finite), Field(ge=1)]
NonNegativeInt = Annotated[StrictInt, BeforeValidator(_finite), Field(ge=0)]
PositiveNumber = Annotated[float, BeforeValidator(_no_bool), Field(gt=0, allow_inf_nan=False)]


_TYPE_WORDS = {
    "int_type": "an integer",
    "int_parsing": "an integer",
    "int_from_float": "an integer",
    "float_type": "a number",
    "float_parsing": "a number",
    "finite_number": "a finite number",
    "bool_type": "true or false",
    "bool_parsing": "true or false",
    "string_type": "a string",
    "list_type": "a list of strings",
    "dict_type": "a mapping",
}
_CONSTRAINTS = {
    "greater_than": "greater than {gt}",
    "greater_than_equal": "at least {ge}",
    "less_than": "less than {lt}",
    "less_than_equal": "at most {le}",
    "finite_number": "a finite number",
}


def _number(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) and x == int(x) and abs(x) < 1e15 else str(x)


def unknown_key(key: str, valid: Sequence[str], where: str) -> str:
    close = difflib.get_close_matches(key, list(valid), n=1)
    hint = f"did you mean '{close[0]}'? " if close else ""
    return f"unknown config key '{key}' in {where}; {hint}valid keys: {', '.join(valid)}"


def one_line(
    error: ValidationError,
    fields: dict[str, FieldInfo],
    data: dict[str, Any],
    where: str = "the overrides",
    prefix: str = "",
) -> str:
    """The first error of ``error`` as one line: ``NAME must be RULE, got VALUE``. ``fields`` are
    the schema's fields (their descriptions are the rules); ``prefix`` goes before the name
    (``--`` for command-line flags)."""
    e = error.errors()[0]
    kind, ctx = e["type"], e.get("ctx") or {}
    loc = [str(x) for x in e["loc"]]
    if kind in ("unexpected_keyword_argument", "extra_forbidden"):
        return unknown_key(loc[0], list(fields), where)
    if kind == "value_error" and (not loc or loc[0] not in fields or "error" in ctx):
        message = str(ctx.get("error", e["msg"]))
        if message not in ("bool", "non-finite"):
            return message
    if not loc:
        return str(e["msg"])
    name = loc[0]
    value = data.get(name, e.get("input"))
    label = prefix + (name.replace("_", "-") if prefix else name)
    info = fields.get(name)
    rule = info.description if info is not None else None
    if len(loc) > 1 and not loc[1].isdigit() and rule:  # a union (bool or int, ...)
        return f"{label} must be {rule}, got {value!r}"
    if kind == "literal_error":
        if not isinstance(e.get("input"), str):
            return f"{label} must be a string, got {value!r}"
        return f"{label} must be one of {ctx.get('expected', '')}, got {value!r}"
    if kind == "is_instance_of" and rule:  # an object of the Python API (ls.MixedPrecision)
        return f"{label} must be {rule}, got {value!r}"
    if kind in _CONSTRAINTS and rule:
        return f"{label} must be {rule}, got {value!r}"
    if kind in _CONSTRAINTS and kind != "finite_number":
        bound = {k: _number(v) for k, v in ctx.items()}
        return f"{label} must be {_CONSTRAINTS[kind].format(**bound)}, got {value!r}"
    if kind == "value_error":  # _no_bool / _finite: say what the value must be
        annotation = str(info.annotation) if info is not None else ""
        what = "an integer" if "int" in annotation else "a number"
        return f"{label} must be {what}, got {value!r}"
    if kind == "dict_type":
        return f"{label} must be a mapping such as {{dim: 256, n_layers: 6}}, got {value!r}"
    if kind in _TYPE_WORDS:
        if len(loc) > 1 and kind == "string_type" and loc[1].isdigit():
            return f"{label} must be a list of strings, got {value!r}"
        return f"{label} must be {_TYPE_WORDS[kind]}, got {value!r}"
    return f"{label}: {e['msg']}, got {value!r}"
