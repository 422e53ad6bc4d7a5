"""The backup's end of the replication channel: apply the primary's batches, in order, and ack.

A backup connects to the primary, says where its store is (HELLO: store id, last applied
batch and its checksum, all read from the store, so a restarted backup resumes where it
stopped), and then applies what comes: a snapshot (the store is wiped and refilled; a mark
in the store says it is partial until the end), then batches. Batches that arrived together
are written as one LevelDB write batch together with the position of the last one
(position.py), and only then acknowledged: an ack means "in this machine's store", fsynced when
the broker's ``sync`` is true (as its own commits would be; a write without fsync survives the
process, not a power loss of its machine). A batch
that does not follow the last applied one, or names another store, is refused: the backup
drops the channel and reconnects, and the primary catches it up again. Never a gap.

``caught_up`` is what the HA loop asks before taking the lease: the primary said IN_SYNC on
the current (or last) connection and nothing it sent since failed to apply.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import ssl
import time
from collections import deque
from collections.abc import Sequence
from typing import Any, Literal, NoReturn

from ..store import VERSION_KEY
from .auth import AuthError, Session, client_handshake, error_text
from .errors import FrameError, FrameMacError, ReplicationGapError, StoreMismatchError, channel_ended
from .framing import (
    NAME_IN_USE,
    NOT_PRIMARY,
    TOO_MANY_BACKUPS,
    VERSION_REFUSED,
    CheckedBatch,
    Frame,
    Hello,
    Op,
    check_batch,
    decode_ops,
    decode_position,
    decode_seq,
    encode_seq,
)
from .position import SNAPSHOT_MARK_KEY, position_op, read_position, read_store_id
from .threads import in_thread
from .tool import join_address

log = logging.getLogger("amqtt_durable.replication")

BackupState = Literal["disconnected", "connecting", "snapshot", "catching_up", "in_sync"]
QUEUE_FRAMES = 1024
"""Frames received but not yet applied; past it the socket is not read (TCP back-pressure)."""
QUEUE_BYTES = 64 * 1024 * 1024
"""Payload bytes of the frames received but not yet applied; past it the socket is not read either
(FrameQueue): QUEUE_FRAMES frames of large batches alone could hold gigabytes."""
_KEPT = frozenset({SNAPSHOT_MARK_KEY, VERSION_KEY})
AUTH_RETRY = 5.0
"""Seconds before a backup refused by the handshake (a secret that does not match) tries again."""
NAME_LOG_EVERY = 60.0
"""Seconds between two ERROR lines of a backup refused, again and again, for its name; and
between two WARNING lines of one whose primary address answers that it is no primary, or
closes the channel before answering (REFUSAL_LOG_EVERY)."""
REFUSAL_LOG_EVERY = NAME_LOG_EVERY
INSTANCE_MARK = 0xFF << 56
"""The top byte of every instance a backup sends (``Backup`` sets it on whatever instance it is
given): 0xFF is never UTF-8, so an earlier version's primary, which decodes all of the HELLO
after its header as the name, always refuses a HELLO with an instance (never takes one for a
name with a NUL in it). Such a backup cannot follow that primary: it retries until the primary
runs this version too."""
WIPE_CHUNK = 10_000
"""Keys deleted per write batch when a snapshot starts."""
INLINE_BYTES = 1 << 20
"""The most frame payload a group written on the event loop holds (see INLINE_OPS)."""
INLINE_OPS = 5000
"""Without ``sync`` (no fsync), while the backup is in sync, batches that arrived together are
written on the event loop, as the primary writes its own commits, when their frames hold at most
INLINE_BYTES of payload and their operations, with the position op added, number at most
INLINE_OPS: a thread hand-off per batch costs more CPU than such a write, and these bounds keep
the loop's stall short (milliseconds; longer when LevelDB slows its writes down for a
compaction, as on the primary).
Every synced write, every write while catching up (a group is then everything received, up to
QUEUE_FRAMES frames and QUEUE_BYTES, or one larger frame alone: up to MAX_FRAME) and every larger group go
to a worker thread, and the loop
(the HA cycle, CONNACK 3 answers, tools' questions) goes on meanwhile."""


class VersionRefusedError(AuthError):
    """The primary does not speak this backup's replication protocol version (an upgrade half
    done): it answered the HELLO with an ERROR frame naming both versions (VERSION_REFUSED)."""


class BackupsFullError(AuthError):
    """The primary serves replication.max_backups backups already: it answered the HELLO with an
    ERROR frame naming the cap (TOO_MANY_BACKUPS). Retried as a version refusal is, every AUTH_RETRY
    seconds: a place frees when one of its backups goes."""


class NameInUseError(AuthError):
    """The primary refused this backup: another broker's backup is connected under its name."""


class NotPrimaryError(AuthError):
    """The node at the primary address is a backup: it answered the HELLO with an ERROR frame
    saying so (NOT_PRIMARY). Retried as often as a closed channel: it may be being promoted."""


class ClosedUnansweredError(ConnectionResetError):
    """The node at the primary address closed the channel before any frame (without TLS): a
    backup of an earlier version answers a HELLO so (one of this version says NOT_PRIMARY), and
    so does a primary of an earlier version (it refuses this version's HELLO)."""


class Backup:
    """Replicates a primary's store into ``db`` (a plyvel DB this object writes alone)."""

    def __init__(
        self,
        db: Any,
        *,
        name: str,
        sync: bool = True,
        secret: bytes | None = None,
        handshake_timeout: float = 10.0,
        tls: ssl.SSLContext | None = None,
        instance: int | None = None,
        queue_bytes: int = QUEUE_BYTES,
    ) -> None:
        self.db = db
        self.queue_bytes = queue_bytes
        """The byte bound of the frames received and not yet applied (FrameQueue)."""
        self.received: FrameQueue | None = None
        """The current connection's frames received and not yet applied (None between connections),
        shown in the node's status (``queued_bytes``, ``queue_full``)."""
        low = (1 << 56) - 1
        self.instance = INSTANCE_MARK | ((instance or secrets.randbits(56)) & low)
        """This broker process in its HELLO (its top byte INSTANCE_MARK, never 0): a primary
        replaces an older connection of the same instance under the same name, and refuses one
        of another (NameInUseError)."""
        self.refused: str | None = None
        """Why the node at the primary address refused the last try of follow() (NameInUseError,
        NotPrimaryError); None after any other outcome, and at the start of a follow()."""
        self._refusal: type[AuthError] | None = None
        """The kind of the last such refusal of this follow(), until the node accepts this backup:
        its INFO line says which refusal ended."""
        self.tls = tls
        """replication.tls: a client context (the primary's certificate must be signed by the CA)."""
        self.secret = secret
        """replication.secret: the primary must prove it knows it before anything is applied."""
        self.handshake_timeout = handshake_timeout
        self.name = name
        self.sync = sync
        self.state: BackupState = "disconnected"
        position = read_position(db)
        self.applied_seq, self.applied_crc = position if position is not None else (0, 0)
        self.partial = position is None
        self.store_id = read_store_id(db)
        self.caught_up = False
        self.in_sync_event = asyncio.Event()
        """Set while the current connection is in sync (for tests and the HA loop)."""
        self.applied_event = asyncio.Event()
        """Set (and replaced) each time batches are applied."""
        self.snapshots = 0

    async def wait_applied(self, seq: int) -> None:
        while self.applied_seq < seq:
            event = self.applied_event
            await event.wait()

    def _read_store(self) -> None:
        """Take the position, the partial mark and the store id from the store, the truth: a
        write in a worker thread that the task's cancellation interrupted finished (in_thread
        waits for it) without the in-memory state following it."""
        position = read_position(self.db)
        if position is None:  # a snapshot under way: as while it is applied (HELLO says batch 0)
            self.partial = True
            return
        if self.partial:  # only a snapshot's end clears the mark: its write finished
            self.snapshots += 1
            self.partial = False
        self.store_id = read_store_id(self.db)
        self._applied(*position)

    def _applied(self, seq: int, crc: int) -> None:
        self.applied_seq, self.applied_crc = seq, crc
        event, self.applied_event = self.applied_event, asyncio.Event()
        event.set()

    async def run(self, host: str, port: int) -> None:
        """One connection to the primary, until it ends (raises the reason; always closes)."""
        self._trying("connecting")
        self.in_sync_event.clear()
        try:
            reader, writer, session = await self._open(host, port)
        except BaseException:
            self.state = "disconnected"
            raise
        frames = self.received = FrameQueue(QUEUE_FRAMES, self.queue_bytes)
        receiver = asyncio.get_running_loop().create_task(_receive(reader, frames, session))
        receiver.add_done_callback(lambda _: frames.end())
        answered = False
        try:
            self._read_store()
            seq = 0 if self.partial else self.applied_seq
            hello = Hello(self.store_id, seq, self.applied_crc, self.name, instance=self.instance)
            writer.write(session.encode(Frame.HELLO, hello.encode()))
            await writer.drain()
            self._trying("catching_up")
            while True:
                # Every frame received is applied before the end of the channel is reported.
                group = await frames.take()
                if not group:
                    self._channel_ended(receiver, answered)
                if not answered:
                    self._answered(*group[0])
                    answered = True
                ack = await self._apply_or_read_store(group)
                if ack is not None:
                    writer.write(session.encode(Frame.ACK, encode_seq(ack)))
                    await writer.drain()
        finally:
            self.state = "disconnected"
            self.in_sync_event.clear()
            receiver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await receiver
            writer.close()
            self.received = None  # what is left in it is never applied

    def _trying(self, state: BackupState) -> None:
        """The state of a try not answered yet; while the last try's refusal stands (``refused``)
        the backup stays disconnected, as its status says until a try ends otherwise or the node
        accepts it (a status read while the retry waits for its answer showed catching_up)."""
        if self.refused is None:
            self.state = state

    async def _open(self, host: str, port: int) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, Session]:
        """Connect and pass the handshake (with TLS, the TLS handshake first), all within one
        handshake_timeout; a TLS failure is raised as a refusal (AuthError) naming replication.tls."""
        deadline = asyncio.get_running_loop().time() + self.handshake_timeout
        try:
            async with asyncio.timeout_at(deadline):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=self.tls, ssl_handshake_timeout=self.handshake_timeout if self.tls else None
                )
        except ssl.SSLError as exc:
            raise self._tls_refusal(exc) from exc
        try:
            async with asyncio.timeout_at(deadline):
                session = await client_handshake(reader, writer, self.secret)
        except (ssl.SSLError, ConnectionResetError, BrokenPipeError, asyncio.IncompleteReadError) as exc:
            writer.close()
            if self.tls is None:
                raise
            raise self._tls_refusal(exc) from exc
        except BaseException:
            writer.close()
            raise
        session.sender = "the primary"
        return reader, writer, session

    def _channel_ended(self, receiver: asyncio.Task[None], answered: bool) -> NoReturn:
        """Raise why the connection ended: with TLS, an end before the primary's first frame is
        most likely the primary refusing this node's certificate (TLS 1.3 tells the client only
        then), retried as a refusal."""
        try:
            receiver.result()
            raise ConnectionResetError("the primary closed the replication channel")
        except (ssl.SSLError, ConnectionError, asyncio.IncompleteReadError) as exc:
            if self.tls is not None and not answered:
                raise self._tls_refusal(exc) from exc
            if not answered:
                raise ClosedUnansweredError(
                    "it closed the channel before answering the HELLO (is it the primary of this version? a backup "
                    "of an earlier version closes it so, and so does a primary of an earlier version)"
                ) from exc
            raise

    @staticmethod
    def _tls_refusal(exc: BaseException) -> AuthError:
        why = str(exc) or type(exc).__name__
        return AuthError(
            f"the TLS channel ended before the primary's first frame ({why}): the primary may refuse this "
            "node's certificate or not use TLS (replication.tls: the same ca on both sides)"
        )

    def _answered(self, kind: Frame, payload: bytes) -> None:
        """The primary's first frame on this connection: anything but ERROR accepts the backup.
        Caught up with the last primary stays true while that primary cannot be reached (the HA
        loop promotes on it), also while its address only answers tools or NOT_PRIMARY (a
        backup's: the last primary, demoted); a primary that answers decides anew."""
        if not _says_not_primary(kind, payload):
            self.caught_up = False
        if kind == Frame.ERROR:
            return
        if self._refusal is NotPrimaryError:
            log.info("replication: backup %s: the node at its primary address answers as the primary", self.name)
        elif self._refusal is NameInUseError:
            log.info("replication: backup %s: accepted by the primary: its name is free again", self.name)
        elif self._refusal is VersionRefusedError:
            log.info("replication: backup %s: accepted by the primary: it speaks this protocol version", self.name)
        elif self._refusal is BackupsFullError:
            log.info("replication: backup %s: accepted by the primary: a place among its backups is free", self.name)
        self.refused = self._refusal = None
        self.state = "catching_up"  # until its frames say otherwise (a snapshot, in sync)

    async def follow(self, host: str, port: int, stop: asyncio.Event, retry: float = 0.5) -> None:
        """Stay connected to the primary at host:port, reconnecting after a failure, until ``stop``."""
        primary = join_address(host, port)
        logged = -NAME_LOG_EVERY
        repeated = _RepeatedLine(REFUSAL_LOG_EVERY)
        versions = _RepeatedLine(REFUSAL_LOG_EVERY, logging.ERROR)
        self.refused = self._refusal = None  # another primary's, if any
        while not stop.is_set():
            pause = retry
            refusal: AuthError | None = None
            try:
                await self.run(host, port)
            except (NotPrimaryError, VersionRefusedError, BackupsFullError) as exc:
                # NotPrimaryError: retried as often as before, it may be a backup being promoted;
                # VersionRefusedError: an upgrade half done, retried until both speak one version;
                # BackupsFullError: retried as slowly, until one of the primary's backups goes.
                refusal = exc
                if not isinstance(exc, NotPrimaryError):
                    pause = max(retry, AUTH_RETRY)
                log.log(
                    (versions if isinstance(exc, VersionRefusedError) else repeated).level(str(exc)),
                    "replication: backup %s: channel to %s refused (retried every %g s, this line at most once a "
                    "minute): %s",
                    self.name,
                    primary,
                    pause,
                    exc,
                )
            except ClosedUnansweredError as exc:
                log.log(
                    repeated.level(str(exc)),
                    "replication: backup %s: the primary at %s closed the channel: %s (retried every %g s, this "
                    "line at most once a minute)",
                    self.name,
                    primary,
                    exc,
                    pause,
                )
            except NameInUseError as exc:  # another broker's backup holds the name: wait until it is free
                pause = max(retry, AUTH_RETRY)
                refusal = exc
                now = time.monotonic()
                level = logging.ERROR if now - logged >= NAME_LOG_EVERY else logging.DEBUG
                logged = now if level == logging.ERROR else logged
                log.log(
                    level,
                    "replication: backup %s: channel to %s refused for its name (retried every %g s, this line "
                    "at most once a minute): %s",
                    self.name,
                    primary,
                    pause,
                    exc,
                )
            except asyncio.IncompleteReadError:
                log.warning("replication: backup %s: the primary at %s closed the channel", self.name, primary)
            except AuthError as exc:
                pause = max(retry, AUTH_RETRY)  # a configuration problem: retried, but not twice a second
                log.warning(
                    "replication: backup %s: channel to %s refused (retried in %g s): %s",
                    self.name,
                    primary,
                    pause,
                    exc,
                )
            except (OSError, TimeoutError, FrameError, FrameMacError, ReplicationGapError, StoreMismatchError) as exc:
                log.warning(
                    "replication: backup %s: channel to %s ended: %s",
                    self.name,
                    primary,
                    channel_ended(exc) or repr(exc),
                )
            self.refused = None if refusal is None else str(refusal)  # never a reason older than this try
            if refusal is not None:
                self._refusal = type(refusal)
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(pause):
                    await stop.wait()

    async def _apply_or_read_store(self, group: list[tuple[Frame, bytes]]) -> int | None:
        """``_apply``; when cancelled, a write in a worker thread may have finished under the
        cancellation: the in-memory position (position(), status) is read from the store. A store
        already closed (shutdown) must not turn the cancellation into an error: the next run()
        reads the store again anyway."""
        try:
            return await self._apply(group)
        except asyncio.CancelledError:
            try:
                self._read_store()
            except Exception:
                log.exception("replication backup %s: its position not read back after a cancelled write", self.name)
            raise

    async def _apply(self, group: list[tuple[Frame, bytes]]) -> int | None:
        """Apply frames in order; returns the batch number to acknowledge, if any."""
        ack: int | None = None
        batches: list[CheckedBatch] = []
        size = 0
        for kind, payload in group:
            if kind == Frame.BATCH:
                batches.append(check_batch(payload))
                size += len(payload)
                continue
            if batches:
                ack = await self._write_batches(batches, size)
                batches, size = [], 0
            if kind == Frame.SNAP_BEGIN:
                self.state = "snapshot"
                self.caught_up = False
                self.partial = True
                await in_thread(_wipe, self.db)
            elif kind == Frame.SNAP_CHUNK:
                ops, _ = decode_ops(payload, 0, "snapshot chunk")
                await in_thread(_write, self.db, ops, False)
            elif kind == Frame.SNAP_END:
                seq, crc = decode_position(payload)
                await in_thread(_write, self.db, [position_op(seq, crc), (SNAPSHOT_MARK_KEY, None)], True)
                self.partial = False
                self.store_id = read_store_id(self.db)
                self.snapshots += 1
                self.state = "catching_up"
                self._applied(seq, crc)
                ack = seq
            elif kind == Frame.ERROR:
                raise _refusal(payload)
            elif kind == Frame.IN_SYNC:
                decode_seq(payload)
                self.state = "in_sync"
                self.caught_up = True
                self.in_sync_event.set()
            else:
                raise FrameError("frame", f"unexpected {kind.name} from the primary")
        if batches:
            ack = await self._write_batches(batches, size)
        return ack

    async def _write_batches(self, batches: list[CheckedBatch], size: int) -> int | None:
        """Write the batches that follow in order (one write batch, synced with ``sync``, their
        operations decoded straight into it); then refuse the first that does not. ``size``:
        their frames' payload bytes (INLINE_BYTES). Returns the last batch written."""
        if self.partial:
            raise ReplicationGapError(0, batches[0].seq)
        following: list[CheckedBatch] = []
        last: CheckedBatch | None = None
        refused: Exception | None = None
        for batch in batches:
            expected = self.applied_seq if last is None else last.seq
            if batch.store_id != self.store_id:
                refused = StoreMismatchError(self.store_id, batch.store_id)
            elif batch.seq != expected + 1:
                refused = ReplicationGapError(expected, batch.seq)
            if refused is not None:
                break
            following.append(batch)
            last = batch
        if last is not None:
            position = [position_op(last.seq, last.crc)]
            count = sum(batch.count for batch in following) + 1
            if self.sync or self.state != "in_sync" or size > INLINE_BYTES or count > INLINE_OPS:
                await in_thread(_write, self.db, position, self.sync, following)
            else:  # a small group, as the primary writes its own commits without sync: on the loop
                _write(self.db, position, False, following)
            self._applied(last.seq, last.crc)
        if refused is not None:
            raise refused
        return None if last is None else last.seq


