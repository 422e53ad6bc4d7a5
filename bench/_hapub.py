"""Load clients of bench_replication.py that follow a replication group's primary: a publisher
that keeps publishing across failovers (remembering which payloads got a PUBACK), and a drain
that reads a durable session to the end and counts each payload it got.

Raw MQTT 3.1.1 as in _rawmqtt.py (same payload layout: tag, sequence number, send time). The
publisher runs in its own process, reports over a Pipe and is bounded by a deadline; a broker
that answers CONNACK 3 (a backup) or does not answer is skipped for the next address.
"""

from __future__ import annotations

import contextlib
import os
import socket
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from _rawmqtt import (
    PAYLOAD_HEADER,
    PAYLOAD_SIZE,
    PT_PUBLISH,
    RECV_SIZE,
    Login,
    RawConnection,
    RawMqttError,
    make_payload,
    publish_packet,
)

from amqtt_durable.wire import split_packets

CONNECT_TIMEOUT = 2.0
RETRY_PAUSE = 0.02


@dataclass(frozen=True)
class FollowPubSpec:
    ports: tuple[int, ...]
    client_id: str
    login: Login
    topic: str
    tag: bytes
    cap: int  # at most this many messages (sequence numbers 0..cap-1)
    inflight: int
    rate: float  # messages/s over the whole run; 0: as fast as the in-flight window allows
    timeout: float  # the whole run, from "go"
    cpus: tuple[int, ...] | None = None


@dataclass
class FollowPubResult:
    sent: int = 0
    acked_count: int = 0
    acked: bytes = b""  # acked[seq] == 1: the payload with this sequence number got its PUBACK
    connects: list[tuple[int, int]] = field(default_factory=list)  # (monotonic_ns, port) of each CONNACK 0
    losses: list[str] = field(default_factory=list)  # why each connection ended
    end: str = ""


class _Publisher:
    def __init__(self, spec: FollowPubSpec, pipe: Connection) -> None:
        self.spec = spec
        self.pipe = pipe
        self.acked = bytearray(spec.cap)
        self.res = FollowPubResult()
        self.seq = 0
        self.stop = False
        self.t0 = time.monotonic()
        self.end_at = self.t0 + spec.timeout
        self.next_pipe_check = 0.0

    def check_pipe(self) -> None:
        now = time.monotonic()
        if now < self.next_pipe_check:
            return
        self.next_pipe_check = now + 0.05
        while self.pipe.poll():
            message = self.pipe.recv()
            if message == "count":
                self.pipe.send(("count", self.res.acked_count))
            elif message == "stop":
                self.stop = True

    def running(self) -> bool:
        self.check_pipe()
        return not self.stop and time.monotonic() < self.end_at and self.seq < self.spec.cap

    def connect_any(self) -> RawConnection | None:
        """The first address that accepts the client (CONNACK 0), trying them round until the end."""
        while self.running():
            for port in self.spec.ports:
                conn: RawConnection | None = None
                try:
                    conn = RawConnection(port, CONNECT_TIMEOUT)
                    conn.connect(self.spec.client_id, self.spec.login, clean=True, timeout=CONNECT_TIMEOUT)
                except (OSError, RawMqttError):
                    if conn is not None:
                        conn.close(graceful=False)
                    continue
                self.res.connects.append((time.monotonic_ns(), port))
                return conn
            time.sleep(RETRY_PAUSE)  # every address refused: a failover is under way
        return None

    def allowed(self, outstanding: int) -> int:
        room = min(self.spec.inflight - outstanding, self.spec.cap - self.seq)
        if self.spec.rate > 0:
            room = min(room, int(self.spec.rate * (time.monotonic() - self.t0)) + 1 - self.seq)
        return room

    def send_some(self, sock: socket.socket, outstanding: dict[int, int]) -> None:
        count = self.allowed(len(outstanding))
        if count <= 0:
            return
        t = time.monotonic_ns()
        packets = []
        for seq in range(self.seq, self.seq + count):
            pid = seq % 65535 + 1
            outstanding[pid] = seq
            packets.append(publish_packet(self.spec.topic, pid, make_payload(self.spec.tag, seq, t)))
        self.seq += count
        self.res.sent = self.seq
        sock.sendall(b"".join(packets))

    def take_acks(self, buf: bytearray, outstanding: dict[int, int]) -> None:
        packets, used = split_packets(buf)
        for first, start, _end in packets:
            if first == 0x40:
                seq = outstanding.pop((buf[start] << 8) | buf[start + 1], None)
                if seq is not None:
                    self.acked[seq] = 1
                    self.res.acked_count += 1
        del buf[:used]

    def publish_on(self, conn: RawConnection) -> str:
        """Publish until the connection ends; in-flight messages then stay unacknowledged (not re-sent)."""
        outstanding: dict[int, int] = {}
        sock, buf = conn.sock, conn.buf
        sock.settimeout(0.05)
        while self.running():
            try:
                self.send_some(sock, outstanding)
                data = sock.recv(RECV_SIZE)
            except TimeoutError:
                continue
            except OSError as exc:
                return f"{type(exc).__name__}: {exc}"
            if not data:
                return "closed by the broker"
            buf += data
            self.take_acks(buf, outstanding)
        return ""

    def run(self) -> None:
        while self.running():
            conn = self.connect_any()
            if conn is None:
                break
            why = self.publish_on(conn)
            conn.close(graceful=not why)
            if why:
                self.res.losses.append(why)
        self.res.end = ("stopped" if self.stop else "cap reached" if self.seq >= self.spec.cap
                        else f"time bound ({self.spec.timeout:.0f}s)")
        self.res.acked = bytes(self.acked[: self.seq])


