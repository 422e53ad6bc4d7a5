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


def open_a_copy(store: Path, opened: Path) -> tuple[set[str], list[int]]:
    """LevelDB's open of a copy of ``store`` at ``opened``: the store's tables it kept (it removes
    every table its version does not list) and the numbers of the tables it made. A table it made
    may have the name and the bytes of one no version lists: a flush the close interrupted, made
    again from the same log under the same number. So a table the open made is not one it kept."""
    shutil.copytree(store, opened)
    plyvel.DB(str(opened)).close()
    log = Path(opened, "LOG").read_text()
    made = [int(number) for number in re.findall(r"(?:Level-0 table|Generated table) #(\d+)", log)]
    tables = {name for name in os.listdir(store) if name.endswith((".ldb", ".sst"))}
    return {name for name in tables & set(os.listdir(opened)) if int(name.split(".")[0]) not in made}, made


def test_the_number_read_bounds_the_listed_tables_and_the_opens_new_files_over_blocks(tmp_path: Path) -> None:
    store = tmp_path / "store"
    db = plyvel.DB(str(store), create_if_missing=True, write_buffer_size=64 * 1024)
    for number in range(40_000):  # hundreds of flushes and compactions, each an edit of the MANIFEST
        db.put(b"k%08d" % (number * 7919 % 40_000), b"%600d" % number)
    big = b"z" + os.urandom(35_000).hex().encode()  # a 70 KiB key, the largest: a table's edit names it
    db.put(big, b"v")
    db.compact_range()
    db.put(b"in the log", b"the next open makes a table of it")
    db.close()
    manifest = manifest_of(store)
    assert big[: BLOCK // 2] in manifest, "an edit longer than two blocks: it spans blocks of LevelDB's log format"
    recorded = next_file_number(manifest)
    assert recorded is not None
    kept, made = open_a_copy(store, tmp_path / "opened")
    assert kept
    assert all(int(name[:-4]) < recorded for name in kept), "a table the MANIFEST lists would be copied"
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


def fragment(kind: int, payload: bytes) -> bytes:
    """A record of LevelDB's log format, its CRC left zero (the reader does not check it)."""
    return bytes(4) + len(payload).to_bytes(2, "little") + bytes([kind]) + payload


def next_file(number: int) -> bytes:
    """A VersionEdit of one field, the next file number (tag 3), its varint any length."""
    out = bytearray([3])
    while number >= 0x80:
        out.append(number & 0x7F | 0x80)
        number >>= 7
    return bytes(out) + bytes([number])


def test_a_torn_last_record_ends_the_reading() -> None:
    torn = bytes(4) + (100).to_bytes(2, "little") + bytes([1]) + bytes([3, 99])
    assert next_file_number(fragment(1, next_file(42)) + torn) == 42


def test_a_record_of_zero_or_unknown_type_ends_the_reading() -> None:
    assert next_file_number(fragment(1, next_file(42)) + fragment(0, next_file(99)) + fragment(1, next_file(77))) == 42
    assert next_file_number(fragment(1, next_file(42)) + fragment(9, next_file(99)) + fragment(1, next_file(77))) == 42


def test_a_header_of_zeros_skips_the_rest_of_its_block_and_the_reading_goes_on() -> None:
    """LevelDB's log reader: zero type and zero length (preallocated zeros) end the block, not the log."""
    head = fragment(1, next_file(42)) + bytes(7) + fragment(1, next_file(99))  # the 99 is in the skipped rest
    assert next_file_number(head + bytes(BLOCK - len(head)) + fragment(1, next_file(77))) == 77
    split = fragment(1, next_file(42)) + fragment(2, bytes([3]))  # a first fragment the zeros' block ends
    assert next_file_number(split + bytes(BLOCK - len(split)) + fragment(4, bytes([99]))) == 42


def test_a_varint_over_64_bits_or_10_bytes_is_not_understood() -> None:
    assert next_file_number(fragment(1, next_file(2**64 - 1))) == 2**64 - 1
    assert next_file_number(fragment(1, next_file(2**64 + 42))) is None  # LevelDB would keep the low 42
    assert next_file_number(fragment(1, bytes([3]) + bytes([0x80] * 10) + bytes([0]))) is None


def test_a_next_file_number_lower_than_an_earlier_one_is_not_understood() -> None:
    assert next_file_number(fragment(1, next_file(42)) + fragment(1, next_file(42)) + fragment(1, next_file(43))) == 43
    assert next_file_number(fragment(1, next_file(42)) + fragment(1, next_file(41))) is None


def test_fragments_are_joined_and_a_fragment_continuing_none_is_dropped() -> None:
    """A first, middle and last fragment make one record; a middle or last with no first before it
    (its first lost) is no record, and a full record after a last starts afresh."""
    edit = next_file(300)  # three bytes: tag, then a two-byte varint
    joined = fragment(2, edit[:1]) + fragment(3, edit[1:2]) + fragment(4, edit[2:])
    assert next_file_number(joined) == 300
    assert next_file_number(joined + fragment(3, bytes([3, 99])) + fragment(4, bytes([3, 99]))) == 300
    assert next_file_number(fragment(4, edit) + fragment(1, next_file(7))) == 7
    assert next_file_number(joined + fragment(1, next_file(301))) == 301
