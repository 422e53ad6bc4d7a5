"""Raw-socket MQTT 3.1.1 client steps for tests that send what paho would not, or must see the
broker's bytes as they come (connect, subscribe, read), bounded by the socket's timeout (WAIT)."""

from __future__ import annotations

import errno
import select
import socket
import time

from conftest import HOST, WAIT, mqtt_packet, mqtt_string


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
