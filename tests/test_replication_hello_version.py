"""What a primary answers a backup that speaks another replication protocol version, or acks what
it was never sent: an ERROR frame naming both versions (and the backup shows it), a closed
connection; the primary goes on."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from replication_helpers import HOST, bounded, commit, following, new_backup, ops_for, started_primary

from amqtt_durable.replication import backup as backup_module
from amqtt_durable.replication import framing
from amqtt_durable.replication.framing import Frame, Hello, encode_frame, encode_seq, read_frame


async def talk(port: int, *frames: bytes) -> bytes:
    """Send ``frames`` to the replication port; everything answered until the node closes."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(b"".join(frames))
        return await bounded(reader.read(), 10)
    finally:
        writer.close()


async def until(check: Callable[[], bool], seconds: float = 10.0) -> None:
    """Return once ``check()`` holds; TimeoutError after ``seconds``."""
    deadline = time.monotonic() + seconds
    while not check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"not true within {seconds} s")
        await asyncio.sleep(0.02)


def refusal(version: int, speaks: int = 1) -> str:
    return f"replication protocol version {version} not supported: this primary speaks {speaks}"


def test_a_hello_of_another_protocol_version_is_answered_with_an_error_naming_both_versions(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The version is read before the rest of the HELLO (another version's may be laid out
    otherwise, or be no more than its version); each refusal is counted, its text logged once
    (rate-limited like the handshake's refusals)."""
    caplog.set_level(logging.INFO, "amqtt_durable")
    hellos = {
        2: Hello(0, 0, 0, "future").encode().replace(b"\x00\x01", b"\x00\x02", 1),
        65535: b"\xff\xff" + b"a layout this version does not know",
    }

    async def main() -> None:
        primary = await started_primary(tmp_path / "p")
        try:
            commit(primary, ops_for(1))
            for version, hello in [*hellos.items(), (2, b"\x00\x02")]:
                answer = await talk(primary.port, encode_frame(Frame.HELLO, hello))
                assert answer == encode_frame(Frame.ERROR, refusal(version).encode()), answer[:200]
            assert primary.links == {} and primary.gate.refused == 3
            # A HELLO of this version is served as before.
            served = await talk_until_snapshot(primary.port)
            assert served == Frame.SNAP_BEGIN
        finally:
            await primary.close()
            primary.db.close()

    asyncio.run(main())
    for version in hellos:
        lines = [r for r in caplog.records if refusal(version) in r.getMessage()]
        assert len(lines) == 1 and lines[0].levelno == logging.WARNING, caplog.text
        assert "refused a connection from 127.0.0.1:" in lines[0].getMessage()
    assert "backup future" not in caplog.text, "a HELLO of another version was served as a backup"


async def talk_until_snapshot(port: int) -> Frame:
    """A HELLO of this version (a new backup): the primary's first frame."""
    reader, writer = await asyncio.open_connection(HOST, port)
    try:
        writer.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, "new").encode()))
        kind, _ = await bounded(read_frame(reader), 10)
        return kind
    finally:
        writer.close()


def test_a_backup_refused_for_its_version_shows_why_and_follows_once_the_primary_speaks_it(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A primary of version 2 (an upgrade half done) refuses this backup's HELLO of version 1: the
    backup logs an ERROR naming both versions (once a minute, however often it retries), says
    so in ``refused`` (``refused_by_primary`` of its status), and retries; once the primary
    speaks its version it follows it."""
    caplog.set_level(logging.DEBUG, "amqtt_durable")
    monkeypatch.setattr(framing, "PROTOCOL_VERSION", 2)
    monkeypatch.setattr(backup_module, "AUTH_RETRY", 0.1)  # retries every 0.1 s, not every 5 s

    def refusals(level: int) -> int:
        return sum(r.levelno == level and "not supported" in r.getMessage() for r in caplog.records)

    async def main() -> None:
        primary = await started_primary(tmp_path / "p")
        backup = new_backup(tmp_path, "b")
        try:
            commit(primary, ops_for(1))
            async with following(backup, primary.port):
                await until(lambda: refusals(logging.DEBUG) >= 2)  # refused 3 times: 1 ERROR, then DEBUG
                assert backup.refused == f"refused by the primary: {refusal(1, speaks=2)}"
                assert not backup.caught_up and backup.applied_seq == 0
                monkeypatch.undo()  # the primary is upgraded: it speaks 1 as well
                await bounded(backup.in_sync_event.wait())
                assert backup.refused is None
                await bounded(backup.wait_applied(1))
        finally:
            await primary.close()
            backup.db.close()
            primary.db.close()

    asyncio.run(main())
    said = f"replication: backup b: channel to {HOST}:"
    lines = [r for r in caplog.records if said in r.getMessage() and "not supported" in r.getMessage()]
    assert [r.levelno for r in lines[:3]] == [logging.ERROR, logging.DEBUG, logging.DEBUG], caplog.text
    assert refusals(logging.ERROR) == 1, caplog.text
    said = f"refused (retried every 0.1 s, this line at most once a minute): refused by the primary: {refusal(1, 2)}"
    assert said in lines[0].getMessage(), lines[0].getMessage()
    assert "accepted by the primary: it speaks this protocol version" in caplog.text


@pytest.mark.parametrize(("acks", "why"), [((1, 0), "ack of batch 0 after an ack of batch 1"),
                                           ((9,), "ack of batch 9, only 1 were sent")])  # fmt: skip
def test_an_ack_going_backwards_or_of_a_batch_never_sent_closes_that_connection(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, acks: tuple[int, ...], why: str
) -> None:
    """A backup's acks only grow on one connection, and never pass what it was sent: another is
    damage or no backup's, and ends that connection (WARNING naming it); the primary serves on."""
    caplog.set_level(logging.INFO, "amqtt_durable")

    async def main() -> None:
        primary = await started_primary(tmp_path / "p")
        try:
            await commit(primary, ops_for(1))
            reader, writer = await asyncio.open_connection(HOST, primary.port)
            writer.write(encode_frame(Frame.HELLO, Hello(0, 0, 0, "fake").encode()))
            kinds = []
            while not kinds or kinds[-1] != Frame.SNAP_END:  # bounded: a snapshot of one batch
                kinds.append((await bounded(read_frame(reader), 10))[0])
            writer.write(b"".join(encode_frame(Frame.ACK, encode_seq(seq)) for seq in acks))
            rest = await bounded(reader.read(), 10)  # IN_SYNC after the ack of the snapshot, then the end
            assert rest in (b"", encode_frame(Frame.IN_SYNC, encode_seq(1))), rest
            writer.close()
            await until(lambda: not primary.links)
            assert (await commit(primary, ops_for(2))) is None  # serves on
        finally:
            await primary.close()
            primary.db.close()

    asyncio.run(main())
    assert "backup fake (127.0.0.1:" in caplog.text and why in caplog.text, caplog.text
