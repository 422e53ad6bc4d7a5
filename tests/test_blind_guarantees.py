"""Black-box checks of docs/guarantees.md, docs/protocol.md and docs/streams.md, written from the
documents alone (the hidden tester's view), for promises the other docs tests leave open: edge
values, exact bounds and features working together. Real broker processes, real paho clients and
raw sockets over TCP to 127.0.0.1."""

from __future__ import annotations

import json
import socket
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly, read_packet
from test_protocol import request
from test_qos2_inbound import pubrel_due
from test_recovery_and_crash import EXPIRED_TOPIC, wait_expired

from amqtt_durable.inspect_store import summarize
from conftest import HOST, WAIT, Broker, Client, connack_code, mqtt_packet, mqtt_string, payloads, seen_away


def frame_seq(payload: bytes) -> int:
    """The sequence id of a framed event (docs/protocol.md, Frames: a u64 at offset 10)."""
    return int.from_bytes(payload[10:18], "big")


def acked_through(client: Client, count: int) -> None:
    """Acknowledge the first ``count`` messages of a manual_ack client, each once it has arrived."""
    for index in range(count):
        assert client.wait_for(lambda ms, i=index: len(ms) > i), f"message {index} did not come"
        message = client.messages[index]
        client.paho.ack(message.mid, message.qos)


def nothing_more(client: Client, count: int, timeout: float = 0.5) -> bool:
    """True when no message beyond the first ``count`` comes within ``timeout`` seconds."""
    return not client.wait_for(lambda ms: len(ms) > count, timeout=timeout)


METRICS = {"metrics_interval": 0.05}


def away_subscriber(
    clients: Callable[..., Client], broker: Broker, client_id: str, topic_filter: str, *, manual_ack: bool = False
) -> Client:
    """A durable session subscribed to ``topic_filter`` (QoS 1), disconnected once the broker saw it go
    (a broker with METRICS); connect() it again to read its queue."""
    device = clients(broker.port, client_id, manual_ack=manual_ack)
    assert device.subscribe(topic_filter, 1) == [1]
    device.disconnect()
    seen_away(clients, broker, 1)
    return device


def drops_at_the_end(broker: Broker, device: Client) -> int:
    """Disconnect ``device``, stop the broker and return its session's stored drop count."""
    device.disconnect()
    broker.stop()
    return dropped(broker, device.client_id)


USER = "someone"


def named_users_only(broker: Broker) -> None:
    """``allow_anonymous: false``: a CONNECT needs a username (any, no password), and amqtt counts
    no session as anonymous, so it keeps a disconnected durable session in memory (with
    ``allow_anonymous: true`` its session monitor deletes it about a second after the disconnect:
    docs/guarantees.md). Clients connect with ``username=USER``."""
    broker.extra_plugins["amqtt.plugins.authentication.AnonymousAuthPlugin"] = {"allow_anonymous": False}
    broker.ready = lambda: connack_code(broker.port) == 5  # type: ignore[method-assign]  # anonymous: refused


@pytest.fixture(params=["plugin-reader", "amqtt-reader"])
def on_either_reader(request: pytest.FixtureRequest, broker_factory: Callable[..., Broker]) -> Callable[..., Broker]:
    """Starts a broker with the given settings, read by the plugin's reader or by amqtt's own loop
    (a topic plugin loaded, amqtt's TopicTabooPlugin, which refuses nothing used here): "the
    guarantees are the same there" (docs/guarantees.md)."""

    def start(*, named: bool = False, **settings: object) -> Broker:
        broker = broker_factory(start=False, **settings)
        if request.param == "amqtt-reader":
            broker.extra_plugins["amqtt.plugins.topic_checking.TopicTabooPlugin"] = {}
        if named:
            named_users_only(broker)
        return broker.start()

    return start


def dropped(broker: Broker, client_id: str) -> int:
    """The session's stored drop count (the `dropped` column of `amqtt-durable inspect`); broker stopped."""
    return {row.client_id: row.dropped for row in summarize(broker.store)}[client_id]


# ------------------------------------------------------------------ queue limits and overflow
def test_the_disconnected_limit_stays_after_a_reconnect_until_the_queue_drains_to_80_percent(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "After a reconnect the larger limit stays until the queue drains
    to 80% of `max_depth_disconnected`; then the limit reverts to `max_depth`. Reverting never purges
    anything: it only lowers the bar for new messages." With limits 2 and 10 and 10 queued: at 9 a new
    message is still queued (10 <= 10, nothing dropped); once the queue is at 8 (80%) the limit is 2,
    so the next one drops the oldest message not sent yet (drop-oldest), and nothing else goes."""
    broker = on_either_reader(max_depth=2, max_depth_disconnected=10, recovery_buffer=1, **METRICS)
    device = away_subscriber(clients, broker, "expand", "ex/t", manual_ack=True)
    publisher = clients(broker.port, "pub", clean_session=True)
    queued = payloads(10)
    publisher.publish("ex/t", queued)
    assert device.connect() is True
    acked_through(device, 1)  # m0 acknowledged: 9 queued, m1 in flight
    assert device.wait_for(lambda ms: len(ms) >= 2)
    publisher.publish("ex/t", [b"x"])  # 10 queued: still within the expanded limit
    acked_through(device, 3)  # m1, m2 acknowledged: 8 queued (80% of 10), m3 in flight
    assert device.wait_for(lambda ms: len(ms) >= 4)
    publisher.publish("ex/t", [b"y"])  # past max_depth 2: drop-oldest deletes m4, the oldest not sent
    acked_through(device, 11)
    assert nothing_more(device, 11), [m.payload for m in device.messages]
    assert [m.payload for m in device.messages] == [*queued[:4], *queued[5:], b"x", b"y"]
    assert drops_at_the_end(broker, device) == 1


def test_a_message_exactly_at_the_byte_limit_is_queued_and_pushes_out_the_older_ones(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "A message larger than the byte limit itself is dropped (counted)
    whatever the policy"; one exactly as large as the limit is not larger, so drop-oldest deletes
    the older ones until it fits, and it is queued. One byte more is dropped and deletes nothing."""
    broker = broker_factory(max_bytes=300, max_bytes_disconnected=300, **METRICS)
    device = away_subscriber(clients, broker, "edge", "eb/t")
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("eb/t", [b"a" * 100, b"b" * 100])
    publisher.publish("eb/t", [b"c" * 301])  # larger than the limit: dropped alone
    publisher.publish("eb/t", [b"d" * 300])  # exactly the limit: both older ones go
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 1)
    assert nothing_more(device, 1)
    assert [m.payload for m in device.messages] == [b"d" * 300]
    assert drops_at_the_end(broker, device) == 3


