"""The test helper tests/packet_relay.py itself, between a raw MQTT client socket and a plain TCP
listener standing in for the broker (the test reads what reaches it, or reads nothing): a relay
thread's failure reaches wait_seen() at once and close() before its thread check, sends are bounded,
a rewrite may release(), and a hanging connect to the broker holds up no waiter."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from packet_relay import Packet, PacketRelay
from raw_mqtt_helpers import connect_packet, read_packet

from conftest import HOST, WAIT, mqtt_packet, mqtt_string

pytestmark = pytest.mark.timeout(60)

SHORT = 1.0
"""The relays' ``wait`` here: a stalled send fails within it."""


@pytest.fixture
def upstream() -> Iterator[socket.socket]:
    """A listener standing in for the broker, with a small receive buffer: one that reads nothing
    stalls the relay's sends after some hundred kilobytes."""
    listener = socket.socket()
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # inherited by what it accepts
    listener.bind((HOST, 0))
    listener.listen()
    listener.settimeout(WAIT)
    yield listener
    listener.close()


def linked(relay: PacketRelay, upstream: socket.socket) -> tuple[socket.socket, socket.socket]:
    """A client connected through ``relay``, and the upstream's side of its link."""
    client = socket.create_connection((HOST, relay.port), timeout=WAIT)
    broker_side, _ = upstream.accept()
    broker_side.settimeout(WAIT)
    return client, broker_side


def publish(number: int, size: int = 0) -> bytes:
    return mqtt_packet(0x30, mqtt_string(f"t/{number}") + bytes(size))


def failing_rewrite(failed: threading.Event) -> Callable[[Packet], Packet]:
    def rewrite(_packet: Packet) -> Packet:
        failed.set()
        raise AssertionError("spoiled by the rewrite")

    return rewrite


def test_a_relay_threads_failure_ends_wait_seen_at_once(upstream: socket.socket) -> None:
    """A waiter is told of the failure as it happens (not after its whole wait, as a timeout)."""
    relay = PacketRelay(upstream.getsockname()[1], failing_rewrite(threading.Event()))
    client, broker_side = linked(relay, upstream)
    client.sendall(connect_packet("c"))
    started = time.monotonic()
    with pytest.raises(AssertionError, match="spoiled by the rewrite"):
        relay.wait_seen(lambda packet: packet.kind == 2)  # no CONNACK comes
    assert time.monotonic() - started < WAIT / 2
    with pytest.raises(AssertionError, match="spoiled by the rewrite"):
        relay.close()
    client.close()
    broker_side.close()


def test_close_raises_a_relay_threads_failure_before_it_checks_the_threads(upstream: socket.socket) -> None:
    """close() raises what a relay thread raised, even while another relay thread still runs (here one
    in a rewrite that waits): the cause, not "still run"."""
    failed, waiting, go_on = threading.Event(), threading.Event(), threading.Event()
    spoil = failing_rewrite(failed)

    def rewrite(packet: Packet) -> Packet:
        if not failed.is_set():
            return spoil(packet)
        waiting.set()
        go_on.wait(WAIT)
        return packet

    relay = PacketRelay(upstream.getsockname()[1], rewrite, wait=SHORT)
    links = [linked(relay, upstream), linked(relay, upstream)]
    links[0][0].sendall(connect_packet("failing"))
    assert failed.wait(WAIT)
    links[1][0].sendall(connect_packet("waiting"))
    assert waiting.wait(WAIT)
    with pytest.raises(AssertionError, match="spoiled by the rewrite"):
        relay.close()
    go_on.set()
    for sock in (sock for link in links for sock in link):
        sock.close()


def test_a_send_to_a_peer_that_reads_nothing_fails_the_relay_within_its_wait(upstream: socket.socket) -> None:
    """The relay forwards to a broker that reads nothing: its send times out after ``wait`` and fails
    the relay: wait_seen() and close() raise the TimeoutError."""
    relay = PacketRelay(upstream.getsockname()[1], wait=SHORT)
    client, broker_side = linked(relay, upstream)
    client.settimeout(SHORT)
    with pytest.raises(OSError):  # the relay stops reading: the client's send stalls too
        client.sendall(b"".join(publish(number, 65536) for number in range(256)))  # 16 MiB
    with pytest.raises(TimeoutError):
        relay.wait_seen(lambda _packet: False)
    with pytest.raises(TimeoutError):
        relay.close()
    client.close()
    broker_side.close()


