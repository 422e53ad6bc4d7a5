"""The fleet's fault proxy against real sockets on 127.0.0.1: a stand-in broker (a threaded TCP
server that records what each connection receives and how it ended) and plain socket devices
that send a real MQTT CONNECT. Waits are condition waits or socket timeouts; the absence of
bytes during a stall is checked with one bounded ~0.3 s wait."""

from __future__ import annotations

import contextlib
import logging
import os
import select
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator

import pytest

from amqtt_durable.wire import remaining_length as varint
from conftest import mqtt_packet, mqtt_string
from durable_fleet.proxy import RATE_STEP, FaultProxy, ProxyStats, TcpRelay, connect_client_id

HOST = "127.0.0.1"
WAIT = 10.0
ABSENT = 0.3
"""How long bytes must not arrive during a stall (the only timed wait)."""


def build_connect(
    client_id: str,
    *,
    version: int = 4,
    properties: bytes = b"",
    username: str | None = None,
    password: bytes | None = None,
) -> bytes:
    """A CONNECT packet of MQTT 3.1.1 (version 4) or 5.0 (version 5, with ``properties``)."""
    flags = 0x02 | (0x80 if username is not None else 0) | (0x40 if password is not None else 0)
    body = mqtt_string("MQTT") + bytes((version, flags)) + struct.pack(">H", 30)
    if version == 5:
        body += varint(len(properties)) + properties
    body += mqtt_string(client_id)
    if username is not None:
        body += mqtt_string(username)
    if password is not None:
        body += mqtt_string(password)
    return mqtt_packet(0x10, body)


def publish(topic: str, payload: bytes) -> bytes:
    return mqtt_packet(0x30, mqtt_string(topic) + payload)


class Conn:
    """One connection the stand-in broker accepted: what arrived, and how it ended."""

    def __init__(self, sock: socket.socket, cond: threading.Condition) -> None:
        self.sock = sock
        self.cond = cond
        self.data = bytearray()
        self.ended: str | None = None
        """'eof' (a FIN), 'reset' (an RST) or 'closed' (closed here)."""
        self.thread = threading.Thread(target=self._read, daemon=True)
        self.thread.start()

    def _read(self) -> None:
        ended = "eof"
        try:
            while chunk := self.sock.recv(65536):
                with self.cond:
                    self.data += chunk
                    self.cond.notify_all()
        except ConnectionResetError:
            ended = "reset"
        except OSError:
            ended = "closed"
        with self.cond:
            self.ended = ended
            self.cond.notify_all()

    def wait(self, predicate: Callable[[], bool], timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(predicate, timeout)

    def wait_data(self, expected: bytes, timeout: float = WAIT) -> bytes:
        """What arrived once it is ``expected`` long (or at the timeout, or at the end)."""
        self.wait(lambda: len(self.data) >= len(expected) or self.ended is not None, timeout)
        with self.cond:
            return bytes(self.data)

    def wait_end(self, timeout: float = WAIT) -> str | None:
        self.wait(lambda: self.ended is not None, timeout)
        return self.ended

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def reset(self) -> None:
        """Resets the connection (an RST, no FIN before it)."""
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        self.sock.shutdown(socket.SHUT_RD)  # ends the reader's recv() and sends nothing...
        self.thread.join(WAIT)
        self.sock.close()  # ...so this close is the RST (a socket in a blocked recv() would stay open)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)
        self.sock.close()


class Upstream:
    """A stand-in broker on an ephemeral port: accepts every connection and records it."""

    def __init__(self) -> None:
        self.listener = socket.create_server((HOST, 0))
        self.port = int(self.listener.getsockname()[1])
        self.cond = threading.Condition()
        self.conns: list[Conn] = []
        self.thread = threading.Thread(target=self._accept, daemon=True)
        self.thread.start()

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.listener.accept()
            except OSError:
                return
            with self.cond:
                self.conns.append(Conn(sock, self.cond))
                self.cond.notify_all()

    def count(self) -> int:
        with self.cond:
            return len(self.conns)

    def wait_count(self, count: int, timeout: float = WAIT) -> bool:
        with self.cond:
            return self.cond.wait_for(lambda: len(self.conns) >= count, timeout)

    def conn_of(self, connect: bytes, start: int = 0, timeout: float = WAIT) -> Conn:
        """The connection (from the ``start``'th accepted on) whose first bytes are ``connect`` (waits for it)."""

        def find() -> Conn | None:
            return next((conn for conn in self.conns[start:] if conn.data.startswith(connect)), None)

        with self.cond:
            self.cond.wait_for(lambda: find() is not None, timeout)
            conn = find()
        assert conn is not None, f"no upstream connection started with {connect!r}"
        return conn

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.listener.shutdown(socket.SHUT_RDWR)
        self.listener.close()
        self.thread.join(WAIT)
        with self.cond:
            conns = list(self.conns)
        for conn in conns:
            conn.close()
            conn.thread.join(WAIT)


@pytest.fixture
def upstream() -> Iterator[Upstream]:
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
def proxies(upstream: Upstream) -> Iterator[Callable[..., FaultProxy]]:
    started: list[FaultProxy] = []

    def make(port: int | None = None, connect_timeout: float = 5.0) -> FaultProxy:
        proxy = FaultProxy(HOST, upstream.port if port is None else port, connect_timeout=connect_timeout)
        proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        proxy.stop()


@pytest.fixture
def proxy(proxies: Callable[..., FaultProxy]) -> FaultProxy:
    return proxies()


@pytest.fixture
def sockets() -> Iterator[Callable[[int], socket.socket]]:
    """Device sockets to the proxy, closed after the test."""
    opened: list[socket.socket] = []

    def connect(port: int) -> socket.socket:
        sock = socket.create_connection((HOST, port), timeout=WAIT)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        opened.append(sock)
        return sock

    yield connect
    for sock in opened:
        sock.close()


Link = tuple[socket.socket, Conn]


@pytest.fixture
def link(proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]) -> Callable[..., Link]:
    """A device connected through the proxy: its socket and the broker's side of the link."""

    def make(client_id: str, version: int = 4) -> Link:
        connect = build_connect(client_id, version=version)
        start = upstream.count()
        sock = sockets(proxy.port)
        sock.sendall(connect)
        return sock, upstream.conn_of(connect, start)

    return make


