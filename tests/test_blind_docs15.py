"""Blind tests of docs/sdk.md, docs/fleet.md and README.md written from those docs (and the SDK's docstrings)
alone, for promises the other test_blind_* files leave out: each test quotes the promise it checks and runs it
as a user would, against real brokers (``amqtt-durable broker`` processes), real SDK and paho clients over TCP
to 127.0.0.1, and the ``amqtt-durable fleet`` command."""

from __future__ import annotations

import contextlib
import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from test_blind_pipeline import fleet_in_process

from amqtt_durable.process import port_open
from conftest import WAIT, Broker, Client, free_port
from durable_client import (
    ConnectFailed,
    DurableClient,
    DurableClientError,
    Event,
    LiveSubscription,
    Marker,
    Unconnected,
    WrongTypeError,
)
from durable_fleet.cli import build_parser, options_from

pytestmark = pytest.mark.timeout(60)


# ------------------------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def shared(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Broker]:
    """One broker for the tests of this file that need no setting of their own (each uses its own client ids)."""
    broker = Broker(tmp_path_factory.mktemp("shared"), max_session_expiry=60, max_subscriptions_per_client=3)
    broker.start()
    yield broker
    broker.stop()


class Seen:
    """What an SDK client's listeners and callbacks got, waited on with a bound."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, Event]] = []
        self.markers: list[Marker] = []
        self.connected: list[Any] = []

    def listener(self, name: str) -> Callable[[Event], None]:
        def call(event: Event) -> None:
            with self.cond:
                self.events.append((name, event))
                self.cond.notify_all()

        return call

    def on_live(self, marker: Marker) -> None:
        with self.cond:
            self.markers.append(marker)
            self.cond.notify_all()

    def on_connected(self, info: Any) -> None:
        with self.cond:
            self.connected.append(info)
            self.cond.notify_all()

    def until(self, predicate: Callable[[], bool]) -> None:
        with self.cond:
            assert self.cond.wait_for(predicate, WAIT), (self.events, self.markers)

    def payloads(self, name: str) -> list[bytes]:
        with self.cond:
            return [event.payload for got, event in self.events if got == name]


@pytest.fixture
def made() -> Iterator[list[DurableClient]]:
    clients: list[DurableClient] = []
    yield clients
    for client in clients:
        client.close()


def client_of(made: list[DurableClient], broker: Broker, client_id: str, seen: Seen, **kwargs: Any) -> DurableClient:
    client = DurableClient(
        client_id,
        port=broker.port,
        on_live=seen.on_live,
        on_connected=seen.on_connected,
        reconnect_min_delay=0.05,
        reconnect_max_delay=0.5,
        **kwargs,
    )
    made.append(client)
    return client


@pytest.fixture
def paho(shared: Broker) -> Iterator[Callable[[str], Client]]:
    clients: list[Client] = []

    def make(client_id: str, **kwargs: Any) -> Client:
        client = Client(shared.port, client_id, clean_session=True, **kwargs)
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.paho.disconnect()
        client.paho.loop_stop()


class Index:
    """A whole number that is not an int: anything with ``__index__``."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


# ------------------------------------------------------------------------------------------- options
def test_whole_numbers_may_be_any_type_with_index_but_not_a_bool() -> None:
    """sdk.md Bad input: "Whole numbers may be any integer type (an `int`, a numpy integer: anything with
    `__index__`), but not `True`/`False`"; "a bad value raises `ValueError` whose message starts with the option's
    or argument's name"."""
    client = DurableClient("blind15-index", port=Index(1883), keepalive=Index(30), fsync_batch=Index(8))  # type: ignore[arg-type]
    assert client.port == 1883
    client.close()
    for option in ("port", "keepalive", "fsync_batch"):
        with pytest.raises(ValueError) as caught:
            DurableClient("blind15-bool", **{option: True})
        assert str(caught.value).startswith(option), caught.value


def test_seconds_refuse_a_bool_and_the_cpl1_client_still_checks_the_group_options() -> None:
    """sdk.md: "seconds may be any real number but `True`/`False`"; `fsync_delay_ms` "a finite number from 0 to
    1000; anything else raises `ValueError` naming the option (also with CPL-1, which ignores both)";
    `reconnect_min_delay` and `reconnect_max_delay` "the maximum at least the minimum"."""
    for option, value in (
        ("reconnect_min_delay", True),
        ("session_expiry", False),
        ("fsync_delay_ms", float("nan")),
        ("fsync_delay_ms", 1000.5),
        ("fsync_batch", 65536),
        ("fsync_batch", 0),
    ):
        with pytest.raises(ValueError) as caught:
            DurableClient("blind15-seconds", persistence="memory", **{option: value})
        assert option in str(caught.value), (option, value, caught.value)
    with pytest.raises(ValueError, match="reconnect_m"):
        DurableClient("blind15-delays", reconnect_min_delay=2.0, reconnect_max_delay=1.0)
    DurableClient("blind15-edges", fsync_batch=65535, fsync_delay_ms=1000, session_expiry=0).close()


def test_failover_pairs_may_be_two_item_lists_and_an_endless_generator_is_refused() -> None:
    """sdk.md: `failover` "any iterable (a list, a tuple, a generator) of at most 1000 (host, port) pairs (an
    endless generator is refused once it passes 1000, not read forever)"; "each pair a tuple or a two-item list,
    checked as `host` and `port` are"."""
    DurableClient("blind15-fo", failover=[["127.0.0.1", 1884], ("::1", 1885)]).close()  # type: ignore[list-item]
    DurableClient("blind15-fo", failover=(("127.0.0.1", p) for p in range(2000, 3000))).close()
    with pytest.raises(ValueError, match="failover"):
        DurableClient("blind15-fo", failover=itertools.repeat(("127.0.0.1", 1884)))
    with pytest.raises(ValueError, match="failover"):
        DurableClient("blind15-fo", failover=[("127.0.0.1", 1884, 1)])  # type: ignore[list-item]
    with pytest.raises(ValueError, match="port"):
        DurableClient("blind15-fo", failover=[("127.0.0.1", 70000)])


