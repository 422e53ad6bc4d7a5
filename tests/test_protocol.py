"""The plugin's side of protocol v1 (docs/protocol.md), spoken by hand with plain paho clients:
hold until ready, replay flags, the marker, frames, non-durable interest, end_session, expiry
override, and refusals that leave the connection and the session as they were."""

from __future__ import annotations

import itertools
import json
import time
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt

from conftest import WAIT, Broker, Client, payloads
from durable_client.protocol import (
    CONTROL_TOPIC,
    MARKER_TOPIC,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    Frame,
    Marker,
    Reply,
    decode_frame,
    decode_marker,
    decode_reply,
    encode_request,
)

_req_ids = itertools.count(1)


def request(client: Client, op: str, qos: int = 0, raw: bytes | None = None, **fields: Any) -> Reply:
    """Publish one control request and wait for the reply that echoes its req id."""
    req = next(_req_ids)
    payload = raw if raw is not None else encode_request(op, req, **fields)
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY_TOPIC)  # before the reply can come
    client.paho.publish(CONTROL_TOPIC, payload, qos=qos)

    def answered(messages: list[mqtt.MQTTMessage]) -> bool:
        return any(m.topic == REPLY_TOPIC and json.loads(m.payload).get("req") == req for m in messages)

    if raw is not None:  # a raw request may carry no req id: take the next reply
        assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY_TOPIC) > seen), "no reply"
        return decode_reply([m for m in client.messages if m.topic == REPLY_TOPIC][seen].payload)
    assert client.wait_for(answered), f"no reply to {op}"
    return next(
        decode_reply(m.payload)
        for m in client.messages
        if m.topic == REPLY_TOPIC and json.loads(m.payload).get("req") == req
    )


def events(client: Client) -> list[tuple[str, Frame, bytes]]:
    out = []
    for message in client.messages:
        if not message.topic.startswith("$durable/"):
            frame, payload = decode_frame(message.payload)
            out.append((message.topic, frame, payload))
    return out


def markers(client: Client) -> list[Marker]:
    return [decode_marker(m.payload) for m in client.messages if m.topic == MARKER_TOPIC]


def sdk_session(clients: Callable[..., Client], broker: Broker, client_id: str, **hello: Any) -> Client:
    client = clients(broker.port, client_id)
    reply = request(client, "hello", **hello)
    assert reply.ok, reply
    return client


def queued_while_away(
    clients: Callable[..., Client],
    broker: Broker,
    client_id: str,
    topic: str,
    messages: list[bytes],
    *,
    topic_filter: str | None = None,
) -> Client:
    """An SDK session gone away with ``messages`` queued for it on ``topic``; returns the publisher.

    The session subscribed to ``topic_filter`` (default: ``topic``) before it went away.
    """
    device = sdk_session(clients, broker, client_id)
    assert device.subscribe(topic_filter or topic) == [1]
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish(topic, messages)
    return publisher


