"""Black-box tests written from README.md and docs/ alone (sdk.md, streams.md, protocol.md,
delivery-log.md, replication.md, pipeline.md, fleet.md): each test quotes the promise it
checks (by its words, not a line number, which drifts) and runs it against real brokers, real
SDK and paho clients over TCP to 127.0.0.1 and the real command-line tools.
"""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from test_blind_pipeline import fleet_in_process

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, run_cli
from durable_client import (
    ControlRequestFailed,
    DurableClient,
    Event,
    Marker,
    PersistenceError,
    Unconnected,
    WrongTypeError,
)

STREAMS = [{"filter": "telemetry/#", "max_count": 1000, "max_age": 0}]
CTL = "_durable/v1/ctl"
REPLY = "$durable/v1/reply"


class Seen:
    """What an SDK client's listener and callbacks got, with bounded waits."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[Event] = []
        self.markers: list[Marker] = []
        self.connected: list[Any] = []
        self.disconnected: list[Any] = []

    def _add(self, bucket: list[Any], item: Any) -> None:
        with self.cond:
            bucket.append(item)
            self.cond.notify_all()

    def on_event(self, event: Event) -> None:
        self._add(self.events, event)

    def on_live(self, marker: Marker) -> None:
        self._add(self.markers, marker)

    def on_connected(self, info: Any) -> None:
        self._add(self.connected, info)

    def on_disconnected(self, reason: Any) -> None:
        self._add(self.disconnected, reason)

    def wait(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)


class LogWatch(logging.Handler):
    """Every WARNING (or above) logged while installed on the root logger, with a bounded wait."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.cond = threading.Condition()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        with self.cond:
            self.messages.append(record.getMessage())
            self.cond.notify_all()

    def wait(self, predicate: Callable[[str], bool], timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: any(predicate(m) for m in self.messages), timeout)

    def __enter__(self) -> LogWatch:
        logging.getLogger().addHandler(self)
        return self

    def __exit__(self, *exc: object) -> None:
        logging.getLogger().removeHandler(self)


@pytest.fixture
def made() -> Iterator[list[DurableClient]]:
    """SDK clients to close (keeping their sessions) after the test."""
    clients: list[DurableClient] = []
    yield clients
    for client in clients:
        client.close(keep_session=True)


def new_client(
    made: list[DurableClient], port: int, client_id: str, seen: Seen | None = None, **kw: Any
) -> DurableClient:
    if seen is not None:
        kw.setdefault("on_live", seen.on_live)
        kw.setdefault("on_connected", seen.on_connected)
        kw.setdefault("on_disconnected", seen.on_disconnected)
    client = DurableClient(client_id, HOST, port, reconnect_min_delay=0.05, reconnect_max_delay=0.5, **kw)
    made.append(client)
    return client


def ctl(client: Client, request: dict[str, Any] | bytes) -> dict[str, Any]:
    """Send one control request from a raw paho client; its reply (the next one on the connection)."""
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY)
    body = request if isinstance(request, bytes) else json.dumps(request).encode()
    client.paho.publish(CTL, body, qos=0)
    assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY) > seen), "no reply"
    reply: dict[str, Any] = json.loads([m.payload for m in client.messages if m.topic == REPLY][seen])
    return reply


def publish(clients: Callable[..., Client], port: int, topic: str, bodies: list[bytes], **kw: Any) -> None:
    pub = clients(port, f"pub-{time.monotonic_ns()}", clean_session=True)
    pub.publish(topic, bodies, **kw)
    pub.disconnect()


# ------------------------------------------------------------------------------ sdk.md


def test_defaults_host_and_port() -> None:
    """sdk.md `DurableClient(client_id, host="127.0.0.1", port=1883, ...)`; sdk.md
    `client.host` and `client.port` name the address in use."""
    client = DurableClient("blind-defaults")
    assert (client.host, client.port) == ("127.0.0.1", 1883)


def test_port_out_of_range_message_is_as_documented() -> None:
    """sdk.md a bad value raises `ValueError` whose message starts with the option's
    name (`port must be a whole number from 1 to 65535, got 70000`)."""
    with pytest.raises(ValueError) as info:
        DurableClient("blind-port", port=70000)
    assert str(info.value).startswith("port must be a whole number from 1 to 65535, got 70000")


