"""A ninth pass of black-box tests written from docs/sdk.md, docs/streams.md, docs/delivery-log.md and the
SDK's public docstrings alone, aimed at the promises earlier rounds left open: the argument checks of every
public constructor option and method (their exception types and the option named first), calls after
``close()``, the last-value cache's documented rules, and the delivery log's columns for each kind of
record. Real brokers and SDK clients over TCP to 127.0.0.1; each test quotes the promise it checks.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from conftest import WAIT, Broker
from durable_client import (
    AsyncDurableClient,
    ControlRequestFailed,
    DurableClient,
    DurableClientError,
    Event,
    LastValueCache,
    RequestTimeout,
    Unconnected,
    WrongTypeError,
)

pytestmark = pytest.mark.timeout(60)

TOO_LONG = threading.TIMEOUT_MAX * 2
STREAMS = [{"filter": "telemetry/#", "max_count": 1000, "max_age": 0}]


def refused(call: Callable[[], object], name: str, wrong_type: bool) -> None:
    """``call`` raises ValueError whose message starts with ``name``; a WrongTypeError (also a TypeError)
    exactly when ``wrong_type``."""
    with pytest.raises(ValueError) as error:
        call()
    message = str(error.value)
    assert message.startswith(name), f"{message!r} does not start with {name!r}"
    assert isinstance(error.value, WrongTypeError) == wrong_type, repr(error.value)
    assert isinstance(error.value, TypeError) == wrong_type, repr(error.value)


# ---------------------------------------------------------------------- sdk.md: Bad input, the constructor

BAD_OPTIONS: list[tuple[str, Any, bool]] = [
    ("client_id", "", False),
    ("client_id", "a\0b", False),
    ("client_id", "é" * 32768, False),  # 65536 bytes in UTF-8
    ("client_id", 7, True),
    ("client_id", b"dev", True),
    ("host", "127.0.0.1:1883", False),
    ("host", "local host", False),
    ("host", "[127.0.0.1]", False),
    ("host", "a\0b", False),
    ("host", "h\ud800", False),
    ("host", 127, True),
    ("port", 0, False),
    ("port", 65536, False),
    ("port", -1, False),
    ("port", "1883", True),
    ("port", True, True),
    ("port", 1883.0, True),
    ("keepalive", 0, False),
    ("keepalive", 65536, False),
    ("keepalive", False, True),
    ("session_expiry", -1, False),
    ("session_expiry", float("nan"), False),
    ("session_expiry", float("inf"), False),
    ("session_expiry", 10**400, False),
    ("session_expiry", "60", True),
    ("reconnect_min_delay", 0, False),
    ("reconnect_min_delay", -0.5, False),
    ("reconnect_min_delay", float("inf"), False),
    ("reconnect_min_delay", TOO_LONG, False),
    ("reconnect_max_delay", 0, False),
    ("reconnect_max_delay", TOO_LONG, False),
    ("reconnect_max_delay", "30", True),
    ("username", "a\0b", False),
    ("username", "u" * 65536, False),
    ("username", 5, True),
    ("password", "p\ud800", False),
    ("password", b"p" * 65536, False),
    ("password", "é" * 32768, False),
    ("password", 5, True),
    ("durable_session", 1, True),
    ("durable_session", None, True),
    ("on_connected", 1, True),
    ("on_disconnected", "print", True),
    ("on_session_lost", 1, True),
    ("on_live", 1, True),
    ("on_persistence_fallback", 1, True),
    ("state_dir", "a\0b", False),
    ("delivery_log", "a\0b", False),
    ("persistence", "DISK", False),
    ("persistence", "none", False),
    ("failover", [("127.0.0.1", 0)], False),
    ("failover", [("127.0.0.1:1", 1884)], False),
    ("failover", [("127.0.0.1", 1884, 1)], False),
    ("failover", [("127.0.0.1", "1884")], True),
    ("failover", [("127.0.0.1", 1884)] * 1001, False),
    ("failover", 5, True),
]


@pytest.mark.parametrize(("option", "value", "wrong_type"), BAD_OPTIONS)
def test_every_bad_constructor_option_is_a_value_error_starting_with_its_name(
    option: str, value: Any, wrong_type: bool, tmp_path: Path
) -> None:
    """sdk.md, Bad input: "a bad value raises `ValueError` whose message starts with the option's or
    argument's name ... A value of the wrong *type* raises `WrongTypeError`, which is both a `ValueError`
    and a `TypeError`"; then each option's range as the `DurableClient(...)` item states it (`client_id`
    non-empty, no U+0000, at most 65535 bytes; `host` without port, spaces, U+0000, lone surrogate,
    brackets only round IPv6; `port` 1..65535; `keepalive` 1..65535; `session_expiry` finite, 0 or more;
    the reconnect delays above 0 and at most `threading.TIMEOUT_MAX`; `username` and `password` at most
    65535 bytes; flags `True` or `False`; callbacks functions or `None`; paths without U+0000;
    `persistence` "memory" or "disk"; `failover` at most 1000 pairs checked as `host` and `port` are)."""
    kwargs: dict[str, Any] = {"client_id": "bad-option"}
    if option in ("password",):
        kwargs["username"] = "user"
    kwargs[option] = value
    refused(lambda: DurableClient(**kwargs), option if not option.startswith("failover") else "failover", wrong_type)


def test_disk_persistence_without_a_state_dir_and_delays_in_the_wrong_order_are_refused() -> None:
    """sdk.md: "`persistence` `"memory"` or `"disk"` (`"disk"` needs `state_dir`)"; "`reconnect_min_delay`
    and `reconnect_max_delay` ... the maximum at least the minimum" (a ValueError naming an option)."""
    with pytest.raises(ValueError, match=r"^(persistence|state_dir)\b"):
        DurableClient("needs-dir", persistence="disk")
    with pytest.raises(ValueError, match=r"^reconnect_(min|max)_delay\b"):
        DurableClient("delays", reconnect_min_delay=2, reconnect_max_delay=1)
    DurableClient("delays-equal", reconnect_min_delay=1, reconnect_max_delay=1)