def test_a_queue_filled_exactly_to_its_limit_drops_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "A queue is full when either its message or its byte limit
    would be passed": exactly `max_depth_disconnected` messages and exactly `max_bytes_disconnected`
    bytes pass neither, so nothing is dropped; the next message drops the oldest one."""
    broker = broker_factory(max_depth=3, max_depth_disconnected=3, max_bytes=30, max_bytes_disconnected=30, **METRICS)
    device = away_subscriber(clients, broker, "exact", "ed/t")
    publisher = clients(broker.port, "pub", clean_session=True)
    full = [b"0" * 10, b"1" * 10, b"2" * 10]
    publisher.publish("ed/t", full)
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 3)
    assert nothing_more(device, 3)
    assert [m.payload for m in device.messages] == full
    device.disconnect()
    seen_away(clients, broker, 1)
    publisher.publish("ed/t", [*full, b"3"])
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 6)
    assert nothing_more(device, 6)
    assert [m.payload for m in device.messages[3:]] == [b"1" * 10, b"2" * 10, b"3"]
    assert drops_at_the_end(broker, device) == 1


def test_an_expired_sessions_messages_dropped_counts_what_overflow_left_queued(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md and 424-444: overflow drops are counted as drops when they happen;
    the expiry event's `messages_dropped` and its WARNING's `<m> queued message(s)` count what the
    queue held at expiry: 3 of 5 published to a queue limited to 3, not 5."""
    broker = broker_factory(max_depth=3, max_depth_disconnected=3, session_expiry=1, **METRICS)
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    away_subscriber(clients, broker, "short", "ov/t")
    clients(broker.port, "pub", clean_session=True).publish("ov/t", payloads(5))
    event = wait_expired(monitor, "short", timeout=WAIT)
    assert event["messages_dropped"] == 3
    lines = [line for line in broker.log().splitlines() if "durable session short expired" in line]
    assert len(lines) == 1 and "3 queued message(s) and its subscriptions deleted" in lines[0], lines


# ------------------------------------------------------------------ QoS and overlapping filters
def test_overlapping_filters_queue_one_copy_at_the_highest_qos_and_a_qos0_match_is_not_queued(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "A durable session with several filters matching a topic (`a/#`
    and `a/b`) gets each message once, at the highest QoS those subscriptions grant"; :51-53: a
    message delivered at QoS 0 ("matching a QoS 0 subscription") is not queued for a disconnected
    session (queue_qos0 false by default); :24-25 FIFO. So while disconnected, with `ol/#` at 0 and
    `ol/b` at 2: a QoS 2 publish to ol/b is queued once at QoS 2, a QoS 1 publish to ol/b once at
    QoS 1, one to ol/c (only the QoS 0 filter) not at all. Read on the wire: paho hands a QoS 2
    message to on_message only at its PUBREL, after a QoS 1 message sent behind it."""
    broker = on_either_reader(**METRICS)
    device = raw_connect(broker.port, "overlap", clean=False)
    device.sendall(mqtt_packet(0x82, b"\x00\x01" + mqtt_string("ol/#") + b"\x00" + mqtt_string("ol/b") + b"\x02"))
    assert read_packet(device) == (0x90, b"\x00\x01\x00\x02")
    device.sendall(mqtt_packet(0xE0, b""))
    device.close()
    seen_away(clients, broker, 1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("ol/b", [b"two"], qos=2)
    publisher.publish("ol/c", [b"lost"], qos=1)
    publisher.publish("ol/b", [b"one"], qos=1)
    again = raw_connect(broker.port, "overlap", clean=False)
    first, body = read_packet(again)
    assert (first, body[:6], body[8:]) == (0x34, mqtt_string("ol/b"), b"two"), (first, body)
    second, body2 = read_packet(again)
    assert (second, body2[:6], body2[8:]) == (0x32, mqtt_string("ol/b"), b"one"), (second, body2)
    again.sendall(mqtt_packet(0x50, body[6:8]) + mqtt_packet(0x40, body2[6:8]))  # PUBREC, PUBACK
    assert read_packet(again) == (0x62, body[6:8])
    again.sendall(mqtt_packet(0x70, body[6:8]))  # PUBCOMP
    publisher.publish("ol/c", [b"live"], qos=1)  # connected: delivered at QoS 0
    assert read_packet(again) == (0x30, mqtt_string("ol/c") + b"live"), "ol/c 'lost' was not queued"
    again.close()


def test_a_will_reaches_a_durable_subscriber_at_the_lower_of_its_qos_and_the_subscriptions(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Delivered QoS = min(publish QoS, subscription QoS), durable and
    clean sessions alike ..., wills ... too"; :121-122: wills reach durable sessions through the same
    queue; :33-34 RETAIN=0 on queued messages: a QoS 2 retained will, queued for a disconnected
    QoS 1 durable subscriber, comes at QoS 1 with RETAIN=0; a new subscription gets it retained."""
    watcher = clients(broker.port, "watcher")
    assert watcher.subscribe("wl/+/status", 1) == [1]
    watcher.disconnect()
    dying = clients(broker.port, "dying", clean_session=True, auto_start=False)
    dying.paho.will_set("wl/dying/status", b"offline", qos=2, retain=True)
    dying.connect()
    dying.drop()
    assert watcher.connect() is True
    assert watcher.wait_for(lambda ms: len(ms) >= 1)
    assert nothing_more(watcher, 1)
    assert [(m.topic, m.payload, m.qos, m.retain) for m in watcher.messages] == [
        ("wl/dying/status", b"offline", 1, False)
    ]
    late = clients(broker.port, "late", clean_session=True)
    assert late.subscribe("wl/#", 2) == [2]
    assert late.wait_for(lambda ms: len(ms) >= 1)
    assert [(m.payload, m.qos, m.retain) for m in late.messages] == [(b"offline", 2, True)]


# ------------------------------------------------------------------ retained messages
def test_an_empty_retained_publish_deletes_the_retained_message_and_is_still_delivered(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: a RETAIN=1 PUBLISH "with an empty payload deletes the topic's
    retained message (MQTT-3.3.1-10/11), and the deletion is stored the same way"; MQTT-3.3.1-10 also
    has it "processed as normal by the Server and sent to Clients with a subscription matching the
    topic": a durable subscriber that was away gets it queued (empty, RETAIN=0, :33-34), and after a
    restart a new subscriber gets no retained message."""
    broker = broker_factory()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("er/lamp", [b"on"], qos=1, retain=True)
    device = clients(broker.port, "er-dev")
    assert device.subscribe("er/#", 1) == [1]
    assert device.wait_for(lambda ms: len(ms) >= 1)
    device.disconnect()
    publisher.publish("er/lamp", [b""], qos=1, retain=True)
    publisher.disconnect()
    broker.restart()
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert [(m.payload, m.retain) for m in device.messages] == [(b"on", True), (b"", False)]
    fresh = clients(broker.port, "fresh", clean_session=True)
    assert fresh.subscribe("er/#", 1) == [1]
    marker = clients(broker.port, "pub2", clean_session=True)
    marker.publish("er/end", [b"end"], qos=1)  # a live message after any retained one would come
    assert fresh.wait_for(lambda ms: any(m.topic == "er/end" for m in ms))
    assert [m.topic for m in fresh.messages] == ["er/end"]


def test_a_retained_publish_under_durable_is_never_retained(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Nothing under `_durable/` is ever retained"; docs/protocol.md:
    every PUBLISH under `_durable/` is "never routed, retained or queued". A RETAIN=1 control
    request is answered as usual, and neither right after it nor after a restart does a new
    subscription to `#` or `_durable/#` get anything retained."""
    broker = broker_factory()
    client = clients(broker.port, "ctl-ret", clean_session=True)
    client.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "hello", "req": 1}), qos=1, retain=True)
    client.paho.publish("_durable/other", b"x", qos=1, retain=True)
    assert client.wait_for(lambda ms: len([m for m in ms if m.topic == "$durable/v1/reply"]) >= 2)
    replies = [json.loads(m.payload) for m in client.messages if m.topic == "$durable/v1/reply"]
    assert replies[0]["ok"] is True and replies[1]["error"]["code"] == "unknown_topic", replies
    for _ in range(2):
        reader = clients(broker.port, "reader", clean_session=True)
        assert reader.subscribe([("#", 1), ("_durable/#", 1)]) == [1, 1]
        clients(broker.port, "end", clean_session=True).publish("rt/end", [b"end"])
        assert reader.wait_for(lambda ms: any(m.topic == "rt/end" for m in ms))
        assert [m.topic for m in reader.messages] == ["rt/end"]
        reader.disconnect()
        broker.restart()


