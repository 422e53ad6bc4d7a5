"""Checks of the SDK's options and arguments, made where they are given (docs/sdk.md, "Bad input").

Every check raises ValueError whose message starts with the option's name and says what is
accepted; a value of the wrong type raises WrongTypeError, a ValueError that is also a
TypeError. A value that would only fail later (a port past 65535 at the first TCP connect, a
NUL in a topic when the broker drops the connection, a timeout too large for a wait) is
refused here, before anything is sent. Whole numbers are taken from anything with
``__index__`` (a numpy integer), seconds from any real number (``numbers.Real``), lists from
any iterable; a flag must be True or False.
"""

from __future__ import annotations

import math
import numbers
import operator
import os
import threading
from collections.abc import Iterable
from typing import Any

from durable_protocol import (
    CONTROL_PREFIX,
    MAX_STREAM_WINDOW,
    filter_is_valid,
    int_digits,
    long_fraction,
    too_many_digits,
)
from durable_protocol.hostport import parse_host

from ._paho import topic_matches
from .errors import WrongTypeError

MAX_STRING = 65_535
"""An MQTT string's most bytes (its length is two bytes): client ids, topics, user names, passwords."""

MAX_SECONDS = threading.TIMEOUT_MAX
"""The longest wait Python's threads take (about 292 years): a longer timeout is refused."""

MAX_FAILOVER = 1000
"""The most addresses ``failover`` may hold (the client tries each in turn)."""

_SHOWN = 60  # characters of a value's repr shown in a message


def check_options(
    *,
    client_id: object,
    host: object,
    port: object,
    keepalive: object,
    session_expiry: object,
    username: object,
    password: object,
    durable_session: object,
    reconnect_min_delay: object,
    reconnect_max_delay: object,
    delivery_log: object,
    state_dir: object,
    failover: object,
    **callbacks: object,
) -> dict[str, Any]:
    """DurableClient's options (those that ``_commit`` and ``persistence`` do not check themselves),
    as the client keeps them: the host without IPv6 brackets, whole numbers as ``int``, seconds as
    ``float`` (``session_expiry`` an ``int`` when given as one), the password as ``str`` or ``bytes``,
    ``failover`` a list of (host, port)."""
    check_client_id(client_id)
    checked: dict[str, Any] = {
        "host": check_host("host", host),
        "port": check_port("port", port),
        "keepalive": check_whole("keepalive", keepalive, 1, 65535, "a whole number of seconds"),
        "session_expiry": None,
        "username": check_username(username),
        "password": check_password(password),
        "reconnect_min_delay": check_seconds("reconnect_min_delay", reconnect_min_delay, low=0),
        "reconnect_max_delay": check_seconds("reconnect_max_delay", reconnect_max_delay, low=0),
        "failover": check_failover(failover),
    }
    if session_expiry is not None:
        seconds = check_seconds("session_expiry", session_expiry, low=0, inclusive=True, high=math.inf)
        checked["session_expiry"] = (
            operator.index(session_expiry) if isinstance(session_expiry, numbers.Integral) else seconds
        )
    check_bool("durable_session", durable_session)
    for name, path in (("delivery_log", delivery_log), ("state_dir", state_dir)):
        if path is None:
            continue
        if not isinstance(path, str | os.PathLike):
            raise WrongTypeError(f"{name} must be a path (str or os.PathLike) or None, got {_show(path)}")
        given = os.fspath(path)
        if ("\0" if isinstance(given, str) else b"\0") in given:  # open/mkdir: a bare "embedded null byte"
            raise ValueError(f"{name}: a path cannot hold U+0000 (NUL), got {_show(path)}")
        try:
            os.fsencode(given)  # a lone surrogate outside surrogateescape's range names no file
        except UnicodeEncodeError:
            raise ValueError(f"{name}: a path the file system cannot encode, got {_show(path)}") from None
    for name, callback in callbacks.items():
        check_callable(name, callback)
    return checked


