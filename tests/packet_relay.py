"""A TCP relay between an MQTT client and a real broker that sees every packet either way: a test
waits on what the broker or the client is sent (not on a client library's log lines), holds one
direction's packets (read and seen, forwarded in order at release()), and may rewrite what the
client sends or what the broker sends it. Two threads per link, every wait bounded (``wait``: WAIT).
The ``relays`` fixture (a pytest plugin of tests/conftest.py) makes relays and closes them all at a
test's end."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any, Literal

import pytest
from raw_mqtt_helpers import ConnectionClosedError, read_packet

from amqtt_durable.wire import encode_packet
from conftest import HOST, WAIT
from durable_protocol import CONTROL_TOPIC, REPLY_TOPIC

Direction = Literal["up", "down"]
"""``up``: from the client to the broker; ``down``: back."""


@dataclass(frozen=True)
class Packet:
    direction: Direction
    first: int
    body: bytes

    @property
    def kind(self) -> int:
        """The MQTT packet type (1 CONNECT ... 14 DISCONNECT)."""
        return self.first >> 4

    def control(self) -> dict[str, Any] | None:
        """The durable control request or reply this packet carries (a PUBLISH to CONTROL_TOPIC or
        REPLY_TOPIC), or None."""
        if self.kind != 3:
            return None
        length = int.from_bytes(self.body[:2], "big")
        if self.body[2 : 2 + length] not in (CONTROL_TOPIC.encode(), REPLY_TOPIC.encode()):
            return None
        start = 2 + length + (2 if self.first & 0x06 else 0)
        found = json.loads(self.body[start:])
        return found if isinstance(found, dict) else None


class PacketRelay:
    """Listens on an ephemeral port of HOST and relays each accepted connection to ``broker_port``."""

    def __init__(
        self,
        broker_port: int,
        rewrite: Callable[[Packet], Packet] | None = None,
        *,
        rewrite_down: Callable[[Packet], Packet] | None = None,
        wait: float = WAIT,
    ) -> None:
        self.broker_port = broker_port
        self.rewrite = rewrite
        """Applied to each packet the client sends before it is seen (``seen`` keeps it as sent) and
        forwarded. It runs outside the relay's locks: it may call release(), hold() or cut()."""
        self.rewrite_down = rewrite_down
        """``rewrite`` for each packet the broker sends the client (a frame the broker never writes)."""
        self.wait = wait
        """The bound of each wait: wait_seen(), a send (a peer that reads nothing that long), a whole
        packet once its first byte came, close()'s joins. A send or read that times out fails the relay."""
        self.seen: list[Packet] = []
        self._cond = threading.Condition()
        self._held: dict[Direction, list[tuple[socket.socket, bytes]] | None] = {"up": None, "down": None}
        self._holding: dict[Direction, Callable[[Packet], bool]] = {}
        self._sending: dict[Direction, threading.Lock] = {"up": threading.Lock(), "down": threading.Lock()}
        """Taken before _cond, kept while sending (never _cond): one way's packets leave in order and a
        slow peer blocks only that way's senders, not every thread waiting on _cond."""
        self._asking = threading.local()
        """Set in the thread running a predicate (under _cond): release() from it would deadlock."""
        self._refusing = False
        self._cuts = 0
        """cut() calls so far: a client accepted before one is dropped, though accept() came since."""
        self._failures: list[BaseException] = []
        """What a relay thread raised other than a link's end (e.g. a ``rewrite`` assertion, a send that
        timed out), and a release() that timed out: wait_seen() and close() raise it, so the test fails
        with it, not with a timeout (or not at all, the release()'s TimeoutError caught)."""
        self._closed = False
        self._sockets: list[socket.socket] = []
        self._cut_sockets: list[socket.socket] = []
        """Sockets cut() shut down, closed by close() once their pumps have ended: closed at once, a
        pump still about to wait on one could wait on whatever socket reused its descriptor (an
        accepted reconnect) until its timeout, ``wait``."""
        self._server = socket.create_server((HOST, 0))
        self.port: int = self._server.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="packet-relay")]
        self._threads[0].start()

    def wait_seen(self, predicate: Callable[[Packet], bool], after: int = 0) -> Packet:
        """The first packet from ``seen[after:]`` that matches; AssertionError after ``wait`` without one,
        or a relay thread's failure as soon as it has one. ``predicate`` runs under the relay's lock."""

        def matches() -> list[Packet]:
            return [packet for packet in self.seen[after:] if self._ask(predicate, packet)]

        with self._cond:
            self._cond.wait_for(lambda: bool(self._failures or matches()), self.wait)
            self._raise_failure()
            found = matches()
        assert found, "the relay saw no such packet"
        return found[0]

    def hold(self, direction: Direction, which: Callable[[Packet], bool] = lambda _packet: True) -> None:
        """Packets going ``direction`` (``which`` of them: the others overtake them) are seen but not
        forwarded until release(); a CONNECT always is. ``which`` runs under the relay's lock."""
        with self._cond:
            self._holding[direction] = which
            if self._held[direction] is None:
                self._held[direction] = []

    def release(self, direction: Direction) -> None:
        """Forward what was held, in order, and stop holding. TimeoutError when a peer reads none of it
        for ``wait``: that link, left with part of a packet sent, is shut down, and the relay fails
        (wait_seen() and close() raise it); RuntimeError from a hold() or wait_seen() predicate (it
        would deadlock)."""
        if getattr(self._asking, "predicate", False):
            raise RuntimeError("release() from a PacketRelay predicate, which runs under the relay's lock")
        with self._sending[direction]:
            with self._cond:
                held, self._held[direction] = self._held[direction] or [], None
            for destination, data in held:
                try:
                    destination.sendall(data)
                except TimeoutError as stalled:
                    with contextlib.suppress(OSError):  # part of a packet went: the rest must not follow
                        destination.shutdown(socket.SHUT_RDWR)
                    self._fail(stalled)
                    raise
                except OSError:  # its link was cut: what it held is lost with it
                    pass

    def cut(self) -> None:
        """Reset every open link and refuse new connections until accept()."""
        with self._cond:
            self._refusing = True
            self._cuts += 1
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its pump's read; close() alone would not
            self._cut_sockets += self._sockets
            self._sockets.clear()

    def accept(self) -> None:
        with self._cond:
            self._refusing = False

    def close(self) -> None:
        """Cut every link and stop listening; re-raises the first failure a relay thread had, then
        asserts each of the relay's threads ended within ``wait``. Once only: a second close() does
        nothing (the ``relays`` fixture's, after a test's own)."""
        if self._closed:
            return
        self._closed = True
        self.cut()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone would not
        self._server.close()
        deadline = time.monotonic() + self.wait
        for thread in self._threads:  # the accept thread first: once it has ended, none is added
            thread.join(max(0.0, deadline - time.monotonic()))
        for sock in self._cut_sockets:
            sock.close()
        self._raise_failure()
        running = [thread.name for thread in self._threads if thread.is_alive()]
        assert not running, f"{running} still run"

    def _raise_failure(self) -> None:
        if self._failures:
            raise self._failures[0]

    def _ask(self, predicate: Callable[[Packet], bool], packet: Packet) -> bool:
        self._asking.predicate = True
        try:
            return predicate(packet)
        finally:
            self._asking.predicate = False

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            client.settimeout(self.wait)
            broker, cuts = None, self._cuts
            if not self._refusing:  # read again under _cond below, once connected
                with contextlib.suppress(OSError):  # connected outside _cond: a slow broker blocks no waiter
                    broker = socket.create_connection((HOST, self.broker_port), timeout=self.wait)
            with self._cond:
                if broker is None or self._refusing or self._cuts != cuts:  # refused, no broker, or cut() since
                    for sock in (client, broker):
                        if sock is not None:
                            sock.close()
                    continue
                self._sockets += [client, broker]
                for source, destination, direction in ((client, broker, "up"), (broker, client, "down")):
                    args = (source, destination, direction)
                    pump = threading.Thread(target=self._pump, args=args, daemon=True, name=f"packet-relay-{direction}")
                    self._threads.append(pump)
                    pump.start()

    def _pump(self, source: socket.socket, destination: socket.socket, direction: Direction) -> None:
        try:
            while True:
                _wait_readable(source)
                packet = Packet(direction, *read_packet(source, time.monotonic() + self.wait))
                rewrite = self.rewrite if direction == "up" else self.rewrite_down
                forward = packet if rewrite is None else rewrite(packet)
                data = encode_packet(forward.first, forward.body)
                with self._sending[direction]:
                    with self._cond:
                        self.seen.append(packet)
                        self._cond.notify_all()
                        held = self._held[direction]
                        if held is not None and forward.kind != 1 and self._ask(self._holding[direction], forward):
                            held.append((destination, data))
                            continue
                    destination.sendall(data)
        except TimeoutError as stalled:  # a peer read nothing, or sent half a packet, for `wait`
            self._fail(stalled)
        except (OSError, ConnectionClosedError):  # a closed or reset link
            pass
        except BaseException as failure:
            self._fail(failure)
        with contextlib.suppress(OSError):  # end the other way too
            destination.shutdown(socket.SHUT_RDWR)

    def _fail(self, failure: BaseException) -> None:
        with self._cond:
            if failure not in self._failures:  # a rewrite's release() that timed out fails its pump too
                self._failures.append(failure)
            self._cond.notify_all()  # a wait_seen() raises it now, not after its wait


def _wait_readable(source: socket.socket) -> None:
    """Until ``source`` has a byte or its end to read: a link may stay idle for the whole test, longer
    than its timeout (which bounds a send, or a packet's rest); cut() or close() ends it."""
    while True:
        with contextlib.suppress(TimeoutError):
            source.recv(1, socket.MSG_PEEK)
            return


def close_all(relays: Iterable[PacketRelay]) -> None:
    """close() every relay, also after one raised; then the first one's failure."""
    failures: list[BaseException] = []
    for relay in relays:
        try:
            relay.close()
        except BaseException as failure:  # the others are closed all the same
            failures.append(failure)
    if failures:
        raise failures[0]


@pytest.fixture
def relays() -> Iterator[Callable[..., PacketRelay]]:
    """PacketRelay(...) makers; at the test's end every relay made is closed (close_all)."""
    made: list[PacketRelay] = []

    def make(*args: Any, **kwargs: Any) -> PacketRelay:
        made.append(PacketRelay(*args, **kwargs))
        return made[-1]

    yield make
    close_all(made)