def test_the_documented_accepted_values_are_taken(tmp_path: Path) -> None:
    """sdk.md: whole numbers "may be any integer type (an `int`, a numpy integer ...)"; seconds "any real
    number (`int`, `float`, `Fraction`, numpy ...)"; `keepalive` 1..65535; `session_expiry` 0 or more;
    `password` "`bytes` (binary data, U+0000 and any byte allowed)" up to 65535 bytes; "`"[::1]"`, kept as
    `client.host == "::1"`"; `failover` "any iterable (a list, a tuple, a generator)", "each pair a tuple
    or a two-item list"; `client_id` at most 65535 bytes; `state_dir`/`delivery_log` may be paths."""
    DurableClient("ints", port=np.uint16(1883), keepalive=np.int64(65535), fsync_batch=np.int32(1))
    DurableClient("reals", session_expiry=Fraction(1, 3), reconnect_min_delay=np.float32(0.5))
    DurableClient("zero-expiry", session_expiry=0, keepalive=1, port=65535)
    DurableClient("bin-pw", username="u", password=b"\0\xff" * 32767 + b"x")
    DurableClient("é" * 32767 + "x")
    assert DurableClient("v6", host="[::1]").host == "::1"
    assert DurableClient("v6-bare", host="::1").host == "::1"
    pairs = (pair for pair in [("127.0.0.1", 1884), ["::1", 1885]])
    DurableClient("gen-failover", failover=pairs)
    DurableClient("max-failover", failover=[("127.0.0.1", 1884)] * 1000)
    DurableClient("paths", persistence="disk", state_dir=tmp_path / "state", delivery_log=tmp_path / "log.jsonl")


# ---------------------------------------------------------------------- sdk.md: Bad input, the methods


def listener(event: Event) -> None:
    """A listener that does nothing."""


