"""DurableClient's network thread and paho adapter against a scripted MQTT peer (no real broker).

The peer speaks just enough MQTT 3.1.1 over a local socket to drive connect, hello,
publish/PUBACK, redelivery with DUP, a dropped connection and close. Every wait is a queue
read with a timeout; nothing sleeps.
"""

from __future__ import annotations

import contextlib
import queue
import socket
import struct
import threading
from collections.abc import Callable, Iterator
from types import SimpleNamespace
from typing import Any

import pytest

from amqtt_durable.wire import decode_remaining_length
from conftest import mqtt_packet, mqtt_string
from durable_client import ConnectFailed, ConnectionInfo, DurableClient, Event
from durable_client._paho import _Reader
from durable_client.protocol import CONTROL_TOPIC, REPLY_TOPIC, Request, encode_frame, encode_reply, parse_request

WAIT = 10.0


class Peer:
    """One connection of the scripted broker."""

    def __init__(self, sock: socket.socket, broker: ScriptedBroker) -> None:
        self.sock = sock
        self.broker = broker
        self.lock = threading.Lock()

    def send(self, first: int, body: bytes) -> None:
        with self.lock, contextlib.suppress(OSError):
            self.sock.sendall(mqtt_packet(first, body))

    def publish(self, topic: str, payload: bytes, *, qos: int = 0, pid: int = 0, dup: bool = False) -> None:
        body = mqtt_string(topic) + (struct.pack(">H", pid) if qos else b"") + payload
        self.send(0x30 | (0x08 if dup else 0) | (qos << 1), body)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def _read_exact(self, n: int) -> bytes:
        data = b""
        while len(data) < n:
            chunk = self.sock.recv(n - len(data))
            if not chunk:
                raise ConnectionError("closed")
            data += chunk
        return data

    def run(self) -> None:
        try:
            while True:
                header = self._read_exact(2)
                while (field := decode_remaining_length(header, 1)) is None:
                    header += self._read_exact(1)
                self.handle(header[0], self._read_exact(field[0]))
        except (ConnectionError, OSError):
            pass
        finally:
            self.broker.events.put(("closed",))
            self.sock.close()

    def handle(self, first: int, body: bytes) -> None:
        handlers = {1: self._connect, 3: self._publish, 4: self._puback, 8: self._subscribe}
        kind = first >> 4
        if kind in handlers:
            handlers[kind](first, body)
        elif kind == 12:  # PINGREQ
            self.send(0xD0, b"")
        elif kind == 14:  # DISCONNECT
            self.broker.events.put(("disconnect",))

    def _connect(self, first: int, body: bytes) -> None:
        broker = self.broker
        name_len = struct.unpack(">H", body[:2])[0]
        flags = body[2 + name_len + 1]
        id_len = struct.unpack(">H", body[2 + name_len + 4 : 2 + name_len + 6])[0]
        client_id = body[2 + name_len + 6 : 2 + name_len + 6 + id_len].decode()
        broker.events.put(("connect", client_id, bool(flags & 0x02)))
        self.send(0x20, bytes([1 if broker.session_present else 0, broker.connack_rc]))
        if broker.connack_rc:
            self.close()

    def _publish(self, first: int, body: bytes) -> None:
        broker = self.broker
        qos = (first >> 1) & 3
        topic_len = struct.unpack(">H", body[:2])[0]
        topic = body[2 : 2 + topic_len].decode()
        rest = body[2 + topic_len :]
        pid = 0
        if qos:
            pid, rest = struct.unpack(">H", rest[:2])[0], rest[2:]
        if topic == CONTROL_TOPIC:
            request = parse_request(rest)
            broker.events.put(("request", request))
            answer = broker.answer(request)
            if answer is not None:
                self.publish(REPLY_TOPIC, answer)
        else:
            broker.events.put(("publish", topic, rest, qos))
            if qos == 1 and broker.puback:
                self.send(0x40, struct.pack(">H", pid))

    def _puback(self, first: int, body: bytes) -> None:
        self.broker.events.put(("puback", struct.unpack(">H", body)[0]))

    def _subscribe(self, first: int, body: bytes) -> None:
        pid = struct.unpack(">H", body[:2])[0]
        pos, filters = 2, []
        while pos < len(body):
            n = struct.unpack(">H", body[pos : pos + 2])[0]
            filters.append((body[pos + 2 : pos + 2 + n].decode(), body[pos + 2 + n]))
            pos += 3 + n
        self.broker.events.put(("subscribe", filters))
        self.send(0x90, struct.pack(">H", pid) + bytes(q for _, q in filters))


