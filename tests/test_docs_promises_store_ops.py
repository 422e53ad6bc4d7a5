"""docs/operations.md's store procedures walked as an operator would, wrong turns included:
backing up, restoring and moving a store; inspect and repair pointed at the wrong path."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import plyvel
import yaml
from small_disk import fill, small_disk

from amqtt_durable.store import held_lock
from conftest import Broker, Client, payloads, probe_connack, run_cli


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


def test_the_replication_tools_pointed_at_an_mqtt_listener_say_nothing_answered(
    broker_factory: Callable[..., Broker],
) -> None:
    """A tired operator's `inspect --replication` / `promote` at the broker's MQTT port (not its
    replication.listen): exit 1, `no answer to ...` saying nothing answered in time (the message
    read `(TimeoutError: )`), and the broker keeps serving."""
    broker = broker_factory()
    result = run_cli("inspect", "--replication", f"127.0.0.1:{broker.port}")
    assert result.returncode == 1, result.stderr
    assert "no answer to STATUS (TimeoutError: nothing answered within 10 s)" in result.stderr, result.stderr
    assert "its replication.listen" in result.stderr
    assert probe_connack(broker.port)


def test_a_listener_whose_host_is_unknown_is_named_by_broker_not_started(broker_factory: Callable[..., Broker]) -> None:
    """operations.md: a listener's host unknown is exit 1 with `broker not started: listener
    '<name>' <host>:<port>: ...` (the line was the bare `[Errno -2] Name or service not known`,
    naming neither the listener nor the host)."""
    broker = broker_factory(start=False)
    broker.write_config()
    config = yaml.safe_load(broker.config_path.read_text())
    config["listeners"]["second"] = {"type": "tcp", "bind": f"nosuchhost.invalid:{broker.port}"}
    broker.config_path.write_text(yaml.safe_dump(config))
    result = run_cli("broker", "-c", str(broker.config_path))
    assert result.returncode == 1, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"amqtt-durable: broker not started: listener 'second' nosuchhost.invalid:{broker.port}: ")
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
