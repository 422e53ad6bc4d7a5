"""Issue 10, points 4 and 6 without a broker: where a store may be created, what a damaged one
says at open and at start-up, how a pump's read meets damage, and what `repair` rebuilds.

Every test uses a real LevelDB folder under tmp_path.
"""

from __future__ import annotations

import asyncio
import hashlib
import os
from pathlib import Path
from typing import Any

import plyvel
import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import ForeignStoreError, StoreCorruptedError, StoreError, StoreReadError
from amqtt_durable.repair import SENT_MARK_JUMP, RepairReport, repair
from amqtt_durable.replication.framing import encode_position
from amqtt_durable.replication.position import POSITION_KEY, read_position
from amqtt_durable.store import (
    FLAG_RELEASED,
    FLAG_SHARED,
    LAYOUT_VERSION,
    MSG_ID_MARK_KEY,
    NO_BODY,
    SID_MARK_KEY,
    VERSION_KEY,
    Body,
    Entry,
    SessionRecord,
    body_key,
    decode_refs,
    decode_totals,
    decode_u64,
    encode_refs,
    encode_totals,
    encode_u64,
    entry_key,
    iter_sessions,
    open_store,
    refs_key,
    sent_mark_key,
    seq_of_entry_key,
    session_key,
    totals_key,
)

NOW = 1_800_000_000.0


def digest(path: str) -> dict[str, str]:
    return {name: hashlib.sha256(Path(path, name).read_bytes()).hexdigest() for name in sorted(os.listdir(path))}


def queue(db: Any, sid: int, seqs: range, *, payload: bytes = b"p" * 10) -> None:
    """Queue entries ``seqs`` for session ``sid``, each with its own body (msg id = sid * 1000 + seq)."""
    for seq in seqs:
        msg_id = sid * 1000 + seq
        db.put(body_key(msg_id), Body("t", payload, 1, NOW).encode())
        db.put(entry_key(sid, seq), Entry(seq, msg_id, 1, 0, len(payload)).encode())


def session(db: Any, client_id: str, sid: int, count: int) -> None:
    db.put(session_key(client_id), SessionRecord(client_id, sid, {"t": 1}, created_at=NOW).encode())
    queue(db, sid, range(1, count + 1))
    db.put(totals_key(sid), encode_totals(count, count * 10, 3))


def largest_table(path: str) -> Path:
    return max(Path(path).glob("*.ldb"), key=lambda table: table.stat().st_size)


# ------------------------------------------------------------------- point 4: never create over data


def test_a_store_that_lost_current_is_refused_untouched(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "dev", 1, 20)
    db.close()
    os.remove(os.path.join(store_path, "CURRENT"))
    before = digest(store_path)
    for create in (True, False):  # the broker, and inspect
        with pytest.raises(StoreCorruptedError) as info:
            open_store(store_path, create=create)
        message = str(info.value)
        assert "CURRENT" in message and "is missing" in message and ".log" in message
        assert f"amqtt-durable repair {store_path}" in message
        assert digest(store_path) == before, "not one byte of a refused store changes (not even LevelDB's LOG)"
    report = repair(store_path)
    db = open_store(store_path)
    try:
        assert [r.client_id for r in iter_sessions(db)] == ["dev"]
        assert len(list(db.iterator(prefix=b"q"))) == 20
    finally:
        db.close()
    assert report.lost == [], report


def test_a_folder_of_other_files_is_not_made_a_store(tmp_path: Path) -> None:
    folder = tmp_path / "data"
    folder.mkdir()
    (folder / "durable.yaml").write_text("x")
    with pytest.raises(StoreError) as info:
        open_store(str(folder))
    assert not isinstance(info.value, StoreCorruptedError)
    assert "holds files (durable.yaml) but no LevelDB store" in str(info.value)
    assert "repair" not in str(info.value)
    assert os.listdir(folder) == ["durable.yaml"]
    with pytest.raises(StoreError, match="no store at"):
        repair(str(folder))
    assert os.listdir(folder) == ["durable.yaml"], "repair does not make a store in a folder that had none"


