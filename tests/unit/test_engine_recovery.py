"""DurableEngine start-up recovery against a real LevelDB store, without a broker."""

from __future__ import annotations

import asyncio
from pathlib import Path

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.sessions import droppable
from amqtt_durable.store import (
    FLAG_RELEASED,
    FLAG_SHARED,
    Body,
    Entry,
    SessionRecord,
    body_key,
    encode_refs,
    encode_totals,
    encode_u64,
    entry_key,
    open_store,
    refs_key,
    sent_mark_key,
    session_key,
    totals_key,
)


def test_queue_entries_of_a_session_deleted_before_a_crash_are_removed_at_start(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(session_key("alive"), SessionRecord("alive", 1).encode())
    db.put(totals_key(1), encode_totals(1, 4, 0))
    db.put(body_key(10), Body("t", b"kept", 1, 1.0).encode())
    db.put(entry_key(1, 1), Entry(1, 10, 1, 0, 4).encode())
    # sid 2: record already deleted, entries left behind; one body shared with sid 1
    db.put(body_key(11), Body("t", b"gone", 1, 1.0).encode())
    db.put(entry_key(2, 5), Entry(5, 11, 1, 0, 4).encode())
    db.put(body_key(12), Body("t", b"both", 1, 1.0).encode())
    db.put(refs_key(12), encode_refs(2))
    db.put(entry_key(1, 2), Entry(2, 12, 1, FLAG_SHARED, 4).encode())
    db.put(entry_key(2, 6), Entry(6, 12, 1, FLAG_SHARED, 4).encode())
    db.put(totals_key(7), encode_totals(1000, 4000, 0))  # totals and sent mark of sessions whose
    db.put(sent_mark_key(8), encode_u64(500))  # deletion a crash cut short after their queue went
    db.close()

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine._next_sid > 8, "a session number with leftovers in the store is never reused"
        await engine.close()

    asyncio.run(main())
    db = open_store(path, create=False)
    try:
        assert [key for key, _ in db.iterator(prefix=b"q")] == [entry_key(1, 1), entry_key(1, 2)]
        assert db.get(body_key(11)) is None, "the orphan's own body goes with it"
        assert db.get(body_key(12)) is not None, "a body another session still holds stays"
        assert db.get(refs_key(12)) == encode_refs(1)
        assert db.get(totals_key(7)) is None and db.get(sent_mark_key(8)) is None
    finally:
        db.close()


def test_a_qos2_entry_waiting_for_pubcomp_is_not_droppable() -> None:
    assert droppable(Entry(1, 1, 2, 0, 1))
    assert not droppable(Entry(1, 1, 2, FLAG_RELEASED, 1))


def test_expiry_spares_a_session_between_connack_and_delivery_but_not_forever(tmp_path: Path) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), session_expiry=0.0))
        engine.open()
        assert await engine.connect("dev", clean_session=False) is False
        session = engine.sessions["dev"]
        session.record.expires_at = 1.0  # long past, as if it had been disconnected
        engine.expiry.schedule("dev", 1.0)
        assert await engine.connect("dev", clean_session=False) is True  # CONNACK on its way
        await engine._expire_due()
        assert "dev" in engine.sessions, "a session whose CONNACK was just sent must not expire"
        assert engine.expiry.deadline("dev") == session.connecting_until
        session.connecting_until = 0.0  # the connection died before delivery started
        engine.expiry.schedule("dev", 1.0)
        await engine._expire_due()
        assert "dev" not in engine.sessions, "a connection that never started delivery must not keep it alive"
        await engine.close()

    asyncio.run(main())


def test_a_session_recreated_while_the_old_one_is_being_deleted_keeps_its_record(tmp_path: Path) -> None:
    path = str(tmp_path / "store")

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("dev", clean_session=False)
        deleting = asyncio.get_running_loop().create_task(engine.delete_session(engine.sessions["dev"]))
        await asyncio.sleep(0)  # the deletion is under way, waiting for its first write
        assert await engine.connect("dev", clean_session=False) is False  # a new session, same client id
        await deleting
        await engine.close()

    asyncio.run(main())
    db = open_store(path, create=False)
    try:
        assert db.get(session_key("dev")) is not None, "the new session's record must survive the old one's deletion"
    finally:
        db.close()


class SilentTransport:
    """A connection that takes bytes and never acknowledges: enough for the engine's bookkeeping."""

    closed = False

    def write(self, data: bytes) -> None:
        self.written = data

    async def drain(self) -> None:
        return None

    def expect_ack(self, kind: str, packet_id: int, on_ack: object) -> None:
        return None


def test_a_connection_attaching_while_its_session_is_deleted_gets_no_pump(tmp_path: Path) -> None:
    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=str(tmp_path / "store")))
        engine.open()
        await engine.connect("dev", clean_session=False)
        session = engine.sessions["dev"]
        attaching = asyncio.get_running_loop().create_task(engine.attach("dev", SilentTransport()))
        await asyncio.sleep(0)  # attach waits for its commit
        await engine.delete_session(session)  # a clean CONNECT of the same client id
        await attaching
        assert session.pump is None and session.transport is None
        assert "dev" not in engine.sessions
        await engine.close()

    asyncio.run(main())


def test_drop_oldest_keeps_a_qos2_entry_awaiting_pubcomp_reachable(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(session_key("dev"), SessionRecord("dev", 1, {"t": 2}, expires_at=9e18).encode())
    for seq, flags in ((1, FLAG_RELEASED), (2, 0), (3, 0)):
        db.put(body_key(seq), Body("t", b"m%d" % seq, 2, 1.0).encode())
        db.put(entry_key(1, seq), Entry(seq, seq, 2, flags, 2).encode())
    db.put(totals_key(1), encode_totals(3, 6, 0))
    db.close()

    async def main() -> None:
        config = DurableConfig(store=path, max_depth=3, max_depth_disconnected=3, overflow="drop-oldest")
        engine = DurableEngine(config)
        engine.open()
        await engine.route_publish("t", b"new", 2)  # full: the oldest droppable one goes
        session = engine.sessions["dev"]
        entries, _ = session.read_entries(session.head_seq, session.committed_tail, 10)
        assert [(e.seq, body.payload) for e, body in entries] == [(1, b"m1"), (3, b"m3"), (4, b"new")]
        await engine.close()

    asyncio.run(main())
