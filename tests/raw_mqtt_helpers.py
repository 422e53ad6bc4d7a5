"""Raw-socket MQTT 3.1.1 client steps for tests that send what paho would not, or must see the
broker's bytes as they come (connect, subscribe, read), bounded by the socket's timeout (WAIT);
``Raw``, such a connection speaking the durable control protocol, and the ``raws`` fixture that
makes them (a pytest plugin of tests/conftest.py)."""

from __future__ import annotations

import contextlib
import errno
import json
import select
import socket
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from conftest import HOST, WAIT, mqtt_packet, mqtt_string

CTL = "_durable/v1/ctl"
REPLY = "$durable/v1/reply"
STREAM_PREFIX = "$durable/v1/stream/"


class ConnectionClosedError(AssertionError):
    """The peer ended the connection: an AssertionError to the tests that expect a packet, told apart
    from a test's own assertion by the relays that read until the end (tests/packet_relay.py)."""


def read_exactly(sock: socket.socket, count: int, deadline: float | None = None) -> bytes:
    """``count`` bytes, each recv bounded by the socket's timeout (WAIT, or a relay's ``wait``); with ``deadline``
    (time.monotonic) all of them by then too, else TimeoutError: a peer that trickles its bytes
    cannot stretch the read. The deadline is waited on with poll(), so only for a plain socket
    (an SSL one may hold bytes poll() does not see); the socket's timeout is left alone (another
    thread may be sending on it)."""
    data = b""
    while len(data) < count:
        if deadline is not None:
            fd = sock.fileno()  # -1 once another thread closed it (a relay's cut() or close())
            if fd < 0:
                raise OSError(errno.EBADF, "the socket was closed")
            poller = select.poll()
            poller.register(fd, select.POLLIN)
            if not poller.poll(max(0.0, deadline - time.monotonic()) * 1000):
                if sock.fileno() < 0:  # closed while polling (its number maybe reused by an idle socket)
                    raise OSError(errno.EBADF, "the socket was closed")
                raise TimeoutError(f"{len(data)} of {count} bytes came before the deadline")
        chunk = sock.recv(count - len(data))  # bounded by the socket timeout (WAIT)
        if not chunk:
            raise ConnectionClosedError("connection closed")
        data += chunk
    return data


def read_packet(sock: socket.socket, deadline: float | None = None) -> tuple[int, bytes]:
    """(first byte, body) of the next packet the broker sends; all of it by ``deadline`` (read_exactly)."""
    first = read_exactly(sock, 1, deadline)[0]
    length, shift = 0, 0
    while True:
        byte = read_exactly(sock, 1, deadline)[0]
        length |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            break
    return first, read_exactly(sock, length, deadline)


def connect_packet(
    client_id: str,
    *,
    clean: bool = True,
    username: str | None = None,
    will_topic: bytes | None = None,
    keepalive: int = 60,
) -> bytes:
    """An MQTT 3.1.1 CONNECT without a password; the will (``will_topic``) is QoS 0, its message "gone"."""
    flags = (0x02 if clean else 0) | (0x04 if will_topic is not None else 0) | (0x80 if username is not None else 0)
    body = mqtt_string("MQTT") + bytes((4, flags)) + keepalive.to_bytes(2, "big") + mqtt_string(client_id)
    if will_topic is not None:
        body += mqtt_string(will_topic) + mqtt_string(b"gone")
    if username is not None:
        body += mqtt_string(username)
    return mqtt_packet(0x10, body)


def raw_connect(
    port: int, client_id: str, *, clean: bool, username: str | None = None, keepalive: int = 60
) -> socket.socket:
    """A raw CONNECT (connect_packet); returns the socket once CONNACK accepted it."""
    sock = socket.create_connection((HOST, port), timeout=WAIT)
    sock.sendall(connect_packet(client_id, clean=clean, username=username, keepalive=keepalive))
    connack = read_exactly(sock, 4)
    assert connack[:2] == b"\x20\x02" and connack[3:4] == b"\x00", connack
    assert not (clean and connack[2]), f"a clean session's CONNACK has session present: {connack!r}"
    return sock


