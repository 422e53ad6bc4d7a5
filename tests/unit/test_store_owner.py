"""store_owner.py: whose a LevelDB folder is, judged before repair touches it (review 280 P2): real
plyvel stores in tmp folders, one written by the real engine and stream logs."""

from __future__ import annotations

import asyncio
import os
import shutil
import struct
import tempfile
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from small_disk import fill, leave_free, small_disk
from test_hostile_store import folder_digest
from test_leveldb_manifest import open_a_copy
from test_store import Holder
from test_store_repair import digest
from test_streams import make_logs, put

import amqtt_durable
from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import (
    ForeignLayoutError,
    ForeignStoreError,
    StoreCorruptedError,
    StoreError,
    StoreLockedError,
)
from amqtt_durable.repair import repair
from amqtt_durable.replication.position import POSITION_KEY, SNAPSHOT_MARK_KEY
from amqtt_durable.store import STORE_ID_KEY, VERSION_KEY, entry_key, open_store, session_key
from amqtt_durable.store_owner import Owner, Verdict, classify, classify_folder, key_fits_layout, scratch_copy

GENEROUS = 10.0
FOREIGN = {b"user:1": b"alice", b"user:2": b"bob"}


def leveldb(path: str, records: dict[bytes, bytes], **options: object) -> None:
    db = plyvel.DB(path, create_if_missing=True, **options)
    try:
        for key, value in records.items():
            db.put(key, value)
    finally:
        db.close()


def verdict_of(path: str) -> Verdict:
    db = plyvel.DB(path)
    try:
        return classify(db)
    finally:
        db.close()


