"""The stored inbound QoS 2 state (b"x" keys) of durable publishers, against a real LevelDB, without a broker."""

from __future__ import annotations

import asyncio
from pathlib import Path

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.store import SessionRecord, iter_pubrel_due, open_store, pubrel_key, session_key


def stored_ids(path: str) -> list[tuple[int, int]]:
    db = open_store(path, create=False)
    try:
        return list(iter_pubrel_due(db))
    finally:
        db.close()


def sid_of(path: str, client_id: str) -> int:
    db = open_store(path, create=False)
    try:
        raw = db.get(session_key(client_id))
        assert raw is not None
        return SessionRecord.decode(client_id, raw).sid
    finally:
        db.close()


def test_a_packet_id_is_written_with_its_message_and_survives_a_restart_until_pubrel(tmp_path: Path) -> None:
    path = str(tmp_path / "store")

    async def publish() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("pub", clean_session=False)
        await engine.connect("sub", clean_session=False)
        await engine.subscribe("sub", "t", 2)
        stored = engine.route_publish("t", b"m", 2)
        assert stored is not None
        engine.expect_pubrel("pub", 7)
        writes = engine.committer.commits
        await stored
        assert engine.committer.commits == writes + 1, "message and packet id share one write batch"
        engine.db.close()  # a crash: nothing more is written

    async def release() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine.pubrel_due("pub", 7), "the re-send after the crash is known"
        assert not engine.pubrel_due("pub", 8) and not engine.pubrel_due("sub", 7)
        erasing = engine.pubrel_released("pub", 7)
        assert erasing is not None and not engine.pubrel_due("pub", 7)
        assert engine.pubrel_released("pub", 7) is erasing, "a second PUBREL waits for the same write"
        await erasing
        assert engine.pubrel_released("pub", 7) is None  # and once it is written, changes nothing
        engine.db.close()  # a crash right after PUBCOMP: the deletion is already written

    asyncio.run(publish())
    sid = sid_of(path, "pub")
    assert stored_ids(path) == [(sid, 7)]
    asyncio.run(release())
    assert stored_ids(path) == []


def test_packet_ids_of_a_session_deleted_before_a_crash_are_removed_at_start(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(session_key("alive"), SessionRecord("alive", 1).encode())
    db.put(pubrel_key(1, 5), b"")
    db.put(pubrel_key(9, 5), b"")  # sid 9: record gone, the crash cut its deletion short
    db.put(pubrel_key(9, 65535), b"")
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine._next_sid > 9, "a session number with leftovers in the store is never reused"
        assert engine.pubrel_due("alive", 5)
        await engine.close()

    asyncio.run(main())
    assert stored_ids(path) == [(1, 5)]


def test_a_deleted_session_takes_its_packet_ids_along(tmp_path: Path) -> None:
    path = str(tmp_path / "store")

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("pub", clean_session=False)
        await engine.connect("keep", clean_session=False)
        engine.expect_pubrel("keep", 3)
        engine.expect_pubrel("pub", 1)
        engine.expect_pubrel("pub", 65535)
        await engine.connect("pub", clean_session=True)  # deletes the stored session
        engine.expect_pubrel("pub", 2)  # no session any more: nothing recorded
        await engine.close()

    asyncio.run(main())
    sid_keep = sid_of(path, "keep")
    assert stored_ids(path) == [(sid_keep, 3)]