def test_a_topic_of_65535_bytes_is_queued_stored_and_delivered_whole(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md and 28-30: a QoS 1 PUBLISH is written to LevelDB for every durable
    session it matches before PUBACK and survives the broker dying. MQTT's longest topic (65,535
    UTF-8 bytes, within the default `max_packet_size` of 1 MB) is an edge value: queued while
    away, kept across a SIGKILL, delivered with its topic whole; retained too."""
    broker = broker_factory()
    topic = "long/" + "x" * (65535 - 5)
    device = clients(broker.port, "long-dev")
    assert device.subscribe(topic, 1) == [1]
    device.disconnect()
    clients(broker.port, "pub", clean_session=True).publish(topic, [b"far", b"kept"], qos=1, retain=True)
    broker.kill()
    broker.start()
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert [(m.topic, m.payload) for m in device.messages] == [(topic, b"far"), (topic, b"kept")]
    fresh = clients(broker.port, "fresh", clean_session=True)
    assert fresh.subscribe("long/+", 1) == [1]
    assert fresh.wait_for(lambda ms: len(ms) >= 1)
    assert [(m.topic, m.payload, m.retain) for m in fresh.messages] == [(topic, b"kept", True)]


# ------------------------------------------------------------------ QoS 2 towards a subscriber
def test_a_qos2_publish_left_without_pubrec_comes_again_with_dup_and_the_same_id(broker: Broker) -> None:
    """docs/guarantees.md: a message that may have been sent before goes out again
    only with DUP=1, at reconnect time, with the same packet id (:443-444); unacknowledged messages
    are not re-sent on the same connection. A QoS 2 PUBLISH interrupted before its PUBREC."""
    device = raw_connect(broker.port, "q2-nopubrec", clean=False)
    assert raw_subscribe(device, "q2n/t", 2) == 2
    publisher = raw_connect(broker.port, "q2-pub", clean=True)
    publisher.sendall(mqtt_packet(0x34, mqtt_string("q2n/t") + b"\x00\x05" + b"body"))
    assert read_packet(publisher) == (0x50, b"\x00\x05")  # PUBREC
    first, body = read_packet(device)
    assert first == 0x34, hex(first)  # QoS 2, DUP 0
    packet_id = body[2 + 5 : 2 + 5 + 2]
    assert body[9:] == b"body"
    device.settimeout(1.0)
    with pytest.raises(TimeoutError):
        read_packet(device)  # not re-sent on the same connection
    device.close()
    again = raw_connect(broker.port, "q2-nopubrec", clean=False)
    first, body = read_packet(again)
    assert (first, body[7:9], body[9:]) == (0x3C, packet_id, b"body"), "QoS 2, DUP 1, same id"
    again.sendall(mqtt_packet(0x50, packet_id))  # PUBREC
    assert read_packet(again) == (0x62, packet_id)
    again.sendall(mqtt_packet(0x70, packet_id))  # PUBCOMP
    again.sendall(mqtt_packet(0xE0, b""))
    again.close()
    publisher.close()


# ------------------------------------------------------------------ control requests
@pytest.mark.parametrize(
    ("op", "fields"),
    [
        ("stream_subscribe", {"filter": "sw/#", "window": 2.0}),
        ("stream_subscribe", {"filter": "sw/#", "window": 0}),
        ("stream_subscribe", {"filter": "sw/#", "window": 1001}),
        ("stream_subscribe", {"filter": "sw/#", "window": True}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/a": 1.0}}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/a": -1}}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/+": 1}}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/#": 1}}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/\u0000": 1}}),
        ("stream_subscribe", {"filter": "sw/#", "after": {"sw/\ud800": 1}}),  # sent as the JSON escape
        ("stream_ack", {"topic": "sw/a", "id": 1.0}),
        ("stream_ack", {"topic": "sw/a", "id": True}),
        ("stream_subscribe", {"filter": ""}),
        ("interest", {"filter": ""}),
    ],
    ids=[
        "window-2.0",
        "window-0",
        "window-1001",
        "window-true",
        "after-id-1.0",
        "after-id-minus-1",
        "after-key-plus",
        "after-key-hash",
        "after-key-nul",
        "after-key-lone-surrogate",
        "ack-id-1.0",
        "ack-id-true",
        "empty-stream-filter",
        "empty-interest-filter",
    ],
)
def test_whole_number_fields_take_integers_only_and_string_fields_refuse_empty(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], op: str, fields: dict[str, object]
) -> None:
    """docs/protocol.md: `malformed` for "a field of the wrong type or out of its range: ...
    `window` a whole number from 1 to 1000; `after` ids whole numbers, 0 or more; `id` a whole
    number, 1 or more; a string field empty" (JSON 2.0 or true is not a whole number, as `v` 1.0 and
    true are refused as not 1, :69-70); `after` keys topics, not filters or names holding U+0000 or
    a lone surrogate (not well-formed UTF-8) (a wildcard key named no topic and was kept as a
    position of a topic without a log, using up max_stream_entries_per_client). A refused request
    changes nothing."""
    broker = broker_factory(streams=[{"filter": "sw/#", "max_count": 10}])
    client = clients(broker.port, "whole")
    reply = request(client, op, **fields)
    assert not reply.ok and reply.error_code == "malformed", reply


def test_the_requests_of_a_clean_session_that_need_a_durable_one_get_no_session(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md column "Needs a durable session": `interest`, `ready` and
    `end_session` are refused with `no_session` on a clean session (echoing `op` and `req`), and
    `hello` there is answered with `epoch`, `session_expiry` and `subscriptions` null."""
    client = clients(broker.port, "clean-ctl", clean_session=True)
    client.subscribe("cc/t", 1)
    for op, fields in (("interest", {"filter": "cc/t"}), ("ready", {}), ("end_session", {})):
        reply = request(client, op, **fields)
        assert (reply.ok, reply.op, reply.error_code) == (False, op, "no_session"), reply
    hello = request(client, "hello")
    assert hello.ok and hello.fields == {"protocol": 1, "epoch": None, "session_expiry": None, "subscriptions": None,
                                       "max_packet_size": 1_048_576}


def test_an_explicit_subscription_to_the_reply_topic_gets_no_other_connections_replies(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "Replies, markers and stream events are written to the one
    connection concerned, never routed; ... subscribing to them explicitly receives nothing"."""
    spy = clients(broker.port, "spy", clean_session=True)
    assert spy.subscribe([("$durable/v1/reply", 1), ("$durable/#", 1)]) == [1, 1]
    asker = clients(broker.port, "asker")
    assert request(asker, "hello").ok
    assert request(asker, "ready").ok
    assert asker.wait_for(lambda ms: any(m.topic == "$durable/v1/marker" for m in ms))
    spy.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "hello", "req": 5}), qos=0)
    assert spy.wait_for(lambda ms: len(ms) >= 1)
    assert nothing_more(spy, 1)
    assert [json.loads(m.payload)["req"] for m in spy.messages] == [5], "its own reply only"


