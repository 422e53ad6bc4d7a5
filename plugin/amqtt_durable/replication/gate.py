"""How many connections a replication listener holds before they pass the handshake.

Anyone who reaches a replication address can open connections and say nothing; each would be
held until ``handshake_timeout``. Unbounded, a few thousand of them take the broker's file
descriptors (MQTT clients then go unanswered) and fill the log. A gate admits at most
``PER_HOST`` such connections from one address and ``TOTAL`` in all; one past either is closed
at once. With ``replication.allow_from``, a connection from an address outside it is closed at
once before that, without taking a place, so a flood from outside (from as many addresses as an
IPv6 /64 holds) cannot fill them. Each of those and a refused handshake (a wrong or missing
secret, a silent peer, a failed TLS handshake) are counted, and logged at once the first time
that address has that event (the same reason) in an interval of ``LOG_EVERY`` seconds: at most
``LOG_PER_HOST`` lines an address (a reason may hold the peer's own text, so one address varying
what it sends cannot take every line) and ``LOG_HOSTS`` of each kind; the rest are summed up in
one WARNING when the interval ends. A node stopping or being promoted aborts the connections
still waiting (from Python 3.12 ``Server.wait_closed`` waits for every connection, so one silent
peer would hold a promotion up)."""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections import Counter
from collections.abc import Sequence
from typing import Any

from .config import Network

log = logging.getLogger("amqtt_durable.replication")

PER_HOST = 8
TOTAL = 64
LOG_EVERY = 10.0
LOG_HOSTS = 16
LOG_PER_HOST = 4
REFUSED = "refused by the handshake"
TURNED_AWAY = "closed at once"
NOT_ALLOWED = "not in allow_from"


