"""Minimal raw MQTT 3.1.1 load clients for bench_durable.py, plus a trivial sink to measure their ceiling.

No MQTT library is in the measured path: the publisher sends pre-encoded QoS1 PUBLISH packets
(at most `inflight` unacknowledged, PUBACKs parsed from the receive stream) and the subscriber
parses PUBLISH packets itself and answers every QoS1 one with a PUBACK (all PUBACKs owed after
one recv() go out in one sendall()).  With qos=2 (PubSpec, SubSpec) both run MQTT's QoS 2 exchange
instead: the publisher answers PUBREC with PUBREL and counts a message done at its PUBCOMP, the
subscriber answers PUBLISH with PUBREC and PUBREL with PUBCOMP.  Each client runs in its own process (multiprocessing,
"spawn"), reports over a Pipe, and is bounded by a deadline; the parent kills only the client
processes it started, by their PID.  Only 127.0.0.1 is ever used.

Timestamps are time.monotonic_ns() (CLOCK_MONOTONIC on Linux: one clock for all processes), so a
send time written into a payload by the publisher process can be compared with the arrival time
seen by the subscriber process.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from amqtt_durable.wire import encode_connect, encode_publish, encode_subscribe, split_packets

HOST = "127.0.0.1"
PAYLOAD_SIZE = 64
# payload layout: 4-byte run tag, uint32 sequence number, int64 send time (monotonic_ns), zero padding
PAYLOAD_HEADER = struct.Struct("!4sIq")
_PAYLOAD_PADDING = bytes(PAYLOAD_SIZE - PAYLOAD_HEADER.size)
_TS = struct.Struct("!q")
_PID_SEQ = struct.Struct("!H4sI")  # packet id directly followed by the payload's tag and sequence number

PT_CONNECT, PT_CONNACK, PT_PUBLISH, PT_PUBACK = 1, 2, 3, 4
PT_SUBSCRIBE, PT_SUBACK, PT_PINGREQ, PT_PINGRESP, PT_DISCONNECT = 8, 9, 12, 13, 14
DISCONNECT = b"\xe0\x00"
PINGRESP = b"\xd0\x00"
RECV_SIZE = 1 << 18
now_ns = time.monotonic_ns


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


class RawMqttError(RuntimeError):
    """Protocol violation, refused connection or timeout in a raw client."""


@dataclass(frozen=True)
class Login:
    username: str | None = None
    password: str | None = None


# --------------------------------------------------------------------------- codec


def connect_packet(client_id: str, login: Login, clean: bool = True, keepalive: int = 0) -> bytes:
    return encode_connect(client_id, username=login.username, password=login.password, clean=clean,
                          keepalive=keepalive)


def publish_packet(topic: str, packet_id: int, payload: bytes, *, qos: int = 1, dup: bool = False,
                   retain: bool = False) -> bytes:
    return encode_publish(topic.encode(), payload, qos, packet_id, dup=dup, retain=retain)


def make_payload(tag: bytes, seq: int, sent_ns: int = 0) -> bytes:
    return PAYLOAD_HEADER.pack(tag, seq, sent_ns) + _PAYLOAD_PADDING


def take_pubacks(buf: bytearray, outstanding: bytearray,
                 pubrels: bytearray | None = None) -> tuple[int, int, int, bool]:
    """Consume the complete packets at the start of `buf`, clearing `outstanding[pid]` per PUBACK.

    With `pubrels` (QoS 2) a PUBREC adds its PUBREL to `pubrels` and a PUBCOMP, not a PUBACK, ends a message.
    Returns (acks for outstanding ids, stray acks, other packets, whether any packet was read).
    """
    packets, used = split_packets(buf)
    acked = stray = other = 0
    done = 0x40 if pubrels is None else 0x70
    for first, start, _end in packets:
        if first == 0x50 and pubrels is not None:
            pubrels += b"\x62\x02" + buf[start:start + 2]
        elif first == done:
            pid = (buf[start] << 8) | buf[start + 1]
            if outstanding[pid]:
                outstanding[pid] = 0
                acked += 1
            else:
                stray += 1
        else:
            other += 1
    del buf[:used]
    return acked, stray, other, bool(packets)


class PublishEncoder:
    """n QoS1 (or `qos` 2) PUBLISH packets to one topic, pre-encoded back to back in one buffer.

    All packets have the same length, so packet k starts at k * size.  Packet ids run 1..65535 and
    wrap (safe with far fewer than 65535 in flight).  The send time inside the payload is patched
    in just before a packet is sent (`stamp`).
    """

    def __init__(self, topic: str, tag: bytes, n: int, qos: int = 1) -> None:
        template = publish_packet(topic, 1, make_payload(tag, 0), qos=qos)
        self.size = len(template)
        self.n = n
        pid_at = self.size - PAYLOAD_SIZE - 2
        self.ts_at = pid_at + _PID_SEQ.size
        self.buf = bytearray(template * n)
        pack = _PID_SEQ.pack_into
        for seq in range(n):
            pack(self.buf, seq * self.size + pid_at, seq % 65535 + 1, tag, seq)
        self.view = memoryview(self.buf)

    @staticmethod
    def packet_id(seq: int) -> int:
        return seq % 65535 + 1

    def stamp(self, first: int, end: int, t_ns: int) -> None:
        pack, buf, size, at = _TS.pack_into, self.buf, self.size, self.ts_at
        for seq in range(first, end):
            pack(buf, seq * size + at, t_ns)

    def chunk(self, first: int, end: int) -> memoryview:
        return self.view[first * self.size:end * self.size]


# --------------------------------------------------------------------------- blocking connection


class RawConnection:
    """One blocking TCP connection (TCP_NODELAY) with a receive buffer."""

    def __init__(self, port: int, timeout: float) -> None:
        self.sock = socket.create_connection((HOST, port), timeout=max(0.1, timeout))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.buf = bytearray()
        self.t_connect_ns = 0
        self.t_connack_ns = 0
        self.session_present = False

    def connect(self, client_id: str, login: Login, *, clean: bool, timeout: float) -> bool:
        """Send CONNECT, wait for CONNACK; return session_present.  Raises on refusal."""
        self.t_connect_ns = now_ns()
        self.sock.sendall(connect_packet(client_id, login, clean))
        body = self.expect(PT_CONNACK, timeout)
        self.t_connack_ns = now_ns()
        if len(body) != 2:
            raise RawMqttError(f"{client_id}: malformed CONNACK {body!r}")
        if body[1] != 0:
            raise RawMqttError(f"{client_id}: CONNACK return code {body[1]}")
        self.session_present = bool(body[0] & 1)
        return self.session_present

    def expect(self, packet_type: int, timeout: float) -> bytes:
        """Read packets until one of `packet_type` arrives; QoS1 PUBLISHes met before it are acked.

        Packets after the one looked for stay in the buffer for the caller's receive loop (a broker
        may send the first replayed PUBLISHes in the same segment as the CONNACK).
        """
        end_at = time.monotonic() + timeout
        while True:
            packets, used = split_packets(self.buf)
            found: bytes | None = None
            acks = bytearray()
            for first, start, end in packets:
                ptype = first >> 4
                if ptype == packet_type:
                    found = bytes(self.buf[start:end])
                    used = end
                    break
                if ptype == PT_PUBLISH and (first >> 1) & 3 == 1:
                    pid_at = start + 2 + ((self.buf[start] << 8) | self.buf[start + 1])
                    acks += b"\x40\x02" + self.buf[pid_at:pid_at + 2]
            del self.buf[:used]
            if acks:
                self.sock.sendall(acks)
            if found is not None:
                return found
            remaining = end_at - time.monotonic()
            if remaining <= 0:
                raise RawMqttError(f"no packet of type {packet_type} within {timeout:.1f}s")
            self.sock.settimeout(remaining)
            try:
                data = self.sock.recv(RECV_SIZE)
            except TimeoutError:
                continue
            if not data:
                raise RawMqttError(f"connection closed while waiting for packet type {packet_type}")
            self.buf += data

    def subscribe(self, topic: str, timeout: float) -> None:
        self.sock.sendall(encode_subscribe(1, topic))
        body = self.expect(PT_SUBACK, timeout)
        if body[2:] != b"\x01":
            raise RawMqttError(f"SUBACK {body!r}: expected granted QoS 1")

    def close(self, graceful: bool = True) -> None:
        if graceful:
            with contextlib.suppress(OSError):
                self.sock.sendall(DISCONNECT)
        with contextlib.suppress(OSError):
            self.sock.close()


def session_roundtrip(port: int, client_id: str, login: Login, *, clean: bool, topic: str | None,
                      timeout: float) -> bool:
    """CONNECT (+ SUBSCRIBE at QoS1), DISCONNECT; returns session_present.  Used for set-up and clean-up."""
    conn = RawConnection(port, timeout)
    try:
        present = conn.connect(client_id, login, clean=clean, timeout=timeout)
        if topic is not None:
            conn.subscribe(topic, timeout)
        return present
    finally:
        conn.close()


# --------------------------------------------------------------------------- publisher process


@dataclass(frozen=True)
class PubSpec:
    port: int
    client_id: str
    login: Login
    topic: str
    tag: bytes
    n: int
    inflight: int
    timeout: float  # for the whole publish phase, counted from "go"
    progress_every: float = 0.0
    cpus: tuple[int, ...] | None = None
    # After the last PUBACK, publish a marker to this topic (subscribed on the same connection before "go") and
    # wait until it comes back: stock amqtt PUBACKs before it routes a message and drops what it has not routed
    # yet when the publisher disconnects, so the marker's return is the point where every message is routed.
    flush_topic: str | None = None
    qos: int = 1  # of the n messages (the flush marker is QoS 1)


@dataclass
class PublishResult:
    requested: int
    sent: int
    acked: int
    t_first_send_ns: int
    t_last_ack_ns: int
    timed_out: bool
    error: str | None = None
    stray_acks: int = 0  # PUBACKs for a packet id that was not outstanding
    other_packets: int = 0
    t_flushed_ns: int = 0  # the flush marker came back (0 = no flush, or it did not come back in time)
    flush_error: str | None = None

    @property
    def seconds(self) -> float:
        return max(1e-9, (self.t_last_ack_ns - self.t_first_send_ns) / 1e9)

    @property
    def ack_rate(self) -> float:
        return self.acked / self.seconds

    @property
    def routed_seconds(self) -> float | None:
        """First send until the flush marker came back (every message routed), if it did."""
        if not self.t_flushed_ns:
            return None
        return max(1e-9, (self.t_flushed_ns - self.t_first_send_ns) / 1e9)

    @property
    def routed_rate(self) -> float | None:
        secs = self.routed_seconds
        return None if secs is None else self.acked / secs


def _publish(conn: RawConnection, enc: PublishEncoder, inflight: int, timeout: float,  # noqa: PLR0917 - one call site
             progress_every: float, qos: int) -> PublishResult:
    n = enc.n
    sock, buf = conn.sock, conn.buf
    outstanding = bytearray(65536)
    pubrels = bytearray() if qos == 2 else None
    sent = acked = stray = other = 0
    t_first = t_last_ack = 0
    error: str | None = None
    end_at = time.monotonic() + timeout
    next_report = time.monotonic() + progress_every if progress_every else float("inf")
    sock.settimeout(0.5)
    while acked < n:
        if sent < n and sent - acked < inflight:
            end = min(n, acked + inflight)
            t = now_ns()
            enc.stamp(sent, end, t)
            for seq in range(sent, end):
                outstanding[seq % 65535 + 1] = 1
            if not t_first:
                t_first = t
            try:
                sock.sendall(enc.chunk(sent, end))
            except OSError as exc:
                error = f"send failed: {exc!r}"
                break
            sent = end
        try:
            data = sock.recv(RECV_SIZE)
        except TimeoutError:
            data = None
        except OSError as exc:
            error = f"recv failed: {exc!r}"
            break
        now_mono = time.monotonic()
        if data is None:
            if now_mono >= end_at:
                break
            continue
        if not data:
            error = "connection closed by the broker"
            break
        buf += data
        new_acks, new_stray, new_other, any_packet = take_pubacks(buf, outstanding, pubrels)
        if pubrels:
            try:
                sock.sendall(pubrels)
            except OSError as exc:
                error = f"send failed: {exc!r}"
                break
            pubrels.clear()
        acked += new_acks
        stray += new_stray
        other += new_other
        if any_packet:
            t_last_ack = now_ns()
        if now_mono >= next_report:
            next_report = now_mono + progress_every
            log(f"    ... {sent:,} sent, {acked:,} acked")
        if now_mono >= end_at:
            break
    return PublishResult(n, sent, acked, t_first, t_last_ack or now_ns(), timed_out=acked < n and error is None,
                         error=error, stray_acks=stray, other_packets=other)


FLUSH_PAYLOAD = b"bench-flush-marker"


def _flush(conn: RawConnection, topic: str, packet_id: int, end_at: float) -> int:
    """Publish the marker (QoS1) and wait for its PUBACK and its return; return the time it came back."""
    sock, buf = conn.sock, conn.buf
    pid = packet_id.to_bytes(2, "big")
    sock.sendall(publish_packet(topic, packet_id, FLUSH_PAYLOAD))
    wanted = topic.encode()
    got_ack = got_echo = False
    t_echo = 0
    while not (got_ack and got_echo):
        if time.monotonic() >= end_at:
            raise RawMqttError(f"flush marker: PUBACK {'' if got_ack else 'not '}seen, "
                               f"{'' if got_echo else 'not '}returned within the time bound")
        try:
            data = sock.recv(RECV_SIZE)
        except TimeoutError:
            continue
        if not data:
            raise RawMqttError("connection closed while waiting for the flush marker")
        t = now_ns()
        buf += data
        packets, used = split_packets(buf)
        acks = bytearray()
        for first, start, end in packets:
            if first == 0x40 and buf[start:start + 2] == pid:
                got_ack = True
            elif first >> 4 == PT_PUBLISH:
                tlen = (buf[start] << 8) | buf[start + 1]
                i = start + 2 + tlen
                if (first >> 1) & 3:
                    acks += b"\x40\x02" + buf[i:i + 2]
                    i += 2
                if buf[start + 2:start + 2 + tlen] == wanted and buf[i:end] == FLUSH_PAYLOAD:
                    got_echo = True
                    t_echo = t
        del buf[:used]
        if acks:
            sock.sendall(acks)
    return t_echo


def _pin(cpus: tuple[int, ...] | None) -> None:
    if cpus:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, set(cpus))


def publisher_main(spec: PubSpec, pipe: Connection) -> None:
    """Child process: pre-encode, connect, report ("ready"), wait for "go", publish, report ("result")."""
    conn: RawConnection | None = None
    try:
        _pin(spec.cpus)
        enc = PublishEncoder(spec.topic, spec.tag, spec.n, spec.qos)
        conn = RawConnection(spec.port, 30.0)
        conn.connect(spec.client_id, spec.login, clean=True, timeout=30.0)
        if spec.flush_topic is not None:
            conn.subscribe(spec.flush_topic, 30.0)
        pipe.send(("ready", None))
        if not pipe.poll(120.0) or pipe.recv() != "go":
            pipe.send(("error", "no 'go' from the parent"))
            return
        end_at = time.monotonic() + spec.timeout
        result = _publish(conn, enc, spec.inflight, spec.timeout, spec.progress_every, spec.qos)
        if spec.flush_topic is not None and result.acked == spec.n and result.error is None:
            try:
                conn.sock.settimeout(0.5)
                result.t_flushed_ns = _flush(conn, spec.flush_topic, enc.packet_id(spec.n), end_at)
            except (OSError, RawMqttError) as exc:
                result.flush_error = f"{type(exc).__name__}: {exc}"
        pipe.send(("result", result))
    except Exception as exc:
        with contextlib.suppress(OSError):
            pipe.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        if conn is not None:
            conn.close()


# --------------------------------------------------------------------------- subscriber process


@dataclass(frozen=True)
class SubSpec:
    port: int
    client_id: str
    login: Login
    clean: bool
    tag: bytes
    n: int
    timeout: float  # whole receive phase, counted from CONNACK
    idle: float | None = None  # give up after this long without a new unique message
    subscribe: str | None = None  # topic to SUBSCRIBE to at `qos` (else rely on the stored session)
    need_session: bool = False  # stop at once if CONNACK says session_present=0
    after_first: float | None = None  # stop this long after the first message (a probe)
    record_latency: bool = False
    cpus: tuple[int, ...] | None = None
    qos: int = 1  # of the SUBSCRIBE (1 or 2)


@dataclass
class ReceiveResult:
    n: int
    session_present: bool = False
    t_connect_ns: int = 0
    t_connack_ns: int = 0
    t_first_ns: int = 0  # first PUBLISH with our tag
    t_last_ns: int = 0  # latest new unique message
    unique: int = 0
    duplicates: int = 0  # same sequence number again
    dup_flags: int = 0  # PUBLISHes carrying DUP=1
    retained: int = 0  # PUBLISHes carrying RETAIN=1
    reordered: int = 0  # first deliveries with a lower sequence number than one seen before
    foreign: int = 0  # not our tag / not our payload layout
    other_packets: int = 0
    publishes: int = 0  # PUBLISH packets received, ours or not
    pubacks_sent: int = 0  # acks sent (at QoS 2: PUBRECs and PUBCOMPs)
    p50_ms: float | None = None
    p99_ms: float | None = None
    end: str = ""
    error: str | None = None

    @property
    def all_received(self) -> bool:
        return self.unique >= self.n


def nearest_rank(sorted_values: list[int], pct: float) -> float | None:
    if not sorted_values:
        return None
    rank = max(1, round(pct / 100.0 * len(sorted_values) + 0.5 - 1e-9))
    return float(sorted_values[min(rank, len(sorted_values)) - 1])


def _receive(conn: RawConnection, spec: SubSpec, res: ReceiveResult, pipe: Connection) -> None:
    sock, buf = conn.sock, conn.buf
    n, tag = spec.n, spec.tag
    seen = bytearray(n)
    unpack = PAYLOAD_HEADER.unpack_from
    latencies: list[int] = []
    record = spec.record_latency
    unique = dups = dup_flags = retained = reordered = foreign = other = acks_sent = publishes = 0
    t_first = t_last = 0
    max_seq = -1
    waiting_suback = spec.subscribe is not None
    start = time.monotonic()
    end_at = start + spec.timeout
    last_progress = start
    next_pipe_check = start + 0.25
    sock.settimeout(0.25)
    leftover = bool(buf)
    end = ""
    while True:
        if unique >= n:
            end = "all received"
            break
        now_mono = time.monotonic()
        if now_mono >= end_at:
            end = f"time bound ({spec.timeout:.0f}s)"
            break
        if spec.idle is not None and not waiting_suback and now_mono - last_progress >= spec.idle:
            end = f"idle {spec.idle:.0f}s"
            break
        if spec.after_first is not None and t_first and now_mono - t_first / 1e9 >= spec.after_first:
            end = f"probe of {spec.after_first:.0f}s after the first message"
            break
        if now_mono >= next_pipe_check:
            next_pipe_check = now_mono + 0.25
            if pipe.poll():
                end = "stopped by the parent"
                break
        if leftover:  # packets that came with the CONNACK / SUBACK are handled before any recv
            leftover = False
        else:
            try:
                data = sock.recv(RECV_SIZE)
            except TimeoutError:
                continue
            if not data:
                end = "connection closed by the broker"
                break
            buf += data
        t = now_ns()
        acks = bytearray()
        packets, used = split_packets(buf)
        for first, pstart, pend in packets:
            if first >> 4 == PT_PUBLISH:
                publishes += 1
                qos = (first >> 1) & 3
                i = pstart + 2 + ((buf[pstart] << 8) | buf[pstart + 1])
                if qos:
                    acks += b"\x40\x02" if qos == 1 else b"\x50\x02"  # PUBACK, or QoS 2's PUBREC
                    acks += buf[i:i + 2]
                    i += 2
                if first & 0x08:
                    dup_flags += 1
                if first & 0x01:
                    retained += 1
                if pend - i != PAYLOAD_SIZE:
                    foreign += 1
                    continue
                ptag, seq, sent = unpack(buf, i)
                if ptag != tag or seq >= n:
                    foreign += 1
                    continue
                if not t_first:
                    t_first = t
                if seen[seq]:
                    dups += 1
                    continue
                seen[seq] = 1
                unique += 1
                if seq < max_seq:
                    reordered += 1
                else:
                    max_seq = seq
                t_last = t
                if record:
                    latencies.append(t - sent)
            elif first >> 4 == PT_SUBACK and waiting_suback:
                waiting_suback = False
                if buf[pstart + 2:pend] != bytes((spec.qos,)):
                    raise RawMqttError(f"SUBACK {bytes(buf[pstart:pend])!r}: expected granted QoS {spec.qos}")
                pipe.send(("ready", conn.session_present))
                last_progress = time.monotonic()
            elif first >> 4 == PT_PINGREQ:
                acks += PINGRESP
            elif first == 0x62:  # PUBREL of a QoS 2 message: PUBCOMP
                acks += b"\x70\x02" + buf[pstart:pstart + 2]
            else:
                other += 1
        del buf[:used]
        if acks:
            sock.sendall(acks)
            acks_sent += len(acks) // 4
        if t_last == t:
            last_progress = time.monotonic()
    latencies.sort()
    p50, p99 = nearest_rank(latencies, 50), nearest_rank(latencies, 99)
    res.p50_ms = None if p50 is None else p50 / 1e6
    res.p99_ms = None if p99 is None else p99 / 1e6
    res.unique, res.duplicates, res.dup_flags, res.retained = unique, dups, dup_flags, retained
    res.reordered, res.foreign, res.other_packets, res.pubacks_sent = reordered, foreign, other, acks_sent
    res.publishes = publishes
    res.t_first_ns, res.t_last_ns, res.end = t_first, t_last, end


def subscriber_main(spec: SubSpec, pipe: Connection) -> None:
    """Child process: connect (+ subscribe), report ("ready"), receive until done, report ("result")."""
    res = ReceiveResult(spec.n)
    conn: RawConnection | None = None
    try:
        _pin(spec.cpus)
        conn = RawConnection(spec.port, 30.0)
        res.session_present = conn.connect(spec.client_id, spec.login, clean=spec.clean, timeout=30.0)
        res.t_connect_ns, res.t_connack_ns = conn.t_connect_ns, conn.t_connack_ns
        if spec.subscribe is not None:
            conn.sock.sendall(encode_subscribe(1, spec.subscribe, spec.qos))  # "ready" follows the SUBACK
        else:
            pipe.send(("ready", res.session_present))
        if spec.need_session and not res.session_present:
            res.end = "no stored session (session_present=0)"
        else:
            _receive(conn, spec, res, pipe)
    except Exception as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    finally:
        if conn is not None:
            conn.close()
    with contextlib.suppress(OSError):
        pipe.send(("result", res))


# --------------------------------------------------------------------------- process handling (parent side)


_MP = multiprocessing.get_context("spawn")


class ClientProcess:
    """A client child process we started, talking over a Pipe; only ever killed through its own PID."""

    def __init__(self, name: str, target: Callable[[Any, Connection], None], spec: object) -> None:
        self.name = name
        self.pipe, child_end = _MP.Pipe()
        self.proc = _MP.Process(target=target, args=(spec, child_end), name=name, daemon=True)
        self.proc.start()
        child_end.close()

    def expect(self, kind: str, timeout: float) -> Any:
        """Wait for a ("kind", payload) message; raise on an error report, death or timeout."""
        end_at = time.monotonic() + timeout
        while True:
            remaining = end_at - time.monotonic()
            if remaining <= 0:
                raise RawMqttError(f"{self.name}: no '{kind}' within {timeout:.0f}s")
            try:
                ready = self.pipe.poll(min(0.2, remaining))
                message = self.pipe.recv() if ready else None
            except (EOFError, OSError) as exc:
                raise RawMqttError(f"{self.name}: client process died (exit code {self.exitcode()})") from exc
            if message is None:
                if not self.proc.is_alive() and not self.pipe.poll():
                    raise RawMqttError(f"{self.name}: client process exited with {self.exitcode()}")
                continue
            got, payload = message
            if got == "error":
                raise RawMqttError(f"{self.name}: {payload}")
            if got == kind:
                return payload
            if got == "result":
                raise RawMqttError(f"{self.name}: finished early: {payload}")

    def send(self, message: object) -> None:
        with contextlib.suppress(OSError):
            self.pipe.send(message)

    def exitcode(self) -> int | None:
        self.proc.join(0.5)
        return self.proc.exitcode

    def close(self, timeout: float = 10.0) -> None:
        self.proc.join(timeout)
        if self.proc.is_alive():
            self.proc.kill()  # SIGKILL to this child's own PID
            self.proc.join(5.0)
        self.pipe.close()

    def __enter__(self) -> ClientProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        if exc[0] is not None:
            self.send("stop")
            self.close(timeout=2.0)
        else:
            self.close()


# --------------------------------------------------------------------------- trivial sink (client ceiling)


def _sink_source(sock: socket.socket, buf: bytearray, n: int, tag: bytes, window: int) -> None:
    """Blast n QoS1 PUBLISHes at a subscriber, at most `window` unacknowledged."""
    enc = PublishEncoder("ceiling/data", tag, n)
    outstanding = bytearray(65536)
    sent = acked = 0
    sock.settimeout(0.5)
    end_at = time.monotonic() + 300.0
    while acked < n and time.monotonic() < end_at:
        if sent < n and sent - acked < window:
            end = min(n, acked + window)
            for seq in range(sent, end):
                outstanding[seq % 65535 + 1] = 1
            sock.sendall(enc.chunk(sent, end))
            sent = end
        try:
            data = sock.recv(RECV_SIZE)
        except TimeoutError:
            continue
        if not data:
            return
        buf += data
        acked += take_pubacks(buf, outstanding)[0]


def _sink_serve(sock: socket.socket, window: int) -> None:
    """Answer CONNECT, SUBSCRIBE, PINGREQ; PUBACK every QoS1 PUBLISH at once; source data on 'ceiling/<n>/<tag>'."""
    buf = bytearray()
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.settimeout(600.0)
    with contextlib.suppress(OSError, RawMqttError), sock:
        while True:
            data = sock.recv(RECV_SIZE)
            if not data:
                return
            buf += data
            packets, used = split_packets(buf)
            out = bytearray()
            source: tuple[int, bytes] | None = None
            for first, start, _end in packets:
                ptype = first >> 4
                if ptype == PT_PUBLISH:
                    if (first >> 1) & 3 == 1:
                        i = start + 2 + ((buf[start] << 8) | buf[start + 1])
                        out += b"\x40\x02"
                        out += buf[i:i + 2]
                elif ptype == PT_CONNECT:
                    out += b"\x20\x02\x00\x00"
                elif ptype == PT_SUBSCRIBE:
                    out += b"\x90\x03" + buf[start:start + 2] + b"\x01"
                    tlen = (buf[start + 2] << 8) | buf[start + 3]
                    topic = bytes(buf[start + 4:start + 4 + tlen]).decode()
                    parts = topic.split("/")
                    if len(parts) == 3 and parts[0] == "ceiling":
                        source = (int(parts[1]), bytes.fromhex(parts[2]))
                elif ptype == PT_PINGREQ:
                    out += PINGRESP
                elif ptype == PT_DISCONNECT:
                    return
            del buf[:used]
            if out:
                sock.sendall(out)
            if source is not None:
                _sink_source(sock, buf, source[0], source[1], window)


def sink_main(params: tuple[int, tuple[int, ...] | None], pipe: Connection) -> None:
    """Child process: a trivial MQTT sink on an ephemeral 127.0.0.1 port; runs until the parent says stop.

    params: (in-flight window when sourcing, CPUs to pin to or None).
    """
    window, cpus = params
    _pin(cpus)
    srv = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    srv.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    srv.bind((HOST, 0))
    srv.listen(16)
    srv.settimeout(0.2)
    pipe.send(("ready", srv.getsockname()[1]))
    end_at = time.monotonic() + 3600.0
    with srv:
        while not pipe.poll() and time.monotonic() < end_at:
            try:
                sock, _addr = srv.accept()
            except TimeoutError:
                continue
            threading.Thread(target=_sink_serve, args=(sock, window), daemon=True).start()
