"""Issue 10 review of the merged store points (4, 5, 6 with the b"e", b"r", b"x" prefixes), without a
broker: each test is an interaction between two merged branches, on a real LevelDB under tmp_path.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import struct
from pathlib import Path

import plyvel
import pytest
from test_store_repair import digest
from test_streams import make_logs, sender_for

from amqtt_durable.cli import main
from amqtt_durable.config import DurableConfig, StreamConfig
from amqtt_durable.delivery import READ_CHUNK
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import ForeignStoreError, StoreCorruptedError, StoreUnavailableError
from amqtt_durable.repair import repair
from amqtt_durable.store import (
    LAYOUT_VERSION,
    PROBE_NAME,
    RETAINED_PREFIX,
    VERSION_KEY,
    GroupCommitter,
    body_key,
    iter_retained,
    open_store,
    pubrel_key,
    retained_key,
    session_key,
    totals_key,
)
from amqtt_durable.stream_log import MARK_PREFIX, StreamLogs, encode_event, event_key
from recording_transport import RecordingTransport

GENEROUS = 10.0
COMMITTER = {"sync": False, "batch_size": 5000, "batch_delay_ms": 0.0, "pending_threshold": 1}
NOW = 1_800_000_000.0


def drop_version_key(path: str) -> None:
    """What a damaged table that held the version key leaves after LevelDB's repair."""
    db = plyvel.DB(path)
    db.delete(VERSION_KEY, sync=True)
    db.close()


def test_repair_restores_the_version_key_of_a_store_holding_only_retained_messages(store_path: str) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        stored = engine.route_publish("device/7/state", b"on", 1, retain=True)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        await engine.close()

    asyncio.run(main())
    drop_version_key(store_path)
    with pytest.raises(StoreCorruptedError, match="no layout version key"):
        open_store(store_path, create=False)
    report = repair(store_path)
    assert report.rebuilt == ["layout version key restored"]
    assert report.lost == []
    db = open_store(store_path, create=False)
    try:
        assert [(m.topic, m.payload, m.qos) for m in iter_retained(db)] == [("device/7/state", b"on", 1)]
    finally:
        db.close()


def test_repair_restores_the_version_key_of_a_store_holding_only_stream_events(store_path: str) -> None:
    db = plyvel.DB(store_path, create_if_missing=True)
    db.put(event_key("s/a", 1), encode_event(NOW, 1, b"first"))
    db.put(MARK_PREFIX + b"s/a", struct.pack(">Q", 1))
    db.close()
    report = repair(store_path)
    assert report.rebuilt == ["layout version key restored"]
    db = open_store(store_path, create=False)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
        assert db.get(event_key("s/a", 1)) == encode_event(NOW, 1, b"first"), "the event is kept"
    finally:
        db.close()


def test_repair_still_refuses_a_leveldb_whose_keys_only_share_the_new_prefixes(store_path: str) -> None:
    """Another program's keys starting with e, r, L or x are not taken for this plugin's: b"Lang" has
    the shape of a stream's id mark, b"email:1" has none (its lengths do not add up), so the folder is
    refused untouched, naming that key."""
    foreign = {b"email:1": b"a@b", b"role:admin": b"1", b"Lang": b"en", b"x1": b"y"}
    db = plyvel.DB(store_path, create_if_missing=True)
    for key, value in foreign.items():
        db.put(key, value)
    db.close()
    before = digest(store_path)
    with pytest.raises(ForeignStoreError, match=r"its key b'email:1' has the shape of no key"):
        repair(store_path)
    assert digest(store_path) == before
    db = plyvel.DB(store_path)
    try:
        assert dict(db.iterator()) == foreign
    finally:
        db.close()


@pytest.mark.parametrize("left", [["LOCK"], ["LOCK", "LOG"], ["LOCK", "LOG", "LOG.old"]])
def test_a_folder_left_by_a_crash_while_creating_the_store_becomes_a_store(tmp_path: Path, left: list[str]) -> None:
    """LevelDB makes LOCK and LOG before CURRENT: a crash (or a full disk) in between leaves only them.
    They are LevelDB's bookkeeping, no data: the next start creates the store instead of refusing."""
    path = tmp_path / "store"
    path.mkdir()
    for name in left:
        (path / name).write_bytes(b"")
    db = open_store(str(path))
    try:
        db.put(b"k", b"v")
    finally:
        db.close()
    db = open_store(str(path), create=False)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()