def test_a_release_to_a_peer_that_reads_nothing_raises_within_the_wait(upstream: socket.socket) -> None:
    """release() of more than a broker that reads nothing takes: TimeoutError after ``wait``."""
    relay = PacketRelay(upstream.getsockname()[1], wait=SHORT)
    relay.hold("up")
    client, broker_side = linked(relay, upstream)
    client.sendall(b"".join(publish(number, 65536) for number in range(256)))  # held: the relay reads it all
    relay.wait_seen(lambda packet: packet.body.startswith(mqtt_string("t/255")))
    with pytest.raises(TimeoutError):
        relay.release("up")
    relay.close()
    client.close()
    broker_side.close()


def test_a_rewrite_may_release_what_is_held(upstream: socket.socket) -> None:
    """A rewrite runs outside the relay's locks: its release() forwards what was held, then its packet."""
    holder: list[PacketRelay] = []

    def release_at_the_second(packet: Packet) -> Packet:
        if packet.body.startswith(mqtt_string("t/2")):
            holder[0].release("up")
        return packet

    relay = PacketRelay(upstream.getsockname()[1], release_at_the_second)
    holder.append(relay)
    relay.hold("up")
    client, broker_side = linked(relay, upstream)
    client.sendall(connect_packet("c") + publish(1) + publish(2))
    forwarded = [read_packet(broker_side) for _ in range(3)]
    assert [first >> 4 for first, _ in forwarded] == [1, 3, 3]
    assert [body for _, body in forwarded[1:]] == [mqtt_string("t/1"), mqtt_string("t/2")]
    relay.close()
    client.close()
    broker_side.close()


def test_a_release_from_a_predicate_raises_instead_of_deadlocking(upstream: socket.socket) -> None:
    """hold()'s ``which`` runs under the relay's lock: a release() from it fails the relay, named."""
    relay = PacketRelay(upstream.getsockname()[1])
    relay.hold("up", lambda _packet: relay.release("up") is None)
    client, broker_side = linked(relay, upstream)
    client.sendall(connect_packet("c") + publish(1))
    with pytest.raises(RuntimeError, match="release\\(\\) from a PacketRelay predicate"):
        relay.wait_seen(lambda _packet: False)
    with pytest.raises(RuntimeError):
        relay.close()
    client.close()
    broker_side.close()


def syn_sent_to(port: int) -> int:
    """Connections of this machine still waiting on their SYN to 127.0.0.1:``port`` (Linux's /proc/net/tcp)."""
    rows = Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]
    return sum(1 for row in rows if row.split()[2] == f"0100007F:{port:04X}" and row.split()[3] == "02")


def test_the_broker_connect_holds_up_no_waiter() -> None:
    """The relay connects to the broker outside its lock: while that connect hangs (the broker's accept
    queue is full, its SYN dropped) hold() returns at once, not when the connect gives up (``wait``)."""
    listener = socket.create_server((HOST, 0), backlog=0)
    filler = socket.create_connection(listener.getsockname(), timeout=WAIT)  # fills the queue: one more waits
    relay = PacketRelay(listener.getsockname()[1], wait=5.0)
    client = socket.create_connection((HOST, relay.port), timeout=WAIT)
    deadline = time.monotonic() + WAIT
    while not syn_sent_to(listener.getsockname()[1]):  # the relay is in its connect; bounded by the deadline
        assert time.monotonic() < deadline, "the relay did not connect to the broker"
        time.sleep(0.01)  # polling the kernel's table: the relay's thread tells nothing
    started = time.monotonic()
    relay.hold("up")
    assert time.monotonic() - started < 1.0
    listener.accept()[0].close()  # room in the queue: the relay's SYN, sent again, gets through
    relay.close()
    for sock in (client, filler, listener):
        sock.close()
