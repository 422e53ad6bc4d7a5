"""Retained messages in the store (b"r" + topic) and the engine's retain path, on a real LevelDB."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from amqtt_durable.config import DurableConfig
from amqtt_durable.engine import DurableEngine
from amqtt_durable.inspect_store import RetainedSummary, format_retained, summarize_retained
from amqtt_durable.store import RetainedMessage, iter_retained, open_store, retained_key

GENEROUS = 10.0


def test_codec_round_trip_keeps_every_byte() -> None:
    message = RetainedMessage("a/ü/b", b"\x00\xffpayload", 2, 1_700_000_000.25)
    key = retained_key(message.topic)
    assert key == b"r" + "a/ü/b".encode()
    assert RetainedMessage.decode(key, message.encode()) == message


def stored(path: str) -> list[tuple[str, bytes, int]]:
    db = open_store(path, create=False)
    try:
        return [(m.topic, m.payload, m.qos) for m in iter_retained(db)]
    finally:
        db.close()


def test_route_publish_sets_replaces_and_clears_in_the_publish_commit(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    applied: list[tuple[str, bytes, int]] = []

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        engine.on_retained = lambda topic, payload, qos: applied.append((topic, payload, qos))
        stored_first = engine.route_publish("a", b"1", 1, retain=True)
        assert stored_first is not None, "no session matches, but the retained message must be waited for"
        assert engine.db.get(retained_key("a")) is None, "written with the commit, not before"
        await asyncio.wait_for(stored_first, GENEROUS)
        assert engine.db.get(retained_key("a")) is not None
        assert engine.route_publish("b", b"2", 0, retain=True) is not None
        assert engine.route_publish("a", b"3", 2, retain=True) is not None  # replaces
        assert engine.route_publish("c", b"x", 1) is None, "without retain and without a session: nothing to do"
        assert engine.metrics()["retained/messages"] == 2
        cleared = engine.route_publish("b", b"", 0, retain=True)
        assert cleared is not None
        await asyncio.wait_for(cleared, GENEROUS)
        assert engine.metrics()["retained/messages"] == 1
        await engine.close()

    asyncio.run(main())
    assert applied == [("a", b"1", 1), ("b", b"2", 0), ("a", b"3", 2), ("b", b"", 0)], "amqtt's table told in order"
    assert stored(path) == [("a", b"3", 2)]


def test_retained_topics_are_known_after_a_restart_so_a_clear_reaches_the_store(tmp_path: Path) -> None:
    path = str(tmp_path / "store")

    async def first() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        for topic in ("x/1", "x/2", "x/3"):
            engine.route_publish(topic, topic.encode(), 1, retain=True)
        await engine.close()

    async def second() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine.metrics()["retained/messages"] == 3
        assert [m.topic for m in engine.retained.take_loaded()] == ["x/1", "x/2", "x/3"]
        assert engine.retained.take_loaded() == [], "handed over once, not kept"
        await asyncio.wait_for(engine.retain("x/2", b"", 0), GENEROUS)  # a will with an empty message, say
        assert engine.metrics()["retained/messages"] == 2
        await engine.close()

    asyncio.run(first())
    asyncio.run(second())
    assert stored(path) == [("x/1", b"x/1", 1), ("x/3", b"x/3", 1)]


def test_clearing_a_topic_without_a_retained_message_writes_nothing(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    told: list[str] = []

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        engine.on_retained = lambda topic, payload, qos: told.append(topic)
        commits = engine.committer.commits
        await asyncio.wait_for(engine.retain("never/set", b"", 1), GENEROUS)
        assert engine.metrics()["retained/messages"] == 0
        assert engine.committer.commits == commits + 1  # a barrier, with no operation in it
        await engine.close()

    asyncio.run(main())
    assert told == ["never/set"], "amqtt's table is told anyway (it may hold one the store never had)"
    assert stored(path) == []


def test_inspect_lists_retained_messages_in_topic_order(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(retained_key("b/temp"), RetainedMessage("b/temp", b"21.5", 1, 1000.0).encode())
    db.put(retained_key("a/lamp"), RetainedMessage("a/lamp", b"on", 0, 1990.0).encode())
    db.close()
    rows = summarize_retained(path, now=2000.0)
    assert rows == [RetainedSummary("a/lamp", 0, 2, 10.0), RetainedSummary("b/temp", 1, 4, 1000.0)]
    lines = format_retained(rows).splitlines()
    assert [line.split() for line in lines] == [
        ["TOPIC", "QOS", "BYTES", "AGE"],
        ["a/lamp", "0", "2", "10s"],
        ["b/temp", "1", "4", "17m"],
        ["2", "retained", "message(s)"],
    ]
    assert lines[0].index("QOS") == lines[1].index("0 "), "aligned columns"


def test_inspect_retained_age_never_negative_and_empty_store(tmp_path: Path) -> None:
    path = str(tmp_path / "store")
    db = open_store(path)
    db.put(retained_key("t"), RetainedMessage("t", b"v", 1, 5000.0).encode())
    db.close()
    assert summarize_retained(path, now=4000.0)[0].age_s == 0.0  # the clock went back
    assert format_retained([]).splitlines()[-1] == "0 retained message(s)"


@pytest.mark.parametrize("payload", [b"", b"x"])
def test_retained_messages_never_touch_queue_or_session_ranges(tmp_path: Path, payload: bytes) -> None:
    """b"r" sits between the queue entries (b"q") and the session records (b"s"): start-up's orphan
    sweep over b"q" and the session scan over b"s" must not see a retained message."""
    path = str(tmp_path / "store")

    async def main() -> None:
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        engine.route_publish("q", b"v", 1, retain=True)
        engine.route_publish("q", payload, 1, retain=True)
        await engine.close()
        engine = DurableEngine(DurableConfig(store=path))
        engine.open()
        assert engine.sessions == {}
        assert engine.metrics()["retained/messages"] == (1 if payload else 0)
        await engine.close()

    asyncio.run(main())
