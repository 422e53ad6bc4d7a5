"""The fleet's TCP fault proxy: it sits between the simulated devices and the broker and fails
their links the way a real network does (a reset, or a blackhole the peers only notice through
their MQTT keep-alive), per device or for all, on the fault schedule's orders.

A device is known by the client id of its MQTT CONNECT, so a fault follows the device across
reconnects. The proxy runs an asyncio loop on its own thread; the schedule calls it from a
plain thread and each call returns once its effect has happened.

In front of a replicated pair (``--ha``) the proxy is the pair's virtual address: an
``Upstream`` (durable_fleet.ha's router) picks the broker that is primary for each new
connection, so devices need no list of brokers. ``TcpRelay`` is a plain TCP relay with a
blackhole switch: the harness puts one between each broker and etcd to partition a primary
from its coordinator.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import os
import socket
import struct
import threading
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, Literal, Protocol, TypeVar

from amqtt_durable.errors import ProtocolViolationError
from amqtt_durable.wire import decode_remaining_length

log = logging.getLogger(__name__)

LinkState = Literal["up", "stall-up", "stall-down", "stall", "cut"]
"""stall-up holds the device's bytes to the broker only, stall-down the broker's to the device only."""
_SEVERITY: dict[LinkState, int] = {"up": 0, "stall-up": 1, "stall-down": 1, "stall": 2, "cut": 3}
Direction = Literal["up", "down"]
"""A link's direction: ``up`` from the device to the broker, ``down`` back."""
CONNECT = 0x10
"""The first byte of a CONNECT packet (type 1, flags 0)."""
_PROTOCOLS = {("MQIsdp", 3), ("MQTT", 4), ("MQTT", 5)}
"""Protocol name and level of MQTT 3.1, 3.1.1 and 5.0: the CONNECT layouts whose client id we can find."""
MAX_CONNECT = 1 << 20
"""A larger CONNECT is taken as garbage rather than waited for (MQTT would allow 256 MB)."""
CHUNK = 65536
RATE_STEP = 16384
"""Bytes a rate-limited TcpRelay reads from its target at a time."""
RATE_RCVBUF = 65536
"""SO_RCVBUF of a rate-limited TcpRelay's socket to its target (Linux doubles it)."""
CALL_TIMEOUT = 10.0
"""Bound of a call from another thread (start, cut, stall, restore, connected, stats, stop)."""
CLOSE_TIMEOUT = 5.0
"""Bound of the wait for sockets to close, inside CALL_TIMEOUT."""
_LINGER_RESET = struct.pack("ii", 1, 0)
"""SO_LINGER on with timeout 0: close() sends an RST, so the peer sees ECONNRESET, not a FIN."""

_T = TypeVar("_T")
Opened = tuple[asyncio.StreamReader, asyncio.StreamWriter, bytes]
"""A broker connection with its CONNECT sent, and the broker's first bytes (its CONNACK) to pass on."""


class Upstream(Protocol):
    """Where a device's connection goes when it is not one fixed broker address."""

    async def open(self, connect: bytes, abandoned: Callable[[], bool]) -> Opened | None:
        """Connect to the right broker, send ``connect`` (the device's CONNECT) and read its
        CONNACK; None when ``abandoned()`` says the device left meanwhile. OSError when no
        broker would take it (the device's connection is then reset)."""


@dataclass
class ProxyStats:
    """What the proxy did so far, for the run's report and the tests."""

    accepted: int = 0
    """TCP connections accepted from devices."""
    cuts: int = 0
    """Links reset by cut()."""
    refused: int = 0
    """Connections reset as soon as their CONNECT was read, because the device's link was cut."""
    bytes_up: int = 0
    """Bytes forwarded to the broker, the CONNECTs included."""
    bytes_down: int = 0
    """Bytes forwarded to the devices."""


def _varint(data: bytes | bytearray, pos: int) -> tuple[int, int]:
    """The MQTT variable byte integer at ``pos`` (the codec's decoder) and the position after it;
    ValueError, as for every other flaw of a CONNECT here, when it is cut short or too long."""
    try:
        field = decode_remaining_length(data, pos)
    except ProtocolViolationError as exc:
        raise ValueError(str(exc)) from None
    if field is None:
        raise ValueError("truncated variable byte integer")
    return field