def test_after_a_failed_write_the_retry_reopens_and_retained_messages_and_qos2_ids_use_the_new_handle(
    store_path: str,
) -> None:
    """The disk-full retry swaps engine.db: nothing may keep writing to or reading the closed one."""

    async def main() -> None:
        recovered = asyncio.Event()
        engine = DurableEngine(
            DurableConfig(store=store_path),
            on_store_health=lambda health: recovered.set() if health.status == "ok" else None,
        )
        engine.open()
        await engine.connect("pub", clean_session=False)
        old = engine.db
        old.close()  # the next write fails, as on a full disk
        refused = engine.route_publish("a", b"1", 1, retain=True)
        assert refused is not None
        with pytest.raises(StoreUnavailableError):
            await asyncio.wait_for(refused, GENEROUS)
        engine.expect_pubrel("pub", 9)  # while failing: kept, written by the retry
        await asyncio.wait_for(recovered.wait(), GENEROUS)
        assert engine.db is not old and not engine.db.closed
        stored = engine.route_publish("b", b"2", 1, retain=True)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        assert [(m.topic, m.payload) for m in iter_retained(engine.db)] == [("a", b"1"), ("b", b"2")]
        assert engine.db.get(pubrel_key(engine.sessions["pub"].sid, 9)) == b""
        assert engine.pubrel_due("pub", 9)
        await engine.close()

    asyncio.run(main())


def test_qos2_ids_of_a_session_gone_before_a_crash_are_swept_and_never_reused(store_path: str) -> None:
    """A b"x" key whose session record is gone (a crash mid-delete) is deleted at start, and its
    session number is still never handed out again."""
    db = open_store(store_path)
    db.put(pubrel_key(41, 7), b"", sync=True)
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path, streams=[StreamConfig("s/#")]))
        engine.open()
        assert engine.db.get(pubrel_key(41, 7)) is None, "swept at start"
        await engine.connect("new", clean_session=False)
        assert engine.sessions["new"].sid > 41
        await engine.close()

    asyncio.run(main())
    assert not os.path.exists(os.path.join(store_path, "lost"))


def damaged_inspect_store(path: str, key: bytes, value: bytes) -> None:
    """A store with one session (one queued message) and one retained message, then ``key`` set to ``value``."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("c", clean_session=False)
        await engine.subscribe("c", "t", 1)
        stored = engine.route_publish("t", b"1", 1, retain=True)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        await engine.close()

    asyncio.run(main())
    db = plyvel.DB(path)
    db.put(key, value, sync=True)
    db.close()


@pytest.mark.parametrize(
    ("args", "key", "value", "named"),
    [
        ([], totals_key(1), b"\x00\x01\x02", "the queue totals of client id 'c': 3 bytes that do not decode"),
        ([], body_key(1), b"\x00", "the message body of the oldest queued message of client id 'c': 1 bytes"),
        (["--retained"], retained_key("t"), b"\x00", "the retained message of topic 't': 1 bytes that do not decode"),
        (["--retained"], RETAINED_PREFIX + b"\xff", b"\x00" * 9, "the topic of a retained message, b'\\xff', is not"),
    ],
    ids=["totals", "body", "retained-value", "retained-topic"],
)
def test_inspect_names_each_damaged_record_and_points_to_repair(
    store_path: str, capsys: pytest.CaptureFixture[str], *, args: list[str], key: bytes, value: bytes, named: str
) -> None:
    damaged_inspect_store(store_path, key, value)
    assert main(["inspect", store_path, *args]) == 1
    err = capsys.readouterr().err
    assert "is corrupted or unreadable" in err and named in err, err
    assert f"amqtt-durable repair {store_path}" in err, err


def test_stream_events_in_a_damaged_table_are_not_migrated_into_sound_keys(store_path: str) -> None:
    """The b"l" -> b"e" move at open re-writes every event: read without checksums, flipped bytes in
    a table would be copied into fresh, valid-looking keys and the damaged originals deleted, so the
    damage could never be detected or repaired again. Open must refuse and leave the old keys."""
    db = open_store(store_path)
    for event_id in range(1, 3001):  # incompressible: stored as is, so flipped bytes break no decompression
        payload = hashlib.shake_256(struct.pack(">Q", event_id)).digest(1000)
        db.put(b"ls/a\x00" + struct.pack(">Q", event_id), encode_event(NOW, 1, payload))
    db.compact_range()
    db.close()
    tables = sorted(Path(store_path).glob("*.ldb"), key=lambda table: table.stat().st_size)
    data = bytearray(tables[-1].read_bytes())
    for offset in range(64):
        data[len(data) // 2 + offset * 7] ^= 0xFF
    tables[-1].write_bytes(bytes(data))

    engine = DurableEngine(DurableConfig(store=store_path, streams=[StreamConfig("s/#")]))
    with pytest.raises(StoreCorruptedError, match="checksum"):
        engine.open()
    db = plyvel.DB(store_path)
    try:
        assert next(db.iterator(prefix=b"e"), None) is None, "nothing moved"
    finally:
        db.close()


def test_a_write_probe_left_by_a_crash_is_removed_at_open(store_path: str) -> None:
    """SIGKILL during a disk-full retry's probe leaves its file: megabytes on a disk that was full."""
    open_store(store_path).close()
    probe = Path(store_path, PROBE_NAME)
    probe.write_bytes(bytes(2 << 20))

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        await engine.close()

    asyncio.run(main())
    assert not probe.exists()


