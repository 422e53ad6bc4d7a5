"""The delivery log's record of a change of durability only (docs/delivery-log.md): written when the
broker's `interest` reply confirms it, not when it is sent. A real broker, the real SDK client, and either
the fleet's fault proxy (durable_fleet.proxy.FaultProxy) stalling, then cutting, the link between the two,
or a PacketRelay (tests/packet_relay.py) that sees each packet, holds one way's, or spoils a request: the
tests wait on what the broker or the client is sent, never on paho's log lines."""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from packet_relay import Packet, PacketRelay
from test_hostile_wire import wait_until

from conftest import HOST, WAIT, Broker, Client, seen_away
from durable_client import ConnectionInfo, DurableClient, Event, Marker, RequestTimeout
from durable_fleet.proxy import FaultProxy

pytestmark = pytest.mark.timeout(120)


def records(log: Path, topic_filter: str) -> list[dict[str, Any]]:
    """The log's records of ``topic_filter``, in order."""
    found = [json.loads(line) for line in log.read_text(encoding="utf-8").splitlines() if line.strip()]
    return [r for r in found if r.get("topic") == topic_filter]


def subscribes(log: Path, topic_filter: str) -> list[dict[str, Any]]:
    """The log's `subscribe` records of ``topic_filter``, in order."""
    return [r for r in records(log, topic_filter) if r["kind"] == "subscribe"]


class Connections:
    """on_connected / on_disconnected callbacks that count, and a wait on the counts."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.up = 0
        self.down = 0

    def connected(self, _info: ConnectionInfo) -> None:
        with self.cond:
            self.up += 1
            self.cond.notify_all()

    def disconnected(self, _reason: str) -> None:
        with self.cond:
            self.down += 1
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool]) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, WAIT)


class Lives:
    """An on_live callback that counts the markers (one per connection once its SUBACKs came, after
    ready_for_events()), and a wait on the count."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.markers: list[Marker] = []

    def on_live(self, marker: Marker) -> None:
        with self.cond:
            self.markers.append(marker)
            self.cond.notify_all()

    def wait(self, count: int) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.markers) == count, WAIT)


def live_device(
    sdk: Callable[..., DurableClient], port: int, client_id: str, log: Path
) -> tuple[DurableClient, Lives]:
    """A device on ``port`` writing its delivery log to ``log``, connected, ready_for_events() called and its
    first marker come (its SUBACKs did), and its Lives."""
    lives = Lives()
    device = sdk(port, client_id, delivery_log=log, on_live=lives.on_live)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert lives.wait(1), "no marker"
    return device, lives


@pytest.fixture
def proxied(broker_factory: Callable[..., Broker]) -> Iterator[Callable[..., tuple[Broker, FaultProxy, int]]]:
    """Start a broker (``broker_factory``'s keywords) and a FaultProxy in front of it: (the broker, the
    proxy, the proxy's port); the proxy is stopped at the test's end."""
    proxies: list[FaultProxy] = []

    def start(**broker_options: Any) -> tuple[Broker, FaultProxy, int]:
        broker = broker_factory(**broker_options)
        proxy = FaultProxy(HOST, broker.port)
        proxies.append(proxy)
        return broker, proxy, proxy.start()

    yield start
    for proxy in proxies:
        with contextlib.suppress(Exception):
            proxy.stop()


def arrived(device: DurableClient, watcher: Client, probe: str) -> None:
    """Wait until the broker has what ``device`` sent so far: it handles a connection's packets in order,
    so a QoS 0 publish on ``probe`` after them, seen by ``watcher`` (subscribed to it), comes after them."""
    device.publish(probe, b"after what was sent", qos=0)
    assert watcher.wait_for(lambda ms: any(m.topic == probe for m in ms)), "the broker got nothing"


