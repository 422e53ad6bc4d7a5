"""How delivery pumps share the event loop while many sessions replay at once (a reconnect storm).

Two policies, both plain (no amqtt, no store):

* ``RunSizes``: a pump's replayed batches start small and grow. Its first batch is at most
  ``FIRST_RUN`` messages, each later one twice the one before, up to the in-flight window. A
  session's first messages go out early; a long replay soon writes whole windows (one write for
  many messages, as before).
* ``ReplayTurns``: one per broker. A batch read from the store (a replay, or a session catching
  up) goes out in a turn. A session's first batch always gets its turn at once: it is small, and
  the session's CONNECT cost the loop more than it. Every later batch gets one in the order the
  pumps asked, and at most ``budget`` messages of later batches per pass of the event loop; a
  pump past that waits for the next pass, so that reads of new packets (CONNECTs, PUBLISHes,
  acks) and the rest of the loop's work come in between. With no pump waiting and budget left,
  a turn is granted at once, without a pass: a replay alone runs as without turns.

The bound this gives (docs/guarantees.md, "Reconnect storms"): a session's first replayed message
is written in the pass of the loop its pump starts in (within attach), whatever the other sessions
have queued, unless that pump must first ask a topic ACL or store its sent mark (then in the first
pass its task runs after that). Between two passes, pumps write at most ``budget`` messages of
later batches (plus at most one window, the batch of a pump granted a turn with budget left), and
the first batches of the sessions attached in that pass (``FIRST_RUN`` each).
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
        """No batch was sent yet (the next one is the session's first)."""

    def sent(self) -> None:
        """A batch went out: the next may be twice as large."""
        self.first = False
        self.next = min(self.window, self.next * 2)


class ReplayTurns:
    """Turns to send replayed batches, shared by every pump of a broker (see the module docstring).

    ``take(size, first, last)`` returns once the pump may send a batch of up to ``size`` messages
    (``last``: ``pass_id`` when this pump had its previous turn, None if never); ``try_take`` is the
    same without waiting (False: not now). A turn counts in full against its pass's budget, however
    many messages the pump then sends. A later batch is granted at once only if the budget of this
    pass is not used up, no pump waits, and this pump had no turn in this pass yet; otherwise it
    waits, and the waiting get their turns in the order they asked, those that already had one in
    the pass they asked in behind those that had not: round robin.
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
        if not waiting:
            return
        while waiting and self.used < self.budget:
            waiter, size = waiting.popleft()
            if not waiter.done():  # else cancelled, its task not yet run to leave the queue: skip it
                waiter.set_result(None)
                self.used += size
        self._arm()  # the next pass resets the budget these grants used (and serves who still waits)