class ScriptedBroker:
    def __init__(self) -> None:
        self.server = socket.socket()
        self.server.bind(("127.0.0.1", 0))
        self.server.listen()
        self.port = self.server.getsockname()[1]
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.peers: queue.Queue[Peer] = queue.Queue()
        self.session_present = False
        self.connack_rc = 0
        self.puback = True
        self.epoch = 5
        self.answer: Callable[[Request], bytes | None] = self.default_answer
        threading.Thread(target=self._accept, daemon=True).start()

    def default_answer(self, request: Request) -> bytes | None:
        if request.op == "hello":
            return encode_reply("hello", request.req, protocol=1, epoch=self.epoch, session_expiry=None)
        if request.op in ("ready", "interest", "end_session"):
            return encode_reply(request.op, request.req)
        return None

    def _accept(self) -> None:
        while True:
            try:
                sock, _ = self.server.accept()
            except OSError:
                return
            peer = Peer(sock, self)
            self.peers.put(peer)
            threading.Thread(target=peer.run, daemon=True).start()

    def next(self, kind: str) -> tuple[Any, ...]:
        """The next event of ``kind``, skipping others (pings, requests we do not check)."""
        while True:
            item = self.events.get(timeout=WAIT)
            if item[0] == kind:
                return item

    def close(self) -> None:
        self.server.close()


@pytest.fixture
def broker() -> Iterator[ScriptedBroker]:
    b = ScriptedBroker()
    yield b
    b.close()


def make_client(broker: ScriptedBroker, **kwargs: Any) -> DurableClient:
    return DurableClient("net-1", port=broker.port, reconnect_min_delay=0.01, reconnect_max_delay=0.05, **kwargs)


def test_connect_publish_close(broker: ScriptedBroker) -> None:
    infos: list[ConnectionInfo] = []
    client = make_client(broker, on_connected=infos.append, session_expiry=60)
    client.connect(timeout=WAIT)
    try:
        assert client.connected and infos == [ConnectionInfo(False, 5, None)]
        assert broker.next("connect") == ("connect", "net-1", False)  # durable: clean_session=0
        hello = broker.next("request")[1]
        assert hello.op == "hello" and hello.session_expiry == 60.0
        client.publish("a/b", b"payload", qos=1)  # returns once the PUBACK is in
        assert broker.next("publish") == ("publish", "a/b", b"payload", 1)
        client.subscribe("s/#")
        assert broker.next("subscribe") == ("subscribe", [("s/#", 1)])
    finally:
        client.close()
    broker.next("disconnect")
    assert client._thread is not None and not client._thread.is_alive()


def test_refused_connack_fails_connect(broker: ScriptedBroker) -> None:
    broker.connack_rc = 5
    client = make_client(broker)
    with pytest.raises(ConnectFailed, match="refused the connection"):
        client.connect(timeout=WAIT)
    assert client._thread is None
    client.close()


def test_nothing_listening_fails_after_the_timeout() -> None:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]  # bound, not listening: connections are refused
        client = DurableClient("net-2", port=port, reconnect_min_delay=0.01, reconnect_max_delay=0.05)
        with pytest.raises(ConnectFailed, match=r"within 0\.5 s \(cannot reach"):
            client.connect(timeout=0.5)
        client.close()


def test_broker_without_the_plugin_never_answers_hello(broker: ScriptedBroker) -> None:
    broker.answer = lambda request: None
    client = make_client(broker)
    with pytest.raises(ConnectFailed, match="amqtt-durable plugin"):
        client.connect(timeout=0.5)
    client.close()


def test_reconnect_after_a_dropped_connection(broker: ScriptedBroker) -> None:
    connected: queue.Queue[ConnectionInfo] = queue.Queue()
    reasons: queue.Queue[str] = queue.Queue()
    client = make_client(broker, on_connected=connected.put, on_disconnected=reasons.put)
    client.connect(timeout=WAIT)
    try:
        peer = broker.peers.get(timeout=WAIT)
        connected.get(timeout=WAIT)
        client.subscribe("d/#")
        client.ready_for_events()
        # A QoS 1 round trip orders everything: the client has processed the SUBACK (sent
        # before the PUBACK), and the broker has seen `ready` (sent before the PUBLISH).
        client.publish("sync", b"", qos=1)
        broker.next("publish")
        broker.session_present = True
        peer.close()
        reasons.get(timeout=WAIT)
        info = connected.get(timeout=WAIT)
        assert info.session_present and client.stats.reconnects == 1
        # The durable subscription was confirmed: not sent again; `ready` is.
        requests = []
        while True:
            item = broker.events.get(timeout=WAIT)
            assert item[0] != "subscribe"
            if item[0] == "request":
                requests.append(item[1].op)
                if item[1].op == "ready":
                    break
        assert requests[0] == "hello"
    finally:
        client.close()