def _utf8(data: bytes, pos: int) -> tuple[str, int]:
    """The MQTT string (two length bytes, UTF-8) at ``pos`` and the position after it."""
    end = pos + 2 + int.from_bytes(data[pos : pos + 2], "big")
    if pos + 2 > len(data) or end > len(data):
        raise ValueError("truncated string")
    try:
        return data[pos + 2 : end].decode(), end
    except UnicodeDecodeError as exc:
        raise ValueError("string is not UTF-8") from exc


def connect_client_id(packet: bytes) -> str:
    """The client id of a complete MQTT 3.1, 3.1.1 or 5.0 CONNECT packet; ValueError if it is not one.

    The client id follows the protocol name, level, flags, keep-alive and (5.0) the properties.
    """
    if not packet or packet[0] != CONNECT:
        raise ValueError("not a CONNECT packet")
    length, body = _varint(packet, 1)
    if body + length != len(packet):
        raise ValueError(f"remaining length {length} does not match the {len(packet) - body} bytes that follow")
    name, pos = _utf8(packet, body)
    if pos + 4 > len(packet):
        raise ValueError("truncated CONNECT header")
    level, flags = packet[pos], packet[pos + 1]
    if (name, level) not in _PROTOCOLS:
        raise ValueError(f"unknown protocol {name!r} level {level}")
    if flags & 0x01:
        raise ValueError("reserved CONNECT flag set")
    pos += 4  # level, flags, keep-alive
    if level == 5:
        properties, pos = _varint(packet, pos)
        pos += properties
    client_id, _ = _utf8(packet, pos)
    return client_id


async def _read_connect(reader: asyncio.StreamReader) -> bytes:
    """The first packet of a connection, which must be a CONNECT (checked before it is read whole)."""
    packet = bytearray(await reader.readexactly(2))
    if packet[0] != CONNECT:
        raise ValueError(f"first byte 0x{packet[0]:02x}, a CONNECT's is 0x10")
    while packet[-1] & 0x80:  # the remaining length goes on
        if len(packet) == 5:
            raise ValueError("remaining length longer than 4 bytes")
        packet += await reader.readexactly(1)
    length, _ = _varint(packet, 1)
    if length > MAX_CONNECT:
        raise ValueError(f"CONNECT of {length} bytes")
    packet += await reader.readexactly(length)
    return bytes(packet)


def _reset(writer: asyncio.StreamWriter) -> None:
    """Closes the socket with an RST, as a failed network link looks to the peer."""
    sock = writer.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):  # already closed
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RESET)
    writer.transport.abort()


async def _closed(writers: Iterable[asyncio.StreamWriter]) -> None:
    """Waits (bounded) until the sockets are closed, so the peers have seen it when a call returns.

    Best effort, so a cancel (by stop()) ends the wait without ending the cleanup that called it.
    """
    waits = asyncio.gather(*(writer.wait_closed() for writer in writers), return_exceptions=True)
    with contextlib.suppress(TimeoutError, asyncio.CancelledError):
        await asyncio.wait_for(waits, CLOSE_TIMEOUT)


