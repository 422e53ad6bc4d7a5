"""Scale of the durable store: fan-out stored once, packet ids past 65,535, start-up without the queue.

Bulk sessions and messages go through ``RawClient``, a minimal MQTT 3.1.1 client over a plain
socket (also used by test_recovery_and_crash.py): creating a thousand paho clients with their
threads would cost more than the behaviour under test, and pipelined publishes are ~10x faster.
"""

from __future__ import annotations

import re
import socket
import struct
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import plyvel
import psutil
import pytest

from amqtt_durable.wire import decode_remaining_length
from conftest import HOST, WAIT, Broker, mqtt_packet, mqtt_string, payloads

_U16 = struct.Struct(">H")


@dataclass(frozen=True)
class RawMessage:
    topic: str
    payload: bytes
    qos: int
    dup: bool
    retain: bool
    packet_id: int | None


class RawClient:
    """A minimal MQTT 3.1.1 client over a plain socket: fast to create in bulk, acks under test control."""

    def __init__(self, port: int, client_id: str, clean_session: bool = False, timeout: float = WAIT) -> None:
        self.client_id = client_id
        self.clean_session = clean_session
        self.sock = socket.create_connection((HOST, port), timeout=timeout)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._buf = bytearray()
        self._next_pid = 0

    def connect_packet(self, keepalive: int = 60) -> bytes:
        flags = 0x02 if self.clean_session else 0x00
        body = mqtt_string("MQTT") + bytes((4, flags)) + _U16.pack(keepalive) + mqtt_string(self.client_id)
        return mqtt_packet(0x10, body)

    def subscribe_packet(self, topic_filter: str, qos: int = 1) -> bytes:
        return mqtt_packet(0x82, _U16.pack(self.pid()) + mqtt_string(topic_filter) + bytes((qos,)))

    def pid(self) -> int:
        self._next_pid = self._next_pid % 65535 + 1
        return self._next_pid

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 16)
        if not chunk:
            raise ConnectionError(f"{self.client_id}: connection closed by the broker")
        self._buf += chunk

    def _parse(self) -> tuple[int, bytes] | None:
        """The first packet of the buffer, if it is whole (only that one is decoded: the buffer may
        hold thousands of PUBACKs)."""
        field = decode_remaining_length(self._buf, 1) if len(self._buf) >= 2 else None
        if field is None:
            return None
        length, start = field
        end = start + length
        if len(self._buf) < end:
            return None
        first = self._buf[0]
        body = bytes(self._buf[start:end])
        del self._buf[:end]
        return first, body

    def read_packet(self, before_blocking: Callable[[], None] | None = None) -> tuple[int, bytes]:
        """One packet as (first byte, body); blocks up to the socket timeout."""
        while True:
            packet = self._parse()
            if packet is not None:
                return packet
            if before_blocking is not None:
                before_blocking()
            self._fill()

    def expect(self, kind: int) -> bytes:
        first, body = self.read_packet()
        assert first >> 4 == kind, f"{self.client_id}: expected packet type {kind}, got {first >> 4}"
        return body

    def connect(self) -> bool:
        """CONNECT and wait for an accepted CONNACK; returns session present."""
        self.send(self.connect_packet())
        return self.read_connack()

    def read_connack(self) -> bool:
        body = self.expect(2)
        assert body[1] == 0, f"{self.client_id}: CONNACK refused with {body[1]}"
        return bool(body[0] & 0x01)

    def subscribe(self, topic_filter: str, qos: int = 1) -> int:
        self.send(self.subscribe_packet(topic_filter, qos))
        return self.read_suback()

    def read_suback(self) -> int:
        return self.expect(9)[2]

    def publish_many(self, items: Iterable[tuple[str, bytes]], qos: int = 1, chunk: int = 2000) -> int:
        """Pipelined QoS 1 publishes, at most two chunks unacknowledged; returns how many were acked."""
        assert qos == 1
        pending: list[int] = []
        acked = 0
        batch: list[bytes] = []

        def flush() -> None:
            nonlocal acked
            if batch:
                self.send(b"".join(batch))
                pending.append(len(batch))
                batch.clear()
            while len(pending) > 2:
                acked += self._read_pubacks(pending.pop(0))

        for topic, payload in items:
            body = mqtt_string(topic) + _U16.pack(self.pid()) + payload
            batch.append(mqtt_packet(0x32, body))
            if len(batch) >= chunk:
                flush()
        flush()
        while pending:
            acked += self._read_pubacks(pending.pop(0))
        return acked

    def _read_pubacks(self, count: int) -> int:
        for _ in range(count):
            self.expect(4)
        return count

    def receive(self, count: int, ack: bool = True) -> list[RawMessage]:
        """Read ``count`` PUBLISH packets (anything else is a test failure), acknowledging QoS 1 in batches."""
        out: list[RawMessage] = []
        acks: list[bytes] = []

        def send_acks() -> None:
            if acks:
                self.send(b"".join(acks))
                acks.clear()

        while len(out) < count:
            first, body = self.read_packet(send_acks if ack else None)
            assert first >> 4 == 3, f"{self.client_id}: expected PUBLISH, got packet type {first >> 4}"
            qos = (first >> 1) & 0x03
            (topic_len,) = _U16.unpack_from(body)
            topic = body[2 : 2 + topic_len].decode()
            pos = 2 + topic_len
            packet_id = None
            if qos:
                (packet_id,) = _U16.unpack_from(body, pos)
                pos += 2
                if ack:
                    acks.append(mqtt_packet(0x40 if qos == 1 else 0x50, _U16.pack(packet_id)))
            out.append(RawMessage(topic, body[pos:], qos, bool(first & 0x08), bool(first & 0x01), packet_id))
        send_acks()
        return out

    def pending_bytes(self, timeout: float) -> bool:
        """True when anything at all arrives within ``timeout`` (used to assert silence)."""
        if self._buf:
            return True
        self.sock.settimeout(timeout)
        try:
            chunk = self.sock.recv(1 << 16)
        except TimeoutError:
            return False
        finally:
            self.sock.settimeout(WAIT)
        self._buf += chunk
        return True

    def disconnect(self, wait_closed: bool = False) -> None:
        """DISCONNECT; with ``wait_closed``, also wait until the broker has closed its end (it handled it)."""
        try:
            self.send(b"\xe0\x00")
            while wait_closed and self.sock.recv(1 << 16):
                pass
        finally:
            self.close()

    def close(self) -> None:
        self.sock.close()