@pytest.mark.parametrize(
    ("key", "what"),
    [(b"x" + b"\x00" * 3, "QoS 2 packet id"), (b"t\x00\x01", "queue totals"), (b"w", "sent mark")],
    ids=["qos2-id", "totals", "sent-mark"],
)
def test_repair_removes_per_session_keys_too_short_to_name_a_session(store_path: str, key: bytes, what: str) -> None:
    """Start-up reads a session number from every b"t", b"w" and b"x" key: one too short stops it, and
    repair (which already removes such b"q" keys) must clear it, or the store never opens again."""
    open_store(store_path).close()
    db = plyvel.DB(store_path)
    db.put(key, b"", sync=True)
    db.close()
    with pytest.raises(StoreCorruptedError):
        DurableEngine(DurableConfig(store=store_path)).open()
    report = repair(store_path)
    assert report.lost == [f"a {what} key of {len(key)} bytes (damaged) removed"]

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        await engine.close()

    asyncio.run(main())


class _Seen(logging.Handler):
    """Sets an event when a record containing ``text`` is logged (same thread as the loop)."""

    def __init__(self, text: str) -> None:
        super().__init__()
        self.text = text
        self.event = asyncio.Event()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)
        if self.text in record.getMessage():
            self.event.set()


def test_a_pump_waits_out_a_store_closed_by_a_failed_reopen_without_calling_it_damage(store_path: str) -> None:
    """A connected session's backlog is read in chunks: during the outage its pump may meet the store
    closed by a reopen whose open failed. It retries (no read error counted, no 'run repair' advice:
    nothing is damaged) and delivers the rest once a retry reopens the store."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path, recovery_buffer=1))  # the in-flight window
        engine.open()
        await engine.connect("c", clean_session=False)
        await engine.subscribe("c", "t", 1)
        payloads = [b"%d" % index for index in range(READ_CHUNK + 2)]  # the pump reads READ_CHUNK at a time
        for payload in payloads:
            stored = engine.route_publish("t", payload, 1)
            assert stored is not None
        await asyncio.wait_for(engine.written_so_far(), GENEROUS)
        transport = RecordingTransport()
        await engine.attach("c", transport)
        # One in flight at a time: the chunk's last entry is sent (emptying the buffer, so the pump
        # reads the store) only once its second-to-last is acknowledged, which the outage's ack is.
        for count in range(1, READ_CHUNK - 1):
            sent = await transport.wait_for(lambda packets, count=count: len(packets) >= count)
            packet_id = sent[-1].packet_id
            assert packet_id is not None
            transport.ack("puback", packet_id)
        last = (await transport.wait_for(lambda packets: len(packets) >= READ_CHUNK - 1))[-1]

        def reopen_fails() -> None:
            if not engine.db.closed:
                engine.db.close()
            raise OSError(28, "No space left on device")

        seen = _Seen("tries again in")
        logging.getLogger("amqtt_durable").addHandler(seen)
        try:
            engine.committer.reopen = reopen_fails
            engine.db.close()  # the ack's write fails; its retry closes the store and cannot open it
            assert last.packet_id is not None
            transport.ack("puback", last.packet_id)
            await asyncio.wait_for(seen.event.wait(), GENEROUS)
            engine.committer.reopen = engine._reopen_store
            chunk_end = (await transport.wait_for(lambda packets: len(packets) >= READ_CHUNK))[-1]
            assert chunk_end.packet_id is not None
            transport.ack("puback", chunk_end.packet_id)
            sent = await transport.wait_for(lambda packets: len(packets) > READ_CHUNK, limit=GENEROUS)
        finally:
            logging.getLogger("amqtt_durable").removeHandler(seen)
        assert [packet.payload for packet in sent] == payloads[: READ_CHUNK + 1], "in order, none skipped"
        assert engine.read_errors == 0, "not damage"
        assert not [r for r in seen.records if "repair" in r.getMessage()], "no repair advice for a full disk"
        await engine.close()

    asyncio.run(main())


def stream_store(path: str, count: int) -> None:
    """``count`` incompressible events of s/a (stored as is: flipped bytes break no decompression)."""
    db = open_store(path)
    logs, committer = make_logs(db)
    for event_id in range(1, count + 1):
        logs.append("s/a", hashlib.shake_256(struct.pack(">Q", event_id)).digest(1000), 1, NOW)
    committer.flush_now()
    db.compact_range()
    db.close()


def test_a_stream_sender_meeting_the_store_closed_by_a_failed_reopen_retries_then_sends(store_path: str) -> None:
    stream_store(store_path, 3)

    async def main() -> None:
        db = open_store(store_path, create=False)
        logs, _ = make_logs(db)
        sender, recorder = sender_for(logs, window=1)
        await sender.subscribe("s/a", window=1)
        await recorder.wait_got(1)
        seen = _Seen("Sending tries again in")
        logging.getLogger("amqtt_durable").addHandler(seen)
        try:
            db.close()  # as a retry after a failed write leaves it when the store does not open again
            sender.ack("s/a", 1)
            await asyncio.wait_for(seen.event.wait(), GENEROUS)
            logs.use_db(open_store(store_path, create=False))  # the next retry reopened it
            assert [got.id for got in await recorder.wait_got(2)] == [1, 2]
        finally:
            logging.getLogger("amqtt_durable").removeHandler(seen)
        assert logs.read_errors == 0, "not damage"
        sender.stop()
        logs._db.close()

    asyncio.run(main())


def test_progress_after_resends_keeps_the_pause_of_a_failed_reads_retry(store_path: str) -> None:
    """An ack that makes progress after backed-off resends brings what is in flight forward, but a
    resend whose read failed waits out its retry pause (1 s first, as its ERROR says), not tried again
    at once (it was: the ack re-armed the timer at the overdue resend)."""
    stream_store(store_path, 3)

    async def main() -> None:
        db = open_store(store_path, create=False)
        logs = StreamLogs(db, GroupCommitter(db, **COMMITTER), [StreamConfig("s/#")], store_path)
        logs.load()
        sender, recorder = sender_for(logs, window=2, ack_timeout=0.05)
        seen = _Seen("the store is damaged")
        logging.getLogger("amqtt_durable").addHandler(seen)
        try:
            await sender.subscribe("s/a", window=2)
            await recorder.wait_for(lambda _: recorder.ids().count(1) >= 2, GENEROUS)  # one resend: backed off
            db.put(event_key("s/a", 2), b"\x00")  # the next resend's read fails on it
            await asyncio.wait_for(seen.event.wait(), GENEROUS)
        finally:
            logging.getLogger("amqtt_durable").removeHandler(seen)
        sender.ack("s/a", 1, refill=False)
        cursor = sender._cursors["s/a"]  # the retry's due time is what this test is about
        assert cursor.timer is not None
        assert cursor.timer.when() - asyncio.get_running_loop().time() > 0.5, "the retry's 1 s pause was cut"
        assert logs.read_errors == 1
        sender.stop()
        db.close()

    asyncio.run(main())


def test_a_stream_sender_meeting_a_damaged_log_reports_it_and_retries(store_path: str) -> None:
    """An event that does not decode: an ERROR with the repair advice, counted, tried again; nothing
    skipped. (Flipped bytes in a table holding a log stop the start already: see the migration test.)"""
    stream_store(store_path, 3)
    db = plyvel.DB(store_path)
    db.put(event_key("s/a", 2), b"\x00", sync=True)
    db.close()

    async def main() -> None:
        db = open_store(store_path, create=False)
        logs = StreamLogs(db, GroupCommitter(db, **COMMITTER), [StreamConfig("s/#")], store_path)
        logs.load()
        sender, recorder = sender_for(logs, window=10)
        seen = _Seen("the store is damaged")
        logging.getLogger("amqtt_durable").addHandler(seen)
        try:
            await sender.subscribe("s/a", window=10)
            await asyncio.wait_for(seen.event.wait(), GENEROUS)
            seen.event.clear()
            await asyncio.wait_for(seen.event.wait(), GENEROUS)  # tried again after its pause
        finally:
            logging.getLogger("amqtt_durable").removeHandler(seen)
        assert logs.read_errors == 2
        assert f"amqtt-durable repair {store_path}" in seen.records[-1].getMessage()
        assert recorder.got == [], "nothing past the damage, and not event 3 before event 2"
        sender.stop()
        db.close()

    asyncio.run(main())
    report = repair(store_path)
    assert report.lost == ["stream s/a: event 2 does not decode: removed"]


def test_repair_matches_a_damaged_record_to_a_publisher_known_only_by_its_qos2_ids(store_path: str) -> None:
    """A durable publisher that subscribes to nothing has no queue and no totals: only its pending
    QoS 2 ids carry its session number. Its damaged record must be matched to them (or, removed,
    its re-send after PUBREC would be routed again as a new session's)."""
    db = open_store(store_path)
    db.put(session_key("pub"), b'{"subscr', sync=True)  # the session number is not in what is left
    db.put(pubrel_key(3, 7), b"", sync=True)
    db.close()
    report = repair(store_path)
    assert report.rebuilt == ["client 'pub': session record rebuilt (session number 3)"]

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        assert engine.pubrel_due("pub", 7), "the re-send is still known"
        await engine.close()

    asyncio.run(main())
