"""Limits at the door: durable sessions in the store (``max_durable_sessions``), open
connections per remote address (``max_connections_per_address``) and the keep-alive a CONNECT
may ask for (``max_keepalive``).

Plain counting and policy, no amqtt, no store: the engine asks ``SessionLimit`` for a place for a
durable CONNECT as it is read, held until its CONNACK (the sessions counted are the engine's,
loaded from the store), and the
glue asks ``AddressConnections`` whether a new connection may open and ``KeepAliveLimit`` whether
a CONNECT's keep-alive is allowed. Each refusal gets a WARNING at most once per
``drop_log_interval`` for all clients together (an attacker cycling client ids or ports would
otherwise write a line per attempt); the first two are counted (the $SYS counters
``sessions/refused`` and ``connections/refused``).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Callable, Collection
from dataclasses import dataclass


class LogBudget:
    """At most one log line per ``interval`` seconds (``drop_log_interval``) for one kind of refusal
    (one connection's control requests, or every client's refusals at the door); the lines left out
    are counted and the next line says how many. A client sending refused requests as fast as it
    can wrote one line (some 200 bytes) per request of 30."""

    def __init__(self, interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self._clock = clock
        self._last = -math.inf
        self.left_out = 0

    def take(self) -> int | None:
        """None: leave this line out (counted); else log it, with this many left out since the last."""
        if not self.due():
            self.left_out += 1
            return None
        self._last = self._clock()
        left_out, self.left_out = self.left_out, 0
        return left_out

    def due(self) -> bool:
        """Whether a line may be logged now (``take`` would not leave it out)."""
        return self._clock() - self._last >= self.interval


class NameBudgets:
    """A ``LogBudget`` per name (one line per ``interval`` seconds for each backup name a primary
    refuses), for the ``size`` names most recently taken: the least recently taken is forgotten
    first, so names a stranger makes up cannot grow it (a forgotten name is logged as a first one)."""

    def __init__(self, interval: float, size: int, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval = interval
        self.size = size
        self._clock = clock
        self._budgets: dict[str, LogBudget] = {}
        """Per name, its budget: the most recently taken last."""

    def of(self, name: str) -> LogBudget:
        """``name``'s budget, now the most recently taken."""
        budget = self._budgets.pop(name, None) or LogBudget(self.interval, self._clock)
        self._budgets[name] = budget
        if len(self._budgets) > self.size:
            del self._budgets[next(iter(self._budgets))]
        return budget


def _left_out(count: int) -> str:
    return f" ({count} more such refusal(s) since the last line)" if count else ""


@dataclass
class Reservation:
    """A place among ``max_durable_sessions`` held for one connection's durable CONNECT of
    ``client_id``, from the moment it is read until its CONNACK (``SessionLimit.reserve``)."""

    client_id: str
    held: bool = True