def test_a_durability_change_lost_with_its_connection_is_logged_only_once_the_reconnect_confirms_it(
    sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """A non-durable filter made durable while the link is stalled: the `interest` is sent, the broker never
    gets it, the link is cut, so the broker drops the filter with the connection and queues nothing for a
    publish made while away. Before, its `durable: true` record was written as it was sent: the audit then
    expected that publish and reported it lost. Now no record until the reconnect sends the change again
    and the broker confirms it; subscribe() waits for that confirmation (RequestTimeout meanwhile)."""
    broker, proxy, port = proxied(metrics_interval=0.1)
    log = tmp_path / "device.jsonl"
    lives = Lives()
    device = sdk(port, "flipper", delivery_log=log, on_live=lives.on_live)
    device.subscribe("flip/t", qos=1, durable=False)
    device.connect(timeout=WAIT)
    device.ready_for_events()  # each connection's marker comes once its SUBACKs did
    assert lives.wait(1), "no marker"
    assert [r["durable"] for r in subscribes(log, "flip/t")] == [False]

    assert proxy.stall() == 1
    timed_out = False
    try:
        device.subscribe("flip/t", qos=1, durable=True, timeout=1.0)  # sent; no reply can come
    except RequestTimeout:
        timed_out = True
    assert [r["durable"] for r in subscribes(log, "flip/t")] == [False], "logged before the broker confirmed it"
    assert timed_out, "subscribe() returned without the broker's confirmation"

    assert proxy.cut() == 1
    seen_away(clients, broker, 1)  # the broker ended the connection, and the non-durable filter with it
    away = time.time()
    publisher = clients(broker.port, "flip-pub", clean_session=True)
    publisher.publish("flip/t", [b"sent while away: nothing queued it"], qos=1)
    assert [r["durable"] for r in subscribes(log, "flip/t")] == [False]

    proxy.restore()
    assert lives.wait(2), "no reconnect"  # after the reconnect's SUBACK, or hello reply, that confirms the change
    logged = subscribes(log, "flip/t")
    assert [r["durable"] for r in logged] == [False, True], logged
    assert logged[1]["time"] > away, (logged, away)  # the window opens after the publish made while away


def test_a_confirmed_durability_change_is_logged_once_at_its_reply_and_subscribe_returns_after_it(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """Without faults: one record per change, written by the time subscribe() returns (it waits for the
    `interest` reply), each with the new `durable`."""
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "toggler", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("tog/t", qos=1, timeout=WAIT)  # a new filter: returns at its SUBACK
    expected = [True]
    for durable in (False, True, False):
        device.subscribe("tog/t", qos=1, durable=durable, timeout=WAIT)
        expected.append(durable)
        assert [r["durable"] for r in subscribes(log, "tog/t")] == expected
    device.subscribe("tog/t", qos=1, durable=False, timeout=WAIT)  # no change: no record
    assert [r["durable"] for r in subscribes(log, "tog/t")] == expected


def test_a_change_to_non_durable_is_logged_as_sent_and_subscribe_still_waits_for_its_reply(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """durable=False closes the audit's window as it is sent (expecting less is safe): with the broker
    stopped (SIGSTOP) no reply can come, so subscribe() raises RequestTimeout, and the `false` record is
    in the log already. Once the broker answers, no second record."""
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "closer", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("close/t", qos=1, timeout=WAIT)
    assert [r["durable"] for r in subscribes(log, "close/t")] == [True]
    with broker.paused():
        with pytest.raises(RequestTimeout):
            device.subscribe("close/t", qos=1, durable=False, timeout=0.3)
        assert [r["durable"] for r in subscribes(log, "close/t")] == [True, False]
    device.subscribe("close/t", qos=1, timeout=WAIT)  # its reply comes after the false one's
    assert [r["durable"] for r in subscribes(log, "close/t")] == [True, False, True]


def test_a_durable_change_whose_reply_is_lost_is_logged_once_at_the_reconnects_hello_reply(
    sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """The broker applies durable: true but its reply is lost (the broker-to-client way stalled), then the
    link is cut: the filter, durable now, survives the connection's end and queues a publish made while
    away. The reconnect says durable: true again before its hello; the hello reply lists the filter, and
    exactly one `true` record is written there (no SUBSCRIBE: no SUBACK to write it at)."""
    broker, proxy, port = proxied(metrics_interval=0.1)
    log = tmp_path / "device.jsonl"
    got: list[bytes] = []
    delivered = threading.Condition()
    links = Connections()

    def listener(event: Any) -> None:
        with delivered:
            got.append(bytes(event.payload))
            delivered.notify_all()

    device = sdk(port, "keeper", delivery_log=log, on_connected=links.connected)
    device.connect(timeout=WAIT)
    device.subscribe("keep/t", qos=1, durable=False, listener=listener, timeout=WAIT)
    device.ready_for_events()
    assert [r["durable"] for r in subscribes(log, "keep/t")] == [False]
    watcher = clients(broker.port, "keep-watch", clean_session=True)
    watcher.subscribe("keep/probe", 0)

    assert proxy.stall(direction="down") == 1
    with pytest.raises(RequestTimeout):
        device.subscribe("keep/t", qos=1, durable=True, listener=listener, timeout=0.5)
    arrived(device, watcher, "keep/probe")
    assert [r["durable"] for r in subscribes(log, "keep/t")] == [False], "logged without the reply"

    assert proxy.cut() == 1
    seen_away(clients, broker, 1)
    publisher = clients(broker.port, "keep-pub", clean_session=True)
    publisher.publish("keep/t", [b"queued while away"], qos=1)
    proxy.restore()
    assert links.wait(lambda: links.up == 2), "no reconnect"
    with delivered:  # the filter survived: the broker had applied durable: true
        assert delivered.wait_for(lambda: b"queued while away" in got, WAIT), got
    assert [r["durable"] for r in subscribes(log, "keep/t")] == [False, True]


def made_durable_again_while_away(
    relay: PacketRelay, sdk: Callable[..., DurableClient], tmp_path: Path, topic_filter: str
) -> tuple[Path, Connections, DurableClient]:
    """A device connected through ``relay``, with ``topic_filter`` durable (QoS 1), then cut off (the relay
    refuses its reconnects until accept()) and, while away, made non-durable and durable again: its
    reconnect's CONNACK sends `interest` durable: true before its hello."""
    log = tmp_path / "device.jsonl"
    links = Connections()
    device = sdk(
        relay.port, "window", delivery_log=log, on_connected=links.connected, on_disconnected=links.disconnected
    )
    device.connect(timeout=WAIT)
    device.subscribe(topic_filter, qos=1, timeout=WAIT)
    relay.cut()
    assert links.wait(lambda: links.down == 1), "the cut was not seen"
    device.subscribe(topic_filter, qos=1, durable=False)  # disconnected: at once
    device.subscribe(topic_filter, qos=1, durable=True)  # made durable again: said before the next hello
    return log, links, device


def test_a_filter_unsubscribed_between_connack_and_hello_reply_gets_no_record_at_the_hello_reply(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path, relays: Callable[..., PacketRelay]
) -> None:
    """Made non-durable, then durable again, while disconnected: the reconnect's CONNACK sends durable: true
    before its hello. Unsubscribed after that CONNACK, before the hello reply (a relay in front of the broker
    holds what the client sends after its CONNECT, and sees the `interest` come): the hello reply writes no
    `subscribe` record of the filter after its `unsubscribe`."""
    relay = relays(broker.port)
    log, links, device = made_durable_again_while_away(relay, sdk, tmp_path, "leave/t")
    relay.hold("up")  # the CONNECT goes through, what follows is held
    after = len(relay.seen)
    relay.accept()
    relay.wait_seen(is_interest(True), after)  # sent at the CONNACK
    device.unsubscribe("leave/t")
    relay.release("up")
    assert links.wait(lambda: links.up == 2), "no reconnect"
    found = [(r["kind"], r.get("durable")) for r in records(log, "leave/t")]
    assert found == [("subscribe", True), ("unsubscribe", None)], found


def test_a_filter_made_durable_again_between_connack_and_hello_reply_is_logged_at_the_suback_not_the_interest_reply(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, relays: Callable[..., PacketRelay],
) -> None:
    """A non-durable filter made durable: its `interest` is held by a relay in front of the real broker, and
    the link is cut, so the broker drops the filter with the connection. The reconnect's CONNACK sends
    durable: true again before its hello; both replies are held, and subscribe(same QoS, durable=True) is
    called again in that window (not yet connected: it returns at once). The broker answers the interest ok
    but holds nothing (the hello lists no such filter): no `true` record at the interest reply, no second
    `interest` after the hello reply, and `true` written at the SUBACK of the SUBSCRIBE sent after it (before,
    the new Subscription object was not among those sent before the hello: `true` was written at the
    interest reply, and it kept its own `interest` to send again)."""
    broker = broker_factory(metrics_interval=0.1)
    relay = relays(broker.port)
    log = tmp_path / "device.jsonl"
    device, lives = live_device(sdk, relay.port, "window", log)
    device.subscribe("window/t", qos=1, durable=False, timeout=WAIT)
    relay.hold("up", is_interest(True))
    caller, outcome = made_durable_in_a_thread(device, "window/t")
    relay.wait_seen(is_interest(True))
    relay.cut()
    relay.release("up")  # to closed sockets: the broker never gets it
    seen_away(clients, broker, 1)  # the broker ended the connection, and the non-durable filter with it
    relay.hold("down", lambda p: (p.control() or {}).get("op") in ("interest", "hello"))
    after = len(relay.seen)
    relay.accept()
    relay.wait_seen(is_interest(True), after)
    hello = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("op") == "hello", after)
    assert "window/t" not in hello.control()["subscriptions"]  # type: ignore[index]
    device.subscribe("window/t", qos=1, durable=True, timeout=WAIT)  # not yet connected: returns at once
    relay.hold("up", lambda p: p.kind == 8)  # the SUBSCRIBE sent after the hello reply
    relay.release("down")  # the interest reply (ok), then the hello reply
    relay.wait_seen(lambda p: p.direction == "up" and p.kind == 8, after)  # both replies handled
    assert [r["durable"] for r in subscribes(log, "window/t")] == [False], "logged true before the broker held it"
    interests = [p for p in relay.seen[after:] if is_interest(True)(p)]
    assert len(interests) == 1, "durable: true said again after the hello reply"
    relay.release("up")
    assert lives.wait(2), "no reconnect"
    caller.join(WAIT)
    assert outcome == [None], outcome
    assert [r["durable"] for r in subscribes(log, "window/t")] == [False, True]


def test_a_change_to_durable_made_while_the_suback_is_on_its_way_waits_for_its_own_reply(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path, relays: Callable[..., PacketRelay]
) -> None:
    """A new non-durable filter's SUBACK is on its way (held by a relay in front of the broker) when another
    call makes the filter durable (an `interest` sent after the SUBSCRIBE, held on its way to the broker):
    the SUBACK, let through first, does not confirm that change: the second call is still waiting once the
    SUBACK's `false` record is written. It returns at the `interest` reply, and the log holds `false` (the
    SUBACK) then `true` (the reply)."""
    relay = relays(broker.port)
    log = tmp_path / "device.jsonl"
    device = sdk(relay.port, "twice", delivery_log=log)
    device.connect(timeout=WAIT)

    relay.hold("down")
    with pytest.raises(RequestTimeout):  # the SUBACK is held
        device.subscribe("twice/t", qos=1, durable=False, timeout=0.3)
    relay.wait_seen(lambda p: p.kind == 9)  # the broker sent the SUBACK
    relay.hold("up")  # now both ways
    caller, outcome = made_durable_in_a_thread(device, "twice/t")
    relay.wait_seen(is_interest(True))
    relay.release("down")  # the SUBACK comes; the interest stays held
    assert wait_until(lambda: [r["durable"] for r in subscribes(log, "twice/t")] == [False], WAIT), "no record"
    assert outcome == [], "subscribe() returned at the SUBACK, before the broker had the change"
    relay.release("up")
    caller.join(WAIT)
    assert outcome == [None], outcome
    assert [r["durable"] for r in subscribes(log, "twice/t")] == [False, True]


def test_a_change_to_non_durable_sent_with_a_subscribe_is_logged_as_sent_and_once(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """durable=False on a durable filter is written as it is sent also when a SUBSCRIBE goes with it (a new
    QoS) or an earlier SUBSCRIBE of the filter still waits for its SUBACK: the broker may apply it before
    that SUBACK comes (or never comes). Before, the `false` record waited for the SUBACK. That SUBACK,
    once it comes, writes no second `false` record."""
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "lowered", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("qos/t", qos=1, timeout=WAIT)
    device.subscribe("wait/t", qos=1, timeout=WAIT)
    with broker.paused():  # SIGSTOP: nothing is answered
        with pytest.raises(RequestTimeout):  # a new QoS and durable: false together
            device.subscribe("qos/t", qos=2, durable=False, timeout=0.3)
        with pytest.raises(RequestTimeout):  # a SUBSCRIBE (new QoS, still durable) waits for its SUBACK
            device.subscribe("wait/t", qos=2, timeout=0.3)
        with pytest.raises(RequestTimeout):  # then durable: false, the same QoS: an interest only
            device.subscribe("wait/t", qos=2, durable=False, timeout=0.3)
        assert [r["durable"] for r in subscribes(log, "qos/t")] == [True, False], "not written as sent"
        assert [r["durable"] for r in subscribes(log, "wait/t")] == [True, False], "not written as sent"
    device.subscribe("sync/t", qos=1, timeout=WAIT)  # its SUBACK comes after theirs
    assert [r["durable"] for r in subscribes(log, "qos/t")] == [True, False]
    assert [r["durable"] for r in subscribes(log, "wait/t")] == [True, False]


def test_a_change_to_non_durable_whose_suback_is_lost_closes_the_window_before_the_outage(
    sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """durable=False with a new QoS: the broker gets both (it makes the filter non-durable) but the SUBACK
    is lost with the connection. A publish made while away is not queued for the filter, and the log's
    `false` record comes before it (the audit does not expect it). Before, the record waited for a SUBACK
    that never came: the publish counted as lost."""
    broker, proxy, port = proxied(metrics_interval=0.1)
    log = tmp_path / "device.jsonl"
    links = Connections()
    device = sdk(port, "lowered2", delivery_log=log, on_connected=links.connected)
    device.connect(timeout=WAIT)
    device.subscribe("low/t", qos=1, timeout=WAIT)
    device.ready_for_events()
    watcher = clients(broker.port, "lowered2-watch", clean_session=True)
    watcher.subscribe("low/probe", 0)
    assert proxy.stall(direction="down") == 1
    with pytest.raises(RequestTimeout):
        device.subscribe("low/t", qos=2, durable=False, timeout=0.3)
    arrived(device, watcher, "low/probe")
    assert proxy.cut() == 1
    seen_away(clients, broker, 1)
    publisher = clients(broker.port, "lowered2-pub", clean_session=True)
    away = time.time()
    publisher.publish("low/t", [b"sent while away"], qos=1)
    proxy.restore()
    assert links.wait(lambda: links.up == 2), "no reconnect"
    before = [r["durable"] for r in subscribes(log, "low/t") if r["time"] < away]
    assert before == [True, False], before


def test_a_new_filter_whose_suback_is_lost_is_logged_at_the_hello_reply_that_lists_it(
    sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """A new durable filter: the broker gets its SUBSCRIBE (the session keeps the filter) but the SUBACK is
    lost with the connection. The reconnect's hello reply lists the filter, so no SUBSCRIBE is sent again:
    that hello reply confirms it and writes its `subscribe` record (before, none was ever written, and the
    audit expected nothing for it)."""
    broker, proxy, port = proxied(metrics_interval=0.1)
    log = tmp_path / "device.jsonl"
    links = Connections()
    device = sdk(port, "unacked", delivery_log=log, on_connected=links.connected)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    watcher = clients(broker.port, "unacked-watch", clean_session=True)
    watcher.subscribe("new/probe", 0)
    assert proxy.stall(direction="down") == 1
    with pytest.raises(RequestTimeout):
        device.subscribe("new/t", qos=1, timeout=0.3)
    arrived(device, watcher, "new/probe")
    assert subscribes(log, "new/t") == []
    assert proxy.cut() == 1
    seen_away(clients, broker, 1)
    proxy.restore()
    assert links.wait(lambda: links.up == 2), "no reconnect"  # on_connected: after the hello reply
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "new/t")] == [(1, True)]


def made_durable_in_a_thread(
    device: DurableClient, topic_filter: str, qos: int = 1, *, durable: bool = True, timeout: float = WAIT
) -> tuple[threading.Thread, list[BaseException | None]]:
    """A started thread whose subscribe() makes ``topic_filter`` durable (or, ``durable=False``, not) at
    ``qos``, and its outcome once it returns: [None], or [what it raised]."""
    outcome: list[BaseException | None] = []

    def make_durable() -> None:
        try:
            device.subscribe(topic_filter, qos=qos, durable=durable, timeout=timeout)
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    caller = threading.Thread(target=make_durable, daemon=True)
    caller.start()
    return caller, outcome


@pytest.mark.parametrize("first_durable", [False, True], ids=["to-non-durable", "to-durable"])
def test_a_non_durable_subscribe_at_a_new_qos_returns_at_its_suback_while_an_earlier_interest_awaits_its_reply(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path, relays: Callable[..., PacketRelay],
    first_durable: bool,
) -> None:
    """sdk.md: a connected subscribe() returns at its SUBACK; only a durable one at a new QoS waits for an
    `interest` reply still due. A change of w/t's durability awaits its reply (held) when a
    subscribe(durable=False) at QoS 0 comes: it took over that wait too and raised RequestTimeout (review 320)."""
    relay = relays(broker.port)
    device = sdk(relay.port, "nd-new-qos", delivery_log=tmp_path / "device.jsonl")
    device.connect(timeout=WAIT)
    device.subscribe("w/t", qos=1, durable=not first_durable, timeout=WAIT)
    relay.hold("down", op_is("interest", "down"))
    after = len(relay.seen)
    changing, _ = made_durable_in_a_thread(device, "w/t", durable=first_durable)
    relay.wait_seen(op_is("interest", "down"), after)
    at_new_qos, outcome = made_durable_in_a_thread(device, "w/t", 0, durable=False, timeout=3)
    relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9, after)  # its SUBACK came
    at_new_qos.join(WAIT)
    relay.release("down")
    changing.join(WAIT)
    assert outcome == [None], outcome


def is_interest(durable: bool) -> Callable[[Packet], bool]:
    """Matches a client's `interest` request with that `durable` (true when left out)."""

    def match(packet: Packet) -> bool:
        request = packet.control()
        return packet.direction == "up" and request is not None and request.get("op") == "interest" and (
            request.get("durable", True) is durable
        )

    return match


def refuse_durable_interests(packet: Packet) -> Packet:
    """A PacketRelay rewrite: each `interest` durable: true gets an invalid filter (the broker answers
    `bad_filter`)."""
    request = packet.control()
    if packet.kind != 3 or request is None or request.get("op") != "interest" or not request.get("durable"):
        return packet
    topic_end = 2 + int.from_bytes(packet.body[:2], "big")
    body = json.dumps({**request, "filter": "refused/#/t"}).encode()
    return Packet(packet.direction, packet.first, packet.body[:topic_end] + body)


def refused_while_its_suback_is_held(
    relay: PacketRelay, device: DurableClient
) -> tuple[threading.Thread, list[BaseException | None]]:
    """refused/t subscribed non-durable, its SUBACK held by ``relay`` (refuse_durable_interests), then made
    durable in a thread (made_durable_in_a_thread) whose `interest` the broker refused: the refusal reached
    the client, the SUBACK is still held ("down")."""
    relay.hold("down", lambda p: p.kind == 9)  # SUBACKs only
    with pytest.raises(RequestTimeout):
        device.subscribe("refused/t", qos=1, durable=False, timeout=0.3)
    relay.wait_seen(lambda p: p.kind == 9)
    caller, outcome = made_durable_in_a_thread(device, "refused/t")
    req = relay.wait_seen(is_interest(True)).control()["req"]  # type: ignore[index]
    refusal = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("req") == req)
    assert refusal.control()["ok"] is False, refusal  # type: ignore[index]
    return caller, outcome


def test_a_change_to_durable_the_broker_refuses_before_the_suback_is_logged_non_durable_at_that_suback(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture,
) -> None:
    """A new non-durable filter's SUBACK is held (a relay in front of the real broker lets other packets
    overtake it) while another call makes the filter durable; the broker refuses that `interest` (the relay
    makes its filter invalid: the broker answers `bad_filter`), and the refusal reaches the client before the
    SUBACK. The broker holds the filter non-durable: that SUBACK writes `durable: false` (before, `true`,
    and the audit expected what the broker never queued); subscribe() returns, with a WARNING. The broker
    still holds it non-durable: a subscribe(durable=True) at a new QoS, and a retry at that QoS, each send
    the change again (refused again: that SUBACK writes `false`). The filter is dropped with the connection,
    so a publish made while away is not queued; the reconnect says the change again before its hello
    (refused again: the relay still rewrites it), subscribes the filter again, and its SUBACK writes `false`
    (before, `true`: the reconnect's refusal went unnoticed)."""

    broker = broker_factory(metrics_interval=0.1)
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log = tmp_path / "device.jsonl"
    device, lives = live_device(sdk, relay.port, "refused", log)
    caller, outcome = refused_while_its_suback_is_held(relay, device)
    relay.release("down")  # the SUBACK comes after the refusal
    caller.join(WAIT)
    assert outcome == [None], outcome  # no exception: a WARNING
    assert any("refused 'interest'" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)
    assert [r["durable"] for r in subscribes(log, "refused/t")] == [False]

    # The broker still holds it non-durable: a new QoS says durable: true again (refused again), and its
    # SUBACK writes false; so does a retry at that QoS (before, it sent nothing and the SUBACK wrote true).
    for _ in range(2):
        after = len(relay.seen)
        device.subscribe("refused/t", qos=0, durable=True, timeout=WAIT)
        relay.wait_seen(is_interest(True), after)
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "refused/t")] == [(1, False), (0, False)]

    relay.cut()
    seen_away(clients, broker, 1)
    away = time.time()
    clients(broker.port, "refused-pub", clean_session=True).publish("refused/t", [b"not queued"], qos=1)
    after = len(relay.seen)
    relay.accept()
    assert lives.wait(2), "no reconnect"
    # Said again before the hello (refused again: the filter is subscribed again, with `interest durable: false`).
    undo = relay.wait_seen(is_interest(True), after)
    hello = relay.wait_seen(lambda p: p.direction == "up" and (p.control() or {}).get("op") == "hello", after)
    assert relay.seen.index(undo, after) < relay.seen.index(hello, after)
    logged = subscribes(log, "refused/t")
    assert [r["durable"] for r in logged] == [False, False, False], logged
    assert logged[2]["time"] > away, (logged, away)