def test_failed_listener_gets_the_event_again_with_dup(broker: ScriptedBroker) -> None:
    seen: queue.Queue[Event] = queue.Queue()
    calls = {"n": 0}

    def listener(event: Event) -> None:
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("first attempt fails")
        seen.put(event)

    connected: queue.Queue[ConnectionInfo] = queue.Queue()
    client = make_client(broker, on_connected=connected.put)
    client.connect(timeout=WAIT)
    try:
        connected.get(timeout=WAIT)
        client.subscribe("t/#", listener=listener)
        broker.next("subscribe")
        first = broker.peers.get(timeout=WAIT)
        frame = encode_frame(0, 5, 1, 1.0) + b"data"
        first.publish("t/x", frame, qos=1, pid=11)
        first.publish("t/x", encode_frame(0, 5, 2, 1.0) + b"next", qos=1, pid=12)
        broker.next("closed")  # the client dropped the connection, acknowledging neither
        broker.session_present = True
        second = broker.peers.get(timeout=WAIT)
        connected.get(timeout=WAIT)
        second.publish("t/x", frame, qos=1, pid=11, dup=True)
        second.publish("t/x", encode_frame(0, 5, 2, 1.0) + b"next", qos=1, pid=12, dup=True)
        assert broker.next("puback") == ("puback", 11)
        assert broker.next("puback") == ("puback", 12)
        got = [seen.get(timeout=WAIT), seen.get(timeout=WAIT)]
        assert [(e.seq, e.payload, e.redelivered) for e in got] == [(1, b"data", True), (2, b"next", True)]
        assert client.stats.redeliveries_requested == 1 and client.stats.processed == 2
    finally:
        client.close()


def test_cpl2_acks_go_once_the_connection_is_quiet_after_one_fsync(broker: ScriptedBroker, tmp_path: Any) -> None:
    seen: queue.Queue[Event] = queue.Queue()
    connected: queue.Queue[ConnectionInfo] = queue.Queue()
    client = make_client(broker, on_connected=connected.put, persistence="disk", state_dir=tmp_path,
                         fsync_batch=65535, fsync_delay_ms=1000)
    gate = client._gate
    assert gate is not None
    gate._clock = lambda: 0.0  # time stands still: neither the batch nor the delay can end a group
    client.subscribe("t/#", listener=seen.put)
    client.connect(timeout=WAIT)
    try:
        connected.get(timeout=WAIT)
        peer = broker.peers.get(timeout=WAIT)
        sock = client._link._client.socket() if client._link is not None else None
        assert isinstance(sock, socket.socket)
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY), "acks are not held back by Nagle"
        groups = gate.groups
        for seq, pid in ((1, 21), (2, 22), (3, 23)):
            peer.publish("t/x", encode_frame(0, 5, seq, 1.0) + b"p", qos=1, pid=pid)
        got = [broker.next("puback")[1] for _ in range(3)]
        assert got == [21, 22, 23], "in order, released by the quiet connection"
        assert [seen.get(timeout=WAIT).seq for _ in range(3)] == [1, 2, 3]
        assert 1 <= gate.groups - groups <= 3 and client._state.unsynced == 0
        assert client._state.get_mark(5) == 3
    finally:
        client.close()


class _ChunkSocket:
    """A non-blocking socket whose data arrives in the given chunks."""

    def __init__(self, *chunks: bytes) -> None:
        self.chunks = list(chunks)

    def recv(self, _size: int) -> bytes:
        if not self.chunks:
            raise BlockingIOError
        return self.chunks.pop(0)


def test_the_reader_serves_paho_reads_from_blocks_and_a_read_past_a_block_is_short() -> None:
    reader = _Reader(SimpleNamespace(_sock=_ChunkSocket(b"abc", b"defg")))  # type: ignore[arg-type]
    assert reader.recv(1) == b"a" and reader.buffered == 2
    assert reader.recv(5) == b"bc" and reader.buffered == 0, "the rest of the block; paho asks again"
    assert reader.recv(3) == b"def" and (reader.buffered, reader.reads) == (1, 2)
    assert reader.recv(1) == b"g"
    with pytest.raises(BlockingIOError):
        reader.recv(1)
    assert reader.buffered == 0 and reader.reads == 2
