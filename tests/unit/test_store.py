"""The LevelDB store: key layout, codecs, open_store errors, repair, iteration helpers.

Every test uses a real LevelDB folder under tmp_path.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import plyvel
import pytest

import amqtt_durable
from amqtt_durable.errors import ForeignLayoutError, StoreCorruptedError, StoreError, StoreLockedError
from amqtt_durable.store import (
    FLAG_RELEASED,
    FLAG_RETAIN,
    LAYOUT_VERSION,
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
    iter_entries,
    iter_sessions,
    last_msg_id,
    last_seq,
    msg_id_of_body_key,
    open_store,
    queue_prefix,
    refs_key,
    repaired_store,
    sent_mark_key,
    seq_of_entry_key,
    session_key,
    totals_key,
)

CHILD_TIMEOUT = 10.0


# ----------------------------------------------------------------------------- key layout


def test_key_layout_version_1() -> None:
    assert VERSION_KEY == b"v"
    assert LAYOUT_VERSION == b"1"
    assert body_key(1) == b"m" + b"\x00" * 7 + b"\x01"
    assert refs_key(258) == b"c" + b"\x00" * 6 + b"\x01\x02"
    assert session_key("dév") == b"s" + "dév".encode()
    assert totals_key(3) == b"t" + (3).to_bytes(8, "big")
    assert sent_mark_key(3) == b"w" + (3).to_bytes(8, "big")
    assert queue_prefix(3) == b"q" + (3).to_bytes(8, "big")
    assert entry_key(3, 9) == b"q" + (3).to_bytes(8, "big") + (9).to_bytes(8, "big")
    assert len(entry_key(1, 1)) == 17


def test_entry_keys_sort_numerically() -> None:
    seqs = [0, 1, 2, 255, 256, 65535, 65536, 2**32, 2**63]
    keys = [entry_key(7, seq) for seq in seqs]
    assert sorted(keys) == keys
    assert [seq_of_entry_key(key) for key in keys] == seqs
    assert entry_key(7, 2**64 - 1) < queue_prefix(8)
    assert sorted([body_key(256), body_key(1), body_key(2**40)]) == [body_key(1), body_key(256), body_key(2**40)]


def test_msg_id_of_body_key_reads_the_id_back_from_body_and_refs_keys() -> None:
    ids = [0, 1, 258, 2**40, 2**64 - 1]
    assert [msg_id_of_body_key(body_key(msg_id)) for msg_id in ids] == ids
    assert [msg_id_of_body_key(refs_key(msg_id)) for msg_id in ids] == ids


# ---------------------------------------------------------------------------------- codecs


def test_body_roundtrip() -> None:
    body = Body("a/ü/c", b"\x00\xffpayload", 2, 1_700_000_000.25)
    raw = body.encode()
    assert len(raw) == 8 + 1 + 2 + len("a/ü/c".encode()) + len(b"\x00\xffpayload")
    assert Body.decode(raw) == body


def test_body_empty_payload_and_topic_bytes_boundary() -> None:
    body = Body("t/" + "x" * 300, b"", 0, 0.0)
    assert Body.decode(body.encode()) == body
    payload_like_topic = Body("ab", b"ab", 1, 1.5)
    decoded = Body.decode(payload_like_topic.encode())
    assert decoded.topic == "ab" and decoded.payload == b"ab"


def test_entry_roundtrip() -> None:
    entry = Entry(seq=42, msg_id=2**40 + 3, qos=2, flags=FLAG_RETAIN | FLAG_RELEASED, size=123_456)
    raw = entry.encode()
    assert len(raw) == 14
    assert Entry.decode(42, raw) == entry
    assert FLAG_RETAIN == 0x01 and FLAG_RELEASED == 0x02


def test_session_record_roundtrip() -> None:
    record = SessionRecord(
        client_id="dev-1",
        sid=7,
        subscriptions={"a/+": 1, "b/#": 2},
        created_at=100.5,
        disconnected_at=200.0,
        expires_at=500.0,
    )
    decoded = SessionRecord.decode("dev-1", record.encode())
    assert decoded == record


def test_session_record_decode_tolerates_missing_optional_fields() -> None:
    decoded = SessionRecord.decode("c", b'{"sid": 3}')
    assert decoded.sid == 3
    assert decoded.subscriptions == {}
    assert decoded.created_at == 0.0
    assert decoded.disconnected_at is None
    assert decoded.expires_at is None


def test_small_codecs() -> None:
    assert decode_totals(None) == (0, 0, 0)
    assert decode_totals(encode_totals(5, 2**40, 7)) == (5, 2**40, 7)
    assert decode_u64(None) == 0
    assert decode_u64(encode_u64(2**64 - 1)) == 2**64 - 1
    assert decode_refs(None) == 1, "an absent refs key means exactly one entry (no fan-out)"
    assert decode_refs(encode_refs(1000)) == 1000


# ------------------------------------------------------------------------------ open_store


def test_open_creates_folder_and_writes_version(tmp_path: Path) -> None:
    path = str(tmp_path / "a" / "b" / "store")
    db = open_store(path)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()
    assert os.path.isdir(path)
    again = open_store(path, create=False)
    try:
        assert again.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        again.close()


def test_data_survives_reopen(store_path: str) -> None:
    db = open_store(store_path)
    db.put(session_key("c"), SessionRecord("c", 1, created_at=1.0).encode())
    db.close()
    db = open_store(store_path)
    try:
        assert [r.client_id for r in iter_sessions(db)] == ["c"]
    finally:
        db.close()


def test_open_without_create_on_missing_folder(tmp_path: Path) -> None:
    path = str(tmp_path / "nope")
    with pytest.raises(StoreError, match="no store at") as info:
        open_store(path, create=False)
    assert path in str(info.value)
    assert not os.path.exists(path), "create=False must not create the folder"


def test_open_without_create_on_folder_that_is_not_a_store(tmp_path: Path) -> None:
    # e.g. `amqtt-durable inspect ./data` instead of ./data/durable: nothing is corrupted, so
    # the error must not call the folder corrupted and tell the user to run 'repair' on it.
    folder = tmp_path / "data"
    folder.mkdir()
    with pytest.raises(StoreError) as info:
        open_store(str(folder), create=False)
    assert str(folder) in str(info.value)
    assert not isinstance(info.value, StoreCorruptedError), str(info.value)
    assert "repair" not in str(info.value)


def test_open_store_on_a_file_is_a_store_error(tmp_path: Path) -> None:
    path = tmp_path / "file"
    path.write_text("x")
    with pytest.raises(StoreError) as info:
        open_store(str(path))
    assert str(path) in str(info.value)


def test_wrong_layout_version_is_another_release_s_store_not_damage(store_path: str) -> None:
    """Not 'corrupted ... run repair': repair cannot change a layout (it refuses such a store)."""
    db = open_store(store_path)
    db.put(VERSION_KEY, b"9")
    db.close()
    with pytest.raises(ForeignLayoutError) as info:
        open_store(store_path)
    message = str(info.value)
    assert store_path in message
    assert "layout version b'9', this release reads b'1'" in message
    assert "another release" in message and f"amqtt-durable repair {store_path}" not in message
    # open_store closed the LevelDB handle it failed on: the LOCK is free again.
    reopened = plyvel.DB(store_path)
    try:
        assert reopened.get(VERSION_KEY) == b"9", "a version mismatch must not rewrite the version"
    finally:
        reopened.close()


def test_data_without_version_key_is_corruption(store_path: str) -> None:
    raw = plyvel.DB(store_path, create_if_missing=True)
    raw.put(session_key("c"), b'{"sid":1}')
    raw.close()
    with pytest.raises(StoreCorruptedError, match="no layout version key") as info:
        open_store(store_path)
    assert info.value.path == store_path
    raw = plyvel.DB(store_path)
    try:
        assert raw.get(VERSION_KEY) is None
    finally:
        raw.close()


def test_empty_leveldb_gets_version_key(store_path: str) -> None:
    plyvel.DB(store_path, create_if_missing=True).close()
    db = open_store(store_path)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()


class Holder:
    """A child process that keeps the store open with plyvel until its stdin closes."""

    SCRIPT = (
        "import sys, plyvel\n"
        "db = plyvel.DB(sys.argv[1], create_if_missing=True)\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
        "db.close()\n"
    )

    def __init__(self, path: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", self.SCRIPT, path],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        assert line == b"ready\n", f"child did not open the store: {self.proc.stderr.read() if line == b'' else line!r}"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()  # only this child, by its PID
        self.proc.wait(timeout=CHILD_TIMEOUT)
        for stream in (self.proc.stdin, self.proc.stdout, self.proc.stderr):
            if stream is not None:
                stream.close()


@pytest.fixture
def locked_store(store_path: str) -> Iterator[str]:
    open_store(store_path).close()
    holder = Holder(store_path)
    try:
        yield store_path
    finally:
        holder.stop()


def test_store_locked_by_another_process(locked_store: str) -> None:
    with pytest.raises(StoreLockedError) as info:
        open_store(locked_store)
    assert info.value.path == locked_store
    assert f"store '{locked_store}' is locked by another process" in str(info.value)
    assert isinstance(info.value, StoreError)
    assert isinstance(info.value.__cause__, plyvel.IOError)


def test_store_lock_released_when_holder_exits(store_path: str) -> None:
    open_store(store_path).close()
    holder = Holder(store_path)
    with pytest.raises(StoreLockedError):
        open_store(store_path)
    holder.stop()
    db = open_store(store_path)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()


def test_store_locked_in_same_process(db: Any, store_path: str) -> None:
    with pytest.raises(StoreLockedError) as info:
        open_store(store_path)
    assert store_path in str(info.value)


def test_repair_refuses_a_store_in_use(locked_store: str) -> None:
    # LevelDB's RepairDB does not take the LOCK file: without a guard, `amqtt-durable repair`
    # rewrites the MANIFEST and moves the live .log into lost/ under a running broker.
    before = sorted(os.listdir(locked_store))
    with pytest.raises(StoreLockedError) as info:
        leveldb_repair(locked_store)
    assert locked_store in str(info.value)
    assert sorted(os.listdir(locked_store)) == before, "a refused repair must not touch the files"


CHECK_AS_NOBODY = """
import sys
from amqtt_durable.errors import StoreLockedError
from amqtt_durable.store import check_repairable
try:
    check_repairable(sys.argv[1])
