"""Exactly-once for QoS 2 publishers across a broker crash (issue 10, point 11).

The publisher speaks raw MQTT, so the test decides when PUBREC is read and when PUBREL goes;
the durable subscriber is away meanwhile and counts what its queue got when it returns.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Callable

import pytest
from test_recovery_and_crash import wait_expired
from test_scale import RawClient

from amqtt_durable.store import iter_pubrel_due, iter_sessions, open_store
from conftest import Broker, Client, mqtt_packet, mqtt_string

PUBACK, PUBREC, PUBCOMP = 4, 5, 7
_U16 = struct.Struct(">H")


def publish(pub: RawClient, payload: bytes, packet_id: int, *, qos: int = 2, dup: bool = False) -> None:
    first = 0x30 | (qos << 1) | (0x08 if dup else 0)
    pub.send(mqtt_packet(first, mqtt_string("q2/a") + _U16.pack(packet_id) + payload))


def expect_ack(pub: RawClient, kind: int, packet_id: int) -> None:
    assert pub.expect(kind) == _U16.pack(packet_id), f"{pub.client_id}: ack for another packet id"


def complete(pub: RawClient, packet_id: int) -> None:
    """PUBREL, then PUBCOMP must come (MQTT-4.3.3)."""
    pub.send(mqtt_packet(0x62, _U16.pack(packet_id)))
    expect_ack(pub, PUBCOMP, packet_id)


def connect_publisher(broker: Broker, *, clean: bool = False) -> RawClient:
    pub = RawClient(broker.port, "q2-pub", clean_session=clean)
    pub.connect()
    return pub


def wait_pubrec_unread(pub: RawClient, packet_id: int) -> None:
    """Wait until PUBREC is in the publisher's socket (so the message is stored) without reading it."""
    assert pub.sock.recv(4, socket.MSG_PEEK) == bytes((PUBREC << 4, 2)) + _U16.pack(packet_id)


def pubrel_due(broker: Broker) -> dict[str, set[int]]:
    """Client id -> stored QoS 2 packet ids whose PUBREL is due (the broker must be stopped)."""
    db = open_store(broker.store, create=False)
    try:
        client_of = {record.sid: record.client_id for record in iter_sessions(db)}
        due: dict[str, set[int]] = {}
        for sid, packet_id in iter_pubrel_due(db):
            due.setdefault(client_of.get(sid, f"orphan sid {sid}"), set()).add(packet_id)
        return due
    finally:
        db.close()


def away_subscriber(clients: Callable[..., Client], broker: Broker) -> Client:
    sub = clients(broker.port, "q2-sub")
    sub.subscribe("q2/#", qos=1)
    sub.disconnect()
    return sub


def received_once_each(sub: Client, expected: list[bytes]) -> None:
    """Reconnect and read the queue up to its last expected message: FIFO puts any duplicate before it."""
    sub.connect()
    assert sub.wait_for(lambda ms: any(m.payload == expected[-1] for m in ms)), "the last message never came"
    assert [m.payload for m in sub.messages] == expected


def test_a_qos2_publish_resent_after_a_crash_gets_pubrec_and_is_not_routed_again(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    sub = away_subscriber(clients, broker)
    pub = connect_publisher(broker)
    publish(pub, b"once", 7)
    wait_pubrec_unread(pub, 7)
    broker.kill()  # the publisher never read PUBREC: it must send the PUBLISH again
    assert pubrel_due(broker) == {"q2-pub": {7}}, "the packet id is stored in the publish's own commit"
    broker.start()

    pub = connect_publisher(broker)
    publish(pub, b"once", 7, dup=True)
    expect_ack(pub, PUBREC, 7)
    complete(pub, 7)
    publish(pub, b"after", 8, qos=1)
    expect_ack(pub, PUBACK, 8)
    received_once_each(sub, [b"once", b"after"])
    broker.kill()
    assert pubrel_due(broker) == {}, "PUBCOMP came after the packet id's deletion was written"


def test_a_pubrel_after_a_crash_gets_pubcomp_and_frees_the_packet_id(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    sub = away_subscriber(clients, broker)
    pub = connect_publisher(broker)
    publish(pub, b"first", 9)
    expect_ack(pub, PUBREC, 9)
    broker.restart()  # SIGKILL: amqtt's in-memory record of the exchange is gone

    pub = connect_publisher(broker)
    complete(pub, 9)  # amqtt alone sends nothing for a PUBREL it has no flow for
    publish(pub, b"second", 9)  # the id is free again: a new message
    expect_ack(pub, PUBREC, 9)
    complete(pub, 9)
    received_once_each(sub, [b"first", b"second"])


@pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])
def test_a_pubrel_for_an_unknown_packet_id_gets_pubcomp(broker: Broker, clean: bool) -> None:
    pub = connect_publisher(broker, clean=clean)
    complete(pub, 4242)
    complete(pub, 4242)  # and again: every PUBREL is answered


@pytest.mark.parametrize("end", ["clean-session", "expiry"])
def test_the_stored_packet_ids_end_with_the_session(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], end: str
) -> None:
    broker = broker_factory(session_expiry=1 if end == "expiry" else 300)
    sub = clients(broker.port, "q2-sub")  # stays connected, so it does not expire
    sub.subscribe("q2/#", qos=1)
    sub.subscribe("$SYS/broker/durable/expired", qos=1)
    pub = connect_publisher(broker)
    publish(pub, b"pending", 11)
    expect_ack(pub, PUBREC, 11)
    pub.sock.close()  # gone without PUBREL
    if end == "expiry":
        wait_expired(sub, "q2-pub", timeout=15)
    else:
        connect_publisher(broker, clean=True).sock.close()  # CONNACK came: the session is deleted
    broker.kill()
    assert pubrel_due(broker) == {}