def test_seconds_refuse_a_decimal_as_a_wrong_type_and_take_a_fraction() -> None:
    """sdk.md seconds may be any real number (`int`, `float`, `Fraction`, numpy: a
    `numbers.Real`, which a `Decimal` is not); sdk.md a value of the wrong type raises
    `WrongTypeError`, both a `ValueError` and a `TypeError`."""
    from decimal import Decimal  # noqa: PLC0415
    from fractions import Fraction  # noqa: PLC0415

    DurableClient("blind-frac", session_expiry=Fraction(7, 2), reconnect_min_delay=Fraction(1, 10))
    for option in ("session_expiry", "reconnect_min_delay", "reconnect_max_delay"):
        with pytest.raises(WrongTypeError, match=f"^{option}") as info:
            DurableClient("blind-dec", **{option: Decimal(5)})
        assert isinstance(info.value, TypeError) and isinstance(info.value, ValueError)
    client = DurableClient("blind-dec-timeout")
    with pytest.raises(WrongTypeError, match=r"^timeout"):
        client.subscribe("a/b", timeout=Decimal(5))  # type: ignore[arg-type]


def test_publish_checks_topic_before_the_connection() -> None:
    """sdk.md options and arguments are checked where they are given, before anything is
    sent; sdk.md `topic: '$SYS/x' starts with $: ...`; sdk.md not under `_durable/`:
    the SDK refuses both before anything is sent; sdk.md `publish()` raises `Unconnected` while disconnected."""
    client = DurableClient("blind-pubcheck")
    with pytest.raises(ValueError) as info:
        client.publish("$SYS/x", b"1")
    assert str(info.value).startswith("topic: '$SYS/x' starts with $")
    with pytest.raises(ValueError, match=r"^topic"):
        client.publish("_durable/v1/ctl", b"1")
    with pytest.raises(TypeError):
        client.publish("a/b", 5)  # type: ignore[arg-type]
    with pytest.raises(Unconnected):
        client.publish("a/b", b"ok")


@pytest.mark.parametrize("timeout", [None, 0, -1, float("inf"), float("nan")])
def test_a_timeout_is_finite_above_0_and_none_is_not_one(timeout: Any) -> None:
    """sdk.md every `timeout` a finite number of seconds above 0 ... `None` is not a
    timeout: every wait is bounded (`subscribe`, `publish`, `stream_info`, `connect`, `close`)."""
    client = DurableClient("blind-timeout")
    calls: list[Callable[[], Any]] = [
        lambda: client.subscribe("a/b", timeout=timeout),
        lambda: client.publish("a/b", b"x", timeout=timeout),
        lambda: client.stream_info("#", timeout=timeout),
        lambda: client.connect(timeout=timeout),
        lambda: client.close(timeout=timeout),
    ]
    for call in calls:
        with pytest.raises(ValueError, match=r"^timeout"):
            call()
    assert not client.connected


def test_close_checks_keep_session_before_closing(broker: Broker, made: list[DurableClient]) -> None:
    """sdk.md the flags (... `keep_session`) must be `True` or `False`; sdk.md
    `close(keep_session=...)` is checked before anything is closed."""
    client = new_client(made, broker.port, "blind-close-check")
    client.connect(timeout=WAIT)
    with pytest.raises(ValueError, match=r"^keep_session"):
        client.close(keep_session="yes")  # type: ignore[arg-type]
    assert client.connected


def stream_broker(broker_factory: Callable[..., Broker], **kw: Any) -> Broker:
    return broker_factory(streams=STREAMS, **kw)


def fleet(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_cli("fleet", "--out", str(tmp_path / "fleet-out"), *args, cwd=tmp_path)


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["--ha", "--faults", "broker_kill=1"], "broker_kill"),
        (["--port", "PORT", "--faults", "primary_kill=1"], "primary_kill"),
        (["--port", "PORT", "--faults", "partition=1"], "partition"),
        (["--ha", "--port", "PORT"], "--port"),
        (["--port", "PORT", "--faults", "broker_kill=1"], "broker_kill"),
    ],
)
def test_fleet_refuses_broker_kill_with_ha_and_primary_kill_without(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, args: list[str], named: str
) -> None:
    """fleet.md `broker_kill` is refused with `--ha` (use primary_kill), and primary_kill
    or partition without `--ha`, each with the reason; `--ha` needs `--config` (not `--port`);
    fleet.md with `--port` no broker kills (`broker_kill` in `--faults` is refused, exit status 2);
    fleet.md a bad option stops the run before it starts, with exit status 2. The command's main() in this
    process (a refusal's exit status from a process of its own: test_fleet_ha_with_port_is_refused_it_needs_a_config):
    a child interpreter importing the fleet's Spark and pandas took 2-4 s a refusal."""
    monkeypatch.chdir(tmp_path)
    port = str(free_port())
    status, err = fleet_in_process(tmp_path, capsys, *(port if arg == "PORT" else arg for arg in args))
    assert status == 2, err
    assert named in err, err
    assert not (tmp_path / "out").exists(), "refused before the run"