def check_client_id(client_id: object) -> str:
    if not isinstance(client_id, str):
        raise WrongTypeError(f"client_id must be a non-empty string, got {type(client_id).__name__}")
    if not client_id:
        raise ValueError("client_id must be a non-empty string: the broker finds the durable session by it")
    _check_mqtt_string("client_id", client_id)
    return client_id


def check_host(option: str, host: object) -> str:
    """A host name or an IP address (durable_protocol.hostport.parse_host): an IPv6 address with
    or without brackets (``[::1]`` is ``::1``); ``host:port`` is refused (the port is its own
    option), as are an empty host, a space or NUL in it, and brackets around anything else."""
    usage = f"{option} must be a host name or an IP address, without a port, spaces or NUL"
    if not isinstance(host, str):
        raise WrongTypeError(f"{usage}, got {_show(host)}")
    try:
        host.encode("utf-8")  # a lone surrogate names no host (parse_host leaves encodings to the resolver)
        return parse_host(host)
    except ValueError as exc:
        raise ValueError(
            f"{usage} (an IPv6 address bare or in brackets: '::1' or '[::1]'), got {_show(host)}: {exc}"
        ) from None


def check_port(option: str, port: object) -> int:
    return check_whole(option, port, 1, 65535)


def check_whole(option: str, value: object, low: int, high: int | None = None, what: str = "a whole number") -> int:
    """A whole number (``int`` or anything with ``__index__``, not a bool) from ``low`` to ``high``."""
    bounds = f"from {low} to {high}" if high is not None else f"{low} or more"
    if isinstance(value, bool):
        raise WrongTypeError(f"{option} must be {what} {bounds}, got {value!r}")
    try:
        number = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise WrongTypeError(f"{option} must be {what} {bounds}, got {_show(value)}") from None
    if number < low or (high is not None and number > high):
        raise ValueError(f"{option} must be {what} {bounds}, got {_show(value)}")
    if high is None and too_many_digits(number):  # JSON carries it as digits: the broker refuses such a request
        raise ValueError(f"{option} must be {what} {bounds} of at most {int_digits()} digits, got {_show(value)}")
    return number


def check_seconds(
    option: str, value: object, *, low: float, inclusive: bool = False, high: float = MAX_SECONDS, unit: str = "seconds"
) -> float:
    """A finite number of seconds (any ``numbers.Real`` but a bool) above ``low`` (``inclusive``:
    ``low`` itself too) and at most ``high`` (by default the longest wait a thread can take)."""
    bound = f"{'at least' if inclusive else 'more than'} {low:g}"
    usage = f"{option} must be a finite number of {unit}, {bound}" + (
        f" and at most {high:.0f}" if math.isfinite(high) else ""
    )
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise WrongTypeError(f"{usage}, got {_show(value)}")
    try:
        number = float(value)
    except (OverflowError, ValueError):  # 10**400, Fraction(10**400, 3): too large for a float
        raise ValueError(f"{usage}, got {_show(value)}") from None
    if not (math.isfinite(number) and (number >= low if inclusive else number > low) and number <= high):
        raise ValueError(f"{usage}, got {_show(value)}")
    return number


def check_username(value: object) -> str | None:
    """An MQTT string (UTF-8 without U+0000, at most 65535 bytes) or None."""
    if value is None:
        return None
    if not isinstance(value, str):
        raise WrongTypeError(f"username must be a string or None, got {type(value).__name__}")
    _check_mqtt_string("username", value)
    return value


