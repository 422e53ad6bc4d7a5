"""The primary's end of the replication channel: ship every batch to each backup, in order.

Backups connect to the primary (so a backup follows whichever node holds the lease); each
connection is served by one sender task and one ack reader. A new connection is first
caught up (log.plan_catch_up: the retained log, or a LevelDB snapshot streamed in chunks
while the primary keeps committing, then the batches since); once the sender has reached
the newest batch, and the backup acknowledged the snapshot's batch if it was sent one, it
tells the backup IN_SYNC and the backup counts for sync replication.

The sync-mode contract (XAP's sync replication): the future ``committed`` returns resolves
(``ship``'s callback is called) once every backup that is connected and in sync acknowledged
the batch (applied it, and synced it when its broker's ``sync`` is true). A backup that drops
out, or stays silent past ``ack_timeout`` with batches outstanding, is disconnected and no
longer counted, so one dead backup does not stop the primary; it is caught up again when it
comes back. One not in sync yet whose connection takes no byte for ``catch_up_timeout`` while
its sender waits to write to it is disconnected too, so a peer that asked for a snapshot and
reads nothing does not hold the LevelDB snapshot and the retained batches for ever. The order
of a commit (store.GroupCommitter through replication/commits.py)::

    prepared = primary.prepare(ops)        # numbers the batch, adds the position op
    write prepared.ops locally             # a retried write reuses the same prepared batch
    future = primary.committed(prepared)   # retained, shipped; sync mode acks after the future
    # or primary.ship(prepared, then): then(None) in the loop pass that learns the backups have it
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import ssl
import struct
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from ..admission import NameBudgets
from ..settings import LISTEN_BACKLOG
from .auth import AuthError, Session, server_handshake
from .errors import FrameError, FrameMacError, ReplicationError, channel_ended
from .framing import (
    MAX_PEER_FRAME,
    NAME_IN_USE,
    TOO_MANY_BACKUPS,
    Frame,
    Hello,
    Op,
    decode_seq,
    encode_batch,
    encode_ops,
    encode_position,
    encode_seq,
    unsupported_version,
)
from .gate import HandshakeGate
from .log import RetainedLog, plan_catch_up
from .position import SNAPSHOT_MARK_KEY, position_op, read_position
from .threads import in_thread
from .tool import join_address

log = logging.getLogger("amqtt_durable.replication")

Shipped = Callable[[BaseException | None], None]
"""What ``ship`` calls with the outcome of a batch: None, every in-sync backup has it; an error, none will."""
LinkState = Literal["snapshot", "catching_up", "in_sync"]
"""What STATUS, inspect and $SYS show of a backup (docs/replication.md, Watching it): a link exists
from its HELLO on, so it is catching up from then until a snapshot starts or it is in sync."""
HELLO_TIMEOUT = 10.0
HIGH_WATER = 4 * 1024 * 1024
"""Bytes buffered towards a backup before the sender waits for the socket to drain."""
KEEPALIVE = (10, 5, 3)
"""TCP keepalive on a backup's connection (seconds idle, seconds between probes, probes): a
backup whose machine or path died without closing its connection (no FIN, no RST) is found
dead about 25 s after the connection's last traffic, even while no batch is sent, and its name
is free again for the same backup restarted, or a replacement under that name."""
USER_TIMEOUT_MS = (KEEPALIVE[0] + KEEPALIVE[1] * KEEPALIVE[2]) * 1000
"""TCP_USER_TIMEOUT on an in-sync backup's connection (milliseconds, keepalive's total): keepalive
never probes a connection with data in flight (unacknowledged batches), whose retransmissions
would run for up to about 15 minutes (tcp_retries2); with it the kernel ends such a connection
once data sent stays unacknowledged this long, and the backup's name is free. Not set during a
snapshot or a catch-up (0 again when an in-sync backup falls behind): a slow backup may keep
its receive window closed longer than this while it applies a queue of snapshot chunks, and a
cut snapshot starts again from the beginning."""
TCP_INFO_SIZE, TCP_INFO_BYTES_ACKED = 128, 120
"""Linux's ``struct tcp_info``: the bytes read of it, and the offset of ``tcpi_bytes_acked`` (u64,
since Linux 4.1): the bytes of a connection its peer's TCP acknowledged."""
WATCHDOG_MIN = 0.01
"""Shortest pause of the watchdog between two looks (a quarter of the smaller of ack_timeout and
catch_up_timeout), so tiny timeouts do not make it spin."""
NAME_LOG_EVERY = 60.0
"""Seconds between two lines about refusals of one backup name, for the name or for max_backups
(a refused backup retries every few seconds: the refusals in between are counted in the next line)."""
CAP_LINE = "refusals of this name for the cap are logged at most once a minute"
"""Ends the primary's WARNING for a backup refused for max_backups (then the count left out)."""
REFUSED_NAMES = 256
"""Backup names whose last refusal line is remembered, for each kind of refusal (the least recently
refused forgotten first): names a stranger makes up cannot grow it."""