METHOD_CASES: list[tuple[str, Callable[[DurableClient], object], str, bool]] = [
    ("publish topic ''", lambda c: c.publish("", b"x"), "topic", False),
    ("publish topic +", lambda c: c.publish("a/+", b"x"), "topic", False),
    ("publish topic #", lambda c: c.publish("a/#", b"x"), "topic", False),
    ("publish topic nul", lambda c: c.publish("a\0", b"x"), "topic", False),
    ("publish topic $", lambda c: c.publish("$SYS/x", b"x"), "topic", False),
    ("publish topic _durable", lambda c: c.publish("_durable/v1/ctl", b"x"), "topic", False),
    ("publish topic _durable other", lambda c: c.publish("_durable/x", b"x"), "topic", False),
    ("publish topic surrogate", lambda c: c.publish("a\udc80", b"x"), "topic", False),
    ("publish topic 65536 bytes", lambda c: c.publish("é" * 32768, b"x"), "topic", False),
    ("publish topic int", lambda c: c.publish(5, b"x"), "topic", True),  # type: ignore[arg-type]
    ("publish payload int", lambda c: c.publish("a", 5), "payload", True),  # type: ignore[arg-type]
    ("publish payload list", lambda c: c.publish("a", [1]), "payload", True),  # type: ignore[arg-type]
    ("publish payload surrogate", lambda c: c.publish("a", "x\ud800"), "payload", False),
    ("publish qos 3", lambda c: c.publish("a", b"x", qos=3), "qos", False),
    ("publish qos -1", lambda c: c.publish("a", b"x", qos=-1), "qos", False),
    ("publish qos True", lambda c: c.publish("a", b"x", qos=True), "qos", True),
    ("publish retain 1", lambda c: c.publish("a", b"x", retain=1), "retain", True),  # type: ignore[arg-type]
    ("publish timeout 0", lambda c: c.publish("a", b"x", timeout=0), "timeout", False),
    ("publish timeout None", lambda c: c.publish("a", b"x", timeout=None), "timeout", True),  # type: ignore[arg-type]
    ("publish timeout huge", lambda c: c.publish("a", b"x", timeout=TOO_LONG), "timeout", False),
    ("publish timeout nan", lambda c: c.publish("a", b"x", timeout=float("nan")), "timeout", False),
    ("subscribe filter a/#/b", lambda c: c.subscribe("a/#/b"), "topic_filter", False),
    ("subscribe filter a+", lambda c: c.subscribe("a+/b"), "topic_filter", False),
    ("subscribe filter ''", lambda c: c.subscribe(""), "topic_filter", False),
    ("subscribe filter nul", lambda c: c.subscribe("a/\0"), "topic_filter", False),
    ("subscribe filter 65536", lambda c: c.subscribe("é" * 32768), "topic_filter", False),
    ("subscribe filter int", lambda c: c.subscribe(5), "topic_filter", True),  # type: ignore[arg-type]
    ("subscribe qos 3", lambda c: c.subscribe("a", 3), "qos", False),
    ("subscribe qos str", lambda c: c.subscribe("a", "1"), "qos", True),  # type: ignore[arg-type]
    ("subscribe durable 1", lambda c: c.subscribe("a", durable=1), "durable", True),  # type: ignore[arg-type]
    ("subscribe listener 5", lambda c: c.subscribe("a", listener=5), "listener", True),  # type: ignore[arg-type]
    ("subscribe timeout -1", lambda c: c.subscribe("a", timeout=-1), "timeout", False),
    ("stream listener None", lambda c: c.subscribe_stream("telemetry/#", None), "listener", True),  # type: ignore[arg-type]
    ("stream filter bad", lambda c: c.subscribe_stream("a/#/b", listener), "topic_filter", False),
    ("stream window 0", lambda c: c.subscribe_stream("telemetry/#", listener, window=0), "window", False),
    ("stream window 1001", lambda c: c.subscribe_stream("telemetry/#", listener, window=1001), "window", False),
    ("stream window True", lambda c: c.subscribe_stream("telemetry/#", listener, window=True), "window", True),
    ("stream window 1.0", lambda c: c.subscribe_stream("telemetry/#", listener, window=1.0), "window", True),  # type: ignore[arg-type]
    ("stream after list", lambda c: c.subscribe_stream("telemetry/#", listener, after=[]), "after", True),  # type: ignore[arg-type]
    (
        "stream after wildcard",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/+": 1}),
        "after",
        False,
    ),
    (
        "stream after unmatched",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"other/a": 1}),
        "after",
        False,
    ),
    (
        "stream after nul",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/\0": 1}),
        "after",
        False,
    ),
    (
        "stream after surrogate",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/\ud800": 1}),
        "after",
        False,
    ),
    (
        "stream after negative",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/a": -1}),
        "after",
        False,
    ),
    (
        "stream after bool",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/a": True}),
        "after",
        True,
    ),
    (
        "stream after float",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/a": 1.5}),
        "after",
        True,
    ),
    (
        "stream after digits",
        lambda c: c.subscribe_stream("telemetry/#", listener, after={"telemetry/a": 10**4300}),
        "after",
        False,
    ),
    ("stream timeout 0", lambda c: c.subscribe_stream("telemetry/#", listener, timeout=0), "timeout", False),
    ("unsubscribe bad", lambda c: c.unsubscribe("a/#/b"), "topic_filter", False),
    ("unsubscribe int", lambda c: c.unsubscribe(5), "topic_filter", True),  # type: ignore[arg-type]
    ("stream_info bad", lambda c: c.stream_info("a/#/b"), "topic_filter", False),
    ("stream_info timeout", lambda c: c.stream_info(timeout=0), "timeout", False),
    ("connect timeout 0", lambda c: c.connect(timeout=0), "timeout", False),
    ("connect timeout huge", lambda c: c.connect(timeout=TOO_LONG), "timeout", False),
    ("close keep_session", lambda c: c.close(keep_session="no"), "keep_session", True),  # type: ignore[arg-type]
    ("close timeout", lambda c: c.close(timeout=0), "timeout", False),
]


