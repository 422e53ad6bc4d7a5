"""Hostile flow control: a connected client that holds the broker's memory by not taking
what it is sent, or by not finishing what it sends. Each test is the attack itself against a
real broker process over TCP with a raw socket, and checks that other clients are still served
and that no message queued for a durable session is lost.
"""

from __future__ import annotations

import socket
from collections.abc import Callable

import pytest
from raw_mqtt_helpers import connect_packet, raw_connect, raw_subscribe, read_exactly
from test_hostile_wire import (
    CONNACK_ACCEPTED,
    PATHS,
    connack_within,
    memory_kb,
    publish_packet,
    read_until_closed,
)

from conftest import HOST, WAIT, Broker, Client, payloads, queued_while_dropped

PAYLOAD = 256 * 1024
COUNT = 160
"""40 MiB sent (twice) to a subscriber that reads nothing: more than twice the default max_pending_bytes_clean."""


def stalled_subscriber(port: int, client_id: str, topic_filter: str, qos: int) -> socket.socket:
    """A clean-session client that subscribes and then never reads: its receive buffer is made
    small before connecting, so the broker's writes to it stop at once."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(WAIT)
    sock.connect((HOST, port))
    sock.sendall(connect_packet(client_id))
    assert sock.recv(4) == CONNACK_ACCEPTED
    assert raw_subscribe(sock, topic_filter, qos) == qos
    return sock


def test_a_clean_subscriber_that_never_reads_does_not_make_the_broker_hold_every_message(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """amqtt 0.12.1 started a send task per message for the stalled subscriber and kept them all
    (and every later task of every connection, behind the first stuck one): memory grew by about
    three times what was published, without bound. Now at most max_pending_bytes_clean (16 MiB)
    waits for one connection; the rest for it is dropped, counted and logged."""
    assert broker.proc is not None
    pid = broker.proc.pid
    queued = payloads(10, "order")
    durable, publisher = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    reader = clients(broker.port, "reader", clean_session=True)
    reader.subscribe("feed/#", 0)
    stalled = stalled_subscriber(broker.port, "stalled", "feed/#", 0)
    sent = [i.to_bytes(4, "big") * (PAYLOAD // 4) for i in range(COUNT)]
    held_kb = []
    for attempt in (1, 2):  # the first fills what may wait for the stalled subscriber; the second may add nothing
        publisher.publish("feed/a", sent, qos=1)
        assert len(reader.wait_messages(attempt * COUNT, WAIT + 30)) == attempt * COUNT, "a reader lost messages"
        held_kb.append(memory_kb(pid, "VmRSS"))
    published_kb = COUNT * PAYLOAD // 1024
    # Without the bound the broker grew by about three times what was published; with it the second
    # round once added 11 MB of 40 MB with a second pytest worker beside it (the allocator's and the
    # reader's buffers): half of what was published still tells the two apart by a factor of six.
    assert held_kb[1] - held_kb[0] < published_kb // 2, (
        f"the broker's memory grew by {held_kb[1] - held_kb[0]} kB when {published_kb} kB more went to a "
        "subscriber that reads nothing"
    )
    assert connack_within(broker.port, WAIT), "a new client was not served"
    durable.connect()
    assert [m.payload for m in durable.wait_messages(len(queued))] == queued
    log = broker.log()
    assert "stalled: " in log and "wait to be sent to this clean-session connection" in log, log[-3000:]
    assert "max_pending_bytes_clean 16777216" in log
    stalled.close()


AWAITING_LIMIT = 1000
"""The default max_awaiting_pubrel."""


@pytest.mark.parametrize("path", PATHS)
def test_qos2_publishes_never_released_close_the_connection_at_max_awaiting_pubrel(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], path: str
) -> None:
    """amqtt holds every QoS 2 message until its PUBREL, for as long as the connection lasts: a
    client that never sends PUBREL could make it hold 65535 packets (of up to max_packet_size
    each) per connection. Past max_awaiting_pubrel the connection is closed, the PUBLISH
    unacknowledged; what was acknowledged before is kept."""
    broker = broker_factory(start=False)
    broker.extra_plugins.update(PATHS[path])
    broker.start()
    queued = payloads(5, "before")
    durable, publisher = queued_while_dropped(clients, broker.port, "q/#", "q/before", queued)
    attacker = raw_connect(broker.port, "hoarder", clean=True)
    body = b"h" * 1024
    for packet_id in range(1, AWAITING_LIMIT + 1):
        attacker.sendall(publish_packet(b"q/held", body, 2, packet_id=packet_id))
    pubrecs = bytearray()
    while len(pubrecs) < 4 * AWAITING_LIMIT:  # bounded: each recv gets at least a byte or fails
        chunk = attacker.recv(4 * AWAITING_LIMIT - len(pubrecs))
        assert chunk, "closed before the PUBRECs of the publishes within the limit"
        pubrecs += chunk
    assert bytes(pubrecs[:4]) == b"\x50\x02\x00\x01"
    resend = publish_packet(b"q/held", body, 2, packet_id=7)
    attacker.sendall(bytes((resend[0] | 0x08,)) + resend[1:])  # a DUP re-send of one awaiting: counts once
    assert attacker.recv(4) == b"\x50\x02\x00\x07"
    attacker.sendall(publish_packet(b"q/held", body, 2, packet_id=AWAITING_LIMIT + 1))
    assert read_until_closed(attacker, WAIT) == b"", "a QoS 2 PUBLISH past max_awaiting_pubrel was acknowledged"
    attacker.close()
    assert connack_within(broker.port, WAIT), "a new client was not served"
    publisher.publish("q/after", [b"after"], qos=2)
    durable.connect()
    got = durable.wait_messages(len(queued) + AWAITING_LIMIT + 1, WAIT + 10)
    assert [m.payload for m in got if m.topic == "q/before"] == queued, "a queued message was lost"
    assert len([m for m in got if m.topic == "q/held"]) == AWAITING_LIMIT  # stored before their PUBREC
    assert got[-1].payload == b"after"
    assert (
        f"closing the connection of hoarder: a QoS 2 PUBLISH (packet id {AWAITING_LIMIT + 1}) while "
        f"{AWAITING_LIMIT} QoS 2 publishes of this client await their PUBREL (this connection's and those an "
        f"earlier one left), max_awaiting_pubrel is "
        f"{AWAITING_LIMIT}"
    ) in broker.log()


PINGS = 100_000


def ping_round(sock: socket.socket) -> None:
    """PINGS PINGREQs, each PINGRESP read (in steps of 1000, so no buffer fills)."""
    for _ in range(PINGS // 1000):
        sock.sendall(b"\xc0\x00" * 1000)
        assert read_exactly(sock, 2000) == b"\xd0\x00" * 1000


@pytest.mark.slow  # 200,000 PINGREQ round trips: about 20 s
def test_an_unreleased_qos2_publish_does_not_make_the_reader_keep_every_later_packet(
    broker: Broker, clients: Callable[..., Client]
) -> None:
    """The plugin's reader ran a task per packet it hands to amqtt (PINGREQ, SUBSCRIBE, PUBREL,
    QoS 2 PUBLISH, ...) and freed finished ones from the front of its list only: behind one QoS 2
    publish awaiting its PUBREL, it kept every later packet's task for as long as the connection
    lasted (100,000 PINGREQs, 200 kB sent, held about 66 MB)."""
    assert broker.proc is not None
    pid = broker.proc.pid
    queued = payloads(5, "order")
    device, _ = queued_while_dropped(clients, broker.port, "orders/#", "orders/1", queued)
    attacker = raw_connect(broker.port, "pinger", clean=True)
    attacker.sendall(publish_packet(b"q/held", b"never released", 2, packet_id=1))
    assert read_exactly(attacker, 4) == b"\x50\x02\x00\x01"
    rss = []
    for _ in range(2):  # the first round may grow the heap; the second may only reuse it
        ping_round(attacker)
        rss.append(memory_kb(pid, "VmRSS"))
    assert rss[1] - rss[0] < 12_000, f"{PINGS} more PINGREQs grew the broker by {rss[1] - rss[0]} kB"
    assert connack_within(broker.port, WAIT), "a new client was not served"
    device.connect()
    assert [m.payload for m in device.wait_messages(len(queued))] == queued, "a queued message was lost"
    attacker.close()
