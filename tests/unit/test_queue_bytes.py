"""Per-queue byte limits (max_bytes, max_bytes_disconnected): QueueLimits and the engine's admission."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from amqtt_durable.config import DurableConfig, OverflowPolicy
from amqtt_durable.engine import DurableEngine
from amqtt_durable.queue_policy import Admission, QueueLimits


def test_a_byte_limit_of_zero_is_no_limit() -> None:
    limits = QueueLimits(10, 100, "drop-newest")
    assert limits.admit(0, 10**12, 10**9) is Admission.ACCEPT
    assert limits.describe() == "100 messages"


@pytest.mark.parametrize(
    ("overflow", "full"), [("drop-oldest", Admission.DROP_OLDEST), ("drop-newest", Admission.DROP_NEWEST)]
)
def test_either_limit_makes_the_queue_full(overflow: OverflowPolicy, full: Admission) -> None:
    limits = QueueLimits(10, 100, overflow, 500, 1000)
    assert limits.admit(99, 900, 100) is Admission.ACCEPT, "exactly at the byte limit still fits"
    assert limits.admit(99, 901, 100) is full, "one byte over"
    assert limits.admit(100, 0, 1) is full, "the message limit alone"
    assert limits.describe() == "100 messages / 1000 bytes"


def test_a_message_larger_than_the_byte_limit_is_dropped_whatever_the_policy() -> None:
    limits = QueueLimits(10, 100, "drop-oldest", 500, 1000)
    assert limits.admit(0, 0, 1001) is Admission.DROP_NEWEST, "dropping everything else would not make it fit"


def test_connected_limits_after_revert() -> None:
    limits = QueueLimits(10, 100, "drop-newest", 500, 1000)
    limits.on_connect(5, 801)
    assert limits.byte_limit() == 1000, "801 bytes > 80 % of 1000: the expanded limits hold"
    limits.on_drained(80, True, 800)
    assert (limits.limit(), limits.byte_limit()) == (10, 500), "both at 80 %: revert"
    limits.on_disconnect()
    assert limits.byte_limit() == 1000


def test_revert_waits_for_messages_too() -> None:
    limits = QueueLimits(10, 100, "drop-newest", 500, 1000)
    limits.on_connect(81, 0)
    assert limits.expanded, "81 messages > 80 % of 100"


def test_room_made_one_out_one_in_and_its_bytes() -> None:
    limits = QueueLimits(10, 100, "drop-oldest", 500, 1000)
    assert limits.room_made(700, 300, freed=100), "fits under the limit now"
    assert not limits.room_made(950, 300, freed=100), "neither fits nor as many bytes gone"
    assert limits.room_made(2000, 300, freed=300), "above a lowered limit: as many bytes out as in"
    assert QueueLimits(10, 100, "drop-oldest").room_made(0, 10**9, freed=0), "no byte limit: one out, one in"


def engine_with(tmp_path: Path, **settings: object) -> DurableEngine:
    engine = DurableEngine(DurableConfig(store=str(tmp_path / "store"), **settings))  # type: ignore[arg-type]
    engine.open()
    return engine


def test_drop_oldest_frees_as_many_bytes_as_the_new_message_needs(tmp_path: Path) -> None:
    async def main() -> None:
        engine = engine_with(tmp_path, max_bytes=500, max_bytes_disconnected=1000)
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "t/#", 1)
        session = engine.sessions["dev"]
        for _ in range(25):
            stored = engine.route_publish("t/x", bytes(100), 1)
            assert stored is not None
            await stored
        assert (session.depth, session.bytes, session.dropped) == (10, 1000, 15)
        stored = engine.route_publish("t/x", bytes(350), 1)
        assert stored is not None
        await stored
        assert (session.depth, session.bytes, session.dropped) == (7, 950, 19), "4 of 100 bytes out, 350 in"
        stored = engine.route_publish("t/x", bytes(1001), 1)  # larger than the limit: dropped
        assert stored is not None, "the drop count is committed before the publish is acknowledged"
        await stored
        assert (session.depth, session.dropped) == (7, 20)
        await engine.close()

    asyncio.run(main())


def test_a_queue_above_a_lowered_byte_limit_does_not_shrink_by_more_than_it_grows(tmp_path: Path) -> None:
    async def main() -> None:
        engine = engine_with(tmp_path, max_bytes=200, max_bytes_disconnected=1000)
        await engine.connect("dev", clean_session=False)
        await engine.subscribe("dev", "t/#", 1)
        session = engine.sessions["dev"]
        for _ in range(8):
            stored = engine.route_publish("t/x", bytes(100), 1)
            assert stored is not None
            await stored
        session.limits.expanded = False  # as after a reconnect that drained to 80 %
        stored = engine.route_publish("t/x", bytes(150), 1)
        assert stored is not None
        await stored
        assert (session.depth, session.bytes, session.dropped) == (7, 750, 2), "2 x 100 bytes out for 150 in"
        await engine.close()

    asyncio.run(main())
