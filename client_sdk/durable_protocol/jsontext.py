"""JSON objects read from outside the process (a client's control request, a coordinator's record,
a node's answer to a tool): one reader, so each refuses what the others refuse with a ValueError
its caller turns into its own error, never an exception that ends the reading loop."""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from typing import Any


def json_object(raw: bytes, *, parse_int: Callable[[str], object] = int, finite: bool = False) -> dict[str, Any]:
    """The JSON object in ``raw`` (UTF-8: bytes are not read as UTF-16/32 as json.loads reads them). A
    ValueError saying what is wrong (``not UTF-8 JSON: ...``, ``JSON nested too deeply``: json raises
    RecursionError past the interpreter's limit, ``not a JSON object but an array``) for anything else;
    with ``finite``, also for ``NaN``, ``Infinity`` and a number past a float's range (``1e999``), which
    ``int()`` of it or a comparison would trip over later. ``parse_int`` reads each integer."""
    try:
        value = json.loads(
            raw.decode("utf-8"),
            parse_int=parse_int,
            parse_constant=_no_constant if finite else None,
            parse_float=_finite_float if finite else None,
        )
    except _NotFiniteError:
        raise
    except (UnicodeDecodeError, ValueError) as exc:
        raise ValueError(f"not UTF-8 JSON: {exc}") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply") from None
    if not isinstance(value, dict):
        raise ValueError(f"not a JSON object but {json_kind(value)}")
    return value


def json_kind(value: object) -> str:
    """What a value read from JSON is, in JSON's words (``a JSON null``, ``a boolean``, ``a number``, ``a string``,
    ``an array``, ``an object``), for an error read by whoever wrote the JSON, not in Python's type names."""
    if value is None:
        return "a JSON null"
    for kind, name in ((bool, "a boolean"), (int | float, "a number"), (str, "a string"), (list, "an array")):
        if isinstance(value, kind):
            return name
    return "an object"


class _NotFiniteError(ValueError):
    """A number ``finite`` refuses: said as it is, not as JSON that does not parse."""


def _no_constant(name: str) -> float:
    raise _NotFiniteError(f"{name} is not a number this reads")


def _finite_float(text: str) -> float:
    number = float(text)
    if not math.isfinite(number):
        raise _NotFiniteError(f"{text[:40]} is past a float's range")
    return number
