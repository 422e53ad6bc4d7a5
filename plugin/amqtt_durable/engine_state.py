"""The state every part of the engine shares, and the store-facing steps they all use.

The engine's steps live in modules named after them (recovery, lifecycle, routing, metrics),
each a class in one chain over this one, so a step calls only steps below it:
EngineState -> EngineMetrics -> Routing -> SessionLifecycle -> Recovery -> DurableEngine.
"""

from __future__ import annotations

import asyncio
import logging
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from .admission import SessionLimit
from .config import DurableConfig
from .expiry import ExpiryTracker
from .retained import RetainedMessages
from .sessions import DurableSession, ExpiredSession, PendingRemovals, SessionDeletions
from .store import (
    FLAG_SHARED,
    Entry,
    GroupCommitter,
    decode_refs,
    erase_bodies,
    erase_body,
    erase_refs,
    refs_key,
    write_refs,
)
from .stream_log import StreamLogs
from .topics import SubscriptionIndex
from .turns import ReplayTurns

log = logging.getLogger("amqtt_durable")

_KEPT = "its body is kept (not deleted with its last queue entry)"


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


class EngineState:
    """The store, the sessions and the counters of one broker."""

    def __init__(
        self,
        config: DurableConfig,
        on_expired: Callable[[ExpiredSession], None] | None = None,
        on_store_health: Callable[[StoreHealth], None] | None = None,
    ) -> None:
        self.config = config
        self.db: Any = None
        self.committer: GroupCommitter
        self.loaded = False
        """Whether sessions were loaded from the store (a replication backup's engine is not)."""
        self.sessions: dict[str, DurableSession] = {}
        # max_durable_sessions against len(sessions): the store's sessions, as loaded and kept since.
        # It counts refused CONNECTs; a reload for a new term keeps it (Recovery.load).
        self.session_limit = SessionLimit(config.max_durable_sessions, config.drop_log_interval)
        self.index = SubscriptionIndex()
        self.expiry = ExpiryTracker()
        self.on_expired = on_expired
        self.on_store_health = on_store_health
        self._next_msg_id = 1
        self._msg_id_mark = 0
        """The b"M" mark handed to the store: ids up to it may be given without writing it again."""
        self._next_sid = 1
        self._refs: dict[int, int] = {}
        self._damaged_refs: set[int] = set()
        """Message ids whose reference count was found missing or undecodable (logged once each)."""
        self._dirty: set[DurableSession] = set()
        self._unsaved_records: set[DurableSession] = set()
        """Sessions whose record changed since the last flush: each is encoded once per commit, not once per
        change (a SUBSCRIBE of 500 filters would encode a growing record 500 times)."""
        self.removing = PendingRemovals()
        self.replay_turns = ReplayTurns()
        """Shared by every pump: replayed batches go out in turns (turns.py, reconnect storms)."""
        self.attach_slots = asyncio.Semaphore(config.attach_limit)
        """Attaches under way at once (``attach_limit``): the rest wait in the order they came."""
        self._expiry_timer: asyncio.TimerHandle | None = None
        self._trim_task: asyncio.Task[None] | None = None
        self._deletions = SessionDeletions()
        """The queue deletions clean CONNECTs left running (``_delete_for_clean_connect``), and the
        client ids whose session record's erasure is not written yet: a clean CONNECT of one is
        accepted only once it is (``SessionLifecycle.connect``)."""
        self.store_id = 0
        """Random, made with the store: stream readers compare it to notice a wiped or replaced store."""
        self.streams: StreamLogs
        self.retained: RetainedMessages
        self.on_store_reopened: Callable[[Any], None] | None = None
        """Told of the new handle after a failed write made the engine reopen the store
        (replication's primary reads snapshots from it)."""
        self.on_retained: Callable[[str, bytes, int], None] | None = None
        """Told of every retained message set or cleared (empty payload), in the order they are stored:
        the glue keeps amqtt's in-memory table in step with the store."""
        self.dropped_total = 0
        self.clean_dropped_total = 0
        """Messages not sent to a clean-session connection past max_pending_clean(_bytes) (the glue counts them)."""
        self.expired_total = 0
        self.replayed_total = 0
        self.sent_total = 0
        self.enqueued_total = 0
        self.read_errors = 0
        """Failed reads of a queue from the store (a damaged store); each one is logged and retried."""
        self.earlier_commits = 0
        """Group commits of the committers of earlier terms as primary (each term has its own)."""
        self.load_started = False


    def _save_record(self, session: DurableSession) -> None:
        if session.deleted:
            return
        self._unsaved_records.add(session)
        self.committer.flush_soon()


    def release_body(self, entry: Entry, body_gone: bool = False) -> None:
        """One queue entry fewer points at this body; the last one deletes it. ``body_gone``: the
        caller found the body missing already (only the count is released)."""
        msg_id = entry.msg_id
        if not entry.flags & FLAG_SHARED:
            erase_body(self.committer, msg_id)
            return
        refs = self._refs.get(msg_id)
        if refs is None:
            # A shared body's count is written with it (and cached until then): one missing or
            # undecodable is damage, and guessing 1 would delete a body other queues still need.
            if msg_id in self._damaged_refs:
                return  # logged at its first release: a body fanned out to 10,000 sessions logs once
            raw = self.db.get(refs_key(msg_id), verify_checksums=True)
            try:
                refs = None if raw is None else decode_refs(raw)
            except struct.error:
                refs = None
            if refs is None:
                self._damaged_refs.add(msg_id)
                log.error(
                    "message %d: its reference count %s: %s; the store is damaged: stop the broker, run "
                    "'amqtt-durable repair %s' (rebuilds every count from the queues), then start the broker "
                    "again",
                    msg_id,
                    "is missing" if raw is None else "does not decode",
                    "its body is already gone" if body_gone else _KEPT,
                    self.config.store,
                )
                return
        refs -= 1
        if refs > 0:
            self._refs[msg_id] = refs
            write_refs(self.committer, msg_id, refs)
            return
        self._refs.pop(msg_id, None)
        erase_body(self.committer, msg_id)
        erase_refs(self.committer, msg_id)


    def release_bodies(self, entries: list[Entry]) -> None:
        """release_body for a run of entries: the bodies of unshared messages are deleted in one go."""
        unshared: list[int] = []
        for entry in entries:
            if entry.flags & FLAG_SHARED:
                self.release_body(entry)
            else:
                unshared.append(entry.msg_id)
        erase_bodies(self.committer, unshared)


    def totals_changed(self, session: DurableSession) -> None:
        if not session.deleted:
            self._dirty.add(session)