def test_fleet_refuses_an_out_folder_with_other_things(tmp_path: Path) -> None:
    """fleet.md Output in `--out` (... a folder that holds other things and no earlier run is refused)."""
    out_dir = tmp_path / "fleet-out"
    out_dir.mkdir()
    (out_dir / "mine.txt").write_text("precious")
    out = fleet(tmp_path, "--port", str(free_port()))
    assert out.returncode == 2, out.stdout + out.stderr
    assert (out_dir / "mine.txt").read_text() == "precious"


def test_resubscribing_a_filter_replaces_its_listener(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md `subscribe(topic_filter, ...)`: calling it again for the same filter changes that
    subscription (one listener per filter: the new listener replaces the old); an event goes to the
    listener of every subscription whose filter matches its topic."""
    seen, old, wide = Seen(), Seen(), Seen()
    client = new_client(made, broker.port, "blind-relisten", seen)
    client.subscribe("rl/a", listener=old.on_event)
    client.subscribe("rl/#", listener=wide.on_event)
    client.connect(timeout=WAIT)
    client.subscribe("rl/a", listener=seen.on_event)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    publish(clients, broker.port, "rl/a", [b"x"])
    assert seen.wait(lambda: len(seen.events) == 1) and wide.wait(lambda: len(wide.events) == 1)
    assert old.events == []






def test_a_state_folder_in_use_by_another_process_is_a_persistence_error(broker: Broker, tmp_path: Path) -> None:
    """sdk.md a lock keeps two processes off one folder; sdk.md `PersistenceError` (for
    example a state folder in use by another process)."""
    state = tmp_path / "state"
    script = (
        "import sys\nfrom durable_client import DurableClient\n"
        f"c = DurableClient('blind-lock', '{HOST}', {broker.port}, persistence='disk', state_dir={str(state)!r})\n"
        "c.connect(timeout=15)\nprint('held', flush=True)\nsys.stdin.readline()\nc.close()\n"
    )
    child = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        with pytest.raises(PersistenceError):
            client = DurableClient("blind-lock", HOST, broker.port, persistence="disk", state_dir=str(state))
            try:
                client.connect(timeout=WAIT)
            finally:
                client.close()
    finally:
        assert child.stdin is not None
        child.stdin.write("\n")
        child.stdin.close()
        child.wait(WAIT)


def test_stream_events_update_the_cache_and_carry_log_ids(
    broker_factory: Callable[..., Broker], made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md live events (and stream events) update [the cache]; delivery-log.md for a stream
    event [seq is] the stream log id and epoch 0; protocol.md epoch 0 for stream events."""
    broker = stream_broker(broker_factory)
    seen = Seen()
    client = new_client(made, broker.port, "blind-scache", durable_session=False)
    client.subscribe_stream("telemetry/#", seen.on_event)
    client.connect(timeout=WAIT)
    publish(clients, broker.port, "telemetry/c", [b"v1", b"v2"])
    assert seen.wait(lambda: len(seen.events) == 2)
    assert [(e.seq, e.epoch) for e in seen.events] == [(1, 0), (2, 0)]
    assert client.cache.get("telemetry/c") == b"v2"





@pytest.mark.parametrize(
    ("fault", "field"),
    [
        ("{at: 5s, kind: drop, device: dev-099, for: 1s}", "device"),  # no such device in a fleet of 20
        ("{at: 5s, kind: explode, device: all, for: 1s}", "kind"),
        ("{at: soon, kind: drop, device: all, for: 1s}", "at"),
        ("{at: 5s, kind: drop, device: all, for: 1 fortnight}", "for"),
    ],
)
def test_a_bad_schedule_stops_the_fleet_naming_file_fault_and_field(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], fault: str, field: str
) -> None:
    """fleet.md times like `500ms`, `5s`, `1m30s` or plain seconds; devices are named
    `--prefix` + an index of at least three digits (`dev-000` ...); fleet.md a bad schedule
    ... stops the run before it starts, with exit status 2 and the file, fault number and field named.
    The command's main() in this process (fleet_in_process)."""
    schedule = tmp_path / "sched.yaml"
    schedule.write_text(f"faults:\n  - {{at: 1500ms, kind: drop, device: dev-001, for: 1m30s}}\n  - {fault}\n")
    status, text = fleet_in_process(tmp_path, capsys, "--schedule", str(schedule), "--port", str(free_port()),
                                    "--duration", "3m")
    assert status == 2, text
    assert "sched.yaml" in text and "fault 2" in text and field in text, text
    assert not (tmp_path / "out" / "logs").exists()