def test_a_refused_change_to_durable_whose_suback_is_lost_is_said_again_and_a_reconnects_refusal_logs_false(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path,
    relays: Callable[..., PacketRelay],
) -> None:
    """As above, but the connection is lost before the held SUBACK comes: no record then; the refusal
    is not kept across the loss: the reconnect says durable: true again before its hello. The broker refuses
    it again (the relay still rewrites it): the SUBACK of the SUBSCRIBE sent again writes `false`, never
    `true` (before, `true`: that refusal went unnoticed); the waiting subscribe() returns there."""
    broker = broker_factory()
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log = tmp_path / "device.jsonl"
    device, lives = live_device(sdk, relay.port, "refused", log)
    caller, outcome = refused_while_its_suback_is_held(relay, device)
    after = len(relay.seen)
    relay.cut()  # the held SUBACK is lost with the connection
    relay.release("down")  # to closed sockets: nothing reaches the client
    relay.accept()
    assert lives.wait(2), "no reconnect"
    undo = relay.wait_seen(is_interest(True), after)
    hello = relay.wait_seen(lambda p: p.direction == "up" and (p.control() or {}).get("op") == "hello", after)
    assert relay.seen.index(undo, after) < relay.seen.index(hello, after)
    caller.join(WAIT)
    assert outcome == [None], outcome
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "refused/t")] == [(1, False)]


