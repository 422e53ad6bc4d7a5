"""The next file number read from a real LevelDB MANIFEST: above every table it lists (those are linked
into repair's scratch copy), and at or below every number LevelDB's open of the copy gives a new file."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import plyvel

from amqtt_durable.leveldb_manifest import next_file_number
from amqtt_durable.store_owner import scratch_copy

BLOCK = 32768


def manifest_of(path: Path) -> bytes:
    return Path(path, Path(path, "CURRENT").read_text().strip()).read_bytes()


def test_the_number_read_bounds_the_listed_tables_and_the_opens_new_files_over_blocks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    db = plyvel.DB(str(store), create_if_missing=True, write_buffer_size=64 * 1024)
    for number in range(40_000):  # hundreds of flushes and compactions, each an edit of the MANIFEST
        db.put(b"k%08d" % (number * 7919 % 40_000), b"%600d" % number)
    db.put(b"in the log", b"the next open makes a table of it")
    db.close()
    manifest = manifest_of(store)
    assert len(manifest) > BLOCK, "the MANIFEST spans more than one block of LevelDB's log format"
    recorded = next_file_number(manifest)
    assert recorded is not None
    opened = tmp_path / "opened"
    shutil.copytree(store, opened)
    plyvel.DB(str(opened)).close()
    tables = {name for name in os.listdir(store) if name.endswith(".ldb")}
    kept = tables & set(os.listdir(opened))  # the open removes every table its version does not list
    assert kept
    assert all(int(name[:-4]) < recorded for name in kept), "a table the MANIFEST lists would be copied"
    made = [int(number) for number in re.findall(r"Level-0 table #(\d+): started", Path(opened, "LOG").read_text())]
    assert made, "the open made a table of the log's records"
    assert min(made) >= recorded, "the open wrote a table under a number a linked table may have"


def test_a_manifest_with_an_edit_it_does_not_know_links_no_table(tmp_path: Path) -> None:
    """Nothing judged on a guess: every table is copied."""
    store = tmp_path / "store"
    db = plyvel.DB(str(store), create_if_missing=True)
    db.put(b"k", b"v")
    db.compact_range()
    db.close()
    plyvel.DB(str(store)).close()
    name = Path(store, "CURRENT").read_text().strip()
    assert next_file_number(manifest_of(store)) is not None
    edit = bytes([99, 1])  # tag 99, which LevelDB's VersionEdit does not write
    with Path(store, name).open("ab") as appended:
        appended.write(bytes(4) + len(edit).to_bytes(2, "little") + bytes([1]) + edit)  # a full record
    assert next_file_number(manifest_of(store)) is None
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    assert scratch_copy(str(store), os.listdir(store), str(scratch)) == []
    assert any(path.name.endswith(".ldb") and not path.is_symlink() for path in scratch.iterdir())


def test_a_torn_last_record_ends_the_reading() -> None:
    edit = bytes([3, 42])  # next file number 42
    record = bytes(4) + len(edit).to_bytes(2, "little") + bytes([1]) + edit
    torn = bytes(4) + (100).to_bytes(2, "little") + bytes([1]) + bytes([3, 99])
    assert next_file_number(record + torn) == 42


def test_a_record_of_zero_or_unknown_type_ends_the_reading() -> None:
    def record(kind: int, number: int) -> bytes:
        return bytes(4) + (2).to_bytes(2, "little") + bytes([kind, 3, number])

    assert next_file_number(record(1, 42) + record(0, 99) + record(1, 77)) == 42
    assert next_file_number(record(1, 42) + record(9, 99) + record(1, 77)) == 42
