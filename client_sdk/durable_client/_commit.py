"""CPL-2 group commit: acknowledgements held until the marks they confirm are on disk.

With ``persistence="disk"`` the mark of each processed event is written to the OS at once
(``DiskState.record``: a SIGKILL of the process cannot lose it) but made durable with one
``fsync`` per group of events. The acknowledgement of an event (PUBACK for a queued event,
``stream_ack`` for a stream event) tells the broker to forget it, so it may only go once its
mark survives a power loss: ``AckGate`` holds it until the ``sync()`` that covers the mark, then
sends the held acknowledgements in arrival order. An acknowledgement is sent at once only when
nothing is held and nothing is unsynced (a redelivered event whose mark is durable already).

A group ends, and is synced and acknowledged, at the first of:

* ``fsync_batch`` acknowledgements held;
* the connection going quiet: a pass of the network loop found no further message to read (the
  broker waits for acknowledgements, its in-flight window being full, or nothing is published).
  This keeps a window-limited sender (a stream with ``window=1``, a session's in-flight window)
  from stalling until the timer;
* ``fsync_delay_ms`` after the first held acknowledgement, while messages keep coming.

So the fsync cost is shared by up to ``fsync_batch`` events, and the latency it adds to an
acknowledgement is at most ``fsync_delay_ms`` plus one fsync.

A lost connection drops the held acknowledgements: their packet ids belong to that connection.
The broker sends the events again on the next one; their marks (written, in memory and in the
OS) recognise them as duplicates, and those acknowledgements pass the gate like any other.

An fsync error: ``FallbackState.sync()`` switches the client to CPL-1 (memory) with every mark
written so far, then the held acknowledgements are sent. No acknowledgement is ever sent on the
strength of the failed fsync as a disk guarantee; from the fallback on, acknowledgements follow
CPL-1's rule (the mark is in memory before the ack), which the held ones meet. Holding them
longer would gain nothing: the broker's in-flight window would stall, and a reconnect would only
bring the same events back for the same in-memory marks to drop. Sending them at once also keeps
the window in which a restart could process them a second time (CPL-1 after a restart) as short
as possible.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable
from typing import Final

from ._options import check_seconds, check_whole
from .events import PersistenceLevel
from .persistence import SessionState, open_state

DEFAULT_FSYNC_BATCH: Final = 64
"""Acknowledgements held before a group is synced; below the broker's default in-flight window (100)
so that the broker gets acknowledgements while the rest of its window is still arriving."""
DEFAULT_FSYNC_DELAY_MS: Final = 5.0
"""Longest an acknowledgement waits for its group's fsync while messages keep arriving."""
MAX_FSYNC_BATCH: Final = 65_535
MAX_FSYNC_DELAY_MS: Final = 1000.0

HeldAck = tuple[int, int, tuple[str, int] | None]
"""(packet id, QoS, stream ack (topic, id) or None): what one acknowledgement sends."""


def check_group_options(fsync_batch: object, fsync_delay_ms: object) -> tuple[int, float]:
    """The client options ``fsync_batch`` and ``fsync_delay_ms``, validated; ValueError names the bad one."""
    batch = check_whole("fsync_batch", fsync_batch, 1, MAX_FSYNC_BATCH, "a whole number of events")
    delay_ms = check_seconds(
        "fsync_delay_ms", fsync_delay_ms, low=0, inclusive=True, high=MAX_FSYNC_DELAY_MS, unit="milliseconds"
    )
    return batch, delay_ms


def open_group_committed(
    level: PersistenceLevel,
    client_id: str,
    state_dir: str | os.PathLike[str] | None,
    on_fallback: Callable[[OSError], None],
    send: Callable[[int, int, tuple[str, int] | None], None],
    *,
    fsync_batch: object,
    fsync_delay_ms: object,
) -> tuple[SessionState, AckGate | None]:
    """The client's state (``open_state``) and, for CPL-2, its gate; the options are checked first."""
    batch, delay_ms = check_group_options(fsync_batch, fsync_delay_ms)
    state = open_state(level, client_id, state_dir, on_fallback, group_commit=True)
    gate = AckGate(state, send, batch=batch, delay_ms=delay_ms) if state.level == "disk" else None
    return state, gate


class AckGate:
    """Holds acknowledgements until their marks are synced (module docstring). Thread-safe.

    ``send(mid, qos, stream_ack)`` sends one acknowledgement; it is called in arrival order.
    """

    def __init__(
        self,
        state: SessionState,
        send: Callable[[int, int, tuple[str, int] | None], None],
        *,
        batch: int = DEFAULT_FSYNC_BATCH,
        delay_ms: float = DEFAULT_FSYNC_DELAY_MS,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._state = state
        self._send = send
        self._batch = batch
        self._delay = delay_ms / 1000.0
        self._clock = clock
        self._lock = threading.RLock()  # an on_persistence_fallback callback may call close(), which flushes
        self._held: list[HeldAck] = []
        self._since = 0.0  # when the oldest held acknowledgement was held
        self.groups = 0
        """fsyncs done by the gate (for statistics: events per fsync)."""

    @property
    def pending(self) -> bool:
        """Acknowledgements held, or records written and not synced."""
        return bool(self._held) or self._state.unsynced > 0

    @property
    def held(self) -> int:
        return len(self._held)

    @property
    def batch(self) -> int:
        """``fsync_batch``."""
        return self._batch

    @property
    def delay_ms(self) -> float:
        """``fsync_delay_ms``."""
        return self._delay * 1000.0

    def submit(self, mid: int, qos: int, stream_ack: tuple[str, int] | None) -> None:
        """Send now when every mark is durable; otherwise hold (and sync the group once it is full)."""
        with self._lock:
            if not self._held and not self._state.unsynced:
                self._send(mid, qos, stream_ack)
                return
            if not self._held:
                self._since = self._clock()
            self._held.append((mid, qos, stream_ack))
            if len(self._held) < self._batch:
                return
            self._flush()

    def due(self, *, idle: bool) -> bool:
        """Should the group end now? ``idle``: the last network pass read no message."""
        if idle:
            return self.pending
        return bool(self._held) and self._clock() - self._since >= self._delay

    def flush(self) -> None:
        """Sync, then send every held acknowledgement in order."""
        with self._lock:
            self._flush()

    def _flush(self) -> None:
        held, self._held = self._held, []
        if self._state.unsynced:
            self._state.sync()  # FallbackState: an fsync error falls back to memory (module docstring)
            self.groups += 1
        for mid, qos, stream_ack in held:
            self._send(mid, qos, stream_ack)

    def drop(self) -> int:
        """The connection was lost: forget the held acknowledgements; returns how many."""
        with self._lock:
            count = len(self._held)
            self._held = []
            return count
