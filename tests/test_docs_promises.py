"""Promises of README.md and docs/*.md that no other test states, each against a real broker.

Each test names the page and the promise it checks; a black-box reader of the docs would
expect exactly what is asserted here.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import plyvel
import pytest
from test_hostile_wire import wait_until
from test_protocol import ack_each, request, stream_events
from test_recovery_and_crash import EXPIRED_TOPIC, wait_expired

from amqtt_durable.inspect_store import summarize
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, seen_away
from durable_client.protocol import MAX_REQUEST_BYTES

SYS = "$SYS/broker/durable/"
METRICS = {
    "sessions/connected",
    "sessions/disconnected",
    "messages/queued",
    "bytes/queued",
    "messages/enqueued",
    "messages/dropped",
    "messages/dropped_clean",
    "messages/replayed",
    "messages/sent",
    "sessions/expired",
    "sessions/refused",
    "connections/refused",
    "retained/messages",
    "store/commits",
    "store/read_errors",
}
"""docs/operations.md, Metrics: the table of topics under $SYS/broker/durable/."""


def latest(client: Client, name: str) -> int | None:
    values = [int(m.payload) for m in client.messages if m.topic == SYS + name]
    return values[-1] if values else None


def wait_for_more(client: Client, count: int) -> bool:
    """True once ``client`` holds more than ``count`` messages; False if none comes within a second."""
    return client.wait_for(lambda messages: len(messages) > count, timeout=1.0)


# ------------------------------------------------------------------------------ operations.md


def test_every_documented_metric_is_published_as_a_decimal_at_qos_0(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Metrics: fifteen topics, plain decimal numbers, QoS 0; messages/dropped
    counts overflow drops and sessions/expired counts expiries."""
    broker = broker_factory(metrics_interval=0.2, session_expiry=1, max_depth=2, max_depth_disconnected=2)
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe(SYS + "#", 1)
    device = clients(broker.port, "dev-m")
    device.subscribe("m/t", 1)
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("m/t", payloads(4))  # a disconnected limit of 2: two are dropped
    publisher.publish("m/r", [b"kept"], retain=True)
    assert watcher.wait_for(
        lambda _: (
            latest(watcher, "sessions/expired") == 1
            and latest(watcher, "messages/dropped") == 2
            and latest(watcher, "retained/messages") == 1
            and latest(watcher, "messages/enqueued") == 4
        )
    ), sorted({(m.topic, m.payload) for m in watcher.messages})
    seen = {m.topic.removeprefix(SYS) for m in watcher.messages if m.topic.startswith(SYS)}
    assert seen - {"expired"} == METRICS
    for message in watcher.messages:
        if message.topic.removeprefix(SYS) in METRICS:
            assert message.qos == 0 and not message.retain, message.topic
            assert message.payload.isdigit(), (message.topic, message.payload)