def test_an_empty_folder_becomes_a_store(tmp_path: Path) -> None:
    folder = tmp_path / "empty"
    folder.mkdir()
    db = open_store(str(folder))
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()


def test_a_truncated_table_is_named_at_open(store_path: str) -> None:
    db = open_store(store_path)
    for index in range(3000):
        db.put(b"m%08d" % index, os.urandom(1000))
    db.compact_range()
    db.close()
    table = largest_table(store_path)
    name = table.name
    table.write_bytes(table.read_bytes()[:1000])
    with pytest.raises(StoreCorruptedError) as info:
        open_store(store_path)
    message = str(info.value)
    assert f"table file {name} is truncated or damaged (1000 bytes" in message
    assert f"amqtt-durable repair {store_path}" in message
    assert table.stat().st_size == 1000, "the refused store's table is left as it was"
    report = repair(store_path)
    assert any(line.startswith(f"table file {name} was damaged") for line in report.lost), report
    open_store(store_path).close()


def test_a_table_whose_index_does_not_open_is_named_at_open(store_path: str) -> None:
    # LevelDB's iterators pass over such a table as if it were empty: without this check the
    # sessions in it would vanish and start-up would delete their queues as leftovers.
    db = open_store(store_path)
    session(db, "dev", 1, 2000)  # the table's smallest key, b"m" + u64, is one LevelDB prints escaped
    db.compact_range()
    db.close()
    assert open_store(store_path).close() is None, "a whole store passes the check"
    table = largest_table(store_path)
    data = bytearray(table.read_bytes())
    for offset in range(20):  # in the index block, just before the 48-byte footer
        data[len(data) - 48 - 200 + offset] ^= 0xFF
    table.write_bytes(bytes(data))
    with pytest.raises(StoreCorruptedError) as info:
        open_store(store_path)
    assert f"table file {table.name} cannot be read: Corruption" in str(info.value)
    assert f"amqtt-durable repair {store_path}" in str(info.value)


# ------------------------------------------------------------------ point 6: start-up names the damage


def test_start_up_names_a_damaged_session_record(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "dev", 1, 5)
    db.put(session_key("dev"), b'{"sid":1,"subscr')
    db.close()
    with pytest.raises(StoreCorruptedError) as info:
        DurableEngine(DurableConfig(store=store_path)).open()
    message = str(info.value)
    assert "the session record of client id 'dev' does not decode" in message
    assert f"amqtt-durable repair {store_path}" in message
    open_store(store_path).close()  # the engine closed the store it refused


@pytest.mark.parametrize(
    ("key", "named"),
    [
        (totals_key(1), "the queue totals of client id 'dev'"),
        (sent_mark_key(1), "the sent mark of client id 'dev'"),
        (SID_MARK_KEY, "the highest session number"),
        (MSG_ID_MARK_KEY, "the highest message id"),
    ],
)
def test_start_up_names_damaged_counters_and_repair_rebuilds_them(store_path: str, key: bytes, named: str) -> None:
    db = open_store(store_path)
    session(db, "dev", 1, 5)
    db.put(key, b"\x01\x02")
    db.close()
    with pytest.raises(StoreCorruptedError, match=f"{named}: 2 bytes that do not decode"):
        DurableEngine(DurableConfig(store=store_path)).open()
    assert len(repair(store_path).rebuilt) == 1

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        assert engine.sessions["dev"].depth == 5
        if key == MSG_ID_MARK_KEY:  # ids past the damaged mark may have been given
            assert engine._next_msg_id == 1005 + SENT_MARK_JUMP + 1
        await engine.close()

    asyncio.run(main())


# --------------------------------------------------------------------------- point 6: the pump's read