def _says_not_primary(kind: Frame, payload: bytes) -> bool:
    """An ERROR frame saying NOT_PRIMARY: the node at the primary address is a backup. Its words
    come first, so the 200-character cut never takes them."""
    return kind == Frame.ERROR and payload.startswith(f"{NOT_PRIMARY}:".encode())


def _refusal(payload: bytes) -> AuthError:
    """The error an ERROR frame from the node at the primary address raises. The words that begin
    a frame (NOT_PRIMARY, TOO_MANY_BACKUPS) are looked for first, at its start only, then the words
    found inside one (NAME_IN_USE, VERSION_REFUSED): a backup name quoted in a refusal cannot make
    it pass for another kind."""
    if _says_not_primary(Frame.ERROR, payload):
        return NotPrimaryError(error_text(payload))
    text = payload.decode("utf-8", "replace")
    refusal: type[AuthError] = AuthError
    if text.startswith(TOO_MANY_BACKUPS):
        refusal = BackupsFullError
    elif NAME_IN_USE in text:
        refusal = NameInUseError
    elif VERSION_REFUSED in text:
        refusal = VersionRefusedError
    return refusal(f"refused by the primary: {error_text(payload)}")


class _RepeatedLine:
    """The level of a channel error's line: WARNING (or ``loud``) for a text not logged so within the last
    ``every`` seconds (the first time, and then at most once every ``every`` seconds per text, so
    texts that alternate are limited too); DEBUG in between. It remembers the last ``KEPT`` texts."""

    KEPT = 8

    def __init__(self, every: float, loud: int = logging.WARNING) -> None:
        self.every = every
        self.loud = loud
        """The level of a line that is logged (WARNING unless said otherwise)."""
        self._logged: dict[str, float] = {}
        """Text: when it was last logged at ``loud``, the latest last."""

    def level(self, text: str) -> int:
        now = time.monotonic()
        last = self._logged.get(text)
        if last is not None and now - last < self.every:
            return logging.DEBUG
        self._logged.pop(text, None)
        self._logged[text] = now
        while len(self._logged) > self.KEPT:
            del self._logged[next(iter(self._logged))]
        return self.loud


