"""DurableEngine start-up recovery against a real LevelDB store, without a broker."""

from __future__ import annotations

import asyncio
import logging
import re
from pathlib import Path

import pytest

from amqtt_durable import engine as engine_module
from amqtt_durable import lifecycle
from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.sessions import droppable
from amqtt_durable.store import (
    FLAG_RELEASED,
    FLAG_SHARED,
    MSG_ID_MARK_KEY,
    MSG_ID_RESERVE,
    NO_BODY,
    RELEASED_BODY,
    Body,
    Entry,
    SessionRecord,
    awaiting_pubcomp,
    body_key,
    decode_u64,
    encode_refs,
    encode_totals,
    encode_u64,
    entry_key,
    iter_entries,
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
    assert droppable(Entry(1, 1, 1, FLAG_RELEASED, 1)), "RELEASED on a QoS 1 entry is damage: it awaits no PUBCOMP"
    assert droppable(Entry(1, 1, 0, FLAG_RELEASED, 1))


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


@pytest.mark.parametrize("grace", [0.0, None], ids=["cancelled-after-its-grace", "finished-in-its-grace"])
def test_a_stop_gives_a_clean_connects_deletion_its_grace_then_cancels_it_and_the_next_start_deletes_the_rest(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, grace: float | None
) -> None:
    """A clean CONNECT's deletion of the old session is still under way when the engine stops
    (``_stop_work``): it gets DELETION_GRACE while the store writes, then it is cancelled (here the
    grace is 0, or the default, long enough). The CONNECT waiting for it is answered (its record's
    erasure is written), not cancelled with it. A new durable session of the same client id, made
    meanwhile, keeps every message; what the cancelled deletion left, the next start deletes."""
    monkeypatch.setattr(lifecycle, "DELETE_CHUNK", 10)  # 200 chunks: still deleting at the stop
    if grace is not None:
        monkeypatch.setattr(engine_module, "DELETION_GRACE", grace)
    path = str(tmp_path / "store")

    async def main() -> tuple[int, int]:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "t", 1)
        for i in range(2000):
            engine.route_publish("t", b"old-%d" % i, 1)
        await engine.committer.commit(urgent=True)
        old_sid = engine.sessions["dev"].sid
        connecting = asyncio.get_running_loop().create_task(engine.connect("dev", clean_session=True))
        for _ in range(10):  # loop passes, up to the deletion it starts
            if engine._deletions.tasks:
                break
            await asyncio.sleep(0)
        assert engine._deletions.tasks and "dev" not in engine.sessions
        assert await engine.connect("dev", clean_session=False) is False, "a new session of the same client id"
        await engine.subscribe("dev", "t", 1)
        await asyncio.gather(*[engine.route_publish("t", b"new-%d" % i, 1) for i in range(30)])
        new_sid = engine.sessions["dev"].sid
        assert new_sid != old_sid
        assert engine._deletions.tasks and not connecting.done(), "the old queue's deletion is under way at the stop"
        await engine.close()
        assert not engine._deletions.tasks
        assert await connecting is False, "the clean CONNECT is answered, not cancelled with the deletion"
        return old_sid, new_sid

    old_sid, new_sid = asyncio.run(main())
    db = open_store(path, create=False)
    try:
        left = len(list(iter_entries(db, old_sid)))
    finally:
        db.close()
    if grace is None:
        assert left == 0, "finished within its grace"
    else:
        assert 0 < left < 2000, "cancelled midway"

    async def reopened() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        with caplog.at_level(logging.WARNING, logger="amqtt_durable"):
            engine.open()
        session = engine.sessions["dev"]
        assert (session.sid, session.depth) == (new_sid, 30)
        assert [Body.decode(engine.db.get(body_key(e.msg_id))).payload for e in iter_entries(engine.db, new_sid)] == [
            b"new-%d" % i for i in range(30)
        ]
        assert list(iter_entries(engine.db, old_sid)) == []
        await engine.close()

    asyncio.run(reopened())
    orphans = [r.getMessage() for r in caplog.records if "cut short" in r.getMessage()]
    expected = f"store: deleted {left} queue entries of a session whose deletion a crash or a stop cut short"
    assert orphans == ([expected] if left else [])