def test_ready_before_connect_marker_lists_the_subscriptions(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md Subscriptions, streams and `ready_for_events()` may be called before `connect()`;
    sdk.md the marker carries ... the live subscriptions (`live`, each a `LiveSubscription` with
    `filter`, `qos` and `durable`); sdk.md `unsubscribe()` of an earlier run's subscription
    called while disconnected (the next hello decides). Also after a restart of the client."""
    seen = Seen()
    client = new_client(made, broker.port, "blind-early", seen)
    client.subscribe("a/#", listener=seen.on_event)
    client.subscribe("b/#", listener=seen.on_event)
    client.ready_for_events()
    client.connect(timeout=WAIT)
    assert seen.wait(lambda: len(seen.markers) == 1)
    assert sorted((s.filter, s.durable) for s in seen.markers[0].live) == [("a/#", True), ("b/#", True)]
    client.close(keep_session=True)
    again = Seen()
    client2 = new_client(made, broker.port, "blind-early", again)
    client2.subscribe("a/#", listener=again.on_event)
    client2.subscribe("c/#", listener=again.on_event, durable=False)
    client2.unsubscribe("b/#")
    client2.ready_for_events()
    client2.connect(timeout=WAIT)
    assert again.wait(lambda: len(again.markers) == 1)
    assert sorted((s.filter, s.durable) for s in again.markers[0].live) == [("a/#", True), ("c/#", False)]


def test_a_destroyed_entry_blocks_initial_values_until_the_next_marker_and_reads_count_valid_only(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md a destroyed entry stays destroyed until the next marker, which removes it (a
    delete received after this connection's marker: at the next connection's); `cache.get(topic,
    default=None)` is the value of a valid entry, else `default`; `topic in cache`, `len(cache)` and
    iteration count valid entries only; `entry()` shows any state."""
    publish(clients, broker.port, "t/1", [b"seed"], retain=True)
    seen = Seen()
    client = new_client(made, broker.port, "blind-tomb", seen)
    client.subscribe("t/1", listener=seen.on_event)
    client.connect(timeout=WAIT)
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1 and len(seen.events) == 1)
    assert seen.events[0].retained and client.cache.get("t/1") == b"seed"
    publish(clients, broker.port, "t/1", [b""])  # a live delete (not retained: the seed stays retained)
    assert seen.wait(lambda: len(seen.events) == 2)
    client.subscribe("t/+", listener=seen.on_event, timeout=WAIT)  # the seed comes again as an initial value
    assert seen.wait(lambda: any(e.retained for e in seen.events[2:]))
    entry = client.cache.entry("t/1")
    assert entry is not None and (entry.state, entry.value) == ("destroyed", None)
    assert client.cache.get("t/1", b"none") == b"none"
    assert "t/1" not in client.cache and len(client.cache) == 0 and list(client.cache) == []
    publish(clients, broker.port, "t/2", [b"two"])
    assert seen.wait(lambda: any(e.topic == "t/2" for e in seen.events))
    assert list(client.cache) == ["t/2"] and len(client.cache) == 1
    broker.restart(kill=True)  # the client reconnects: a new marker
    assert seen.wait(lambda: len(seen.markers) == 2)
    assert client.cache.entry("t/1") is None and client.cache.get("t/2") == b"two"


