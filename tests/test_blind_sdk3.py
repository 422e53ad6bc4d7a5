"""A third pass of black-box tests written from README.md and docs/ alone (sdk.md, delivery-log.md,
streams.md), for promises test_blind_sdk.py, test_blind_sdk2.py and the docs-promises files leave out:
each test quotes the promise it checks (by its words, not a line number) and runs it against real
brokers (SIGKILLed where the promise is about a crash), real SDK and paho clients over TCP to 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import json
import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from raw_mqtt_helpers import read_packet
from test_blind_sdk import Seen
from test_sdk import Recorder

from amqtt_durable.process import free_port
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, seen_away
from durable_client import (
    AsyncDurableClient,
    DurableClient,
    Event,
    Marker,
    RequestTimeout,
    Unconnected,
    WrongTypeError,
)

pytestmark = pytest.mark.timeout(60)


def records(log: Path, kind: str) -> list[dict[str, Any]]:
    """The delivery log's records of one kind, in order."""
    lines = log.read_text(encoding="utf-8").splitlines()
    return [record for record in map(json.loads, lines) if record["kind"] == kind]


# ------------------------------------------------------------------------------ sdk.md: Bad input


@pytest.mark.parametrize(
    ("option", "value", "wrong_type"),
    [
        ("fsync_batch", 0, False),
        ("fsync_batch", 65536, False),
        ("fsync_batch", True, True),
        ("fsync_batch", 64.0, True),
        ("fsync_delay_ms", -0.1, False),
        ("fsync_delay_ms", 1000.5, False),
        ("fsync_delay_ms", float("nan"), False),
        ("fsync_delay_ms", float("inf"), False),
        ("fsync_delay_ms", "5", True),
    ],
)
def test_fsync_options_out_of_range_are_refused_also_with_cpl1(option: str, value: object, wrong_type: bool) -> None:
    """sdk.md, CPL-2: "`fsync_batch` is a whole number from 1 to 65535 ..., `fsync_delay_ms` a finite number
    from 0 to 1000; anything else raises `ValueError` naming the option (also with CPL-1, which ignores both)";
    Bad input: "A value of the wrong *type* raises `WrongTypeError`, which is both a `ValueError` and a
    `TypeError`"; whole numbers not `True`/`False`."""
    with pytest.raises(ValueError, match=rf"^{option}\b") as refused:
        DurableClient("fsync-options", persistence="memory", **{option: value})
    assert isinstance(refused.value, TypeError) == wrong_type, repr(refused.value)
    assert isinstance(refused.value, WrongTypeError) == wrong_type


def test_fsync_options_take_their_bounds_and_the_defaults_are_64_and_5() -> None:
    """sdk.md: "`DurableClient(..., fsync_batch=64, fsync_delay_ms=5.0)`: `fsync_batch` is a whole number from 1
    to 65535 ..., `fsync_delay_ms` a finite number from 0 to 1000" (the bounds included)."""
    defaults = inspect.signature(DurableClient).parameters
    assert (defaults["fsync_batch"].default, defaults["fsync_delay_ms"].default) == (64, 5.0)
    for batch, delay in ((1, 0), (65535, 1000), (1, 1000.0)):
        DurableClient("fsync-bounds", fsync_batch=batch, fsync_delay_ms=delay)


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"reconnect_min_delay": 2.0, "reconnect_max_delay": 1.0}, "reconnect_max_delay"),
        ({"persistence": "Disk", "state_dir": "state"}, "persistence"),
        ({"persistence": "disk"}, "persistence"),  # "disk" needs state_dir
    ],
)
def test_option_combinations_the_page_refuses_name_the_option(options: dict[str, Any], named: str) -> None:
    """sdk.md, Bad input: "`reconnect_min_delay` and `reconnect_max_delay` finite numbers of seconds above 0,
    the maximum at least the minimum"; "`persistence` `"memory"` or `"disk"` (`"disk"` needs `state_dir`)";
    "a bad value raises `ValueError` whose message starts with the option's or argument's name"."""
    with pytest.raises(ValueError, match=rf"^{named}\b"):
        DurableClient("combination", **options)
    # the maximum equal to the minimum is "at least the minimum"
    DurableClient("combination", reconnect_min_delay=1.5, reconnect_max_delay=1.5)


