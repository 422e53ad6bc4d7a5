"""Issue 10, points 4 and 6: damaged stores, against the real `amqtt-durable` CLI and broker.

Each test queues a few thousand messages for a disconnected durable session through a real
broker, stops it, damages the LevelDB folder as a disk or an operator would, and checks that
the broker refuses or reports the damage (never silence, never a new store over the old one),
that `amqtt-durable repair` brings the store back and says what it could not, and that the
broker then delivers every message the repair kept, in order.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable
from pathlib import Path

import plyvel
from test_metrics_and_batching import latest

from conftest import WAIT, Broker, Client, run_cli

COUNT = 5000
PAYLOAD_SIZE = 1000
"""Incompressible 1 KB payloads: 5,000 of them fill several 2 MB table files once compacted."""


def payload(index: int) -> bytes:
    head = f"m{index:07d}:".encode()
    return head + hashlib.shake_256(head).digest(PAYLOAD_SIZE - len(head))


def index_of(data: bytes) -> int:
    return int(data[1:8])


def folder_digest(path: str) -> dict[str, str]:
    """Every file in the store folder by name, with a hash of its bytes."""
    digest: dict[str, str] = {}
    for root, _, names in os.walk(path):
        for name in names:
            full = os.path.join(root, name)
            digest[os.path.relpath(full, path)] = hashlib.sha256(Path(full).read_bytes()).hexdigest()
    return digest


def store_records(path: str) -> dict[bytes, bytes]:
    db = plyvel.DB(path)
    try:
        return dict(db.iterator())
    finally:
        db.close()


def queue_for_offline_session(broker: Broker, clients: Callable[..., Client], count: int = COUNT) -> Client:
    """dev-1 subscribes to 't' and goes away; ``count`` messages are queued for it; the broker stops."""
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [payload(i) for i in range(count)], qos=1)
    broker.stop()
    return sub


def compact(path: str) -> str:
    """Move everything into table files (a store that has run for a while); the name of the
    largest one that does not hold dev-1's session record (so mostly message bodies)."""
    db = plyvel.DB(path)
    db.compact_range()
    db.close()
    tables = [name for name in os.listdir(path) if name.endswith(".ldb")]
    assert len(tables) >= 2, f"expected the queue to span several table files, got {tables}"
    # A key that starts a block is stored whole, and snappy keeps a short unrepeated string as is.
    bodies = [name for name in tables if b"sdev-1" not in Path(path, name).read_bytes()]
    assert bodies, "every table holds the session record?"
    return max(bodies, key=lambda name: os.path.getsize(os.path.join(path, name)))


def start_refused(broker: Broker) -> str:
    result = run_cli("broker", "-c", str(broker.write_config()))
    assert result.returncode == 1, f"the broker must refuse this store:\n{result.stdout}\n{result.stderr}"
    return result.stderr


def repaired(broker: Broker) -> str:
    result = run_cli("repair", broker.store)
    assert result.returncode == 0, result.stderr
    assert f"repaired '{broker.store}'" in result.stdout
    return result.stdout


def received_indexes(sub: Client, count: int) -> list[int]:
    """Indexes of the messages received so far, once ``count`` are in; each payload checked whole."""
    messages = sub.wait_messages(count, timeout=WAIT + count / 200)
    indexes = [index_of(m.payload) for m in messages]
    assert all(m.payload == payload(i) for m, i in zip(messages, indexes, strict=True)), "a damaged payload"
    return indexes


def queued(broker: Broker) -> int:
    """Messages the (stopped) broker's store holds for dev-1, as `amqtt-durable inspect` shows them."""
    result = run_cli("inspect", broker.store, "--json")
    assert result.returncode == 0, result.stderr
    rows = {row["client_id"]: row for row in json.loads(result.stdout)}
    return int(rows["dev-1"]["depth"])