def test_a_change_to_non_durable_while_a_refused_filters_retry_awaits_its_reply_is_sent(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path,
    relays: Callable[..., PacketRelay],
) -> None:
    """The broker refused durable: true once; a subscribe(durable=True) sends it again and the broker
    applies it, its reply held (by a relay in front of the real broker). A subscribe(durable=False)
    meanwhile sends `interest` durable: false (before, it sent none: the filter still counted as
    refused, and the broker kept it durable)."""
    broker = broker_factory()
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    lives = Lives()
    device = sdk(relay.port, "refused", delivery_log=tmp_path / "device.jsonl", on_live=lives.on_live)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert lives.wait(1), "no marker"
    caller, outcome = refused_while_its_suback_is_held(relay, device)
    relay.release("down")
    caller.join(WAIT)
    assert outcome == [None], outcome
    relay.rewrite = None  # the retry is applied
    relay.hold("down", lambda p: (p.control() or {}).get("op") == "interest")  # its reply held
    after = len(relay.seen)
    caller, outcome = made_durable_in_a_thread(device, "refused/t")
    relay.wait_seen(is_interest(True), after)
    with pytest.raises(RequestTimeout):  # it waits for its reply, held too
        device.subscribe("refused/t", qos=1, durable=False, timeout=0.3)
    relay.wait_seen(is_interest(False), after)
    relay.release("down")
    caller.join(WAIT)
    assert outcome == [None], outcome