# ------------------------------------------------------------------ sdk.md: subscriptions, closing


def test_subscribing_a_held_filter_again_changes_its_durability_on_the_broker_and_in_the_log(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path,
) -> None:
    """sdk.md: "calling it again for a filter it holds changes that subscription's QoS, durability and
    listener"; "`durable=False` ... is dropped by the broker when the connection ends, so nothing is queued for
    it while away". delivery-log.md: a `subscribe` record's `durable` says "a durable subscription (false:
    non-durable, ends with the connection ...)"; "A `subscribe` is written when the broker confirms it (SUBACK)";
    one that "changes only a subscription's durability ... sends no SUBSCRIBE: its `subscribe` record, with the
    new `durable`, is written when the broker confirms the change (its `interest` reply), before `subscribe()`
    returns (the audit's window closes or opens there)": before a
    publish the broker rightly does not queue. From a listener (which cannot wait for a SUBACK), a new filter
    made non-durable while its SUBSCRIBE waits for its SUBACK gets one record, the non-durable one, written
    as the change is sent (delivery-log.md: that SUBACK writes no second one)."""
    broker = broker_factory(metrics_interval=0.1)
    log = tmp_path / "device.jsonl"
    seen = Seen()
    in_listener: list[list[str]] = []
    listened = threading.Event()

    def subscribe_twice(event: Event) -> None:
        device.subscribe("chg/from-listener", qos=1, durable=True, listener=seen.on_event)
        device.subscribe("chg/from-listener", qos=1, durable=False, listener=seen.on_event)
        in_listener.append([r["topic"] for r in records(log, "subscribe")])  # no SUBACK yet: this thread reads it
        listened.set()

    device = sdk(broker.port, "changer", on_live=seen.on_live, delivery_log=log)
    device.subscribe("chg/made-non-durable", qos=1, durable=True, listener=seen.on_event)
    device.subscribe("chg/made-durable", qos=1, durable=False, listener=seen.on_event)
    device.subscribe("chg/trigger", qos=1, durable=False, listener=subscribe_twice)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    publisher = clients(broker.port, "chg-pub", clean_session=True)
    publisher.publish("chg/trigger", [b"subscribe from the listener"])
    assert listened.wait(WAIT)
    # A new filter's SUBACK after the listener's: the SUBACKs come in order, so the listener's is handled first.
    device.subscribe("chg/after", qos=1, durable=False)
    assert len(in_listener) == 1 and in_listener[0][-1] == "chg/from-listener", in_listener  # written as sent
    device.subscribe("chg/made-non-durable", qos=1, durable=False, listener=seen.on_event)
    device.subscribe("chg/made-durable", qos=1, durable=True, listener=seen.on_event)
    device.close(keep_session=True)
    seen_away(clients, broker, 1)

    before_publish = time.time()
    publisher.publish("chg/made-non-durable", [b"not queued"])
    publisher.publish("chg/from-listener", [b"not queued either"])
    publisher.publish("chg/made-durable", [b"queued"])
    again = Seen()
    back = sdk(broker.port, "changer", on_live=again.on_live)
    back.subscribe("chg/#", qos=1, durable=False, listener=again.on_event)
    back.connect(timeout=WAIT)
    back.ready_for_events()
    assert again.wait(lambda: len(again.markers) == 1)
    assert [(e.topic, e.payload, e.replayed) for e in again.events] == [("chg/made-durable", b"queued", True)]
    assert again.markers[0].replayed == 1

    subscribes = records(log, "subscribe")
    assert [(r["topic"], r["qos"], r["durable"]) for r in subscribes] == [
        ("chg/made-non-durable", 1, True), ("chg/made-durable", 1, False), ("chg/trigger", 1, False),
        ("chg/from-listener", 1, False), ("chg/after", 1, False),
        ("chg/made-non-durable", 1, False), ("chg/made-durable", 1, True),
    ], subscribes
    made_non_durable = subscribes[5]
    assert made_non_durable["time"] < before_publish, (made_non_durable, before_publish)