def test_store_that_lost_current_is_refused_untouched_and_repair_recovers_every_message(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    sub = queue_for_offline_session(broker, clients)
    os.remove(os.path.join(broker.store, "CURRENT"))
    before = folder_digest(broker.store)

    error = start_refused(broker)
    assert "CURRENT" in error and "is missing" in error, error
    assert f"amqtt-durable repair {broker.store}" in error, error
    assert folder_digest(broker.store) == before, "a refused store must be left exactly as it was"

    repaired(broker)
    broker.start()
    assert sub.connect() is True, "the session survives the repair"
    assert received_indexes(sub, COUNT) == list(range(COUNT)), "every queued message, in order"


def test_a_folder_holding_other_files_is_not_made_a_store(broker_factory: Callable[..., Broker]) -> None:
    broker = broker_factory(start=False)
    os.makedirs(broker.store)
    Path(broker.store, "notes.txt").write_text("not a store")
    error = start_refused(broker)
    assert "holds files (notes.txt) but no LevelDB store" in error and "empty or missing folder" in error, error
    assert "repair" not in error, "nothing to repair: the setting points at the wrong folder"
    assert sorted(os.listdir(broker.store)) == ["notes.txt"]


def test_flipped_bytes_in_a_table_are_reported_and_retried_not_silent(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory(metrics_interval=0.2)
    sub = queue_for_offline_session(broker, clients)
    table = Path(broker.store, compact(broker.store))
    data = bytearray(table.read_bytes())
    middle = len(data) // 2
    for offset in range(64):
        data[middle + offset * 7] ^= 0xFF
    table.write_bytes(bytes(data))

    broker.start()  # start-up reads keys, not whole queues: the damage is met by the pump
    watcher = clients(broker.port, "ops", clean_session=True)
    watcher.subscribe("$SYS/broker/durable/store/read_errors", 0)
    topic = "$SYS/broker/durable/store/read_errors"
    assert sub.connect() is True
    assert watcher.wait_for(lambda ms: (latest(ms, topic) or 0) >= 2, timeout=WAIT), (
        "a failed read is counted and tried again\n" + broker.log()
    )
    log = broker.log()
    assert "ERROR" in log and "session dev-1: reading its queue after message" in log, log
    assert f"amqtt-durable repair {broker.store}" in log, log
    assert "resumes on the next connection" not in log
    first = [index_of(m.payload) for m in sub.messages]
    assert 0 < len(first) < COUNT and first == list(range(len(first))), "in order up to the damage"

    sub.disconnect()
    broker.stop()
    report = repaired(broker)
    assert f"table file {table.name} was damaged" in report, report
    left = queued(broker)
    assert 0 < left < COUNT - len(first), f"the damaged block's messages are gone:\n{report}"
    broker.start()
    assert sub.connect() is True
    got = received_indexes(sub, len(first) + left)  # both connections
    assert len(got) == len(first) + left, "every message the repaired store holds"
    assert got == sorted(set(got)), "in order, no duplicates"
    assert got[: len(first)] == first


def test_truncated_table_is_named_with_the_repair_path(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    sub = queue_for_offline_session(broker, clients)
    name = compact(broker.store)
    table = Path(broker.store, name)
    table.write_bytes(table.read_bytes()[: table.stat().st_size // 2])
    before = table.read_bytes()

    error = start_refused(broker)
    assert f"table file {name} is truncated" in error, error
    assert f"amqtt-durable repair {broker.store}" in error, error
    assert "Invalid argument" not in error
    assert table.read_bytes() == before, "the refused store's table is left as it was"

    report = repaired(broker)
    assert f"not recovered: table file {name} was damaged" in report, report
    left = queued(broker)
    assert 0 < left < COUNT, report
    broker.start()
    assert sub.connect() is True
    got = received_indexes(sub, left)
    assert len(got) == left and got == sorted(set(got)), "every message the repair kept, in order"


def test_damaged_session_record_and_totals_are_named_and_rebuilt_by_repair(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    sub = queue_for_offline_session(broker, clients)
    db = plyvel.DB(broker.store)
    record = db.get(b"sdev-1")
    assert record is not None
    sid = int(record.split(b'"sid":')[1].split(b",")[0])
    db.put(b"sdev-1", record[: len(record) // 2])  # cut in the middle of its JSON
    db.put(b"t" + sid.to_bytes(8, "big"), b"\x00\x01\x02")  # totals of the wrong size
    db.close()
    before = store_records(broker.store)

    error = start_refused(broker)
    assert "the session record of client id 'dev-1' does not decode" in error, error
    assert f"amqtt-durable repair {broker.store}" in error, error
    assert store_records(broker.store) == before, "a refused store keeps every record as it was"

    report = repaired(broker)
    assert f"rebuilt: client 'dev-1': session record rebuilt (session number {sid})" in report, report
    assert f"queue totals rebuilt from the queue: {COUNT} message(s), {COUNT * PAYLOAD_SIZE} bytes" in report
    assert "the client must subscribe again" in report
    assert queued(broker) == COUNT

    broker.start()
    assert sub.connect() is True, "the rebuilt record keeps the session and its queue"
    assert received_indexes(sub, COUNT) == list(range(COUNT))


def test_damaged_totals_alone_are_named_at_start(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    broker = broker_factory()
    sub = queue_for_offline_session(broker, clients, count=50)
    db = plyvel.DB(broker.store)
    sid = next(key for key in db.iterator(prefix=b"t", include_value=False))
    db.put(sid, b"\xff")
    db.close()
    error = start_refused(broker)
    assert "the queue totals of client id 'dev-1': 1 bytes that do not decode" in error, error
    assert "amqtt-durable repair" in error
    report = repaired(broker)
    assert "client 'dev-1': queue totals rebuilt from the queue: 50 message(s)" in report
    broker.start()
    assert sub.connect() is True
    assert received_indexes(sub, 50) == list(range(50))


def test_a_body_that_passes_its_checksum_but_does_not_decode_is_removed_by_repair(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """Issue 14: a body LevelDB reads back intact (its checksum holds) whose bytes Body.decode refuses (a
    topic length running past the body's end) stopped replay at it for good, and repair, which only
    looked for missing bodies, left it there: the queue stayed stuck. Repair now removes the body and
    the entries of both sessions it was shared by, and says so; the rest comes in order."""
    count, bad = 50, 20
    broker = broker_factory(metrics_interval=0.2)
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    other = clients(broker.port, "dev-2")
    other.subscribe("t", 1)
    other.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [payload(i) for i in range(count)], qos=1)
    broker.stop()
    db = plyvel.DB(broker.store)
    try:
        key, raw = next((k, v) for k, v in db.iterator(prefix=b"m") if v.endswith(payload(bad)))
        # The head (time, QoS) as stored, then a topic length past the end: written through LevelDB,
        # so every checksum is right and only the plugin's decoding can tell.
        db.put(key, raw[:9] + (60_000).to_bytes(2, "big") + raw[11:], sync=True)
    finally:
        db.close()
    msg_id = int.from_bytes(key[1:], "big")

    broker.start()  # replay meets it: everything before it comes, then an ERROR, counted and retried
    watcher = clients(broker.port, "ops", clean_session=True)
    topic = "$SYS/broker/durable/store/read_errors"
    watcher.subscribe(topic, 0)
    assert sub.connect() is True
    assert watcher.wait_for(lambda ms: (latest(ms, topic) or 0) >= 1, timeout=WAIT), broker.log()
    assert f"session dev-1: reading its queue after message {bad}" in broker.log(), broker.log()
    assert received_indexes(sub, bad) == list(range(bad)), "in order up to the damaged body"
    sub.disconnect()
    broker.stop()

    report = repaired(broker)
    size = len(raw)
    assert (
        f"not recovered: message {msg_id}: its body does not decode (a topic of 60000 bytes in a body of "
        f"{size}): removed, with the 2 queue entry(ies) pointing at it" in report
    ), report
    assert "not recovered: client 'dev-1': 1 queued message(s) unreadable (removed)" in report, report
    assert "not recovered: client 'dev-2': 1 queued message(s) unreadable (removed)" in report, report
    assert queued(broker) == count - bad - 1
    db = plyvel.DB(broker.store)
    try:
        assert db.get(key) is None and db.get(b"c" + key[1:]) is None, "the body and its reference count are gone"
    finally:
        db.close()

    logged = len(broker.log())
    broker.start()
    assert sub.connect() is True
    expected = [i for i in range(count) if i != bad]
    assert received_indexes(sub, count - 1) == expected, "every other message, in order, after the damaged one"
    assert other.connect() is True
    assert received_indexes(other, count - 1) == expected, "the session that shared the body too"
    assert "reading its queue" not in broker.log()[logged:], "the repaired store reads without an error"