def test_a_change_to_durable_at_a_new_qos_whose_reply_comes_after_its_suback_is_logged_true_at_the_reply(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path,
    relays: Callable[..., PacketRelay],
) -> None:
    """A non-durable filter made durable at a new QoS: `interest` durable: true, then a SUBSCRIBE. The relay
    holds the `interest` reply until after the SUBACK: the SUBACK writes `false` (not applied yet) and the
    reply `true` (before, none: the audit never expected the filter durable). sdk.md: such a subscribe()
    returns at the SUBACK and the reply, whichever comes last."""
    broker = broker_factory()
    relay = relays(broker.port)
    log = tmp_path / "device.jsonl"
    device = sdk(relay.port, "newqos", delivery_log=log)
    device.connect(timeout=WAIT)
    device.subscribe("newqos/t", qos=1, durable=False, timeout=WAIT)
    relay.hold("down", lambda p: (p.control() or {}).get("op") == "interest")
    after = len(relay.seen)
    caller, outcome = made_durable_in_a_thread(device, "newqos/t", qos=0)
    relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9, after)
    relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("op") == "interest", after)
    assert wait_until(lambda: len(subscribes(log, "newqos/t")) == 2, WAIT), "the SUBACK wrote no record"
    assert caller.is_alive(), "subscribe() returned before the broker's interest reply"
    relay.release("down")
    caller.join(WAIT)
    assert outcome == [None], outcome
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "newqos/t")] == [(1, False), (0, False), (0, True)]


class Received:
    """A listener that keeps each event's (topic, payload), and a wait on them."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.events: list[tuple[str, bytes]] = []

    def __call__(self, event: Event) -> None:
        with self.cond:
            self.events.append((event.topic, event.payload))
            self.cond.notify_all()

    def wait(self, topic: str, payload: bytes) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: (topic, payload) in self.events, WAIT)


def hello_reply(relay: PacketRelay, after: int) -> dict[str, Any]:
    """The first successful `hello` reply the client was sent from ``relay.seen[after:]``."""

    def match(packet: Packet) -> bool:
        reply = packet.control() or {}
        return packet.direction == "down" and reply.get("op") == "hello" and reply.get("ok") is True

    found = relay.wait_seen(match, after).control()
    assert found is not None
    return found


def suback_codes(relay: PacketRelay, topic_filter: str, after: int) -> bytes:
    """The return codes of the SUBACK to the first SUBSCRIBE of ``topic_filter`` in ``relay.seen[after:]``."""
    named = len(topic_filter).to_bytes(2, "big") + topic_filter.encode()
    subscribe = relay.wait_seen(lambda p: p.direction == "up" and p.kind == 8 and named in p.body, after)
    packet_id = subscribe.body[:2]
    suback = relay.wait_seen(
        lambda p: p.direction == "down" and p.kind == 9 and p.body[:2] == packet_id, relay.seen.index(subscribe, after)
    )
    return suback.body[2:]


def test_a_filter_the_broker_refuses_is_missing_from_each_reconnects_hello_and_is_subscribed_and_refused_again(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
    *,
    relays: Callable[..., PacketRelay],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md: "A SUBACK that refuses the filter (0x80: the broker's topic ACL, its `max_subscriptions_per_client`
    ...) does not raise: it is logged as a WARNING naming those causes, the subscription stays registered and is
    sent again after every reconnect"; the marker's `live` list holds the filters granted, "not those refused
    with 0x80"; protocol.md: the hello reply's `subscriptions` are those the session holds; delivery-log.md: a
    `subscribe` record is written when the broker confirms the subscription (its SUBACK). A real broker
    (max_subscriptions_per_client 1), the real SDK through a relay that sees each packet. After a dropped
    link, then after the broker's SIGKILL and restart, the reconnect's hello reply lists only the granted
    filter (the broker never held the refused one), the SDK subscribes the refused one again (it never
    counts it as held) and the broker refuses it again: the same WARNING each time, no `subscribe` record,
    nothing routed to it. The broker restarted with room for it grants it at the next reconnect: its
    record is written then, and its events come."""
    broker = broker_factory(max_subscriptions_per_client=1)
    relay = relays(broker.port)
    log = tmp_path / "device.jsonl"
    lives = Lives()
    received = Received()
    device = sdk(relay.port, "over", delivery_log=log, on_live=lives.on_live)
    device.subscribe("kept/t", listener=received)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert lives.wait(1), "no marker"

    def refusals() -> int:
        return sum("refused the subscription to over/t" in r.getMessage() for r in caplog.records)

    with caplog.at_level(logging.WARNING, logger="durable_client"):
        after = len(relay.seen)
        device.subscribe("over/t", listener=received, timeout=WAIT)  # returns at the SUBACK: no exception
        assert suback_codes(relay, "over/t", after) == b"\x80"
        assert refusals() == 1
        warning = next((r.getMessage() for r in caplog.records if "refused the subscription" in r.getMessage()), None)
        assert warning is not None, "no WARNING of the refusal"
        assert "max_subscriptions_per_client" in warning, "the WARNING does not name the cause"
        for connection, drop in ((2, relay.cut), (3, broker.restart)):
            after = len(relay.seen)
            drop()
            relay.accept()
            assert lives.wait(connection), "no reconnect"  # its marker comes after the reconnect's SUBACKs
            assert hello_reply(relay, after)["subscriptions"] == {"kept/t": 1}
            assert suback_codes(relay, "over/t", after) == b"\x80", "not subscribed again, or granted"
            assert refusals() == connection, "the refusal was not said again"
            assert [s.filter for s in lives.markers[-1].live] == ["kept/t"]
            publisher = clients(broker.port, f"over-pub-{connection}", clean_session=True)
            publisher.publish("over/t", [f"refused {connection}".encode()], qos=1)
            publisher.publish("kept/t", [f"fence {connection}".encode()], qos=1)  # routed after the one above
            assert received.wait("kept/t", f"fence {connection}".encode())
            assert not [e for e in received.events if e[0] == "over/t"], "routed to a refused filter"
            assert subscribes(log, "over/t") == [], "a refused filter was logged as subscribed"

    broker.stop()
    broker.settings["max_subscriptions_per_client"] = 2  # room for it now
    after = len(relay.seen)
    broker.start()
    assert lives.wait(4), "no reconnect"
    assert hello_reply(relay, after)["subscriptions"] == {"kept/t": 1}
    assert suback_codes(relay, "over/t", after) == b"\x01"
    assert [s.filter for s in lives.markers[-1].live] == ["kept/t", "over/t"]
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "over/t")] == [(1, True)]
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "kept/t")] == [(1, True)], "kept/t subscribed again"
    clients(broker.port, "over-pub-4", clean_session=True).publish("over/t", [b"granted"], qos=1)
    assert received.wait("over/t", b"granted")


