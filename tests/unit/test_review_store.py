"""Issue 10 review of the merged store points (4, 5, 6 with the b"e", b"r", b"x" prefixes), without a
broker: each test is an interaction between two merged branches, on a real LevelDB under tmp_path.
"""

from __future__ import annotations

import asyncio
import os
import struct
from pathlib import Path

import plyvel
import pytest

from amqtt_durable.config import DurableConfig, StreamConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.errors import StoreCorruptedError, StoreReadError
from amqtt_durable.repair import repair
from amqtt_durable.store import LAYOUT_VERSION, VERSION_KEY, iter_retained, open_store, pubrel_key
from amqtt_durable.streams import MARK_PREFIX, encode_event, event_key

GENEROUS = 10.0
NOW = 1_800_000_000.0


def drop_version_key(path: str) -> None:
    """What a damaged table that held the version key leaves after LevelDB's repair."""
    db = plyvel.DB(path)
    db.delete(VERSION_KEY, sync=True)
    db.close()


def test_repair_restores_the_version_key_of_a_store_holding_only_retained_messages(store_path: str) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        stored = engine.route_publish("device/7/state", b"on", 1, retain=True)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        await engine.close()

    asyncio.run(main())
    drop_version_key(store_path)
    with pytest.raises(StoreCorruptedError, match="no layout version key"):
        open_store(store_path, create=False)
    report = repair(store_path)
    assert report.rebuilt == ["layout version key restored"]
    assert report.lost == []
    db = open_store(store_path, create=False)
    try:
        assert [(m.topic, m.payload, m.qos) for m in iter_retained(db)] == [("device/7/state", b"on", 1)]
    finally:
        db.close()


def test_repair_restores_the_version_key_of_a_store_holding_only_stream_events(store_path: str) -> None:
    db = plyvel.DB(store_path, create_if_missing=True)
    db.put(event_key("s/a", 1), encode_event(NOW, 1, b"first"))
    db.put(MARK_PREFIX + b"s/a", struct.pack(">Q", 1))
    db.close()
    report = repair(store_path)
    assert report.rebuilt == ["layout version key restored"]
    db = open_store(store_path, create=False)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
        assert db.get(event_key("s/a", 1)) == encode_event(NOW, 1, b"first"), "the event is kept"
    finally:
        db.close()


def test_repair_still_refuses_a_leveldb_whose_keys_only_share_the_new_prefixes(store_path: str) -> None:
    """Another program's keys starting with e, r, L or x are not taken for this plugin's."""
    foreign = {b"email:1": b"a@b", b"role:admin": b"1", b"Lang": b"en", b"x1": b"y"}
    db = plyvel.DB(store_path, create_if_missing=True)
    for key, value in foreign.items():
        db.put(key, value)
    db.close()
    report = repair(store_path)
    assert report.rebuilt == []
    db = plyvel.DB(store_path)
    try:
        assert dict(db.iterator()) == foreign
    finally:
        db.close()


@pytest.mark.parametrize("left", [["LOCK"], ["LOCK", "LOG"], ["LOCK", "LOG", "LOG.old"]])
def test_a_folder_left_by_a_crash_while_creating_the_store_becomes_a_store(tmp_path: Path, left: list[str]) -> None:
    """LevelDB makes LOCK and LOG before CURRENT: a crash (or a full disk) in between leaves only them.
    They are LevelDB's bookkeeping, no data: the next start creates the store instead of refusing."""
    path = tmp_path / "store"
    path.mkdir()
    for name in left:
        (path / name).write_bytes(b"")
    db = open_store(str(path))
    try:
        db.put(b"k", b"v")
    finally:
        db.close()
    db = open_store(str(path), create=False)
    try:
        assert db.get(VERSION_KEY) == LAYOUT_VERSION
    finally:
        db.close()


def test_retained_messages_and_qos2_ids_are_read_through_the_reopened_handle(store_path: str) -> None:
    """The disk-full retry swaps engine.db: nothing may keep reading the closed one."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        stored = engine.route_publish("a", b"1", 1, retain=True)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        old = engine.db
        assert engine.committer.reopen is not None
        assert engine.committer.reopen() is not old
        assert old.closed
        assert [(m.topic, m.payload) for m in engine.retained.stored()] == [("a", b"1")]
        await engine.close()

    asyncio.run(main())


def test_a_pump_read_while_the_store_is_closed_for_a_reopen_is_a_read_error_retried(store_path: str) -> None:
    """A reopen that closed the store and could not open it again (the disk filled up again between
    the probe and the open) leaves engine.db closed until the next retry: a pump reading then gets
    the read error it reports and retries, not a RuntimeError that ends its delivery."""

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path))
        engine.open()
        await engine.connect("c", clean_session=False)
        await engine.subscribe("c", "t", 1)
        stored = engine.route_publish("t", b"1", 1)
        assert stored is not None
        await asyncio.wait_for(stored, GENEROUS)
        session = engine.sessions["c"]
        assert len(session.read_entries(0, session.next_seq, 10)[0]) == 1
        engine.db.close()
        with pytest.raises(StoreReadError, match="closed"):
            session.read_entries(0, session.next_seq, 10)
        engine.db = open_store(store_path, create=False)
        await engine.close()

    asyncio.run(main())


def test_qos2_ids_of_a_session_gone_before_a_crash_are_swept_and_never_reused(store_path: str) -> None:
    """A b"x" key whose session record is gone (a crash mid-delete) is deleted at start, and its
    session number is still never handed out again."""
    db = open_store(store_path)
    db.put(pubrel_key(41, 7), b"", sync=True)
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=store_path, streams=[StreamConfig("s/#")]))
        engine.open()
        assert engine.db.get(pubrel_key(41, 7)) is None, "swept at start"
        await engine.connect("new", clean_session=False)
        assert engine.sessions["new"].sid > 41
        await engine.close()

    asyncio.run(main())
    assert not os.path.exists(os.path.join(store_path, "lost"))