except StoreLockedError:
    print("locked")
else:
    print("free")
"""


@pytest.mark.parametrize("held", [True, False], ids=["held", "free"])
def test_a_user_who_may_read_but_not_write_the_lock_file_sees_a_brokers_lock(*, held: bool) -> None:
    """The lock was tested on LOCK opened for writing: for a user who may only read it the open
    failed, and a running broker's store was taken for free (review 288 P3-1)."""
    if os.geteuid() != 0:
        pytest.skip("needs root, to run the check as another user")
    base = tempfile.mkdtemp(prefix="amqtt-durable-lock-")  # not under tmp_path: its parents are root's only
    try:
        os.chmod(base, 0o755)
        path = os.path.join(base, "store")
        open_store(path).close()
        for name in os.listdir(path):
            os.chmod(os.path.join(path, name), 0o644)
        holder = Holder(path) if held else None
        try:
            plugin = os.path.dirname(os.path.dirname(amqtt_durable.__file__))
            checked = subprocess.run(
                ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable, "-c",
                 CHECK_AS_NOBODY, path],
                env={**os.environ, "PYTHONPATH": plugin},
                capture_output=True,
                text=True,
                timeout=CHILD_TIMEOUT,
                check=False,
            )
        finally:
            if holder is not None:
                holder.stop()
        assert (checked.returncode, checked.stdout) == (0, "locked\n" if held else "free\n"), checked.stderr
    finally:
        shutil.rmtree(base)