def _abandoned(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> bool:
    """Did the device close or reset this connection (seen without reading from it)?"""
    if reader.at_eof():
        return True
    sock = writer.get_extra_info("socket")
    if sock is None:
        return True
    with socket.socket(fileno=os.dup(sock.fileno())) as peek:
        try:
            return peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
        except BlockingIOError:
            return False  # open, nothing sent
        except OSError:
            return True  # reset


def _worse(a: LinkState, b: LinkState) -> LinkState:
    """The state of a link under both: one way stalled each way is a stall; cut is worst."""
    if {a, b} == {"stall-up", "stall-down"}:
        return "stall"
    return max(a, b, key=_SEVERITY.__getitem__)


def _peer(writer: asyncio.StreamWriter) -> str:
    peer = writer.get_extra_info("peername")
    return f"{peer[0]}:{peer[1]}" if isinstance(peer, tuple) else str(peer)


class _Link:
    """A device's connection (its CONNECT read) and, once made, its broker connection.

    ``flowing`` is clear while the link is stalled: the pumps neither read nor write then;
    ``ways[direction]`` is clear while only that direction is (its pump neither reads nor writes).
    """

    def __init__(self, device: str, device_writer: asyncio.StreamWriter, task: asyncio.Task[Any]) -> None:
        self.device = device
        self.task = task
        self.writers = [device_writer]
        self.flowing = asyncio.Event()
        self.flowing.set()
        self.ways: dict[Direction, asyncio.Event] = {"up": asyncio.Event(), "down": asyncio.Event()}
        for way in self.ways.values():
            way.set()
        self._paused: list[asyncio.ReadTransport] = []

    def attach(self, broker_writer: asyncio.StreamWriter) -> None:
        self.writers.append(broker_writer)
        if not (self.flowing.is_set() and self.ways["down"].is_set()):
            self._pause(broker_writer)

    async def moving(self, direction: Direction) -> None:
        """Returns once neither the link nor ``direction`` is stalled."""
        way = self.ways[direction]
        while not (self.flowing.is_set() and way.is_set()):
            await self.flowing.wait()
            await way.wait()

    def hold_one(self, direction: Direction) -> None:
        """Stops reading the socket whose bytes go ``direction`` (the device's for up, the
        broker's for down): they stay in the kernel, as in a one-way blackhole."""
        self.release()
        self.ways[direction].clear()
        source = 0 if direction == "up" else 1
        if source < len(self.writers):
            self._pause(self.writers[source])

    def hold(self) -> None:
        """Stops reading both sockets, so what the peers send stays in the kernel, as in a blackhole."""
        if self.flowing.is_set():
            self.flowing.clear()
            for writer in self.writers:
                self._pause(writer)

    def _pause(self, writer: asyncio.StreamWriter) -> None:
        # Only a transport that is reading: one its StreamReader paused (full buffer) it resumes itself.
        transport = writer.transport
        if isinstance(transport, asyncio.ReadTransport) and transport.is_reading():
            transport.pause_reading()
            self._paused.append(transport)

    def release(self) -> None:
        if not self.flowing.is_set():
            for transport in self._paused:
                transport.resume_reading()
            self._paused.clear()
            self.flowing.set()
        if not all(way.is_set() for way in self.ways.values()):
            for transport in self._paused:
                transport.resume_reading()
            self._paused.clear()
            for way in self.ways.values():
                way.set()

    def reset(self) -> None:
        """Resets both sockets at once and stops the link's task wherever it waits."""
        for writer in self.writers:
            _reset(writer)
        self.task.cancel()


class _LoopThread:
    """An asyncio server on a loop of its own thread; other threads call in with ``_call``."""

    def __init__(self, listen_host: str, name: str) -> None:
        self.listen_host = listen_host
        self.port = 0
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=name, daemon=True)
        self._server: asyncio.Server | None = None
        self._links: set[_Link] = set()
        """The open connections (only touched on the loop)."""

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        raise NotImplementedError

    async def _shutdown(self) -> None:
        """Closes the listener, resets every link and ends every connection's task (bounded)."""
        if self._server is not None:
            self._server.close()
        for link in list(self._links):
            link.reset()
        tasks = asyncio.all_tasks() - {asyncio.current_task()}
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=CLOSE_TIMEOUT)

    def start(self) -> int:
        """Starts the loop's thread and listens on an ephemeral port of listen_host; returns the port."""
        self._thread.start()
        serving = asyncio.start_server(self._serve, self.listen_host, 0, backlog=1024)
        self._server = asyncio.run_coroutine_threadsafe(serving, self._loop).result(CALL_TIMEOUT)
        self.port = int(self._server.sockets[0].getsockname()[1])
        return self.port

    def stop(self) -> None:
        """Closes the listener and resets every connection, then ends the loop's thread (bounded waits)."""
        if self._thread.is_alive():
            with contextlib.suppress(TimeoutError):  # the thread is a daemon: stopping is best effort
                asyncio.run_coroutine_threadsafe(self._shutdown(), self._loop).result(CALL_TIMEOUT)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(CALL_TIMEOUT)
        if not self._thread.is_alive() and not self._loop.is_closed():
            self._loop.close()

    def _call(self, work: Callable[[], Coroutine[Any, Any, _T]], idle: _T) -> _T:
        """Runs ``work`` on the loop and waits for it (bounded); ``idle`` when the loop is not running."""
        if not self._loop.is_running():
            return idle
        future = asyncio.run_coroutine_threadsafe(work(), self._loop)
        try:
            return future.result(CALL_TIMEOUT)
        except TimeoutError:
            future.cancel()
            raise


