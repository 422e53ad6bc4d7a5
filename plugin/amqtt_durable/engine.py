"""The durable-session engine: sessions, routing, queues and expiry over the LevelDB store.

Data flow: ``route_publish`` appends a message to every matching session's queue in the
current group commit and returns the commit's future (the glue sends PUBACK when it
resolves); once durable, each connected session's pump is offered the entry. A
disconnected session runs the same path with its pump absent. Nothing here imports amqtt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import struct
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal, TypeVar

import plyvel

from durable_protocol import LiveSubscription

from .config import DurableConfig
from .delivery import Pump, ReadAccess, Transport
from .errors import (
    DamagedRecordError,
    NotSessionOwnerError,
    StoreCorruptedError,
    StoreReadError,
    StoreUnavailableError,
)
from .expiry import ExpiryTracker
from .queue_policy import Admission, QueueLimits
from .retained import RetainedMessages
from .store import (
    FLAG_RELEASED,
    FLAG_RETAIN,
    FLAG_SHARED,
    RETRY_MAX,
    SID_MARK_KEY,
    STORE_ID_KEY,
    Body,
    Entry,
    GroupCommitter,
    SessionRecord,
    body_key,
    check_writable,
    decode_refs,
    decode_totals,
    decode_u64,
    decoded,
    discard_probe,
    encode_refs,
    encode_totals,
    encode_u64,
    entry_key,
    iter_entries,
    iter_pubrel_due,
    iter_sessions,
    last_msg_id,
    last_seq,
    last_sid,
    leveldb_detail,
    open_store,
    pubrel_key,
    pubrel_prefix,
    queue_prefix,
    read_error,
    refs_key,
    sent_mark_key,
    session_key,
    sid_of_entry_key,
    totals_key,
)
from .streams import TRIM_BUDGET, StreamLogs
from .topics import SubscriptionIndex

log = logging.getLogger("amqtt_durable")
CONNECT_GRACE = 30.0
"""Seconds between CONNACK and the start of delivery during which expiry leaves a session alone."""
DELETE_CHUNK = 10_000
_T = TypeVar("_T")


@dataclass
class ExpiredSession:
    """What an expiry removed, for the WARNING log and the $SYS event."""

    client_id: str
    messages_dropped: int
    disconnected_at: float | None


@dataclass
class StoreHealth:
    """The store started or stopped failing to write, for the $SYS health topic."""

    status: Literal["failing", "ok"]
    """failing (writes fail: nothing that needs one is acknowledged) or ok (they succeed again)."""
    since: float
    """Unix time the status began."""
    error: str | None = None
    """The write error (failing only)."""
    failed_for: float | None = None
    """Seconds the store failed (ok only)."""


def droppable(entry: Entry) -> bool:
    """Overflow may drop anything but a QoS 2 message whose PUBREL is due: the client holds its
    packet id until PUBCOMP, so dropping it would wedge that id."""
    return not entry.flags & FLAG_RELEASED


class PendingRemovals:
    """Queue entries removed in memory whose delete is not written yet, as (sid, seq).

    Reads of the store (the pump's fill, drop-oldest, session deletion) skip them; a set is
    sealed when a write starts and forgotten once that write has landed.
    """

    def __init__(self) -> None:
        self._open: set[tuple[int, int]] = set()
        self._writing: set[tuple[int, int]] = set()

    def add(self, key: tuple[int, int]) -> None:
        self._open.add(key)

    def __contains__(self, key: object) -> bool:
        return key in self._open or key in self._writing

    def seal(self) -> None:
        self._writing |= self._open
        self._open = set()

    def written(self) -> None:
        self._writing = set()


class DurableSession:
    """In-memory state of one durable session; the store holds the rest."""

    def __init__(self, engine: DurableEngine, record: SessionRecord) -> None:
        self.engine = engine
        self.record = record
        self.client_id = record.client_id
        self.sid = record.sid
        self.head_seq = 1
        self.next_seq = 1
        self.committed_tail = 0
        self.depth = 0
        self.bytes = 0
        self.dropped = 0
        self.uncommitted: dict[int, Entry] = {}
        self.connecting_until = 0.0
        self.ready_for: Transport | None = None
        """The connection whose ready came before its pump existed (see DurableEngine.ready)."""
        self.deleted = False
        self.sent_mark = 0
        self.sent_max = 0
        self.replay_upto = 0
        config = engine.config
        self.limits = QueueLimits(
            config.max_depth,
            config.max_depth_disconnected,
            config.overflow,
            config.max_bytes,
            config.max_bytes_disconnected,
        )
        self.transport: Transport | None = None
        self.pump: Pump | None = None
        self.newest: Transport | None = None
        """The connection whose CONNECT was accepted last (None: not told): the only one that may attach."""
        self._last_drop_log = 0.0
        self._drops_since_log = 0
        self.pubrel_due: set[int] = set()
        """Packet ids of QoS 2 PUBLISHes taken from this session whose PUBREL has not come (b"x" keys)."""

    @property
    def connected(self) -> bool:
        return self.transport is not None

    def superseded(self, transport: Transport) -> bool:
        """Was a CONNECT of this client id accepted after the one of ``transport``?"""
        return self.newest is not None and self.newest is not transport

    def read_entries(self, start: int, tail: int, limit: int) -> tuple[list[tuple[Entry, Body]], int | None]:
        """Up to ``limit`` stored entries from ``start`` to ``tail`` with their bodies, and the last
        sequence looked at when the limit cut the read short (None: everything up to ``tail`` read).

        Entries removed in memory but not yet written are skipped: the store must not bring them back.
        A read that fails part way returns what came before the damage (cut short there); one that
        fails at once raises StoreReadError: the pump reports it and tries again later.
        """
        db = self.engine.db
        if db.closed:  # a retry after a failed write closed it and could not open it again (yet)
            raise StoreReadError(self.client_id, start - 1, "the store is closed until a write retry reopens it")
        removing = self.engine.removing
        out: list[tuple[Entry, Body]] = []
        looked = 0
        last_seq_looked: int | None = None
        try:
            for entry in iter_entries(db, self.sid, start, limit):
                if entry.seq > tail:
                    return out, None
                looked += 1
                if (self.sid, entry.seq) not in removing:
                    raw = db.get(body_key(entry.msg_id), verify_checksums=True)
                    if raw is None:
                        log.error(
                            "session %s: queue entry %d has no message body; removing it", self.client_id, entry.seq
                        )
                        self.remove_entry(entry)
                    else:
                        out.append((entry, Body.decode(raw)))
                last_seq_looked = entry.seq
        except (plyvel.Error, ValueError, struct.error) as exc:
            if last_seq_looked is None:
                raise StoreReadError(self.client_id, start - 1, leveldb_detail(exc)) from exc
            return out, last_seq_looked
        return out, (last_seq_looked if looked >= limit else None)

    async def advance_sent_mark(self, mark: int) -> None:
        """Persist 'entries up to ``mark`` may have been sent' before sending them (DUP after a crash)."""
        if self.deleted:
            return
        self.sent_mark = mark
        self.engine.committer.put(sent_mark_key(self.sid), encode_u64(mark))
        # While the store cannot write, sending goes on: the mark is queued ahead of the acks of
        # what is sent next, so no write can land those acks without it (a later message never
        # reuses a sequence a client has seen); a crash before the store recovers loses only the
        # DUP flag on re-sends of what was sent meanwhile.
        with contextlib.suppress(StoreUnavailableError):
            await self.engine.committer.commit(urgent=True, fail_fast=True)

    def mark_released(self, entry: Entry) -> None:
        if self.deleted:
            return
        self.engine.committer.put(entry_key(self.sid, entry.seq), entry.encode())
        self.engine.committer.flush_soon()

    def remove_entry(self, entry: Entry) -> None:
        if self.deleted:
            return  # delete_session removes every entry, exactly once
        committer = self.engine.committer
        committer.delete(entry_key(self.sid, entry.seq))
        self.engine.removing.add((self.sid, entry.seq))
        self.engine.release_body(entry)
        self.depth -= 1
        self.bytes -= entry.size
        self.engine.totals_changed(self)
        self.limits.on_drained(self.depth, self.connected, self.bytes)
        committer.flush_soon()

    def append(self, msg_id: int, qos: int, flags: int, size: int) -> Entry:
        entry = Entry(self.next_seq, msg_id, qos, flags, size)
        self.next_seq += 1
        self.uncommitted[entry.seq] = entry
        committer = self.engine.committer
        committer.put(entry_key(self.sid, entry.seq), entry.encode())
        self.depth += 1
        self.bytes += size
        self.engine.totals_changed(self)
        if self.pump is not None and entry.seq > self.sent_mark:
            # A live entry goes out right after the commit: mark it in the same batch.
            self.sent_mark = entry.seq + self.engine.config.recovery_buffer
            committer.put(sent_mark_key(self.sid), encode_u64(self.sent_mark))
        return entry

    def on_committed(self, entry: Entry, body: Body) -> None:
        self.committed_tail = max(self.committed_tail, entry.seq)
        if self.uncommitted.pop(entry.seq, None) is None:
            return  # dropped by overflow before its commit
        if self.pump is not None:
            self.pump.offer_live(entry, body)

    def admit(self, size: int) -> bool:
        """Apply the queue limits for one new message of ``size`` payload bytes; False when the new
        message is dropped. drop-oldest removes one message, or more while the byte limit still
        leaves no room and the queue has not shrunk by ``size`` bytes yet."""
        decision = self.limits.admit(self.depth, self.bytes, size)
        if decision is Admission.ACCEPT:
            return True
        self._count_drop(self._overflow_cause)
        if decision is Admission.REJECT:
            return False
        start = self.bytes
        while self._drop_oldest():
            if self.limits.room_made(self.bytes, size, start - self.bytes):
                return True
            self._count_drop(self._overflow_cause)
        return False

    def _drop_oldest(self) -> bool:
        """Remove the oldest entry not in flight: buffered, then stored, then still uncommitted."""
        pump = self.pump
        buffered = next((i for i, item in enumerate(pump.buffer) if droppable(item.entry)), None) if pump else None
        if pump is not None and buffered is not None:
            victim = pump.buffer[buffered].entry
            del pump.buffer[buffered]
        else:
            start = pump.next_fill_seq if pump is not None else self.head_seq
            removing = self.engine.removing
            live = (e for e in iter_entries(self.engine.db, self.sid, start) if (self.sid, e.seq) not in removing)
            first = found = next(live, None)
            while found is not None and not droppable(found):
                found = next(live, None)
            if found is not None and found.seq <= self.committed_tail:
                victim = found
                if victim is first:  # nothing still due before it: later scans may start after it
                    if pump is not None:
                        pump.next_fill_seq = victim.seq + 1
                    else:
                        self.head_seq = victim.seq + 1
            elif self.uncommitted:
                victim = self.uncommitted.pop(next(iter(self.uncommitted)))
            else:
                return False
        self.remove_entry(victim)
        return True

    def drop_unreadable(self, entry: Entry) -> None:
        """The pump may not send this entry: the connection's user may not read its topic."""
        self.remove_entry(entry)
        self._count_drop(self._unreadable_cause)

    def _overflow_cause(self) -> str:
        return f"queue full at its limit of {self.limits.describe()} (overflow {self.limits.overflow})"

    def _unreadable_cause(self) -> str:
        return f"its user {self.record.username!r} may not read them under the topic ACL"

    def _count_drop(self, cause: Callable[[], str]) -> None:
        """Count one dropped message, with a WARNING at most once per drop_log_interval."""
        self.dropped += 1
        self.engine.dropped_total += 1
        self.engine.totals_changed(self)
        self._drops_since_log += 1
        now = time.monotonic()
        if now - self._last_drop_log >= self.engine.config.drop_log_interval:
            log.warning(
                "session %s: %s: dropped %d message(s) since the last warning, %d in all",
                self.client_id,
                cause(),
                self._drops_since_log,
                self.dropped,
            )
            self._last_drop_log = now
            self._drops_since_log = 0

    def expiry_seconds(self) -> float:
        override = self.record.expiry
        return self.engine.config.session_expiry if override is None else override

    def live_subscriptions(self) -> tuple[LiveSubscription, ...]:
        non_durable = self.record.non_durable
        return tuple(
            LiveSubscription(topic_filter, qos, topic_filter not in non_durable)
            for topic_filter, qos in sorted(self.record.subscriptions.items())
        )

    def drop_non_durable(self) -> None:
        """The connection ended: its non-durable subscriptions end with it (queued messages stay)."""
        for topic_filter in self.record.non_durable:
            if self.record.subscriptions.pop(topic_filter, None) is not None:
                self.engine.index.remove(self.client_id, topic_filter)
        self.record.non_durable.clear()


class DurableEngine:
    """Owns the store and every durable session of one broker."""

    def __init__(
        self,
        config: DurableConfig,
        on_expired: Callable[[ExpiredSession], None] | None = None,
        on_store_health: Callable[[StoreHealth], None] | None = None,
    ) -> None:
        self.config = config
        self.db: Any = None
        self.committer: GroupCommitter
        self.sessions: dict[str, DurableSession] = {}
        self.index = SubscriptionIndex()
        self.expiry = ExpiryTracker()
        self.on_expired = on_expired
        self.on_store_health = on_store_health
        self._next_msg_id = 1
        self._next_sid = 1
        self._refs: dict[int, int] = {}
        self._dirty: set[DurableSession] = set()
        self.removing = PendingRemovals()
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self.store_id = 0
        """Random, made with the store: stream readers compare it to notice a wiped or replaced store."""
        self.streams: StreamLogs
        self.retained: RetainedMessages
        self.on_retained: Callable[[str, bytes, int], None] | None = None
        """Told of every retained message set or cleared (empty payload), in the order they are stored:
        the glue keeps amqtt's in-memory table in step with the store."""
        self.dropped_total = 0
        self.expired_total = 0
        self.replayed_total = 0
        self.sent_total = 0
        self.enqueued_total = 0
        self.read_errors = 0
        """Failed reads of a queue from the store (a damaged store); each one is logged and retried."""

    # ----------------------------------------------------------------- lifecycle
    def open(self) -> None:
        """Open the store and rebuild sessions from it; reads keys, never whole queues (and the
        retained messages, once, for amqtt's table)."""
        path = self.config.store
        self.db = open_store(path)
        discard_probe(path)
        try:
            self._load()
        except plyvel.Error as exc:
            self.db.close()
            raise read_error(path, exc) from exc
        except DamagedRecordError as exc:
            self.db.close()
            raise StoreCorruptedError(path, str(exc)) from exc
        except (ValueError, KeyError, struct.error) as exc:
            self.db.close()
            raise StoreCorruptedError(path, f"{type(exc).__name__}: {exc}") from exc

    def _load(self) -> None:
        config = self.config
        self.committer = GroupCommitter(
            self.db,
            sync=config.sync,
            batch_size=config.batch_size,
            # Without fsync a commit costs microseconds: waiting for company would only add
            # latency, and writes that arrive in one loop pass already share a batch.
            batch_delay_ms=config.batch_delay_ms if config.sync else 0.0,
            pending_threshold=config.pending_threshold,
        )
        self.committer.before_flush = self._before_flush
        self.committer.after_write = self.removing.written
        self.committer.reopen = self._reopen_store
        self.committer.on_health = self._store_health_changed
        raw_id = self.db.get(STORE_ID_KEY, verify_checksums=True)
        self.store_id = decode_u64(raw_id) if raw_id is not None else secrets.randbits(63)
        if raw_id is None:
            self.committer.put(STORE_ID_KEY, encode_u64(self.store_id))
        self.streams = StreamLogs(self.db, self.committer, config.streams, config.store)
        self.streams.load()
        self.retained = RetainedMessages(self.committer)
        self.retained.load(self.db)
        self._next_msg_id = last_msg_id(self.db) + 1
        # Also past queues and totals a crash left without a record: a sid is never reused.
        sid_mark = self._load_value(decode_u64, SID_MARK_KEY, "the highest session number")
        self._next_sid = max(sid_mark, *(last_sid(self.db, prefix) for prefix in (b"q", b"t", b"w", b"x"))) + 1
        now = time.time()
        for record in iter_sessions(self.db):
            session = DurableSession(self, record)
            what = f"of client id {record.client_id!r}"
            totals = self._load_value(decode_totals, totals_key(record.sid), f"the queue totals {what}")
            session.depth, session.bytes, session.dropped = totals
            first = next(iter_entries(self.db, record.sid, 0, 1), None)
            tail = last_seq(self.db, record.sid)
            sent_mark = self._load_value(decode_u64, sent_mark_key(record.sid), f"the sent mark {what}")
            session.sent_mark = session.sent_max = sent_mark
            # New entries number past the sent mark: a fresh message must never look like a re-send.
            session.committed_tail = max(tail or 0, session.sent_mark)
            session.next_seq = session.committed_tail + 1
            session.head_seq = first.seq if first is not None else session.next_seq
            self.sessions[record.client_id] = session
            self._next_sid = max(self._next_sid, record.sid + 1)
            for topic_filter, qos in record.subscriptions.items():
                self.index.add(record.client_id, topic_filter, qos)
            if record.expires_at is None:
                # It was connected when the broker stopped: its disconnect is now.
                session.drop_non_durable()
                record.disconnected_at = now
                record.expires_at = now + session.expiry_seconds()
                self.committer.put(session_key(record.client_id), record.encode())
            self.expiry.schedule(record.client_id, record.expires_at)
        by_sid = {session.sid: session for session in self.sessions.values()}
        for sid, packet_id in iter_pubrel_due(self.db):
            if sid in by_sid:
                by_sid[sid].pubrel_due.add(packet_id)
        self._drop_orphans(set(by_sid))
        self.committer.flush_now()
        log.info(
            "durable store %s: %d session(s), %d queued message(s), %d retained message(s)",
            config.store,
            len(self.sessions),
            sum(s.depth for s in self.sessions.values()),
            len(self.retained),
        )

    def _load_value(self, decode: Callable[[bytes | None], _T], key: bytes, what: str) -> _T:
        """A fixed-size value read at start-up; one that does not decode is named (repair rebuilds it)."""
        return decoded(decode, self.db.get(key, verify_checksums=True), what)

    def _drop_orphans(self, known: set[int]) -> None:
        """Delete queue entries of sessions whose record is gone: a crash in the middle of deleting
        a session (its record goes first) leaves them; nothing else can reach them."""
        sid = 0
        while True:
            rows = self.db.iterator(start=queue_prefix(sid), stop=b"r", include_value=False, verify_checksums=True)
            key = next(rows, None)
            if key is None:
                break
            sid = sid_of_entry_key(key)
            if sid not in known:
                dropped = self._delete_entries(sid)
                log.warning("store: deleted %d queue entries of a session deleted before a crash", dropped)
            sid += 1
        for prefix in (b"t", b"w", b"x"):  # totals, sent marks, QoS 2 states outlive their queue in such a crash
            for key in self.db.iterator(prefix=prefix, include_value=False, verify_checksums=True):
                if sid_of_entry_key(key) not in known:
                    self.committer.delete(key)

    def _reopen_store(self) -> Any:
        """Before a store write is retried: a fresh handle (see GroupCommitter), opened only once
        the folder takes a probe write, so the store is not left closed and unreadable."""
        check_writable(self.config.store)
        if not self.db.closed:
            self.db.close()
        self.db = open_store(self.config.store, create=False)
        self.streams.use_db(self.db)
        return self.db

    def _store_health_changed(self, failure: BaseException | None, failing_since: float) -> None:
        now = time.time()
        if failure is not None:
            log.warning(
                "store write failed: %s. Until a write succeeds, publishes that must be stored get no "
                "PUBACK/PUBREC (their connections are closed) and durable CONNECTs get CONNACK 3; the "
                "write is retried, at most %.0f s apart. Free space on the store's disk: no restart needed",
                failure,
                RETRY_MAX,
            )
            health = StoreHealth("failing", failing_since, error=str(failure))
        else:
            log.warning("store writes succeed again after %.1f s of failures: serving normally", now - failing_since)
            health = StoreHealth("ok", now, failed_for=round(now - failing_since, 3))
        if self.on_store_health is not None:
            self.on_store_health(health)

    def start_timers(self) -> None:
        self._arm_expiry()
        interval = self.streams.trim_interval()
        if interval is not None:
            self._trim_task = asyncio.get_running_loop().create_task(self._trim_streams(interval))

    async def _trim_streams(self, interval: float) -> None:
        """Age retention of the stream logs; a long backlog of expired events goes in chunks."""
        while True:
            await asyncio.sleep(interval)
            try:
                while self.streams.trim_expired(time.time()) >= TRIM_BUDGET:
                    await self.committer.commit(urgent=True)
                self.committer.flush_soon()
            except Exception:
                log.exception("stream retention failed; it is tried again in %.1f s", interval)

    async def close(self) -> None:
        for session in list(self.sessions.values()):
            if session.pump is not None:
                await session.pump.stop()
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
        if self._trim_task is not None:
            self._trim_task.cancel()
            await asyncio.gather(self._trim_task, return_exceptions=True)
        if self.db is not None and not self.db.closed:
            await self.committer.drain()
            self.db.close()

    # ------------------------------------------------------------------ sessions
    async def connect(
        self,
        client_id: str,
        clean_session: bool,
        username: str | None = None,
        transport: Transport | None = None,
        revoke: Iterable[str] = (),
    ) -> bool:
        """CONNECT arrived (over ``transport``, which becomes the one connection that may attach);
        returns session_present. A clean session wipes any stored one.

        A session belongs to the user that created it: another user's CONNECT raises
        NotSessionOwnerError, unless session_takeover is any-user; then the session passes to that
        user without the subscriptions in ``revoke`` (those the topic ACL refuses the new user).

        Raises StoreUnavailableError while the store cannot write and the CONNECT needs a write (a
        durable one, or a clean one that deletes a durable session): the glue refuses it.
        """
        self.check_owner(client_id, username)
        existing = self.sessions.get(client_id)
        failure = self.committer.failure
        if failure is not None and (existing is not None or not clean_session):
            raise StoreUnavailableError(failure)
        if existing is not None and existing.record.username != username and not clean_session:
            self._pass_to(existing, username, revoke)
        if clean_session:
            if existing is not None:
                await self.delete_session(existing)
            return False
        if existing is not None:
            existing.newest = transport
            # Spared by expiry until attach() cancels the deadline; a connection that dies before
            # that (no attach, no detach) must not leave the session immortal, hence a time limit.
            existing.connecting_until = time.time() + CONNECT_GRACE
            return True
        record = SessionRecord(client_id=client_id, sid=self._next_sid, username=username)
        self._next_sid += 1
        self.sessions[client_id] = session = DurableSession(self, record)
        session.newest = transport
        self.committer.put(session_key(client_id), record.encode())
        self.committer.put(SID_MARK_KEY, encode_u64(record.sid))
        try:
            await self.committer.commit(urgent=True, fail_fast=True)
        except StoreUnavailableError:
            # Refused, but the record is written once the store recovers: a disconnected session
            # from now on, so it expires if the client does not come back.
            self._disconnected(session)
            raise
        return False

    def check_owner(self, client_id: str, username: str | None) -> None:
        """Raise NotSessionOwnerError if, under session_takeover: owner-only, the durable session of
        ``client_id`` belongs to another user (a clean CONNECT would delete it, so it counts too)."""
        session = self.sessions.get(client_id)
        if session is not None and session.record.username != username and self.config.session_takeover == "owner-only":
            raise NotSessionOwnerError(client_id, session.record.username, username)

    def _pass_to(self, session: DurableSession, username: str | None, revoke: Iterable[str]) -> None:
        """session_takeover: any-user: the session becomes ``username``'s, minus the subscriptions it
        may not make; what is queued is checked against its read access when sent (Pump). The
        packet ids of the previous user's QoS 2 publishes whose PUBREL is due are forgotten: the
        new user's packet ids are its own, and one of its publishes must not be taken for a re-send."""
        record = session.record
        revoked = [f for f in revoke if record.subscriptions.pop(f, None) is not None]
        for topic_filter in revoked:
            record.non_durable.discard(topic_filter)
            self.index.remove(session.client_id, topic_filter)
        for packet_id in session.pubrel_due:
            self.committer.delete(pubrel_key(session.sid, packet_id))
        session.pubrel_due.clear()
        log.warning(
            "durable session %s passes from user %r to user %r (session_takeover: any-user); subscriptions "
            "the topic ACL refuses the new user removed: %s. Queued messages it may not read are dropped when due",
            session.client_id,
            record.username,
            username,
            ", ".join(revoked) or "none",
        )
        record.username = username
        self._save_record(session)

    def is_durable(self, client_id: str | None) -> bool:
        return client_id is not None and client_id in self.sessions

    async def attach(
        self, client_id: str, transport: Transport, read_access: ReadAccess | None = None
    ) -> Transport | None:
        """The connection got CONNACK: start sending the session's queue over it, each message only
        if ``read_access`` (None: no topic ACL) lets this connection's user read it. Returns the
        connection the session was attached to until now, if another: the caller ends it.

        Only if no later CONNECT of the client id was accepted (see ``superseded``): amqtt sets
        up each connection in its own task, so an older connection (taken over, or closed right
        after its CONNECT) can get here after the newer one has attached. Taking the session then
        would stop the live connection's pump, and the old connection's end would leave the
        session disconnected while its device stays connected, sent nothing more.
        """
        session = self.sessions.get(client_id)
        if session is None or session.superseded(transport):
            return None
        if session.pump is not None:
            await session.pump.stop()
        # Acks and drops of the previous connection may still be pending: the pump reads the
        # store, so let it see them.
        await self.committer.commit(urgent=True)
        if session.deleted:
            return None  # a clean CONNECT of the same client id removed it meanwhile
        if session.superseded(transport):
            return None  # a newer connection came meanwhile; its attach takes the session
        previous = session.pump  # stopped above, unless another attach ran meanwhile
        displaced = session.transport if session.transport is not transport else None
        session.transport = transport
        session.limits.on_connect(session.depth, session.bytes)
        self.expiry.cancel(client_id)
        session.connecting_until = 0.0  # attached: expiry counts from this connection's end, not its CONNECT
        session.record.disconnected_at = None
        session.record.expires_at = None
        self._save_record(session)
        session.replay_upto = session.committed_tail
        session.pump = pump = Pump(session, transport, self.config.recovery_buffer, read_access)
        if session.ready_for is transport:
            self._release(session, pump)
        pump.start()
        if previous is not None:
            await previous.stop()  # at once: it sends nothing more, whatever the new one does
        return displaced

    def superseded(self, client_id: str, transport: Transport) -> bool:
        """Was a later CONNECT of the client id accepted than the one of this connection? MQTT-3.1.4-2
        then wants this one ended (amqtt does it only when both connections share its Session)."""
        session = self.sessions.get(client_id)
        return session is not None and session.superseded(transport)

    async def detach(self, client_id: str, transport: Transport) -> None:
        """That connection is gone; a newer one (take-over) keeps the session connected."""
        session = self.sessions.get(client_id)
        if session is None or session.transport is not transport:
            return
        pump, session.pump, session.transport = session.pump, None, None
        if not session.deleted:
            session.drop_non_durable()  # with the connection, before any await lets a publish in
        if pump is not None:
            await pump.stop()
        if session.deleted:
            return
        session.limits.on_disconnect()
        self._disconnected(session)

    def _disconnected(self, session: DurableSession) -> None:
        """Start the expiry clock of a session that has no connection now."""
        now = time.time()
        session.record.disconnected_at = now
        session.record.expires_at = now + session.expiry_seconds()
        self._save_record(session)
        self.expiry.schedule(session.client_id, session.record.expires_at)
        self._arm_expiry()

    async def delete_session(self, session: DurableSession) -> int:
        """Remove a session with its queue and subscriptions; returns the messages dropped.

        The session stops taking messages first; then everything pending is written, so the
        store holds exactly its entries (none half-written, none already removed) when they go.
        """
        session.deleted = True  # from now on nothing writes for it: acks, records, totals
        self.sessions.pop(session.client_id, None)
        # Its record goes first, before any await: a crash midway leaves no half session to come
        # back, and a new session of the same client id, created meanwhile, writes its record after.
        self.committer.delete(session_key(session.client_id))
        self.expiry.cancel(session.client_id)
        for topic_filter in session.record.subscriptions:
            self.index.remove(session.client_id, topic_filter)
        pump, session.pump, session.transport = session.pump, None, None
        if pump is not None:
            await pump.stop()
        committer = self.committer
        await committer.commit(urgent=True)
        dropped = 0
        while True:
            # In chunks, yielding between them: a million-message queue must not stall the broker.
            deleted = self._delete_entries(session.sid, DELETE_CHUNK)
            dropped += deleted
            await committer.commit(urgent=True)
            if deleted < DELETE_CHUNK:
                break
        self._dirty.discard(session)
        committer.delete(totals_key(session.sid))
        committer.delete(sent_mark_key(session.sid))
        for key in self.db.iterator(prefix=pubrel_prefix(session.sid), include_value=False):
            committer.delete(key)  # at most 65,535; any recorded before the deletion began is written
        await committer.commit(urgent=True)
        return dropped

    def _delete_entries(self, sid: int, limit: int | None = None) -> int:
        """Queue the deletion of a session's first ``limit`` stored entries (all by default), with
        their bodies' references; returns how many."""
        count = 0
        for entry in iter_entries(self.db, sid, 0, limit):
            self.committer.delete(entry_key(sid, entry.seq))
            self.release_body(entry)
            count += 1
        return count

    # ------------------------------------------------------------ SDK sessions
    def hello(self, client_id: str, expiry: float | None) -> tuple[int, float | None]:
        """An SDK client greets its session: from now on it is held until ready and gets frames
        and markers. Returns (epoch, granted expiry)."""
        session = self.sessions[client_id]
        granted = None if expiry is None else min(expiry, self.config.max_session_expiry)
        if not session.record.sdk or session.record.expiry != granted:
            session.record.sdk = True
            session.record.expiry = granted
            self._save_record(session)
        if session.pump is not None:
            session.pump.become_sdk()
        return session.sid, granted

    def ready(self, client_id: str, transport: Transport) -> bool:
        """The client is ready for events: replay up to the current tail, then the marker.
        False when this connection had already said so (one marker per connection).

        amqtt reads a connection's packets before its pump exists (attach awaits commits), so a
        ready that comes first is kept for that connection and applied by attach.
        """
        session = self.sessions[client_id]
        pump = session.pump
        if pump is None or pump.transport is not transport:
            first = session.ready_for is not transport
            session.ready_for = transport
            return first
        if pump.marker_point is not None:
            return False
        self._release(session, pump)
        return True

    @staticmethod
    def _release(session: DurableSession, pump: Pump) -> None:
        session.ready_for = None
        session.replay_upto = session.committed_tail
        pump.release(session.committed_tail)

    def set_interest(self, client_id: str, topic_filter: str, durable: bool) -> None:
        """Mark a subscription (made before or after this) as ending with the connection, or not."""
        session = self.sessions[client_id]
        non_durable = session.record.non_durable
        if durable != (topic_filter not in non_durable):
            if durable:
                non_durable.discard(topic_filter)
            else:
                non_durable.add(topic_filter)
            self._save_record(session)

    def _save_record(self, session: DurableSession) -> None:
        if session.deleted:
            return
        self.committer.put(session_key(session.client_id), session.record.encode())
        self.committer.flush_soon()

    # ------------------------------------------------------------- subscriptions
    async def subscribe(
        self, client_id: str, topic_filter: str, qos: int, retained: Iterable[tuple[str, bytes, int]] = ()
    ) -> None:
        """Store a subscription; ``retained`` (topic, payload, qos) are queued with it, ahead of
        any live message the new subscription matches."""
        session = self.sessions.get(client_id)
        if session is None:
            return  # deleted meanwhile (clean connect elsewhere); amqtt still answers SUBACK
        session.record.subscriptions[topic_filter] = qos
        self.index.add(client_id, topic_filter, qos)
        for topic, payload, retained_qos in retained:
            self._enqueue(topic, payload, retained_qos, [(session, retained_qos)], flags=FLAG_RETAIN)
        self._save_record(session)
        await self.committer.commit(urgent=True)

    def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        session = self.sessions.get(client_id)
        if session is None or session.record.subscriptions.pop(topic_filter, None) is None:
            return
        session.record.non_durable.discard(topic_filter)  # a later SUBSCRIBE starts durable again
        self.index.remove(client_id, topic_filter)
        self._save_record(session)

    # -------------------------------------------------------------------- routing
    def route_publish(
        self, topic: str, payload: bytes, qos: int, targets: dict[str, int] | None = None, *, retain: bool = False
    ) -> asyncio.Future[None] | None:
        """Queue a publish for every matching durable session, append it to its stream log if
        a stream covers the topic, and with ``retain`` make it the topic's retained message (an
        empty payload clears it); the future resolves once all of that is durable.

        ``targets`` (client id -> subscription QoS, from ``index.route``) narrows the sessions,
        e.g. to those a topic ACL lets receive it. Runs without awaiting, so publishes are queued
        in the order they arrive. Raises StoreUnavailableError, changing nothing, while the store
        cannot write and the publish would have to be stored.
        """
        if targets is None:
            targets = self.index.route(topic)
        failure = self.committer.failure
        if failure is not None and (targets or retain or self.streams.logged(topic) is not None):
            raise StoreUnavailableError(failure)
        published_at = time.time()
        if retain:
            self._retain(topic, payload, qos, published_at)
        log_id = self.streams.append(topic, payload, qos, published_at) if self.streams.streams else None
        if not targets and log_id is None and not retain:
            return None
        sessions = self.sessions
        chosen = [(sessions[c], q) for c, q in targets.items() if c in sessions]  # one may just have gone
        appended = self._append_to_queues(topic, payload, qos, chosen, flags=0, published_at=published_at)
        then = None if log_id is None else partial(self.streams.appended, topic, log_id)
        return self._commit_queued(appended, then, retained=retain, fail_fast=True)

    def retain(self, topic: str, payload: bytes, qos: int) -> asyncio.Future[None]:
        """Set (an empty payload: clear) a retained message that is not routed with it (a will's retain
        comes after its broadcast; a plugin's); the future resolves once it is durable."""
        self._retain(topic, payload, qos, time.time())
        return self.committer.commit()

    def _retain(self, topic: str, payload: bytes, qos: int, published_at: float) -> None:
        self.retained.update(topic, payload, qos, published_at)
        if self.on_retained is not None:
            self.on_retained(topic, payload, qos)

    def _enqueue(
        self, topic: str, payload: bytes, qos: int, targets: list[tuple[DurableSession, int]], flags: int
    ) -> asyncio.Future[None] | None:
        appended = self._append_to_queues(topic, payload, qos, targets, flags=flags, published_at=time.time())
        return self._commit_queued(appended)

    def _commit_queued(
        self,
        appended: list[tuple[DurableSession, Entry, Body]],
        then: Callable[[], None] | None = None,
        *,
        retained: bool = False,
        fail_fast: bool = False,
    ) -> asyncio.Future[None] | None:
        """Commit the batch; once durable, offer the entries to their pumps, then run ``then``.
        ``retained``: the batch also holds a retained message, which the caller waits for too.
        ``fail_fast``: the future fails if the write does (a publish is then not acknowledged)."""
        if not appended and then is None and not retained:
            return None

        def deliver() -> None:
            for session, entry, body in appended:
                session.on_committed(entry, body)
            if then is not None:
                then()

        return self.committer.commit(deliver, fail_fast=fail_fast)

    def _append_to_queues(
        self,
        topic: str,
        payload: bytes,
        qos: int,
        targets: list[tuple[DurableSession, int]],
        *,
        flags: int,
        published_at: float,
    ) -> list[tuple[DurableSession, Entry, Body]]:
        """Put one message into the current batch for every target session its limits admit."""
        accepted: list[tuple[DurableSession, int]] = []
        size = len(payload)
        for session, sub_qos in targets:
            delivered_qos = min(qos, sub_qos)
            if delivered_qos == 0 and not session.connected and not self.config.queue_qos0:
                continue
            if session.admit(size):
                accepted.append((session, delivered_qos))
        if not accepted:
            return []
        body = Body(topic, payload, qos, published_at)
        msg_id = self._next_msg_id
        self._next_msg_id += 1
        committer = self.committer
        committer.put(body_key(msg_id), body.encode())
        if len(accepted) > 1:
            flags |= FLAG_SHARED
            self._refs[msg_id] = len(accepted)
            committer.put(refs_key(msg_id), encode_refs(len(accepted)))
        appended = [(session, session.append(msg_id, qos_out, flags, size), body) for session, qos_out in accepted]
        self.enqueued_total += len(appended)
        return appended

    # ------------------------------------------------------- inbound QoS 2 (MQTT 4.3.3, method B)
    def pubrel_due(self, client_id: str, packet_id: int) -> bool:
        """Was a QoS 2 PUBLISH with this packet id taken from this durable session, its PUBREL not
        yet received? Then a PUBLISH with the id is a re-send, never routed again (MQTT-4.3.3-2),
        also after a crash."""
        session = self.sessions.get(client_id)
        return session is not None and packet_id in session.pubrel_due

    def expect_pubrel(self, client_id: str, packet_id: int) -> None:
        """Record that a QoS 2 PUBLISH of this durable session was routed: call it in the loop pass
        of its ``route_publish``, so the record is in the same write batch as the message."""
        session = self.sessions.get(client_id)
        if session is None or session.deleted:
            return
        session.pubrel_due.add(packet_id)
        # Kept in memory also while writes fail: a failed write is retried, never dropped, so the
        # message and this id are stored together, and a re-send meanwhile is not routed again.
        self.committer.put(pubrel_key(session.sid, packet_id), b"")
        self.committer.flush_soon()

    async def pubrel_received(self, client_id: str, packet_id: int) -> None:
        """PUBREL came: forget the packet id, durably, before PUBCOMP lets the client reuse it."""
        session = self.sessions.get(client_id)
        if session is None or session.deleted or packet_id not in session.pubrel_due:
            return
        session.pubrel_due.discard(packet_id)
        self.committer.delete(pubrel_key(session.sid, packet_id))
        await self.committer.commit()

    def written_so_far(self) -> asyncio.Future[None]:
        """Resolves once everything handed to the store until now is durable (batches are FIFO)."""
        return self.committer.commit()

    def release_body(self, entry: Entry) -> None:
        """One queue entry fewer points at this body; the last one deletes it."""
        msg_id = entry.msg_id
        if not entry.flags & FLAG_SHARED:
            self.committer.delete(body_key(msg_id))
            return
        refs = self._refs.get(msg_id)
        if refs is None:
            refs = decode_refs(self.db.get(refs_key(msg_id)))
        refs -= 1
        if refs > 0:
            self._refs[msg_id] = refs
            self.committer.put(refs_key(msg_id), encode_refs(refs))
            return
        self._refs.pop(msg_id, None)
        self.committer.delete(body_key(msg_id))
        self.committer.delete(refs_key(msg_id))

    def totals_changed(self, session: DurableSession) -> None:
        if not session.deleted:
            self._dirty.add(session)

    def _before_flush(self) -> None:
        self.removing.seal()
        for session in self._dirty:
            if session.depth < 0 or session.bytes < 0:
                log.error(
                    "session %s: queue totals went negative (%d, %d); reset to 0",
                    session.client_id,
                    session.depth,
                    session.bytes,
                )
                session.depth, session.bytes = max(0, session.depth), max(0, session.bytes)
            self.committer.put(totals_key(session.sid), encode_totals(session.depth, session.bytes, session.dropped))
        self._dirty.clear()

    def note_sent(self, sent: int, replayed: int) -> None:
        self.sent_total += sent
        self.replayed_total += replayed

    # --------------------------------------------------------------------- expiry
    def _arm_expiry(self) -> None:
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        deadline = self.expiry.next_deadline()
        if deadline is None:
            return
        loop = asyncio.get_running_loop()
        delay = max(0.0, deadline - time.time())
        self._expiry_timer = loop.call_later(delay, lambda: loop.create_task(self._expire_due()))

    async def _expire_due(self) -> None:
        self._expiry_timer = None
        try:
            now = time.time()
            for client_id in self.expiry.pop_expired(now):
                session = self.sessions.get(client_id)
                deadline = session.record.expires_at if session is not None else None
                if session is None or session.connected or deadline is None or deadline > now:
                    continue  # reconnected since the deadline was set
                if session.connecting_until > now:
                    self.expiry.schedule(client_id, session.connecting_until)  # CONNACK sent, attach due
                    continue
                disconnected_at = session.record.disconnected_at
                dropped = await self.delete_session(session)
                self.expired_total += 1
                log.warning(
                    "durable session %s expired after %.0f s disconnected: %d queued message(s) and its "
                    "subscriptions deleted",
                    client_id,
                    session.expiry_seconds(),
                    dropped,
                )
                if self.on_expired is not None:
                    self.on_expired(ExpiredSession(client_id, dropped, disconnected_at))
        except Exception:
            log.exception("session expiry failed; it is tried again at the next deadline")
        finally:
            self._arm_expiry()

    # -------------------------------------------------------------------- metrics
    def metrics(self) -> dict[str, int]:
        connected = sum(1 for s in self.sessions.values() if s.connected)
        return {
            "sessions/connected": connected,
            "sessions/disconnected": len(self.sessions) - connected,
            "messages/queued": sum(s.depth for s in self.sessions.values()),
            "bytes/queued": sum(s.bytes for s in self.sessions.values()),
            "messages/enqueued": self.enqueued_total,
            "messages/dropped": self.dropped_total,
            "messages/replayed": self.replayed_total,
            "messages/sent": self.sent_total,
            "sessions/expired": self.expired_total,
            "retained/messages": len(self.retained),
            "store/commits": self.committer.commits,
            "store/read_errors": self.read_errors + self.streams.read_errors,
        }
