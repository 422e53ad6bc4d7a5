"""Routing: subscriptions, fan-out of a publish to every matching session's queue, retained
messages, and the body references shared by fanned-out entries.

A publish becomes one body and one queue entry per admitted session in the current group
commit; the commit's future is what the glue waits for before PUBACK.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable
from functools import partial

from .errors import (
    StoreUnavailableError,
)
from .metrics import EngineMetrics
from .sessions import DurableSession
from .store import (
    FLAG_RETAIN,
    FLAG_SHARED,
    MSG_ID_RESERVE,
    Body,
    Entry,
    write_body,
    write_msg_id_mark,
    write_refs,
    write_session,
    write_totals,
)

log = logging.getLogger("amqtt_durable")


class Routing(EngineMetrics):
    """The engine's routing steps, over its counters and state (see engine_state.py)."""

    async def subscribe(
        self, client_id: str, topic_filter: str, qos: int, retained: Iterable[tuple[str, bytes, int]] = ()
    ) -> None:
        """``add_subscription``, returning once it is stored."""
        self.add_subscription(client_id, topic_filter, qos, retained)
        await self.committer.commit(urgent=True)

    def add_subscription(
        self, client_id: str, topic_filter: str, qos: int, retained: Iterable[tuple[str, bytes, int]] = ()
    ) -> None:
        """A subscription, routed from now on and stored by the next commit (a SUBSCRIBE of many
        filters adds each, then awaits one commit); ``retained`` (topic, payload, qos) are queued with
        it, ahead of any live message the new subscription matches."""
        session = self.sessions.get(client_id)
        if session is None:
            return  # deleted meanwhile (clean connect elsewhere); amqtt still answers SUBACK
        session.record.subscriptions[topic_filter] = qos
        self.index.add(client_id, topic_filter, qos)
        for topic, payload, retained_qos in retained:
            self._enqueue(topic, payload, retained_qos, [(session, retained_qos)], flags=FLAG_RETAIN)
        self._save_record(session)

    async def unsubscribe(self, client_id: str, topic_filter: str) -> None:
        """``remove_subscription``, returning once that is stored, so a crash after the UNSUBACK
        cannot bring the filter back."""
        self.remove_subscription(client_id, topic_filter)
        await self.committer.commit(urgent=True)

    def remove_subscription(self, client_id: str, topic_filter: str) -> None:
        """Drop a subscription: routed no more from now on, stored by the next commit."""
        session = self.sessions.get(client_id)
        if session is None or session.record.subscriptions.pop(topic_filter, None) is None:
            return
        session.forget_interest(topic_filter)  # a later SUBSCRIBE starts durable again
        self.index.remove(client_id, topic_filter)
        self._save_record(session)

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

    def _commit_queued(self,
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

    def _append_to_queues(self,
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
        if msg_id > self._msg_id_mark:  # the mark goes in this batch, ahead of the body: never an id twice
            self._msg_id_mark = msg_id + MSG_ID_RESERVE - 1
            write_msg_id_mark(committer, self._msg_id_mark)
        write_body(committer, msg_id, body)
        if len(accepted) > 1:
            flags |= FLAG_SHARED
            self._refs[msg_id] = len(accepted)
            write_refs(committer, msg_id, len(accepted))
        appended = [(session, session.append(msg_id, qos_out, flags, size), body) for session, qos_out in accepted]
        self.enqueued_total += len(appended)
        return appended

    def _before_flush(self) -> None:
        self.removing.seal()
        for session in self._unsaved_records:
            if not session.deleted:  # a deleted one's erase is in the batch already
                write_session(self.committer, session.record)
        self._unsaved_records.clear()
        for session in self._dirty:
            if session.depth < 0 or session.bytes < 0:
                log.error(
                    "session %s: queue totals went negative (%d, %d); reset to 0",
                    session.client_id,
                    session.depth,
                    session.bytes,
                )
                session.depth, session.bytes = max(0, session.depth), max(0, session.bytes)
            write_totals(self.committer, session.sid, session.depth, session.bytes, session.dropped)
        self._dirty.clear()