def engine_store(path: str) -> None:
    """A store as the broker writes it: a durable session with a queued QoS 1 message and a QoS 2
    packet id whose PUBREL is due, a retained message, a stream log's events and id mark."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "t/#", 1)
        for stored in (engine.route_publish("t/1", b"q", 1), engine.route_publish("t/r", b"on", 1, retain=True)):
            assert stored is not None
            await asyncio.wait_for(stored, GENEROUS)
        engine.expect_pubrel("dev", 9)
        await engine.close()

    asyncio.run(main())
    db = open_store(path, create=False)
    try:
        logs, committer = make_logs(db)
        put(logs, committer, "s/tél")
        db.put(POSITION_KEY, bytes(12))
    finally:
        db.close()


def test_every_key_the_engine_writes_fits_the_layout(store_path: str) -> None:
    engine_store(store_path)
    db = plyvel.DB(store_path)
    try:
        keys = list(db.iterator(include_value=False))
    finally:
        db.close()
    written = {key[:1] for key in keys}
    assert written >= {b"v", b"i", b"n", b"M", b"m", b"q", b"s", b"t", b"r", b"x", b"e", b"L", b"R"}, keys
    assert [key for key in keys if not key_fits_layout(key)] == []


@pytest.mark.parametrize(
    "key",
    [
        SNAPSHOT_MARK_KEY,
        session_key("client"),
        session_key(""),
        entry_key(1, 2),
        b"q" + bytes(16),  # a queue entry's shape, whoever wrote it
        b"l" + "s/tél".encode() + b"\x00" + struct.pack(">Q", 7),  # an earlier release's stream event
    ],
)
def test_keys_of_the_layouts_shapes_fit(key: bytes) -> None:
    assert key_fits_layout(key)


@pytest.mark.parametrize(
    "key",
    [
        b"user:1",
        b"",
        b"vv",
        b"M2",
        b"q" + bytes(15),
        b"q" + bytes(17),
        b"t" + bytes(9),
        b"x1",
        b"m",
        b"email:1",  # the lengths of a stream event's key do not add up
        b"e\x00\x02ab" + bytes(7),
        b"s\xff",  # a client id that is not UTF-8
        b"r\xfe",
        b"L\xc3",
        b"l" + b"topic",  # no NUL and id
        b"e\x00\x02\xff\xfe" + bytes(8),  # lengths add up, the topic is not UTF-8
    ],
)
def test_keys_of_no_layout_shape_do_not_fit(key: bytes) -> None:
    assert not key_fits_layout(key)


def test_a_store_that_lost_its_version_key_and_store_id_is_ours_when_every_key_fits(store_path: str) -> None:
    engine_store(store_path)
    db = plyvel.DB(store_path)
    try:
        db.delete(VERSION_KEY)
        db.delete(STORE_ID_KEY)
        assert classify(db) == Verdict(Owner.OURS)
    finally:
        db.close()


@pytest.mark.parametrize(
    ("records", "owner"),
    [
        ({}, Owner.OURS),
        ({VERSION_KEY: b"1", **FOREIGN}, Owner.OURS),
        ({STORE_ID_KEY: bytes(8), **FOREIGN}, Owner.OURS),
        ({STORE_ID_KEY: b"abc", **FOREIGN}, Owner.FOREIGN),
        ({entry_key(1, 1): bytes(14), b"s" + b"dev": b"{}", **FOREIGN}, Owner.FOREIGN),
        ({VERSION_KEY: b"2", **FOREIGN}, Owner.ANOTHER_RELEASE),
    ],
    ids=["empty", "version", "store-id", "store-id-of-3-bytes", "some-keys-fit", "another-release"],
)
def test_the_version_key_or_store_id_makes_it_ours_else_every_key_must_fit(
    store_path: str, records: dict[bytes, bytes], owner: Owner
) -> None:
    leveldb(store_path, records)
    assert verdict_of(store_path).owner is owner


def test_the_first_key_that_fits_nothing_is_named(store_path: str) -> None:
    leveldb(store_path, {entry_key(1, 1): bytes(14), b"a" * 60: b"1", b"user:1": b"x"})
    assert verdict_of(store_path) == Verdict(
        Owner.FOREIGN,
        f"no layout version key or store id, and its key {b'a' * 40!r}, ... has the shape of no key of "
        "amqtt-durable's store layout",
    )


def test_a_foreign_leveldb_whose_only_keys_fit_cannot_be_told_from_ours(store_path: str) -> None:
    """Documented limitation: only keys are judged."""
    leveldb(store_path, {b"q" + bytes(16): b"another program's value"})
    assert verdict_of(store_path) == Verdict(Owner.OURS)


def test_the_folder_is_judged_on_a_scratch_copy_and_its_files_stay_byte_identical(store_path: str) -> None:
    """A plain open of the folder would turn its log into a table, write a new MANIFEST and move LOG:
    the records here are in the log only (LevelDB writes no table at close) and are still judged."""
    leveldb(store_path, FOREIGN)
    assert any(name.endswith(".log") and Path(store_path, name).stat().st_size for name in digest(store_path))
    before = digest(store_path)
    verdict = classify_folder(store_path)
    assert verdict.owner is Owner.FOREIGN and "b'user:1'" in verdict.why, verdict
    assert digest(store_path) == before


def test_keys_in_tables_are_judged_too(store_path: str) -> None:
    leveldb(store_path, {entry_key(1, 1): bytes(14)})
    db = plyvel.DB(store_path)
    db.compact_range()
    db.put(b"user:1", b"x")
    db.close()
    assert any(name.endswith(".ldb") for name in digest(store_path))
    before = digest(store_path)
    assert classify_folder(store_path).owner is Owner.FOREIGN
    assert digest(store_path) == before


def assert_refused_untouched(path: str, error: type[Exception], match: str) -> None:
    """``repair`` of ``path`` raises ``error`` (its message matching ``match``), every file as it was."""
    before = digest(path)
    with pytest.raises(error, match=match):
        repair(path)
    assert digest(path) == before


def reverse(a: bytes, b: bytes) -> int:
    return (a < b) - (a > b)


def test_a_leveldb_with_its_own_comparator_is_another_programs_and_its_owner_still_opens_it(store_path: str) -> None:
    """The review's case: LevelDB's repair with the default comparator rewrites the tables in
    another order and the owner can no longer open them. Even keys of our layout's shape do not help."""
    leveldb(store_path, {VERSION_KEY: b"1", entry_key(1, 1): bytes(14)}, comparator=reverse,
            comparator_name=b"test.Reverse")
    before = digest(store_path)
    assert classify_folder(store_path) == Verdict(
        Owner.FOREIGN,
        "its keys are kept in the order of the comparator 'test.Reverse', not LevelDB's default, which "
        "amqtt-durable uses",
    )
    with pytest.raises(ForeignStoreError, match=r"the comparator 'test\.Reverse'"):
        repair(store_path)
    assert digest(store_path) == before
    db = plyvel.DB(store_path, comparator=reverse, comparator_name=b"test.Reverse")
    try:
        assert db.get(VERSION_KEY) == b"1"
    finally:
        db.close()


