"""How many connections a replication listener holds before they pass the handshake.

Anyone who reaches a replication address can open connections and say nothing; each would be
held until ``handshake_timeout``. Unbounded, a few thousand of them take the broker's file
descriptors (MQTT clients then go unanswered) and fill the log. A gate admits at most
``PER_HOST`` such connections from one address and ``TOTAL`` in all; one past either is closed
at once, counted, and logged at most once per ``LOG_EVERY`` seconds. A refused handshake (a
wrong or missing secret, a silent peer, a failed TLS handshake) is logged at once the first time
its address and reason come up in an interval of ``LOG_EVERY`` seconds (at most ``LOG_HOSTS``
such pairs); the others are counted and summed up in one WARNING when that interval ends. A node
stopping or being promoted aborts the connections still waiting (from Python 3.12 ``Server.wait_closed`` waits
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
LOG_HOSTS = 16


class HandshakeGate:
    def __init__(self, where: str, per_host: int = PER_HOST, total: int = TOTAL) -> None:
        self.where = where
        self.per_host = per_host
        self.total = total
        self.turned_away = 0
        """Connections closed at once because too many were waiting (since start)."""
        self.refused = 0
        """Connections refused by the handshake (since start): wrong or missing secret, silent peer, TLS."""
        self._refusals_since = float("-inf")
        self._refusals_logged: set[tuple[str, str]] = set()
        """The addresses and reasons logged in this interval (at most ``LOG_HOSTS``)."""
        self._refusals_unlogged = 0
        self._summary: asyncio.TimerHandle | None = None
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

    def refusal(self, host: str, peer: str, why: str) -> None:
        """A connection from ``peer`` (at ``host``) refused by the handshake: counted, and logged
        as a WARNING unless the same address and reason were logged in this interval (or
        ``LOG_HOSTS`` others were); the ones not logged are summed up in one WARNING when the
        interval ends."""
        self.refused += 1
        now = time.monotonic()
        if now - self._refusals_since >= LOG_EVERY:
            self._summarize()
            self._refusals_since = now
        if (host, why) not in self._refusals_logged and len(self._refusals_logged) < LOG_HOSTS:
            self._refusals_logged.add((host, why))
            log.warning("replication: refused a connection from %s: %s", peer, why)
            return
        self._refusals_unlogged += 1
        if self._summary is None:
            delay = max(0.0, self._refusals_since + LOG_EVERY - now)
            self._summary = asyncio.get_running_loop().call_later(delay, self._summarize)

    def _summarize(self) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if self._refusals_unlogged:
            log.warning(
                "replication: %s: refused %d more connection(s) (the first from each address for each reason is "
                "logged, once per %g s); %d refused since start",
                self.where, self._refusals_unlogged, LOG_EVERY, self.refused,
            )
        self._refusals_unlogged = 0
        self._refusals_logged.clear()
        self._refusals_since = float("-inf")

    def abort_all(self) -> None:
        """End every connection still in its handshake (a stop, a promotion): its task is
        cancelled, and closes it (aborting the socket under a TLS handshake would leave asyncio's
        stream without a transport)."""
        for _, task in list(self._waiting.values()):
            if task is not None:
                task.cancel()
        self._summarize()