def test_sdk_session_is_held_until_ready_then_replays_marks_and_goes_live(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    publisher = queued_while_away(clients, broker, "sdk-1", "t/a", payloads(5, "old"), topic_filter="t/#")

    device = clients(broker.port, "sdk-1")
    assert device.session_present
    assert request(device, "hello").fields["epoch"] >= 1
    publisher.publish("t/a", payloads(2, "held"))
    assert not device.wait_for(lambda ms: any(m.topic == "t/a" for m in ms), timeout=0.5), "sent before ready"

    assert request(device, "ready").ok
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    publisher.publish("t/a", payloads(3, "live"))
    assert device.wait_for(lambda ms: len(events(device)) >= 10)

    got = events(device)
    assert [p for _, _, p in got] == payloads(5, "old") + payloads(2, "held") + payloads(3, "live")
    assert [f.replayed for _, f, _ in got] == [True] * 7 + [False] * 3
    seqs = [f.seq for _, f, _ in got]
    assert seqs == sorted(seqs) and len(set(seqs)) == 10
    assert {f.epoch for _, f, _ in got} == {request(device, "hello").fields["epoch"]}
    (marker,) = markers(device)
    assert (marker.replayed, marker.first_seq, marker.last_seq) == (7, seqs[0], seqs[6])
    assert [(s.filter, s.qos, s.durable) for s in marker.live] == [("t/#", 1, True)]
    topics = [m.topic for m in device.messages if m.topic != REPLY_TOPIC]
    assert topics.index(MARKER_TOPIC) == 7, "the marker comes after every replayed message, before live ones"


def test_a_brand_new_sdk_session_gets_a_marker_too(broker: Broker, clients: Callable[..., Client]) -> None:
    device = sdk_session(clients, broker, "sdk-new")
    assert request(device, "ready").fields == {"already": False}
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    (marker,) = markers(device)
    assert (marker.replayed, marker.first_seq, marker.last_seq, marker.live) == (0, None, None, ())
    assert request(device, "ready").fields == {"already": True}, "one marker per connection"


def test_plain_clients_get_the_publishers_bytes_and_no_hold(broker: Broker, clients: Callable[..., Client]) -> None:
    sdk = sdk_session(clients, broker, "sdk-2")
    sdk.subscribe("x")
    request(sdk, "ready")
    plain = clients(broker.port, "plain-2")
    plain.subscribe("x")
    body = bytes(range(256))
    clients(broker.port, "pub", clean_session=True).publish("x", [body])
    assert plain.wait_messages(1)[0].payload == body
    assert sdk.wait_for(lambda ms: len(events(sdk)) == 1)
    assert events(sdk)[0][2] == body


def test_non_durable_interest_ends_with_the_connection(broker: Broker, clients: Callable[..., Client]) -> None:
    device = sdk_session(clients, broker, "sdk-3")
    device.subscribe("keep/#")
    assert request(device, "interest", filter="gone/#", durable=False).ok  # before its SUBSCRIBE
    device.subscribe("gone/#")
    device.subscribe("later/#")
    assert request(device, "interest", filter="later/#", durable=False).ok  # after its SUBSCRIBE
    request(device, "ready")
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    live = {(s.filter, s.durable) for s in markers(device)[0].live}
    assert live == {("keep/#", True), ("gone/#", False), ("later/#", False)}
    device.disconnect()

    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("keep/a", [b"k"])
    publisher.publish("gone/a", [b"g"])
    publisher.publish("later/a", [b"l"])
    device = clients(broker.port, "sdk-3")
    request(device, "hello")
    request(device, "ready")
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    assert [p for _, _, p in events(device)] == [b"k"]
    assert [s.filter for s in markers(device)[0].live] == ["keep/#"]


def test_non_durable_subscriptions_are_gone_after_a_broker_crash(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    device = sdk_session(clients, broker, "sdk-crash")
    device.subscribe("keep")
    request(device, "interest", filter="gone", durable=False)
    device.subscribe("gone")
    broker.restart()
    device = clients(broker.port, "sdk-crash")
    request(device, "hello")
    request(device, "ready")
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    assert [s.filter for s in markers(device)[0].live] == ["keep"]


def test_end_session_removes_the_session_at_once(broker: Broker, clients: Callable[..., Client]) -> None:
    queued_while_away(clients, broker, "sdk-4", "e", payloads(3))
    device = clients(broker.port, "sdk-4")
    request(device, "hello")
    reply = request(device, "end_session")
    assert reply.ok and reply.fields == {"messages_dropped": 3}
    device.disconnect()
    again = clients(broker.port, "sdk-4")
    assert again.session_present is False


def test_hello_sets_a_capped_expiry_override(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(session_expiry=300, max_session_expiry=1)
    device = clients(broker.port, "sdk-5")
    assert request(device, "hello", session_expiry=0.5).fields["session_expiry"] == 0.5
    assert request(device, "hello", session_expiry=100).fields["session_expiry"] == 1.0
    assert request(device, "hello", session_expiry=0.3).fields["session_expiry"] == 0.3
    device.disconnect()
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/expired")
    assert watcher.wait_for(lambda ms: any(json.loads(m.payload)["client_id"] == "sdk-5" for m in ms), WAIT)
    assert clients(broker.port, "sdk-5").session_present is False


def test_refused_requests_name_the_problem_and_change_nothing(broker: Broker, clients: Callable[..., Client]) -> None:
    device = sdk_session(clients, broker, "sdk-6")
    device.subscribe("r")
    cases = [
        (b"not json", "malformed"),
        (b"[1, 2]", "malformed"),
        (json.dumps({"v": 2, "op": "hello", "req": 1}).encode(), "unsupported_version"),
        (json.dumps({"v": 1, "op": "fly", "req": 2}).encode(), "unknown_op"),
        (json.dumps({"v": 1, "op": "interest", "req": 3}).encode(), "malformed"),
        (json.dumps({"v": 1, "op": "interest", "req": 4, "filter": "a/#/b"}).encode(), "bad_filter"),
        (json.dumps({"v": 1, "op": "ready", "req": 5, "client_id": "someone-else"}).encode(), "not_your_session"),
        (json.dumps({"v": 1, "op": "end_session", "req": 6, "client_id": "victim"}).encode(), "not_your_session"),
        (b"\xff\xfe", "malformed"),
        (b"[" * 5000, "malformed"),  # nesting deep enough to exhaust a recursive JSON parser
    ]
    for raw, code in cases:
        reply = request(device, "", raw=raw)
        assert not reply.ok and reply.error_code == code, (raw, reply)
        assert reply.error_message
    # A request to another control topic, and QoS 1 and 2 requests, are answered as well.
    device.paho.publish("_durable/v1/other", b"{}", qos=1)
    assert device.wait_for(lambda ms: any(b"unknown_topic" in m.payload for m in ms))
    assert request(device, "hello", qos=1).ok
    assert request(device, "hello", qos=2).ok
    # The connection is still up and the session untouched: the queued message is delivered.
    clients(broker.port, "pub", clean_session=True).publish("r", [b"still here"])
    request(device, "ready")
    assert device.wait_for(lambda ms: [p for _, _, p in events(device)] == [b"still here"])
    assert clients(broker.port, "probe", clean_session=True).paho.is_connected()


def test_session_ops_need_a_durable_session(broker: Broker, clients: Callable[..., Client]) -> None:
    stateless = clients(broker.port, "clean-1", clean_session=True)
    hello = request(stateless, "hello")
    assert hello.ok and hello.fields["epoch"] is None
    for op in ("ready", "end_session"):
        reply = request(stateless, op)
        assert reply.error_code == "no_session" and "clean_session=false" in (reply.error_message or "")


def test_another_client_cannot_touch_this_session(broker: Broker, clients: Callable[..., Client]) -> None:
    queued_while_away(clients, broker, "victim", "v", payloads(2))
    attacker = clients(broker.port, "attacker")
    reply = request(attacker, "end_session", client_id="victim")
    assert reply.error_code == "not_your_session"
    attacker.paho.publish("_durable/v1/victim/ctl", encode_request("end_session", 99))
    assert attacker.wait_for(lambda ms: any(b"unknown_topic" in m.payload for m in ms))
    victim = clients(broker.port, "victim")
    assert victim.session_present
    request(victim, "hello")
    request(victim, "ready")
    assert victim.wait_for(lambda ms: len(events(victim)) == 2)


def test_control_traffic_never_reaches_subscribers(broker: Broker, clients: Callable[..., Client]) -> None:
    everything = clients(broker.port, "all", clean_session=True)
    everything.subscribe("#")
    spy = clients(broker.port, "spy", clean_session=True)
    spy.subscribe("_durable/#")
    durable_spy = clients(broker.port, "durable-spy")
    durable_spy.subscribe("#")
    device = clients(broker.port, "sdk-7")
    request(device, "hello")
    device.paho.publish(CONTROL_TOPIC, encode_request("hello", 1), qos=1, retain=True)
    request(device, "ready")
    clients(broker.port, "pub", clean_session=True).publish("fence", [b"f"])
    for watcher in (everything, durable_spy):
        assert watcher.wait_for(lambda ms: any(m.topic == "fence" for m in ms))
    for watcher in (everything, spy, durable_spy):
        assert not [m.topic for m in watcher.messages if m.topic.startswith(("_durable", "$durable"))]
    late = clients(broker.port, "late", clean_session=True)
    late.subscribe("_durable/#")
    late.subscribe("#")
    assert not late.wait_for(bool, timeout=0.3), "a control request was retained"


# ----------------------------------------------------------------- stream logs
def stream_events(client: Client) -> list[tuple[str, Frame, bytes]]:
    out = []
    for message in client.messages:
        if message.topic.startswith(STREAM_TOPIC_PREFIX):
            frame, payload = decode_frame(message.payload)
            out.append((message.topic[len(STREAM_TOPIC_PREFIX) :], frame, payload))
    return out


def ack_each(client: Client, topic: str, ids: range) -> None:
    """Ack-then-next: ack each event once it has arrived."""
    for event_id in ids:
        assert client.wait_for(lambda ms, i=event_id: any(f.seq == i for _, f, _ in stream_events(client)))
        client.paho.publish(CONTROL_TOPIC, encode_request("stream_ack", topic=topic, id=event_id))


STREAMS = [{"filter": "log/#", "max_count": 5}]


def test_a_stateless_client_resumes_from_the_middle_of_a_log_one_event_per_ack(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=[{"filter": "log/#", "max_count": 100}])
    clients(broker.port, "pub", clean_session=True).publish("log/a", payloads(6, "e"))
    broker.restart()  # the log is in the store, ids and all
    reader = clients(broker.port, "reader", clean_session=True)
    reply = request(reader, "stream_subscribe", filter="log/#", after={"log/a": 3})
    assert reply.ok and reply.fields["topics"] == {"log/a": {"first": 1, "last": 6}}
    assert reply.fields["gaps"] == {}
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 1)
    assert not reader.wait_for(lambda ms: len(stream_events(reader)) > 1, timeout=0.3), "window 1: waits for the ack"
    ack_each(reader, "log/a", range(4, 7))
    got = stream_events(reader)
    assert [(t, f.seq, p) for t, f, p in got] == [("log/a", i + 1, payloads(6, "e")[i]) for i in range(3, 6)]
    assert not any(f.redelivered for _, f, _ in got)
    info = request(reader, "stream_info", filter="log/#")
    assert info.fields["topics"] == {"log/a": {"first": 1, "last": 6, "count": 6}}


def test_an_unacknowledged_stream_event_is_sent_again(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=STREAMS, stream_ack_timeout=0.2)
    clients(broker.port, "pub", clean_session=True).publish("log/r", [b"again"])
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="log/r").ok
    assert reader.wait_for(lambda ms: len(stream_events(reader)) >= 2)
    first, second = stream_events(reader)[:2]
    assert (first[1].seq, first[1].redelivered, second[1].seq, second[1].redelivered) == (1, False, 1, True)
    assert first[2] == second[2] == b"again"


def test_a_stalled_reader_gets_its_window_again_ever_more_slowly(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=[{"filter": "log/#", "max_count": 100}], stream_ack_timeout=0.3)
    clients(broker.port, "pub", clean_session=True).publish("log/s", payloads(5, "s"))
    reader = clients(broker.port, "reader", clean_session=True)
    sends: list[float] = []
    reader.on_message_hook = lambda m: sends.append(time.monotonic()) if m.topic.endswith("log/s") else None
    assert request(reader, "stream_subscribe", filter="log/#", window=5).ok  # the hook sees the first send too
    # it never acknowledges: the first send, then resends of the window (5 events each)
    assert reader.wait_for(lambda ms: len(stream_events(reader)) >= 5 * 5, timeout=30)
    rounds = sends[::5][:5]
    waits = [later - earlier for earlier, later in itertools.pairwise(rounds)]
    assert waits[-1] >= 4 * waits[0], f"waits between resends {waits}: backed off, not every 0.3 s"
    ack_each(reader, "log/s", range(5, 6))  # one cumulative ack for the whole window: the resends stop
    redelivered = len(stream_events(reader))
    assert not reader.wait_for(lambda ms: len(stream_events(reader)) > redelivered, timeout=1.5)


def test_one_cumulative_ack_releases_the_whole_window(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=[{"filter": "log/#", "max_count": 100}])
    clients(broker.port, "pub", clean_session=True).publish("log/c", payloads(9, "c"))
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="log/#", window=4).ok
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 4)
    ack_each(reader, "log/c", range(4, 5))  # covers 1..4
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 8)
    ack_each(reader, "log/c", range(8, 9))
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 9)
    assert [f.seq for _, f, _ in stream_events(reader)] == list(range(1, 10))
    assert not any(f.redelivered for _, f, _ in stream_events(reader))