@dataclass(slots=True)
class WriteStall:
    """How long the primary's writes to one backup have waited with no byte taken by its connection
    (replication.catch_up_timeout). The sender calls ``blocked`` as it starts waiting for the socket
    to drain and ``unblocked`` when the wait returns; the watchdog calls ``stalled`` with the
    connection's progress mark (``sent_mark``), and any change of the mark restarts the clock: a
    backup on a slow link that keeps taking bytes is never stalled, however long one wait lasts
    (one wait lasts until a whole chunk, 1 MiB, left the buffers)."""

    since: float | None = None
    """When the current wait started or last saw progress; None: the sender is not waiting."""
    mark: int = 0
    """The progress mark seen then."""

    def blocked(self, now: float, mark: int) -> None:
        self.since, self.mark = now, mark

    def unblocked(self) -> None:
        self.since = None

    def stalled(self, now: float, mark: int) -> float:
        """Seconds the current wait has gone without progress (0.0 when the sender is not waiting)."""
        if self.since is None:
            return 0.0
        if mark != self.mark:
            self.since, self.mark = now, mark
        return now - self.since


@dataclass(slots=True, eq=False)
class BackupLink:
    """The primary's view of one connected backup (shown by inspect and $SYS)."""

    name: str
    peer: str
    state: LinkState = "catching_up"
    instance: int = 0
    """The backup's broker process (its HELLO; 0: an earlier version's, which does not say)."""
    sent_seq: int = 0
    acked_seq: int = 0
    acks: int = 0
    """ACK frames received on this connection (a snapshot at batch 0 is acknowledged with 0, the
    ``acked_seq`` it starts from)."""
    reason: str = ""
    """Why it is caught up the way it is (the catch-up plan's reason)."""
    snapshot_rows: int = 0
    in_sync_at: int = 0
    """The newest batch when it became in sync."""
    last_progress: float = field(default_factory=time.monotonic)
    """When it last acknowledged, or when it got work while it had none outstanding."""
    writer: asyncio.StreamWriter | None = None
    session: Session = field(default_factory=Session)
    """The connection's frames (with replication.secret: each one MACed, auth.Session)."""
    live: bool = False
    """In sync, sent everything, and its socket not backed up: ``ship`` writes each new batch to
    it at once, in the commit's own loop pass (its sender task sleeps until ``wake``)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    """Set when a live link must go back to its sender task (its socket is backed up or closing)."""
    stall: WriteStall = field(default_factory=WriteStall)
    """Its sender's wait for the socket to drain, for the watchdog (catch_up_timeout)."""


@dataclass(frozen=True, slots=True)
class PreparedBatch:
    seq: int
    crc: int
    data: bytes
    ops: list[Op]
    """What to write locally: the commit's operations and the position op."""


