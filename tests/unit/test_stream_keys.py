"""Stream-log keys: unambiguous whatever a topic holds, and the first layout migrated on open.

Real LevelDB stores (plyvel) in tmp folders. The first layout kept events under
``b"l" + topic + NUL + id``; a topic holding NUL could forge another topic's event there.
"""

from __future__ import annotations

import struct
import time
from typing import Any

import pytest

from amqtt_durable import stream_log as streams_module
from amqtt_durable.config import StreamConfig
from amqtt_durable.store import GroupCommitter, open_store
from amqtt_durable.stream_log import StreamLogs, encode_event, event_key, mark_key

STREAMS = [StreamConfig("s/#", max_count=100)]
U64 = struct.Struct(">Q")
FORGED = "s/a\x00" + U64.pack(2).decode("latin-1")
"""The attack's topic: s/a, NUL, then the 8 bytes of the number 2."""


def make_logs(db: Any) -> tuple[StreamLogs, GroupCommitter]:
    committer = GroupCommitter(db, sync=False, batch_size=5000, batch_delay_ms=0.0, pending_threshold=1)
    logs = StreamLogs(db, committer, STREAMS)
    logs.load()
    return logs, committer


def legacy_key(topic: bytes, event_id: int) -> bytes:
    """A key of the first layout, written byte by byte as the old code did."""
    return b"l" + topic + b"\x00" + U64.pack(event_id)


def write_legacy_store(db: Any) -> None:
    """What the old broker stored after the attack: s/a ids 1..3, s/b id 1, and the forged event."""
    for event_id in (1, 2, 3):
        db.put(legacy_key(b"s/a", event_id), encode_event(100.0 + event_id, 1, b"a%d" % event_id))
    db.put(legacy_key(b"s/b", 1), encode_event(200.0, 0, b"b1"))
    db.put(legacy_key(FORGED.encode("latin-1"), 1), encode_event(300.0, 1, b"injected"))
    db.put(mark_key("s/a"), U64.pack(3))
    db.put(mark_key("s/b"), U64.pack(1))
    db.put(b"L" + FORGED.encode("latin-1"), U64.pack(1))


def keys(db: Any, prefix: bytes) -> list[bytes]:
    return list(db.iterator(prefix=prefix, include_value=False))


def events(logs: StreamLogs, topic: str) -> list[tuple[int, bytes]]:
    return [(e.id, e.payload) for e in logs.read(topic, 0, 100)]


def test_the_legacy_layout_was_ambiguous() -> None:
    """The forged key sits between s/a's ids 2 and 3 and ends in the 8 bytes of id 1."""
    forged = legacy_key(FORGED.encode("latin-1"), 1)
    assert legacy_key(b"s/a", 2) < forged < legacy_key(b"s/a", 3)
    assert forged.startswith(b"l" + b"s/a" + b"\x00")


def test_a_nul_topic_cannot_reach_another_topics_events(db: Any) -> None:
    logs, committer = make_logs(db)
    for topic in ("s/a", "s/a", FORGED, "s/a"):
        event_id = logs.append(topic, topic.encode("utf-8"), 1, time.time())
        assert event_id is not None
        committer.flush_now()
        logs.appended(topic, event_id)
    assert [event_id for event_id, _ in events(logs, "s/a")] == [1, 2, 3]
    assert {payload for _, payload in events(logs, "s/a")} == {b"s/a"}
    assert events(logs, FORGED) == [(1, FORGED.encode("utf-8"))]
    assert event_key("s/a", 1) == b"e\x00\x03s/a" + U64.pack(1)


def test_a_legacy_store_opens_migrated_without_the_forged_event(store_path: str, db: Any) -> None:
    write_legacy_store(db)
    logs, committer = make_logs(db)
    assert events(logs, "s/a") == [(1, b"a1"), (2, b"a2"), (3, b"a3")]
    assert [(e.qos, e.published_at) for e in logs.read("s/a", 0, 100)] == [(1, 101.0), (1, 102.0), (1, 103.0)]
    assert events(logs, "s/b") == [(1, b"b1")]
    assert set(logs.topics("s/#")) == {"s/a", "s/b"}, "the forged topic is gone, its mark too"
    assert keys(db, b"l") == []
    assert db.get(b"L" + FORGED.encode("latin-1")) is None
    event_id = logs.append("s/a", b"a4", 1, 104.0)
    committer.flush_now()
    assert event_id == 4, "ids continue after the migration"
    db.close()
    reopened = open_store(store_path)
    try:
        again, _ = make_logs(reopened)
        assert [event_id for event_id, _ in events(again, "s/a")] == [1, 2, 3, 4]
    finally:
        reopened.close()


def test_a_migration_cut_short_is_finished_on_the_next_open(db: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crash between two batches: some events under new keys, the rest under old keys."""
    write_legacy_store(db)
    monkeypatch.setattr(streams_module, "MIGRATE_BATCH_BYTES", 1)  # one event per batch
    with db.write_batch() as batch:  # the first batch went through before the crash
        batch.delete(legacy_key(b"s/a", 1))
        batch.put(event_key("s/a", 1), encode_event(101.0, 1, b"a1"))
    assert streams_module.migrate_legacy_events(db) == (3, 1)
    assert streams_module.migrate_legacy_events(db) == (0, 0), "nothing left: running it again changes nothing"
    logs, _ = make_logs(db)
    assert events(logs, "s/a") == [(1, b"a1"), (2, b"a2"), (3, b"a3")]
    assert events(logs, "s/b") == [(1, b"b1")]