# ------------------------------------------------------------------------ corruption/repair


def leveldb_repair(path: str) -> None:
    """The repair ``amqtt-durable repair`` runs, its store closed again at once (no bookkeeping rebuilt)."""
    with repaired_store(path):
        pass


def fill(path: str, count: int = 300, *, compact: bool = False) -> None:
    db = open_store(path)
    db.put(session_key("dev"), SessionRecord("dev", 1, created_at=1.0).encode())
    for seq in range(1, count + 1):
        db.put(body_key(seq), Body("t", b"payload-%06d" % seq + b"x" * 64, 1, 1000.0 + seq).encode())
        db.put(entry_key(1, seq), Entry(seq, seq, 1, 0, 80).encode())
    db.put(totals_key(1), encode_totals(count, count * 80, 0))
    if compact:
        db.compact_range()
    db.close()


def only_file(path: str, suffix: str) -> str:
    names = [name for name in os.listdir(path) if name.endswith(suffix) or name.startswith(suffix)]
    assert len(names) == 1, names
    return os.path.join(path, names[0])


def assert_corruption_message(error: StoreError, path: str) -> None:
    message = str(error)
    assert path in message
    assert "corrupted" in message
    assert f"amqtt-durable repair {path}" in message


def test_garbage_current_file(store_path: str) -> None:
    fill(store_path)
    Path(store_path, "CURRENT").write_bytes(b"garbage\n")
    with pytest.raises(StoreCorruptedError) as info:
        open_store(store_path)
    assert_corruption_message(info.value, store_path)
    leveldb_repair(store_path)
    db = open_store(store_path)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
        assert [r.client_id for r in iter_sessions(db)] == ["dev"]
        assert len(list(iter_entries(db, 1))) == 300
        assert decode_totals(db.get(totals_key(1))) == (300, 24000, 0)
    finally:
        db.close()


