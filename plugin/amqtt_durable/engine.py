"""The durable-session engine: one object that owns the store and every durable session.

Data flow: ``route_publish`` (routing.py) appends a message to every matching session's
queue in the current group commit and returns the commit's future (the glue sends PUBACK
when it resolves); once durable, each connected session's pump (delivery.py) is offered the
entry. A disconnected session runs the same path with its pump absent. The engine's steps
live in modules named after them: recovery.py (start-up, store health), lifecycle.py
(connect, attach, expiry), routing.py (subscriptions, fan-out), metrics.py; this module
holds the shared state and the timers. Nothing here imports amqtt.
"""

from __future__ import annotations

import asyncio
import logging
import time

from .engine_state import StoreHealth
from .errors import NotPrimaryError
from .lifecycle import DELETION_GRACE
from .recovery import Recovery
from .sessions import DurableSession, ExpiredSession
from .store import CommitReplication
from .stream_log import COUNT_TRIM_PER_APPEND, TRIM_BUDGET

__all__ = ["DurableEngine", "DurableSession", "ExpiredSession", "StoreHealth"]

log = logging.getLogger("amqtt_durable")


class DurableEngine(Recovery):
    """Owns the store and every durable session of one broker."""

    @property
    def serving(self) -> bool:
        """Loaded and not halted: a replication backup, or a demoted primary, serves no client."""
        return self.loaded and self.committer.halted is None

    def start_timers(self) -> None:
        self._arm_expiry()
        if self.streams.streams:
            interval = self.streams.trim_interval()
            self._trim_task = asyncio.get_running_loop().create_task(self._trim_streams(interval))

    async def _trim_streams(self, interval: float | None) -> None:
        """Retention of the stream logs: one pass at once (what the store holds past a lowered
        ``max_count`` or ``max_age``, or what aged while the broker was down, goes from the start,
        not at the next append or age check), then, with an age limit, one every ``interval``; a
        long backlog goes ``TRIM_BUDGET`` deletes at a time, each chunk committed before the next.
        A term that ends meanwhile (the commit refused: NotPrimaryError) ends the task quietly: the
        demotion stops it anyway, and a later term's ``start_timers`` runs a pass of its own."""
        while True:
            try:
                while self.streams.trim_expired(time.time()) >= TRIM_BUDGET:
                    await self.committer.commit(urgent=True)
                self.committer.flush_soon()
            except NotPrimaryError:
                return
            except Exception:
                later = (
                    f"each append trims its own log ({COUNT_TRIM_PER_APPEND} events at most per append)"
                    if interval is None
                    else f"it is tried again in {interval:.1f} s"
                )
                log.exception("stream retention failed; %s", later)
            if interval is None:
                return
            await asyncio.sleep(interval)

    async def stop_serving(self, reason: str) -> None:
        """No longer the primary: acknowledge and write nothing more, stop every pump and timer,
        and return once the last write in the worker thread is finished (the store then follows
        the new primary). The in-memory state is stale from here on; ``serve`` rebuilds it on a
        later promotion."""
        self.committer.halt(reason)
        await self._stop_work()
        await self.committer.wait_idle()

    async def serve(self, replication: CommitReplication | None = None) -> None:
        """Serve as the primary (again, after a demotion): load the store afresh for this term.
        What the previous term left running (pumps, the expiry timer, the stream trim task, a
        write in the worker thread) is stopped and awaited first, so none of it acts on the new
        term's state; cumulative counters carry on (see ``load``)."""
        if self.loaded:
            await self.stop_serving("a new term as primary begins")
        self.load(replication)

    async def finish_writes(self) -> None:
        """A replicated primary about to stop cleanly: stop pumps and timers and write everything
        pending (the replication end then waits until the backups have it, and the committer
        is halted: nothing written after that could be shipped)."""
        await self._stop_work()
        await self.committer.drain()

    async def _stop_work(self) -> None:
        for session in list(self.sessions.values()):
            if session.pump is not None:
                await session.pump.stop()
        if self._expiry_timer is not None:
            self._expiry_timer.cancel()
            self._expiry_timer = None
        if self._trim_task is not None:
            self._trim_task.cancel()
            await asyncio.gather(self._trim_task, return_exceptions=True)
            self._trim_task = None
        if self._deletions.tasks:
            # Queue deletions a clean CONNECT left running finish while the store writes (for at most
            # DELETION_GRACE); one waiting for a failing store is cancelled: what it has not erased,
            # the next load deletes (orphaned entries).
            grace = 0.0 if self.committer.failure is not None else DELETION_GRACE
            _, unfinished = await asyncio.wait(list(self._deletions.tasks), timeout=grace)
            for deletion in unfinished:
                deletion.cancel()
            await asyncio.gather(*unfinished, return_exceptions=True)

    async def close(self) -> None:
        await self._stop_work()
        if self.db is not None and not self.db.closed:
            if self.loaded:
                await self.committer.drain()
            self.db.close()

    def written_so_far(self) -> asyncio.Future[None]:
        """Resolves once everything handed to the store until now is durable (batches are FIFO)."""
        return self.committer.commit()