def allowed(host: str, networks: Sequence[Network]) -> bool:
    """Whether the peer address ``host`` is in one of ``networks`` (a scoped peer, fe80::1%eth0,
    by its address alone)."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        return False
    return any(address in network for network in networks)


class HandshakeGate:
    def __init__(
        self, where: str, per_host: int = PER_HOST, total: int = TOTAL, allow_from: Sequence[Network] | None = None
    ) -> None:
        self.where = where
        self.per_host = per_host
        self.total = total
        self.allow_from = allow_from
        """The networks a peer must be in (``replication.allow_from``); None: any address."""
        self.not_allowed = 0
        """Connections closed at once because their address is not in ``allow_from`` (since start)."""
        self.turned_away = 0
        """Connections closed at once because too many were waiting (since start)."""
        self.refused = 0
        """Connections refused by the handshake (since start): wrong or missing secret, silent peer, TLS."""
        self._waiting: dict[asyncio.StreamWriter, tuple[str, asyncio.Task[Any] | None]] = {}
        """Each connection in its handshake: its address, and the task serving it."""
        self._hosts: Counter[str] = Counter()
        self._interval_start = float("-inf")
        self._logged: set[tuple[str, str]] = set()
        """The (address, reason) pairs logged in this interval (at most ``LOG_HOSTS``)."""
        self._lines_of: Counter[str] = Counter()
        """Lines logged in this interval per address (at most ``LOG_PER_HOST``)."""
        self._lines_of_kind: Counter[str] = Counter()
        """Lines logged in this interval per kind (at most ``LOG_HOSTS`` each: a flood of connections
        closed at once does not take the lines that name refused handshakes)."""
        self._unlogged: Counter[str] = Counter()
        """Per kind, the events of this interval left to its summary."""
        self._summary: asyncio.TimerHandle | None = None

    def admit(self, writer: asyncio.StreamWriter, host: str) -> bool:
        """Hold ``writer`` until ``done``; False (and the connection aborted) when ``host`` is not
        allowed or the gate is full."""
        if self.allow_from is not None and not allowed(host, self.allow_from):
            writer.transport.abort()
            self.not_allowed += 1
            if self._may_log(host, NOT_ALLOWED, NOT_ALLOWED):
                log.warning(
                    "replication: %s: refused a connection from %s at once: not in replication.allow_from",
                    self.where,
                    host,
                )
            return False
        if len(self._waiting) >= self.total or self._hosts[host] >= self.per_host:
            writer.transport.abort()
            self.turned_away += 1
            if self._may_log(host, TURNED_AWAY, TURNED_AWAY):
                log.warning(
                    "replication: %s: closed a connection from %s at once: %d from that address (at most %d) or "
                    "%d in all (at most %d) had not finished the handshake",
                    self.where,
                    host,
                    self._hosts[host],
                    self.per_host,
                    len(self._waiting),
                    self.total,
                )
            return False
        self._waiting[writer] = (host, asyncio.current_task())
        self._hosts[host] += 1
        return True

    @property
    def refusals(self) -> int:
        """Every connection refused since start: by ``allow_from``, closed at once, by the handshake."""
        return self.not_allowed + self.turned_away + self.refused

    def done(self, writer: asyncio.StreamWriter) -> None:
        host, _ = self._waiting.pop(writer, (None, None))
        if host is not None:
            self._hosts[host] -= 1
            if not self._hosts[host]:
                del self._hosts[host]

    def refusal(self, writer: asyncio.StreamWriter, peer: str, why: str, logged: bool = True) -> bool:
        """The admitted connection ``writer`` (from ``peer``) was refused by the handshake; with
        ``logged`` False only counted (the caller's own limit left its line out). Whether it was logged."""
        self.refused += 1
        host, _ = self._waiting.get(writer, (peer.rpartition(":")[0].strip("[]"), None))
        if logged and self._may_log(host, REFUSED, why):
            log.warning("replication: refused a connection from %s: %s", peer, why)
            return True
        return False

    def _may_log(self, host: str, kind: str, reason: str) -> bool:
        """Whether this event is logged now: the first with this reason from ``host`` in this
        interval (within ``LOG_PER_HOST`` lines for the address and ``LOG_HOSTS`` of its kind);
        otherwise it is left to the interval's summary, counted by ``kind``."""
        now = time.monotonic()
        if now - self._interval_start >= LOG_EVERY:
            self._summarize()
            self._interval_start = now
        fresh = (host, reason) not in self._logged
        if fresh and self._lines_of_kind[kind] < LOG_HOSTS and self._lines_of[host] < LOG_PER_HOST:
            self._logged.add((host, reason))
            self._lines_of[host] += 1
            self._lines_of_kind[kind] += 1
            return True
        self._unlogged[kind] += 1
        if self._summary is None:
            delay = max(0.0, self._interval_start + LOG_EVERY - now)
            self._summary = asyncio.get_running_loop().call_later(delay, self._summarize)
        return False

    def _summarize(self) -> None:
        if self._summary is not None:
            self._summary.cancel()
            self._summary = None
        if self._unlogged:
            log.warning(
                "replication: %s: %d more connection(s) refused by the handshake, %d more closed at once and "
                "%d more not in allow_from (the first for each reason from each address is logged, once per %g s); "
                "since start %d refused, %d closed at once, %d not in allow_from",
                self.where,
                self._unlogged[REFUSED],
                self._unlogged[TURNED_AWAY],
                self._unlogged[NOT_ALLOWED],
                LOG_EVERY,
                self.refused,
                self.turned_away,
                self.not_allowed,
            )
        self._unlogged.clear()
        self._logged.clear()
        self._lines_of.clear()
        self._lines_of_kind.clear()
        self._interval_start = float("-inf")

    def abort_all(self) -> None:
        """End every connection still in its handshake (a stop, a promotion): its task is
        cancelled, and closes it (aborting the socket under a TLS handshake would leave asyncio's
        stream without a transport). The interval's summary is logged now."""
        for _, task in list(self._waiting.values()):
            if task is not None:
                task.cancel()
        self._summarize()
