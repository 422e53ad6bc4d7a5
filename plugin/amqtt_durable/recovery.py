"""Start-up recovery and store health: open the store, rebuild sessions and their bounds from
its keys (never whole queues), delete what a crash orphaned, and reopen the store before a
failed write is retried.
"""

from __future__ import annotations

import logging
import secrets
import struct
import time
from typing import Any

import plyvel

from .engine_state import EngineState, StoreHealth
from .errors import (
    DamagedRecordError,
    StoreCorruptedError,
)
from .lifecycle import SessionLifecycle
from .retained import RetainedMessages
from .sessions import DurableSession
from .store import (
    RETRY_MAX,
    CommitReplication,
    GroupCommitter,
    check_writable,
    discard_probe,
    first_seq,
    holds_queue_entries,
    iter_pubrel_due,
    iter_sessions,
    last_msg_id,
    last_seq,
    next_free_sid,
    open_store,
    orphaned_keys,
    read_error,
    read_msg_id_mark,
    read_session_state,
    read_store_id,
    scan_msg_ids_in_use,
    write_msg_id_mark,
    write_session,
    write_store_id,
)
from .stream_log import StreamLogs

log = logging.getLogger("amqtt_durable")

CUMULATIVE = (
    "dropped_total", "clean_dropped_total", "expired_total", "replayed_total", "sent_total", "enqueued_total",
    "read_errors", "earlier_commits",
)
"""Counters that add up over the broker's life: a reload for a new term as primary keeps them."""