def test_a_closed_client_refuses_every_method_before_looking_at_the_arguments() -> None:
    """sdk.md: "a closed client raises `Unconnected` (`this client was closed ...`) from every method but
    `close()`, before looking at the arguments; `close()` does nothing again (a bad argument to it is still
    refused); its `cache` can still be read"."""
    client = DurableClient("blind15-closed")
    client.close()
    calls: list[Callable[[], object]] = [
        lambda: client.publish(123, object()),  # type: ignore[arg-type]
        lambda: client.subscribe("a/#/b", qos=7),
        lambda: client.subscribe_stream("s/#", listener=None, window=0),  # type: ignore[arg-type]
        lambda: client.unsubscribe(""),
        lambda: client.stream_info(5),  # type: ignore[arg-type]
        lambda: client.connect(timeout=-1),
        client.ready_for_events,
    ]
    for call in calls:
        with pytest.raises(Unconnected, match="this client was closed"):
            call()
    client.close()
    with pytest.raises(WrongTypeError):
        client.close(keep_session="no")  # type: ignore[arg-type]
    assert client.cache.get("t", b"d") == b"d" and len(client.cache) == 0 and client.cache.entry("t") is None


def test_timeouts_above_timeout_max_and_none_are_refused_not_clamped(shared: Broker, made: list[DurableClient]) -> None:
    """sdk.md: "every `timeout` a finite number of seconds above 0 and at most `threading.TIMEOUT_MAX` ... `None` is
    not a timeout: every wait is bounded. A larger one is refused, not clamped"."""
    seen = Seen()
    client = client_of(made, shared, "blind15-timeouts", seen)
    client.connect()
    for timeout in (threading.TIMEOUT_MAX * 2, None, 0, float("inf")):
        with pytest.raises(ValueError) as caught:
            client.publish("blind15/t", b"x", timeout=timeout)  # type: ignore[arg-type]
        assert str(caught.value).startswith("timeout"), caught.value
        with pytest.raises(ValueError):
            client.subscribe("blind15/t", timeout=timeout)  # type: ignore[arg-type]
    client.publish("blind15/t", b"x", timeout=threading.TIMEOUT_MAX)