class FrameQueue:
    """The frames received from the primary and not yet applied, bounded by count and by payload
    bytes: ``put`` waits (the socket is not read: TCP back-pressure on the primary) while the queue
    holds ``max_frames`` frames or the frame would take it past ``max_bytes``. A frame larger than
    ``max_bytes`` waits for an empty queue and is taken alone. The applier ``take``s everything at
    once, so a backup holds the group it applies and the queue filling meanwhile, each at most
    max(``max_bytes``, the largest frame), and the one frame being read: about
    2 x max(``max_bytes``, largest frame) + that frame (frames are at most MAX_FRAME)."""

    def __init__(self, max_frames: int, max_bytes: int) -> None:
        self.max_frames = max_frames
        self.max_bytes = max_bytes
        self.bytes = 0
        """Payload bytes queued now (a backup's status: ``queued_bytes``)."""
        self.full = False
        """True while the reader waits for room: the primary meets TCP back-pressure, this backup's
        writes are what holds replication back (a backup's status: ``queue_full``)."""
        self._frames: deque[tuple[Frame, bytes]] = deque()
        self._ended = False
        self._space = asyncio.Event()
        self._queued = asyncio.Event()

    def _full_for(self, size: int) -> bool:
        return bool(self._frames) and (len(self._frames) >= self.max_frames or self.bytes + size > self.max_bytes)

    async def put(self, frame: tuple[Frame, bytes]) -> None:
        size = len(frame[1])
        while self._full_for(size):  # one reader: only take() makes room
            self.full = True
            self._space.clear()
            await self._space.wait()
        self._frames.append(frame)
        self.bytes += size
        self._queued.set()

    async def take(self) -> list[tuple[Frame, bytes]]:
        """Every frame queued, in order (at least one); [] once ``end`` was called and all were taken."""
        while not self._frames and not self._ended:
            self._queued.clear()
            await self._queued.wait()
        group = list(self._frames)
        self._frames.clear()
        self.bytes = 0
        self.full = False
        self._space.set()
        return group

    def end(self) -> None:
        """The receiver ended: ``take`` returns what is left, then []."""
        self._ended = True
        self._queued.set()


