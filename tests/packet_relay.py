"""A TCP relay between an MQTT client and a real broker that sees every packet either way: a test
waits on what the broker or the client is sent (not on a client library's log lines), holds one
direction's packets (read and seen, forwarded in order at release()), and may rewrite what the
client sends. Blocking sockets, two threads per link, every wait bounded by WAIT."""

from __future__ import annotations

import contextlib
import json
import socket
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

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

    def __init__(self, broker_port: int, rewrite: Callable[[Packet], Packet] | None = None) -> None:
        self.broker_port = broker_port
        self.rewrite = rewrite
        """Applied to each packet the client sends (after it is seen) before it is forwarded."""
        self.seen: list[Packet] = []
        self._cond = threading.Condition()
        self._held: dict[Direction, list[tuple[socket.socket, bytes]] | None] = {"up": None, "down": None}
        self._holding: dict[Direction, Callable[[Packet], bool]] = {}
        self._sending: dict[Direction, threading.Lock] = {"up": threading.Lock(), "down": threading.Lock()}
        """Taken before _cond, kept while sending (never _cond): one way's packets leave in order and a
        slow peer blocks only that way's senders, not every thread waiting on _cond."""
        self._refusing = False
        self._failures: list[BaseException] = []
        """What a relay thread raised other than a link's end (e.g. a ``rewrite`` assertion): close()
        raises it, so the test fails instead of seeing a mere EOF."""
        self._sockets: list[socket.socket] = []
        self._server = socket.create_server((HOST, 0))
        self.port: int = self._server.getsockname()[1]
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="packet-relay")]
        self._threads[0].start()

    def wait_seen(self, predicate: Callable[[Packet], bool], after: int = 0) -> Packet:
        """The first packet from ``seen[after:]`` that matches; AssertionError after WAIT without one."""
        with self._cond:
            found: list[Packet] = []
            self._cond.wait_for(lambda: found.extend(p for p in self.seen[after:] if predicate(p)) or bool(found), WAIT)
        assert found, "the relay saw no such packet"
        return found[0]

    def hold(self, direction: Direction, which: Callable[[Packet], bool] = lambda _packet: True) -> None:
        """Packets going ``direction`` (``which`` of them: the others overtake them) are seen but not
        forwarded until release(); a CONNECT always is."""
        with self._cond:
            self._holding[direction] = which
            if self._held[direction] is None:
                self._held[direction] = []

    def release(self, direction: Direction) -> None:
        """Forward what was held, in order, and stop holding."""
        with self._sending[direction]:
            with self._cond:
                held, self._held[direction] = self._held[direction] or [], None
            for destination, data in held:
                with contextlib.suppress(OSError):
                    destination.sendall(data)

    def cut(self) -> None:
        """Reset every open link and refuse new connections until accept()."""
        with self._cond:
            self._refusing = True
            for sock in self._sockets:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)  # wakes its pump's read; close() alone would not
                sock.close()
            self._sockets.clear()

    def accept(self) -> None:
        with self._cond:
            self._refusing = False

    def close(self) -> None:
        """Cut every link and stop listening; each of the relay's threads has ended (AssertionError
        when one is still running after WAIT); re-raises the first failure a relay thread had."""
        self.cut()
        with contextlib.suppress(OSError):
            self._server.shutdown(socket.SHUT_RDWR)  # wakes the accept(); close() alone would not
        self._server.close()
        for thread in list(self._threads):
            thread.join(WAIT)
            assert not thread.is_alive(), f"{thread.name} still runs"
        if self._failures:
            raise self._failures[0]

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._server.accept()
            except OSError:  # closed
                return
            with self._cond:
                if self._refusing:
                    client.close()
                    continue
                try:
                    broker = socket.create_connection((HOST, self.broker_port), timeout=WAIT)
                except OSError:
                    client.close()
                    continue
                self._sockets += [client, broker]
            for source, destination, direction in ((client, broker, "up"), (broker, client, "down")):
                args = (source, destination, direction)
                pump = threading.Thread(target=self._pump, args=args, daemon=True, name=f"packet-relay-{direction}")
                self._threads.append(pump)
                pump.start()

    def _pump(self, source: socket.socket, destination: socket.socket, direction: Direction) -> None:
        source.settimeout(None)  # a link may stay idle for the whole test; cut() or close() ends the read
        try:
            while True:
                packet = Packet(direction, *read_packet(source))
                with self._sending[direction]:
                    with self._cond:
                        self.seen.append(packet)
                        self._cond.notify_all()
                        if direction == "up" and self.rewrite is not None:
                            packet = self.rewrite(packet)
                        data = encode_packet(packet.first, packet.body)
                        held = self._held[direction]
                        if held is not None and packet.kind != 1 and self._holding[direction](packet):
                            held.append((destination, data))
                            continue
                    destination.sendall(data)
        except (OSError, ConnectionClosedError):  # a closed or reset link
            pass
        except BaseException as failure:
            with self._cond:
                self._failures.append(failure)
        with contextlib.suppress(OSError):  # end the other way too
            destination.shutdown(socket.SHUT_RDWR)