@pytest.mark.parametrize(("case", "call", "name", "wrong_type"), METHOD_CASES, ids=[c[0] for c in METHOD_CASES])
def test_every_bad_method_argument_is_a_value_error_starting_with_its_name_before_anything_is_sent(
    case: str, call: Callable[[DurableClient], object], name: str, wrong_type: bool
) -> None:
    """sdk.md, Bad input: "Options and arguments are checked where they are given, before anything is
    sent: a bad value raises `ValueError` whose message starts with the option's or argument's name";
    `publish`: `topic` non-empty, no `+`, `#`, U+0000, valid UTF-8, at most 65535 bytes, not `$...` nor
    `_durable/`; `payload` bytes or str (a lone surrogate refused); `qos` 0..2; `retain` a flag; every
    `timeout` finite, above 0, at most `threading.TIMEOUT_MAX`, "`None` is not a timeout";
    `subscribe_stream`: "`listener` a function, `window` `None` or a whole number from 1 to 1000";
    streams.md: "`after` must be a dict (else `TypeError`) of topics without wildcards, U+0000 or a lone
    surrogate that the filter matches, each with a whole number of 0 or more, written with at most 4300
    digits ... (else `ValueError`)". Checked on a client never connected: the check comes first (else a
    publish would be `Unconnected`)."""
    client = DurableClient("bad-args")
    refused(lambda: call(client), name, wrong_type)