def test_sigterm_stops_the_broker_with_status_0_and_the_store_keeps_version_1(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """operations.md: Ctrl-C or SIGTERM shuts the broker down cleanly; store-layout.md: the
    layout version is stored under key `v`."""
    device = clients(broker.port, "dev-t")
    device.subscribe("t/x", 1)
    device.disconnect()
    broker.stop()
    assert broker.exit_status == 0, broker.log()
    db = plyvel.DB(broker.store)
    try:
        assert db.get(b"v") == b"1"
    finally:
        db.close()
    broker.start()
    assert clients(broker.port, "dev-t").session_present is True


# ------------------------------------------------------------------------------ guarantees.md


def test_a_durable_subscriber_gets_the_expired_event_through_its_queue(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry and 'broker-internal messages ($SYS/...) reach durable sessions
    through the same queue': an expiry while the subscriber is away is delivered on its return,
    at QoS 1, with the documented fields."""
    monitor = clients(broker.port, "monitor")
    assert monitor.subscribe(EXPIRED_TOPIC, 1) == [1]
    monitor.disconnect()
    short = clients(broker.port, "short-lived")
    assert request(short, "hello", session_expiry=0.3).fields["session_expiry"] == 0.3
    short.subscribe("s/t", 1)
    short.disconnect()
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(EXPIRED_TOPIC, 1)
    wait_expired(watcher, "short-lived", timeout=WAIT)
    assert monitor.connect() is True
    assert monitor.wait_for(lambda ms: any(m.topic == EXPIRED_TOPIC for m in ms)), "the queued expiry event"
    message = next(m for m in monitor.messages if m.topic == EXPIRED_TOPIC)
    event = json.loads(message.payload)
    assert set(event) == {"client_id", "messages_dropped", "disconnected_at"}
    assert (event["client_id"], event["messages_dropped"], message.qos, message.retain) == ("short-lived", 0, 1, False)


def test_session_expiry_0_deletes_a_session_as_soon_as_it_disconnects(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: `session_expiry: 0` deletes a session as soon as it disconnects."""
    broker = broker_factory(session_expiry=0)
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(EXPIRED_TOPIC, 1)
    device = clients(broker.port, "dev-0")
    device.subscribe("z/t", 1)
    device.disconnect()
    wait_expired(watcher, "dev-0", timeout=WAIT)
    clients(broker.port, "pub", clean_session=True).publish("z/t", [b"nobody queues this"])
    assert device.connect() is False
    assert not device.wait_for(lambda ms: len(ms) > 0, timeout=0.5)


def test_an_unsubscribe_is_stored_before_its_unsuback(broker: Broker, clients: Callable[..., Client]) -> None:
    """guarantees.md, lifecycle: subscriptions are stored before SUBACK. The same must hold for
    their removal and UNSUBACK: a SIGKILL right after the UNSUBACK must not bring the filter back.
    Raw MQTT, so the kill follows the UNSUBACK as closely as a crash could; three rounds."""
    for round_ in range(3):
        client_id, gone, kept = f"unsub-{round_}", f"u{round_}/gone", f"u{round_}/kept"
        with socket.create_connection((HOST, broker.port), timeout=WAIT) as sock:
            connect = mqtt_string("MQTT") + bytes((4, 0x00)) + (60).to_bytes(2, "big") + mqtt_string(client_id)
            sock.sendall(mqtt_packet(0x10, connect))  # clean_session=false
            assert sock.recv(4) == b"\x20\x02\x00\x00"
            subscribe = b"\x00\x01" + mqtt_string(gone) + b"\x01" + mqtt_string(kept) + b"\x01"
            sock.sendall(mqtt_packet(0x82, subscribe))
            assert sock.recv(6) == b"\x90\x04\x00\x01\x01\x01"
            sock.sendall(mqtt_packet(0xA2, b"\x00\x02" + mqtt_string(gone)))
            assert sock.recv(4) == b"\xb0\x02\x00\x02"
            broker.kill()  # right after the UNSUBACK
        broker.start()
        publisher = clients(broker.port, f"pub-{round_}", clean_session=True)
        publisher.publish(gone, [b"unsubscribed"])
        publisher.publish(kept, [b"subscribed"])
        device = clients(broker.port, client_id)
        assert device.session_present is True
        assert device.wait_for(lambda ms: len(ms) >= 1)
        assert not device.wait_for(lambda ms: len(ms) > 1, timeout=0.5), f"round {round_}: the UNSUBSCRIBE was lost"
        assert [m.payload for m in device.messages] == [b"subscribed"]


@pytest.mark.parametrize("kill", [True, False], ids=["sigkill", "sigterm"])
def test_a_session_connected_when_the_broker_stopped_counts_its_expiry_from_the_restart(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], kill: bool
) -> None:
    """guarantees.md, Expiry: 'a session that was connected when the broker stopped gets its deadline
    counted from the restart', whether the broker died or was stopped cleanly (a maintenance stop
    longer than session_expiry must not delete every connected session)."""
    broker = broker_factory(session_expiry=1)
    device = clients(broker.port, "connected-at-stop")
    device.subscribe("c/t", 1)
    broker.kill() if kill else broker.stop()
    device.paho.loop_stop()
    time.sleep(1.5)  # longer than session_expiry, while the broker is down: nothing to synchronise with
    broker.start()
    assert device.connect() is True, "the deadline must count from the restart, not from the stop"


@pytest.mark.parametrize(("overflow", "kept"), [("drop-oldest", [0, 1, 9]), ("drop-newest", [0, 1, 2])])
def test_messages_in_flight_count_towards_the_limit_and_are_never_dropped(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], overflow: str, kept: list[int]
) -> None:
    """guarantees.md, Queue limits: max_depth limits a connected session's queue (max_depth_disconnected
    is for a disconnected one); drop-oldest deletes the oldest message not sent yet (messages in
    flight are never dropped); drop-newest does not queue the new one; drops are counted."""
    broker = broker_factory(max_depth=3, max_depth_disconnected=100, recovery_buffer=2, overflow=overflow)
    device = clients(broker.port, "slow", manual_ack=True)
    device.subscribe("o/t", 1)
    sent = payloads(10)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("o/t", sent[:2])
    assert len(device.wait_messages(2)) == 2, "both fill the in-flight window"
    publisher.publish("o/t", sent[2:])  # one place is left in a queue of 3 holding 2 in flight
    acked = 0
    while acked < len(kept):  # bounded: each pass acknowledges at least one more message
        # A success path (an acknowledgement, its commit, the next send): the full wait, not a second.
        assert device.wait_for(lambda ms, n=acked: len(ms) > n), f"{acked} of {len(kept)} messages came"
        for message in device.messages[acked:]:
            device.paho.ack(message.mid, message.qos)
        acked = len(device.messages)
    assert not wait_for_more(device, acked), "the dropped messages never come"
    assert [m.payload for m in device.messages] == [sent[i] for i in kept]
    device.disconnect()
    broker.stop()
    assert {row.client_id: row.dropped for row in summarize(broker.store)}["slow"] == 7


