"""Issue 10 review of the merged store points, against the real `amqtt-durable` CLI and broker: a
tired operator's stores that the merged branches (store guard, retained messages, stream keys)
each handled alone but not together.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import plyvel
from test_hostile_store import repaired, start_refused

from conftest import Broker, Client


def test_a_store_of_retained_messages_only_that_lost_its_version_key_is_repaired_and_keeps_them(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """No durable session ever connected: the store holds retained messages (and its id), nothing
    else. The start-up refusal sends the operator to repair, which must then be able to help."""
    broker = broker_factory()
    clients(broker.port, "pub", clean_session=True).publish("device/7/state", [b"on"], qos=1, retain=True)
    broker.stop()
    db = plyvel.DB(broker.store)
    db.delete(b"v", sync=True)  # what a damaged table that held the version key leaves after repair
    db.close()

    error = start_refused(broker)
    assert "no layout version key" in error and f"amqtt-durable repair {broker.store}" in error, error
    report = repaired(broker)
    assert "rebuilt: layout version key restored" in report, report
    assert "not this plugin's store" not in report, report

    broker.start()
    sub = clients(broker.port, "reader", clean_session=True)
    sub.subscribe("device/+/state", 1)
    (message,) = sub.wait_messages(1)
    assert (message.topic, message.payload, message.retain) == ("device/7/state", b"on", True)


def test_a_store_folder_left_with_only_leveldb_lock_and_log_files_becomes_a_store(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """LevelDB writes LOCK and LOG before CURRENT: a crash or a full disk while the very first start
    created the store leaves only them. Nothing is in them, so the next start creates the store."""
    broker = broker_factory(start=False)
    os.makedirs(broker.store)
    Path(broker.store, "LOCK").write_bytes(b"")
    Path(broker.store, "LOG").write_text("2026/11/24-23:50:00.000000 7f00 Creating DB store since it was missing.\n")

    broker.start()
    sub = clients(broker.port, "dev-1")
    sub.subscribe("t", 1)
    sub.disconnect()
    clients(broker.port, "pub", clean_session=True).publish("t", [b"kept"], qos=1)
    broker.restart(kill=True)
    assert sub.connect() is True, "the session is in the store created there"
    assert [m.payload for m in sub.wait_messages(1)] == [b"kept"]


def test_a_damaged_retained_message_stops_start_up_by_name_and_repair_removes_it(
    broker_factory: Callable[..., Broker], clients: Callable[..., Client]
) -> None:
    """A retained value that no longer decodes (LevelDB's repair keeps a record whose bytes a disk
    changed) must not start a broker silently without retained messages, nor stop every start."""
    broker = broker_factory()
    publisher = clients(broker.port, "pub", clean_session=True)
    publisher.publish("a/state", [b"broken soon"], qos=1, retain=True)
    publisher.publish("b/state", [b"fine"], qos=1, retain=True)
    broker.stop()
    db = plyvel.DB(broker.store)
    db.put(b"ra/state", b"\x00", sync=True)
    db.close()

    error = start_refused(broker)
    assert "the retained message of topic 'a/state': 1 bytes that do not decode" in error, error
    assert f"amqtt-durable repair {broker.store}" in error, error
    report = repaired(broker)
    assert "not recovered: the retained message of topic 'a/state' does not decode: removed" in report, report

    broker.start()
    sub = clients(broker.port, "reader", clean_session=True)
    sub.subscribe("+/state", 1)
    (message,) = sub.wait_messages(1)
    assert (message.topic, message.payload) == ("b/state", b"fine")
