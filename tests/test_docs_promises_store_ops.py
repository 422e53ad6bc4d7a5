"""docs/operations.md's store procedures walked as an operator would, wrong turns included:
backing up, restoring and moving a store; inspect and repair pointed at the wrong path."""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
import yaml
from small_disk import fill, free_bytes, leave_free, remount_read_only, small_disk
from test_hostile_store import folder_digest

from amqtt_durable.store import (
    Body,
    Entry,
    SessionRecord,
    body_key,
    encode_totals,
    entry_key,
    held_lock,
    open_store,
    repaired_store,
    session_key,
    totals_key,
)
from conftest import Broker, Client, payloads, probe_connack, run_cli, seen_away


def _start_on(broker_factory: Callable[..., Broker], store: Path) -> Broker:
    return broker_factory(store=str(store))


def test_backup_restore_and_move_of_a_store_as_operations_md_says(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md, Backing up, restoring and moving a store: a copy of a stopped broker's folder
    is the whole store anywhere; copied *into* an existing folder it is refused, named, untouched;
    after a restore, what was acknowledged since the copy comes again."""
    first = broker_factory()
    device = clients(first.port, "bk-1")
    device.subscribe("bk/t", 1)
    device.disconnect()
    publisher = clients(first.port, "bk-pub", clean_session=True)
    publisher.publish("bk/t", payloads(3), qos=1)
    publisher.publish("bk/r", [b"kept"], qos=1, retain=True)
    publisher.disconnect()
    first.stop()
    assert first.exit_status == 0, first.log()

    backups = tmp_path / "backups"
    backups.mkdir()
    backup = backups / "durable-copy"
    shutil.copytree(first.store, backup)  # cp -a STORE /backups/durable-copy
    listed = json.loads(run_cli("inspect", str(backup), "--json").stdout)
    assert [(row["client_id"], row["depth"]) for row in listed] == [("bk-1", 3)]

    # The wrong turn: the copy put *into* an existing folder (cp -a COPY data/durable, data/durable there).
    existing = tmp_path / "restore" / "durable"
    existing.mkdir(parents=True)
    shutil.copytree(backup, existing / "durable-copy")
    wrong = broker_factory(start=False, store=str(existing))
    wrong.write_config()
    refused = run_cli("broker", "-c", str(wrong.config_path))
    assert refused.returncode == 1, refused.stderr
    assert f"store folder '{existing}' holds files (durable-copy) but no LevelDB store" in refused.stderr
    assert sorted(p.name for p in existing.iterdir()) == ["durable-copy"], "nothing is created beside the copy"

    # A copy that missed LevelDB's CURRENT file (cp interrupted, a glob that skipped it).
    partial = tmp_path / "partial"
    shutil.copytree(backup, partial)
    (partial / "CURRENT").unlink()
    before = sorted(p.name for p in partial.iterdir())
    half = broker_factory(start=False, store=str(partial))
    half.write_config()
    refused = run_cli("broker", "-c", str(half.config_path))
    assert refused.returncode == 1, refused.stderr
    assert f"store '{partial}' is corrupted or unreadable" in refused.stderr
    assert "CURRENT, the file naming the live MANIFEST, is missing" in refused.stderr
    assert sorted(p.name for p in partial.iterdir()) == before

    # Restore as documented: the folder itself at the store path. The first broker's own store is
    # used meanwhile (its messages acknowledged), then the copy brings them back: at-least-once.
    again = _start_on(broker_factory, Path(first.store))
    device = clients(again.port, "bk-1")
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)
    device.disconnect()
    again.stop()
    shutil.rmtree(first.store)  # moved aside / removed
    shutil.copytree(backup, first.store)
    restored = _start_on(broker_factory, Path(first.store))
    device = clients(restored.port, "bk-1")
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)
    reader = clients(restored.port, "bk-reader", clean_session=True)
    reader.subscribe("bk/r", 1)
    assert [m.payload for m in reader.wait_messages(1)] == [b"kept"]
    reader.disconnect()
    device.disconnect()
    restored.stop()

    # Move: the folder renamed, `store` pointed at its new path.
    moved = tmp_path / "elsewhere" / "durable"
    moved.parent.mkdir()
    shutil.move(str(backup), str(moved))
    at_new_path = _start_on(broker_factory, moved)
    assert probe_connack(at_new_path.port)
    device = clients(at_new_path.port, "bk-1")
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)
    device.disconnect()


def test_repair_of_a_file_names_the_file_and_inspect_of_a_folder_of_other_files_names_them(tmp_path: Path) -> None:
    """A store path that is a file (or below one) is named as such by repair, as by inspect and
    the broker (repair said 'folder does not exist'); inspect of a folder holding other files
    says so (operations.md, inspect)."""
    file = tmp_path / "notes.txt"
    file.write_text("not a store")
    for args, named in (
        (("repair", str(file)), f"store '{file}' is a file, not a folder"),
        (("repair", str(file / "durable")), f"store '{file / 'durable'}': '{file}' is a file, not a folder"),
        (("inspect", str(file)), f"store '{file}' is a file, not a folder"),
    ):
        result = run_cli(*args)
        assert result.returncode == 1, (args, result.stderr)
        assert named in result.stderr, (args, result.stderr)
        assert "Traceback" not in result.stderr
    assert file.read_text() == "not a store"
    data = tmp_path / "data"
    data.mkdir()
    (data / "durable").mkdir()
    shown = run_cli("inspect", str(data))
    assert shown.returncode == 1
    assert f"store folder '{data}' holds files (durable) but no LevelDB store" in shown.stderr
    empty = run_cli("inspect", str(data / "durable"))
    assert (empty.returncode, f"no store at '{data / 'durable'}'" in empty.stderr) == (1, True), empty.stderr
    assert list((data / "durable").iterdir()) == [], "inspect creates nothing"


def test_inspect_without_a_store_or_with_both_a_store_and_replication_is_a_usage_error(tmp_path: Path) -> None:
    """operations.md: `inspect` takes a store folder or `--replication HOST:PORT`; neither, both,
    or `--retained` with `--replication` is a usage error, exit code 2 (was exit 1 with a config
    error naming a 'store' setting for the first, and the store silently ignored for the second)."""
    for args in (
        ("inspect",),
        ("inspect", "--json"),
        ("inspect", str(tmp_path), "--replication", "127.0.0.1:1"),
        ("inspect", "--replication", "127.0.0.1:1", "--retained"),
    ):
        result = run_cli(*args)
        assert result.returncode == 2, (args, result.returncode, result.stderr)
        assert "usage: amqtt-durable inspect" in result.stderr, result.stderr
        assert "amqtt_durable config" not in result.stderr


def test_the_replication_tools_pointed_at_an_mqtt_listener_say_it_closed_without_an_answer(
    broker_factory: Callable[..., Broker],
) -> None:
    """A tired operator's `inspect --replication` / `promote` at the broker's MQTT port (not its
    replication.listen): exit 1, `no answer to ...` saying the connection was closed without an
    answer (the message read `(TimeoutError: )`, then a bare IncompleteReadError), and the broker keeps serving."""
    broker = broker_factory()
    result = run_cli("inspect", "--replication", f"127.0.0.1:{broker.port}")
    assert result.returncode == 1, result.stderr
    # The MQTT listener closes a connection whose first packet is not a CONNECT at once (guarantees.md).
    closed = "no answer to STATUS (IncompleteReadError: the connection was closed without an answer)"
    assert closed in result.stderr, result.stderr
    assert "its replication.listen" in result.stderr
    assert probe_connack(broker.port)


@pytest.mark.parametrize("kind", ["tcp", "ws"])
def test_a_listener_whose_host_is_unknown_is_named_by_broker_not_started(
    broker_factory: Callable[..., Broker], kind: str
) -> None:
    """operations.md: a listener's host unknown is exit 1 with `broker not started: listener
    '<name>' <host>:<port>: ...` (the line was the bare `[Errno -2] Name or service not known`,
    naming neither the listener nor the host; a `type: ws` listener's too), and the other
    listener, opened first, is closed again."""
    broker = broker_factory(start=False)
    broker.write_config()
    config = yaml.safe_load(broker.config_path.read_text())
    port = broker.port + 1
    config["listeners"]["second"] = {"type": kind, "bind": f"nosuchhost.invalid:{port}"}
    broker.config_path.write_text(yaml.safe_dump(config))
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"amqtt-durable: broker not started: listener 'second' nosuchhost.invalid:{port}: ")
    assert not probe_connack(broker.port), "the other listener is closed again"


def test_on_a_full_disk_the_broker_does_not_start_and_repair_changes_nothing(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md: a broker started on a full disk exits 1 naming `No space left on device`;
    `repair` then refuses before LevelDB's repair runs, and nothing is lost: once space is freed
    the queue is there. (LevelDB's repair moved the store's log to lost/ and failed writing its
    MANIFEST, after which the next open deleted the log's new table: every record it held lost.)"""
    with small_disk(tmp_path / "disk", 16) as disk:
        store = str(disk / "store")
        broker = broker_factory(store=store)
        device = clients(broker.port, "full-1")
        device.subscribe("full/t", 1)
        device.disconnect()
        publisher = clients(broker.port, "full-pub", clean_session=True)
        publisher.publish("full/t", payloads(3), qos=1)
        publisher.disconnect()
        broker.kill()  # what it acknowledged is in the store's log, not yet in a table
        filler = fill(disk)
        started = run_cli("broker", "-c", str(broker.config_path))
        assert started.returncode == 1, started.stderr
        assert "broker not started: cannot read store" in started.stderr
        assert "No space left on device" in started.stderr
        refused = run_cli("repair", store)
        filler.unlink()
        listed = json.loads(run_cli("inspect", store, "--json").stdout)
        assert [(row["client_id"], row["depth"]) for row in listed] == [("full-1", 3)], "the queue is kept"
        assert refused.returncode == 1, refused.stderr
        assert f"repair of '{store}' not started" in refused.stderr, refused.stderr
        assert "nothing was changed" in refused.stderr
        assert not (Path(store) / "lost").exists()
        repaired = run_cli("repair", store)
        assert repaired.returncode == 0, repaired.stderr
        broker.start()
        device = clients(broker.port, "full-1")
        assert [m.payload for m in device.wait_messages(3)] == payloads(3)
        device.disconnect()
        broker.stop()


def test_a_probe_file_a_killed_process_left_on_a_full_disk_is_removed_before_the_store_opens(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md: the probe file `durable-write-probe.tmp` a crash left is removed at the next
    start. A process killed during a space check leaves it holding the space it allocated; the
    broker removed it only after LevelDB's open, which failed for that very space: exit 1, probe
    kept, no start until someone found the file."""
    with small_disk(tmp_path / "disk", 16) as disk:
        store = str(disk / "store")
        broker = broker_factory(store=store)
        device = clients(broker.port, "probe-1")
        device.subscribe("probe/t", 1)
        device.disconnect()
        publisher = clients(broker.port, "probe-pub", clean_session=True)
        publisher.publish("probe/t", payloads(3), qos=1)
        publisher.disconnect()
        broker.kill()  # what it acknowledged is in the store's log: the next open must write a table
        probe = Path(store) / "durable-write-probe.tmp"
        with probe.open("wb") as out:  # what a space check killed mid-way leaves: every free byte allocated
            os.posix_fallocate(out.fileno(), 0, free_bytes(disk))
        assert free_bytes(disk) < (1 << 20), "the probe holds the disk's free space"
        broker.start()
        assert not probe.exists()
        device = clients(broker.port, "probe-1")
        assert [m.payload for m in device.wait_messages(3)] == payloads(3)
        device.disconnect()
        broker.stop()


def test_while_repair_rewrites_a_store_a_broker_or_inspect_started_on_it_is_refused_as_locked(
    broker_factory: Callable[..., Broker], tmp_path: Path
) -> None:
    """operations.md: repair needs the broker stopped, and a broker started while LevelDB's repair
    (which takes no lock) rewrites the store must not open it half rewritten: repair holds the
    store's lock meanwhile, so a broker or `inspect` gets `store '...' is locked by another
    process`, exit code 1 (they opened it). The lock is the one repair holds around
    plyvel.repair_db (store.held_lock); held here as repair holds it."""
    broker = broker_factory()
    broker.stop()
    with held_lock(broker.store):
        started = run_cli("broker", "-c", str(broker.config_path))
        listed = run_cli("inspect", broker.store)
        repaired = run_cli("repair", broker.store)  # a second repair: its check that nothing holds the store
    for result in (started, listed, repaired):
        assert result.returncode == 1, result.stderr
        assert f"store '{broker.store}' is locked by another process" in result.stderr, result.stderr
    assert run_cli("repair", broker.store).returncode == 0, "released once repair is done"
    assert broker.start() is broker


def test_a_store_of_another_layout_is_named_as_another_release_s_and_repair_refuses_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md, Troubleshooting: another release's store (layout version b'2') is not called
    corrupted with the advice to run repair (which cannot change a layout); repair refuses it,
    exit code 1, its records untouched (it said 'repaired ...', exit code 0, and the broker still
    refused the store)."""
    broker = broker_factory()
    device = clients(broker.port, "layout-1")
    device.subscribe("layout/t", 1)
    device.disconnect()
    broker.stop()
    db = plyvel.DB(broker.store)
    db.put(b"v", b"2")
    before = dict(db.iterator())
    db.close()
    named = "was written by another release of amqtt_durable: layout version b'2', this release reads b'1'"
    for args in (("broker", "-c", str(broker.config_path)), ("inspect", broker.store), ("repair", broker.store)):
        result = run_cli(*args)
        assert result.returncode == 1, (args, result.stdout, result.stderr)
        assert f"store '{broker.store}' {named}" in result.stderr, (args, result.stderr)
        assert "corrupted" not in result.stderr and "repaired" not in result.stdout
    db = plyvel.DB(broker.store)
    assert dict(db.iterator()) == before
    db.close()


def _rewrite_tables(path: str, **options: object) -> list[Path]:
    """Compact the (closed) store into new table files written with ``options``; their paths."""
    db = plyvel.DB(path, **options)
    db.compact_range()
    db.close()
    return sorted(Path(path).glob("*.ldb"))


def test_a_damaged_layout_version_value_is_damage_that_repair_restores_not_another_release(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The layout version key's value byte damaged on disk ('1' become '3', its block's checksum
    no longer matching): the broker and inspect say corrupted, run repair; repair must not then
    refuse it as another release's store (it read the value without verifying the checksum, so
    the operator was stuck between the two): it restores the key, exit code 0."""
    broker = broker_factory(metrics_interval=0.05)
    device = clients(broker.port, "ver-1")
    device.subscribe("ver/t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)  # else the publish may find it still connected, and the stop leave it so
    publisher = clients(broker.port, "ver-pub", clean_session=True)
    publisher.publish("ver/t", payloads(3), qos=1)
    publisher.disconnect()
    broker.stop()
    # Uncompressed, one record per block: the damage hits the version key's block only.
    tables = _rewrite_tables(broker.store, compression=None, block_size=1)
    # The key "v" at the start of its block: shared 0, 9 key bytes ("v" + 8 of sequence and type), value 1 byte.
    found = [(t, m.end() - 1) for t in tables for m in re.finditer(rb"\x00\x09\x01v.{8}1", t.read_bytes(), re.S)]
    assert len(found) == 1, found
    table, offset = found[0]
    data = bytearray(table.read_bytes())
    data[offset] = ord("3")
    table.write_bytes(bytes(data))

    listed = run_cli("inspect", broker.store)
    assert listed.returncode == 1, listed.stderr
    assert f"store '{broker.store}' is corrupted or unreadable" in listed.stderr, listed.stderr
    assert f"run 'amqtt-durable repair {broker.store}'" in listed.stderr
    repaired = run_cli("repair", broker.store)
    assert repaired.returncode == 0, repaired.stderr
    assert "another release" not in repaired.stderr
    assert "rebuilt: layout version key restored" in repaired.stdout, repaired.stdout
    rows = json.loads(run_cli("inspect", broker.store, "--json").stdout)
    assert [(row["client_id"], row["depth"]) for row in rows] == [("ver-1", 3)]
    broker.start()
    device = clients(broker.port, "ver-1")
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)
    device.disconnect()


BODY_SIZE = 1000
BODIES = 8000
"""8,000 incompressible 1 KB bodies: about 8 MB."""


def _body(index: int) -> bytes:
    head = f"m{index:07d}:".encode()
    return head + hashlib.shake_256(head).digest(BODY_SIZE - len(head))


def _store_of_damaged_tables(path: Path) -> int:
    """A store (as the plugin writes one) of one session queueing BODIES messages, compacted into
    table files each damaged in one block; how many tables."""
    open_store(str(path)).close()  # a store of this release (its layout version key)
    db = plyvel.DB(str(path), write_buffer_size=1 << 20, max_file_size=1 << 20)  # 1 MB table files
    db.put(session_key("dmg-1"), SessionRecord("dmg-1", 1, {"dmg/t": 1}, created_at=1.8e9).encode())
    for first in range(1, BODIES + 1, 500):  # several memtables, merged by the compaction into 2 MB tables
        with db.write_batch() as batch:
            for seq in range(first, first + 500):
                batch.put(body_key(seq), Body("dmg/t", _body(seq), 1, 1.8e9).encode())
                batch.put(entry_key(1, seq), Entry(seq, seq, 1, 0, BODY_SIZE).encode())
    db.put(totals_key(1), encode_totals(BODIES, BODIES * BODY_SIZE, 0))
    db.close()
    tables = _rewrite_tables(str(path), max_file_size=1 << 20)
    assert len(tables) >= 6, tables
    for table in tables:  # a few bytes in the middle: one data block's checksum fails, the rest reads
        data = bytearray(table.read_bytes())
        for offset in range(8):
            data[len(data) // 2 + offset] ^= 0xFF
        table.write_bytes(bytes(data))
    return len(tables)


def _tables(store: Path) -> dict[str, str]:
    return {name: digest for name, digest in folder_digest(str(store)).items() if name.endswith(".ldb")}


def _depth(store: Path) -> int:
    shown = run_cli("inspect", str(store), "--json")
    assert shown.returncode == 0, shown.stderr
    return int(json.loads(shown.stdout)[0]["depth"])


def test_repair_refuses_a_disk_without_room_for_a_copy_of_every_damaged_table_and_loses_nothing(
    tmp_path: Path,
) -> None:
    """operations.md: repair first checks that the store's disk has twice the store's table and
    log files free, plus 1 MB. LevelDB's repair writes a copy of the readable records of every
    damaged table (and drops a copy that fails without a word), and the reopen compacts every
    table: with room for only the largest table's copy (the check was the logs, the largest table
    and 1 MB), repair said 'repaired', exit code 0, having dropped thousands of readable messages.
    Refused, nothing changed; with the room it asks for, nothing readable is lost."""
    made = tmp_path / "made"
    count = _store_of_damaged_tables(made)
    reference = tmp_path / "reference"
    shutil.copytree(made, reference)
    assert run_cli("repair", str(reference)).returncode == 0
    kept = _depth(reference)  # what a repair with room to spare keeps
    assert 0 < kept < BODIES
    store_size = sum(p.stat().st_size for p in made.iterdir() if p.suffix in (".ldb", ".log"))
    largest = max(p.stat().st_size for p in made.glob("*.ldb"))
    with small_disk(tmp_path / "disk", 64) as disk:
        store = disk / "store"
        shutil.copytree(made, store)
        filler = fill(disk)
        old_estimate = largest + (1 << 20)
        leave_free(disk, filler, old_estimate + (1 << 20))
        assert old_estimate + (1 << 20) < 2 * store_size + (1 << 20), (count, store_size)
        before = _tables(store)
        refused = run_cli("repair", str(store))
        assert refused.returncode == 1, (refused.stdout, refused.stderr)
        assert f"repair of '{store}' not started" in refused.stderr, refused.stderr
        assert "No space left on device" in refused.stderr and "nothing was changed" in refused.stderr
        assert "twice the store's table and log files plus 1 MB" in refused.stderr
        assert "Free space on the store's disk, then run repair again" in refused.stderr
        # (The open that checks the store is not held by a broker, as inspect's, starts a new log and MANIFEST.)
        assert _tables(store) == before, "no table file changed"
        assert not (store / "lost").exists(), "nothing moved to lost/"
        # Room as asked for (a page over): the repair keeps every readable message.
        leave_free(disk, filler, 2 * store_size + (1 << 20) + 8192)
        repaired = run_cli("repair", str(store))
        assert repaired.returncode == 0, repaired.stderr
        assert _depth(store) == kept, "every message the repair with room to spare keeps"


def test_repair_on_a_read_only_disk_names_the_error_and_does_not_ask_to_free_space(tmp_path: Path) -> None:
    """repair's refusal advises freeing space only when the disk is full (or over quota); on a
    read-only file system it names that error (it said 'Free space on the store's disk')."""
    with small_disk(tmp_path / "disk", 8) as disk:
        store = disk / "store"
        db = open_store(str(store))
        db.close()
        remount_read_only(disk)
        refused = run_cli("repair", str(store))
    assert refused.returncode == 1, refused.stderr
    assert f"repair of '{store}' not started: its folder cannot be written (Read-only file system)" in refused.stderr
    assert "nothing was changed" in refused.stderr
    assert "Free space" not in refused.stderr, refused.stderr


def test_a_damaged_store_of_another_release_is_reported_as_such_after_leveldb_s_repair_exit_1(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """operations.md: another release's store that does not open (here CURRENT and the MANIFEST are
    gone; one that lost only CURRENT is read with its newest MANIFEST and refused untouched) can only
    be read after LevelDB's repair: repair then says so (LevelDB's repair ran, nothing of the
    plugin's rebuilt), exit code 1; it said 'repaired', exit code 0."""
    broker = broker_factory()
    device = clients(broker.port, "old-1")
    device.subscribe("old/t", 1)
    device.disconnect()
    broker.stop()
    db = plyvel.DB(broker.store)
    db.put(b"v", b"2")
    db.close()
    for name in ["CURRENT", *(path.name for path in Path(broker.store).glob("MANIFEST-*"))]:
        (Path(broker.store) / name).unlink()
    result = run_cli("repair", broker.store)
    assert result.returncode == 1, (result.stdout, result.stderr)
    assert "repaired" not in result.stdout, result.stdout
    assert f"store '{broker.store}' was written by another release of amqtt_durable: layout version b'2'" in (
        result.stderr
    )
    assert "It did not open, so LevelDB's repair has run on it" in result.stderr, result.stderr
    assert "none of its sessions, queue totals or references was rebuilt" in result.stderr
    started = run_cli("broker", "-c", str(broker.config_path))
    assert started.returncode == 1
    assert "was written by another release of amqtt_durable: layout version b'2'" in started.stderr


def test_repair_holds_the_store_s_lock_until_the_rebuilt_store_is_closed(tmp_path: Path) -> None:
    """The lock repair holds covers the rebuild too (it was released before the store was opened
    again for it: a broker started in between opened a store whose bookkeeping was not rebuilt),
    and LevelDB opening the store in repair's own process does not end it."""
    store = tmp_path / "store"
    db = open_store(str(store))
    db.close()
    with repaired_store(str(store)) as opened:
        assert opened.get(b"v") == b"1"
        listed = run_cli("inspect", str(store))
        assert listed.returncode == 1
        assert f"store '{store}' is locked by another process" in listed.stderr, listed.stderr
    assert run_cli("inspect", str(store)).returncode == 0


def test_a_backup_copied_into_the_live_store_s_folder_is_warned_about(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], tmp_path: Path
) -> None:
    """operations.md: `cp -a /backups/durable-1 data/durable` with `data/durable` still holding the
    old store puts the copy inside it; the broker then runs on the old store, and says so with a
    WARNING naming the copy (it said nothing)."""
    broker = broker_factory()
    broker.stop()
    backup = tmp_path / "durable-1"
    shutil.copytree(broker.store, backup)
    shutil.copytree(backup, Path(broker.store) / "durable-1")
    broker.start()
    assert probe_connack(broker.port)
    log = broker.log()
    assert "WARNING" in log and f"store folder '{broker.store}' holds a folder 'durable-1' that is itself" in log, log
    broker.stop()
    shown = run_cli("inspect", broker.store)
    assert shown.returncode == 0
    assert "holds a folder 'durable-1' that is itself a LevelDB store" in shown.stderr, shown.stderr