class SessionLimit:
    """``max_durable_sessions`` (0: no limit): a CONNECT with clean_session=false that would create
    a new durable session is refused while the store holds that many; an existing session's
    CONNECT and clean sessions are never concerned.

    The decision is taken as the CONNECT is read, before amqtt touches anything (a take-over of a
    live connection of the client id comes before the CONNACK): an admitted durable CONNECT holds
    a ``Reservation`` until its CONNACK turns it into its session (``use``) or its connection ends
    (``release``). The places taken are the sessions plus the client ids with a reservation and
    no session (two connections of one client id hold one place), so the limit holds exactly
    however many CONNECTs are between their read and their CONNACK."""

    def __init__(self, limit: int, log_interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.refused = 0
        """CONNECTs refused since the broker started (carried over a new term as primary)."""
        self._budget = LogBudget(log_interval, clock)
        self._reserved: Counter[str] = Counter()
        """Client id -> reservations held for it."""

    def has_place(self, client_id: str, sessions: Collection[str]) -> bool:
        """May ``client_id`` have a durable session while the store holds ``sessions``: it has one,
        a place is held for it, or the places taken are fewer than the limit."""
        if not self.limit or client_id in sessions or client_id in self._reserved:
            return True
        if len(sessions) + len(self._reserved) < self.limit:
            return True  # without counting the reserved client ids that have a session meanwhile
        return len(sessions) + sum(1 for held in self._reserved if held not in sessions) < self.limit

    def reserve(self, client_id: str, sessions: Collection[str]) -> Reservation | None:
        """A durable CONNECT of ``client_id`` was read: its reservation (give it to ``use`` or
        ``release``), or None when there is no place for it (``refuse``)."""
        if not self.has_place(client_id, sessions):
            return None
        self._reserved[client_id] += 1
        return Reservation(client_id)

    def use(self, reservation: Reservation | None) -> bool:
        """The CONNACK of a durable CONNECT is due: its reservation ends (the caller creates the
        session, if any, before anything else can take a place); whether it held one."""
        if reservation is None or not reservation.held:
            return False
        self.release(reservation)
        return True

    def release(self, reservation: Reservation) -> None:
        """The reservation ends (its connection ended, or ``use``); a second call does nothing."""
        if not reservation.held:
            return
        reservation.held = False
        self._reserved[reservation.client_id] -= 1
        if not self._reserved[reservation.client_id]:
            del self._reserved[reservation.client_id]

    @property
    def reservations(self) -> int:
        return self._reserved.total()

    def refuse(self, client_id: str) -> str | None:
        """Count one refused CONNECT; the WARNING to log, or None (rate-limited: counted, left out)."""
        self.refused += 1
        left_out = self._budget.take()
        if left_out is None:
            return None
        return (
            f"CONNECT of client id {client_id!r} refused (CONNACK 3, server unavailable): the store holds "
            f"max_durable_sessions ({self.limit}) durable sessions; a new one is accepted once a session "
            f"ends (expiry, a clean CONNECT, end_session){_left_out(left_out)}"
        )


class AddressConnections:
    """``max_connections_per_address`` (0: no limit): the connections open from each remote IP
    address; one past the limit is refused (the caller closes it). An address is forgotten
    when its last connection closes, so the table holds only addresses with open connections."""

    def __init__(self, limit: int, log_interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.limit = limit
        self.open_by_address: dict[str, int] = {}
        self.refused = 0
        """Connections refused since the broker started."""
        self._budget = LogBudget(log_interval, clock)

    def open(self, address: str) -> bool:
        """A connection from ``address`` was accepted: True (counted; call ``close`` at its end), or
        False past the limit (not counted, ``refusal`` says what to log)."""
        held = self.open_by_address.get(address, 0)
        if self.limit and held >= self.limit:
            self.refused += 1
            return False
        self.open_by_address[address] = held + 1
        return True

    def close(self, address: str) -> None:
        held = self.open_by_address.get(address, 0) - 1
        if held > 0:
            self.open_by_address[address] = held
        else:
            self.open_by_address.pop(address, None)

    def refusal(self, address: str, *, websocket: bool = False) -> str | None:
        """The WARNING of a refusal ``open`` just counted (of a TCP connection as it is accepted, or
        of a websocket upgrade request), or None (rate-limited: left out)."""
        left_out = self._budget.take()
        if left_out is None:
            return None
        what = (
            f"answering the websocket upgrade request of a new connection from {address} with HTTP 503"
            if websocket
            else f"closing a new connection from {address} before reading anything"
        )
        return f"{what}: it has max_connections_per_address ({self.limit}) connections open{_left_out(left_out)}"


class KeepAliveLimit:
    """``max_keepalive`` (0: no limit), as Mosquitto 2 applies it to MQTT 3.1.1 clients, which have
    no way to be told another keep-alive: a CONNECT with keep-alive 0 (none: a silent client is
    never disconnected) or above the limit is refused (CONNACK 2, identifier rejected)."""

    def __init__(self, maximum: int, log_interval: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.maximum = maximum
        self._budget = LogBudget(log_interval, clock)

    def admits(self, keepalive: int) -> bool:
        return not self.maximum or 0 < keepalive <= self.maximum

    def refusal(self, client_id: str, keepalive: int) -> str | None:
        """The WARNING of a refused CONNECT, or None (rate-limited: left out)."""
        left_out = self._budget.take()
        if left_out is None:
            return None
        return (
            f"CONNECT of client id {client_id!r} refused (CONNACK 2, identifier rejected): its keep-alive is "
            f"{keepalive} s, and max_keepalive ({self.maximum}) allows 1 to {self.maximum} s{_left_out(left_out)}"
        )