def lose_current_and_manifests(path: str) -> None:
    for name in digest(path):
        if name == "CURRENT" or name.startswith("MANIFEST-"):
            Path(path, name).unlink()


def test_a_folder_leveldb_cannot_open_is_unreadable(store_path: str) -> None:
    leveldb(store_path, FOREIGN)
    lose_current_and_manifests(store_path)
    verdict = classify_folder(store_path)
    assert verdict.owner is Owner.UNREADABLE and "does not exist" in verdict.why, verdict


def test_a_folder_that_lost_only_its_current_file_is_judged_with_its_newest_manifest(store_path: str) -> None:
    leveldb(store_path, FOREIGN)
    db = plyvel.DB(store_path)  # a second MANIFEST, the first one removed as LevelDB does
    db.close()
    Path(store_path, "CURRENT").unlink()
    assert_refused_untouched(store_path, ForeignStoreError, r"its key b'user:1' has")


def test_a_damaged_block_hiding_every_foreign_key_is_not_refused(store_path: str) -> None:
    """Keys that cannot be read prove nothing (LevelDB's iterator passes over a block whose checksum
    fails without a word): not refused, repair runs as for any damage, and the block's records are lost."""
    leveldb(store_path, FOREIGN)
    db = plyvel.DB(store_path)
    db.compact_range()
    db.close()
    (table,) = (Path(store_path, name) for name in digest(store_path) if name.endswith(".ldb"))
    data = bytearray(table.read_bytes())
    data[data.index(b"alice")] ^= 0xFF  # inside the table's one data block: its checksum fails
    table.write_bytes(bytes(data))
    assert classify_folder(store_path).owner is not Owner.FOREIGN
    report = repair(store_path)
    assert report.rebuilt == ["layout version key restored"], report
    assert report.lost == [
        f"table file {table.name} was damaged (moved to {Path(store_path, 'lost', table.name)}): records only it "
        "held are gone, and older versions of them may be back (a message already delivered may be sent again)"
    ], report


def test_a_missing_folder_is_left_to_repairs_own_checks(tmp_path: Path) -> None:
    assert classify_folder(str(tmp_path / "nothing")).owner is Owner.UNREADABLE


@pytest.mark.parametrize("current_lost", [False, True])
def test_another_releases_store_is_refused_untouched(store_path: str, *, current_lost: bool) -> None:
    """Also one that lost its CURRENT file (LevelDB's repair ran on it before it was refused)."""
    leveldb(store_path, {VERSION_KEY: b"2", b"q" + bytes(16): bytes(14)})
    if current_lost:
        Path(store_path, "CURRENT").unlink()
    before = digest(store_path)
    with pytest.raises(ForeignLayoutError):
        repair(store_path)
    assert digest(store_path) == before


