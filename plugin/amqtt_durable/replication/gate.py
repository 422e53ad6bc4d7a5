"""How many connections a replication listener holds before they pass the handshake.

Anyone who reaches a replication address can open connections and say nothing; each would be
held until ``handshake_timeout``. Unbounded, a few thousand of them take the broker's file
descriptors (MQTT clients then go unanswered) and fill the log. A gate admits at most
``PER_HOST`` such connections from one address and ``TOTAL`` in all; one past either is closed
at once, counted, and logged at most once per ``LOG_EVERY`` seconds. A node stopping or being
promoted aborts the connections still waiting (from Python 3.12 ``Server.wait_closed`` waits
for every connection, so one silent peer would hold a promotion up)."""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from typing import Any

log = logging.getLogger("amqtt_durable.replication")

PER_HOST = 8
TOTAL = 64
LOG_EVERY = 10.0


class HandshakeGate:
    def __init__(self, where: str, per_host: int = PER_HOST, total: int = TOTAL) -> None:
        self.where = where
        self.per_host = per_host
        self.total = total
        self.turned_away = 0
        """Connections closed at once because too many were waiting (since start)."""
        self._waiting: dict[asyncio.StreamWriter, tuple[str, asyncio.Task[Any] | None]] = {}
        """Each connection in its handshake: its address, and the task serving it."""
        self._hosts: Counter[str] = Counter()
        self._unlogged = 0
        self._logged_at = float("-inf")

    def admit(self, writer: asyncio.StreamWriter, host: str) -> bool:
        """Hold ``writer`` until ``done``; False (and the connection aborted) when full."""
        if len(self._waiting) >= self.total or self._hosts[host] >= self.per_host:
            writer.transport.abort()
            self.turned_away += 1
            self._unlogged += 1
            now = time.monotonic()
            if now - self._logged_at >= LOG_EVERY:
                log.warning(
                    "replication: %s: closed %d connection(s) at once, the last from %s: %d from that "
                    "address (at most %d) or %d in all (at most %d) had not finished the handshake",
                    self.where, self._unlogged, host, self._hosts[host], self.per_host, len(self._waiting),
                    self.total,
                )
                self._unlogged, self._logged_at = 0, now
            return False
        self._waiting[writer] = (host, asyncio.current_task())
        self._hosts[host] += 1
        return True

    def done(self, writer: asyncio.StreamWriter) -> None:
        host, _ = self._waiting.pop(writer, (None, None))
        if host is not None:
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]

    def abort_all(self) -> None:
        """End every connection still in its handshake (a stop, a promotion): its task is
        cancelled, and closes it (aborting the socket under a TLS handshake would leave asyncio's
        stream without a transport)."""
        for _, task in list(self._waiting.values()):
            if task is not None:
                task.cancel()
