"""Checks of the SDK's options and arguments, made where they are given (docs/sdk.md, "Bad input").

Every check raises ValueError naming the option, for a value of the wrong type as for one out of
range, so ``except ValueError`` catches any bad option; the message says what is accepted. A
value that would only fail later (a port past 65535 at the first TCP connect, a NUL in a topic
when the broker drops the connection) is refused here, before anything is sent.
"""

from __future__ import annotations

import ipaddress
import math
import os
from collections.abc import Sequence
from typing import Any

from durable_protocol import CONTROL_PREFIX, filter_is_valid

MAX_STRING = 65_535
"""An MQTT string's most bytes (its length is two bytes): client ids, topics, user names."""


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
) -> tuple[str, int, list[tuple[str, int]]]:
    """DurableClient's options (those that ``_commit`` and ``persistence`` do not check themselves):
    (host, port, the failover addresses), the host without IPv6 brackets."""
    check_client_id(client_id)
    address = check_host("host", host), check_port("port", port)
    if not isinstance(keepalive, int) or isinstance(keepalive, bool) or not 1 <= keepalive <= 65535:
        raise ValueError(f"keepalive must be a whole number of seconds from 1 to 65535, got {keepalive!r}")
    if session_expiry is not None:
        check_seconds("session_expiry", session_expiry, low=0, inclusive=True)
    check_optional_string("username", username)
    check_optional_string("password", password)
    check_bool("durable_session", durable_session)
    check_seconds("reconnect_min_delay", reconnect_min_delay, low=0)
    check_seconds("reconnect_max_delay", reconnect_max_delay, low=0)
    for name, path in (("delivery_log", delivery_log), ("state_dir", state_dir)):
        if path is not None and not isinstance(path, str | os.PathLike):
            raise ValueError(f"{name} must be a path (str or os.PathLike) or None, got {path!r}")
    for name, callback in callbacks.items():
        check_callable(name, callback)
    return *address, check_failover(failover)


def check_client_id(client_id: object) -> str:
    if not isinstance(client_id, str) or not client_id:
        raise ValueError("client_id must be a non-empty string: the broker finds the durable session by it")
    _check_mqtt_string("client_id", client_id)
    return client_id


def check_host(option: str, host: object) -> str:
    """A host name or an IP address; an IPv6 address with or without brackets (``[::1]`` is ``::1``).

    ``host:port`` is refused (the port is its own option), as is an empty host or a NUL in it."""
    if not isinstance(host, str) or not host.strip():
        raise ValueError(f"{option} must be a host name or an IP address (a non-empty string), got {host!r}")
    if "\0" in host or host != host.strip():
        raise ValueError(f"{option} must be a host name or an IP address, without spaces or NUL, got {host!r}")
    bracketed = host.startswith("[") and host.endswith("]")
    bare = host[1:-1] if bracketed else host
    if ":" in bare or bracketed:
        if _is_ipv6(bare):
            return bare
        raise ValueError(
            f"{option} must be a host name or an IP address without a port, got {host!r} (the port is its own "
            "option; brackets only around an IPv6 address: '::1' or '[::1]')"
        )
    if "[" in host or "]" in host or "/" in host:
        raise ValueError(f"{option} must be a host name or an IP address, got {host!r}")
    return host


def check_port(option: str, port: object) -> int:
    if not isinstance(port, int) or isinstance(port, bool) or not 0 < port < 65536:
        raise ValueError(f"{option} must be a whole number from 1 to 65535, got {port!r}")
    return port


def check_seconds(option: str, value: object, *, low: float, inclusive: bool = False) -> float:
    """A finite number of seconds above ``low`` (``inclusive``: ``low`` itself too)."""
    number = _number(value)
    if number is None or not (number >= low if inclusive else number > low):
        raise ValueError(
            f"{option} must be a number of seconds, {'at least' if inclusive else 'more than'} {low:g}, got {value!r}"
        )
    return number


def check_optional_string(option: str, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"{option} must be a string or None, got {type(value).__name__}")
    if isinstance(value, str):
        _check_mqtt_string(option, value)


def check_bool(option: str, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{option} must be True or False, got {value!r}")


def check_callable(option: str, value: object, *, optional: bool = True) -> None:
    if (value is None and optional) or callable(value):
        return
    raise ValueError(f"{option} must be a function{' or None' if optional else ''}, got {type(value).__name__}")


def check_qos(qos: object) -> int:
    if not isinstance(qos, int) or isinstance(qos, bool) or qos not in (0, 1, 2):
        raise ValueError(f"qos must be 0, 1 or 2, got {qos!r}")
    return qos


def check_topic(topic: object) -> str:
    """A topic to publish to: no wildcard, not empty, no U+0000, valid UTF-8, at most 65535 bytes, not
    starting with ``$`` (the broker closes the connection of a client that publishes to any of those,
    and the SDK would send the message again after every reconnect), and not the SDK's control channel."""
    if not isinstance(topic, str) or not topic:
        raise ValueError(f"topic must be a non-empty string, got {topic!r}")
    if topic.startswith(CONTROL_PREFIX):
        raise ValueError(f"topics under {CONTROL_PREFIX} are the SDK's control channel; cannot publish to {topic}")
    if topic.startswith("$"):
        raise ValueError(
            f"{topic!r}: topics starting with $ are the broker's own (it closes a connection that publishes to one)"
        )
    if "+" in topic or "#" in topic or not filter_is_valid(topic) or len(topic.encode("utf-8")) > MAX_STRING:
        raise ValueError(
            f"{topic!r} is not a topic one can publish to (no '+' or '#', no U+0000 or lone surrogate, at most "
            "65535 bytes)"
        )
    return topic


def check_failover(failover: object) -> list[tuple[str, int]]:
    """``failover``: (host, port) pairs (tuples or two-item lists), each checked as ``host`` and ``port``."""
    if isinstance(failover, str | bytes) or not isinstance(failover, Sequence):
        raise ValueError(f"failover must be a list of (host, port) pairs, got {failover!r}")
    addresses: list[tuple[str, int]] = []
    for entry in failover:
        if not isinstance(entry, tuple | list) or len(entry) != 2:
            raise ValueError(f"failover takes (host, port) pairs of the group's other brokers, got {entry!r}")
        host: Any = entry[0]
        addresses.append((check_host("failover host", host), check_port("failover port", entry[1])))
    return addresses


def _check_mqtt_string(option: str, value: str) -> None:
    try:
        size = len(value.encode("utf-8"))
    except UnicodeEncodeError:
        raise ValueError(f"{option} must be valid UTF-8 (a lone surrogate is not), got {value!r}") from None
    if "\0" in value or size > MAX_STRING:
        raise ValueError(f"{option} must be an MQTT string: no U+0000 and at most 65535 bytes in UTF-8")


def _number(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        return None
    return float(value)


def _is_ipv6(text: str) -> bool:
    try:
        return ipaddress.ip_address(text).version == 6
    except ValueError:
        return False


__all__ = [
    "MAX_STRING",
    "check_bool",
    "check_callable",
    "check_client_id",
    "check_failover",
    "check_host",
    "check_optional_string",
    "check_options",
    "check_port",
    "check_qos",
    "check_seconds",
    "check_topic",
]