def test_retention_trims_a_log_and_a_late_reader_is_told_of_the_gap(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=STREAMS)
    clients(broker.port, "pub", clean_session=True).publish("log/t", payloads(8, "t"))
    reader = clients(broker.port, "reader", clean_session=True)
    reply = request(reader, "stream_subscribe", filter="log/t", after={"log/t": 1})
    assert reply.fields["topics"] == {"log/t": {"first": 4, "last": 8}}
    assert reply.fields["gaps"] == {"log/t": [2, 3]}
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 1)
    assert stream_events(reader)[0][1].seq == 4, "it resumes at the first retained event"


def test_stream_requests_that_cannot_be_served_are_refused(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(streams=STREAMS)
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="other/#").error_code == "unknown_stream"
    assert request(reader, "stream_subscribe", filter="log/#/x").error_code == "bad_filter"
    assert request(reader, "stream_subscribe", filter="log/#", window=0).error_code == "malformed"
    assert request(reader, "stream_ack", topic="log/none", id=1).error_code == "unknown_stream"
    plain = broker_factory(name="plain")
    other = clients(plain.port, "reader2", clean_session=True)
    assert request(other, "stream_subscribe", filter="log/#").error_code == "unknown_stream"


def test_a_retained_will_on_a_control_topic_is_neither_retained_nor_delivered(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("#")
    doomed = Client(broker.port, "doomed", clean_session=True, auto_start=False)
    doomed.paho.will_set(CONTROL_TOPIC, encode_request("end_session"), qos=1, retain=True)
    doomed.connect()
    doomed.drop()
    clients(broker.port, "pub", clean_session=True).publish("fence", [b"f"])
    assert watcher.wait_for(lambda ms: any(m.topic == "fence" for m in ms))
    late = clients(broker.port, "late", clean_session=True)
    late.subscribe("#")
    late.subscribe("_durable/#")
    clients(broker.port, "pub2", clean_session=True).publish("fence2", [b"f"])
    assert late.wait_for(lambda ms: any(m.topic == "fence2" for m in ms))
    for client in (watcher, late):
        assert not [m.topic for m in client.messages if m.topic.startswith("_durable")]