def test_a_stateless_client_keeps_a_destroyed_entry_across_reconnects(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md a destroyed entry stays destroyed until the next marker; a stateless client
    (`durable_session=False`), which gets no marker, keeps its destroyed entries: the retained
    value its re-sent SUBSCRIBE brings after a reconnect does not fill it."""
    publish(clients, broker.port, "t/1", [b"seed"], retain=True)
    seen = Seen()
    client = new_client(made, broker.port, "blind-tomb-stateless", seen, durable_session=False)
    client.subscribe("t/1", listener=seen.on_event)
    client.connect(timeout=WAIT)
    assert seen.wait(lambda: len(seen.events) == 1) and client.cache.get("t/1") == b"seed"
    publish(clients, broker.port, "t/1", [b""])  # a live delete (the seed stays retained)
    assert seen.wait(lambda: len(seen.events) == 2)
    broker.restart(kill=True)
    assert seen.wait(lambda: len(seen.connected) == 2 and len(seen.events) == 3)
    assert seen.events[2].retained and seen.events[2].payload == b"seed"
    entry = client.cache.entry("t/1")
    assert entry is not None and entry.state == "destroyed" and not seen.markers


def test_a_stream_delete_before_the_marker_goes_at_that_marker(
    broker_factory: Callable[..., Broker], made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md a destroyed entry received before this connection's marker (a stream event,
    which is not held) is removed at this connection's marker; sdk.md stream events are not held."""
    broker = stream_broker(broker_factory)
    seen = Seen()
    client = new_client(made, broker.port, "blind-tomb-stream", seen)
    client.subscribe_stream("telemetry/#", seen.on_event)
    client.connect(timeout=WAIT)
    publish(clients, broker.port, "telemetry/a", [b""])
    assert seen.wait(lambda: len(seen.events) == 1)
    entry = client.cache.entry("telemetry/a")
    assert entry is not None and entry.state == "destroyed" and not seen.markers
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    assert client.cache.entry("telemetry/a") is None


def test_the_markers_live_list_leaves_out_refused_and_unsubscribed_filters(
    broker_factory: Callable[..., Broker], made: list[DurableClient]
) -> None:
    """sdk.md the marker's `live` list reflects the connection's SUBSCRIBEs and UNSUBSCRIBEs:
    not the filters refused with 0x80 (here `max_subscriptions_per_client`), nor those unsubscribed;
    a refused subscription stays registered and is sent again after every reconnect, after the
    UNSUBSCRIBEs still due, which the broker applies first (they were sent first)."""
    broker = broker_factory(max_subscriptions_per_client=2)
    seen = Seen()
    client = new_client(made, broker.port, "blind-live-list", seen)
    for topic_filter in ("a/#", "b/#", "c/#"):
        client.subscribe(topic_filter)
    client.ready_for_events()
    client.connect(timeout=WAIT)
    assert seen.wait(lambda: len(seen.markers) == 1)
    assert sorted(s.filter for s in seen.markers[0].live) == ["a/#", "b/#"]
    client.unsubscribe("b/#")
    broker.restart(kill=True)  # the reconnect sends c/# again: now there is room for it
    assert seen.wait(lambda: len(seen.markers) == 2)
    assert sorted(s.filter for s in seen.markers[1].live) == ["a/#", "c/#"]


@pytest.mark.parametrize(("depth", "ok"), [(100, True), (1000, False)])
def test_a_request_nested_too_deeply_is_malformed_with_req_null(
    broker: Broker, clients: Callable[..., Client], depth: int, ok: bool
) -> None:
    """protocol.md `malformed`: JSON nested deeper than the parser allows (a little under 1000
    levels); protocol.md such a request is answered with `op` and `req` null; protocol.md
    the connection stays up."""
    raw = clients(broker.port, "blind-deep")
    body = b'{"v": 1, "op": "hello", "req": 7, "x": ' + b"[" * depth + b"]" * depth + b"}"
    reply = ctl(raw, body)
    if ok:
        assert (reply["ok"], reply["req"]) == (True, 7)
    else:
        assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (False, "malformed", None, None)
    assert ctl(raw, {"v": 1, "op": "hello", "req": 8})["ok"] is True


@pytest.mark.parametrize(
    "request_fields",
    [
        {"op": "hello", "session_expiry": -1},
        {"op": "stream_subscribe", "filter": "telemetry/#", "window": 1001},
        {"op": "stream_subscribe", "filter": "telemetry/#", "window": 0},
        {"op": "stream_subscribe", "filter": "telemetry/#", "after": {"telemetry/a": -1}},
        {"op": "stream_ack", "topic": "telemetry/a", "id": 0},
        {"op": "interest", "filter": ""},
    ],
)
def test_a_field_out_of_its_range_is_malformed_and_changes_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], request_fields: dict[str, Any]
) -> None:
    """protocol.md `malformed`: a field of the wrong type or out of its range (`session_expiry`
    0 or more, `window` 1 to 1000, `after` ids 0 or more, `id` 1 or more, a string field empty);
    protocol.md a refused request changes nothing: the connection stays up."""
    broker = stream_broker(broker_factory)
    raw = clients(broker.port, "blind-range")
    reply = ctl(raw, {"v": 1, "req": 5, **request_fields})
    refusal = (reply["ok"], reply["error"]["code"], reply["req"], reply["op"])
    assert refusal == (False, "malformed", 5, request_fields["op"])
    assert raw.paho.is_connected()
    assert ctl(raw, {"v": 1, "op": "hello", "req": 6})["ok"] is True