def _drop_oldest_with_a_released_first_entry(tmp_path: Path, qos: int) -> tuple[list[tuple[int, bytes]], int]:
    """A session whose full queue (max_depth 3, drop-oldest) holds three QoS ``qos`` entries, the
    first with the RELEASED flag, gets a fourth: its queue's (seq, payload) pairs after that, and
    its count of dropped messages."""
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(session_key("dev"), SessionRecord("dev", 1, {"t": qos}, expires_at=9e18).encode())
    for seq, flags in ((1, FLAG_RELEASED), (2, 0), (3, 0)):
        db.put(body_key(seq), Body("t", b"m%d" % seq, qos, 1.0).encode())
        db.put(entry_key(1, seq), Entry(seq, seq, qos, flags, 2).encode())
    db.put(totals_key(1), encode_totals(3, 6, 0))
    db.close()

    async def main() -> tuple[list[tuple[int, bytes]], int]:
        config = DurableConfig(store=path, max_depth=3, max_depth_disconnected=3, overflow="drop-oldest")
        engine = DurableEngine(config)
        engine.open()
        await engine.route_publish("t", b"new", qos)  # full: the oldest droppable one goes
        session = engine.sessions["dev"]
        entries, _ = session.read_entries(session.head_seq, session.committed_tail, 10)
        queue_and_dropped = [(e.seq, body.payload) for e, body in entries], session.dropped
        await engine.close()
        return queue_and_dropped

    return asyncio.run(main())


def test_drop_oldest_keeps_a_qos2_entry_awaiting_pubcomp_reachable(tmp_path: Path) -> None:
    queue, _ = _drop_oldest_with_a_released_first_entry(tmp_path, 2)
    assert queue == [(1, b"m1"), (3, b"m3"), (4, b"new")]


def test_drop_oldest_drops_a_qos1_entry_with_the_released_flag(tmp_path: Path) -> None:
    """RELEASED on a QoS 1 entry is damage, not a PUBREL due: drop-oldest drops it as any other."""
    queue, dropped = _drop_oldest_with_a_released_first_entry(tmp_path, 1)
    assert queue == [(2, b"m2"), (3, b"m3"), (4, b"new")]
    assert dropped == 1


def _released_without_body(path: str) -> None:
    """Session dev (sid 1, t: QoS 2): entry 1 a released QoS 2 message whose body, message 50, is gone
    (shared with session other, sid 2, count 2), entry 2 message 10 (stored); no b"M" mark."""
    db = open_store(path)
    db.put(session_key("dev"), SessionRecord("dev", 1, {"t": 2}, expires_at=9e18).encode())
    db.put(session_key("other"), SessionRecord("other", 2, {}, expires_at=9e18).encode())
    db.put(entry_key(1, 1), Entry(1, 50, 2, FLAG_RELEASED | FLAG_SHARED, 5).encode())
    db.put(entry_key(2, 1), Entry(1, 50, 1, FLAG_SHARED, 5).encode())
    db.put(refs_key(50), encode_refs(2))
    db.put(body_key(10), Body("t", b"ten", 2, 1.0).encode())
    db.put(entry_key(1, 2), Entry(2, 10, 2, 0, 3).encode())
    db.put(totals_key(1), encode_totals(2, 8, 0))
    db.put(totals_key(2), encode_totals(1, 5, 0))
    db.close()


