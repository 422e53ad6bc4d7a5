"""Replication framing, the retained batch log and catch-up planning: pure logic."""

from __future__ import annotations

import asyncio
import re
import zlib
from pathlib import Path

import pytest

from amqtt_durable.replication import backup
from amqtt_durable.replication.backup import Backup
from amqtt_durable.replication.errors import FrameError
from amqtt_durable.replication.framing import (
    MAX_PEER_FRAME,
    NAME_IN_USE,
    TOO_MANY_BACKUPS,
    VERSION_REFUSED,
    Frame,
    Hello,
    decode_batch,
    encode_batch,
    encode_frame,
    encode_ops,
    frame_type,
    read_frame,
)
from amqtt_durable.replication.log import RetainedLog, plan_catch_up
from amqtt_durable.store import open_store

OPS = [(b"q\x00\x01", b"entry"), (b"m\x00", b""), (b"t\x07", None), (b"\xff" * 300, b"v" * 70_000)]


def test_batch_round_trip_keeps_every_operation_in_order() -> None:
    data, crc = encode_batch(42, 0xABCDEF, OPS)
    batch = decode_batch(data)
    assert (batch.seq, batch.store_id, list(batch.ops), batch.crc) == (42, 0xABCDEF, OPS, crc)


def test_a_batch_is_the_documented_bytes() -> None:
    """framing.py's layout, written out by hand (big-endian): a primary and a backup of different
    releases must agree on it byte for byte, whatever shortcuts the encoder takes. Keys of many
    lengths (each length has its own packer), empty keys and values, puts and deletes mixed."""
    ops = [*OPS, (b"", b""), (b"", None), *((bytes([n % 256]) * n, bytes(n % 7)) for n in range(1, 400, 13))]
    body = (42).to_bytes(8, "big") + (0xABCDEF).to_bytes(8, "big") + len(ops).to_bytes(4, "big")
    for key, value in ops:
        body += len(key).to_bytes(4, "big") + (b"\x01" if value is None else b"\x00") + key
        if value is not None:
            body += len(value).to_bytes(4, "big") + value
    crc = zlib.crc32(body)
    assert encode_batch(42, 0xABCDEF, ops) == (body + crc.to_bytes(4, "big"), crc)
    assert encode_ops(ops) == body[16:]


def test_empty_batch_round_trips() -> None:
    data, _ = encode_batch(1, 2, [])
    assert decode_batch(data).ops == ()


@pytest.mark.parametrize("position", [0, 9, 20, 40])
def test_a_flipped_byte_is_a_checksum_error(position: int) -> None:
    data, _ = encode_batch(7, 8, OPS)
    damaged = bytearray(data)
    damaged[position] ^= 0x01
    with pytest.raises(FrameError, match="checksum"):
        decode_batch(bytes(damaged))


def test_a_truncated_batch_is_refused() -> None:
    data, _ = encode_batch(7, 8, OPS)
    with pytest.raises(FrameError):
        decode_batch(data[:10])


def test_the_checksum_is_the_batch_identity() -> None:
    assert encode_batch(3, 1, OPS)[1] != encode_batch(3, 1, OPS[:-1])[1]
    assert encode_batch(3, 1, OPS)[1] == encode_batch(3, 1, list(OPS))[1]


def test_frames_round_trip_and_damage_is_detected() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        hello = Hello(store_id=5, seq=6, crc=7, name="backup-é")
        good = encode_frame(Frame.HELLO, hello.encode())
        bad = bytearray(encode_frame(Frame.ACK, b"\x00" * 8))
        bad[6] ^= 0xFF
        reader.feed_data(good + bytes(bad))
        reader.feed_eof()
        kind, payload = await read_frame(reader)
        assert kind == Frame.HELLO
        assert Hello.decode(payload) == hello
        with pytest.raises(FrameError, match="checksum"):
            await read_frame(reader)

    asyncio.run(main())


def test_frame_type_names_every_type_and_refuses_any_other_number() -> None:
    for kind in Frame:
        found = frame_type(int(kind))
        assert found is kind and type(found) is Frame
    for number in (0, 12, 99, 255, -1):
        with pytest.raises(FrameError, match=f"unknown type {number}"):
            frame_type(number)


HEADER = Hello(store_id=5, seq=6, crc=7, name="").encode()
"""A HELLO's fixed header (version, store, batch, crc) without a name."""