def check_password(value: object) -> str | bytes | None:
    """MQTT's password is binary data: bytes (any, NUL included) or a string (sent as UTF-8), at
    most 65535 bytes, or None. A bytearray is taken as bytes."""
    if value is None:
        return None
    if isinstance(value, bytearray):
        value = bytes(value)
    if isinstance(value, bytes):
        size = len(value)
    elif isinstance(value, str):
        try:
            size = len(value.encode("utf-8"))
        except UnicodeEncodeError:
            raise ValueError("password must be valid UTF-8 when a string (a lone surrogate is not)") from None
    else:
        raise WrongTypeError(f"password must be bytes, a string or None, got {type(value).__name__}")
    if size > MAX_STRING:
        raise ValueError(f"password must be at most {MAX_STRING} bytes, got {size}")
    return value


def check_bool(option: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise WrongTypeError(f"{option} must be True or False, got {_show(value)}")
    return value


def check_callable(option: str, value: object, *, optional: bool = True) -> None:
    if (value is None and optional) or callable(value):
        return
    raise WrongTypeError(f"{option} must be a function{' or None' if optional else ''}, got {type(value).__name__}")


def check_qos(qos: object) -> int:
    if type(qos) is int and 0 <= qos <= 2:  # the common case, at once
        return qos
    return check_whole("qos", qos, 0, 2)


def check_window(window: object) -> int | None:
    """subscribe_stream's ``window``: None (the broker's default) or 1 to MAX_STREAM_WINDOW."""
    return None if window is None else check_whole("window", window, 1, MAX_STREAM_WINDOW)


def check_topic(topic: object) -> str:
    """A topic to publish to: no wildcard, not empty, no U+0000, valid UTF-8, at most 65535 bytes, not
    starting with ``$`` (the broker closes the connection of a client that publishes to one) nor
    under ``_durable/`` (the control channel: the broker takes such a message as a control request
    and answers ``unknown_topic``; docs/protocol.md)."""
    # The common case in one quick pass (an ASCII topic's length is its size in bytes).
    if (
        type(topic) is str
        and topic.isascii()
        and 0 < len(topic) <= MAX_STRING
        and topic[0] not in "$_"
        and "+" not in topic
        and "#" not in topic
        and "\0" not in topic
    ):
        return topic
    if not isinstance(topic, str):
        raise WrongTypeError(f"topic must be a non-empty string, got {_show(topic)}")
    if not topic:
        raise ValueError("topic must be a non-empty string, got ''")
    if topic.startswith(CONTROL_PREFIX):
        raise ValueError(
            f"topic: {_show(topic)} is under {CONTROL_PREFIX}, the SDK's control channel; cannot publish to it "
            "(the broker would take it as a control request and answer unknown_topic)"
        )
    if topic.startswith("$"):
        raise ValueError(
            f"topic: {_show(topic)} starts with $: topics starting with $ are the broker's own (it closes a "
            "connection that publishes to one)"
        )
    if "+" in topic or "#" in topic or not filter_is_valid(topic) or len(topic.encode("utf-8")) > MAX_STRING:
        raise ValueError(
            f"topic: {_show(topic)} is not a topic one can publish to (no '+' or '#', no U+0000 or lone "
            f"surrogate, at most {MAX_STRING} bytes)"
        )
    return topic


def check_filter(topic_filter: object) -> str:
    """A topic filter to subscribe to (or unsubscribe, or ask stream_info about): a valid MQTT
    filter, at most 65535 bytes, not one of the SDK's own topics."""
    if not isinstance(topic_filter, str):
        raise WrongTypeError(f"topic_filter must be a non-empty string, got {_show(topic_filter)}")
    if not topic_filter:
        raise ValueError("topic_filter must be a non-empty string, got ''")
    if topic_filter.startswith((CONTROL_PREFIX, "$durable/")):
        raise ValueError(f"topic_filter: {_show(topic_filter)}: the SDK's own topics cannot be subscribed to")
    if not filter_is_valid(topic_filter) or len(topic_filter.encode("utf-8")) > MAX_STRING:
        raise ValueError(
            f"topic_filter: {_show(topic_filter)} is not a valid MQTT topic filter ('#' only as the whole last "
            f"level, '+' only as a whole level, no U+0000 or lone surrogate, at most {MAX_STRING} bytes)"
        )
    return topic_filter


def check_after(topic_filter: str, after: object) -> dict[str, int]:
    """subscribe_stream's ``after``: concrete topics the filter matches, each with an id of 0 or more."""
    if after is None:
        return {}
    if not isinstance(after, dict):
        raise WrongTypeError(f"after must be a dict of topic -> last id processed, got {type(after).__name__}")
    positions: dict[str, int] = {}
    for topic, last_id in after.items():
        if not isinstance(topic, str) or not topic or "+" in topic or "#" in topic or not filter_is_valid(topic):
            error = ValueError if isinstance(topic, str) else WrongTypeError
            raise error(
                f"after: {_show(topic)} is not a topic (a non-empty string without wildcards, U+0000 or lone surrogate)"
            )
        if not topic_matches(topic_filter, topic):
            raise ValueError(
                f"after: the topic {_show(topic)} is not matched by the stream filter {_show(topic_filter)}"
            )
        positions[topic] = check_whole(f"after: the id of {_show(topic)}", last_id, 0, None)
    return positions


def check_failover(failover: object) -> list[tuple[str, int]]:
    """``failover``: any iterable (not a string) of at most MAX_FAILOVER (host, port) pairs (tuples
    or two-item lists), each checked as ``host`` and ``port``. The bound also ends the reading of
    an endless iterator (a generator that never stops), which would otherwise never return."""
    if isinstance(failover, str | bytes) or not isinstance(failover, Iterable):
        raise WrongTypeError(f"failover must be a list of (host, port) pairs, got {_show(failover)}")
    addresses: list[tuple[str, int]] = []
    for entry in failover:
        if len(addresses) == MAX_FAILOVER:
            raise ValueError(f"failover must hold at most {MAX_FAILOVER} (host, port) pairs, got more")
        usage = f"failover must hold (host, port) pairs (the group's other brokers), got {_show(entry)}"
        if not isinstance(entry, tuple | list):
            raise WrongTypeError(usage)
        if len(entry) != 2:
            raise ValueError(usage)
        addresses.append((check_host("failover host", entry[0]), check_port("failover port", entry[1])))
    return addresses


def _check_mqtt_string(option: str, value: str) -> None:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{option} must be valid UTF-8 (a lone surrogate is not), got {_show(value)}") from None
    if "\0" in value or size > MAX_STRING:
        raise ValueError(f"{option} must be an MQTT string: no U+0000 and at most {MAX_STRING} bytes in UTF-8")


def _show(value: object) -> str:
    """``repr(value)``, cut short: a 65536-byte topic must not make a 65536-character message."""
    if isinstance(value, int) and too_many_digits(value):  # its repr would be slow, or raise ValueError
        return f"an integer of {value.bit_length()} bits"
    if (parts := long_fraction(value)) is not None:
        return f"a fraction of {parts[0].bit_length()}/{parts[1].bit_length()} bits"
    text = repr(value)
    if len(text) <= _SHOWN:
        return text
    # The size of the value itself, not of its repr (quotes and escapes would add to it).
    if isinstance(value, str):
        size = f"{len(value)} characters"
    elif isinstance(value, (bytes, bytearray, memoryview)):
        size = f"{len(value)} bytes"
    elif isinstance(value, int):
        size = f"{len(text.lstrip('-'))} digits"
    else:
        size = f"a repr of {len(text)} characters"
    return f"{text[:_SHOWN - 10]}...{text[-6:]} ({size})"


__all__ = [
    "MAX_FAILOVER",
    "MAX_SECONDS",
    "MAX_STRING",
    "check_after",
    "check_bool",
    "check_callable",
    "check_client_id",
    "check_failover",
    "check_filter",
    "check_host",
    "check_options",
    "check_password",
    "check_port",
    "check_qos",
    "check_seconds",
    "check_topic",
    "check_username",
    "check_whole",
    "check_window",
]
