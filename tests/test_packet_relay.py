"""The test helper tests/packet_relay.py itself, between a raw MQTT client socket and a plain TCP
listener standing in for the broker (the test reads what reaches it, or reads nothing): a relay
thread's failure reaches wait_seen() at once and close() before its thread check, sends, release()s
and a whole packet's read are bounded (a release() that times out fails the relay), a rewrite may
release(), a hanging connect to the broker holds up no waiter, a client whose broker connect was
under way at a cut() is dropped, a cut() leaves its links' descriptors to the pumps until they end,
and the ``relays`` fixture closes every relay even after one raised.
Every relay and socket is closed at the test's end, even when it fails (fixtures)."""

from __future__ import annotations

import contextlib
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
import raw_mqtt_helpers
from packet_relay import Packet, PacketRelay, close_all
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


@pytest.fixture
def sockets() -> Iterator[list[socket.socket]]:
    """The sockets a test opens, closed at its end whatever happened."""
    opened: list[socket.socket] = []
    yield opened
    for sock in opened:
        sock.close()


def linked(
    relay: PacketRelay, upstream: socket.socket, sockets: list[socket.socket]
) -> tuple[socket.socket, socket.socket]:
    """A client connected through ``relay``, and the upstream's side of its link (both kept in ``sockets``)."""
    client = socket.create_connection((HOST, relay.port), timeout=WAIT)
    sockets.append(client)
    broker_side, _ = upstream.accept()
    sockets.append(broker_side)
    broker_side.settimeout(WAIT)
    return client, broker_side


def publish(number: int, size: int = 0) -> bytes:
    return mqtt_packet(0x30, mqtt_string(f"t/{number}") + bytes(size))


def failing_rewrite(failed: threading.Event) -> Callable[[Packet], Packet]:
    def rewrite(_packet: Packet) -> Packet:
        failed.set()
        raise AssertionError("spoiled by the rewrite")

    return rewrite


