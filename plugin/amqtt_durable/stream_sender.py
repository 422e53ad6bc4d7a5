"""The stream sender: the seed's temporary client agent (17.4.2), one per connection.

A cursor per topic, at most ``window`` unacknowledged events in flight, a resend (backed off) after the
ack timeout; reading from the logs of stream_log.py, as the delivery pump reads queues.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import plyvel

from durable_protocol import (
    FLAG_QOS_SHIFT,
    FLAG_REDELIVERED,
    MAX_STREAM_WINDOW,
    STREAM_TOPIC_PREFIX,
    ProtocolError,
    encode_frame,
    filter_is_valid,
    shown_topic,
)

from .delivery import READ_RETRY_FIRST, READ_RETRY_MAX
from .stream_log import MAX_MQTT_TOPIC_BYTES, LogEvent, StreamLogs
from .topics import matches
from .wire import encode_publish

_AHEAD_SHOWN = 5
"""Topics named in the WARNING of positions past the log end (thousands may be presented)."""
RESEND_WAIT_MAX = 60.0
"""Longest wait before a resend to a client that acknowledges nothing (unless stream_ack_timeout is longer)."""

log = logging.getLogger("amqtt_durable.streams")  # one logger for the logs and their senders


class StreamTransport(Protocol):
    """What a sender needs of a connection (the glue's delivery Transport has it)."""

    def write(self, data: bytes) -> None: ...

    @property
    def closed(self) -> bool: ...


MayReceive = Callable[[str], Awaitable[bool]]


class _Cursor:
    """One topic of one connection: the next id to send and the ids in flight."""

    __slots__ = (
        "acked", "closed", "held", "inflight", "next_id", "read_failures", "resends", "timer", "topic", "topic_bytes",
        "window",
    )  # fmt: skip

    def __init__(self, topic: str, window: int, start: int) -> None:
        self.topic = topic
        self.topic_bytes = (STREAM_TOPIC_PREFIX + topic).encode("utf-8")
        self.window = window
        self.next_id = start
        self.acked = start - 1
        """No id at or below it is in flight (the client acknowledged up to it)."""
        self.inflight: dict[int, float] = {}
        """Sent, unacknowledged id -> resend deadline (loop time), in deadline order."""
        self.timer: asyncio.TimerHandle | None = None
        """The resend timer; after a failed read, the retry of that read."""
        self.closed = False
        self.held = False
        """Set by ``ack(refill=False)``: no new event is sent (whatever appends come) until
        ``refill``; resends of ids in flight still go."""
        self.read_failures = 0
        self.resends = 0
        """Resends since the client last acknowledged progress: each doubles the wait for the next."""


class StreamSender:
    """The per-connection agent of the stateless model: sends, waits for acks, resends.

    Nothing is persisted: when the connection ends, ``stop()`` forgets every position and
    the client presents them again in its next ``subscribe``.
    """

    def __init__(
        self,
        logs: StreamLogs,
        transport: StreamTransport,
        *,
        default_window: int,
        ack_timeout: float,
        may_receive: MayReceive | None = None,
        max_entries: int = 0,
        client_id: str = "",
        log_interval: float = 0.0,
    ) -> None:
        self._logs = logs
        self._max_entries = max_entries
        """``max_stream_entries_per_client``: open filters plus positions kept for topics without a
        log (0: no limit)."""
        self._client_id = client_id
        self._log_interval = log_interval
        self._warned = -math.inf
        self._transport = transport
        self._default_window = default_window
        self._ack_timeout = ack_timeout
        self._may_receive = may_receive
        self._filters: dict[str, int] = {}
        """Subscribed filter -> window for the cursors it opens."""
        self._cursors: dict[str, _Cursor] = {}
        self._refused: set[str] = set()
        self._checking: set[str] = set()
        """Topics whose may_receive answer is awaited (never asked twice at once)."""
        self._pending_after: dict[str, int] = {}
        """Positions presented for topics that had no log yet: used when the topic appears."""
        self._dirty: set[str] = set()
        self._flush: asyncio.Handle | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._stopped = False

    @property
    def cursors(self) -> dict[str, tuple[int, int]]:
        """topic -> (next id to send, ids in flight): for tests and metrics."""
        return {t: (c.next_id, len(c.inflight)) for t, c in self._cursors.items()}

    async def subscribe(
        self, topic_filter: str, after: dict[str, int] | None = None, window: int | None = None
    ) -> dict[str, Any]:
        """Open the logs matching the filter; returns the reply's ``topics`` and ``gaps``.

        Events follow from the next loop pass, so a reply written right after this returns
        goes out before them. A topic already open through another subscription keeps its
        cursor (one cursor per topic: no duplicates), and its position in ``after`` is ignored.
        """
        if self._stopped:
            return {"topics": {}, "gaps": {}, "ahead": {}}
        window = self._checked_window(topic_filter, window)
        after = after or {}
        self._check_entries(topic_filter, after)
        open_before = set(self._cursors)  # their positions stand; ``after`` cannot put them ahead
        self._filters[topic_filter] = window
        self._logs.register(self)
        for topic, last_seen in after.items():
            if matches(topic, topic_filter) and self._logs.bounds(topic) is None:
                self._pending_after[topic] = last_seen
        gaps = await self._open_matching(topic_filter, window, after)
        topics: dict[str, dict[str, int]] = {}
        ahead: dict[str, int] = {}
        for topic in self._cursors:
            bounds = self._logs.bounds(topic)
            if bounds is not None and matches(topic, topic_filter):
                topics[topic] = {"first": bounds[0], "last": bounds[1]}
                if topic not in open_before and after.get(topic, 0) > bounds[1]:
                    ahead[topic] = bounds[1]
        if ahead:
            # Ids are never reused by one store: a position past the end means another store.
            shown = ", ".join(f"{shown_topic(topic)}: {last}" for topic, last in list(ahead.items())[:_AHEAD_SHOWN])
            log.warning(
                "stream subscribe %s: %d positions past the log end (a wiped store?): %s%s",
                shown_topic(topic_filter), len(ahead), shown, ", ..." if len(ahead) > _AHEAD_SHOWN else "",
            )
        return {"topics": topics, "gaps": gaps, "ahead": ahead}

    def _check_entries(self, topic_filter: str, after: dict[str, int]) -> None:
        """ProtocolError, before anything changes, when the subscription would make the connection
        hold more than ``max_entries`` filters and kept positions: both stay until it ends, and a
        client could otherwise add some 1,800 positions per 64 kB request, without end."""
        if not self._max_entries:
            return
        new_positions = sum(
            1
            for topic in after
            if topic not in self._pending_after and matches(topic, topic_filter) and self._logs.bounds(topic) is None
        )
        held = len(self._filters) + len(self._pending_after)
        wanted = held + (topic_filter not in self._filters) + new_positions
        if wanted <= self._max_entries:
            return
        now = time.monotonic()
        if now - self._warned >= self._log_interval:  # at most once per drop_log_interval
            self._warned = now
            log.warning(
                "%s: stream_subscribe %r refused: the connection would hold %d stream filters and positions of "
                "topics without a log, max_stream_entries_per_client is %d",
                self._client_id,
                topic_filter,
                wanted,
                self._max_entries,
            )
        raise ProtocolError(
            "malformed",
            f"this subscription would make the connection hold {wanted} stream filters and positions of "
            f"topics without a log; the limit is {self._max_entries} (max_stream_entries_per_client)",
        )

    def _checked_window(self, topic_filter: str, window: int | None) -> int:
        """The subscription's window; ProtocolError for a filter no stream covers or a bad window."""
        if not filter_is_valid(topic_filter):
            raise ProtocolError("bad_filter", f"{topic_filter!r} is not a valid topic filter")
        if not self._logs.covers_filter(topic_filter):
            raise ProtocolError("unknown_stream", f"{topic_filter!r} matches no configured stream")
        if window is None:
            return self._default_window
        if not 1 <= window <= MAX_STREAM_WINDOW:
            raise ProtocolError("malformed", f"'window' must be a whole number from 1 to {MAX_STREAM_WINDOW}")
        return window

    async def _open_matching(self, topic_filter: str, window: int, after: dict[str, int]) -> dict[str, list[int]]:
        """Open a cursor on every log of the filter not open yet that the user may read; returns
        the gaps (ids trimmed past a presented position) by topic."""
        candidates = [t for t in self._logs.topics(topic_filter) if t not in self._cursors and t not in self._checking]
        self._checking.update(candidates)
        try:
            allowed = await self._admit_all(candidates)
        finally:
            self._checking.difference_update(candidates)
        gaps: dict[str, list[int]] = {}
        for topic, ok in zip(candidates, allowed, strict=True):
            if self._stopped or topic in self._cursors or not self._covered(topic):
                continue
            if not ok:
                self._refused.add(topic)
                continue
            self._refused.discard(topic)
            gap = self._open(topic, window, after.get(topic))
            if gap is not None:
                gaps[topic] = list(gap)
        return gaps

    def unsubscribe(self, topic_filter: str) -> bool:
        """Close the filter's cursors (those no other subscription covers); False if not subscribed."""
        if self._filters.pop(topic_filter, None) is None:
            return False
        for topic in [t for t in self._cursors if not self._covered(t)]:
            self._close(topic)
        for topic in [t for t in self._pending_after if not self._covered(t)]:
            del self._pending_after[topic]
        self._refused = {t for t in self._refused if self._covered(t)}
        if not self._filters:
            self._logs.unregister(self)
        return True

    def is_open(self, topic: str) -> bool:
        """Whether ``topic`` has a cursor on this connection (an ack on it is not refused)."""
        return topic in self._cursors

    def refill(self, topic: str) -> None:
        """Send the next events of ``topic`` up to its window again (held since an ``ack`` without refill)."""
        cursor = self._cursors.get(topic)
        if cursor is not None:
            cursor.held = False
            self._pump(cursor)

    def ack(self, topic: str, event_id: int, refill: bool = True) -> None:
        """Cumulative: every in-flight id <= ``event_id`` is done; then the next go out. With
        ``refill`` False the topic is held instead: no new event of it is sent, not even on an
        append, until ``refill(topic)`` (or an ack with refill); resends of ids still in flight
        go on, at most a window per backed-off ack timeout."""
        cursor = self._cursors.get(topic)
        if cursor is None:
            raise ProtocolError("unknown_stream", f"no open stream on {topic!r}")
        upto = min(event_id, cursor.next_id - 1)
        if upto > cursor.acked:
            if upto - cursor.acked <= len(cursor.inflight):
                for done in range(cursor.acked + 1, upto + 1):
                    cursor.inflight.pop(done, None)
            else:  # the cursor skipped trimmed ids: walk the (at most window) ids in flight instead
                for done in [i for i in cursor.inflight if i <= upto]:
                    del cursor.inflight[done]
            cursor.acked = upto
            if cursor.resends:
                cursor.resends = 0
                self._hasten(cursor)
            if not cursor.inflight and cursor.timer is not None:
                cursor.timer.cancel()
                cursor.timer = None
        cursor.held = not refill
        if refill:
            self._pump(cursor)

    def stop(self) -> None:
        """The connection ended: cancel timers and checks, stop hearing about appends."""
        self._stopped = True
        for topic in list(self._cursors):
            self._close(topic)
        if self._flush is not None:
            self._flush.cancel()
            self._flush = None
        for task in self._tasks:
            task.cancel()
        self._filters.clear()
        self._logs.unregister(self)

    def notify(self, topic: str) -> None:
        """Called by StreamLogs once an append to ``topic`` is durable."""
        if self._stopped:
            return
        if topic in self._cursors:
            self._mark_dirty(topic)
            return
        if topic in self._refused or topic in self._checking:
            return
        window = self._window_for(topic)
        if window is None:
            return
        if self._may_receive is None:
            self._open_new(topic, window, True)
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # a commit flushed while closing: nobody to send to
            return
        self._checking.add(topic)
        task = loop.create_task(self._check_and_open(topic))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # --------------------------------------------------------------- internals
    def _covered(self, topic: str) -> bool:
        return any(matches(topic, f) for f in self._filters)

    def _window_for(self, topic: str) -> int | None:
        for topic_filter, window in self._filters.items():
            if matches(topic, topic_filter):
                return window
        return None

    async def _admit(self, topic: str) -> bool:
        if self._may_receive is None:
            return True
        try:
            return bool(await self._may_receive(topic))
        except Exception:
            log.exception("stream %s: the topic check failed; the topic is not opened", shown_topic(topic))
            return False

    async def _admit_all(self, topics: list[str]) -> list[bool]:
        if self._may_receive is None or not topics:
            return [True] * len(topics)
        return list(await asyncio.gather(*(self._admit(t) for t in topics)))

    async def _check_and_open(self, topic: str) -> None:
        try:
            allowed = await self._admit(topic)
        finally:
            self._checking.discard(topic)
        window = self._window_for(topic)
        if self._stopped or topic in self._cursors or window is None:
            return
        self._open_new(topic, window, allowed)

    def _open_new(self, topic: str, window: int, allowed: bool) -> None:
        """A topic that appeared after the subscribe: from its first event, or the presented position."""
        after_id = self._pending_after.pop(topic, None)  # its log exists now: no longer a kept position
        if not allowed:
            self._refused.add(topic)
            return
        gap = self._open(topic, window, after_id)
        if gap is not None:
            log.warning(
                "stream %s: ids %d to %d were trimmed before this connection could read them", shown_topic(topic), *gap
            )

    def _open(self, topic: str, window: int, after_id: int | None) -> tuple[int, int] | None:
        """Open a cursor after ``after_id`` (or at the first retained event); returns the gap."""
        if self._logs.bounds(topic) is None:
            return None
        # Not bounds()' first, which stops at the written ids: a topic's first batch (read in one
        # pass, sync: false) is heard of one event at a time, and what it trimmed is gone all the same.
        first = self._logs.first_kept(topic)
        start = first if after_id is None else max(after_id + 1, first)
        cursor = _Cursor(topic, window, start)
        if len(cursor.topic_bytes) > MAX_MQTT_TOPIC_BYTES:
            log.warning(
                "stream %s: topic too long for the %s prefix (%d bytes with it, more than %d); not opened",
                shown_topic(topic), STREAM_TOPIC_PREFIX, len(cursor.topic_bytes), MAX_MQTT_TOPIC_BYTES,
            )
            self._refused.add(topic)
            return None
        self._cursors[topic] = cursor
        self._logs.watch(topic, self)
        self._mark_dirty(topic)
        if after_id is not None and after_id + 1 < first:
            return after_id + 1, first - 1
        return None

    def _close(self, topic: str) -> None:
        cursor = self._cursors.pop(topic)
        cursor.closed = True
        if cursor.timer is not None:
            cursor.timer.cancel()
            cursor.timer = None
        self._dirty.discard(topic)
        self._logs.unwatch(topic, self)

    def _mark_dirty(self, topic: str) -> None:
        """Send on the next loop pass: appends of one commit batch become one read per cursor."""
        self._dirty.add(topic)
        if self._flush is None:
            # Without a loop (a commit flushed while closing) nothing is scheduled: sent on the next ack.
            with contextlib.suppress(RuntimeError):
                self._flush = asyncio.get_running_loop().call_soon(self._flush_dirty)

    def _flush_dirty(self) -> None:
        self._flush = None
        dirty, self._dirty = self._dirty, set()
        for topic in dirty:
            cursor = self._cursors.get(topic)
            if cursor is not None:
                self._pump(cursor)

    def _skip_trimmed(self, cursor: _Cursor, first: int) -> None:
        """Retention removed ids the cursor had not sent yet: move to the first retained one.

        Trimmed ids already in flight keep their window slot until acknowledged or until
        their resend finds them gone, so retention never makes the sender outrun the client.
        """
        if cursor.next_id < first:
            log.warning(
                "stream %s: ids %d to %d were trimmed by retention before they were sent; resuming at id %d",
                shown_topic(cursor.topic),
                cursor.next_id,
                first - 1,
                first,
            )
            cursor.next_id = first

    def _pump(self, cursor: _Cursor) -> None:
        """Fill the window: one read of up to ``room`` events (none while the cursor is held)."""
        if self._stopped or cursor.closed or cursor.held or self._transport.closed:
            return
        bounds = self._logs.bounds(cursor.topic)
        if bounds is None:
            return
        first, last = bounds
        room = cursor.window - len(cursor.inflight)
        if room <= 0:
            return
        self._skip_trimmed(cursor, first)
        if cursor.next_id > last:
            return
        events = self._read(cursor, cursor.next_id - 1, room)
        if events is not None:
            self._send(cursor, events, 0)

    def _read(self, cursor: _Cursor, after_id: int, limit: int) -> list[LogEvent] | None:
        """The log's events after ``after_id``; None when the read failed: it is reported and
        ``_expire`` (resends, then new events) runs again after a growing pause; nothing is skipped."""
        try:
            events = self._logs.read(cursor.topic, after_id, limit)
        except (plyvel.Error, RuntimeError, struct.error, ValueError) as exc:
            cursor.read_failures += 1
            delay = min(READ_RETRY_MAX, READ_RETRY_FIRST * 2 ** min(cursor.read_failures - 1, 10))
            self._logs.read_failed(cursor.topic, after_id, exc, delay)
            if cursor.timer is not None:
                cursor.timer.cancel()
            cursor.timer = asyncio.get_running_loop().call_later(delay, self._expire, cursor)
            return None
        cursor.read_failures = 0
        return events

    def _send(self, cursor: _Cursor, events: list[LogEvent], flags: int) -> None:
        loop = asyncio.get_running_loop()
        # A client that does not acknowledge is not flooded: the wait doubles with each resend.
        deadline = loop.time() + min(self._ack_timeout * 2**cursor.resends, max(self._ack_timeout, RESEND_WAIT_MAX))
        packets = []
        for event in events:
            frame = encode_frame(flags | event.qos << FLAG_QOS_SHIFT, 0, event.id, event.published_at)
            packets.append(encode_publish(cursor.topic_bytes, frame + event.payload, 0, 0, dup=False, retain=False))
            cursor.inflight.pop(event.id, None)  # a resend moves to the end: the order is by deadline
            cursor.inflight[event.id] = deadline
            cursor.next_id = max(cursor.next_id, event.id + 1)
        if packets:
            self._transport.write(b"".join(packets))
        self._arm(cursor, loop)

    def _arm(self, cursor: _Cursor, loop: asyncio.AbstractEventLoop) -> None:
        """One timer per cursor, due when the oldest send in flight is."""
        if cursor.inflight and cursor.timer is None:
            head = next(iter(cursor.inflight.values()))
            cursor.timer = loop.call_later(max(head - loop.time(), 0.0), self._expire, cursor)

    def _hasten(self, cursor: _Cursor) -> None:
        """Progress after backed-off resends: what is still in flight waits no longer than a first send
        does (``ack_timeout`` from now), not the longer wait its last resend was given. (Without resends
        every deadline is within ``ack_timeout`` already.) The ids stay in deadline order."""
        loop = asyncio.get_running_loop()
        soonest = loop.time() + self._ack_timeout
        for event_id, deadline in cursor.inflight.items():
            if deadline > soonest:
                cursor.inflight[event_id] = soonest
        if cursor.read_failures:  # a failed read's retry keeps its pause (operations.md); it resends these then
            return
        if cursor.timer is not None:
            cursor.timer.cancel()
            cursor.timer = None
        self._arm(cursor, loop)

    def _expire(self, cursor: _Cursor) -> None:
        """Resend what waited for its ack (flag redelivered): ``ack_timeout`` at first, twice as long
        after each resend without progress, at most RESEND_WAIT_MAX; retries are unlimited."""
        cursor.timer = None
        if self._stopped or cursor.closed or self._transport.closed:
            return  # a closed connection waits for stop(), not for timers
        loop = asyncio.get_running_loop()
        now = loop.time()
        due = []
        for event_id, deadline in cursor.inflight.items():
            if deadline > now:
                break
            due.append(event_id)
        if due:
            low, high = min(due), max(due)
            wanted = set(due)
            read = self._read(cursor, low - 1, high - low + 1)
            if read is None:
                return
            events = [e for e in read if e.id in wanted]
            for missing in wanted.difference(e.id for e in events):
                cursor.inflight.pop(missing, None)  # trimmed meanwhile: nothing left to resend
            cursor.resends += 1
            self._send(cursor, events, FLAG_REDELIVERED)
        self._arm(cursor, loop)
        self._pump(cursor)