def test_a_message_larger_than_the_byte_limit_is_dropped_under_drop_newest_too(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: a message larger than the byte limit itself is dropped (counted)
    whatever the policy (test_hostile_disk shows drop-oldest)."""
    broker = broker_factory(max_bytes=10, max_bytes_disconnected=10, overflow="drop-newest")
    device = clients(broker.port, "bytes")
    device.subscribe("b/t", 1)
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("b/t", [b"x" * 20, b"small"])
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 1)
    assert not device.wait_for(lambda ms: len(ms) > 1, timeout=0.5)
    assert [m.payload for m in device.messages] == [b"small"]
    device.disconnect()
    broker.stop()
    assert {row.client_id: row.dropped for row in summarize(broker.store)}["bytes"] == 1


def test_a_retained_message_queued_with_a_subscription_comes_at_the_lower_qos(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md: retained messages matching a new subscription are queued with RETAIN=1 at QoS
    min(subscription, retained)."""
    clients(broker.port, "pub", clean_session=True).publish("r/state", [b"on"], qos=2, retain=True)
    device = clients(broker.port, "dev-r")
    assert device.subscribe("r/#", 1) == [1]
    assert device.wait_for(lambda ms: len(ms) == 1)
    assert [(m.payload, m.retain, m.qos) for m in device.messages] == [(b"on", True, 1)]
    at_most_once = clients(broker.port, "dev-r0")
    assert at_most_once.subscribe("r/#", 0) == [0]
    assert at_most_once.wait_for(lambda ms: [(m.payload, m.retain, m.qos) for m in ms] == [(b"on", True, 0)])


@pytest.mark.parametrize("queue_qos0", [False, True])
def test_a_qos1_publish_to_a_qos0_subscription_is_a_qos0_message_for_queue_qos0(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], queue_qos0: bool
) -> None:
    """guarantees.md / configuration.md `queue_qos0`: messages delivered at QoS 0 (here: a QoS 0
    subscription) are queued for a disconnected session only with `queue_qos0: true`."""
    broker = broker_factory(queue_qos0=queue_qos0, metrics_interval=0.05)
    device = clients(broker.port, "qos0-sub")
    assert device.subscribe("z/t", 0) == [0]
    device.disconnect()
    seen_away(clients, broker, 1)  # else the publish may find the session still connected, which queues QoS 0
    clients(broker.port, "pub", clean_session=True).publish("z/t", [b"at qos 1"], qos=1)
    assert device.connect() is True
    if queue_qos0:
        assert device.wait_for(lambda ms: [(m.payload, m.qos) for m in ms] == [(b"at qos 1", 0)])
    else:
        assert not device.wait_for(lambda ms: len(ms) > 0, timeout=0.5)


