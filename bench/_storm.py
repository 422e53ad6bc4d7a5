"""Reconnect storm load client: many durable sessions with a queued backlog each reconnect at once.

One asyncio event loop drives every connection over raw sockets (MQTT 3.1.1, the encoders of _rawmqtt.py),
so a storm of 1,000 sessions needs neither 1,000 threads nor an MQTT library in the measured path.

Phases (run_storm):
  1. set-up: every session connects with clean_session=0, subscribes QoS1 to its own topic
     ``<prefix>/s/<i>`` and disconnects (a bounded number at a time);
  2. enqueue: one publisher publishes ``messages`` QoS1 messages to every session's topic
     (round-robin over the sessions, at most ``inflight`` unacknowledged), then publishes a flush marker to
     a topic it subscribed itself and waits for it, so the backlog is routed before the storm;
  3. storm: all sessions open their connection at the same moment (t0) and receive their backlog,
     acknowledging every PUBLISH; meanwhile a probe publisher (connected before t0; its own thread and
     event loop) publishes QoS1 messages one at a time to an unrelated topic and records each PUBACK.
     The storm ends when every session has all its messages, or at the time bound.

Payloads carry the session index and the message's sequence number, so order, gaps and duplicates are
checked per session.  Used by bench_storm.py (in a client process) and tests/test_reconnect_storm.py.
Everything talks to 127.0.0.1 only; every wait is bounded.
"""

from __future__ import annotations

import asyncio
import bisect
import contextlib
import os
import statistics
import struct
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from _rawmqtt import (
    DISCONNECT,
    HOST,
    PAYLOAD_SIZE,
    Login,
    RawMqttError,
    connect_packet,
    publish_packet,
)

from amqtt_durable.wire import encode_subscribe, read_packet, split_packets

_PAYLOAD = struct.Struct("!II")  # session index, sequence number
_PADDING = bytes(PAYLOAD_SIZE - _PAYLOAD.size)
SETUP_CONCURRENCY = 50  # sessions set up at a time in phase 1 (not measured)
now_ns = time.monotonic_ns


@dataclass(frozen=True)
class StormSpec:
    port: int
    login: Login
    prefix: str  # client ids and topics of this storm start with it (unique per run)
    sessions: int
    messages: int  # queued per session
    inflight: int = 100  # the enqueueing publisher's window
    timeout: float = 600.0  # bound of each phase (s)
    probe: bool = True  # a publisher keeps publishing (QoS1, one at a time) during the storm
    cpus: tuple[int, ...] | None = None


@dataclass
class StormResult:
    sessions: int
    messages: int
    enqueue_s: float = 0.0
    enqueued: int = 0  # PUBACKs to the enqueueing publisher
    storm_s: float | None = None  # t0 -> the last message of the last session (None: not all arrived)
    first_ms: list[float] = field(default_factory=list)  # per session, t0 -> its first message (sorted)
    complete_ms: list[float] = field(default_factory=list)  # per session, t0 -> its last message (sorted)
    connected_ms: list[float] = field(default_factory=list)  # per session, t0 -> TCP connection made (sorted)
    connack_ms: list[float] = field(default_factory=list)  # per session, t0 -> its CONNACK (sorted)
    first_rank: list[int] = field(default_factory=list)
    """Per session (sorted): how many messages the storm had delivered, to all sessions, before this
    session's first one (in the order this client read them); the last is the slowest session's."""
    received: int = 0  # distinct messages over all sessions
    complete_sessions: int = 0
    no_session: int = 0  # CONNACK with session_present=0
    out_of_order: int = 0  # a first-time message whose sequence number is not the previous one + 1
    duplicates: int = 0
    refused: int = 0  # connections that failed or were refused
    probe_acks: int = 0  # PUBACKs to the probe publisher received before the storm ended
    probe_acks_total: int = 0
    probe_max_ms: float | None = None  # the probe's slowest PUBLISH -> PUBACK during the storm
    probe_median_ms: float | None = None
    probe_max_firsts: int | None = None
    """The most sessions whose first message arrived between one probe PUBLISH and its PUBACK."""
    error: str | None = None

    @property
    def expected(self) -> int:
        return self.sessions * self.messages

    @property
    def slowest_first_ms(self) -> float | None:
        return self.first_ms[-1] if len(self.first_ms) == self.sessions else None

    @property
    def rate(self) -> float | None:
        return self.expected / self.storm_s if self.storm_s else None

    def summary(self) -> str:
        parts = [f"{self.received:,}/{self.expected:,} messages, {self.complete_sessions:,}/{self.sessions:,} "
                 "sessions complete"]
        for count, what in ((self.no_session, "without stored session"), (self.out_of_order, "out of order"),
                            (self.duplicates, "duplicates"), (self.refused, "connections failed")):
            if count:
                parts.append(f"{count:,} {what}")
        if self.probe_acks_total:
            parts.append(f"probe publisher: {self.probe_acks:,} PUBACKs during the storm, slowest "
                         f"{self.probe_max_ms or 0:.1f} ms, median {self.probe_median_ms or 0:.2f} ms, at most "
                         f"{self.probe_max_firsts} sessions' first messages during one")
        if self.error:
            parts.append(f"error: {self.error}")
        return ", ".join(parts)