def test_a_request_in_another_encoding_than_utf8_is_malformed(broker: Broker, clients: Callable[..., Client]) -> None:
    """protocol.md A request is a JSON object in UTF-8 (no other encoding is read)."""
    raw = clients(broker.port, "blind-utf16")
    reply = ctl(raw, json.dumps({"v": 1, "op": "hello", "req": 1}).encode("utf-16"))
    assert (reply["ok"], reply["error"]["code"]) == (False, "malformed")


def test_subscribe_stream_to_a_filter_no_stream_covers(
    broker_factory: Callable[..., Broker], made: list[DurableClient]
) -> None:
    """streams.md connected, `subscribe_stream` returns at the broker's answer, and a refusal
    raises `ControlRequestFailed` (`unknown_stream` for a filter no configured stream covers) and keeps
    nothing; called before `connect()`, a refusal at the connect is a WARNING (`the broker refused
    'stream_subscribe' ...`)."""
    broker = stream_broker(broker_factory)
    early = new_client(made, broker.port, "blind-nostream-early", durable_session=False)
    early.subscribe_stream("other/#", lambda e: None)
    with LogWatch() as logs:
        early.connect(timeout=WAIT)
        assert logs.wait(lambda m: "the broker refused 'stream_subscribe'" in m and "unknown_stream" in m)
    client = new_client(made, broker.port, "blind-nostream", durable_session=False)
    client.connect(timeout=WAIT)
    with pytest.raises(ControlRequestFailed) as refused:
        client.subscribe_stream("other/#", lambda e: None)
    assert refused.value.code == "unknown_stream" and refused.value.message
    with pytest.raises(ControlRequestFailed):  # nothing was kept: the same call is refused the same way
        client.subscribe_stream("other/#", lambda e: None)


@pytest.mark.parametrize("persistence", ["memory", "disk"])
def test_a_refused_stream_subscribe_keeps_none_of_its_after_positions(
    broker_factory: Callable[..., Broker], made: list[DurableClient], clients: Callable[..., Client],
    tmp_path: Path, persistence: str,
) -> None:
    """streams.md connected, a refusal raises `ControlRequestFailed` and keeps nothing;
    streams.md `after` replaces the client's positions for those topics: a refused call's
    `after` (here over `max_stream_entries_per_client`) leaves them as they were: none for
    telemetry/a (read from id 1), 3 for telemetry/b (read from 4), also after a restart on disk."""
    broker = stream_broker(broker_factory, max_stream_entries_per_client=1)
    publisher = clients(broker.port, "blind-after-pub", clean_session=True)
    publisher.publish("telemetry/a", [b"1", b"2", b"3"])
    publisher.publish("telemetry/b", [b"1", b"2", b"3"])
    options: dict[str, Any] = {"persistence": persistence, "durable_session": False}
    if persistence == "disk":
        options["state_dir"] = str(tmp_path / "state")
    client = new_client(made, broker.port, "blind-after", **options)
    client.connect(timeout=WAIT)
    client.subscribe_stream("telemetry/b", lambda e: None, after={"telemetry/b": 3})  # nothing to read
    client.unsubscribe("telemetry/b")
    client.subscribe_stream("telemetry/c", lambda e: None)  # the one entry allowed
    with pytest.raises(ControlRequestFailed):
        client.subscribe_stream("telemetry/+", lambda e: None, after={"telemetry/a": 2, "telemetry/b": 1})
    client.unsubscribe("telemetry/c")
    if persistence == "disk":
        client.close()
        client = new_client(made, broker.port, "blind-after", **options)
        client.connect(timeout=WAIT)
    seen = Seen()
    client.subscribe_stream("telemetry/+", seen.on_event)
    assert seen.wait(lambda: len(seen.events) == 3)
    publisher.publish("telemetry/b", [b"4"])
    assert seen.wait(lambda: len(seen.events) == 4)
    assert [(e.topic, e.seq) for e in seen.events] == [("telemetry/a", 1), ("telemetry/a", 2), ("telemetry/a", 3),
                                                       ("telemetry/b", 4)]