def test_a_stream_ack_past_the_last_event_sent_is_refused_or_ignored_without_skipping_events(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: "`stream_ack` with `id` N releases every id up to N of that topic,
    and the broker fills the window again at once. An `id` past the last one sent on the connection
    counts as that last one: events not sent yet still come, none is skipped": with a window of 1
    and 3 events logged, an ack of id 3 right after event 1 came lets event 2 come, and event 3
    only once event 2 is acknowledged."""
    broker = broker_factory(streams=[{"filter": "sa/#", "max_count": 10}])
    clients(broker.port, "pub", clean_session=True).publish("sa/a", payloads(3, "e"))
    reader = clients(broker.port, "sa-reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="sa/#", window=1).ok
    stream = "$durable/v1/stream/sa/a"
    assert reader.wait_for(lambda ms: any(m.topic == stream for m in ms))
    reader.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "stream_ack", "topic": "sa/a", "id": 3}))
    assert reader.wait_for(lambda ms: len([m for m in ms if m.topic == stream]) >= 2), "event 2 comes"
    assert not reader.wait_for(lambda ms: len([m for m in ms if m.topic == stream]) >= 3, timeout=0.5), "window 1"
    reader.paho.publish("_durable/v1/ctl", json.dumps({"v": 1, "op": "stream_ack", "topic": "sa/a", "id": 2}))
    assert reader.wait_for(lambda ms: len([m for m in ms if m.topic == stream]) >= 3), "event 3 comes"
    events = [(frame_seq(m.payload), m.payload[26:]) for m in reader.messages if m.topic == stream]
    assert events == list(zip([1, 2, 3], payloads(3, "e"), strict=True)), events


# ------------------------------------------------------------------ retained and re-subscribed, on the wire
def release(sock: socket.socket, packet_id: bytes) -> None:
    """PUBREL of an inbound QoS 2 publish, and its PUBCOMP."""
    sock.sendall(mqtt_packet(0x62, packet_id))
    assert read_packet(sock) == (0x70, packet_id)


def publish_exactly_once(sock: socket.socket, topic: str, payload: bytes, packet_id: bytes) -> None:
    """A whole QoS 2 publish: PUBLISH, PUBREC, PUBREL, PUBCOMP."""
    sock.sendall(mqtt_packet(0x34, mqtt_string(topic) + packet_id + payload))
    assert read_packet(sock) == (0x50, packet_id)
    release(sock, packet_id)


def publish_id(body: bytes) -> bytes:
    """The packet id of a QoS 1/2 PUBLISH's body."""
    start = 2 + int.from_bytes(body[:2], "big")
    return body[start : start + 2]


def publish_parts(first: int, body: bytes) -> tuple[int, bool, bool, str, bytes]:
    """(QoS, DUP, RETAIN, topic, payload) of a PUBLISH read as (first byte, body)."""
    assert first >> 4 == 3, hex(first)
    qos, end = (first >> 1) & 3, 2 + int.from_bytes(body[:2], "big")
    return qos, bool(first & 0x08), bool(first & 0x01), body[2:end].decode(), body[end + (2 if qos else 0) :]


def test_retained_messages_of_a_new_subscription_queue_behind_what_the_session_has_and_before_live(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Retained messages matching a new subscription are queued, with
    the subscription and before any live message it matches, behind what the session already has
    (RETAIN=1, QoS min(subscription, retained))". With a window of 1 and two messages still queued,
    a SUBSCRIBE's retained message comes after them, and a live one published after the SUBACK
    after it."""
    broker = on_either_reader(recovery_buffer=1)
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rb/state", [b"on"], qos=2, retain=True)
    device = raw_connect(broker.port, "rb-dev", clean=False)
    assert raw_subscribe(device, "rb/q", 1) == 1
    publisher.publish("rb/q", [b"q0", b"q1", b"q2"])
    first, body = read_packet(device)
    assert publish_parts(first, body)[3:] == ("rb/q", b"q0")
    assert raw_subscribe(device, "rb/+", 1, packet_id=2) == 1  # the window (1) is full: nothing else came
    publisher.publish("rb/state", [b"live"])
    got = []
    for _ in range(4):
        device.sendall(mqtt_packet(0x40, publish_id(body)))  # PUBACK the one in flight
        first, body = read_packet(device)
        got.append(publish_parts(first, body))
    assert got == [
        (1, False, False, "rb/q", b"q1"),
        (1, False, False, "rb/q", b"q2"),
        (1, False, True, "rb/state", b"on"),
        (1, False, False, "rb/state", b"live"),
    ], got
    device.close()


def test_a_resubscribe_at_a_lower_qos_leaves_the_queued_messages_at_theirs(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "A SUBSCRIBE of a filter the session already holds replaces that
    subscription: messages published after it come at the new QoS (those already queued for a
    durable session keep the QoS they were queued at)"."""
    broker = on_either_reader(recovery_buffer=1)
    device = raw_connect(broker.port, "rq-dev", clean=False)
    assert raw_subscribe(device, "rq/t", 2) == 2
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rq/t", [b"p0", b"p1", b"p2"], qos=2)
    first, body = read_packet(device)
    assert publish_parts(first, body) == (2, False, False, "rq/t", b"p0")
    assert raw_subscribe(device, "rq/t", 1, packet_id=2) == 1
    publisher.publish("rq/t", [b"new"], qos=2)
    got = [publish_parts(first, body)]
    while len(got) < 4:
        packet_id = publish_id(body)
        if got[-1][0] == 2:
            device.sendall(mqtt_packet(0x50, packet_id))  # PUBREC
            assert read_packet(device) == (0x62, packet_id)
            device.sendall(mqtt_packet(0x70, packet_id))  # PUBCOMP
        else:
            device.sendall(mqtt_packet(0x40, packet_id))
        first, body = read_packet(device)
        got.append(publish_parts(first, body))
    assert [(qos, payload) for qos, _, _, _, payload in got] == [(2, b"p0"), (2, b"p1"), (2, b"p2"), (1, b"new")]
    device.close()


# ------------------------------------------------------------------ packet size bound
def test_a_packet_exactly_max_packet_size_long_is_read_and_one_byte_more_closes(
    on_either_reader: Callable[..., Broker],
) -> None:
    """docs/guarantees.md (Packet size): "a packet whose remaining length is larger than
    `max_packet_size` ... closes the connection right after its fixed header": one whose remaining
    length is exactly the limit is not larger, and is acknowledged."""
    broker = on_either_reader(max_packet_size=1024)
    sock = raw_connect(broker.port, "ps", clean=True)
    head = mqtt_string("ps/t") + b"\x00\x07"
    sock.sendall(mqtt_packet(0x32, head + b"x" * (1024 - len(head))))
    assert read_packet(sock) == (0x40, b"\x00\x07")
    sock.sendall(mqtt_packet(0x32, b"\x00\x04ps/t\x00\x08" + b"x" * (1025 - len(head))))
    sock.settimeout(WAIT)
    assert sock.recv(16) == b"", "closed unanswered"
    sock.close()
    assert "1025" in broker.log() and "1024" in broker.log()


# ------------------------------------------------------------------ streams
def test_every_publish_to_a_logged_topic_is_logged_qos_0_and_retained_ones_too(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/streams.md: "Every publish to a logged topic is appended to its log";
    docs/protocol.md: flag bits 3-4 carry "the publish QoS of a stream event": a QoS 0, a
    retained QoS 1 and a QoS 2 publish get ids 1, 2, 3 and their own QoS in the frame."""
    broker = broker_factory(streams=[{"filter": "lg/#", "max_count": 10}])
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("lg/a", [b"zero"], qos=0)
    publisher.publish("lg/a", [b"one"], qos=1, retain=True)
    publisher.publish("lg/a", [b"two"], qos=2)
    reader = clients(broker.port, "lg-reader", clean_session=True)
    reply = request(reader, "stream_subscribe", filter="lg/#", window=10)
    assert reply.fields["topics"] == {"lg/a": {"first": 1, "last": 3}}, reply
    stream = "$durable/v1/stream/lg/a"
    assert reader.wait_for(lambda ms: len([m for m in ms if m.topic == stream]) >= 3)
    events = [
        (frame_seq(m.payload), (m.payload[1] & 0x18) >> 3, m.payload[26:]) for m in reader.messages if m.topic == stream
    ]
    assert events == [(1, 0, b"zero"), (2, 1, b"one"), (3, 2, b"two")]


def test_an_empty_control_request_is_malformed_with_op_and_req_null(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md: not UTF-8 JSON is `malformed`, "answered with `op` and `req`
    null"; :51-53: "an empty one counts too" (an empty PUBLISH to the control topic is a request)."""
    client = clients(broker.port, "empty-ctl")
    reply = request(client, "", raw=b"")
    assert (reply.ok, reply.op, reply.req, reply.error_code) == (False, None, None, "malformed"), reply


def test_a_message_left_in_flight_replays_with_dup_and_the_redelivered_and_replayed_flags(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md flags `0x01` replayed, `0x04` redelivered (sent before); :90 `ready`:
    "the broker sends the recovery buffer and what was queued up to this point (flag
    `replayed`), then a marker"; :134 `replayed` counts the messages sent before the marker with
    that flag; docs/guarantees.md: a message that may have been sent before goes out again
    only with DUP=1."""
    device = clients(broker.port, "rd-dev", manual_ack=True)
    assert request(device, "hello").ok
    assert device.subscribe("rd/t", 1) == [1]
    assert request(device, "ready").ok
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rd/t", [b"sent"])
    assert device.wait_for(lambda ms: any(m.topic == "rd/t" for m in ms))
    device.drop()
    publisher.publish("rd/t", [b"queued"])
    again = clients(broker.port, "rd-dev", manual_ack=True)
    assert request(again, "hello").ok
    assert request(again, "ready").ok
    assert again.wait_for(lambda ms: any(m.topic == "$durable/v1/marker" for m in ms))
    got = [(m.payload[26:], m.dup, m.payload[1]) for m in again.messages if m.topic == "rd/t"]
    assert got == [(b"sent", True, 0x05), (b"queued", False, 0x01)], got
    marker = json.loads(next(m.payload for m in again.messages if m.topic == "$durable/v1/marker"))
    assert marker["replayed"] == 2, marker


def test_after_topics_outside_the_filter_unknown_fields_and_closing_an_unopened_filter(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/protocol.md, Requests: "Fields an op does not take are ignored"; `stream_subscribe`:
    "an `after` topic the filter does not match is ignored"; `stream_unsubscribe`: "Reply: `filter`
    (also for a filter that is not open: there is nothing to close)"."""
    broker = broker_factory(streams=[{"filter": "ig/#", "max_count": 10}])
    clients(broker.port, "pub", clean_session=True).publish("ig/a", payloads(2, "e"))
    reader = clients(broker.port, "ig-reader", clean_session=True)
    reply = request(reader, "stream_subscribe", filter="ig/a", after={"ig/b": 1, "elsewhere": 5}, colour="blue")
    assert reply.ok and reply.fields == {
        "filter": "ig/a",
        "topics": {"ig/a": {"first": 1, "last": 2}},
        "gaps": {},
        "ahead": {},
    }, reply
    stream = "$durable/v1/stream/ig/a"
    assert reader.wait_for(lambda ms: any(m.topic == stream for m in ms))
    assert frame_seq(next(m.payload for m in reader.messages if m.topic == stream)) == 1
    closed = request(reader, "stream_unsubscribe", filter="ig/never")
    assert (closed.ok, closed.fields) == (True, {"filter": "ig/never"}), closed


def test_retained_messages_of_a_new_subscription_obey_the_queue_limit(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: retained messages matching a new subscription are queued and
    "count against the queue's limits as any message: more than the queue has room for are handled
    by its `overflow` policy, one at a time"; :431-437 drops are counted per session."""
    broker = broker_factory(max_depth=2, max_depth_disconnected=2, recovery_buffer=1)
    publisher = clients(broker.port, "pub", clean_session=True)
    retained = {f"rl/{i}": f"v{i}".encode() for i in range(4)}
    for topic, value in retained.items():
        publisher.publish(topic, [value], retain=True)
    device = clients(broker.port, "rl-dev")
    assert device.subscribe("rl/#", 1) == [1]
    assert device.wait_for(lambda ms: len(ms) >= 2)
    assert nothing_more(device, 2)
    assert all(m.retain and retained[m.topic] == m.payload for m in device.messages)
    assert drops_at_the_end(broker, device) == 2


def test_a_qos2_message_waiting_for_its_pubcomp_is_never_dropped_by_overflow(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: drop-oldest deletes "the oldest one not sent yet: messages in
    flight, and QoS 2 messages waiting for their PUBCOMP, are never dropped"; :441-443 a QoS 2
    message stays until its PUBCOMP and a PUBREC is stored, so PUBREL is re-sent. A message whose
    PUBREC came holds its place in a queue of 2 while later ones overflow; its PUBREL comes again
    after a reconnect, and once PUBCOMP comes the newest message follows."""
    broker = on_either_reader(max_depth=2, max_depth_disconnected=2, recovery_buffer=1, **METRICS)
    device = raw_connect(broker.port, "pc-dev", clean=False)
    assert raw_subscribe(device, "pc/t", 2) == 2
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("pc/t", [b"p0"], qos=2)
    first, body = read_packet(device)
    packet_id = publish_id(body)
    assert publish_parts(first, body) == (2, False, False, "pc/t", b"p0")
    device.sendall(mqtt_packet(0x50, packet_id))  # PUBREC
    assert read_packet(device) == (0x62, packet_id)  # PUBREL; no PUBCOMP yet
    publisher.publish("pc/t", [b"p1", b"p2", b"p3"], qos=2)  # p1, then p2 dropped: p0 stays
    device.close()
    seen_away(clients, broker, 1)
    again = raw_connect(broker.port, "pc-dev", clean=False)
    assert read_packet(again) == (0x62, packet_id), "PUBREL again: p0 was kept"
    again.sendall(mqtt_packet(0x70, packet_id))  # PUBCOMP
    first, body = read_packet(again)
    assert publish_parts(first, body) == (2, False, False, "pc/t", b"p3")
    again.close()
    broker.stop()
    assert dropped(broker, "pc-dev") == 2


def test_a_keepalive_of_0_turns_the_silence_check_off(broker: Broker) -> None:
    """docs/guarantees.md: "A client silent for 1.5 times its keep-alive ... is
    disconnected (...; a keep-alive of 0 turns the check off, MQTT-3.1.2-10, unless
    `max_keepalive` is set)": silent for 2 s (past 1.5 x 0 and 1.5 x 1), it is still served."""
    sock = raw_connect(broker.port, "ka0", clean=True, keepalive=0)
    sock.settimeout(2.0)
    with pytest.raises(TimeoutError):
        sock.recv(1)  # the broker neither writes nor closes
    sock.settimeout(WAIT)
    sock.sendall(bytes((0xC0, 0)))  # PINGREQ
    assert read_packet(sock) == (0xD0, b"")
    sock.close()


def test_a_hello_after_ready_frames_what_follows_and_holds_nothing(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/protocol.md `hello`: "Marks the session as an SDK session (framed events, the
    session's messages held until `ready` ...)"; "A `hello` after the connection's `ready` holds
    nothing: the messages after it come at once, framed"; :90 one marker per connection."""
    device = clients(broker.port, "late-hello")
    assert device.subscribe("lh/t", 1) == [1]
    assert request(device, "ready").fields == {"already": False}
    assert device.wait_for(lambda ms: any(m.topic == "$durable/v1/marker" for m in ms))
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("lh/t", [b"plain"])
    assert device.wait_for(lambda ms: any(m.topic == "lh/t" for m in ms))
    hello = request(device, "hello")
    assert hello.ok and hello.fields["subscriptions"] == {"lh/t": 1}
    publisher.publish("lh/t", [b"framed"])
    assert device.wait_for(lambda ms: len([m for m in ms if m.topic == "lh/t"]) >= 2), "not held"
    first, second = [m.payload for m in device.messages if m.topic == "lh/t"]
    assert first == b"plain"
    assert (second[0], second[1], int.from_bytes(second[2:10], "big"), second[26:]) == (
        1,
        0,
        hello.fields["epoch"],
        b"framed",
    )
    assert len([m for m in device.messages if m.topic == "$durable/v1/marker"]) == 1


def test_an_expiry_event_is_queued_for_a_disconnected_durable_sys_subscriber(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Wills and broker-internal messages (`$SYS/...`) reach durable
    sessions through the same queue"; :105-110 the expiry event, published at QoS 1 on
    `$SYS/broker/durable/expired`; :33-34 RETAIN=0 on queued messages. The watcher's own expiry is
    set longer with a `hello` (protocol.md)."""
    broker = broker_factory(session_expiry=1, max_session_expiry=3600, **METRICS)
    watcher = clients(broker.port, "sys-watcher")
    assert request(watcher, "hello", session_expiry=600).fields["session_expiry"] == 600
    assert watcher.subscribe("$SYS/broker/durable/expired", 1) == [1]
    watcher.disconnect()
    seen_away(clients, broker, 1)
    victim = clients(broker.port, "victim")
    victim.disconnect()
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    wait_expired(monitor, "victim", timeout=WAIT)
    assert watcher.connect() is True
    assert request(watcher, "ready").ok
    assert watcher.wait_for(lambda ms: any(m.topic == EXPIRED_TOPIC for m in ms))
    (event,) = [m for m in watcher.messages if m.topic == EXPIRED_TOPIC]
    body = json.loads(event.payload[26:])
    assert (body["client_id"], body["messages_dropped"], event.qos, event.retain) == ("victim", 0, 1, False)


def test_a_qos2_publish_sent_again_before_its_pubrel_is_routed_once_on_any_connection(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: for a durable publisher, "Until its PUBREL comes, a PUBLISH with
    that packet id (DUP or not, on any connection ...) gets PUBREC and is not routed again
    (MQTT-4.3.3-2). PUBREL deletes the stored id and PUBCOMP follows ..., so the id is free for a
    new message". Re-sent on the same connection with DUP, then on a new connection without DUP
    (no crash); after PUBCOMP the same id carries a new message."""
    broker = on_either_reader(named=True)
    subscriber = clients(broker.port, "q2-sub", username=USER)
    assert subscriber.subscribe("q2a/t", 2) == [2]
    publisher = raw_connect(broker.port, "q2-durable-pub", clean=False, username=USER)
    packet = mqtt_packet(0x34, mqtt_string("q2a/t") + b"\x00\x15" + b"once")
    publisher.sendall(packet)
    assert read_packet(publisher) == (0x50, b"\x00\x15")
    publisher.sendall(bytes((packet[0] | 0x08,)) + packet[1:])  # DUP, same connection
    assert read_packet(publisher) == (0x50, b"\x00\x15")
    publisher.close()
    again = raw_connect(broker.port, "q2-durable-pub", clean=False, username=USER)
    assert read_packet(again) == (0x50, b"\x00\x15"), "its PUBREC, sent again on the reconnect"
    again.sendall(packet)  # not DUP, another connection
    assert read_packet(again) == (0x50, b"\x00\x15")
    release(again, b"\x00\x15")
    publish_exactly_once(again, "q2a/t", b"new", b"\x00\x15")  # the id is free again
    assert subscriber.wait_for(lambda ms: len(ms) >= 2)
    assert nothing_more(subscriber, 2)
    assert [m.payload for m in subscriber.messages] == [b"once", b"new"]
    again.close()


def test_a_reconnected_publisher_owing_a_pubrel_is_served_at_once_and_its_packet_id_freed(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: until its PUBREL comes, the packet id of a durable publisher's QoS 2
    PUBLISH is held; "On a reconnect the broker sends again the PUBREC of each QoS 2 publish still
    awaiting its PUBREL ...; the client may send the PUBREL when it likes: nothing else of the
    connection waits for it". "PUBREL deletes the stored id and PUBCOMP follows ..., so the id is
    free for a new message". A publisher that subscribes before its PUBREL gets its SUBACK at once
    (amqtt held the
    connection's message loop up to 10 s for that PUBREL, then lost the message for clean
    subscribers and the next one with that packet id for durable ones)."""
    broker = on_either_reader(named=True)
    durable = clients(broker.port, "q2r-durable", username=USER)
    assert durable.subscribe("q2r/t", 2) == [2]
    clean = clients(broker.port, "q2r-clean", clean_session=True, username=USER)
    assert clean.subscribe("q2r/t", 2) == [2]
    publisher = raw_connect(broker.port, "q2r-pub", clean=False, username=USER)
    publisher.sendall(mqtt_packet(0x34, mqtt_string("q2r/t") + b"\x00\x15" + b"first"))
    assert read_packet(publisher) == (0x50, b"\x00\x15")
    publisher.close()  # gone before its PUBREL
    again = raw_connect(broker.port, "q2r-pub", clean=False, username=USER)
    assert read_packet(again) == (0x50, b"\x00\x15"), "its PUBREC again"
    again.settimeout(3.0)  # well below amqtt's 10 s
    assert raw_subscribe(again, "q2r/other", 1, packet_id=5) == 1
    release(again, b"\x00\x15")
    publish_exactly_once(again, "q2r/t", b"second", b"\x00\x15")
    for subscriber in (durable, clean):
        assert subscriber.wait_for(lambda ms: len(ms) >= 2), subscriber.client_id
        assert nothing_more(subscriber, 2)
        assert [m.payload for m in subscriber.messages] == [b"first", b"second"], subscriber.client_id
    again.close()


def reconnect_with_pubrel(port: int, client_id: str, packet_id: bytes, *, pipelined: bool) -> socket.socket:
    """CONNECT (clean_session=0, username USER) and the PUBREL it owes for ``packet_id``: in the
    same write, or right after CONNACK (session present)."""
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    pubrel = mqtt_packet(0x62, packet_id)
    if pipelined:
        sock.sendall(connect_packet(client_id, clean=False, username=USER) + pubrel)
        connack = read_exactly(sock, 4)
    else:
        sock.sendall(connect_packet(client_id, clean=False, username=USER))
        connack = read_exactly(sock, 4)
        sock.sendall(pubrel)
    assert connack[:2] == b"\x20\x02" and connack[3] == 0, connack
    return sock


@pytest.mark.parametrize("stored", [False, True], ids=["nothing-stored", "stored"])
@pytest.mark.parametrize("pipelined", [True, False], ids=["pubrel-with-connect", "pubrel-after-connack"])
def test_a_pubrel_sent_at_once_on_the_reconnect_completes_the_flow(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], pipelined: bool, stored: bool
) -> None:
    """docs/guarantees.md, Guarantees, Exactly-once: "the client may send the PUBREL when it likes",
    "PUBREL deletes the stored id and PUBCOMP follows ..., so the id is free for a new message". A
    reconnecting durable publisher sends its owed PUBREL at once (MQTT-3.1.4: packets may follow
    CONNECT without waiting for CONNACK), before the broker re-sent the PUBREC: the message reaches
    the clean subscriber once, and the id then carries a new message to a durable session. Its
    first publish matched a durable session (stored) or none (nothing stored: the durable
    subscriber came after it). A PUBREL read in the same write as the CONNECT was answered with a
    bare PUBCOMP before the re-run flow waited for it: the message never reached clean
    subscribers and the next one with that id counted as a re-send."""
    packet_id = b"\x00\x21"
    broker = on_either_reader(named=True)
    if stored:
        assert clients(broker.port, "race-early", username=USER).subscribe("race/#", 2) == [2]
    clean = clients(broker.port, "race-clean", clean_session=True, username=USER)
    assert clean.subscribe("race/t", 2) == [2]
    publisher = raw_connect(broker.port, "race-pub", clean=False, username=USER)
    publisher.sendall(mqtt_packet(0x34, mqtt_string("race/t") + packet_id + b"first"))
    assert read_packet(publisher) == (0x50, packet_id)
    publisher.close()  # gone before its PUBREL
    durable = clients(broker.port, "race-durable", username=USER)
    assert durable.subscribe("race/t", 2) == [2]
    again = reconnect_with_pubrel(broker.port, "race-pub", packet_id, pipelined=pipelined)
    seen = [read_packet(again)]
    while seen[-1] != (0x70, packet_id):  # a PUBREC may come first (bounded by the socket timeout)
        assert len(seen) < 3 and seen[-1] == (0x50, packet_id), seen
        seen.append(read_packet(again))
    assert clean.wait_for(lambda ms: len(ms) >= 1), f"first lost for clean subscribers; the broker sent {seen}"
    publish_exactly_once(again, "race/t", b"second", packet_id)
    assert durable.wait_for(lambda ms: any(m.payload == b"second" for m in ms)), f"the broker sent {seen}"
    assert clean.wait_for(lambda ms: len(ms) >= 2)
    assert nothing_more(clean, 2)
    assert [m.payload for m in clean.messages] == [b"first", b"second"]
    assert [m.payload for m in durable.messages] == [b"second"]
    again.close()


@pytest.mark.parametrize("clean_publisher", [True, False])
def test_a_duplicate_pubrel_in_one_write_delivers_once(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], clean_publisher: bool
) -> None:
    """docs/guarantees.md, Exactly-once: a QoS 2 message reaches each subscriber once, and MQTT-4.3.3
    wants a PUBCOMP for every PUBREL. A publisher that sends its PUBREL twice in one write (a
    re-send) gets two PUBCOMPs, and the clean subscriber the message once. The second PUBREL,
    handled before the flow the first released had ended, delivered the message again and got no
    PUBCOMP (amqtt's flow then found its message gone)."""
    packet_id = b"\x00\x21"
    broker = broker_factory()
    clean = clients(broker.port, "dup-clean", clean_session=True)
    assert clean.subscribe("dup/#", 2) == [2]
    publisher = raw_connect(broker.port, "dup-pub", clean=clean_publisher)
    publisher.sendall(mqtt_packet(0x34, mqtt_string("dup/t") + packet_id + b"first"))
    assert read_packet(publisher) == (0x50, packet_id)
    publisher.sendall(mqtt_packet(0x62, packet_id) + mqtt_packet(0x62, packet_id))
    assert read_packet(publisher) == (0x70, packet_id)
    assert read_packet(publisher) == (0x70, packet_id)
    assert clean.wait_for(lambda ms: len(ms) >= 1)
    assert nothing_more(clean, 1, timeout=1.0), [m.payload for m in clean.messages]
    publisher.close()


def test_a_pubrel_sent_twice_gets_its_pubcomp_only_once_the_deletion_is_written(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md, Exactly-once: "PUBREL deletes the stored id and PUBCOMP follows once the
    deletion is written". A PUBREL sent twice while the deletion is still being written (a long
    batch_delay_ms) got its PUBCOMP at once for the second one, which found the id gone from memory:
    a SIGKILL right at that PUBCOMP left the id stored, so the client's next publish with it would
    have been taken for a re-send and never routed."""
    packet_id = b"\x00\x21"
    broker = broker_factory(start=False, sync=True, batch_delay_ms=1500, pending_threshold=1000)
    named_users_only(broker)
    broker.start()
    durable = clients(broker.port, "twice-durable", username=USER)
    assert durable.subscribe("twice/#", 2) == [2]
    durable.disconnect()
    publisher = raw_connect(broker.port, "twice-pub", clean=False, username=USER)
    publisher.sendall(mqtt_packet(0x34, mqtt_string("twice/t") + packet_id + b"first"))
    assert read_packet(publisher) == (0x50, packet_id)
    publisher.sendall(mqtt_packet(0x62, packet_id) + mqtt_packet(0x62, packet_id))
    assert read_packet(publisher) == (0x70, packet_id)
    broker.kill()
    assert pubrel_due(broker) == {}


# ------------------------------------------------------------------ topic matching at the edges
FILTERS = ["tm/#", "tm/+", "+/+", "tm/+/x", "#", "+"]
TOPICS = ["tm", "tm/", "/x", "tm//x", "tm/a/x", "x", "/"]


def expected_matches(topic_filter: str, topic: str) -> bool:
    """MQTT 3.1.1 section 4.7: `+` one whole level (empty too), `#` the rest, also the parent level."""
    levels, pattern = topic.split("/"), topic_filter.split("/")
    for index, part in enumerate(pattern):
        if part == "#":
            return True
        if index >= len(levels) or (part != "+" and part != levels[index]):
            return False
    return len(levels) == len(pattern)


def test_durable_and_clean_sessions_match_empty_levels_and_parent_levels_alike(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: routing walks a trie of the wildcard filters (durable sessions'
    filters, and a mirror of amqtt's table of clean sessions' filters); MQTT 3.1.1 section 4.7: `tm/#`
    also matches `tm` (MQTT-4.7.1-2), `+` matches an empty level (`tm/`, `/x`, `tm//x`). A durable and
    a clean subscriber of the same filter get the same messages: those MQTT says match."""
    subscribers = []
    for index, topic_filter in enumerate(FILTERS):
        for clean in (False, True):
            subscriber = clients(broker.port, f"tm-{index}-{clean}", clean_session=clean)
            assert subscriber.subscribe(topic_filter, 1) == [1]
            subscribers.append((topic_filter, subscriber))
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("tm/end", [b"first"])
    for topic in TOPICS:
        publisher.publish(topic, [b"m"])
    publisher.publish("tm/a/x", [b"last"])
    published = ["tm/end", *TOPICS, "tm/a/x"]
    for topic_filter, subscriber in subscribers:
        count = len([t for t in published if expected_matches(topic_filter, t)])
        assert subscriber.wait_for(lambda ms, n=count: len(ms) >= n), (topic_filter, subscriber.client_id)
    for topic_filter, subscriber in subscribers:
        expected = [t for t in published if expected_matches(topic_filter, t)]
        assert nothing_more(subscriber, len(expected), timeout=0.1)
        assert [m.topic for m in subscriber.messages] == expected, (topic_filter, subscriber.client_id)


def test_a_take_over_gets_the_unacknowledged_messages_first_with_dup_and_ends_the_old_connection(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md: "Take-over: a second connection with the same client id ... takes
    the session over (amqtt closes the old one); delivery continues on the new connection,
    unacknowledged messages first"; :30-32 with DUP=1; :454-455 they were not re-sent on the old
    connection."""
    broker = on_either_reader(recovery_buffer=3)
    old = clients(broker.port, "tk-dev", manual_ack=True)
    assert old.subscribe("tk/t", 1) == [1]
    publisher = clients(broker.port, "pub", clean_session=True)
    sent = payloads(5)
    publisher.publish("tk/t", sent)
    assert old.wait_for(lambda ms: len(ms) >= 3)
    new = clients(broker.port, "tk-dev")
    assert new.session_present is True
    assert old.wait_disconnected(), "amqtt closes the old connection"
    assert new.wait_for(lambda ms: len(ms) >= 5)
    assert nothing_more(new, 5)
    assert [(m.payload, m.dup) for m in new.messages] == [(p, i < 3) for i, p in enumerate(sent)]
    assert [m.payload for m in old.messages] == sent[:3]


@pytest.mark.parametrize(
    "case",
    [
        (0, {"gb/a": [1, 2]}, {}, 3),
        (1, {"gb/a": [2, 2]}, {}, 3),
        (2, {}, {}, 3),
        (4, {}, {}, 5),
        (5, {}, {}, None),
        (6, {}, {"gb/a": 5}, None),
    ],
)
def test_stream_positions_at_the_edges_of_a_trimmed_log(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    case: tuple[int, dict[str, list[int]], dict[str, int], int | None],
) -> None:
    """docs/protocol.md `stream_subscribe`: "from the id after `after[topic]`"; `gaps` "{topic:
    [first missing id, last missing id]} for positions retention already trimmed"; `ahead` "where
    the position presented is past the log's end". A log of 5 events keeping 3 (ids 3 to 5, docs/
    streams.md `max_count`): a position of 2 misses nothing, 5 is the end (nothing to send, not
    ahead), 6 is ahead."""
    after, gaps, ahead, first_sent = case
    broker = broker_factory(streams=[{"filter": "gb/#", "max_count": 3}])
    clients(broker.port, "pub", clean_session=True).publish("gb/a", payloads(5, "e"))
    reader = clients(broker.port, "gb-reader", clean_session=True)
    reply = request(reader, "stream_subscribe", filter="gb/#", after={"gb/a": after}, window=10)
    assert reply.ok and (reply.fields["topics"], reply.fields["gaps"], reply.fields["ahead"]) == (
        {"gb/a": {"first": 3, "last": 5}},
        gaps,
        ahead,
    ), reply
    stream = "$durable/v1/stream/gb/a"
    if first_sent is None:
        assert not reader.wait_for(lambda ms: any(m.topic == stream for m in ms), timeout=0.3)
    else:
        count = 5 - first_sent + 1
        assert reader.wait_for(lambda ms: len([m for m in ms if m.topic == stream]) >= count)
        ids = [frame_seq(m.payload) for m in reader.messages if m.topic == stream]
        assert ids == list(range(first_sent, 6)), ids


def test_a_client_id_of_65535_bytes_keeps_its_durable_session_across_a_sigkill(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """docs/guarantees.md and 84-85: a durable session is created by a CONNECT with
    clean_session=false and a non-empty client id, "session_present in CONNACK comes from the store
    ... also after a broker restart or crash. Subscriptions come back without re-subscribing". The
    edge value: MQTT's longest client id (65,535 UTF-8 bytes, MQTT-3.1.3-5 lets a server accept it)."""
    broker = broker_factory(**METRICS)
    client_id = "L" * 65535
    device = raw_connect(broker.port, client_id, clean=False)
    assert raw_subscribe(device, "lid/t", 1) == 1
    device.sendall(mqtt_packet(0xE0, b""))
    device.close()
    seen_away(clients, broker, 1)  # else "kept" may go to this connection, and come again with DUP
    seen = clients(broker.port, "seen", clean_session=True)
    seen.publish("lid/t", [b"kept"])
    broker.kill()
    broker.start()
    again = socket.create_connection((HOST, broker.port), timeout=WAIT)
    again.sendall(connect_packet(client_id, clean=False))
    assert read_packet(again) == (0x20, b"\x01\x00"), "session present"
    first, body = read_packet(again)
    assert publish_parts(first, body) == (1, False, False, "lid/t", b"kept")
    again.close()


@pytest.mark.parametrize(
    ("queued", "new", "kept"),
    [
        ([100, 100, 100], 150, [100, 150]),  # the docs' example: two of 100 bytes go for one of 150
        ([100, 50, 100], 100, [50, 100, 100]),  # 50 bytes must go: the oldest (100) makes it up
        ([40, 40, 200], 100, [200, 100]),  # 40 then 40: fewer bytes than 100 gone after one, so two
    ],
)
def test_drop_oldest_under_a_byte_limit_deletes_only_what_the_new_message_needs(
    broker_factory: Callable[..., Broker],
    clients: Callable[..., Client],
    queued: list[int],
    new: int,
    kept: list[int],
) -> None:
    """docs/guarantees.md: under a byte limit drop-oldest "deletes more of the oldest while
    the new message does not fit yet and fewer bytes than it brings have gone: it stops at the
    message that makes up the new one's size, so what it removes exceeds what it adds by less than
    that last message (two of 100 bytes for one of 150), never more". Limit 300 bytes, queue as given."""
    broker = broker_factory(max_bytes=300, max_bytes_disconnected=300, **METRICS)
    device = away_subscriber(clients, broker, "bytes-dev", "by/t")
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("by/t", [bytes([65 + i]) * size for i, size in enumerate(queued)])
    publisher.publish("by/t", [b"n" * new])
    assert device.connect() is True
    assert device.wait_for(lambda ms: len(ms) >= len(kept))
    assert nothing_more(device, len(kept))
    assert [len(m.payload) for m in device.messages] == kept
    assert device.messages[-1].payload == b"n" * new