class Primary:
    """Serves backups on ``host:port``; ``prepare`` and ``ship`` (or ``committed``) around each
    local commit."""

    def __init__(
        self,
        db: Any,
        *,
        store_id: int,
        log_max_batches: int,
        log_max_bytes: int,
        ack_timeout: float = 5.0,
        catch_up_timeout: float = 60.0,
        max_backups: int = 8,
        chunk_bytes: int = 1024 * 1024,
        on_change: Callable[[BackupLink, str], None] | None = None,
        publish_sync_set: Callable[[frozenset[str]], Awaitable[None]] | None = None,
        delete_sync_set: Callable[[], Awaitable[None]] | None = None,
        secret: bytes | None = None,
        handshake_timeout: float = HELLO_TIMEOUT,
        gate: HandshakeGate | None = None,
        backlog: int = LISTEN_BACKLOG,
    ) -> None:
        position = read_position(db) or (0, 0)
        self.db = db
        self.store_id = store_id
        self.log = RetainedLog(
            max_batches=log_max_batches, max_bytes=log_max_bytes, last_seq=position[0], last_crc=position[1]
        )
        self.ack_timeout = ack_timeout
        self.catch_up_timeout = catch_up_timeout
        """Seconds a backup not in sync may keep its sender waiting with no byte taken before it is
        disconnected (its snapshot and its pin released): a stranger's HELLO from an empty store,
        then nothing read, would hold them for ever."""
        self.max_backups = max_backups
        """Backup links served at once (replication.max_backups), counted at HELLO: a connection
        that never says HELLO takes no place (the gate and ``handshake_timeout`` bound those), and
        one whose HELLO replaces its own broker's older link takes that link's place."""
        self.chunk_bytes = chunk_bytes
        self.backlog = backlog
        """The listen backlog of its listener (the plugin's ``listen_backlog``; asyncio's default is
        100, which a flood of connections fills faster than they are accepted and closed)."""
        self.on_change = on_change
        self.links: dict[int, BackupLink] = {}
        self._next_seq = position[0] + 1
        self._waiting: deque[tuple[int, Shipped]] = deque()
        self._server: asyncio.Server | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._serving: set[asyncio.Task[None]] = set()
        self._acked: asyncio.Event | None = None
        """Set by the next acknowledgement (``_progressed``) for whoever waits (``_next_ack``); made only
        when one waits: every ACK frame calls ``_progressed``."""
        self._closed: BaseException | None = None
        self.port = 0
        self._publish = publish_sync_set
        self.sync_set: frozenset[str] | None = None if publish_sync_set is not None else frozenset()
        """With ``publish_sync_set``: the backups last published (None: not yet) as the only
        ones that may be promoted; acknowledgements wait for each of them."""
        self._delete_sync = delete_sync_set
        self._held: list[Shipped] | None = [] if delete_sync_set is not None else None
        """With ``delete_sync_set`` (async mode with a coordinator): the acknowledgements held until
        ``sync_set_deleted`` ran (None from then on): a synchronous set an earlier primary published
        names backups that lack what this primary acknowledges alone."""
        self._last_acked: dict[str, int] = {}
        self._publishing: asyncio.Task[None] | None = None
        self._name_refusals = NameBudgets(NAME_LOG_EVERY, REFUSED_NAMES)
        """Per name refused for being in use: its ERROR lines."""
        self._place_refusals = NameBudgets(NAME_LOG_EVERY, REFUSED_NAMES)
        """Per name refused for max_backups: its WARNING lines."""
        self.secret = secret
        """replication.secret: every peer must pass the handshake of auth.py first."""
        self.handshake_timeout = handshake_timeout
        self.gate = gate if gate is not None else HandshakeGate("the primary's replication address")
        """Bounds the connections in their handshake and logs the refused ones (a node passes the
        one its replication address keeps across promotions and demotions)."""
        self._tls: ssl.SSLContext | None = None
        self.on_admin: Callable[[Frame], dict[str, Any]] | None = None
        """Answers a tool's STATUS or PROMOTE frame (replication.node)."""

    # --- the commit path ------------------------------------------------------------------

    def prepare(self, ops: list[Op]) -> PreparedBatch:
        """Number the commit's operations; the caller writes ``ops`` of the result locally."""
        if self._closed is not None:
            raise self._closed
        seq = self._next_seq
        self._next_seq += 1
        data, crc = encode_batch(seq, self.store_id, ops)
        return PreparedBatch(seq, crc, data, [*ops, position_op(seq, crc)])

    def withdraw(self, batch: PreparedBatch) -> None:
        """The local write of the newest prepared batch failed: its number is given again to the
        retry (whose operations may have grown), so the shipped sequence has no gap."""
        if batch.seq != self._next_seq - 1:
            raise ReplicationError(f"batch {batch.seq} withdrawn after batch {self._next_seq - 1}")
        self._next_seq = batch.seq

    def committed(self, batch: PreparedBatch) -> asyncio.Future[None]:
        """The batch is written locally: retain and ship it; the future says every in-sync
        backup has it (at once when none is in sync)."""
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.ship(batch, partial(_settle, future))
        return future

    def ship(self, batch: PreparedBatch, then: Shipped | None) -> None:
        """``committed`` with a callback for the future: ``then(None)`` once every in-sync backup
        has the batch (at once when none is in sync), ``then(error)`` when none ever will (the
        primary closed). Called in commit order, in the loop pass that learns it (the callbacks
        of a future would wait for the next pass: one more event-loop turn per batch before its
        PUBACKs). ``then`` None (async mode): nobody waits for the outcome."""
        if self._closed is not None:
            if then is not None:
                _call(then, self._closed)
            return
        self.log.append(batch.seq, batch.crc, batch.data)
        now = time.monotonic()
        for link in self.links.values():
            if link.state == "in_sync" and link.acked_seq >= link.sent_seq:  # level until now: lag counts from here
                link.last_progress = now
            if link.live:
                self._send_live(link, batch)
        if then is not None:
            self._waiting.append((batch.seq, then))
            self._resolve()

    def _send_live(self, link: BackupLink, batch: PreparedBatch) -> None:
        """Write ``batch`` to a live link now (no task switch per batch): its sender is parked."""
        assert link.writer is not None
        if batch.seq <= link.sent_seq:  # already in the snapshot it was sent (written before this call)
            return
        transport = link.writer.transport
        if transport.is_closing():  # its tasks end it; nothing more is written to it
            link.live = False
            link.wake.set()
            return
        link.writer.write(link.session.encode(Frame.BATCH, batch.data))
        link.sent_seq = batch.seq
        self.log.pin(link, batch.seq)
        if transport.get_write_buffer_size() > HIGH_WATER:  # the sender waits for the socket to drain
            link.live = False
            link.wake.set()

    def status(self) -> list[dict[str, Any]]:
        """One row per connected backup, for inspect and ``$SYS/broker/durable/replication/...``:
        its state, how many batches it lags, and for how long it has acknowledged nothing while
        behind (0 when it is level)."""
        head, now = self.log.head_seq, time.monotonic()
        return [
            {
                "name": link.name,
                "peer": link.peer,
                "state": link.state,
                "acked": link.acked_seq,
                "lag_batches": head - link.acked_seq,
                "lag_seconds": round(now - link.last_progress, 3) if link.acked_seq < head else 0.0,
                "snapshot_rows": link.snapshot_rows,
                "reason": link.reason,
            }
            for link in self.links.values()
        ]

    def in_sync(self) -> list[BackupLink]:
        return [link for link in self.links.values() if link.state == "in_sync"]

    async def wait_shipped(self, *, within: float) -> None:
        """Return once every in-sync backup acknowledged every batch committed so far, or after
        ``within`` seconds (a backup that does not answer is waited for no longer than a sync
        publish would wait for it). A primary about to stop calls it after its last commit."""
        head = self.log.head_seq
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(within):
                while any(link.acked_seq < head for link in self.in_sync()):
                    await self._next_ack().wait()
                return
        behind = sorted(link.name for link in self.in_sync() if link.acked_seq < head)
        if not behind:
            return
        log.warning(
            "replication: stopping with backup(s) %s short of batch %d after %g s: a failover to them "
            "loses the batches they lack",
            ", ".join(behind),
            head,
            within,
        )

    async def wait_acked(self, name: str, seq: int) -> None:
        """Return once the backup called ``name`` acknowledged batch ``seq``."""
        while not any(link.name == name and link.acked_seq >= seq for link in self.links.values()):
            await self._next_ack().wait()

    def hold(self, then: Shipped) -> bool:
        """Async mode: False when the batch may be acknowledged now; True when ``then`` gets the
        outcome once the earlier synchronous set is deleted (or the error, if this end closes first)."""
        if self._held is None:
            return False
        if self._closed is not None:
            _call(then, self._closed)
        else:
            self._held.append(then)
        return True

    def delete_earlier_sync_set(self) -> None:
        """The promotion succeeded (async mode with a coordinator): delete the synchronous set an
        earlier primary published (retried until done or closed), then release the held acknowledgements."""
        if self._delete_sync is not None and self._held is not None and self._closed is None:
            self._spawn(self._delete_earlier_sync_set(self._delete_sync))

    async def _delete_earlier_sync_set(self, delete: Callable[[], Awaitable[None]]) -> None:
        while True:
            try:
                await delete()
                break
            except Exception as exc:  # the coordinator's answer decides; retried after a pause
                log.warning("replication: deleting the synchronous set of an earlier primary failed: %s", exc)
                await asyncio.sleep(self.ack_timeout / 4)
        log.info("replication: no synchronous set (async mode): acknowledging")
        held, self._held = self._held or [], None
        for then in held:
            _call(then, None)

    def _resolve(self) -> None:
        if self._closed is not None:
            return
        if self._publish is None:
            if not self._waiting:  # async mode: nobody waits (every ACK calls this)
                return
            upto = min((link.acked_seq for link in self.in_sync()), default=self.log.head_seq)
        else:
            self._republish_soon()
            if self.sync_set is None:
                return  # until the first publication, nothing is acknowledged
            # Every in-sync backup counts from the moment it is in sync (as without a published
            # set), and a published backup that is gone holds acknowledgements back until the
            # set without it is published: it may be promoted until then, so it must have them.
            acked = {link.name: link.acked_seq for link in self.in_sync()}
            members = acked.keys() | self.sync_set
            upto = min((acked.get(n, self._last_acked.get(n, 0)) for n in members), default=self.log.head_seq)
        while self._waiting and self._waiting[0][0] <= upto:
            _, then = self._waiting.popleft()
            _call(then, None)

    def _wanted_sync_set(self) -> frozenset[str]:
        """In-sync backups that also applied everything up to where they became in sync: batches
        before that point may have been acknowledged without them."""
        return frozenset(link.name for link in self.in_sync() if link.acked_seq >= link.in_sync_at)

    def _republish_soon(self) -> None:
        if self._publishing is None and self._wanted_sync_set() != self.sync_set and self._closed is None:
            self._publishing = self._spawn(self._republish())

    async def _republish(self) -> None:
        """Publish the in-sync set until the published one is current (Patroni's /sync key).
        A failed publication is retried; meanwhile a backup that left keeps holding acks."""
        assert self._publish is not None
        try:
            while (wanted := self._wanted_sync_set()) != self.sync_set:
                try:
                    await self._publish(wanted)
                except Exception as exc:  # the coordinator's answer decides; retried after a pause
                    log.warning("replication: publishing the synchronous set %s failed: %s", sorted(wanted), exc)
                    await asyncio.sleep(self.ack_timeout / 4)
                    continue
                self.sync_set = wanted
                log.info("replication: synchronous set published: %s", sorted(wanted) or "none")
        finally:
            self._publishing = None
        self._resolve()

    # --- serving ----------------------------------------------------------------------------

    async def start(self, host: str, port: int, tls: ssl.SSLContext | None = None) -> None:
        """Serve on host:port; with ``tls`` (a server context of replication.tls), over TLS."""
        self._tls = tls  # upgraded in first_frame, once the gate admitted the connection
        self._server = await asyncio.start_server(self._serve, host, port, backlog=self.backlog)
        self.port = self._server.sockets[0].getsockname()[1]
        self._begin()

    def serve_accepted(self, port: int, tls: ssl.SSLContext | None = None) -> None:
        """Serve the connections a listener of the caller's accepts on ``port`` and hands to
        ``serve`` (the node's replication address, kept open across role changes, so a
        promotion never gives its port away); ``close`` does not close that listener."""
        self._tls = tls
        self.port = port
        self._begin()

    async def serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One connection accepted by the caller's listener (see ``serve_accepted``)."""
        await self._serve(reader, writer)

    def _begin(self) -> None:
        self._spawn(self._watchdog())
        if self._publish is not None:
            self._publishing = self._spawn(self._republish())  # the new primary's set, at first none

    def _spawn(self, coro: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def close(self, reason: str = "the primary stopped") -> None:
        """Stop serving; batches still waiting for backups fail (they must not be acknowledged)."""
        self._closed = ReplicationError(f"replication: {reason}; the publish was not acknowledged")
        if self._server is not None:
            self._server.close()
        self.gate.abort_all()
        for link in list(self.links.values()):
            if link.writer is not None:
                link.writer.close()
        await self._end_tasks()
        while self._waiting:
            _, then = self._waiting.popleft()
            _call(then, self._closed)
        held, self._held = self._held or [], [] if self._held is not None else None
        for then in held:
            _call(then, self._closed)
        if self._server is not None:
            await self._server.wait_closed()

    async def _end_tasks(self) -> None:
        if self._serving:  # each ends as its connection closes
            _, late = await asyncio.wait(set(self._serving), timeout=self.handshake_timeout)
            for task in late:
                task.cancel()
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task

    def _changed(self, link: BackupLink, what: str) -> None:
        level = logging.WARNING if what.startswith(("disconnected", "no ack", "fell behind")) else logging.INFO
        log.log(level, "replication: backup %s (%s): %s", link.name, link.peer, what)
        if self.on_change is not None:
            self.on_change(link, what)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        host, port = writer.get_extra_info("peername")[:2]
        peer = join_address(host, port)
        if self._closed is not None:  # accepted as close() ran: past its abort_all and its wait
            writer.transport.abort()
            return
        if not self.gate.admit(writer, host):
            return
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        try:
            first = await self._first_frame(reader, writer, peer)
        except asyncio.CancelledError:  # a stop (gate.abort_all, _end_tasks): the connection ends here
            first = None  # not raised on: asyncio would log a cancelled connection callback as an error
        finally:
            self.gate.done(writer)
        if first is None:
            writer.close()
            self._serving.discard(task)
            return
        await self._serve_peer(reader, writer, peer, first, task)

    async def _serve_peer(
        self,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        peer: str,
        first: tuple[Session, Frame, bytes],
        task: asyncio.Task[None],
    ) -> None:
        """An authenticated peer: a tool's question answered, or a backup served until it goes."""
        key = id(writer)
        link = BackupLink(name="?", peer=peer, writer=writer)
        link.session, kind, payload = first
        acks: asyncio.Task[None] | None = None
        sender: asyncio.Task[None] | None = None
        ended = "disconnected"
        try:
            if kind in (Frame.STATUS, Frame.PROMOTE) and self.on_admin is not None:
                writer.write(link.session.encode(kind, json.dumps(self.on_admin(kind)).encode()))
                await writer.drain()
                return  # a tool's question, not a backup
            try:
                hello = self._hello(link, kind, payload)
            except FrameError as exc:  # a stranger's or damage: refused as the handshake refuses, rate-limited
                self.gate.refusal(writer, peer, str(exc))
                ended = ""
                return
            if hello is None:
                ended = ""  # refused for its version or its name, and logged so
                return
            self.links[key] = link
            acks = asyncio.get_running_loop().create_task(self._read_acks(reader, link))
            sender = asyncio.get_running_loop().create_task(self._send(writer, link, hello))
            done, _ = await asyncio.wait({acks, sender}, return_when=asyncio.FIRST_COMPLETED)
            for finished in done:
                finished.result()
        except asyncio.IncompleteReadError:
            ended = "disconnected (the backup closed the channel)"
        except (ConnectionError, TimeoutError, ReplicationError) as exc:
            ended = f"disconnected ({type(exc).__name__}: {channel_ended(exc)})"
        except Exception as exc:
            log.exception("replication: the channel to backup %s (%s) failed", link.name, peer)
            ended = f"disconnected (failed: {exc!r})"
        finally:
            helpers = {extra for extra in (acks, sender) if extra is not None}
            if self.links.pop(key, None) is None and helpers:  # served, and dropped already, logged
                ended = ""  # why: the watchdog's abort, or a new connection of the same backup
            await self._end_peer(writer, link, helpers, task)
        if ended:
            self._changed(link, ended)

    async def _end_peer(
        self, writer: asyncio.StreamWriter, link: BackupLink, helpers: set[asyncio.Task[None]], task: asyncio.Task[None]
    ) -> None:
        """A peer's connection ended (its link out of ``links``): its tasks and connection end."""
        self.log.pin(link, None)
        for extra in helpers:
            extra.cancel()
        if helpers:  # a sender reading a snapshot in a thread finishes that read first
            await asyncio.wait(helpers)
        writer.close()
        self._serving.discard(task)
        self._resolve()
        self._progressed()  # a backup gone is no longer waited for

    def _hello(self, link: BackupLink, kind: Frame, payload: bytes) -> Hello | None:
        """A backup's HELLO, its name and instance given to ``link``; None when refused (logged):
        for its version, or for its name."""
        if kind != Frame.HELLO:
            raise FrameError("HELLO", f"first frame is {kind.name}")
        assert link.writer is not None
        unsupported = unsupported_version(payload)
        if unsupported is not None:  # refused as the handshake refuses (rate-limited, counted), and told why
            self.gate.refusal(link.writer, link.peer, unsupported)
            link.writer.write(link.session.encode(Frame.ERROR, unsupported.encode("utf-8")))
            return None
        hello = Hello.decode(payload)
        link.name, link.instance = hello.name, hello.instance
        if not self._take_name(link) or not self._take_place(link):
            return None
        _keepalive(link.writer)
        return hello

    def _take_name(self, link: BackupLink) -> bool:
        """Whether ``link`` (its HELLO read) may serve under its name. A name is one backup's:
        another connection under it from the same broker process (the same ``instance``: that
        backup reconnected before this primary saw its old connection end, a half-dead TCP
        connection) is closed and replaced by ``link``; one from another process (another
        broker given the same name, or an earlier version's backup, which does not say) keeps
        the name, and ``link`` is refused with an ERROR frame saying why (the backup retries)."""
        for key, other in list(self.links.items()):
            if other.name != link.name:
                continue
            if link.instance and other.instance == link.instance:
                self.links.pop(key)
                self.log.pin(other, None)
                self._changed(other, f"replaced by its new connection from {link.peer} (the same broker reconnected)")
                if other.writer is not None:
                    other.writer.transport.abort()
                self._resolve()
                continue
            why = (
                f"backup name {link.name} {NAME_IN_USE} {other.peer} (this connection: {link.peer}); "
                "give each backup its own replication.name"
            )
            self._name_refused(link, other)  # logged first: the refused backup's own line comes after it
            assert link.writer is not None
            link.writer.write(link.session.encode(Frame.ERROR, why.encode("utf-8")))
            return False
        return True

    def _take_place(self, link: BackupLink) -> bool:
        """Whether a place is free for ``link`` (its name taken): fewer than ``max_backups`` links
        are served; otherwise it is refused with an ERROR frame naming the cap (the backup retries),
        counted by the gate and logged at most once a minute per name within the gate's bounds for
        refused handshakes, before it holds anything."""
        if len(self.links) < self.max_backups:
            return True
        assert link.writer is not None
        why = f"{TOO_MANY_BACKUPS} {self.max_backups} (backup {link.name} refused; it retries)"
        budget = self._place_refusals.of(link.name)
        line = f"{why}; {CAP_LINE}{_more(budget.left_out)}"
        if self.gate.refusal(link.writer, link.peer, line, logged=budget.due()):
            budget.take()  # the name's minute starts with a line logged, not with one the gate left out
        else:
            budget.left_out += 1
        link.writer.write(link.session.encode(Frame.ERROR, why.encode("utf-8")))
        return False

    def _name_refused(self, link: BackupLink, holder: BackupLink) -> None:
        """An ERROR line naming the name and both addresses: the first refusal of a name, then at
        most one every NAME_LOG_EVERY seconds while its refusals go on, with their count."""
        left_out = self._name_refusals.of(link.name).take()
        if left_out is None:
            return
        log.error(
            "replication: refused backup name %s from %s: the name %s %s %s, another broker process; names "
            "must be unique in the cluster: give one of them another replication.name (it retries; refusals "
            "of this name are logged at most once a minute%s)",
            link.name,
            link.peer,
            link.name,
            NAME_IN_USE,
            holder.peer,
            _more(left_out),
        )

    async def _first_frame(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str
    ) -> tuple[Session, Frame, bytes] | None:
        """The peer's session and first frame after the handshake; None when it was refused."""
        try:
            return await first_frame(
                reader, writer, self.secret, self.handshake_timeout, peer, tls=self._tls, gate=self.gate
            )
        except (AuthError, FrameError, FrameMacError, OSError, TimeoutError, asyncio.IncompleteReadError):
            return None

    async def _read_acks(self, reader: asyncio.StreamReader, link: BackupLink) -> None:
        while True:
            kind, payload = await link.session.read(reader, MAX_PEER_FRAME)
            if kind != Frame.ACK:
                raise FrameError("ACK", f"unexpected {kind.name} from a backup")
            seq = decode_seq(payload)
            if seq > link.sent_seq:
                raise FrameError("ACK", f"ack of batch {seq}, only {link.sent_seq} were sent")
            if seq < link.acked_seq:  # a backup's acks only grow on a connection: damage, or not a backup
                raise FrameError("ACK", f"ack of batch {seq} after an ack of batch {link.acked_seq}")
            link.acked_seq = seq
            link.acks += 1
            link.last_progress = time.monotonic()
            if link.state == "in_sync":
                self._last_acked[link.name] = seq
            self._resolve()
            self._progressed()

    def _next_ack(self) -> asyncio.Event:
        """The event the next acknowledgement sets."""
        if self._acked is None:
            self._acked = asyncio.Event()
        return self._acked

    def _progressed(self) -> None:
        """Wake whoever waits for acknowledgements (``wait_acked``, ``wait_shipped``)."""
        event, self._acked = self._acked, None
        if event is not None:
            event.set()

    async def _send(self, writer: asyncio.StreamWriter, link: BackupLink, hello: Hello) -> None:
        plan = plan_catch_up(self.log, self.store_id, hello.store_id, hello.seq, hello.crc)
        link.reason = plan.reason
        self._changed(link, f"connected at batch {hello.seq}: {plan.reason}")
        pos: int | None = plan.from_seq if plan.kind == "log" else None
        if pos is not None:
            link.sent_seq = link.acked_seq = pos
        try:
            await self._send_from(writer, link, pos)
        finally:
            self.log.pin(link, None)

    async def _send_from(self, writer: asyncio.StreamWriter, link: BackupLink, pos: int | None) -> None:
        snapshot: tuple[int, int] | None = None
        """The batch the last snapshot sent holds and the ACK frames received before its SNAP_END:
        the backup is in sync only once it acknowledged that batch with a later ACK (its receive
        queue may hold many chunks it has not applied yet; a snapshot may be at batch 0, a store
        with rows but no replication position yet)."""
        while True:
            if pos is None:
                pos = await self._send_snapshot(writer, link)
                snapshot = (pos, link.acks)
                link.state = "catching_up"
            for item in self.log.since(pos):
                writer.write(link.session.encode(Frame.BATCH, item.data))
                pos = link.sent_seq = item.seq
                if writer.transport.get_write_buffer_size() > HIGH_WATER:
                    self.log.pin(link, pos)
                    await _drain(writer, link)
            self.log.pin(link, pos)  # the batches after it stay until sent (up to pin_max_bytes)
            if pos < self.log.base_seq:
                self._changed(link, f"fell behind the retained log (at {pos}, log from {self.log.first_seq}): snapshot")
                if link.state == "in_sync":
                    link.state = "catching_up"
                    _user_timeout(writer, 0)
                    self._resolve()
                pos = None
                continue
            if pos >= self.log.head_seq:  # a snapshot may hold a batch not yet handed to ship()
                if link.state != "in_sync" and snapshot is not None and not _acked(link, snapshot):
                    await _drain(writer, link)
                    await self._acked_or_beyond(link, snapshot, pos)  # then send what came meanwhile
                    continue
                if link.state != "in_sync":
                    self._in_sync(writer, link, pos)
                pos = await self._live(writer, link, pos)

    def _in_sync(self, writer: asyncio.StreamWriter, link: BackupLink, pos: int) -> None:
        """``link`` has every batch up to ``pos``, the newest: IN_SYNC, and counted from now on."""
        if writer.transport.is_closing():  # aborted (the watchdog, or replaced by its reconnect): never in sync
            raise ConnectionResetError("the connection to the backup was aborted")
        writer.write(link.session.encode(Frame.IN_SYNC, encode_seq(pos)))
        _user_timeout(writer, USER_TIMEOUT_MS)
        link.state = "in_sync"
        link.in_sync_at = pos
        self._last_acked[link.name] = link.acked_seq
        link.last_progress = time.monotonic()
        self._changed(link, f"in sync at batch {pos}")
        self._resolve()

    async def _live(self, writer: asyncio.StreamWriter, link: BackupLink, pos: int) -> int:
        """An in-sync link sent everything up to ``pos``: drain its socket; then, unless batches
        came meanwhile, ``ship`` writes the next batches to it itself, until its socket backs up
        or closes. Returns the last batch sent."""
        await _drain(writer, link)
        if pos < self.log.head_seq:
            return pos
        link.wake.clear()
        link.live = True
        try:
            await link.wake.wait()
        finally:
            link.live = False
        return link.sent_seq

    async def _acked_or_beyond(self, link: BackupLink, snapshot: tuple[int, int], pos: int) -> None:
        """Return once ``link`` acknowledged the ``snapshot`` (see ``_acked``), or at the next
        acknowledgement, or once a batch after ``pos`` is in the log."""
        waiters = {asyncio.ensure_future(self._next_ack().wait()), asyncio.ensure_future(self.log.wait_beyond(pos))}
        try:
            if not _acked(link, snapshot) and self.log.head_seq <= pos:
                await asyncio.wait(waiters, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for waiter in waiters:
                waiter.cancel()

    async def _send_snapshot(self, writer: asyncio.StreamWriter, link: BackupLink) -> int:
        """Stream a LevelDB snapshot; returns the batch number it holds."""
        link.state = "snapshot"
        link.snapshot_rows = 0
        snapshot = self.db.snapshot()
        try:
            position = read_position(snapshot) or (0, 0)
            self.log.pin(link, position[0])  # in the same loop pass: no batch after it has left yet
            self._changed(link, f"snapshot at batch {position[0]} starts")
            writer.write(link.session.encode(Frame.SNAP_BEGIN))
            rows = snapshot.iterator()
            try:
                while True:
                    chunk = await in_thread(_next_chunk, rows, self.chunk_bytes)
                    if not chunk:
                        break
                    writer.write(link.session.encode(Frame.SNAP_CHUNK, encode_ops(chunk)))
                    link.snapshot_rows += len(chunk)
                    await _drain(writer, link)
            finally:
                rows.close()
        finally:
            snapshot.close()
        writer.write(link.session.encode(Frame.SNAP_END, encode_position(*position)))
        link.sent_seq = position[0]
        self._changed(link, f"snapshot at batch {position[0]} sent ({link.snapshot_rows} rows)")
        return position[0]

    async def _watchdog(self) -> None:
        """Disconnect an in-sync backup silent past ``ack_timeout`` with batches outstanding, and
        one not in sync whose connection took no byte for ``catch_up_timeout`` while its sender
        waited to write to it (a snapshot or a catch-up it does not read: its LevelDB snapshot and
        its pin of the retained log would be held for ever)."""
        while True:
            await asyncio.sleep(max(min(self.ack_timeout, self.catch_up_timeout) / 4, WATCHDOG_MIN))
            now = time.monotonic()
            for key, link in list(self.links.items()):
                if link.writer is None:
                    continue
                if link.state == "in_sync":
                    if link.acked_seq < link.sent_seq and now - link.last_progress > self.ack_timeout:
                        self._drop(key, link, f"no ack for {self.ack_timeout:g} s: disconnected, no longer counted")
                elif link.stall.stalled(now, sent_mark(link.writer)) > self.catch_up_timeout:
                    self._drop(key, link, _stalled(link, self.catch_up_timeout))

    def _drop(self, key: int, link: BackupLink, why: str) -> None:
        """Disconnect ``link`` at once: its connection is aborted (a close would wait for its write
        buffer to reach a backup that takes nothing) and its link dropped, so its name is free for
        a backup under it; its sender ends at the aborted write, releasing what it held."""
        assert link.writer is not None
        self._changed(link, why)
        link.state = "catching_up"
        self.links.pop(key, None)
        self.log.pin(link, None)
        link.writer.transport.abort()  # its reader ends, and its sender with it
        self._resolve()
        self._progressed()


async def first_frame(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    secret: bytes | None,
    within: float,
    peer: str,
    *,
    tls: ssl.SSLContext | None = None,
    gate: HandshakeGate,
) -> tuple[Session, Frame, bytes]:
    """The connection's session and a peer's first frame after the handshake (auth.py; with
    ``tls``, the TLS handshake first), all within ``within`` seconds; a refusal (a failed TLS
    handshake, a first frame that failed its MAC included) is logged as a WARNING naming the
    peer (through ``gate``, which counts it and keeps a flood from filling the log) and raised
    (the caller closes the connection)."""
    try:
        async with asyncio.timeout(within):
            if tls is not None:
                await writer.start_tls(tls)
            return await server_handshake(reader, writer, secret, MAX_PEER_FRAME)
    except (AuthError, FrameError, FrameMacError) as exc:
        gate.refusal(writer, peer, str(exc))
        raise
    except TimeoutError:
        what = "the handshake was not completed" if secret is not None or tls is not None else "no first frame"
        gate.refusal(writer, peer, f"{what} within {within:g} s")
        raise
    except ssl.SSLError as exc:
        gate.refusal(writer, peer, f"the TLS handshake failed: {exc}")
        raise
    except (OSError, asyncio.IncompleteReadError) as exc:
        log.info("replication: a connection from %s ended before its first frame: %r", peer, exc)
        raise


def sent_mark(writer: asyncio.StreamWriter) -> int:
    """A count that changes whenever a backup's connection takes bytes while its sender waits: on
    Linux the bytes its peer's TCP acknowledged (TCP_INFO), which over TLS too moves with every
    segment (the TLS layer's own buffer empties into the socket's a whole chunk at a time, so its
    size stays level for seconds on a slow link that makes progress); elsewhere the bytes left in
    the transport's buffer, negated (nothing is written to it while its sender waits)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and sys.platform.startswith("linux") and hasattr(socket, "TCP_INFO"):
        with contextlib.suppress(OSError):
            info = sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, TCP_INFO_SIZE)
            if len(info) >= TCP_INFO_SIZE:
                return int(struct.unpack_from("=Q", info, TCP_INFO_BYTES_ACKED)[0])
    return -writer.transport.get_write_buffer_size()


def _more(left_out: int) -> str:
    """The end of a refusal line counting the refusals of its name left out since the last."""
    return f", {left_out} more since the last line" if left_out else ""


async def _drain(writer: asyncio.StreamWriter, link: BackupLink) -> None:
    """``writer.drain()``, its wait on ``link.stall`` for the watchdog while ``link`` is not in sync
    (an in-sync one is bounded by ack_timeout: no bookkeeping, no getsockopt on its every drain)."""
    if link.state == "in_sync":
        await writer.drain()
        return
    link.stall.blocked(time.monotonic(), sent_mark(writer))
    try:
        await writer.drain()
    finally:
        link.stall.unblocked()


def _stalled(link: BackupLink, timeout: float) -> str:
    """The watchdog's WARNING for a backup whose connection took nothing for ``timeout`` seconds."""
    if link.state == "snapshot":
        where, held = f"its snapshot, {link.snapshot_rows} rows sent", "a snapshot, retained batches"
    else:
        where, held = f"its catch-up, batch {link.sent_seq} sent, {link.acked_seq} acknowledged", "retained batches"
    return (
        f"disconnected: its connection took no byte for {timeout:g} s during {where}; what was held for it "
        f"({held}) is released (a real backup on a link this slow: raise replication.catch_up_timeout)"
    )


def _keepalive(writer: asyncio.StreamWriter) -> None:
    """TCP keepalive (KEEPALIVE) on a backup's connection, where the platform has the options."""
    sock = writer.get_extra_info("socket")
    if sock is None:
        return
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in zip(("TCP_KEEPIDLE", "TCP_KEEPINTVL", "TCP_KEEPCNT"), KEEPALIVE, strict=True):
        if hasattr(socket, option):
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


def _user_timeout(writer: asyncio.StreamWriter, ms: int) -> None:
    """TCP_USER_TIMEOUT on a backup's connection (0: the kernel's default), where the platform has
    it (not on a socket already closed: the connection ends anyway)."""
    sock = writer.get_extra_info("socket")
    if sock is not None and hasattr(socket, "TCP_USER_TIMEOUT"):
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT, ms)


def _settle(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)


def _call(then: Shipped, error: BaseException | None) -> None:
    """A ``ship`` callback, run where the primary learns the outcome (an ack reader, ``close``):
    its failure is logged, not raised into the replication channel."""
    try:
        then(error)
    except Exception:
        log.exception("replication: a shipped batch's callback failed")


def _acked(link: BackupLink, snapshot: tuple[int, int]) -> bool:
    """Whether ``link`` acknowledged ``snapshot`` (its batch, the ACK frames received before its
    SNAP_END): an ACK came after those, of that batch or a later one. (Counting ACK frames tells a
    snapshot at batch 0 from no acknowledgement: ``acked_seq`` starts at 0.)"""
    seq, acks_before = snapshot
    return link.acks > acks_before and link.acked_seq >= seq


def _next_chunk(rows: Any, limit: int) -> list[Op]:
    chunk: list[Op] = []
    size = 0
    for key, value in rows:
        if key == SNAPSHOT_MARK_KEY:
            continue
        chunk.append((key, value))
        size += len(key) + len(value) + 9
        if size >= limit:
            break
    return chunk


__all__ = ["BackupLink", "PreparedBatch", "Primary"]
