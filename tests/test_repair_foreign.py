"""Review 280 P2, against the real `amqtt-durable repair` command: a LevelDB of another program is
refused untouched (it ran LevelDB's repair on it and exited 0), while a genuine store that lost its
version key is still repaired (docs/operations.md, repair)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import plyvel
import pytest
from test_hostile_store import folder_digest, repaired

from conftest import Broker, Client, payloads, run_cli, seen_away


def reverse(a: bytes, b: bytes) -> int:
    return (a < b) - (a > b)


FOREIGN = {b"user:1": b"alice", b"user:2": b"bob", b"q" + bytes(16): b"a queue entry's key shape"}


@pytest.mark.parametrize(
    ("options", "why"),
    [
        ({}, "no layout version key or store id, and its key b'user:1' has the shape of no key of amqtt-durable's "
             "store layout"),
        ({"comparator": reverse, "comparator_name": b"other.Reverse"},
         "its keys are kept in the order of the comparator 'other.Reverse', not LevelDB's default, which "
         "amqtt-durable uses"),
    ],
    ids=["foreign-keys", "own-comparator"],
)
def test_repair_refuses_another_programs_leveldb_and_changes_no_file(
    tmp_path: Path, options: dict[str, object], why: str
) -> None:
    store = str(tmp_path / "other")
    db = plyvel.DB(store, create_if_missing=True, **options)
    for key, value in FOREIGN.items():
        db.put(key, value)
    db.compact_range()  # some records in a table, some in the log
    db.put(b"user:3", b"carol")
    db.close()
    before = folder_digest(store)

    result = run_cli("repair", store)

    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr == (
        f"amqtt-durable: repair of '{store}' refused: it is not an amqtt-durable store but another program's "
        f"LevelDB ({why}); nothing was changed. Point repair at the plugin's 'store' folder\n"
    )
    assert folder_digest(store) == before, "a file of the folder changed"
    db = plyvel.DB(store, **options)
    try:
        assert dict(db.iterator()) == {**FOREIGN, b"user:3": b"carol"}, "its owner reads it as before"
    finally:
        db.close()


@pytest.mark.parametrize("lost", [[b"v"], [b"v", b"i"]], ids=["version", "version-and-store-id"])
def test_repair_still_repairs_a_genuine_store_that_lost_its_version_key(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client], lost: list[bytes]
) -> None:
    """Without the version key, or without it and the store id, the store's keys all have the layout's shapes."""
    broker = broker_factory(metrics_interval=0.2)
    device = clients(broker.port, "dev-1")
    device.subscribe("t", 1)
    device.disconnect()
    seen_away(clients, broker, 1)
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(3), qos=1)
    broker.stop()
    db = plyvel.DB(broker.store)
    for key in lost:
        assert db.get(key) is not None
        db.delete(key, sync=True)
    db.close()

    report = repaired(broker)

    assert report.splitlines()[1:] == ["  rebuilt: layout version key restored"], report
    broker.start()
    assert device.connect() is True, "the session is kept"
    assert [m.payload for m in device.wait_messages(3)] == payloads(3)


def test_repair_of_a_running_brokers_store_is_refused_before_any_file_of_it_is_written(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """The lock is checked before the scratch copy: no file of the store changes, not even LevelDB's
    info LOG an open moves (review 282 P1)."""
    broker = broker_factory()
    clients(broker.port, "pub", clean_session=True).publish("t", payloads(3), qos=1)
    before = folder_digest(broker.store)

    result = run_cli("repair", broker.store)

    assert result.returncode == 1, result.stdout + result.stderr
    locked = f"amqtt-durable: store '{broker.store}' is locked by another process ("
    assert result.stderr.startswith(locked), result.stderr
    assert folder_digest(broker.store) == before


def test_repair_exits_1_for_a_leveldb_found_another_programs_only_after_leveldbs_repair(tmp_path: Path) -> None:
    """Its CURRENT and MANIFEST gone, nothing could be read before LevelDB's repair; what it reads
    then is not taken over, and repair says so and fails (it said 'repaired' and exited 0)."""
    store = str(tmp_path / "other")
    db = plyvel.DB(store, create_if_missing=True)
    for key, value in FOREIGN.items():
        db.put(key, value)
    db.close()
    for name in Path(store).iterdir():
        if name.name == "CURRENT" or name.name.startswith("MANIFEST-"):
            name.unlink()

    result = run_cli("repair", store)

    assert result.returncode == 1, result.stdout + result.stderr
    assert result.stdout == ""
    assert result.stderr.startswith(
        f"amqtt-durable: repair of '{store}' stopped: it is not an amqtt-durable store but another program's "
        "LevelDB (no layout version key or store id, and its key b'user:1' has the shape of no key of "
        "amqtt-durable's store layout). It could not be read, so LevelDB's repair has run on it"
    ), result.stderr
    db = plyvel.DB(store)
    try:
        assert db.get(b"v") is None
        assert dict(db.iterator()) == FOREIGN
    finally:
        db.close()


def layout_keys() -> dict[bytes, bytes]:
    """One key of each shape store-layout.md lists (with store.py's docstring for the values), no `v`, no `i`."""
    topic = "telemetry/é".encode()
    event = b"\x40\x8f\x40\x00\x00\x00\x00\x00\x01p"  # published_at 1000.0, qos 1, payload b"p"
    return {
        b"e" + len(topic).to_bytes(2, "big") + topic + (1).to_bytes(8, "big"): event,
        b"L" + topic: (1).to_bytes(8, "big"),
        b"l" + b"old/t" + b"\x00" + (2).to_bytes(8, "big"): event,  # an earlier release's event
        b"L" + b"old/t": (2).to_bytes(8, "big"),
        b"r" + b"some/retained": event,
        b"n": (3).to_bytes(8, "big"),
        b"M": (1024).to_bytes(8, "big"),
    }


@pytest.mark.parametrize(
    ("changed", "accepted"),
    [
        ({}, True),
        ({b"e\x00\x05telemetry/x" + bytes(8): b"p"}, False),  # a topic length that does not add up
        ({b"t" + bytes(7): bytes(24)}, False),  # `t` and 7 bytes
        ({b"x" + bytes(9): b""}, False),  # `x` and 9 bytes
    ],
    ids=["every-shape", "e-lengths", "t-7-bytes", "x-9-bytes"],
)
def test_repair_takes_a_store_whose_every_key_has_a_layout_shape_and_refuses_one_other_key(
    tmp_path: Path, changed: dict[bytes, bytes], accepted: bool
) -> None:
    """store-layout.md: repair takes a folder without `v` or `i` "when every key it holds has the
    shape of a key of this layout": `e` with lengths that add up and a UTF-8 topic, `L` and `r`
    followed by UTF-8, `n`, `M` alone, an earlier release's `l`, topic, NUL and 8 bytes, `t` and 8
    bytes, `x` and 10 bytes; a single other key makes it another program's LevelDB."""
    store = str(tmp_path / "store")
    db = plyvel.DB(store, create_if_missing=True)
    for key, value in {**layout_keys(), **changed}.items():
        db.put(key, value)
    db.close()
    before = folder_digest(store)

    result = run_cli("repair", store)

    if accepted:
        assert result.returncode == 0, result.stdout + result.stderr
        assert "layout version key restored" in result.stdout, result.stdout
    else:
        assert result.returncode == 1, result.stdout + result.stderr
        (key,) = changed
        assert f"its key {key!r} has the shape of no key of amqtt-durable's store layout" in result.stderr
        assert folder_digest(store) == before, "a file of the folder changed"