def test_close_with_a_timeout_from_another_thread_returns_and_the_listener_s_event_is_acknowledged_later(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: "The event being processed when `close()` is called finishes (each of its listeners runs) and is
    acknowledged before the DISCONNECT; no later event is processed: those still arriving are left
    unacknowledged, so a durable session's next connection gets them"; "From another thread,
    `close(timeout=...)` waits up to `timeout` for the listener running; if it returns first, the network
    thread (a daemon thread) sends the PUBACK and the DISCONNECT later"."""
    entered, release = threading.Event(), threading.Event()
    processed: list[bytes] = []

    def slow(event: Event) -> None:
        entered.set()
        assert release.wait(WAIT)
        processed.append(event.payload)

    disconnected = threading.Event()
    device = sdk(broker.port, "slow-closer", on_disconnected=lambda reason: disconnected.set())
    device.subscribe("slow/t", qos=1, listener=slow)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    clients(broker.port, "slow-pub", clean_session=True).publish("slow/t", [b"first", b"second"])
    assert entered.wait(WAIT)
    started = time.monotonic()
    device.close(timeout=0.3)
    took = time.monotonic() - started
    assert 0.25 <= took < 0.3 + 2.0, took  # waited up to its timeout for the listener, no longer
    assert not disconnected.is_set(), "the DISCONNECT goes only after the listener returned"
    release.set()
    assert disconnected.wait(WAIT), "the network thread sends the PUBACK and the DISCONNECT later"
    assert processed == [b"first"], "no later event is processed"

    seen = Seen()
    back = sdk(broker.port, "slow-closer", on_live=seen.on_live)
    back.subscribe("slow/t", qos=1, listener=seen.on_event)
    back.connect(timeout=WAIT)
    back.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    assert [e.payload for e in seen.events] == [b"second"], "first was acknowledged; second comes again"
    assert seen.markers[0].replayed == 1


# --------------------------------------------------------------- sdk.md: reconnection, a broker crash


def test_across_a_broker_sigkill_the_callbacks_come_in_order_with_one_marker_per_connection(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: "Reconnection is automatic"; "`connect()` starts one network thread; it calls every listener and
    callback, one at a time": `on_connected(info)` (`session_present`, `epoch`), `on_disconnected(reason)`, and
    the marker "(`on_live(marker)`, ..., once per marker)" that `ready_for_events()`, which "the client repeats
    ... after every reconnect", brings on each connection; sequence ids increase "along the delivery order"
    within the session's epoch and dedup gives each event once. (A broker stopped cleanly:
    test_docs_promises_sdk_input; here it is SIGKILLed.)"""
    order: list[tuple[str, Any]] = []
    cond = threading.Condition()

    def note(what: str) -> Callable[[Any], None]:
        def callback(arg: Any) -> None:
            with cond:
                order.append((what, arg))
                cond.notify_all()
        return callback

    recorder = Recorder()
    device = sdk(broker.port, "crash-watcher", on_connected=note("connected"), on_disconnected=note("disconnected"),
                 on_live=note("live"))
    device.subscribe("crash/t", qos=1, listener=recorder)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    clients(broker.port, "crash-pub-1", clean_session=True).publish("crash/t", payloads(3, "before"))
    recorder.wait(3)
    broker.kill()  # SIGKILL
    broker.start()
    with cond:
        assert cond.wait_for(lambda: [what for what, _ in order].count("live") == 2, WAIT), order
    assert [what for what, _ in order] == ["connected", "live", "disconnected", "connected", "live"], order
    first, first_marker, _, second, second_marker = (arg for _, arg in order)
    assert (first.session_present, second.session_present) == (False, True)
    assert first.epoch == second.epoch == first_marker.epoch == second_marker.epoch
    assert [s.filter for s in second_marker.live] == ["crash/t"]

    clients(broker.port, "crash-pub-2", clean_session=True).publish("crash/t", payloads(3, "after"))
    events = recorder.wait(6)
    assert [e.payload for e in events] == payloads(3, "before") + payloads(3, "after")
    seqs = [e.seq for e in events]
    assert seqs == sorted(seqs) and len(set(seqs)) == 6
    assert {e.epoch for e in events} == {first.epoch}


# ------------------------------------------------------------------------------ sdk.md: asyncio


def test_the_async_clients_requests_are_bounded_by_request_timeout_and_its_callbacks_run_on_the_network_thread(
    broker_factory: Callable[..., Broker],
) -> None:
    """sdk.md, asyncio: "`subscribe`, `subscribe_stream`, `unsubscribe`, `publish`, `stream_info`, `connect` and
    `close(keep_session=...)` are coroutines; their blocking parts run in a worker thread, each bounded by
    `request_timeout` (10 s), so none takes a `timeout`"; "Every other keyword option is `DurableClient`'s
    (..., callbacks other than `on_live`, which still run on the network thread)"; waits raise
    `RequestTimeout`, and the client is usable once the broker answers again."""

    assert inspect.signature(AsyncDurableClient).parameters["request_timeout"].default == 10
    broker = broker_factory(streams=[{"filter": "telemetry/#", "max_count": 10, "max_age": 0}])
    callback_threads: list[threading.Thread] = []

    async def main() -> dict[str, float]:
        took: dict[str, float] = {}
        async with AsyncDurableClient(
            "async-bounded", port=broker.port, request_timeout=0.5, reconnect_min_delay=0.05,
            reconnect_max_delay=0.5, on_connected=lambda info: callback_threads.append(threading.current_thread()),
        ) as client:
            calls = {
                "subscribe": lambda: client.subscribe("bounded/t"),
                "publish": lambda: client.publish("bounded/t", b"late", qos=1),
                "stream_info": lambda: client.stream_info("telemetry/#"),
                "subscribe_stream": lambda: client.subscribe_stream("telemetry/#"),
            }
            with broker.paused():
                for name, call in calls.items():
                    began = time.monotonic()
                    with pytest.raises(RequestTimeout):
                        await call()
                    took[name] = time.monotonic() - began
            await client.publish("bounded/t", b"answered again", qos=1)
            assert threading.current_thread() not in callback_threads
        return took

    took = asyncio.run(main())
    assert all(0.45 <= seconds < 0.5 + 2.0 for seconds in took.values()), took
    assert callback_threads and all(thread is callback_threads[0] for thread in callback_threads)


# ------------------------------------------------------ sdk.md: a broker whose hello reply lacks a field


class OlderBroker:
    """A relay on 127.0.0.1 in front of a real broker that takes ``dropped`` out of every hello reply (a
    PUBLISH to $durable/v1/reply whose JSON has `protocol`), as a broker of an older version would answer,
    and notes the packets the client sends: (packet type, body length), in order."""

    def __init__(self, broker_port: int, dropped: str) -> None:
        self.broker_port, self.dropped = broker_port, dropped
        self.port = free_port()
        self.sent: list[tuple[int, int]] = []
        self.cond = threading.Condition()
        self.sockets: list[socket.socket] = []
        self.listener = socket.create_server((HOST, self.port))
        self.accepting = threading.Thread(target=self._accept, daemon=True)
        self.accepting.start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection((HOST, self.broker_port))
            self.sockets += [client, upstream]
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, source: socket.socket, target: socket.socket, from_broker: bool) -> None:
        while True:
            try:
                first, body = read_packet(source)
            except (OSError, AssertionError):  # AssertionError: read_exactly's "connection closed"
                break
            if from_broker and first >> 4 == 3:
                body = self._rewrite(first, body)
            elif not from_broker:
                with self.cond:
                    self.sent.append((first >> 4, len(body)))
                    self.cond.notify_all()
            try:
                target.sendall(mqtt_packet(first, body))
            except OSError:
                break
        for sock in (source, target):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _rewrite(self, first: int, body: bytes) -> bytes:
        size = int.from_bytes(body[:2], "big")
        topic, rest = body[2:2 + size], body[2 + size:]
        if topic != b"$durable/v1/reply" or first & 0x06:  # replies are QoS 0: no packet id
            return body
        reply = json.loads(rest)
        if "protocol" in reply:
            reply.pop(self.dropped, None)
        return mqtt_string(topic) + json.dumps(reply).encode()

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)  # wakes the accept thread: it ends
        self.listener.close()
        self.accepting.join(WAIT)
        for sock in self.sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()


def test_against_a_hello_reply_without_max_packet_size_nothing_is_checked(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: a payload "no larger than the broker's `max_packet_size` lets a PUBLISH be (...; the broker's
    hello reply says it ...)"; "Against a broker whose hello reply has no `max_packet_size` (an older one)
    nothing is checked, neither here nor in the SDK's own requests." The same publish through a reply that
    says it is refused with `ValueError` (test_blind_sdk2 pins that message)."""
    broker = broker_factory(max_packet_size=4096)
    big = b"x" * 5000
    told = sdk(broker.port, "told-the-limit")
    told.connect(timeout=WAIT)
    with pytest.raises(ValueError, match=r"^payload"):
        told.publish("big/t", big, qos=0)

    older = OlderBroker(broker.port, "max_packet_size")
    try:
        dropped = threading.Event()
        device = sdk(older.port, "not-told", on_disconnected=lambda reason: dropped.set())
        device.connect(timeout=WAIT)
        device.publish("big/t", big, qos=0)  # not refused: the SDK does not know the limit
        assert dropped.wait(WAIT), "the broker closed the connection for the packet's size"
        with older.cond:
            assert any(kind == 3 and size >= len(big) for kind, size in older.sent), older.sent  # it went out
    finally:
        older.close()


@pytest.mark.parametrize("dropped", [None, "subscriptions"])
def test_a_filter_nobody_holds_is_unsubscribed_only_from_a_broker_whose_hello_reply_has_no_list(
    broker: Broker, sdk: Callable[..., DurableClient], dropped: str | None
) -> None:
    """sdk.md: "of a filter neither this run nor the broker's session holds it sends nothing (a broker whose
    hello reply has no `subscriptions` list gets the UNSUBSCRIBE)"; "`unsubscribe(topic_filter)` (no
    `timeout`) returns once the UNSUBSCRIBE is sent"."""
    older = OlderBroker(broker.port, dropped or "no-such-field")
    try:
        markers: list[Marker] = []
        live = threading.Event()
        device = sdk(older.port, f"unsub-{dropped}", on_live=lambda marker: (markers.append(marker), live.set()))
        device.connect(timeout=WAIT)
        device.ready_for_events()
        assert live.wait(WAIT)
        device.unsubscribe("never/held")
        device.publish("sync/t", b"after the unsubscribe", qos=1)  # its PUBACK: what went before has passed
        with older.cond:
            unsubscribes = [kind for kind, _ in older.sent].count(10)
        assert unsubscribes == (1 if dropped else 0), older.sent
    finally:
        older.close()


def test_close_without_keep_session_while_disconnected_closes_the_client_and_raises_unconnected(
    broker: Broker, sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """sdk.md: "`close(keep_session=False)` removes it on the broker at once ... The client is closed either
    way: a session that could not be ended raises afterwards, `Unconnected` when called while disconnected
    ... and the broker then keeps it, queueing, until it expires (the delivery log gets no `session_end`)";
    "a closed client raises `Unconnected`" at `connect()`."""
    log = tmp_path / "log.jsonl"
    seen = Seen()
    device = sdk(broker.port, "ends-while-away", on_live=seen.on_live, on_disconnected=seen.on_disconnected,
                 delivery_log=log)
    device.subscribe("away/t", qos=1, listener=seen.on_event)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert seen.wait(lambda: len(seen.markers) == 1)
    broker.kill()  # SIGKILL
    assert seen.wait(lambda: len(seen.disconnected) == 1)
    with pytest.raises(Unconnected):
        device.close(keep_session=False)
    with pytest.raises(Unconnected):
        device.connect(timeout=1)
    assert not records(log, "session_end")

    broker.start()
    clients(broker.port, "away-pub", clean_session=True).publish("away/t", [b"queued for the kept session"])
    again = Seen()
    back = sdk(broker.port, "ends-while-away", on_live=again.on_live, on_connected=again.on_connected)
    back.subscribe("away/t", qos=1, listener=again.on_event)
    back.connect(timeout=WAIT)
    back.ready_for_events()
    assert again.wait(lambda: len(again.markers) == 1)
    assert again.connected[0].session_present
    assert [e.payload for e in again.events] == [b"queued for the kept session"]


def test_close_without_keep_session_that_gets_no_reply_closes_the_client_and_raises_request_timeout(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """sdk.md: "The client is closed either way: a session that could not be ended raises afterwards, ...
    `RequestTimeout` when no reply came within `timeout` ..., and then the session may or may not have been
    ended. In each of these cases the delivery log gets no `session_end`". Against a broker that answers
    nothing."""
    log = tmp_path / "log.jsonl"
    device = sdk(broker.port, "ends-unanswered", delivery_log=log)
    device.subscribe("unanswered/t", qos=1)
    device.connect(timeout=WAIT)
    with broker.paused():
        started = time.monotonic()
        with pytest.raises(RequestTimeout):
            device.close(keep_session=False, timeout=0.3)
        assert time.monotonic() - started < 0.3 + 2.0
    with pytest.raises(Unconnected):
        device.connect(timeout=1)
    assert not records(log, "session_end")


def test_a_subscribe_that_sends_no_subscribe_returns_at_its_interest_reply_or_at_once(
    broker: Broker, sdk: Callable[..., DurableClient]
) -> None:
    """sdk.md: "Connected, `subscribe()` returns at the SUBACK; when it sends no SUBSCRIBE, at the broker's
    `interest` reply if only the durability of a filter it holds changes ..., or at once if only the listener
    does; `RequestTimeout` after `timeout` without that SUBACK or reply"; "a SUBSCRIBE goes out again only for a
    new QoS". Against a broker that answers nothing."""
    device = sdk(broker.port, "no-suback-needed")
    device.subscribe("held/t", qos=1)
    device.connect(timeout=WAIT)
    with broker.paused():
        with pytest.raises(RequestTimeout):
            device.subscribe("held/t", qos=1, durable=False, timeout=0.3)  # an interest: waits for its reply
        device.subscribe("held/t", qos=1, durable=False, listener=print, timeout=0.3)
        with pytest.raises(RequestTimeout):
            device.subscribe("held/t", qos=0, durable=False, timeout=0.3)  # a new QoS: a SUBSCRIBE


# ------------------------------------------------------------------------------ sdk.md: several addresses


def test_a_client_moves_on_to_the_next_address_when_its_broker_dies_and_is_told_the_session_is_not_there(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client]
) -> None:
    """sdk.md: "`failover=[(host, port), ...]`: ... A connection that fails ... moves the client on to the next
    address, round the list"; "`client.host` and `client.port` name the address in use (or being tried)";
    "`on_session_lost()` when the broker no longer has a session the client had (...): the client then starts
    as new (GemFire), subscribes again and resets its marks". Two brokers that share nothing (not a replication
    group): the first address is down at `connect()`, the second is SIGKILLed once the client is on it. What
    this adds to the other failover tests (test_blind_ha and test_hostile_door_limits: CONNACK 3 moves the
    client; test_ha_brokers: a replicated pair, whose session survives; test_blind_sdk2: a session deleted by a
    clean connect): a refused connection and a SIGKILLed broker move it on, `client.host`/`client.port` follow,
    and `on_session_lost` comes from a broker that never had the session, whose low sequence ids the reset
    marks do not drop as duplicates."""
    first = broker_factory(start=False, name="first")
    second = broker_factory(name="second")
    seen = Seen()
    lost = threading.Event()
    device = sdk(first.port, "roamer", failover=[(HOST, second.port)], on_live=seen.on_live,
                 on_connected=seen.on_connected, on_session_lost=lost.set)
    device.subscribe("roam/t", qos=1, listener=seen.on_event)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert device.port == second.port and seen.wait(lambda: len(seen.markers) == 1)
    clients(second.port, "roam-pub-2", clean_session=True).publish("roam/t", [b"on the second"])
    assert seen.wait(lambda: len(seen.events) == 1)

    first.start()
    second.kill()  # SIGKILL
    assert lost.wait(WAIT), "the first broker never had the session"
    assert seen.wait(lambda: len(seen.markers) == 2)
    assert (device.host, device.port) == (HOST, first.port)
    assert not seen.connected[1].session_present
    assert [s.filter for s in seen.markers[1].live] == ["roam/t"], "subscribed again"
    clients(first.port, "roam-pub-1", clean_session=True).publish("roam/t", [b"on the first"])
    assert seen.wait(lambda: len(seen.events) == 2)
    assert [e.payload for e in seen.events] == [b"on the second", b"on the first"], "marks reset: not dropped"
