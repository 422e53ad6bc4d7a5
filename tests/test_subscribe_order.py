"""MQTT 3.1.1 section 4.6 and 3.10.4: a connection's SUBSCRIBEs and UNSUBSCRIBEs are applied in
the order they arrive. amqtt's message loop took them from two queues and, when both had one,
applied the SUBSCRIBE first: ``UNSUBSCRIBE f`` then ``SUBSCRIBE f`` sent back to back left no
subscription though the SUBACK granted it (live messages lost), and ``SUBSCRIBE f`` then
``UNSUBSCRIBE f`` behind other SUBSCRIBEs left one the UNSUBACK had removed.

The packets go in one write, on both readers (the plugin's, and amqtt's own, used when a topic
plugin is loaded), for a durable and a clean session. Which packets both queues hold at once
depends on the reader: the plugin's hands over everything one read brought before the loop
runs, amqtt's reads a packet per loop pass, so its loop must be busy with an earlier packet
(a SUBSCRIBE) while the pair arrives. Then a client publishes to each filter and then to a
sentinel topic the raw client also holds: by the sentinel's arrival, a filter's message has
arrived if the client holds the filter.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import raw_connect, raw_subscribe, read_packet

from conftest import Broker, Client, mqtt_packet, mqtt_string

TOPIC_PLUGIN = "amqtt.plugins.topic_checking.TopicTabooPlugin"
"""Any topic plugin makes the broker read with amqtt's own loop instead of the plugin's."""
SUBACK, UNSUBACK, PUBLISH = 9, 11, 3
READERS = pytest.mark.parametrize("amqtt_reader", [False, True], ids=["plugin-reader", "amqtt-reader"])
SESSIONS = pytest.mark.parametrize("clean", [False, True], ids=["durable", "clean"])


def subscribe(topic_filter: str, packet_id: int) -> tuple[bytes, tuple[int, int]]:
    """A QoS 0 SUBSCRIBE, and the ack it must get."""
    body = packet_id.to_bytes(2, "big") + mqtt_string(topic_filter) + b"\x00"
    return mqtt_packet(0x82, body), (SUBACK, packet_id)


def unsubscribe(topic_filter: str, packet_id: int) -> tuple[bytes, tuple[int, int]]:
    """An UNSUBSCRIBE, and the ack it must get."""
    return mqtt_packet(0xA2, packet_id.to_bytes(2, "big") + mqtt_string(topic_filter)), (UNSUBACK, packet_id)


def send_in_one_write(sock: socket.socket, packets: list[tuple[bytes, tuple[int, int]]]) -> None:
    """Sends the packets in one write; their SUBACKs and UNSUBACKs must come back in the same order."""
    sock.sendall(b"".join(packet for packet, _ in packets))
    got = []
    for _ in packets:
        first, body = read_packet(sock)  # bounded by the socket's timeout
        assert first >> 4 in (SUBACK, UNSUBACK), (first, body)
        assert first >> 4 == UNSUBACK or body[2:] == b"\x00", f"SUBSCRIBE refused: {body!r}"
        got.append((first >> 4, int.from_bytes(body[:2], "big")))
    assert got == [ack for _, ack in packets], "not handled in the order they arrived"


def topics_until_sentinel(sock: socket.socket, publisher: Client, topics: list[str]) -> list[str]:
    """Publishes to each topic, then to the sentinel; the topics the raw client receives up to the sentinel."""
    for topic in topics:
        publisher.publish(topic, [b"m"])
    publisher.publish("sentinel", [b"s"])
    received = []
    for _ in range(len(topics) + 1):
        first, body = read_packet(sock)
        assert first >> 4 == PUBLISH and not first & 0x06, f"a QoS 0 PUBLISH expected: {first:#x} {body!r}"
        received.append(body[2 : 2 + int.from_bytes(body[:2], "big")].decode())
        if received[-1] == "sentinel":
            return received
    raise AssertionError(f"no sentinel: {received}")


def connected(
    broker_factory: Callable[..., Broker], client_id: str, *, amqtt_reader: bool, clean: bool
) -> tuple[Broker, socket.socket]:
    broker = broker_factory(start=False)
    if amqtt_reader:
        broker.extra_plugins[TOPIC_PLUGIN] = {}
    broker.start()
    sock = raw_connect(broker.port, client_id, clean=clean)
    assert raw_subscribe(sock, "sentinel", 0, packet_id=1) == 0
    return broker, sock


@READERS
@SESSIONS
def test_unsubscribe_then_subscribe_in_one_write_keeps_the_subscription(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], amqtt_reader: bool, clean: bool
) -> None:
    """The pair alone (lost on the plugin's reader), then behind a SUBSCRIBE (lost on amqtt's)."""
    broker, sock = connected(broker_factory, "order-resub", amqtt_reader=amqtt_reader, clean=clean)
    with sock:
        for topic_filter in ("a/#", "b/#"):
            assert raw_subscribe(sock, topic_filter, 0, packet_id=2) == 0
        send_in_one_write(sock, [unsubscribe("a/#", 3), subscribe("a/#", 4)])
        send_in_one_write(sock, [subscribe("g/#", 5), unsubscribe("b/#", 6), subscribe("b/#", 7)])
        publisher = clients(broker.port, "order-pub", clean_session=True)
        received = topics_until_sentinel(sock, publisher, ["a/x", "b/x"])
        assert received == ["a/x", "b/x", "sentinel"], "the SUBACK granted the filter, then it was gone"


@READERS
@SESSIONS
def test_subscribe_then_unsubscribe_in_one_write_leaves_no_subscription(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], amqtt_reader: bool, clean: bool
) -> None:
    """The pair behind five SUBSCRIBEs: the UNSUBSCRIBE's queue had it while the SUBSCRIBE's was
    still at the earlier ones."""
    broker, sock = connected(broker_factory, "order-unsub", amqtt_reader=amqtt_reader, clean=clean)
    with sock:
        lead = [subscribe(f"g{i}/#", 10 + i) for i in range(5)]
        send_in_one_write(sock, [*lead, subscribe("f/#", 2), unsubscribe("f/#", 3)])
        publisher = clients(broker.port, "order-pub", clean_session=True)
        assert topics_until_sentinel(sock, publisher, ["f/x"]) == ["sentinel"], (
            "the UNSUBACK removed f/#, yet it stayed"
        )