def test_a_change_to_durable_refused_again_at_the_reconnect_keeps_the_filter_non_durable_on_the_broker(
    broker_factory: Callable[..., Broker],
    sdk: Callable[..., DurableClient],
    clients: Callable[..., Client],
    tmp_path: Path,
    *,
    relays: Callable[..., PacketRelay],
) -> None:
    """delivery-log.md and sdk.md: the reconnect says a refused change to durable: true again before its
    hello; "If the broker refuses it again there ..., the filter stays refused: that SUBACK writes `durable:
    false`", held non-durable by the broker; "A `subscribe(durable=False)` of a refused filter sends no
    `interest`". The reconnect subscribes it non-durable (`interest` durable: false with its SUBSCRIBE), so
    a publish made while away is not queued, after each reconnect that refuses it, and after a
    subscribe(durable=False) that sent nothing. Before, the reconnect sent the SUBSCRIBE alone: the broker
    made the filter durable and queued those publishes, while the log said `false`."""
    broker = broker_factory(metrics_interval=0.1)
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log = tmp_path / "device.jsonl"
    lives = Lives()
    received = Received()
    device = sdk(relay.port, "refused", delivery_log=log, on_live=lives.on_live)
    device.subscribe("refused/t", qos=1, durable=False, listener=received)
    device.subscribe("fence/t", qos=1, listener=received)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert lives.wait(1), "no marker"
    device.subscribe("refused/t", qos=1, durable=True, listener=received, timeout=WAIT)  # refused: a WARNING

    def away_and_back(connection: int, *, durable: bool = True) -> None:
        """Drop the link; once the broker has ended the connection, publish to refused/t, then reconnect
        (it says `durable` again before its hello: refused again, the relay still rewrites it)."""
        after = len(relay.seen)
        relay.cut()
        seen_away(clients, broker, 1)
        clients(broker.port, f"pub-{connection}", clean_session=True).publish(
            "refused/t", [f"away {connection}".encode()], qos=1
        )
        relay.accept()
        assert lives.wait(connection), "no reconnect"
        relay.wait_seen(is_interest(durable), after)
        clients(broker.port, f"fence-{connection}", clean_session=True).publish(
            "fence/t", [f"fence {connection}".encode()], qos=1
        )
        assert received.wait("fence/t", f"fence {connection}".encode())
        assert not [e for e in received.events if e[0] == "refused/t"], "queued for a non-durable filter"

    away_and_back(2)
    away_and_back(3)
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "refused/t")] == [(1, False)] * 3

    after = len(relay.seen)
    device.subscribe("refused/t", qos=1, durable=False, listener=received, timeout=WAIT)
    device.publish("fence/t", b"after it", qos=1, timeout=WAIT)  # the broker has what was sent before it
    assert not [p for p in relay.seen[after:] if (p.control() or {}).get("op") == "interest"], "an interest was sent"
    away_and_back(4, durable=False)
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "refused/t")] == [(1, False)] * 4

    device.subscribe("refused/t", qos=1, durable=True, listener=received, timeout=WAIT)  # refused again
    after = len(relay.seen)
    device.subscribe("refused/t", qos=0, durable=False, listener=received, timeout=WAIT)  # "another QoS"
    assert not [p for p in relay.seen[after:] if (p.control() or {}).get("op") == "interest"], "an interest was sent"
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "refused/t")] == [(1, False)] * 4 + [(0, False)]


def test_a_refused_change_to_durable_has_logged_its_warning_when_subscribe_returns(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path,
    *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture,
) -> None:
    """sdk.md: a refused change to durable "returns there too, without raising, with a WARNING": the
    WARNING is logged before subscribe() is woken (it was logged after, so about 1 return in 4 came first;
    30 changes, each refused by the real broker through the relay's rewrite, catch that)."""
    broker = broker_factory()
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    device = sdk(relay.port, "refused-warning", delivery_log=tmp_path / "device.jsonl")
    device.connect(timeout=WAIT)
    device.subscribe("w/t", qos=1, durable=False, timeout=WAIT)

    def warnings() -> int:
        return sum("refused 'interest'" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)

    with caplog.at_level(logging.WARNING, logger="durable_client"):
        for change in range(30):
            before = warnings()
            device.subscribe("w/t", qos=1, durable=True, timeout=WAIT)
            assert warnings() == before + 1, f"change {change}: subscribe() returned before its WARNING"
            device.subscribe("w/t", qos=1, durable=False, timeout=WAIT)
    assert warnings() == 30


def test_a_filter_refused_by_its_suback_then_made_non_durable_writes_no_record(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], tmp_path: Path
) -> None:
    """sdk.md: a filter a SUBACK refuses (0x80) "writes no delivery-log record until a SUBACK grants it":
    a subscribe(durable=False) of it at the same QoS wrote `durable: false`, and the audit expected live
    deliveries of a filter the broker never held."""
    broker = broker_factory(max_subscriptions_per_client=1)
    log = tmp_path / "device.jsonl"
    device = sdk(broker.port, "over", delivery_log=log)
    device.subscribe("kept/t")
    device.connect(timeout=WAIT)
    device.subscribe("over/t", timeout=WAIT)  # 0x80: past max_subscriptions_per_client
    device.subscribe("over/t", durable=False, timeout=WAIT)
    assert subscribes(log, "over/t") == []
    assert [r["durable"] for r in subscribes(log, "kept/t")] == [True]