def test_an_unreadable_foreign_leveldb_is_repaired_by_leveldb_but_not_taken_over(store_path: str) -> None:
    """Without CURRENT and MANIFEST nothing could be read before: LevelDB's repair runs, as for a
    damaged store; what it reads then is another program's keys, so no version key is written,
    nothing rebuilt, and repair fails (it said 'repaired' and exited 0)."""
    leveldb(store_path, FOREIGN)
    lose_current_and_manifests(store_path)
    with pytest.raises(ForeignStoreError) as info:
        repair(store_path)
    assert info.value.repaired
    assert str(info.value) == (
        f"repair of '{store_path}' stopped: it is not an amqtt-durable store but another program's LevelDB (no "
        "layout version key or store id, and its key b'user:1' has the shape of no key of amqtt-durable's store "
        "layout). It could not be read, so LevelDB's repair has run on it (its readable records kept: the logs' and "
        "damaged tables' in new table files; the logs, damaged tables and old MANIFESTs moved to "
        f"'{store_path}/lost'), but nothing was rebuilt and no version key written"
    )
    db = plyvel.DB(store_path)
    try:
        assert dict(db.iterator()) == FOREIGN
    finally:
        db.close()


def assert_refused_for_tmpdir(path: str, tmpdir: Path, why: str) -> None:
    """``repair`` of ``path`` refused as operations.md says, the scratch copy in ``tmpdir`` failed for ``why``."""
    with pytest.raises(StoreError) as info:
        repair(path)
    assert str(info.value) == (
        f"repair of '{path}' not started: whose LevelDB it is could not be checked (a scratch copy of it in "
        f"{tmpdir} failed: {why}); nothing was changed. Set TMPDIR to a folder with room for copies of its log "
        "and MANIFEST files and of the table files numbered at or above the next file number its MANIFEST "
        "records, and for what LevelDB writes opening the copy, then run repair again"
    )