class Recovery(SessionLifecycle):
    """The engine's start-up and store-health steps, over its session steps (see engine_state.py)."""

    def open(self) -> None:
        """Open the store and rebuild sessions from it; reads keys, never whole queues (and the
        retained messages, once, for amqtt's table)."""
        self.open_store()
        self.load()

    def open_store(self) -> None:
        """Only open the store: a replication backup writes it until it is promoted. A new store
        gets its id now, so a primary stamps every batch with it from the first one."""
        discard_probe(self.config.store)  # first: a probe a killed process left may hold the space the open needs
        self.db = open_store(self.config.store)
        try:
            stored_id = read_store_id(self.db)
        except DamagedRecordError as exc:
            self.db.close()
            raise StoreCorruptedError(self.config.store, str(exc)) from exc
        if stored_id is None:
            write_store_id(self.db, secrets.randbits(63))

    def load(self, replication: CommitReplication | None = None) -> None:
        """Rebuild sessions from the open store, forgetting any earlier state (a promoted backup's
        store was written behind the engine's back); ``replication``: commits are shipped.

        A reload (a new term as primary; ``DurableEngine.serve`` stops the previous term's
        work first) builds a fresh state, but the cumulative counters ($SYS ``*_total`` and
        ``read_errors``) carry on from the previous terms instead of starting again from 0;
        gauges (sessions, queued messages) are the store's as loaded."""
        path = self.config.store
        if self.load_started:  # a new term, or a retry after a failed load: none of its state may stay
            for handle in (self._expiry_timer, self._trim_task):  # serve() stopped them; a direct reload too
                if handle is not None:
                    handle.cancel()
            db, on_retained, on_reopened = self.db, self.on_retained, self.on_store_reopened
            session_limit = self.session_limit  # its refusal count is cumulative too
            counters = {name: getattr(self, name) for name in CUMULATIVE}
            if self.loaded:
                counters["earlier_commits"] += self.committer.commits
            EngineState.__init__(self, self.config, self.on_expired, self.on_store_health)
            self.db, self.on_retained, self.on_store_reopened = db, on_retained, on_reopened
            self.session_limit = session_limit
            for name, value in counters.items():
                setattr(self, name, value)
        self.load_started = True
        try:
            self._load(replication)
        except plyvel.Error as exc:
            self.db.close()
            raise read_error(path, exc) from exc
        except DamagedRecordError as exc:
            self.db.close()
            raise StoreCorruptedError(path, str(exc)) from exc
        except (ValueError, KeyError, struct.error) as exc:
            self.db.close()
            raise StoreCorruptedError(path, f"{type(exc).__name__}: {exc}") from exc

    def _load(self, replication: CommitReplication | None) -> None:
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
        self.committer.replication = replication
        self.committer.before_flush = self._before_flush
        self.committer.after_write = self.removing.written
        self.committer.reopen = self._reopen_store
        self.committer.on_health = self._store_health_changed
        stored_id = read_store_id(self.db)
        if stored_id is None:  # a store written by a version that made none
            stored_id = secrets.randbits(63)
            write_store_id(self.committer, stored_id)
        self.store_id = stored_id
        self.streams = StreamLogs(self.db, self.committer, config.streams, config.store)
        self.streams.load()
        self.retained = RetainedMessages(self.committer)
        self.retained.load(self.db)
        mark = read_msg_id_mark(self.db)
        if mark is None:  # a store from before the mark: past every id a body, count or entry holds
            mark = self._scan_msg_ids()
            write_msg_id_mark(self.committer, mark)
        # Never below a stored body, whatever the mark says.
        self._msg_id_mark = max(mark, last_msg_id(self.db))
        self._next_msg_id = self._msg_id_mark + 1
        self._next_sid = next_free_sid(self.db)
        normalised = self._load_sessions()
        by_sid = {session.sid: session for session in self.sessions.values()}
        for sid, packet_id in iter_pubrel_due(self.db):
            if sid in by_sid:
                by_sid[sid].pubrel_due.add(packet_id)
        self._drop_orphans(set(by_sid))
        if normalised:
            self._said_normalised(normalised)
        self.committer.flush_now()
        self.loaded = True
        log.info(
            "durable store %s: %d session(s), %d queued message(s), %d retained message(s)",
            config.store,
            len(self.sessions),
            sum(s.depth for s in self.sessions.values()),
            len(self.retained),
        )

    def _load_sessions(self) -> list[str]:
        """Every session record, its totals and bounds (keys only); the client ids whose totals
        were normalised (``_normalise_totals``)."""
        now = time.time()
        normalised: list[str] = []
        for record in iter_sessions(self.db):
            session = DurableSession(self, record)
            (session.depth, session.bytes, session.dropped), sent_mark = read_session_state(self.db, record)
            first = first_seq(self.db, record.sid)
            if self._normalise_totals(session, empty=first is None):
                normalised.append(record.client_id)
            tail = last_seq(self.db, record.sid)
            session.sent_mark = session.stored_mark = session.sent_max = sent_mark
            # New entries number past the sent mark: a fresh message must never look like a re-send.
            session.committed_tail = max(tail or 0, session.sent_mark)
            session.next_seq = session.committed_tail + 1
            session.head_seq = first if first is not None else session.next_seq
            self.sessions[record.client_id] = session
            self._next_sid = max(self._next_sid, record.sid + 1)
            for topic_filter, qos in record.subscriptions.items():
                self.index.add(record.client_id, topic_filter, qos)
            if record.expires_at is None:
                # It was connected when the broker stopped: its disconnect is now.
                session.drop_non_durable()
                record.disconnected_at = now
                record.expires_at = now + session.expiry_seconds()
                write_session(self.committer, record)
            self.expiry.schedule(record.client_id, record.expires_at)
        return normalised

    def _said_normalised(self, normalised: list[str]) -> None:
        """One WARNING for every session whose totals the load set to 0."""
        shown = ", ".join(repr(client_id) for client_id in normalised[:5])
        more = f" and {len(normalised) - 5} more" if len(normalised) > 5 else ""
        log.warning(
            "durable store %s: %d session(s) had queue totals that did not fit their queue (bytes in an "
            "empty queue, or messages counted in a queue without entries; an earlier release left such "
            "totals after dropping a damaged entry): set to 0 for %s%s",
            self.config.store,
            len(normalised),
            shown,
            more,
        )

    def _normalise_totals(self, session: DurableSession, *, empty: bool) -> bool:
        """An empty queue (no entry key) counts no message, and a queue that counts no message holds
        no bytes: the size of a damaged entry dropped by its key stays in the byte total only while
        the queue is not empty (sessions.py), and a store from before that rule kept it for good.
        True when the totals were changed (written with the load's first batch)."""
        depth = 0 if empty else session.depth
        size = session.bytes if depth else 0
        if (depth, size) == (session.depth, session.bytes):
            return False
        session.depth, session.bytes = depth, size
        self.totals_changed(session)
        return True

    def _drop_orphans(self, known: set[int]) -> None:
        """Delete queue entries of sessions whose record is gone: a crash in the middle of deleting
        a session (its record goes first), or a stop that cancelled a deletion a clean CONNECT left
        running (engine ``_stop_work``), leaves them; nothing else can reach them."""
        sids, keys = orphaned_keys(self.db, known)
        for sid in sids:
            dropped = self._delete_entries(sid)
            log.warning(
                "store: deleted %d queue entries of a session whose deletion a crash or a stop cut short", dropped
            )
        for key in keys:  # totals, sent marks, QoS 2 states outlive their queue in such a crash
            self.committer.delete(key)

    def _scan_msg_ids(self) -> int:
        """The highest message id in use in a store without the b"M" mark (one read of every queue
        entry, logged before and after: seconds for millions of entries). A store without queue
        entries (a new one) has nothing to read: nothing is logged."""
        if not holds_queue_entries(self.db):
            return scan_msg_ids_in_use(self.db)[0]
        log.info(
            "durable store %s has no message id mark (written by an earlier release): reading every queue entry once",
            self.config.store,
        )
        started = time.monotonic()
        mark, read = scan_msg_ids_in_use(self.db)
        log.info(
            "durable store %s: %d queue entries read in %.1f s; highest message id in use %d, kept as the "
            "mark from now on",
            self.config.store,
            read,
            time.monotonic() - started,
            mark,
        )
        return mark

    def _reopen_store(self) -> Any:
        """Before a store write is retried: a fresh handle (see GroupCommitter), opened only once
        the disk can allocate a probe file, so the store is not left closed and unreadable."""
        check_writable(self.config.store)
        if not self.db.closed:
            self.db.close()
        self.db = open_store(self.config.store, create=False)
        self.streams.use_db(self.db)
        if self.on_store_reopened is not None:
            self.on_store_reopened(self.db)
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
