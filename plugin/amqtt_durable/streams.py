"""Stream logs and their per-connection senders: stateless resume (seed 17.4.2).

A stateless client has no session the broker could keep positions in. Instead it presents
"the last id I processed" per topic on every connect, so the broker keeps events by
(topic, id), independent of who reads them, and forgets readers when they disconnect.

* ``StreamLogs`` is the storage, one per broker: a log per concrete topic that a
  configured stream filter matches, ids 1, 2, 3, ... Appends go into the engine's
  group-commit batch, so a publish and its log event become durable together.
* ``StreamSender`` is the seed's temporary client agent, one per connection: a cursor per
  topic, at most ``window`` unacknowledged events, a resend after the ack timeout.

Key layout (additions to layout version 1, see store.py)::

    b"e" + tlen:u16 + topic(utf-8) + id:u64  -> published_at:f64 qos:u8 payload
    b"L" + topic(utf-8)                     -> last_id:u64     ids ever assigned (high-water mark)

The topic's length comes first, so ``b"e" + tlen + topic`` is a prefix of exactly one topic's
events whatever the topic holds, and the events of one topic are contiguous in key order.
Stores written before this layout kept events under ``b"l" + topic + b"\\x00" + id``, which
relied on topics never holding U+0000 (a NUL topic could forge another topic's event);
``migrate_legacy_events`` moves them on open.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import struct
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Protocol

import plyvel

from durable_protocol import (
    FLAG_QOS_SHIFT,
    FLAG_REDELIVERED,
    MAX_STREAM_WINDOW,
    STREAM_TOPIC_PREFIX,
    ProtocolError,
    encode_frame,
)

from .config import StreamConfig
from .delivery import READ_RETRY_FIRST, READ_RETRY_MAX
from .store import GroupCommitter, leveldb_detail
from .topics import filter_is_valid, filters_overlap, matches, topic_problem
from .wire import encode_publish

log = logging.getLogger(__name__)

EVENT_PREFIX = b"e"
MARK_PREFIX = b"L"
LEGACY_EVENT_PREFIX = b"l"
MIGRATE_BATCH_BYTES = 4 * 1024 * 1024
"""Bytes of legacy events one migration write batch moves (memory bound; each batch is atomic)."""
TRIM_BUDGET = 10_000
"""Deletes one ``trim_expired`` call adds to a batch at most (a backlog is trimmed over several calls)."""
COUNT_TRIM_PER_APPEND = 64
"""Deletes one append adds at most: after max_count was lowered, the excess goes over many appends."""
MAX_MQTT_TOPIC_BYTES = 65_535

_U16 = struct.Struct(">H")
_U64 = struct.Struct(">Q")
_EVENT_HEAD = struct.Struct(">dB")
_KEY_HEAD = 1 + _U16.size


def log_prefix(topic: str) -> bytes:
    raw = topic.encode("utf-8")
    return EVENT_PREFIX + _U16.pack(len(raw)) + raw


def event_key(topic: str, event_id: int) -> bytes:
    return log_prefix(topic) + _U64.pack(event_id)


def mark_key(topic: str) -> bytes:
    return MARK_PREFIX + topic.encode("utf-8")


def event_topic(key: bytes) -> bytes | None:
    """The topic bytes of a ``b"e"`` event key; None when the lengths do not add up."""
    if len(key) < _KEY_HEAD + _U64.size:
        return None
    end = _KEY_HEAD + _U16.unpack_from(key, 1)[0]
    return key[_KEY_HEAD:end] if len(key) == end + _U64.size else None


def event_id_of(key: bytes) -> int:
    return int(_U64.unpack_from(key, len(key) - _U64.size)[0])


def _legacy_topic(key: bytes) -> str | None:
    """The topic of a first-layout key (``b"l" + topic + NUL + id``); None if no client could
    have published to it (an event forged through a NUL topic)."""
    if len(key) < 2 + _U64.size or key[-9] != 0:
        return None
    try:
        topic = key[1:-9].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return topic if topic_problem(topic) is None else None


def migrate_legacy_events(db: Any) -> tuple[int, int]:
    """Move first-layout stream events to ``b"e"`` keys; returns (moved, dropped).

    Each write batch deletes the old keys it re-writes, so every event is under exactly one
    key at any time: a crash mid-way loses nothing and the next open moves the rest. Events
    and marks of topics no client may publish to (U+0000 in them, as an injected event had)
    are dropped with a warning: they were never a topic's own events.
    """
    moved = dropped = 0
    while True:
        chunk: list[tuple[bytes, bytes]] = []
        size = 0
        # Checksums verified: a damaged block must stop the move, not be copied into sound keys.
        with db.iterator(prefix=LEGACY_EVENT_PREFIX, verify_checksums=True) as legacy:
            for key, value in legacy:
                chunk.append((key, value))
                size += len(key) + len(value)
                if size >= MIGRATE_BATCH_BYTES:
                    break
        if not chunk:
            break
        with db.write_batch(sync=True) as batch:
            for key, value in chunk:
                batch.delete(key)
                topic = _legacy_topic(key)
                if topic is None:
                    dropped += 1
                else:
                    batch.put(event_key(topic, event_id_of(key)), value)
                    moved += 1
    marks = db.iterator(prefix=MARK_PREFIX, include_value=False, verify_checksums=True)
    bad_marks = [key for key in marks if _mark_topic(key) is None]
    if bad_marks:
        with db.write_batch(sync=True) as batch:
            for key in bad_marks:
                batch.delete(key)
    if moved or dropped or bad_marks:
        log.warning(
            "stream logs: %d events moved to the current key layout; %d events and %d id marks of topics "
            "no client may publish to (U+0000) dropped",
            moved,
            dropped,
            len(bad_marks),
        )
    return moved, dropped


def _mark_topic(key: bytes) -> str | None:
    try:
        topic = key[1:].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return topic if topic_problem(topic) is None else None


def encode_event(published_at: float, qos: int, payload: bytes) -> bytes:
    return _EVENT_HEAD.pack(published_at, qos) + payload


@dataclass(frozen=True, slots=True)
class LogEvent:
    """One stored stream event."""

    topic: str
    id: int
    qos: int
    published_at: float
    payload: bytes


def decode_event(topic: str, event_id: int, raw: bytes) -> LogEvent:
    published_at, qos = _EVENT_HEAD.unpack_from(raw)
    return LogEvent(topic, event_id, qos, published_at, raw[_EVENT_HEAD.size :])


class _Log:
    """In-memory bounds of one topic's log (the events themselves stay on disk)."""

    __slots__ = ("config", "durable", "first", "last", "oldest_at")

    def __init__(self, config: StreamConfig | None, first: int, last: int, oldest_at: float | None) -> None:
        self.config = config
        """Retention; None for a log left from a stream no longer configured (kept, read-only)."""
        self.first = first
        """First retained id, counting deletes still in the uncommitted batch; last + 1 when empty."""
        self.last = last
        """Last id assigned, counting appends still in the uncommitted batch."""
        self.durable = last
        """Last id written: senders never read past it, so nothing goes out before it is stored."""
        self.oldest_at = oldest_at
        """A lower bound of the first event's publish time (None: unknown), so trim_expired
        skips young logs without reading them."""


