"""The delivery log's record of a change of durability only (docs/delivery-log.md): written when the
broker's `interest` reply confirms it, not when it is sent. A real broker, the real SDK client, and the
fleet's fault proxy (durable_fleet.proxy.FaultProxy) stalling, then cutting, the link between the two."""

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

from conftest import HOST, WAIT, Broker, Client, seen_away
from durable_client import ConnectionInfo, DurableClient, Marker, RequestTimeout
from durable_fleet.proxy import FaultProxy
from durable_protocol import CONTROL_TOPIC

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


class ControlSent(logging.Handler):
    """Events set once paho logs (the SDK's paho lines are DEBUG, on its network thread) the sending of
    a control request (``sent``: e.g. what a CONNACK makes the client send, ``interest`` then ``hello``),
    or a SUBACK received (``suback``: the client handles it before any packet after it)."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.sent = threading.Event()
        self.suback = threading.Event()
        self.lines = 0

    def emit(self, record: logging.LogRecord) -> None:
        text = record.getMessage()
        self.lines += 1
        if "Sending PUBLISH" in text and CONTROL_TOPIC in text:
            self.sent.set()
        elif text.startswith("Received SUBACK"):
            self.suback.set()


@pytest.fixture
def control_sent() -> Iterator[ControlSent]:
    """A ControlSent on the SDK's paho logger, set up before the client is made (the client only hands
    paho's lines on when that logger asks for DEBUG); at the end, it must have seen paho's lines, so a
    wait on it that times out is a change of paho's wording, not a silent logger."""
    sent = ControlSent()
    paho_log = logging.getLogger("durable_client.paho")
    level = paho_log.level
    paho_log.setLevel(logging.DEBUG)
    paho_log.addHandler(sent)
    try:
        yield sent
    finally:
        paho_log.removeHandler(sent)
        paho_log.setLevel(level)
    assert sent.lines > 0, "no paho line reached durable_client.paho"


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
    live = threading.Condition()
    markers: list[Marker] = []

    def on_live(marker: Marker) -> None:
        with live:
            markers.append(marker)
            live.notify_all()

    device = sdk(port, "flipper", delivery_log=log, on_live=on_live)
    device.subscribe("flip/t", qos=1, durable=False)
    device.connect(timeout=WAIT)
    device.ready_for_events()  # each connection's marker comes once its SUBACKs did
    with live:
        assert live.wait_for(lambda: len(markers) == 1, WAIT), "no marker"
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
    with live:  # after the reconnect's SUBACK, or hello reply, that confirms the change
        assert live.wait_for(lambda: len(markers) == 2, WAIT), "no reconnect"
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


def test_a_filter_unsubscribed_between_connack_and_hello_reply_gets_no_record_at_the_hello_reply(
    sdk: Callable[..., DurableClient], tmp_path: Path, control_sent: ControlSent,
    proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """Made non-durable, then durable again, while disconnected: the reconnect's CONNACK sends durable: true
    before its hello. Unsubscribed after that CONNACK, before the hello reply (the client-to-broker way is
    stalled meanwhile): the hello reply writes no `subscribe` record of the filter after its `unsubscribe`."""
    _broker, proxy, port = proxied()
    log = tmp_path / "device.jsonl"
    links = Connections()
    sent = control_sent
    device = sdk(port, "leaver", delivery_log=log, on_connected=links.connected, on_disconnected=links.disconnected)
    device.connect(timeout=WAIT)
    device.subscribe("leave/t", qos=1, timeout=WAIT)

    proxy.stall(direction="up")  # for the connections to come
    assert proxy.cut("leaver") == 1
    assert links.wait(lambda: links.down == 1), "the cut was not seen"
    device.subscribe("leave/t", qos=1, durable=False)  # disconnected: at once
    device.subscribe("leave/t", qos=1, durable=True)  # made durable again: said before the next hello
    sent.sent.clear()
    proxy.restore("leaver")  # the stall up stays: the CONNECT goes through, what follows is held
    assert sent.sent.wait(WAIT), "no request sent at the CONNACK"
    device.unsubscribe("leave/t")
    proxy.restore()
    assert links.wait(lambda: links.up == 2), "no reconnect"
    found = [(r["kind"], r.get("durable")) for r in records(log, "leave/t")]
    assert found == [("subscribe", True), ("unsubscribe", None)], found


def test_a_change_to_durable_made_while_the_suback_is_on_its_way_waits_for_its_own_reply(
    sdk: Callable[..., DurableClient], clients: Callable[..., Client], tmp_path: Path,
    control_sent: ControlSent, proxied: Callable[..., tuple[Broker, FaultProxy, int]],
) -> None:
    """A new non-durable filter's SUBACK is on its way (the broker-to-client way stalled) when another call
    makes the filter durable (an `interest` sent after the SUBSCRIBE, held on the client-to-broker way):
    the SUBACK, let through first, does not confirm that change. The second call returns at the
    `interest` reply, and the log holds `false` (the SUBACK) then `true` (the reply)."""
    broker, proxy, port = proxied()
    log = tmp_path / "device.jsonl"
    sent = control_sent
    outcome: list[BaseException | None] = []
    device = sdk(port, "twice", delivery_log=log)
    device.connect(timeout=WAIT)

    def make_durable() -> None:
        try:
            device.subscribe("twice/t", qos=1, durable=True, timeout=WAIT)
            outcome.append(None)
        except BaseException as exc:  # handed to the test's thread
            outcome.append(exc)

    watcher = clients(broker.port, "twice-watch", clean_session=True)
    watcher.subscribe("twice/probe", 0)
    assert proxy.stall("twice", direction="down") == 1
    with pytest.raises(RequestTimeout):  # the SUBACK is held
        device.subscribe("twice/t", qos=1, durable=False, timeout=0.3)
    arrived(device, watcher, "twice/probe")
    assert proxy.stall(direction="up") == 1  # now both ways
    sent.sent.clear()
    caller = threading.Thread(target=make_durable, daemon=True)
    caller.start()
    assert sent.sent.wait(WAIT), "the interest was not sent"
    sent.suback.clear()
    proxy.restore("twice")  # the SUBACK comes; the interest stays held
    assert sent.suback.wait(WAIT), "no SUBACK"
    proxy.restore()
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