def payload(index: int, seq: int) -> bytes:
    return _PAYLOAD.pack(index, seq) + _PADDING


def session_id(spec: StormSpec, index: int) -> str:
    return f"{spec.prefix}-{index}"


def session_topic(spec: StormSpec, index: int) -> str:
    return f"{spec.prefix}/s/{index}"


# --------------------------------------------------------------------------- phase 1: set-up


async def _expect(reader: asyncio.StreamReader, packet_type: int) -> bytes:
    while True:  # bounded by the caller's timeout
        packet = await read_packet(reader)
        assert packet is not None  # no idle bound: only EOF ends a read, and it raises
        first, body = packet
        if first >> 4 == packet_type:
            return body


async def _subscribe_once(spec: StormSpec, index: int) -> None:
    reader, writer = await asyncio.open_connection(HOST, spec.port)
    try:
        writer.write(connect_packet(session_id(spec, index), spec.login, clean=False))
        connack = await _expect(reader, 2)
        if connack[1] != 0:
            raise RawMqttError(f"session {index}: CONNACK return code {connack[1]}")
        writer.write(encode_subscribe(1, session_topic(spec, index)))
        suback = await _expect(reader, 9)
        if suback[2:3] != b"\x01":
            raise RawMqttError(f"session {index}: SUBACK {suback!r}")
        writer.write(DISCONNECT)
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def set_up_sessions(spec: StormSpec) -> None:
    gate = asyncio.Semaphore(SETUP_CONCURRENCY)

    async def one(index: int) -> None:
        async with gate:
            await _subscribe_once(spec, index)

    await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(spec.sessions))), spec.timeout)


# --------------------------------------------------------------------------- phase 2: enqueue


def _packets(spec: StormSpec) -> Iterator[bytes]:
    topics = [session_topic(spec, i) for i in range(spec.sessions)]
    k = 0
    for seq in range(spec.messages):
        for index, topic in enumerate(topics):
            yield publish_packet(topic, k % 65535 + 1, payload(index, seq))
            k += 1


async def enqueue(spec: StormSpec, result: StormResult) -> None:
    """Publish the backlog with a window of spec.inflight; result.enqueued counts the PUBACKs as they come,
    result.enqueue_s is set to the seconds until the flush marker came back."""
    reader, writer = await asyncio.open_connection(HOST, spec.port, limit=1 << 20)
    flush_topic = f"{spec.prefix}/flush"
    try:
        writer.write(connect_packet(f"{spec.prefix}-pub", spec.login, clean=True))
        await asyncio.wait_for(_expect(reader, 2), 30.0)
        writer.write(encode_subscribe(1, flush_topic))
        await asyncio.wait_for(_expect(reader, 9), 30.0)
        total = spec.sessions * spec.messages
        source = _packets(spec)
        t0 = time.perf_counter()
        sent = acked = 0
        buf = bytearray()
        deadline = time.monotonic() + spec.timeout
        while acked < total:
            burst = []
            while sent < total and sent - acked < spec.inflight:
                burst.append(next(source))
                sent += 1
            if burst:
                writer.write(b"".join(burst))
            data = await asyncio.wait_for(reader.read(1 << 18), max(0.001, deadline - time.monotonic()))
            if not data:
                raise RawMqttError(f"publisher: connection closed after {acked:,} PUBACKs")
            buf += data
            packets, used = split_packets(buf)
            acked += sum(1 for first, _s, _e in packets if first == 0x40)
            result.enqueued = acked
            del buf[:used]
        writer.write(publish_packet(flush_topic, 1, b"flush"))
        while True:  # the marker comes back once everything before it was routed
            packet = await asyncio.wait_for(read_packet(reader), max(0.001, deadline - time.monotonic()))
            assert packet is not None  # no idle bound: only EOF ends a read, and it raises
            first, body = packet
            if first >> 4 == 3 and body.endswith(b"flush"):
                if first & 0x06:
                    writer.write(b"\x40\x02" + body[2 + len(flush_topic):4 + len(flush_topic)])
                break
        result.enqueue_s = time.perf_counter() - t0
        writer.write(DISCONNECT)
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