# ------------------------------------------------------------------------------------------- the marker
def test_events_before_ready_are_replayed_counted_by_the_marker_and_kept_out_of_the_cache(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md: "A brand-new session gets a marker too; events that arrived between its SUBSCRIBE and
    `ready_for_events()` count as replayed"; the marker carries "the session's `epoch`, the number of replayed
    events (`replayed`), their first and last sequence ids"; "replayed events go to listeners but never into the
    cache ...; live events ... update it"; `on_connected(info)` (`session_present`, `epoch`)."""
    seen = Seen()
    client = client_of(made, shared, "blind15-replayed", seen)
    client.subscribe("blind15/r/#", listener=seen.listener("r"))
    client.connect()
    paho("blind15-pub-r").publish("blind15/r/a", [b"q1", b"q2"], qos=1)
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    marker = seen.markers[0]
    events = [event for _, event in seen.events]
    assert [e.payload for e in events] == [b"q1", b"q2"] and all(e.replayed for e in events)
    assert (marker.replayed, marker.first_seq, marker.last_seq) == (2, events[0].seq, events[1].seq)
    info = seen.connected[0]
    assert info.session_present is False and marker.epoch == info.epoch == events[0].epoch
    assert client.cache.get("blind15/r/a") is None
    paho("blind15-pub-r2").publish("blind15/r/a", [b"live"], qos=1)
    seen.until(lambda: len(seen.events) == 3)
    assert seen.events[2][1].replayed is False and seen.events[2][1].seq > events[1].seq
    assert client.cache.get("blind15/r/a") == b"live"


def test_a_brand_new_session_with_nothing_queued_gets_a_marker_of_none(
    shared: Broker, made: list[DurableClient]
) -> None:
    """sdk.md: "A brand-new session gets a marker too"; `first_seq`, `last_seq` "`None` when nothing was
    replayed"."""
    seen = Seen()
    client = client_of(made, shared, "blind15-empty", seen)
    client.subscribe("blind15/empty", listener=seen.listener("e"))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    marker = seen.markers[0]
    assert (marker.replayed, marker.first_seq, marker.last_seq) == (0, None, None)


def test_the_marker_lists_qos2_as_qos1_and_leaves_out_refused_and_unsubscribed_filters(
    shared: Broker, made: list[DurableClient]
) -> None:
    """sdk.md: "QoS 2 subscriptions of an SDK session are made at QoS 1"; the marker's `live` list "holds the
    filters they granted, not those refused with 0x80, nor those unsubscribed", also for SUBSCRIBEs "a
    `ready_for_events()` called before `connect()` sends"; "Subscriptions, streams and `ready_for_events()` may be
    called before `connect()`". The broker allows 3 subscriptions per client (`max_subscriptions_per_client`)."""
    seen = Seen()
    client = client_of(made, shared, "blind15-live", seen)
    client.subscribe("blind15/live/q2", qos=2, listener=seen.listener("a"))
    client.subscribe("blind15/live/gone", qos=1, listener=seen.listener("b"))
    client.subscribe("blind15/live/q0", qos=0, durable=False, listener=seen.listener("c"))
    client.unsubscribe("blind15/live/gone")
    client.subscribe("blind15/live/x", qos=1, listener=seen.listener("d"))
    client.subscribe("blind15/live/y", qos=1, listener=seen.listener("e"))  # the fourth: refused
    client.ready_for_events()
    client.connect()
    seen.until(lambda: len(seen.markers) == 1)
    live = sorted(seen.markers[0].live, key=lambda s: s.filter)
    assert len(live) == 3, live
    assert live[0] == LiveSubscription("blind15/live/q0", 0, False)
    assert live[1] == LiveSubscription("blind15/live/q2", 1, True)
    assert live[2].filter in ("blind15/live/x", "blind15/live/y") and live[2].qos == 1


def test_a_stateless_client_gets_no_marker(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md: the marker comes before live messages; "a stateless client (`durable_session=False`), which gets no
    marker"; "Plain MQTT clients get no hold, no marker and no frame"."""
    seen = Seen()
    client = client_of(made, shared, "blind15-stateless", seen, durable_session=False)
    client.subscribe("blind15/sl", listener=seen.listener("s"))
    client.connect()
    client.ready_for_events()
    paho("blind15-pub-sl").publish("blind15/sl", [b"v"], qos=1)
    seen.until(lambda: len(seen.events) == 1)
    assert seen.markers == []
    assert seen.events[0][1].payload == b"v"


# ------------------------------------------------------------------------------------------- the cache
def test_the_cache_applies_initial_values_by_register_interest_rules(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md The last-value cache: "retained messages sent with a new subscription are initial values ...: an
    entry that already holds a valid value is not overwritten, an invalidated one (`cache.invalidate(topic)`,
    which changes only a valid entry) takes the value, a destroyed one stays destroyed until the next marker ...:
    a delete received after this connection's marker stays until the next connection's marker ...; an absent one
    is created"; "an empty payload destroys the entry"; reads: `get(topic, default=None)`, `entry(topic)` with
    `state`, "`value` is `None` unless valid"; "`topic in cache`, `len(cache)` and iteration ... count `valid`
    entries only"; "Reads keep working while disconnected, possibly stale (`cache.stale`)"."""
    publisher = paho("blind15-pub-cache")
    publisher.publish("blind15/c/x", [b"x0"], qos=1, retain=True)
    publisher.publish("blind15/c/y", [b"y0"], qos=1, retain=True)
    seen = Seen()
    client = client_of(made, shared, "blind15-cache", seen)
    client.subscribe("blind15/c/x", listener=seen.listener("x"))
    client.subscribe("blind15/c/y", listener=seen.listener("y"))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1 and len(seen.events) >= 2)
    try:
        assert client.cache.get("blind15/c/x") == b"x0" and client.cache.get("blind15/c/y") == b"y0"  # created
        assert client.cache.stale is False
        publisher.publish("blind15/c/x", [b"x1"], qos=1)  # live: x valid x1
        publisher.publish("blind15/c/y", [b""], qos=1)  # live delete: y destroyed
        seen.until(lambda: seen.payloads("x")[-1:] == [b"x1"] and seen.payloads("y")[-1:] == [b""])
        y = client.cache.entry("blind15/c/y")
        assert y is not None and y.state == "destroyed" and y.value is None
        assert "blind15/c/y" not in client.cache and client.cache.get("blind15/c/y", b"d") == b"d"
        client.cache.invalidate("blind15/c/y")  # changes only a valid entry
        client.cache.invalidate("blind15/c/none")
        assert client.cache.entry("blind15/c/y").state == "destroyed"  # type: ignore[union-attr]
        assert client.cache.entry("blind15/c/none") is None
        client.subscribe("blind15/c/+", listener=seen.listener("plus"))  # initial values x0, y0 again
        seen.until(lambda: sorted(seen.payloads("plus")) == [b"x0", b"y0"])
        assert client.cache.get("blind15/c/x") == b"x1"  # valid: not overwritten
        assert client.cache.entry("blind15/c/y").state == "destroyed"  # type: ignore[union-attr]
        client.cache.invalidate("blind15/c/x")
        x = client.cache.entry("blind15/c/x")
        assert x is not None and x.state == "invalid" and x.value is None and client.cache.get("blind15/c/x") is None
        assert len(client.cache) == 0 and list(client.cache) == []
        client.unsubscribe("blind15/c/+")  # the broker allows 3 subscriptions per client
        client.subscribe("blind15/c/#", listener=seen.listener("hash"))
        seen.until(lambda: sorted(seen.payloads("hash")) == [b"x0", b"y0"])
        assert client.cache.get("blind15/c/x") == b"x0"  # invalidated: takes the value
        assert client.cache.entry("blind15/c/y").state == "destroyed"  # type: ignore[union-attr]
        assert list(client.cache) == ["blind15/c/x"] and len(client.cache) == 1 and "blind15/c/x" in client.cache
        client.close()
        assert client.cache.stale is True and client.cache.get("blind15/c/x") == b"x0"
    finally:
        publisher.publish("blind15/c/x", [b""], qos=1, retain=True)
        publisher.publish("blind15/c/y", [b""], qos=1, retain=True)


def test_a_retained_message_with_an_empty_payload_sets_nothing(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md: "a retained message with an empty payload sets nothing" (initial values); "an absent one is
    created"."""
    publisher = paho("blind15-pub-empty-ret")
    publisher.publish("blind15/er/a", [b"a0"], qos=1, retain=True)
    seen = Seen()
    client = client_of(made, shared, "blind15-empty-ret", seen)
    client.subscribe("blind15/er/a", listener=seen.listener("a"))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: seen.payloads("a") == [b"a0"])
    try:
        # An empty retained publish clears the broker's retained value; it goes live to the subscriber as a delete.
        publisher.publish("blind15/er/a", [b""], qos=1, retain=True)
        seen.until(lambda: seen.payloads("a") == [b"a0", b""])
        assert client.cache.entry("blind15/er/a").state == "destroyed"  # type: ignore[union-attr]
    finally:
        publisher.publish("blind15/er/a", [b""], qos=1, retain=True)
    assert client.cache.entry("blind15/er/none") is None


# ------------------------------------------------------------------------------------------- publish, subscribe
def test_a_publish_while_disconnected_raises_unconnected_and_queues_nothing(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md `publish()`: "Disconnected, it raises `Unconnected` and queues nothing"."""
    watcher = paho("blind15-watch-pd")
    watcher.subscribe("blind15/pd", 1)
    seen = Seen()
    client = client_of(made, shared, "blind15-pd", seen)
    for qos in (0, 1, 2):
        with pytest.raises(Unconnected):
            client.publish("blind15/pd", f"lost{qos}", qos=qos)
    client.connect()
    client.publish("blind15/pd", "after", qos=1)
    assert watcher.wait_for(lambda ms: len(ms) >= 1)
    client.publish("blind15/pd", "after2", qos=1)
    assert watcher.wait_for(lambda ms: len(ms) >= 2)
    assert [m.payload for m in watcher.messages] == [b"after", b"after2"]


def test_session_expiry_is_capped_by_the_brokers_max_session_expiry(shared: Broker, made: list[DurableClient]) -> None:
    """sdk.md: "`session_expiry=seconds` overrides the broker's `session_expiry` for this client, capped by the
    broker's `max_session_expiry`"; `on_connected(info)` (`session_present`, `epoch`, granted `session_expiry`).
    The broker's `max_session_expiry` is 60."""
    seen = Seen()
    client = client_of(made, shared, "blind15-expiry", seen, session_expiry=3600)
    client.connect()
    seen.until(lambda: len(seen.connected) == 1)
    assert seen.connected[0].session_expiry == 60
    seen2 = Seen()
    client2 = client_of(made, shared, "blind15-expiry2", seen2, session_expiry=7)
    client2.connect()
    seen2.until(lambda: len(seen2.connected) == 1)
    assert seen2.connected[0].session_expiry == 7


def test_one_function_for_two_matching_filters_is_called_twice_and_a_new_listener_replaces_the_old(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md `subscribe()`: "one listener per filter: calling it again for a filter it holds changes that
    subscription's ... listener (the new `listener`, `None` included, replaces the old ...); an event goes to the
    listener of every subscription whose filter matches its topic (one function given for two matching filters is
    called twice)"."""
    seen = Seen()
    both = seen.listener("both")
    client = client_of(made, shared, "blind15-twice", seen)
    client.subscribe("blind15/tw/+", listener=both)
    client.subscribe("blind15/tw/#", listener=both)
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    publisher = paho("blind15-pub-tw")
    publisher.publish("blind15/tw/a", [b"one"], qos=1)
    seen.until(lambda: len(seen.payloads("both")) >= 2)
    client.subscribe("blind15/tw/#", listener=seen.listener("new"))
    client.subscribe("blind15/tw/+", listener=None)
    publisher.publish("blind15/tw/a", [b"two"], qos=1)
    seen.until(lambda: seen.payloads("new") == [b"two"])
    assert seen.payloads("both") == [b"one", b"one"]


# ------------------------------------------------------------------------------------------- fleet
@pytest.fixture
def broker_yaml(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "broker.yaml"
    path.write_text((Path(__file__).parent.parent / "broker.yaml").read_text(encoding="utf-8"), encoding="utf-8")
    return path


def schedule_file(folder: Path, *faults: dict[str, Any]) -> Path:
    path = folder / "script.yaml"
    path.write_text(yaml.safe_dump({"faults": list(faults)}), encoding="utf-8")
    return path


def test_schedule_device_names_have_at_least_three_digits(broker_yaml: Path) -> None:
    """fleet.md: "devices are named `--prefix` + an index of at least three digits, `dev-000` ... `dev-999`,
    `dev-1000` ..."; a schedule is refused when a `drop` ... names a device "that is not one of the run's
    `--devices`"."""
    parser = build_parser()
    fine = schedule_file(
        broker_yaml.parent,
        {"at": "5s", "kind": "drop", "device": "dev-1000", "for": "1s"},
        {"at": "5s", "kind": "stall", "device": "dev-007", "for": "1s"},
    )
    options = options_from(
        parser.parse_args(["--devices", "1001", "--schedule", str(fine), "--duration", "60s"]), parser
    )
    assert sorted(str(fault.target) for fault in options.faults) == ["dev-007", "dev-1000"]
    for name in ("dev-7", "dev-0007", "dev-20"):
        bad = schedule_file(broker_yaml.parent, {"at": "5s", "kind": "drop", "device": name, "for": "1s"})
        with pytest.raises(SystemExit) as caught:
            options_from(parser.parse_args(["--devices", "1001", "--schedule", str(bad), "--duration", "60s"]), parser)
        assert caught.value.code == 2, name


def test_schedule_device_names_follow_the_prefix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fleet.md: devices are named "`--prefix` + an index"; a device "that is not one of the run's `--devices`" is
    refused: "A bad schedule ... stops the run before it starts, with exit status 2 and the file, fault number and
    field named"."""
    schedule = schedule_file(
        tmp_path,
        {"at": "5s", "kind": "drop", "device": "car-002", "for": "1s"},
        {"at": "9s", "kind": "drop", "device": "dev-002", "for": "1s"},
    )
    status, err = fleet_in_process(
        tmp_path,
        capsys,
        "-c",
        str(tmp_path / "broker.yaml"),
        "--prefix",
        "car-",
        "--schedule",
        str(schedule),
        "--devices",
        "5",
        "--duration",
        "60s",
    )
    assert status == 2, err
    assert "script.yaml" in err and "fault 2: device" in err and "dev-002" in err, err
    assert not (tmp_path / "out").exists()


def test_the_error_classes_nest_as_the_page_says() -> None:
    """sdk.md: "Errors: `DurableClientError` > `Unconnected`, `ConnectFailed`, `ControlRequestFailed` ...,
    `RequestTimeout`, `PersistenceError` ..., `EventNotProcessedError`"; "`WrongTypeError`, both a `ValueError` and
    a `TypeError`"."""
    import durable_client  # noqa: PLC0415 - the names the page lists, looked up by name

    for name in (
        "Unconnected",
        "ConnectFailed",
        "ControlRequestFailed",
        "RequestTimeout",
        "PersistenceError",
        "EventNotProcessedError",
    ):
        assert issubclass(getattr(durable_client, name), DurableClientError), name
    assert issubclass(WrongTypeError, ValueError) and issubclass(WrongTypeError, TypeError)
    with pytest.raises(TypeError):
        DurableClient("blind15-types", port="1883")  # type: ignore[arg-type]


def test_a_same_qos_subscribe_sends_no_subscribe_so_no_retained_value_comes_again(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md `subscribe()`: "calling it again for a filter it holds changes that subscription's QoS, durability
    and listener (...; a SUBSCRIBE goes out again only for a new QoS)"; "a restarted client re-sends only the
    subscriptions its broker session lacks (a repeated SUBSCRIBE would queue retained values again)"."""
    publisher = paho("blind15-pub-same")
    publisher.publish("blind15/same/t", [b"r0"], qos=1, retain=True)
    try:
        seen = Seen()
        client = client_of(made, shared, "blind15-same", seen)
        client.subscribe("blind15/same/t", listener=seen.listener("a"))
        client.connect()
        client.ready_for_events()
        seen.until(lambda: seen.payloads("a") == [b"r0"] and len(seen.markers) == 1)
        client.subscribe("blind15/same/t", listener=seen.listener("b"))
        publisher.publish("blind15/same/t", [b"l1"], qos=1)
        seen.until(lambda: seen.payloads("b") == [b"l1"])
        client.close()
        # The next run of the same client id subscribes the same filter at the same QoS.
        again = Seen()
        second = client_of(made, shared, "blind15-same", again)
        second.subscribe("blind15/same/t", listener=again.listener("c"))
        second.connect()
        second.ready_for_events()
        again.until(lambda: len(again.markers) == 1)
        publisher.publish("blind15/same/t", [b"l2"], qos=1)
        again.until(lambda: again.payloads("c") == [b"l2"])
        assert again.markers[0].replayed == 0 and again.connected[0].session_present is True
    finally:
        publisher.publish("blind15/same/t", [b""], qos=1, retain=True)


def test_an_unsubscribe_followed_at_once_by_close_is_applied_before_the_session_is_left(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md `unsubscribe(topic_filter)`: "returns once the UNSUBSCRIBE is sent ...; the broker applies a
    connection's SUBSCRIBEs and UNSUBSCRIBEs in the order they were sent, ... and one followed at once by `close()`
    is applied before the session is left"; `durable=False` "is dropped by the broker when the connection ends, so
    nothing is queued for it while away"."""
    seen = Seen()
    client = client_of(made, shared, "blind15-unsub", seen)
    for name in ("gone", "kept", "nd"):
        client.subscribe(f"blind15/un/{name}", durable=name != "nd", listener=seen.listener(name))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    client.unsubscribe("blind15/un/gone")
    client.close()
    publisher = paho("blind15-pub-unsub")
    for name in ("gone", "kept", "nd"):
        publisher.publish(f"blind15/un/{name}", [name.encode()], qos=1)
    again = Seen()
    second = client_of(made, shared, "blind15-unsub", again)
    second.subscribe("blind15/un/#", listener=again.listener("all"))
    second.connect()
    second.ready_for_events()
    again.until(lambda: len(again.markers) == 1)
    assert again.payloads("all") == [b"kept"] and again.markers[0].replayed == 1


def test_a_worker_spec_the_runner_did_not_write_is_exit_2_and_one_line(tmp_path: Path) -> None:
    """fleet.md: "A spec the runner did not write (not JSON, a field missing or unknown, a file that cannot be
    read) stops the worker with exit status 2 and one line, "SPEC is not a worker spec the fleet runner wrote:
    ..." naming what is wrong, before any device starts" (run with `python -m durable_fleet.worker SPEC`)."""
    not_json = tmp_path / "notjson.json"
    not_json.write_text("{devices: [", encoding="utf-8")
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"surprise": 1}), encoding="utf-8")
    for spec in (not_json, unknown, tmp_path / "missing.json", tmp_path):
        done = subprocess.run(
            [sys.executable, "-m", "durable_fleet.worker", str(spec)],
            capture_output=True,
            text=True,
            timeout=WAIT * 2,
            check=False,
        )
        lines = done.stderr.strip().splitlines()
        assert done.returncode == 2, (spec, done.stderr)
        assert len(lines) == 1 and lines[0].startswith(f"{spec} is not a worker spec the fleet runner wrote: "), lines


def test_a_subscribe_whose_packet_would_pass_max_packet_size_is_refused_at_the_exact_size(
    tmp_path: Path, made: list[DurableClient]
) -> None:
    """sdk.md Bad input: "once a hello reply has said the broker's `max_packet_size`, a filter whose SUBSCRIBE or
    UNSUBSCRIBE (its UTF-8 bytes and 5) ... would be larger" is a `ValueError` (`topic_filter: ...`); configuration
    .md: `max_packet_size` is the remaining length. A stateless client (no control request for a subscribe): a
    1019-byte filter's SUBSCRIBE is 1024 bytes and fits, a 1020-byte one does not; UTF-8 bytes count, not
    characters."""
    broker = Broker(tmp_path, max_packet_size=1024)
    broker.start()
    try:
        seen = Seen()
        client = client_of(made, broker, "blind15-size", seen, durable_session=False)
        client.connect()
        fits = "s/" + "f" * 1015 + "/#"  # 1019 bytes: its SUBSCRIBE's remaining length is 1024
        client.subscribe(fits, qos=1, listener=seen.listener("fits"))
        for too_big in ("s/" + "g" * 1018, "s/" + "é" * 509):  # 1020 and 1020 bytes (510 characters)
            with pytest.raises(ValueError, match=r"^topic_filter: "):
                client.subscribe(too_big, qos=1, listener=seen.listener("big"))
        client.publish(fits[:-2], b"in", qos=0)  # 1021 bytes
        seen.until(lambda: seen.payloads("fits") == [b"in"])
        assert client.connected and seen.connected == [seen.connected[0]], "the connection was closed"
    finally:
        broker.stop()


def test_a_subscription_without_a_listener_feeds_the_cache(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """`DurableClient.subscribe` docstring: "Without a listener the events only feed the cache"; sdk.md `subscribe(
    topic_filter, qos=1, *, durable=True, listener=None, ...)`; "live events ... update it"."""
    seen = Seen()
    client = client_of(made, shared, "blind15-nolistener", seen)
    client.subscribe("blind15/nl/t")
    client.subscribe("blind15/nl2/#", listener=seen.listener("after"))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    publisher = paho("blind15-pub-nl")
    publisher.publish("blind15/nl/t", [b"quiet"], qos=1)
    publisher.publish("blind15/nl2/x", [b"later"], qos=1)  # delivered after it, on the same session
    seen.until(lambda: seen.payloads("after") == [b"later"])
    assert client.cache.get("blind15/nl/t") == b"quiet" and len(seen.events) == 1


def test_a_stateless_client_is_not_held_and_ready_for_events_changes_nothing(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """`ready_for_events` docstring: "Until then a durable session is held ... A no-op on a stateless client";
    sdk.md: `durable_session=False` clients get no marker; their events are raw: `seq` and `epoch` 0 ("Raw events
    of a stateless connection have neither (0, 0)", the `Event` docstring)."""
    seen = Seen()
    client = client_of(made, shared, "blind15-nothold", seen, durable_session=False)
    client.subscribe("blind15/nh", listener=seen.listener("s"))
    client.connect()
    paho("blind15-pub-nh").publish("blind15/nh", [b"first"], qos=1)
    seen.until(lambda: seen.payloads("s") == [b"first"])
    event = seen.events[0][1]
    assert (event.seq, event.epoch, event.replayed) == (0, 0, False)
    client.ready_for_events()
    paho("blind15-pub-nh2").publish("blind15/nh", [b"second"], qos=1)
    seen.until(lambda: seen.payloads("s") == [b"first", b"second"])
    assert seen.markers == []


def test_a_destroyed_entry_is_removed_by_the_next_connections_marker(tmp_path: Path, made: list[DurableClient]) -> None:
    """sdk.md The last-value cache: "a destroyed one stays destroyed until the next marker, which removes it (then
    absent): a delete received after this connection's marker stays until the next connection's marker"; "Reads
    keep working while disconnected, possibly stale (`cache.stale`)"; "Reconnection is automatic"; `on_connected(
    info)` (`session_present`); "a stateless client (`durable_session=False`), which gets no marker, keeps its
    destroyed entries"; a `durable=False` subscription: "the client subscribes it again on reconnect"."""
    broker = Broker(tmp_path)
    broker.start()
    publishers: list[Client] = []
    try:
        publisher = Client(broker.port, "blind15-pub-destroy", clean_session=True)
        publishers.append(publisher)
        publisher.publish("blind15/d/y", [b"y0"], qos=1)
        seen = Seen()
        lost = threading.Event()
        client = client_of(made, broker, "blind15-destroy", seen, on_disconnected=lambda reason: lost.set())
        client.subscribe("blind15/d/+", listener=seen.listener("d"))
        client.subscribe("blind15/nd", durable=False, listener=seen.listener("nd"))
        client.connect()
        client.ready_for_events()
        seen.until(lambda: len(seen.markers) == 1)
        stateless_seen = Seen()
        stateless = client_of(made, broker, "blind15-destroy-sl", stateless_seen, durable_session=False)
        stateless.subscribe("blind15/d/+", listener=stateless_seen.listener("d"))
        stateless.connect()
        publisher.publish("blind15/d/y", [b"y1"], qos=1)
        publisher.publish("blind15/d/y", [b""], qos=1)
        publisher.publish("blind15/d/z", [b"z1"], qos=1)
        seen.until(lambda: seen.payloads("d") == [b"y1", b"", b"z1"])
        stateless_seen.until(lambda: stateless_seen.payloads("d") == [b"y1", b"", b"z1"])
        assert client.cache.entry("blind15/d/y").state == "destroyed"  # type: ignore[union-attr]
        broker.stop()
        assert lost.wait(WAIT)
        assert client.cache.stale is True and client.cache.get("blind15/d/z") == b"z1"
        assert client.cache.entry("blind15/d/y").state == "destroyed"  # type: ignore[union-attr]
        broker.start()
        seen.until(lambda: len(seen.markers) == 2)
        assert seen.connected[-1].session_present is True and client.cache.stale is False
        assert client.cache.entry("blind15/d/y") is None and client.cache.get("blind15/d/z") == b"z1"
        stateless_seen.until(lambda: len(stateless_seen.connected) == 2 and stateless.connected)
        assert stateless.cache.entry("blind15/d/y").state == "destroyed"  # type: ignore[union-attr]
        assert stateless_seen.markers == []
        assert LiveSubscription("blind15/nd", 1, False) in seen.markers[1].live
        again = Client(broker.port, "blind15-pub-destroy2", clean_session=True)
        publishers.append(again)
        again.publish("blind15/nd", [b"still"], qos=1)
        seen.until(lambda: seen.payloads("nd") == [b"still"])
    finally:
        for one in publishers:
            one.paho.disconnect()
            one.paho.loop_stop()
        broker.stop()


def test_an_unsubscribe_from_on_connected_is_applied_after_the_connections_subscribes(
    shared: Broker, made: list[DurableClient], paho: Callable[[str], Client]
) -> None:
    """sdk.md `unsubscribe()`: "the broker applies a connection's SUBSCRIBEs and UNSUBSCRIBEs in the order they were
    sent ..., an `unsubscribe()` sent while the connection's SUBSCRIBEs still wait (from `on_connected`, say) is
    applied after them"; called from a callback it returns once sent."""
    seen = Seen()
    done: list[bool] = []

    def on_connected(info: Any) -> None:
        if not done:
            done.append(True)
            client.unsubscribe("blind15/oc/x")
        seen.on_connected(info)

    client = DurableClient(
        "blind15-oc",
        port=shared.port,
        on_live=seen.on_live,
        on_connected=on_connected,
        reconnect_min_delay=0.05,
        reconnect_max_delay=0.5,
    )
    made.append(client)
    client.subscribe("blind15/oc/x", listener=seen.listener("x"))
    client.subscribe("blind15/oc/y", listener=seen.listener("y"))
    client.connect()
    client.ready_for_events()
    seen.until(lambda: len(seen.markers) == 1)
    publisher = paho("blind15-pub-oc")
    publisher.publish("blind15/oc/x", [b"x"], qos=1)
    publisher.publish("blind15/oc/y", [b"y"], qos=1)
    seen.until(lambda: seen.payloads("y") == [b"y"])
    assert seen.payloads("x") == [] and done == [True]
    client.close()
    again = Seen()
    second = client_of(made, shared, "blind15-oc", again)
    second.connect()
    second.ready_for_events()
    again.until(lambda: len(again.markers) == 1)
    assert [s.filter for s in again.markers[0].live] == ["blind15/oc/y"], again.markers


@pytest.mark.parametrize(
    ("text", "named"),
    [
        (
            "plugins:\n  amqtt_durable.DurableSessionsPlugin:\n    store: ./s\n    session_expiry: -5\n",
            "session_expiry",
        ),
        ("plugins:\n  amqtt_durable.DurableSessionsPlugin:\n    store: ./s\n    sesion_expiry: 5\n", "sesion_expiry"),
        ("plugins: [\n", "not valid YAML"),
        (
            "plugins:\n  amqtt_durable.DurableSessionsPlugin:\n    store: ./s\n    max_keepalive: 3\n",
            "max_keepalive (3)",
        ),
    ],
)
def test_a_bad_broker_yaml_stops_the_fleet_before_it_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, named: str
) -> None:
    """fleet.md: "A bad schedule, option or broker.yaml stops the run before it starts, with exit status 2 and the
    file ... and field named"; the broker is started "with `-c broker.yaml`"; `--keepalive` (default 4) is "at most
    the `max_keepalive` of `-c`'s broker.yaml when that sets one" (configuration.md: a CONNECT above it gets
    CONNACK 2)."""
    config = tmp_path / "mine.yaml"
    config.write_text(text, encoding="utf-8")
    status, err = fleet_in_process(tmp_path, capsys, "-c", str(config), "--devices", "2", "--duration", "30s")
    assert status == 2, err
    assert "mine.yaml" in err and named in err, err
    assert not (tmp_path / "out").exists()


def test_a_bad_setting_names_a_broker_yaml_whose_name_is_short(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """fleet.md: a bad broker.yaml stops the run "with ... the file ... named", also when the file's name is a
    word the setting's message holds ("e" is in "expected"; the file was named only if its path was not)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "e").write_text(
        "plugins:\n  amqtt_durable.DurableSessionsPlugin:\n    store: ./s\n    max_keepalive: -1\n", encoding="utf-8"
    )
    status, err = fleet_in_process(tmp_path, capsys, "-c", "e", "--devices", "2", "--duration", "30s")
    assert status == 2, err
    assert "e: amqtt_durable config: 'max_keepalive'" in err, err


def test_a_keepalive_equal_to_the_broker_yaml_s_max_keepalive_is_taken(tmp_path: Path) -> None:
    """fleet.md: `--keepalive` is "at most the `max_keepalive` of `-c`'s broker.yaml when that sets one": equal
    is allowed, one more is a bad option."""
    config = tmp_path / "three.yaml"
    config.write_text(
        "plugins:\n  amqtt_durable.DurableSessionsPlugin:\n    store: ./s\n    max_keepalive: 3\n", encoding="utf-8"
    )
    parser = build_parser()
    taken = options_from(parser.parse_args(["-c", str(config), "--keepalive", "3", "--faults", ""]), parser)
    assert taken.keepalive == 3
    with pytest.raises(SystemExit) as stopped:
        options_from(parser.parse_args(["-c", str(config), "--keepalive", "4", "--faults", ""]), parser)
    assert stopped.value.code == 2


def test_the_queue_depth_monitor_is_served_by_a_broker_with_a_short_max_keepalive(tmp_path: Path) -> None:
    """The fleet's report charts the broker's queued messages from a monitor client: with a `max_keepalive`
    below its 10 s (a run's `--keepalive` within it, as the CLI checks) it was refused with CONNACK 2 at every
    try and the chart stayed empty."""
    from durable_fleet.runner import _QueueDepth  # noqa: PLC0415 - the fleet's imports only where used

    broker = Broker(tmp_path, max_keepalive=5, metrics_interval=1)
    broker.spawn()  # its readiness probe's keep-alive is above 5 s: wait for the listener instead
    try:
        assert broker.wait_until(lambda: port_open(broker.port), WAIT), broker.log()
        depth = _QueueDepth("127.0.0.1", broker.port, 4)
        got = threading.Event()
        read = depth.client.on_message
        depth.client.on_message = lambda *args: (read(*args), got.set())
        try:
            assert got.wait(WAIT), broker.log()
            assert depth.value == 0
        finally:
            depth.close()
    finally:
        broker.stop()


AMQTT = Path(sys.executable).parent / "amqtt"


@pytest.mark.skipif(not AMQTT.exists(), reason="the stock amqtt command")
def test_connect_to_a_broker_without_the_plugin_fails_within_its_timeout_and_stops_the_thread(tmp_path: Path) -> None:
    """`DurableClient.connect` docstring: "Raises ConnectFailed ... when no session is set up within ``timeout``
    (broker down, or without the amqtt-durable plugin). The thread has then stopped"; README: "the broker answers
    plain MQTT clients exactly as before" (a stock amqtt broker: no plugin to answer the SDK's hello)."""
    port = free_port()
    config = tmp_path / "broker.yaml"
    config.write_text(
        f"listeners:\n  default: {{type: tcp, bind: '127.0.0.1:{port}'}}\nplugins:\n"
        "  amqtt.plugins.authentication.AnonymousAuthPlugin: {allow_anonymous: true}\n",
        encoding="utf-8",
    )
    with (tmp_path / "amqtt.log").open("wb") as out:
        stock = subprocess.Popen([str(AMQTT), "-c", str(config)], cwd=tmp_path, stdout=out, stderr=out)
    try:
        plain = None
        deadline = time.monotonic() + WAIT
        while plain is None and time.monotonic() < deadline:
            with contextlib.suppress(AssertionError, OSError):
                plain = Client(port, "blind15-stock-plain", clean_session=True)
            if plain is None:
                time.sleep(0.05)  # the stock broker's listener opens after its start: bounded polling
        assert plain is not None, (tmp_path / "amqtt.log").read_text(errors="replace")
        plain.disconnect()
        threads = threading.active_count()
        client = DurableClient("blind15-stock", port=port, reconnect_min_delay=0.05, reconnect_max_delay=0.2)
        started = time.monotonic()
        with pytest.raises(ConnectFailed):
            client.connect(timeout=1.0)
        assert time.monotonic() - started < 1.0 + WAIT / 3
        assert not client.connected
        left = time.monotonic() + WAIT
        while threading.active_count() > threads and time.monotonic() < left:
            time.sleep(0.05)  # the network thread ends on its own: bounded polling
        assert threading.active_count() == threads, threading.enumerate()
        client.close()
    finally:
        stock.terminate()
        stock.wait(WAIT)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--keepalive", "65536"], "--keepalive"),
        (["--port", "PORT", "--host", "bad host"], "--host"),
        (["--port", "PORT", "--host", "127.0.0.1:1883"], "--host"),
        (["--port", "PORT", "--host", ""], "--host"),
    ],
)
def test_a_keepalive_or_host_no_device_can_use_is_a_bad_option(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], named: str
) -> None:
    """fleet.md: "A bad ... option ... stops the run before it starts, with exit status 2"; "`--port P [--host H]`
    targets a running broker instead (`H` a host name or an IP address ...)"; "`--keepalive`, the devices' MQTT
    keep-alive: a whole number of seconds from 1 to 65535" (the SDK refuses a `keepalive` above 65535, sdk.md).
    Before, the run started (a broker, workers) and failed after minutes."""
    port = str(free_port())  # nothing listens there: a refusal that regressed fails fast, touching no broker
    status, err = fleet_in_process(
        tmp_path, capsys, *(port if arg == "PORT" else arg for arg in args), "--faults", "drop=1", "--duration", "30s"
    )
    assert status == 2, err
    assert named in err.splitlines()[-1], err
    assert not (tmp_path / "out").exists()


def test_a_bracketed_ipv6_host_is_taken_as_the_sdk_takes_it(broker_yaml: Path) -> None:
    """fleet.md `--port P [--host H]`; sdk.md: "an IPv6 address is written bare or in brackets (`"::1"` or
    `"[::1]"`, kept as ... `"::1"`)"; the largest keep-alive MQTT carries is accepted."""
    parser = build_parser()
    options = options_from(
        parser.parse_args(["--port", "1883", "--host", "[::1]", "--keepalive", "65535", "--faults", "drop=1"]), parser
    )
    assert options.host == "::1" and options.keepalive == 65535


def test_a_prefix_whose_device_names_cannot_name_files_is_a_bad_option(broker_yaml: Path) -> None:
    """fleet.md: "A device's client id is `--prefix` ... and its index; it names the device's files, so the longest
    must stay within 249 characters, a `:` counted as 3 (a longer `--prefix` is a bad option)"; "A bad ... option
    ... stops the run before it starts, with exit status 2". Before, a run with a 300-character prefix started
    and failed (its delivery logs could not be made)."""
    parser = build_parser()
    fits = options_from(parser.parse_args(["--prefix", "p" * 246, "--devices", "1000", "--faults", ""]), parser)
    assert len(fits.prefix + "999") == 249
    for prefix, devices in (("p" * 247, "1000"), ("p" * 246, "1001"), (":" * 83, "10")):
        with pytest.raises(SystemExit) as stopped:
            options_from(parser.parse_args(["--prefix", prefix, "--devices", devices, "--faults", ""]), parser)
        assert stopped.value.code == 2, (len(prefix), devices)