@pytest.mark.parametrize("refused", [True, False], ids=["refused-at-reconnect", "applied-at-reconnect"])
@pytest.mark.parametrize("new_qos", [True, False], ids=["new-qos", "same-qos"])
def test_a_change_to_durable_lost_before_its_reply_returns_at_the_reconnects_outcome(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path,
    *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture, refused: bool, new_qos: bool,
) -> None:
    """sdk.md: a subscribe() whose connection is lost first "waits for the SUBACK of the SUBSCRIBE sent again
    after the reconnect, or for the reconnect's confirmation of the change". A non-durable filter made durable
    at a new QoS (its SUBACK came) or at the same QoS (a change of durability only: no SUBSCRIBE), its
    `interest` reply held by a relay in front of the real broker, and the link is cut. The reconnect says the
    change again before its hello; its hello reply is held. Refused there (the relay spoils the request:
    `bad_filter`), the reconnect subscribes the filter non-durable after the hello reply: subscribe() returns
    at that SUBACK (before, at the refusal, while the hello reply was still held and no SUBSCRIBE sent), which
    writes `false`. Applied, it returns at the hello reply or the SUBACK after it, and `true` is written.

    The broker had applied the change whose reply was lost, so the hello reply lists the filter, durable.
    Refused at the reconnect, the filter is subscribed non-durable all the same ("also when the hello reply
    lists it", delivery-log.md): a publish made while away after the next cut is not queued (without that,
    the hello's list counted as the confirmation, nothing was sent, the broker kept the filter durable and
    queued the publish, and the log said `true`)."""
    broker = broker_factory(metrics_interval=0.1)
    relay = relays(broker.port)
    log = tmp_path / "device.jsonl"
    lives = Lives()
    received = Received()
    device = sdk(relay.port, "lost-reply", delivery_log=log, on_live=lives.on_live)
    device.subscribe("fence/t", qos=1, listener=received)
    device.connect(timeout=WAIT)
    device.ready_for_events()
    assert lives.wait(1), "no marker"
    first_qos = 0 if new_qos else 1
    device.subscribe("lost/t", qos=first_qos, durable=False, listener=received, timeout=WAIT)
    relay.hold("down", lambda p: (p.control() or {}).get("op") == "interest")
    after = len(relay.seen)
    outcome: list[int | BaseException] = []  # len(relay.seen) when subscribe() returned, or what it raised

    def make_durable() -> None:
        try:
            device.subscribe("lost/t", qos=1, durable=True, listener=received, timeout=WAIT)
            outcome.append(len(relay.seen))
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    caller = threading.Thread(target=make_durable, daemon=True)
    caller.start()
    if new_qos:
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9, after)  # the SUBACK: let through
    relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("op") == "interest", after)
    if new_qos:
        assert wait_until(lambda: len(subscribes(log, "lost/t")) == 2, WAIT), "the SUBACK wrote no record"
    assert caller.is_alive(), "subscribe() returned before the broker's interest reply"

    relay.cut()
    relay.release("down")  # the interest reply, to closed sockets: lost with the connection
    if refused:
        relay.rewrite = refuse_durable_interests
    relay.hold("down", lambda p: (p.control() or {}).get("op") == "hello")  # the reconnect's hello reply
    after = len(relay.seen)
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        relay.accept()
        req = relay.wait_seen(is_interest(True), after).control()["req"]  # type: ignore[index]
        answer = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("req") == req, after)
        assert answer.control()["ok"] is not refused, answer  # type: ignore[index]
        if refused:  # logged by the network thread as it handles the refusal, before it wakes subscribe()
            assert wait_until(lambda: any("refused 'interest'" in r.getMessage() for r in caplog.records), WAIT)
        hello = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("op") == "hello", after)
        # Timed, one-sided (it cannot fail wrongly): one woken by the interest reply returns at once, while the hello
        # reply is held. Refused, the SUBACK index check below is the exact one; applied, nothing better is seen.
        caller.join(0.5)
        assert caller.is_alive(), f"subscribe() returned while the reconnect's hello reply was held: {outcome}"
        relay.release("down")
        caller.join(WAIT)
    assert outcome, "subscribe() did not return"
    if isinstance(outcome[0], BaseException):
        raise AssertionError("subscribe() raised") from outcome[0]
    returned_at = outcome[0]
    assert lives.wait(2), "no reconnect"
    confirmed_after = relay.seen.index(hello, after)
    if refused:  # the SUBSCRIBE sent again after the hello reply, and its SUBACK, came before the return
        suback = relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9, confirmed_after)
        assert relay.seen.index(suback, confirmed_after) < returned_at
    assert returned_at > confirmed_after
    expected = [(first_qos, False), *([(1, False)] if new_qos else []), (1, not refused)]
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "lost/t")] == expected
    assert hello.control()["subscriptions"] == {"fence/t": 1, "lost/t": 1}  # type: ignore[index]
    if not refused:
        return
    relay.wait_seen(is_interest(False), after)
    relay.cut()
    seen_away(clients, broker, 1)
    clients(broker.port, "lost-pub", clean_session=True).publish("lost/t", [b"away"], qos=1)
    relay.accept()
    assert lives.wait(3), "no reconnect"
    clients(broker.port, "lost-fence", clean_session=True).publish("fence/t", [b"fence"], qos=1)
    assert received.wait("fence/t", b"fence")
    assert ("lost/t", b"away") not in received.events, "queued for a filter the SDK holds non-durable"


@pytest.mark.parametrize(
    ("unsubscribed", "qos", "refused_first"),
    [(True, 1, True), (True, 1, False), (False, 0, False)],
    ids=["unsubscribed-after-the-refusal", "unsubscribed-before-the-refusal", "new-qos-before-the-refusal"],
)
def test_a_subscribe_between_connack_and_hello_reply_keeps_the_refusal_of_the_interest_sent_before_the_hello(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path,
    *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture,
    unsubscribed: bool, qos: int, refused_first: bool,
) -> None:
    """A durable filter made non-durable, then durable again, while disconnected: the reconnect's CONNACK says
    durable: true before its hello, and the broker refuses it (a relay in front of the real broker spoils the
    request: `bad_filter`). Between that CONNACK and the hello reply (held by the relay), the application
    calls unsubscribe() and subscribe(same QoS, durable=True), or subscribe() at a new QoS, before or after
    the refusal reaches the client. Either way the filter stays refused, as for a subscribe() of it alone in
    that window (delivery-log.md: "the reconnect subscribes the filter non-durable (an `interest` durable:
    false with its SUBSCRIBE, also when the hello reply lists it) and that SUBACK writes `durable: false`").
    Before, the new subscription knew nothing of the refusal: unsubscribed, the hello reply that lists the
    filter confirmed it and wrote `true` with no `interest` sent; at a new QoS, its SUBACK wrote `true`."""
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log, links, device = made_durable_again_while_away(relay, sdk, tmp_path, "window/t")
    held_ops = ("hello",) if refused_first else ("hello", "interest")
    relay.hold("down", lambda p: (p.control() or {}).get("op") in held_ops)
    after = len(relay.seen)
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        relay.accept()
        req = relay.wait_seen(is_interest(True), after).control()["req"]  # type: ignore[index]
        refusal = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("req") == req, after)
        assert refusal.control()["ok"] is False, refusal  # type: ignore[index]
        if refused_first:  # logged by the network thread as it handles the refusal
            assert wait_until(lambda: any("refused 'interest'" in r.getMessage() for r in caplog.records), WAIT)
        hello = relay.wait_seen(lambda p: p.direction == "down" and (p.control() or {}).get("op") == "hello", after)
        assert hello.control()["subscriptions"] == {"window/t": 1}  # type: ignore[index]
        if unsubscribed:
            device.unsubscribe("window/t")
        device.subscribe("window/t", qos=qos, durable=True)  # not yet connected: returns at once
        relay.release("down")
        assert links.wait(lambda: links.up == 2), "no reconnect"
        assert wait_until(lambda: len(subscribes(log, "window/t")) == 2, WAIT), "no record of the reconnect"
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "window/t")] == [(1, True), (qos, False)]
    relay.wait_seen(is_interest(False), relay.seen.index(hello, after))  # the broker holds it non-durable


def op_is(op: str, direction: str) -> Callable[[Packet], bool]:
    """Matches a control request (``up``) or reply (``down``) of ``op``."""
    return lambda packet: packet.direction == direction and (packet.control() or {}).get("op") == op


def in_the_window(relay: PacketRelay) -> int:
    """Let a device away (made_durable_again_while_away) reconnect, holding what it sends after its CONNECT
    until its hello was sent: its CONNACK was handled, the hello reply cannot have come. The index in
    ``relay.seen`` from which this connection's packets are."""
    relay.hold("up")
    after = len(relay.seen)
    relay.accept()
    relay.wait_seen(op_is("hello", "up"), after)
    return after


def interest_handled(relay: PacketRelay, after: int, caplog: pytest.LogCaptureFixture) -> Packet:
    """Let the `interest` sent before the hello, and the hello, reach the broker; hold the hello reply; return
    the `interest` reply once the client has handled it (its DEBUG line, written after that)."""
    relay.hold("down", op_is("hello", "down"))
    relay.release("up")
    reply = relay.wait_seen(op_is("interest", "down"), after)
    handled = f"answered 'interest' (req {reply.control()['req']})"  # type: ignore[index]
    assert wait_until(lambda: any(handled in r.getMessage() for r in caplog.records), WAIT), "reply not handled"
    return reply


def sent_after(relay: PacketRelay, packet: Packet, after: int) -> list[Packet]:
    """What ``relay`` saw after ``packet`` (seen at or past ``after``)."""
    return relay.seen[relay.seen.index(packet, after) + 1 :]