def test_a_topic_an_open_stream_reads_cannot_be_moved_by_after(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """streams.md: "a topic that an open stream subscription of the client already reads cannot be moved
    (`ValueError`)"; "a filter no configured stream covers ... `ControlRequestFailed` (`unknown_stream`...)"."""
    broker = broker_factory(streams=STREAMS)
    publisher = sdk(broker.port, "pub-9", durable_session=False)
    publisher.connect(timeout=WAIT)
    publisher.publish("telemetry/a", b"one")
    got: list[Event] = []
    done = threading.Event()

    def on_event(event: Event) -> None:
        got.append(event)
        done.set()

    reader = sdk(broker.port, "reader-9", durable_session=False)
    reader.connect(timeout=WAIT)
    reader.subscribe_stream("telemetry/#", on_event, timeout=WAIT)
    assert done.wait(WAIT), "no stream event"
    with pytest.raises(ValueError, match=r"^after\b"):
        reader.subscribe_stream("telemetry/a", on_event, after={"telemetry/a": 0}, timeout=WAIT)
    with pytest.raises(ControlRequestFailed) as error:
        reader.subscribe_stream("nolog/#", on_event, timeout=WAIT)
    assert error.value.code == "unknown_stream"
    assert [(e.topic, e.seq, e.epoch, e.stream) for e in got] == [("telemetry/a", 1, 0, True)]


# ---------------------------------------------------------------------- sdk.md: the last-value cache


def event(topic: str, payload: bytes, seq: int, *, replayed: bool = False, retained: bool = False) -> Event:
    """A session event as a listener sees it."""
    return Event(topic, payload, 1, seq, 1, 1000.0 + seq, replayed, retained, False, False)


def test_the_cache_follows_the_documented_rules() -> None:
    """sdk.md, The last-value cache: "replayed events ... never into the cache; live events ... update
    it; an empty payload destroys the entry"; retained initial values: "an entry that already holds a
    valid value is not overwritten, an invalidated one (`cache.invalidate(topic)`, which changes only a
    valid entry) takes the value, a destroyed one stays destroyed until the next marker, which removes it
    (then absent) ... an absent one is created; a retained message with an empty payload sets nothing";
    reads: "`cache.get(topic, default=None)` is the value of a `valid` entry, else `default`;
    `cache.entry(topic)` ... `None` for an absent topic; `topic in cache`, `len(cache)` and iteration
    count `valid` entries only"; `apply`'s docstring: "True when the cache changed"."""
    cache = LastValueCache()
    assert cache.apply(event("r", b"old", 1, replayed=True)) is False
    assert cache.entry("r") is None and cache.get("r", "dflt") == "dflt"
    assert cache.apply(event("a", b"v1", 2)) is True
    assert cache.get("a") == b"v1" and "a" in cache and len(cache) == 1 and list(cache) == ["a"]
    assert cache.apply(event("a", b"init", 3, retained=True)) is False  # valid: not overwritten
    assert cache.get("a") == b"v1"
    cache.invalidate("a")
    entry = cache.entry("a")
    assert entry is not None and entry.state == "invalid" and entry.value is None
    assert "a" not in cache and len(cache) == 0 and cache.get("a", 0) == 0
    assert cache.apply(event("a", b"init", 4, retained=True)) is True  # invalidated: takes it
    assert cache.get("a") == b"init"
    cache.invalidate("nothing")  # changes only a valid entry: an absent one stays absent
    assert cache.entry("nothing") is None
    assert cache.apply(event("a", b"", 5)) is True  # empty payload destroys
    destroyed = cache.entry("a")
    assert destroyed is not None and destroyed.state == "destroyed" and destroyed.value is None
    cache.invalidate("a")  # not valid: unchanged
    assert cache.entry("a") == destroyed
    assert cache.apply(event("a", b"stale", 6, retained=True)) is False
    assert cache.apply(event("n", b"", 7, retained=True)) is False  # retained empty sets nothing
    assert cache.entry("n") is None
    assert cache.apply(event("n", b"new", 8, retained=True)) is True  # absent: created
    cache.marker()
    assert cache.entry("a") is None and sorted(cache) == ["n"]


# ---------------------------------------------------------------------- delivery-log.md: the columns


def message_id(topic: str, payload: bytes) -> str:
    """delivery-log.md: "the first 16 bytes of SHA-256 over the topic (UTF-8), a NUL byte and the
    payload, in hex"."""
    return hashlib.sha256(topic.encode() + b"\0" + payload).digest()[:16].hex()


def test_each_kind_of_record_carries_its_documented_columns(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """delivery-log.md, the table: every record has `kind`, `device`, `time`; `send` and `receive` have
    `topic`, `id` (the SHA-256 prefix), `qos`; `receive` has `replayed`, `redelivered`, `seq`, `epoch`
    ("session epochs start at 1"), `published_at`; `subscribe` has `topic` (the filter), `qos`, `durable`;
    `connect` has `session_present` ("what CONNACK said"); `live` has `replayed_count` ("the marker's
    replayed count"); `unsubscribe` the filter; `session_end` at `close(keep_session=False)`. "One JSON
    object per line"."""
    broker = broker_factory()
    log = tmp_path / "device.jsonl"
    topic = "caf\u00e9/\u6e29\u5ea6"
    got = threading.Event()
    live = threading.Event()
    device = sdk(broker.port, "dev-9", delivery_log=str(log), on_live=lambda marker: live.set())
    device.subscribe("caf\u00e9/#", 1, listener=lambda e: got.set())
    device.subscribe("other/#", 0, durable=False)
    device.connect(timeout=WAIT)
    device.publish(topic, "h\u00e9 \u2603", qos=1)
    device.ready_for_events()
    assert live.wait(WAIT), "no marker"
    assert got.wait(WAIT), "no event"
    device.unsubscribe("other/#")
    device.close(keep_session=False, timeout=WAIT)
    records = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    kinds = [r["kind"] for r in records]
    assert all(r["device"] == "dev-9" and isinstance(r["time"], float) for r in records)
    assert kinds.count("connect") == 1 and kinds.index("connect") < kinds.index("live")
    (connect,) = [r for r in records if r["kind"] == "connect"]
    assert connect["session_present"] is False
    subscribes = {r["topic"]: (r["qos"], r["durable"]) for r in records if r["kind"] == "subscribe"}
    assert subscribes == {"caf\u00e9/#": (1, True), "other/#": (0, False)}
    (send,) = [r for r in records if r["kind"] == "send"]
    payload = "h\u00e9 \u2603".encode()
    assert (send["topic"], send["id"], send["qos"]) == (topic, message_id(topic, payload), 1)
    (receive,) = [r for r in records if r["kind"] == "receive"]
    assert (receive["topic"], receive["id"], receive["qos"]) == (topic, send["id"], 1)
    assert receive["epoch"] == 1 and receive["seq"] >= 1
    assert receive["replayed"] is True and receive["redelivered"] is False  # before ready_for_events
    assert isinstance(receive["published_at"], float)
    (marker,) = [r for r in records if r["kind"] == "live"]
    assert marker["replayed_count"] == 1
    assert [r["topic"] for r in records if r["kind"] == "unsubscribe"] == ["other/#"]
    assert kinds[-1] == "session_end"


# ---------------------------------------------------------------------- sdk.md / streams.md: state rules


@pytest.mark.parametrize(("durable_session", "keep_session"), [(True, True), (False, False)])
def test_a_closed_client_raises_unconnected_from_every_method_but_close_and_its_cache_still_reads(
    durable_session: bool,
    keep_session: bool,
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
) -> None:
    """sdk.md: "a closed client raises `Unconnected`" (from every method but `close()`, which does nothing
    again: the docstring's "idempotent"), even for an argument it would refuse; "Disconnected, [publish]
    raises `Unconnected` and queues nothing" (QoS 0 too); stream_info "needs a connection
    (`Unconnected`)"; the cache's "Reads keep working while disconnected"."""
    broker = broker_factory(streams=STREAMS)
    got = threading.Event()
    client = sdk(broker.port, f"closed-{durable_session}", durable_session=durable_session)
    client.subscribe("telemetry/#", listener=lambda e: got.set())
    client.ready_for_events()
    client.connect(timeout=WAIT)
    assert client.connected
    client.publish("telemetry/x", b"kept")
    assert got.wait(WAIT), "no event"
    client.close(keep_session=keep_session)
    assert not client.connected
    calls: list[Callable[[], object]] = [
        lambda: client.connect(timeout=WAIT),
        lambda: client.publish("telemetry/x", b"y"),
        lambda: client.publish("telemetry/x", b"y", qos=0),
        lambda: client.subscribe("telemetry/#"),
        lambda: client.subscribe("a/#/b"),
        lambda: client.unsubscribe("telemetry/#"),
        lambda: client.subscribe_stream("telemetry/#", listener),
        client.stream_info,
        client.ready_for_events,
    ]
    for call in calls:
        with pytest.raises(Unconnected, match="closed"):
            call()
    client.close()
    client.close(keep_session=not keep_session)
    assert client.cache.get("telemetry/x") == b"kept" and list(client.cache) == ["telemetry/x"]


def test_after_cannot_move_a_topic_a_stream_registered_before_connect_matches(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """streams.md: "a topic that a stream subscription the client holds already matches (open, or
    registered to open at the next connect, the same filter's included) cannot be moved (`ValueError`: the
    broker keeps one cursor per topic and connection; unsubscribe that filter first)"; a topic no held
    stream matches can be."""
    client = DurableClient("after-held")
    client.subscribe_stream("telemetry/#", listener)
    with pytest.raises(ValueError, match=r"^after: .*'telemetry/#'.*telemetry/a"):
        client.subscribe_stream("telemetry/a", listener, after={"telemetry/a": 1})
    client.subscribe_stream("other/+", listener, after={"other/a": 1})
    with pytest.raises(ValueError, match=r"^after\b"):
        client.subscribe_stream("other/+", listener, after={"other/b": 1})
    client.unsubscribe("telemetry/#")
    client.subscribe_stream("telemetry/a", listener, after={"telemetry/a": 1})


def test_the_async_client_is_tied_to_its_first_loop_and_any_loop_may_close_it() -> None:
    """sdk.md, asyncio: "the first coroutine called (any of them, or `events()`) ties it to its event loop;
    a call from another loop raises `DurableClientError` and changes nothing. `close()` is the exception:
    any loop may close the client"."""
    client = AsyncDurableClient("async-loops", reconnect_min_delay=0.05)
    asyncio.run(client.subscribe("a/b"))
    with pytest.raises(DurableClientError):
        asyncio.run(client.subscribe("c/d"))
    with pytest.raises(DurableClientError):
        asyncio.run(client.ready_for_events())

    async def events_elsewhere() -> None:
        client.events()

    with pytest.raises(DurableClientError):
        asyncio.run(events_elsewhere())
    asyncio.run(client.close())


def test_a_long_number_is_shown_cut_short_with_its_length_in_digits_or_its_repr_length() -> None:
    """sdk.md, Bad input: "a long value is shown cut short, with its length (... an integer's in digits,
    `(401 digits)` for `10**400`, anything else's as `(a repr of N characters)` ...)"."""
    with pytest.raises(ValueError, match=r"^session_expiry\b") as error:
        DurableClient("long-int", session_expiry=10**400)
    message = str(error.value)
    assert message.endswith("(401 digits)") and len(message) < 200, message
    with pytest.raises(ValueError, match=r"^session_expiry\b") as error:
        DurableClient("long-int", session_expiry=-(10**400))
    assert str(error.value).endswith("(401 digits)"), str(error.value)
    fraction = Fraction(10**400, 3)
    with pytest.raises(ValueError, match=r"^reconnect_max_delay\b") as error:
        DurableClient("long-fraction", reconnect_max_delay=fraction)
    message = str(error.value)
    assert message.endswith(f"(a repr of {len(repr(fraction))} characters)") and len(message) < 250, message


def test_async_live_raises_unconnected_when_the_client_is_closed_before_its_marker(broker: Broker) -> None:
    """sdk.md, asyncio: "`live()` waits, unbounded, so bound it yourself ..., and raises `Unconnected` when
    the client is closed before the marker came, also while it waits: a closed client gets none"."""

    async def closed_while_waiting() -> None:
        client = AsyncDurableClient("async-live-closed", port=broker.port, reconnect_min_delay=0.05)
        await client.connect()
        await client.subscribe("held/#")  # no ready_for_events(): the session stays held, no marker
        waiting = asyncio.create_task(client.live())
        await asyncio.sleep(0)  # let live() start waiting (not a synchronisation: it would not end either way)
        await client.close()
        with pytest.raises(Unconnected):
            await asyncio.wait_for(waiting, WAIT)
        with pytest.raises(Unconnected):
            await asyncio.wait_for(client.live(), WAIT)

    async def closed_before() -> None:
        client = AsyncDurableClient("async-live-never", port=broker.port)
        await client.close()
        with pytest.raises(Unconnected):
            await asyncio.wait_for(client.live(), WAIT)

    async def events_of_one_closed_before() -> list[object]:  # close(): "an async for over events() ends"
        client = AsyncDurableClient("async-events-never", port=broker.port)
        await client.close()  # before any coroutine tied it to this loop (review 319: it waited for ever)
        return await asyncio.wait_for(_all_events(client), WAIT)

    asyncio.run(closed_while_waiting())
    asyncio.run(closed_before())
    assert asyncio.run(events_of_one_closed_before()) == []


async def _all_events(client: AsyncDurableClient) -> list[object]:
    return [event async for event in client.events()]


def test_async_live_after_close_still_returns_a_marker_that_came(broker: Broker) -> None:
    """sdk.md, asyncio: "`await client.live()` returns the replay marker once every queued event was
    processed"; "a marker that came before `close()` is still returned"."""

    async def run() -> None:
        client = AsyncDurableClient("async-live-came", port=broker.port)
        await client.connect()
        await client.ready_for_events()
        marker = await asyncio.wait_for(client.live(), WAIT)
        await client.close()
        assert await asyncio.wait_for(client.live(), WAIT) == marker

    asyncio.run(run())


def test_the_logs_and_the_marks_missing_folders_are_made_when_the_client_is_created(tmp_path: Path) -> None:
    """delivery-log.md: "The log's missing folders are made, and the file is created (empty) if absent, when
    the `DurableClient` is created. A log that cannot be opened for appending (a folder, a path under a
    file) raises that `OSError` then"; sdk.md: "the marks are kept under `state_dir/<client_id>/`, made
    with any missing folders when the client is created"."""
    log = tmp_path / "a" / "b" / "log.jsonl"
    client = DurableClient("dev/1", persistence="disk", state_dir=tmp_path / "s" / "t", delivery_log=log)
    assert log.is_file() and log.read_bytes() == b""
    assert (tmp_path / "s" / "t" / "dev%2F1").is_dir() and client.persistence_level == "disk"
    (tmp_path / "plain").write_text("x")
    for bad in (tmp_path / "a", tmp_path / "plain" / "log.jsonl"):
        with pytest.raises(OSError):
            DurableClient("dev-2", delivery_log=bad)


@pytest.mark.parametrize("qos_and_acknowledgement", [(1, 4), (2, 7)])  # PUBACK, PUBCOMP
def test_a_publish_that_timed_out_gets_its_send_record_when_its_puback_comes_late(
    qos_and_acknowledgement: tuple[int, int],
    broker: Broker,
    sdk: Callable[..., DurableClient],
    relays: Callable[..., Any],
    tmp_path: Path,
) -> None:
    """sdk.md: "`RequestTimeout` after `timeout` without [the PUBACK] (the message stays with paho ...,
    so it may still arrive)"; delivery-log.md: "A `send` is written once the broker has acknowledged the
    publish (its PUBACK at QoS 1, its PUBCOMP at QoS 2)": one that comes after the RequestTimeout writes it
    then, in order with the sends after it."""
    qos, acknowledgement = qos_and_acknowledgement
    relay = relays(broker.port)
    log = tmp_path / "pub.jsonl"
    publisher = sdk(relay.port, "late-puback", delivery_log=log)
    publisher.connect(timeout=WAIT)
    relay.hold("down", lambda packet: packet.kind == acknowledgement)
    with pytest.raises(RequestTimeout):
        publisher.publish("late/a", b"first", qos=qos, timeout=0.3)
    assert '"send"' not in log.read_text(encoding="utf-8"), "no send record before the PUBACK"
    relay.release("down")
    publisher.publish("late/a", b"second", qos=qos, timeout=WAIT)
    sends = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines()]
    assert [r["id"] for r in sends if r["kind"] == "send"] == [
        message_id("late/a", b"first"),
        message_id("late/a", b"second"),
    ]


@pytest.mark.parametrize("call", ["publish", "subscribe_stream", "stream_info"])
def test_close_from_another_thread_ends_a_wait_with_unconnected(
    call: str, broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], relays: Callable[..., Any]
) -> None:
    """sdk.md, Threads: "A `close()` from another thread ends the waits of `publish()` (within half a
    second; the message may still arrive), `subscribe_stream()` and `stream_info()` (at once: the request
    may or may not have taken effect) with `Unconnected`, as it ends `subscribe()`'s" (not after their
    `timeout`)."""
    broker = broker_factory(streams=STREAMS)
    relay = relays(broker.port)
    client = sdk(relay.port, f"close-ends-{call}")
    client.connect(timeout=WAIT)
    relay.hold("down")  # no PUBACK, no reply
    calls: dict[str, Callable[[], object]] = {
        "publish": lambda: client.publish("close/a", b"x", timeout=60),
        "subscribe_stream": lambda: client.subscribe_stream("telemetry/#", listener, timeout=60),
        "stream_info": lambda: client.stream_info(timeout=60),
    }
    outcome: list[BaseException | None] = []

    def wait() -> None:
        try:
            calls[call]()
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    before = len(relay.seen)
    waiter = threading.Thread(target=wait)
    waiter.start()
    relay.wait_seen(lambda packet: packet.direction == "up" and packet.kind == 3, after=before)  # its PUBLISH
    client.close()
    waiter.join(WAIT)
    assert not waiter.is_alive(), "close() did not end the wait"
    assert len(outcome) == 1 and isinstance(outcome[0], Unconnected), outcome


# ---------------------------------------------------------------------- pipeline.md: the source's options


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_sources_option_names_are_case_insensitive(
    spark: Any, broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """pipeline.md: "Option names are case-insensitive, as Spark's are"; "Batch reads of an id range ...
    `startingOffsets` ... `endingOffsets` ... reads exactly ids 11 to 20"; `idsPerPartition` splits a
    topic's ids into read tasks."""
    broker = broker_factory(streams=STREAMS)
    publisher = sdk(broker.port, "case-pub", durable_session=False)
    publisher.connect(timeout=WAIT)
    for number in range(1, 26):
        publisher.publish("telemetry/a", f"a{number}".encode())
    options = {
        "HOST": "127.0.0.1",
        "Port": broker.port,
        "FILTER": "telemetry/#",
        "StartingOffsets": json.dumps({"telemetry/a": 10}),
        "ENDINGOFFSETS": json.dumps({"telemetry/a": 20}),
        "idsperpartition": 4,
        "TIMEOUT": 20,
    }
    reader = spark.read.format("amqtt-durable")
    for key, value in options.items():
        reader = reader.option(key, value)
    frame = reader.load()
    rows = sorted((row.id, bytes(row.payload)) for row in frame.collect())
    assert rows == [(number, f"a{number}".encode()) for number in range(11, 21)]
    assert frame.rdd.getNumPartitions() == 3  # ids 11-20 in ranges of 4