class StreamLogs:
    """Every stream log of the store: appends, reads, retention and the senders to wake.

    Writes go into the GroupCommitter's current batch and are never committed here: the
    engine commits each publish anyway, and the event must be durable with it.
    """

    def __init__(self, db: Any, committer: GroupCommitter, streams: list[StreamConfig], store: str = "STORE") -> None:
        self._db = db
        self._committer = committer
        self.streams = list(streams)
        self._store = store
        self.read_errors = 0
        """Failed reads of a log (a damaged store); each one is logged and retried, like a queue's."""
        self._logs: dict[str, _Log] = {}
        self._senders: set[StreamSender] = set()
        """Senders with a subscription: told about topics that become visible."""
        self._watchers: dict[str, set[StreamSender]] = {}
        """Senders with an open cursor per topic: told about every durable append."""

    def use_db(self, db: Any) -> None:
        """The store was reopened (after a failed write): read through the new handle."""
        self._db = db

    # ------------------------------------------------------------------ storage
    def load(self) -> None:
        """Find each log's first and last id: two seeks per topic, never a whole log."""
        migrate_legacy_events(self._db)
        self._logs.clear()
        marks: dict[str, int] = {}
        for key, value in self._db.iterator(prefix=MARK_PREFIX):
            marks[key[1:].decode("utf-8")] = int(_U64.unpack(value)[0])
        with self._db.iterator(prefix=EVENT_PREFIX) as events:
            for key, value in events:
                topic_bytes = event_topic(key)
                if topic_bytes is None:
                    log.warning("stream log: skipping malformed key %r", key)
                    events.seek(key + b"\x00")
                    continue
                topic = topic_bytes.decode("utf-8")
                first = event_id_of(key)
                last = first
                prefix = key[: -_U64.size]
                for last_key in self._db.iterator(prefix=prefix, reverse=True, include_value=False):
                    last = event_id_of(last_key)
                    break
                published_at = float(_EVENT_HEAD.unpack_from(value)[0])
                mark = marks.pop(topic, 0)
                self._logs[topic] = _Log(self.logged(topic), first, max(last, mark), published_at)
                # Every key of this topic is the prefix and 8 bytes: nine 0xff bytes are past them.
                events.seek(prefix + b"\xff" * (_U64.size + 1))
        for topic, mark in marks.items():  # retention removed every event: only the mark is left
            self._logs[topic] = _Log(self.logged(topic), mark + 1, mark, None)

    def logged(self, topic: str) -> StreamConfig | None:
        """The stream configuration that covers ``topic`` (the first matching one), if any."""
        for stream in self.streams:
            if matches(topic, stream.filter):
                return stream
        return None

    def covers_filter(self, topic_filter: str) -> bool:
        """True when some configured stream can log a topic that ``topic_filter`` matches."""
        return any(filters_overlap(topic_filter, stream.filter) for stream in self.streams)

    def append(self, topic: str, payload: bytes, qos: int, published_at: float) -> int | None:
        """Put the event into the current batch and return its id; None when no stream covers it.

        The caller commits the batch, then calls ``appended(topic, id)``. The high-water mark
        goes into the same batch, so an id is never handed out twice, even once retention has
        removed every event, or after a crash (an id whose batch was lost was never visible).
        """
        entry = self._logs.get(topic)
        config = entry.config if entry is not None else self.logged(topic)
        if config is None:
            return None
        if entry is None:
            entry = self._logs[topic] = _Log(config, 1, 0, None)
        if entry.first > entry.last:
            entry.oldest_at = published_at
        elif entry.oldest_at is not None:  # None stays "unknown": trim_expired reads the log
            entry.oldest_at = min(entry.oldest_at, published_at)
        event_id = entry.last + 1
        entry.last = event_id
        self._committer.put(event_key(topic, event_id), encode_event(published_at, qos, payload))
        self._committer.put(mark_key(topic), _U64.pack(event_id))
        self._trim_count(topic, entry, COUNT_TRIM_PER_APPEND)
        return event_id

    def _trim_count(self, topic: str, entry: _Log, budget: int) -> int:
        if entry.config is None:
            return 0
        excess = min(entry.last - entry.first + 1 - entry.config.max_count, budget)
        for _ in range(max(excess, 0)):
            self._committer.delete(event_key(topic, entry.first))
            entry.first += 1
        return max(excess, 0)

    def appended(self, topic: str, event_id: int) -> None:
        """The batch holding ``event_id`` is written: wake the senders that want the topic."""
        entry = self._logs.get(topic)
        if entry is None or event_id <= entry.durable:
            return
        newly_visible = entry.durable == 0
        entry.durable = min(event_id, entry.last)
        targets = self._senders if newly_visible else self._watchers.get(topic, ())
        for sender in list(targets):
            sender.notify(topic)

    def read(self, topic: str, after_id: int, limit: int) -> list[LogEvent]:
        """Up to ``limit`` stored events with id > ``after_id``, in id order (one iterator)."""
        entry = self._logs.get(topic)
        if entry is None or limit <= 0:
            return []
        start = max(after_id + 1, entry.first)
        if start > entry.durable:
            return []
        out: list[LogEvent] = []
        stop = event_key(topic, entry.durable + 1)
        with self._db.iterator(start=event_key(topic, start), stop=stop, verify_checksums=True) as events:
            for key, value in events:
                out.append(decode_event(topic, event_id_of(key), value))
                if len(out) >= limit:
                    break
        return out

    def read_failed(self, topic: str, after_id: int, exc: BaseException, delay: float) -> None:
        """Say why a sender could not read ``topic`` and when it tries again (counted, if damage)."""
        what = f"stream {topic}: reading its log after id {after_id} failed: {leveldb_detail(exc)}"
        if self._db.closed:  # not damage: a retry after a failed write could not reopen the store yet
            log.warning("%s. Sending tries again in %.0f s", what, delay)
            return
        self.read_errors += 1
        log.error(
            "%s. Sending waits and tries again in %.0f s; the store is damaged: stop the broker, run "
            "'amqtt-durable repair %s' (keeps every readable event), then start the broker again",
            what,
            delay,
            self._store,
        )

    def bounds(self, topic: str) -> tuple[int, int] | None:
        """(first, last) readable ids; first == last + 1 for a log retention emptied; None if no log."""
        entry = self._logs.get(topic)
        if entry is None or entry.durable == 0:
            return None
        return min(entry.first, entry.durable + 1), entry.durable

    def topics(self, topic_filter: str) -> dict[str, tuple[int, int]]:
        """Logged topics matching the filter, each with ``bounds``."""
        if "+" not in topic_filter and "#" not in topic_filter:
            bounds = self.bounds(topic_filter)
            return {} if bounds is None else {topic_filter: bounds}
        out: dict[str, tuple[int, int]] = {}
        for topic, entry in self._logs.items():
            if entry.durable and matches(topic, topic_filter):
                out[topic] = (min(entry.first, entry.durable + 1), entry.durable)
        return out

    # ---------------------------------------------------------------- retention
    def trim_expired(self, now: float) -> int:
        """Delete events older than their stream's max_age (and any excess over max_count)
        into the current batch; at most ``TRIM_BUDGET`` deletes, returned so the caller
        commits (``committer.flush_soon()``) and calls again soon when the budget ran out."""
        budget = TRIM_BUDGET
        deleted = 0
        for topic, entry in self._logs.items():
            if budget <= 0:
                break
            config = entry.config
            if config is None or entry.first > entry.last:
                continue
            if entry.last - entry.first + 1 > config.max_count:
                done = self._trim_count(topic, entry, budget)
                deleted += done
                budget -= done
            if config.max_age <= 0 or budget <= 0:
                continue
            cutoff = now - config.max_age
            if entry.oldest_at is not None and entry.oldest_at >= cutoff:
                continue
            done = self._trim_age(topic, entry, cutoff, budget)
            deleted += done
            budget -= done
        return deleted

    def _trim_age(self, topic: str, entry: _Log, cutoff: float, budget: int) -> int:
        deleted = 0
        start, stop = event_key(topic, entry.first), event_key(topic, entry.durable + 1)
        with self._db.iterator(start=start, stop=stop) as events:
            for key, value in events:
                published_at = float(_EVENT_HEAD.unpack_from(value)[0])
                if published_at >= cutoff:
                    entry.oldest_at = published_at
                    return deleted
                if deleted >= budget:
                    return deleted
                self._committer.delete(key)
                entry.first = event_id_of(key) + 1
                deleted += 1
        entry.oldest_at = None  # every written event is gone; what is left is still in the batch
        return deleted

    def trim_interval(self) -> float | None:
        """How often to call ``trim_expired``: a quarter of the shortest max_age, 0.5 s to 60 s;
        None when no stream has an age limit (count retention happens on append)."""
        ages = [s.max_age for s in self.streams if s.max_age > 0 and math.isfinite(s.max_age)]
        if not ages:
            return None
        return min(max(min(ages) / 4, 0.5), 60.0)

    # ------------------------------------------------------------------ senders
    def register(self, sender: StreamSender) -> None:
        self._senders.add(sender)

    def unregister(self, sender: StreamSender) -> None:
        """The sender has no subscription left (it unwatches its own topics)."""
        self._senders.discard(sender)

    def watch(self, topic: str, sender: StreamSender) -> None:
        self._watchers.setdefault(topic, set()).add(sender)

    def unwatch(self, topic: str, sender: StreamSender) -> None:
        senders = self._watchers.get(topic)
        if senders is not None:
            senders.discard(sender)
            if not senders:
                del self._watchers[topic]