def test_the_scan_of_a_store_without_the_message_id_mark_is_logged_before_and_after(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The first start of a store from an earlier release reads every queue entry (seconds for
    millions): it says so before, and after with the count and the time it took. Never again."""
    path = str(tmp_path / "store")
    _released_without_body(path)

    async def start() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        await engine.close()

    with caplog.at_level(logging.INFO, logger="amqtt_durable"):
        asyncio.run(start())
    messages = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    before = (
        f"durable store {path} has no message id mark (written by an earlier release): reading every queue entry once"
    )
    assert before in messages, messages
    after = [m for m in messages if m.startswith(f"durable store {path}: 3 queue entries read in ")]
    assert len(after) == 1, messages
    assert re.fullmatch(
        r".* read in \d+\.\d s; highest message id in use 50, kept as the mark from now on", after[0]
    ), after
    assert messages.index(before) < messages.index(after[0])
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="amqtt_durable"):
        asyncio.run(start())  # the mark is stored now: no scan, no line
    assert not [
        r for r in caplog.records if "queue entries read in" in r.getMessage() or "no message id mark" in r.getMessage()
    ]


def test_a_store_without_the_message_id_mark_gives_ids_past_every_queue_entry_then_keeps_the_mark(
    tmp_path: Path,
) -> None:
    """Ids went on past the highest stored body: an entry pointing at a gone body with a higher id
    had its id given to a new message, whose body that entry's removal then deleted."""
    path = str(tmp_path / "store")
    _released_without_body(path)

    async def main() -> int:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine._next_msg_id == 51, "past message 50, which only a queue entry names"
        engine.route_publish("t", b"new", 1)
        ops = [key for key, _ in engine.committer._ops]
        assert MSG_ID_MARK_KEY in ops and ops.index(MSG_ID_MARK_KEY) < ops.index(body_key(51)), (
            "the mark is written in the batch of the first message past it, ahead of its body"
        )
        await engine.committer.commit()
        await engine.close()
        return 51

    new_id = asyncio.run(main())
    db = open_store(path, create=False)
    try:
        assert db.get(body_key(new_id)) is not None
        assert decode_u64(db.get(MSG_ID_MARK_KEY)) == new_id + MSG_ID_RESERVE - 1
        db.delete(body_key(new_id))  # its body is lost too: its id is still never given again
    finally:
        db.close()

    async def again() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine._next_msg_id == new_id + MSG_ID_RESERVE
        await engine.close()

    asyncio.run(again())


@pytest.mark.parametrize(("body", "refs"), [(40, 70), (90, 60)])
def test_a_store_without_the_mark_or_queue_entries_gives_ids_past_its_bodies_and_counts_silently(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, body: int, refs: int
) -> None:
    """No queue entry to read, so no scan to announce (store-layout.md: "logged when it holds queue
    entries"), but its message bodies and reference counts still name ids: the next id is past both."""
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(body_key(body), Body("t", b"b", 1, 1.0).encode())
    db.put(refs_key(refs), encode_refs(2))
    db.close()

    async def start() -> int:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        next_id = engine._next_msg_id
        await engine.close()
        return next_id

    with caplog.at_level(logging.INFO, logger="amqtt_durable"):
        assert asyncio.run(start()) == max(body, refs) + 1
    assert not [
        r for r in caplog.records if "queue entries read in" in r.getMessage() or "no message id mark" in r.getMessage()
    ]


def test_a_released_entry_read_without_its_body_is_rewritten_to_no_body_in_the_store(tmp_path: Path) -> None:
    """The rewrite to NO_BODY (size 0, not SHARED) is written, the old body's reference released
    and the queue's bytes lowered in the same batch; a second read before that write changes nothing."""
    path = str(tmp_path / "store")
    _released_without_body(path)

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        session = engine.sessions["dev"]
        for _ in range(2):
            entries, bodies, _ = session.read_stored(1, 2, 10)
            assert [(e.seq, e.msg_id, e.flags, e.size) for e in entries] == [
                (1, NO_BODY, FLAG_RELEASED, 0),
                (2, 10, 0, 3),
            ]
            assert bodies[0] == RELEASED_BODY
        assert session.bytes == 3
        await engine.committer.commit()
        await engine.close()

    asyncio.run(main())
    db = open_store(path, create=False)
    try:
        stored = Entry.decode(1, db.get(entry_key(1, 1)))
        assert (stored.msg_id, stored.flags, stored.size) == (NO_BODY, FLAG_RELEASED, 0)
        assert db.get(totals_key(1)) == encode_totals(2, 3, 0)
        assert db.get(refs_key(50)) == encode_refs(1), "session other's entry still counts"
    finally:
        db.close()


def test_only_a_released_qos2_entry_awaits_pubcomp() -> None:
    assert awaiting_pubcomp(Entry(1, 1, 2, FLAG_RELEASED, 1))
    assert awaiting_pubcomp(Entry(1, NO_BODY, 2, FLAG_RELEASED | FLAG_SHARED, 1))
    assert not awaiting_pubcomp(Entry(1, 1, 2, 0, 1))
    assert not awaiting_pubcomp(Entry(1, 1, 1, FLAG_RELEASED, 1))
    assert not awaiting_pubcomp(Entry(1, 1, 0, FLAG_RELEASED, 1))