def test_a_relay_threads_failure_ends_wait_seen_at_once(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """A waiter is told of the failure as it happens (not after its whole wait, as a timeout)."""
    relay = relays(upstream.getsockname()[1], failing_rewrite(threading.Event()))
    client, _ = linked(relay, upstream, sockets)
    client.sendall(connect_packet("c"))
    started = time.monotonic()
    with pytest.raises(AssertionError, match="spoiled by the rewrite"):
        relay.wait_seen(lambda packet: packet.kind == 2)  # no CONNACK comes
    assert time.monotonic() - started < WAIT / 2
    with pytest.raises(AssertionError, match="spoiled by the rewrite"):
        relay.close()


def test_close_raises_a_relay_threads_failure_before_it_checks_the_threads(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
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

    relay = relays(upstream.getsockname()[1], rewrite, wait=SHORT)
    links = [linked(relay, upstream, sockets), linked(relay, upstream, sockets)]
    try:
        links[0][0].sendall(connect_packet("failing"))
        assert failed.wait(WAIT)
        links[1][0].sendall(connect_packet("waiting"))
        assert waiting.wait(WAIT)
        with pytest.raises(AssertionError, match="spoiled by the rewrite"):
            relay.close()
    finally:
        go_on.set()


def test_a_send_to_a_peer_that_reads_nothing_fails_the_relay_within_its_wait(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """The relay forwards to a broker that reads nothing: its send times out after ``wait`` and fails
    the relay: wait_seen() and close() raise the TimeoutError."""
    relay = relays(upstream.getsockname()[1], wait=SHORT)
    client, _ = linked(relay, upstream, sockets)
    client.settimeout(SHORT)
    with pytest.raises(OSError):  # the relay stops reading: the client's send stalls too
        client.sendall(b"".join(publish(number, 65536) for number in range(256)))  # 16 MiB
    with pytest.raises(TimeoutError):
        relay.wait_seen(lambda _packet: False)
    with pytest.raises(TimeoutError):
        relay.close()


def test_a_release_to_a_peer_that_reads_nothing_raises_within_the_wait_and_fails_the_relay(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """release() of more than a broker that reads nothing takes: TimeoutError after ``wait``; the link,
    left with part of a packet sent, is shut down, and the relay has failed: wait_seen() and close()
    raise it too, so a test that catches the release()'s error still fails (before: close() passed)."""
    relay = relays(upstream.getsockname()[1], wait=SHORT)
    relay.hold("up")
    client, broker_side = linked(relay, upstream, sockets)
    client.sendall(b"".join(publish(number, 65536) for number in range(256)))  # held: the relay reads it all
    relay.wait_seen(lambda packet: packet.body.startswith(mqtt_string("t/255")))
    with pytest.raises(TimeoutError) as released:
        relay.release("up")
    with pytest.raises(TimeoutError) as seen:
        relay.wait_seen(lambda _packet: False)
    assert seen.value is released.value
    broker_side.settimeout(SHORT)
    while broker_side.recv(1 << 20):  # what was sent, then the end the shutdown brought; bounded by SHORT
        pass
    with pytest.raises(TimeoutError):
        relay.close()


def test_a_packet_trickled_slower_than_the_wait_fails_the_relay(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """``wait`` bounds a whole packet's read, not each byte's: a client that sends its bytes 0.3 s
    apart (each well within the relay's 1 s) has not sent a 10-byte packet within the wait, and the
    relay fails with TimeoutError (before: it waited for every byte, forwarded it, and passed)."""
    relay = relays(upstream.getsockname()[1], wait=SHORT)
    client, broker_side = linked(relay, upstream, sockets)
    packet = publish(1, 3)  # 0x30, 8, then 8 bytes: 10 in all
    assert len(packet) == 10
    for index in range(len(packet)):  # 2.7 s for the whole packet
        try:
            client.sendall(packet[index : index + 1])
        except OSError:  # the relay gave up on the packet and ended the link
            break
        time.sleep(0.3)  # the trickle itself (a byte each 0.3 s), not a synchronisation
    with pytest.raises(TimeoutError, match="before the deadline"):
        relay.wait_seen(lambda candidate: candidate.kind == 3)
    broker_side.settimeout(SHORT)
    assert broker_side.recv(16) == b"", "the relay forwarded the trickled packet"
    with pytest.raises(TimeoutError):
        relay.close()


def test_a_rewrite_may_release_what_is_held(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """A rewrite runs outside the relay's locks: its release() forwards what was held, then its packet."""
    holder: list[PacketRelay] = []

    def release_at_the_second(packet: Packet) -> Packet:
        if packet.body.startswith(mqtt_string("t/2")):
            holder[0].release("up")
        return packet

    relay = relays(upstream.getsockname()[1], release_at_the_second)
    holder.append(relay)
    relay.hold("up")
    client, broker_side = linked(relay, upstream, sockets)
    client.sendall(connect_packet("c") + publish(1) + publish(2))
    forwarded = [read_packet(broker_side) for _ in range(3)]
    assert [first >> 4 for first, _ in forwarded] == [1, 3, 3]
    assert [body for _, body in forwarded[1:]] == [mqtt_string("t/1"), mqtt_string("t/2")]
    relay.close()


def test_a_release_from_a_predicate_raises_instead_of_deadlocking(
    upstream: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """hold()'s ``which`` runs under the relay's lock: a release() from it fails the relay, named."""
    relay = relays(upstream.getsockname()[1])
    relay.hold("up", lambda _packet: relay.release("up") is None)
    client, _ = linked(relay, upstream, sockets)
    client.sendall(connect_packet("c") + publish(1))
    with pytest.raises(RuntimeError, match="release\\(\\) from a PacketRelay predicate"):
        relay.wait_seen(lambda _packet: False)
    with pytest.raises(RuntimeError):
        relay.close()


def test_close_all_closes_every_relay_then_raises_the_first_failure(
    upstream: socket.socket, sockets: list[socket.socket]
) -> None:
    """The ``relays`` fixture's close_all: a relay whose close() raises (its thread failed) does not
    leave the next one open (before: the fixture's loop stopped at the first that raised)."""
    failing = PacketRelay(upstream.getsockname()[1], failing_rewrite(threading.Event()))
    healthy = PacketRelay(upstream.getsockname()[1])
    try:
        client, _ = linked(failing, upstream, sockets)
        client.sendall(connect_packet("c"))
        with pytest.raises(AssertionError, match="spoiled by the rewrite"):
            failing.wait_seen(lambda _packet: False)
        with pytest.raises(AssertionError, match="spoiled by the rewrite"):
            close_all([failing, healthy])
        with pytest.raises(ConnectionRefusedError):  # it stopped listening: closed
            socket.create_connection((HOST, healthy.port), timeout=WAIT).close()
    finally:
        with contextlib.suppress(AssertionError):
            close_all([failing, healthy])  # each close() after the first does nothing


def syn_sent_to(port: int) -> int:
    """Connections of this machine still waiting on their SYN to 127.0.0.1:``port`` (Linux's /proc/net/tcp)."""
    rows = Path("/proc/net/tcp").read_text(encoding="ascii").splitlines()[1:]
    return sum(1 for row in rows if row.split()[2] == f"0100007F:{port:04X}" and row.split()[3] == "02")


def await_syn_sent(port: int) -> None:
    """Until a connection of this machine waits on its SYN to ``port`` (the relay is in its broker connect)."""
    deadline = time.monotonic() + WAIT
    while not syn_sent_to(port):  # bounded by the deadline
        assert time.monotonic() < deadline, "the relay did not connect to the broker"
        time.sleep(0.01)  # polling the kernel's table: the relay's thread tells nothing


@pytest.fixture
def full_listener(sockets: list[socket.socket]) -> socket.socket:
    """A listener standing in for a broker whose accept queue is full (one connection in it, not
    accepted): a connect to it hangs, its SYN dropped, until the test accepts from it."""
    listener = socket.create_server((HOST, 0), backlog=0)
    listener.settimeout(WAIT)
    sockets.append(listener)
    sockets.append(socket.create_connection(listener.getsockname(), timeout=WAIT))  # fills the queue
    return listener


def test_the_broker_connect_holds_up_no_waiter(
    full_listener: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """The relay connects to the broker outside its lock: while that connect hangs (the broker's accept
    queue is full, its SYN dropped) hold() returns at once, not when the connect gives up (``wait``)."""
    relay = relays(full_listener.getsockname()[1], wait=5.0)
    sockets.append(socket.create_connection((HOST, relay.port), timeout=WAIT))
    await_syn_sent(full_listener.getsockname()[1])
    started = time.monotonic()
    relay.hold("up")
    assert time.monotonic() - started < 1.0
    full_listener.accept()[0].close()  # room in the queue: the relay's SYN, sent again, gets through
    relay.close()


def test_a_client_whose_broker_connect_was_under_way_at_a_cut_is_dropped(
    full_listener: socket.socket, sockets: list[socket.socket], relays: Callable[..., PacketRelay]
) -> None:
    """A client accepted before cut() whose broker connect is still under way (held by a full accept
    queue) is dropped once that connect succeeds, though accept() came meanwhile: both its sockets
    end, nothing is relayed (before the cut counter: it was linked, as if accepted after the cut)."""
    relay = relays(full_listener.getsockname()[1], wait=WAIT)  # its connect outlives the SYN's resends
    client = socket.create_connection((HOST, relay.port), timeout=WAIT)
    sockets.append(client)
    await_syn_sent(full_listener.getsockname()[1])  # the relay took the client and is in its connect
    relay.cut()
    relay.accept()
    full_listener.accept()[0].close()  # room in the queue: the relay's SYN, sent again, gets through
    broker_side, _ = full_listener.accept()
    sockets.append(broker_side)
    broker_side.settimeout(WAIT)
    assert client.recv(1) == b"", "the client accepted before the cut was linked"
    assert broker_side.recv(1) == b""


FD_GRABS = 8
"""Socket pairs opened right after a cut(): had it closed the link's sockets, their freed descriptor
numbers go to these (Linux hands out the lowest free one), idle for the whole test."""


def test_a_cut_leaves_the_link_s_descriptors_open_until_its_pumps_have_ended(
    upstream: socket.socket,
    sockets: list[socket.socket],
    relays: Callable[..., PacketRelay],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A pump reads a packet's rest with poll() on its socket's descriptor number, taken just before.
    A cut() between the two that closed the socket (not only shut it down) let that number go to
    another, idle socket: the pump polled that one until the relay's ``wait`` (the 14.7 s close() of
    three SDK tests). Here the up pump is held between the two (a poll object that waits for the test
    at register()) while the cut happens and new sockets are opened: it must end at once after."""
    at_register, go_on = threading.Event(), threading.Event()

    class HeldPoll:
        """select.poll() whose first register() in the up pump waits for the test."""

        def __init__(self) -> None:
            self._poll = select.poll()

        def register(self, fd: int, mask: int) -> None:
            if threading.current_thread().name == "packet-relay-up" and not at_register.is_set():
                at_register.set()
                assert go_on.wait(WAIT)
            self._poll.register(fd, mask)

        def poll(self, timeout: float) -> list[tuple[int, int]]:
            return self._poll.poll(timeout)

    monkeypatch.setattr(raw_mqtt_helpers, "select", SimpleNamespace(poll=HeldPoll, POLLIN=select.POLLIN))
    relay = relays(upstream.getsockname()[1], wait=WAIT)
    client, _ = linked(relay, upstream, sockets)
    client.sendall(b"\x30")  # a PUBLISH's first byte: the pump reads it, then polls for the rest
    try:
        assert at_register.wait(WAIT)
        relay.cut()
        for _ in range(FD_GRABS):
            sockets += socket.socketpair()
    finally:
        go_on.set()
    pumps = [thread for thread in relay._threads if thread.name.startswith("packet-relay-")]
    assert len(pumps) == 2  # the link's, up and down
    deadline = time.monotonic() + SHORT
    for pump in pumps:
        pump.join(max(0.0, deadline - time.monotonic()))
    assert not [pump.name for pump in pumps if pump.is_alive()], "a cut link's pump still waits"
