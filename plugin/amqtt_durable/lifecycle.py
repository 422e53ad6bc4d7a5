"""Session lifecycle: CONNECT, attach, detach, deletion and expiry, the SDK's hello/ready, and
the inbound QoS 2 state of durable sessions.

The steps between a client's CONNECT and its session's end, each keeping the store and the
in-memory session in step (the engine holds the state; this is its lifecycle half).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterable
from functools import partial

from .admission import Reservation
from .delivery import Pump, ReadAccess, Transport
from .errors import (
    NotPrimaryError,
    NotSessionOwnerError,
    SessionLimitError,
    StoreUnavailableError,
)
from .routing import Routing
from .sessions import DurableSession, ExpiredSession
from .settings import seconds_text
from .store import (
    DamagedEntry,
    SessionRecord,
    erase_entry,
    erase_pubrel_due,
    erase_session,
    erase_session_keys,
    iter_entries,
    write_pubrel_due,
    write_session,
    write_sid_mark,
)

log = logging.getLogger("amqtt_durable")

CONNECT_GRACE = 30.0
"""Seconds between CONNACK and the start of delivery during which expiry leaves a session alone."""
DELETE_CHUNK = 10_000
DELETION_GRACE = 5.0
"""Seconds a stopping engine lets the queue deletions a clean CONNECT left running finish (while the
store writes); the next load deletes what they had not erased."""


class SessionLifecycle(Routing):
    """The engine's session steps, over its routing (a subclass in the chain of engine_state.py)."""

    async def connect(self,
        client_id: str,
        clean_session: bool,
        username: str | None = None,
        transport: Transport | None = None,
        revoke: Iterable[str] = (),
        *,
        reservation: Reservation | None = None,
    ) -> bool:
        """CONNECT arrived (over ``transport``, which becomes the one connection that may attach);
        returns session_present. A clean session wipes any stored one.

        A session belongs to the user that created it: another user's CONNECT raises
        NotSessionOwnerError, unless session_takeover is any-user; then the session passes to that
        user without the subscriptions in ``revoke`` (those the topic ACL refuses the new user).

        ``reservation``: the place among ``max_durable_sessions`` taken for this CONNECT as it was
        read (``reserve_session``); it ends here, turned into the session if one is created. Without
        one, raises SessionLimitError when the CONNECT would create a durable session while there
        is no place for it.

        Raises StoreUnavailableError while the store cannot write and the CONNECT needs a write (a
        durable one, a clean one that deletes a durable session, or a clean one of a client id whose
        deleted session's record erasure is not written yet), or when that write fails: the glue
        refuses it (CONNACK 3).
        """
        reserved = self.session_limit.use(reservation)
        self.check_owner(client_id, username)
        self.check_writable_for(client_id, clean_session)
        if clean_session and self._deletions.unerased(client_id):
            # A session of this client id was deleted and its record's erasure is not written yet
            # (a clean CONNECT refused with CONNACK 3 after that write failed, or a deletion under
            # way): accepted only once it is, so a restart cannot bring back the session this
            # CONNECT is told is gone (MQTT-3.1.2-6); refused if the write fails.
            await self.committer.commit(urgent=True, fail_fast=True)
            self.check_owner(client_id, username)  # a session of the client id created meanwhile
        existing = self.sessions.get(client_id)
        if existing is not None and existing.record.username != username and not clean_session:
            self._pass_to(existing, username, revoke)
        if clean_session:
            if existing is not None:
                await self._delete_for_clean_connect(existing)
            return False
        if existing is not None:
            # The non-durable subscriptions of earlier connections closed by now (a DISCONNECT, a
            # take-over) end here, before this CONNACK, whether or not their detach has run: on a
            # loaded broker it can come after this connection's attach (see detach).
            if existing.drop_non_durable():
                self._save_record(existing)
            existing.newest = transport
            # Spared by expiry until attach() cancels the deadline; a connection that dies before
            # that (no attach, no detach) must not leave the session immortal, hence a time limit.
            existing.connecting_until = time.time() + CONNECT_GRACE
            return True
        # No await since the reservation was used and ``existing`` read: its place is this session's.
        if not reserved:
            self.check_session_limit(client_id, clean_session)
        record = SessionRecord(client_id=client_id, sid=self._next_sid, username=username)
        self._next_sid += 1
        self.sessions[client_id] = session = DurableSession(self, record)
        session.newest = transport
        write_session(self.committer, record)
        write_sid_mark(self.committer, record.sid)
        try:
            await self.committer.commit(urgent=True, fail_fast=True)
        except StoreUnavailableError:
            # Refused, but the record is written once the store recovers: a disconnected session
            # from now on, so it expires if the client does not come back.
            self._disconnected(session)
            raise
        return False

    def check_writable_for(self, client_id: str, clean_session: bool) -> None:
        """Raise StoreUnavailableError while the store cannot write and a CONNECT of ``client_id``
        needs a write: a durable one (creates or updates its session), or a clean one for the
        client id of a durable session (deletes it) or of a deleted one whose record's erasure is
        not written yet (a clean CONNECT refused with CONNACK 3 is refused again when retried)."""
        failure = self.committer.failure
        if failure is None:
            return
        if not clean_session or client_id in self.sessions or self._deletions.unerased(client_id):
            raise StoreUnavailableError(failure)

    def reserve_session(self, client_id: str) -> Reservation | None:
        """A durable CONNECT of ``client_id`` was read: a place among ``max_durable_sessions`` held
        for it until its ``connect`` (pass it there) or ``session_limit.release``; None when there
        is none (the CONNECT is refused). Always one for a client id with a session: should that
        session end before the CONNACK, the CONNECT still has its place."""
        return self.session_limit.reserve(client_id, self.sessions.keys())

    def check_session_limit(self, client_id: str, clean_session: bool) -> None:
        """Raise SessionLimitError if a CONNECT of ``client_id`` without a reservation would create a
        durable session while there is no place for it (``SessionLimit.has_place``)."""
        if not clean_session and not self.session_limit.has_place(client_id, self.sessions.keys()):
            raise SessionLimitError(client_id, self.config.max_durable_sessions)

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
            session.forget_interest(topic_filter)
            self.index.remove(session.client_id, topic_filter)
        for packet_id in session.pubrel_due:
            erase_pubrel_due(self.committer, session.sid, packet_id)
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
        """``_attach`` in one of ``attach_limit`` slots, held until the pump's task has made its first
        step (docs/guarantees.md, "Reconnect storms"). A connection closed while it waited for its
        slot stays queued; when its turn comes it hands the slot on at once: no commit, no pump
        (``detach`` then starts its session's expiry clock from this disconnect).

        While a connection waits for its slot (in a storm, longer than CONNECT_GRACE) and attaches,
        expiry spares its session (``attach_waiters``); every waiter gets a slot and ends, so that
        cannot keep a session forever."""
        session = self.sessions.get(client_id)
        if session is not None:
            session.attach_waiters += 1
        try:
            return await self._attach_in_slot(client_id, transport, read_access)
        finally:
            if session is not None:
                session.attach_waiters -= 1

    async def _attach_in_slot(
        self, client_id: str, transport: Transport, read_access: ReadAccess | None
    ) -> Transport | None:
        slots = self.attach_slots
        await slots.acquire()
        if transport.closed:  # gone while it waited: never attached
            slots.release()
            session = self.sessions.get(client_id)
            if session is not None and not session.superseded(transport):
                # No longer a waiter, but its detach (which starts the expiry clock) is still to
                # come: spared until then, as between CONNECT and attach.
                session.connecting_until = time.time() + CONNECT_GRACE
            return None
        try:
            displaced = await self._attach(client_id, transport, read_access)
        except BaseException:
            slots.release()
            raise
        # Queued behind the first step of the pump _attach started: the slot is freed right after it.
        asyncio.get_running_loop().call_soon(slots.release)
        return displaced

    async def _attach(
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
            if self._attach_dropped(session, transport):
                # The pump stopped is that of the connection attached until now: it would stay
                # connected, sent nothing until the next attach. A newer CONNECT than its own was
                # accepted, so it goes (the caller ends it), unless it is the newest one.
                current = session.transport
                return current if current is not None and session.superseded(current) else None
        # Acks and drops of the previous connection may still be pending: the pump reads the
        # store, so let it see them. The session's connection (its record, no longer disconnected)
        # and the pump's first sent mark go in the same commit: the first replayed message waits for
        # it. Set before the wait: a session deleted meanwhile writes no record (_save_record), and a
        # newer connection's attach or end writes its own after this one.
        disconnect = session.record.disconnected_at, session.record.expires_at
        self._store_connected(session)
        session.advance_sent_mark_for_attach(self.config.recovery_buffer)
        await self.committer.commit(urgent=True)
        if self._attach_dropped(session, transport):
            self._restore_disconnect(session, *disconnect)
            return None
        if session.record.disconnected_at is not None:
            # The previous connection ended while that commit was awaited (sync, sync replication,
            # or a failing store) and started the expiry clock: this connection's record again, in
            # a commit of its own.
            disconnect = session.record.disconnected_at, session.record.expires_at
            self._store_connected(session)
            await self.committer.commit(urgent=True)
            if self._attach_dropped(session, transport):
                self._restore_disconnect(session, *disconnect)
                return None
        previous = session.pump  # stopped above, unless another attach ran meanwhile
        displaced = session.transport if session.transport is not transport else None
        session.transport = transport
        session.limits.on_connect(session.depth, session.bytes)
        session.connecting_until = 0.0  # attached: expiry counts from this connection's end, not its CONNECT
        session.replay_upto = session.committed_tail
        session.pump = pump = Pump(
            session,
            transport,
            self.config.recovery_buffer,
            read_access,
            on_sent=self.note_sent,
            on_read_error=self.queue_read_failed,
            turns=self.replay_turns,
        )
        if session.ready_for is transport:
            self._release(session, pump)
        pump.start()
        if previous is not None:
            await previous.stop()  # at once: it sends nothing more, whatever the new one does
        return displaced

    @staticmethod
    def _attach_dropped(session: DurableSession, transport: Transport) -> bool:
        """After an await of ``_attach``: a clean CONNECT of the same client id removed the session
        meanwhile, or a newer connection came, whose attach takes the session (or whose end starts
        the expiry clock)."""
        return session.deleted or session.superseded(transport)

    def _restore_disconnect(
        self, session: DurableSession, disconnected_at: float | None, expires_at: float | None
    ) -> None:
        """An attach dropped after ``_store_connected``: unless something else has the session now (a
        connection attached, another attach under way, an end that started the clock, a deletion),
        its record and expiry clock go back to the disconnect before that attach. Else, when the
        newer connection neither attaches nor ends (its CONNACK write failed), the session never
        expired. The newer CONNECT's grace still spares the session (``connecting_until``).

        A session with no disconnect before that attach (created by that connection's CONNECT: a
        loaded one counts as disconnected at the start) starts its clock now; before, it had no
        deadline at all, and never expired."""
        record = session.record
        if session.deleted or session.transport is not None or session.attach_waiters > 1:
            return
        if record.disconnected_at is not None:
            return
        if disconnected_at is None or expires_at is None:
            self._disconnected(session)
            return
        record.disconnected_at, record.expires_at = disconnected_at, expires_at
        self._save_record(session)
        self.expiry.schedule(session.client_id, expires_at)
        self._arm_expiry()

    def _store_connected(self, session: DurableSession) -> None:
        """The session has a connection: no expiry clock, no disconnect time in its record (saved)."""
        self.expiry.cancel(session.client_id)
        session.record.disconnected_at = None
        session.record.expires_at = None
        self._save_record(session)

    def superseded(self, client_id: str, transport: Transport) -> bool:
        """Was a later CONNECT of the client id accepted than the one of this connection? MQTT-3.1.4-2
        then wants this one ended (amqtt does it only when both connections share its Session)."""
        session = self.sessions.get(client_id)
        return session is not None and session.superseded(transport)

    async def detach(self, client_id: str, transport: Transport, *, broker_stopping: bool = False) -> None:
        """That connection is gone; a newer one (take-over) keeps the session connected.

        A connection the broker's own stop ends starts no expiry clock: the session counts as
        connected at the stop, so its deadline counts from the restart (as after a crash), and a
        maintenance stop longer than ``session_expiry`` expires nobody.

        A connection that got CONNACK but never attached (closed while it waited for its attach
        slot) ends the same way for its session: the expiry clock counts from this disconnect, not
        from the one before its CONNECT (the glue calls this once per connection). Its CONNECT's
        grace ends with it even while an older connection is still attached (CONNECTs read at the
        same time, whose newer one closed unattached): that one's end then starts the clock alone."""
        session = self.sessions.get(client_id)
        if session is None:
            return
        # The non-durable subscriptions it made end with it, before any await lets a publish in,
        # also when a newer connection has attached first (its end handled late): the session is
        # no longer this connection's, but what it made non-durable still ends here.
        if not session.deleted and session.drop_non_durable(transport):
            self._save_record(session)
        if session.transport is not transport:
            if session.newest is transport and not session.deleted and not broker_stopping:
                session.connecting_until = 0.0  # as at attach: its CONNECT's grace ends with it
                if session.transport is None:  # no other connection has the session
                    self._disconnected(session)
            return
        pump, session.pump, session.transport = session.pump, None, None
        if pump is not None:
            await pump.stop()
        if session.deleted or session.transport is not None:
            return  # removed meanwhile, or a newer connection attached while the pump stopped: it has the session
        session.limits.on_disconnect()
        if not broker_stopping:
            self._disconnected(session)

    def _disconnected(self, session: DurableSession) -> None:
        """Start the expiry clock of a session that has no connection now."""
        now = time.time()
        session.record.disconnected_at = now
        session.record.expires_at = now + session.expiry_seconds()
        self._save_record(session)
        self.expiry.schedule(session.client_id, session.record.expires_at)
        self._arm_expiry()

    async def _delete_for_clean_connect(self, session: DurableSession) -> None:
        """A clean CONNECT deletes the durable session of its client id, and its CONNACK waits for
        the whole deletion to be written, unless a write of it fails (a failure the check before it
        could not know of, such as a disk that filled since the last write). Then the CONNECT is
        answered at once: StoreUnavailableError (CONNACK 3) when the failed write is the erasure of
        the session's record, the first; accepted when that one was written. Either way the
        deletion goes on (``_deletions``): the committer keeps failed writes in order and retries
        them. A restart before they are written finds a refused CONNECT's session whole, and
        deletes what an accepted one's left of its queue (recovery's orphans).

        Before, the CONNECT waited for the whole deletion whatever happened, and a full disk left
        the client without a CONNACK until it had room again."""
        pump = self._forget(session)
        erased = self.committer.commit(urgent=True, fail_fast=True)
        deletion = asyncio.get_running_loop().create_task(self._erase_queue(session, pump))
        self._deletions.tasks.add(deletion)
        deletion.add_done_callback(partial(self._deleted_in_background, session.client_id))
        await erased
        failing = self.committer.when_failing()
        try:
            await asyncio.wait((deletion, failing), return_when=asyncio.FIRST_COMPLETED)
        finally:
            failing.cancel()
        if deletion.done() and not deletion.cancelled():
            # A deletion that failed (the broker demoted) fails the CONNECT, as before. One the stop
            # cancelled does not cancel this task: the record's erasure is written, the CONNECT
            # accepted, and the stop ends its connection; the next start deletes what is left.
            deletion.result()

    def _deleted_in_background(self, client_id: str, deletion: asyncio.Task[int]) -> None:
        self._deletions.tasks.discard(deletion)
        if deletion.cancelled():
            return  # the broker stopping or demoted: the next start deletes what is left (orphans)
        error = deletion.exception()
        if error is not None and not isinstance(error, NotPrimaryError):
            log.warning(
                "%s: deleting the queue of its former durable session stopped (%s); the next start deletes "
                "what is left",
                client_id,
                error,
            )

    async def delete_session(self, session: DurableSession) -> int:
        """Remove a session with its queue and subscriptions; returns the messages dropped.

        The session stops taking messages first; then everything pending is written, so the
        store holds exactly its entries (none half-written, none already removed) when they go.
        """
        return await self._erase_queue(session, self._forget(session))

    def _forget(self, session: DurableSession) -> Pump | None:
        """The first step of a deletion, with no await: the session stops taking messages, its
        record's erasure is queued, and its pump is taken from it (returned, to be stopped)."""
        session.deleted = True  # from now on nothing writes for it: acks, records, totals
        self.sessions.pop(session.client_id, None)
        # Its record goes first, before any await: a crash midway leaves no half session to come
        # back, and a new session of the same client id, created meanwhile, writes its record after.
        erase_session(self.committer, session.client_id)
        self._deletions.record_erasure_queued(session.client_id, self.committer)
        self.expiry.cancel(session.client_id)
        for topic_filter in session.record.subscriptions:
            self.index.remove(session.client_id, topic_filter)
        pump, session.pump, session.transport = session.pump, None, None
        return pump

    async def _erase_queue(self, session: DurableSession, pump: Pump | None) -> int:
        """The rest of a deletion after ``_forget``: its pump stopped, the queue and the session's
        other keys erased; returns the messages dropped."""
        if pump is not None:
            await pump.stop()
        committer = self.committer
        await committer.commit(urgent=True)
        dropped = 0
        while True:
            # In chunks, yielding between them: a million-message queue must not stall the broker.
            deleted = self._delete_entries(session.sid, DELETE_CHUNK, session.client_id)
            dropped += deleted
            await committer.commit(urgent=True)
            if deleted < DELETE_CHUNK:
                break
        self._dirty.discard(session)
        # With its QoS 2 states: any recorded before the deletion began are written by now.
        erase_session_keys(committer, self.db, session.sid)
        await committer.commit(urgent=True)
        return dropped

    def _delete_entries(self, sid: int, limit: int | None = None, client_id: str | None = None) -> int:
        """Queue the deletion of a session's first ``limit`` stored entries (all by default), with
        their bodies' references; returns how many. An entry that does not decode goes by its key,
        named in an ERROR; its body and reference count (its message id is unknown) stay for repair."""
        count = 0
        for entry in iter_entries(self.db, sid, 0, limit, client_id, keep_damaged=True):
            if isinstance(entry, DamagedEntry):
                self.committer.delete(entry.key)
                log.error(
                    "%s: erased with its session; the body it points at, if any, is left in the store: "
                    "run 'amqtt-durable repair %s' (with the broker stopped) to remove it",
                    entry.problem,
                    self.config.store,
                )
            else:
                erase_entry(self.committer, sid, entry.seq)
                self.release_body(entry)
            count += 1
        return count

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

    def set_interest(self, client_id: str, topic_filter: str, durable: bool, transport: Transport) -> None:
        """Mark a subscription (made before or after this) as ending with ``transport``, the
        connection that asked, or not."""
        session = self.sessions[client_id]
        if session.mark_interest(topic_filter, durable, transport):
            self._save_record(session)

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
        write_pubrel_due(self.committer, session.sid, packet_id)
        self.committer.flush_soon()

    def pubrel_released(self, client_id: str, packet_id: int) -> asyncio.Future[None] | None:
        """PUBREL came: forget the packet id, durably, before PUBCOMP lets the client reuse it.
        Returns the write PUBCOMP waits for (None: nothing to wait for); a PUBREL sent again while
        that deletion is being written gets the same write. Called as the PUBREL is read, so a
        connection ending right after it cannot leave the id stored."""
        session = self.sessions.get(client_id)
        if session is None or session.deleted:
            return None
        erasing = session.pubrel_erasing.get(packet_id)
        if packet_id in session.pubrel_due:
            session.pubrel_due.discard(packet_id)
            erase_pubrel_due(self.committer, session.sid, packet_id)
            erasing = session.pubrel_erasing[packet_id] = self.committer.commit()
            erasing.add_done_callback(partial(_erased, session.pubrel_erasing, packet_id))
        return erasing

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
                if session.attach_waiters:
                    # Its client is connected and waits for an attach slot (a storm can make that
                    # longer than CONNECT_GRACE): looked at again later; its attach cancels this.
                    self.expiry.schedule(client_id, now + CONNECT_GRACE)
                    continue
                disconnected_at = session.record.disconnected_at
                dropped = await self.delete_session(session)
                self.expired_total += 1
                log.warning(
                    "durable session %s expired after %s s disconnected: %d queued message(s) and its "
                    "subscriptions deleted",
                    client_id,
                    seconds_text(session.expiry_seconds()),  # as configured: 300, 0.5 (not rounded to 0)
                    dropped,
                )
                if self.on_expired is not None:
                    self.on_expired(ExpiredSession(client_id, dropped, disconnected_at))
        except Exception:
            log.exception("session expiry failed; it is tried again at the next deadline")
        finally:
            self._arm_expiry()


def _erased(erasing: dict[int, asyncio.Future[None]], packet_id: int, done: asyncio.Future[None]) -> None:
    if erasing.get(packet_id) is done:  # not a later PUBREL's write of the same id, reused meanwhile
        del erasing[packet_id]
