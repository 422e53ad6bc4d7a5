"""Promises of README.md, docs/guarantees.md and docs/protocol.md that no other test states,
each against a real broker (a sentence-by-sentence audit of those pages).

Each test names the page and the promise it checks; a black-box reader of the docs would
expect exactly what is asserted here.
"""

from __future__ import annotations

import json
import queue
import re
import socket
import struct
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import paho.mqtt.client as mqtt
import plyvel
import pytest
from test_protocol import request, stream_events
from test_qos2_inbound import connect_publisher, pubrel_due
from test_recovery_and_crash import EXPIRED_TOPIC, wait_expired
from test_scale import RawClient

from amqtt_durable.inspect_store import summarize
from conftest import HOST, WAIT, Broker, Client, mqtt_packet, mqtt_string, payloads, readme_example
from durable_client.protocol import (
    CONTROL_TOPIC,
    FLAG_REDELIVERED,
    FLAG_REPLAYED,
    FLAG_RETAINED,
    MARKER_TOPIC,
    REPLY_TOPIC,
    STREAM_TOPIC_PREFIX,
    decode_frame,
)

# ------------------------------------------------------------------------------ protocol.md


def next_reply(client: Client, topic: str, payload: bytes) -> dict[str, Any]:
    """Publish ``payload`` on ``topic`` as it is; the next reply, as JSON."""
    seen = sum(1 for m in client.wait_messages(0) if m.topic == REPLY_TOPIC)
    client.paho.publish(topic, payload, qos=0)
    assert client.wait_for(lambda ms: sum(1 for m in ms if m.topic == REPLY_TOPIC) > seen), "no reply"
    reply: dict[str, Any] = json.loads([m.payload for m in client.messages if m.topic == REPLY_TOPIC][seen])
    return reply


@pytest.mark.parametrize("version", [True, 1.0, 1.5, None], ids=["true", "1.0", "1.5", "null"])
def test_a_v_that_is_not_the_integer_1_is_unsupported_version(
    shared_broker: Broker, clients: Callable[..., Client], case_tag: str, version: object
) -> None:
    """protocol.md, Requests: "`v` (required): the protocol version, 1. A request without it, or
    with any other value, is refused with `unsupported_version`". JSON `true` and `1.0` are other
    values (a Python `==` took them for 1: `req` is already refused as `1.0` or `true`)."""
    client = clients(shared_broker.port, f"proto-version-{case_tag}")
    reply = next_reply(client, "_durable/v1/ctl", json.dumps({"v": version, "op": "ready", "req": 5}).encode())
    assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (
        False,
        "unsupported_version",
        "ready",
        5,
    ), reply
    assert next_reply(client, "_durable/v1/ctl", b'{"v": 1, "op": "ready", "req": 6}')["ok"] is True


@pytest.mark.parametrize(
    ("payload", "op", "req"),
    [
        (b'{"v": 1, "op": "end_session", "req": 21}', "end_session", 21),
        (b'{"v": 1, "op": "fly", "req": 22}', None, 22),  # not a known op: null, as for unknown_op
        (b'{"v": 1, "op": "hello", "req": "23"}', None, None),
        (b"not json", None, None),
    ],
    ids=["readable", "unknown-op", "req-not-integer", "not-json"],
)
def test_a_request_on_another_control_topic_echoes_what_could_be_read(
    shared_broker: Broker,
    clients: Callable[..., Client],
    *,
    case_tag: str,
    payload: bytes,
    op: str | None,
    req: int | None,
) -> None:
    """protocol.md: "A PUBLISH under `_durable/` other than `_durable/v1/ctl` gets the error
    `unknown_topic`", and Replies: only a request too large, not a JSON object, or whose `req` is
    not an integer is answered with `op` and `req` null; "otherwise a refusal echoes `req`, and
    `op` when it names a known op". The request is refused whole: the session stays."""
    client = clients(shared_broker.port, f"proto-topic-{case_tag}")
    reply = next_reply(client, "_durable/v1/other", payload)
    assert (reply["ok"], reply["error"]["code"], reply["op"], reply["req"]) == (False, "unknown_topic", op, req), reply
    hello = next_reply(client, "_durable/v1/ctl", b'{"v": 1, "op": "hello", "req": 1}')
    assert hello["ok"] is True and hello["epoch"] is not None, "end_session on another topic did nothing"