def test_a_read_that_meets_damage_returns_what_came_before_then_raises(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "dev", 1, 0)
    queue(db, 1, range(1, 4001), payload=os.urandom(200))  # the bodies fill most of the table
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        dev = engine.sessions["dev"]
        whole, _ = dev.read_entries(1, dev.committed_tail, 4000)
        assert len(whole) == 4000
        # A body LevelDB can no longer read, as a damaged block makes it: the read fails there.
        engine.db.close()
        table = largest_table(store_path)
        data = bytearray(table.read_bytes())
        for offset in range(64):
            data[len(data) // 3 + offset * 7] ^= 0xFF
        table.write_bytes(bytes(data))
        engine.db = plyvel.DB(store_path, paranoid_checks=True)
        try:
            got, last = dev.read_entries(1, dev.committed_tail, 4000)
            assert 0 < len(got) < 4000 and last == got[-1][0].seq, "what came before the damage, cut short there"
            with pytest.raises(StoreReadError) as info:
                dev.read_entries(last + 1, dev.committed_tail, 4000)
            assert f"session dev: reading its queue after message {last}" in str(info.value)
            assert "Corruption" in str(info.value)
        finally:
            engine.db.close()

    asyncio.run(main())


def test_a_read_that_meets_a_body_that_does_not_decode_names_why(store_path: str) -> None:
    """Issue 14: a body whose checksum holds but whose topic is not UTF-8 stops the read there like a
    damaged block, and the error says why (it said only "utf-8", a UnicodeDecodeError's first argument)."""
    db = open_store(store_path)
    session(db, "dev", 1, 5)
    good = db.get(body_key(1003))
    db.put(body_key(1003), good[:11] + b"\xff" + good[12:])
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        try:
            dev = engine.sessions["dev"]
            got, last = dev.read_entries(1, dev.committed_tail, 100)
            assert [entry.seq for entry, _ in got] == [1, 2] and last == 2, "what came before it, cut short there"
            with pytest.raises(StoreReadError) as info:
                dev.read_entries(3, dev.committed_tail, 100)
            assert "session dev: reading its queue after message 2 failed: 'utf-8' codec can't decode byte 0xff" in str(
                info.value
            )
        finally:
            await engine.close()

    asyncio.run(main())


# ------------------------------------------------------------------------------- point 6: repair


def test_repair_rebuilds_records_totals_and_references_from_the_queues(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "keeps-sid", 1, 3)
    db.put(session_key("keeps-sid"), b'{"sid":1,"subscriptions":{"t":1},"created_at":17,"username":"alice","x')
    session(db, "no-sid", 2, 4)
    db.put(session_key("no-sid"), b"\xff\xfe garbage")
    session(db, "fine", 3, 2)
    db.put(totals_key(3), encode_totals(50, 500, 7))  # decodes, but wrong
    db.put(entry_key(3, 3), Entry(3, 99_999, 1, 0, 10).encode())  # its body is gone
    db.put(body_key(5000), Body("t", b"s" * 10, 1, NOW).encode())  # a body shared by two queues
    db.put(refs_key(5000), encode_refs(9))
    db.put(entry_key(1, 4), Entry(4, 5000, 1, FLAG_SHARED, 10).encode())
    db.put(entry_key(3, 4), Entry(4, 5000, 1, FLAG_SHARED, 10).encode())
    db.delete(VERSION_KEY)
    db.put(sent_mark_key(3), b"\x07")  # a sent mark that no longer decodes
    db.delete(totals_key(2))
    db.put(SID_MARK_KEY, b"\x01")
    db.close()

    report = repair(store_path, now=NOW)

    assert report.rebuilt == [
        "layout version key restored",
        "1 shared message reference count(s) rebuilt from the queues",
        "client 'keeps-sid': session record rebuilt (session number 1)",
        "client 'no-sid': session record rebuilt (session number 2)",
        "client 'keeps-sid': queue totals rebuilt from the queue: 4 message(s), 40 bytes "
        "(they said 3 message(s), 30 bytes)",
        "client 'no-sid': queue totals rebuilt from the queue: 4 message(s), 40 bytes (there were none)",
        "client 'fine': queue totals rebuilt from the queue: 3 message(s), 30 bytes "
        "(they said 50 message(s), 500 bytes)",
        "client 'fine': sent mark rebuilt past the queue (its queued messages go out again DUP-flagged)",
        "highest session number did not decode: set past every one in use",
    ], report
    assert report.lost == [
        "client 'keeps-sid': its subscriptions and SDK settings were in the damaged record; the client must "
        "subscribe again (its queued messages are kept)",
        "client 'no-sid': its subscriptions and SDK settings were in the damaged record; the client must "
        "subscribe again (its queued messages are kept)",
        "client 'fine': 1 queued message(s) unreadable (removed)",
    ], report
    db = open_store(store_path)
    try:
        records = {r.client_id: r for r in iter_sessions(db)}
        assert {cid: r.sid for cid, r in records.items()} == {"fine": 3, "keeps-sid": 1, "no-sid": 2}
        assert records["keeps-sid"].username == "alice", "the owner is kept when its bytes are readable"
        assert records["keeps-sid"].subscriptions == {}
        assert decode_totals(db.get(totals_key(3))) == (3, 30, 7), "the overflow count is kept"
        assert decode_totals(db.get(totals_key(2))) == (4, 40, 0), "rebuilt: the overflow count is lost with them"
        assert decode_u64(db.get(sent_mark_key(3))) == 4 + SENT_MARK_JUMP
        assert decode_u64(db.get(SID_MARK_KEY)) == 3 + SENT_MARK_JUMP, "a session number is never used twice"
        assert db.get(entry_key(3, 3)) is None
        assert decode_refs(db.get(refs_key(5000))) == 2
    finally:
        db.close()
    assert repair(store_path, now=NOW).rebuilt == [], "a second repair finds nothing left to rebuild"


def test_repair_removes_bodies_that_do_not_decode_with_every_entry_pointing_at_them(store_path: str) -> None:
    """Issue 14: a body whose checksum holds but that Body.decode refuses stops a replay at it for
    good (the pump's read fails there, retried, never skipped): repair treats it as a missing body."""
    db = open_store(store_path)
    session(db, "a", 1, 6)
    session(db, "b", 2, 3)
    good = Body("t", b"p" * 10, 1, NOW).encode()
    db.put(body_key(1002), good[:11] + b"\xff\xfe" + good[13:])  # a topic that is not UTF-8
    db.put(body_key(1004), good[:9] + b"\x10\x00" + good[11:])  # a topic running past the body's end
    db.put(body_key(1005), good[:5])  # shorter than the head
    db.put(body_key(7000), good[:9] + b"\x10\x00" + good[11:])  # shared by both queues
    db.put(refs_key(7000), encode_refs(2))
    db.put(entry_key(1, 7), Entry(7, 7000, 1, FLAG_SHARED, 10).encode())
    db.put(entry_key(2, 4), Entry(4, 7000, 1, FLAG_SHARED, 10).encode())
    db.put(totals_key(1), encode_totals(7, 70, 0))
    db.put(totals_key(2), encode_totals(4, 40, 0))
    db.close()

    report = repair(store_path, now=NOW)

    assert report.lost == [
        "message 1002: its body does not decode ('utf-8' codec can't decode byte 0xff in position 0: invalid "
        "start byte): removed, with the 1 queue entry(ies) pointing at it",
        "message 1004: its body does not decode (a topic of 4096 bytes in a body of 22): removed, with the 1 "
        "queue entry(ies) pointing at it",
        "message 1005: its body does not decode (unpack_from requires a buffer of at least 11 bytes for "
        "unpacking 11 bytes at offset 0 (actual buffer size is 5)): removed, with the 1 queue entry(ies) "
        "pointing at it",
        "message 7000: its body does not decode (a topic of 4096 bytes in a body of 22): removed, with the 2 "
        "queue entry(ies) pointing at it",
        "client 'a': 4 queued message(s) unreadable (removed)",
        "client 'b': 1 queued message(s) unreadable (removed)",
    ], report
    assert report.rebuilt == [
        "1 shared message reference count(s) rebuilt from the queues",
        "client 'a': queue totals rebuilt from the queue: 3 message(s), 30 bytes (they said 7 message(s), 70 bytes)",
        "client 'b': queue totals rebuilt from the queue: 3 message(s), 30 bytes (they said 4 message(s), 40 bytes)",
    ], report
    db = open_store(store_path)
    try:
        for sid, left in ((1, [1, 3, 6]), (2, [1, 2, 3])):
            keys = db.iterator(prefix=entry_key(sid, 0)[:9], include_value=False)
            assert [seq_of_entry_key(key) for key in keys] == left, "every other entry, in order"
        for msg_id in (1002, 1004, 1005, 7000):
            assert db.get(body_key(msg_id)) is None, "nothing points at it any more"
        assert db.get(refs_key(7000)) is None
    finally:
        db.close()
    assert repair(store_path, now=NOW) == RepairReport(), "a second repair finds nothing left"


def test_repair_cannot_pair_records_without_a_session_number_when_several_queues_are_left(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "a", 1, 2)
    session(db, "b", 2, 2)
    db.put(session_key("a"), b"garbage")
    db.put(session_key("b"), b"{}")
    queue(db, 3, range(1, 6))  # and a queue whose record key itself is gone
    db.close()
    report = repair(store_path, now=NOW)
    assert [line for line in report.lost if "does not decode" in line] == [
        "client 'a': its session record does not decode and no queue could be matched to it; removed (the "
        "client starts a new session)",
        "client 'b': its session record does not decode and no queue could be matched to it; removed (the "
        "client starts a new session)",
    ]
    assert [line for line in report.lost if "have no session record" in line] == [
        f"session number {sid}: {count} queued message(s) have no session record, so their client id is lost; "
        "the broker deletes them when it starts"
        for sid, count in ((1, 2), (2, 2), (3, 5))
    ]
    db = open_store(store_path)
    try:
        assert list(iter_sessions(db)) == [], "no guess: the records are removed, the queues reported"
    finally:
        db.close()


def test_repair_does_not_take_over_another_programs_leveldb(store_path: str) -> None:
    """Refused before anything is touched (it ran LevelDB's repair on it, then said 'nothing rebuilt'):
    every file of the folder is as it was, and its owner reads its data."""
    db = plyvel.DB(store_path, create_if_missing=True)
    db.put(b"user:1", b"alice")
    db.close()
    before = digest(store_path)
    with pytest.raises(ForeignStoreError) as info:
        repair(store_path)
    assert str(info.value) == (
        f"repair of '{store_path}' refused: it is not an amqtt-durable store but another program's LevelDB (no "
        "layout version key or store id, and its key b'user:1' has the shape of no key of amqtt-durable's store "
        "layout); nothing was changed. Point repair at the plugin's 'store' folder"
    )
    assert digest(store_path) == before
    db = plyvel.DB(store_path)
    try:
        assert dict(db.iterator()) == {b"user:1": b"alice"}
    finally:
        db.close()


def test_repair_clears_the_replication_position_so_backups_get_a_new_snapshot(store_path: str) -> None:
    db = open_store(store_path)
    session(db, "device", 1, 3)
    db.put(POSITION_KEY, encode_position(41, 0xABC))
    db.close()
    report = repair(store_path, now=NOW)
    assert "replication position cleared: this store's backups get a new snapshot" in report.rebuilt
    db = plyvel.DB(store_path)
    try:
        assert read_position(db) == (0, 0), "a store never replicated: a backup at batch 41 is ahead and resnapshots"
        assert db.get(entry_key(1, 3)) is not None
    finally:
        db.close()


def test_repair_sets_an_entry_pointing_at_no_body_to_not_shared_size_0_and_writes_no_count_for_id_0(
    store_path: str,
) -> None:
    """A released QoS 2 entry already rewritten to NO_BODY but still SHARED and sized: its count went
    under id 0 and its size into the totals. A QoS 1 entry pointing at NO_BODY has no body: removed."""
    db = open_store(store_path)
    db.put(session_key("dev"), SessionRecord("dev", 1, {"t": 2}, created_at=NOW).encode())
    db.put(entry_key(1, 1), Entry(1, NO_BODY, 2, FLAG_RELEASED | FLAG_SHARED, 7).encode())
    db.put(entry_key(1, 2), Entry(2, NO_BODY, 1, FLAG_RELEASED | FLAG_SHARED, 7).encode())
    db.put(totals_key(1), encode_totals(2, 14, 0))
    db.close()

    report = repair(store_path, now=NOW)

    assert report.rebuilt == [
        "client 'dev': 1 queue entry(ies) (QoS 2, PUBREL due) without a body set to not shared, size 0",
        "client 'dev': queue totals rebuilt from the queue: 1 message(s), 0 bytes (they said 2 message(s), 14 bytes)",
    ], report
    assert report.lost == ["client 'dev': 1 queued message(s) unreadable (removed)"], report
    db = open_store(store_path)
    try:
        assert Entry.decode(1, db.get(entry_key(1, 1))) == Entry(1, NO_BODY, 2, FLAG_RELEASED, 0)
        assert db.get(entry_key(1, 2)) is None
        assert db.get(refs_key(NO_BODY)) is None, "no count is written for id 0"
    finally:
        db.close()
    assert repair(store_path, now=NOW) == RepairReport(), "a second repair finds nothing left"


def test_repair_raises_a_readable_message_id_mark_below_an_id_in_use(store_path: str) -> None:
    """An earlier release (which keeps no b"M" mark) ran on the store: a released QoS 2 entry names
    message 2050, whose body is gone, above the mark (1000) and above every body left (2003). The
    broker would start past 2003 and give 2050 again; repair raises the mark to it."""
    db = open_store(store_path)
    session(db, "dev", 2, 3)
    db.put(entry_key(2, 4), Entry(4, 2050, 2, FLAG_RELEASED, 0).encode())  # its body is gone
    db.put(totals_key(2), encode_totals(4, 30, 3))
    db.put(MSG_ID_MARK_KEY, encode_u64(1000))
    db.close()

    report = repair(store_path, now=NOW)

    assert report.rebuilt == [
        "client 'dev': queue entry 4 (QoS 2, PUBREL due): its body, message 2050, is gone; kept without it "
        "(the client has the message; its PUBREL is sent when it reconnects)",
        "highest message id 1000 was below message 2050, which is in use (an earlier release wrote the store "
        "since): set to 2050",
    ], report
    db = open_store(store_path)
    try:
        assert decode_u64(db.get(MSG_ID_MARK_KEY)) == 2050
    finally:
        db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        assert engine._next_msg_id == 2051
        await engine.close()

    asyncio.run(main())
    assert repair(store_path, now=NOW) == RepairReport(), "a second repair finds nothing left"


def test_repair_gives_a_store_without_the_message_id_mark_one(store_path: str) -> None:
    """A store of an earlier release has no mark: repair writes it (no line), so the broker's first
    start need not read every queue entry."""
    db = open_store(store_path)
    session(db, "dev", 1, 3)
    db.put(entry_key(1, 4), Entry(4, 1500, 2, FLAG_RELEASED, 0).encode())
    db.put(totals_key(1), encode_totals(4, 30, 3))
    db.close()
    repair(store_path, now=NOW)
    db = open_store(store_path)
    try:
        assert decode_u64(db.get(MSG_ID_MARK_KEY)) == 1500
    finally:
        db.close()