def test_a_scratch_copy_that_cannot_be_made_refuses_repair_untouched(
    store_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The temporary folder (TMPDIR) unusable: nothing is judged, so nothing is touched."""
    leveldb(store_path, FOREIGN)
    before = digest(store_path)
    not_a_folder = tmp_path / "file"
    not_a_folder.write_bytes(b"")
    monkeypatch.setattr(tempfile, "tempdir", str(not_a_folder))
    assert_refused_for_tmpdir(store_path, not_a_folder, "Not a directory")
    assert digest(store_path) == before


def orphan_tables(path: str) -> None:
    """Table files no MANIFEST lists, numbered where the next open allocates: what a crash between a
    flush's (or a compaction's) table write and its MANIFEST record leaves, and what a running
    LevelDB has on disk during every flush (review 282)."""
    for number in range(1, 20):
        taken = [Path(path, f"{number:06d}.{ext}") for ext in ("ldb", "log")] + [Path(path, f"MANIFEST-{number:06d}")]
        if not any(name.exists() for name in taken):
            Path(path, f"{number:06d}.ldb").write_bytes(b"orphan table %d " % number * 64)


def test_an_orphan_table_of_a_crashed_store_stays_byte_identical(store_path: str) -> None:
    """The copy's open makes a table of the log's records with the next file number: a linked orphan
    of that number was truncated and rewritten through the link (review 282 P1)."""
    leveldb(store_path, {VERSION_KEY: b"1", entry_key(1, 1): bytes(14)})  # in the log only
    orphan_tables(store_path)
    before = digest(store_path)
    assert classify_folder(store_path).owner is Owner.OURS
    assert digest(store_path) == before


def test_a_manifest_named_above_its_recorded_next_file_number_does_not_let_the_copy_write_the_folder(
    store_path: str, tmp_path: Path
) -> None:
    """LevelDB numbers the copy's new files from the next file number its MANIFEST records, not from
    the MANIFEST's name (a renamed or restored one): a table linked below the name's number was
    rewritten through the link (review 288 P2-1)."""
    leveldb(store_path, {VERSION_KEY: b"1", entry_key(1, 1): bytes(14)})  # in the log: the copy's open makes a table
    (manifest,) = [name for name in os.listdir(store_path) if name.startswith("MANIFEST-")]
    Path(store_path, manifest).rename(Path(store_path, "MANIFEST-000100"))
    Path(store_path, "CURRENT").write_text("MANIFEST-000100\n")
    probe = tmp_path / "probe"  # LevelDB itself opens such a folder
    shutil.copytree(store_path, probe)
    db = plyvel.DB(str(probe))
    try:
        assert db.get(VERSION_KEY) == b"1"
    finally:
        db.close()
    names = os.listdir(store_path)
    for number in range(1, 100):  # table files the folder holds under the numbers the open may take
        if not any(name.startswith(f"{number:06d}.") for name in names):
            Path(store_path, f"{number:06d}.ldb").write_bytes(b"someone's table %d" % number)
    before = digest(store_path)
    assert classify_folder(store_path).owner is Owner.OURS
    assert digest(store_path) == before


def test_the_tables_of_a_store_after_a_broker_run_are_linked_not_copied(store_path: str, tmp_path: Path) -> None:
    """The MANIFEST is named at the store's open, and every table the run writes is numbered past
    that name: bounded by the name, the scratch copy copied nearly the whole store (review 288 P2-1)."""
    engine_store(store_path)
    db = open_store(store_path, create=False)  # the broker's open, then a run that flushes and compacts
    try:
        for run in range(2):
            for number in range(60_000):
                db.put(entry_key(number, run), os.urandom(100))
            for number in range(0, 60_000, 2):
                db.delete(entry_key(number, run))
        db.compact_range()  # else the close could cut a compaction short: its output, numbered past the
        # MANIFEST's next-file number, is copied, and how large it was depended on the machine's load
    finally:
        db.close()
    tables = {name for name in os.listdir(store_path) if name.endswith((".ldb", ".sst"))}
    kept = open_a_copy(Path(store_path), tmp_path / "listed")[0]  # the tables the MANIFEST lists
    assert len(kept) > 1
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    linked = set(scratch_copy(store_path, os.listdir(store_path), str(scratch)))
    assert kept <= linked
    copied = tables - linked  # at most the output of a compaction the close cut short (no MANIFEST lists it)
    assert sum(Path(store_path, name).stat().st_size for name in copied) < sum(
        Path(store_path, name).stat().st_size for name in tables
    ) // 4


def test_a_link_the_temporary_folder_cannot_take_is_named_as_its_fault_not_the_stores(
    store_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """TMPDIR out of inodes while the copy is made: a table's link that failed named the store's
    table as a file that could not be read (review 288 P3-2)."""
    db = plyvel.DB(store_path, create_if_missing=True, write_buffer_size=64 * 1024)
    for number in range(2000):  # tables of the LevelDB's flushes and compactions, numbered below its MANIFEST's
        db.put(b"user:%d" % number, os.urandom(1000))
    db.close()
    plyvel.DB(store_path).close()
    before = digest(store_path)
    with small_disk(tmp_path / "disk", 1, inodes=8) as disk:
        taken = []
        for number in range(8):  # bounded: the tmpfs has 8 inodes, its root folder one of them
            try:
                taken.append(disk / f"taken{number}")
                taken[-1].touch()
            except OSError:
                taken.pop()
                break
        for path in taken[:3]:  # room for the scratch folder, its CURRENT and MANIFEST: not for its log or a link
            path.unlink()
        monkeypatch.setattr(tempfile, "tempdir", str(disk))
        assert_refused_for_tmpdir(store_path, disk, "No space left on device")
    assert digest(store_path) == before


def test_a_store_a_running_broker_holds_is_refused_before_anything_of_it_is_written(store_path: str) -> None:
    """The lock is checked before the scratch copy is made: the broker's flush output, not in its
    MANIFEST yet, was rewritten through the copy's link (review 282 P1)."""
    leveldb(store_path, {VERSION_KEY: b"1"})
    holder = Holder(store_path)
    try:
        orphan_tables(store_path)
        before = digest(store_path)
        with pytest.raises(StoreLockedError):
            repair(store_path)
        assert digest(store_path) == before
    finally:
        holder.stop()


