"""A durable session in memory: its queue's bounds, totals, limits and connection.

The store holds the entries and bodies; a DurableSession knows where its queue starts and
ends, how deep it is, which connection (and pump) it has, and writes its own entries and
marks through the store's verbs. Its lifecycle (connect, attach, expiry) is lifecycle.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING

import plyvel

from durable_protocol import LiveSubscription

from .delivery import Pump, Transport
from .errors import StoreReadError, StoreUnavailableError
from .queue_policy import Admission, QueueLimits
from .store import (
    FLAG_SHARED,
    NO_BODY,
    RELEASED_BODY,
    Body,
    DamagedEntry,
    Entry,
    SessionRecord,
    awaiting_pubcomp,
    entry_key,
    erase_entries,
    erase_entry,
    iter_entries,
    leveldb_detail,
    queue_prefix,
    read_entry_run,
    read_stored_bodies,
    seq_of_entry_key,
    write_entry,
    write_sent_mark,
)

if TYPE_CHECKING:
    from .engine_state import EngineState
    from .store import GroupCommitter

log = logging.getLogger("amqtt_durable")


@dataclass
class ExpiredSession:
    """What an expiry removed, for the WARNING log and the $SYS event."""

    client_id: str
    messages_dropped: int
    disconnected_at: float | None


def droppable(entry: Entry) -> bool:
    """Overflow may drop anything but a QoS 2 message whose PUBREL is due: the client holds its
    packet id until PUBCOMP, so dropping it would wedge that id."""
    return not awaiting_pubcomp(entry)


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

    def __bool__(self) -> bool:
        return bool(self._open or self._writing)

    def add_run(self, sid: int, seqs: list[int]) -> None:
        self._open.update(zip(repeat(sid), seqs))

    def absent(self, sid: int, entries: list[Entry]) -> list[Entry]:
        """The entries of session ``sid`` not removed in memory (a run read from the store)."""
        if not (self._open or self._writing):
            return entries
        pending, writing = self._open, self._writing
        return [entry for entry in entries if (key := (sid, entry.seq)) not in pending and key not in writing]

    def seal(self) -> None:
        self._writing |= self._open
        self._open = set()

    def written(self) -> None:
        self._writing = set()


class SessionDeletions:
    """Deletions of whole sessions under way: the queue erasures clean CONNECTs left running
    (``tasks``), and the client ids of deleted sessions whose record's erasure is not written yet."""

    def __init__(self) -> None:
        self.tasks: set[asyncio.Task[int]] = set()
        self._unerased: dict[str, int] = {}

    def record_erasure_queued(self, client_id: str, committer: GroupCommitter) -> None:
        """The erasure of ``client_id``'s session record was just handed to ``committer``: the id
        counts as unerased until the write that holds it (a failed write keeps its callbacks with
        its operations, and the retry that writes them runs them)."""
        self._unerased[client_id] = self._unerased.get(client_id, 0) + 1
        committer.when_written(partial(self._written, client_id))

    def _written(self, client_id: str) -> None:
        left = self._unerased.pop(client_id, 1) - 1
        if left > 0:
            self._unerased[client_id] = left

    def unerased(self, client_id: str) -> bool:
        """Is the erasure of a deleted session's record of ``client_id`` not written yet?"""
        return client_id in self._unerased


