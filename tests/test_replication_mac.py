"""replication.secret without TLS against a relay between a backup and its primary (the review's
attack_relay.py): whoever the backup connects to (a redirected primary address) forwards the
handshake's three AUTH frames to the real primary, frame by frame, without knowing the secret,
and then speaks on the connection. Every frame after the handshake carries a MAC (auth.Session),
so the primary gives it nothing and counts no ACK of its, and the backup applies nothing from
it. Real Primary and Backup, real LevelDB stores, TCP on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from replication_helpers import HOST, bounded, commit, content, following, in_sync, new_backup, ops_for, started_primary

from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.errors import FrameError
from amqtt_durable.replication.framing import (
    Frame,
    Hello,
    decode_batch,
    encode_batch,
    encode_frame,
    encode_ops,
    encode_position,
    encode_seq,
    read_frame,
)
from amqtt_durable.replication.primary import Primary
from amqtt_durable.store import open_store

pytestmark = pytest.mark.timeout(60)

SECRET = b"replication-secret-of-the-mac-tests-0123456789"
Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]
Attack = Callable[[Streams, Streams], Awaitable[None]]


class Relay:
    """A listening address the backup is sent to: the first connection has its handshake relayed
    to the primary, then ``attack`` runs with (backup side, primary side); later connections are
    closed at once. ``done`` is set when the attack returns."""

    def __init__(self, primary_port: int, attack: Attack) -> None:
        self.primary_port = primary_port
        self.attack = attack
        self.done = asyncio.Event()
        self.port = 0
        self._server: asyncio.Server | None = None
        self._used = False

    async def __aenter__(self) -> Relay:
        self._server = await asyncio.start_server(self._serve, HOST, 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, b_reader: asyncio.StreamReader, b_writer: asyncio.StreamWriter) -> None:
        if self._used:
            b_writer.close()
            return
        self._used = True
        p_reader, p_writer = await asyncio.open_connection(HOST, self.primary_port)
        try:
            for source, target in ((b_reader, p_writer), (p_reader, b_writer), (b_reader, p_writer)):
                kind, payload = await read_frame(source)
                assert kind == Frame.AUTH
                target.write(encode_frame(kind, payload))
                await target.drain()
            await self.attack((b_reader, b_writer), (p_reader, p_writer))
        finally:
            p_writer.close()
            b_writer.close()
            self.done.set()


@pytest.fixture(autouse=True)
def replication_named_once(caplog: pytest.LogCaptureFixture) -> Iterator[None]:
    """Every line these tests log names replication once: the errors' texts began with "replication: "
    too, so a backup's `replication: backup b: channel to ...: ended: replication: frame 4 from the primary
    failed its MAC` and a primary's `... disconnected (FrameMacError: replication: frame 2 ...` said it twice."""
    caplog.set_level(logging.INFO, logger="amqtt_durable")
    yield
    messages = [record.getMessage() for record in caplog.get_records("call")]
    assert [message for message in messages if message.count("replication:") > 1] == []


async def read_until_closed(reader: asyncio.StreamReader, within: float = 3.0) -> list[tuple[Frame, bytes]]:
    """The frames the other side sends until it closes the connection (or ``within`` seconds)."""
    received: list[tuple[Frame, bytes]] = []
    with contextlib.suppress(TimeoutError, asyncio.IncompleteReadError, ConnectionError, FrameError):
        async with asyncio.timeout(within):
            while True:
                received.append(await read_frame(reader))
    return received


async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    """Bytes from reader to writer, unchanged, until the reader's side ends."""
    with contextlib.suppress(ConnectionError):
        while data := await reader.read(65536):
            writer.write(data)
            await writer.drain()


async def relay_downstream(
    backup_side: Streams, primary_side: Streams, on_frame: Callable[[Frame, bytes], Awaitable[None]]
) -> None:
    """The backup's HELLO and ACKs go to the primary unchanged; each frame from the primary goes to
    ``on_frame`` (the attack), until either side ends. When the backup leaves, so does the relay."""

    async def upstream() -> None:
        try:
            await pipe(backup_side[0], primary_side[1])
        finally:
            primary_side[1].close()

    forwarding = asyncio.create_task(upstream())
    try:
        with contextlib.suppress(asyncio.IncompleteReadError, ConnectionError):
            while not forwarding.done():
                await on_frame(*await read_frame(primary_side[0]))
    finally:
        forwarding.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await forwarding


async def secured_pair(folder: Path) -> tuple[Primary, Backup]:
    """A started primary with the secret (its store in folder/p) and a backup with it (folder/b)."""
    primary = await started_primary(folder / "p", log_max_batches=1000, secret=SECRET)
    return primary, new_backup(folder, "b", secret=SECRET)


async def replicated_pair(folder: Path, batches: int) -> tuple[Primary, Backup]:
    """A primary with the secret and ``batches`` batches, a backup (with the secret) that has
    applied them all, no longer following."""
    primary, backup = await secured_pair(folder)
    async with in_sync(primary.port, backup):
        await bounded(asyncio.gather(*(commit(primary, ops_for(n)) for n in range(1, batches + 1))))
        await bounded(backup.wait_applied(batches))
    return primary, backup


def test_a_relayed_handshake_then_a_hello_of_its_own_gets_nothing_from_the_primary(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    stolen: list[tuple[Frame, bytes]] = []

    async def steal(backup_side: Streams, primary_side: Streams) -> None:
        p_reader, p_writer = primary_side
        p_writer.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, "thief").encode()))  # a snapshot, please
        await p_writer.drain()
        stolen.extend(await read_until_closed(p_reader))

    async def main() -> None:
        primary, backup = await replicated_pair(tmp_path, 30)
        async with Relay(primary.port, steal) as relay, following(backup, relay.port):
            await bounded(relay.done.wait())
        assert stolen == []  # not a frame: no snapshot, no batch
        assert all(row["name"] != "thief" for row in primary.status())
        await primary.close()
        backup.db.close()

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    assert "refused a connection from 127.0.0.1:" in caplog.text
    assert "frame 0 from the peer failed its MAC" in caplog.text
    refusals = [record.getMessage() for record in caplog.records if "refused a connection" in record.getMessage()]
    assert refusals and all(line.count("replication:") == 1 for line in refusals), refusals  # said once


def test_a_relayed_handshake_then_a_forged_snapshot_leaves_the_backups_store_as_it_was(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    answers: list[tuple[Frame, bytes]] = []

    async def forge(backup_side: Streams, primary_side: Streams) -> None:
        b_reader, b_writer = backup_side
        kind, _ = await read_frame(b_reader)  # the backup's HELLO
        assert kind == Frame.HELLO
        b_writer.write(
            encode_frame(Frame.SNAP_BEGIN)
            + encode_frame(Frame.SNAP_CHUNK, encode_ops([(b"forged-key", b"forged-value")]))
            + encode_frame(Frame.SNAP_END, encode_position(424242, 0))
            + encode_frame(Frame.IN_SYNC, encode_seq(424242))
            + encode_frame(Frame.BATCH, encode_batch(31, 1, [(b"forged-batch", b"x")])[0])
        )
        await b_writer.drain()
        answers.extend(await read_until_closed(b_reader))

    async def main() -> None:
        primary, backup = await replicated_pair(tmp_path, 30)
        before = content(backup.db)
        async with Relay(primary.port, forge) as relay, following(backup, relay.port):
            await bounded(relay.done.wait())
        assert answers == []  # no ACK: nothing applied
        assert backup.applied_seq == 30 and backup.snapshots == 1
        await primary.close()
        backup.db.close()
        db = open_store(str(tmp_path / "b"))  # as it is on disk
        try:
            assert content(db) == before and db.get(b"forged-key") is None
        finally:
            db.close()

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    assert "backup b: channel to 127.0.0.1:" in caplog.text
    assert "frame 0 from the primary failed its MAC" in caplog.text


def tamper(frame_content: bytes) -> bytes:
    """The batch in a BATCH frame's content with its values changed and its CRC made right again
    (a MAC of 16 bytes after it, if any, is kept as it was: the relay cannot make a new one)."""
    for tail in (0, 16):
        body, tag = (frame_content[:-tail], frame_content[-tail:]) if tail else (frame_content, b"")
        try:
            batch = decode_batch(body)
        except FrameError:
            continue
        ops = [(key, value.replace(b"body-", b"EVIL-") if value else value) for key, value in batch.ops]
        return encode_batch(batch.seq, batch.store_id, ops)[0] + tag
    raise AssertionError("not a batch")


def test_a_batch_altered_on_the_wire_with_its_checksums_fixed_is_refused(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def alter(backup_side: Streams, primary_side: Streams) -> None:
        async def pass_on_altered(kind: Frame, payload: bytes) -> None:
            backup_side[1].write(encode_frame(kind, tamper(payload) if kind == Frame.BATCH else payload))
            await backup_side[1].drain()

        await relay_downstream(backup_side, primary_side, pass_on_altered)

    async def main() -> None:
        primary, backup = await secured_pair(tmp_path)
        async with Relay(primary.port, alter) as relay, following(backup, relay.port):
            await bounded(backup.in_sync_event.wait())  # the snapshot of the empty store passed unaltered
            committed = [commit(primary, ops_for(n)) for n in range(1, 6)]
            with contextlib.suppress(TimeoutError):
                await bounded(relay.done.wait(), 10)  # the backup closes the connection
            assert not any(b"EVIL-" in value for _, value in content(backup.db))
            assert backup.applied_seq == 0 and relay.done.is_set()
            await bounded(asyncio.gather(*committed))  # the primary no longer waits for it
        await primary.close()
        backup.db.close()

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    assert "failed its MAC" in caplog.text and "backup b: channel to 127.0.0.1:" in caplog.text


def test_a_pair_with_the_secret_replicates_and_catches_up_through_an_honest_relay(tmp_path: Path) -> None:
    """A relay that only forwards is a network hop: every frame passes its MAC, batches and a
    snapshot (for a second backup) arrive intact."""

    async def forward(backup_side: Streams, primary_side: Streams) -> None:
        pipes = {
            asyncio.create_task(pipe(backup_side[0], primary_side[1])),
            asyncio.create_task(pipe(primary_side[0], backup_side[1])),
        }
        await asyncio.wait(pipes, return_when=asyncio.FIRST_COMPLETED)
        for task in pipes:
            task.cancel()

    async def main() -> None:
        primary, backup = await replicated_pair(tmp_path, 200)
        late = new_backup(tmp_path, "late", secret=SECRET)
        async with Relay(primary.port, forward) as relay, following(late, relay.port):
            await bounded(late.in_sync_event.wait())  # a snapshot of 200 batches' rows
            await bounded(asyncio.gather(*(commit(primary, ops_for(n)) for n in range(201, 301))))
            await bounded(late.wait_applied(300))
            assert content(late.db) == content(primary.db)
        await primary.close()
        backup.db.close()
        late.db.close()

    asyncio.run(main())


def test_a_forged_ack_does_not_count_for_the_primary(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The relay keeps the batches from the backup and acknowledges them itself: on a channel
    without MACs the primary would count the backup as having batches it never received."""

    async def swallow_and_ack(backup_side: Streams, primary_side: Streams) -> None:
        async def ack_batches_pass_on_the_rest(kind: Frame, payload: bytes) -> None:
            if kind != Frame.BATCH:
                backup_side[1].write(encode_frame(kind, payload))
                await backup_side[1].drain()
                return
            seq = int.from_bytes(payload[:8], "big")
            primary_side[1].write(encode_frame(Frame.ACK, encode_seq(seq)))  # "applied", says the relay
            await primary_side[1].drain()

        await relay_downstream(backup_side, primary_side, ack_batches_pass_on_the_rest)

    async def main() -> None:
        primary, backup = await secured_pair(tmp_path)
        async with Relay(primary.port, swallow_and_ack) as relay, following(backup, relay.port):
            await bounded(backup.in_sync_event.wait())
            await bounded(asyncio.gather(*(commit(primary, ops_for(n)) for n in range(1, 6))))
            assert backup.applied_seq == 0
            assert all(row["acked"] <= backup.applied_seq for row in primary.status()), primary.status()
        await primary.close()
        backup.db.close()
        await bounded(relay.done.wait())

    with caplog.at_level(logging.WARNING, logger="amqtt_durable.replication"):
        asyncio.run(main())
    assert "backup b (127.0.0.1:" in caplog.text and "from the peer failed its MAC" in caplog.text
