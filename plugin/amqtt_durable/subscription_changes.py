"""One connection's SUBSCRIBEs and UNSUBSCRIBEs, in the order they arrived (MQTT 3.1.1 section 4.6;
3.10.4: after an UNSUBSCRIBE nothing more is sent for its filters, a SUBSCRIBE after it adds them
again). amqtt 0.12.1 queued the two kinds apart and its message loop applied a waiting SUBSCRIBE
before a waiting UNSUBSCRIBE; this is the one queue both go to, applied one at a time, and the
connection's end waits until it is empty (``drained``). Pure logic; amqtt_glue.py feeds it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Generic, TypeVar

Change = TypeVar("Change")


class SubscriptionChanges(Generic[Change]):
    """A FIFO whose head stays in it while it is applied: ``next()`` hands the head out, ``start()``
    marks it as being applied, ``done()`` removes it once applied, so ``drained()`` (empty, or
    closed) means every change that arrived has been applied. One consumer: the connection's
    message loop."""

    def __init__(self) -> None:
        self._changes: deque[Change] = deque()
        self._arrived = asyncio.Event()
        """Set by ``add()``; ``next()`` clears it before it waits (``close()`` leaves it: a closed
        queue hands nothing out)."""
        self._empty = asyncio.Event()
        """Set while no change waits or is being applied (or the queue is closed)."""
        self._empty.set()
        self._taken = asyncio.Event()
        """Set as a change is done or the queue closed (``fewer_than`` waits for it)."""
        self._applying: Change | None = None
        """The head ``start()`` began applying, until ``done()``: it is not dropped."""
        self.closed = False

    def __len__(self) -> int:
        return len(self._changes)

    def add(self, change: Change) -> None:
        """A change arrived; one added after ``close()`` is dropped (nothing applies it any more)."""
        if self.closed:
            return
        self._changes.append(change)
        self._arrived.set()
        self._empty.clear()

    async def next(self) -> Change:
        """The oldest change not yet applied (waits for one). It stays queued until ``done()``. A
        closed queue hands nothing out: this waits for ever (its waiter is cancelled)."""
        while not self._changes or self.closed:
            self._arrived.clear()
            await self._arrived.wait()
        return self._changes[0]

    def start(self, change: Change) -> bool:
        """The consumer begins applying ``change``, the one ``next()`` handed out: ``close()`` no
        longer drops it. False if the queue was closed since it was handed out (the loop had not
        begun it: it was dropped, and counted, with the rest): it is not to be applied."""
        if self.closed:
            return False
        self._applying = change
        return True

    def done(self, change: Change) -> None:
        """``change``, the one ``next()`` handed out, has been applied."""
        if self._applying is change:
            self._applying = None
        if self._changes and self._changes[0] is change:
            self._changes.popleft()
        if not self._changes:
            self._empty.set()
        self._taken.set()

    def close(self) -> int:
        """No change is handed out any more (the message loop ended, or the connection's end stopped
        waiting for them): those waiting are dropped and ``drained()`` returns at once. Returns how
        many were dropped: not the one being applied (``start()``, not yet ``done()``), which the
        loop completes; one handed out but not started is dropped. Closing a closed queue drops nothing more."""
        if self.closed:
            return 0
        dropped = len(self._changes) - (1 if self._changes and self._changes[0] is self._applying else 0)
        self._changes.clear()
        self.closed = True
        self._empty.set()
        self._taken.set()
        return dropped

    async def fewer_than(self, count: int) -> None:
        """Waits until fewer than ``count`` changes wait or are being applied (or the queue is
        closed): each pass of the loop follows one change done."""
        while len(self._changes) >= count and not self.closed:
            self._taken.clear()
            await self._taken.wait()

    async def drained(self) -> None:
        """Waits until every change that arrived has been applied (or the queue is closed); the
        caller bounds the wait."""
        await self._empty.wait()