@pytest.mark.parametrize(("refused", "qos"), [(True, 1), (False, 0)], ids=["refused", "applied-new-qos"])
def test_an_interest_reply_between_unsubscribe_and_subscribe_before_the_hello_reply_reaches_the_new_subscription(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path,
    *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture, refused: bool, qos: int,
) -> None:
    """Between the CONNACK that sent `interest` durable: true before its hello and the hello reply (held by a
    relay): unsubscribe(), the broker's reply to that interest reaches the client, then subscribe(durable=True)
    (that UNSUBSCRIBE, not sent yet, is dropped). Refused (the relay spoils the request): the reconnect
    subscribes the filter non-durable (`interest` durable: false) and its SUBACK writes `false`. Applied, at a
    new QoS: its SUBACK writes `true`, and no second `interest` durable: true is sent. Before, the reply went
    to no subscription (the unsubscribed one was looked for only among the registered): refused, the hello
    reply wrote `true` with no `interest` sent; applied, the new one kept the answered request id and its
    SUBACK wrote `false`."""
    relay = relays(broker.port, rewrite=refuse_durable_interests if refused else None)
    log, links, device = made_durable_again_while_away(relay, sdk, tmp_path, "race/t")
    with caplog.at_level(logging.DEBUG, logger="durable_client"):
        after = in_the_window(relay)
        device.unsubscribe("race/t")
        assert interest_handled(relay, after, caplog).control()["ok"] is not refused  # type: ignore[index]
        device.subscribe("race/t", qos=qos, durable=True)  # not yet connected: returns at once
        hello = relay.wait_seen(op_is("hello", "down"), after)
        relay.release("down")
        assert links.wait(lambda: links.up == 2), "no reconnect"
        assert wait_until(lambda: len(subscribes(log, "race/t")) == 2, WAIT), "no record of the reconnect"
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "race/t")] == [(1, True), (qos, not refused)]
    later = sent_after(relay, hello, after)  # its SUBSCRIBE's SUBACK came: what went before it is there
    assert (any(map(is_interest(False), later)), any(map(is_interest(True), later))) == (refused, False)


@pytest.mark.parametrize("made_non_durable_first", [True, False], ids=["before-the-refusal", "after-the-refusal"])
def test_a_filter_made_non_durable_then_durable_before_the_hello_reply_sends_its_own_interest(
    broker: Broker, sdk: Callable[..., DurableClient], tmp_path: Path,
    *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture, made_non_durable_first: bool,
) -> None:
    """Between the CONNACK that sent `interest` durable: true before its hello and the hello reply (held by a
    relay, which spoils each `interest` durable: true: the broker refuses them): subscribe(durable=False) and
    then subscribe(durable=True), the first before or after the refusal reaches the client. The non-durable
    one clears the refusal and takes no place among the interests sent before the hello, so after the hello
    reply the durable one sends its own `interest` durable: true with its SUBSCRIBE; the broker refuses that
    too, and the SUBACK writes `false`. Before, the durable one stood for the interest sent before the hello
    without its refusal: the hello reply that lists the filter wrote `true`, with no `interest` sent."""
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log, links, device = made_durable_again_while_away(relay, sdk, tmp_path, "flip/t")
    with caplog.at_level(logging.DEBUG, logger="durable_client"):
        after = in_the_window(relay)
        if made_non_durable_first:
            device.subscribe("flip/t", qos=1, durable=False)
        assert interest_handled(relay, after, caplog).control()["ok"] is False  # type: ignore[index]
        if not made_non_durable_first:
            device.subscribe("flip/t", qos=1, durable=False)
        device.subscribe("flip/t", qos=1, durable=True)
        hello = relay.wait_seen(op_is("hello", "down"), after)
        relay.release("down")
        assert links.wait(lambda: links.up == 2), "no reconnect"
        assert wait_until(lambda: len(subscribes(log, "flip/t")) == 2, WAIT), "no record of the reconnect"
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "flip/t")] == [(1, True), (1, False)]
    later = sent_after(relay, hello, after)
    assert (any(map(is_interest(False), later)), any(map(is_interest(True), later))) == (False, True)


@pytest.mark.parametrize("suback_first", [False, True], ids=["reply-first", "suback-first"])
def test_a_subscribe_at_a_new_qos_while_a_change_to_durable_awaits_its_reply_gets_that_reply(
    broker_factory: Callable[..., Broker], sdk: Callable[..., DurableClient], clients: Callable[..., Client],
    tmp_path: Path, *, relays: Callable[..., PacketRelay], caplog: pytest.LogCaptureFixture, suback_first: bool,
) -> None:
    """Connected: a non-durable filter made durable at its QoS (an `interest` only; a relay in front of the
    real broker spoils it, so the broker refuses it), then subscribe(durable=True) at a new QoS before that
    reply comes (held by the relay, with what follows it, or alone: the SUBACK overtakes it): it sends no
    `interest` of its own (the one awaiting its reply may be applied), returns once it has both that reply and
    its SUBACK, and the reply, a refusal, reaches it: its SUBACK writes `false`, the broker drops the filter
    with the connection, and the reconnect, refused again, subscribes it non-durable. Before, the reply went
    to no subscription and the SUBACK wrote `true`."""
    broker = broker_factory(metrics_interval=0.1)
    relay = relays(broker.port, rewrite=refuse_durable_interests)
    log = tmp_path / "device.jsonl"
    links = Connections()
    device = sdk(relay.port, "cq", delivery_log=log, on_connected=links.connected, on_disconnected=links.disconnected)
    device.connect(timeout=WAIT)
    device.subscribe("cq/t", qos=1, durable=False, timeout=WAIT)
    relay.hold("down", op_is("interest", "down") if suback_first else lambda _packet: True)
    after = len(relay.seen)
    with caplog.at_level(logging.WARNING, logger="durable_client"):
        first, first_outcome = made_durable_in_a_thread(device, "cq/t")
        relay.wait_seen(op_is("interest", "down"), after)  # held
        second, second_outcome = made_durable_in_a_thread(device, "cq/t", qos=0)
        relay.wait_seen(lambda p: p.direction == "down" and p.kind == 9, after)  # its SUBACK
        if suback_first:  # handled: it wrote its record (a timed check, one-sided: it cannot fail wrongly)
            assert wait_until(lambda: len(subscribes(log, "cq/t")) == 2, WAIT), "the SUBACK wrote no record"
            second.join(0.5)
            assert second.is_alive(), f"subscribe() returned before the interest reply: {second_outcome}"
        relay.release("down")
        first.join(WAIT)
        second.join(WAIT)
        assert wait_until(lambda: any("refused 'interest'" in r.getMessage() for r in caplog.records), WAIT)
    assert (first_outcome, second_outcome) == ([None], [None])
    interest = relay.wait_seen(is_interest(True), after)
    assert not any(map(is_interest(True), sent_after(relay, interest, after))), "an `interest` of the new QoS"
    assert [(r["qos"], r["durable"]) for r in subscribes(log, "cq/t")] == [(1, False), (0, False)]
    relay.cut()
    seen_away(clients, broker, 1)  # the broker ended the connection, and the non-durable filter with it
    after = len(relay.seen)
    relay.accept()
    assert links.wait(lambda: links.up == 2), "no reconnect"
    assert relay.wait_seen(op_is("hello", "down"), after).control()["subscriptions"] == {}  # type: ignore[index]
    assert wait_until(lambda: len(subscribes(log, "cq/t")) == 3, WAIT), "no record of the reconnect"
    assert subscribes(log, "cq/t")[2]["durable"] is False