def test_hello_carries_the_backup_process_after_a_nul_and_an_earlier_versions_hello_reads_as_unknown() -> None:
    hello = Hello(store_id=5, seq=6, crc=7, name="b-é", instance=0xFF00_0000_0000_0001)
    assert hello.encode() == HEADER + "b-é".encode() + b"\x00" + (0xFF00_0000_0000_0001).to_bytes(8, "big")
    assert Hello.decode(hello.encode()) == hello
    assert Hello.decode(HEADER + b"b") == Hello(5, 6, 7, "b", instance=0)  # no NUL: an earlier version's
    assert Hello(5, 6, 7, "b").encode() == HEADER + b"b"  # instance 0 (unknown) is not sent
    assert Hello.decode(HEADER + b"b\x00" + bytes(8)) == Hello(5, 6, 7, "b", instance=0)  # an explicit 0: unknown
    with pytest.raises(FrameError, match="it is empty"):  # a backup without replication.name sends "backup"
        Hello.decode(HEADER + b"\x00" + (9).to_bytes(8, "big"))


@pytest.mark.parametrize(
    ("name", "why"),
    [
        ("", "it is empty"),
        ("a/b", "it holds '/', '+', '#' or a control character"),
        ("a+b", "it holds '/', '+', '#' or a control character"),
        ("a#b", "it holds '/', '+', '#' or a control character"),
        ("a\nb", "it holds '/', '+', '#' or a control character"),
        ("a\x1b[2Jb", "it holds '/', '+', '#' or a control character"),
        (1025 * "x", "it is longer than 1024 bytes of UTF-8"),
        (513 * "\u00e9", "it is longer than 1024 bytes of UTF-8"),
    ],
)
def test_a_hello_under_a_name_no_replication_name_can_be_does_not_decode(name: str, why: str) -> None:
    """A stranger's name reaches the $SYS topics (a topic is at most 65535 bytes) and the logs only if decoded."""
    with pytest.raises(FrameError, match=re.escape(f"the backup's name is no replication.name: {why}")):
        Hello.decode(Hello(5, 6, 7, name).encode())
    assert Hello.decode(Hello(5, 6, 7, 1024 * "x").encode()).name == 1024 * "x"
    assert Hello.decode(Hello(5, 6, 7, 512 * "\u00e9").encode()).name == 512 * "\u00e9"


@pytest.mark.parametrize("tail", [b"\x00", b"\x00" + bytes(7), b"\x00" + bytes(9), b"\x00" + bytes(8) + b"\x00"])
def test_a_hello_whose_instance_is_not_eight_bytes_is_refused(tail: bytes) -> None:
    with pytest.raises(FrameError, match="HELLO"):
        Hello.decode(HEADER + b"b" + tail)


def test_a_backups_hello_is_never_read_as_a_name_by_an_earlier_versions_primary(tmp_path: Path) -> None:
    """An earlier version decodes all after the header as the name (UTF-8): the instance's top byte
    0xFF makes that fail every time (that primary refuses the HELLO, never takes it for a name)."""
    db = open_store(str(tmp_path / "b"))
    for _ in range(200):
        instance = Backup(db, name="b").instance
        assert instance >> 56 == 0xFF
        with pytest.raises(UnicodeDecodeError):
            Hello(5, 6, 7, "b", instance=instance).encode()[len(HEADER) :].decode("utf-8")
    db.close()


def test_a_frame_longer_than_the_limit_is_refused_before_its_payload_arrives() -> None:
    async def main() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data(bytes([Frame.HELLO]) + (200 * 1024 * 1024).to_bytes(4, "big"))  # the header alone
        with pytest.raises(FrameError, match=f"length 209715200 is larger than {MAX_PEER_FRAME}"):
            await asyncio.wait_for(read_frame(reader, MAX_PEER_FRAME), 5)

    asyncio.run(main())


def filled(count: int, *, max_batches: int = 100, max_bytes: int = 1 << 20, size: int = 10) -> RetainedLog:
    log = RetainedLog(max_batches=max_batches, max_bytes=max_bytes)
    for seq in range(1, count + 1):
        log.append(seq, 1000 + seq, b"x" * size)
    return log


def test_retained_log_bounded_by_count_keeps_the_newest() -> None:
    log = filled(250, max_batches=100)
    assert (len(log), log.first_seq, log.head_seq, log.base_seq) == (100, 151, 250, 150)
    assert log.crc_of(150) == 1150  # the last batch that left still answers a position check
    assert log.crc_of(149) is None
    assert [item.seq for item in log.since(247)] == [248, 249, 250]


def test_retained_log_bounded_by_bytes_keeps_at_least_the_newest() -> None:
    log = filled(50, max_bytes=100, size=30)
    assert (len(log), log.first_seq, log.size_bytes) == (3, 48, 90)
    huge = filled(3, max_bytes=10, size=1000)
    assert (len(huge), huge.head_seq) == (1, 3)


def test_retained_log_refuses_a_gap() -> None:
    log = filled(3)
    with pytest.raises(ValueError, match="after batch 3"):
        log.append(5, 0, b"")


def test_retained_log_starts_at_the_store_position() -> None:
    log = RetainedLog(max_batches=10, max_bytes=100, last_seq=77, last_crc=9)
    assert (log.head_seq, log.first_seq, log.crc_of(77)) == (77, 78, 9)
    log.append(78, 1, b"")
    assert log.head_seq == 78


