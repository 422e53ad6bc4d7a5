"""How delivery pumps share the event loop while many sessions replay at once (a reconnect storm).

Two policies, both plain (no amqtt, no store):

* ``RunSizes``: a pump's replayed batches start small and grow. Its first batch is at most
  ``FIRST_RUN`` messages, each later one twice the one before, up to the in-flight window. A
  session's first messages go out early; a long replay soon writes whole windows (one write for
  many messages, as before).
* ``ReplayTurns``: one per broker. A batch read from the store (a replay, or a session catching
  up) goes out in a turn, which the pump takes right before the write (after the topic ACL and
  its sent mark's commit) and which counts the batch's size. A session's first batch (its pump's
  first write) always gets its turn at once: it is small, and the session's CONNECT cost the loop
  more than it. Every later batch gets one in the order the pumps asked, while fewer than
  ``budget`` messages are counted since the budget started; a pump past that waits for the
  budget's next start, at most once per pass of the event loop, so that reads of new packets
  (CONNECTs, PUBLISHes, acks) and the rest of the loop's work come in between. A pump that had
  a turn waits for that start (``next_pass``) before it takes its next batch. With no pump
  waiting and budget left, a turn is granted at once, without a pass: a replay alone runs as
  without turns.

The bound this gives (docs/guarantees.md, "Reconnect storms"): a session's first replayed message
is written in the pass of the loop its pump starts in (within attach), whatever the other sessions
have queued, unless that pump must first ask a topic ACL or store its sent mark (then in the pass
that resumes its task after that). The later batches counted against one budget are at most
``budget - 1`` messages plus one window (the last turn), and each is written while that budget
runs: a granted pump writes in the next pass, before the budget starts again. So one pass of the
loop writes at most two budgets' worth, 2 x (``budget`` - 1 + window) messages of later batches,
besides the first batches of the sessions attached in it (``FIRST_RUN`` each).
"""

from __future__ import annotations

import asyncio
from collections import deque

FIRST_RUN = 8
"""Messages in a pump's first replayed batch (at most; also at most the window)."""
TURN_BUDGET = 256
"""Messages of later replayed batches granted per pass of the event loop while pumps wait (a few ms)."""


class RunSizes:
    """A pump's replayed batch sizes: ``FIRST_RUN``, then doubled per batch, up to the window."""

    def __init__(self, window: int, first: int = FIRST_RUN) -> None:
        self.window = window
        self.next = max(1, min(first, window))
        self.first = True
        """The pump wrote no batch yet: the next one, if read from the store, is the session's first
        (its turn at once, see ReplayTurns). After a live batch none is: a pump that falls behind
        later waits for a turn for every batch."""

    def sent(self, replayed: bool = True) -> None:
        """A batch went out: no later one is the first; after a ``replayed`` one (read from the
        store) the next may be twice as large."""
        self.first = False
        if replayed:
            self.next = min(self.window, self.next * 2)


class ReplayTurns:
    """Turns to send replayed batches, shared by every pump of a broker (see the module docstring).

    ``take(size, first, last)`` returns once the pump may send a batch of up to ``size`` messages
    (``last``: ``pass_id`` when this pump had its previous turn, None if never); ``try_take`` is the
    same without waiting (False: not now). A turn counts ``size`` against its pass's budget; the pump
    writes at most that, at once (``try_take``) or as soon as its task runs (``take``: in the next
    pass of the loop, before the next ``_next_pass``), awaiting nothing else. A later batch is
    granted at once only if the budget of this pass is not used up, no pump waits, and this pump
    had no turn in this pass yet; otherwise it waits, and the waiting get their turns in the order
    they asked, those that already had one in the pass they asked in behind those that had not:
    round robin. ``next_pass`` returns when the next pass begins: a pump that had its turn in this
    one waits for it before it takes its next batch (which can then be larger: acks came).
    """

    def __init__(self, budget: int = TURN_BUDGET) -> None:
        if budget < 1:
            raise ValueError(f"a turn budget must be at least 1, not {budget}")
        self.budget = budget
        self.used = 0
        """Messages granted since the current pass began."""
        self.pass_id = 0
        """Counts the passes that began a new budget (one follows every pass that granted a turn)."""
        self._waiting: deque[tuple[asyncio.Future[None], int]] = deque()
        self._again: deque[tuple[asyncio.Future[None], int]] = deque()
        """Pumps that asked in the pass they had a turn in: queued behind ``_waiting`` at the next pass."""
        self._passes: list[asyncio.Future[None]] = []
        """Waiting in ``next_pass``."""
        self._armed = False

    @property
    def waiting(self) -> int:
        return len(self._waiting) + len(self._again)

    def try_take(self, size: int, first: bool, last: int | None = None) -> bool:
        """A turn now: always for a first batch; for a later one see the class docstring."""
        if not first and (last == self.pass_id or self._waiting or self.used >= self.budget):
            return False
        self.used += size
        self._arm()
        return True

    async def take(self, size: int, first: bool, last: int | None = None) -> None:
        if self.try_take(size, first, last):
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        item = (waiter, size)
        queue = self._again if last == self.pass_id else self._waiting
        queue.append(item)
        self._arm()
        try:
            await waiter
        except asyncio.CancelledError:
            # The task's cancel cancelled ``waiter`` too: leave the queue at once. A turn granted just
            # before the cancel was taken off the queue then, and is simply unused.
            for queued in (self._waiting, self._again):
                if item in queued:
                    queued.remove(item)
                    break
            raise

    async def next_pass(self) -> None:
        """Returns once the next pass has begun (its budget, and the turns it hands out)."""
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._passes.append(waiter)
        self._arm()
        await waiter  # a cancel cancels it: the pass skips it

    def _arm(self) -> None:
        """The next pass starts a new budget (and hands out turns to those waiting)."""
        if not self._armed:
            self._armed = True
            asyncio.get_running_loop().call_soon(self._next_pass)

    def _next_pass(self) -> None:
        self._armed = False
        self.used = 0
        self.pass_id += 1
        waiting = self._waiting
        waiting.extend(self._again)
        self._again.clear()
        if waiting:
            while waiting and self.used < self.budget:
                waiter, size = waiting.popleft()
                if not waiter.done():  # else cancelled, its task not yet run to leave the queue: skip it
                    waiter.set_result(None)
                    self.used += size
            self._arm()  # the next pass resets the budget these grants used (and serves who still waits)
        passes, self._passes = self._passes, []
        for waiter in passes:  # after the grants: those pumps write first
            if not waiter.done():
                waiter.set_result(None)
