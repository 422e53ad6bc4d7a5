"""Scalar settings read from YAML, shared by the plugin's and replication's configuration.

YAML booleans are ints to Python, so each scalar kind is checked exactly, not with int()/float().
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping
from typing import Any, SupportsFloat

import yaml

from durable_protocol import int_digits, long_fraction, too_many_digits

from .errors import ConfigError

LISTEN_BACKLOG = 512
"""The default of ``listen_backlog``: the listen backlog of the broker's listeners (TCP and websocket)
and of its replication address (config.DurableConfig.listen_backlog)."""
MAX_LISTEN_BACKLOG = 2**31 - 1
"""listen() takes a C int; a larger listen_backlog is passed as this (Linux caps it at somaxconn anyway)."""


def socket_backlog(listen_backlog: int) -> int:
    """The ``listen_backlog`` setting as every listener (MQTT and replication) passes it to listen()."""
    return min(listen_backlog, MAX_LISTEN_BACKLOG)


def refuse_long_ints(where: str, value: Any) -> None:
    """Refuse an int (or a Fraction's) of more than ``int_digits()`` digits anywhere in a setting given in
    Python, in a mapping (its keys too), list or settings object (broker.yaml's reader refuses them as it
    reads): a message showing one, or the name of a key, would raise Python's own ValueError instead of
    naming the setting."""
    if isinstance(value, int) and too_many_digits(value):
        raise ConfigError(where, f"an integer of more than {int_digits()} digits")
    if long_fraction(value) is not None:
        raise ConfigError(where, f"a fraction of an integer of more than {int_digits()} digits")
    if isinstance(value, Mapping):
        for key, item in value.items():
            refuse_long_key(where, key)
            refuse_long_ints(f"{where}.{key}", item)
    elif isinstance(value, (list, tuple)):
        for index, item in enumerate(value):
            refuse_long_ints(f"{where}[{index}]", item)
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for field in dataclasses.fields(value):
            refuse_long_ints(f"{where}.{field.name}", getattr(value, field.name))


def refuse_long_key(where: str, key: Any) -> None:
    """Refuse a key of the mapping at ``where`` that is an int too long to name in a message."""
    if isinstance(key, int) and too_many_digits(key):
        raise ConfigError(where, f"a key that is an integer of more than {int_digits()} digits")


def _as_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    raise ConfigError(key, f"expected true or false, got {value!r}")


def _as_int(key: str, value: Any) -> int:
    """A YAML integer. A float is refused even when whole (``5.0``): the key counts things, and YAML
    reads ``5.0`` as a float, so the error says how to write it rather than "not a whole number"."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():
        raise ConfigError(key, f"must be written as an integer ({int(value)}), not {value!r}")
    raise ConfigError(key, f"expected a whole number, got {value!r}")


class WrittenFloat(float):
    """A number read as a float that shows (repr, str, an f-string's ``{}``) as the user wrote it,
    so an error quotes what is in the file: ``session_expiry: -1`` is refused with ``got -1``, not
    ``got -1.0``. Only about: YAML gives the value, not its text (``1.50`` shows as ``1.5``); a
    command line's text shows as typed. Arithmetic on it gives plain floats."""

    text: str

    def __new__(cls, value: SupportsFloat | str) -> WrittenFloat:
        number = super().__new__(cls, value)
        if isinstance(value, str):
            number.text = value.strip()
        elif isinstance(value, WrittenFloat):  # checked again (DurableConfig(...) after from_mapping)
            number.text = value.text
        else:  # an int as written; a float, Fraction, numpy number as the float it is (replication reads it back)
            number.text = repr(value) if type(value) is int else repr(float(number))
        return number

    def __repr__(self) -> str:
        return self.text

    __str__ = __repr__


def seconds_text(value: float) -> str:
    """Seconds for a log line: a setting as written (a WrittenFloat), else exact: a whole number in all its
    digits (300 for a hello's 300.0, 100000000000000000000 for 1e20), another in the shortest text that
    reads back as the same float (0.3333333333333333; ``.15g`` cut 1/3 to 0.333333333333333, 2**60 to
    1.15292150460685e+18)."""
    if isinstance(value, WrittenFloat):
        return str(value)
    number = float(value)
    return str(int(number)) if number.is_integer() else repr(number)


class TooLargeFloat(WrittenFloat):
    """A float broker.yaml writes finite that no float holds (above about 1.8e308, such as ``1.0e+400``
    or 310 digits before its point), which PyYAML reads as inf: a *number* setting refuses it as too
    large for a float, as it does such a number given in Python, and an error quotes it as written,
    not as ``inf``."""

    @classmethod
    def written(cls, value: float, text: str) -> TooLargeFloat:
        number = cls(value)
        number.text = text.strip()
        return number


# yaml.safe_dump of a parsed setting writes a plain float, as for the float it stands for.
yaml.SafeDumper.add_multi_representer(WrittenFloat, lambda dumper, data: dumper.represent_float(float(data)))


def _as_float(key: str, value: Any) -> float:
    """A YAML int or float, or any real number given in Python (a Fraction too), as a float."""
    if isinstance(value, TooLargeFloat):  # broker.yaml's 1.0e+400: refused as Python's 10**400 is, not as inf
        raise ConfigError(key, "must be a finite number, got a number too large for one")
    if isinstance(value, numbers.Real) and not isinstance(value, bool):
        try:
            return WrittenFloat(value)
        except OverflowError:  # above about 1.8e308 (an integer of 310 digits, Fraction(10**400, 3)): no float holds it
            raise ConfigError(key, "must be a finite number, got a number too large for one") from None
    raise ConfigError(key, f"expected a number, got {value!r}")


SCALARS: dict[str, Callable[[str, Any], Any]] = {"bool": _as_bool, "int": _as_int, "float": _as_float}