def test_one_network_thread_calls_every_listener_and_callback_one_at_a_time(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md Threads: `connect()` starts one network thread; it calls every listener and
    callback, one at a time (README.md the listener runs on the client's network thread, in order)."""
    threads: list[tuple[str, int]] = []
    busy = threading.Lock()
    overlapped = threading.Event()
    seen = Seen()

    def record(name: str) -> None:
        if not busy.acquire(blocking=False):
            overlapped.set()
            return
        try:
            threads.append((name, threading.get_ident()))
        finally:
            busy.release()

    def listener(event: Event) -> None:
        record("listener")
        seen.on_event(event)

    client = new_client(
        made, broker.port, "blind-threads", seen,
        on_connected=lambda info: (record("on_connected"), seen.on_connected(info)),
        on_live=lambda marker: (record("on_live"), seen.on_live(marker)),
        on_disconnected=lambda reason: (record("on_disconnected"), seen.on_disconnected(reason)),
    )
    client.subscribe("thr/#", listener=listener)
    client.connect(timeout=WAIT)
    publish(clients, broker.port, "thr/a", [b"1", b"2"])
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.events) == 2 and len(seen.markers) == 1)
    broker.restart(kill=True)
    assert seen.wait(lambda: len(seen.disconnected) == 1 and len(seen.connected) == 2)
    assert {name for name, _ in threads} == {"listener", "on_connected", "on_live", "on_disconnected"}
    assert len({ident for _, ident in threads}) == 1 and threads[0][1] != threading.get_ident()
    assert not overlapped.is_set()


