"""`max_awaiting_pubrel` counts what a durable session's earlier connections left awaiting their PUBREL
(docs/configuration.md, docs/guarantees.md): it counted only the current connection's, so a publisher
that reconnected after every few unreleased QoS 2 publishes made the broker hold any number of them.
Raw sockets; both readers (the plugin's, and amqtt's own, used when a topic plugin is loaded).
"""

from __future__ import annotations

import socket
from collections.abc import Callable

from raw_mqtt_helpers import raw_connect, read_packet
from test_blind_guarantees import USER
from test_blind_guarantees import on_either_reader as on_either_reader  # noqa: PLC0414  (the fixture, by its own name)

from conftest import Broker, Client, mqtt_packet, mqtt_string

PUBREC, PUBREL, PUBCOMP = 0x50, 0x62, 0x70


def subscribers(clients: Callable[..., Client], broker: Broker, topic_filter: str) -> list[Client]:
    """A clean-session subscriber at QoS 1, one at QoS 2, and a durable one at QoS 2, all connected."""
    made = []
    for client_id, clean, qos in (("clean-1", True, 1), ("clean-2", True, 2), ("durable-2", False, 2)):
        subscriber = clients(broker.port, client_id, clean_session=clean, username=USER)
        assert subscriber.subscribe(topic_filter, qos) == [qos]
        made.append(subscriber)
    return made


def each_got_once(subscribers: list[Client], expected: list[bytes]) -> None:
    """Every subscriber gets ``expected``, in order, and nothing more (within half a second after)."""
    for subscriber in subscribers:
        subscriber.wait_for(lambda ms: len(ms) >= len(expected))
        assert not subscriber.wait_for(lambda ms: len(ms) > len(expected), timeout=0.5), subscriber.client_id
        assert [m.payload for m in subscriber.messages] == expected, subscriber.client_id


def release(sock: socket.socket, packet_id: bytes) -> None:
    """PUBREL, and its PUBCOMP."""
    sock.sendall(mqtt_packet(PUBREL, packet_id))
    assert read_packet(sock) == (PUBCOMP, packet_id)


def test_max_awaiting_pubrel_counts_what_earlier_connections_left_awaiting(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """configuration.md `max_awaiting_pubrel` (here 3): a durable publisher leaves two QoS 2
    publishes unreleased and reconnects (the broker keeps them, and sends their PUBRECs again); one
    of them sent again counts once, a new one makes three; a fourth, new id closes the connection
    unacknowledged, with a WARNING naming the client (only the current connection's counted: it
    held any number across reconnects). On the next connection the three can still be released;
    a PUBREL frees its place, so the fourth is then taken. Every subscriber gets the four once each."""
    broker = on_either_reader(named=True, max_awaiting_pubrel=3)
    receivers = subscribers(clients, broker, "aw/#")
    ids = [index.to_bytes(2, "big") for index in range(1, 5)]
    publish = [mqtt_packet(0x34, mqtt_string("aw/t") + packet_id + b"m%d" % n) for n, packet_id in enumerate(ids, 1)]
    with raw_connect(broker.port, "aw-pub", clean=False, username=USER) as first:
        for packet, packet_id in zip(publish[:2], ids, strict=False):
            first.sendall(packet)
            assert read_packet(first) == (PUBREC, packet_id)
    with raw_connect(broker.port, "aw-pub", clean=False, username=USER) as second:
        assert [read_packet(second), read_packet(second)] == [(PUBREC, ids[0]), (PUBREC, ids[1])], "sent again"
        second.sendall(bytes((publish[0][0] | 0x08,)) + publish[0][1:])  # DUP: held already, counts once
        assert read_packet(second) == (PUBREC, ids[0])
        second.sendall(publish[2])
        assert read_packet(second) == (PUBREC, ids[2])
        second.sendall(publish[3])
        assert second.recv(4) == b"", "a fourth new id was acknowledged"  # bounded by the socket's timeout
    assert any(
        " WARNING " in line and "closing the connection of aw-pub" in line and "max_awaiting_pubrel is 3" in line
        for line in broker.log().splitlines()
    ), broker.log()[-3000:]
    with raw_connect(broker.port, "aw-pub", clean=False, username=USER) as third:
        assert [read_packet(third) for _ in range(3)] == [(PUBREC, packet_id) for packet_id in ids[:3]]
        release(third, ids[0])
        third.sendall(publish[3])  # its place is free
        assert read_packet(third) == (PUBREC, ids[3])
        for packet_id in ids[1:]:
            release(third, packet_id)
    each_got_once(receivers, [b"m1", b"m2", b"m3", b"m4"])