def raw_subscribe(sock: socket.socket, topic_filter: str | bytes, qos: int, packet_id: int = 1) -> int:
    """SUBSCRIBE to one filter; the return code of its SUBACK (whose packet id is checked)."""
    packet_id_bytes = packet_id.to_bytes(2, "big")
    sock.sendall(mqtt_packet(0x82, packet_id_bytes + mqtt_string(topic_filter) + bytes((qos,))))
    suback = read_exactly(sock, 5)
    assert suback[:4] == b"\x90\x03" + packet_id_bytes, suback
    return suback[4]


class Raw:
    """A raw MQTT 3.1.1 connection speaking the control protocol: requests at QoS 0, replies and
    other PUBLISHes read off the socket as they come (bounded by the socket's timeout)."""

    def __init__(self, port: int, client_id: str, *, clean: bool = False, username: str | None = None) -> None:
        self.sock = raw_connect(port, client_id, clean=clean, username=username)
        self.publishes: list[tuple[str, int, bytes]] = []  # (topic, first byte, payload) not yet taken
        self.packet_id = 0

    def send(self, request: bytes | dict[str, Any], topic: str = CTL) -> None:
        body = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.sock.sendall(mqtt_packet(0x30, mqtt_string(topic) + body))

    def publish(self, topic: str, payload: bytes, qos: int = 1) -> None:
        """PUBLISH at QoS 1 and wait for its PUBACK (other packets read meanwhile are kept)."""
        self.packet_id += 1
        pid = self.packet_id.to_bytes(2, "big")
        self.sock.sendall(mqtt_packet(0x30 | qos << 1, mqtt_string(topic) + pid + payload))
        for _ in range(1000):
            first, body = read_packet(self.sock)
            if first == 0x40 and body == pid:
                return
            self._keep(first, body)
        raise AssertionError("no PUBACK")

    def _keep(self, first: int, body: bytes) -> None:
        if first >> 4 != 3:
            return
        length = int.from_bytes(body[:2], "big")
        topic = body[2 : 2 + length].decode()
        rest = body[2 + length :]
        if (first >> 1) & 3:
            pid, rest = rest[:2], rest[2:]
            self.sock.sendall(bytes((0x40, 2)) + pid)
        self.publishes.append((topic, first, rest))

    def take(self, predicate: Callable[[str, bytes], bool]) -> tuple[str, bytes]:
        """The first PUBLISH (kept or still to come) matching ``predicate``; removed from the kept ones."""
        for _ in range(1000):
            for index, (topic, _first, payload) in enumerate(self.publishes):
                if predicate(topic, payload):
                    del self.publishes[index]
                    return topic, payload
            self._keep(*read_packet(self.sock))
        raise AssertionError("never came")

    def reply(self) -> dict[str, Any]:
        _topic, payload = self.take(lambda topic, _p: topic == REPLY)
        result: dict[str, Any] = json.loads(payload)
        return result

    def request(self, request: bytes | dict[str, Any], topic: str = CTL) -> dict[str, Any]:
        self.send(request, topic)
        return self.reply()

    def stream_events(self, topic: str, count: int) -> list[tuple[int, int, bytes]]:
        """(flags, id, payload) of the next ``count`` stream events of ``topic``."""
        events = []
        for _ in range(count):
            _t, framed = self.take(lambda t, _p: t == STREAM_PREFIX + topic)
            events.append((framed[1], int.from_bytes(framed[10:18], "big"), framed[26:]))
        return events

    def kept_stream_events(self, topic: str) -> list[bytes]:
        return [payload for t, _f, payload in self.publishes if t == STREAM_PREFIX + topic]

    def alive(self) -> bool:
        """The connection still answers (a PINGREQ gets its PINGRESP; publishes read meanwhile are kept)."""
        try:
            self.sock.sendall(b"\xc0\x00")
            for _ in range(1000):
                first, body = read_packet(self.sock)
                if first == 0xD0:
                    return True
                self._keep(first, body)
        except (OSError, AssertionError):
            return False
        return False

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.sendall(b"\xe0\x00")
        self.sock.close()


@pytest.fixture
def raws() -> Iterator[Callable[..., Raw]]:
    """Raw connections made by ``raws(port, client_id, ...)``, each closed (DISCONNECT first) after the test."""
    made: list[Raw] = []

    def make(port: int, client_id: str, **kwargs: Any) -> Raw:
        raw = Raw(port, client_id, **kwargs)
        made.append(raw)
        return raw

    yield make
    for raw in made:
        raw.close()