def recv_exactly(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            raise AssertionError(f"EOF after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


def assert_reset(sock: socket.socket) -> None:
    """The device sees its connection reset (an RST, not a FIN)."""
    sock.settimeout(WAIT)
    with pytest.raises(ConnectionResetError):
        sock.recv(1)


def assert_closed(sock: socket.socket) -> None:
    """The device sees its connection closed, by a FIN or an RST."""
    sock.settimeout(WAIT)
    with contextlib.suppress(ConnectionResetError):
        assert sock.recv(1) == b""


def readable(sock: socket.socket, timeout: float = 0.0) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


def held(proxy: FaultProxy, device: str, count: int, timeout: float = WAIT) -> bool:
    """Wait until the proxy has read ``count`` CONNECTs of ``device`` (it reports no event for that)."""
    deadline = time.monotonic() + timeout
    pause = threading.Event()
    while proxy.connected(device) != count:
        if time.monotonic() > deadline:
            return False
        pause.wait(0.01)  # each check is a call into the proxy's loop; bounded by the deadline
    return True


def roundtrip(sock: socket.socket, conn: Conn, tag: bytes) -> None:
    """Bytes go through the link both ways."""
    before = len(conn.wait_data(b""))
    up = publish("up", tag)
    sock.sendall(up)
    assert conn.wait_data(b"x" * (before + len(up)))[before:] == up
    down = publish("down", tag)
    conn.send(down)
    assert recv_exactly(sock, len(down)) == down


@pytest.mark.timeout(30)
def test_connect_client_id_311_and_5() -> None:
    assert connect_client_id(build_connect("dev-1")) == "dev-1"
    assert connect_client_id(build_connect("dev-ü", username="u", password=b"p")) == "dev-ü"
    properties = b"\x11\x00\x00\x0e\x10" + b"\x21\x00\x14" + b"\x26" + mqtt_string("k" * 100) + mqtt_string("v")
    packet = build_connect("dev-5", version=5, properties=properties)
    assert packet[1] & 0x80  # a two-byte remaining length
    assert connect_client_id(packet) == "dev-5"
    assert connect_client_id(build_connect("", version=5)) == ""


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "packet",
    [
        publish("t", b"x"),
        mqtt_packet(0x10, mqtt_string("HTTP") + b"\x04\x02\x00\x1e" + mqtt_string("d")),
        mqtt_packet(0x10, mqtt_string("MQTT") + b"\x04\x03\x00\x1e" + mqtt_string("d")),  # reserved flag
        mqtt_packet(0x10, mqtt_string("MQTT") + b"\x04\x02\x00\x1e\x00\x05ab"),  # truncated client id
        mqtt_packet(0x10, mqtt_string("MQTT") + b"\x05\x02\x00\x1e\x09" + mqtt_string("d")),  # properties overrun
        mqtt_packet(0x10, mqtt_string("MQTT") + b"\x04\x02\x00\x1e" + mqtt_string(b"\xff\xfe")),
        build_connect("d")[:-1],
    ],
)
def test_connect_client_id_rejects_malformed(packet: bytes) -> None:
    with pytest.raises(ValueError):
        connect_client_id(packet)


@pytest.mark.timeout(30)
def test_forwards_both_ways_byte_exact(link: Callable[..., Link]) -> None:
    sock, conn = link("d1")
    connect = build_connect("d1")
    up = os.urandom(300_000)
    sock.sendall(up)
    assert conn.wait_data(connect + up) == connect + up
    down = os.urandom(300_000)
    conn.send(down)
    assert recv_exactly(sock, len(down)) == down


@pytest.mark.timeout(30)
def test_connect_split_across_sends_and_extra_bytes_in_the_same_send(
    proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    properties = b"\x11\x00\x00\x0e\x10" + b"\x26" + mqtt_string("k" * 200) + mqtt_string("v")
    split = build_connect("split-5", version=5, properties=properties)
    sock = sockets(proxy.port)
    for start in range(0, len(split), 7):  # the header byte, the 2-byte length and the rest in pieces
        sock.send(split[start : start + 7])
    extra = publish("after", b"split")
    sock.sendall(extra)
    assert upstream.conn_of(split).wait_data(split + extra) == split + extra

    together = build_connect("together", username="u", password=b"pw")
    extra = publish("same", b"send") + publish("same", b"again")
    other = sockets(proxy.port)
    other.sendall(together + extra)
    assert upstream.conn_of(together).wait_data(together + extra) == together + extra
    assert proxy.connected("split-5") == 1
    assert proxy.connected("together") == 1
    assert proxy.connected() == 2


@pytest.mark.timeout(30)
def test_cut_resets_the_device_refuses_it_until_restore(
    proxy: FaultProxy, upstream: Upstream, link: Callable[..., Link], sockets: Callable[[int], socket.socket]
) -> None:
    d1, conn1 = link("d1", version=5)
    d2, conn2 = link("d2")

    assert proxy.cut("d1") == 1
    assert_reset(d1)
    assert conn1.wait_end() == "reset"
    assert proxy.connected("d1") == 0
    roundtrip(d2, conn2, b"unaffected")

    conns = upstream.count()
    again = sockets(proxy.port)
    again.sendall(build_connect("d1", version=5))
    assert_reset(again)
    assert upstream.count() == conns  # refused before the broker
    assert proxy.stats.refused == 1

    proxy.restore("d1")
    d1, conn1 = link("d1", version=5)
    roundtrip(d1, conn1, b"back")
    assert proxy.stats.cuts == 1


@pytest.mark.timeout(30)
def test_cut_all_resets_every_link(
    proxy: FaultProxy, link: Callable[..., Link], sockets: Callable[[int], socket.socket]
) -> None:
    links = [link(f"d{i}") for i in range(3)]
    assert proxy.cut() == 3
    for sock, conn in links:
        assert_reset(sock)
        assert conn.wait_end() == "reset"
    assert proxy.connected() == 0
    refused = sockets(proxy.port)
    refused.sendall(build_connect("never-seen"))
    assert_reset(refused)

    proxy.restore()
    roundtrip(*link("d0"), b"again")
    assert proxy.stats.cuts == 3
    assert proxy.stats.refused == 1


@pytest.mark.timeout(30)
def test_cut_before_the_device_ever_connects(
    proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    assert proxy.cut("later") == 0
    sock = sockets(proxy.port)
    sock.sendall(build_connect("later"))
    assert_reset(sock)
    assert upstream.count() == 0


@pytest.mark.timeout(30)
def test_stall_holds_both_ways_and_restore_delivers_in_order(proxy: FaultProxy, link: Callable[..., Link]) -> None:
    d1, conn1 = link("d1")
    d2, conn2 = link("d2")
    connect = build_connect("d1")
    conn1.wait_data(connect)

    assert proxy.stall("d1") == 1
    up = [publish("up", b"held-1"), publish("up", b"held-2")]
    down = publish("down", b"held")
    d1.sendall(up[0])
    conn1.send(down)
    roundtrip(d2, conn2, b"other device flows")
    d1.sendall(up[1])
    assert not conn1.wait(lambda: len(conn1.data) > len(connect), ABSENT)
    assert not readable(d1)
    assert conn1.ended is None
    assert proxy.connected("d1") == 1

    proxy.restore("d1")
    expected = connect + up[0] + up[1]
    assert conn1.wait_data(expected) == expected
    assert recv_exactly(d1, len(down)) == down
    roundtrip(d1, conn1, b"after")


@pytest.mark.timeout(30)
def test_a_one_way_stall_holds_that_way_only_and_both_ways_make_a_stall(
    proxy: FaultProxy, link: Callable[..., Link]
) -> None:
    d1, conn1 = link("d1")
    connect = build_connect("d1")
    conn1.wait_data(connect)

    assert proxy.stall("d1", direction="down") == 1
    up = publish("up", b"flows")
    d1.sendall(up)
    assert conn1.wait_data(connect + up) == connect + up
    down = publish("down", b"held")
    conn1.send(down)
    assert not readable(d1, ABSENT)
    proxy.restore("d1")
    assert recv_exactly(d1, len(down)) == down

    assert proxy.stall("d1", direction="up") == 1
    down = publish("down", b"flows")
    conn1.send(down)
    assert recv_exactly(d1, len(down)) == down
    held_up = publish("up", b"held")
    d1.sendall(held_up)
    assert not conn1.wait(lambda: len(conn1.data) > len(connect + up), ABSENT)
    assert proxy.stall("d1", direction="down") == 1  # up, then down: both ways
    conn1.send(down)
    assert not readable(d1, ABSENT)
    proxy.restore("d1")
    expected = connect + up + held_up
    assert conn1.wait_data(expected) == expected
    assert recv_exactly(d1, len(down)) == down
    roundtrip(d1, conn1, b"after")


@pytest.mark.timeout(30)
def test_a_connection_opened_during_a_stall_up_sends_its_connect_only(
    proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    """The proxy reads the CONNECT to know the device: a one-way stall up forwards it, holds what follows."""
    assert proxy.stall(direction="up") == 0
    connect = build_connect("d5")
    extra = publish("early", b"bird")
    sock = sockets(proxy.port)
    sock.sendall(connect + extra)
    conn = upstream.conn_of(connect)
    assert not conn.wait(lambda: len(conn.data) > len(connect), ABSENT)
    connack = bytes([0x20, 2, 0, 0])
    conn.send(connack)
    assert recv_exactly(sock, len(connack)) == connack
    proxy.restore()
    assert conn.wait_data(connect + extra) == connect + extra


@pytest.mark.timeout(30)
def test_connection_opened_during_a_stall_is_held_until_restore(
    proxy: FaultProxy, upstream: Upstream, link: Callable[..., Link], sockets: Callable[[int], socket.socket]
) -> None:
    other, other_conn = link("other")
    assert proxy.stall("d3") == 0  # before d3 ever connected
    connect = build_connect("d3")
    extra = publish("early", b"bird")
    sock = sockets(proxy.port)
    sock.sendall(connect + extra)
    assert not upstream.wait_count(2, ABSENT)
    roundtrip(other, other_conn, b"flows")
    assert proxy.connected("d3") == 1

    proxy.restore("d3")
    conn = upstream.conn_of(connect)
    assert conn.wait_data(connect + extra) == connect + extra
    roundtrip(sock, conn, b"now")


@pytest.mark.timeout(30)
def test_a_held_connection_the_device_gave_up_on_never_reaches_the_broker(
    proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    """In a real blackhole its SYN is never answered; the broker must not get its stale CONNECT."""
    proxy.stall("d4")
    given_up = sockets(proxy.port)
    given_up.sendall(build_connect("d4"))
    assert held(proxy, "d4", 1)  # its CONNECT read, held before the broker
    given_up.close()  # the client's connect timed out
    retry = sockets(proxy.port)
    retry_connect = build_connect("d4") + publish("retry", b"x")
    retry.sendall(retry_connect)
    assert held(proxy, "d4", 2)

    proxy.restore("d4")
    conn = upstream.conn_of(retry_connect)
    assert conn.wait_data(retry_connect) == retry_connect
    assert upstream.wait_count(2, ABSENT) is False  # only the retry went upstream


@pytest.mark.timeout(30)
def test_close_and_reset_during_a_stall_propagate_after_restore(proxy: FaultProxy, link: Callable[..., Link]) -> None:
    d1, conn1 = link("d1")
    d2, conn2 = link("d2")
    assert proxy.stall() == 2
    d1.sendall(b"last words")
    d1.close()  # a FIN after the data
    conn2.reset()  # the broker resets d2's connection
    assert conn1.wait_end(ABSENT) is None
    assert not readable(d2)

    proxy.restore()
    assert conn1.wait_end() == "eof"
    assert conn1.data.endswith(b"last words")
    assert_reset(d2)


@pytest.mark.timeout(30)
def test_global_stall_outlasts_restore_of_one_device(proxy: FaultProxy, link: Callable[..., Link]) -> None:
    d1, conn1 = link("d1")
    sent = len(conn1.wait_data(build_connect("d1")))
    assert proxy.stall() == 1
    proxy.restore("d1")
    d1.sendall(b"still stalled")
    assert not conn1.wait(lambda: len(conn1.data) > sent, ABSENT)

    proxy.restore()
    assert conn1.wait_data(b"x" * (sent + 13))[sent:] == b"still stalled"


@pytest.mark.timeout(30)
def test_cut_during_a_stall_resets(proxy: FaultProxy, link: Callable[..., Link]) -> None:
    d1, conn1 = link("d1")
    d2, conn2 = link("d2")
    proxy.stall()
    assert proxy.cut("d1") == 1  # a device's cut is worse than a global stall
    assert_reset(d1)
    assert conn1.wait_end() == "reset"
    proxy.restore()
    roundtrip(d2, conn2, b"survived")


@pytest.mark.timeout(30)
def test_a_stall_over_a_cut_keeps_the_device_refused(
    proxy: FaultProxy, upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    """Overlapping faults: only restore() makes a link better."""
    proxy.cut("d5")
    assert proxy.stall("d5") == 0
    refused = sockets(proxy.port)
    refused.sendall(build_connect("d5"))
    assert_reset(refused)  # still cut: refused, not held
    assert upstream.count() == 0
    proxy.restore("d5")
    sock = sockets(proxy.port)
    connect = build_connect("d5")
    sock.sendall(connect)
    assert upstream.conn_of(connect).wait_data(connect) == connect


@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    "case",
    [(publish("not", b"a connect"), "not a well-formed MQTT CONNECT"), (b"", "no complete MQTT CONNECT within")],
    ids=["malformed", "silent"],
)
def test_bad_first_packet_is_closed_with_a_warning(
    proxies: Callable[..., FaultProxy],
    upstream: Upstream,
    sockets: Callable[[int], socket.socket],
    caplog: pytest.LogCaptureFixture,
    case: tuple[bytes, str],
) -> None:
    first, problem = case
    caplog.set_level(logging.WARNING, logger="durable_fleet.proxy")
    proxy = proxies(connect_timeout=0.5)
    bad = sockets(proxy.port)
    bad.sendall(first)
    good = sockets(proxy.port)
    connect = build_connect("good")
    good.sendall(connect)
    roundtrip(good, upstream.conn_of(connect), b"unaffected")

    assert_closed(bad)
    peer = f"{HOST}:{bad.getsockname()[1]}"
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert any(peer in message and problem in message for message in warnings), warnings
    assert upstream.count() == 1
    roundtrip(good, upstream.conn_of(connect), b"still")


@pytest.mark.timeout(30)
def test_broker_not_reachable_closes_the_device(
    proxies: Callable[..., FaultProxy], sockets: Callable[[int], socket.socket], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG, logger="durable_fleet.proxy")
    with socket.socket() as closed_port:  # bound, not listening: connections to it are refused
        closed_port.bind((HOST, 0))
        proxy = proxies(port=closed_port.getsockname()[1])
        sock = sockets(proxy.port)
        sock.sendall(build_connect("lonely"))
        assert_reset(sock)
    records = [r for r in caplog.records if r.name == "durable_fleet.proxy"]
    assert any(r.levelno == logging.DEBUG and "not reachable" in r.getMessage() for r in records)
    assert not [r for r in records if r.levelno >= logging.WARNING]
    assert proxy.connected() == 0


@pytest.mark.timeout(30)
def test_stats(proxy: FaultProxy, link: Callable[..., Link], sockets: Callable[[int], socket.socket]) -> None:
    assert proxy.stats == ProxyStats()
    d1, conn1 = link("d1")
    up, down = b"u" * 1000, b"d" * 2000
    d1.sendall(up)
    conn1.wait_data(build_connect("d1") + up)
    conn1.send(down)
    recv_exactly(d1, len(down))
    link("d2")
    proxy.cut("d1")
    refused = sockets(proxy.port)
    refused.sendall(build_connect("d1"))
    assert_reset(refused)
    assert proxy.stats == ProxyStats(
        accepted=3,
        cuts=1,
        refused=1,
        bytes_up=len(build_connect("d1")) + len(up) + len(build_connect("d2")),
        bytes_down=len(down),
    )


@pytest.mark.timeout(30)
def test_stop_resets_links_and_calls_after_stop_are_harmless(
    upstream: Upstream, sockets: Callable[[int], socket.socket]
) -> None:
    proxy = FaultProxy(HOST, upstream.port)
    proxy.start()
    sock = sockets(proxy.port)
    connect = build_connect("d1")
    sock.sendall(connect)
    conn = upstream.conn_of(connect)
    proxy.stop()
    assert_reset(sock)
    assert conn.wait_end() == "reset"
    assert proxy.cut() == 0
    proxy.restore()
    assert proxy.connected() == 0
    assert proxy.stats.accepted == 1


def test_a_tcp_relay_with_a_rate_passes_the_targets_bytes_no_faster_and_all_of_them() -> None:
    """TcpRelay(rate=...): a slow link from the target to the client (600 kB at 400 kB/s: 1.5 s less
    the first step), every byte in order."""
    data = os.urandom(600_000)
    with socket.create_server((HOST, 0)) as server:

        def serve() -> None:
            conn, _ = server.accept()
            with conn:
                conn.sendall(data)

        sender = threading.Thread(target=serve, daemon=True)
        sender.start()
        relay = TcpRelay(HOST, server.getsockname()[1], rate=400_000)
        relay.start()
        try:
            began = time.monotonic()
            received = b""
            with socket.create_connection((HOST, relay.port), timeout=WAIT) as client:
                while chunk := client.recv(65536):
                    received += chunk
            took = time.monotonic() - began
        finally:
            relay.stop()
        sender.join(WAIT)
    assert received == data
    assert (len(data) - RATE_STEP) / 400_000 <= took < WAIT, took


@pytest.mark.parametrize("rate", [0, -1.0, float("nan"), float("inf")])
def test_a_tcp_relay_refuses_a_rate_that_is_not_a_positive_finite_number(rate: float) -> None:
    with pytest.raises(ValueError, match=r"TcpRelay rate must be bytes per second, finite and above 0, got "):
        TcpRelay(HOST, 1, rate=rate)