def create_sessions(port: int, client_ids: Sequence[str], topic_filter: Callable[[str], str], batch: int = 50) -> None:
    """Durable sessions with one subscription each: CONNECT + SUBSCRIBE pipelined, batch connections at a time."""
    for start in range(0, len(client_ids), batch):
        group = [RawClient(port, cid) for cid in client_ids[start : start + batch]]
        for raw in group:
            raw.send(raw.connect_packet() + raw.subscribe_packet(topic_filter(raw.client_id), 1))
        for raw in group:
            assert raw.read_connack() is False, f"{raw.client_id}: a new session must not be present"
            assert raw.read_suback() == 1
        for raw in group:
            raw.disconnect()


def count_keys(db: plyvel.DB, prefix: bytes) -> int:
    return sum(1 for _ in db.iterator(prefix=prefix, include_value=False))


def folder_size(path: str) -> int:
    return sum(f.stat().st_size for f in Path(path).rglob("*") if f.is_file())


def kilobyte_payloads(count: int) -> list[bytes]:
    return [f"kb{i:04d}-".encode().ljust(1024, b"x") for i in range(count)]


def offline_backlog(broker: Broker, client_id: str, topic: str, sent: Iterable[bytes]) -> int:
    sub = RawClient(broker.port, client_id)
    assert sub.connect() is False
    assert sub.subscribe(topic, 1) == 1
    sub.disconnect(wait_closed=True)  # so that no message goes out live to the closing connection
    pub = RawClient(broker.port, f"pub-{client_id}", clean_session=True)
    pub.connect()
    try:
        return pub.publish_many((topic, payload) for payload in sent)
    finally:
        pub.disconnect()