# --------------------------------------------------------------------------- phase 3: the storm


class _Session(asyncio.Protocol):
    """One reconnecting session: CONNECT on connection, PUBACK every PUBLISH, check order per session."""

    def __init__(self, storm: _Storm, index: int) -> None:
        self.storm = storm
        self.index = index
        self.buf = bytearray()
        self.seen = bytearray(storm.spec.messages)
        self.unique = 0
        self.last_seq = -1
        self.first_ns = 0
        self.last_ns = 0
        self.connected_ns = 0
        self.connack_ns = 0
        self.first_rank = -1
        self.counted = False
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        self.connected_ns = now_ns()
        transport.write(connect_packet(session_id(self.storm.spec, self.index), self.storm.spec.login, clean=False))

    def data_received(self, data: bytes) -> None:
        buf = self.buf
        buf += data
        packets, used = split_packets(buf)
        acks = []
        storm = self.storm
        res = storm.result
        t = now_ns()
        for first, start, end in packets:
            kind = first >> 4
            if kind == 3:
                pos = start + 2 + ((buf[start] << 8) | buf[start + 1])
                if first & 0x06:
                    acks.append(b"\x40\x02" + buf[pos:pos + 2])
                    pos += 2
                if end - pos < _PAYLOAD.size:
                    continue
                index, seq = _PAYLOAD.unpack_from(buf, pos)
                if index != self.index or seq >= len(self.seen):
                    continue
                if self.seen[seq]:
                    res.duplicates += 1
                    continue
                self.seen[seq] = 1
                if seq != self.last_seq + 1:
                    res.out_of_order += 1
                self.last_seq = seq
                self.unique += 1
                if not self.first_ns:
                    self.first_ns = t
                    self.first_rank = res.received
                res.received += 1
                self.last_ns = t
            elif kind == 2 and end - start >= 2:
                self.connack_ns = t
                if buf[start + 1] != 0:
                    res.refused += 1
                elif not buf[start] & 1:
                    res.no_session += 1
        del buf[:used]
        if acks and self.transport is not None:
            self.transport.write(b"".join(acks))
        if self.unique == len(self.seen):
            storm.session_done(self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.transport = None
        self.storm.session_lost(self)


class _Storm:
    def __init__(self, spec: StormSpec, result: StormResult) -> None:
        self.spec = spec
        self.result = result
        self.sessions: list[_Session] = []
        self.pending = spec.sessions
        self.finished = asyncio.Event()
        self.t0 = 0

    def session_done(self, session: _Session) -> None:
        if session.counted:
            return
        session.counted = True
        self.result.complete_sessions += 1
        self.pending -= 1
        if self.pending == 0:
            self.finished.set()

    def session_lost(self, session: _Session) -> None:
        if not self.finished.is_set() and session.unique < len(session.seen):
            self.result.refused += 1
            self.pending -= 1
            if self.pending == 0:
                self.finished.set()


def _probe_thread(spec: StormSpec, latencies: list[tuple[int, int]], connected: threading.Event,
                  stop: threading.Event, errors: list[BaseException]) -> None:
    """The probe publisher, on its own event loop in its own thread: a PUBACK the broker wrote is read
    at once, not after this process's loop got through the storm's 1,000 connections (which, in the
    storm's loop, added up to about a second to the probe's slowest PUBACK)."""
    try:
        asyncio.run(_probe_publisher(spec, latencies, connected, stop))
    except BaseException as exc:  # reported by storm() as the probe's failure
        errors.append(exc)


async def _probe_publisher(spec: StormSpec, latencies: list[tuple[int, int]], connected: threading.Event,
                           stop: threading.Event) -> None:
    """QoS1 PUBLISH, wait for its PUBACK, repeat, until `stop`; record (PUBLISH written, PUBACK read), ns."""
    reader, writer = await asyncio.open_connection(HOST, spec.port)
    try:
        writer.write(connect_packet(f"{spec.prefix}-probe", spec.login, clean=True))
        await asyncio.wait_for(_expect(reader, 2), 30.0)
        connected.set()
        topic = f"{spec.prefix}/probe"
        pid = 0
        while not stop.is_set():
            pid = pid % 65535 + 1
            packet = publish_packet(topic, pid, payload(0, pid))
            t = now_ns()
            writer.write(packet)
            await asyncio.wait_for(_expect(reader, 4), spec.timeout)
            latencies.append((t, now_ns()))
            await asyncio.sleep(0.001)  # ~1 publish per ms at most: a device reporting, not a flood
        writer.write(DISCONNECT)
        await writer.drain()
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def storm(spec: StormSpec, result: StormResult) -> None:
    loop = asyncio.get_running_loop()
    st = _Storm(spec, result)
    latencies: list[tuple[int, int]] = []
    stop = threading.Event()
    probe_connected = threading.Event()
    probe_errors: list[BaseException] = []
    probe = None
    if spec.probe:
        probe = threading.Thread(target=_probe_thread, args=(spec, latencies, probe_connected, stop, probe_errors),
                                 name="storm-probe", daemon=True)
        probe.start()
        if not await asyncio.to_thread(probe_connected.wait, 30.0):
            stop.set()
            raise RawMqttError(f"the probe publisher did not connect within 30 s: {probe_errors}")

    async def connect(index: int) -> None:
        session = _Session(st, index)
        st.sessions.append(session)
        try:
            await loop.create_connection(lambda: session, HOST, spec.port)
        except OSError:
            result.refused += 1
            st.pending -= 1
            if st.pending == 0:
                st.finished.set()

    st.t0 = now_ns()
    await asyncio.gather(*(connect(i) for i in range(spec.sessions)))
    try:
        await asyncio.wait_for(st.finished.wait(), spec.timeout)
    except TimeoutError:
        result.error = f"not all sessions complete within {spec.timeout:.0f}s"
    end_ns = max((s.last_ns for s in st.sessions), default=st.t0)
    if result.complete_sessions == spec.sessions:
        result.storm_s = (end_ns - st.t0) / 1e9
    result.first_ms = sorted((s.first_ns - st.t0) / 1e6 for s in st.sessions if s.first_ns)
    result.complete_ms = sorted((s.last_ns - st.t0) / 1e6 for s in st.sessions if s.unique == spec.messages)
    result.connected_ms = sorted((s.connected_ns - st.t0) / 1e6 for s in st.sessions if s.connected_ns)
    result.connack_ms = sorted((s.connack_ns - st.t0) / 1e6 for s in st.sessions if s.connack_ns)
    result.first_rank = sorted(s.first_rank for s in st.sessions if s.first_rank >= 0)
    stop.set()
    if probe is not None:
        await asyncio.to_thread(probe.join, 30.0)
        if probe.is_alive() or probe_errors:  # the probe's own failure is a finding, not a crash of the storm
            why = f"{type(probe_errors[0]).__name__}: {probe_errors[0]}" if probe_errors else "still running"
            result.error = (result.error or "") + f" probe publisher: {why}"
    during = [(sent, acked) for sent, acked in latencies if acked <= end_ns]
    result.probe_acks_total = len(latencies)
    result.probe_acks = len(during)
    if during:
        result.probe_max_ms = max(acked - sent for sent, acked in during) / 1e6
        result.probe_median_ms = statistics.median(acked - sent for sent, acked in during) / 1e6
        # order of events, not time: sessions whose first message came while a probe PUBLISH awaited its PUBACK
        firsts = sorted(s.first_ns for s in st.sessions if s.first_ns)
        result.probe_max_firsts = max(
            bisect.bisect_left(firsts, acked) - bisect.bisect_right(firsts, sent) for sent, acked in during
        )
    for session in st.sessions:
        if session.transport is not None:
            session.transport.write(DISCONNECT)
            session.transport.close()


async def run_storm(spec: StormSpec) -> StormResult:
    """All three phases against the broker on spec.port; failures are reported in result.error."""
    result = StormResult(spec.sessions, spec.messages)
    phase = "set-up"
    try:
        await set_up_sessions(spec)
        phase = "enqueue"
        await enqueue(spec, result)
        phase = "storm"
        await storm(spec, result)
    except TimeoutError:
        result.error = f"{phase} did not finish within {spec.timeout:.0f}s"
        if phase == "enqueue":
            result.error += f" ({result.enqueued:,}/{result.expected:,} PUBACKed)"
    except Exception as exc:
        result.error = f"{phase}: {type(exc).__name__}: {exc}"
    await asyncio.sleep(0)  # let the transports close
    return result


def storm_main(spec: StormSpec, pipe: Connection) -> None:
    """Child process (bench_storm.py): run the storm, report ("result", StormResult)."""
    if spec.cpus:
        with contextlib.suppress(AttributeError, OSError):
            os.sched_setaffinity(0, set(spec.cpus))
    pipe.send(("ready", None))
    result = asyncio.run(run_storm(spec))
    with contextlib.suppress(OSError):
        pipe.send(("result", result))
