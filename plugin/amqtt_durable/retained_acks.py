"""The acks (PUBACK, PUBREC, PUBCOMP) a clean connection owes for the QoS 1/2 messages amqtt's
side sends it (the retained messages its SUBSCRIBEs brought, and live ones), as a table of packet
ids, not amqtt's task of about 3 KB per message, which gave a message up 5 s after its write (a
QoS 2 one then got no PUBREL, so its client never delivered it) though the ack could sit unread
behind a reader paused by its bound on pipelined requests, or in a client that reads late. On the
plugin's reader a wait ends only with its ack or the connection (MQTT 3.1.1 has no ack timeout);
on amqtt's own loop 5 s after its write, as amqtt's did. Pure logic; amqtt_glue.py feeds it."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable, Container

from .delivery import AckKind

ACK_TIMEOUT = 5.0
"""Seconds a client has to acknowledge a message on amqtt's own loop (amqtt's ack timeout)."""
MAX_RETAINED_ACKS = 4096
"""Retained waits of one connection at which its message loop sends no more retained messages
until half that are done, while its reader reads (``room``). Looked at once per filter of a
SUBSCRIBE (amqtt sends each filter's in turn): 4,095 plus one filter's matches may wait. Live
waits do not count (``max_pending_clean`` bounds them)."""
MAX_PACKET_ID = 65535


HELD_LOOKS = 8
"""Ids set aside as held (``PacketIds``) looked at again per take, once no other id is free."""


REUSE_AFTER = 32
"""Ids given back that a connection keeps before it takes them again instead of ids never given."""


class PacketIds:
    """Free packet ids: those never given while fewer than REUSE_AFTER acknowledged ones were given
    back, then those, oldest first, so a connection holds at most its most in flight at once plus
    REUSE_AFTER ids given back (all 65,535, some 2.4 MB, once a long-lived one had sent that many
    when ids never given went first), and an id given back goes behind REUSE_AFTER - 1 others.
    The id of a wait given up (amqtt's own loop, 5 s after the write: its ack may still come) is
    taken only once no other is free, so a late ack does not meet a newer message. amqtt's
    ``next_packet_id`` scanned up to all 65,535 per message (18.6 ms near a full table, the event
    loop held). An id met still held by amqtt (``taken``: the session's ``inflight_out``; the
    client's own ids are another set, MQTT 3.1.1 section 2.3.1) is set aside, out of the FIFO, so
    it is looked at once per hold, not at every take; the set-aside ones are looked at again, at
    most HELD_LOOKS per take, only once no other id is free. A take thus looks at one id, plus
    those it sets aside, plus at most HELD_LOOKS."""

    def __init__(self, most: int = MAX_PACKET_ID) -> None:
        self._most = most
        self._fresh = 1
        """The lowest id never given."""
        self._back: deque[int] = deque()
        """Ids given back, acknowledged."""
        self._given_up: deque[int] = deque()
        """Ids of waits given up, taken last."""
        self._held: deque[int] = deque()
        """Ids met while amqtt held them."""

    def take(self, taken: Container[int] = ()) -> int | None:
        """A free id not in ``taken``, or None when none is. An id given back (a wait given up on
        amqtt's loop, whose ack may still come) is not the next one sent."""
        while True:  # bounded: each id met held leaves the FIFO
            if self._back and (len(self._back) >= REUSE_AFTER or self._fresh > self._most):
                packet_id = self._back.popleft()
            elif self._fresh <= self._most:
                packet_id = self._fresh
                self._fresh += 1
            elif self._given_up:
                packet_id = self._given_up.popleft()
            else:
                break
            if packet_id not in taken:
                return packet_id
            self._held.append(packet_id)
        for _ in range(min(HELD_LOOKS, len(self._held))):
            packet_id = self._held.popleft()
            if packet_id not in taken:
                return packet_id
            self._held.append(packet_id)
        return None

    def give_back(self, packet_id: int, given_up: bool = False) -> None:
        (self._given_up if given_up else self._back).append(packet_id)


class RetainedAcks:
    """A connection's messages awaiting their acks: packet id -> (the ack awaited, its deadline,
    retained or live), in the order of their deadlines. Their ids come from ``ids`` and go back to
    it as their waits end. ``expired`` is called for a wait given up at its deadline (amqtt's own
    loop only: ``never_expire``); a wait's ``finished``, once it ends whichever way."""

    def __init__(
        self,
        expired: Callable[[int, AckKind], None],
        timeout: float = ACK_TIMEOUT,
        most: int = MAX_RETAINED_ACKS,
        ids: PacketIds | None = None,
    ) -> None:
        self._expired = expired
        self._timeout: float | None = timeout
        self._most = most
        self.ids = PacketIds() if ids is None else ids
        self._waits: dict[int, tuple[AckKind, float, bool]] = {}
        """By packet id, in the order of their deadlines (a wait moved to its next ack goes last)."""
        self._retained = 0
        """Waits of retained messages (``room`` counts these only)."""
        self._finished: dict[int, Callable[[], None]] = {}
        self._timer: asyncio.TimerHandle | None = None
        self._room = asyncio.Event()
        self._room.set()
        self._reader_paused = False
        self._ending = False
        """The connection's end began: ``room`` waits for nothing any more."""
        self.stopped = False

    def never_expire(self) -> None:
        """The plugin's reader reads this connection: a wait ends only with its ack or the end."""
        self._timeout = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    @property
    def expires(self) -> bool:
        return self._timeout is not None

    def __len__(self) -> int:
        return len(self._waits)

    def awaits(self, packet_id: int, kind: AckKind) -> bool:
        entry = self._waits.get(packet_id)
        return entry is not None and entry[0] == kind

    def send(
        self, kind: AckKind, retained: bool, finished: Callable[[], None] | None, taken: Container[int] = ()
    ) -> int | None:
        """A free packet id (none in ``taken``), its ``kind`` awaited; None, nothing awaited, once
        stopped or with no id free."""
        packet_id = None if self.stopped else self.ids.take(taken)
        if packet_id is None:
            return None
        if finished is not None:
            self._finished[packet_id] = finished
        self._retained += retained
        self._waits[packet_id] = (kind, 0.0, retained)
        self.wait(packet_id, kind)
        if self._retained >= self._most and not (self._reader_paused or self._ending):
            self._room.clear()
        return packet_id

    def wait(self, packet_id: int, kind: AckKind) -> bool:
        """Awaits ``kind`` for ``packet_id``'s message (a PUBCOMP replaces the PUBREC its PUBREL
        answers; on amqtt's loop, waiting again restarts its ``timeout``, as once its write is
        done); False unless it awaits an ack."""
        entry = self._waits.pop(packet_id, None)
        if entry is None:
            return False
        loop = asyncio.get_running_loop()
        deadline = 0.0 if self._timeout is None else loop.time() + self._timeout
        self._waits[packet_id] = (kind, deadline, entry[2])
        if self._timeout is not None and self._timer is None:
            self._timer = loop.call_at(deadline, self._expire)
        return True

    def done(self, packet_id: int, given_up: bool = False) -> None:
        """Its last ack came (or its send failed, or its wait ended, ``given_up``): its id is free again."""
        entry = self._waits.pop(packet_id, None)
        if entry is None:
            return
        self.ids.give_back(packet_id, given_up)
        if entry[2]:
            self._retained -= 1
            if self._retained <= self._most // 2:
                self._room.set()
        finished = self._finished.pop(packet_id, None)
        if finished is not None:
            finished()

    def _expire(self) -> None:
        """Ends the waits past their deadline (amqtt's own loop)."""
        self._timer = None
        if self._timeout is None:
            return
        loop = asyncio.get_running_loop()
        now = loop.time()
        due: list[tuple[int, AckKind]] = []
        for packet_id, (kind, deadline, _) in self._waits.items():
            if deadline > now:
                break
            due.append((packet_id, kind))
        for packet_id, kind in due:
            self.done(packet_id, given_up=True)
            self._expired(packet_id, kind)
        if self._waits and self._timer is None:
            self._timer = loop.call_at(next(iter(self._waits.values()))[1], self._expire)

    def reader_paused(self, paused: bool) -> None:
        """The reader pauses or reads on: while paused, ``room`` waits for nothing: the acks it
        would wait for sit behind the paused read, which waits for the message loop."""
        self._reader_paused = paused
        if paused:
            self._room.set()
        elif self._retained >= self._most and not self._ending:
            self._room.clear()

    def ending(self) -> None:
        """The connection's end began (its reader read to the end, a DISCONNECT, a take-over,
        ``stop()``): ``room`` waits for nothing from now on, so the message loop applies the changes
        the end waits for (their SUBACKs) instead of waiting for acks that will not come."""
        self._ending = True
        self._room.set()

    async def room(self) -> None:
        """Until fewer than ``most`` retained messages wait, or at most half once that many did, or
        the reader pauses, or the connection's end began (``ending``)."""
        await self._room.wait()

    def stop(self) -> list[tuple[int, AckKind]]:
        """At the connection's end nothing awaits an ack: the waits there were, for the glue to free."""
        self.stopped = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None
        waits = [(packet_id, kind) for packet_id, (kind, _, _) in self._waits.items()]
        self._waits.clear()
        self._retained = 0
        self._room.set()
        finished, self._finished = self._finished, {}
        for then in finished.values():
            then()
        return waits