def test_fan_out_to_1000_offline_sessions_stores_each_body_once(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    client_ids = [f"fan-{i:04d}" for i in range(1000)]
    create_sessions(broker.port, client_ids, lambda _cid: "fan/out")
    sent = kilobyte_payloads(20)
    pub = RawClient(broker.port, "pub", clean_session=True)
    pub.connect()
    assert pub.publish_many(("fan/out", payload) for payload in sent) == 20
    pub.disconnect()
    broker.stop()

    db = plyvel.DB(broker.store, create_if_missing=False)
    try:
        assert count_keys(db, b"m") == 20, "a message routed to 1000 sessions must be stored once, not per session"
        assert count_keys(db, b"q") == 20 * 1000, "every session must have its own queue entry"
        assert count_keys(db, b"s") == 1000
    finally:
        db.close()
    size = folder_size(broker.store)
    assert size < 4 * 1024 * 1024, f"store is {size} bytes; 20000 copies of the 1 KB bodies would be ~20 MB"

    broker.start()
    assert "1000 session(s), 20000 queued message(s)" in broker.log()
    for client_id in (client_ids[0], client_ids[500], client_ids[-1]):
        sub = RawClient(broker.port, client_id)
        assert sub.connect() is True
        got = sub.receive(20)
        assert [(m.topic, m.payload) for m in got] == [("fan/out", p) for p in sent], client_id
        assert not sub.pending_bytes(0.2), f"{client_id}: more than its 20 messages"
        sub.disconnect()


@pytest.mark.slow
def test_backlog_past_65535_packet_ids_drains_in_order(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    sent = payloads(70_000)
    assert offline_backlog(broker, "deep", "deep/t", sent) == len(sent)
    sub = RawClient(broker.port, "deep")
    assert sub.connect() is True
    got = sub.receive(len(sent))
    assert [m.payload for m in got] == sent, "the backlog must drain completely and in order past 65,535"
    assert all(m.qos == 1 and not m.dup for m in got)
    assert all(m.packet_id is not None and 1 <= m.packet_id <= 65535 for m in got), "packet ids must stay valid"
    assert not sub.pending_bytes(0.3), "nothing may follow the drained backlog"
    sub.disconnect()
    again = RawClient(broker.port, "deep")
    assert again.connect() is True
    assert not again.pending_bytes(0.3), "a fully acknowledged backlog must not be sent again"
    again.disconnect()


@pytest.mark.slow
def test_start_up_does_not_load_the_queue_into_memory(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory()
    assert broker.proc is not None
    empty_rss = psutil.Process(broker.proc.pid).memory_info().rss
    count = 200_000
    assert offline_backlog(broker, "big", "big/t", payloads(count)) == count
    broker.kill()
    broker.start()
    assert broker.proc is not None
    rss = psutil.Process(broker.proc.pid).memory_info().rss
    assert re.search(rf"1 session\(s\), {count} queued message\(s\)", broker.log())
    mib = 1024 * 1024
    assert rss < 150 * mib, f"broker RSS after start is {rss / mib:.0f} MB with {count} messages queued"
    # 200,000 small messages as Python objects take ~95 MB: compare with the same broker on an empty store too,
    # which the loose 150 MB bound alone would not catch for payloads this small.
    growth = rss - empty_rss
    assert growth < 50 * mib, f"RSS grew by {growth / mib:.0f} MB over an empty store's broker: queue loaded?"
    sub = RawClient(broker.port, "big")
    assert sub.connect() is True
    got = sub.receive(1000)
    assert [m.payload for m in got] == payloads(1000), "the stored queue must still be delivered from its head"
    sub.close()