@pytest.mark.parametrize("current", [b"", b"garbage\n", b"MANIFEST-000999\n"], ids=["empty", "garbled", "no-such"])
def test_a_foreign_leveldb_whose_current_file_is_a_crash_leftover_is_refused_untouched(
    store_path: str, current: bytes
) -> None:
    """A CURRENT that names no MANIFEST of the folder is taken for a lost one: the copy is opened
    with the newest MANIFEST (LevelDB's repair ran on it)."""
    leveldb(store_path, FOREIGN)
    Path(store_path, "CURRENT").write_bytes(current)
    assert_refused_untouched(store_path, ForeignStoreError, r"its key b'user:1' has")


def test_a_leveldb_with_its_own_comparator_that_lost_only_current_is_refused_untouched(store_path: str) -> None:
    leveldb(store_path, {b"k": b"1"}, comparator=reverse, comparator_name=b"test.Reverse")
    Path(store_path, "CURRENT").unlink()
    assert_refused_untouched(store_path, ForeignStoreError, r"the comparator 'test\.Reverse'")


def a_store_whose_log_cannot_be_read(path: str) -> None:
    leveldb(path, FOREIGN)
    Path(path, "000099.log").mkdir()  # read as a log: IsADirectoryError


@pytest.mark.parametrize(
    ("make", "owner"),
    [
        (lambda path: leveldb(path, {VERSION_KEY: b"1"}), Owner.OURS),
        (lambda path: leveldb(path, {VERSION_KEY: b"2"}), Owner.ANOTHER_RELEASE),
        (lambda path: leveldb(path, FOREIGN), Owner.FOREIGN),
        (lambda path: (leveldb(path, FOREIGN), lose_current_and_manifests(path)), Owner.UNREADABLE),
        (a_store_whose_log_cannot_be_read, None),
    ],
    ids=["ours", "another-release", "foreign", "unreadable", "error"],
)
def test_the_temporary_folder_is_left_empty(
    store_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, make: Callable[[str], object], owner: Owner | None
) -> None:
    make(store_path)
    scratch = tmp_path / "tmpdir"
    scratch.mkdir()
    monkeypatch.setattr(tempfile, "tempdir", str(scratch))
    if owner is None:
        with pytest.raises(StoreError):
            classify_folder(store_path)
    else:
        assert classify_folder(store_path).owner is owner
    assert list(scratch.iterdir()) == []


def test_a_file_of_the_store_that_cannot_be_read_is_named_not_the_temporary_folder(store_path: str) -> None:
    a_store_whose_log_cannot_be_read(store_path)
    before = folder_digest(store_path)
    with pytest.raises(StoreError) as info:
        repair(store_path)
    assert str(info.value) == (
        f"repair of '{store_path}' not started: whose LevelDB it is could not be checked (its file 000099.log "
        "could not be read: Is a directory); nothing was changed"
    )
    assert folder_digest(store_path) == before


def test_a_temporary_folder_too_full_for_the_copys_open_refuses_repair_untouched(
    store_path: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The copy is made, but LevelDB's open of it cannot write the table of its log: TMPDIR's fault,
    not damage (it was 'unreadable', and LevelDB's repair ran on another program's LevelDB)."""
    leveldb(store_path, {b"user:%d" % number: os.urandom(1000) for number in range(300)})  # in the log only
    before = digest(store_path)
    log_size = sum(Path(store_path, name).stat().st_size for name in before if name.endswith(".log"))
    with small_disk(tmp_path / "disk", 1) as disk:
        leave_free(disk, fill(disk), log_size + log_size // 2)
        monkeypatch.setattr(tempfile, "tempdir", str(disk))
        assert_refused_for_tmpdir(store_path, disk, "No space left on device")
        assert sorted(name.name for name in disk.iterdir()) == ["filler"]
    assert digest(store_path) == before


def test_the_error_of_another_programs_leveldb_is_exported_as_a_store_error_not_damage() -> None:
    """operations.md names it ``amqtt_durable.ForeignStoreError``, like ForeignLayoutError (review 288 P3-6)."""
    assert amqtt_durable.ForeignStoreError is ForeignStoreError
    assert issubclass(ForeignStoreError, StoreError)
    assert not issubclass(ForeignStoreError, StoreCorruptedError)