# ------------------------------------------------------------------------------ guarantees.md


def test_a_client_over_a_lowered_subscription_limit_keeps_its_filters_but_gets_no_new_one(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Subscription limit: "A client that holds more (the limit was lowered) keeps
    them but gets no new one"; re-subscribing to a filter it holds does not count twice, and
    unsubscribing frees places."""
    broker = broker_factory(max_subscriptions_per_client=3)
    device = clients(broker.port, "over-limit")
    assert device.subscribe([("low/a", 1), ("low/b", 1), ("low/c", 1)]) == [1, 1, 1]
    device.disconnect()
    broker.stop()
    broker.settings["max_subscriptions_per_client"] = 1
    broker.start()
    assert device.connect() is True
    assert device.subscribe([("low/a", 0), ("low/d", 1)]) == [0, 0x80], "a held filter again, then a new one"
    warning = [line for line in broker.log().splitlines() if "WARNING" in line and "'low/d'" in line]
    assert warning and "over-limit" in warning[0] and "max_subscriptions_per_client" in warning[0], broker.log()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("low/d", [b"refused"])
    for topic in ("low/a", "low/b", "low/c"):
        publisher.publish(topic, [topic.encode()])
    assert device.wait_for(lambda ms: len(ms) >= 3)
    assert sorted(m.payload for m in device.messages) == [b"low/a", b"low/b", b"low/c"]
    assert [m.qos for m in device.messages if m.topic == "low/a"] == [0], "the re-subscription's QoS"
    device.unsubscribe(["low/b", "low/c"])
    assert device.subscribe("low/e") == [0x80], "it holds 1 (low/a): the limit"
    device.unsubscribe("low/a")
    assert device.subscribe("low/e") == [1]


def test_packet_ids_are_the_sequence_id_mod_65535_plus_1_and_a_resend_after_a_crash_reuses_them(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Recovery buffer: "Packet ids are derived from the queue sequence number
    (`seq % 65535 + 1`), so a re-send, even after a crash, reuses the original id" (the sequence
    id is the one an SDK session's frame carries, protocol.md)."""
    broker = broker_factory(recovery_buffer=5)
    device = clients(broker.port, "pid-seq", manual_ack=True)
    assert request(device, "hello").ok
    device.subscribe("pid/t", 1)
    assert request(device, "ready").ok
    clients(broker.port, "pub", clean_session=True).publish("pid/t", payloads(8))
    assert device.wait_for(lambda ms: len(events_of(device)) >= 5)
    assert not device.wait_for(lambda ms: len(events_of(device)) > 5, timeout=0.3), "5 in flight at most"
    first = [(m.mid, decode_frame(m.payload)[0].seq, m.dup) for m in events_of(device)]
    assert [mid for mid, _, _ in first] == [seq % 65535 + 1 for _, seq, _ in first], first
    broker.kill()
    assert device.wait_disconnected()
    broker.start()
    again = clients(broker.port, "pid-seq")
    assert again.session_present is True
    assert request(again, "hello").ok
    assert request(again, "ready").ok
    assert again.wait_for(lambda ms: len(events_of(again)) >= 8)
    resent = [(m.mid, decode_frame(m.payload)[0].seq, m.dup) for m in events_of(again)]
    assert resent[:5] == [(mid, seq, True) for mid, seq, _ in first], "the same ids, with DUP=1"
    flags = [decode_frame(m.payload)[0].flags for m in events_of(again)[:5]]
    assert flags == [FLAG_REPLAYED | FLAG_REDELIVERED] * 5, "protocol.md: framed replayed and redelivered"
    assert [mid for mid, _, _ in resent] == [seq % 65535 + 1 for _, seq, _ in resent]


def events_of(client: Client) -> list[mqtt.MQTTMessage]:
    """The session's own messages (not replies or markers)."""
    return [m for m in client.messages if not m.topic.startswith("$durable/")]


def test_a_client_that_never_acknowledges_stalls_only_its_own_window(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Recovery buffer: "Unacknowledged messages are not re-sent on the same
    connection (MQTT 3.1.1 re-sends on reconnect); a client that never acknowledges stalls only
    its own window"; the re-send on reconnect is DUP=1, in order."""
    broker = broker_factory(recovery_buffer=4)
    stuck = clients(broker.port, "never-acks", manual_ack=True)
    stuck.subscribe("st/t", 1)
    healthy = clients(broker.port, "acks")
    healthy.subscribe("st/t", 1)
    sent = payloads(20)
    clients(broker.port, "pub", clean_session=True).publish("st/t", sent)
    assert [m.payload for m in healthy.wait_messages(20)] == sent, "the other session is not held up"
    assert [m.payload for m in stuck.wait_messages(4)] == sent[:4]
    assert not stuck.wait_for(lambda ms: len(ms) > 4, timeout=1.0), "re-sent or sent past the window"
    stuck.drop()
    again = clients(broker.port, "never-acks")
    got = again.wait_messages(20)
    assert [m.payload for m in got] == sent
    assert [m.dup for m in got[:4]] == [True] * 4 and not any(m.dup for m in got[4:])


def test_wildcards_at_the_first_level_do_not_match_dollar_topics_for_durable_sessions(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md, lifecycle: "broker-internal messages (`$SYS/...`) reach durable sessions
    through the same queue. As MQTT requires, filters starting with `+` or `#` do not match `$`
    topics" (MQTT-4.7.2-1): a queued `$SYS` event reaches a session that names it, not one whose
    filters start with a wildcard."""
    wild = clients(broker.port, "wild")
    assert wild.subscribe([("#", 1), ("+/broker/durable/expired", 1), ("+/+/+/+", 1)]) == [1, 1, 1]
    wild.disconnect()
    explicit = clients(broker.port, "explicit")
    assert explicit.subscribe("$SYS/broker/durable/#", 1) == [1]
    explicit.disconnect()
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(EXPIRED_TOPIC, 1)  # before the expiry starts: the event is not retained
    short = clients(broker.port, "short")
    assert request(short, "hello", session_expiry=0.2).ok
    short.disconnect()
    wait_expired(watcher, "short", timeout=WAIT)
    clients(broker.port, "pub", clean_session=True).publish("fence/x", [b"fence"])
    assert explicit.connect() is True
    assert explicit.wait_for(lambda ms: any(m.topic == EXPIRED_TOPIC for m in ms)), "the named $SYS topic"
    assert wild.connect() is True
    assert wild.wait_for(lambda ms: any(m.topic == "fence/x" for m in ms))
    assert not wild.wait_for(lambda ms: any(m.topic.startswith("$") for m in ms), timeout=0.5)
    assert [m.topic for m in wild.messages] == ["fence/x"]


def test_a_clean_session_gets_one_copy_per_matching_filter(broker: Broker, clients: Callable[..., Client]) -> None:
    """guarantees.md: "clean sessions, served by amqtt, get one copy per matching filter" (a durable
    session gets one, at the highest QoS: test_docs_promises)."""
    clean = clients(broker.port, "clean-overlap", clean_session=True)
    assert clean.subscribe([("co/#", 0), ("co/b", 1)]) == [0, 1]
    clients(broker.port, "pub", clean_session=True).publish("co/b", [b"one"], qos=1)
    assert clean.wait_for(lambda ms: len(ms) >= 2)
    assert not clean.wait_for(lambda ms: len(ms) > 2, timeout=0.5)
    assert sorted((m.payload, m.qos) for m in clean.messages) == [(b"one", 0), (b"one", 1)]


def test_a_retained_message_queued_with_a_subscription_is_framed_retained_with_its_queueing_time(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md, Frames: flag `0x02` retained ("an initial value queued with a new
    subscription"), and the publish time "for a retained message queued with a new subscription:
    when it was queued"; a live publish with RETAIN=1 to a subscribed session is neither."""
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rt/a", [b"initial"], retain=True)
    stored = time.time()
    device = clients(broker.port, "rt-sdk")
    assert request(device, "hello").ok
    assert request(device, "ready").ok
    subscribed = time.time()
    assert subscribed > stored
    device.subscribe("rt/#", 1)
    publisher.publish("rt/a", [b"live"], retain=True)
    assert device.wait_for(lambda ms: len(events_of(device)) >= 2)
    (initial, live) = [(m.retain, *decode_frame(m.payload)) for m in events_of(device)]
    assert (initial[0], initial[1].flags, initial[2]) == (True, FLAG_RETAINED, b"initial")
    assert subscribed <= initial[1].published_at <= time.time(), "the time it was queued, not published"
    assert (live[0], live[1].flags, live[2]) == (False, 0, b"live")
    assert initial[1].published_at <= live[1].published_at


def test_replies_markers_and_stream_events_travel_at_qos_0_unretained(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, Topics: the reply, the marker and stream events are QoS 0, also when the
    request came at QoS 1 or 2 and the stream event was published at QoS 2 (its QoS is in the
    frame's bits 3-4); a stream event's epoch is 0."""
    broker = broker_factory(streams=[{"filter": "sq/#"}])
    device = clients(broker.port, "qos0-replies")
    assert request(device, "hello", qos=2).ok
    assert request(device, "stream_subscribe", qos=1, filter="sq/#").ok
    assert request(device, "ready", qos=1).ok
    assert device.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("sq/a", [b"two"], qos=2)
    assert device.wait_for(lambda ms: any(m.topic == STREAM_TOPIC_PREFIX + "sq/a" for m in ms))
    own = [m for m in device.messages if m.topic.startswith("$durable/")]
    assert {m.topic for m in own} == {REPLY_TOPIC, MARKER_TOPIC, STREAM_TOPIC_PREFIX + "sq/a"}
    assert [(m.qos, m.retain) for m in own] == [(0, False)] * len(own)
    frame, payload = decode_frame(own[-1].payload)
    assert (frame.qos, frame.epoch, frame.seq, payload) == (2, 0, 1, b"two")


@pytest.mark.parametrize("end", ["disconnect", "sigkill", "sigkill-slow-commit"])
def test_a_qos2_message_whose_pubrec_came_gets_pubrel_again_not_publish(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], end: str
) -> None:
    """guarantees.md, Recovery buffer: "A message stays in LevelDB until its PUBACK (QoS 1) or
    PUBCOMP (QoS 2); a PUBREC is stored too, so PUBREL, not PUBLISH, is re-sent" on reconnect,
    also after a crash; once PUBCOMP came nothing is sent again. slow-commit (sync: true, a
    commit a second after the PUBREC): the PUBREL went out before the PUBREC was stored, and a
    SIGKILL right after it made the broker send the PUBLISH again (review 65)."""
    broker = broker_factory(sync=True, batch_delay_ms=1000) if end == "sigkill-slow-commit" else broker_factory()
    device = RawClient(broker.port, "q2-out")
    assert device.connect() is False
    assert device.subscribe("q2o/t", 2) == 2
    clients(broker.port, "pub", clean_session=True).publish("q2o/t", [b"exactly once"], qos=2)
    first, body = device.read_packet()
    assert first >> 4 == 3 and (first >> 1) & 3 == 2 and body.endswith(b"exactly once"), (first, body)
    packet_id = body[2 + int.from_bytes(body[:2], "big") :][:2]
    device.send(mqtt_packet(0x50, packet_id))  # PUBREC
    assert device.read_packet() == (0x62, packet_id), "PUBREL"
    if end.startswith("sigkill"):
        broker.kill()
        broker.start()
    device.sock.close()  # no PUBCOMP
    again = RawClient(broker.port, "q2-out")
    assert again.connect() is True
    assert again.read_packet() == (0x62, packet_id), "PUBREL again, not the PUBLISH"
    again.send(mqtt_packet(0x70, packet_id))  # PUBCOMP
    again.sock.close()
    last = RawClient(broker.port, "q2-out")
    assert last.connect() is True
    last.sock.settimeout(0.5)
    with pytest.raises(TimeoutError):
        last.read_packet()
    last.sock.close()


def test_interest_durable_true_undoes_a_non_durable_interest(broker: Broker, clients: Callable[..., Client]) -> None:
    """protocol.md, `interest`: "`durable: false` makes that filter's subscription non-durable: the
    broker drops it when the connection that sent it ends ... `durable: true` undoes it." Reply: `filter`,
    `durable`; the hello reply lists the subscriptions the session holds."""
    device = clients(broker.port, "undo-interest")
    assert request(device, "hello").ok
    device.subscribe([("undo/a", 1), ("undo/b", 0)])
    assert request(device, "interest", filter="undo/a", durable=False).fields == {"filter": "undo/a", "durable": False}
    assert request(device, "interest", filter="undo/b", durable=False).ok
    assert request(device, "interest", filter="undo/a").fields == {"filter": "undo/a", "durable": True}
    device.disconnect()
    again = clients(broker.port, "undo-interest")
    assert again.session_present is True
    assert request(again, "hello").fields["subscriptions"] == {"undo/a": 1}


def test_the_expiry_warning_reads_as_guarantees_md_quotes_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: "the broker logs a WARNING (`durable session <id> expired after <n> s
    disconnected: <m> queued message(s) and its subscriptions deleted`)", <n> being the session's
    expiry."""
    broker = broker_factory(session_expiry=1)
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(EXPIRED_TOPIC, 1)
    publisher = clients(broker.port, "pub", clean_session=True)  # connected before the 1 s starts
    device = clients(broker.port, "exp-words")
    device.subscribe("ew/t", 1)
    device.disconnect()
    publisher.publish("ew/t", payloads(2))
    event = wait_expired(watcher, "exp-words", timeout=WAIT)
    assert event["messages_dropped"] == 2
    pattern = (
        r"WARNING .*durable session exp-words expired after 1 s disconnected: 2 queued message\(s\) and its "
        r"subscriptions deleted$"
    )
    assert any(re.search(pattern, line) for line in broker.log().splitlines()), broker.log()


# ------------------------------------------------------------------------------ README.md


def test_the_readme_asyncio_example_runs_and_prints_a_replayed_reading(
    broker: Broker, clients: Callable[..., Client], tmp_path: Path
) -> None:
    """README.md, The SDK: the `AsyncDurableClient` block, run as written (only the port changed):
    a reading queued before its `ready` (here a retained one, queued with the subscription) is
    printed as replayed; the loop then waits for live readings until it is stopped."""
    script = readme_example("For asyncio code", broker.port, tmp_path)
    clients(broker.port, "pub", clean_session=True).publish("sensors/7/temperature", [b"21.5"], retain=True)
    child = subprocess.Popen(
        [sys.executable, "-u", str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path
    )
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: [lines.put(line) for line in child.stdout or ()], daemon=True).start()
        line = lines.get(timeout=WAIT)
        assert line == "sensors/7/temperature b'21.5' replayed\n"
        assert child.poll() is None, "async for waits for live readings"
    finally:
        child.terminate()
        _, err = child.communicate(timeout=WAIT)
    assert "Traceback" not in err, err


def test_a_client_silent_in_the_middle_of_a_packet_is_disconnected_after_one_and_a_half_keepalives(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """guarantees.md, The message path: "A client silent for 1.5 times its keep-alive, also in the
    middle of a packet, is disconnected (MQTT-3.1.2-24)", so its session becomes disconnected and
    queues; the half-sent PUBLISH is not routed."""
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe("mid/#", 1)
    sock = socket.create_connection((HOST, broker.port), timeout=WAIT)
    connect = mqtt_string("MQTT") + bytes((4, 0)) + struct.pack(">H", 1) + mqtt_string("mid-packet")  # keep-alive 1 s
    sock.sendall(mqtt_packet(0x10, connect))
    assert sock.recv(4)[:1] == b"\x20"
    sock.sendall(mqtt_packet(0x82, struct.pack(">H", 1) + mqtt_string("mid/q") + b"\x01"))
    assert sock.recv(5)[:1] == b"\x90"
    whole = mqtt_packet(0x32, mqtt_string("mid/a") + struct.pack(">H", 2) + b"never finished")
    started = time.monotonic()  # before the last byte: the silence is at most this long
    sock.sendall(whole[:9])  # the fixed header and part of the body, then silence
    assert sock.recv(1) == b"", "closed"
    silent = time.monotonic() - started
    sock.close()
    assert 1.3 <= silent <= 1.5 + 2.0, f"closed after {silent:.2f} s of silence, keep-alive 1 s"
    clients(broker.port, "pub", clean_session=True).publish("mid/q", [b"queued"])
    assert watcher.wait_for(lambda ms: any(m.payload == b"queued" for m in ms))
    assert [m.payload for m in watcher.messages] == [b"queued"], "the half-sent PUBLISH was not routed"
    again = clients(broker.port, "mid-packet")
    assert again.session_present is True
    assert [m.payload for m in again.wait_messages(1)] == [b"queued"]


def test_the_hello_is_remembered_with_the_session_across_a_crash(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md: "The `hello` is remembered with the session: an SDK session stays one until it
    ends": after a SIGKILL and a reconnect without `hello`, its messages are held until `ready`,
    framed, and followed by a marker; once it ended (a clean connect), it is plain again."""
    device = clients(broker.port, "remembered")
    assert request(device, "hello").ok
    device.subscribe("rem/t", 1)
    device.disconnect()
    broker.kill()
    broker.start()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("rem/t", [b"queued"])
    again = clients(broker.port, "remembered")
    assert again.session_present is True
    assert not again.wait_for(lambda ms: len(events_of(again)) > 0, timeout=0.5), "held until ready"
    assert request(again, "ready").ok
    assert again.wait_for(lambda ms: any(m.topic == MARKER_TOPIC for m in ms))
    (message,) = events_of(again)
    frame, payload = decode_frame(message.payload)
    assert (payload, frame.replayed) == (b"queued", True)
    again.disconnect()
    clients(broker.port, "remembered", clean_session=True).disconnect()  # ends the session
    plain = clients(broker.port, "remembered")
    assert plain.session_present is False
    plain.subscribe("rem/t", 1)
    publisher.publish("rem/t", [b"plain"])
    assert [m.payload for m in plain.wait_messages(1)] == [b"plain"], "a new session is a plain one"


def test_a_qos2_publish_no_durable_session_or_stream_matches_stores_nothing_not_even_its_id(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Exactly-once from QoS 2 publishers: "a QoS 2 publish that matched no durable
    session and no stream stores nothing, its id neither"; one a stream matches stores its id."""
    broker = broker_factory(streams=[{"filter": "q2/logged"}])
    clean = clients(broker.port, "clean-sub", clean_session=True)
    clean.subscribe("q2/#", 2)
    pub = connect_publisher(broker)
    for packet_id, topic in ((3, "q2/nobody"), (4, "q2/logged")):
        pub.send(mqtt_packet(0x34, mqtt_string(topic) + struct.pack(">H", packet_id) + b"x"))
        assert pub.expect(5) == struct.pack(">H", packet_id), "PUBREC"
    broker.kill()
    assert pubrel_due(broker) == {"q2-pub": {4}}
    db = plyvel.DB(broker.store, create_if_missing=False)
    try:
        assert not any(b"q2/nobody" in key + value for key, value in db.iterator()), "stored nothing"
    finally:
        db.close()


def test_hello_without_a_durable_session_grants_nothing(broker: Broker, clients: Callable[..., Client]) -> None:
    """protocol.md, `hello`: its reply's `epoch`, `session_expiry` and `subscriptions` are null
    without a durable session (a clean one), also when it asked for an expiry."""
    clean = clients(broker.port, "clean-hello", clean_session=True)
    reply = request(clean, "hello", session_expiry=60)
    assert reply.ok
    assert reply.fields == {
        "protocol": 1, "epoch": None, "session_expiry": None, "subscriptions": None, "max_packet_size": 1_048_576
    }


def test_expiry_counts_from_the_last_disconnect_however_many_reconnects_came_before(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Expiry: "The time counts from its last disconnect, however many reconnects
    came before": a session connected past the deadline its earlier disconnect set is not expired
    while connected nor right after it leaves, but session_expiry after that."""
    broker = broker_factory(session_expiry=2)
    monitor = clients(broker.port, "monitor", clean_session=True)
    monitor.subscribe(EXPIRED_TOPIC, 1)
    device = clients(broker.port, "reconnects")
    device.subscribe("rc/t", 1)
    for _ in range(3):
        device.disconnect()
        assert device.connect() is True
    # Connected for longer than session_expiry after the earlier disconnects' deadlines.
    assert not monitor.wait_for(lambda ms: len(ms) > 0, timeout=2.5), "expired while connected"
    left = time.monotonic()  # before the disconnect: the broker's 2 s start after this
    device.disconnect()
    wait_expired(monitor, "reconnects", timeout=WAIT)
    assert time.monotonic() - left >= 1.95, "counted from an earlier disconnect"


def test_a_stream_ack_gets_no_reply_unless_it_fails(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """protocol.md, `stream_ack`: "the broker sends the next. No reply unless it fails" (an ack
    with a `req` included; an ack of a topic with no open stream gets `unknown_stream`)."""
    broker = broker_factory(streams=[{"filter": "sa/#"}])
    clients(broker.port, "pub", clean_session=True).publish("sa/a", [b"1", b"2"])
    reader = clients(broker.port, "reader", clean_session=True)
    assert request(reader, "stream_subscribe", filter="sa/#").ok  # window 1: one event at a time
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 1)
    replies = sum(1 for m in reader.messages if m.topic == REPLY_TOPIC)
    reader.paho.publish(CONTROL_TOPIC, b'{"v": 1, "op": "stream_ack", "req": 9, "topic": "sa/a", "id": 1}')
    assert reader.wait_for(lambda ms: len(stream_events(reader)) == 2), "the next event"
    refused = next_reply(reader, CONTROL_TOPIC, b'{"v": 1, "op": "stream_ack", "req": 10, "topic": "sb/x", "id": 1}')
    assert (refused["req"], refused["error"]["code"]) == (10, "unknown_stream")
    assert sum(1 for m in reader.messages if m.topic == REPLY_TOPIC) == replies + 1, "only the failure answered"


def test_with_sync_true_a_lone_publish_waits_batch_delay_ms_but_connects_and_subscribes_do_not(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Group commit: with `sync: true` a commit starts "at once when
    `pending_threshold` ... requests wait, otherwise `batch_delay_ms` ... after the first one";
    "Connects, subscribes and a delivery pump about to send never wait for company"."""
    broker = broker_factory(sync=True, batch_delay_ms=3000, pending_threshold=3)
    started = time.monotonic()
    device = clients(broker.port, "no-company")  # a durable session: stored before its CONNACK
    assert device.subscribe("gc/t", 1) == [1]  # stored before its SUBACK
    assert time.monotonic() - started < 2.5, "a connect or subscribe waited for company"
    publisher = clients(broker.port, "pub", clean_session=True)
    started = time.monotonic()
    publisher.publish("gc/t", [b"lone"])
    assert time.monotonic() - started >= 2.9, "a lone publish is committed batch_delay_ms after it came"
    started = time.monotonic()
    publisher.publish("gc/t", payloads(3))  # pipelined: pending_threshold requests wait
    assert time.monotonic() - started < 2.5, "pending_threshold requests start the commit at once"
    assert [m.payload for m in device.wait_messages(4)] == [b"lone", *payloads(3)]


def test_with_sync_true_and_batch_delay_ms_0_a_lone_publisher_does_not_wait(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Group commit: "`batch_delay_ms: 0` fsyncs at the end of every pass instead"
    (of waiting for company): a publisher waiting for each PUBACK is not held to 1000 / delay."""
    broker = broker_factory(sync=True, batch_delay_ms=0, pending_threshold=1000)
    publisher = clients(broker.port, "pub", clean_session=True)
    device = clients(broker.port, "dev")
    device.subscribe("z0/t", 1)
    started = time.monotonic()
    for payload in payloads(20):
        publisher.publish("z0/t", [payload])  # one at a time: each waits for its PUBACK
    assert time.monotonic() - started < 4.0, "20 lone publishes, each an fsync of its own"
    assert [m.payload for m in device.wait_messages(20)] == payloads(20)


def test_drop_oldest_under_a_byte_limit_stops_once_the_new_message_s_bytes_have_gone(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """guarantees.md, Queue limits: under a byte limit drop-oldest "deletes more of the oldest while
    the new message does not fit yet and fewer bytes than it brings have gone": it stops as soon as
    the new message fits, or at the message that makes up its size (then it removed less than
    that last message more than it adds). Each deleted message is a counted drop."""
    broker = broker_factory(max_bytes=100, max_bytes_disconnected=100)
    device = clients(broker.port, "bytes-dev")
    device.subscribe("ob/t", 1)
    device.disconnect()
    publisher = clients(broker.port, "pub", clean_session=True)
    for payload in (b"a" * 10, b"b" * 10, b"c" * 80):  # 100 bytes: full
        publisher.publish("ob/t", [payload])
    publisher.publish("ob/t", [b"d" * 30])  # a and b (20 bytes) leave no room: c goes too
    for payload in (b"e" * 40, b"f" * 30):  # 100 bytes again
        publisher.publish("ob/t", [payload])
    publisher.publish("ob/t", [b"g" * 20])  # d out: 70 + 20 fits
    broker.stop()
    (row,) = [row for row in summarize(broker.store) if row.client_id == "bytes-dev"]
    assert (row.depth, row.bytes, row.dropped) == (3, 90, 4)
    broker.start()
    assert device.connect() is True
    assert [m.payload for m in device.wait_messages(3)] == [b"e" * 40, b"f" * 30, b"g" * 20]
    assert not device.wait_for(lambda ms: len(ms) > 3, timeout=0.3)


def test_a_session_created_anew_gets_a_new_epoch_however_the_old_one_ended(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """protocol.md, Frames: the epoch is "the durable session's id; a session created anew (after
    expiry, `end_session` or a clean connect) gets a new one"; a reconnect, also after a SIGKILL,
    keeps it."""
    device = clients(broker.port, "epochs")
    epochs = [request(device, "hello").fields["epoch"]]
    device.disconnect()
    broker.kill()
    broker.start()
    assert device.connect() is True
    assert request(device, "hello").fields["epoch"] == epochs[0], "the same session"
    assert request(device, "end_session").ok
    device.disconnect()
    assert device.connect() is False
    epochs.append(request(device, "hello").fields["epoch"])
    device.disconnect()
    clients(broker.port, "epochs", clean_session=True).disconnect()
    assert device.connect() is False
    epochs.append(request(device, "hello", session_expiry=0.2).fields["epoch"])
    watcher = clients(broker.port, "watch", clean_session=True)
    watcher.subscribe(EXPIRED_TOPIC, 1)
    device.disconnect()
    wait_expired(watcher, "epochs", timeout=WAIT)
    assert device.connect() is False
    epochs.append(request(device, "hello").fields["epoch"])
    assert len(set(epochs)) == 4 and None not in epochs, epochs