def follow_publisher_main(spec: FollowPubSpec, pipe: Connection) -> None:
    """Child process: report "ready", wait for "go", publish until "stop" (answering "count"), report "result"."""
    try:
        if spec.cpus:
            with contextlib.suppress(AttributeError, OSError):
                os.sched_setaffinity(0, set(spec.cpus))
        pipe.send(("ready", None))
        if not pipe.poll(120.0) or pipe.recv() != "go":
            pipe.send(("error", "no 'go' from the parent"))
            return
        publisher = _Publisher(spec, pipe)
        publisher.run()
        pipe.send(("result", publisher.res))
    except Exception as exc:
        with contextlib.suppress(OSError):
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))


@dataclass
class Drained:
    counts: bytearray  # how many times each sequence number arrived (saturates at 255)
    session_present: bool
    publishes: int = 0
    foreign: int = 0
    end: str = ""


def _count(buf: bytearray, packet: tuple[int, int, int], tag: bytes, out: Drained) -> bytes:
    """Count one PUBLISH; return the PUBACK it needs (empty for QoS 0)."""
    first, start, end = packet
    out.publishes += 1
    i = start + 2 + ((buf[start] << 8) | buf[start + 1])
    ack = b""
    if (first >> 1) & 3:
        ack = b"\x40\x02" + bytes(buf[i:i + 2])
        i += 2
    if end - i != PAYLOAD_SIZE:
        out.foreign += 1
        return ack
    ptag, seq, _sent = PAYLOAD_HEADER.unpack_from(buf, i)
    if ptag != tag or seq >= len(out.counts):
        out.foreign += 1
    elif out.counts[seq] < 255:
        out.counts[seq] += 1
    return ack


def _take(sock: socket.socket, buf: bytearray, tag: bytes, out: Drained) -> None:
    """Count the complete PUBLISHes at the start of ``buf`` and acknowledge them in one send."""
    packets, used = split_packets(buf)
    acks = [_count(buf, packet, tag, out) for packet in packets if packet[0] >> 4 == PT_PUBLISH]
    del buf[:used]
    if any(acks):
        sock.sendall(b"".join(acks))


def drain(port: int, client_id: str, login: Login, tag: bytes, size: int, *, wanted: int, idle: float,
          timeout: float) -> Drained:
    """Reconnect to the durable session ``client_id`` and read until ``wanted`` distinct payloads
    arrived, or nothing new came for ``idle`` seconds, or ``timeout``."""
    conn = RawConnection(port, 30.0)
    try:
        out = Drained(bytearray(size), conn.connect(client_id, login, clean=False, timeout=30.0))
        sock, buf = conn.sock, conn.buf
        sock.settimeout(0.25)
        _take(sock, buf, tag, out)  # what came with the CONNACK
        end_at, last_new, distinct = time.monotonic() + timeout, time.monotonic(), 0
        while not out.end:
            now_distinct = size - out.counts.count(0)
            if now_distinct > distinct:
                distinct, last_new = now_distinct, time.monotonic()
            if distinct >= wanted:
                out.end = "all wanted received"
            elif time.monotonic() >= end_at:
                out.end = f"time bound ({timeout:.0f}s)"
            elif time.monotonic() - last_new >= idle:
                out.end = f"idle {idle:.0f}s"
            else:
                try:
                    data = sock.recv(RECV_SIZE)
                except TimeoutError:
                    continue
                if not data:
                    out.end = "closed by the broker"
                buf += data
                _take(sock, buf, tag, out)
        return out
    finally:
        conn.close()