class DurableSession:
    """In-memory state of one durable session; the store holds the rest."""

    def __init__(self, engine: EngineState, record: SessionRecord) -> None:
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
        self.attach_waiters = 0
        """Connections of this client id in attach (waiting for an attach slot, or attaching): expiry
        spares the session meanwhile, however long the queue for slots (SessionLifecycle.attach)."""
        self.ready_for: Transport | None = None
        """The connection whose ready came before its pump existed (see DurableEngine.ready)."""
        self.deleted = False
        self.sent_mark = 0
        """The highest sent mark handed to the store: written, or in a batch not written yet."""
        self.stored_mark = 0
        """The highest sent mark written (see advance_sent_mark for a store that cannot write): the
        pump sends nothing past it, so no PUBLISH leaves before a stored mark covers it."""
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
        self.interest_by: dict[str, Transport] = {}
        """The connection that made each filter of ``record.non_durable`` non-durable: the
        subscription ends with that connection (``drop_non_durable``), not with another's."""
        self._last_drop_log = 0.0
        self._drops_since_log = 0
        self.pubrel_due: set[int] = set()
        """Packet ids of QoS 2 PUBLISHes taken from this session whose PUBREL has not come (b"x" keys)."""
        self.pubrel_erasing: dict[int, asyncio.Future[None]] = {}
        """The write of each packet id's deletion at its PUBREL, until done: a PUBREL sent again
        meanwhile (the id already gone from ``pubrel_due``) waits for it too before its PUBCOMP."""
        self.unbodied: set[int] = set()
        """Sequences of RELEASED entries rewritten to NO_BODY (``_unbodied``): a read before that write
        lands must not write it, nor release the old body, twice."""

    @property
    def connected(self) -> bool:
        return self.transport is not None

    def superseded(self, transport: Transport) -> bool:
        """Was a CONNECT of this client id accepted after the one of ``transport``?"""
        return self.newest is not None and self.newest is not transport

    def read_entries(self, start: int, tail: int, limit: int) -> tuple[list[tuple[Entry, Body | None]], int | None]:
        """read_stored with each body decoded (None: a RELEASED entry read without its body)."""
        entries, bodies, last = self.read_stored(start, tail, limit)
        pairs = zip(entries, bodies, strict=True)
        return [(entry, None if raw == RELEASED_BODY else Body.decode(raw)) for entry, raw in pairs], last

    def read_stored(self, start: int, tail: int, limit: int) -> tuple[list[Entry], list[bytes], int | None]:
        """Up to ``limit`` stored entries from ``start`` to ``tail``, their bodies as stored (in the same
        order; each checked as Body.decode would), and the last sequence looked at when the limit
        cut the read short (None: everything up to ``tail`` read).

        Entries removed in memory but not yet written are skipped: the store must not bring them back.
        An entry without a body is removed (logged), except a QoS 2 RELEASED one (awaiting_pubcomp;
        the flag on another QoS is damage, and such an entry is removed too): only its PUBREL is due,
        which needs no body, so when its body is gone or damaged it comes with RELEASED_BODY (a gone
        one as an entry that points at none, ``_unbodied``). A read that fails part way returns what came before
        the damage (cut short there); one that fails at once raises StoreReadError: the pump
        reports it and tries again later.
        """
        db = self.engine.db
        if db.closed:  # a retry after a failed write closed it and could not open it again (yet)
            raise StoreReadError(self.client_id, start - 1, "the store is closed until a write retry reopens it")
        entries, damage = read_entry_run(db, self.sid, start, tail, limit)
        if damage is not None and not entries:
            raise StoreReadError(self.client_id, start - 1, leveldb_detail(damage)) from damage
        cut = damage is not None or len(entries) >= limit
        kept = self.engine.removing.absent(self.sid, entries)
        try:
            stored = read_stored_bodies(db, [entry.msg_id for entry in kept])
        except (plyvel.Error, ValueError, struct.error):
            return self._read_entry_by_entry(entries, start, cut)
        try:
            bodies = [stored[entry.msg_id] for entry in kept]
        except KeyError:  # an entry without its body
            with_body: list[Entry] = []
            bodies = []
            for entry in kept:
                raw = stored.get(entry.msg_id)
                if raw is not None:
                    with_body.append(entry)
                    bodies.append(raw)
                elif awaiting_pubcomp(entry):  # its PUBREL needs no body
                    with_body.append(self._unbodied(entry))
                    bodies.append(RELEASED_BODY)
                else:
                    self._bodiless(entry)
            kept = with_body
        return kept, bodies, (entries[-1].seq if cut else None)

    def _unbodied(self, entry: Entry) -> Entry:
        """A RELEASED entry whose body is gone, rewritten to one that points at none (NO_BODY, not
        SHARED, size 0), in the store too: its PUBREL goes all the same, and the PUBCOMP that removes
        it deletes no body or reference count under its old message id. The old id's reference is
        released now (a shared body's count goes down; the id is never given again, b"M"), and the
        queue's bytes lose its size, in the same batch as the rewrite."""
        if entry.msg_id == NO_BODY:
            return entry
        rewritten = Entry(entry.seq, NO_BODY, entry.qos, entry.flags & ~FLAG_SHARED, 0)
        if entry.seq in self.unbodied or self.deleted:
            return rewritten
        log.warning(
            "session %s: queue entry %d (QoS 2, PUBREL due): its body, message %d, is gone; "
            "the PUBREL goes without it",
            self.client_id,
            entry.seq,
            entry.msg_id,
        )
        self.unbodied.add(entry.seq)
        engine = self.engine
        write_entry(engine.committer, self.sid, rewritten)
        engine.release_body(entry, body_gone=True)
        self.bytes -= entry.size
        engine.totals_changed(self)
        self.limits.on_drained(self.depth, self.connected, self.bytes)
        engine.committer.flush_soon()
        return rewritten

    def _bodiless(self, entry: Entry) -> None:
        log.error("session %s: queue entry %d has no message body; removing it", self.client_id, entry.seq)
        self.remove_entry(entry)

    def _read_entry_by_entry(
        self, entries: list[Entry], start: int, cut: bool
    ) -> tuple[list[Entry], list[bytes], int | None]:
        """read_stored's body reads one by one, after the run's read met damage: what came before the
        damaged body is returned (cut short there); damage at the first raises StoreReadError."""
        db = self.engine.db
        removing = self.engine.removing
        kept: list[Entry] = []
        bodies: list[bytes] = []
        last_seq_looked: int | None = None
        for entry in entries:
            if (self.sid, entry.seq) not in removing:
                try:
                    raw = read_stored_bodies(db, [entry.msg_id]).get(entry.msg_id)
                except (plyvel.Error, ValueError, struct.error) as exc:
                    if awaiting_pubcomp(entry):
                        # A damaged body its PUBREL does not need; the PUBCOMP deletes it with the entry.
                        log.warning(
                            "session %s: queue entry %d (QoS 2, PUBREL due): its body, message %d, does "
                            "not decode (%s); the PUBREL goes without it",
                            self.client_id,
                            entry.seq,
                            entry.msg_id,
                            leveldb_detail(exc),
                        )
                        raw = RELEASED_BODY
                    elif last_seq_looked is None:
                        raise StoreReadError(self.client_id, start - 1, leveldb_detail(exc)) from exc
                    else:
                        return kept, bodies, last_seq_looked
                if raw is not None:
                    kept.append(entry)
                    bodies.append(raw)
                elif awaiting_pubcomp(entry):
                    kept.append(self._unbodied(entry))
                    bodies.append(RELEASED_BODY)
                else:
                    self._bodiless(entry)
            last_seq_looked = entry.seq
        return kept, bodies, (last_seq_looked if cut else None)

    def _queue_sent_mark(self, mark: int) -> None:
        """Hand 'entries up to ``mark`` may have been sent' to the store; ``stored_mark`` follows once
        the batch holding it is written."""
        self.sent_mark = mark
        committer = self.engine.committer
        write_sent_mark(committer, self.sid, mark)
        committer.when_written(partial(self._mark_written, mark))

    def _mark_written(self, mark: int) -> None:
        self.stored_mark = max(self.stored_mark, mark)

    async def advance_sent_mark(self, highest: int, window: int) -> None:
        """Before entries up to ``highest`` are sent: return once a stored sent mark covers them (DUP
        after a crash). The commit waited for writes ``highest + window``, even when a mark already
        handed to the store covers ``highest`` (a live entry's, or one queued ahead but not yet
        written): a write is forced either way, so it may as well cover the next sends too."""
        if self.deleted:
            return
        if highest + window > self.sent_mark:
            self._queue_sent_mark(highest + window)
        queued = self.sent_mark
        # While the store cannot write, sending goes on: the mark is queued ahead of the acks of
        # what is sent next, so no write can land those acks without it (a later message never
        # reuses a sequence a client has seen); a crash before the store recovers loses only the
        # DUP flag on re-sends of what was sent meanwhile.
        # A replicated primary does not wait for its backups: a mark lost in a failover costs
        # only the DUP flag of what was in flight (new entries still number past every entry).
        with contextlib.suppress(StoreUnavailableError):
            await self.engine.committer.commit(urgent=True, local=True)
        self._mark_written(queued)  # written here, or (store failing) queued ahead of every later write

    def mark_ahead(self, mark: int) -> None:
        """Hand the sent mark a later send will need to the store now, asking for no write: it goes
        with the next one (the acks of what is in flight ask for it), so the pump finds it stored
        instead of waiting for a commit of its own (see Pump._write_batch)."""
        if not self.deleted and mark > self.sent_mark:
            self._queue_sent_mark(mark)

    def advance_sent_mark_for_attach(self, window: int) -> None:
        """Before a pump starts: queue the sent mark its first send will need (the first stored entry
        + ``window``, as ``Pump._send`` would write it), so that it goes in the attach's commit and
        the first send need not wait for a commit of its own. A guess, never a promise: a first
        send it does not cover waits for its own mark as before (a failed peek writes nothing)."""
        db = self.engine.db
        if self.deleted or db.closed:
            return
        try:
            rows = db.iterator(
                start=entry_key(self.sid, self.head_seq), stop=queue_prefix(self.sid + 1), include_value=False
            )
            try:
                key = next(rows, None)
            finally:
                rows.close()
        except plyvel.Error:
            return
        if key is None:
            return
        mark = seq_of_entry_key(key) + window
        if mark > self.sent_mark:
            self._queue_sent_mark(mark)

    def mark_released(self, entry: Entry) -> asyncio.Future[None] | None:
        """Store that ``entry``'s PUBREC came; the future resolves once it is stored (with sync
        replication, on the backups too): its PUBREL may go out then, not before, or a crash in
        between would send the PUBLISH again to a client that may have completed it already.
        None once the session is deleted."""
        if self.deleted:
            return None
        write_entry(self.engine.committer, self.sid, entry)
        return self.engine.committer.commit()

    def remove_entry(self, entry: Entry) -> None:
        if self.deleted:
            return  # delete_session removes every entry, exactly once
        committer = self.engine.committer
        erase_entry(committer, self.sid, entry.seq)
        self.engine.removing.add((self.sid, entry.seq))
        self.engine.release_body(entry)
        self._shrink(1, entry.size)
        self.engine.totals_changed(self)
        self.limits.on_drained(self.depth, self.connected, self.bytes)
        committer.flush_soon()

    def remove_entries(self, entries: list[Entry]) -> None:
        """remove_entry for a run of entries (a pump's acknowledged ones): the same writes, with the
        totals, limits and the flush request done once for the run."""
        if self.deleted or not entries:
            return
        engine = self.engine
        committer = engine.committer
        seqs = [entry.seq for entry in entries]
        erase_entries(committer, self.sid, seqs)
        engine.release_bodies(entries)
        engine.removing.add_run(self.sid, seqs)
        size = 0
        for entry in entries:
            size += entry.size
        self._shrink(len(entries), size)
        engine.totals_changed(self)
        self.limits.on_drained(self.depth, self.connected, self.bytes)
        committer.flush_soon(len(entries))

    def _shrink(self, count: int, size: int) -> None:
        """``count`` entries of ``size`` bytes in all left the queue. An empty queue holds no bytes:
        the size of a damaged entry dropped by its key (unknown, so not taken off) goes with the last."""
        self.depth -= count
        self.bytes = self.bytes - size if self.depth else 0

    def append(self, msg_id: int, qos: int, flags: int, size: int) -> Entry:
        entry = Entry(self.next_seq, msg_id, qos, flags, size)
        self.next_seq += 1
        self.uncommitted[entry.seq] = entry
        committer = self.engine.committer
        write_entry(committer, self.sid, entry)
        self.depth += 1
        self.bytes += size
        self.engine.totals_changed(self)
        if self.pump is not None and entry.seq > self.sent_mark:
            # A live entry goes out right after the commit: mark it in the same batch. Until that batch
            # is written the pump does not count on this mark (stored_mark), also for older entries.
            self._queue_sent_mark(entry.seq + self.engine.config.recovery_buffer)
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
        if decision is Admission.DROP_NEWEST:
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
        victim = pump.drop_buffered(droppable) if pump is not None else None
        if victim is None:
            start = pump.next_unread if pump is not None else self.head_seq
            removing = self.engine.removing
            stored = iter_entries(self.engine.db, self.sid, start, client_id=self.client_id, keep_damaged=True)
            live = (e for e in stored if (self.sid, e.seq) not in removing)
            first = found = next(live, None)
            while found is not None and not droppable(found):
                found = next(live, None)
            if isinstance(found, DamagedEntry) and found.seq < 0:
                log.error(
                    "session %s: %s: its queue is full and this key cannot be dropped: the new message is "
                    "dropped; stop the broker and run 'amqtt-durable repair %s'",
                    self.client_id,
                    found.problem,
                    self.engine.config.store,
                )
                return False
            if found is not None and found.seq <= self.committed_tail:
                victim = found
                if victim is first:  # nothing still due before it: later scans may start after it
                    if pump is not None:
                        pump.skip_to(victim.seq + 1)
                    else:
                        self.head_seq = victim.seq + 1
            elif self.uncommitted:
                victim = self.uncommitted.pop(next(iter(self.uncommitted)))
            else:
                return False
        if isinstance(victim, DamagedEntry):
            self._drop_damaged(victim)
        else:
            self.remove_entry(victim)
        return True

    def _drop_damaged(self, entry: DamagedEntry) -> None:
        """Drop-oldest met an entry that does not decode: it goes by its key. Its message id and size
        are unknown: its body (and reference count) stay until repair rebuilds them, and its size stays
        in the byte total until the queue is empty (then the total is 0) or repair rebuilds it."""
        if self.deleted:
            return
        log.error(
            "session %s: %s: dropped as the oldest message by its queue limit; the body it points at stays, "
            "and its size in the byte total until the queue is empty, or 'amqtt-durable repair %s' "
            "(with the broker stopped)",
            self.client_id,
            entry.problem,
            self.engine.config.store,
        )
        committer = self.engine.committer
        committer.delete(entry.key)
        self.engine.removing.add((self.sid, entry.seq))
        self._shrink(1, 0)
        self.engine.totals_changed(self)
        self.limits.on_drained(self.depth, self.connected, self.bytes)
        committer.flush_soon()

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

    def mark_interest(self, topic_filter: str, durable: bool, transport: Transport) -> bool:
        """``transport``'s interest: the filter's subscription ends with that connection (not
        ``durable``), or no longer does. Returns whether the record changed."""
        non_durable = self.record.non_durable
        changed = durable != (topic_filter not in non_durable)
        if durable:
            self.forget_interest(topic_filter)
        else:
            non_durable.add(topic_filter)
            self.interest_by[topic_filter] = transport
        return changed

    def forget_interest(self, topic_filter: str) -> None:
        """The filter is durable again (its subscription removed, say)."""
        self.record.non_durable.discard(topic_filter)
        self.interest_by.pop(topic_filter, None)

    def drop_non_durable(self, ended: Transport | None = None) -> bool:
        """Connections ended: the non-durable subscriptions they made end with them (queued
        messages stay). Those made by ``ended`` or by a connection closed by now, whichever order
        the connections' ends and attaches run in; one whose connection is not known (made before
        the store was loaded) too. Another connection's, still open, stay. Returns whether any
        ended (the record is to be saved)."""
        interest_by = self.interest_by
        ended_filters = [
            topic_filter
            for topic_filter in self.record.non_durable
            if (made_by := interest_by.get(topic_filter)) is None or made_by is ended or made_by.closed
        ]
        for topic_filter in ended_filters:
            self.forget_interest(topic_filter)
            if self.record.subscriptions.pop(topic_filter, None) is not None:
                self.engine.index.remove(self.client_id, topic_filter)
        return bool(ended_filters)
