"""Promises of README.md, docs/guarantees.md and docs/protocol.md that no other test states,
each against a real broker (a sentence-by-sentence audit of those pages).

Each test names the page and the promise it checks; a black-box reader of the docs would
expect exactly what is asserted here.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import paho.mqtt.client as mqtt
import pytest
from test_protocol import request

from conftest import Broker, Client, payloads
from durable_client.protocol import REPLY_TOPIC, decode_frame

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
    broker: Broker, clients: Callable[..., Client], version: object
) -> None:
    """protocol.md, Requests: "`v` (required): the protocol version, 1. A request without it, or
    with any other value, is refused with `unsupported_version`". JSON `true` and `1.0` are other
    values (a Python `==` took them for 1: `req` is already refused as `1.0` or `true`)."""
    client = clients(broker.port, "proto-version")
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
    broker: Broker, clients: Callable[..., Client], payload: bytes, op: str | None, req: int | None
) -> None:
    """protocol.md: "A PUBLISH under `_durable/` other than `_durable/v1/ctl` gets the error
    `unknown_topic`", and Replies: only a request too large, not a JSON object, or whose `req` is
    not an integer is answered with `op` and `req` null; "otherwise a refusal echoes `req`, and
    `op` when it names a known op". The request is refused whole: the session stays."""
    client = clients(broker.port, "proto-topic")
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
