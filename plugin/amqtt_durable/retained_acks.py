"""The acks (PUBACK, PUBREC, PUBCOMP) a clean connection owes for the QoS 1/2 messages amqtt's
side sends it (the retained messages its SUBSCRIBEs brought, and live ones), as a table of packet
ids, not a task per message. amqtt's flow awaited each
ack in a task of about 3 KB for 5 s and then gave the message up (a QoS 2 one got no PUBREL, so
its client never delivered it); a client that pipelines its SUBSCRIBEs sends those acks behind
the rest of them, which a reader paused by its bound on pipelined requests (or one behind on a
busy machine) reads seconds later. Here a wait ends unacknowledged only once the reader has
read all its client sent and the client received all written to it (``caught_up``), at least
``timeout`` seconds after the write: the ack's absence then says the client did not send it.
Pure logic; amqtt_glue.py feeds it."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from .delivery import AckKind

ACK_TIMEOUT = 5.0
"""Seconds a client has to acknowledge a retained message (amqtt's own ack timeout)."""
RECHECK = 0.5
"""Seconds between two looks at whether the reader caught up, while a due wait waits for it."""
MAX_RETAINED_ACKS = 4096
"""Waits of one connection at which its message loop sends no more retained messages until half
that are done, while its reader reads (``room``). Looked at once per SUBSCRIBE: 4,095 plus one
SUBSCRIBE's matches may wait."""


def _always() -> bool:
    return True


class RetainedAcks:
    """A connection's messages awaiting their acks: packet id -> (the ack awaited, its deadline),
    in the order of their deadlines, one timer for the earliest. ``expired`` is called for a wait
    that ends unacknowledged (the glue frees its packet id); a wait's ``finished``, once it ends
    whichever way."""

    def __init__(
        self,
        expired: Callable[[int, AckKind], None],
        timeout: float = ACK_TIMEOUT,
        recheck: float = RECHECK,
        most: int = MAX_RETAINED_ACKS,
    ) -> None:
        self._expired = expired
        self._timeout = timeout
        self._recheck = recheck
        self._most = most
        self._waits: dict[int, tuple[AckKind, float]] = {}
        """By packet id, in the order of their deadlines (a wait moved to its next ack goes last)."""
        self._finished: dict[int, Callable[[], None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._reader_paused = False
        self.stopped = False
        self.caught_up: Callable[[], bool] = _always
        """Whether the connection's reader has read all its client sent (the plugin's reader sets
        it; on amqtt's own loop, which reads all the time, a wait ends ``timeout`` after its write)."""

    @property
    def watches_reader(self) -> bool:
        """Whether a wait ends only with ``caught_up`` (the plugin's reader), not at its deadline."""
        return self.caught_up is not _always

    def __len__(self) -> int:
        return len(self._waits)

    def awaits(self, packet_id: int, kind: AckKind) -> bool:
        entry = self._waits.get(packet_id)
        return entry is not None and entry[0] == kind

    def wait(self, packet_id: int, kind: AckKind, finished: Callable[[], None] | None = None) -> bool:
        """Awaits ``kind`` for ``packet_id`` for ``timeout`` seconds from now (a PUBCOMP replaces
        the PUBREC its PUBREL answers; waiting again for the same ack restarts its time, as once
        its write is done); False once stopped: nothing is awaited past the end."""
        if self.stopped:
            return False
        if finished is not None:
            self._finished[packet_id] = finished
        loop = asyncio.get_running_loop()
        self._waits.pop(packet_id, None)
        self._waits[packet_id] = (kind, loop.time() + self._timeout)
        if self._timer is None:
            self._timer = loop.call_at(loop.time() + self._timeout, self._expire)
        if len(self._waits) >= self._most and not self._reader_paused:
            self._room.clear()
        return True

    def done(self, packet_id: int) -> None:
        """Its last ack came (or its send failed, or its wait ended)."""
        if self._waits.pop(packet_id, None) is not None and len(self._waits) <= self._most // 2:
            self._room.set()
        finished = self._finished.pop(packet_id, None)
        if finished is not None:
            finished()

    def _expire(self) -> None:
        """Ends the waits past their deadline, once the reader caught up (looked at again every
        ``recheck`` seconds until it has): until it has read all its client sent, the ack may be
        among what it has not read."""
        self._timer = None
        loop = asyncio.get_running_loop()
        now = loop.time()
        first = next(iter(self._waits.values()), None)
        if first is not None and first[1] <= now and not self.caught_up():
            self._timer = loop.call_at(now + self._recheck, self._expire)
            return
        due: list[tuple[int, AckKind]] = []
        for packet_id, (kind, deadline) in self._waits.items():
            if deadline > now:
                break
            due.append((packet_id, kind))
        for packet_id, kind in due:
            self.done(packet_id)
            self._expired(packet_id, kind)
        if self._waits and self._timer is None:
            self._timer = loop.call_at(next(iter(self._waits.values()))[1], self._expire)

    def reader_paused(self, paused: bool) -> None:
        """The reader pauses or reads on: while paused, ``room`` waits for nothing (the acks it
        would wait for sit behind the paused read, which waits for the message loop)."""
        self._reader_paused = paused
        if paused:
            self._room.set()
        elif len(self._waits) >= self._most:
            self._room.clear()

    async def room(self) -> None:
        """Until fewer than ``most`` wait, or at most half once that many did, or the reader pauses."""
        await self._room.wait()

    def stop(self) -> list[tuple[int, AckKind]]:
        """At the connection's end nothing awaits an ack: the waits there were, for the glue to free."""
        self.stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waits = [(packet_id, kind) for packet_id, (kind, _) in self._waits.items()]
        self._waits.clear()
        self._room.set()
        finished, self._finished = self._finished, {}
        for then in finished.values():
            then()
        return waits
