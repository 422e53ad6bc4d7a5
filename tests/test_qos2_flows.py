"""QoS 2 publishers' flows at a connection's edges (docs/guarantees.md, Exactly-once; docs/configuration.md,
`max_awaiting_pubrel`). Raw sockets, so the packets go in one write; both readers (the plugin's, and
amqtt's own, used when a topic plugin is loaded).

A QoS 2 publish released as its connection ends reaches every subscriber once: a publisher sent its
PUBREL and then ended the connection in the same write (PUBREL + DISCONNECT, PUBREL then EOF, several
PUBRELs then DISCONNECT), also a PUBLISH and its PUBREL together. With a durable publisher the broker
sent PUBCOMP, yet the message was queued to amqtt's delivery after the connection's message loop had
stopped taking from that queue: clean-session subscribers never got it (main's broker delivers it
when the publisher is a clean session; those cases guard against a regression). Also when a
take-over of the client id races with the PUBREL, and a take-over of a connection whose socket is
full is CONNACKed at once (a regression of this branch). What a publisher sends behind a PUBREL
reaches subscribers after the released message, and QoS 1 PUBLISHes read with a DISCONNECT reach
clean subscribers (amqtt's reader; the plugin's reader guards against a regression).

`max_awaiting_pubrel` counts what a durable session's earlier connections left awaiting their PUBREL:
it counted only the current connection's, so a publisher that reconnected after every few unreleased
QoS 2 publishes made the broker hold any number of them.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly, read_packet
from test_blind_guarantees import USER
from test_blind_guarantees import on_either_reader as on_either_reader  # noqa: PLC0414  (the fixture, by its own name)

from conftest import HOST, WAIT, Broker, Client, each_got_only, mqtt_packet, mqtt_string

PUBREC, PUBREL, PUBCOMP = 0x50, 0x62, 0x70
DISCONNECT = b"\xe0\x00"


def subscribers(clients: Callable[..., Client], broker: Broker, topic_filter: str) -> list[Client]:
    """A clean-session subscriber at QoS 1, one at QoS 2, and a durable one at QoS 2, all connected."""
    made = []
    for client_id, clean, qos in (("clean-1", True, 1), ("clean-2", True, 2), ("durable-2", False, 2)):
        subscriber = clients(broker.port, client_id, clean_session=clean, username=USER)
        assert subscriber.subscribe(topic_filter, qos) == [qos]
        made.append(subscriber)
    return made


def published_unreleased(sock: socket.socket, topic: str, bodies: list[bytes]) -> list[bytes]:
    """QoS 2 PUBLISHes of ``bodies`` (packet ids 1, 2, ...), each PUBREC read; the packet ids."""
    packet_ids = [index.to_bytes(2, "big") for index in range(1, len(bodies) + 1)]
    for packet_id, body in zip(packet_ids, bodies, strict=True):
        sock.sendall(mqtt_packet(0x34, mqtt_string(topic) + packet_id + body))
        assert read_packet(sock) == (PUBREC, packet_id)
    return packet_ids


def pubcomps_then_closed(sock: socket.socket, packet_ids: list[bytes]) -> None:
    """A PUBCOMP for each PUBREL, in order, then the broker closes the connection."""
    for packet_id in packet_ids:
        assert read_packet(sock) == (PUBCOMP, packet_id)
    assert sock.recv(1) == b"", "the connection stays open"  # bounded by the socket's timeout


PUBLISHERS = pytest.mark.parametrize("clean", [True, False], ids=["clean-publisher", "durable-publisher"])


@PUBLISHERS
@pytest.mark.parametrize("end", ["disconnect", "eof"])
def test_a_pubrel_and_the_connections_end_in_one_write_deliver_the_message(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], clean: bool, end: str
) -> None:
    """PUBREL + DISCONNECT in one write, or PUBREL then EOF (the socket shut for writing right
    after it): PUBCOMP comes, and every subscriber gets the message once."""
    broker = on_either_reader()
    receivers = subscribers(clients, broker, "rel/#")
    with raw_connect(broker.port, "rel-pub", clean=clean) as publisher:
        [packet_id] = published_unreleased(publisher, "rel/t", [b"released"])
        pubrel = mqtt_packet(PUBREL, packet_id)
        if end == "disconnect":
            publisher.sendall(pubrel + DISCONNECT)
        else:
            publisher.sendall(pubrel)
            publisher.shutdown(socket.SHUT_WR)
        pubcomps_then_closed(publisher, [packet_id])
    each_got_only(receivers, [b"released"])


@PUBLISHERS
def test_several_pubrels_and_a_disconnect_in_one_write_deliver_all_in_order(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], clean: bool
) -> None:
    """Five QoS 2 publishes, each PUBREC read, then their five PUBRELs and DISCONNECT in one write:
    five PUBCOMPs, and every subscriber gets the five once each, in publish order."""
    broker = on_either_reader()
    receivers = subscribers(clients, broker, "rel/#")
    bodies = [f"m{index}".encode() for index in range(5)]
    with raw_connect(broker.port, "rel-pub", clean=clean) as publisher:
        packet_ids = published_unreleased(publisher, "rel/t", bodies)
        publisher.sendall(b"".join(mqtt_packet(PUBREL, packet_id) for packet_id in packet_ids) + DISCONNECT)
        pubcomps_then_closed(publisher, packet_ids)
    each_got_only(receivers, bodies)


@PUBLISHERS
@pytest.mark.parametrize("end", ["none", "disconnect", "eof"])
def test_a_pubrel_sent_right_behind_its_publish_releases_that_message(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], clean: bool, end: str
) -> None:
    """docs/guarantees.md, Exactly-once: a PUBLISH (QoS 2) and its PUBREL in one write, without
    waiting for the PUBREC, the connection kept, or ended right behind them (DISCONNECT in the same
    write, or the socket shut for writing): PUBREC, then PUBCOMP, and every subscriber gets the
    message once. Five rounds, a connection each. The PUBREL was handled while the PUBLISH was
    still being stored: it found no message to release and got a bare PUBCOMP, and the message then
    waited for a PUBREL that had come already (never reaching clean subscribers); at the
    connection's end the readers cancelled the PUBLISH's handling (PUBCOMP without PUBREC, the
    message lost)."""
    broker = on_either_reader()
    receivers = subscribers(clients, broker, "rel/#")
    bodies = [b"eager%d" % index for index in range(5)]
    for index, body in enumerate(bodies, start=1):
        with raw_connect(broker.port, "rel-pub", clean=clean) as publisher:
            packet_id = index.to_bytes(2, "big")
            publish = mqtt_packet(0x34, mqtt_string("rel/t") + packet_id + body)
            publisher.sendall(publish + mqtt_packet(PUBREL, packet_id) + (DISCONNECT if end == "disconnect" else b""))
            if end == "eof":
                publisher.shutdown(socket.SHUT_WR)
            assert [read_packet(publisher), read_packet(publisher)] == [(PUBREC, packet_id), (PUBCOMP, packet_id)]
            if end != "none":
                assert publisher.recv(1) == b"", "the connection stays open"  # bounded by the socket's timeout
    each_got_only(receivers, bodies)


@PUBLISHERS
def test_a_publish_read_behind_a_pubrel_reaches_subscribers_after_the_released_message(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], clean: bool
) -> None:
    """docs/guarantees.md, FIFO: QoS 2 "A" got its PUBREC; then its PUBREL and a QoS 1 PUBLISH "B"
    in one write: PUBCOMP and PUBACK, and a clean and a durable subscriber (QoS 1: paho reports a
    QoS 2 message only at its PUBREL, after a QoS 1 one sent behind it) get A, then B (the plugin's
    reader queued B, handled as it was read, before the PUBREL's task released A: clean
    subscribers got B first)."""
    broker = on_either_reader()
    receivers = []
    for client_id, clean_session in (("clean-1", True), ("durable-1", False)):
        receivers.append(clients(broker.port, client_id, clean_session=clean_session, username=USER))
        assert receivers[-1].subscribe("ord/#", 1) == [1]
    with raw_connect(broker.port, "ord-pub", clean=clean) as publisher:
        [packet_id] = published_unreleased(publisher, "ord/t", [b"A"])
        publish_b = mqtt_packet(0x32, mqtt_string("ord/t") + b"\x00\x09" + b"B")
        publisher.sendall(mqtt_packet(PUBREL, packet_id) + publish_b)
        assert sorted([read_packet(publisher), read_packet(publisher)]) == [(0x40, b"\x00\x09"), (PUBCOMP, packet_id)]
    each_got_only(receivers, [b"A", b"B"])


def connect_owing(port: int, client_id: str, pubrels: list[bytes]) -> socket.socket:
    """A durable CONNECT (username USER) and, in the same write, the PUBRELs the client owes for
    ``pubrels`` (MQTT-4.4.0-1: sent again on a reconnect, as it cannot know whether the broker read
    them); returns once CONNACK (session present) came."""
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.sendall(connect_packet(client_id, clean=False, username=USER) + b"".join(
        mqtt_packet(PUBREL, packet_id) for packet_id in pubrels
    ))
    assert read_exactly(sock, 4) == b"\x20\x02\x01\x00", "CONNACK, session present"
    return sock


def until_pubcomp(sock: socket.socket, packet_id: bytes) -> list[tuple[int, bytes]]:
    """The packets read up to the PUBCOMP of ``packet_id``: a PUBREC of it may come first (the
    message was still held: the take-over came before its PUBREL was read)."""
    seen = [read_packet(sock)]
    while seen[-1] != (PUBCOMP, packet_id):  # bounded: at most one PUBREC first, then the socket timeout
        assert len(seen) < 3 and seen[-1] == (PUBREC, packet_id), seen
        seen.append(read_packet(sock))
    return seen


@pytest.mark.parametrize("then", [b"", DISCONNECT], ids=["pubrel", "pubrel-disconnect"])
def test_a_pubrel_racing_a_take_over_of_the_client_id_delivers_once(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client], then: bytes
) -> None:
    """docs/guarantees.md, Exactly-once: a QoS 2 message reaches each subscriber once. A durable
    publisher sends its PUBREL (alone, or with a DISCONNECT in the same write) and, at once, a new
    connection of its client id CONNECTs with that PUBREL again (it never saw the PUBCOMP):
    whichever connection the broker reads it on first releases the message, the other gets a bare
    PUBCOMP. Ten rounds, each a new packet id: every subscriber gets the ten once each, in order."""
    broker = on_either_reader(named=True)
    receivers = subscribers(clients, broker, "race/#")
    sock = raw_connect(broker.port, "race-pub", clean=False, username=USER)
    bodies = [f"r{index}".encode() for index in range(10)]
    for index, body in enumerate(bodies, start=1):
        packet_id = index.to_bytes(2, "big")
        sock.sendall(mqtt_packet(0x34, mqtt_string("race/t") + packet_id + body))
        assert read_packet(sock) == (PUBREC, packet_id)
        sock.sendall(mqtt_packet(PUBREL, packet_id) + then)
        again = connect_owing(broker.port, "race-pub", [packet_id])
        until_pubcomp(again, packet_id)
        sock.close()
        sock = again
    sock.close()
    each_got_only(receivers, bodies)


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
    each_got_only(receivers, [b"m1", b"m2", b"m3", b"m4"])


def test_a_take_over_of_a_connection_whose_socket_is_full_is_connacked_at_once(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A durable subscriber stops reading (its receive buffer small, 4 MB queued for it at QoS 1:
    the broker's writes to it stall) and connects again with its client id: CONNACK comes well
    within the 5 s close grace (a take-over waited for the old connection's unsent bytes to drain,
    which they never do, and was CONNACKed after that grace ran out). Nothing queued is lost: the
    new connection gets every message (DUP re-sends of those in flight allowed)."""
    broker = on_either_reader(named=True)
    stalled = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    stalled.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    stalled.settimeout(WAIT)
    stalled.connect((HOST, broker.port))
    stalled.sendall(connect_packet("full-sub", clean=False, username=USER))
    assert read_exactly(stalled, 4)[:2] == b"\x20\x02"
    assert raw_subscribe(stalled, "full/#", 1) == 1
    bodies = [index.to_bytes(4, "big") * 50_000 for index in range(20)]
    clients(broker.port, "full-pub", clean_session=True, username=USER).publish("full/t", bodies, qos=1)
    assert read_exactly(stalled, 1)[0] & 0xF0 == 0x30, "the broker sends nothing"  # it writes to the socket
    with socket.create_connection((HOST, broker.port), timeout=WAIT) as again:
        started = time.monotonic()
        again.sendall(connect_packet("full-sub", clean=False, username=USER))
        assert read_exactly(again, 4) == b"\x20\x02\x01\x00", "CONNACK, session present"
        took = time.monotonic() - started
        assert took < 2.0, f"the take-over's CONNACK took {took:.2f} s"
        received: list[bytes] = []
        while sorted(set(received)) != sorted(bodies):  # bounded: each read by the socket's timeout
            first, body = read_packet(again)
            assert first & 0xF6 == 0x32, hex(first)  # PUBLISH QoS 1
            packet_id = body[2 + int.from_bytes(body[:2], "big") : 4 + int.from_bytes(body[:2], "big")]
            received.append(body[4 + int.from_bytes(body[:2], "big") :])
            again.sendall(mqtt_packet(0x40, packet_id))
    stalled.close()