class StreamTransport(Protocol):
    """What a sender needs of a connection (the glue's delivery Transport has it)."""

    def write(self, data: bytes) -> None: ...

    @property
    def closed(self) -> bool: ...


MayReceive = Callable[[str], Awaitable[bool]]


class _Cursor:
    """One topic of one connection: the next id to send and the ids in flight."""

    __slots__ = ("acked", "closed", "inflight", "next_id", "read_failures", "timer", "topic", "topic_bytes", "window")

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
        self.read_failures = 0


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
    ) -> None:
        self._logs = logs
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
        if not filter_is_valid(topic_filter):
            raise ProtocolError("bad_filter", f"{topic_filter!r} is not a valid topic filter")
        if not self._logs.covers_filter(topic_filter):
            raise ProtocolError("unknown_stream", f"{topic_filter!r} matches no configured stream")
        if window is None:
            window = self._default_window
        elif not 1 <= window <= MAX_STREAM_WINDOW:
            raise ProtocolError("malformed", f"'window' must be a whole number from 1 to {MAX_STREAM_WINDOW}")
        after = after or {}
        self._filters[topic_filter] = window
        self._logs.register(self)
        for topic, last_seen in after.items():
            if matches(topic, topic_filter) and self._logs.bounds(topic) is None:
                self._pending_after[topic] = last_seen
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
        topics: dict[str, dict[str, int]] = {}
        ahead: dict[str, int] = {}
        for topic in self._cursors:
            bounds = self._logs.bounds(topic)
            if bounds is not None and matches(topic, topic_filter):
                topics[topic] = {"first": bounds[0], "last": bounds[1]}
                if after.get(topic, 0) > bounds[1]:
                    ahead[topic] = bounds[1]
        if ahead:
            # Ids are never reused by one store: a position past the end means another store.
            log.warning("stream subscribe %s: positions past the log end (a wiped store?): %s", topic_filter, ahead)
        return {"topics": topics, "gaps": gaps, "ahead": ahead}

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

    def ack(self, topic: str, event_id: int) -> None:
        """Cumulative: every in-flight id <= ``event_id`` is done; then the next go out."""
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
            if not cursor.inflight and cursor.timer is not None:
                cursor.timer.cancel()
                cursor.timer = None
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
            log.exception("stream %s: the topic check failed; the topic is not opened", topic)
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
        if not allowed:
            self._refused.add(topic)
            return
        gap = self._open(topic, window, self._pending_after.pop(topic, None))
        if gap is not None:
            log.warning("stream %s: ids %d to %d were trimmed before this connection could read them", topic, *gap)

    def _open(self, topic: str, window: int, after_id: int | None) -> tuple[int, int] | None:
        """Open a cursor after ``after_id`` (or at the first retained event); returns the gap."""
        bounds = self._logs.bounds(topic)
        if bounds is None:
            return None
        first = bounds[0]
        start = first if after_id is None else max(after_id + 1, first)
        cursor = _Cursor(topic, window, start)
        if len(cursor.topic_bytes) > MAX_MQTT_TOPIC_BYTES:
            log.warning("stream %s: topic too long for the %s prefix; not opened", topic, STREAM_TOPIC_PREFIX)
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
                "stream %s: %d events were trimmed by retention before they were sent; resuming at id %d",
                cursor.topic,
                first - cursor.next_id,
                first,
            )
            cursor.next_id = first

    def _pump(self, cursor: _Cursor) -> None:
        """Fill the window: one read of up to ``room`` events."""
        if self._stopped or cursor.closed or self._transport.closed:
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
        deadline = loop.time() + self._ack_timeout
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

    def _expire(self, cursor: _Cursor) -> None:
        """Resend what waited ``ack_timeout`` for its ack (flag redelivered); retries are unlimited."""
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
            self._send(cursor, events, FLAG_REDELIVERED)
        self._arm(cursor, loop)
        self._pump(cursor)
