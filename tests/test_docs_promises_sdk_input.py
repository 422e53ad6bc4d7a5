"""docs/sdk.md, "Bad input": the SDK refuses a bad option or argument where it is given, with a
ValueError naming it, instead of failing later (at the first connect, on the network thread, or by
the broker closing the connection again after every reconnect).

The refusals need no broker; what they protect is checked against a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import socket
import threading
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy
import plyvel
import pytest
from test_hostile_wire import wait_until
from test_sdk import Recorder

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, payloads, run_cli
from durable_client import (
    AsyncDurableClient,
    ConnectionInfo,
    DurableClient,
    DurableClientError,
    Event,
    Marker,
    PersistenceError,
    Unconnected,
    WrongTypeError,
)
from durable_protocol.hostport import split_host_port

BAD_OPTIONS = [
    ({"host": ""}, "host"),
    ({"host": 127001}, "host"),
    ({"host": "127.0.0.1:1883"}, "host"),  # the port is its own option
    ({"host": "[127.0.0.1]"}, "host"),  # brackets only around an IPv6 address
    ({"port": 0}, "port"),
    ({"port": 65536}, "port"),
    ({"port": "1883"}, "port"),
    ({"port": True}, "port"),
    ({"keepalive": "30"}, "keepalive"),
    ({"keepalive": 65536}, "keepalive"),
    ({"session_expiry": "60"}, "session_expiry"),
    ({"session_expiry": float("nan")}, "session_expiry"),
    ({"reconnect_min_delay": "0.1"}, "reconnect_min_delay"),
    ({"reconnect_min_delay": 0}, "reconnect_min_delay"),  # more than 0 (Backoff's own check before)
    ({"reconnect_min_delay": -1}, "reconnect_min_delay"),
    ({"session_expiry": 10**400}, "session_expiry"),  # too large for a float: not an OverflowError
    ({"reconnect_max_delay": Fraction(10**400, 3)}, "reconnect_max_delay"),
    ({"reconnect_max_delay": None}, "reconnect_max_delay"),
    ({"username": 5}, "username"),
    ({"password": 5}, "password"),
    ({"password": b"x" * 65536}, "password"),
    ({"host": "my host"}, "host"),  # the message says "without spaces": so does the check
    ({"durable_session": "no"}, "durable_session"),
    ({"on_connected": "print"}, "on_connected"),
    ({"on_live": 5}, "on_live"),
    ({"delivery_log": 5}, "delivery_log"),
    ({"failover": "127.0.0.1:1884"}, "failover"),
    ({"failover": None}, "failover"),
    ({"failover": [("127.0.0.1", 70000)]}, "failover port"),
    ({"failover": [("127.0.0.1", True)]}, "failover port"),
    ({"failover": [("", 1884)]}, "failover host"),
    ({"failover": [("10.0.0.1:1884", 1884)]}, "failover host"),
    ({"client_id": "a\x00b"}, "client_id"),
    ({"client_id": "x" * 65536}, "client_id"),
]


@pytest.mark.parametrize(("options", "named"), BAD_OPTIONS, ids=[repr(o)[:40] for o, _ in BAD_OPTIONS])
def test_a_bad_constructor_option_is_a_value_error_naming_it(options: dict[str, Any], named: str) -> None:
    """sdk.md, Bad input: every option is checked when the client is created; a value of the wrong
    type or out of range raises ValueError naming the option (before: most were accepted and
    failed at connect() as a ConnectFailed about the network, or with a bare TypeError)."""
    arguments: dict[str, Any] = {"client_id": "bad-option", **options}
    client_id = arguments.pop("client_id")
    with pytest.raises(ValueError, match=rf"^{named} must"):
        DurableClient(client_id, **arguments)


def test_the_async_client_checks_request_timeout_and_on_live_too() -> None:
    with pytest.raises(ValueError, match=r"^request_timeout must"):
        AsyncDurableClient("bad-async", request_timeout="10")
    with pytest.raises(ValueError, match=r"^on_live must"):
        AsyncDurableClient("bad-async", on_live="print")


@pytest.mark.parametrize(("host", "kept"), [("::1", "::1"), ("[::1]", "::1"), ("[2001:db8::10]", "2001:db8::10")])
def test_an_ipv6_host_is_taken_with_or_without_brackets(host: str, kept: str) -> None:
    """sdk.md, Bad input: an IPv6 address may be written bare or in brackets, as the broker's
    tools show it (``[::1]:7883``); the brackets are taken off (before, ``[::1]`` was handed to
    the resolver as it was, and every connect failed with "Name or service not known")."""
    client = DurableClient("v6", host, 1883, failover=[(host, 1884)])
    assert client.host == kept
    assert client._addresses == [(kept, 1883), (kept, 1884)]


@pytest.mark.parametrize(
    ("args", "named"),
    [
        ((None, b"x"), "topic"),
        (("", b"x"), "topic"),
        (("t", b"x", "1"), "qos"),
        (("t", b"x", 3), "qos"),
        (("t", b"x", 1, "yes"), "retain"),
    ],
)
def test_a_bad_publish_argument_is_a_value_error_naming_it(
    shared_broker: Broker, sdk: Callable[..., DurableClient], case_tag: str, args: tuple[Any, ...], named: str
) -> None:
    client = sdk(shared_broker.port, f"bad-publish-args-{case_tag}", durable_session=False)
    client.connect(timeout=5)
    with pytest.raises(ValueError, match=rf"^{named} must"):
        client.publish(*args)


@pytest.mark.parametrize("topic", ["a\x00b", "$SYS/mine", "a/+/b", "a/#", "a/\ud800"])
def test_a_topic_no_client_may_publish_to_is_refused_and_the_connection_stays_up(
    shared_broker: Broker,
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    case_tag: str,
    topic: str,
) -> None:
    """sdk.md, Bad input: publish() refuses a topic the broker would close the connection for
    (U+0000, a leading ``$``: guarantees.md) with ValueError, and sends nothing. Before, the
    message went out, the broker closed the connection, publish() raised RequestTimeout saying
    the message "is re-sent after a reconnect", and it was: each reconnect was closed again."""
    receiver = clients(shared_broker.port, f"after-refusal-{case_tag}", clean_session=True)
    receiver.subscribe(f"fine/{case_tag}", 1)
    client = sdk(shared_broker.port, f"bad-topic-{case_tag}", durable_session=False)
    client.connect(timeout=5)
    with pytest.raises(ValueError, match=r"publish to|broker's own"):
        client.publish(topic, b"x", qos=1, timeout=2)
    client.publish(f"fine/{case_tag}", b"still connected", qos=1, timeout=5)
    assert [m.payload for m in receiver.wait_messages(1)] == [b"still connected"]
    assert client.connected and client.stats.reconnects == 0


def test_a_listener_that_is_not_callable_is_refused_at_subscribe(
    shared_broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md, Bad input: a listener must be a function. Before, ``listener=5`` was registered, its
    every event "raised", and the client reconnected for ever to get the event again."""
    client = sdk(shared_broker.port, "bad-listener")
    with pytest.raises(ValueError, match=r"^listener must"):
        client.subscribe("t", listener=5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^listener must"):
        client.subscribe_stream("t", None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^timeout must"):
        client.subscribe("t", timeout=0)
    with pytest.raises(ValueError, match=r"^timeout must"):
        client.connect(timeout="5")  # type: ignore[arg-type]
    client.connect(timeout=5)
    assert client.connected


@pytest.mark.parametrize("bad_filter", [None, 5, "", "a/#/b", "_durable/v1/x"])
def test_unsubscribe_refuses_what_subscribe_refuses(
    shared_broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path, case_tag: str, bad_filter: object
) -> None:
    """sdk.md, Bad input: a filter subscribe() refuses is a ValueError in unsubscribe() too
    (before: a silent no-op, that even wrote an `unsubscribe` record of it to the delivery log)."""
    log = tmp_path / "log.jsonl"
    client = sdk(shared_broker.port, f"bad-unsubscribe-{case_tag}", delivery_log=log)
    client.connect(timeout=5)
    with pytest.raises(ValueError, match=r"^topic_filter"):
        client.unsubscribe(bad_filter)  # type: ignore[arg-type]
    assert '"kind": "unsubscribe"' not in log.read_text()
    assert client.connected


def test_failover_takes_two_item_lists_as_json_or_yaml_give_them(
    shared_broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md, failover: (host, port) pairs, tuples or two-item lists (a list read from JSON or
    YAML). The first address is dead; the client moves on to the broker in the list."""
    recorder = Recorder()
    client = sdk(free_port(), "failover-list", failover=[[HOST, shared_broker.port]])
    client.subscribe("fo/t", listener=recorder)
    client.connect(timeout=10)
    assert client.port == shared_broker.port
    client.ready_for_events()
    client.publish("fo/t", b"via the list", qos=1)
    assert [e.payload for e in recorder.wait(1)] == [b"via the list"]


def test_the_async_client_refuses_a_bad_topic_without_touching_the_connection(shared_broker: Broker) -> None:
    async def main() -> None:
        async with AsyncDurableClient("async-bad-topic", port=shared_broker.port, durable_session=False) as client:
            with pytest.raises(ValueError, match="broker's own"):
                await client.publish("$SYS/x", b"x")
            await client.publish("fine", b"y")
            assert client.connected

    asyncio.run(asyncio.wait_for(main(), 30))


# ------------------------------------------------------------------------------ sdk.md, promises that held


def test_the_marker_carries_epoch_replayed_first_and_last_seq_and_the_live_subscriptions(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, Ready for events: the marker carries `epoch`, `replayed`, `first_seq`, `last_seq`
    (None when nothing was replayed) and `live` (filter, qos, durable)."""
    markers: list[Marker] = []
    live = threading.Event()

    def on_live(marker: Marker) -> None:
        markers.append(marker)
        live.set()

    first = sdk(broker.port, "marker-fields", on_live=on_live)
    first.subscribe("mk/#", qos=1)
    first.subscribe("mk-nd", qos=0, durable=False)
    first.connect()
    first.ready_for_events()
    assert live.wait(WAIT)
    assert (markers[0].replayed, markers[0].first_seq, markers[0].last_seq) == (0, None, None)
    assert {(s.filter, s.qos, s.durable) for s in markers[0].live} == {("mk/#", 1, True), ("mk-nd", 0, False)}
    first.close(keep_session=True)

    clients(broker.port, "pub", clean_session=True).publish("mk/a", payloads(3))
    recorder, live = Recorder(), threading.Event()
    again = sdk(broker.port, "marker-fields", on_live=on_live, on_connected=lambda info: epochs.append(info.epoch))
    epochs: list[int | None] = []
    again.subscribe("mk/#", listener=recorder)
    again.connect()
    again.ready_for_events()
    assert live.wait(WAIT)
    events = recorder.wait(3)
    marker = markers[-1]
    assert marker.replayed == 3 and all(e.replayed for e in events)
    assert (marker.first_seq, marker.last_seq) == (events[0].seq, events[-1].seq)
    assert marker.epoch == events[0].epoch == epochs[0]


def test_cpl2_marks_live_under_state_dir_in_a_folder_named_by_the_percent_encoded_client_id(
    shared_broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """sdk.md, CPL-2: the marks are kept under `state_dir/<client_id>/`, the id percent-encoded
    where it is not a safe file name; a second client on the same folder is a PersistenceError."""
    state = tmp_path / "state"
    plain = sdk(shared_broker.port, "plain-id", persistence="disk", state_dir=state)
    odd = sdk(shared_broker.port, "site/a b", persistence="disk", state_dir=state)
    plain.connect()
    odd.connect()
    assert sorted(p.name for p in state.iterdir()) == ["plain-id", "site%2Fa%20b"]
    with pytest.raises(PersistenceError, match="in use"):
        DurableClient("plain-id", port=shared_broker.port, persistence="disk", state_dir=state)


def test_subscribe_stream_after_an_id_replays_from_the_next_id_and_a_reconnect_resumes_after_the_last_processed(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: `after={topic: last id}` starts the stream at the next id; the client's
    positions then resume a reconnect (here across a broker restart) after the last processed."""
    broker = broker_factory(streams=[{"filter": "rp/#"}])
    clients(broker.port, "rp-pub", clean_session=True).publish("rp/a", payloads(10))
    recorder = Recorder()
    reader = sdk(broker.port, "rp-reader", durable_session=False)
    reader.connect()
    reader.subscribe_stream("rp/#", recorder, after={"rp/a": 6}, window=4)
    assert [(e.seq, e.payload, e.stream, e.epoch) for e in recorder.wait(4)] == [
        (seq, b"m%07d" % (seq - 1), True, 0) for seq in range(7, 11)
    ]
    broker.restart(kill=True)
    clients(broker.port, "rp-pub2", clean_session=True).publish("rp/a", [b"eleventh"])
    assert [e.seq for e in recorder.wait(5)] == [7, 8, 9, 10, 11], "nothing again, nothing skipped"
    assert recorder.events[-1].payload == b"eleventh"


def test_across_a_broker_restart_the_callbacks_fire_publish_is_unconnected_and_the_session_comes_back(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md, Subscriptions, reconnection and closing: `on_disconnected(reason)` when the link
    goes, `publish()` raises `Unconnected` meanwhile, the cache stays readable and `stale`; then
    `on_connected(info)` with `session_present` and the same epoch, and what was queued while the
    client was away comes, replayed, exactly once."""
    infos: list[ConnectionInfo] = []
    reasons: list[str] = []
    connected, lost = threading.Event(), threading.Event()

    def on_connected(info: ConnectionInfo) -> None:
        infos.append(info)
        connected.set()

    def on_disconnected(reason: str) -> None:
        reasons.append(reason)
        lost.set()

    recorder, live = Recorder(), threading.Event()
    device = sdk(
        broker.port, "restart-cb", on_connected=on_connected, on_disconnected=on_disconnected,
        on_live=lambda _marker: live.set(),
    )
    device.subscribe("rc/t", listener=recorder)
    device.connect()
    device.ready_for_events()
    # Before the marker, an event counts as replayed and leaves the cache alone (sdk.md).
    assert live.wait(WAIT)
    clients(broker.port, "rc-pub", clean_session=True).publish("rc/t", [b"before"])
    recorder.wait(1)
    connected.clear()
    broker.stop()
    assert lost.wait(WAIT) and isinstance(reasons[0], str)
    assert not device.connected and device.cache.stale and device.cache.get("rc/t") == b"before"
    with pytest.raises(Unconnected):
        device.publish("rc/t", b"while away")
    broker.start()
    assert connected.wait(WAIT)
    assert infos[-1].session_present and infos[-1].epoch == infos[0].epoch
    clients(broker.port, "rc-pub2", clean_session=True).publish("rc/t", [b"after"])
    events = recorder.wait(2)
    assert [e.payload for e in events] == [b"before", b"after"]
    assert not device.cache.stale and device.stats.reconnects == 1


def test_a_qos2_subscription_of_an_sdk_session_is_made_at_qos1_and_its_events_come_once(
    shared_broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: QoS 2 subscriptions of an SDK session are made at QoS 1 (dedup gives exactly-once)."""
    markers: list[Marker] = []
    live = threading.Event()
    recorder = Recorder()

    def on_live(marker: Marker) -> None:
        markers.append(marker)
        live.set()

    device = sdk(shared_broker.port, "q2-device", on_live=on_live)
    device.subscribe("q2/t", qos=2, listener=recorder)
    device.connect()
    device.ready_for_events()
    assert live.wait(WAIT)
    assert [(s.filter, s.qos) for s in markers[0].live] == [("q2/t", 1)]
    clients(shared_broker.port, "q2-pub", clean_session=True).publish("q2/t", payloads(5), qos=2)
    events = recorder.wait(5)
    assert [(e.payload, e.qos) for e in events] == [(p, 1) for p in payloads(5)]


# ------------------------------------------------------------------------------ store-layout.md


def test_a_store_with_data_but_no_version_key_is_refused(broker_factory: Callable[..., Broker]) -> None:
    """store-layout.md: "a store with another version, or with data but no version, is refused"."""
    broker = broker_factory(start=False)
    db = plyvel.DB(broker.store, create_if_missing=True)
    db.put(b"s\x00\x00\x00\x00\x00\x00\x00\x01", b"{}")
    db.close()
    broker.write_config()
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 1
    assert "no layout version" in result.stderr
    db = plyvel.DB(broker.store)
    try:
        assert db.get(b"v") is None, "a refused store is not stamped with a version"
    finally:
        db.close()


# ------------------------------------------------------------------------------ streams.md


def test_a_position_past_the_logs_end_is_an_sdk_warning_and_the_topic_waits_until_the_log_passes_it(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """streams.md: a position past a log's last id is a WARNING from the SDK naming the topic and
    the log's last id; nothing is sent on the topic until the log passes the position."""
    broker = broker_factory(streams=[{"filter": "ah/#"}])
    publisher = clients(broker.port, "ah-pub", clean_session=True)
    publisher.publish("ah/a", payloads(3))
    caplog.set_level(logging.WARNING, logger="durable_client")
    recorder = Recorder()
    reader = sdk(broker.port, "ah-reader", durable_session=False)
    reader.connect()
    reader.subscribe_stream("ah/#", recorder, after={"ah/a": 5})
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any("stream ah/a: this client has processed ids past the log's last id 3" in w for w in warnings), warnings
    publisher.publish("ah/a", [b"id4", b"id5", b"id6"])
    events = recorder.wait(1)
    assert [(e.seq, e.payload) for e in events] == [(6, b"id6")], "ids 4 and 5 are at or below the position"


def test_stream_info_reads_an_emptied_log_as_last_plus_1_last_and_needs_a_connection_and_another_thread(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """streams.md: `stream_info()` gives `(last + 1, last)` for a log retention emptied; it raises
    `Unconnected` without a connection and `DurableClientError` from a listener."""
    broker = broker_factory(streams=[{"filter": "se/#", "max_age": 0.5}])
    clients(broker.port, "se-pub", clean_session=True).publish("se/a", payloads(3))
    reader = sdk(broker.port, "se-reader", durable_session=False)
    with pytest.raises(Unconnected):
        reader.stream_info()
    reader.connect()
    assert dict(reader.stream_info()) == {"se/a": (1, 3)}
    assert wait_until(lambda: dict(reader.stream_info()) == {"se/a": (4, 3)}, WAIT)

    from_listener: list[BaseException] = []
    called = threading.Event()

    def listener(_event: Event) -> None:
        try:
            reader.stream_info()
        except BaseException as exc:
            from_listener.append(exc)
        called.set()

    reader.subscribe_stream("se/#", listener)
    clients(broker.port, "se-pub2", clean_session=True).publish("se/a", [b"fourth"])
    assert called.wait(WAIT)
    assert len(from_listener) == 1 and type(from_listener[0]) is DurableClientError


# ------------------------------------------------------------------------------ review 128


WRONG_TYPES: list[tuple[dict[str, Any], str]] = [
    ({"host": 127001}, "host"),
    ({"port": "1883"}, "port"),
    ({"port": 1883.0}, "port"),
    ({"keepalive": "30"}, "keepalive"),
    ({"session_expiry": "60"}, "session_expiry"),
    ({"reconnect_min_delay": "0.1"}, "reconnect_min_delay"),
    ({"username": 5}, "username"),
    ({"password": 5}, "password"),
    ({"durable_session": 1}, "durable_session"),
    ({"on_connected": "print"}, "on_connected"),
    ({"state_dir": 5}, "state_dir"),
    ({"failover": None}, "failover"),
    ({"failover": ["h:1884"]}, "failover"),
    ({"client_id": 5}, "client_id"),
    ({"persistence": 2}, "persistence"),
    ({"fsync_batch": "64"}, "fsync_batch"),
]


@pytest.mark.parametrize(("options", "named"), WRONG_TYPES, ids=[repr(o)[:40] for o, _ in WRONG_TYPES])
def test_a_wrong_type_is_a_value_error_and_a_type_error(options: dict[str, Any], named: str) -> None:
    """sdk.md, Bad input: a value of the wrong type raises WrongTypeError, both a ValueError (as
    every bad option) and a TypeError (as Python's own checks raise): either ``except`` catches it."""
    arguments: dict[str, Any] = {"client_id": "wrong-type", **options}
    client_id = arguments.pop("client_id")
    for caught in (TypeError, ValueError, WrongTypeError):
        with pytest.raises(caught, match=rf"^{named} must"):
            DurableClient(client_id, **arguments)


def test_a_wrong_type_argument_is_a_type_error_too_payload_and_after_included() -> None:
    """sdk.md, Bad input: the docs' TypeError for a payload neither bytes nor str and for an
    ``after`` that is not a dict holds, and each is a ValueError like every other refusal."""
    client = DurableClient("wrong-type-args")
    calls: list[tuple[str, Callable[[], object]]] = [
        ("payload", lambda: client.publish("t", 5)),  # type: ignore[arg-type]
        ("after", lambda: client.subscribe_stream("s/#", print, after=[("s/a", 1)])),  # type: ignore[arg-type]
        ("qos", lambda: client.publish("t", b"x", "1")),  # type: ignore[arg-type]
        ("retain", lambda: client.publish("t", b"x", 1, 0)),  # type: ignore[arg-type]
        ("timeout", lambda: client.subscribe("t", timeout="5")),  # type: ignore[arg-type]
        ("topic", lambda: client.publish(None, b"x")),  # type: ignore[arg-type]
        ("topic_filter", lambda: client.subscribe(5)),  # type: ignore[arg-type]
        ("window", lambda: client.subscribe_stream("s/#", print, window=2.0)),  # type: ignore[arg-type]
        ("keep_session", lambda: client.close(keep_session=0)),  # type: ignore[arg-type]
    ]
    for named, call in calls:
        for caught in (TypeError, ValueError):
            with pytest.raises(caught, match=rf"^{named} must"):
                call()


def test_inputs_that_worked_before_the_checks_still_work(shared_broker: Broker, clients: Callable[..., Client]) -> None:
    """Review 128: the checks refused what worked before them. An MQTT password is binary data
    (bytes, NUL and all); whole numbers may be numpy integers, seconds any real number (a numpy
    float, a Fraction), ``failover`` any iterable (a generator)."""
    receiver = clients(shared_broker.port, "worked-before-rx", clean_session=True)
    receiver.subscribe("wb/#", 1)
    client = DurableClient(
        "worked-before",
        port=numpy.int64(free_port()),  # dead: the client moves on to the failover address
        username="user",
        password=b"pw\x00\xff",
        keepalive=numpy.int32(30),
        session_expiry=numpy.int64(60),
        reconnect_min_delay=Fraction(1, 20),
        reconnect_max_delay=numpy.float64(0.5),
        failover=((HOST, numpy.int64(port)) for port in [shared_broker.port]),
    )
    try:
        client.connect(timeout=numpy.float64(10))
        assert client.port == shared_broker.port
        client.publish("wb/a", b"1", qos=numpy.int8(1), timeout=Fraction(5))
        client.subscribe("wb/b", qos=numpy.uint8(1), timeout=numpy.float32(5))
        assert [m.payload for m in receiver.wait_messages(1)] == [b"1"]
        assert client.connected
    finally:
        client.close()
    # a string password is sent as UTF-8 as before; only the size limit applies to it
    DurableClient("pw-str", password="p\x00w")


def test_a_timeout_too_long_for_a_wait_is_refused_before_anything_starts(
    shared_broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md, Bad input: a timeout above threading.TIMEOUT_MAX is refused. Before, connect(timeout=1e10)
    passed the check, started the network thread and then raised OverflowError; a second connect()
    said it "was called already"."""
    client = sdk(shared_broker.port, "huge-timeout", durable_session=False)
    for caught in (ValueError,):
        with pytest.raises(caught, match=r"^timeout must be a finite number of seconds, more than 0 and at most"):
            client.connect(timeout=1e10)
    client.connect(timeout=5)
    assert client.connected
    with pytest.raises(ValueError, match=r"^timeout must"):
        client.publish("t", b"x", timeout=1e10)
    with pytest.raises(ValueError, match=r"^timeout must"):
        client.close(timeout=1e10)
    assert client.connected
    client.close(timeout=5)
    assert not client.connected


def test_the_async_client_checks_keep_session_before_closing_anything(
    shared_broker: Broker, clients: Callable[..., Client]
) -> None:
    """Review 128: AsyncDurableClient.close(keep_session=0) closed its event queue before the check
    raised, so the client went on connected but its ``async for`` got nothing more."""
    publisher = clients(shared_broker.port, "ks-pub", clean_session=True)

    async def main() -> None:
        async with AsyncDurableClient("async-keep-session", port=shared_broker.port) as client:
            await client.subscribe("ks/#")
            await client.ready_for_events()
            with pytest.raises(ValueError, match=r"^keep_session must be True or False"):
                await client.close(keep_session=0)  # type: ignore[arg-type]
            await asyncio.to_thread(publisher.publish, "ks/a", [b"still delivered"])
            got: list[Event] = []
            async with client.events() as events:
                async for event in events:
                    got.append(event)
                    break
            assert [e.payload for e in got] == [b"still delivered"]

    asyncio.run(asyncio.wait_for(main(), 2 * WAIT))


def test_every_refusal_message_starts_with_the_name_and_shows_a_long_value_cut_short(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md, Bad input: the message starts with the option's name, for the topic of publish(),
    the topic filter of subscribe()/unsubscribe()/subscribe_stream()/stream_info() and the ``after``
    of a stream that is already read; a long value is shown cut short (a 65536-byte topic put about
    65,000 characters in the message)."""
    broker = broker_factory(streams=[{"filter": "mv/#"}])
    client = sdk(broker.port, "messages", durable_session=False)
    client.connect(timeout=5)
    topics = ["a\x00b", "$SYS/x", "_durable/v1/ctl", "a/+", "a/#", "x" * 65536, "a/\ud800"]
    for topic in topics:
        with pytest.raises(ValueError, match=r"^topic: ") as raised:
            client.publish(topic, b"x")
        assert len(str(raised.value)) < 400
    for bad_filter in ["a/#/b", "_durable/v1/x", "$durable/v1/reply", "x" * 65536]:
        for call in (client.subscribe, client.unsubscribe, client.stream_info):
            with pytest.raises(ValueError, match=r"^topic_filter: ") as raised:
                call(bad_filter)
            assert len(str(raised.value)) < 400
    client.subscribe_stream("mv/#", print)
    with pytest.raises(ValueError, match=r"^after: the stream subscription 'mv/#' already reads mv/a"):
        client.subscribe_stream("mv/a", print, after={"mv/a": 0})
    with pytest.raises(ValueError, match=r"^after: "):
        client.subscribe_stream("mv/#", print, after={"other/a": 0})
    assert client.connected


def test_a_client_id_too_long_for_its_cpl2_folder_is_refused_not_a_fall_back_to_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md, CPL-2: the folder state_dir/<client_id>/ is the percent-encoded id; one longer than
    the file system's name limit (255 bytes here) is refused at construction. Before, the client
    fell back to memory with a warning: exactly-once across restarts silently lost."""
    caplog.set_level(logging.WARNING)
    with pytest.raises(ValueError, match=r"^client_id: .* 400 bytes percent-encoded, more than the 255 bytes"):
        DurableClient("x" * 100 + "/" * 100, persistence="disk", state_dir=tmp_path / "state")
    assert not caplog.records
    fits = DurableClient("y" * 255, persistence="disk", state_dir=tmp_path / "state")
    assert fits.persistence_level == "disk"
    fits.close()
    assert DurableClient("x" * 100 + "/" * 100).persistence_level == "memory"  # CPL-1 makes no folder


def test_one_host_parser_brackets_only_around_an_ipv6_address() -> None:
    """Review 128: the SDK's host check and hostport.split_host_port (the replication settings, the
    tools, the Spark source's failover) agree: brackets only around an IPv6 address."""
    for bracketed in ("[127.0.0.1]", "[localhost]"):
        with pytest.raises(ValueError, match=r"^host must"):
            DurableClient("brackets", host=bracketed)
        with pytest.raises(ValueError, match="brackets around something other than an IPv6 address"):
            split_host_port(f"{bracketed}:1883")
    assert split_host_port("[::1]:1883") == ("::1", 1883)
    assert DurableClient("brackets", host="[::1]").host == "::1"


class _PubcompHolder:
    """A TCP relay between the SDK and the real broker that holds the broker's PUBCOMP (MQTT packet
    type 7) until ``release`` is set: the QoS 2 flow then stands between PUBREC and PUBCOMP."""

    def __init__(self, broker_port: int) -> None:
        self.held, self.release = threading.Event(), threading.Event()
        self._server = socket.create_server((HOST, 0))
        self.port = self._server.getsockname()[1]
        self._broker_port = broker_port
        self._sockets: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            device, _ = self._server.accept()
            broker = socket.create_connection((HOST, self._broker_port), timeout=WAIT)
            self._sockets += [device, broker]
            threading.Thread(target=self._plain, args=(device, broker), daemon=True).start()
            self._packets(broker, device)

    @staticmethod
    def _plain(source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            while data := source.recv(65536):
                target.sendall(data)

    def _packets(self, source: socket.socket, target: socket.socket) -> None:
        with contextlib.suppress(OSError):
            reader = source.makefile("rb")
            while header := reader.read(1):
                length, shift, lengths = 0, 0, b""
                while True:  # MQTT's remaining length: at most 4 bytes
                    byte = reader.read(1)
                    lengths += byte
                    length |= (byte[0] & 0x7F) << shift
                    shift += 7
                    if not byte[0] & 0x80 or len(lengths) == 4:
                        break
                packet = header + lengths + reader.read(length)
                if header[0] >> 4 == 7 and not self.release.is_set():
                    self.held.set()
                    self.release.wait(WAIT)
                target.sendall(packet)

    def close(self) -> None:
        for sock in self._sockets:
            sock.close()


def test_a_qos2_send_record_is_written_after_the_pubcomp(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """delivery-log.md: a `send` record is written once the broker has acknowledged the publish, its
    PUBCOMP at QoS 2 (not at the PUBREC before it). The broker's PUBCOMP is held back by a relay."""
    relay = _PubcompHolder(broker.port)
    log = tmp_path / "log.jsonl"
    try:
        client = sdk(relay.port, "qos2-send-record", durable_session=False, delivery_log=log)
        client.connect(timeout=WAIT)
        done = threading.Event()

        def publish() -> None:
            client.publish("q2/a", b"exactly once", qos=2, timeout=WAIT)
            done.set()

        publisher = threading.Thread(target=publish)
        publisher.start()
        assert relay.held.wait(WAIT), "the broker's PUBCOMP reached the relay"
        assert not done.is_set()
        assert '"kind": "send"' not in log.read_text(), "no send record before the PUBCOMP"
        relay.release.set()
        publisher.join(WAIT)
        assert done.is_set()
        sends = [line for line in log.read_text().splitlines() if '"kind": "send"' in line]
        assert len(sends) == 1 and '"topic": "q2/a"' in sends[0] and '"qos": 2' in sends[0]
    finally:
        relay.release.set()
        relay.close()


def test_a_number_too_large_for_a_float_is_a_value_error_naming_the_option() -> None:
    """Review 137: seconds are converted with float(), which raised OverflowError (not a ValueError)
    for 10**400 or Fraction(10**400, 3)."""
    client = DurableClient("too-large")
    for value in (10**400, -(10**400), Fraction(10**400, 3)):
        with pytest.raises(ValueError, match=r"^timeout must be a finite number of seconds"):
            client.subscribe("t", timeout=value)
        with pytest.raises(ValueError, match=r"^session_expiry must"):
            DurableClient("too-large", session_expiry=value)


def test_a_non_string_topic_in_after_is_a_wrong_type_error() -> None:
    """Review 137: a key of ``after`` that is not a string (1, b"a/x") is a wrong type, a TypeError
    too; an empty or wildcard string stays a plain ValueError."""
    client = DurableClient("after-keys")
    for key in (1, b"a/x"):
        for caught in (TypeError, ValueError):
            with pytest.raises(caught, match=r"^after: .* is not a topic"):
                client.subscribe_stream("a/#", print, after={key: 5})  # type: ignore[dict-item]
    for key in ("", "a/+"):
        with pytest.raises(ValueError, match=r"^after: .* is not a topic") as raised:
            client.subscribe_stream("a/#", print, after={key: 5})
        assert not isinstance(raised.value, TypeError)


def test_an_endless_failover_iterator_is_refused_past_the_limit() -> None:
    """sdk.md: ``failover`` holds at most 1000 addresses; an endless generator was read forever at
    construction."""

    def endless() -> Any:
        port = 0
        while True:
            port = port % 65535 + 1
            yield ("127.0.0.1", port)

    with pytest.raises(ValueError, match=r"^failover must hold at most 1000"):
        DurableClient("endless", failover=endless())
    many = [("127.0.0.1", port) for port in range(2000, 3000)]
    assert len(DurableClient("thousand", failover=iter(many))._addresses) == 1001


def test_a_state_dir_too_long_for_its_files_paths_is_refused_not_a_fall_back_to_memory(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md, CPL-2: a state_dir whose folder's files would pass the path limit (PC_PATH_MAX) is
    refused at construction, naming state_dir. Before, with a client id under the name limit, the
    client fell back to memory ([Errno 36] File name too long): exactly-once across restarts lost."""
    caplog.set_level(logging.WARNING)
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    long_dir = tmp_path.joinpath(*["d" * 199] * ((limit - len(str(tmp_path))) // 200))
    assert len(str(long_dir / ("c" * 200))) >= limit  # the folder alone: mkdir fails
    with pytest.raises(ValueError, match=r"^state_dir: .* more than the \d+ bytes a path may have") as raised:
        DurableClient("c" * 200, persistence="disk", state_dir=long_dir)
    assert "client_id" in str(raised.value)
    assert not caplog.records
    short = tmp_path / "s"
    fits = DurableClient("c" * 200, persistence="disk", state_dir=short)
    assert fits.persistence_level == "disk"
    fits.close()


def test_a_relative_state_dir_is_measured_as_given_not_made_absolute(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sdk.md, CPL-2: the path limit applies to the path as the client gives it to the kernel. A
    short relative state_dir in a current folder deeper than the limit works; before, its absolute
    path was measured and the client was refused with "state_dir: ... more than 4095 bytes"."""
    limit = os.pathconf(tmp_path, "PC_PATH_MAX")
    monkeypatch.chdir(tmp_path)
    for _ in range(limit // 200 + 1):  # made step by step: the whole path is too long for one mkdir
        os.mkdir("d" * 200)
        os.chdir("d" * 200)
    assert len(os.fsencode(Path.cwd())) > limit
    client = DurableClient("deep", persistence="disk", state_dir="s")
    try:
        assert client.persistence_level == "disk"
        assert os.path.exists("s/deep/lock")
    finally:
        client.close()
    os.chdir(tmp_path)
    shutil.rmtree("d" * 200)  # relative: rmtree works by descriptors below it


def test_a_deleted_current_folder_is_an_io_error_falling_back_to_memory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """sdk.md, CPL-2: an I/O error at the state folder falls back to CPL-1 with a WARNING. With the
    current folder deleted, a relative state_dir cannot be made absolute: before, Path.absolute()
    raised FileNotFoundError out of the constructor."""
    caplog.set_level(logging.WARNING)
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    fell_back: list[OSError] = []
    client = DurableClient("cwd-gone", persistence="disk", state_dir="s", on_persistence_fallback=fell_back.append)
    try:
        assert client.persistence_level == "memory"
        assert [type(error) for error in fell_back] == [FileNotFoundError]
        assert any("CPL-2 -> CPL-1" in record.getMessage() for record in caplog.records)
    finally:
        client.close()


@pytest.mark.parametrize("name", ["state_dir", "delivery_log"])
@pytest.mark.parametrize("path", ["s\x00t", Path("s\x00t")])
def test_a_nul_in_a_path_option_is_a_value_error_naming_it(name: str, path: str | Path) -> None:
    """sdk.md, Bad input: a path with U+0000 is refused naming the option; before, os.mkdir or
    open raised a bare ValueError ("embedded null byte"), the option not named."""
    with pytest.raises(ValueError, match=rf"^{name}: a path cannot hold U\+0000"):
        DurableClient("nul-path", **{name: path})