def test_a_cpl2_client_with_a_delivery_log_resumes_a_stream_after_the_logs_last_receive(
    broker_factory: Callable[..., Broker], made: list[DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """delivery-log.md a `DurableClient` created with both [`persistence="disk"` and a delivery
    log] reads the last 64 KiB of its existing log before it connects and takes the last `receive`
    records of its own client id: ... the device's very last `receive`, when it is a stream event,
    moves that topic's position forward; delivery-log.md for a stream event [seq is] the stream
    log id and epoch 0."""
    broker = stream_broker(broker_factory)
    log = tmp_path / "reader.jsonl"
    state = str(tmp_path / "state")
    publish(clients, broker.port, "telemetry/r", [f"e{i}".encode() for i in range(1, 4)])
    first = Seen()
    c1 = new_client(made, broker.port, "blind-logresume", durable_session=False, persistence="disk",
                    state_dir=state, delivery_log=str(log))
    c1.subscribe_stream("telemetry/#", first.on_event)
    c1.connect(timeout=WAIT)
    assert first.wait(lambda: len(first.events) == 3)
    c1.close()
    receives = [json.loads(line) for line in log.read_text().splitlines() if '"receive"' in line]
    assert [(r["topic"], r["seq"], r["epoch"]) for r in receives] == [("telemetry/r", i, 0) for i in (1, 2, 3)]
    publish(clients, broker.port, "telemetry/r", [f"e{i}".encode() for i in range(4, 7)])
    # A process killed after its listener returned for id 5, its record written, its mark not yet:
    with log.open("a") as out:
        out.write(json.dumps({**receives[-1], "seq": 4, "time": time.time()}) + "\n")
        out.write(json.dumps({**receives[-1], "seq": 5, "time": time.time()}) + "\n")
    second = Seen()
    c2 = new_client(made, broker.port, "blind-logresume", durable_session=False, persistence="disk",
                    state_dir=state, delivery_log=str(log))
    c2.subscribe_stream("telemetry/#", second.on_event)
    c2.connect(timeout=WAIT)
    assert second.wait(lambda: len(second.events) >= 1)
    c2.close()
    assert [(e.seq, e.payload) for e in second.events] == [(6, b"e6")]


def test_the_async_clients_coroutines_and_shared_attributes() -> None:
    """sdk.md `subscribe`, `subscribe_stream`, `unsubscribe`, `publish`, `stream_info`,
    `connect` and `close(keep_session=...)` are coroutines; `ready_for_events()` and `live()` are
    coroutines too, `events()` is not; `cache`, `stats`, `connected` and `persistence_level` are
    the threaded client's."""
    import inspect  # noqa: PLC0415

    from durable_client import AsyncDurableClient  # noqa: PLC0415

    for name in ("subscribe", "subscribe_stream", "unsubscribe", "publish", "stream_info", "connect", "close",
                 "ready_for_events", "live"):
        assert inspect.iscoroutinefunction(getattr(AsyncDurableClient, name)), name
    assert not inspect.iscoroutinefunction(AsyncDurableClient.events)
    client = AsyncDurableClient("blind-async-attrs", HOST, free_port())
    assert client.connected is False and client.persistence_level == "memory"
    assert client.cache.get("x") is None and client.stats is not None


def test_the_hold_keeps_the_sessions_messages_not_stream_events(
    broker_factory: Callable[..., Broker], made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md after (re)connecting the broker sends none of the session's messages until
    `ready_for_events()` (stream events of `subscribe_stream` are not held); sdk.md events that
    arrived between its SUBSCRIBE and `ready_for_events()` count as replayed."""
    broker = stream_broker(broker_factory)
    publish(clients, broker.port, "telemetry/h", [b"s1"])
    seen = Seen()
    client = new_client(made, broker.port, "blind-hold-streams", seen)
    client.subscribe("q/#", listener=seen.on_event)
    client.subscribe_stream("telemetry/#", seen.on_event)
    client.connect(timeout=WAIT)
    publish(clients, broker.port, "q/a", [b"q1"])
    assert seen.wait(lambda: [e.payload for e in seen.events] == [b"s1"])  # the stream, not the held queue
    publish(clients, broker.port, "telemetry/h", [b"s2"])
    assert seen.wait(lambda: len(seen.events) == 2)
    assert [e.payload for e in seen.events] == [b"s1", b"s2"] and not seen.markers
    client.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1 and len(seen.events) == 3)
    assert seen.events[2].payload == b"q1" and seen.events[2].replayed and seen.markers[0].replayed == 1


@pytest.mark.parametrize("qos", [1, 2])
def test_a_control_request_at_qos_1_or_2_is_acknowledged_and_answered(
    broker: Broker, clients: Callable[..., Client], qos: int
) -> None:
    """protocol.md `_durable/v1/ctl` ... QoS 0 (QoS 1 and 2 are accepted, but a retransmitted
    request is handled again); protocol.md the PUBACK (or PUBREC) of a request sent at QoS 1
    or 2 says it was received."""
    raw = clients(broker.port, f"blind-ctl-qos{qos}")
    seen = sum(1 for m in raw.wait_messages(0) if m.topic == REPLY)
    info = raw.paho.publish(CTL, json.dumps({"v": 1, "op": "hello", "req": 11}).encode(), qos=qos)
    info.wait_for_publish(WAIT)
    assert info.is_published()
    assert raw.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY) > seen)
    reply = json.loads([m.payload for m in raw.messages if m.topic == REPLY][seen])
    assert (reply["op"], reply["req"], reply["ok"]) == ("hello", 11, True)


def test_a_str_payload_is_sent_as_utf8_and_one_that_cannot_be_is_a_value_error_naming_it(
    broker: Broker, made: list[DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md a bad value raises `ValueError` whose message starts with the option's or
    argument's name; sdk.md a payload that is neither `bytes` nor `str` is a `TypeError` (so a
    `str` is a payload: sent as UTF-8, as the password is; a lone surrogate cannot be)."""
    receiver = clients(broker.port, "blind-str-rx", clean_session=True)
    receiver.subscribe("str/#", 1)
    client = new_client(made, broker.port, "blind-str", durable_session=False)
    client.connect(timeout=WAIT)
    client.publish("str/a", "grüße")
    assert receiver.wait_for(lambda ms: len(ms) == 1) and receiver.messages[0].payload == "grüße".encode()
    with pytest.raises(ValueError, match=r"^payload") as refused:
        client.publish("str/a", "bad \ud800")
    assert not isinstance(refused.value, UnicodeError)
    assert client.connected


@pytest.mark.parametrize(
    ("named", "call"),
    [
        ("host", lambda: DurableClient("c", host="h\ud800")),
        ("failover host", lambda: DurableClient("c", failover=[("h\ud800", 1884)])),
        ("state_dir", lambda: DurableClient("c", persistence="disk", state_dir="/tmp/\ud800")),
        ("delivery_log", lambda: DurableClient("c", delivery_log="/tmp/\ud800.jsonl")),
        ("after", lambda: DurableClient("c").subscribe_stream("t/#", print, after={"t/\ud800": 1})),
        ("after", lambda: DurableClient("c").subscribe_stream("t/#", print, after={"t/a\x00": 1})),
    ],
)
def test_a_string_no_encoding_can_carry_is_a_value_error_naming_the_option(named: str, call: Callable[[], Any]) -> None:
    """sdk.md a bad value raises `ValueError` whose message starts with the option's or
    argument's name; sdk.md `host` a host name or an IP address; streams.md `after` a
    dict of topics ... (else `ValueError`). A lone surrogate names no host, file or topic."""
    with pytest.raises(ValueError, match=f"^{named}") as refused:
        call()
    assert not isinstance(refused.value, UnicodeError), refused.value