def test_garbage_manifest(store_path: str) -> None:
    fill(store_path)
    Path(only_file(store_path, "MANIFEST-")).write_bytes(b"\xde\xad\xbe\xef" * 64)
    with pytest.raises(StoreCorruptedError) as info:
        open_store(store_path)
    assert_corruption_message(info.value, store_path)
    leveldb_repair(store_path)
    db = open_store(store_path)
    try:
        entries = list(iter_entries(db, 1))
        assert [e.seq for e in entries] == list(range(1, 301))
        assert Body.decode(db.get(body_key(300))).payload.startswith(b"payload-000300")
    finally:
        db.close()


def test_damaged_write_ahead_log(store_path: str) -> None:
    fill(store_path)
    log_file = only_file(store_path, ".log")
    data = bytearray(Path(log_file).read_bytes())
    data[100:400] = b"\xff" * 300
    Path(log_file).write_bytes(bytes(data))
    with pytest.raises(StoreCorruptedError) as info:
        open_store(store_path)
    assert_corruption_message(info.value, store_path)
    assert isinstance(info.value.__cause__, plyvel.CorruptionError)
    leveldb_repair(store_path)
    db = open_store(store_path)
    try:
        # The records of the damaged log block are lost; every readable one is kept and the
        # store is usable again: entries still in seq order, each decodable.
        entries = list(iter_entries(db, 1))
        assert 0 < len(entries) < 300
        assert [e.seq for e in entries] == sorted(e.seq for e in entries)
        assert all(e.msg_id == e.seq and e.size == 80 for e in entries)
        assert last_seq(db, 1) == 300
        db.put(b"x", b"y")
    finally:
        db.close()
    assert os.path.isdir(os.path.join(store_path, "lost")), "repair keeps unreadable files in lost/"