class FaultProxy(_LoopThread):
    """A TCP proxy from the devices to the broker whose links cut(), stall() and restore() control.

    The state of a device's link is the worse of the global state and its own (cut is worse than
    stall), so restore(device) leaves a global fault in force and cut(device) resets the device's
    links even during a global stall. A "link" is a device connection whose CONNECT was read,
    until it closes, including one still held by a stall or connecting to the broker.
    """

    def __init__(
        self,
        broker_host: str,
        broker_port: int,
        *,
        listen_host: str = "127.0.0.1",
        connect_timeout: float = 5.0,
        upstream: Upstream | None = None,
    ) -> None:
        super().__init__(listen_host, "fault-proxy")
        self.broker_host = broker_host
        self.broker_port = broker_port
        self.connect_timeout = connect_timeout
        """Bound of the wait for a device's CONNECT and of the connection to the broker."""
        self.upstream = upstream
        """None: every link goes to broker_host:broker_port; else the upstream picks the broker."""
        self._lock = threading.Lock()  # the states: set from the caller's thread, read on the loop
        self._global: LinkState = "up"
        self._states: dict[str, LinkState] = {}
        self._stats = ProxyStats()

    def cut(self, device: str | None = None) -> int:
        """Takes the link down: resets every open link of ``device`` (None: of every device) and, until
        restore(), every new connection of it once its CONNECT is read. Returns the links reset."""
        self._set(device, "cut")
        reset, _ = self._call(lambda: self._enforce(device), (0, 0))
        return reset

    def stall(self, device: str | None = None, *, direction: Direction | None = None) -> int:
        """Blackholes the links of ``device`` (None: of every device) until restore(): nothing is read
        or forwarded either way, nothing is closed, new connections are held before the broker.
        With ``direction`` only that way is: ``up``, what the devices send (except a new
        connection's CONNECT, which the proxy reads to know the device: the broker gets it and
        its CONNACK comes back), ``down``, what the broker sends (a new connection's CONNACK too).
        One way, then the other, is a stall of both. Returns the links stalled (either way)."""
        self._set(device, "stall" if direction is None else "stall-up" if direction == "up" else "stall-down")
        _, stalled = self._call(lambda: self._enforce(device), (0, 0))
        return stalled

    def restore(self, device: str | None = None) -> None:
        """Ends ``device``'s own fault (None: every fault, global and per device); held bytes, closes
        and connections then go on in order."""
        with self._lock:
            if device is None:
                self._global = "up"
                self._states.clear()
            else:
                self._states.pop(device, None)
        self._call(lambda: self._enforce(device), (0, 0))

    def connected(self, device: str | None = None) -> int:
        """The open links of ``device`` (None: of all devices)."""

        async def count() -> int:
            return sum(1 for link in self._links if device is None or link.device == device)

        return self._call(count, 0)

    @property
    def stats(self) -> ProxyStats:
        """A copy of the counters."""

        async def snapshot() -> ProxyStats:
            return dataclasses.replace(self._stats)

        return self._call(snapshot, dataclasses.replace(self._stats))

    def _set(self, device: str | None, state: LinkState) -> None:
        """Only restore() makes a link better: a stall over a cut leaves it cut."""
        with self._lock:
            if device is None:
                self._global = _worse(self._global, state)
            else:
                self._states[device] = _worse(self._states.get(device, "up"), state)

    def _state_of(self, device: str) -> LinkState:
        with self._lock:
            return _worse(self._global, self._states.get(device, "up"))

    async def _enforce(self, target: str | None) -> tuple[int, int]:
        """Brings every link in line with the states; returns how many links of ``target`` (None: of
        all) it reset and how many are stalled now."""
        reset: list[_Link] = []
        stalled = 0
        for link in list(self._links):
            state = self._state_of(link.device)
            if state == "cut":
                self._links.discard(link)
                link.reset()
                reset.append(link)
            elif state == "stall":
                link.hold()
                stalled += target is None or link.device == target
            elif state in ("stall-up", "stall-down"):
                link.hold_one("up" if state == "stall-up" else "down")
                stalled += target is None or link.device == target
            else:
                link.release()
        self._stats.cuts += len(reset)
        if reset:  # their tasks end once the sockets are closed
            await asyncio.wait([link.task for link in reset], timeout=CLOSE_TIMEOUT)
        return sum(1 for link in reset if target is None or link.device == target), stalled

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """A device's connection: its CONNECT names the device, whose state decides what follows."""
        self._stats.accepted += 1
        try:
            try:
                packet = await asyncio.wait_for(_read_connect(reader), self.connect_timeout)
                device = connect_client_id(packet)
            except TimeoutError:
                log.warning("closing %s: no complete MQTT CONNECT within %.3g s", _peer(writer), self.connect_timeout)
                writer.close()
                return
            except ValueError as exc:
                log.warning("closing %s: its first packet is not a well-formed MQTT CONNECT: %s", _peer(writer), exc)
                writer.close()
                return
            except (EOFError, OSError) as exc:  # the device went away (a killed process), nothing wrong here
                log.debug("%s closed before its CONNECT was complete: %r", _peer(writer), exc)
                writer.close()
                return
            task = asyncio.current_task()
            assert task is not None, "a connection is served by its own task"
            state = self._state_of(device)
            if state == "cut":
                self._stats.refused += 1
                log.debug("refused %s (%r): its link is cut", _peer(writer), device)
                _reset(writer)
                return
            link = _Link(device, writer, task)
            self._links.add(link)
            if state == "stall":
                link.hold()
            elif state in ("stall-up", "stall-down"):
                link.hold_one("up" if state == "stall-up" else "down")
            await self._run(link, reader, packet)
        except asyncio.CancelledError:
            pass  # by cut() or stop(); the server's task ends quietly (Python 3.11 logs a cancelled one)
        finally:
            if not writer.transport.is_closing():  # cancelled (stop) before the link existed
                _reset(writer)
            await _closed([writer])

    async def _run(self, link: _Link, device_reader: asyncio.StreamReader, connect: bytes) -> None:
        """Connects the link to the broker and pumps both ways until both sides closed (each EOF is
        passed on as a half-close) or one failed (then both are reset, as the failure propagates)."""
        failed = True
        pumps: set[asyncio.Task[None]] = set()
        try:
            await link.flowing.wait()  # a connection made during a stall is held before the broker
            if _abandoned(device_reader, link.writers[0]):
                # In a real blackhole its SYN would never have been answered: the broker must not get
                # a CONNECT the device gave up on (it reconnects on a new connection).
                log.debug("%r closed its connection while it was held; not forwarded", link.device)
                return
            opened = await self._open_broker(link, device_reader, connect)
            if opened is None:
                return
            broker_reader, broker_writer, reply = opened
            link.attach(broker_writer)
            device_writer = link.writers[0]
            sent = b"" if self.upstream is None else connect  # an upstream sent the CONNECT itself
            self._stats.bytes_up += len(sent)
            pumps = {
                asyncio.create_task(self._pump(link, device_reader, broker_writer, connect[len(sent):], up=True)),
                asyncio.create_task(self._pump(link, broker_reader, device_writer, reply, up=False)),
            }
            pending = pumps
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                errors = [error for error in (task.exception() for task in done) if error is not None]
                for error in errors:
                    if isinstance(error, OSError):
                        log.debug("link of %r ended: %r", link.device, error)
                    else:
                        log.error("link of %r failed", link.device, exc_info=error)
                if errors:
                    return
            failed = False
        finally:
            self._links.discard(link)
            for pump in pumps:
                pump.cancel()
            for writer in link.writers:
                if failed:
                    _reset(writer)
                else:
                    writer.close()
            await _closed(link.writers)

    async def _open_broker(
        self, link: _Link, device_reader: asyncio.StreamReader, connect: bytes
    ) -> Opened | None:
        """The broker end of a link: broker_host:broker_port, or what the upstream picks; None
        (the device's connection is then reset) when there is none to be had."""
        try:
            if self.upstream is not None:
                return await self.upstream.open(connect, lambda: _abandoned(device_reader, link.writers[0]))
            reader, writer = await asyncio.wait_for(
                asyncio.open_connection(self.broker_host, self.broker_port), self.connect_timeout
            )
        except (OSError, TimeoutError) as exc:  # e.g. the broker is being restarted
            where = "primary broker" if self.upstream is not None else f"broker {self.broker_host}:{self.broker_port}"
            log.debug("%s not reachable for %r: %r; resetting the device's connection", where, link.device, exc)
            return None
        return reader, writer, b""

    async def _pump(
        self, link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, first: bytes, *, up: bool
    ) -> None:
        """One direction of a link: ``first``, then what ``reader`` gets, to ``writer``, then the EOF.

        While the link (or this direction) is stalled nothing is read, and what was read (data, EOF,
        a reset) is held; a one-way stall up lets the device's CONNECT (``first`` up) through.
        """
        direction: Direction = "up" if up else "down"
        chunk = first
        connect = up
        try:
            while True:
                if chunk:
                    await (link.flowing.wait() if connect else link.moving(direction))
                    writer.write(chunk)
                    if up:
                        self._stats.bytes_up += len(chunk)
                    else:
                        self._stats.bytes_down += len(chunk)
                    await writer.drain()
                connect = False
                await link.moving(direction)
                chunk = await reader.read(CHUNK)
                if not chunk:
                    break
            await link.moving(direction)
            writer.write_eof()
        except OSError:
            await link.moving(direction)
            raise