def test_qos1_publishes_and_a_disconnect_in_one_write_reach_clean_subscribers(
    on_either_reader: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Five QoS 1 PUBLISHes and a DISCONNECT in one write, ten rounds: every message that got its
    PUBACK reaches a clean and a durable subscriber, once, in publish order (on amqtt's reader the
    task it cancelled at the DISCONNECT still stored, acknowledged and queued its message, after
    the connection's last hand-over to the broker: clean subscribers never got it)."""
    broker = on_either_reader()
    receivers = []
    for client_id, clean_session in (("clean-1", True), ("durable-1", False)):
        receivers.append(clients(broker.port, client_id, clean_session=clean_session, username=USER))
        assert receivers[-1].subscribe("five/#", 1) == [1]
    sent: list[bytes] = []
    acknowledged: list[bytes] = []
    for round_ in range(10):
        bodies = {index.to_bytes(2, "big"): b"r%d-%d" % (round_, index) for index in range(1, 6)}
        sent += bodies.values()
        with raw_connect(broker.port, "five-pub", clean=True) as publisher:
            publisher.sendall(
                b"".join(mqtt_packet(0x32, mqtt_string("five/t") + pid + body) for pid, body in bodies.items())
                + DISCONNECT
            )
            while chunk := publisher.recv(4):  # bounded: PUBACKs (4 bytes each), then the close; the socket's timeout
                chunk += read_exactly(publisher, 4 - len(chunk)) if len(chunk) < 4 else b""
                assert chunk[:2] == b"\x40\x02", chunk
                acknowledged.append(bodies[chunk[2:]])
    for subscriber in receivers:
        subscriber.wait_for(lambda ms: {m.payload for m in ms} >= set(acknowledged))
        got = [m.payload for m in subscriber.messages]
        assert set(acknowledged) <= set(got), (subscriber.client_id, sorted(set(acknowledged) - set(got)))
        assert got == [body for body in sent if body in got], subscriber.client_id  # once each, in order