def test_repair_of_a_healthy_store_keeps_everything(store_path: str) -> None:
    fill(store_path, compact=True)
    leveldb_repair(store_path)
    db = open_store(store_path)
    try:
        assert len(list(iter_entries(db, 1))) == 300
        assert last_msg_id(db) == 300
    finally:
        db.close()


def test_repair_missing_folder(tmp_path: Path) -> None:
    path = str(tmp_path / "missing")
    with pytest.raises(StoreError, match="no store at") as info:
        leveldb_repair(path)
    assert path in str(info.value)


# -------------------------------------------------------------------------- iteration helpers


def put_entries(db: Any, sid: int, seqs: list[int]) -> None:
    for seq in seqs:
        db.put(entry_key(sid, seq), Entry(seq, 1000 * sid + seq, 1, 0, seq).encode())


def test_iter_entries_stays_inside_one_session(db: Any) -> None:
    put_entries(db, 1, [1, 2, 3])
    put_entries(db, 2, [5, 6, 300, 70000])
    put_entries(db, 3, [1])
    got = list(iter_entries(db, 2))
    assert [e.seq for e in got] == [5, 6, 300, 70000]
    assert [e.msg_id for e in got] == [2005, 2006, 2300, 72000]
    assert list(iter_entries(db, 4)) == []
    assert [e.seq for e in iter_entries(db, 3)] == [1]


def test_iter_entries_start_and_limit(db: Any) -> None:
    put_entries(db, 1, list(range(1, 11)))
    put_entries(db, 2, [1])
    assert [e.seq for e in iter_entries(db, 1, 4)] == list(range(4, 11))
    assert [e.seq for e in iter_entries(db, 1, 4, 3)] == [4, 5, 6]
    assert [e.seq for e in iter_entries(db, 1, 0, 1)] == [1]
    assert [e.seq for e in iter_entries(db, 1, 9, 100)] == [9, 10]
    assert list(iter_entries(db, 1, 11)) == []
    assert [e.seq for e in iter_entries(db, 1, 10, 5)] == [10]


def test_iter_entries_limit_zero_yields_nothing(db: Any) -> None:
    put_entries(db, 1, [1, 2, 3])
    assert list(iter_entries(db, 1, 0, 0)) == []


def test_last_seq(db: Any) -> None:
    assert last_seq(db, 1) is None
    put_entries(db, 1, [1, 2, 256, 70000])
    put_entries(db, 2, [3])
    assert last_seq(db, 1) == 70000
    assert last_seq(db, 2) == 3
    assert last_seq(db, 3) is None
    db.delete(entry_key(2, 3))
    assert last_seq(db, 2) is None


def test_last_seq_is_not_confused_by_neighbour_session(db: Any) -> None:
    put_entries(db, 1, [5])
    put_entries(db, 2, [1, 9])
    put_entries(db, 256, [77])  # big-endian sids: 256 must not be read as a neighbour of 1 or 0
    assert last_seq(db, 1) == 5
    assert last_seq(db, 0) is None


def test_iter_sessions_and_last_msg_id(db: Any) -> None:
    assert last_msg_id(db) == 0
    assert list(iter_sessions(db)) == []
    db.put(session_key("b"), SessionRecord("b", 2, created_at=1.0).encode())
    db.put(session_key("a/ü"), SessionRecord("a/ü", 1, {"x": 1}, created_at=1.0).encode())
    db.put(totals_key(1), encode_totals(1, 2, 0))  # neighbour prefix must not be read as a session
    for msg_id in (1, 255, 256, 70000):
        db.put(body_key(msg_id), Body("t", b"", 0, 0.0).encode())
    db.put(refs_key(99999), encode_refs(2))
    sessions = list(iter_sessions(db))
    assert [(s.client_id, s.sid) for s in sessions] == [("a/ü", 1), ("b", 2)]
    assert sessions[0].subscriptions == {"x": 1}
    assert last_msg_id(db) == 70000
