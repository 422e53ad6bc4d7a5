"""Per-session delivery pump: sends a session's queue in order within the in-flight window.

The pump is the only sender of application messages to a durable session. Packet ids
come from the queue sequence (see ``wire.packet_id_for``), entries leave the store on
PUBACK / PUBCOMP, and anything at or below ``sent_max`` goes out again with DUP set.
It knows nothing of amqtt: the connection is a ``Transport``.

Batches read from the store (a replay) are sized by ``turns.RunSizes`` (a small first one, then
growing to the window) and go out in turns of the broker's ``turns.ReplayTurns``, so that many
sessions replaying at once share the event loop (see turns.py).

SDK sessions (protocol v1, docs/protocol.md) differ in three ways: the pump holds everything
until the client is ready; it then sends the queue up to the marker point (flagged replayed),
the marker, and live messages; and every payload carries the frame with the sequence id.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from itertools import repeat
from typing import TYPE_CHECKING, Literal, Protocol

from durable_protocol import (
    FLAG_REDELIVERED,
    FLAG_REPLAYED,
    FLAG_RETAINED,
    MARKER_TOPIC,
    Marker,
    encode_frame,
    encode_marker,
)

from .errors import StoreReadError
from .store import BODY_TOPIC_FIELD, FLAG_RELEASED, FLAG_RETAIN, Body, Entry, awaiting_pubcomp
from .turns import ReplayTurns, RunSizes
from .wire import PublishRun, encode_publish, encode_pubrel, packet_id_for

if TYPE_CHECKING:
    from .sessions import DurableSession

log = logging.getLogger(__name__)

AckKind = Literal["puback", "pubrec", "pubcomp"]
READ_CHUNK = 512
READ_FIRST = 16
"""A pump with a window of REFILL_CHUNKED_FROM or more reads this many entries first (the first
message goes out sooner), then 8 times more per read up to READ_CHUNK (16, 128, 512)."""
LIVE_BUFFER = 1024
REFILL_CHUNKED_FROM = 32
READ_DECISIONS_KEPT = 10_000
READ_RETRY_FIRST = 1.0
"""Seconds before a failed read of the queue is tried again; doubled per failure up to READ_RETRY_MAX."""
READ_RETRY_MAX = 60.0


class Transport(Protocol):
    """The one connection a pump writes to (implemented by the amqtt glue)."""

    def write(self, data: bytes) -> None: ...

    async def drain(self) -> None: ...

    def expect_ack(self, kind: AckKind, packet_id: int, on_ack: Callable[[], None]) -> None: ...

    @property
    def closed(self) -> bool: ...


class ReadAccess:
    """May one connection's user read a topic? The topic ACL's decisions, asked once per topic
    and connection (a new connection asks again), so a check costs a dict lookup."""

    def __init__(self, decide: Callable[[str], Awaitable[bool]]) -> None:
        self._decide = decide
        self._known: dict[str, bool] = {}

    async def allows(self, topic: str) -> bool:
        known = self._known.get(topic)
        if known is None:
            known = await self._decide(topic)
            if len(self._known) >= READ_DECISIONS_KEPT:  # a client reading endless topics: start over
                self._known.clear()
            self._known[topic] = known
        return known


class AckRuns(Protocol):
    """What a transport that hands over acks in runs (many PUBACKs read at once) calls around a run,
    and gives every PUBACK to (``take_pubacks``: the pump then registers no callback per QoS 1 message)."""

    def begin_ack_run(self) -> None: ...

    def end_ack_run(self) -> None: ...

    def take_pubacks(self, packet_ids: list[int]) -> list[int]: ...


@dataclass(slots=True)
class Outgoing:
    """A message to send: its entry, and its body decoded (live messages) or as stored (read from
    the store: decoded only when a topic ACL or the SDK's frame needs it, see ``Pump.body``)."""

    entry: Entry
    body: Body | None
    stored: bytes | None = None

    @property
    def from_store(self) -> bool:
        """Read from the store (not live). A batch is all one or the other (``Pump._take_sendable``),
        so its first message says it for the whole batch: whether it is a replay that takes turns."""
        return self.stored is not None


def packet_seq(packet_id: int, oldest: int) -> int:
    """The sequence at or after ``oldest`` (and before ``oldest`` + 65535) whose packet id is
    ``packet_id`` (see ``wire.packet_id_for``): with fewer than 65535 sequences in flight from
    ``oldest`` on, the one in-flight entry an ack with that id can be for."""
    return oldest + (packet_id - 1 - oldest) % 65535


class Pump:
    """Sends one session's queue over one connection; a new connection gets a new pump."""

    def __init__(
        self,
        session: DurableSession,
        transport: Transport,
        window: int,
        read_access: ReadAccess | None = None,
        *,
        on_sent: Callable[[int, int], None],
        on_read_error: Callable[[str, StoreReadError, float], None],
        turns: ReplayTurns | None = None,
    ) -> None:
        self.session = session
        self._on_sent = on_sent
        """Told (sent, of which replayed) after each batch goes out: the broker's counters."""
        self._on_read_error = on_read_error
        """Told (client id, error, seconds until the retry) when a read of the queue fails."""
        self.transport = transport
        self.window = window
        self.read_access = read_access
        """None: no topic ACL; else every message is checked before it is sent, queued or live."""
        # A full window refills in chunks of a quarter (one write for many messages); small windows,
        # where that saves little, refill one by one.
        self.refill = window // 4 if window >= REFILL_CHUNKED_FROM else 1
        self._refilling = False
        self._taken_refilling = False
        """``_refilling`` as it was before ``_take_sendable`` took the latest batch: what ``_put_back``
        restores (taking a batch that fills the window sets ``_refilling``)."""
        self._read_size = READ_FIRST if window >= REFILL_CHUNKED_FROM else READ_CHUNK
        self._turns = turns
        """None: batches read from the store go out without waiting for a turn (no other pumps)."""
        self._runs = RunSizes(window)
        self._turn_pass: int | None = None
        """The turns' ``pass_id`` when this pump last had a turn."""
        self._pending: list[Outgoing] = []
        """The batch taken from the buffer and not yet written (awaiting the topic ACL, its sent mark's
        commit or its turn): not in flight and older than the buffer, so overflow's drop-oldest takes
        from it first (``drop_buffered``)."""
        self.inflight: dict[int, Outgoing] = {}
        self.buffer: deque[Outgoing] = deque()
        self.next_fill_seq = session.head_seq
        self._wake = asyncio.Event()
        self._stopped = False
        self._task: asyncio.Task[None] | None = None
        self.framed = session.record.sdk
        self.held = session.record.sdk
        self.marker_point: int | None = None
        """Set by ready: entries up to it are replayed; the marker goes once they are all sent."""
        self._marker_due = False
        self._replayed = 0
        self._replayed_first: int | None = None
        self._replayed_last: int | None = None
        self._read_failures = 0
        self._ack_run: list[Entry] | None = None
        """While a transport hands over a run of acks: the acknowledged entries, removed at its end."""
        self._publishes = PublishRun()
        self._ranged = hasattr(transport, "ack_runs")
        """The glue's transport: acks come in runs and PUBACKs to ``take_pubacks`` (see AckRuns), matched
        to the in-flight entries by packet id, with no callback registered per QoS 1 message."""
        self._stopped_ids: set[int] = set()
        """After stop: the packet ids of the QoS 1 messages then in flight, whose PUBACKs are still
        taken (and ignored) rather than passed on, as a registered callback would be."""
        if self._ranged:
            setattr(transport, "ack_runs", self)  # noqa: B010  # not part of the Transport protocol

    def begin_ack_run(self) -> None:
        """Acks that come until end_ack_run are one run: their entries leave the store in one go."""
        if self._ack_run is None:
            self._ack_run = []

    def end_ack_run(self) -> None:
        run, self._ack_run = self._ack_run, None
        if run:
            self.session.remove_entries(run)
            self._wake.set()

    def take_pubacks(self, packet_ids: list[int]) -> list[int]:
        """PUBACKs read together (called between begin_ack_run and end_ack_run): each for an in-flight
        QoS 1 message is matched by its packet id to that entry (``packet_seq``), which leaves the
        store at the run's end; returns the packet ids that were not for one, in order."""
        inflight = self.inflight
        if self._stopped or not inflight:
            ignored = self._stopped_ids
            if not ignored:
                return packet_ids
            others: list[int] = []
            for packet_id in packet_ids:
                if packet_id in ignored:
                    ignored.discard(packet_id)
                else:
                    others.append(packet_id)
            return others
        run = self._ack_run
        if run is None:  # not inside a run: remove at once (as end_ack_run would)
            self.begin_ack_run()
            try:
                return self.take_pubacks(packet_ids)
            finally:
                self.end_ack_run()
        oldest = next(iter(inflight))  # sent, so inserted, in seq order; every ack here is for one still in
        others = []
        get = inflight.get
        take = run.append
        for packet_id in packet_ids:
            seq = oldest + (packet_id - 1 - oldest) % 65535  # packet_seq, inlined
            item = get(seq)
            if item is None or item.entry.qos != 1 or not packet_id:  # 0 is no packet id (MQTT-2.3.1-1)
                others.append(packet_id)
            else:
                del inflight[seq]
                take(item.entry)
        return others

    def become_sdk(self) -> None:
        """hello on this connection: frames from now on, and nothing more until ready."""
        self.framed = True
        if self.marker_point is None:
            self.held = True

    def release(self, marker_point: int) -> None:
        self.held = False
        self.marker_point = marker_point
        self._marker_due = True
        self._wake.set()

    def start(self) -> None:
        """Send the first batch now if it needs no wait (see ``_send_first``), then the rest from a task."""
        self._send_first()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"durable-pump-{self.session.client_id}")

    def _send_first(self) -> None:
        """The first batch, written at once (the first replayed message goes out before amqtt sets up
        its message loop) when nothing in it has to be awaited: no topic ACL to ask, its sent mark
        already stored (attach's commit wrote it), the connection open. Otherwise, or when the read
        fails, the task sends it as every later batch."""
        if self.held or self.read_access is not None or self.transport.closed:
            return
        try:
            self._fill_from_store()
        except StoreReadError:
            return  # the task reads again, and reports and waits if it fails again
        batch = self._take_sendable()
        if not batch:
            return
        turns = self._turns
        if batch[-1].entry.seq > self.session.stored_mark or (
            turns is not None and batch[0].from_store and not turns.try_take(len(batch), self._runs.first)
        ):
            # its mark must be stored first (or, not its first batch, it waits for a turn): the task does it
            self._put_back(batch)
            return
        if turns is not None and batch[0].from_store:
            self._turn_pass = turns.pass_id
        self._write_batch(batch)

    async def stop(self) -> None:
        """Stop sending; acks arriving later are ignored, so unacked entries go out again on the
        session's current connection (DUP-flagged) instead of being removed twice."""
        self.end_ack_run()  # acks already taken still count
        if self._ranged and not self._stopped:  # a second stop (a take-over's) finds nothing in flight
            self._stopped_ids = {packet_id_for(seq) for seq, item in self.inflight.items() if item.entry.qos == 1}
        self._stopped = True
        self.inflight.clear()
        self._wake.set()
        if self._task is not None and self._task is not asyncio.current_task():
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    def drop_buffered(self, droppable: Callable[[Entry], bool]) -> Entry | None:
        """Take the oldest buffered entry ``droppable`` allows out of the batch about to be written
        (older than the buffer's, see ``_pending``) or the buffer, for overflow's drop-oldest; None
        when there is none. In-flight entries are not in the buffer."""
        for queued in (self._pending, self.buffer):
            for index, item in enumerate(queued):
                if droppable(item.entry):
                    del queued[index]
                    return item.entry
        return None

    @property
    def next_unread(self) -> int:
        """The first sequence this pump has not read from the store yet."""
        return self.next_fill_seq

    def skip_to(self, seq: int) -> None:
        """Entries before ``seq`` that are not read yet are gone: reading starts at ``seq``."""
        self.next_fill_seq = seq

    def offer_live(self, entry: Entry, body: Body) -> None:
        """A just-committed entry: keep it in memory if it is next in line, else it is read later."""
        if entry.seq == self.next_fill_seq and len(self.buffer) < LIVE_BUFFER:
            self.buffer.append(Outgoing(entry, body))
            self.next_fill_seq = entry.seq + 1
        self._wake.set()

    async def _run(self) -> None:
        try:
            await self._deliver()
        except asyncio.CancelledError:
            raise
        except (ConnectionError, OSError) as exc:
            log.info("delivery to %s ended with the connection: %s", self.session.client_id, exc)
        except Exception:
            log.exception(
                "delivery to %s stopped by an internal error; it starts again when the client reconnects",
                self.session.client_id,
            )

    async def _deliver(self) -> None:
        while not self._stopped and not self.transport.closed:
            batch = await self._next_batch()
            if batch is None:
                continue
            if batch:
                await self._send(batch)
                continue
            if self._marker_due and self._replay_sent():
                self._send_marker()
                continue
            # Nothing can go out now; every state change that could alter that sets _wake.
            self._wake.clear()
            await self._wake.wait()

    async def _next_batch(self) -> list[Outgoing] | None:
        """What may go out now: [] when nothing may, None when the pump should look again (a read
        failed and was waited out, or it waited for the turns' next pass)."""
        if self.held:
            return []
        turns = self._turns
        if turns is not None and self._turn_pass == turns.pass_id and self._store_next():
            # One turn per pass: wait for the next before taking the batch, which can then be larger
            # (acks come meanwhile); taken now it would wait for its turn as it is.
            await turns.next_pass()
            return None
        if len(self.buffer) < self._runs.next:  # a batch cut short by the end of a read would leave a
            try:  # pass between it and the rest, and the rest would wait for its sent mark's commit
                self._fill_from_store()
            except StoreReadError as exc:
                if not self.buffer:  # else what is read already goes first, and the read is tried again
                    await self._retry_later(exc)
                    return None
        return self._take_sendable()

    async def _retry_later(self, exc: StoreReadError) -> None:
        """A read of the queue failed: say so, count it, and try again after a growing pause.

        Nothing is skipped: the session's delivery waits at the damaged entry, and a repair of the
        store (broker stopped) is what gets past it.
        """
        self._read_failures += 1
        delay = min(READ_RETRY_MAX, READ_RETRY_FIRST * 2 ** min(self._read_failures - 1, 10))
        self._on_read_error(self.session.client_id, exc, delay)
        await asyncio.sleep(delay)

    async def _drop_unreadable(self, batch: list[Outgoing]) -> bool:
        """Drop (counted) the messages of ``batch`` the connection's user may not read, in place;
        False when the pump was interrupted meanwhile (``_interrupted``: nothing dropped).

        The ACL is asked per topic first, and ``batch`` filtered after every answer came: while
        it waits, overflow's drop-oldest may take from it (it is ``_pending``). A PUBREL (RELEASED
        entry) carries no message and always goes.
        """
        assert self.read_access is not None
        allows = self.read_access.allows
        topics = dict.fromkeys(self.body(item).topic for item in batch if not awaiting_pubcomp(item.entry))
        refused = {topic for topic in topics if not await allows(topic)}
        if self._interrupted(batch):
            return False
        if refused:
            kept: list[Outgoing] = []
            unreadable: list[Entry] = []
            for item in batch:
                if awaiting_pubcomp(item.entry) or self.body(item).topic not in refused:
                    kept.append(item)
                else:
                    unreadable.append(item.entry)
            batch[:] = kept  # first: a batch put back (``_send``) holds no entry already removed
            for entry in unreadable:
                self.session.drop_unreadable(entry)
        return True

    def _fill_from_store(self) -> None:
        tail = self.session.committed_tail
        if self.next_fill_seq > tail:
            return
        entries, bodies, last_read = self.session.read_stored(self.next_fill_seq, tail, self._read_size)
        self._read_size = min(READ_CHUNK, self._read_size * 8)
        self._read_failures = 0
        inflight = self.inflight
        if not inflight:
            self.buffer.extend(map(Outgoing, entries, repeat(None), bodies))
        else:
            append = self.buffer.append
            for entry, stored in zip(entries, bodies, strict=True):
                if entry.seq not in inflight:
                    append(Outgoing(entry, None, stored))
        self.next_fill_seq = tail + 1 if last_read is None else last_read + 1

    def _store_next(self) -> bool:
        """Is the next batch (if any) read from the store?"""
        if self.buffer:
            return self.buffer[0].from_store
        return self.next_fill_seq <= self.session.committed_tail

    def _put_back(self, batch: list[Outgoing]) -> None:
        """Undo ``_take_sendable`` (``_refilling`` as it was before, so that the batch, taken again,
        does not wait for acks it did not need): what is left of the batch waits in the buffer. Every
        batch taken and not written comes back through here."""
        self.buffer.extendleft(reversed(batch))
        self._refilling = self._taken_refilling

    def _take_sendable(self) -> list[Outgoing]:
        """The next batch: within the window, and a replayed one (read from the store) at most the
        run size (``RunSizes``). Live entries and entries read from the store (after them in the
        buffer once the live buffer overflowed) never share a batch."""
        batch: list[Outgoing] = []
        count = len(self.inflight)
        self._taken_refilling = self._refilling
        if self._refilling and self.window - count < self.refill:
            return batch
        self._refilling = False
        if not self.buffer:
            return batch
        replay = self.buffer[0].from_store
        limit = self._runs.next if replay else self.window
        oldest = next(iter(self.inflight)) if count else None  # sent, so inserted, in seq order
        point = self.marker_point if self._marker_due else None
        while self.buffer:
            item = self.buffer[0]
            if point is not None and item.entry.seq > point:
                break  # the marker goes first
            if item.from_store is not replay:
                break  # a batch is all live or all read from the store: only the latter take turns
            if item.entry.qos:
                if count >= self.window or (oldest is not None and item.entry.seq >= oldest + self.window):
                    self._refilling = True
                    break
                count += 1
                if oldest is None:
                    oldest = item.entry.seq
            batch.append(self.buffer.popleft())
            if len(batch) >= limit:
                break
        return batch

    def _replay_sent(self) -> bool:
        """Has everything up to the marker point been written (the marker may follow)?"""
        point = self.marker_point
        assert point is not None
        if self.buffer:
            return self.buffer[0].entry.seq > point
        return self.next_fill_seq > point

    def _send_marker(self) -> None:
        self._marker_due = False
        marker = Marker(
            epoch=self.session.sid,
            replayed=self._replayed,
            first_seq=self._replayed_first,
            last_seq=self._replayed_last,
            live=self.session.live_subscriptions(),
        )
        payload = encode_marker(marker)
        self.transport.write(encode_publish(MARKER_TOPIC.encode(), payload, 0, 0, dup=False, retain=False))

    @staticmethod
    def body(item: Outgoing) -> Body:
        """The message's body, decoded (once) if it was read from the store."""
        body = item.body
        if body is None:
            assert item.stored is not None
            body = item.body = Body.decode(item.stored)
        return body

    def _payload(self, item: Outgoing, dup: bool) -> bytes:
        body = self.body(item)
        if not self.framed:
            return body.payload
        entry = item.entry
        flags = FLAG_REDELIVERED if dup else 0
        if entry.flags & FLAG_RETAIN:
            flags |= FLAG_RETAINED
        if self._marker_due and self.marker_point is not None and entry.seq <= self.marker_point:
            flags |= FLAG_REPLAYED
            self._replayed += 1
            if self._replayed_first is None:
                self._replayed_first = entry.seq
            self._replayed_last = entry.seq
        return encode_frame(flags, self.session.sid, entry.seq, body.published_at) + body.payload

    async def _send(self, batch: list[Outgoing]) -> None:
        """Write ``batch`` once what it awaits is done (``_prepare``). Meanwhile it is ``_pending``,
        where drop-oldest sees it; a stop's cancel, or an error (a topic ACL plugin raising), puts
        what is left of it back in the buffer, where drop-oldest still finds it until the pump goes."""
        self._pending = batch
        try:
            ready = await self._prepare(batch)
        except BaseException:
            # Not put back yet: ``_interrupted``, which puts it back, is the last step of _prepare.
            self._put_back(batch)
            raise
        finally:
            self._pending = []
        if ready:
            self._write_batch(batch)
            await self.transport.drain()

    async def _prepare(self, batch: list[Outgoing]) -> bool:
        """Ask the topic ACL, store the sent mark past ``batch`` and, for a batch read from the store,
        take its turn, in that order (the turn right before the write, see ``_take_turn``). False
        when nothing is to be written now: overflow dropped the whole batch, or the pump was
        interrupted (``_interrupted``: the batch is back in the buffer)."""
        if self.read_access is not None and not await self._drop_unreadable(batch):
            return False
        if batch and batch[-1].entry.seq > self.session.stored_mark:
            await self.session.advance_sent_mark(batch[-1].entry.seq, self.window)
            if self._interrupted(batch):
                return False
        turns = self._turns
        if batch and turns is not None and batch[0].from_store:
            return await self._take_turn(turns, batch)
        return bool(batch)

    def _interrupted(self, batch: list[Outgoing]) -> bool:
        """Checked after each await of a batch not yet written: True when the pump stopped, the
        connection closed, or an SDK hello now holds the pump; the batch is then back in the buffer
        (after ready it goes out framed, with the replayed flag, before the marker)."""
        if self._stopped or self.transport.closed or self.held:
            self._put_back(batch)
            return True
        return False

    async def _take_turn(self, turns: ReplayTurns, batch: list[Outgoing]) -> bool:
        """A batch read from the store goes out in a turn (turns.py), taken after every other await
        (the topic ACL, the sent mark's commit): granted at once, or in a pass the task resumes from
        in the next, it is written before the budget it counts in starts again, and the turn counts
        no fewer messages than are written (drop-oldest may take from the batch while it waits).
        Only the pump's first write may be a first batch (``RunSizes.first``): the one at attach.
        False as ``_prepare``."""
        if turns.try_take(len(batch), self._runs.first, self._turn_pass):
            self._turn_pass = turns.pass_id
            return True
        await turns.take(len(batch), self._runs.first, self._turn_pass)
        self._turn_pass = turns.pass_id
        return not self._interrupted(batch) and bool(batch)

    def _write_batch(self, batch: list[Outgoing]) -> None:
        """Write ``batch`` (its sent mark stored): PUBLISHes (PUBRELs of released QoS 2 ones) in one
        write, QoS 1 and 2 ones in flight from now, QoS 0 ones removed."""
        session = self.session
        run = self._publishes
        add_stored = run.add_stored
        inflight = self.inflight
        plain = not self.framed
        per_ack = not self._ranged
        sent_max = session.sent_max
        replay_upto = session.replay_upto
        replayed = 0
        qos0: list[Entry] = []
        for item in batch:
            entry = item.entry
            seq = entry.seq
            qos = entry.qos
            dup = qos > 0 and seq <= sent_max
            if seq <= replay_upto:
                replayed += 1
            packet_id = seq % 65535 + 1  # packet_id_for, inlined
            stored = item.stored
            if qos == 2 and entry.flags & FLAG_RELEASED:  # awaiting_pubcomp(entry), inlined
                run.add_raw(encode_pubrel(packet_id))
            elif plain and stored is not None:  # as stored: no decoding
                add_stored(stored, BODY_TOPIC_FIELD, qos, packet_id, dup=dup, retain=bool(entry.flags & FLAG_RETAIN))
            else:
                payload = self._payload(item, dup)
                run.add(self.body(item).topic, payload, qos, packet_id, dup=dup, retain=bool(entry.flags & FLAG_RETAIN))
            if qos:
                inflight[seq] = item
                if qos > 1 or per_ack:  # QoS 1 acks of the glue's transport come to take_pubacks
                    self._expect(item)
            else:
                qos0.append(entry)
        highest = batch[-1].entry.seq
        session.sent_max = max(sent_max, highest)
        self.transport.write(run.take())
        self._runs.sent(replayed=batch[0].from_store)
        if batch[0].from_store and session.sent_mark < highest + self.window:
            # A replay (the batch was read from the store): the next batch may reach a window past
            # this one, so its mark goes with the write the acks of this batch ask for, and it need
            # not wait for a commit of its own (one mark per batch). Live entries need none: each
            # one's batch raises the mark a window past it when it passes the mark (append).
            session.mark_ahead(highest + self.window)
        for entry in qos0:
            session.remove_entry(entry)
        self._on_sent(len(batch), replayed)

    def _expect(self, item: Outgoing) -> None:
        entry = item.entry
        packet_id = packet_id_for(entry.seq)
        if entry.qos == 1:
            self.transport.expect_ack("puback", packet_id, lambda: self._acked(entry.seq))
        elif awaiting_pubcomp(entry):
            self.transport.expect_ack("pubcomp", packet_id, lambda: self._acked(entry.seq))
        else:
            self.transport.expect_ack("pubrec", packet_id, lambda: self._received(entry.seq))

    def _received(self, seq: int) -> None:
        item = self.inflight.get(seq)
        if item is None or self._stopped:  # not ``closed``: a PUBREC read with the close counts too
            return
        item.entry.flags |= FLAG_RELEASED
        stored = self.session.mark_released(item.entry)
        if stored is not None:  # PUBREL once the PUBREC is stored (MQTT-4.3.3: never the PUBLISH again)
            stored.add_done_callback(lambda written: self._release(seq, written))

    def _release(self, seq: int, written: asyncio.Future[None]) -> None:
        if written.cancelled() or written.exception() is not None:
            return  # not stored (a demotion, the store closing): the connection ends, nothing is owed
        if seq not in self.inflight or self._stopped or self.transport.closed:
            return  # the next connection sends the PUBREL (the entry is stored released)
        packet_id = packet_id_for(seq)
        self.transport.expect_ack("pubcomp", packet_id, lambda: self._acked(seq))
        self.transport.write(encode_pubrel(packet_id))

    def _acked(self, seq: int) -> None:
        item = self.inflight.pop(seq, None)
        if item is None or self._stopped:
            return
        if self._ack_run is not None:
            self._ack_run.append(item.entry)
            return
        self.session.remove_entry(item.entry)
        self._wake.set()