def test_wait_beyond_returns_once_a_newer_batch_is_appended() -> None:
    async def main() -> None:
        log = filled(2)
        waiter = asyncio.create_task(log.wait_beyond(2))
        await asyncio.sleep(0)
        assert not waiter.done()
        log.append(3, 0, b"")
        await asyncio.wait_for(waiter, 5)

    asyncio.run(main())


STORE = 0x51


@pytest.mark.parametrize(
    ("store", "seq", "crc", "kind", "words"),
    [
        (STORE, 250, 1250, "log", "up to date"),
        (STORE, 200, 1200, "log", "50 batches behind"),
        (STORE, 150, 1150, "log", "100 batches behind"),
        (STORE, 149, 1149, "snapshot", "too far behind"),
        (STORE, 0, 0, "snapshot", "never applied"),
        (STORE, None, 0, "snapshot", "half-applied"),
        (0x99, 200, 1200, "snapshot", "not this primary's"),
        (STORE, 260, 0, "snapshot", "diverged"),
        (STORE, 200, 4, "snapshot", "differs"),
    ],
)
def test_catch_up_plan(store: int, seq: int | None, crc: int, kind: str, words: str) -> None:
    plan = plan_catch_up(filled(250, max_batches=100), STORE, store, seq, crc)
    assert plan.kind == kind
    assert words in plan.reason
    if kind == "log":
        assert plan.from_seq == seq


def test_a_pin_keeps_the_batches_a_backup_still_needs_up_to_the_hard_limit() -> None:
    log = RetainedLog(max_batches=10, max_bytes=1000, pin_max_bytes=500)
    for seq in range(1, 11):
        log.append(seq, seq, b"x" * 10)
    log.pin("backup", 3)
    for seq in range(11, 31):
        log.append(seq, seq, b"x" * 10)
    assert log.first_seq == 4  # batches 4.. stay for the pinned backup
    log.pin("backup", None)
    log.append(31, 31, b"")
    assert log.first_seq == 22
    log.pin("backup", 22)
    for seq in range(32, 100):
        log.append(seq, seq, b"x" * 10)
    assert log.first_seq > 23  # past pin_max_bytes the pin is dropped: that backup needs a snapshot
    assert plan_catch_up(log, 1, 1, 22, 22).kind == "snapshot"


def raw_batch(ops_bytes: bytes) -> bytes:
    """A batch around ``ops_bytes`` as given (count and operations), its checksum right."""
    body = (7).to_bytes(8, "big") + (8).to_bytes(8, "big") + ops_bytes
    return body + zlib.crc32(body).to_bytes(4, "big")


PUT = (3).to_bytes(4, "big") + b"\x00" + b"key" + (5).to_bytes(4, "big") + b"value"


@pytest.mark.parametrize(
    ("ops_bytes", "why"),
    [
        ((2).to_bytes(4, "big") + PUT, "truncated"),  # one operation fewer than counted
        ((1).to_bytes(4, "big") + PUT[:-1], "truncated"),  # the value ends early
        ((1).to_bytes(4, "big") + (9).to_bytes(4, "big") + b"\x01" + b"key", "truncated"),  # a key into the CRC
        ((1).to_bytes(4, "big") + PUT + b"\x00", "1 bytes after the last operation"),
        ((1).to_bytes(4, "big") + (3).to_bytes(4, "big") + b"\x02" + b"key", "unknown operation kind 2"),
    ],
)
def test_a_batch_whose_operations_do_not_fit_its_length_is_refused(ops_bytes: bytes, why: str) -> None:
    decode_batch(raw_batch((1).to_bytes(4, "big") + PUT))  # the well-formed one decodes
    with pytest.raises(FrameError, match=why):
        decode_batch(raw_batch(ops_bytes))


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (f"{TOO_MANY_BACKUPS} 2 (backup x {NAME_IN_USE} y refused; it retries)", backup.BackupsFullError),
        (f"{TOO_MANY_BACKUPS} 2 (backup x {VERSION_REFUSED} 2 refused; it retries)", backup.BackupsFullError),
        (f"backup name {TOO_MANY_BACKUPS} 2 {NAME_IN_USE} 10.0.0.1:1 (this connection: ...)", backup.NameInUseError),
        (f"backup name x {VERSION_REFUSED} 1 {NAME_IN_USE} 10.0.0.1:1 (this connection: ...)", backup.NameInUseError),
        (f"replication protocol version 3 {VERSION_REFUSED} 2", backup.VersionRefusedError),
        ("something else", backup.AuthError),
    ],
)
def test_a_refusal_is_known_by_its_own_words_whatever_name_it_quotes(text: str, kind: type) -> None:
    """The words that begin a refusal are looked for at its start only, and first: the backup name
    a refusal for the cap quotes cannot make it pass for a name clash or a version refusal."""
    assert type(backup._refusal(text.encode())) is kind