class TcpRelay(_LoopThread):
    """A plain TCP relay to ``host:port`` that ``cut()`` turns into a blackhole until ``heal()``.

    While cut nothing is read or forwarded either way and nothing is closed: a client's calls
    time out, as across a real partition; connections made meanwhile are accepted and held.
    ``heal()`` resets what was held (its peers gave up on it long ago) and relays again.

    With ``rate`` (bytes per second, finite and above 0, else ValueError) the target's bytes reach
    the client no faster, as over a slow link: the relay reads them in steps of RATE_STEP bytes,
    paced, through a socket with a small receive buffer (RATE_RCVBUF), so the target's writes wait
    as they would on that link instead of filling a kernel buffer of megabytes.
    """

    def __init__(
        self,
        host: str,
        port: int,
        *,
        listen_host: str = "127.0.0.1",
        connect_timeout: float = 5.0,
        rate: float | None = None,
    ) -> None:
        if rate is not None and not 0 < rate < math.inf:
            raise ValueError(f"TcpRelay rate must be bytes per second, finite and above 0, got {rate!r}")
        super().__init__(listen_host, f"relay-{port}")
        self.host = host
        self.target_port = port
        self.connect_timeout = connect_timeout
        self.rate = rate
        self.cut_now = False
        """Read from the relay's loop only (set there by cut() and heal())."""

    @property
    def address(self) -> str:
        return f"{self.listen_host}:{self.port}"

    def cut(self) -> int:
        """Blackholes every connection, open or new, until heal(); returns how many were open."""

        async def hold() -> int:
            self.cut_now = True
            for link in self._links:
                link.hold()
            return len(self._links)

        return self._call(hold, 0)

    def heal(self) -> None:
        """Resets the connections held by the cut; new ones are relayed again."""

        async def release() -> None:
            self.cut_now = False
            held = [link for link in self._links if not link.flowing.is_set()]
            for link in held:
                self._links.discard(link)
                link.reset()
            await _closed(writer for link in held for writer in link.writers)

        self._call(release, None)

    async def _open_target(self) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        """The connection to the target; with ``rate``, through a socket with a small receive buffer
        (set before the connect, so the window it advertises stays small)."""
        if self.rate is None:
            return await asyncio.open_connection(self.host, self.target_port)
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, RATE_RCVBUF)
            sock.setblocking(False)
            await asyncio.get_running_loop().sock_connect(sock, (self.host, self.target_port))
            return await asyncio.open_connection(sock=sock, limit=RATE_STEP)
        except BaseException:
            sock.close()
            raise

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None, "a connection is served by its own task"
        link = _Link(_peer(writer), writer, task)
        self._links.add(link)
        try:
            if self.cut_now:
                link.hold()
            await link.flowing.wait()  # held until heal(), which resets it
            target_reader, target_writer = await asyncio.wait_for(self._open_target(), self.connect_timeout)
            link.attach(target_writer)
            pumps = [
                asyncio.create_task(_relay(link, reader, target_writer)),
                asyncio.create_task(_relay(link, target_reader, writer, self.rate)),
            ]
            try:
                await asyncio.gather(*pumps)
            finally:
                for pump in pumps:
                    pump.cancel()
        except (OSError, TimeoutError, asyncio.CancelledError) as exc:
            log.debug("relay link %s ended: %r", link.device, exc)
        finally:
            self._links.discard(link)
            for end in link.writers:
                if link.flowing.is_set():
                    end.close()
                else:
                    _reset(end)
            await _closed(link.writers)


async def _relay(
    link: _Link, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, rate: float | None = None
) -> None:
    """One direction of a relay link, until EOF (passed on); nothing moves while the link is held.
    With ``rate``: at most that many bytes per second (TcpRelay)."""
    loop = asyncio.get_running_loop()
    due = loop.time()
    while True:
        await link.flowing.wait()
        chunk = await reader.read(CHUNK if rate is None else RATE_STEP)
        if not chunk:
            break
        await link.flowing.wait()
        writer.write(chunk)
        await writer.drain()
        if rate is not None:  # the pace of the link: never faster, no burst after a pause
            due = max(due, loop.time()) + len(chunk) / rate
            await asyncio.sleep(due - loop.time())
    with contextlib.suppress(OSError):
        writer.write_eof()