async def _receive(reader: asyncio.StreamReader, frames: FrameQueue, session: Session) -> None:
    """Queue the primary's frames; a frame that fails its MAC (with a secret) ends the connection
    here, before it is queued: nothing in it is applied."""
    while True:
        await frames.put(await session.read(reader))


def _write(db: Any, ops: list[Op], sync: bool, batches: Sequence[CheckedBatch] = ()) -> None:
    """Write ``batches``' operations, then ``ops``, as one LevelDB write batch; nothing of it when
    an operation does not decode (or a put fails)."""
    with db.write_batch(sync=sync, transaction=True) as batch:
        delete, put = batch.delete, batch.put
        for checked in batches:
            checked.apply(put, delete)
        for key, value in ops:
            if value is None:
                delete(key)
            else:
                put(key, value)


def _wipe(db: Any) -> None:
    """Mark the store partial (synced), then delete every other key, in chunks. The layout
    version stays: the store remains one the plugin opens (and the snapshot writes it again)."""
    db.put(SNAPSHOT_MARK_KEY, b"", sync=True)
    while True:
        keys = []
        for key in db.iterator(include_value=False):
            if key not in _KEPT:
                keys.append(key)
            if len(keys) >= WIPE_CHUNK:
                break
        if not keys:
            return
        _write(db, [(key, None) for key in keys], False)
