"""Stream logs: the storage of stateless resume (seed 17.4.2), one per broker.

A stateless client has no session the broker could keep positions in. Instead it presents
"the last id I processed" per topic on every connect, so the broker keeps events by
(topic, id), independent of who reads them. ``StreamLogs`` keeps a log per concrete topic
that a configured stream filter matches, ids 1, 2, 3, ...; appends go into the engine's
group-commit batch, so a publish and its log event become durable together. The key layout
(``b"e"`` events, ``b"L"`` id marks, the migrated ``b"l"`` keys) is store.py's, described
there once; the per-connection sender is stream_sender.py's.
"""

from __future__ import annotations

import logging
import math
import struct
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .config import StreamConfig
from .errors import DamagedRecordError
from .store import GroupCommitter, decoded, leveldb_detail
from .topics import filters_overlap, matches, topic_problem

if TYPE_CHECKING:
    from .stream_sender import StreamSender

log = logging.getLogger("amqtt_durable.streams")  # one logger for the logs and their senders

EVENT_PREFIX = b"e"
MARK_PREFIX = b"L"
LEGACY_EVENT_PREFIX = b"l"
MIGRATE_BATCH_BYTES = 4 * 1024 * 1024
"""Bytes of legacy events one migration write batch moves (memory bound; each batch is atomic)."""
TRIM_BUDGET = 10_000
"""Deletes one ``trim_expired`` call adds to a batch at most (a backlog is trimmed over several calls)."""
COUNT_TRIM_PER_APPEND = 64
"""Deletes one append adds at most (one, a log at its max_count): the excess of a lowered max_count
is the retention pass's as the broker starts or becomes the primary (engine.start_timers); an
append meets more only before that pass reached its log, or after it failed."""
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


def _decode_mark(raw: bytes) -> int:
    return int(_U64.unpack(raw)[0])


def _published_at(raw: bytes) -> float:
    return float(_EVENT_HEAD.unpack_from(raw)[0])


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
            topic = key[1:].decode("utf-8")  # migrate_legacy_events removed marks whose topic is not UTF-8
            marks[topic] = decoded(_decode_mark, value, f"the id mark of stream {topic!r}")
        with self._db.iterator(prefix=EVENT_PREFIX) as events:
            for key, value in events:
                topic_bytes = event_topic(key)
                if topic_bytes is None:
                    log.warning("stream log: skipping malformed key %r", key)
                    events.seek(key + b"\x00")
                    continue
                try:
                    topic = topic_bytes.decode("utf-8")
                except UnicodeDecodeError as exc:
                    raise DamagedRecordError(f"a stream event key whose topic {topic_bytes!r} is not UTF-8") from exc
                first = event_id_of(key)
                last = first
                prefix = key[: -_U64.size]
                for last_key in self._db.iterator(prefix=prefix, reverse=True, include_value=False):
                    last = event_id_of(last_key)
                    break
                published_at = decoded(_published_at, value, f"event {first} of stream {topic!r}")
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

    def first_kept(self, topic: str) -> int:
        """The first id retention keeps, counting appends whose batch is not written yet: no id
        below it is ever read again (1 for a topic without a log)."""
        entry = self._logs.get(topic)
        return 1 if entry is None else entry.first

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
        None when no stream has an age limit (count retention is then the start's one pass, see
        engine.start_timers, and each append's)."""
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