def test_overlapping_filters_of_a_durable_session_deliver_a_message_once_at_the_highest_qos(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md: delivered QoS = min(publish QoS, subscription QoS); a durable session with
    several filters matching a topic gets each message once, at the highest QoS they grant."""
    device = clients(broker.port, "overlap")
    assert device.subscribe([("o/#", 0), ("o/b", 1)]) == [0, 1]
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("o/b", [b"live"], qos=2)
    assert device.wait_for(lambda ms: len(ms) >= 1)
    device.disconnect()
    publisher.publish("o/b", [b"queued"], qos=2)
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert not device.wait_for(lambda ms: len(ms) > 2, timeout=0.5)
    assert [(m.payload, m.qos) for m in device.messages] == [(b"live", 1), (b"queued", 1)]


# ------------------------------------------------------------------------------ protocol.md


def test_a_request_of_65536_bytes_is_served_and_one_byte_more_is_malformed(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md, Requests: a request is a JSON object of at most 65,536 bytes."""
    assert MAX_REQUEST_BYTES == 65_536
    client = clients(broker.port, "big-requests", clean_session=True)

    def padded(req: int, size: int) -> bytes:
        bare = json.dumps({"v": 1, "op": "hello", "req": req, "pad": ""}).encode()
        return json.dumps({"v": 1, "op": "hello", "req": req, "pad": "x" * (size - len(bare))}).encode()

    largest = padded(1, 65_536)
    assert len(largest) == 65_536
    assert request(client, "", raw=largest).ok
    too_large = padded(2, 65_537)
    assert len(too_large) == 65_537
    reply = request(client, "", raw=too_large)
    assert (reply.ok, reply.error_code) == (False, "malformed")
    assert request(client, "hello").ok, "the connection stays up"


REFUSED_FIELDS: list[dict[str, Any]] = [
    {"op": "interest"},  # 'filter' missing
    {"op": "hello", "session_expiry": -1},
    {"op": "stream_subscribe", "filter": "a/#", "window": 0},
    {"op": "ready", "client_id": 7},
]


def test_a_refused_request_whose_op_was_read_echoes_op_and_req(broker: Broker, clients: Callable[..., Client]) -> None:
    """protocol.md, Replies: `{"op": "ready", "req": 8, "ok": false, "error": {...}}`: a reply,
    refusals included, names the op and req of the request it answers."""
    client = clients(broker.port, "refused")
    answered = []
    for fields in REFUSED_FIELDS:
        reply = request(client, "", raw=json.dumps({"v": 1, "req": 41, **fields}).encode())
        assert (reply.ok, reply.error_code) == (False, "malformed"), (fields, reply)
        answered.append((reply.op, reply.req))
    assert answered == [(fields["op"], 41) for fields in REFUSED_FIELDS]


def test_age_retention_empties_a_log_whose_ids_go_on(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `streams` max_age, protocol.md stream_info / stream_subscribe: events older
    than max_age are removed, a reader is told of the gap, and ids are never reused."""
    broker = broker_factory(streams=[{"filter": "s/#", "max_age": 0.5}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("s/a", payloads(3))
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_info", filter="s/#").fields["topics"] == {"s/a": {"first": 1, "last": 3, "count": 3}}
    assert wait_until(lambda: request(reader, "stream_info").fields["topics"]["s/a"]["count"] == 0, WAIT)
    reply = request(reader, "stream_subscribe", filter="s/#", after={"s/a": 0})
    assert reply.fields["gaps"] == {"s/a": [1, 3]}
    publisher.publish("s/a", [b"fourth"])
    assert reader.wait_for(lambda ms: any(m.topic == "$durable/v1/stream/s/a" for m in ms))
    assert request(reader, "stream_info").fields["topics"]["s/a"]["last"] == 4


def test_stream_window_is_the_default_window_and_a_request_may_ask_up_to_1000(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `stream_window`: stream events in flight per topic before the client's ack
    (a client may ask for up to 1000)."""
    broker = broker_factory(streams=[{"filter": "w/#"}], stream_window=3)
    clients(broker.port, "pub", clean_session=True).publish("w/a", payloads(5))
    default = clients(broker.port, "default-window", clean_session=True)
    assert request(default, "stream_subscribe", filter="w/#").ok
    assert default.wait_for(lambda _: len(stream_events(default)) >= 3)
    assert not default.wait_for(lambda _: len(stream_events(default)) > 3, timeout=0.5), "3 in flight, no more"
    ack_each(default, "w/a", range(3, 4))  # covers 1..3
    assert default.wait_for(lambda _: [f.seq for _, f, _ in stream_events(default)] == [1, 2, 3, 4, 5])
    widest = clients(broker.port, "widest-window", clean_session=True)
    assert request(widest, "stream_subscribe", filter="w/#", window=1000).ok
    assert widest.wait_for(lambda _: len(stream_events(widest)) == 5)


def test_stream_logs_and_their_ids_survive_a_sigkill_even_once_retention_emptied_them(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """streams.md: every publish to a logged topic is appended in the commit that queues it, before
    the PUBACK; stream logs survive crashes; protocol.md: ids are never reused by one store."""
    broker = broker_factory(streams=[{"filter": "k/#", "max_count": 2}])
    clients(broker.port, "pub", clean_session=True).publish("k/a", payloads(5))
    store_id = request(clients(broker.port, "before", clean_session=True), "stream_info").fields["store"]
    broker.restart(kill=True)
    reader = clients(broker.port, "after", clean_session=True)
    info = request(reader, "stream_info").fields
    assert (info["topics"], info["store"]) == ({"k/a": {"first": 4, "last": 5, "count": 2}}, store_id)
    clients(broker.port, "pub2", clean_session=True).publish("k/a", [b"sixth"])
    assert request(reader, "stream_info").fields["topics"] == {"k/a": {"first": 5, "last": 6, "count": 2}}


def test_a_topic_already_open_keeps_its_position_and_the_reply_does_not_call_it_ahead(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, stream_subscribe: a topic already open on the connection keeps its position (its
    `after` entry is ignored), so the reply's `ahead` (positions past the log's end, after which the
    topic sends nothing) must not name it: its events keep coming."""
    broker = broker_factory(streams=[{"filter": "h/#"}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("h/a", payloads(2))
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="h/#", window=10).ok
    assert reader.wait_for(lambda _: len(stream_events(reader)) == 2)
    again = request(reader, "stream_subscribe", filter="h/#", after={"h/a": 50})
    publisher.publish("h/a", [b"third"])
    assert reader.wait_for(lambda _: len(stream_events(reader)) == 3), "the open topic went on from its position"
    assert again.fields["ahead"] == {}, again.fields
