"""Hostile control traffic from an ordinary client over TCP (docs/protocol.md): every numeric field
given numbers JSON or Python cannot hold, every field the wrong type, strings with U+0000 and lone
surrogates, keys given twice, all pipelined without waiting; stream positions and acks forged past
anything the broker sent; QoS 2 control requests left awaiting their PUBREL in bulk. Each test is
the attack against a real broker process with a raw socket, checks the reply the docs promise (in
order, naming the problem), that no request failed inside the broker, and that another client's
queued messages still come whole and in order.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from raw_mqtt_helpers import raw_connect, raw_subscribe, read_packet
from test_hostile_wire import PATHS, connack_within, publish_packet, read_until_closed

from conftest import WAIT, Broker, Client, payloads, queued_while_dropped
from durable_client.protocol import CONTROL_TOPIC, REPLY_TOPIC, STREAM_TOPIC_PREFIX, decode_frame

BIG = 2**64 + 1
"""Past every id the broker gives (u64 in frames)."""
DIGITS_4300 = "9" * 4300
"""The longest integer a request may hold (Python's default int_max_str_digits)."""
DIGITS_4301 = "9" * 4301


def control(sock: socket.socket, payload: bytes, qos: int = 0, packet_id: int = 1) -> None:
    sock.sendall(publish_packet(CONTROL_TOPIC.encode(), payload, qos, packet_id))


def next_publish(sock: socket.socket, deadline: float) -> tuple[str, bytes]:
    """(topic, payload) of the next PUBLISH the broker sends (other packets are skipped)."""
    while True:  # bounded by the deadline
        first, body = read_packet(sock, deadline)
        if first >> 4 == 3:
            length = int.from_bytes(body[:2], "big")
            return body[2 : 2 + length].decode(), body[2 + length :]


def replies(sock: socket.socket, count: int) -> list[dict[str, Any]]:
    """The next ``count`` control replies, in the order they came."""
    deadline = time.monotonic() + WAIT
    got = []
    while len(got) < count:
        topic, payload = next_publish(sock, deadline)
        if topic == REPLY_TOPIC:
            got.append(json.loads(payload))
    return got


def request(req: int | str, op: str = '"hello"', **fields: str) -> bytes:
    """A request written by hand (values are raw JSON text: NaN, 1e309, 4300 digits as Python's
    json would never write them)."""
    body = ['"v":1', f'"op":{op}', f'"req":{req}', *(f'"{name}":{value}' for name, value in fields.items())]
    return ("{" + ",".join(body) + "}").encode()


def others_served(broker: Broker, attacker: socket.socket, durable: Client, queued: list[bytes]) -> str:
    """Once the attacker's connection is closed: a new client is served and the durable session's
    queue comes whole and in order. Returns the broker's log."""
    attacker.close()
    assert connack_within(broker.port, WAIT), "a new client was not served"
    durable.connect()
    assert [m.payload for m in durable.wait_messages(len(queued))] == queued
    return broker.log()


NOT_NUMBERS = ("NaN", "Infinity", "-Infinity", "1e309", "-1e309")
"""Numbers Python's json reads (as nan and inf) that no field takes."""

CASES: list[tuple[bytes, str | None]] = [
    # req: not an integer, so the refusal cannot echo it
    *((request(value), "malformed") for value in (*NOT_NUMBERS, "1.5", '"1"', "true", "[]", "{}")),
    (request(DIGITS_4301), "malformed"),
    # v: only the integer 1
    *(
        (f'{{"v":{value},"op":"hello","req":1}}'.encode(), "unsupported_version")
        for value in (*NOT_NUMBERS, "1.0", "-1", str(BIG), '"1"', "true", "null", "[1]")
    ),
    (f'{{"v":{DIGITS_4301},"op":"hello","req":1}}'.encode(), "malformed"),
    # keys given twice: the last one counts, as Python's json (and the SDK's) reads them
    (b'{"v":2,"v":1,"op":"hello","req":2}', None),
    (b'{"v":1,"v":2,"op":"hello","req":3}', "unsupported_version"),
    (b'{"v":1,"op":"hello","op":"nope","req":4}', "unknown_op"),
    # op: a known name only
    *((request(5, op=value), "unknown_op") for value in ('"hello\\u0000"', '"\\ud800"', "1", "[]", "{}", "null")),
    # session_expiry: a finite number of seconds, 0 or more
    *(
        (request(6, session_expiry=value), "malformed")
        for value in (*NOT_NUMBERS, "-1", "-1e-300", "1" + "0" * 400, '"5"', "true", "[]", "{}")
    ),
    (request(7, session_expiry=DIGITS_4301), "malformed"),
    (request(8, session_expiry="-0.0"), None),
    # window: a whole number from 1 to 1000
    *(
        (request(9, op='"stream_subscribe"', filter='"s/#"', window=value), "malformed")
        for value in (*NOT_NUMBERS, "0", "-1", "1001", str(BIG), "1.0", "true", '"5"')
    ),
    # after: topics to whole numbers, 0 or more
    *(
        (request(10, op='"stream_subscribe"', filter='"s/#"', after=value), "malformed")
        for value in (
            *(f'{{"s/a":{number}}}' for number in (*NOT_NUMBERS, "-1", "1.5", '"3"', "true", "null", "[]")),
            '{"s/+":1}',
            '{"":1}',
            '{"s/\\u0000":1}',
            '{"\\ud800":1}',
            "[]",
            '"s/a"',
            "5",
        )
    ),
    # id: a whole number, 1 or more
    *(
        (request(11, op='"stream_ack"', topic='"s/a"', id=value), "malformed")
        for value in (*NOT_NUMBERS, "0", "-1", f"-{BIG}", "1.0", '"1"', "true", "[]")
    ),
    (request(12, op='"stream_ack"', topic='"s/a"', id=str(BIG)), "unknown_stream"),  # no stream open
    # strings: U+0000, lone surrogates, empty, wrong types
    (request(13, client_id='"att\\u0000"'), "not_your_session"),
    (request(14, client_id='"\\ud800"'), "not_your_session"),
    (request(15, client_id='""'), "malformed"),
    (request(16, client_id="5"), "malformed"),
    (request(17, op='"interest"', filter='"s/\\u0000"'), "bad_filter"),
    (request(18, op='"interest"', filter='"\\udc00/#"'), "bad_filter"),
    (request(19, op='"interest"', filter="5"), "malformed"),
    (request(20, op='"interest"', filter='"a/#"', durable='"yes"'), "malformed"),
    (request(21, op='"interest"', filter='"a/#"', durable="1"), "malformed"),
    (request(22, op='"stream_ack"', topic='""', id="1"), "malformed"),
    (request(23, op='"stream_ack"', topic="[]", id="1"), "malformed"),
    (request(24, op='"stream_info"', filter='"s/\\u0000"'), "bad_filter"),
    (request(25, op='"stream_unsubscribe"', filter='"\\ud800"'), "bad_filter"),
    # not a request at all
    *((value.encode(), "malformed") for value in ("[]", '"hello"', "null", "1e309", "NaN", "", "{", "[" * 5000)),
    (b'{"v":1,"op":"hello","x":"' + b"\xff" + b'"}', "malformed"),
    (b"x" * 65_537, "malformed"),
    # fields an op does not take are ignored, whatever they hold
    (request(26, x="[" + ",".join(["1e309"] * 5000) + "]", y=DIGITS_4300, z='"\\ud800\\u0000"'), None),
    # positions past anything the broker gave: the topic is listed as ahead
    (request(27, op='"stream_subscribe"', filter='"s/#"', after=f'{{"s/a":{BIG}}}'), None),
]


def test_adversarial_values_in_every_field_pipelined_are_each_refused_in_order_naming_the_problem(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Every request of CASES written in one burst before any reply is read: each gets its reply, in
    order, with the documented code (or ok), its ``req`` echoed when it is an integer (null when the
    request could not be read as a JSON object with an integer ``req``); none fails inside the
    broker, the connection stays up and another client's queue comes whole."""
    broker = broker_factory(streams=[{"filter": "s/#"}])
    queued = payloads(20, "order")
    durable, publisher = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    publisher.publish("s/a", [b"e1", b"e2"], qos=1)
    attacker = raw_connect(broker.port, "att", clean=False)
    attacker.sendall(b"".join(publish_packet(CONTROL_TOPIC.encode(), payload, 0) for payload, _ in CASES))
    got = replies(attacker, len(CASES))
    for (payload, code), reply in zip(CASES, got, strict=True):
        shown = payload[:120]
        if code is None:
            assert reply["ok"] is True, (shown, reply)
        else:
            assert reply["ok"] is False and reply["error"]["code"] == code, (shown, reply)
            assert reply["error"]["message"], (shown, reply)
        try:
            sent = json.loads(payload)
        except (ValueError, RecursionError):  # not JSON, or nested too deeply to read here too
            sent = None
        expected_req = sent.get("req") if isinstance(sent, dict) else None
        if isinstance(expected_req, bool) or not isinstance(expected_req, int):
            expected_req = None
        assert reply["req"] == expected_req, (shown, reply)
    assert got[-1]["ahead"] == {"s/a": 2}, got[-1]
    assert got[-1]["topics"] == {"s/a": {"first": 1, "last": 2}}, got[-1]
    control(attacker, request(99, op='"stream_info"'))
    assert replies(attacker, 1)[0]["req"] == 99, "the attacker's connection no longer answers"
    log = others_served(broker, attacker, durable, queued)
    assert "Traceback" not in log and "failed inside the broker" not in log, log[-3000:]
    assert "att: control request refused (malformed)" in log


def stream_events(sock: socket.socket, count: int) -> list[tuple[int, bytes]]:
    """The next ``count`` stream events (id, payload), other publishes skipped."""
    deadline = time.monotonic() + WAIT
    got = []
    while len(got) < count:
        topic, payload = next_publish(sock, deadline)
        if topic.startswith(STREAM_TOPIC_PREFIX):
            frame, body = decode_frame(payload)
            got.append((frame.seq, body))
    return got


def test_acks_forged_past_every_id_sent_skip_no_stream_event(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A reader that acks ids the broker never sent (2**64 + 1, an integer of 4300 digits) with a
    window of 1: each such ack counts as the last id sent, so every event of the log still comes,
    once, in order, also those appended after the forged acks; nothing is refused or fails."""
    broker = broker_factory(streams=[{"filter": "s/#"}])
    publisher = clients(broker.port, "pub", clean_session=True)
    logged = payloads(5, "event")
    publisher.publish("s/a", logged, qos=1)
    reader = raw_connect(broker.port, "reader", clean=True)
    control(reader, request(1, op='"stream_subscribe"', filter='"s/#"', window="1"))
    assert replies(reader, 1)[0]["topics"] == {"s/a": {"first": 1, "last": 5}}
    got = stream_events(reader, 1)
    forged = (str(BIG), DIGITS_4300, str(2**63), str(BIG))
    for value in forged:
        control(reader, request(2, op='"stream_ack"', topic='"s/a"', id=value))
        got += stream_events(reader, 1)
    assert got == [(i + 1, payload) for i, payload in enumerate(logged)], got
    later = payloads(2, "later")
    publisher.publish("s/a", later, qos=1)
    control(reader, request(3, op='"stream_ack"', topic='"s/a"', id=DIGITS_4300))
    got = stream_events(reader, 1)
    control(reader, request(4, op='"stream_ack"', topic='"s/a"', id=str(BIG)))
    got += stream_events(reader, 1)
    assert got == [(6, later[0]), (7, later[1])], got
    control(reader, request(5, op='"stream_info"'))
    reply = replies(reader, 1)[0]  # no refusal came before it: the forged acks were taken
    assert reply["req"] == 5 and reply["topics"]["s/a"]["last"] == 7, reply
    log = broker.log()
    assert "Traceback" not in log and "reader: control request refused" not in log, log[-3000:]


AWAITING_LIMIT = 10


def test_qos2_control_requests_never_released_close_the_connection_at_max_awaiting_pubrel(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """QoS 2 control requests whose PUBREL never comes count against ``max_awaiting_pubrel`` as any
    QoS 2 publish does: each is answered and gets its PUBREC; a re-send of one awaiting (DUP) is
    handled again (protocol.md) without a new place; a new packet id past the limit closes the
    connection; another client's queue comes whole."""
    broker = broker_factory(max_awaiting_pubrel=AWAITING_LIMIT)
    queued = payloads(5, "order")
    durable, _ = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    attacker = raw_connect(broker.port, "hoarder", clean=False)
    for packet_id in range(1, AWAITING_LIMIT + 1):
        control(attacker, request(packet_id), qos=2, packet_id=packet_id)
    assert [reply["req"] for reply in replies(attacker, AWAITING_LIMIT)] == list(range(1, AWAITING_LIMIT + 1))
    resend = publish_packet(CONTROL_TOPIC.encode(), request(100), 2, packet_id=3)
    attacker.sendall(bytes((resend[0] | 0x08,)) + resend[1:])
    assert replies(attacker, 1)[0]["req"] == 100
    control(attacker, request(AWAITING_LIMIT + 1), qos=2, packet_id=AWAITING_LIMIT + 1)
    assert read_until_closed(attacker, WAIT) is not None, "a QoS 2 request past max_awaiting_pubrel was taken"
    assert f"max_awaiting_pubrel is {AWAITING_LIMIT}" in others_served(broker, attacker, durable, queued)


@pytest.mark.parametrize("path", PATHS)
def test_acks_of_packet_ids_nothing_awaits_are_ignored_with_one_log_line_per_interval(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """amqtt logged a WARNING (some 100 bytes) for each PUBACK, PUBREC or PUBCOMP of a packet id it did
    not await: a client sending 4-byte acks filled the broker's log disk 25 times as fast. Now such
    an ack changes nothing and is logged at most once per drop_log_interval per connection; the
    attacker's own messages are still delivered and acknowledged, and another client's queue
    comes whole."""
    broker = broker_factory(start=False, drop_log_interval=3600)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    queued = payloads(5, "order")
    durable, publisher = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    attacker = raw_connect(broker.port, "acker", clean=True)
    assert raw_subscribe(attacker, "own/#", 1) == 1
    attacker.sendall(
        b"".join(bytes((kind, 2)) + i.to_bytes(2, "big") for kind in (0x40, 0x50, 0x70) for i in range(1, 1001))
    )
    attacker.sendall(b"\xc0\x00")  # PINGREQ: its PINGRESP comes once every ack before it was handled
    deadline = time.monotonic() + WAIT
    while read_packet(attacker, deadline)[0] != 0xD0:
        pass
    publisher.publish("own/1", [b"mine"], qos=1)
    topic, payload = next_publish(attacker, time.monotonic() + WAIT)
    assert (topic, payload[2:]) == ("own/1", b"mine")  # a QoS 1 PUBLISH: its packet id first
    puback = b"\x40\x02" + payload[:2]
    attacker.sendall(puback * 2)  # its PUBACK, and the same again: nothing awaits the second
    attacker.sendall(b"\xc0\x00")
    deadline = time.monotonic() + WAIT
    while read_packet(attacker, deadline)[0] != 0xD0:
        pass
    log = others_served(broker, attacker, durable, queued)
    assert "unknown pending message" not in log and "already done" not in log, log[-3000:]
    ignored = [line for line in log.splitlines() if "acker: " in line and "ignored" in line]
    assert len(ignored) == 1, ignored
    assert "PUBACK of packet id 1 ignored: no message sent to this connection awaits it" in ignored[0]
